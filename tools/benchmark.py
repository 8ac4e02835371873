#!/usr/bin/env python3
"""Single-process training speed of syncsgd against PyTorch, and BVLC Caffe, on the same nets.

    python tools/benchmark.py                    # lenet, cifar10_quick, cddnn, vgg_a, alexnet,
                                                 # googlenet, resnet50
    python tools/benchmark.py --model vgg_a --batch 8 --size 224 --json
    python tools/benchmark.py --model alexnet --caffe --no-torch

Each framework trains in its own child process (tools/runners.py), so each has its own threads
and its own peak memory; the parent runs them in turns (iterations of one for about a second, a
pause for its threads to go idle, the same of the other), so load from other processes on a
shared machine hits both alike. The machine's GEMM rate is measured in the same run, after the
training and in turns like it: one square float32 product per kernel per round, each kernel's
median taken. The kernels are those syncsgd's layers can call (syncsgd.kernels.blas on numpy's
BLAS, and oneDNN where it loads, as its matmul), and PyTorch's torch.mm for comparison; the
best of syncsgd's is the denominator of "% of GEMM". Peak memory is each process's resident-set
peak (VmHWM) from the first training iteration to the last, before the GEMMs: weights, gradients,
solver history, activations and buffers. The BLAS and OpenMP libraries each process loaded are
reported as threadpoolctl sees them (which kernel OpenBLAS chose, its version and threads).
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE override OpenBLAS's own detection of the CPU and its
cache, so a run with either set says so.

With --caffe, where BVLC Caffe's oracle is built (../shared/oracle/build-bvlc-caffe.sh), its
`caffe time` is timed against `syncsgd time` after the training: both run the same prototxt (the
TRAIN net with its data layers as Input layers of the same batch, force_backward: true, so both
compute every gradient; inputs are zero in Caffe, noise with zero labels in syncsgd: the work does
not depend on them), the same number of forward+backward iterations after one untimed pass,
each in a child process on the same thread count (OPENBLAS_NUM_THREADS and OMP_NUM_THREADS), in
turns whose order alternates. Each framework's figure is the minimum over rounds of its average
iteration time (load from other processes only ever adds time): for syncsgd the wall time of its
whole iterations, for Caffe the sum of its forward and backward pass timers, so that any bias
is against syncsgd. This is tooling, not part of the installed package.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from runners import LR_SCALE, SyncsgdRunner, TorchRunner, benchmark_param

DEFAULT_BATCH = {"lenet": 64, "cifar10_quick": 100, "cddnn": 256, "vgg_a": 8, "alexnet": 32,
                 "googlenet": 32, "resnet50": 16}
GEMM_SIZE = 2048          # the machine's GEMM rate: one (n, n) @ (n, n) float32 product
PAUSE = 0.3               # seconds between turns: OpenBLAS / OpenMP threads spin that long at most
OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
GEMM_NAMES = {"blas": "BLAS", "onednn": "oneDNN", "pytorch": "PyTorch"}
CAFFE_ITERATIONS = 10     # forward+backward iterations of each `syncsgd time` / `caffe time` run
TIME_TIMEOUT = 1800       # seconds one of those runs may take
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMEXPR_NUM_THREADS")


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
                # Iterations until arg seconds have passed, at least one.
                times, loss = [], None
                began = time.perf_counter()
                while not times or time.perf_counter() - began < arg:
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


def caffe_oracle():
    """The env file of BVLC Caffe's oracle, where tests/test_oracle.py finds it:
    $CAFFE_ORACLE_DIR, else ~/.cache/bvlc-caffe-9b89154; None where it is not built."""
    base = os.environ.get("CAFFE_ORACLE_DIR") or os.path.expanduser("~/.cache/bvlc-caffe-9b89154")
    env = os.path.join(base, "env.sh")
    return env if os.path.isfile(env) else None


def write_fwd_bwd_prototxt(model, batch, size, path):
    """The net both `syncsgd time` and `caffe time` run: the TRAIN net of `model` as the
    training turns build it (data layers as Input layers of `batch`, Split layers explicit), with
    force_backward: true."""
    from google.protobuf import text_format
    net_param, _ = benchmark_param(model, batch, size)
    net_param.force_backward = True
    with open(path, "w") as f:
        f.write(text_format.MessageToString(net_param))


def _threads_env(threads, environ):
    env = dict(environ)
    env.update({name: str(threads) for name in THREAD_VARIABLES})
    return env


def time_syncsgd(prototxt, iterations, threads):
    """Milliseconds per forward+backward iteration: the total_ms of `syncsgd time --json`, the
    wall time of whole passes as training runs them (lanes and all)."""
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "time", "--model", prototxt,
                           "--iterations", str(iterations), "--json"], capture_output=True,
                          text=True, env=_threads_env(threads, os.environ), timeout=TIME_TIMEOUT)
    if done.returncode:
        raise RuntimeError(f"syncsgd time --model {prototxt} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["total_ms"]


def time_bvlc(oracle, prototxt, iterations, threads):
    """Milliseconds per forward+backward iteration by BVLC's `caffe time`, run in the oracle's
    own environment: its "Average Forward pass" plus "Average Backward pass", timed in
    microseconds (its "Average Forward-Backward" is a count of whole milliseconds over the run,
    0 for a small net). They leave out the few microseconds of its loop and log line."""
    own = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GLOG_minloglevel")}
    done = subprocess.run(["bash", "-c", 'source "$0" && exec caffe time -model "$1" '
                           '-iterations "$2"', oracle, prototxt, str(iterations)],
                          capture_output=True, text=True, env=_threads_env(threads, own),
                          timeout=TIME_TIMEOUT)
    passes = [re.search(rf"Average {name} pass: ([0-9.e+-]+) ms", done.stderr)
              for name in ("Forward", "Backward")]
    if done.returncode or not all(passes):
        raise RuntimeError(f"BVLC Caffe ({oracle}): caffe time -model {prototxt} failed: "
                           f"{done.stderr[-2000:]}")
    return sum(float(found.group(1)) for found in passes)


def caffe_comparison(prototxt, threads, rounds, iterations, oracle, say=lambda message: None):
    """`syncsgd time` and, where `oracle` (BVLC Caffe's env file) is given, `caffe time` on
    `prototxt`, in `rounds` rounds of one run each, the first of a round alternating; a dict
    with each framework's milliseconds per iteration (the minimum over rounds) and their
    ratio (Caffe's over syncsgd's: above 1, syncsgd is faster)."""
    runs = {"syncsgd": lambda: time_syncsgd(prototxt, iterations, threads)}
    if oracle:
        runs["bvlc"] = lambda: time_bvlc(oracle, prototxt, iterations, threads)
    rounds_ms = {kind: [] for kind in runs}
    for r in range(rounds):
        for kind in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            rounds_ms[kind].append(runs[kind]())
            time.sleep(PAUSE)
        say(f"fwd+bwd round {r + 1}/{rounds}: " + ", ".join(
            f"{kind} {ms[-1]:.1f} ms" for kind, ms in rounds_ms.items()))
    best = {kind: min(ms) for kind, ms in rounds_ms.items()}
    return {"iterations": iterations, "rounds": rounds, "threads": threads, "oracle": oracle,
            "rounds_ms": rounds_ms, "syncsgd_ms": best["syncsgd"], "bvlc_ms": best.get("bvlc"),
            "ratio": best["bvlc"] / best["syncsgd"] if oracle else None}


def torch_available():
    """Whether PyTorch is installed (without importing it in this process)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def benchmark(model, batch=None, size=None, rounds=5, warmup=2, threads=None, use_torch=True,
              turn_seconds=1.0, progress=None, lr_scale=LR_SCALE, caffe=False,
              caffe_iterations=CAFFE_ITERATIONS):
    """Train `model` in syncsgd and (if installed and asked) PyTorch in turns; a dict of results.

    After `warmup` untimed iterations each, each of `rounds` rounds gives each framework one turn
    of iterations until `turn_seconds` have passed (a count set from the warm-up would be a few
    where a first iteration times kernels, and a turn of a few mostly wakes threads); which one
    goes first alternates. Speeds use the median iteration time. Then `rounds` rounds of one
    product per GEMM kernel each, in turns; a kernel's rate is its median. With `caffe`, then
    caffe_comparison over `rounds` rounds of `caffe_iterations` iterations ("caffe" in the
    result; its BVLC figures None where the oracle is not built).
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
            warm_losses = {}
            for child in children:
                warm = [child.ask("run", 0) for _ in range(warmup)]
                warm_losses[child.kind] = [reply["loss"] for reply in warm]
                time.sleep(PAUSE)
            for r in range(rounds):
                order = children if r % 2 == 0 else children[::-1]
                for child in order:
                    reply = child.ask("run", turn_seconds)
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
        if caffe:
            prototxt = os.path.join(scratch, "fwd_bwd.prototxt")
            write_fwd_bwd_prototxt(model, batch, size, prototxt)
            comparison = caffe_comparison(prototxt, threads, rounds, caffe_iterations,
                                          caffe_oracle(), lambda m: say(f"{model}: {m}"))
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
    if caffe:
        result["caffe"] = comparison
    if "pytorch" in result["frameworks"]:
        s, t = result["frameworks"]["syncsgd"], result["frameworks"]["pytorch"]
        result["speed_ratio"] = s["images_per_s"] / t["images_per_s"]
        result["memory_ratio"] = s["peak_rss_mb"] / t["peak_rss_mb"]
    return result


def format_table(results):
    """A Markdown table of benchmark results ("-" where PyTorch, oneDNN or BVLC Caffe was not
    run)."""
    lines = ["| net | batch | input | syncsgd images/s | PyTorch images/s | ratio | syncsgd "
             "GFLOP/s | % of GEMM | GEMM GFLOP/s " + " / ".join(GEMM_NAMES.values()) +
             " | update ms syncsgd / PyTorch | peak MiB syncsgd / PyTorch "
             "| syncsgd fwd+bwd ms | BVLC Caffe ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
        vs_caffe = r.get("caffe") or {}
        cells += [_ms(vs_caffe.get("syncsgd_ms")), _ms(vs_caffe.get("bvlc_ms")),
                  "-" if vs_caffe.get("ratio") is None else f"{vs_caffe['ratio']:.2f}x"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _ms(value):
    """Milliseconds for the table: one decimal, three significant figures below 1 ms."""
    if value is None:
        return "-"
    return f"{value:,.1f}" if value >= 1 else f"{value:.3g}"


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
    parser.add_argument("--no-torch", action="store_true", help="train syncsgd only")
    parser.add_argument("--caffe", action="store_true",
                        help="also time `syncsgd time` against BVLC Caffe's `caffe time` (where "
                             "its oracle is built) on the same prototxt, in turns")
    parser.add_argument("--caffe-iterations", type=int, default=CAFFE_ITERATIONS,
                        help="forward+backward iterations of each of those runs (default "
                             f"{CAFFE_ITERATIONS})")
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
    if args.caffe and not caffe_oracle():
        print("benchmark: --caffe: BVLC Caffe is not built here ($CAFFE_ORACLE_DIR or "
              "~/.cache/bvlc-caffe-9b89154; ../shared/oracle/build-bvlc-caffe.sh builds it): "
              "its columns show -", file=sys.stderr, flush=True)
    results = []
    for model, batch, size in zip(models, batches, sizes):
        results.append(benchmark(model, batch, size or None, args.rounds, args.warmup,
                                 args.threads, not args.no_torch,
                                 progress=None if quiet else print, caffe=args.caffe,
                                 caffe_iterations=args.caffe_iterations))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(format_table(results))
        print(f"(threads {results[0]['threads']}; load average {load:.2f} at the end; % of GEMM:"
              " of the best GEMM kernel syncsgd can call)")
        if args.caffe:
            print(f"(fwd+bwd: `syncsgd time` and BVLC Caffe's `caffe time` on the same prototxt, "
                  f"force_backward, {args.caffe_iterations} iterations, the minimum over "
                  f"{args.rounds} round(s) in turns; ratio: Caffe ms / syncsgd ms)")
        print(format_libraries(results))
        if warning:
            print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
