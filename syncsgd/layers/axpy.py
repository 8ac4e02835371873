"""Axpy (hujie-frank/SENet): top = a * x + y with a per-channel scale a of shape (N, C) or
(N, C, 1, 1), bottoms (a, x, y); SENet uses it to scale a residual branch by its excitation and
add the shortcut in one layer."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class AxpyLayer(Layer):
    type = "Axpy"
    fork = "hujie-frank/SENet"
    exact_bottoms = 3
    exact_tops = 1
    sample_wise = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        a, x, y = (b.shape for b in bottom)
        if x != y:
            self.fail(f"bottoms 2 and 3 (x and y) must have one shape, got {x} and {y}")
        if len(x) < 2 or a[:2] != x[:2] or any(d != 1 for d in a[2:]):
            self.fail(f"bottom 1 (the scale a) must be (N, C) or (N, C, 1, 1) of the x it "
                      f"scales, {x[:2]}; got {a}")
        top[0].reshape(x)
        self._dims = (x[0], x[1], -1)        # (N, C, spatial)

    def forward(self, bottom, top):
        a, x, y = bottom
        out = top[0].data.reshape(self._dims)
        np.multiply(x.data.reshape(self._dims), a.data.reshape(self._dims[:2] + (1,)), out=out)
        out += y.data.reshape(self._dims)

    def backward(self, top, propagate_down, bottom):
        a, x, y = bottom
        dtop = top[0].diff.reshape(self._dims)
        if propagate_down[0]:
            np.einsum("ncs,ncs->nc", dtop, x.data.reshape(self._dims),
                      out=a.diff.reshape(self._dims[:2]))
        if propagate_down[1]:
            np.multiply(dtop, a.data.reshape(self._dims[:2] + (1,)),
                        out=x.diff.reshape(self._dims))
        if propagate_down[2]:
            np.copyto(y.diff.reshape(self._dims), dtop)
