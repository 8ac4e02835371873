"""Bias: adds a learned blob, or bottom[1], broadcast over bottom[0] (Caffe's BiasLayer)."""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.broadcast import broadcast_dims, learned_shape, operand_grad
from syncsgd.layers.base import Layer
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
            operand_grad(self.blobs[0].diff, True, dy)
        elif propagate_down[1]:
            operand_grad(bottom[1].diff, False, dy)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = top[0].diff
