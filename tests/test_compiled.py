"""Compiled kernels (kernels/compiled.py): Numba loads without bringing a second BLAS into the
process, leaves SciPy importable, and SYNCSGD_NUMBA=0 turns it off."""
import subprocess
import sys

import pytest

from syncsgd.kernels import compiled

PROBE = """
import numpy as np
from threadpoolctl import threadpool_info
from syncsgd.kernels import lrn
x = np.ones((1, 8, 16), np.float32)
y, s = np.empty_like(x), np.empty_like(x)
lrn.forward(x, y, s, 5, np.float32(1), np.float32(1), np.float32(0.75))
blas = [lib["filepath"] for lib in threadpool_info() if lib["user_api"] == "blas"]
print(len(blas))
try:
    import scipy.linalg
    scipy.linalg.blas.sdot(np.ones(3, np.float32), np.ones(3, np.float32))
    print("scipy")
except ImportError:
    print("none")
"""


def test_a_compiled_kernel_loads_no_second_blas():
    if not compiled.available():
        pytest.fail("Numba does not import: it is a dependency (pyproject.toml)")
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    count, scipy = result.stdout.split()[-2:]
    assert count == "1", result.stdout
    assert scipy in ("scipy", "none")


def test_the_switch_turns_compiled_kernels_off(monkeypatch):
    monkeypatch.setenv("SYNCSGD_NUMBA", "0")
    assert not compiled.available() and compiled.version() is None
    monkeypatch.setenv("SYNCSGD_NUMBA", "1")
    assert compiled.available() and compiled.version()
