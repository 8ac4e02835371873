"""BN: the batch norm of Caffe's segmentation forks, normalisation and a learned per-channel scale
and shift in one layer, as two families of forks define it under one type name:

- PSPNet's (hszhao/PSPNet; brocolli-caffe): bn_param slope_filler, bias_filler, momentum, eps,
  frozen. Blobs (1, C, 1, 1): [0] slope, [1] bias, [2] moving mean, [3] moving variance. TRAIN
  normalises by the batch's statistics and moves the averages (avg = (1 - momentum) * batch +
  momentum * avg, variance biased); TEST, or frozen, by the moving averages (frozen also learns
  neither slope nor bias: the fork forces those lr_mult to 0, as it does for blobs 2 and 3).
- SegNet's and ENet's (alexgkendall/caffe-segnet, TimoSaemann/caffe-enet): bn_param
  scale_filler, shift_filler, bn_mode. Blobs (1, C, 1, 1): [0] scale, [1] shift. bn_mode LEARN
  (whatever the phase) normalises by the batch's statistics with eps 1e-9 and may give the batch
  mean and (biased) variance as tops 2 and 3; INFERENCE is y = scale * x + shift, the statistics
  having been folded into scale and shift by SegNet's compute_bn_statistics.py.

A layer whose bn_param sets fields of neither family follows PSPNet's. Batch statistics are the
GLOBAL batch's (sums through ctx.allreduce_sum), so ranks normalise as one process would.
Difference from PSPNet's fork: backward in TEST (not frozen) is the gradient of what forward
computed (the moving averages are constants), where the fork applies its batch-statistics formula.
"""
import numexpr as ne
import numpy as np

from syncsgd import TRAIN
from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

PSPNET_FIELDS = ("slope_filler", "bias_filler", "momentum", "eps", "frozen")
SEGNET_FIELDS = ("scale_filler", "shift_filler", "bn_mode")
SEGNET_EPS = 1e-9     # fixed in SegNet's bn_layer.cpp


@register
class BNLayer(Layer):
    type = "BN"
    fork = "hszhao/PSPNet, alexgkendall/caffe-segnet"
    exact_bottoms = 1
    min_tops = 1
    max_tops = 3
    in_place_ok = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.bn_param
        segnet = [f for f in SEGNET_FIELDS if p.HasField(f)]
        pspnet = [f for f in PSPNET_FIELDS if p.HasField(f)]
        if segnet and pspnet:
            self.fail(f"bn_param mixes SegNet's fields ({', '.join(segnet)}) with PSPNet's "
                      f"({', '.join(pspnet)}); the two forks' BN differ, keep one fork's fields")
        if bottom[0].num_axes < 2:
            self.fail(f"bottom must have a channel axis, got shape {bottom[0].shape}")
        self.segnet = bool(segnet)
        if self.segnet:
            learn = p.bn_mode == pb.BNParameter.LEARN
            self.stats = "batch" if learn else "none"
            self.eps = SEGNET_EPS
            self.learns_params = True
            fillers = (p.scale_filler, p.shift_filler)
            if not learn and len(top) > 1:
                self.fail("bn_mode INFERENCE gives one top; the batch mean and variance tops "
                          "exist in bn_mode LEARN only")
        else:
            if len(top) > 1:
                self.fail("PSPNet's BN gives one top (SegNet's, with bn_mode: LEARN, gives the "
                          "batch mean and variance as tops 2 and 3)")
            if not 0 <= p.momentum <= 1:
                self.fail(f"bn_param.momentum {p.momentum} must be in [0, 1]")
            if p.eps <= 0:
                self.fail(f"bn_param.eps {p.eps} must be positive")
            moving = p.frozen or self.ctx.phase != TRAIN
            self.stats = "moving" if moving else "batch"
            self.eps = p.eps
            self.momentum = np.float32(p.momentum)
            self.learns_params = not p.frozen
            fillers = (p.slope_filler, p.bias_filler)
        self._channels = bottom[0].shape[1]
        if not self.blobs:
            shape = (1, self._channels, 1, 1)
            for role, filler in zip(("scale", "shift"), fillers):
                blob = Blob(shape, name=f"{self.name}.{role}")
                fill(blob.data, filler, self.ctx.rng(self.name, len(self.blobs)))
                self.blobs.append(blob)
            if not self.segnet:
                self.blobs.append(Blob(shape, name=f"{self.name}.mean"))
                self.blobs.append(Blob(shape, name=f"{self.name}.variance"))
                self.blobs[3].data[...] = 1.0 if p.frozen else 0.0
        want = 2 if self.segnet else 4
        if len(self.blobs) != want:
            self.fail(f"has {len(self.blobs)} blobs; this fork's BN has {want}")
        if not self.segnet:
            self._fix_param_specs(frozen=p.frozen)
        self._inv_std = np.ones((1, self._channels, 1), np.float32)
        self._shape = None

    def _fix_param_specs(self, frozen):
        """The fork's rule: the statistics (and, frozen, slope and bias) are never learned."""
        while len(self.param.param) < 4:
            self.param.param.add()
        for k in (0, 1, 2, 3) if frozen else (2, 3):
            self.param.param[k].lr_mult = 0.0
            self.param.param[k].decay_mult = 0.0

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 2 or shape[1] != self._channels:
            self.fail(f"bottom {shape} must have the {self._channels} channels the layer was "
                      f"set up for")
        if top[0] is not bottom[0]:
            top[0].reshape(shape)
        for extra in top[1:]:
            extra.reshape(1, self._channels, 1, 1)
        n = shape[0]
        self._dims = (n, self._channels, bottom[0].count // max(n * self._channels, 1))
        if shape != self._shape:
            self._shape = shape
            self._x_norm = np.zeros(self._dims, np.float32)   # kept: in-place layers clobber top
            self._work = np.zeros(self._dims, np.float32)

    def _channel_sums(self, *arrays):
        """Per-channel float64 sums of (N, C, S) arrays, concatenated."""
        return np.concatenate([a.sum(axis=(0, 2), dtype=np.float64) for a in arrays])

    def _per_channel(self, blob):
        return blob.data.reshape(1, self._channels, 1)

    def forward(self, bottom, top):
        c = self._channels
        x = bottom[0].data.reshape(self._dims)
        xn = self._x_norm
        if self.stats == "none":
            np.copyto(xn, x)
        elif self.stats == "moving":
            mean = self._per_channel(self.blobs[2])
            np.sqrt(self._per_channel(self.blobs[3]) + np.float32(self.eps), out=self._inv_std)
            np.reciprocal(self._inv_std, out=self._inv_std)
            np.subtract(x, mean, out=xn)
            xn *= self._inv_std
        else:
            totals = self.ctx.allreduce_sum(np.append(self._channel_sums(x), x.size / c))
            self._count = totals[c]
            mean = totals[:c] / self._count
            np.subtract(x, mean.astype(np.float32).reshape(1, c, 1), out=xn)
            np.multiply(xn, xn, out=self._work)
            var = self.ctx.allreduce_sum(self._channel_sums(self._work)) / self._count
            self._inv_std[...] = (1.0 / np.sqrt(var + self.eps)).reshape(1, c, 1)
            xn *= self._inv_std
            self._record_statistics(top, mean, var)
        y = top[0].data.reshape(self._dims)
        ne.evaluate("xn * scale + shift", out=y,
                    local_dict={"xn": xn, "scale": self._per_channel(self.blobs[0]),
                                "shift": self._per_channel(self.blobs[1])})

    def _record_statistics(self, top, mean, var):
        """SegNet's extra tops; PSPNet's moving averages."""
        if self.segnet:
            for blob, value in zip(top[1:], (mean, var)):
                blob.data.reshape(-1)[...] = value
            return
        keep = self.momentum
        for blob, value in zip(self.blobs[2:], (mean, var)):
            flat = blob.data.reshape(-1)
            flat[...] = (1 - keep) * value.astype(np.float32) + keep * flat

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self._dims)
        xn = self._x_norm
        local = self._channel_sums(dy, ne.evaluate("dy * xn", out=self._work))  # [sum dy, dy*xn]
        # Parameter gradients first: in place, the bottom diff overwrites the top diff.
        if self.learns_params:
            c = self._channels
            for k, sums in ((0, local[c:]), (1, local[:c])):
                if self.propagates_param(k):
                    self.blobs[k].diff.reshape(-1)[...] += sums.astype(np.float32)
        if not propagate_down[0]:
            return
        scale = self._per_channel(self.blobs[0])
        dx = bottom[0].diff.reshape(self._dims)
        if self.stats != "batch":
            np.multiply(dy, scale * self._inv_std, out=dx)
            return
        c = self._channels
        means = self.ctx.allreduce_sum(local) / self._count
        mean_dy = means[:c].astype(np.float32).reshape(1, c, 1)
        mean_dy_xn = means[c:].astype(np.float32).reshape(1, c, 1)
        # dy and dx may be one array (in place); the expression is elementwise.
        ne.evaluate("scale * sd * (dy - a - b * xn)", out=dx,
                    local_dict={"dy": dy, "a": mean_dy, "b": mean_dy_xn, "xn": xn,
                                "scale": scale, "sd": self._inv_std})
