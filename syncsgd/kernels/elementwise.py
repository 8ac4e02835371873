"""Sums and copies of whole arrays, the passes Eltwise's SUM and Split make: over flat pieces
shared out to the threads (blas.on_pieces), each piece of an input read once however many
outputs it goes into. numpy's one call over a whole array runs on one thread, at about half the
rate (docs/performance.md, "BatchNorm, Scale, Eltwise and Split")."""
import numpy as np

from syncsgd.kernels import compiled
from syncsgd.kernels import relu as relu_kernels
from syncsgd.kernels.blas import on_pieces


def weighted_sum(xs, coeffs, y, relu=False, mask=None):
    """y = the sum of c * x over arrays `xs` (of y's shape) and coefficients `coeffs`; with
    `relu`, max(that sum, 0), a ReLU's work while the piece is in cache; with `mask` (an array
    of y's shape), that sum * (mask > 0), a plain ReLU's gradient where `mask` is its output."""
    pair = len(xs) > 1 and coeffs[0] == 1 and coeffs[1] == 1     # 1 * x0 + x1 is x0 + x1
    compiled_pair = (pair and len(xs) == 2 and compiled.available()
                     and all(a.flags.c_contiguous for a in (y, *xs))
                     and not any(np.shares_memory(y, x) for x in xs))
    if relu and compiled_pair:
        on_pieces(lambda out, a, b: relu_kernels.clamped_sum(a, b, out), y, *xs)
        return
    if mask is not None and compiled_pair and mask.flags.c_contiguous:
        on_pieces(lambda out, a, b, m: relu_kernels.masked_sum(a, b, m, out), y, *xs, mask)
        return
    masks = [] if mask is None else [mask]

    def piece(out, *parts):
        if pair:
            np.add(parts[0], parts[1], out=out)
        else:
            np.multiply(parts[0], coeffs[0], out=out)
        for x, c in zip(parts[1 + pair:len(xs)], coeffs[1 + pair:]):
            if c == 1:
                np.add(out, x, out=out)
            else:
                out += c * x
        if relu:
            np.maximum(out, 0, out=out)
        if masks:
            np.multiply(out, parts[len(xs)] > 0, out=out)
    on_pieces(piece, y, *xs, *masks)


def scaled_copies(x, coeffs, ys):
    """ys[i] = coeffs[i] * x, for arrays `ys` of x's shape."""
    def piece(part, *outs):
        for out, c in zip(outs, coeffs):
            if c == 1:
                np.copyto(out, part)
            else:
                np.multiply(part, c, out=out)
    on_pieces(piece, x, *ys)
