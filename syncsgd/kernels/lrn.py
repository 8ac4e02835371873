"""LRN across channels as compiled loops (kernels/compiled.py), for the LRN layer on arrays.

Arrays are (samples, channels, pixels) views of NCHW blobs. For each channel the window sum of
squares is added up from its neighbours' rows while they are in the cache, and s, s^-beta and
the output follow in one loop: one read of x and one write of y and s where numpy makes about
a dozen passes. The sums add the same values in the same order as the numpy passes of
layers/lrn.py (zero padding adds nothing), and s^-0.75 is the same 1 / sqrt(s * sqrt(s)), so
for beta 0.75 forward results are those passes' to the bit (exp and log, for other betas, may
differ from numpy's by an ulp).
"""
import numpy as np

from syncsgd.kernels.compiled import kernel

_ONE = np.float32(1.0)


@kernel
def forward(x, y, s, size, alpha_over_d, k, beta):
    """y = x * s^-beta, s = k + alpha_over_d * (window sum of x^2), kept for backward."""
    num, channels, pixels = x.shape
    pad = (size - 1) // 2
    for n in range(num):
        for c in range(channels):
            sc = s[n, c]
            sc[:] = 0
            for j in range(max(0, c - pad), min(channels, c + pad + 1)):
                xj = x[n, j]
                for i in range(pixels):
                    sc[i] += xj[i] * xj[i]
            xc, yc = x[n, c], y[n, c]
            if beta == 0.75:
                for i in range(pixels):
                    v = sc[i] * alpha_over_d + k
                    sc[i] = v
                    yc[i] = xc[i] * (_ONE / np.sqrt(v * np.sqrt(v)))
            else:
                for i in range(pixels):
                    v = sc[i] * alpha_over_d + k
                    sc[i] = v
                    yc[i] = xc[i] * np.exp(np.log(v) * -beta)


@kernel
def backward(x, y, s, dy, dx, work, size, coefficient, beta):
    """dx = dy * s^-beta - coefficient * x * (window sum of dy * y / s); work is a (channels,
    pixels) buffer of the caller's thread."""
    num, channels, pixels = x.shape
    pad = (size - 1) // 2
    for n in range(num):
        for c in range(channels):
            wc, dyc, yc, sc = work[c], dy[n, c], y[n, c], s[n, c]
            for i in range(pixels):
                wc[i] = dyc[i] * yc[i] / sc[i]
        for c in range(channels):
            dxc, dyc, xc, sc = dx[n, c], dy[n, c], x[n, c], s[n, c]
            dxc[:] = 0
            for j in range(max(0, c - pad), min(channels, c + pad + 1)):
                wj = work[j]
                for i in range(pixels):
                    dxc[i] += wj[i]
            # The numpy passes' order: (sum * x) * coefficient.
            if beta == 0.75:
                for i in range(pixels):
                    v = sc[i]
                    power = _ONE / np.sqrt(v * np.sqrt(v))
                    dxc[i] = dyc[i] * power - dxc[i] * xc[i] * coefficient
            else:
                for i in range(pixels):
                    power = np.exp(np.log(sc[i]) * -beta)
                    dxc[i] = dyc[i] * power - dxc[i] * xc[i] * coefficient
