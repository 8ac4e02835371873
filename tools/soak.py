#!/usr/bin/env python3
"""A long run that watches for leaks: memory, open files and threads of every rank.

    python tools/soak.py --ranks 2 --iterations 5000 --every 250 --out runs/soak.csv

Trains models/lenet/solver.prototxt (build the digits set first: python data/digits.py) with
test passes and snapshots every `--every` iterations, so data prefetch threads, test nets, the
timeline and snapshot writing all run; after each block every rank reports its resident memory,
open file descriptors and thread count. Memory should rise over the first blocks (buffers, caches)
and then stay flat.
"""
import argparse
import csv
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_mib():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args):
    import syncsgd
    from syncsgd.parallel import world
    from syncsgd.solvers import load_solver_param
    comm = world()
    param, _ = load_solver_param(os.path.join(ROOT, "models/lenet/solver.prototxt"))
    param.test_interval = args.every
    param.snapshot = args.every
    param.display = args.every
    param.snapshot_prefix = os.path.join(args.scratch, "soak")
    param.max_iter = args.iterations
    solver = syncsgd.get_solver(param)
    solver.enable_timeline(os.path.join(args.scratch, "trace.json"))
    rows = []
    while solver.iter < args.iterations:
        solver.step(args.every)
        rows.append((solver.iter, rss_mib(), len(os.listdir("/proc/self/fd")),
                     threading.active_count()))
    solver.close()
    gathered = comm.ctrl.gather(rows, root=0) if comm is not None else [rows]
    if comm is None or comm.rank == 0:
        for rank, rank_rows in enumerate(gathered):
            for it, rss, fds, threads in rank_rows:
                print(f"ROW {rank} {it} {rss:.1f} {fds} {threads}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--out", help="CSV of rank, iteration, rss_mib, open_fds, threads")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import shutil
    import sysconfig
    mpiexec = shutil.which("mpiexec") or os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, "-m", "mpi4py",
                               __file__, "--worker", "--iterations", str(args.iterations),
                               "--every", str(args.every), "--scratch", scratch],
                              capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        return 1
    rows = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    print(f"{'rank':>4} {'iter':>6} {'rss MiB':>8} {'fds':>5} {'threads':>7}")
    for rank, it, rss, fds, threads in rows:
        print(f"{rank:>4} {it:>6} {rss:>8} {fds:>5} {threads:>7}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rank", "iteration", "rss_mib", "open_fds", "threads"])
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
