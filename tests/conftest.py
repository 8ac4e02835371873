"""Fixtures shared by several test files, and the session check of SYNCSGD_REQUIRE_ONEDNN."""
import os
import shutil
import tempfile

import pytest

from syncsgd import TRAIN
from syncsgd.blob import Blob
from tests.gradcheck import make_layer

# BVLC Caffe's own tests run in a pytest process of their own, from tests/test_bvlc_pycaffe.py.
collect_ignore = ["bvlc_pycaffe"]


@pytest.fixture
def layer_factory():
    """Set-up data layers from LayerParameter text, as rank `rank` of `size`; all are closed at
    the end of the test (their prefetch threads stop)."""
    made = []

    def make(text, rank=0, size=1, phase=TRAIN, seed=1701, tops=("data", "label")):
        layer = make_layer(text, phase, seed)
        layer.ctx.rank, layer.ctx.size = rank, size
        top = [Blob(name=t) for t in tops]
        layer.setup([], top)
        layer.reshape([], top)
        made.append(layer)
        return layer, top

    yield make
    for layer in made:
        layer.close()


def pytest_sessionstart(session):
    """The suite (and the jobs it launches) sees no calibration cache of the developer's: the
    default layout of fully connected layers comes from the shipped cluster file.

    With SYNCSGD_REQUIRE_ONEDNN=1 (CI, where libgomp.so.1 exists) a oneDNN that does not load
    ends the run before any test: the default engine's tests would pass on the GEMM kernels.

    Kernels follow the fixed rules (SYNCSGD_KERNELS=rules): timing them for every new shape
    would take much of the suite's time (a zoo net's set-up from 0.5 s to 18 s) and make what
    runs depend on the machine's load; tests/test_kernel_choice.py runs the timed choice."""
    session.config.cache_home = tempfile.mkdtemp(prefix="syncsgd-test-cache-")
    os.environ["XDG_CACHE_HOME"] = session.config.cache_home
    os.environ["SYNCSGD_KERNELS"] = "rules"
    os.environ.pop("SYNCSGD_CLUSTER", None)
    if os.environ.get("SYNCSGD_REQUIRE_ONEDNN") == "1":
        from syncsgd.kernels import onednn
        try:
            onednn.library()
        except onednn.Required as e:
            pytest.exit(str(e), returncode=1)


@pytest.fixture
def thread_budget(monkeypatch):
    """set(count): the kernels see a thread budget of `count` (None: the one the test started
    with) until the end of the test."""
    from syncsgd.kernels.threads import BUDGET
    before = BUDGET.count

    def set_count(count):
        monkeypatch.setattr(BUDGET, "count", before if count is None else count)
    return set_count


@pytest.fixture(scope="session")
def openmpi():
    """(mpirun, python): Open MPI's launcher and a Python whose mpi4py is built against it,
    installed once where absent (tests/cluster.py); the tests skip, saying why, where they
    cannot be."""
    import cluster
    try:
        return cluster.openmpi()
    except cluster.Unavailable as e:
        pytest.skip(f"Open MPI: {e}")


def pytest_sessionfinish(session):
    shutil.rmtree(getattr(session.config, "cache_home", ""), ignore_errors=True)
