"""``fsdp_lite.checkpoint``, the public path of atomic DCP checkpoints of a model and its optimizer (save, load); the code is fsdp_lite/state/checkpoint.py."""

from fsdp_lite.state.checkpoint import *  # noqa: F403
from fsdp_lite.state.checkpoint import __all__  # noqa: F401
