"""Bias: adds a learned blob, or bottom[1], broadcast over bottom[0] (Caffe's BiasLayer).

Its shape rules are shared with Scale and PReLU: an operand covering axes [axis, axis + k) of
bottom[0], which views bottom[0] as (outer, dim, inner) and the operand as (1, dim, 1), so one
numpy broadcast applies it and one reduction over axes (0, 2) gives its gradient.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


@register
class BiasLayer(Layer):
    type = "Bias"
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    in_place_ok = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.bias_param
        if len(bottom) == 1 and not self.blobs:
            shape = learned_shape(self, bottom[0].shape, p.axis, p.num_axes, "bias_param")
            bias = Blob(shape, name=f"{self.name}.bias")
            fill(bias.data, p.filler, self.ctx.rng(self.name, 0))
            self.blobs.append(bias)

    def reshape(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self._dims = broadcast_dims(self, bottom[0].shape, self.param.bias_param.axis,
                                    bias.shape, "the bias")
        if top[0] is not bottom[0]:
            top[0].reshape_like(bottom[0])

    def forward(self, bottom, top):
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        np.add(bottom[0].data.reshape(self._dims), bias.data.reshape(1, self._dims[1], 1),
               out=top[0].data.reshape(self._dims))

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self._dims)
        if len(bottom) == 1:
            if self.propagates_param(0):
                operand_grad(self.blobs[0].diff, True, dy)
        elif propagate_down[1]:
            operand_grad(bottom[1].diff, False, dy)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = top[0].diff


def learned_shape(layer, shape, axis, num_axes, what):
    """Shape of a learned operand: `num_axes` of bottom[0]'s axes from `axis` (-1: all the rest)."""
    axis = canonical_axis(axis, len(shape), layer)
    if num_axes < -1:
        layer.fail(f"{what}.num_axes is {num_axes}; use a count >= 0, or -1 for all remaining axes")
    end = len(shape) if num_axes == -1 else axis + num_axes
    if end > len(shape):
        layer.fail(f"{what}: {num_axes} axes from axis {axis} extend past bottom[0]'s shape "
                   f"{tuple(shape)}; lower num_axes or axis")
    return tuple(shape[axis:end])


def broadcast_dims(layer, shape, axis, operand_shape, what):
    """(outer, dim, inner) of bottom[0] for an operand of `operand_shape` placed at `axis`.

    A scalar operand ignores `axis`, as in Caffe.
    """
    k = len(operand_shape)
    axis = 0 if k == 0 else canonical_axis(axis, len(shape), layer)
    if tuple(shape[axis:axis + k]) != tuple(operand_shape):
        layer.fail(f"{what} of shape {tuple(operand_shape)} does not match bottom[0] shape "
                   f"{tuple(shape)} at axis {axis}; fix {what}'s shape or the axis field")
    return (int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(operand_shape, dtype=np.int64)),
            int(np.prod(shape[axis + k:], dtype=np.int64)))


def operand_grad(out, accumulate, a, b=None):
    """Gradient of an operand from (outer, dim, inner) arrays: sum of `a` (Bias) or of `a * b`
    (Scale, without a temporary) over axes 0 and 2. Accumulates into parameter diffs (the solver
    clears them) and overwrites a bottom's diff."""
    total = a.sum(axis=(0, 2)) if b is None else np.einsum("odi,odi->d", a, b)
    total = total.reshape(out.shape)
    if accumulate:
        out += total
    else:
        out[...] = total
