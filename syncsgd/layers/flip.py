"""Flip (happynear/caffe-windows): mirrors a blob along its width and/or height, as AM-Softmax's
deploy net does to add a mirrored copy of each face to the batch.

As in the fork, the axes are Caffe's legacy (num, channels, height, width): a blob of fewer than
four axes has no width (and, below three, no height) to flip, and more than four are refused.
"""
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class FlipLayer(Layer):
    type = "Flip"
    fork = "happynear/caffe-windows"
    exact_bottoms = 1
    exact_tops = 1
    sample_wise = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)

    def reshape(self, bottom, top):
        if bottom[0].num_axes > 4:
            self.fail(f"bottom {bottom[0].shape} has more than the 4 axes (num, channels, "
                      f"height, width) the layer flips in")
        top[0].reshape_like(bottom[0])
        p = self.param.flip_param
        axes = bottom[0].num_axes
        flips = [slice(None)] * axes
        if p.flip_height and axes >= 3:
            flips[2] = slice(None, None, -1)
        if p.flip_width and axes == 4:
            flips[3] = slice(None, None, -1)
        self._flip = tuple(flips)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self._flip]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff[self._flip]
