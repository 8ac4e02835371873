#!/usr/bin/env python3
"""Training speed of syncsgd against PyTorch on the zoo nets: see syncsgd/perf.py.

    python tools/benchmark.py                                 # lenet, cifar10_quick, cddnn, vgg_a
    python tools/benchmark.py --model vgg_a --batch 8 --size 224 --json
"""
import sys

from syncsgd.perf import main

if __name__ == "__main__":
    sys.exit(main())
