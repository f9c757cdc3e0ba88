"""Entry point of ``python -m conformance``; the command line lives in cli.py."""

import sys

from conformance.cli import main

if __name__ == "__main__":
    sys.exit(main())
