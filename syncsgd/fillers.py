"""Caffe's weight fillers, drawing from a numpy Generator so a seeded run is repeatable."""
import numpy as np

from syncsgd.errors import PrototxtError
from syncsgd.proto import pb

_NORM = pb.FillerParameter


def fill(array, filler, rng):
    """Fill `array` (float32, in place) as FillerParameter `filler` says."""
    kind = filler.type
    try:
        fn = _FILLERS[kind]
    except KeyError:
        raise PrototxtError(f"unknown filler type '{kind}'; known: {', '.join(sorted(_FILLERS))}")
    array[...] = fn(array.shape, filler, rng)
    return array


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


def _constant(shape, f, rng):
    return np.full(shape, f.value, np.float32)


def _uniform(shape, f, rng):
    return rng.uniform(f.min, f.max, shape)


def _gaussian(shape, f, rng):
    values = rng.normal(f.mean, f.std, shape)
    if f.sparse >= 0:
        # Keep each weight with probability sparse / num_outputs, as Caffe does.
        if len(shape) < 1 or shape[0] == 0:
            raise PrototxtError("sparse gaussian filler needs a blob with at least one axis")
        keep = rng.random(shape) < f.sparse / shape[0]
        values *= keep
    return values


def _positive_unitball(shape, f, rng):
    values = rng.random(shape).reshape(shape[0] if shape else 1, -1)
    values /= values.sum(axis=1, keepdims=True)
    return values.reshape(shape)


def _xavier(shape, f, rng):
    scale = np.sqrt(3.0 / _norm_n(shape, f))
    return rng.uniform(-scale, scale, shape)


def _msra(shape, f, rng):
    return rng.normal(0.0, np.sqrt(2.0 / _norm_n(shape, f)), shape)


def _bilinear(shape, f, rng):
    """Upsampling kernel for a Deconvolution layer (Caffe's BilinearFiller)."""
    if len(shape) != 4 or shape[2] != shape[3]:
        raise PrototxtError(f"bilinear filler needs a 4-D blob with a square kernel, got {shape}")
    size = shape[3]
    factor = np.ceil(size / 2.0)
    center = (2 * factor - 1 - factor % 2) / (2.0 * factor)
    ramp = 1 - np.abs(np.arange(size) / factor - center)
    return np.broadcast_to(np.outer(ramp, ramp), shape)


_FILLERS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}
