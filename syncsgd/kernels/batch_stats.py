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

Where one process holds the batch, normalise_channels and gradient_channels make both passes
of a block of channels (every sample's rows of them) in one call, the second while the block
is in the cache, with the channels' statistics between as the layer computes them in numpy:
the same operations in the same order, so the same bits as the two passes.

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


@kernel
def channel_total(row_sums, channels, c):
    """The sum of channel c's rows of row_sums (one value a row, sample after sample) over
    the samples in order, as numpy's sum over the samples axis of (samples, channels)."""
    total = 0.0
    for r in range(c, row_sums.size, channels):
        total += row_sums[r]
    return total


@kernel
def normalise_channels(x, y, centred, keep, channels, c0, c1, count, eps, scale, shift, relu,
                       row_sums, row_squares, zeros, mean_rows, slope_rows, bias_rows,
                       mean, var, std):
    """Forward with batch statistics over channels c0:c1 of every sample at once, where one
    process holds the batch (no sums to add up across ranks between the passes): `sums` of
    their rows, then the channels' statistics as the layer computes them (mean and var float64
    of the sums / count, var at least 0; std = sqrt(float32 var + eps) in float32; the rows'
    mean, slope scale / std and bias in float32, mean, var and std kept per channel), then
    `normalise` while the rows are still in the cache. The same bits as the two passes."""
    samples = x.shape[0] // channels
    for s in range(samples):
        sums(x, x, zeros, zeros, zeros, False, s * channels + c0, s * channels + c1, row_sums,
             row_squares)
    for c in range(c0, c1):
        m = channel_total(row_sums, channels, c) / count
        v = channel_total(row_squares, channels, c) / count - m * m
        if v < 0.0:
            v = 0.0
        m32 = np.float32(m)
        sd = np.sqrt(np.float32(v) + eps)
        mean[c], var[c], std[c] = m32, v, sd
        k = scale[c] / sd
        for r in range(c, x.shape[0], channels):
            mean_rows[r], slope_rows[r], bias_rows[r] = m32, k, shift[c]
    for s in range(samples):
        normalise(x, y, centred, keep, mean_rows, slope_rows, bias_rows, relu,
                  s * channels + c0, s * channels + c1)


@kernel
def gradient_channels(d, b, mean_rows, slope_rows, bias_rows, relu, channels, c0, c1, count,
                      scale, std, row_sums, row_dots, gain_rows, shift_rows, tilt_rows,
                      g_sums, g_dots):
    """Backward with batch statistics over channels c0:c1 of every sample at once, where one
    process holds the batch, in place (d holds dy, then dx): `sums` of g and g * (b - mean)
    of their rows (kept per channel in g_sums, g_dots), the factors as the layer computes
    them from those / count in float64 (gain scale / std, shift mean(g) gain, tilt mean(g c)
    gain / std^2, rounded to float32 per row), then `gradient` while the rows are still in the
    cache. The same bits as the two passes."""
    samples = d.shape[0] // channels
    for s in range(samples):
        sums(d, b, mean_rows, slope_rows, bias_rows, relu, s * channels + c0,
             s * channels + c1, row_sums, row_dots)
    for c in range(c0, c1):
        g_sums[c] = channel_total(row_sums, channels, c)
        g_dots[c] = channel_total(row_dots, channels, c)
        sd = np.float64(std[c])
        u = np.float64(scale[c]) / sd
        a, t = np.float32(u), np.float32(g_dots[c] / count * u / (sd * sd))
        h = np.float32(g_sums[c] / count * u)
        for r in range(c, d.shape[0], channels):
            gain_rows[r], shift_rows[r], tilt_rows[r] = a, h, t
    for s in range(samples):
        gradient(d, b, mean_rows, slope_rows, bias_rows, relu, gain_rows, shift_rows,
                 tilt_rows, s * channels + c0, s * channels + c1)
