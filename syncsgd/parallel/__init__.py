"""Everything that crosses ranks: the communicator, gradient synchronisation, model-parallel
partitioning, the watchdog and the timeline.

A solver gets its synchronisation object from default_sync(): over every rank when the process
was started by an MPI launcher with several ranks, else the one-process LocalSync, for which MPI
is not even initialised.
"""
import functools
import os
import sys
import time

from syncsgd.launcher import check_size, launched
from syncsgd.parallel.sync import LocalSync


@functools.cache
def world():
    """The Communicator over all ranks when run under an MPI launcher with several ranks, else
    None. The same object on every call; creating it sets this rank's thread budget."""
    if "mpi4py.MPI" not in sys.modules and not launched():
        check_size(1)
        return None
    from mpi4py import MPI

    from syncsgd.parallel.comm import Communicator
    size = MPI.COMM_WORLD.Get_size()
    check_size(size)
    if size == 1:
        return None
    _share_cores(MPI.COMM_WORLD)
    return Communicator(MPI.COMM_WORLD)


def _share_cores(comm):
    """Give this rank its share of the cores it may run on: the cores of its affinity mask divided
    among the ranks on its node whose masks overlap it, at most the CPUs of its Slurm task."""
    from mpi4py import MPI

    from syncsgd.kernels.threads import set_budget, usable_cores, within_allocation
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    mine = usable_cores()
    sharers = sum(1 for cores in node.allgather(mine) if cores & mine)
    node.Free()
    set_budget(within_allocation(len(mine) // sharers))


def default_sync():
    """The synchronisation object a solver or evaluation uses when given none."""
    comm = world()
    if comm is None:
        return LocalSync()
    from syncsgd.parallel.mpi_sync import MpiSync
    return MpiSync(comm)


def abort_world(message, status=1):
    """On a failing rank of a multi-rank job, print `message` and end every rank (no hang)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() > 1:
        sys.stderr.write(f"[rank {world.Get_rank()}] {message}\n")
        sys.stderr.flush()
        time.sleep(1.0)       # the launcher forwards the line before it acts on the abort
        world.Abort(status)
        os._exit(status)      # a rank cut off from the launcher returns from Abort
