"""A pytest plugin for the vendored BVLC pycaffe suite (tests/test_bvlc_pycaffe.py): numpy's
global random state seeded before each test, so that a test drawing its data from it runs on
the same data every time. test_net's test_forward_start_end compares a float32 product with
np.dot's at atol 1e-5 on unseeded draws, and failed once in the suite on the draw that put an
output at -4.4e-4, 1.4e-5 from np.dot's (float32 sums of terms near 50 in another order)."""
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def seeded_numpy():
    np.random.seed(0)
