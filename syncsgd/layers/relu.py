"""ReLU with Caffe's leaky variant: y = max(x, 0) + negative_slope * min(x, 0).

The plain ReLU (slope 0) runs as numpy ufuncs, max(x, 0) forward and dy * (y > 0) backward, on
pieces shared out to the thread budget (blas.in_pieces: the mask of a piece stays in cache),
faster than whole-array passes or numexpr's where() (docs/performance.md, "ReLU"). The leaky
form keeps numexpr.
"""
import numexpr as ne
import numpy as np

from syncsgd.kernels.blas import in_pieces
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
        if self.slope == 0:
            x, y = x.reshape(-1), y.reshape(-1)
            in_pieces(lambda p: np.maximum(x[p], 0, out=y[p]), x.size)   # NaN stays NaN
        else:
            ne.evaluate("where(x > 0, x, x * slope)", local_dict={"x": x, "slope": self.slope},
                        out=y)

    def gradient(self, x, y, dy, dx):
        sign_of = x if self.needs_input() else y
        if self.slope == 0:
            s, dy, dx = sign_of.reshape(-1), dy.reshape(-1), dx.reshape(-1)
            in_pieces(lambda p: np.multiply(dy[p], s[p] > 0, out=dx[p]), dy.size)
        else:
            ne.evaluate("where(s > 0, dy, dy * slope)",
                        local_dict={"s": sign_of, "dy": dy, "slope": self.slope}, out=dx)
