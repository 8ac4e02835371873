"""SmoothL1Loss (py-faster-rcnn, rbgirshick/caffe-fast-rcnn): the box-regression loss of Fast
and Faster R-CNN, sum(w_out * f(w_in * (x - t))) / N, with f quadratic below 1 / sigma^2 and
linear above. The inside and outside weights (bottoms 2 and 3) come together or not at all, as
in the fork; N is the number of samples (over all ranks), as the fork divides by num."""
import numpy as np

from syncsgd.layers.loss import BATCH_SIZE, LossLayer
from syncsgd.layers.registry import register


def smooth_l1(x, sigma2):
    """(f(x), f'(x)) elementwise, float32, computed as the fork does (in double, then rounded)."""
    x = x.astype(np.float64)
    small = np.abs(x) < 1.0 / sigma2
    value = np.where(small, 0.5 * x * x * sigma2, np.abs(x) - 0.5 / sigma2)
    slope = np.where(small, sigma2 * x, np.sign(x))
    return value.astype(np.float32), slope.astype(np.float32)


@register
class SmoothL1LossLayer(LossLayer):
    type = "SmoothL1Loss"
    fork = "rbgirshick/caffe-fast-rcnn"
    exact_bottoms = None
    min_bottoms = 2
    max_bottoms = 4

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        if len(bottom) == 3:
            self.fail("takes the inside and the outside weights together (bottoms 2 and 3), "
                      "as py-faster-rcnn does; add the outside weights (ones) as a 4th bottom")
        sigma = self.param.smooth_l1_loss_param.sigma
        if not np.isfinite(sigma) or sigma == 0:
            self.fail(f"smooth_l1_loss_param.sigma {sigma} must be finite and non-zero")
        self.sigma2 = float(np.float32(sigma) * np.float32(sigma))

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        for i, blob in enumerate(bottom[1:], 1):
            if blob.shape != bottom[0].shape:
                self.fail(f"bottom {i} {blob.shape} must have the predictions' shape "
                          f"{bottom[0].shape}")

    def forward(self, bottom, top):
        diff = bottom[0].data - bottom[1].data
        if len(bottom) == 4:
            diff *= bottom[2].data
        errors, self.slope = smooth_l1(diff, self.sigma2)
        if len(bottom) == 4:
            errors *= bottom[3].data
            self.slope *= bottom[2].data * bottom[3].data
        rows = bottom[0].shape[0] if bottom[0].num_axes else 1
        total = float(errors.sum(dtype=np.float64))
        self.global_loss(top, BATCH_SIZE, total, rows, rows, rows)

    def backward(self, top, propagate_down, bottom):
        scale = self.gradient_scale(top)
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                np.multiply(self.slope, np.float32(sign) * scale, out=bottom[i].diff)
