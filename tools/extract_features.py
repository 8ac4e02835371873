#!/usr/bin/env python3
"""Caffe's tools/extract_features for syncsgd: the same as
`syncsgd extract_features WEIGHTS MODEL BLOBS DBS N TYPE`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["extract_features"] + sys.argv[1:]))
