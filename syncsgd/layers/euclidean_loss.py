"""EuclideanLoss: sum((a - b)^2) / (2 N), N the (global) batch size."""
import numpy as np

from syncsgd.layers.loss import BATCH_SIZE, LossLayer
from syncsgd.layers.registry import register


@register
class EuclideanLoss(LossLayer):
    type = "EuclideanLoss"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.difference = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            self.fail(f"the bottoms {bottom[0].shape} and {bottom[1].shape} must have the same "
                      f"number of elements")
        if self.difference is None or self.difference.shape != bottom[0].shape:
            self.difference = np.empty(bottom[0].shape, np.float32)

    def allow_force_backward(self, bottom_index):
        """Both bottoms are predictions or targets that may be learned, as in Caffe."""
        return True

    def forward(self, bottom, top):
        d = self.difference
        np.subtract(bottom[0].data, bottom[1].data.reshape(d.shape), out=d)
        half_sum = 0.5 * float(np.dot(d.ravel(), d.ravel()))
        batch = d.shape[0] if d.ndim else 1
        self.global_loss(top, BATCH_SIZE, half_sum, d.size, batch, d.size)

    def backward(self, top, propagate_down, bottom):
        # Both bottoms are inputs here (no labels): d/da = (a - b) / N, d/db = -(a - b) / N.
        scale = self.gradient_scale(top)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                np.multiply(self.difference, sign * scale,
                            out=bottom[i].diff.reshape(self.difference.shape))
