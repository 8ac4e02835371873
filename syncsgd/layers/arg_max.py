"""ArgMax: the indices (and optionally the values) of the top_k largest entries.

Without argmax_param.axis each sample is flattened and the top is (N, 1, top_k), or
(N, 2, top_k) with out_max_val (indices, then values), padded with 1s to the bottom's number of
axes; with an axis, that axis of the bottom shrinks to top_k and holds indices, or values with
out_max_val. Equal values rank the higher index first, as Caffe's sort of (value, index) pairs does.
"""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


@register
class ArgMax(Layer):
    type = "ArgMax"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.argmax_param
        if p.top_k < 1:
            self.fail("argmax_param.top_k must be at least 1")
        self.top_k, self.out_max_val = p.top_k, p.out_max_val

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        p = self.param.argmax_param
        if p.HasField("axis"):
            self.axis = canonical_axis(p.axis, len(shape), self)
            dim, what = shape[self.axis], f"axis {self.axis}"
            top[0].reshape(shape[:self.axis] + (self.top_k,) + shape[self.axis + 1:])
        else:
            self.axis = None
            dim, what = int(np.prod(shape[1:], dtype=np.int64)), "a flattened sample"
            out = [1] * max(len(shape), 3)
            out[0], out[1], out[2] = shape[0], 2 if self.out_max_val else 1, self.top_k
            top[0].reshape(out)
        if self.top_k > dim:
            self.fail(f"argmax_param.top_k {self.top_k} is more than the {dim} values of {what} "
                      f"in bottom shape {shape}")

    def _ranked(self, x):
        """Indices along the last axis of x, largest value first, ties to the higher index."""
        dim = x.shape[-1]
        order = np.argsort(-x[..., ::-1], axis=-1, kind="stable")[..., :self.top_k]
        return dim - 1 - order

    def forward(self, bottom, top):
        x = bottom[0].data
        if self.axis is None:
            x = x.reshape(x.shape[0], -1)                       # (N, dim)
            index = self._ranked(x)                              # (N, top_k)
            y = top[0].data.reshape(x.shape[0], -1, self.top_k)  # (N, 1 or 2, top_k)
            y[:, 0] = index
            if self.out_max_val:
                y[:, 1] = np.take_along_axis(x, index, axis=-1)
            return
        x = np.moveaxis(x, self.axis, -1)
        index = self._ranked(x)
        y = np.moveaxis(top[0].data, self.axis, -1)
        y[...] = np.take_along_axis(x, index, axis=-1) if self.out_max_val else index

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        # Indices are piecewise constant in the input: zero gradient. Values are not, and Caffe
        # has no backward for them.
        if self.out_max_val:
            self.fail("has no gradient for out_max_val; set `propagate_down: false` for its "
                      "bottom or stop back-propagation before it")
        bottom[0].diff.fill(0)
