"""SoftmaxWithLoss: multinomial logistic loss of the softmax over `softmax_param.axis`."""
import numpy as np

from syncsgd.layers.loss import (FLT_MIN, VALID, LossLayer, checked_labels, labels_as_int,
                                 normalization_mode)
from syncsgd.layers.registry import register
from syncsgd.layers.softmax import in_rows, softmax_forward


@register
class SoftmaxWithLoss(LossLayer):
    type = "SoftmaxWithLoss"
    exact_tops = None
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.mode = normalization_mode(lp, VALID)
        self.own_prob = None
        self.labels = None
        self.base_dims = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        outer, channels, inner = self.reshape_class_scores(bottom, top, self.param.softmax_param.axis,
                                                           "softmax axis")
        if self.labels is None or self.labels.shape != (outer, inner):
            self.labels = np.empty((outer, inner), np.int64)
            self.at = np.empty((outer, inner), np.int64)
            self.scratch = np.empty((outer, 1, inner), np.float32)
        if self.base_dims != self.dims:
            # Flat index of (sample, class 0, position) in the (outer, C, inner) probabilities:
            # the label's entries are picked by one flat index array (take_along_axis builds
            # its index grids at every call, under the interpreter lock the lanes share).
            self.base = (np.arange(outer)[:, None] * (channels * inner) + np.arange(inner))
            self.base_dims = self.dims

    def forward(self, bottom, top):
        outer, channels, inner = self.dims
        prob = self.prob.reshape(self.dims)
        softmax_forward(bottom[0].data.reshape(self.dims), prob, self.scratch)
        labels = labels_as_int(bottom[1].data, self.labels)
        self.valid, self.index = checked_labels(self, labels, channels, self.ignore_label)
        at = np.multiply(self.index, inner, out=self.at)
        at += self.base
        log_prob = np.log(np.maximum(prob.reshape(-1)[at], FLT_MIN), dtype=np.float64)
        if self.ignore_label is None:
            loss, valid = -log_prob.reshape(-1).sum(), outer * inner
        else:
            loss, valid = -log_prob[self.valid].sum(), int(np.count_nonzero(self.valid))
        self.global_loss(top, self.mode, loss, valid, outer, outer * inner)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        scale = self.gradient_scale(top)
        base, inner = self.base, self.dims[2]

        def rows(dx, prob, index, valid):
            np.copyto(dx, prob)
            at = base[:len(index)] + index * inner      # a piece's rows start at 0, like base's
            dx.reshape(-1)[at] -= 1
            if self.ignore_label is None:
                dx *= scale
            else:
                np.multiply(dx, (valid.astype(np.float32) * scale)[:, None, :], out=dx)
        in_rows(rows, bottom[0].diff.reshape(self.dims), self.prob.reshape(self.dims),
                self.index, self.valid)
