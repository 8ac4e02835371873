"""What an MPI launcher (MPICH's and Intel's hydra, Open MPI, PMIx, MVAPICH2) puts in each
rank's environment. Read without MPI, because importing mpi4py initialises it: one-process runs
must not, and the log decides who writes before any communicator exists."""
import os

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
LAUNCHER_VARIABLES = RANK_VARIABLES + ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched():
    """Whether an MPI launcher started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def launcher_rank():
    """This process's rank as its launcher set it; 0 without a launcher."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
