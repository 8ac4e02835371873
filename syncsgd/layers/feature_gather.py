"""FeatureGather: model layout -> group layout between two model-parallel layers (fc6 -> fc7).

Inserted by the partitioner. Forward gathers every member's feature slice of the group's samples;
backward sums the members' partial gradients and keeps this rank's features (reduce-scatter)."""
import numpy as np

from syncsgd.layers.group_gather import GroupExchange
from syncsgd.layers.registry import register


@register
class FeatureGatherLayer(GroupExchange):
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
