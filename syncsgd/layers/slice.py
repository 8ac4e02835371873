"""Slice: cuts the bottom into the tops along one axis, at slice_point or in equal parts."""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.concat import join_axis, spans
from syncsgd.layers.registry import register


@register
class Slice(Layer):
    type = "Slice"
    exact_bottoms = 1
    min_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.points = list(self.param.slice_param.slice_point)
        if self.points and len(self.points) != len(top) - 1:
            self.fail(f"{len(self.points)} slice_point value(s) for {len(top)} tops; give one "
                      f"fewer slice_point than tops, or none to split equally")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        self.axis = join_axis(self, self.param.slice_param, "slice_dim", len(shape))
        length = shape[self.axis]
        if self.points:
            bounds = [0] + self.points + [length]
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            if any(s <= 0 for s in sizes):
                self.fail(f"slice_point {self.points} must increase strictly and stay inside "
                          f"1..{length - 1} (axis {self.axis} has {length} entries)")
        else:
            if length % len(top):
                self.fail(f"axis {self.axis} has {length} entries, which do not split equally "
                          f"into {len(top)} tops; give slice_point")
            sizes = [length // len(top)] * len(top)
        self.parts = spans(sizes, self.axis)
        for t, size in zip(top, sizes):
            t.reshape(shape[:self.axis] + (size,) + shape[self.axis + 1:])

    def forward(self, bottom, top):
        for t, part in zip(top, self.parts):
            np.copyto(t.data, bottom[0].data[part])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.concatenate([t.diff for t in top], axis=self.axis, out=bottom[0].diff)
