#!/usr/bin/env python3
"""GEMM rates of the kernels syncsgd.kernels.blas can call, in turns on the same operands:
numpy's OpenBLAS (one thread per piece, split over the thread budget), oneDNN's matmul as
syncsgd runs it (the kernel named), and oneDNN's first choice of kernel where syncsgd picks
another.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tools/gemm_kernels.py
    python tools/gemm_kernels.py --shapes 256x2048x2048:nt,2048x256x2048:tn+ --threads 2

A shape is MxKxN; after ':' "n"/"t" say whether A and B are read plainly or transposed (views,
as the layers pass them) and a trailing "+" accumulates (beta = 1). The default shapes are
LeNet's and CD-DNN's fully connected layers at their benchmark batches (forward, weight gradient
over a cleared diff, input gradient), VGG-A's fc6 weight gradient at batch 8, and a square 2048
product.
"""
import argparse
import os
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_SHAPES = ("64x800x500:nt,500x64x800:tn,64x500x800:nn,64x500x10:nt,"
                  "256x2048x2048:nt,2048x256x2048:tn,256x2048x2048:nn,"
                  "256x2048x9304:nt,9304x256x2048:tn,256x9304x2048:nn,4096x8x25088:tn,"
                  "2048x2048x2048:nn")


def parse(spec):
    dims, _, flags = spec.partition(":")
    m, k, n = (int(d) for d in dims.split("x"))
    flags = flags or "nn"
    return m, k, n, flags[0] == "t", flags[1:2] == "t", flags.endswith("+")


def operands(m, k, n, ta, tb, rng):
    a = rng.random((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.random((n, k) if tb else (k, n), dtype=np.float32)
    return (a.T if ta else a), (b.T if tb else b), rng.random((m, n), dtype=np.float32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    from syncsgd.kernels import blas, onednn
    from syncsgd.kernels.plans import THRESHOLDS
    from syncsgd.kernels.threads import set_budget
    set_budget(args.threads)
    if not onednn.available():
        sys.exit("gemm_kernels: oneDNN does not load here (pip install onednn-cpu-gomp)")
    guards = {v: os.environ[v] for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
              if v in os.environ}
    print(f"threads {args.threads}; guard variables: {guards or 'unset'}")
    print("| M x K x N | A, B, beta | OpenBLAS GFLOP/s | oneDNN GFLOP/s (kernel) | "
          "oneDNN / OpenBLAS | oneDNN's first choice GFLOP/s (kernel) |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for spec in args.shapes.split(","):
        m, k, n, ta, tb, accumulate = parse(spec)
        a, b, out = operands(m, k, n, ta, tb, rng)
        beta = 1.0 if accumulate else 0.0
        first = onednn.MatMul(a, b, out, accumulate)
        def gemm():
            blas.gemm(a, b, out, beta=beta)
        # Each kind: gemm's oneDNN threshold while it runs, and what runs.
        kinds = {"blas": (float("inf"), gemm), "onednn": (0, gemm),
                 "first": (0, lambda: first(a, b, out))}
        best = dict.fromkeys(kinds, 0.0)
        kernel = None
        for _ in range(args.rounds):
            for kind, (limit, run) in kinds.items():
                with blas.planned_with(replace(THRESHOLDS, onednn_flops=limit)):
                    start = time.perf_counter()
                    run()
                    rate = 2 * m * k * n / (time.perf_counter() - start) / 1e9
                    if kind == "onednn":
                        kernel = blas.onednn_kernel(a, b, out, beta)
                best[kind] = max(best[kind], rate)
        other = "" if kernel == first.kernel else f"{best['first']:.0f} ({first.kernel})"
        print(f"| {m} x {k} x {n} | {'T' if ta else 'N'}, {'T' if tb else 'N'}, {beta:g} | "
              f"{best['blas']:.0f} | {best['onednn']:.0f} ({kernel}) | "
              f"{best['onednn'] / best['blas']:.2f} | {other} |")


if __name__ == "__main__":
    main()
