"""BatchNorm's batch-statistics passes, in place, as compiled loops (kernels/compiled.py): two
passes each way where the numpy passes of layers/batch_norm.py make three, each loop reading
its operands once, with the Scale and the ReLU that follow in place folded in.

Arrays are a blob's (sample, channel) rows (kernels/rows.py), per-row values flat float32
arrays. Row sums are float64 in LANES partial sums added in a fixed order: a row's sum does not
depend on the thread or block that took it (so N ranks sum as one process does), and the
squares of float32 values are exact in float64, so the variance from one pass (sum of squares
less the squared mean) loses nothing that matters to cancellation where the mean is large.

With `relu`, the ReLU in place after the Scale: forward clamps y = centred * slope + bias at 0
as numpy's maximum does (NaN stays NaN, -0 becomes 0); backward takes the gradient where that
same float32 value, recomputed from `centred` as forward computed it, is above 0 (the ReLU's
y > 0); elsewhere, NaN included, the gradient is dy * 0 as the ReLU's is (NaN for an
infinite or NaN dy).
"""
import numpy as np

from syncsgd.kernels.compiled import kernel

LANES = 32      # partial sums a row: the widest a float64 loop vectorised to at full speed

_ZERO = np.float32(0)


@kernel
def sums(a, b, centred, slope, bias, relu, lo, hi, a_sums, ab_sums):
    """a_sums[r] = sum of g, ab_sums[r] = sum of g * b over rows lo:hi, in float64, where g is
    a, or with relu a where centred * slope + bias > 0 and a * 0 elsewhere. With a and b one
    array and no relu: a row's sum and sum of squares (centred is then not read)."""
    length = a.shape[1]
    full = length - length % LANES
    s = np.empty(LANES)
    p = np.empty(LANES)
    for r in range(lo, hi):
        s[:] = 0.0
        p[:] = 0.0
        m, c = slope[r], bias[r]
        for i in range(0, full, LANES):
            for j in range(LANES):
                g = np.float64(a[r, i + j])
                if relu and not centred[r, i + j] * m + c > _ZERO:
                    g *= 0.0
                s[j] += g
                p[j] += g * np.float64(b[r, i + j])
        total, product = 0.0, 0.0
        for i in range(full, length):
            g = np.float64(a[r, i])
            if relu and not centred[r, i] * m + c > _ZERO:
                g *= 0.0
            total += g
            product += g * np.float64(b[r, i])
        for j in range(LANES):
            total += s[j]
            product += p[j]
        a_sums[r] = total
        ab_sums[r] = product


@kernel
def normalise(xy, centred, mean, slope, bias, relu, lo, hi):
    """Rows lo:hi, in place: centred = x - mean, then xy = centred * slope + bias, clamped at 0
    with relu."""
    length = xy.shape[1]
    for r in range(lo, hi):
        m, k, c = mean[r], slope[r], bias[r]
        for i in range(length):
            v = xy[r, i] - m
            centred[r, i] = v
            v = v * k + c
            if relu and v <= _ZERO:
                v = _ZERO
            xy[r, i] = v


@kernel
def gradient(d, centred, slope, bias, relu, gain, shift, tilt, lo, hi):
    """Rows lo:hi, in place (d holds dy, then dx): dx = g * gain - shift - centred * tilt, g as
    in `sums`, the products and differences in float32 in that order, as numpy's passes."""
    length = d.shape[1]
    for r in range(lo, hi):
        m, c = slope[r], bias[r]
        a, s, t = gain[r], shift[r], tilt[r]
        for i in range(length):
            x = centred[r, i]
            g = d[r, i]
            if relu and not x * m + c > _ZERO:
                g *= _ZERO
            d[r, i] = (g * a - s) - x * t
