"""Embed: a lookup table. Each bottom value is an integer index in [0, input_dim) that selects a
row of the (input_dim, num_output) weights (InnerProduct's weights transposed, for locality);
the top adds a num_output axis to the bottom's shape.

The indices have no gradient, so the backward fills only the weight and bias gradients.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def integer_indices(layer, values, limit, what):
    """values (float) as int64 indices, refused unless they are whole numbers in [0, limit)."""
    index = values.astype(np.int64)
    bad = (index != values) | (index < 0) | (index >= limit)
    if bad.any():
        layer.fail(f"{what} value {values.reshape(-1)[np.argmax(bad.reshape(-1))]} is not an "
                   f"integer index in [0, {limit})")
    return index


@register
class Embed(Layer):
    type = "Embed"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.embed_param
        if p.num_output < 1:
            self.fail("embed_param.num_output must be set to a positive number")
        if p.input_dim < 1:
            self.fail("embed_param.input_dim must be set to a positive number")
        self._k, self._n, self._bias_term = p.input_dim, p.num_output, p.bias_term
        if not self.blobs:
            self.blobs.append(Blob((self._k, self._n), name=f"{self.name}.weight"))
            fill(self.blobs[0].data, p.weight_filler, self.ctx.rng(self.name, 0))
            if self._bias_term:
                self.blobs.append(Blob((self._n,), name=f"{self.name}.bias"))
                fill(self.blobs[1].data, p.bias_filler, self.ctx.rng(self.name, 1))

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self._n,))

    def forward(self, bottom, top):
        self._index = integer_indices(self, bottom[0].data.reshape(-1), self._k, "bottom")
        y = top[0].data.reshape(-1, self._n)        # (M, num_output)
        np.take(self.blobs[0].data, self._index, axis=0, out=y)
        if self._bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self.fail("cannot back-propagate to its indices (bottom 0); set "
                      "`propagate_down: false` for it")
        dy = top[0].diff.reshape(-1, self._n)
        if self.propagates_param(0):
            np.add.at(self.blobs[0].diff, self._index, dy)
        if self._bias_term and self.propagates_param(1):
            self.blobs[1].diff += dy.sum(axis=0)
