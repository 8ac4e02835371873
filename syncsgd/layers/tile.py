"""Tile: repeats the blob `tiles` times along `axis` (each block of axes from `axis` on is copied
whole, so (a, b) tiled twice on axis 0 is (a, b, a, b))."""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


@register
class Tile(Layer):
    type = "Tile"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.tile_param
        if not p.HasField("tiles"):
            self.fail("tile_param.tiles must be set")
        if p.tiles < 1:
            self.fail(f"tile_param.tiles must be positive, got {p.tiles}")
        self.tiles = p.tiles

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = canonical_axis(self.param.tile_param.axis, len(shape), self)
        top[0].reshape(shape[:axis] + (shape[axis] * self.tiles,) + shape[axis + 1:])
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        self._blocks = (outer, bottom[0].count // outer if outer else 0)    # (outer, inner)

    def forward(self, bottom, top):
        outer, inner = self._blocks
        np.copyto(top[0].data.reshape(outer, self.tiles, inner),
                  bottom[0].data.reshape(outer, 1, inner))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            outer, inner = self._blocks
            np.sum(top[0].diff.reshape(outer, self.tiles, inner), axis=1,
                   out=bottom[0].diff.reshape(self._blocks))
