"""The shape shared by elementwise ("neuron") layers: one bottom, one top of the same shape.

Neuron layers may run in place (top is bottom). Then the forward pass overwrites the input, so a
layer whose backward needs it says so in `needs_input`, and the input is kept in a buffer.
"""
import numpy as np

from syncsgd.layers.base import Layer


class NeuronLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True
    feature_local = True
    sample_wise = True

    def __init__(self, param, ctx):
        super().__init__(param, ctx)
        self._kept_input = None

    def needs_input(self):
        """True where the gradient reads the input x and not only the output y."""
        return True

    def compute(self, x, y):
        """y = f(x); x and y may be the same array."""
        raise NotImplementedError

    def gradient(self, x, y, dy, dx):
        """dx = f'(x) * dy; dx may be dy, and x is already y in place unless needs_input()."""
        raise NotImplementedError

    def reshape(self, bottom, top):
        top[0].reshape_like(bottom[0])
        if top[0] is bottom[0] and self.needs_input():
            if self._kept_input is None or self._kept_input.shape != bottom[0].shape:
                self._kept_input = np.empty(bottom[0].shape, np.float32)
        else:
            self._kept_input = None

    def forward(self, bottom, top):
        if self._kept_input is not None:
            np.copyto(self._kept_input, bottom[0].data)
        self.compute(bottom[0].data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data if self._kept_input is None else self._kept_input
        self.gradient(x, top[0].data, top[0].diff, bottom[0].diff)
