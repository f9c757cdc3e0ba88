"""``fsdp_lite.trace``, the public path of the trace and the sharding plan (record_collectives, explain, plots, write_chrome_trace); the code is fsdp_lite/tools/trace.py."""

from fsdp_lite.tools.trace import *  # noqa: F403
from fsdp_lite.tools.trace import __all__  # noqa: F401
