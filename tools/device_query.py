#!/usr/bin/env python3
"""`caffe device_query` for syncsgd: the same as `syncsgd device_query`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["device_query"] + sys.argv[1:]))
