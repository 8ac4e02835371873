#!/usr/bin/env python3
"""The balance-equation planner: the same as `syncsgd plan`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan"] + sys.argv[1:]))
