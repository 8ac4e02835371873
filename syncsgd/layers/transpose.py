"""Transpose (senlinuc/caffe_ocr): axis i of the top is axis dim[i] of the bottom, as numpy's
transpose; CRNN nets turn (N, C, H, W) features into time-major (W, N, H, C) with it. Unlike
SSD's Permute, every axis must be named."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class TransposeLayer(Layer):
    type = "Transpose"
    fork = "senlinuc/caffe_ocr"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.dims = list(self.param.transpose_param.dim)
        self.inverse = list(np.argsort(self.dims))

    def reshape(self, bottom, top):
        axes = bottom[0].num_axes
        if sorted(self.dims) != list(range(axes)):
            self.fail(f"transpose_param.dim {self.dims} must name each axis of the {axes}-axis "
                      f"bottom {bottom[0].shape} once (0..{axes - 1} in the top's order)")
        if top[0] is bottom[0]:
            self.fail("cannot run in place; give the top its own name")
        top[0].reshape(*(bottom[0].shape[d] for d in self.dims))

    def forward(self, bottom, top):
        np.copyto(top[0].data, bottom[0].data.transpose(self.dims))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.copyto(bottom[0].diff, top[0].diff.transpose(self.inverse))
