"""Slurm, which schedules most clusters' jobs: a one-host Slurm (Debian's slurm-wlm and munge,
installed where absent; munged, slurmctld and slurmd started with a config written in a temporary
folder, 2 CPUs, stopped by PID: tests/cluster.py). srun starts the ranks with the plugin each MPI
needs (pmi2 for the mpich wheel, pmix for Open MPI) and they train as one process does; a killed
or stalled rank ends the job within the bound, named; each rank's thread budget is what Slurm
gives its task; srun without an MPI plugin is refused; and a batch job preempted by an urgent
one snapshots, requeues itself and, resumed, ends with the weights of a run never interrupted.

Every srun has -K (--kill-on-bad-exit): a task that fails ends the others, which would otherwise
wait for it in MPI_Init or in a collective."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cluster
import test_distributed
from test_distributed import SCRIPT, assert_same, write_solver
from test_preemption import MESSAGE, assert_identical, weights
from test_preemption import write_solver as write_long_solver

pytestmark = pytest.mark.mpi
single_runs = test_distributed.single_runs     # the one-process runs, a fixture

BOUND = 90         # seconds from a rank's fault to the end of the job
PLUGINS = {"mpich": "pmi2", "openmpi": "pmix"}
# The preempted run's ranks are stopped (SIGSTOP, by the job's own PIDs) from the submission of
# the urgent job until Slurm has preempted theirs, so training cannot end first: preemption
# came 2 to 23 s after the urgent job on this 2-core host, and 10000 iterations (22 s) once
# ended before it under the whole suite's load.
ITERATIONS = 3000

# What a batch job that may be preempted runs: training ended by SIGTERM (status 143, after its
# snapshot) puts the job back in the queue, and the same command then resumes.
JOB = """#!/bin/bash
#SBATCH --ntasks=2 --requeue --open-mode=append --output={output}
srun -K --mpi=pmix {python} -m mpi4py -m syncsgd.cli train --solver {solver} --auto-resume \
    --iterations {iterations}
status=$?
if [ $status -eq 143 ]; then scontrol requeue $SLURM_JOB_ID; fi
exit $status
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        with cluster.Slurm(tmp_path_factory.mktemp("slurm")) as running:
            yield running
    except cluster.Unavailable as e:
        pytest.skip(f"Slurm: {e}")


def srun(slurm, mpi, python, *args, timeout=240, check=True):
    """`srun -n 2 python -m mpi4py ARGS` with the plugin `mpi` needs."""
    return slurm.run("srun", "-K", f"--mpi={PLUGINS[mpi]}", "-n", 2, python, "-m", "mpi4py",
                     *args, timeout=timeout, check=check)


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_srun_ranks_match_one_process(request, tmp_path, slurm, single_runs, mpi):
    python = sys.executable if mpi == "mpich" else request.getfixturevalue("openmpi")[1]
    solver, reference = single_runs["SGD"]
    srun(slurm, mpi, python, SCRIPT, solver, 6, tmp_path / "n.npz")
    result = dict(np.load(tmp_path / "n.npz"))
    assert_same(result, reference)
    assert result["score/acc"] == pytest.approx(reference["score/acc"], abs=1e-6)


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_killed_or_stalled_rank_ends_the_job_named(tmp_path, slurm, fault):
    solver = write_solver(tmp_path, "SGD", "distributed_param { stall_timeout: 4 }")
    started = time.monotonic()
    result = srun(slurm, "mpich", sys.executable, SCRIPT, solver, 6, tmp_path / "x.npz",
                  "--fault", fault, "--fault-rank", 1, timeout=BOUND + 30, check=False)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert elapsed < BOUND, f"took {elapsed:.0f} s"
    named = {"kill": r"task 1: Killed", "stall": r"rank\(s\) 1 did not arrive"}[fault]
    assert re.search(named, output), output[-3000:]


def one_task(slurm, cpus):
    """What the one task of `srun -c CPUS` sees (cluster.PROBE)."""
    result = slurm.run("srun", "-K", "-n", 1, "-c", cpus, sys.executable, "-c", cluster.PROBE)
    return cluster.probes(result.stdout)[0]


def test_the_thread_budget_is_what_slurm_gives_each_task(slurm):
    two = cluster.probes(srun(slurm, "mpich", sys.executable, "-c", cluster.PROBE).stdout)
    assert sorted(two) == [0, 1]
    for rank, probe in two.items():            # each task bound to a CPU of its own
        assert probe["launcher_rank"] == rank and probe["size"] == 2
        assert probe["logs"] == (rank == 0)
        assert probe["budget"] == len(probe["cores"]) == 1 and probe["openblas"] == [1]
    assert two[0]["cores"] != two[1]["cores"]
    both = one_task(slurm, 2)
    assert both["cores"] == [0, 1] and both["budget"] == 2 and both["openblas"] == [2]


def test_unbound_the_thread_budget_is_slurms_cpus_per_task(tmp_path):
    """Where Slurm binds no task (task/none), each sees the whole node in its affinity mask:
    SLURM_CPUS_PER_TASK is then its share."""
    try:
        with cluster.Slurm(tmp_path, task_plugin="task/none") as unbound:
            one, both = one_task(unbound, 1), one_task(unbound, 2)
    except cluster.Unavailable as e:
        pytest.skip(f"Slurm: {e}")
    assert one["cores"] == both["cores"] == [0, 1]
    assert one["budget"] == 1 and one["openblas"] == [1]
    assert both["budget"] == 2 and both["openblas"] == [2]


def scripted(tmp_path, monkeypatch, outcomes):
    """A Slurm (never started) whose client commands end as the shell lines `outcomes` say, one
    per call; the commands it was asked to run, in order."""
    asked, outcomes = [], iter(outcomes)

    def run(*command, check=True):
        asked.append(command[0])
        return subprocess.run(["sh", "-c", next(outcomes)], capture_output=True, text=True)

    client = cluster.Slurm(tmp_path)
    monkeypatch.setattr(client, "run", run)
    return client, asked


def test_a_query_dead_of_sigpipe_runs_again(tmp_path, monkeypatch):
    client, asked = scripted(tmp_path, monkeypatch, ["kill -PIPE $$", "echo JobState=RUNNING"])
    assert client.idempotent("scontrol", "show", "job", "7").stdout == "JobState=RUNNING\n"
    assert asked == ["scontrol", "scontrol"]


def test_a_query_that_fails_otherwise_is_not_run_again(tmp_path, monkeypatch):
    client, asked = scripted(tmp_path, monkeypatch, ["echo 'Invalid job id' >&2; exit 1"])
    with pytest.raises(AssertionError, match="Invalid job id"):
        client.idempotent("scontrol", "show", "job", "7")
    assert asked == ["scontrol"]


def test_a_submission_dead_of_sigpipe_is_looked_up_before_it_runs_again(tmp_path, monkeypatch):
    client, asked = scripted(tmp_path, monkeypatch, ["kill -PIPE $$", "true", "echo '12;test'"])
    assert client.submit("job.sh") == "12"
    assert asked == ["sbatch", "squeue", "sbatch"]
    client, asked = scripted(tmp_path, monkeypatch, ["kill -PIPE $$", "echo 11"])
    assert client.submit("job.sh") == "11"
    assert asked == ["sbatch", "squeue"]


def test_srun_without_an_mpi_plugin_is_refused(tmp_path, slurm):
    solver = write_solver(tmp_path, "SGD")
    result = slurm.run("srun", "-K", "--mpi=none", "-n", 2, sys.executable, "-m", "mpi4py",
                       "-m", "syncsgd.cli", "train", "--solver", solver, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("the launcher started 2 processes, but MPI sees this one alone") == 2, \
        output[-3000:]
    assert "--mpi=pmi2" in output and "Iteration" not in output
    assert not list(tmp_path.glob("snap_iter_*"))


def test_a_preempted_batch_job_requeues_and_ends_with_the_uninterrupted_weights(tmp_path,
                                                                              slurm, openmpi):
    """With Open MPI, the MPI of most clusters."""
    python = openmpi[1]
    straight = write_long_solver(tmp_path / "straight")
    srun(slurm, "openmpi", python, "-m", "syncsgd.cli", "train", "--solver", straight,
         "--iterations", ITERATIONS)
    folder = tmp_path / "preempted"
    solver = write_long_solver(folder)
    output = folder / "job.out"
    script = folder / "job.sh"
    script.write_text(JOB.format(output=output, python=python, solver=solver,
                                 iterations=ITERATIONS))
    job = slurm.submit(script)
    wait(lambda: output.exists() and "Iteration 20," in output.read_text(), "training",
         output)
    ranks = training_pids(slurm, job)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        slurm.submit("--partition=urgent", "--ntasks=2", f"--output={folder}/urgent.out",
                     "--wrap=true")
        wait(lambda: job_fields(slurm, job)["PreemptTime"] != "None", "the preemption", output)
    finally:
        for pid in ranks:          # Slurm sends SIGCONT with its SIGTERM; here if it did not
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def requeued():
        state = job_state(slurm, job)
        assert state != ("COMPLETED", 0), f"trained to the end before the preemption reached " \
                                          f"it:\n{output.read_text()[-3000:]}"
        return state == ("PENDING", 1)
    wait(requeued, "the preempted job's requeue", output)
    slurm.idempotent("scontrol", "update", f"jobid={job}", "StartTime=now")   # not 2 minutes later
    wait(lambda: job_state(slurm, job)[0] == "COMPLETED", "the requeued job's end", output)

    log = output.read_text()
    stopped = MESSAGE.search(log)
    assert stopped, log[-3000:]
    assert f"--auto-resume: resuming from {stopped.group(2)}" in log
    assert "Optimization Done." in log
    assert_identical(weights(folder, ITERATIONS), weights(tmp_path / "straight", ITERATIONS))


def job_fields(slurm, job):
    """`scontrol show job`'s fields of a job, {name: value}."""
    text = slurm.idempotent("scontrol", "show", "job", "-o", job).stdout
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def job_state(slurm, job):
    """(JobState, Restarts) of a job."""
    fields = job_fields(slurm, job)
    return fields["JobState"], int(fields["Restarts"])


def training_pids(slurm, job):
    """The PIDs of the job's training ranks (this host's processes Slurm lists for the job that
    run syncsgd.cli), two of them."""
    def ranks():
        listed = slurm.idempotent("scontrol", "listpids", job, slurm.NODE).stdout
        found = []
        for line in listed.split("\n")[1:]:
            if not line.split():
                continue
            pid = int(line.split()[0])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if b"syncsgd.cli" in words:
                found.append(pid)
        return found
    deadline = time.monotonic() + 30
    while len(found := ranks()) < 2:
        assert time.monotonic() < deadline, f"job {job}'s ranks not found: {found}"
        time.sleep(0.2)
    return found


def wait(ready, what, output, timeout=120):
    """Until `ready()`, which may fail the test at once."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            log = output.read_text() if output.exists() else "(no output yet)"
            raise AssertionError(f"waited {timeout} s for {what}:\n{log[-3000:]}")
        time.sleep(0.1)
