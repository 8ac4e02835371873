"""Shared window kernels: im2col / col2im for Convolution, Deconvolution and Im2col over any number
of spatial axes, and for 2-D layers MEC's row lowering, WideIm2Col and the window ranges Pooling
also uses.

Columns are channel-major, batched over the minibatch; in 2-D
    cols[c, i, j, n, y, x] = image[n, c, y*stride_h + i*dil_h - pad_h, x*stride_w + j*dil_w - pad_w]
(0 outside the image), viewed as a (C*kh*kw, n*out_h*out_w) matrix, and likewise with one kernel
offset and one window position per axis in N-D (BVLC's im2col_nd_cpu, its rows in the order of
the (C, k1, ..., kN) weights). One GEMM covers every sample, or, because sample n's columns are
the (C*kh*kw, out_h*out_w) block at column n*out_h*out_w (a view with a leading dimension BLAS
accepts), one GEMM per sample can write straight into the sample's feature maps;
plans.plan_convolution picks per layer shape.

Im2Col runs one kernel offset at a time (kh*kw strided copies or adds over the whole batch,
the copies shared out to the process's threads); the padding is never materialised: each offset
copies only the windows inside the image and zeroes the border it does not reach. WideIm2Col,
for 2-D stride-1 layers with small maps, builds the columns with one copy over whole padded rows
(see its docstring).
"""
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from syncsgd.kernels.blas import spread
from syncsgd.kernels.scratch import scratch

def kernel_extent(kernel, dilation):
    return dilation * (kernel - 1) + 1


def conv_out_size(size, kernel, pad, stride, dilation=1):
    """Caffe's convolution output size; may be <= 0 when the kernel does not fit (caller checks)."""
    return (size + 2 * pad - kernel_extent(kernel, dilation)) // stride + 1


def deconv_out_size(size, kernel, pad, stride, dilation=1):
    """Caffe's deconvolution output size: the input size of the convolution it transposes."""
    return stride * (size - 1) + kernel_extent(kernel, dilation) - 2 * pad


def inside(offset, pad, stride, size, out):
    """(first, stop) window positions along one axis whose input index
    position * stride + offset - pad lies in [0, size), and the input index of `first`."""
    first = max(0, -(-(pad - offset) // stride))
    stop = min(out, (size - 1 + pad - offset) // stride + 1)
    return first, max(first, stop), first * stride + offset - pad


def _fill_block(item, worker=0):
    """Copy one kernel offset's windows into its column block, zero where they leave the image."""
    block, (inner, border), window = item
    block[inner] = window
    for where in border:
        block[where] = 0


class Im2Col:
    """im2col / col2im for one geometry over any number of spatial axes; size, kernel, pad,
    stride, dilation have one value per axis and out_size is the window grid."""

    def __init__(self, channels, size, kernel, pad, stride, dilation):
        self.channels, self.size, self.kernel = channels, tuple(size), tuple(kernel)
        self.pad, self.stride, self.dilation = tuple(pad), tuple(stride), tuple(dilation)
        self.out_size = tuple(conv_out_size(*a) for a in zip(size, kernel, pad, stride, dilation))
        self.rows = channels * math.prod(kernel)
        self.pixels = math.prod(self.out_size)
        self._transpose = (1, 0) + tuple(range(2, 2 + len(self.size)))   # (n, C) -> (C, n)
        # Each kernel offset's indices, worked out once: a pass only slices with them.
        self._spans = [self._span(offset) for offset in np.ndindex(*self.kernel)]

    def _span(self, offset):
        """Where kernel offset `offset` (one index per axis) reads and writes, as indices: its
        block of the (C, *kernel, n, *out_size) columns, the window positions inside the image
        in that (C, n, *out_size) block, the image values they read in the (C, n, *size)
        images, and the parts of the block outside the image (to zero), axis by axis."""
        every = (slice(None), slice(None))        # channels, samples
        inner, read, border = every, every, []
        for k, d, p, s, size, out in zip(offset, self.dilation, self.pad, self.stride,
                                         self.size, self.out_size):
            first, stop, start = inside(k * d, p, s, size, out)
            if first > 0:
                border.append(inner + (slice(0, first),))
            if stop < out:
                border.append(inner + (slice(stop, None),))
            inner += (slice(first, stop),)
            read += (slice(start, start + s * (stop - first - 1) + 1, s) if stop > first
                     else slice(0, 0),)
        return (slice(None),) + offset, (inner, border), read

    def columns(self, n):
        """The shared column buffer for n images as a (rows, n*pixels) matrix."""
        return scratch("columns", (self.rows, n * self.pixels))

    def _blocks(self, cols, images):
        """(column block, its windows' index and border, image block) per kernel offset; cols
        is the (rows, n*pixels) matrix, images (n, C, *size)."""
        n = images.shape[0]
        grid = cols.reshape((self.channels,) + self.kernel + (n,) + self.out_size)
        source = images.transpose(self._transpose)                   # (C, n, *size)
        for block, windows, read in self._spans:
            yield grid[block], windows, source[read]

    def im2col(self, images, cols=None):
        """images (n, C, *size), any strides -> the filled (rows, n*pixels) column matrix.

        The kernel offsets' copies are shared out to the process's threads (one thread when
        called from a thread that already works on its own share)."""
        cols = self.columns(images.shape[0]) if cols is None else cols
        spread(list(self._blocks(cols, images)), _fill_block)
        return cols

    def col2im(self, cols, out):
        """Sum the (rows, n*pixels) columns back over the windows into out (n, C, *size),
        which is overwritten."""
        out[...] = 0
        for block, (inner, _), window in self._blocks(cols, out):
            window += block[inner]
        return out


class WideIm2Col:
    """im2col / col2im of a stride-1 convolution over whole padded rows.

    The windows of kernel offset (i, j) for output rows y and every padded column x read the
    padded image's values at (y + i*dil_h) * padded_w + x + j*dil_w: one contiguous run per image
    and channel. So the columns are built by one copy of a strided view, and col2im is kh*kw
    contiguous additions, where Im2Col needs kh*kw copies whose rows are only out_w long (slow
    for small images). The price: the GEMM also computes the padded_w - out_w columns past the
    right edge of every output row, which the layer drops (and feeds zeros for in backward).
    """

    def __init__(self, channels, size, kernel, pad, dilation):
        self.channels, self.size, self.kernel = channels, tuple(size), tuple(kernel)
        self.pad, self.dilation = tuple(pad), tuple(dilation)
        (h, w), (ph, pw) = self.size, self.pad
        self.padded = (h + 2 * ph, w + 2 * pw)
        extent = [kernel_extent(k, d) for k, d in zip(kernel, dilation)]
        self.out_size = (self.padded[0] - extent[0] + 1, self.padded[1] - extent[1] + 1)
        self.width = self.padded[1]                     # the GEMM's row length
        self.rows = channels * kernel[0] * kernel[1]
        self.pixels = self.out_size[0] * self.width
        # One padded image plane, with room for the last runs to end inside it.
        self.plane = self.padded[0] * self.padded[1] + extent[1] - 1
        self._offsets = [i * dilation[0] * self.width + j * dilation[1]
                         for i in range(kernel[0]) for j in range(kernel[1])]

    def columns(self, n):
        return scratch("columns", (self.rows, n * self.pixels))

    def _buffer(self, n):
        """The shared (n, C, plane) padded-image buffer and its (n, C, H, W) image part."""
        buffer = scratch("padded", (n, self.channels, self.plane))
        (hp, wp), (h, w), (ph, pw) = self.padded, self.size, self.pad
        grid = buffer[:, :, :hp * wp].reshape(n, self.channels, hp, wp)
        return buffer, grid, grid[:, :, ph:ph + h, pw:pw + w]

    def im2col(self, images, cols=None):
        n = images.shape[0]
        cols = self.columns(n) if cols is None else cols
        buffer, grid, image = self._buffer(n)
        (h, w), (ph, pw) = self.size, self.pad
        grid[:, :, :ph] = 0
        grid[:, :, ph + h:] = 0
        grid[:, :, ph:ph + h, :pw] = 0
        grid[:, :, ph:ph + h, pw + w:] = 0
        buffer[:, :, grid.shape[2] * grid.shape[3]:] = 0
        image[...] = images
        step = buffer.itemsize
        kh, kw = self.kernel
        runs = as_strided(buffer, (self.channels, kh, kw, n, self.pixels),
                          (self.plane * step, self.dilation[0] * self.width * step,
                           self.dilation[1] * step, self.channels * self.plane * step, step),
                          writeable=False)
        np.copyto(cols.reshape(self.channels, kh, kw, n, self.pixels), runs)
        return cols

    def col2im(self, cols, out):
        n = out.shape[0]
        buffer, _, image = self._buffer(n)
        buffer.fill(0)
        target = buffer.transpose(1, 0, 2)                 # (C, n, plane)
        runs = cols.reshape(self.channels, len(self._offsets), n, self.pixels)
        for k, offset in enumerate(self._offsets):
            target[:, :, offset:offset + self.pixels] += runs[:, k]
        out[...] = image
        return out


class RowLowering:
    """The lowering of Cho and Brand's MEC ("memory-efficient convolution", 2017) for stride-1
    convolutions: each output column's windows over *all* padded rows, one kernel row apart.

    lowered[(n, x), (r, j, c)] = padded_image[n, c, r, x + j], a (n*out_w, padded_h*kw*C) matrix;
    output row y is then one GEMM with lowered[:, y*kw*C : (y + kh)*kw*C], a (n*out_w, kh*kw*C)
    view whose columns are the windows of row y in (i, j, c) order. The lowering is kw times the
    image (im2col's is kh*kw times), every GEMM is exactly as large as the convolution (no wide
    columns), and the copy that builds it moves runs of kw*C contiguous values from a channels-
    last padded image. It wins where C is large enough for those runs and for the GEMMs' K; for
    a few channels WideIm2Col stays ahead (docs/performance.md, "Convolution: row lowering").
    """

    def __init__(self, channels, size, kernel, pad):
        self.channels, self.size, self.kernel, self.pad = channels, tuple(size), tuple(kernel), \
            tuple(pad)
        (h, w), (kh, kw), (ph, pw) = self.size, self.kernel, self.pad
        self.padded = (h + 2 * ph, w + 2 * pw)
        self.out_size = (self.padded[0] - kh + 1, self.padded[1] - kw + 1)
        self.step = kw * channels                    # columns per kernel row
        self.rows = kh * self.step                   # the GEMMs' K
        self.width = self.padded[0] * self.step      # columns of the lowered matrix
        self.sample_bytes = 4 * self.out_size[1] * self.width

    def lower(self, images):
        """images (n, C, H, W) -> the (n*out_w, padded_h*kw*C) lowered matrix (shared scratch)."""
        n = images.shape[0]
        (h, w), (ph, pw), (hp, wp) = self.size, self.pad, self.padded
        padded = scratch("padded", (n, hp, wp, self.channels))
        padded[:, :ph] = 0
        padded[:, ph + h:] = 0
        padded[:, ph:ph + h, :pw] = 0
        padded[:, ph:ph + h, pw + w:] = 0
        padded[:, ph:ph + h, pw:pw + w] = images.transpose(0, 2, 3, 1)
        s = padded.strides
        out_w, kw = self.out_size[1], self.kernel[1]
        runs = as_strided(padded, (n, out_w, hp, kw, self.channels),
                          (s[0], s[2], s[1], s[2], s[3]), writeable=False)
        lowered = scratch("columns", (n * out_w, self.width))
        np.copyto(lowered.reshape(n, out_w, hp, kw, self.channels), runs)
        return lowered

    def unlower(self, lowered, out):
        """The transpose of lower: sum the (n*out_w, padded_h*kw*C) matrix back over the
        windows into out (n, C, H, W), which is overwritten."""
        n = out.shape[0]
        (h, w), (ph, pw), (hp, wp) = self.size, self.pad, self.padded
        out_w, kw = self.out_size[1], self.kernel[1]
        padded = scratch("padded", (n, hp, wp, self.channels))
        padded.fill(0)
        runs = lowered.reshape(n, out_w, hp, kw, self.channels)
        for j in range(kw):
            padded[:, :, j:j + out_w] += runs[:, :, :, j].transpose(0, 2, 1, 3)
        np.copyto(out, padded[:, ph:ph + h, pw:pw + w].transpose(0, 3, 1, 2))
        return out

    def window(self, lowered, row):
        """The (n*out_w, kh*kw*C) windows of output row `row`."""
        return lowered[:, row * self.step:row * self.step + self.rows]
