"""Reorg (YOLOv2's passthrough, eric612/MobileNet-YOLO): darknet's reorg, which is not a plain
space-to-depth. Its loop reads the (C, H, W) bottom as if it were (C / s^2, H * s, W * s) and
writes the values in the (C, H, W) order; weights trained in darknet only work with this exact
order, which OpenCV's Reorg layer follows too. With `reverse` the same map writes instead of
reads: from (C, H, W) to (C / s^2, H * s, W * s).

The top of the plain direction is (N, C * s^2, H / s, W / s). The fork's Backward_cpu reads a
buffer nothing writes (its diff_ blob), so its gradient is zero; here backward is the forward's
adjoint, as in lwplw/caffe_yolov2, the same layer whose backward reads the top's diff.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def darknet_order(channels, height, width, stride):
    """For each flat (c, h, w) index of a (C, H, W) plane, the flat index into the same values
    read as (C / s^2, H * s, W * s): darknet's reorg_cpu index map."""
    c, h, w = np.meshgrid(np.arange(channels), np.arange(height), np.arange(width),
                          indexing="ij")
    out_c = channels // (stride * stride)
    offset = c // out_c
    w2 = w * stride + offset % stride
    h2 = h * stride + offset // stride
    return (w2 + width * stride * (h2 + height * stride * (c % out_c))).reshape(-1)


@register
class ReorgLayer(Layer):
    type = "Reorg"
    fork = "eric612/MobileNet-YOLO"
    exact_bottoms = 1
    exact_tops = 1
    sample_wise = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.reorg_param
        if not p.HasField("stride") or p.stride == 0:
            self.fail("reorg_param.stride is required and must be positive")
        self.stride, self.reverse = p.stride, p.reverse
        self._key = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        s = self.stride
        if len(shape) != 4:
            self.fail(f"the bottom must be (N, C, H, W), got {shape}")
        n, c, h, w = shape
        if self.reverse:
            if c % (s * s):
                self.fail(f"reverse reorg_param.stride {s} needs channels divisible by "
                          f"{s * s}, got {c}")
            top[0].reshape(n, c // (s * s), h * s, w * s)
        else:
            if h % s or w % s or c % (s * s):
                self.fail(f"reorg_param.stride {s} must divide the bottom's height and width "
                          f"and its square the channels, got {shape}")
            top[0].reshape(n, c * s * s, h // s, w // s)
        if self._key != shape[1:]:
            self._key = shape[1:]
            # darknet reads the plane through this map; in reverse it writes through it.
            self._order = darknet_order(c, h, w, s)

    def forward(self, bottom, top):
        n = bottom[0].shape[0]
        source, target = bottom[0].data.reshape(n, -1), top[0].data.reshape(n, -1)
        if self.reverse:
            target[:, self._order] = source
        else:
            np.take(source, self._order, axis=1, out=target)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n = bottom[0].shape[0]
        source, target = top[0].diff.reshape(n, -1), bottom[0].diff.reshape(n, -1)
        if self.reverse:
            np.take(source, self._order, axis=1, out=target)
        else:
            target[:, self._order] = source
