#!/usr/bin/env python3
"""`caffe train` for syncsgd: the same as `syncsgd train` (works under mpiexec too)."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["train"] + sys.argv[1:]))
