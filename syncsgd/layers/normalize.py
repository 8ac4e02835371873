"""Normalize (SSD, weiliu89/caffe): scales each sample (across_spatial) or each pixel's channel
vector to unit L2 norm, then multiplies by a learned scale, shared or per channel. SSD uses it
on VGG's conv4_3, whose activations are much larger than the later layers'.

The norm is sqrt(sum x^2 + eps), as in SSD. The bottom gradient here is the exact one; SSD's
applies a per-channel scale after the projection, which is exact only for a shared scale.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.proto import pb


@register
class NormalizeLayer(Layer):
    type = "Normalize"
    fork = "weiliu89/caffe (ssd)"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        if bottom[0].num_axes < 2:
            self.fail(f"bottom {bottom[0].shape} needs at least 2 axes (N, C, ...)")
        p = self.param.norm_param
        self._planes = None
        self.across_spatial, self.channel_shared, self.eps = (p.across_spatial,
                                                              p.channel_shared, p.eps)
        channels = bottom[0].shape[1]
        shape = () if self.channel_shared else (channels,)
        if not self.blobs:
            filler = (p.scale_filler if p.HasField("scale_filler")
                      else pb.FillerParameter(type="constant", value=1.0))
            blob = Blob(shape, name=f"{self.name}.scale")
            fill(blob.data, filler, self.ctx.rng(self.name, 0))
            self.blobs.append(blob)
        elif self.blobs[0].count != (1 if self.channel_shared else channels):
            self.fail(f"scale blob has shape {self.blobs[0].shape}; norm_param.channel_shared "
                      f"{self.channel_shared} needs {1 if self.channel_shared else channels} "
                      f"value(s)")

    def reshape(self, bottom, top):
        top[0].reshape_like(bottom[0])
        n, c = bottom[0].shape[:2]
        planes = (n, c, bottom[0].count // max(n * c, 1))      # (N, C, H*W)
        if planes == self._planes:
            return
        self._planes = planes
        sums = (n, 1, 1) if self.across_spatial else (n, 1, planes[2])
        self._norm = np.zeros(sums, np.float32)
        self._sums = np.zeros(sums, np.float32)
        self._work = np.zeros(planes, np.float32)

    def _axes(self):
        return (1, 2) if self.across_spatial else (1,)

    def _scale(self):
        return self.blobs[0].data.reshape((1, -1, 1))

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._planes)
        np.square(x, out=self._work)
        np.sum(self._work, axis=self._axes(), keepdims=True, out=self._norm)
        self._norm += np.float32(self.eps)
        np.sqrt(self._norm, out=self._norm)
        y = top[0].data.reshape(self._planes)
        np.divide(x, self._norm, out=y)
        y *= self._scale()

    def backward(self, top, propagate_down, bottom):
        x = bottom[0].data.reshape(self._planes)
        dy = top[0].diff.reshape(self._planes)
        work = self._work
        if self.propagates_param(0):
            # Scale gradient: sum of dy * x / norm over what each scale value multiplies.
            np.divide(x, self._norm, out=work)
            work *= dy
            scale_diff = self.blobs[0].diff
            scale_diff += (work.sum() if self.channel_shared
                           else work.sum(axis=(0, 2))).astype(np.float32)
        if not propagate_down[0]:
            return
        # With g = dy * scale: dx = (g - x * sum(x * g) / norm^2) / norm.
        dx = bottom[0].diff.reshape(self._planes)
        np.multiply(dy, self._scale(), out=dx)
        np.multiply(x, dx, out=work)
        np.sum(work, axis=self._axes(), keepdims=True, out=self._sums)
        self._sums /= np.square(self._norm)
        np.multiply(x, self._sums, out=work)
        dx -= work
        dx /= self._norm
