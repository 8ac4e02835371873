#!/usr/bin/env python3
"""Caffe's tools/upgrade_net_proto_text for syncsgd: the same as
`syncsgd upgrade_net_proto_text IN OUT`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["upgrade_net_proto_text"] + sys.argv[1:]))
