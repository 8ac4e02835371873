"""HingeLoss: the one-against-all hinge loss of a linear SVM on the scores, L1 or L2.

Each sample's scores are its count / N values; with t = +1 for the label's score and -1 for the
others, loss = sum(max(0, 1 - t x)) / N (L1) or sum(max(0, 1 - t x)^2) / N (L2).
"""
import numpy as np

from syncsgd.layers.loss import BATCH_SIZE, LossLayer, checked_labels, labels_as_int
from syncsgd.layers.registry import register
from syncsgd.proto import pb

L1 = pb.HingeLossParameter.L1
L2 = pb.HingeLossParameter.L2


@register
class HingeLoss(LossLayer):
    type = "HingeLoss"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.norm = self.param.hinge_loss_param.norm
        if self.norm not in (L1, L2):
            self.fail(f"hinge_loss_param.norm {self.norm} is unknown; use L1 or L2")
        self.margins = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        num = bottom[0].shape[0] if bottom[0].num_axes else 1
        if bottom[1].count != num:
            self.fail(f"{bottom[1].count} labels for {num} samples; give one label per sample")
        shape = (num, bottom[0].count // max(num, 1))
        if self.margins is None or self.margins.shape != shape:
            self.margins = np.empty(shape, np.float32)
            self.labels = np.empty(num, np.int64)

    def forward(self, bottom, top):
        m = self.margins                                # (N, scores): max(0, 1 - t x)
        num, scores = m.shape
        _, self.index = checked_labels(self, labels_as_int(bottom[1].data, self.labels), scores,
                                       None)
        self.sample_index = np.arange(num)
        np.copyto(m, bottom[0].data.reshape(m.shape))
        m[self.sample_index, self.index] *= -1
        m += 1
        np.maximum(m, 0, out=m)
        flat = m.ravel()
        total = flat.sum(dtype=np.float64) if self.norm == L1 else np.dot(flat, flat)
        self.global_loss(top, BATCH_SIZE, float(total), num, num, num)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        dx = bottom[0].diff.reshape(self.margins.shape)
        scale = self.gradient_scale(top)
        if self.norm == L1:
            np.sign(self.margins, out=dx)
        else:
            np.multiply(self.margins, np.float32(2), out=dx)
        dx[self.sample_index, self.index] *= -1
        dx *= scale
