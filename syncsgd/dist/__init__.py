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

    from syncsgd.dist.comm import Communicator
    if MPI.COMM_WORLD.Get_size() == 1:
        return None
    return Communicator(MPI.COMM_WORLD)
