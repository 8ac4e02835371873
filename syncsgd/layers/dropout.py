"""Dropout (inverted, as Caffe): in TRAIN keep each value with probability 1 - ratio and scale the
kept ones by 1 / (1 - ratio); in TEST pass values through. With Fast R-CNN's
`scale_train: false` the kept values stay as they are and TEST scales by 1 - ratio instead.

The mask row of a sample depends only on (seed, layer, iteration, global sample index), so a batch
split over ranks drops exactly what one process dropping the whole batch would.
"""
import numpy as np

from syncsgd import TRAIN
from syncsgd.context import uniform_rows
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class DropoutLayer(Layer):
    type = "Dropout"
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True
    feature_local = True      # the mask follows the bottom's layout (a feature slice)

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        ratio = self.param.dropout_param.dropout_ratio
        if not 0.0 <= ratio < 1.0:
            self.fail(f"dropout_param.dropout_ratio is {ratio}; it must be in [0, 1)")
        self._ratio = np.float32(ratio)
        if self.param.dropout_param.scale_train:
            self._scale, self._test_scale = np.float32(1.0 / (1.0 - ratio)), None
        else:
            self._scale, self._test_scale = np.float32(1.0), np.float32(1.0 - ratio)
        self._mask = np.zeros(0, np.float32)
        self._keep = np.zeros(0, bool)

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 1:
            self.fail("bottom must have a sample axis (axis 0)")
        if top[0] is not bottom[0]:
            top[0].reshape_like(bottom[0])
        n = bottom[0].shape[0]
        self._rows = (n, bottom[0].count // n if n else 0)
        if self._mask.shape != self._rows:
            self._mask = np.zeros(self._rows, np.float32)
            self._keep = np.zeros(self._rows, bool)

    def forward(self, bottom, top):
        if self.ctx.phase != TRAIN:
            if self._test_scale is not None:
                np.multiply(bottom[0].data, self._test_scale, out=top[0].data)
            elif top[0] is not bottom[0]:
                np.copyto(top[0].data, bottom[0].data)
            return
        n, row_size = self._rows
        layout = bottom[0].layout
        if layout is None:
            u = uniform_rows(self.ctx.seed, (self.name, self.ctx.iteration),
                             self.ctx.batch_offset, n, row_size)
        else:
            # A model-parallel slice: this rank's columns of the group's rows.
            u = uniform_rows(self.ctx.seed, (self.name, self.ctx.iteration),
                             layout.first_sample, n, layout.features)
            u = u[:, layout.first_feature:layout.first_feature + row_size]
        # mask = where(u >= ratio, scale, 0), as two in-place ufuncs: numexpr's where is much
        # slower here (docs/performance.md, "Elementwise passes")
        np.greater_equal(u, self._ratio, out=self._keep)
        np.multiply(self._keep, self._scale, out=self._mask)
        np.multiply(bottom[0].data.reshape(self._rows), self._mask,
                    out=top[0].data.reshape(self._rows))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.ctx.phase != TRAIN:
            if self._test_scale is not None:
                np.multiply(top[0].diff, self._test_scale, out=bottom[0].diff)
            elif top[0] is not bottom[0]:
                np.copyto(bottom[0].diff, top[0].diff)
            return
        np.multiply(top[0].diff.reshape(self._rows), self._mask,
                    out=bottom[0].diff.reshape(self._rows))
