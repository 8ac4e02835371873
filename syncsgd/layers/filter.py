"""Filter: keeps the samples (first-axis rows) of every bottom but the last where the last
bottom, the selector, is non-zero. Top i is bottom i filtered.

The selector has one value per sample. The top's first axis changes with the selector's values,
so it is sized in each reshape, before each forward. Rows that were filtered out get zero gradient;
the selector gets none.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class Filter(Layer):
    type = "Filter"
    min_bottoms = 2
    min_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        if len(top) != len(bottom) - 1:
            self.fail(f"takes one top per filtered bottom ({len(bottom) - 1} for "
                      f"{len(bottom)} bottoms, the last being the selector), got {len(top)}")

    def allow_force_backward(self, bottom_index):
        return bottom_index < len(self.param.bottom) - 1

    def reshape(self, bottom, top):
        selector = bottom[-1]
        if selector.num_axes < 1 or any(d != 1 for d in selector.shape[1:]):
            self.fail(f"the selector (last bottom) must have shape (N,) or (N, 1, ...), "
                      f"got {selector.shape}")
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != selector.shape[0]:
                self.fail(f"bottom {i} has shape {b.shape} but the selector has "
                          f"{selector.shape[0]} samples; their first axes must agree")
        self._keep = np.flatnonzero(selector.data.reshape(-1))
        for b, t in zip(bottom, top):
            t.reshape((self._keep.size,) + b.shape[1:])

    def forward(self, bottom, top):
        for b, t in zip(bottom, top):
            np.take(b.data, self._keep, axis=0, out=t.data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            self.fail("cannot back-propagate to the selector (last bottom); set "
                      "`propagate_down: false` for it")
        for b, t, down in zip(bottom, top, propagate_down):
            if down:
                b.diff.fill(0)
                b.diff[self._keep] = t.diff
