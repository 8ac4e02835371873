"""Caffe's weight fillers, drawing from a numpy Generator so a seeded run is repeatable.

Fillers that draw every value independently draw them CHUNK at a time into the array: numpy's
generators give the same sequence whether asked for n values at once or in pieces, so the weights
are the same as from one draw, without a float64 temporary the size of the blob: for a large fully
connected layer that temporary would be the largest allocation of a whole training run.
"""
import math

import numpy as np

from syncsgd.errors import FillerError
from syncsgd.proto import pb

_NORM = pb.FillerParameter
CHUNK = 1 << 20      # values drawn at a time by the independent-value fillers


def fill(array, filler, rng):
    """Fill `array` (float32, in place) as FillerParameter `filler` says."""
    kind = filler.type
    if kind not in _FILLERS and kind not in _DRAWS:
        known = sorted(set(_FILLERS) | set(_DRAWS))
        raise FillerError(f"unknown filler type '{kind}'; known: {', '.join(known)}")
    _check(filler)
    if array.size == 0:         # nothing to fill, and no fan to scale xavier or msra by
        return array
    if kind in _FILLERS or not array.flags.c_contiguous:
        if kind in _DRAWS:
            array[...] = _draw_whole(array.shape, filler, rng)
        else:
            array[...] = _FILLERS[kind](array.shape, filler, rng)
        return array
    flat = array.reshape(-1)
    draw = _DRAWS[kind](array.shape, filler)
    for start in range(0, flat.size, CHUNK):
        piece = flat[start:start + CHUNK]
        piece[...] = draw(rng, piece.size)
    keep = _sparse_keep(array.shape, filler)
    if keep is not None:
        for start in range(0, flat.size, CHUNK):
            piece = flat[start:start + CHUNK]
            piece *= rng.random(piece.size) < keep
    return array


# The FillerParameter fields each filler type reads.
_USES = {"constant": ("value",), "uniform": ("min", "max"), "gaussian": ("mean", "std")}


def _check(filler):
    """Refuse settings numpy would reject mid-fill, or that fill the blob with NaN."""
    kind = filler.type
    for field in _USES.get(kind, ()):
        value = getattr(filler, field)
        if not math.isfinite(value):
            raise FillerError(f"{kind} filler has {field}: {value}; give a finite number")
    if kind == "gaussian" and filler.std < 0:
        raise FillerError(f"gaussian filler has std: {filler.std:g}; give std >= 0")
    if kind == "uniform" and filler.min > filler.max:
        raise FillerError(f"uniform filler has min: {filler.min:g} above max: {filler.max:g}; "
                          "give min <= max")


def _draw_whole(shape, filler, rng):
    """What the chunked draws give, in one draw (for arrays that are not contiguous)."""
    values = _DRAWS[filler.type](shape, filler)(rng, shape)
    keep = _sparse_keep(shape, filler)
    if keep is not None:
        values = values * (rng.random(shape) < keep)
    return values


def _sparse_keep(shape, filler):
    """Probability of keeping a weight for a sparse gaussian filler (sparse / num_outputs, as
    Caffe), or None."""
    if filler.type != "gaussian" or filler.sparse < 0:
        return None
    if len(shape) < 1 or shape[0] == 0:
        raise FillerError("sparse gaussian filler needs a blob with at least one axis")
    return filler.sparse / shape[0]


def _fans(shape):
    count = int(np.prod(shape))
    fan_in = count // shape[0] if shape and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    return fan_in, fan_out


def _norm_n(shape, filler):
    fan_in, fan_out = _fans(shape)
    if filler.variance_norm == _NORM.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if filler.variance_norm == _NORM.FAN_OUT:
        return fan_out
    return fan_in


# Independent-value fillers: (shape, filler) -> draw(rng, count or shape).
def _constant(shape, f):
    return lambda rng, n: np.full(n, f.value, np.float32)


def _uniform(shape, f):
    return lambda rng, n: rng.uniform(f.min, f.max, n)


def _gaussian(shape, f):
    return lambda rng, n: rng.normal(f.mean, f.std, n)


def _xavier(shape, f):
    scale = np.sqrt(3.0 / _norm_n(shape, f))
    return lambda rng, n: rng.uniform(-scale, scale, n)


def _msra(shape, f):
    std = np.sqrt(2.0 / _norm_n(shape, f))
    return lambda rng, n: rng.normal(0.0, std, n)


def _positive_unitball(shape, f, rng):
    values = rng.random(shape).reshape(shape[0] if shape else 1, -1)
    values /= values.sum(axis=1, keepdims=True)
    return values.reshape(shape)


def _bilinear(shape, f, rng):
    """Upsampling kernel for a Deconvolution layer (Caffe's BilinearFiller)."""
    if len(shape) != 4 or shape[2] != shape[3]:
        raise FillerError(f"bilinear filler needs a 4-D blob with a square kernel, got {shape}")
    size = shape[3]
    factor = np.ceil(size / 2.0)
    center = (2 * factor - 1 - factor % 2) / (2.0 * factor)
    ramp = 1 - np.abs(np.arange(size) / factor - center)
    return np.broadcast_to(np.outer(ramp, ramp), shape)


_DRAWS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "xavier": _xavier,
    "msra": _msra,
}

_FILLERS = {
    "positive_unitball": _positive_unitball,
    "bilinear": _bilinear,
}
