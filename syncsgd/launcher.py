"""What a launcher puts in each rank's environment: MPI's (MPICH's and Intel's hydra, Open MPI's
mpirun, PMIx, MVAPICH2) and Slurm's srun. Read without MPI, because importing mpi4py initialises
it: one-process runs must not, and the log decides who writes before any communicator exists.

srun sets PMI_RANK and PMI_SIZE with --mpi=pmi2, PMIX_RANK with --mpi=pmix, and only its own
SLURM_* variables with --mpi=none (Slurm's default), under which MPI cannot join the tasks.
"""
import os

from syncsgd.errors import SyncSGDError

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
LAUNCHER_VARIABLES = RANK_VARIABLES + ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
# How many processes were started together, in the order they are believed: an MPI launcher's
# count first, because Open MPI's mpirun and Intel's hydra start their daemons with srun, whose
# SLURM_STEP_NUM_TASKS then counts nodes.
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def launched():
    """Whether an MPI launcher started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def launcher_rank():
    """This process's rank as its launcher set it; 0 without a launcher."""
    return _first_number(RANK_VARIABLES, 0)


def launcher_size():
    """How many processes the launcher started together; 1 without a launcher."""
    return _first_number(SIZE_VARIABLES, 1)


def check_size(mpi_size):
    """Refuse to train when the launcher started more processes than MPI joined: each would
    train alone, and all of them on the same snapshot files."""
    started = launcher_size()
    if mpi_size == 1 < started:
        raise SyncSGDError(
            f"the launcher started {started} processes, but MPI sees this one alone, so each "
            "would train by itself. Under srun, give the MPI plugin this MPI needs: --mpi=pmi2 "
            "for MPICH and Intel MPI, --mpi=pmix for Open MPI (`srun --mpi=list` shows this "
            "Slurm's); under mpiexec or mpirun, use the launcher of the MPI mpi4py was built "
            "against (`python -m mpi4py --mpi-library` names it)")


def slurm_cpus_per_task():
    """The CPUs Slurm gave each task (SLURM_CPUS_PER_TASK, set by -c / --cpus-per-task), or None.
    Without task binding every process sees the whole node in its affinity mask, so this count
    is then its only limit."""
    value = _first_number(("SLURM_CPUS_PER_TASK",), 0)
    return value or None


def _first_number(names, default):
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default
