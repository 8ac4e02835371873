"""LabelSpecificAdd (AM-Softmax, happynear/caffe-windows): adds `bias` (AM-Softmax's -m) to each
sample's target score, only where the score is above -bias; the gradient passes through
unchanged, as in the fork.

As in the fork, the TEST phase copies the scores unchanged whatever transform_test says (its
TRAIN-only flag never lets TEST add) and leaves the optional second top, the bias, at 0. With
bias_base set, the bias anneals: bias_base + (1 + bias_gamma * iter)^bias_power - 1, clipped to
[bias_min, bias_max], iter being `iteration` + the forward passes so far (ctx.iteration, the same
on every rank; the fork counts its own passes, which restart at `iteration` on resume).
"""
import numpy as np

from syncsgd import TEST
from syncsgd.layers.base import Layer
from syncsgd.layers.loss import checked_labels, labels_as_int
from syncsgd.layers.registry import register


def annealed_bias(p, iteration):
    """The fork's schedule, in float32."""
    f = np.float32
    bias = f(p.bias_base) + np.power(f(1) + f(p.bias_gamma) * f(iteration), f(p.bias_power)) - 1
    return min(max(f(bias), f(p.bias_min)), f(p.bias_max))


@register
class LabelSpecificAddLayer(Layer):
    type = "LabelSpecificAdd"
    fork = "happynear/caffe-windows"
    min_bottoms = 2
    min_tops = 1
    max_tops = 2
    in_place_ok = True

    @property
    def sample_wise(self):
        """Per sample, unless a second top holds the (whole-batch) bias."""
        return len(self.param.top) == 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 1:
            self.fail("bottom 0 must have a sample axis (N, classes...)")
        num = bottom[0].shape[0]
        if bottom[1].count != num:
            self.fail(f"label bottom {bottom[1].shape} must hold one class index per sample "
                      f"of {bottom[0].shape}")
        if top[0] is not bottom[0]:
            top[0].reshape_like(bottom[0])
        if len(top) > 1:
            top[1].reshape(1)
        self._rows = (num, bottom[0].count // max(num, 1))     # (N, dim)
        self._labels = np.zeros(num, np.int64)

    def forward(self, bottom, top):
        if top[0] is not bottom[0]:
            top[0].data[...] = bottom[0].data
        if self.ctx.phase == TEST:
            if len(top) > 1:
                top[1].data[...] = 0
            return
        p = self.param.label_specific_add_param
        bias = (annealed_bias(p, p.iteration + self.ctx.iteration) if p.HasField("bias_base")
                else np.float32(p.bias))
        if len(top) > 1:
            top[1].data[...] = bias
        _, labels = checked_labels(self, labels_as_int(bottom[1].data, self._labels),
                                   self._rows[1], None)
        y = top[0].data.reshape(self._rows)
        rows = np.arange(self._rows[0])
        target = y[rows, labels]
        y[rows, labels] = np.where(target > -bias, target + bias, target)

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 1 and propagate_down[1]:
            self.fail("cannot backpropagate to the labels (bottom 1); "
                      "set `propagate_down: false` for it")
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = top[0].diff
