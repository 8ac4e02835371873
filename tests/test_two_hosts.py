"""Two hosts for real: a 2-rank job whose ranks live in two network namespaces joined by a veth
pair, MPICH over TCP between the two addresses. It trains equal to one process, and a link cut
mid-run ends it (non-zero, the unreachable rank named) with the last snapshot intact."""
import collections
import contextlib
import glob
import re
import subprocess
import time

import numpy as np
import pytest

import netns
from test_distributed import SCRIPT, assert_same, train, write_solver
from syncsgd.solvers.snapshot import read_state
from syncsgd.weights import file_sha256, verify_checksum

pytestmark = pytest.mark.mpi

CUT_LIMIT = 90          # seconds from the cut to the job's end
# Short to keep the test quick; the bound above also holds for a stall_timeout of 60 s (the
# watchdog ends the job about a second after it).
STALL_TIMEOUT = 20
RANK_GRACE = 5          # seconds the cut-off rank may outlive the job


@contextlib.contextmanager
def two_hosts():
    hosts = netns.TwoHosts()
    try:
        hosts.open()
    except netns.Unavailable as e:
        pytest.skip(f"two-host tests need network namespaces: {e}")
    try:
        yield hosts
    finally:
        hosts.close()


def finish(job, timeout):
    """The job's exit status, or None if it is still running after `timeout` seconds."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_two_namespace_job_trains_equal_to_one_process(tmp_path):
    solver = write_solver(tmp_path, "SGD")
    reference = train(1, solver, 6, tmp_path / "one.npz")
    with two_hosts() as hosts:
        received = hosts.received_bytes(1)
        job = hosts.mpiexec(SCRIPT, solver, 6, tmp_path / "two.npz", workdir=tmp_path)
        status = finish(job, 180)
        assert status == 0, f"exit {status}\n{netns.output(job)[-4000:]}"
        received = hosts.received_bytes(1) - received
    result = dict(np.load(tmp_path / "two.npz"))
    assert_same(result, reference)
    # Rank 0's gradients reached rank 1 over the link, not through shared memory.
    _, gradient_bytes = result["bytes_sent"]
    assert received >= gradient_bytes > 0


# elapsed: seconds from the cut to the job's end (None: it had not ended by CUT_LIMIT);
# survivor: rank 1 was still running RANK_GRACE s after the job ended.
Cut = collections.namedtuple("Cut", "elapsed status output folder survivor")


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A long run on two hosts whose link is cut (on rank 1's side) after its first snapshot."""
    tmp = tmp_path_factory.mktemp("cut")
    solver = write_solver(tmp, "SGD", f"snapshot: 10 distributed_param {{ stall_timeout: "
                                      f"{STALL_TIMEOUT} }}")
    with two_hosts() as hosts:
        job = hosts.mpiexec(SCRIPT, solver, 100000, tmp / "x.npz", workdir=tmp)
        deadline = time.monotonic() + 120
        while not glob.glob(str(tmp / "snap_iter_*.solverstate.sha256")):
            assert job.poll() is None, f"exit {job.poll()}\n{netns.output(job)[-4000:]}"
            assert time.monotonic() < deadline, "no snapshot within 120 s"
            time.sleep(0.1)
        hosts.set_link(1, "down")
        cut = time.monotonic()
        status = finish(job, CUT_LIMIT)
        elapsed = time.monotonic() - cut if status is not None else None
        deadline = time.monotonic() + RANK_GRACE
        while hosts.running(1, SCRIPT) and time.monotonic() < deadline:
            time.sleep(0.2)
        return Cut(elapsed, status, netns.output(job), tmp, bool(hosts.running(1, SCRIPT)))


def test_cut_link_ends_the_job_non_zero_in_time(cut_run):
    output = cut_run.output[-4000:]
    assert cut_run.elapsed is not None, f"still running {CUT_LIMIT} s after the cut\n{output}"
    assert cut_run.status != 0, output
    assert "syncsgd watchdog:" in output, output


# Rank 0's watchdog line names rank 1 alone as the one it cannot go on without.
NAMED = re.compile(r"\brank(\(s\))? 1\b(?! *,)")


def watchdog_line(output):
    """Rank 0's verdict: the launching side's, whose exit status is the job's."""
    return next((line for line in output.splitlines()
                 if line.startswith("[rank 0] syncsgd watchdog:")), "(no watchdog line)")


def test_cut_link_names_the_unreachable_rank(cut_run):
    line = watchdog_line(cut_run.output)
    assert NAMED.search(line), line


def test_cut_link_leaves_the_last_snapshot_intact(cut_run):
    tmp = cut_run.folder
    states = glob.glob(str(tmp / "snap_iter_*.solverstate"))
    assert states
    last = max(states, key=lambda p: int(re.search(r"_iter_(\d+)\.", p)[1]))
    model = last.replace(".solverstate", ".caffemodel")
    assert verify_checksum(last) and verify_checksum(model)
    assert read_state(last).learned_net_sha256 == file_sha256(model)
    # A snapshot cut short leaves no weights file without its record.
    for path in glob.glob(str(tmp / "snap_iter_*.caffemodel")):
        assert verify_checksum(path), path


def test_cut_link_ends_the_cut_off_rank_too(cut_run):
    assert not cut_run.survivor, f"rank 1 still running {RANK_GRACE} s after the job ended"
