"""BVLC Caffe's own pycaffe tests (tests/bvlc_pycaffe/, vendored with only their imports changed)
pass on syncsgd, with lanes on and off.

The suite runs in a child pytest rooted at its own folder: its modules share names with ours
(test_net_spec.py), test_solver.py imports test_net as a top-level module, and an engine crash
(a segfault) then fails this test with the child's stack instead of ending our whole run."""
import os
import re

import pytest

from tests import child_pytest
from tests.paths import TESTS

SUITE = TESTS / "bvlc_pycaffe" / "python" / "caffe" / "test"
EXPECTED_PASSED = 51      # every test of the nine modules
TIMEOUT = 300


def passed_count(stdout):
    """The number of passed tests on pytest's final summary line ("1 failed, 50 passed in 9.1s"),
    or None without one (the child crashed)."""
    summaries = [line for line in stdout.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", line)]
    found = re.search(r"(\d+) passed", summaries[-1]) if summaries else None
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["lanes-on", "lanes-off"])
def test_bvlc_pycaffe_suite_passes(lanes, tmp_path):
    # -c /dev/null, --rootdir and --confcutdir: neither our pyproject.toml nor our conftest.py
    # applies to the child, which sees the suite as it is in Caffe's tree. -ra, not -rA: the
    # passed tests' logs (180 KB) would push the failures' tracebacks out of the report's tail.
    # It runs in tmp_path: test_solver.py's snapshot writes there (with syncsgd's .sha256 files,
    # which the test does not remove), not into the repository.
    # numpy's random state is seeded before each test (plugins/seeded_numpy.py).
    args = ["-ra", "-c", os.devnull, "--rootdir", str(SUITE), "--confcutdir", str(SUITE),
            "-p", "seeded_numpy", str(SUITE)]
    path = os.pathsep.join(filter(None, [str(TESTS / "plugins"), os.environ.get("PYTHONPATH")]))
    code, stdout, report = child_pytest.run(
        args, dict(os.environ, SYNCSGD_LANES=lanes, PYTHONPATH=path), tmp_path, TIMEOUT,
        f"SYNCSGD_LANES={lanes}")
    assert code == 0, report
    assert passed_count(stdout) == EXPECTED_PASSED, report
