"""A job sent SIGTERM (what Slurm sends before it kills a job it preempts, cancels or ends at its
time limit) acts on every rank as SIGINT and SIGHUP do: by default it snapshots at the next
iteration boundary and exits with status 143 and one line naming the snapshot, and the same
command with --auto-resume continues from the newest intact snapshot of the prefix, ending with
the very weights of a run never interrupted. -sigterm_effect stop ends without a snapshot, none
ignores SIGTERM. Jobs are `mpiexec -n N python -m mpi4py -m syncsgd.cli train ...` (the
mpich wheel); Slurm itself preempts one in test_slurm.py."""
import re
import shutil
import signal

import numpy as np
import pytest

import mpijob
import mpirun
import syncsgd

pytestmark = pytest.mark.mpi

ENDS = 30           # seconds a job may take to end once signalled
# SIGTERM sent once iteration 20 is logged has landed by iteration 35 in runs here (some 200
# iterations a second on 2 ranks), well before MAX_ITER.
NET = """
name: "preempted"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 32 dim: 3 dim: 24 dim: 24 } shape { dim: 32 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 3.99 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 16 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""
MAX_ITER = 200
MESSAGE = re.compile(r"^syncsgd train: SIGTERM: training ended at iteration (\d+); the last "
                     r"snapshot is (\S+); run the same command with --auto-resume to continue$",
                     re.M)


def write_solver(folder, settings=""):
    """A solver whose files all live in `folder`: its snapshots are that run's alone."""
    folder.mkdir(exist_ok=True)
    (folder / "net.prototxt").write_text(NET)
    path = folder / "solver.prototxt"
    path.write_text(f'net: "{folder}/net.prototxt" type: "SGD" base_lr: 0.01 momentum: 0.9 '
                    f'lr_policy: "fixed" max_iter: {MAX_ITER} display: 10 random_seed: 1 '
                    f'snapshot_prefix: "{folder}/snap" {settings}')
    return path


def train(n, solver, *flags, check=True):
    """`syncsgd train` on n ranks, to its end."""
    return mpirun.run(n, "-m", "syncsgd.cli", "train", "--solver", solver, *flags, timeout=120,
                      check=check)


def weights(folder, iteration=MAX_ITER):
    net = syncsgd.Net(str(folder / "net.prototxt"), syncsgd.TEST,
                      weights=str(folder / f"snap_iter_{iteration}.caffemodel"))
    return {f"{name}/{i}": blob.data.copy() for name, blobs in net.params.items()
            for i, blob in enumerate(blobs)}


def assert_identical(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert np.array_equal(a[key], b[key]), \
            f"{key}: differs by up to {np.abs(a[key] - b[key]).max():.3g}"


def states(folder):
    return sorted(p.name for p in folder.glob("snap_iter_*.solverstate"))


@pytest.fixture
def start(tmp_path):
    """Start `syncsgd train` on n ranks in the background; every job is cleaned up after."""
    jobs = []

    def start_job(n, solver, *flags):
        job = mpijob.Job(n, "-m", "syncsgd.cli", "train", "--solver", solver, *flags)
        jobs.append(job)
        return job

    yield start_job
    for job in jobs:
        job.cleanup()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{n: final weights} of runs on n ranks that nothing interrupts."""
    runs = {}

    def final(n):
        if n not in runs:
            folder = tmp_path_factory.mktemp(f"uninterrupted{n}")
            train(n, write_solver(folder))
            runs[n] = weights(folder)
        return runs[n]
    return final


def terminate(job, ranks, sig=signal.SIGTERM):
    """Send `sig` to `ranks` once training is under way; the job's status and output."""
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.rank_pids()
    for rank in ranks:
        job.signal(rank, sig)
    status = job.wait(ENDS)
    assert status is not None, f"the job still runs {ENDS} s after SIGTERM:\n{job.output[-3000:]}"
    return status, job.output


@pytest.mark.parametrize("n,ranks", [(1, [0]), (2, [1]), (2, [0, 1])],
                         ids=["one process", "one rank of 2", "every rank of 2"])
def test_sigterm_snapshots_and_the_resumed_run_ends_with_the_uninterrupted_weights(
        tmp_path, start, uninterrupted, n, ranks):
    solver = write_solver(tmp_path)
    status, output = terminate(start(n, solver), ranks)
    assert status == 143, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = MESSAGE.findall(output)
    assert len(lines) == 1, output[-3000:]            # one line, from rank 0
    stopped, snapshot = int(lines[0][0]), lines[0][1]
    assert 20 < stopped < MAX_ITER
    assert states(tmp_path) == [f"snap_iter_{stopped}.solverstate"]
    assert snapshot == str(tmp_path / f"snap_iter_{stopped}.solverstate")

    resumed = train(n, solver, "--auto-resume")
    assert f"--auto-resume: resuming from {snapshot}" in resumed.stderr
    assert "Optimization Done." in resumed.stderr
    assert_identical(weights(tmp_path), uninterrupted(n))


def test_sigterm_during_a_test_pass_snapshots_and_ends(tmp_path, start):
    solver = write_solver(tmp_path, "test_iter: 100000000 test_interval: 1000 "
                                    "test_initialization: true")
    job = start(2, solver)
    assert job.wait_for("Testing net (#0)"), job.output[-3000:]
    job.rank_pids()
    job.signal(1, signal.SIGTERM)
    assert job.wait(ENDS) == 143, job.output[-3000:]
    assert "Test interrupted." in job.output
    assert states(tmp_path) == ["snap_iter_0.solverstate"]


def test_effect_stop_ends_without_a_snapshot(tmp_path, start):
    status, output = terminate(start(2, write_solver(tmp_path), "--sigterm_effect", "stop"),
                               [0])
    assert status == 143, output[-3000:]
    assert MESSAGE.search(output).group(2) == "none", output[-3000:]
    assert states(tmp_path) == []


def test_effect_none_ignores_sigterm(tmp_path, start):
    job = start(2, write_solver(tmp_path), "--sigterm_effect", "none", "--iterations", 100000)
    assert job.wait_for("Iteration 20,"), job.output[-3000:]
    job.rank_pids()
    job.signal(1, signal.SIGTERM)
    iterations = job.output.count("Iteration ")
    assert job.wait_for("Iteration ", ENDS, count=iterations + 5), job.output[-3000:]
    assert job.wait(0.5) is None and states(tmp_path) == []
    job.signal(1, signal.SIGINT)
    assert job.wait(ENDS) == 0, job.output[-3000:]


def test_auto_resume_takes_the_newest_intact_snapshot(tmp_path):
    """A state changed since it was written, one whose weights were, and a hidden temporary
    file (a run killed while writing) are passed over, each newer than the state taken."""
    solver = write_solver(tmp_path, "snapshot: 10")
    train(1, solver, "--iterations", 40)
    assert states(tmp_path) == [f"snap_iter_{i}.solverstate" for i in (10, 20, 30, 40)]
    with open(tmp_path / "snap_iter_40.solverstate", "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff")
    with open(tmp_path / "snap_iter_30.caffemodel", "ab") as f:
        f.write(b"\0")
    shutil.copy(tmp_path / "snap_iter_20.solverstate", tmp_path / ".snap_iter_50.solverstate.tmp7")
    result = train(1, solver, "--auto-resume", "--iterations", 25)
    log = result.stderr
    assert f"Not resuming from {tmp_path}/snap_iter_40.solverstate: " in log, log[-3000:]
    assert f"Not resuming from {tmp_path}/snap_iter_30.solverstate: " in log, log[-3000:]
    assert f"--auto-resume: resuming from {tmp_path}/snap_iter_20.solverstate" in log
    assert "Iteration 20, lr" in log and "Iteration 10, lr" not in log
    assert f"solver state to binary proto file {tmp_path}/snap_iter_25.solverstate" in log


def test_auto_resume_without_a_snapshot_starts_from_the_weights(tmp_path):
    first = write_solver(tmp_path / "first")
    train(1, first, "--iterations", 5)
    solver = write_solver(tmp_path / "second")
    pretrained = tmp_path / "first" / "snap_iter_5.caffemodel"
    result = train(1, solver, "--auto-resume", "--weights", pretrained, "--iterations", 3)
    log = result.stderr
    assert f"--auto-resume: no snapshot of {tmp_path}/second/snap to resume from" in log
    assert f"Finetuning from {pretrained}" in log
    again = train(1, solver, "--auto-resume", "--weights", pretrained, "--iterations", 6)
    assert f"resuming from {tmp_path}/second/snap_iter_3.solverstate" in again.stderr
    assert "Finetuning from" not in again.stderr
