#!/usr/bin/env python3
"""A deploy net and its weights as an ONNX model: the same as `syncsgd export`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["export"] + sys.argv[1:]))
