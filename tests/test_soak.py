"""A soak run (marked slow: `pytest -m slow tests/test_soak.py`): memory, open files and threads
stay flat over a long distributed LeNet run. The full 5,000-iteration version is
`python tools/soak.py --ranks 2 --iterations 5000`."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


def test_two_rank_run_does_not_leak(tmp_path):
    subprocess.run([sys.executable, "data/digits.py"], cwd=ROOT, check=True, timeout=300)
    out = tmp_path / "soak.csv"
    subprocess.run([sys.executable, "tools/soak.py", "--ranks", "2", "--iterations", "1200",
                    "--every", "100", "--out", str(out)], cwd=ROOT, check=True, timeout=1200)
    rows = list(csv.DictReader(open(out)))
    for rank in ("0", "1"):
        mine = [r for r in rows if r["rank"] == rank]
        half = mine[len(mine) // 2:]
        rss = [float(r["rss_mib"]) for r in half]
        assert max(rss) - min(rss) < 0.05 * min(rss), rss
        assert len({r["open_fds"] for r in half}) == 1
        assert len({r["threads"] for r in half}) == 1
