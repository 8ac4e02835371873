"""MultinomialLogisticLoss: -log of the probability given to the label, for nets whose last
layer already outputs probabilities (a Softmax); SoftmaxWithLoss is the stable fused form.

loss = -sum(log(max(p[n, label_n], 1e-20))) / N, each sample's probabilities being its
count / N values.
"""
import numpy as np

from syncsgd.layers.loss import (BATCH_SIZE, LOG_THRESHOLD, LossLayer, checked_labels,
                                 labels_as_int)
from syncsgd.layers.registry import register


@register
class MultinomialLogisticLoss(LossLayer):
    type = "MultinomialLogisticLoss"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.labels = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        num = bottom[0].shape[0] if bottom[0].num_axes else 1
        if bottom[1].count != num or any(d != 1 for d in bottom[1].shape[1:]):
            self.fail(f"the label bottom must hold one label per sample (shape ({num},) or "
                      f"({num}, 1, 1, 1)), got {bottom[1].shape}")
        self.dims = (num, bottom[0].count // max(num, 1))
        if self.labels is None or self.labels.shape != (num,):
            self.labels = np.empty(num, np.int64)

    def forward(self, bottom, top):
        num, classes = self.dims
        _, self.index = checked_labels(self, labels_as_int(bottom[1].data, self.labels),
                                       classes, None)
        self.sample_index = np.arange(num)
        prob = bottom[0].data.reshape(self.dims)[self.sample_index, self.index]
        self.picked = np.maximum(prob, LOG_THRESHOLD)
        loss = -np.log(self.picked, dtype=np.float64).sum()
        self.global_loss(top, BATCH_SIZE, loss, num, num, num)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        dx = bottom[0].diff.reshape(self.dims)
        dx.fill(0)
        dx[self.sample_index, self.index] = -self.gradient_scale(top) / self.picked
