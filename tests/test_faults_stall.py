"""A rank stopped with SIGSTOP (a hung node), rank 0 included, ends the job within a bound, named
by the others' watchdogs in every run; a pause shorter than stall_timeout is no fault. The
stopped rank is continued (SIGCONT) before anything left is killed, by PID."""
import re
import signal
import time

import numpy as np
import pytest

import mpijob

pytestmark = pytest.mark.mpi

NET = mpijob.SMALL_NET

TIMEOUT = 3        # stall_timeout of these runs
BOUND = 15         # seconds from the stop to the end of the job, oversubscribed ranks included

# Rank 0 and rank 1 of 2-rank jobs in turn, and two ranks of a 4-rank job (4 ranks share the
# 2 cores). The stop falls at a different moment of each run: training, test passes, snapshots.
RUNS = [(2, run % 2, run) for run in range(6)] + [(4, 0, 10), (4, 3, 11)]


# At the default stall_timeout (60 s), in the 90 s: 10 runs on 2 ranks, 10 on 4, the
# stopped rank in turn. About 25 minutes of mostly waiting: `python -m pytest -m slow FILE`.
DEFAULT_TIMEOUT, DEFAULT_BOUND = 60, 90
DEFAULT_RUNS = [(2, run % 2, run) for run in range(10)] + [(4, run % 4, run)
                                                          for run in range(10, 20)]


def write_solver(tmp_path, timeout=TIMEOUT):
    """timeout None: the default stall_timeout."""
    (tmp_path / "net.prototxt").write_text(NET)
    path = tmp_path / "solver.prototxt"
    watch = f"distributed_param {{ stall_timeout: {timeout} }}" if timeout is not None else ""
    path.write_text(f'net: "{tmp_path}/net.prototxt" base_lr: 0.01 lr_policy: "fixed" '
                    f'max_iter: 100000000 display: 10 random_seed: 1 test_iter: 30 '
                    f'test_interval: 60 snapshot: 45 snapshot_prefix: "{tmp_path}/snap" {watch}')
    return path


@pytest.fixture
def train(tmp_path):
    jobs = []

    def start(n, timeout=TIMEOUT):
        job = mpijob.Job(n, "-m", "syncsgd.cli", "train", "--solver",
                         write_solver(tmp_path, timeout))
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()


@pytest.mark.parametrize("n,rank,run", RUNS)
def test_a_stopped_rank_is_named_and_ends_the_job(train, n, rank, run):
    stop_and_watch(train(n), rank, run, TIMEOUT, BOUND)


@pytest.mark.slow
@pytest.mark.parametrize("n,rank,run", DEFAULT_RUNS)
def test_at_the_default_timeout_a_stopped_rank_ends_the_job_in_90_s(train, n, rank, run):
    stop_and_watch(train(n, timeout=None), rank, run, DEFAULT_TIMEOUT, DEFAULT_BOUND)


def stop_and_watch(job, rank, run, timeout, bound):
    """Stop `rank` a little after iteration 20; the job must end within `bound` seconds, not
    before `timeout`, with the others' watchdog naming that rank alone."""
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.rank_pids()
    time.sleep(np.random.default_rng(run).uniform(0, 1.0))
    stopped = time.monotonic()
    job.signal(rank, signal.SIGSTOP)
    status = job.wait(bound)
    elapsed = time.monotonic() - stopped
    output = job.output
    assert status is not None, f"rank {rank} stopped: the job still runs after {bound} s"
    assert status != 0
    named = re.findall(r"rank\(s\) ([\d, ]+) stopped responding", output)
    assert named, f"status {status} after {elapsed:.1f} s: {output[-1500:]}"
    assert set(named) == {str(rank)}, output[-3000:]
    assert re.search(rf"last heard: rank {rank} at iteration \d+, ", output), output[-3000:]
    assert timeout - 0.5 < elapsed < bound


def test_a_pause_shorter_than_the_timeout_is_no_fault(tmp_path, train):
    job = train(2)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.signal(1, signal.SIGSTOP)
    time.sleep(TIMEOUT / 3)
    job.signal(1, signal.SIGCONT)
    job.stopped.clear()
    iterations = job.output.count("Iteration ")
    assert job.wait_for("Iteration ", 30, count=iterations + 5), job.output[-3000:]
    time.sleep(TIMEOUT)
    assert job.wait(0.1) is None, job.output[-3000:]
    job.signal(0, signal.SIGINT)
    assert job.wait(60) == 0, job.output[-3000:]
    assert "stopped responding" not in job.output
