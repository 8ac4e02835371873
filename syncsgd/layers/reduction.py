"""Reduction: SUM, ASUM (sum of |x|), SUMSQ or MEAN over all axes from `axis` on, times coeff.

The top keeps the axes before `axis`; the default axis 0 reduces the whole blob to a scalar.
"""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register
from syncsgd.proto import pb

_OP = pb.ReductionParameter


@register
class Reduction(Layer):
    type = "Reduction"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.op = self.param.reduction_param.operation

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        p = self.param.reduction_param
        axis = canonical_axis(p.axis, len(shape), self)
        top[0].reshape(shape[:axis])
        self._rows = int(np.prod(shape[:axis], dtype=np.int64))
        self._dim = int(np.prod(shape[axis:], dtype=np.int64))
        self.coeff = np.float32(p.coeff / self._dim if self.op == _OP.MEAN else p.coeff)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._rows, self._dim)
        y = top[0].data.reshape(self._rows)
        if self.op == _OP.ASUM:
            np.sum(np.abs(x), axis=1, out=y)
        elif self.op == _OP.SUMSQ:
            np.einsum("ij,ij->i", x, x, out=y)
        else:
            np.sum(x, axis=1, out=y)
        y *= self.coeff

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data.reshape(self._rows, self._dim)
        dx = bottom[0].diff.reshape(self._rows, self._dim)
        dy = top[0].diff.reshape(self._rows, 1) * self.coeff
        if self.op == _OP.ASUM:
            np.multiply(np.sign(x), dy, out=dx)
        elif self.op == _OP.SUMSQ:
            np.multiply(x, 2 * dy, out=dx)
        else:
            np.copyto(dx, dy)
