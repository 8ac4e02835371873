"""Split: hands one blob to several consumers; their gradients add up."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class Split(Layer):
    type = "Split"
    exact_bottoms = 1
    min_tops = 1
    feature_local = True
    sample_wise = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        for t in top:
            t.reshape_like(bottom[0])

    def forward(self, bottom, top):
        # Copies, not shared arrays: a consumer working in place must not change its siblings.
        for t in top:
            np.copyto(t.data, bottom[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        np.copyto(dx, top[0].diff)
        for t in top[1:]:
            np.add(dx, t.diff, out=dx)
