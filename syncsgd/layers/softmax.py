"""Softmax over one axis; the kernels are shared with SoftmaxWithLoss."""
import math

import numpy as np

from syncsgd.kernels.blas import spread
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


def split_at_axis(shape, axis):
    """(outer, channels, inner): the blob seen as a 3-D array around `axis`."""
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1:])
    return outer, shape[axis], inner


def in_rows(work, *arrays):
    """work(*row_slices) over pieces of the outer axis of (outer, C, inner) arrays, about
    2^18 values each, shared out to the threads (a piece's passes stay in cache)."""
    outer = arrays[0].shape[0]
    rows = max(1, (1 << 18) // max(1, math.prod(arrays[0].shape[1:])))
    if rows >= outer:
        work(*arrays)
        return
    spans = [slice(r, r + rows) for r in range(0, outer, rows)]
    spread(spans, lambda span, _: work(*(a[span] for a in arrays)))


def softmax_forward(x, y, scratch):
    """y = softmax of x over axis 1 of (outer, C, inner) arrays; y may be x.
    scratch: (outer, 1, inner)."""
    def rows(x, y, scratch):
        np.maximum.reduce(x, axis=1, keepdims=True, out=scratch)   # np.max and np.sum without
        np.subtract(x, scratch, out=y)                               # their Python wrappers
        np.exp(y, out=y)
        np.add.reduce(y, axis=1, keepdims=True, out=scratch)
        np.divide(y, scratch, out=y)
    in_rows(rows, x, y, scratch)


def softmax_backward(y, dy, dx, scratch):
    """dx = (dy - sum_c dy * y) * y over axis 1; dx may be dy."""
    def rows(y, dy, dx, scratch):
        np.einsum("icj,icj->ij", dy, y, out=scratch[:, 0, :])
        np.subtract(dy, scratch, out=dx)
        np.multiply(dx, y, out=dx)
    in_rows(rows, y, dy, dx, scratch)


@register
class Softmax(Layer):
    type = "Softmax"
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True   # backward reads only the output

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.scratch = None

    def reshape(self, bottom, top):
        axis = canonical_axis(self.param.softmax_param.axis, bottom[0].num_axes, self)
        self.dims = split_at_axis(bottom[0].shape, axis)
        outer, _, inner = self.dims
        if self.scratch is None or self.scratch.shape != (outer, 1, inner):
            self.scratch = np.empty((outer, 1, inner), np.float32)
        top[0].reshape_like(bottom[0])

    def forward(self, bottom, top):
        softmax_forward(bottom[0].data.reshape(self.dims), top[0].data.reshape(self.dims),
                        self.scratch)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            softmax_backward(top[0].data.reshape(self.dims), top[0].diff.reshape(self.dims),
                             bottom[0].diff.reshape(self.dims), self.scratch)
