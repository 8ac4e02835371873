#!/usr/bin/env python3
"""Strong scaling of a solver over 1, 2, 4, ... MPI ranks (fixed global minibatch), optionally
against PyTorch DistributedDataParallel on the same net.

    python tools/scaling.py --solver models/cifar10_quick/solver.prototxt --ranks 1,2 \
        --iterations 60 --out runs/scaling_cifar10_quick.csv [--torch] [--rounds 5]

For each rank count it launches `mpiexec -n N` on this script in worker mode, which trains the
solver's net with its data layers replaced by constant DummyData of the same global batch (the
measurement is of compute and communication, not of disk), each rank with its share of the cores
unless --threads says otherwise. Each run reports images/s, the time the collectives ran, the
part of it the training thread waited for after backward (not hidden by overlap), and the raw
MPI allreduce bandwidth for the same number of bytes measured in the same job.

With --torch, the PyTorch twin of the same net (tools/runners.py: built from the same prototxt,
starting from syncsgd's initial weights, constant inputs of the same value) trains the same
global batch split over the same number of ranks, each with the same threads, under
DistributedDataParallel on gloo: N processes on 127.0.0.1, each with a timeout and killed by its
PID if the job fails. The two frameworks run in turns (each round gives every rank count one run
of each, which one goes first alternating), and each figure is the median round's. One rank is
always run: it is each framework's own baseline (one process with all the threads), of which
"keeps" is the fraction N ranks keep. A CSV and, with matplotlib, a PNG plot are written.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONSTANT = 0.5       # every input value, data and labels, in both frameworks


def constant_data(net_path, batch=None, input_size=None, fc_mode=None):
    """The TRAIN net with each data layer replaced by constant DummyData of the same global batch
    (or `batch`); the sample shape comes from the Input layer of deploy.prototxt beside the net,
    its spatial size optionally replaced by `input_size` (h, w). `fc_mode` ("MODEL", "HYBRID:2",
    ...) sets parallel_param on every InnerProduct layer."""
    from syncsgd import TRAIN
    from syncsgd.compile import compile_net
    from syncsgd.proto import pb
    param, _ = compile_net(net_path, TRAIN)
    deploy, _ = compile_net(os.path.join(os.path.dirname(net_path), "deploy.prototxt"), TRAIN)
    sample = list(deploy.layer[0].input_param.shape[0].dim[1:])
    if input_size:
        sample[-2:] = input_size
    if fc_mode:
        mode, _, groups = fc_mode.partition(":")
        for layer in param.layer:
            if layer.type == "InnerProduct":
                layer.parallel_param.mode = pb.ParallelParameter.Mode.Value(mode)
                layer.parallel_param.groups = int(groups or 1)
    for layer in param.layer:
        if layer.type not in ("HDF5Data", "Data"):
            continue
        batch = batch or (layer.hdf5_data_param if layer.type == "HDF5Data" else
                          layer.data_param).batch_size
        dummy = pb.LayerParameter(name=layer.name, type="DummyData", top=list(layer.top))
        dummy.dummy_data_param.shape.add(dim=[batch] + sample)
        for _ in layer.top[1:]:
            dummy.dummy_data_param.shape.add(dim=[batch])
        dummy.dummy_data_param.data_filler.add(type="constant", value=CONSTANT)
        layer.CopyFrom(dummy)
    return param


def rank_threads(threads, ranks):
    """Threads per rank: --threads, else the rank's share of the cores this process may use."""
    from syncsgd.kernels.threads import usable_cores
    return threads or max(1, len(usable_cores()) // ranks)


def build_solver(args):
    """The solver of the measured net (constant data, its rate times runners.LR_SCALE as the
    PyTorch twin's, no tests, display or snapshots)."""
    import syncsgd
    from runners import LR_SCALE
    from syncsgd.proto import pb
    from syncsgd.solvers import load_solver_param
    param, _ = load_solver_param(args.solver)
    net = constant_data(param.net or param.train_net, args.batch, args.input, args.fc_mode)
    solver_param = pb.SolverParameter()
    solver_param.CopyFrom(param)
    for field in ("net", "train_net", "test_net", "test_iter", "test_net_param", "net_param"):
        solver_param.ClearField(field)
    solver_param.train_net_param.CopyFrom(net)
    solver_param.test_interval = 0
    solver_param.display = 0
    solver_param.snapshot = 0
    solver_param.snapshot_after_train = False
    solver_param.random_seed = 1
    solver_param.base_lr *= LR_SCALE
    if args.options:
        from google.protobuf import text_format
        text_format.Merge(args.options, solver_param)
    return syncsgd.get_solver(solver_param)


def worker(args):
    """One rank of the syncsgd job; with --save-weights, one process writing the initial weights
    (for the PyTorch twin) and the global batch instead."""
    import numpy as np

    from syncsgd.kernels.threads import set_budget
    from syncsgd.parallel import world
    comm = world()
    ranks = comm.size if comm is not None else 1
    threads = set_budget(rank_threads(args.threads, ranks))
    solver = build_solver(args)
    global_batch = solver.ctx.global_batch
    if args.save_weights:
        # The PyTorch twin's initial weights: the learnable blobs in net order, as runners reads.
        with open(args.save_weights, "wb") as f:
            for info in solver.net.learnable_params:
                f.write(memoryview(np.ascontiguousarray(info.blob.data)).cast("B"))
        solver.close()
        print("RESULT " + json.dumps({"global_batch": global_batch}), flush=True)
        return
    first_loss = None
    if args.warmup:
        solver.step(1)
        first_loss = float(solver.net.loss)
        solver.step(args.warmup - 1)
    solver.sync.reset_stats()
    start = time.perf_counter()
    solver.step(args.iterations)
    elapsed = time.perf_counter() - start
    stats = solver.sync.stats()
    sent = stats.get("bytes_sent", 0) + stats.get("group_bytes_sent", 0)
    grad_bytes = sum(p.blob.diff.nbytes for p in solver.net.learnable_params)
    raw = None
    if comm is not None:
        from mpi4py import MPI
        buf = np.ones(grad_bytes // 4, np.float32)
        comm.grad.Allreduce(MPI.IN_PLACE, buf)
        comm.barrier()
        t = time.perf_counter()
        for _ in range(args.iterations):
            comm.grad.Allreduce(MPI.IN_PLACE, buf)
        raw = (time.perf_counter() - t) / args.iterations
    solver.close()
    if comm is None or comm.rank == 0:
        per_iter = elapsed / args.iterations
        n = stats.get("iterations") or 1
        print("RESULT " + json.dumps({
            "ranks": ranks,
            "threads": threads,
            "global_batch": global_batch,
            "iteration_s": per_iter,
            "images_per_s": global_batch / per_iter,
            "first_loss": first_loss,
            "grad_bytes": grad_bytes,
            "comm_s": stats.get("comm_s", 0.0) / n,
            "exposed_comm_s": stats.get("exposed_s", 0.0) / n,
            "raw_allreduce_s": raw,
            "fc_mode": args.fc_mode or "default",
            "bytes_sent_per_rank": sent / args.iterations,
        }), flush=True)


def torch_worker(args):
    """One rank of the PyTorch DDP job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
    environment): its slice of the global batch (--batch), as syncsgd slices it.

    DDP's reducer keeps the process group alive past destroy_process_group, and gloo's threads
    torn down during the interpreter's shutdown can abort the process ("terminate called
    without an active exception": rank 1, signal 6, once in CI): the DDP module goes first,
    then the group, and the worker leaves without the interpreter's shutdown."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from runners import TorchRunner
    from syncsgd.context import shard_range
    from syncsgd.solvers import load_solver_param
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threads = rank_threads(args.threads, ranks)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=args.timeout))
    param, _ = load_solver_param(args.solver)
    runner = TorchRunner(param.net or param.train_net, shard_range(args.batch, rank, ranks)[1],
                         args.input, weights_path=args.weights)
    runner.fill_inputs(CONSTANT)
    runner.distribute()
    losses = [runner.step() for _ in range(args.warmup)]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iterations):
        runner.step()
    elapsed = time.perf_counter() - start
    dist.barrier()
    del runner
    dist.destroy_process_group()
    if rank == 0:
        per_iter = elapsed / args.iterations
        print("RESULT " + json.dumps({
            "ranks": ranks, "threads": threads, "global_batch": args.batch,
            "iteration_s": per_iter, "images_per_s": args.batch / per_iter,
            "first_loss": losses[0] if losses else None}), flush=True)
    sys.stderr.flush()
    os._exit(0)


def mpiexec():
    import shutil
    import sysconfig
    return shutil.which("mpiexec") or os.path.join(sysconfig.get_path("scripts"), "mpiexec")


def worker_flags(args):
    """The command-line flags the workers share."""
    flags = ["--solver", args.solver, "--iterations", str(args.iterations),
             "--warmup", str(args.warmup), "--threads", str(args.threads),
             "--timeout", str(args.timeout)]
    for flag in ("options", "batch", "input", "fc_mode"):
        value = getattr(args, flag)
        if value:
            flags += [f"--{flag.replace('_', '-')}", str(value) if flag != "input"
                      else ",".join(map(str, value))]
    return flags


def result(what, returncode, stdout, stderr):
    """The RESULT a worker printed, or the end of the run naming `what` failed."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if returncode != 0 or not lines:
        sys.stderr.write(stdout[-3000:] + stderr[-3000:])
        raise SystemExit(f"scaling: {what} failed (exit {returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def run_syncsgd(args, n, *extra):
    """One syncsgd job on `n` ranks (one plain process with `extra` flags for --save-weights)."""
    launcher = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py"] if not extra else \
        [sys.executable]
    command = launcher + [__file__, "--worker"] + worker_flags(args) + list(extra)
    what = "writing the initial weights" if extra else f"the {n}-rank syncsgd run"
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"scaling: {what} timed out after {args.timeout} s (--timeout)")
    return result(what, done.returncode, done.stdout, done.stderr)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(args, n, weights, global_batch):
    """One PyTorch DDP job: `n` processes on this host, all killed (each by its PID) as soon as
    one fails or --timeout passes."""
    import tempfile
    command = [sys.executable, __file__, "--torch-worker", "--weights", weights] + \
        worker_flags(args) + ["--batch", str(global_batch)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(n))
    what = f"the {n}-rank PyTorch run"
    killed = set()
    with tempfile.TemporaryDirectory() as scratch:
        outputs, processes = [], []
        try:
            for rank in range(n):
                out = open(os.path.join(scratch, f"{rank}.out"), "w+")
                err = open(os.path.join(scratch, f"{rank}.err"), "w+")
                outputs.append((out, err))
                processes.append(subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT,
                                                  env=dict(env, RANK=str(rank))))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in processes):
                if any(p.returncode for p in processes) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for rank, p in enumerate(processes):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    killed.add(rank)
        texts = []
        for out, err in outputs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    codes = [p.returncode for p in processes]
    if not any(codes):
        return result(what, 0, *texts[0])
    failed = {rank: code for rank, code in enumerate(codes) if code and rank not in killed}
    if not failed:
        raise SystemExit(f"scaling: {what} timed out after {args.timeout} s (--timeout)")
    for rank in failed:
        sys.stderr.write(f"--- rank {rank}:\n" + texts[rank][1][-2000:])
    raise SystemExit(f"scaling: {what} failed (" + ", ".join(
        f"rank {rank} " + (f"exit {code}" if code > 0 else f"signal {-code}")
        for rank, code in failed.items()) + ")")


def median_run(runs):
    """The run of median iteration time (the faster middle one of an even count)."""
    return sorted(runs, key=lambda r: r["iteration_s"])[(len(runs) - 1) // 2]


def rank_counts(text):
    counts = [int(r) for r in text.split(",")]
    return [1] + [n for n in counts if n != 1]


def driver(args):
    import importlib.util
    import tempfile

    from benchmark import PAUSE
    if args.torch and importlib.util.find_spec("torch") is None:
        raise SystemExit(f"scaling: --torch needs PyTorch, not installed for {sys.executable} "
                         f"(the CPU build: pip install torch==2.13.0)")
    counts = rank_counts(args.ranks)
    kinds = ["syncsgd"] + (["pytorch"] if args.torch else [])
    runs = {(kind, n): [] for kind in kinds for n in counts}
    with tempfile.TemporaryDirectory() as scratch:
        weights = os.path.join(scratch, "weights.bin")
        global_batch = None
        if args.torch:
            global_batch = run_syncsgd(args, 1, "--save-weights", weights)["global_batch"]
        for r in range(args.rounds):
            for i, n in enumerate(counts):
                for kind in (kinds if (r + i) % 2 == 0 else kinds[::-1]):
                    runs[(kind, n)].append(run_syncsgd(args, n) if kind == "syncsgd" else
                                           run_torch(args, n, weights, global_batch))
                    time.sleep(PAUSE)
    rows = scaling_rows(runs, counts, os.path.basename(os.path.dirname(
        os.path.abspath(args.solver))))
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        try:
            from syncsgd.plot import plot_scaling
            plot_scaling(plot_rows(rows), os.path.splitext(args.out)[0] + ".png")
        except ImportError as e:
            print(f"scaling: no plot ({e})")
    return rows


def scaling_rows(runs, counts, model):
    """One row per rank count from {(framework, ranks): [run results]}: syncsgd's median run,
    its speedup over its one-rank run (the fraction of one process's throughput N ranks keep),
    and with PyTorch the same for PyTorch and the ratio of the two."""
    rows = []
    base = {kind: median_run(runs[(kind, 1)]) for kind, n in runs if n == 1}
    for n in counts:
        row = dict(median_run(runs[("syncsgd", n)]))
        one = base["syncsgd"]
        row["model"] = model
        row["speedup"] = one["iteration_s"] / row["iteration_s"]
        row["efficiency"] = one["iteration_s"] / (row["iteration_s"] * row["ranks"])
        comm = row["comm_s"]
        row["hidden_fraction"] = (1 - row["exposed_comm_s"] / comm) if comm else None
        raw = row["raw_allreduce_s"]
        row["exchange_vs_raw_bandwidth"] = (raw / comm) if raw and comm else None
        if "pytorch" in base:
            torch = median_run(runs[("pytorch", n)])
            row["torch_threads"] = torch["threads"]
            row["torch_iteration_s"] = torch["iteration_s"]
            row["torch_images_per_s"] = torch["images_per_s"]
            row["torch_speedup"] = base["pytorch"]["iteration_s"] / torch["iteration_s"]
            row["torch_first_loss"] = torch["first_loss"]
            row["syncsgd_vs_torch"] = row["images_per_s"] / torch["images_per_s"]
        rows.append(row)
    return rows


def plot_rows(rows):
    """The rows for syncsgd.plot.plot_scaling, with PyTorch's as a model of their own."""
    torch = [{"model": f"{r['model']} (PyTorch DDP)", "ranks": r["ranks"],
              "images_per_s": r["torch_images_per_s"], "speedup": r["torch_speedup"],
              "efficiency": r["torch_speedup"] / r["ranks"]}
             for r in rows if "torch_images_per_s" in r]
    return rows + torch


def print_table(rows):
    """The rows as a table: per framework images/s and the fraction of its own one-rank
    throughput kept ("keeps"), and syncsgd's communication figures."""
    torch = "torch_images_per_s" in rows[0]
    head = f"{'ranks':>5} {'fc':>8} {'thr':>3} {'img/s':>9} {'keeps':>6} "
    if torch:
        head += f"{'torch img/s':>11} {'keeps':>6} {'ratio':>6} "
    print(head + f"{'comm ms':>8} {'exposed ms':>10} {'hidden':>7} {'raw ms':>7} "
          f"{'bw ratio':>8} {'MB sent':>8}")
    for r in rows:
        fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        line = (f"{r['ranks']:>5} {r['fc_mode']:>8} {r['threads']:>3} "
                f"{r['images_per_s']:>9.1f} {r['speedup']:>6.2f} ")
        if torch:
            line += (f"{r['torch_images_per_s']:>11.1f} {r['torch_speedup']:>6.2f} "
                     f"{r['syncsgd_vs_torch']:>5.2f}x ")
        print(line + f"{r['comm_s'] * 1e3:>8.2f} {r['exposed_comm_s'] * 1e3:>10.2f} "
              f"{fmt(r['hidden_fraction'], 2):>7} "
              f"{fmt(r['raw_allreduce_s'] and r['raw_allreduce_s'] * 1e3, 2):>7} "
              f"{fmt(r['exchange_vs_raw_bandwidth'], 2):>8} "
              f"{r['bytes_sent_per_rank'] / 2**20:>8.2f}")
    print("(img/s: of the global batch; keeps: of the framework's own 1-rank throughput; "
          + ("ratio: syncsgd / PyTorch; fc: syncsgd's InnerProduct layout, PyTorch's is data "
             "parallel; " if torch else "") + "comm figures: syncsgd's, per iteration)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solver", required=True)
    parser.add_argument("--ranks", default="1,2", help="rank counts (1 is always run: the "
                        "baseline)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="BLAS threads per rank (default: the rank's share of the cores)")
    parser.add_argument("--options", help="text-format SolverParameter fields to merge, e.g. "
                        "'distributed_param { progress: POLL }'")
    parser.add_argument("--batch", type=int, help="global minibatch (default: the net's)")
    parser.add_argument("--input", type=lambda t: [int(v) for v in t.split(",")],
                        help="H,W: a reduced input size (e.g. 112,112 for VGG-A)")
    parser.add_argument("--fc-mode", help="parallel_param of every InnerProduct layer: DATA, "
                        "MODEL, HYBRID:G or AUTO (default: none, so the planner's choice on "
                        "more than one rank)")
    parser.add_argument("--torch", action="store_true", help="also PyTorch DDP (gloo) on the "
                        "same net, batch, ranks and threads, in turns with syncsgd")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each framework per rank "
                        "count, in turns (figures: the median run)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    parser.add_argument("--out", help="CSV path (a PNG plot is written beside it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-weights", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.torch_worker:
        torch_worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
