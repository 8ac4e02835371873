#!/usr/bin/env python3
"""Caffe's tools/extra/plot_training_log.py for syncsgd: the same as
`syncsgd plot CHART_TYPE OUT.png LOG...`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["plot"] + sys.argv[1:]))
