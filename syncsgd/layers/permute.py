"""Permute (SSD, weiliu89/caffe): reorders the axes, e.g. (N, C, H, W) -> (N, H, W, C) so that a
detection head's per-location predictions lie next to each other before Flatten."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class PermuteLayer(Layer):
    type = "Permute"
    fork = "weiliu89/caffe (ssd)"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        order = list(self.param.permute_param.order)
        axes = bottom[0].num_axes
        if any(o >= axes for o in order) or len(set(order)) != len(order):
            self.fail(f"permute_param order {order} must name distinct axes of the "
                      f"{axes}-axis bottom")
        # Axes the order leaves out follow in their old order, as in SSD.
        self.order = order + [a for a in range(axes) if a not in order]
        self.inverse = list(np.argsort(self.order))

    def reshape(self, bottom, top):
        if bottom[0].num_axes != len(self.order):
            self.fail(f"bottom has {bottom[0].num_axes} axes, {len(self.order)} at setup")
        top[0].reshape(*(bottom[0].shape[a] for a in self.order))

    def forward(self, bottom, top):
        np.copyto(top[0].data, bottom[0].data.transpose(self.order))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.copyto(bottom[0].diff, top[0].diff.transpose(self.inverse))
