"""MarginInnerProduct (SphereFace's A-Softmax, wy1iu/sphereface): an inner product with unit-norm
weight rows whose target score |x| cos(theta) becomes |x| psi(theta), psi(theta) = (-1)^k
cos(m theta) - 2k on theta's k-th interval (m = 1..4 for type SINGLE..QUADRUPLE), blended with
the plain score by lambda, which anneals over the iterations so training starts as a softmax.

As in the fork, forward rescales the weight rows to unit norm in place (the solver then updates
the unit rows), the weight gradient is the plain inner product's (it ignores the margin and the
normalisation), and the bottom gradient of each target score is the true one with its two
coefficients (on w and on x) scaled to a unit vector: training with the fork's weights and
schedule needs its update, not the exact gradient.

lambda's iteration is `iteration` + the forward passes so far + 1 (ctx.iteration, the same on
every rank; the fork counts its own passes, which restart at `iteration` on resume).
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.kernels.blas import gemm
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.loss import checked_labels, labels_as_int
from syncsgd.layers.registry import register
from syncsgd.proto import pb

MARGIN = pb.MarginInnerProductParameter


def lambda_at(p, iteration):
    """The fork's schedule in float32: max(base * (1 + gamma * iter)^-power, lambda_min)."""
    f = np.float32
    lam = f(p.base) * np.power(f(1) + f(p.gamma) * f(iteration), -f(p.power))
    return max(f(lam), f(p.lambda_min))


def psi_and_coefficients(kind, c, x_norm):
    """For cos(theta) `c` of each target score: psi, and the (coeff_w, coeff_x) of
    d(|x| psi)/dx = coeff_w * w + coeff_x * x scaled to unit length, as the fork uses them."""
    s0 = np.sign(c)
    c2 = c * c
    if kind == MARGIN.DOUBLE:
        psi = 2 * s0 * c2 - 1
        cw = 4 * s0 * c
        cx = -(2 * s0 * c2 + 1) / x_norm
    elif kind == MARGIN.TRIPLE:
        s1 = np.sign(np.abs(c) - np.float32(0.5))
        s2 = s0 * (1 + s1) - 2
        psi = s1 * (4 * c2 * c - 3 * c) + s2
        cw = s1 * (12 * c2 - 3)
        cx = -(8 * s1 * c2 * c - s2) / x_norm
    else:
        s3 = s0 * np.sign(2 * c2 - 1)
        s4 = 2 * s0 + s3 - 3
        psi = s3 * (8 * c2 * c2 - 8 * c2 + 1) + s4
        cw = s3 * (32 * c2 * c - 16 * c)
        cx = -(s3 * (24 * c2 * c2 - 8 * c2 - 1) - s4) / x_norm
    norm = np.sqrt(cw * cw + cx * cx)
    return psi, cw / norm, cx / norm


@register
class MarginInnerProductLayer(Layer):
    type = "MarginInnerProduct"
    fork = "wy1iu/sphereface"
    exact_bottoms = 2
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.margin_inner_product_param
        if p.num_output == 0:
            self.fail("margin_inner_product_param.num_output must be set to the number of "
                      "classes")
        self._n = p.num_output
        self._k = self._split(bottom[0])[1]
        if not self.blobs:
            self.blobs.append(Blob((self._n, self._k), name=f"{self.name}.weight"))
            fill(self.blobs[0].data, p.weight_filler, self.ctx.rng(self.name, 0))
        elif self.blobs[0].shape != (self._n, self._k):
            self.fail(f"weight blob {self.blobs[0].shape} does not fit num_output {self._n} "
                      f"and {self._k} inputs; it must be ({self._n}, {self._k})")

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def _split(self, blob):
        axis = canonical_axis(self.param.margin_inner_product_param.axis, blob.num_axes, self)
        return int(np.prod(blob.shape[:axis])), int(np.prod(blob.shape[axis:])), axis

    def reshape(self, bottom, top):
        m, k, axis = self._split(bottom[0])
        if k != self._k:
            self.fail(f"bottom shape {bottom[0].shape} gives {k} inputs from axis {axis}, but "
                      f"the weights take {self._k}; fix the bottom shape or "
                      f"margin_inner_product_param.axis")
        if bottom[1].count != m:
            self.fail(f"{bottom[1].count} labels for {m} rows of {bottom[0].shape}: the label "
                      f"bottom needs one class index per row")
        self._m = m
        top[0].reshape(bottom[0].shape[:axis] + (self._n,))
        if len(top) > 1:
            top[1].reshape(1)
        self._labels = np.zeros(m, np.int64)

    def forward(self, bottom, top):
        p = self.param.margin_inner_product_param
        self.lam = lambda_at(p, p.iteration + self.ctx.iteration + 1)
        if len(top) > 1:
            top[1].data[...] = self.lam
        w = self.blobs[0].data
        norms = np.sqrt(np.einsum("nk,nk->n", w, w))
        if not norms.all():
            self.fail(f"weight row {int(np.flatnonzero(norms == 0)[0])} is all zeros and "
                      f"cannot be normalised; set margin_inner_product_param.weight_filler")
        w *= (np.float32(1) / norms)[:, None]
        x = bottom[0].data.reshape(self._m, self._k)
        _, self.labels = checked_labels(self, labels_as_int(bottom[1].data, self._labels),
                                        self._n, None)
        y = top[0].data.reshape(self._m, self._n)
        gemm(x, w.T, y)
        if p.type == MARGIN.SINGLE:
            return
        rows = np.arange(self._m)
        self.x_norm = np.sqrt(np.einsum("mk,mk->m", x, x))
        target = y[rows, self.labels]                               # (M,) x . w_label
        psi, self.coeff_w, self.coeff_x = psi_and_coefficients(
            p.type, target / self.x_norm, self.x_norm)
        # As the fork's GPU kernel: only the target scores change.
        y[rows, self.labels] = (self.lam * target + self.x_norm * psi) / (1 + self.lam)

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 1 and propagate_down[1]:
            self.fail("cannot backpropagate to the labels (bottom 1); "
                      "set `propagate_down: false` for it")
        dy = top[0].diff.reshape(self._m, self._n)
        x = bottom[0].data.reshape(self._m, self._k)
        w = self.blobs[0].data
        if self.propagates_param(0):
            diff, beta = self.blobs[0].gradient_target()
            gemm(dy.T, x, diff, beta=beta)
        if not propagate_down[0]:
            return
        dx = bottom[0].diff.reshape(self._m, self._k)
        gemm(dy, w, dx)
        if self.param.margin_inner_product_param.type == MARGIN.SINGLE:
            return
        # dx above has dy * w_label for each target; the fork's is
        # (dy / (1 + lambda)) * (coeff_w * w_label + coeff_x * x) + dy * lambda / (1 + lambda)
        # * w_label.
        dy_t = dy[np.arange(self._m), self.labels] / (1 + self.lam)
        dx += ((self.coeff_w - 1) * dy_t)[:, None] * w[self.labels]
        dx += (self.coeff_x * dy_t)[:, None] * x
