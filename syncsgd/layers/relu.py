"""ReLU with Caffe's leaky variant: y = max(x, 0) + negative_slope * min(x, 0)."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class ReLU(NeuronLayer):
    type = "ReLU"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.slope = np.float32(self.param.relu_param.negative_slope)

    def needs_input(self):
        # With slope >= 0 the output has the sign of the input, so y tells where x > 0.
        return self.slope < 0

    def compute(self, x, y):
        ne.evaluate("where(x > 0, x, x * slope)", local_dict={"x": x, "slope": self.slope}, out=y)

    def gradient(self, x, y, dy, dx):
        sign_of = x if self.needs_input() else y
        ne.evaluate("where(s > 0, dy, dy * slope)",
                    local_dict={"s": sign_of, "dy": dy, "slope": self.slope}, out=dx)
