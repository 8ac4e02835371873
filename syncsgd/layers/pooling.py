"""Pooling: MAX and AVE over 2-D windows of (N, C, H, W) blobs, with Caffe's output-size rules.

Windows are evaluated one kernel offset at a time over the whole batch (see im2col.offset_view).
The image sits in a buffer padded with a value that never changes the result (-FLT_MAX for MAX, 0
for AVE) and large enough for every window, including the ones that ceil rounding lets hang over
the edge. MAX keeps the first maximum in window order, as Caffe does; a window that holds no image
pixel at all (possible in ceil mode when stride > kernel) gives -FLT_MAX and mask -1 for MAX, as in
Caffe, and 0 for AVE (where Caffe would divide 0 by a window size of 0).
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.im2col import offset_view
from syncsgd.layers.registry import register
from syncsgd.proto import pb

_P = pb.PoolingParameter
_LOWEST = np.float32(-np.finfo(np.float32).max)


def pooled_size(size, kernel, pad, stride, ceil_mode):
    """Caffe's pooled output size along one axis: rounded up or down, and with padding the last
    window must start inside the image."""
    span = size + 2 * pad - kernel
    pooled = (-(-span // stride) if ceil_mode else span // stride) + 1
    if pad and (pooled - 1) * stride >= size + pad:
        pooled -= 1
    return pooled


def _pair(p, field, prefix):
    """(h, w) from a single-valued field or its prefix_h / prefix_w forms, which come together."""
    h, w = f"{prefix}_h", f"{prefix}_w"
    if p.HasField(h) or p.HasField(w):
        if p.HasField(field) or not (p.HasField(h) and p.HasField(w)):
            raise ValueError(f"give either {field} or both {h} and {w}")
        return getattr(p, h), getattr(p, w)
    return getattr(p, field), getattr(p, field)


@register
class PoolingLayer(Layer):
    type = "Pooling"
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2      # MAX may output its argmax mask (index h * W + w in the plane) as top[1]

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.pooling_param
        self.method = p.pool
        if self.method not in (_P.MAX, _P.AVE):
            self.fail("pooling_param.pool STOCHASTIC is not supported; use MAX or AVE")
        if len(top) > 1 and self.method != _P.MAX:
            self.fail("only MAX pooling has a second top (the argmax mask); remove it")
        self.global_pooling = p.global_pooling
        self.ceil_mode = p.round_mode == _P.CEIL
        try:
            if self.global_pooling:
                if any(p.HasField(f) for f in ("kernel_size", "kernel_h", "kernel_w")):
                    raise ValueError("with global_pooling the kernel is the whole image; remove "
                                     "kernel_size / kernel_h / kernel_w")
                self.kernel = None
            else:
                if not (p.HasField("kernel_size") or p.HasField("kernel_h")
                        or p.HasField("kernel_w")):
                    raise ValueError("kernel_size (or kernel_h and kernel_w) is required")
                self.kernel = _pair(p, "kernel_size", "kernel")
                if min(self.kernel) <= 0:
                    raise ValueError(f"kernel size must be positive, got {self.kernel}")
            self.pad = _pair(p, "pad", "pad")
            self.stride = _pair(p, "stride", "stride")
        except ValueError as e:
            self.fail(f"pooling_param: {e}")
        if min(self.stride) <= 0:
            self.fail(f"pooling_param stride must be positive, got {self.stride}")
        if self.global_pooling and (any(self.pad) or self.stride != (1, 1)):
            self.fail("with pooling_param.global_pooling only pad 0 and stride 1 are allowed")
        if self.kernel and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]):
            self.fail(f"pooling_param pad {self.pad} must be smaller than the kernel "
                      f"{self.kernel}")
        self._key = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            self.fail(f"bottom must have 4 axes (num, channels, height, width), got {shape}")
        size = shape[2:]
        kernel = size if self.global_pooling else self.kernel
        pooled = tuple(pooled_size(*a, self.ceil_mode)
                       for a in zip(size, kernel, self.pad, self.stride))
        if min(pooled) <= 0:
            self.fail(f"pooled size {pooled} from input {size} is empty: the kernel {kernel} "
                      f"does not fit the padded image")
        for t in top:
            t.reshape(shape[:2] + pooled)
        key = (shape, kernel, pooled)
        if key != self._key:
            self._key = key
            self._allocate(shape, kernel, pooled)

    def _allocate(self, shape, kernel, pooled):
        self._kernel, self._pooled = kernel, pooled
        n, c, h, w = shape
        # Rows and columns every window touches, counted from -pad.
        reach = [(p - 1) * s + k for p, s, k in zip(pooled, self.stride, kernel)]
        self._buffered = any(self.pad) or reach[0] > h or reach[1] > w
        if self._buffered:
            extent = (max(reach[0], self.pad[0] + h), max(reach[1], self.pad[1] + w))
            fill = _LOWEST if self.method == _P.MAX else 0
            self._padded = np.full((n, c) + extent, fill, np.float32)
            self._padded_diff = np.zeros((n, c) + extent, np.float32)
            self._interior = (slice(None), slice(None), slice(self.pad[0], self.pad[0] + h),
                              slice(self.pad[1], self.pad[1] + w))
        if self.method == _P.MAX:
            self._select = np.empty((n, c) + pooled, bool)
            # The argmax as kernel offset i * kw + j, and a scratch array of the same type.
            offsets = kernel[0] * kernel[1]
            self._argmax = np.empty((n, c) + pooled, np.int8 if offsets < 128 else np.int32)
            self._scratch = np.empty_like(self._argmax)
        else:
            # Caffe's divisor: the window clipped to the padded image, not to the image.
            sizes = []
            for p, s, k, length, pad in zip(pooled, self.stride, kernel, shape[2:], self.pad):
                start = np.arange(p) * s - pad
                sizes.append(np.minimum(start + k, length + pad) - start)
            self._pool_size = np.maximum(np.outer(*sizes), 1).astype(np.float32)
        self._scratch_diff = np.empty((n, c) + pooled, np.float32)

    def _windows(self, array):
        """(offset, view) for each kernel offset in window order; views are (N, C, ph, pw)."""
        kh, kw = self._kernel
        for i in range(kh):
            for j in range(kw):
                yield i * kw + j, offset_view(array, i, j, self._pooled, self.stride)

    def forward(self, bottom, top):
        source = bottom[0].data
        if self._buffered:
            self._padded[self._interior] = source
            source = self._padded
        out = top[0].data
        if self.method == _P.MAX:
            out.fill(_LOWEST)
            self._argmax.fill(-1)
            arg, step = self._argmax, self._scratch
            for k, view in self._windows(source):
                np.greater(view, out, out=self._select)
                np.fmax(out, view, out=out)     # like the comparison, passes over NaN as Caffe
                # arg = where(select, k, arg), without masked writes (several times slower)
                np.subtract(k, arg, out=step)
                np.multiply(step, self._select, out=step)
                arg += step
            if len(top) > 1:
                top[1].data[...] = self._mask(bottom[0].shape[3])
        else:
            out.fill(0)
            for _, view in self._windows(source):
                out += view
            out /= self._pool_size

    def _mask(self, width):
        """Caffe's top mask: the argmax as an index h * width + w into the image plane, or -1."""
        kw = self._kernel[1]
        rows = np.arange(self._pooled[0]) * self.stride[0] - self.pad[0]
        cols = np.arange(self._pooled[1]) * self.stride[1] - self.pad[1]
        index = ((rows[:, None] + self._argmax // kw) * width
                 + cols[None, :] + self._argmax % kw)
        return np.where(self._argmax < 0, -1, index)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        target = self._padded_diff if self._buffered else bottom[0].diff
        target.fill(0)
        dy = top[0].diff
        if self.method == _P.MAX:
            routed = self._scratch_diff
            for k, view in self._windows(target):
                np.equal(self._argmax, k, out=self._select)
                np.multiply(dy, self._select, out=routed)
                view += routed
        else:
            np.divide(dy, self._pool_size, out=self._scratch_diff)
            for _, view in self._windows(target):
                view += self._scratch_diff
        if self._buffered:
            bottom[0].diff[...] = target[self._interior]
