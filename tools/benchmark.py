#!/usr/bin/env python3
"""Single-process training speed of syncsgd against PyTorch on the same nets.

    python tools/benchmark.py                                 # lenet, cifar10_quick, cddnn, vgg_a
    python tools/benchmark.py --model vgg_a --batch 8 --size 224 --json

Each framework trains in its own child process (tools/runners.py), so each has its own threads
and its own peak memory; the parent runs them in turns (a few iterations of one, a pause for its
threads to go idle, a few of the other), so load from other processes on a shared machine hits
both alike. The machine's GEMM rate is measured in the same run, in turns like the training: one
square float32 product per framework per round (syncsgd's through syncsgd.kernels.blas,
PyTorch's through its MKL), the better median taken. Peak memory is each process's resident-set
peak (VmHWM) from the first training iteration on: weights, gradients, solver history,
activations and buffers. This is tooling, not part of the installed package.
"""
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from runners import LR_SCALE, SyncsgdRunner, TorchRunner

DEFAULT_BATCH = {"lenet": 64, "cifar10_quick": 100, "cddnn": 256, "vgg_a": 8}
GEMM_SIZE = 2048          # the machine's GEMM rate: one (n, n) @ (n, n) float32 product
PAUSE = 0.3               # seconds between turns: OpenBLAS / OpenMP threads spin that long at most


def rss_bytes(field="VmRSS"):
    """This process's resident memory (VmRSS) or its peak since the last reset (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak():
    """Start the peak (VmHWM) afresh from the current resident size, where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _serve(kind, setup, threads, weights_path, conn):
    """A child process: build one framework's trainer, then answer the parent's requests."""
    try:
        if kind == "pytorch":
            import torch
            torch.set_num_threads(threads)
            runner_class = TorchRunner
        else:
            import numexpr
            from threadpoolctl import threadpool_limits
            threadpool_limits(threads)
            numexpr.set_num_threads(threads)
            runner_class = SyncsgdRunner
        baseline = rss_bytes()
        if kind == "pytorch":
            runner = runner_class(*setup, weights_path=weights_path)
        else:
            runner = runner_class(*setup)
            with open(weights_path, "wb") as f:
                for w in runner.weights():
                    f.write(memoryview(np.ascontiguousarray(w)).cast("B"))
        conn.send({"baseline_rss": baseline, "flops": getattr(runner, "flops", None),
                   "input": getattr(runner, "input_shape", None)})
        while True:
            request, arg = conn.recv()
            if request == "run":
                times, loss = [], None
                for _ in range(arg):
                    start = time.perf_counter()
                    loss = runner.step()
                    times.append(time.perf_counter() - start)
                conn.send({"times": times, "loss": loss,
                           "updates": runner.update_seconds[-len(times):]})
            elif request == "gemm":
                conn.send({"seconds": runner.gemm_seconds(arg)})
            elif request == "reset_peak":
                conn.send({"reset": _reset_peak()})
            elif request == "peak":
                conn.send({"peak_rss": rss_bytes("VmHWM"), "rss": rss_bytes()})
            else:
                conn.send({})
                return
    except Exception as e:      # reported to the parent, which stops the benchmark
        import traceback
        conn.send({"error": f"{kind}: {e}\n{traceback.format_exc()}"})


class _Child:
    def __init__(self, context, kind, *args):
        self.kind = kind
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(kind,) + args + (theirs,),
                                       daemon=True)
        self.process.start()
        self.info = self.receive()

    def receive(self):
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def ask(self, request, arg=None):
        self.conn.send((request, arg))
        return self.receive()

    def close(self):
        try:
            self.conn.send(("stop", None))
            self.conn.recv()
        except (OSError, EOFError):
            pass
        self.process.join(timeout=10)


def torch_available():
    """Whether PyTorch is installed (without importing it in this process)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def benchmark(model, batch=None, size=None, rounds=5, warmup=2, threads=None, use_torch=True,
              turn_seconds=1.0, progress=None, lr_scale=LR_SCALE):
    """Train `model` in syncsgd and (if installed and asked) PyTorch in turns; a dict of results.

    After `warmup` untimed iterations each, each of `rounds` rounds gives each framework one turn
    of k iterations (k chosen so that a turn lasts about `turn_seconds`); which one goes first
    alternates. Speeds use the median iteration time; the GEMM rate is the median of one product
    per framework per round.
    """
    import multiprocessing
    batch = batch or DEFAULT_BATCH.get(os.path.basename(os.fspath(model)).split(".")[0], 32)
    threads = threads or len(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    kinds = ["syncsgd"] + (["pytorch"] if use_torch and torch_available() else [])
    say = progress or (lambda message: None)
    children = []
    with tempfile.TemporaryDirectory() as scratch:
        weights_path = os.path.join(scratch, "weights.bin")
        try:
            for kind in kinds:
                say(f"{model}: building the {kind} model")
                children.append(_Child(context, kind, (model, batch, size, lr_scale), threads,
                                       weights_path))
            for child in children:
                child.ask("reset_peak")
            times = {kind: [] for kind in kinds}
            gemm = {kind: [] for kind in kinds}
            updates = {kind: [] for kind in kinds}
            per_turn, warm_losses = {}, {}
            for child in children:
                warm = [child.ask("run", 1) for _ in range(warmup)]
                warm_losses[child.kind] = [reply["loss"] for reply in warm]
                fastest = min(reply["times"][0] for reply in warm)
                per_turn[child.kind] = max(1, int(turn_seconds / max(fastest, 1e-6)))
                time.sleep(PAUSE)
            for r in range(rounds):
                order = children if r % 2 == 0 else children[::-1]
                for child in order:
                    reply = child.ask("run", per_turn[child.kind])
                    times[child.kind] += reply["times"]
                    updates[child.kind] += reply["updates"]
                    time.sleep(PAUSE)
                    gemm[child.kind].append(child.ask("gemm", GEMM_SIZE)["seconds"])
                    time.sleep(PAUSE)
                say(f"{model}: round {r + 1}/{rounds}: " + ", ".join(
                    f"{kind} {batch / statistics.median(times[kind]):.1f} images/s"
                    for kind in kinds))
            peaks = {child.kind: child.ask("peak") for child in children}
        finally:
            for child in children:
                child.close()
    flops = children[0].info["flops"]
    gemm_flops = 2.0 * GEMM_SIZE ** 3
    result = {"model": os.fspath(model), "batch": batch, "size": size,
              "input": list(children[0].info["input"]), "threads": threads,
              "lr_scale": lr_scale, "flops_per_iteration": flops, "frameworks": {}}
    for child in children:
        kind = child.kind
        seconds = statistics.median(times[kind])
        result["frameworks"][kind] = {
            "images_per_s": batch / seconds,
            "iteration_ms": 1000.0 * seconds,
            "update_ms": 1000.0 * statistics.median(updates[kind]),
            "iterations": len(times[kind]),
            "gflops": flops / seconds / 1e9,
            "gemm_gflops": gemm_flops / statistics.median(gemm[kind]) / 1e9,
            "peak_rss_mb": peaks[kind]["peak_rss"] / 2**20,
            "baseline_rss_mb": child.info["baseline_rss"] / 2**20,
            # The first `warmup` iterations of both see the same weights and batches.
            "warmup_losses": warm_losses[kind],
        }
    machine = max(f["gemm_gflops"] for f in result["frameworks"].values())
    result["machine_gemm_gflops"] = machine
    for f in result["frameworks"].values():
        f["fraction_of_gemm"] = f["gflops"] / machine
    if "pytorch" in result["frameworks"]:
        s, t = result["frameworks"]["syncsgd"], result["frameworks"]["pytorch"]
        result["speed_ratio"] = s["images_per_s"] / t["images_per_s"]
        result["memory_ratio"] = s["peak_rss_mb"] / t["peak_rss_mb"]
    return result


def format_table(results):
    """A Markdown table of benchmark results ("-" where PyTorch was not run)."""
    lines = ["| net | batch | input | syncsgd images/s | PyTorch images/s | ratio | syncsgd "
             "GFLOP/s | % of GEMM | GEMM GFLOP/s | update ms syncsgd / PyTorch | peak MiB "
             "syncsgd / PyTorch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["frameworks"]["syncsgd"]
        t = r["frameworks"].get("pytorch")

        def both(key, fmt):
            return f"{s[key]:{fmt}} / " + (f"{t[key]:{fmt}}" if t else "-")
        size = "x".join(str(d) for d in r["input"])
        cells = [os.path.basename(r["model"]), r["batch"], size, f"{s['images_per_s']:.1f}",
                 f"{t['images_per_s']:.1f}" if t else "-",
                 f"{r['speed_ratio']:.2f}x" if t else "-", f"{s['gflops']:.1f}",
                 f"{100 * s['fraction_of_gemm']:.0f}%", f"{r['machine_gemm_gflops']:.1f}",
                 both("update_ms", ".0f"), both("peak_rss_mb", ".0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(
        prog="benchmark", description="Training images/s of syncsgd and PyTorch (when "
        "installed) on the same nets, weights and batches, run in turns.")
    parser.add_argument("--model", action="append",
                        help="zoo name, folder or prototxt (repeatable; default: "
                             + ", ".join(DEFAULT_BATCH) + ")")
    parser.add_argument("--batch", type=int, action="append",
                        help="minibatch per --model (default: "
                             + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    parser.add_argument("--size", type=int, action="append",
                        help="square input size per --model (0: the net's own)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both frameworks (default: this process's cores)")
    parser.add_argument("--no-torch", action="store_true", help="time syncsgd only")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args(argv)
    models = args.model or list(DEFAULT_BATCH)
    batches = args.batch or [None] * len(models)
    sizes = args.size or [0] * len(models)
    if len(batches) != len(models) or len(sizes) != len(models):
        parser.error("give --batch and --size once per --model, or not at all")
    quiet = args.json
    results = []
    for model, batch, size in zip(models, batches, sizes):
        results.append(benchmark(model, batch, size or None, args.rounds, args.warmup,
                                 args.threads, not args.no_torch,
                                 progress=None if quiet else print))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(format_table(results))
        print(f"(threads {results[0]['threads']}; load average {load:.2f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
