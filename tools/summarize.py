#!/usr/bin/env python3
"""Caffe's tools/extra/summarize.py for syncsgd: the same as `syncsgd summarize NET`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["summarize"] + sys.argv[1:]))
