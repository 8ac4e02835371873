"""LRN (local response normalisation): top = x * s^-beta, s = k + alpha / D * (window sum of x^2).

ACROSS_CHANNELS: the window is `local_size` neighbouring channels, D = local_size.
WITHIN_CHANNEL: Caffe composes it from average pooling (zero padded, the divisor always the full
window) and a power layer, which comes to the same form with a local_size x local_size spatial
window, D = local_size^2 and k = 1.
Both windows are centred and zero padded, hence symmetric, so backward reuses the same window sum:
dx = dy * s^-beta - (2 alpha beta / D) * x * (window sum of dy * y / s).
s^-beta is computed once, as exp(-beta * log(s)) with numpy's vectorised float32 exp and log
(faster than numexpr's power: docs/performance.md), and kept for backward.
"""
import numexpr as ne
import numpy as np

from syncsgd.blob import check_shape
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb


def _along(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


@register
class LRNLayer(Layer):
    sample_wise = True
    type = "LRN"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.lrn_param
        self._size = p.local_size
        if self._size % 2 != 1:
            self.fail(f"lrn_param.local_size is {self._size}; LRN supports odd sizes only")
        self._pad = (self._size - 1) // 2
        if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
            self._axes = (1,)
            divisor, self._k = self._size, np.float32(p.k)
        else:
            self._axes = (2, 3)
            divisor, self._k = self._size * self._size, np.float32(1.0)
        self._alpha_over_d = np.float32(p.alpha / divisor)
        self._grad_coef = np.float32(2.0 * p.alpha * p.beta / divisor)
        self._neg_beta = np.float32(-p.beta)
        self._shape = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must have 4 axes (num, channels, height, width), got {shape}")
        top[0].reshape(shape)
        if shape != self._shape:
            self._shape = shape
            self._scale = np.zeros(shape, np.float32)   # s, kept for backward
            self._power = np.zeros(shape, np.float32)   # s^-beta, kept for backward
            self._work = np.zeros(shape, np.float32)
            # Zero-bordered copies along each window axis; only the middle is ever written.
            self._padded = {}
            for axis in self._axes:
                padded_shape = list(shape)
                padded_shape[axis] += self._size - 1
                check_shape(tuple(padded_shape), f"{self.name} window (lrn_param.local_size "
                            f"{self._size})")
                self._padded[axis] = np.zeros(padded_shape, np.float32)

    def _window_sum(self, src, out):
        """out = zero-padded centred window sum of src (out may be src)."""
        for axis, padded in self._padded.items():
            length = src.shape[axis]
            padded[_along(axis, self._pad, self._pad + length)] = src
            np.copyto(out, padded[_along(axis, 0, length)])
            for offset in range(1, self._size):
                out += padded[_along(axis, offset, offset + length)]
            src = out

    def forward(self, bottom, top):
        x, s = bottom[0].data, self._scale
        np.multiply(x, x, out=s)
        self._window_sum(s, s)
        ne.evaluate("k + c * s", out=s, local_dict={"k": self._k, "c": self._alpha_over_d, "s": s})
        power = self._power
        np.log(s, out=power)
        power *= self._neg_beta
        np.exp(power, out=power)
        np.multiply(x, power, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        s, w = self._scale, self._work
        dy = top[0].diff
        ne.evaluate("dy * y / s", out=w, local_dict={"dy": dy, "y": top[0].data, "s": s})
        self._window_sum(w, w)
        ne.evaluate("dy * p - c * x * w", out=bottom[0].diff,
                    local_dict={"dy": dy, "p": self._power, "c": self._grad_coef,
                                "x": bottom[0].data, "w": w})
