"""Snapshot faults: a snapshot_prefix belongs to one run, a resumed state pairs only with the
weights written with it, an unwritable prefix stops the run at start-up, and a run that could save
none of its snapshots does not end as a success."""
import io
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import log, weights
from syncsgd.errors import SnapshotError, WeightsError
from syncsgd.proto import pb
from syncsgd.solvers import lock as prefix_lock
from syncsgd.solvers.lock import PrefixLock, lock_path
from syncsgd.solvers.snapshot import read_state
from tests import mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NET = """
layer { name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 8 dim: 6 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture(autouse=True)
def captured_log():
    """syncsgd's log lines of the test, in a string; the logger is put back afterwards."""
    logger = log.LOGGER
    saved = (list(logger.handlers), logger.level, logger.propagate)
    stream = io.StringIO()
    log.configure(stream=stream)
    yield stream
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def write_solver(directory, settings="max_iter: 4", prefix=None, seed=1):
    net = directory / "net.prototxt"
    net.write_text(NET)
    prefix = prefix or f"{directory}/snap"
    solver = directory / f"solver{seed}.prototxt"
    solver.write_text(f'net: "{net}" type: "SGD" base_lr: 0.1 lr_policy: "fixed" display: 0 '
                      f'random_seed: {seed} snapshot_prefix: "{prefix}" {settings}')
    return str(solver)


def train_cli(solver, *flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", "--solver", solver,
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def error_line(result):
    """The one error line a failed command printed (and nothing like a traceback)."""
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def pb_param(directory, settings):
    param = text_format.Parse(f'type: "SGD" base_lr: 0.1 lr_policy: "fixed" display: 0 '
                              f'random_seed: 1 snapshot_prefix: "{directory}/snap" {settings}',
                              pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(NET, pb.NetParameter()))
    return param


# -- one run per prefix ---------------------------------------------------------------------------

def test_second_run_on_a_prefix_fails_at_start_up_and_the_first_is_unharmed(tmp_path):
    solver = write_solver(tmp_path, "max_iter: 6 snapshot: 3")
    first = syncsgd.get_solver(solver)
    lock = lock_path(f"{tmp_path}/snap")
    owner = pathlib.Path(lock).read_text().split()
    assert owner[:2] == [socket.gethostname(), str(os.getpid())]
    first.step(2)
    before = sorted(os.listdir(tmp_path))

    line = error_line(train_cli(solver))
    assert lock in line and f"pid {os.getpid()}" in line and "another snapshot_prefix" in line
    assert sorted(os.listdir(tmp_path)) == before        # the second run wrote nothing

    first.solve()
    first.close()
    assert not os.path.exists(lock)
    for k in (3, 6):
        assert weights.verify_checksum(f"{tmp_path}/snap_iter_{k}.caffemodel")
        assert weights.verify_checksum(f"{tmp_path}/snap_iter_{k}.solverstate")
    resumed = syncsgd.get_solver(solver)
    resumed.restore(f"{tmp_path}/snap_iter_6.solverstate")
    assert resumed.iter == 6
    resumed.close()
    assert train_cli(solver, "--iterations", "1").returncode == 0   # the prefix is free again


def finished_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


@pytest.mark.parametrize("owner", ["ended", "recycled pid"])
def test_stale_lock_is_taken_over_with_a_log_line(tmp_path, owner, captured_log):
    path = lock_path(f"{tmp_path}/snap")
    # A process that has ended; or a live pid whose start time is not the lock owner's.
    if owner == "ended":
        pid, started = finished_pid(), "1"
    else:
        pid = os.getppid()
        started = str(int(prefix_lock._start_time(pid)) + 1)
    with open(path, "w") as f:
        f.write(f"{socket.gethostname()} {pid} {started}\n")
    solver = syncsgd.get_solver(write_solver(tmp_path))
    assert f"Taking over the stale snapshot lock {path} of pid {pid}" in captured_log.getvalue()
    assert pathlib.Path(path).read_text().split()[1] == str(os.getpid())
    solver.close()
    assert not os.path.exists(path)


def test_lock_of_another_host_is_refused_naming_it(tmp_path):
    lock = lock_path(f"{tmp_path}/snap")
    with open(lock, "w") as f:
        f.write("other-node 4242 12345\n")
    with pytest.raises(SnapshotError, match=rf"{lock}: snapshot_prefix is in use by pid 4242 on "
                                            r"host other-node; .*delete the lock file"):
        syncsgd.get_solver(write_solver(tmp_path))
    assert pathlib.Path(lock).read_text() == "other-node 4242 12345\n"


def test_a_run_that_plans_no_snapshot_takes_the_prefix_at_its_first(tmp_path):
    """snapshot: 0 and no snapshot after training: no lock at start-up; a snapshot asked for
    (solver.snapshot(), a signal) while another run owns the prefix fails like a full disk."""
    settings = "snapshot: 0 snapshot_after_train: false"
    quiet = syncsgd.get_solver(write_solver(tmp_path, settings))
    assert not os.path.exists(lock_path(f"{tmp_path}/snap"))
    with open(lock_path(f"{tmp_path}/snap"), "w") as f:
        f.write(f"{socket.gethostname()} {os.getppid()} -\n")     # a live run's lock
    assert quiet.snapshot() is None
    assert quiet.failed_snapshot[2].endswith("give this run another snapshot_prefix")
    assert not [f for f in os.listdir(tmp_path) if "_iter_" in f]
    quiet.close()


# -- a state pairs with its weights ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_weights_of_another_run_are_refused_on_resume(tmp_path, fmt):
    runs = []
    for seed in (1, 2):
        directory = tmp_path / f"run{seed}"
        directory.mkdir()
        solver = syncsgd.get_solver(write_solver(directory, f"snapshot_format: {fmt}", seed=seed))
        solver.step(2)
        runs.append(solver.snapshot())
        solver.close()
    (model_a, state_a), (model_b, _) = runs
    assert read_state(state_a).learned_net_sha256 == weights.file_sha256(model_a)
    for suffix in ("", ".sha256"):                    # B's weights, with B's intact record
        os.replace(model_b + suffix, model_a + suffix)
    assert weights.verify_checksum(model_a)
    fresh = syncsgd.get_solver(write_solver(tmp_path / "run1", f"snapshot_format: {fmt}"))
    with pytest.raises(WeightsError) as failure:
        fresh.restore(state_a)
    message = str(failure.value)
    assert "\n" not in message and state_a in message and model_a in message
    assert "different runs" in message
    fresh.close()


def test_state_without_the_digest_still_resumes_with_a_log_line(tmp_path, captured_log):
    solver = syncsgd.get_solver(write_solver(tmp_path))
    solver.step(3)
    _, state = solver.snapshot()
    expected = [p.blob.data.copy() for p in solver.net.learnable_params]
    solver.close()
    proto = pb.SolverState()
    proto.ParseFromString(pathlib.Path(state).read_bytes())
    proto.ClearField("learned_net_sha256")            # as Caffe writes it
    with open(state, "wb") as f:
        f.write(proto.SerializeToString())
    os.remove(state + ".sha256")
    fresh = syncsgd.get_solver(write_solver(tmp_path))
    fresh.restore(state)
    assert fresh.iter == 3
    for value, p in zip(expected, fresh.net.learnable_params):
        assert (p.blob.data == value).all()
    assert f"{state} records no digest of its weights" in captured_log.getvalue()
    fresh.close()


# -- an unwritable prefix stops the run at start-up ------------------------------------------------

def test_prefix_under_a_regular_file_fails_at_start_up(tmp_path):
    (tmp_path / "file").write_text("")
    prefix = f"{tmp_path}/file/snap"
    solver = write_solver(tmp_path, prefix=prefix)
    with pytest.raises(SnapshotError, match=rf"cannot write snapshots to snapshot_prefix "
                                            rf"'{prefix}': .*Not a directory"):
        syncsgd.get_solver(solver)
    line = error_line(train_cli(solver))
    assert prefix in line and "Not a directory" in line and "writable" in line


@pytest.fixture
def read_only_directory(tmp_path):
    """A read-only tmpfs (root ignores permission bits, not a read-only mount)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs",
                           str(directory)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.decode().strip()}")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


def test_prefix_on_a_read_only_file_system_fails_at_start_up(tmp_path, read_only_directory):
    prefix = f"{read_only_directory}/snap"
    with pytest.raises(SnapshotError, match=rf"'{prefix}': .*Read-only file system"):
        syncsgd.get_solver(write_solver(tmp_path, prefix=prefix))


# -- a run that saved nothing does not succeed ----------------------------------------------------

def test_every_snapshot_failing_exits_non_zero_naming_the_path(tmp_path):
    """The lock file's name fits, every snapshot's does not (ENAMETOOLONG): each snapshot fails
    as on a full disk, training goes on, and the run ends with an error instead of Done."""
    prefix = f"{tmp_path}/{'p' * 240}"
    result = train_cli(write_solver(tmp_path, "max_iter: 4 snapshot: 2", prefix=prefix))
    line = error_line(result)
    assert "every snapshot of this run failed, the last at iteration 4" in line
    assert f"{prefix}_iter_4.caffemodel" in line and "nothing was saved" in line
    assert "Optimization Done." not in result.stdout + result.stderr
    assert (result.stdout + result.stderr).count("Snapshot at iteration") == 2


def test_solve_raises_when_every_snapshot_failed_but_not_after_one_succeeded(
        tmp_path, monkeypatch, captured_log):
    def full(path, data):
        raise OSError(28, "No space left on device")
    solver = syncsgd.get_solver(pb_param(tmp_path, "max_iter: 4 snapshot: 2"))
    real = weights._write_bytes
    monkeypatch.setattr(weights, "_write_bytes", full)
    with pytest.raises(SnapshotError, match=r"last at iteration 4 \(.*snap_iter_4.caffemodel: No "
                                            r"space left on device\); nothing was saved"):
        solver.solve()
    assert "Optimization Done." not in captured_log.getvalue()
    solver.close()

    monkeypatch.setattr(weights, "_write_bytes", real)
    solver = syncsgd.get_solver(pb_param(tmp_path, "max_iter: 4 snapshot: 2"))
    solver.step(2)                                    # snap_iter_2 is saved
    monkeypatch.setattr(weights, "_write_bytes", full)
    solver.solve()                                    # the last fails: the earlier one remains
    assert solver.last_snapshot.endswith("snap_iter_2.solverstate")
    assert captured_log.getvalue().rstrip().endswith("Optimization Done.")
    solver.close()


# -- two ranks ------------------------------------------------------------------------------------

API_SCRIPT = textwrap.dedent("""
    import sys
    import syncsgd
    from syncsgd.errors import SnapshotError
    from syncsgd.parallel import world
    try:
        syncsgd.get_solver(sys.argv[1])
    except SnapshotError as e:
        print(f"rank {world().rank} refused: {e}", flush=True)
""")


def test_lock_failure_on_two_ranks_ends_every_rank(tmp_path):
    """Rank 0 finds the prefix taken (by this test process); the error reaches rank 1 too:
    from Python each rank raises it, and the command line exits non-zero, naming the lock."""
    solver = write_solver(tmp_path)
    owner = PrefixLock(f"{tmp_path}/snap")
    owner.acquire()
    lock = lock_path(f"{tmp_path}/snap")
    try:
        script = tmp_path / "get_solver.py"
        script.write_text(API_SCRIPT)
        result = mpirun.run(2, script, solver, timeout=120)
        for rank in (0, 1):
            assert f"rank {rank} refused: {lock}: snapshot_prefix is in use" in result.stdout
        failed = mpirun.run(2, "-m", "syncsgd.cli", "train", "--solver", solver, timeout=120,
                            check=False)
        assert failed.returncode != 0
        assert f"syncsgd train: error: {lock}: snapshot_prefix is in use by a running job " \
               f"(pid {os.getpid()}" in failed.stderr
        assert "Traceback" not in failed.stderr
    finally:
        owner.release()
    assert not os.path.exists(lock)
