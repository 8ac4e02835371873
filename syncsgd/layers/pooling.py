"""Pooling: MAX and AVE over 2-D windows of (N, C, H, W) blobs, with Caffe's output-size rules.

Windows are evaluated one kernel offset at a time, on parts of the batch that the process's
threads take in turn. The image is first split by column phase (column modulo the horizontal
stride) into `planes`, padded with a value that never changes the result (-FLT_MAX for MAX, 0 for
AVE) and large enough for every window, including the ones that ceil rounding lets hang over the
edge: every kernel offset then reads rows of contiguous values from one plane, which numpy
processes about twice as fast as the column-strided view of the image (CIFAR-10 quick's pool1:
0.6 ms against 1.2 ms per offset and operation). Gradients are summed in planes of the same layout
and interleaved back once. The planes are a buffer all layers share (im2col.scratch), not one per
layer.

MAX keeps the first maximum in window order, as Caffe does; a window that holds no image pixel at
all (possible in ceil mode when stride > kernel) gives -FLT_MAX and mask -1 for MAX, as in Caffe,
and 0 for AVE (where Caffe would divide 0 by a window size of 0).
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.blas import spread, threads
from syncsgd.layers.im2col import inside, scratch
from syncsgd.layers.registry import register
from syncsgd.proto import pb

_P = pb.PoolingParameter
# Window values (outputs x kernel offsets) from which a batch is split over threads (a quarter
# of a millisecond of work; on 2 idle cores LeNet's pool1 then takes 4.3 ms instead of 5.5).
PARALLEL_WORK = 1 << 18
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
        self._window_values = c * pooled[0] * pooled[1] * kernel[0] * kernel[1]   # per sample
        (ph, pw), sw = self.pad, self.stride[1]
        # Rows and columns every window touches, counted from -pad.
        reach = [(p - 1) * s + k for p, s, k in zip(pooled, self.stride, kernel)]
        rows, cols = max(reach[0], ph + h), max(reach[1], pw + w)
        # The image itself is the only plane when no padding, overhang or stride splits it.
        self._direct = sw == 1 and not any(self.pad) and reach[0] <= h and reach[1] <= w
        # Windows that tile the planes exactly (kernel = stride, as LeNet's and VGG's 2x2 / 2):
        # backward then writes each gradient once instead of clearing and adding.
        self._tiled = (tuple(kernel) == tuple(self.stride)
                       and reach == ([h, w] if self._direct else [rows, cols]))
        if not self._direct:
            # The planes live in buffers all layers share (im2col.scratch).
            self._plane_shape = (sw, n, c, rows, -(-cols // sw))
            width = self._plane_shape[-1]
            # Per phase: (its columns holding the image, the image columns they hold).
            self._phases = []
            for r in range(sw):
                first, stop, start = inside(r, pw, sw, w, width)
                self._phases.append((slice(first, stop),
                                     slice(start, start + sw * (stop - first - 1) + 1, sw)))
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

    def _split(self, image, planes):
        """The planes holding `image` (n, c, h, w) (the image itself when _direct), the rest of
        them filled with the neutral value; `planes` is their buffer."""
        if self._direct:
            return image[None]
        fill = _LOWEST if self.method == _P.MAX else 0
        top, bottom = self.pad[0], self.pad[0] + image.shape[2]
        for plane, (columns, image_columns) in zip(planes, self._phases):
            plane[:, :, :top] = fill
            plane[:, :, bottom:] = fill
            plane[:, :, top:bottom, :columns.start] = fill
            plane[:, :, top:bottom, columns.stop:] = fill
            plane[:, :, top:bottom, columns] = image[..., image_columns]
        return planes

    def _parts(self, n):
        """Slices of the batch for the process's threads (two per thread, for balance), or the
        whole batch when the work is too small to be worth handing out."""
        if n * self._window_values < PARALLEL_WORK:
            return [slice(0, n)]
        count = max(1, min(n, 2 * threads()))
        return [slice(i * n // count, (i + 1) * n // count) for i in range(count)]

    def _planes(self):
        return None if self._direct else scratch("pooling", self._plane_shape)

    def _windows(self, planes):
        """(offset, view) for each kernel offset in window order; views are (N, C, ph, pw)."""
        kh, kw = self._kernel
        (sh, sw), (rows, cols) = self.stride, self._pooled
        for i in range(kh):
            for j in range(kw):
                plane = planes[j % sw]
                yield i * kw + j, plane[..., i:i + sh * (rows - 1) + 1:sh,
                                        j // sw:j // sw + cols]

    def forward(self, bottom, top):
        """The batch is split into parts that the process's threads take in turn."""
        image, out, planes = bottom[0].data, top[0].data, self._planes()
        spread(self._parts(image.shape[0]),
               lambda part, worker: self._forward_part(
                   part, image[part], out[part], None if planes is None else planes[:, part]))
        if len(top) > 1:
            top[1].data[...] = self._mask(image.shape[3])

    def _forward_part(self, part, image, out, planes):
        planes = self._split(image, planes)
        if self.method == _P.MAX:
            out.fill(_LOWEST)
            arg, step, select = self._argmax[part], self._scratch[part], self._select[part]
            arg.fill(-1)
            for k, view in self._windows(planes):
                np.greater(view, out, out=select)
                np.fmax(out, view, out=out)     # like the comparison, passes over NaN as Caffe
                # arg = where(select, k, arg), without masked writes (several times slower)
                np.subtract(k, arg, out=step)
                np.multiply(step, select, out=step)
                arg += step
        else:
            out.fill(0)
            for _, view in self._windows(planes):
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
        dy, dx, planes = top[0].diff, bottom[0].diff, self._planes()
        spread(self._parts(dy.shape[0]),
               lambda part, worker: self._backward_part(
                   part, dy[part], dx[part], None if planes is None else planes[:, part]))

    def _backward_part(self, part, dy, dx, planes):
        target = dx[None] if self._direct else planes
        if not self._tiled:
            target.fill(0)
        routed = scratch("pooling_routed", dy.shape)
        if self.method == _P.MAX:
            select = self._select[part]
            for k, view in self._windows(target):
                np.equal(self._argmax[part], k, out=select)
                if self._tiled:
                    np.multiply(dy, select, out=view)
                else:
                    np.multiply(dy, select, out=routed)
                    view += routed
        else:
            np.divide(dy, self._pool_size, out=routed)
            for _, view in self._windows(target):
                if self._tiled:
                    np.copyto(view, routed)
                else:
                    view += routed
        if not self._direct:
            h = dx.shape[2]
            for plane, (columns, image_columns) in zip(target, self._phases):
                dx[..., image_columns] = plane[:, :, self.pad[0]:self.pad[0] + h, columns]
