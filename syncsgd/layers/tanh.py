"""TanH: y = tanh(x); the gradient 1 - y^2 needs only the output, so in place costs nothing.

Forward is numpy's float32 tanh, which is vectorised and faster than numexpr's
(docs/performance.md)."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class TanH(NeuronLayer):
    type = "TanH"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def needs_input(self):
        return False

    def compute(self, x, y):
        np.tanh(x, out=y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("dy * (1 - y * y)", out=dx)
