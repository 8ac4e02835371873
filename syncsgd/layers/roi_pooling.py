"""ROIPooling (Fast R-CNN, rbgirshick/caffe-fast-rcnn): max pooling of each region of interest
of a feature map into a fixed pooled_h x pooled_w grid, so that fully connected layers can
classify regions of any size.

Bottoms: features (N, C, H, W) and rois (R, 5) (or (R, 5, 1, 1)), each row (image, x1, y1, x2,
y2) in input-image pixels. Top (R, C, pooled_h, pooled_w). As in the fork, the corners are
scaled by spatial_scale and rounded half away from zero, the region includes both corners
(at least one pixel), bin edges are floor/ceil of multiples of region / pooled size in float32,
an empty bin gives 0, and backward sends each output's gradient to its first maximum in
row-major order (none for an inverted roi). The fork's CPU backward is not implemented;
this follows its GPU kernel.

The image column is an index into this rank's features. On N ranks, rois a layer derives from
the rank's own images (py-faster-rcnn's proposal layers, its RoI data layer) index them from 0;
rois that a data layer slices with the images (read from a file written for the whole batch)
index the global batch, from ctx.batch_offset: both are accepted, as `local_images` tells.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def round_half_away(x):
    """C's round(): halves away from zero (numpy rounds them to even), exactly (adding 0.5
    first would round 0.49999997 up in float32)."""
    whole = np.trunc(x)
    return whole + np.where(np.abs(x - whole) >= 0.5, np.sign(x), 0).astype(x.dtype)


def local_images(layer, column, num):
    """The rois' image column as indices into this rank's `num` images (int64)."""
    index = column.astype(np.int64)      # C's int conversion truncates toward zero
    offset = layer.ctx.batch_offset
    if len(index) and offset and index.min() >= offset:
        index = index - offset
    bad = (index < 0) | (index >= num)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        held = f"images [{offset}, {offset + num}) of the batch" if offset else f"{num} images"
        layer.fail(f"roi {k} names image {int(column[k])}, but this rank holds {held}; the "
                   f"first column of bottom 1 must index the images of bottom 0 (those of this "
                   f"rank's slice when a data layer slices the rois with them)")
    return index


@register
class ROIPoolingLayer(Layer):
    type = "ROIPooling"
    fork = "rbgirshick/caffe-fast-rcnn"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.roi_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            self.fail(f"roi_pooling_param needs pooled_h and pooled_w > 0, got {p.pooled_h} "
                      f"and {p.pooled_w}")
        if not np.isfinite(p.spatial_scale) or p.spatial_scale <= 0:
            self.fail(f"roi_pooling_param.spatial_scale must be positive, got "
                      f"{p.spatial_scale}")
        self.pooled = (p.pooled_h, p.pooled_w)
        self.scale = np.float32(p.spatial_scale)

    def reshape(self, bottom, top):
        features, rois = bottom[0].shape, bottom[1].shape
        if len(features) != 4:
            self.fail(f"bottom 0 must be features (N, C, H, W), got {features}")
        if len(rois) < 2 or bottom[1].count != rois[0] * 5:
            self.fail(f"bottom 1 must be rois (R, 5): (image, x1, y1, x2, y2), got {rois}")
        top[0].reshape(rois[0], features[1], *self.pooled)
        # Per output, the flat index of its maximum in bottom 0, or -1 for an empty bin.
        self.argmax = np.empty(top[0].shape, np.int64)

    def forward(self, bottom, top):
        x = bottom[0].data
        n, c, height, width = x.shape
        rois = bottom[1].data.reshape(-1, 5)
        images = local_images(self, rois[:, 0], n)
        corners = round_half_away(rois[:, 1:] * self.scale).astype(np.int64)  # (R, 4): x1 y1 x2 y2
        out = top[0].data
        for r in range(len(rois)):
            rows = bin_edges(corners[r, 1], corners[r, 3], self.pooled[0], height)
            cols = bin_edges(corners[r, 0], corners[r, 2], self.pooled[1], width)
            out[r], where = pool_region(x[images[r]], rows, cols)
            base = (images[r] * c + np.arange(c))[:, None, None] * (height * width)
            self.argmax[r] = np.where(where >= 0, where + base, -1)
        # The fork's backward passes over pixels outside [x1, x2] x [y1, y2]: an inverted roi
        # (x2 < x1 after rounding) pools one pixel but gets no gradient.
        self.inverted = (corners[:, 2] < corners[:, 0]) | (corners[:, 3] < corners[:, 1])

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        valid = (self.argmax >= 0) & ~self.inverted[:, None, None, None]
        bottom[0].diff[...] = np.bincount(
            self.argmax[valid], weights=top[0].diff[valid], minlength=bottom[0].count
        ).reshape(bottom[0].shape)


def bin_edges(start, end, pooled, size):
    """(starts, stops) of the `pooled` bins over pixels [start, end], clipped to [0, size]:
    floor(i * bin) and ceil((i + 1) * bin) in float32, bin = max(end - start + 1, 1) / pooled."""
    step = np.float32(max(end - start + 1, 1)) / np.float32(pooled)
    i = np.arange(pooled, dtype=np.float32)
    lo = np.floor(i * step).astype(np.int64) + start
    hi = np.ceil((i + 1) * step).astype(np.int64) + start
    return np.clip(lo, 0, size), np.clip(hi, 0, size)


def pool_region(image, rows, cols):
    """Max over each (row bin, column bin) of image (C, H, W): values (C, ph, pw) and the
    flat H*W index of each first maximum in row-major order, -1 (value 0) for empty bins.

    The bins are gathered into (C, ph, pw, bin_h * bin_w) with short bins padded by repeating
    their last row or column, which moves neither the maximum nor its first place."""
    (r0, r1), (c0, c1) = rows, cols
    width = image.shape[2]
    tall, wide = max(int((r1 - r0).max()), 1), max(int((c1 - c0).max()), 1)
    r = r0[:, None] + np.minimum(np.arange(tall), np.maximum(r1 - r0 - 1, 0)[:, None])
    w = c0[:, None] + np.minimum(np.arange(wide), np.maximum(c1 - c0 - 1, 0)[:, None])
    r, w = np.minimum(r, image.shape[1] - 1), np.minimum(w, width - 1)
    flat = (r[:, None, :, None] * width + w[None, :, None, :]).reshape(len(r0), len(c0), -1)
    values = image.reshape(image.shape[0], -1)[:, flat]              # (C, ph, pw, tall * wide)
    first = values.argmax(axis=3)
    best = np.take_along_axis(values, first[..., None], axis=3)[..., 0]
    index = np.broadcast_to(flat, values.shape[1:])
    where = np.take_along_axis(index[None], first[..., None], axis=3)[..., 0]
    empty = ((r1 <= r0)[:, None] | (c1 <= c0)[None, :])[None]
    return np.where(empty, np.float32(0), best), np.where(empty, -1, where)
