"""SIGINT and SIGHUP sent to any one rank act on the whole job as they do on one process (Caffe's
-sigint_effect / -sighup_effect): every rank stops or snapshots at the same iteration, the job
exits as Caffe does, and nothing hangs. Each job is `mpiexec -n N python -m mpi4py -m
syncsgd.cli train ...` with every wait bounded."""
import os
import signal
import time

import pytest

import mpijob
import mpirun

pytestmark = pytest.mark.mpi

NET = mpijob.SMALL_NET

ENDS = 30          # seconds a job may take to end once asked


def write_solver(tmp_path, settings="test_iter: 2 test_interval: 1000000 "
                                    "test_initialization: false"):
    (tmp_path / "net.prototxt").write_text(NET)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt" base_lr: 0.01 lr_policy: "fixed" '
                    f'max_iter: 100000000 display: 10 random_seed: 1 {settings} '
                    f'snapshot_prefix: "{tmp_path}/snap" distributed_param {{ stall_timeout: 20 }}')
    return path


@pytest.fixture
def train(tmp_path):
    """Start `syncsgd train` on n ranks; every job is cleaned up at the end of the test."""
    jobs = []

    def start(n, *flags, solver=None):
        job = mpijob.Job(n, "-m", "syncsgd.cli", "train", "--solver",
                         solver or write_solver(tmp_path), *flags)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()


def states(tmp_path):
    return sorted((p for p in os.listdir(tmp_path) if p.endswith(".solverstate")),
                  key=lambda p: int(p.split("_iter_")[1].split(".")[0]))


def assert_ends_cleanly(job, started):
    status = job.wait(ENDS)
    output = job.output
    assert status is not None, f"the job did not end within {ENDS} s:\n{output[-3000:]}"
    assert status == 0, output[-3000:]
    assert time.monotonic() - started < ENDS
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "Optimization stopped early." in output
    return output


@pytest.mark.parametrize("n,rank", [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)])
def test_sigint_on_any_rank_stops_every_rank_with_a_snapshot(tmp_path, train, n, rank):
    job = train(n)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    started = time.monotonic()
    job.signal(rank, signal.SIGINT)
    output = assert_ends_cleanly(job, started)
    assert len(states(tmp_path)) == 1, states(tmp_path)
    assert output.count("Snapshotting solver state") == 1


def test_the_stop_snapshot_resumes_on_other_ranks(tmp_path, train):
    job = train(2)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.signal(1, signal.SIGINT)
    assert_ends_cleanly(job, time.monotonic())
    state = states(tmp_path)[0]
    stopped = int(state.split("_iter_")[1].split(".")[0])
    result = mpirun.run(4, "-m", "syncsgd.cli", "train", "--solver", write_solver(tmp_path),
                        "--snapshot", tmp_path / state, "--iterations", stopped + 3, timeout=120)
    assert "Optimization Done." in result.stderr + result.stdout
    assert states(tmp_path)[-1] == f"snap_iter_{stopped + 3}.solverstate"


@pytest.mark.parametrize("n,rank,snap,stop,flags", [
    (2, 0, signal.SIGHUP, signal.SIGINT, ()),
    (2, 1, signal.SIGHUP, signal.SIGINT, ()),
    (4, 2, signal.SIGHUP, signal.SIGINT, ()),
    (2, 1, signal.SIGINT, signal.SIGHUP,
     ("--sigint_effect", "snapshot", "--sighup_effect", "stop")),
])
def test_snapshot_signal_on_any_rank_snapshots_and_training_goes_on(tmp_path, train, n, rank,
                                                                    snap, stop, flags):
    job = train(n, *flags)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.signal(rank, snap)
    assert job.wait_for("Snapshotting solver state", ENDS), job.output[-3000:]
    iterations = job.output.count("Iteration ")
    assert job.wait_for("Iteration ", ENDS, count=iterations + 3), job.output[-3000:]
    assert len(states(tmp_path)) == 1
    started = time.monotonic()
    job.signal(n - 1 - rank, stop)                # the stop comes from another rank
    assert_ends_cleanly(job, started)
    assert len(states(tmp_path)) == 2


@pytest.mark.parametrize("n,rank", [(1, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("effect", ["stop", "snapshot"])
def test_signal_during_a_test_pass(tmp_path, train, n, rank, effect):
    """A test pass that would run for ever: SIGINT stops it ("Test interrupted.") and the run;
    SIGHUP snapshots in the middle of it and the pass goes on."""
    solver = write_solver(tmp_path, "test_iter: 100000000 test_interval: 1000 "
                                    "test_initialization: true")
    job = train(n, solver=solver)
    assert job.wait_for("Testing net (#0)"), job.output[-3000:]
    time.sleep(0.5)
    started = time.monotonic()
    if effect == "snapshot":
        job.signal(rank, signal.SIGHUP)
        assert job.wait_for("Snapshotting solver state", ENDS), job.output[-3000:]
        assert job.wait(2) is None and "Test interrupted." not in job.output
        assert states(tmp_path) == ["snap_iter_0.solverstate"]
        started = time.monotonic()
    job.signal(rank, signal.SIGINT)
    output = assert_ends_cleanly(job, started)
    assert "Test interrupted." in output
    assert "Test net output" not in output
    assert states(tmp_path) == ["snap_iter_0.solverstate"]


@pytest.mark.parametrize("n,rank", [(1, 0), (2, 1), (2, 0)])
def test_effect_none_ignores_the_signal_without_a_traceback(tmp_path, train, n, rank):
    job = train(n, "--sigint_effect", "none", "--sighup_effect", "stop")
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.signal(rank, signal.SIGINT)
    iterations = job.output.count("Iteration ")
    assert job.wait_for("Iteration ", ENDS, count=iterations + 5), job.output[-3000:]
    assert job.wait(0.5) is None
    assert not states(tmp_path)
    started = time.monotonic()
    job.signal(rank, signal.SIGHUP)
    assert_ends_cleanly(job, started)
    assert len(states(tmp_path)) == 1


def test_ctrl_c_to_the_launcher_stops_every_rank(tmp_path, train):
    """Ctrl-C in a terminal reaches mpiexec, which hands SIGINT to every rank."""
    job = train(2)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.rank_pids()
    started = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    assert_ends_cleanly(job, started)
    assert len(states(tmp_path)) == 1
