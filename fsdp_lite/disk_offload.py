"""``fsdp_lite.disk_offload``, the public path of the files behind disk offload (step, close); the code is fsdp_lite/engine/disk.py."""

from fsdp_lite.engine.disk import *  # noqa: F403
from fsdp_lite.engine.disk import __all__  # noqa: F401
