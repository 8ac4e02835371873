#!/usr/bin/env python3
"""`caffe test` for syncsgd: the same as `syncsgd test` (works under mpiexec too)."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["test"] + sys.argv[1:]))
