"""Reshape: a new shape for the same data (0 copies a bottom dimension, -1 is inferred).

The top's data and diff are views of the bottom's, so forward and backward move nothing.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def share_reshaped(bottom, top, shape):
    """Make top's data and diff views of bottom's with `shape` (Caffe's ShareData/ShareDiff)."""
    top.data = bottom.data.reshape(shape)
    top.diff = bottom.diff.reshape(shape)


def pass_gradient(top, propagate_down, bottom):
    """Diffs are shared views already; copy only if someone replaced the top's diff array."""
    if propagate_down[0] and not np.shares_memory(top[0].diff, bottom[0].diff):
        np.copyto(bottom[0].diff, top[0].diff.reshape(bottom[0].shape))


@register
class Reshape(Layer):
    type = "Reshape"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.reshape_param
        self.dims = list(p.shape.dim)
        if any(d < -1 for d in self.dims):
            self.fail(f"reshape_param shape {self.dims}: dimensions must be >= -1")
        if self.dims.count(-1) > 1:
            self.fail(f"reshape_param shape {self.dims} has more than one -1 (inferred) "
                      f"dimension")
        if p.num_axes < -1:
            self.fail(f"reshape_param num_axes {p.num_axes} must be >= -1 (-1: to the end)")

    def reshape(self, bottom, top):
        p = self.param.reshape_param
        shape = bottom[0].shape
        n = len(shape)
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            self.fail(f"reshape_param axis {p.axis} out of range for a {n}-axis bottom")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            self.fail(f"reshape_param axis {p.axis} + num_axes {p.num_axes} go past the "
                      f"{n} axes of the bottom {shape}")
        new = []
        for k, d in enumerate(self.dims):
            if d == 0:
                if start + k >= n:
                    self.fail(f"reshape_param shape dim {k} is 0 (copy) but the bottom {shape} "
                              f"has no axis {start + k}")
                d = shape[start + k]
            new.append(d)
        top_shape = shape[:start] + tuple(new) + shape[end:]
        if -1 in new:
            known = int(np.prod([d for d in top_shape if d != -1], dtype=np.int64))
            if known == 0 or bottom[0].count % known:
                self.fail(f"cannot infer the -1 dimension of {top_shape} from the "
                          f"{bottom[0].count} elements of the bottom {shape}")
            top_shape = tuple(bottom[0].count // known if d == -1 else d for d in top_shape)
        if int(np.prod(top_shape, dtype=np.int64)) != bottom[0].count:
            self.fail(f"shape {top_shape} holds {int(np.prod(top_shape))} elements, the bottom "
                      f"{shape} {bottom[0].count}")
        share_reshaped(bottom[0], top[0], top_shape)

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass_gradient(top, propagate_down, bottom)
