"""The layers only a partitioned net has: a fully connected layer holding a slice of its outputs,
and the three exchanges that move activations between layouts at its boundaries (see groups.py
for the layouts, docs/method.md "Model and hybrid parallelism").

The partitioner (partition.py) writes their internal type names into the net it rewrites; no
user prototxt names them. Importing this module registers them.
"""
import numpy as np

from syncsgd.blob import FeatureSlice
from syncsgd.context import shard_range
from syncsgd.layers.base import Layer, Part
from syncsgd.layers.inner_product import InnerProductLayer
from syncsgd.layers.registry import register

MODEL_PARALLEL_INNER_PRODUCT = "ModelParallelInnerProduct"


@register
class ModelParallelInnerProduct(InnerProductLayer):
    """InnerProduct split by output neurons over a group: this rank holds its slice of the rows of
    the weights and entries of the bias, and sees all of its group's samples. Registered under an
    internal name; the layer, its LayerParameter and saved files say "InnerProduct"."""
    type = MODEL_PARALLEL_INNER_PRODUCT
    internal = True
    sample_wise = False       # its batch is the group's, gathered by the layers around it

    def __init__(self, param, ctx):
        super().__init__(param, ctx)
        self.type = param.type = "InnerProduct"

    def output_range(self, num_output):
        groups = self.ctx.groups
        return shard_range(num_output, groups.rank, groups.size)

    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.inner_product_param
        end = self._first + self._n
        self.blob_parts = {0: Part(1 if p.transpose else 0, self._first, end, p.num_output),
                           1: Part(0, self._first, end, p.num_output)}

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        groups = self.ctx.groups
        first_sample = shard_range(self.ctx.global_batch, groups.group * groups.size,
                                   groups.world_size)[0]
        top[0].layout = FeatureSlice(first_sample, self._first,
                                     self.param.inner_product_param.num_output)


class GroupExchange(Layer):
    """What the three layout exchanges share: one bottom, one top, a group to talk to, and
    (after a model-parallel layer) the bottom's place in the global activation matrix."""
    internal = True
    exact_bottoms = 1
    exact_tops = 1
    needs_layout = False

    def setup(self, bottom, top):
        if self.ctx.groups is None or (self.needs_layout and bottom[0].layout is None):
            self.fail("only the model-parallel partitioner inserts this layer (several ranks)")


@register
class GroupGather(GroupExchange):
    """Data layout -> group layout into a model-parallel layer. Forward gathers the group's
    samples onto every member; backward sums the members' partial input gradients and hands each
    rank those of its own samples (reduce-scatter)."""
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


@register
class FeatureGather(GroupExchange):
    """Model layout -> group layout between two model-parallel layers (fc6 -> fc7). Forward
    gathers every member's feature slice of the group's samples; backward sums the members'
    partial gradients and keeps this rank's features (reduce-scatter)."""
    type = "FeatureGather"
    needs_layout = True

    def reshape(self, bottom, top):
        n = bottom[0].shape[0]
        features = bottom[0].layout.features
        self._cols = self.ctx.groups.feature_counts(features)
        top[0].reshape(n, features)
        self._scratch = np.empty(n * features, np.float32)

    def forward(self, bottom, top):
        self.ctx.groups.gather_features(bottom[0].data.reshape(bottom[0].shape[0], -1),
                                        top[0].data, self._cols, self._scratch)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self.ctx.groups.scatter_feature_sums(
                top[0].diff, bottom[0].diff.reshape(-1), self._cols, self._scratch)


@register
class ModelToData(GroupExchange):
    """Model layout -> data layout where a model-parallel layer feeds an ordinary one (fc8 ->
    loss). Forward is an all-to-all in the group that gives each rank its own samples with every
    feature; backward is the reverse all-to-all."""
    type = "ModelToData"
    needs_layout = True

    def reshape(self, bottom, top):
        groups = self.ctx.groups
        features = bottom[0].layout.features
        self._rows = groups.sample_counts(self.ctx.global_batch)
        self._cols = groups.feature_counts(features)
        mine = self._rows[groups.rank]
        top[0].reshape(mine, features)
        self._scratch = np.empty(max(mine * features, bottom[0].count), np.float32)

    def forward(self, bottom, top):
        self.ctx.groups.model_to_data(bottom[0].data, top[0].data, self._rows, self._cols,
                                      self._scratch)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self.ctx.groups.data_to_model(top[0].diff, bottom[0].diff, self._rows, self._cols,
                                          self._scratch)
