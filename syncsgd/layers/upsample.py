"""Upsample (SegNet, alexgkendall/caffe-segnet): max-unpooling. Each value goes back to where
its pooling window's maximum was, by the mask the Pooling layer gives as its second top (the
argmax as an index h * W + w into the pooled image plane); the rest of the top is zero.

Bottoms: (N, C, H, W) values and their (N, C, H, W) mask. The top is upsample_h x upsample_w,
or H * scale_h (minus 1 with pad_out_h) by W * scale_w (minus 1 with pad_out_w).
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class UpsampleLayer(Layer):
    type = "Upsample"
    fork = "alexgkendall/caffe-segnet"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.upsample_param
        if p.HasField("upsample_h") and p.HasField("upsample_w"):
            if min(p.upsample_h, p.upsample_w) <= 1:
                self.fail("upsample_param upsample_h and upsample_w must be larger than 1")
            self.size, self.scale, self.pad_out = (p.upsample_h, p.upsample_w), None, None
            self._key = None
            return
        if p.HasField("scale_h") != p.HasField("scale_w") or (
                p.HasField("scale_h") and p.HasField("scale")):
            self.fail("upsample_param needs upsample_h and upsample_w, or scale, or scale_h "
                      "and scale_w")
        self.scale = (p.scale_h, p.scale_w) if p.HasField("scale_h") else (p.scale, p.scale)
        if min(self.scale) <= 1:
            self.fail(f"upsample_param scale {self.scale} must be larger than 1")
        self.pad_out = (p.pad_out_h, p.pad_out_w)
        if any(pad and s != 2 for pad, s in zip(self.pad_out, self.scale)):
            self.fail("upsample_param pad_out_h / pad_out_w need a scale of 2")
        self.size = self._key = None

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0        # no gradient to the mask

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4 or bottom[1].shape != shape:
            self.fail(f"values {shape} and mask {bottom[1].shape} must be the same (N, C, H, W)")
        size = self.size or tuple(d * s - int(pad) for d, s, pad
                                  in zip(shape[2:], self.scale, self.pad_out))
        top[0].reshape(*shape[:2], *size)
        if (shape, size) == self._key:
            return
        self._key = (shape, size)
        planes, self._plane = shape[0] * shape[1], size[0] * size[1]
        # Flat index into the top of each bottom value: its plane's start plus the mask.
        self._starts = (np.arange(planes, dtype=np.int64) * self._plane)[:, None]
        self._index = np.zeros((planes, shape[2] * shape[3]), np.int64)

    def forward(self, bottom, top):
        mask = bottom[1].data.reshape(self._index.shape)
        if mask.size and not (0 <= mask.min() and mask.max() < self._plane):
            self.fail(f"mask index out of range {int(mask.min())}..{int(mask.max())} for a "
                      f"{top[0].shape[2]}x{top[0].shape[3]} top: check that the scale or "
                      "upsample size matches the pooling layer's input")
        np.add(self._starts, mask, out=self._index, casting="unsafe")
        top[0].data.fill(0)
        top[0].data.reshape(-1)[self._index.reshape(-1)] = bottom[0].data.reshape(-1)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.take(top[0].diff.reshape(-1), self._index, out=bottom[0].diff.reshape(
                self._index.shape))
