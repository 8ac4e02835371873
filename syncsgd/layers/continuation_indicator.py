"""ContinuationIndicator (jolibrain/caffe): the (time_step, N) sequence indicators Caffe's LSTM
takes as its second bottom, 0 at the first step and 1 after, so that each batch is one sequence
per stream; N is the size of the bottom's axis `axis`, whose values are not read."""
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class ContinuationIndicatorLayer(Layer):
    type = "ContinuationIndicator"
    fork = "jolibrain/caffe"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.continuation_indicator_param
        self.time_step, self.axis = p.time_step, p.axis
        if self.time_step <= 0:
            self.fail("continuation_indicator_param.time_step must be set to the number of "
                      "time steps (positive)")

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        axes = bottom[0].num_axes
        if not -axes <= self.axis < axes:
            self.fail(f"continuation_indicator_param.axis {self.axis} is not an axis of the "
                      f"bottom {bottom[0].shape}; name its batch axis")
        top[0].reshape(self.time_step, bottom[0].shape[self.axis])

    def forward(self, bottom, top):
        top[0].data[0] = 0
        top[0].data[1:] = 1
