"""ContrastiveLoss: pulls pairs labelled similar together and pushes the others at least
`margin` apart (Hadsell, Chopra and LeCun, "Dimensionality Reduction by Learning an Invariant
Mapping"), for siamese nets.

With d = ||a - b|| per pair: loss = sum(sim d^2 + (1 - sim) max(margin - d, 0)^2) / (2 N);
legacy_version keeps Caffe's first form, max(margin - d^2, 0), for dissimilar pairs. A pair is
similar when its label, truncated to an integer, is not 0.
"""
import numpy as np

from syncsgd.layers.loss import BATCH_SIZE, LossLayer, labels_as_int
from syncsgd.layers.registry import register

# Caffe adds this to d where it divides by it in the gradient (d may be 0).
DISTANCE_EPSILON = np.float32(1e-4)


@register
class ContrastiveLoss(LossLayer):
    type = "ContrastiveLoss"
    exact_bottoms = 3

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.contrastive_loss_param
        self.margin = np.float32(p.margin)
        self.legacy = p.legacy_version
        self.difference = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        a, b, sim = (x.shape for x in bottom)
        if a[:2] != b[:2] or any(d != 1 for d in a[2:] + b[2:]):
            self.fail(f"the two feature bottoms must both be (N, C) or (N, C, 1, 1) with the "
                      f"same N and C, got {a} and {b}")
        num = a[0] if a else 1
        if bottom[2].count != num or any(d != 1 for d in sim[1:]):
            self.fail(f"the similarity bottom must hold one label per pair (shape ({num},) or "
                      f"({num}, 1, 1, 1)), got {sim}")
        shape = (num, bottom[0].count // max(num, 1))
        if self.difference is None or self.difference.shape != shape:
            self.difference = np.empty(shape, np.float32)
            self.similar = np.empty(num, np.int64)

    def allow_force_backward(self, bottom_index):
        """Both feature bottoms take gradients; the similarity labels do not."""
        return bottom_index != 2

    def forward(self, bottom, top):
        d = self.difference                                     # (N, C): a - b
        np.subtract(bottom[0].data.reshape(d.shape), bottom[1].data.reshape(d.shape), out=d)
        dist_sq = np.einsum("nc,nc->n", d, d)
        similar = labels_as_int(bottom[2].data, self.similar) != 0
        if self.legacy:
            gap = self.margin - dist_sq
            dissimilar = np.maximum(gap, 0)
            pull = np.float32(-1)
        else:
            dist = np.sqrt(dist_sq)
            gap = self.margin - dist
            dissimilar = np.maximum(gap, 0) ** 2
            pull = -gap / (dist + DISTANCE_EPSILON)
        # Per pair, d loss / d (a - b) = coefficient * (a - b) / N.
        self.coefficient = np.where(similar, 1, np.where(gap > 0, pull, 0)).astype(np.float32)
        half_sum = 0.5 * np.where(similar, dist_sq, dissimilar).sum(dtype=np.float64)
        num = d.shape[0]
        self.global_loss(top, BATCH_SIZE, half_sum, num, num, num)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[2]:
            self.fail("cannot backpropagate to the similarity labels (bottom 2); set "
                      "`propagate_down: false` for it")
        scale = self.gradient_scale(top)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                np.multiply(self.difference, (sign * scale) * self.coefficient[:, None],
                            out=bottom[i].diff.reshape(self.difference.shape))
