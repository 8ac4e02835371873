"""Sigmoid: y = 1 / (1 + exp(-x)), computed through tanh so large |x| cannot overflow."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register

HALF = np.float32(0.5)


def sigmoid(x, out):
    return ne.evaluate("h * tanh(h * x) + h", local_dict={"x": x, "h": HALF}, out=out)


@register
class Sigmoid(NeuronLayer):
    type = "Sigmoid"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def needs_input(self):
        return False

    def compute(self, x, y):
        sigmoid(x, y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("dy * y * (1 - y)", out=dx)
