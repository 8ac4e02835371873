#!/usr/bin/env python3
"""Strong scaling of a solver over 1, 2, 4, ... MPI ranks (fixed global minibatch).

    python tools/scaling.py --solver models/cifar10_quick/solver.prototxt --ranks 1,2 \
        --iterations 20 --out runs/scaling_cifar10_quick.csv

For each rank count it launches `mpiexec -n N` on this script in worker mode, which trains the
solver's net with its data layers replaced by constant DummyData of the same global batch (the
measurement is of compute and communication, not of disk), each rank with its share of the cores
for BLAS unless --threads says otherwise. Each run reports images/s, the time the collectives
ran, the part of it the training thread waited for after backward (not hidden by overlap), and
the raw MPI allreduce bandwidth for the same number of bytes measured in the same job. A CSV and, with matplotlib, a
PNG plot are written.
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
        dummy.dummy_data_param.data_filler.add(type="constant", value=0.5)
        layer.CopyFrom(dummy)
    return param


def worker(args):
    import numpy as np

    import syncsgd
    from syncsgd.kernels.threads import set_budget
    from syncsgd.parallel import world
    from syncsgd.proto import pb
    from syncsgd.solvers import load_solver_param
    comm = world()
    ranks = comm.size if comm is not None else 1
    threads = set_budget(args.threads or max(1, (os.cpu_count() or 1) // ranks))
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
    if args.options:
        from google.protobuf import text_format
        text_format.Merge(args.options, solver_param)
    solver = syncsgd.get_solver(solver_param)
    solver.step(args.warmup)
    global_batch = solver.ctx.global_batch
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
            "ranks": comm.size if comm is not None else 1,
            "threads": threads,
            "global_batch": global_batch,
            "iteration_s": per_iter,
            "images_per_s": global_batch / per_iter,
            "grad_bytes": grad_bytes,
            "comm_s": stats.get("comm_s", 0.0) / n,
            "exposed_comm_s": stats.get("exposed_s", 0.0) / n,
            "raw_allreduce_s": raw,
            "fc_mode": args.fc_mode or "DATA",
            "bytes_sent_per_rank": sent / args.iterations,
        }), flush=True)


def mpiexec():
    import shutil
    import sysconfig
    return shutil.which("mpiexec") or os.path.join(sysconfig.get_path("scripts"), "mpiexec")


def driver(args):
    rows = []
    for n in [int(r) for r in args.ranks.split(",")]:
        command = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", __file__, "--worker",
                   "--solver", args.solver, "--iterations", str(args.iterations),
                   "--warmup", str(args.warmup), "--threads", str(args.threads)]
        for flag in ("options", "batch", "input", "fc_mode"):
            value = getattr(args, flag)
            if value:
                command += [f"--{flag.replace('_', '-')}", str(value) if flag != "input"
                            else ",".join(map(str, value))]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              timeout=args.timeout)
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"scaling: the {n}-rank run failed (exit {done.returncode})")
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
    base = rows[0]["iteration_s"] * rows[0]["ranks"]
    for row in rows:
        row["model"] = os.path.basename(os.path.dirname(os.path.abspath(args.solver)))
        row["speedup"] = rows[0]["iteration_s"] / row["iteration_s"]
        row["efficiency"] = base / (row["iteration_s"] * row["ranks"])
        comm = row["comm_s"]
        row["hidden_fraction"] = (1 - row["exposed_comm_s"] / comm) if comm else None
        raw = row["raw_allreduce_s"]
        row["exchange_vs_raw_bandwidth"] = (raw / comm) if raw and comm else None
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        try:
            from syncsgd.plot import plot_scaling
            plot_scaling(rows, os.path.splitext(args.out)[0] + ".png")
        except ImportError as e:
            print(f"scaling: no plot ({e})")
    return rows


def print_table(rows):
    print(f"{'ranks':>5} {'fc':>8} {'img/s':>9} {'speedup':>8} {'eff':>6} {'comm ms':>8} "
          f"{'exposed ms':>10} {'hidden':>7} {'raw ms':>7} {'bw ratio':>8} {'MB sent':>8}")
    for r in rows:
        fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        print(f"{r['ranks']:>5} {r['fc_mode']:>8} {r['images_per_s']:>9.1f} {r['speedup']:>8.2f} "
              f"{r['efficiency']:>6.2f} {r['comm_s'] * 1e3:>8.2f} "
              f"{r['exposed_comm_s'] * 1e3:>10.2f} {fmt(r['hidden_fraction'], 2):>7} "
              f"{fmt(r['raw_allreduce_s'] and r['raw_allreduce_s'] * 1e3, 2):>7} "
              f"{fmt(r['exchange_vs_raw_bandwidth'], 2):>8} "
              f"{r['bytes_sent_per_rank'] / 2**20:>8.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solver", required=True)
    parser.add_argument("--ranks", default="1,2")
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
                        "MODEL, HYBRID:G or AUTO")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", help="CSV path (a PNG plot is written beside it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
