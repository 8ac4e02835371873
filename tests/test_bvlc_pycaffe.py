"""BVLC Caffe's own pycaffe tests (tests/bvlc_pycaffe/, vendored with only their imports changed)
pass on syncsgd, with lanes on and off.

The suite runs in a child pytest rooted at its own folder: its modules share names with ours
(test_net_spec.py), test_solver.py imports test_net as a top-level module, and an engine crash
(a segfault) then fails this test with the child's stack instead of ending our whole run."""
import os
import re
import subprocess
import sys

import pytest

from tests.paths import TESTS

SUITE = TESTS / "bvlc_pycaffe" / "python" / "caffe" / "test"
EXPECTED_PASSED = 51      # every test of the nine modules
TIMEOUT = 300
TAIL = 20000              # characters of each of the child's streams shown on failure


def tail(output):
    """The end of a child's output as text (after a timeout it is bytes, or None)."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return (output or "")[-TAIL:]


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
    command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-ra", "-c", os.devnull, "--rootdir", str(SUITE), "--confcutdir", str(SUITE),
               str(SUITE)]
    env = dict(os.environ, SYNCSGD_LANES=lanes)
    try:
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"SYNCSGD_LANES={lanes}: the suite still ran after {TIMEOUT} s\n"
                    f"--- stdout ---\n{tail(e.stdout)}\n--- stderr ---\n{tail(e.stderr)}")
    report = (f"SYNCSGD_LANES={lanes}: return code {result.returncode}\n"
              f"--- stdout ---\n{tail(result.stdout)}\n--- stderr ---\n{tail(result.stderr)}")
    assert result.returncode == 0, report
    assert passed_count(result.stdout) == EXPECTED_PASSED, report
