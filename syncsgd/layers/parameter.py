"""Parameter: a learnable blob of parameter_param.shape as the layer's one top, so that a net can
feed weights into layers that take them as bottoms.

Caffe's top shares the blob's memory; here the forward copies the values and the backward adds
the top's gradient to the blob's, which is the same gradient (the solver clears parameter diffs)
and also accumulates correctly over iter_size.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class Parameter(Layer):
    type = "Parameter"
    exact_bottoms = 0
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        shape = tuple(self.param.parameter_param.shape.dim)
        if not self.blobs:
            # Zeros, as Caffe's fresh blob; the values come from a weight file.
            self.blobs.append(Blob(shape, name=f"{self.name}.parameter"))

    def reshape(self, bottom, top):
        top[0].reshape(self.blobs[0].shape)

    def forward(self, bottom, top):
        np.copyto(top[0].data, self.blobs[0].data)

    def backward(self, top, propagate_down, bottom):
        if self.propagates_param(0):
            self.blobs[0].diff += top[0].diff
