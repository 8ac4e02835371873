#!/usr/bin/env python3
"""Single-process training speed of syncsgd against PyTorch on the same nets.

    python tools/benchmark.py                                 # lenet, cifar10_quick, cddnn, vgg_a
    python tools/benchmark.py --model vgg_a --batch 8 --size 224 --json

Each framework trains in its own child process (tools/runners.py), so each has its own threads
and its own peak memory; the parent runs them in turns (a few iterations of one, a pause for its
threads to go idle, a few of the other), so load from other processes on a shared machine hits
both alike. The machine's GEMM rate is measured in the same run, after the training and in turns
like it: one square float32 product per kernel per round, each kernel's median taken. The
kernels are those syncsgd's layers can call (syncsgd.kernels.blas on numpy's BLAS, and oneDNN
where it loads, as its matmul), and PyTorch's torch.mm for comparison; the best of
syncsgd's is the denominator of "% of GEMM". Peak memory is each process's resident-set peak
(VmHWM) from the first training iteration to the last, before the GEMMs: weights, gradients,
solver history, activations and buffers. The BLAS and OpenMP libraries each process loaded are
reported as threadpoolctl sees them (which kernel OpenBLAS chose, its version and threads).
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE override OpenBLAS's own detection of the CPU and its
cache, so a run with either set says so. This is tooling, not part of the installed package.
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
OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
GEMM_NAMES = {"blas": "BLAS", "onednn": "oneDNN", "pytorch": "PyTorch"}


def openblas_overrides(argv, environ=os.environ):
    """A warning naming the OPENBLAS_* variables set in `environ` that override OpenBLAS's own
    detection of the CPU and its cache, with the command that runs without them; None if unset."""
    found = [name for name in OPENBLAS_OVERRIDES if name in environ]
    if not found:
        return None
    import shlex
    values = ", ".join(f"{name}={environ[name]}" for name in found)
    unset = " ".join(f"-u {name}" for name in found)
    return (f"warning: {values} set: OpenBLAS's CPU kernels and cache size are forced, not "
            f"detected; to run without: env {unset} python tools/benchmark.py "
            f"{shlex.join(argv)}".rstrip())


def blas_report(kind):
    """The BLAS and OpenMP libraries loaded in this process, as threadpoolctl reports them, and
    for PyTorch its own kernels (its MKL is linked in, out of threadpoolctl's sight)."""
    from threadpoolctl import threadpool_info
    keys = ("internal_api", "prefix", "architecture", "version", "num_threads")
    libraries = [{key: lib.get(key) for key in keys} for lib in threadpool_info()]
    if kind == "pytorch":
        import torch
        libraries.append({"internal_api": "torch", "prefix": "mkl" if
                          torch.backends.mkl.is_available() else "no mkl",
                          "architecture": torch.backends.cpu.get_cpu_capability(),
                          "version": torch.__version__, "num_threads": torch.get_num_threads()})
    return libraries


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
            elif request == "blas":
                conn.send({"libraries": blas_report(kind)})
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
    alternates. Speeds use the median iteration time. Then `rounds` rounds of one product per
    GEMM kernel each, in turns; a kernel's rate is its median.
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
                say(f"{model}: round {r + 1}/{rounds}: " + ", ".join(
                    f"{kind} {batch / statistics.median(times[kind]):.1f} images/s"
                    for kind in kinds))
            peaks = {child.kind: child.ask("peak") for child in children}
            gemm = {}
            for r in range(rounds):
                for child in (children if r % 2 == 0 else children[::-1]):
                    for kernel, seconds in child.ask("gemm", GEMM_SIZE)["seconds"].items():
                        gemm.setdefault(kernel, []).append(seconds)
                    time.sleep(PAUSE)
            libraries = {child.kind: child.ask("blas")["libraries"] for child in children}
        finally:
            for child in children:
                child.close()
    flops = children[0].info["flops"]
    gemm_flops = 2.0 * GEMM_SIZE ** 3
    result = {"model": os.fspath(model), "batch": batch, "size": size,
              "input": list(children[0].info["input"]), "threads": threads,
              "lr_scale": lr_scale, "flops_per_iteration": flops, "frameworks": {},
              "blas_libraries": libraries,
              "openblas_overrides": {name: os.environ[name] for name in OPENBLAS_OVERRIDES
                                     if name in os.environ},
              "gemm_gflops": {kernel: gemm_flops / statistics.median(seconds) / 1e9
                              for kernel, seconds in gemm.items()}}
    for child in children:
        kind = child.kind
        seconds = statistics.median(times[kind])
        result["frameworks"][kind] = {
            "images_per_s": batch / seconds,
            "iteration_ms": 1000.0 * seconds,
            "update_ms": 1000.0 * statistics.median(updates[kind]),
            "iterations": len(times[kind]),
            "gflops": flops / seconds / 1e9,
            "peak_rss_mb": peaks[kind]["peak_rss"] / 2**20,
            "baseline_rss_mb": child.info["baseline_rss"] / 2**20,
            # The first `warmup` iterations of both see the same weights and batches.
            "warmup_losses": warm_losses[kind],
        }
    # The denominator: the best kernel syncsgd can call, not PyTorch's.
    ours = {k: v for k, v in result["gemm_gflops"].items() if k != "pytorch"}
    result["gemm_kernel"] = max(ours, key=ours.get)
    machine = result["machine_gemm_gflops"] = ours[result["gemm_kernel"]]
    for f in result["frameworks"].values():
        f["fraction_of_gemm"] = f["gflops"] / machine
    if "pytorch" in result["frameworks"]:
        s, t = result["frameworks"]["syncsgd"], result["frameworks"]["pytorch"]
        result["speed_ratio"] = s["images_per_s"] / t["images_per_s"]
        result["memory_ratio"] = s["peak_rss_mb"] / t["peak_rss_mb"]
    return result


def format_table(results):
    """A Markdown table of benchmark results ("-" where PyTorch or oneDNN was not run)."""
    lines = ["| net | batch | input | syncsgd images/s | PyTorch images/s | ratio | syncsgd "
             "GFLOP/s | % of GEMM | GEMM GFLOP/s " + " / ".join(GEMM_NAMES.values()) +
             " | update ms syncsgd / PyTorch | peak MiB syncsgd / PyTorch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["frameworks"]["syncsgd"]
        t = r["frameworks"].get("pytorch")

        def both(key, fmt):
            return f"{s[key]:{fmt}} / " + (f"{t[key]:{fmt}}" if t else "-")
        size = "x".join(str(d) for d in r["input"])
        rates = " / ".join(f"{r['gemm_gflops'][k]:.1f}" if k in r["gemm_gflops"] else "-"
                           for k in GEMM_NAMES)
        cells = [os.path.basename(r["model"]), r["batch"], size, f"{s['images_per_s']:.1f}",
                 f"{t['images_per_s']:.1f}" if t else "-",
                 f"{r['speed_ratio']:.2f}x" if t else "-", f"{s['gflops']:.1f}",
                 f"{100 * s['fraction_of_gemm']:.0f}% of {GEMM_NAMES[r['gemm_kernel']]}", rates,
                 both("update_ms", ".0f"), both("peak_rss_mb", ".0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def format_libraries(results):
    """One line per framework naming the BLAS / OpenMP libraries its process ran, each once."""
    seen = {}
    for r in results:
        for kind, libraries in r["blas_libraries"].items():
            for lib in libraries:
                text = f"{lib['internal_api']} ({lib['prefix']})"
                if lib["version"]:
                    text += f" {lib['version']}"
                if lib["architecture"]:
                    text += f", {lib['architecture']} kernels"
                text += f", {lib['num_threads']} threads"
                seen.setdefault(kind, {}).setdefault(text)
    return "\n".join(f"{kind}: " + "; ".join(texts) for kind, texts in seen.items())


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
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    models = args.model or list(DEFAULT_BATCH)
    batches = args.batch or [None] * len(models)
    sizes = args.size or [0] * len(models)
    if len(batches) != len(models) or len(sizes) != len(models):
        parser.error("give --batch and --size once per --model, or not at all")
    quiet = args.json
    warning = openblas_overrides(argv)
    if warning:
        print(f"benchmark: {warning}", file=sys.stderr, flush=True)
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
        print(f"(threads {results[0]['threads']}; load average {load:.2f} at the end; % of GEMM:"
              " of the best GEMM kernel syncsgd can call)")
        print(format_libraries(results))
        if warning:
            print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
