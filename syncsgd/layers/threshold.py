"""Threshold: y = 1 where x > threshold, else 0.

Caffe gives this layer no backward; its gradient is zero wherever it exists, so where a net asks
for one it gets zeros (as Accuracy does) rather than an abort.
"""
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class Threshold(NeuronLayer):
    type = "Threshold"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.threshold = np.float32(self.param.threshold_param.threshold)

    def needs_input(self):
        return False

    def compute(self, x, y):
        np.greater(x, self.threshold, out=y)

    def gradient(self, x, y, dy, dx):
        dx.fill(0)
