"""TanH: y = tanh(x); the gradient 1 - y^2 needs only the output, so in place costs nothing."""
import numexpr as ne

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
        ne.evaluate("tanh(x)", out=y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("dy * (1 - y * y)", out=dx)
