"""Exp: y = base ^ (shift + scale * x), with base e when exp_param.base is -1 (the default).

Computed as outer * exp(inner * x), outer = base ^ shift and inner = scale * ln(base), as Caffe
does; the gradient is inner * y, so the input need not be kept.
"""
import math

import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


def log_base(layer, base, field):
    """ln(base) for Exp and Log: -1 means e; other bases must be positive."""
    if base == -1:
        return 1.0
    if not base > 0:
        layer.fail(f"{field}.base must be positive (or -1 for e), got {base}")
    return math.log(base)


@register
class Exp(NeuronLayer):
    type = "Exp"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.exp_param
        ln_base = log_base(self, p.base, "exp_param")
        self.inner = np.float32(ln_base * p.scale)
        self.outer = np.float32(math.exp(ln_base * p.shift))

    def needs_input(self):
        return False

    def compute(self, x, y):
        ne.evaluate("outer * exp(inner * x)",
                    local_dict={"x": x, "inner": self.inner, "outer": self.outer}, out=y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("dy * y * inner", local_dict={"y": y, "dy": dy, "inner": self.inner}, out=dx)
