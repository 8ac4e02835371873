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

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        outer, channels, inner = self.reshape_class_scores(bottom, top, self.param.softmax_param.axis,
                                                           "softmax axis")
        if self.labels is None or self.labels.shape != (outer, inner):
            self.labels = np.empty((outer, inner), np.int64)
            self.scratch = np.empty((outer, 1, inner), np.float32)

    def forward(self, bottom, top):
        outer, channels, inner = self.dims
        prob = self.prob.reshape(self.dims)
        softmax_forward(bottom[0].data.reshape(self.dims), prob, self.scratch)
        labels = labels_as_int(bottom[1].data, self.labels)
        self.valid, self.index = checked_labels(self, labels, channels, self.ignore_label)
        picked = np.take_along_axis(prob, self.index[:, None, :], axis=1)[:, 0, :]
        log_prob = np.log(np.maximum(picked, FLT_MIN), dtype=np.float64)
        loss = -log_prob[self.valid].sum()
        valid = int(np.count_nonzero(self.valid))
        top[0].data[...] = self.global_loss(self.mode, loss, valid, outer, outer * inner)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        weight = self.valid.astype(np.float32) * self.gradient_scale(top)

        def rows(dx, prob, index, weight):
            np.copyto(dx, prob)
            at_label = index[:, None, :]
            np.put_along_axis(dx, at_label, np.take_along_axis(dx, at_label, axis=1) - 1,
                              axis=1)
            np.multiply(dx, weight[:, None, :], out=dx)
        in_rows(rows, bottom[0].diff.reshape(self.dims), self.prob.reshape(self.dims),
                self.index, weight)
