"""MVN: subtract each sample's mean, per channel or across channels, and with normalize_variance
divide by the standard deviation plus eps.

Caffe's MVN reads the bottom as legacy 4-D (num, channels, height, width), so it takes at most 4
axes and its top is always 4-D. The backward is the exact gradient of this forward; Caffe's drops
a factor (std + eps) / std in one term, which only shows when eps is not small against the std.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class MVN(Layer):
    type = "MVN"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.mvn_param
        self.normalize_variance, self.across_channels = p.normalize_variance, p.across_channels
        self.eps = np.float32(p.eps)
        self._std = np.zeros((0, 1), np.float32)       # std + eps of each row
        self._ratio = np.zeros((0, 1), np.float32)     # (std + eps) / std

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.num_axes > 4:
            self.fail(f"takes at most 4 axes (num, channels, height, width), got shape {b.shape}")
        top[0].reshape(b.num, b.channels, b.height, b.width)
        rows = b.num if self.across_channels else b.num * b.channels
        self._rows = (rows, b.count // rows if rows else 0)
        if self._std.shape != (rows, 1):
            self._std = np.zeros((rows, 1), np.float32)
            self._ratio = np.zeros((rows, 1), np.float32)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._rows)
        y = top[0].data.reshape(self._rows)
        np.subtract(x, x.mean(axis=1, keepdims=True), out=y)
        if self.normalize_variance:
            std = np.sqrt(np.mean(np.square(y), axis=1, keepdims=True))
            np.add(std, self.eps, out=self._std)
            np.divide(self._std, std, out=self._ratio, where=std > 0)
            self._ratio[std == 0] = 1      # a constant row has y = 0; any finite ratio will do
            y /= self._std

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self._rows)
        dx = bottom[0].diff.reshape(self._rows)
        np.subtract(dy, dy.mean(axis=1, keepdims=True), out=dx)
        if self.normalize_variance:
            # dx = (dy - mean(dy) - y * mean(dy * y) * (std + eps) / std) / (std + eps)
            y = top[0].data.reshape(self._rows)
            dx -= y * (np.mean(dy * y, axis=1, keepdims=True) * self._ratio)
            dx /= self._std
