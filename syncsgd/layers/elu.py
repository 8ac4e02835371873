"""ELU: y = x for x > 0, alpha * (exp(x) - 1) otherwise."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class ELU(NeuronLayer):
    type = "ELU"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.alpha = np.float32(self.param.elu_param.alpha)

    def needs_input(self):
        # With alpha >= 0 the output is positive exactly where the input is.
        return self.alpha < 0

    def compute(self, x, y):
        ne.evaluate("where(x > 0, x, alpha * (exp(x) - 1))",
                    local_dict={"x": x, "alpha": self.alpha}, out=y)

    def gradient(self, x, y, dy, dx):
        # For x <= 0, d/dx alpha * (exp(x) - 1) = alpha * exp(x) = y + alpha.
        sign_of = x if self.needs_input() else y
        ne.evaluate("where(s > 0, dy, dy * (y + alpha))",
                    local_dict={"s": sign_of, "y": y, "dy": dy, "alpha": self.alpha}, out=dx)
