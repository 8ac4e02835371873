"""Everything that crosses ranks: the communicator, the gradient reducer, the timeline."""
import os
import sys

_LAUNCHER_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def world():
    """A Communicator over all ranks when run under an MPI launcher with several ranks, else
    None (one process: MPI is not even initialised)."""
    if "mpi4py.MPI" not in sys.modules and not any(v in os.environ for v in _LAUNCHER_VARS):
        return None
    from mpi4py import MPI

    from syncsgd.parallel.comm import Communicator
    if MPI.COMM_WORLD.Get_size() == 1:
        return None
    return Communicator(MPI.COMM_WORLD)


def abort_world(message):
    """On a failing rank of a multi-rank job, print `message` and end every rank (no hang)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() > 1:
        sys.stderr.write(f"[rank {world.Get_rank()}] {message}\n")
        sys.stderr.flush()
        world.Abort(1)
