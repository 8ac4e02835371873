"""ShuffleChannel (ShuffleNet, farmingyard/ShuffleNet): channel c of group g moves to position
c * group + g, so that the next grouped convolution sees channels of every group."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class ShuffleChannelLayer(Layer):
    type = "ShuffleChannel"
    fork = "farmingyard/ShuffleNet"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.group = self.param.shuffle_channel_param.group
        if self.group <= 0:
            self.fail("shuffle_channel_param.group must be positive")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 2 or shape[1] % self.group:
            self.fail(f"shuffle_channel_param.group {self.group} must divide the channels of "
                      f"the bottom {shape}")
        top[0].reshape_like(bottom[0])
        n, c = shape[:2]
        # (n, group, c / group, rest) in the bottom is (n, c / group, group, rest) in the top.
        self._grouped = (n, self.group, c // self.group, -1)
        self._shuffled = (n, c // self.group, self.group, -1)

    def forward(self, bottom, top):
        np.copyto(top[0].data.reshape(self._shuffled),
                  bottom[0].data.reshape(self._grouped).transpose(0, 2, 1, 3))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.copyto(bottom[0].diff.reshape(self._grouped),
                      top[0].diff.reshape(self._shuffled).transpose(0, 2, 1, 3))
