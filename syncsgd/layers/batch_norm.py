"""BatchNorm: normalise each channel by its batch mean and variance (TRAIN) or by the stored
moving averages (use_global_stats), as Caffe's BatchNormLayer; a Scale layer usually follows.

The statistics are over the GLOBAL batch: per-channel sums and the element count go through
ctx.allreduce_sum, so a net split over ranks normalises exactly as one process would.
Blobs (never learned): [0] mean sum, [1] variance sum, [2] the normalising factor, shape (1,);
the moving averages are blobs[0] / blobs[2] and blobs[1] / blobs[2].
"""
import numexpr as ne
import numpy as np

from syncsgd import TEST
from syncsgd.blob import Blob
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class BatchNormLayer(Layer):
    type = "BatchNorm"
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.batch_norm_param
        self._global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                              else self.ctx.phase == TEST)
        self._fraction = p.moving_average_fraction
        self._eps = p.eps
        if bottom[0].num_axes < 1:
            self.fail("bottom must have at least one axis (num)")
        self._channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        if not self.blobs:
            for i, shape in enumerate([(self._channels,), (self._channels,), (1,)]):
                self.blobs.append(Blob(shape, name=f"{self.name}.stat{i}"))
        for i in range(len(self.blobs)):
            if len(self.param.param) == i:
                self.param.param.add(lr_mult=0.0, decay_mult=0.0)
            elif self.param.param[i].lr_mult != 0:
                self.fail(f"param {i} has lr_mult {self.param.param[i].lr_mult}; batch "
                          f"statistics are not learned, set lr_mult: 0 or drop the param entry")
        self._std = np.ones((1, self._channels, 1), np.float32)   # sqrt(var + eps), for backward
        self._shape = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 1 and shape[1] != self._channels:
            self.fail(f"bottom has {shape[1]} channels, the layer was set up for {self._channels}")
        if top[0] is not bottom[0]:
            top[0].reshape(shape)
        n = shape[0]
        self._dims = (n, self._channels, bottom[0].count // max(n * self._channels, 1))
        if shape != self._shape:
            self._shape = shape
            self._x_norm = np.zeros(self._dims, np.float32)  # in-place layers after us clobber top
            self._work = np.zeros(self._dims, np.float32)

    def _channel_sums(self, *arrays):
        """Per-channel float64 sums of (N, C, S) arrays, concatenated."""
        return np.concatenate([a.sum(axis=(0, 2), dtype=np.float64) for a in arrays])

    def forward(self, bottom, top):
        c = self._channels
        x = bottom[0].data.reshape(self._dims)
        y = top[0].data.reshape(self._dims)
        if self._global_stats:
            factor = self.blobs[2].data[0]
            factor = 0.0 if factor == 0 else 1.0 / factor
            mean = self.blobs[0].data * np.float32(factor)
            var = self.blobs[1].data * np.float32(factor)
        else:
            totals = np.append(self._channel_sums(x), x.size / c)
            self.ctx.allreduce_sum(totals)
            self._count = totals[c]
            mean = (totals[:c] / self._count).astype(np.float32)
        np.subtract(x, mean.reshape(1, c, 1), out=y)
        if not self._global_stats:
            np.multiply(y, y, out=self._work)
            var = self.ctx.allreduce_sum(self._channel_sums(self._work)) / self._count
            self._update_moving_averages(mean, var)
        np.sqrt(np.asarray(var, np.float32) + np.float32(self._eps), out=self._std.reshape(c))
        np.divide(y, self._std, out=y)
        np.copyto(self._x_norm, y)

    def _update_moving_averages(self, mean, var):
        m = self._count
        f = np.float32(self._fraction)
        self.blobs[2].data *= f
        self.blobs[2].data += 1
        self.blobs[0].data[...] = mean + f * self.blobs[0].data
        correction = m / (m - 1) if m > 1 else 1.0
        unbiased = np.float32(correction) * var.astype(np.float32)
        self.blobs[1].data[...] = unbiased + f * self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self._dims)
        dx = bottom[0].diff.reshape(self._dims)
        if self._global_stats:
            np.divide(dy, self._std, out=dx)
            return
        c = self._channels
        np.multiply(dy, self._x_norm, out=self._work)
        sums = self.ctx.allreduce_sum(self._channel_sums(dy, self._work)) / self._count
        mean_dy = sums[:c].astype(np.float32).reshape(1, c, 1)
        mean_dy_xn = sums[c:].astype(np.float32).reshape(1, c, 1)
        # dy and dx may be one array (in place); the expression is elementwise.
        ne.evaluate("(dy - a - b * xn) / sd", out=dx,
                    local_dict={"dy": dy, "a": mean_dy, "b": mean_dy_xn, "xn": self._x_norm,
                                "sd": self._std})
