"""GroupGather: data layout -> group layout at the boundary into a model-parallel layer.

Inserted by the partitioner (syncsgd/parallel/partition.py), never written by hand. Forward gathers
the group's samples onto every member; backward sums the members' partial input gradients and
hands each rank those of its own samples (reduce-scatter), PAPER.md section 2."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


class GroupExchange(Layer):
    """What the three layout-exchange layers share: one bottom, one top, a group to talk to, and
    (after a model-parallel layer) the bottom's place in the global activation matrix."""
    exact_bottoms = 1
    exact_tops = 1
    needs_layout = False

    def setup(self, bottom, top):
        if self.ctx.groups is None or (self.needs_layout and bottom[0].layout is None):
            self.fail("only the model-parallel partitioner inserts this layer (several ranks)")


@register
class GroupGatherLayer(GroupExchange):
    type = "GroupGather"

    def reshape(self, bottom, top):
        self._rows = self.ctx.groups.sample_counts(self.ctx.global_batch)
        top[0].reshape((sum(self._rows),) + bottom[0].shape[1:])

    def forward(self, bottom, top):
        self.ctx.groups.gather_samples(np.ascontiguousarray(bottom[0].data), top[0].data,
                                       self._rows)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self.ctx.groups.scatter_sample_sums(top[0].diff, bottom[0].diff, self._rows)
