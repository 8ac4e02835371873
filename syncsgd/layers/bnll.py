"""BNLL (binomial normal log-likelihood, softplus): y = log(1 + exp(x)).

Written as max(x, 0) + log1p(exp(-|x|)), which is what Caffe's two branches compute, so exp never
overflows; the gradient is the logistic sigmoid of x.
"""
import numexpr as ne

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class BNLL(NeuronLayer):
    type = "BNLL"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def compute(self, x, y):
        ne.evaluate("where(x > 0, x, 0) + log1p(exp(-abs(x)))", local_dict={"x": x}, out=y)

    def gradient(self, x, y, dy, dx):
        # exp(-x) may overflow to inf for very negative x, which gives the limit 0.
        ne.evaluate("dy / (1 + exp(-x))", local_dict={"x": x, "dy": dy}, out=dx)
