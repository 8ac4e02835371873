"""BatchNorm's batch-statistics passes as compiled loops (kernels/compiled.py): two passes each
way where the numpy passes of layers/batch_norm.py make three, each loop reading its operands
once, with the Scale and the ReLU that follow in place folded in.

Arrays are a blob's (sample, channel) rows (kernels/rows.py), per-row values flat float32
arrays. Row sums are float64 in LANES partial sums added in a fixed order: a row's sum does not
depend on the thread or block that took it (so N ranks sum as one process does), and the
squares of float32 values are exact in float64, so the variance from one pass (sum of squares
less the squared mean) loses nothing that matters to cancellation where the mean is large.

The centred values x - mean are what backward reads. normalise may write them beside its output
(where it writes over x), or leave x as it is and the output elsewhere: the layer then keeps x
and backward takes x - mean again, the same float32 subtraction, so both give the same bits.

With `relu`, the ReLU in place after the Scale: forward clamps y = centred * slope + bias at 0
as numpy's maximum does (NaN stays NaN, -0 becomes 0); backward takes the gradient where that
same float32 value, recomputed from the centred value as forward computed it, is above 0 (the
ReLU's y > 0); elsewhere, NaN included, the gradient is dy * 0 as the ReLU's is (NaN for an
infinite or NaN dy).
"""
import numpy as np

from syncsgd.kernels.compiled import kernel

LANES = 32      # partial sums a row: the widest a float64 loop vectorised to at full speed

_ZERO = np.float32(0)


@kernel
def sums(a, b, mean, slope, bias, relu, lo, hi, a_sums, ab_sums):
    """a_sums[r] = sum of g, ab_sums[r] = sum of g * c over rows lo:hi, in float64, where c is
    b - mean[r] in float32 and g is a, or with relu a where c * slope + bias > 0 and a * 0
    elsewhere. With a and b one array, a zero mean and no relu: a row's sum and sum of
    squares."""
    length = a.shape[1]
    full = length - length % LANES
    s = np.empty(LANES)
    p = np.empty(LANES)
    for r in range(lo, hi):
        s[:] = 0.0
        p[:] = 0.0
        m, c, k = slope[r], bias[r], mean[r]
        for i in range(0, full, LANES):
            for j in range(LANES):
                v = b[r, i + j] - k
                g = np.float64(a[r, i + j])
                if relu and not v * m + c > _ZERO:
                    g *= 0.0
                s[j] += g
                p[j] += g * np.float64(v)
        total, product = 0.0, 0.0
        for i in range(full, length):
            v = b[r, i] - k
            g = np.float64(a[r, i])
            if relu and not v * m + c > _ZERO:
                g *= 0.0
            total += g
            product += g * np.float64(v)
        for j in range(LANES):
            total += s[j]
            product += p[j]
        a_sums[r] = total
        ab_sums[r] = product


@kernel
def normalise(x, y, centred, keep, mean, slope, bias, relu, lo, hi):
    """Rows lo:hi: y = (x - mean) * slope + bias, clamped at 0 with relu, and with `keep`
    centred = x - mean. y may be x (in place): each value is read before it is written."""
    length = x.shape[1]
    for r in range(lo, hi):
        m, k, c = mean[r], slope[r], bias[r]
        for i in range(length):
            v = x[r, i] - m
            if keep:
                centred[r, i] = v
            v = v * k + c
            if relu and v <= _ZERO:
                v = _ZERO
            y[r, i] = v


@kernel
def gradient(d, b, mean, slope, bias, relu, gain, shift, tilt, lo, hi):
    """Rows lo:hi, in place (d holds dy, then dx): dx = g * gain - shift - c * tilt, c = b -
    mean[r] and g as in `sums`, the products and differences in float32 in that order, as
    numpy's passes."""
    length = d.shape[1]
    for r in range(lo, hi):
        m, c, k = slope[r], bias[r], mean[r]
        a, s, t = gain[r], shift[r], tilt[r]
        for i in range(length):
            x = b[r, i] - k
            g = d[r, i]
            if relu and not x * m + c > _ZERO:
                g *= _ZERO
            d[r, i] = (g * a - s) - x * t
