#!/usr/bin/env python3
"""Caffe's tools/upgrade_net_proto_binary for syncsgd: the same as
`syncsgd upgrade_net_proto_binary IN OUT`."""
import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["upgrade_net_proto_binary"] + sys.argv[1:]))
