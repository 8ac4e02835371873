"""MVN: subtract each sample's mean, per channel or across channels, and with normalize_variance
divide by the standard deviation plus eps.

Caffe's MVN reads the bottom as legacy 4-D (num, channels, height, width), so it takes at most 4
axes and its top is always 4-D.

The backward is Caffe's formula, dx = (dy - mean(dy) - y * mean(dy * y)) / (std + eps), which is
not quite the gradient of this forward: the exact one has the last term times (std + eps) / std.
The two agree while eps is small against the std (the default 1e-9); with eps 0.01 and unit std
they differ by about 5e-3 of the gradient's scale (tests/test_oracle.py measures it). syncsgd
follows Caffe, so that training an MVN net gives Caffe's results.
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

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.num_axes > 4:
            self.fail(f"takes at most 4 axes (num, channels, height, width), got shape {b.shape}")
        top[0].reshape(b.num, b.channels, b.height, b.width)
        rows = b.num if self.across_channels else b.num * b.channels
        self._rows = (rows, b.count // rows if rows else 0)
        if self._std.shape != (rows, 1):
            self._std = np.zeros((rows, 1), np.float32)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._rows)
        y = top[0].data.reshape(self._rows)
        np.subtract(x, x.mean(axis=1, keepdims=True), out=y)
        if self.normalize_variance:
            np.sqrt(np.mean(np.square(y), axis=1, keepdims=True), out=self._std)
            self._std += self.eps
            y /= self._std

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self._rows)
        dx = bottom[0].diff.reshape(self._rows)
        np.subtract(dy, dy.mean(axis=1, keepdims=True), out=dx)
        if self.normalize_variance:
            y = top[0].data.reshape(self._rows)
            dx -= y * np.mean(dy * y, axis=1, keepdims=True)
            dx /= self._std
