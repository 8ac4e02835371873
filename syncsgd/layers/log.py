"""Log: y = log_base(shift + scale * x), the natural log when log_param.base is -1 (default)."""
import numexpr as ne
import numpy as np

from syncsgd.layers.exp import log_base
from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class Log(NeuronLayer):
    type = "Log"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.log_param
        ln_base = log_base(self, p.base, "log_param")
        if ln_base == 0:
            self.fail("log_param.base 1 has no logarithm; use another base")
        self.scale, self.shift = np.float32(p.scale), np.float32(p.shift)
        self.base_scale = np.float32(1 / ln_base)
        self.diff_scale = np.float32(p.scale / ln_base)

    def compute(self, x, y):
        names = {"x": x, "a": self.scale, "b": self.shift, "k": self.base_scale}
        ne.evaluate("log(b + a * x) * k", local_dict=names, out=y)

    def gradient(self, x, y, dy, dx):
        names = {"x": x, "dy": dy, "a": self.scale, "b": self.shift, "d": self.diff_scale}
        ne.evaluate("dy * d / (b + a * x)", local_dict=names, out=dx)
