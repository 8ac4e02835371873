"""ReLU6 (MobileNet v2 ports; the SSD-era fork on PyPI, brocolli-caffe): a leaky ReLU capped at
relu6_param.threshold, y = min(max(x, 0) + negative_slope * min(x, 0), threshold)."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class ReLU6Layer(NeuronLayer):
    type = "ReLU6"
    fork = "inisis/caffe (brocolli-caffe)"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.relu6_param
        if p.threshold <= 0:
            self.fail(f"relu6_param.threshold {p.threshold} must be positive (6 by default)")
        self.slope = np.float32(p.negative_slope)
        self.threshold = np.float32(p.threshold)

    def needs_input(self):
        # Without a slope, y > 0 and y < threshold hold exactly where they hold for x.
        return self.slope != 0

    def compute(self, x, y):
        ne.evaluate("where(x > 0, x, x * slope)", out=y,
                    local_dict={"x": x, "slope": self.slope})
        np.minimum(y, self.threshold, out=y)

    def gradient(self, x, y, dy, dx):
        # The fork's: slope where x <= 0, 1 where x > 0, and nothing from threshold on.
        ne.evaluate("where(x < t, where(x > 0, dy, dy * slope), 0)", out=dx,
                    local_dict={"x": x, "dy": dy, "slope": self.slope, "t": self.threshold})
