"""Power: y = (shift + scale * x) ^ power."""
import numexpr as ne
import numpy as np

from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


@register
class Power(NeuronLayer):
    type = "Power"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.power_param
        self.power = np.float32(p.power)
        self.scale = np.float32(p.scale)
        self.shift = np.float32(p.shift)
        # dy/dx = power * scale * (shift + scale * x) ^ (power - 1)
        self.diff_scale = np.float32(self.power * self.scale)

    def _constant_gradient(self):
        """Power 0 (or scale 0) gives a constant output, power 1 an affine one."""
        return self.diff_scale == 0 or self.power == 1

    def needs_input(self):
        return not self._constant_gradient()

    def compute(self, x, y):
        if self.diff_scale == 0:
            y.fill(1 if self.power == 0 else self.shift ** self.power)
            return
        names = {"x": x, "a": self.scale, "b": self.shift, "p": self.power}
        expr = "b + a * x" if self.power == 1 else "(b + a * x) ** p"
        ne.evaluate(expr, local_dict=names, out=y)

    def gradient(self, x, y, dy, dx):
        if self.diff_scale == 0:
            dx.fill(0)
            return
        if self.power == 1:
            np.multiply(dy, self.diff_scale, out=dx)
            return
        names = {"x": x, "dy": dy, "a": self.scale, "b": self.shift, "p": self.power,
                 "d": self.diff_scale}
        expr = "dy * d * (b + a * x)" if self.power == 2 else "dy * d * (b + a * x) ** (p - 1)"
        ne.evaluate(expr, local_dict=names, out=dx)
