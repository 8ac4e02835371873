"""BatchReindex: top[i] = bottom0[bottom1[i]], a gather (with repeats) along the first axis.

bottom 1 is a 1-D blob of indices into bottom 0's first axis; the backward adds each top row's
gradient into the row it came from, and the indices get none.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.embed import integer_indices
from syncsgd.layers.registry import register


@register
class BatchReindex(Layer):
    type = "BatchReindex"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        if bottom[1].num_axes != 1:
            self.fail(f"the indices (bottom 1) must be a 1-D blob, got shape {bottom[1].shape}")
        if bottom[0].num_axes < 1:
            self.fail("bottom 0 needs a first axis to reindex")
        top[0].reshape(bottom[1].shape + bottom[0].shape[1:])

    def forward(self, bottom, top):
        self._index = integer_indices(self, bottom[1].data, bottom[0].shape[0], "index")
        np.take(bottom[0].data, self._index, axis=0, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            self.fail("cannot back-propagate to the indices (bottom 1); set "
                      "`propagate_down: false` for it")
        if propagate_down[0]:
            bottom[0].diff.fill(0)
            np.add.at(bottom[0].diff, self._index, top[0].diff)
