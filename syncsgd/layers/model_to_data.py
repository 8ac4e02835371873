"""ModelToData: model layout -> data layout where a model-parallel layer feeds an ordinary one
(fc8 -> loss). Inserted by the partitioner. Forward is an all-to-all in the group that gives each
rank its own samples with every feature; backward is the reverse all-to-all."""
import numpy as np

from syncsgd.layers.group_gather import GroupExchange
from syncsgd.layers.registry import register


@register
class ModelToDataLayer(GroupExchange):
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
