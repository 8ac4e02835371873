"""Open MPI, the MPI of most clusters, in place of the mpich wheel: Debian's openmpi-bin (installed
where absent), mpi4py built against it in a venv of its own (the `openmpi` fixture,
tests/cluster.py), jobs started by its mpirun. 2 and 4 ranks (these placed by a hostfile) train
as one process does, a killed or stalled rank ends the job within the bound and is named, and
each rank reads its rank, the job's size and its thread budget from what Open MPI gives it."""
import re
import time

import numpy as np
import pytest

import cluster
import mpirun
import test_distributed
from test_distributed import SCRIPT, assert_same, write_solver

pytestmark = pytest.mark.mpi
single_runs = test_distributed.single_runs     # the one-process runs, a fixture

BOUND = 90         # seconds from a rank's fault to the end of the job


def launch(openmpi, n, *args, where=("--oversubscribe",), timeout=240, check=True):
    """`mpirun WHERE -n N python -m mpi4py ARGS` with Open MPI and its mpi4py; by default more
    ranks than cores may share this host."""
    command, python = openmpi
    return mpirun.launch([command, *where, "-n", n, python, "-m", "mpi4py", *args],
                         timeout=timeout, check=check, env=cluster.openmpi_env())


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_ranks_match_one_process(tmp_path, openmpi, single_runs, n, kind):
    solver, reference = single_runs[kind]
    where = ("--oversubscribe",)
    if n == 4:                          # the slots a hostfile declares, as on a cluster
        hosts = tmp_path / "hosts"
        hosts.write_text("localhost slots=4\n")
        where = ("--hostfile", hosts)
    launch(openmpi, n, SCRIPT, solver, 6, tmp_path / "n.npz", where=where)
    result = dict(np.load(tmp_path / "n.npz"))
    assert_same(result, reference)
    assert result["score/acc"] == pytest.approx(reference["score/acc"], abs=1e-6)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_killed_or_stalled_rank_ends_the_job_named(tmp_path, openmpi, fault):
    solver = write_solver(tmp_path, "SGD", "distributed_param { stall_timeout: 4 }")
    started = time.monotonic()
    result = launch(openmpi, 2, SCRIPT, solver, 6, tmp_path / "x.npz", "--fault", fault,
                    "--fault-rank", 1, timeout=BOUND + 30, check=False)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert elapsed < BOUND, f"took {elapsed:.0f} s"
    named = {"kill": r"process rank 1 with PID \d+ on node \S+ exited on signal 9",
             "stall": r"rank\(s\) 1 did not arrive"}[fault]
    assert re.search(named, output), output[-3000:]


def test_each_rank_reads_open_mpis_variables(openmpi):
    """Rank and size from OMPI_COMM_WORLD_*, read before MPI starts (only rank 0 logs), and a
    thread budget that shares the cores: mpirun binds each of 2 ranks to a core of its own."""
    result = launch(openmpi, 2, "-c", cluster.PROBE, timeout=120)
    ranks = cluster.probes(result.stdout)
    assert sorted(ranks) == [0, 1], result.stdout + result.stderr
    for rank, probe in ranks.items():
        assert probe["launcher_rank"] == rank and probe["size"] == 2
        assert probe["logs"] == (rank == 0)
        assert probe["budget"] == len(probe["cores"]) == 1
        assert probe["openblas"] == [1]
    assert ranks[0]["cores"] != ranks[1]["cores"]
