"""PSROIPooling (R-FCN, daijifeng001/caffe-rfcn): position-sensitive ROI pooling. Each region is
cut into group_size x group_size bins and bin (i, j) of output channel d averages input channel
(d * group_size + i) * group_size + j over the bin, so that each bin's score map learns one
relative position of the object.

Bottoms: score maps (N, output_dim * group_size^2, H, W) and rois (R, 5), rows (image, x1, y1,
x2, y2) in input-image pixels. Top (R, output_dim, group_size, group_size). As in the fork's
kernels (it has no CPU code): corners rounded half away from zero, then scaled, the region ends
one pixel past x2 and y2 and is at least 0.1 wide, bin edges floor/ceil in float32, an empty
bin gives 0. The image column is handled as by ROIPooling (roi_pooling.local_images).
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.layers.roi_pooling import local_images, round_half_away


@register
class PSROIPoolingLayer(Layer):
    type = "PSROIPooling"
    fork = "daijifeng001/caffe-rfcn"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.psroi_pooling_param
        if p.output_dim <= 0 or p.group_size <= 0:
            self.fail(f"psroi_pooling_param needs output_dim and group_size > 0, got "
                      f"{p.output_dim} and {p.group_size}")
        if not p.HasField("spatial_scale") or not np.isfinite(p.spatial_scale) or \
                p.spatial_scale <= 0:
            self.fail("psroi_pooling_param.spatial_scale is required and must be positive")
        self.dim, self.group = p.output_dim, p.group_size
        self.scale = np.float32(p.spatial_scale)
        g = np.arange(self.group)
        # (D, G, G): the input channel each output (d, i, j) reads.
        self.channel = ((np.arange(self.dim)[:, None, None] * self.group + g[:, None])
                        * self.group + g)

    def reshape(self, bottom, top):
        maps, rois = bottom[0].shape, bottom[1].shape
        if len(maps) != 4 or maps[1] != self.dim * self.group ** 2:
            self.fail(f"bottom 0 must be score maps (N, output_dim * group_size^2 = "
                      f"{self.dim * self.group ** 2}, H, W), got {maps}")
        if len(rois) < 2 or bottom[1].count != rois[0] * 5:
            self.fail(f"bottom 1 must be rois (R, 5): (image, x1, y1, x2, y2), got {rois}")
        top[0].reshape(rois[0], self.dim, self.group, self.group)

    def forward(self, bottom, top):
        x = bottom[0].data
        n, _, height, width = x.shape
        rois = bottom[1].data.reshape(-1, 5)
        self.images = local_images(self, rois[:, 0], n)
        self.rows = self._edges(rois[:, 2], rois[:, 4], height)     # (lo, hi), each (R, G)
        self.cols = self._edges(rois[:, 1], rois[:, 3], width)
        # Sums over bins from the summed-area table (N, C, H + 1, W + 1), in float64.
        table = np.zeros((n, x.shape[1], height + 1, width + 1))
        np.cumsum(np.cumsum(x, axis=2, dtype=np.float64), axis=3, out=table[:, :, 1:, 1:])
        img, ch, (r0, r1), (c0, c1) = self._corners()
        sums = (table[img, ch, r1, c1] - table[img, ch, r0, c1] - table[img, ch, r1, c0]
                + table[img, ch, r0, c0])
        area = self._area()
        top[0].data[...] = np.where(area > 0, sums / np.maximum(area, 1), 0)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n, channels, height, width = bottom[0].shape
        area = self._area()
        share = np.where(area > 0, top[0].diff / np.maximum(area, 1), 0)
        # Each bin adds its share to a rectangle: four corners of a difference table, then
        # cumulative sums over rows and columns.
        img, ch, (r0, r1), (c0, c1) = self._corners()
        plane = (img * channels + ch) * (height + 1)
        corners = np.concatenate([((plane + r) * (width + 1) + c).ravel()
                                  for r, c in ((r0, c0), (r0, c1), (r1, c0), (r1, c1))])
        signs = np.concatenate([s * share.ravel() for s in (1, -1, -1, 1)])
        table = np.bincount(corners, signs, minlength=n * channels * (height + 1) * (width + 1))
        table = table.reshape(n, channels, height + 1, width + 1).cumsum(2).cumsum(3)
        bottom[0].diff[...] = table[:, :, :height, :width]

    def _edges(self, first, last, size):
        """Bin edges (lo, hi), each (R, G), along one axis, clipped to [0, size]."""
        start = round_half_away(first) * self.scale
        end = (round_half_away(last) + np.float32(1)) * self.scale
        step = np.maximum(end - start, np.float32(0.1)) / np.float32(self.group)
        i = np.arange(self.group, dtype=np.float32)
        lo = np.floor(i * step[:, None] + start[:, None]).astype(np.int64)
        hi = np.ceil((i + 1) * step[:, None] + start[:, None]).astype(np.int64)
        return np.clip(lo, 0, size), np.clip(hi, 0, size)

    def _corners(self):
        """Index arrays broadcasting to (R, D, G, G): image, channel, row and column edges."""
        img = self.images[:, None, None, None]
        (r0, r1), (c0, c1) = self.rows, self.cols
        rows = (r0[:, None, :, None], r1[:, None, :, None])
        cols = (c0[:, None, None, :], c1[:, None, None, :])
        return img, self.channel[None], rows, cols

    def _area(self):
        (r0, r1), (c0, c1) = self.rows, self.cols
        tall = np.maximum(r1 - r0, 0)[:, None, :, None]
        wide = np.maximum(c1 - c0, 0)[:, None, None, :]
        return np.broadcast_to(tall * wide, (len(r0), self.dim, self.group, self.group))
