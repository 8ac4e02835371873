"""Flatten: merges axes axis..end_axis into one; the top is a view of the bottom."""
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register
from syncsgd.layers.reshape import pass_gradient, share_reshaped


@register
class Flatten(Layer):
    type = "Flatten"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        p = self.param.flatten_param
        shape = bottom[0].shape
        start = canonical_axis(p.axis, len(shape), self)
        end = canonical_axis(p.end_axis, len(shape), self)
        if end < start:
            self.fail(f"flatten_param end_axis {p.end_axis} comes before axis {p.axis} "
                      f"for a {len(shape)}-axis bottom")
        merged = 1
        for d in shape[start:end + 1]:
            merged *= d
        share_reshaped(bottom[0], top[0], shape[:start] + (merged,) + shape[end + 1:])

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass_gradient(top, propagate_down, bottom)
