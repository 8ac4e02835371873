#!/usr/bin/env python3
"""`caffe time` for syncsgd: the same as `syncsgd time`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["time"] + sys.argv[1:]))
