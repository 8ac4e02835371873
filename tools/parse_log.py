#!/usr/bin/env python3
"""Caffe's tools/extra/parse_log.py for syncsgd: the same as `syncsgd parse-log LOG OUTDIR`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["parse-log"] + sys.argv[1:]))
