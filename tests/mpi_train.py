"""Run by the MPI tests under `mpiexec -n N python -m mpi4py tests/mpi_train.py ...`: train a
solver for some iterations on however many ranks there are, then rank 0 writes every parameter
(and the test-net scores) to an .npz file, so the test can compare runs of different sizes."""
import argparse
import os
import signal
import sys
import time

import numpy as np

import syncsgd
from syncsgd.parallel import world


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("solver")
    parser.add_argument("iterations", type=int)
    parser.add_argument("out")
    parser.add_argument("--restore")
    parser.add_argument("--snapshot", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--other-solver", help="used by the last rank instead of `solver`")
    parser.add_argument("--fault", choices=["raise", "kill", "stall", "unreadable"],
                        help="what --fault-rank does in the forward pass of iteration 3")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--threads", type=int, help="each rank's thread budget (lanes at 2)")
    args = parser.parse_args()
    comm = world()
    if args.threads:
        from syncsgd.kernels.threads import set_budget
        set_budget(args.threads)
    rank = comm.rank if comm is not None else 0
    if rank == args.fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    last = comm is not None and rank == comm.size - 1
    solver = syncsgd.get_solver(args.other_solver if last and args.other_solver else args.solver)
    if args.restore:
        solver.restore(args.restore)
    if rank == args.fault_rank:
        inject_fault(solver, args.fault)
    solver.step(args.iterations)
    scores = solver.test(0) if solver.test_nets else {}
    if args.snapshot:
        solver.snapshot()
    whole = solver.sync.whole_params()
    arrays = {f"{layer.name}/{i}": whole.get((layer.name, i), (blob.data,))[0]
              for layer in solver.net.layers for i, blob in enumerate(layer.blobs)}
    lanes = solver.net.lanes.engaged is not None
    stats = solver.sync.stats()
    group_bytes, grad_bytes = stats.get("group_bytes_sent", 0), stats.get("bytes_sent", 0)
    solver.close()
    if rank == 0:
        arrays["bytes_sent"] = np.array([group_bytes, grad_bytes])
        arrays["lanes"] = np.array(lanes)
        arrays.update({f"score/{k}": np.asarray(v) for k, v in scores.items()})
        np.savez(args.out, **arrays)


def inject_fault(solver, fault):
    """Make the last layer's forward misbehave at iteration 3 on this rank: after iteration 2's
    gradient reduction, which rank 0 reaches only once its snapshot at 2 is written."""
    layer = solver.net.layers[-1]
    forward = layer.forward

    def faulty(bottom, top):
        if solver.iter == 3:
            if fault == "unreadable":
                make_data_unreadable(solver)
            if fault == "raise":
                raise RuntimeError(f"deliberate failure in layer '{layer.name}'")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stall":
                time.sleep(600)
        forward(bottom, top)
    layer.forward = faulty


def make_data_unreadable(solver):
    """From now on this rank cannot open its HDF5 files (as a node whose disk failed)."""
    import h5py

    def broken(*args, **kwargs):
        raise OSError("Unable to synchronously open file (file read failed)")
    # Broken first: a prefetch thread reopening the file now fails to, instead of getting a
    # handle the next lines close under it.
    h5py.File = broken
    for layer in solver.net.layers:
        source = getattr(layer, "source", None)
        if hasattr(source, "close"):
            source.close()


if __name__ == "__main__":
    sys.exit(main())
