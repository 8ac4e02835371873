"""Reverse (senlinuc/caffe_ocr): reverses the order along one axis, usually time (axis 0), so
that an Lstm between two Reverse layers reads a sequence backwards: the second half of a
bidirectional LSTM in CRNN nets."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class ReverseLayer(Layer):
    type = "Reverse"
    fork = "senlinuc/caffe_ocr"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.axis = self.param.reverse_param.axis
        if self.axis < 0:
            self.fail(f"reverse_param.axis {self.axis} must be 0 or more (the fork takes no "
                      "negative axes)")

    def reshape(self, bottom, top):
        if self.axis >= bottom[0].num_axes:
            self.fail(f"reverse_param.axis {self.axis} is not an axis of the bottom "
                      f"{bottom[0].shape}; use 0..{bottom[0].num_axes - 1}")
        if top[0] is bottom[0]:
            self.fail("cannot run in place; give the top its own name")
        top[0].reshape_like(bottom[0])

    def forward(self, bottom, top):
        np.copyto(top[0].data, np.flip(bottom[0].data, self.axis))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.copyto(bottom[0].diff, np.flip(top[0].diff, self.axis))
