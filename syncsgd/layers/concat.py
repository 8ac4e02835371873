"""Concat: joins the bottoms along one axis."""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


def join_axis(layer, param, legacy, num_axes):
    """The axis from `axis`, or from the legacy non-negative field `legacy` (concat_dim,
    slice_dim) where that is set; both together are refused, as in Caffe."""
    if param.HasField(legacy):
        if param.HasField("axis"):
            layer.fail(f"set either axis or {legacy}, not both")
        axis = getattr(param, legacy)
        if axis >= num_axes:
            layer.fail(f"{legacy} {axis} out of range for a {num_axes}-axis blob")
        return axis
    return canonical_axis(param.axis, num_axes, layer)


def spans(sizes, axis):
    """Index tuples selecting consecutive runs of `sizes` along `axis`."""
    lead = (slice(None),) * axis
    ends = np.cumsum(sizes)
    return [lead + (slice(int(end - size), int(end)),) for size, end in zip(sizes, ends)]


@register
class Concat(Layer):
    type = "Concat"
    min_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        first = bottom[0].shape
        self.axis = join_axis(self, self.param.concat_param, "concat_dim", len(first))
        for i, b in enumerate(bottom[1:], 1):
            if len(b.shape) != len(first) or any(
                    d != e for k, (d, e) in enumerate(zip(b.shape, first)) if k != self.axis):
                self.fail(f"bottom {i} has shape {b.shape}, bottom 0 {first}: all dimensions "
                          f"but the concat axis {self.axis} must agree")
        sizes = [b.shape[self.axis] for b in bottom]
        self.parts = spans(sizes, self.axis)
        top[0].reshape(first[:self.axis] + (sum(sizes),) + first[self.axis + 1:])

    def forward(self, bottom, top):
        np.concatenate([b.data for b in bottom], axis=self.axis, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        for b, part, down in zip(bottom, self.parts, propagate_down):
            if down:
                np.copyto(b.diff, top[0].diff[part])
