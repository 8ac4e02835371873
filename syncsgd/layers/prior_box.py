"""PriorBox (SSD, weiliu89/caffe): the default boxes of one feature map, in image-relative corner
coordinates, and their variances. They depend on shapes only, so they are made in reshape.

Top (1, 2, H*W*P*4): channel 0 holds, per location (row-major) and per prior, (xmin, ymin, xmax,
ymax); channel 1 the four variances of each box. Per min_size the priors are: the min_size square,
the sqrt(min_size * max_size) square (when max sizes are given), then one box per aspect ratio
other than 1. As in SSD, min and max sizes are truncated to integers.
"""
import math

import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def _pair(p, field, name):
    """(h, w) from field_h/field_w, or field for both, or (0, 0): unset, as in SSD."""
    h, w = f"{field}_h", f"{field}_w"
    if p.HasField(h) or p.HasField(w):
        if p.HasField(name):
            raise ValueError(f"give either {name} or {h}/{w}, not both")
        return getattr(p, h), getattr(p, w)
    if p.HasField(name):
        return getattr(p, name), getattr(p, name)
    return 0, 0


@register
class PriorBoxLayer(Layer):
    type = "PriorBox"
    fork = "weiliu89/caffe (ssd)"
    exact_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.prior_box_param
        for name in ("min_size", "max_size", "aspect_ratio", "variance"):
            if not all(math.isfinite(v) for v in getattr(p, name)):
                self.fail(f"prior_box_param {name} {list(getattr(p, name))}: give finite numbers")
        for name in ("offset", "step", "step_h", "step_w"):
            if not math.isfinite(getattr(p, name)):
                self.fail(f"prior_box_param {name} is {getattr(p, name)}; give a finite number")
        if any(r <= 0 for r in p.aspect_ratio):
            self.fail(f"prior_box_param aspect_ratio {list(p.aspect_ratio)}: give positive values")
        if not p.min_size or min(p.min_size) <= 0:
            self.fail("prior_box_param needs min_size (positive, one or more)")
        self.min_sizes = [int(s) for s in p.min_size]
        self.max_sizes = [int(s) for s in p.max_size]
        if self.max_sizes and (len(self.max_sizes) != len(self.min_sizes) or any(
                big <= small for small, big in zip(self.min_sizes, self.max_sizes))):
            self.fail(f"prior_box_param max_size {list(p.max_size)} must give one size per "
                      f"min_size {list(p.min_size)}, each larger")
        ratios = [1.0]
        for r in p.aspect_ratio:
            if all(abs(r - known) >= 1e-6 for known in ratios):
                ratios += [r, 1.0 / r] if p.flip else [r]
        self.ratios = [r for r in ratios if abs(r - 1.0) >= 1e-6]
        if len(p.variance) not in (0, 1, 4) or any(v <= 0 for v in p.variance):
            self.fail(f"prior_box_param variance {list(p.variance)}: give 1 or 4 positive values")
        self.variance = list(p.variance) or [0.1]
        try:
            self.img = _pair(p, "img", "img_size")
            self.step = _pair(p, "step", "step")
        except ValueError as e:
            self.fail(f"prior_box_param: {e}")
        for name, pair in (("image size", self.img), ("step", self.step)):
            if pair != (0, 0) and min(pair) <= 0:
                self.fail(f"prior_box_param {name} (h, w) {pair} must be positive")
        self.clip, self.offset = p.clip, p.offset
        self._half = self._half_sizes()
        self._key = None

    def _half_sizes(self):
        """(P, 2) half widths and heights of the priors at one location, in pixels (the sizes
        rounded to float32, as SSD stores them)."""
        sizes = []
        for i, small in enumerate(self.min_sizes):
            sizes.append((small, small))
            if self.max_sizes:
                side = np.sqrt(small * self.max_sizes[i])
                sizes.append((side, side))
            for r in self.ratios:
                root = np.sqrt(np.float32(r))
                sizes.append((np.float32(small) * root, np.float32(small) / root))
        return np.array(sizes, np.float32).astype(np.float64) / 2

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4 or bottom[1].num_axes != 4:
            self.fail(f"bottoms must be (N, C, H, W) feature map and image, got "
                      f"{bottom[0].shape} and {bottom[1].shape}")
        height, width = bottom[0].shape[2:]
        image = self.img if 0 not in self.img else bottom[1].shape[2:]
        key = (height, width, tuple(image))
        half = self._half
        top[0].reshape(1, 2, height * width * len(half) * 4)
        if key == self._key:
            return
        self._key = key
        img_h, img_w = image
        step_h, step_w = (self.step if 0 not in self.step
                          else (np.float32(img_h) / np.float32(height),
                                np.float32(img_w) / np.float32(width)))
        # Centres in float32, as SSD computes them.
        cy = (np.arange(height, dtype=np.float32) + np.float32(self.offset)) * np.float32(step_h)
        cx = (np.arange(width, dtype=np.float32) + np.float32(self.offset)) * np.float32(step_w)
        boxes = np.empty((height, width, len(half), 4), np.float64)
        boxes[..., 0] = (cx[None, :, None] - half[:, 0]) / img_w
        boxes[..., 1] = (cy[:, None, None] - half[:, 1]) / img_h
        boxes[..., 2] = (cx[None, :, None] + half[:, 0]) / img_w
        boxes[..., 3] = (cy[:, None, None] + half[:, 1]) / img_h
        if self.clip:
            np.clip(boxes, 0.0, 1.0, out=boxes)
        self._priors = np.empty((2, boxes.size), np.float32)
        self._priors[0] = boxes.reshape(-1)
        self._priors[1] = np.resize(np.array(self.variance, np.float32), boxes.size)

    def forward(self, bottom, top):
        np.copyto(top[0].data[0], self._priors)
