"""CenterLoss (Wen et al., ydwen/caffe-face): half the mean squared distance of each feature to
its class's centre, which pulls features of one class together next to a softmax loss.

The centres are a parameter blob, but their "gradient" is the fork's update rule, not the loss's
derivative: centre j's diff gets -sum(x_i - c_j) / (1 + n_j) over the n_j samples of class j, not
scaled by the loss weight; the solver's learning rate (the paper's alpha) does the rest. On
several ranks n_j counts the global batch (ctx.allreduce_sum in forward), so the ranks' diffs,
summed by the solver's gradient reduction, are one process's.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import canonical_axis
from syncsgd.layers.loss import LossLayer, checked_labels, labels_as_int
from syncsgd.layers.registry import register


@register
class CenterLossLayer(LossLayer):
    type = "CenterLoss"
    fork = "ydwen/caffe-face"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.center_loss_param
        if p.num_output == 0:
            self.fail("center_loss_param.num_output must be set to the number of classes")
        self._n = p.num_output
        self._k = self._features(bottom[0])
        if not self.blobs:
            self.blobs.append(Blob((self._n, self._k), name=f"{self.name}.center"))
            fill(self.blobs[0].data, p.center_filler, self.ctx.rng(self.name, 0))
        elif self.blobs[0].shape != (self._n, self._k):
            self.fail(f"center blob {self.blobs[0].shape} does not fit num_output {self._n} "
                      f"and {self._k} features; it must be ({self._n}, {self._k})")

    def _features(self, blob):
        """K: the features from `axis` on. The fork takes one row per sample (axis 0's)."""
        shape = blob.shape
        axis = canonical_axis(self.param.center_loss_param.axis, blob.num_axes, self)
        if axis == 0 or int(np.prod(shape[1:axis])) != 1:
            self.fail(f"center_loss_param.axis {axis} on bottom {shape}: the features must "
                      f"start after the sample axis with nothing else before them (axis 1)")
        return int(np.prod(shape[axis:]))

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        m, k = bottom[0].shape[0], self._features(bottom[0])
        if k != self._k:
            self.fail(f"bottom {bottom[0].shape} has {k} features, the centres {self._k}")
        if bottom[1].count != m:
            self.fail(f"label bottom {bottom[1].shape} must hold one class index per sample "
                      f"({m})")
        self._m = m
        self._labels = np.zeros(m, np.int64)
        self._distance = np.zeros((m, k), np.float32)      # x_i - c_{y_i}

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._m, self._k)
        _, self.labels = checked_labels(self, labels_as_int(bottom[1].data, self._labels),
                                        self._n, None)
        np.subtract(x, self.blobs[0].data[self.labels], out=self._distance)
        d = self._distance.reshape(-1)
        sums = np.zeros(self._n + 2, np.float64)          # loss sum, samples, per-class counts
        sums[0] = float(np.dot(d, d))
        sums[1] = self._m
        sums[2:] = np.bincount(self.labels, minlength=self._n)
        sums = self.ctx.allreduce_sum(sums)
        self.batch, self.counts = max(sums[1], 1.0), sums[2:]
        top[0].data[...] = sums[0] / self.batch / 2

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if self.propagates_param(0) and self._m:
            # Only the classes in this batch: the centres may be many (one per identity).
            classes, which = np.unique(self.labels, return_inverse=True)
            variation = np.zeros((len(classes), self._k), np.float32)
            np.subtract.at(variation, which, self._distance)
            variation /= (self.counts[classes] + 1).astype(np.float32)[:, None]
            self.blobs[0].diff[classes] += variation
        if propagate_down[0]:
            scale = np.float32(float(top[0].diff.flat[0]) / self.batch)
            np.multiply(self._distance, scale, out=bottom[0].diff.reshape(self._m, self._k))
