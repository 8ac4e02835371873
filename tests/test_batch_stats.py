"""BatchNorm's compiled passes (kernels/batch_stats.py) against numpy: row sums in float64
that do not depend on how the rows are split into blocks (threads, ranks), the normalisation
with the Scale's values and the ReLU's clamp, and a gradient masked where that clamp's output
is not above 0 (NaN included); backward from x and the mean, as the layer keeps them where its
output goes beside x, gives the bits it gives from x - mean."""
import numpy as np
import pytest

from syncsgd.kernels import batch_stats, compiled

pytestmark = pytest.mark.skipif(not compiled.available(), reason="Numba does not import")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("length", [1, 7, 49, 100, 3136])
def test_row_sums_are_float64_and_do_not_depend_on_the_blocks(length):
    x = rand(12, length) * 3 + 50
    unused = np.zeros(12, np.float32)
    sums = []
    for blocks in ([(0, 12)], [(0, 5), (5, 6), (6, 12)]):
        s, q = np.zeros(12), np.zeros(12)
        for lo, hi in blocks:
            batch_stats.sums(x, x, unused, unused, unused, False, lo, hi, s, q)
        sums.append((s, q))
    np.testing.assert_array_equal(sums[0][0], sums[1][0])
    np.testing.assert_array_equal(sums[0][1], sums[1][1])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(sums[0][0], x64.sum(axis=1), rtol=1e-14)
    np.testing.assert_allclose(sums[0][1], (x64 * x64).sum(axis=1), rtol=1e-14)


@pytest.mark.parametrize("relu", [False, True])
def test_normalise_then_gradient_match_numpy(relu):
    rows, length = 6, 50
    x = rand(rows, length, seed=1)
    x[2, 3] = np.nan
    mean, slope, bias = rand(rows, seed=2), rand(rows, seed=3), rand(rows, seed=4)
    zeros = np.zeros(rows, np.float32)
    y, centred = x.copy(), np.empty_like(x)
    batch_stats.normalise(y, y, centred, True, mean, slope, bias, relu, 0, rows)
    expect_c = x - mean[:, None]
    expect_y = expect_c * slope[:, None] + bias[:, None]
    if relu:
        expect_y = np.maximum(expect_y, 0)
    np.testing.assert_array_equal(centred, expect_c)
    np.testing.assert_array_equal(y, expect_y)
    beside = np.full_like(x, 7.0)
    batch_stats.normalise(x, beside, beside, False, mean, slope, bias, relu, 0, rows)
    np.testing.assert_array_equal(beside, expect_y)
    assert np.isnan(x[2, 3]) and x[0, 0] == rand(rows, length, seed=1)[0, 0]

    dy = rand(rows, length, seed=5)
    g = dy * (y > 0) if relu else dy
    g64 = g.astype(np.float64)
    finite = np.isfinite(centred).all(axis=1)
    gain, shift, tilt = rand(rows, seed=6), rand(rows, seed=7), rand(rows, seed=8)
    expect = (g * gain[:, None] - shift[:, None]) - centred * tilt[:, None]
    results = []
    for kept, kept_mean in ((centred, zeros), (x, mean)):
        s, p = np.zeros(rows), np.zeros(rows)
        batch_stats.sums(dy, kept, kept_mean, slope, bias, relu, 0, rows, s, p)
        np.testing.assert_allclose(s, g64.sum(axis=1), rtol=1e-12)
        np.testing.assert_allclose(p[finite], (g64 * centred)[finite].sum(axis=1), rtol=1e-12)
        d = dy.copy()
        batch_stats.gradient(d, kept, kept_mean, slope, bias, relu, gain, shift, tilt, 0, rows)
        np.testing.assert_array_equal(d, expect)
        results.append((s, p))
    np.testing.assert_array_equal(results[0], results[1])
