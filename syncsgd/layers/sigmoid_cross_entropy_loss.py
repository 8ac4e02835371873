"""SigmoidCrossEntropyLoss: cross-entropy of sigmoid(x) against targets in [0, 1]."""
import numexpr as ne
import numpy as np

from syncsgd.layers.loss import BATCH_SIZE, LossLayer, labels_as_int, normalization_mode
from syncsgd.layers.registry import register
from syncsgd.layers.sigmoid import sigmoid


@register
class SigmoidCrossEntropyLoss(LossLayer):
    type = "SigmoidCrossEntropyLoss"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        # Unlike SoftmaxWithLoss, Caffe divides by the batch size unless told otherwise.
        self.mode = normalization_mode(lp, BATCH_SIZE)
        self.terms = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            self.fail(f"the input {bottom[0].shape} and target {bottom[1].shape} bottoms must "
                      f"have the same number of elements")
        if self.terms is None or self.terms.shape != bottom[0].shape:
            self.terms = np.empty(bottom[0].shape, np.float32)
            self.int_targets = np.empty(bottom[0].shape, np.int64)

    def forward(self, bottom, top):
        x, t = bottom[0].data, bottom[1].data.reshape(bottom[0].shape)
        # -[t log s(x) + (1 - t) log(1 - s(x))], written so exp never overflows.
        ne.evaluate("log1p(exp(-abs(x))) - x * (t - where(x >= 0, 1, 0))", out=self.terms)
        if self.ignore_label is None:
            self.valid = None
            loss = self.terms.sum(dtype=np.float64)
            valid = self.terms.size
        else:
            self.valid = labels_as_int(t, self.int_targets) != self.ignore_label
            loss = self.terms[self.valid].sum(dtype=np.float64)
            valid = int(np.count_nonzero(self.valid))
        batch = x.shape[0] if x.ndim else 1
        self.global_loss(top, self.mode, loss, valid, batch, x.size)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        sigmoid(bottom[0].data, dx)
        np.subtract(dx, bottom[1].data.reshape(dx.shape), out=dx)
        if self.valid is not None:
            np.multiply(dx, self.valid, out=dx)
        np.multiply(dx, self.gradient_scale(top), out=dx)
