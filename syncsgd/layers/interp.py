"""Interp (PSPNet, hszhao/PSPNet; DeepLab): bilinear resizing with aligned corners, output pixel
o sampling input position o * (in - 1) / (out - 1), as in those forks.

The output size is height x width, or the input's (less the crop) shrunk by shrink_factor,
(in - 1) / shrink + 1, and/or zoomed by zoom_factor, in + (in - 1) * (zoom - 1). Non-positive
pad_beg / pad_end crop rows and columns off the input first (positive padding is refused, as in
PSPNet). Resizing is separable: top = A_h @ x @ A_w^T per plane, with interpolation matrices A.
"""
import numpy as np

from syncsgd.kernels.blas import gemm
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def interpolation_matrix(size_in, size_out):
    """(size_out, size_in) weights of the fork's align-corners interpolation (float32 ratios)."""
    matrix = np.zeros((size_out, size_in), np.float32)
    if size_in == size_out:
        np.fill_diagonal(matrix, 1)
        return matrix
    ratio = np.float32((size_in - 1) / (size_out - 1)) if size_out > 1 else np.float32(0)
    position = ratio * np.arange(size_out, dtype=np.float32)
    low = position.astype(np.int64)
    step = (low < size_in - 1).astype(np.int64)
    weight = position - low
    rows = np.arange(size_out)
    np.add.at(matrix, (rows, low), 1 - weight)
    np.add.at(matrix, (rows, low + step), weight)
    return matrix


@register
class InterpLayer(Layer):
    type = "Interp"
    fork = "hszhao/PSPNet"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.interp_param
        if p.pad_beg > 0 or p.pad_end > 0:
            self.fail("interp_param pad_beg and pad_end must be <= 0 (cropping only)")
        zoom, shrink = p.HasField("zoom_factor"), p.HasField("shrink_factor")
        if not (zoom or shrink or (p.HasField("height") and p.HasField("width"))):
            self.fail("interp_param needs zoom_factor, shrink_factor, or height and width")
        if (zoom and p.zoom_factor < 1) or (shrink and p.shrink_factor < 1):
            self.fail("interp_param zoom_factor and shrink_factor must be at least 1")
        self._key = None

    def _out_size(self, size):
        """The output length for an (already cropped) input length, or None for height and
        width, by the fork's rules in the fork's order."""
        p = self.param.interp_param
        zoom, shrink = p.HasField("zoom_factor"), p.HasField("shrink_factor")
        if shrink and not zoom:
            return (size - 1) // p.shrink_factor + 1
        if zoom and not shrink:
            return size + (size - 1) * (p.zoom_factor - 1)
        if p.HasField("height") and p.HasField("width"):
            return None
        size = (size - 1) // p.shrink_factor + 1
        return size + (size - 1) * (p.zoom_factor - 1)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must be (N, C, H, W), got {shape}")
        p = self.param.interp_param
        n, c, h, w = shape
        crop = -p.pad_beg
        inner = (h + p.pad_beg + p.pad_end, w + p.pad_beg + p.pad_end)
        if min(inner) <= 0:
            self.fail(f"pad_beg {p.pad_beg} and pad_end {p.pad_end} crop all of {h}x{w}")
        out = tuple(self._out_size(s) for s in inner)
        if out[0] is None:
            out = (p.height, p.width)
        if min(out) <= 0:
            self.fail(f"output size {out} must be positive")
        top[0].reshape(n, c, *out)
        key = (shape, out)
        if key == self._key:
            return
        self._key = key
        self._window = (slice(None), slice(crop, crop + inner[0]), slice(crop, crop + inner[1]))
        self._cropped = inner != (h, w)
        self._rows = interpolation_matrix(inner[0], out[0])             # (out_h, in_h)
        self._cols_t = interpolation_matrix(inner[1], out[1]).T.copy()  # (in_w, out_w)
        planes = n * c
        self._inner = np.zeros((planes, *inner), np.float32)            # the cropped input
        self._half = np.zeros((planes, inner[0], out[1]), np.float32)   # resized along w

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(-1, *bottom[0].shape[2:])
        if self._cropped:
            np.copyto(self._inner, x[self._window])
            x = self._inner
        planes, in_h, in_w = self._inner.shape
        gemm(x.reshape(planes * in_h, in_w), self._cols_t,
             self._half.reshape(planes * in_h, -1))
        np.matmul(self._rows, self._half, out=top[0].data.reshape(planes, *top[0].shape[2:]))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        planes, in_h, in_w = self._inner.shape
        dy = top[0].diff.reshape(planes, *top[0].shape[2:])
        np.matmul(self._rows.T, dy, out=self._half)
        dx = bottom[0].diff.reshape(-1, *bottom[0].shape[2:])
        target = self._inner if self._cropped else dx
        gemm(self._half.reshape(planes * in_h, -1), self._cols_t.T,
             target.reshape(planes * in_h, in_w))
        if self._cropped:
            dx.fill(0)
            dx[self._window] = self._inner
