"""Sums and copies of whole arrays, the passes Eltwise's SUM and Split make: over flat pieces
shared out to the threads (blas.on_pieces), each piece of an input read once however many
outputs it goes into. numpy's one call over a whole array runs on one thread, at about half the
rate (docs/performance.md, "BatchNorm, Scale, Eltwise and Split")."""
import numpy as np

from syncsgd.kernels.blas import on_pieces


def weighted_sum(xs, coeffs, y):
    """y = the sum of c * x over arrays `xs` (of y's shape) and coefficients `coeffs`."""
    def piece(out, *parts):
        np.multiply(parts[0], coeffs[0], out=out)
        for x, c in zip(parts[1:], coeffs[1:]):
            if c == 1:
                np.add(out, x, out=out)
            else:
                out += c * x
    on_pieces(piece, y, *xs)


def scaled_copies(x, coeffs, ys):
    """ys[i] = coeffs[i] * x, for arrays `ys` of x's shape."""
    def piece(part, *outs):
        for out, c in zip(outs, coeffs):
            if c == 1:
                np.copyto(out, part)
            else:
                np.multiply(part, c, out=out)
    on_pieces(piece, x, *ys)
