"""Crop: cuts bottom 0 to the shape of bottom 1 on the axes from crop_param.axis on (FCN uses
it to align upsampled score maps with the input).

`offset` is where the crop starts: one value for every cropped axis, or one per axis from
`axis` on, or none (0). Bottom 1 only gives the shape; it takes no gradient.
"""
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register


@register
class Crop(Layer):
    type = "Crop"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.crop_param
        axes = bottom[0].num_axes
        self.axis = canonical_axis(p.axis, axes, self)
        self.offsets = list(p.offset)
        if len(self.offsets) > 1 and self.axis + len(self.offsets) != axes:
            self.fail(f"crop_param gives {len(self.offsets)} offsets for the "
                      f"{axes - self.axis} axes from axis {self.axis} of a {axes}-axis bottom; "
                      f"give one offset, or one per cropped axis")

    def reshape(self, bottom, top):
        data, like = bottom[0].shape, bottom[1].shape
        if len(like) != len(data):
            self.fail(f"bottom 1 {like} must have as many axes as bottom 0 {data}")
        shape, self.window = [], []
        for i, size in enumerate(data):
            start, length = 0, size
            if i >= self.axis:
                length = like[i]
                if self.offsets:
                    start = self.offsets[0 if len(self.offsets) == 1 else i - self.axis]
                if start + length > size:
                    self.fail(f"the crop of axis {i} is out of bounds: offset {start} plus "
                              f"size {length} (of bottom 1) passes the bottom's {size}")
            shape.append(length)
            self.window.append(slice(start, start + length))
        self.window = tuple(self.window)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.window]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff.fill(0)
            bottom[0].diff[self.window] = top[0].diff
        if propagate_down[1]:
            bottom[1].diff.fill(0)
