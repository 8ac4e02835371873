#!/usr/bin/env python3
"""Caffe's python/draw_net.py for syncsgd: the same as `syncsgd draw NET OUT`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["draw"] + sys.argv[1:]))
