"""pycaffe's image helpers (caffe.io.load_image, resize_image, oversample): images as float32
(H, W, K) arrays in RGB order with values in [0, 1], the form pycaffe's Transformer expects.

pycaffe reads and resizes with scikit-image; here Pillow reads and numpy interpolates, with the
same conventions: grey as 0.2125 R + 0.7154 G + 0.0721 B, pixel centres aligned when resizing.
"""
import os

import numpy as np

from syncsgd.errors import DataError
from syncsgd.io.lmdb import require

# scikit-image's rgb2gray weights (ITU-R BT.709), which pycaffe's load_image uses.
_GREY = np.array([0.2125, 0.7154, 0.0721], np.float32)


def load_image(filename, color=True):
    """An image file as float32 (H, W, 3) RGB in [0, 1], or (H, W, 1) grey when color=False."""
    image_module = require("PIL.Image", "pillow", "caffe.io.load_image")
    if not os.path.isfile(filename):
        raise DataError(f"load_image: '{filename}' does not exist")
    try:
        with image_module.open(filename) as img:
            raw = np.asarray(img)
            mode = img.mode
    except OSError as exc:
        raise DataError(f"load_image: '{filename}' is not an image Pillow can read ({exc})") \
            from None
    img = _as_float(raw, mode)
    if img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]
    elif img.ndim == 3 and img.shape[2] == 2:      # grey + alpha
        img = img[:, :, :1]
    if not color and img.ndim == 3 and img.shape[2] == 3:
        img = img @ _GREY
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
    if color and img.shape[2] == 1:
        img = np.tile(img, (1, 1, 3))
    return np.ascontiguousarray(img, np.float32)


def _as_float(raw, mode):
    """Pixel values scaled to [0, 1] by their type's range (scikit-image's img_as_float)."""
    if raw.dtype == np.bool_:
        return raw.astype(np.float32)
    if np.issubdtype(raw.dtype, np.integer):
        top = 65535.0 if mode.startswith("I;16") else float(np.iinfo(raw.dtype).max)
        return raw.astype(np.float32) / np.float32(top)
    return raw.astype(np.float32)


def resize_image(im, new_dims, interp_order=1):
    """`im` (H, W, K) resized to new_dims (h, w): interp_order 0 nearest, 1 bilinear."""
    im = np.asarray(im, np.float32)
    if im.ndim != 3:
        raise ValueError(f"resize_image takes an (H, W, K) image, got shape {im.shape}")
    if interp_order not in (0, 1):
        raise ValueError(f"resize_image: interp_order {interp_order} is not supported; use 0 "
                         "(nearest) or 1 (bilinear)")
    h, w = (int(d) for d in new_dims[:2])
    if (h, w) == im.shape[:2]:
        return im.copy()
    rows = _axis_weights(im.shape[0], h, interp_order)
    cols = _axis_weights(im.shape[1], w, interp_order)
    out = _resample(im, rows, axis=0)
    return np.ascontiguousarray(_resample(out, cols, axis=1), np.float32)


def _axis_weights(size, new_size, order):
    """(lower index, upper index, upper weight) per output position along one axis, sampling at
    pixel centres: output i reads input (i + 0.5) * size / new_size - 0.5, clamped to the edge."""
    x = (np.arange(new_size, dtype=np.float64) + 0.5) * (size / new_size) - 0.5
    x = np.clip(x, 0, size - 1)
    if order == 0:
        nearest = np.minimum(np.floor(x + 0.5), size - 1).astype(np.intp)
        return nearest, nearest, np.zeros(new_size, np.float32)
    lo = np.floor(x).astype(np.intp)
    hi = np.minimum(lo + 1, size - 1)
    return lo, hi, (x - lo).astype(np.float32)


def _resample(im, weights, axis):
    lo, hi, t = weights
    a, b = np.take(im, lo, axis=axis), np.take(im, hi, axis=axis)
    shape = [1] * im.ndim
    shape[axis] = -1
    t = t.reshape(shape)
    return a + (b - a) * t


def oversample(images, crop_dims):
    """Ten crops of each (H, W, K) image: the four corners and the centre, then the same five
    mirrored left-right; (10 * len(images), crop_h, crop_w, K) float32."""
    images = [np.asarray(im) for im in images]
    ch, cw = (int(d) for d in crop_dims[:2])
    h, w = images[0].shape[:2]
    if ch > h or cw > w:
        raise ValueError(f"oversample: crop {ch}x{cw} is larger than the images ({h}x{w})")
    centre_y, centre_x = int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0)
    corners = [(0, 0), (0, w - cw), (h - ch, 0), (h - ch, w - cw), (centre_y, centre_x)]
    crops = np.empty((10 * len(images), ch, cw, images[0].shape[-1]), np.float32)
    for i, im in enumerate(images):
        five = np.stack([im[y:y + ch, x:x + cw] for y, x in corners])
        crops[10 * i:10 * i + 5] = five
        crops[10 * i + 5:10 * i + 10] = five[:, :, ::-1]
    return crops
