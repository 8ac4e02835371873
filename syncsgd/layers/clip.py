"""Clip: y = max(min, min(x, max)); the gradient passes where min <= x <= max."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class Clip(NeuronLayer):
    type = "Clip"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            self.fail("clip_param needs both min and max")
        # Caffe would silently output `min` everywhere; an empty range is a mistake in the net.
        if p.min > p.max:
            self.fail(f"clip_param.min {p.min} is above clip_param.max {p.max}")
        self.lo, self.hi = np.float32(p.min), np.float32(p.max)

    def compute(self, x, y):
        np.minimum(x, self.hi, out=y)
        np.maximum(y, self.lo, out=y)

    def gradient(self, x, y, dy, dx):
        ne.evaluate("where((x >= lo) & (x <= hi), dy, 0)",
                    local_dict={"x": x, "dy": dy, "lo": self.lo, "hi": self.hi}, out=dx)
