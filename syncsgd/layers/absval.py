"""AbsVal: y = |x|; the gradient is sign(x), 0 at x = 0 as in Caffe."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class AbsVal(NeuronLayer):
    type = "AbsVal"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def compute(self, x, y):
        np.abs(x, out=y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("where(x > 0, dy, where(x < 0, -dy, 0))", out=dx)
