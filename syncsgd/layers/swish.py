"""Swish: y = x * sigmoid(beta * x).

The sigmoid is kept from the forward pass: with it and y the gradient needs no input, so the
layer runs in place without a copy of x.
"""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register
from syncsgd.layers.sigmoid import sigmoid


@register
class Swish(NeuronLayer):
    type = "Swish"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.beta = np.float32(self.param.swish_param.beta)
        self._sig = np.zeros(0, np.float32)

    def needs_input(self):
        return False

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._sig.shape != bottom[0].shape:
            self._sig = np.empty(bottom[0].shape, np.float32)

    def compute(self, x, y):
        np.multiply(x, self.beta, out=self._sig)
        sigmoid(self._sig, self._sig)
        np.multiply(x, self._sig, out=y)

    def gradient(self, x, y, dy, dx):
        # d/dx x s(bx) = s + b x s (1 - s) = b y + s (1 - b y)
        ne.evaluate("dy * (b * y + s * (1 - b * y))",
                    local_dict={"y": y, "dy": dy, "s": self._sig, "b": self.beta}, out=dx)
