"""``fsdp_lite.estimate`` and ``python -m fsdp_lite.estimate``, the public path of the planner;
the code is fsdp_lite/tools/estimate.py."""

import sys

from fsdp_lite.tools.estimate import *  # noqa: F403
from fsdp_lite.tools.estimate import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
