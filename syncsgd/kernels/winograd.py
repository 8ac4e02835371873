"""Winograd's minimal filtering F(2x2, 3x3) (Lavin and Gray, 2015) for 3x3 stride-1 convolutions
(and below, F(4x4, 3x3), F(2x2, 5x5) and strided windows on the image's space-to-depth): each
2x2 block of outputs from a 4x4 tile of the image in 16 products instead of 36, so the
convolution becomes 16 GEMMs of 4/9 of the direct one's flops (run as one batch:
blas.batched_gemm), between transforms that only add and subtract. Where the GEMM rate is the
limit (3x3 layers of 128 channels and more) this is the one way left to go faster than a direct
convolution at that rate.

With the transforms G (weights), B (image tiles) and A (outputs) of the paper,
    U[q] = (G w G^T)[q]   for the 16 points q of a tile, an (outputs, channels) matrix each,
    V[q] = (B^T d B)[q]   for every tile d of the padded image, a (tiles, channels) matrix each,
    M[q] = V[q] @ U[q]^T, maps = A^T M A per tile.
All three are linear, so the weight gradient and the image gradient are their adjoints:
dM = A dY A^T per tile, dU[q] = dM[q]^T @ V[q] (then dW = G^T dU G), dV[q] = dM[q] @ U[q]
(then summed back over the overlapping tiles by B dV B^T). Each transform of the weights is
one GEMM with G (x) G. The tiles are channels-last (a tile point of every tile is one row of
channels), so every pass adds whole rows of channels; the maps and images stay (n, C, H, W)
outside. Tiles overlap by two pixels: a 4x4 tile every 2 pixels, the image padded to whole
tiles (zeros beyond the layer's own padding, outputs cropped).

Where Numba is available (kernels/compiled.py) the transforms and the copies between NCHW and
channels-last run as compiled loops (kernels/winograd_transforms.py), a tile's 16 points at a
time, with the same results; the numpy passes below are the fallback.

F(4x4, 3x3) (6x6 tiles every 4 pixels, 36 GEMMs of 1/4 of the direct flops) and F(2x2, 5x5)
(the same 6x6 tiles and points every 2 pixels, 36 GEMMs of 9/25 of the direct flops: AlexNet's
conv2, GoogLeNet's 5x5 branches) run on compiled transforms only. Their transforms scale by up
to 8 and down to 1/24, so their error is a few times F(2x2, 3x3)'s (relative to the largest
value against float64: F(4x4, 3x3) 2-4e-6 on 64 channels, F(2x2, 5x5) 1-9e-6 on 5-12, F(2x2,
3x3) 1e-6, whose transforms are exact in float32); in numpy
their scaled terms cost more than the GEMMs save, as loops they cost less than F(2x2, 3x3)'s
(docs/performance.md, "Convolution: Winograd").

F(4x4, 5x5) takes 8x8 tiles every 4 pixels, on F(6x6, 3x3)'s points (0, +-1, +-2, +-1/2 and
infinity): 64 GEMMs of 4/25 of the direct flops, against F(2x2, 5x5)'s 36 of 9/25, and a
quarter as many tiles to transform. Its transforms scale by up to 21/4 and G down to 1/90:
2-14e-6 of the largest value against float64 (docs/performance.md, "Convolution: Winograd
F(4x4, 5x5)").

The layer gives a kernel a chunk of samples on each thread, or where a thread's share of the
batch has few tiles (plans.Thresholds.winograd_shared_tiles) the whole batch on one: the kernel
then shares each transform out by samples (_in_parts) and its products run on every thread in
one batched call, so that U is read once rather than once a thread, and the weight gradient is
one dU rather than one a thread, summed.
"""
import math

import numpy as np

from syncsgd.kernels import compiled, winograd_transforms
from syncsgd.kernels.blas import batched_gemm, gemm, spread
from syncsgd.kernels.scratch import scratch
from syncsgd.kernels.threads import budget

# The kernels by their names in a plan: F(m x m, r x r) as (m, r), tiles of m + r - 1 points a
# side, one every m pixels.
VARIANTS = {"winograd": (2, 3), "winograd4": (4, 3), "winograd_5x5": (2, 5),
            "winograd4_5x5": (4, 5)}
# G, the weights' transform, (m + r - 1, r) by name; on a flattened r x r window it is G (x) G.
# F(2x2, 5x5)'s rows are each point's powers 1, p, .., p^4 scaled so that its B is F(4x4, 3x3)'s.
G = {"winograd": np.array([[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]]),
     "winograd4": np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                            [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
     "winograd_5x5": np.array([[1 / 4, 0, 0, 0, 0], [-1 / 6, -1 / 6, -1 / 6, -1 / 6, -1 / 6],
                               [-1 / 6, 1 / 6, -1 / 6, 1 / 6, -1 / 6],
                               [1 / 24, 1 / 12, 1 / 6, 1 / 3, 2 / 3],
                               [1 / 24, -1 / 12, 1 / 6, -1 / 3, 2 / 3], [0, 0, 0, 0, 1]]),
     # F(4x4, 5x5)'s, solved for the B of F(6x6, 3x3) (winograd_transforms.tiles8).
     "winograd4_5x5": np.array([[1, 0, 0, 0, 0], [-2 / 9] * 5,
                                [-2 / 9, 2 / 9, -2 / 9, 2 / 9, -2 / 9],
                                [1 / 90, 1 / 45, 2 / 45, 4 / 45, 8 / 45],
                                [1 / 90, -1 / 45, 2 / 45, -4 / 45, 8 / 45],
                                [32 / 45, 16 / 45, 8 / 45, 4 / 45, 2 / 45],
                                [32 / 45, -16 / 45, 8 / 45, -4 / 45, 2 / 45], [0, 0, 0, 0, 1]])}
GG = {name: np.kron(g, g).astype(np.float32) for name, g in G.items()}


def names(geometry):
    """The kernels that compute `geometry` here, in VARIANTS' order: a 2-D convolution of an
    r x r window, stride and dilation 1, or of a k x k window with stride s on both axes where
    ceil(k / s) is r (on the image's space-to-depth: see Winograd); all but F(2x2, 3x3) at
    stride 1 need the compiled transforms."""
    g = geometry
    if (len(g.kernel) != 2 or g.dilation != (1, 1) or g.reverse or g.force_nd
            or g.stride[0] != g.stride[1] or g.kernel[0] != g.kernel[1]):
        return []
    stride = g.stride[0]
    window = -(-g.kernel[0] // stride)
    return [name for name, (m, r) in VARIANTS.items()
            if r == window and ((name == "winograd" and stride == 1) or compiled.available())]


def channels(geometry):
    """The channels Winograd's products take: the image's, stride^2 times as many on the
    space-to-depth of a strided window."""
    return geometry.image_channels * math.prod(geometry.stride)


def tile_outputs(geometry):
    """The largest tile (outputs a side) of the kernels that compute `geometry` here."""
    return max(VARIANTS[name][0] for name in names(geometry))


def _strided(a, axis, start, count):
    """`count` entries of `a` along `axis` from `start`, every second one."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, start + 2 * count, 2)
    return a[tuple(index)]


def _tile_rows(d, axis, out):
    """out[0..3] = B^T's rows along `axis` of d, one tile every 2 entries: d0 - d2, d1 + d2,
    d2 - d1, d1 - d3 (d_k: the tiles' k-th entries)."""
    count = out[0].shape[axis]
    d0, d1, d2, d3 = (_strided(d, axis, k, count) for k in range(4))
    np.subtract(d0, d2, out=out[0])
    np.add(d1, d2, out=out[1])
    np.subtract(d2, d1, out=out[2])
    np.subtract(d1, d3, out=out[3])


def _untile_rows(v, axis, out):
    """The adjoint of _tile_rows: out (along `axis`, 2 * count + 2 entries) = the sum over the
    tiles of what each of their 4 entries gave to v[0..3] (count tiles each)."""
    count = v[0].shape[axis]
    even, odd = _strided(out, axis, 0, count + 1), _strided(out, axis, 1, count + 1)
    head, tail = [slice(None)] * out.ndim, [slice(None)] * out.ndim
    head[axis], tail[axis] = slice(0, count), slice(1, count + 1)
    last = [slice(None)] * out.ndim
    last[axis] = slice(count, count + 1)
    head, tail, last = tuple(head), tuple(tail), tuple(last)
    # Entry 0 of a tile: v0; entry 1: v1 - v2 + v3; entry 2: v1 + v2 - v0; entry 3: -v3.
    # Entries 2 and 3 of tile j are entries 0 and 1 of tile j + 1.
    even[head] = v[0]
    even[last] = 0
    even[tail] += v[1]
    even[tail] += v[2]
    even[tail] -= v[0]
    np.subtract(v[1], v[2], out=odd[head])
    odd[head] += v[3]
    odd[last] = 0
    odd[tail] -= v[3]


def _channels_first(source, out, bias=None):
    """out (n, C, h, w) = source (n, h or more, w or more, C) cropped (+ bias per channel), an
    image row at a time: numpy's copy through the whole transposed view ran 2-6x slower."""
    n, _, h, w = out.shape
    bias = None if bias is None else bias[:, None]
    for i in range(n):
        for y in range(h):
            row = source[i, y, :w].T
            if bias is None:
                np.copyto(out[i, :, y], row)
            else:
                np.add(row, bias, out=out[i, :, y])


def _outputs(m, out):
    """out[0..1] = A^T's rows of m[0..3]: m0 + m1 + m2, m1 - m2 - m3."""
    np.add(m[0], m[1], out=out[0])
    out[0] += m[2]
    np.subtract(m[1], m[2], out=out[1])
    out[1] -= m[3]


def _outputs_adjoint(dy, out):
    """The adjoint of _outputs: out[0..3] = dy0, dy0 + dy1, dy0 - dy1, -dy1."""
    np.copyto(out[0], dy[0])
    np.add(dy[0], dy[1], out=out[1])
    np.subtract(dy[0], dy[1], out=out[2])
    np.negative(dy[1], out=out[3])


class Winograd:
    """F(m x m, r x r) for one geometry, VARIANTS[name], with the GEMM kernels' methods
    (kernels/convolution.py): `weights` is U as weight_matrix makes it, a weight gradient
    accumulates as dU (one per group of chunks) and add_gradients turns it into the weights'
    gradient; what weight_grad returns (dM) is what image_grad takes.

    A k x k convolution with stride s > 1 is the stride-1 convolution of an r x r window,
    r = ceil(k / s), over the image's space-to-depth: pixel (Y, X) of its channel (c s + dy) s
    + dx is pixel (s Y + dy, s X + dx) of channel c of the padded image, and tap (i, j) of the
    window the same of the k x k one, padded with zeros to r s. AlexNet's conv1 (11x11, stride
    4, 3 channels) so becomes a 3x3 convolution of 48 channels, 1.19 times its flops before
    Winograd's saving."""

    def __init__(self, geometry, name="winograd"):
        g = geometry
        self.name = name
        self.size, self.window = VARIANTS[name]
        self.side = self.size + self.window - 1
        self.points = self.side ** 2
        self.stride, self.kernel = g.stride[0], g.kernel[0]
        self.channels, self.outputs = channels(g), g.conv_out
        self.image_size, self.features_size, self.pad = g.image_size, g.features_size, g.pad
        self.tiles = tuple(-(-extent // self.size) for extent in g.features_size)
        self.padded = tuple(self.size * t + self.window - 1 for t in self.tiles)
        self._gradients = []
        self._unwritten = set()     # ids of gradient matrices no chunk has written yet
        # Per group: its outputs and its channels (a GEMM per group and tile point).
        m, c = g.conv_out // g.group, self.channels // g.group
        self.groups = [(slice(i * m, (i + 1) * m), slice(i * c, (i + 1) * c))
                       for i in range(g.group)]
        self.group_channels = c
        self._weights = np.empty((self.points, self.outputs, c), np.float32)
        self._compiled = compiled.available()
        self._no_bias = np.zeros(1, np.float32)

    # -- weights --------------------------------------------------------------------------------
    def weight_matrix(self, weights):
        """U = G w G^T per (output, channel of its group), as (points, outputs, channels /
        group), in the kernel's own buffer (a pass uses it, then the next pass's replaces
        it)."""
        if self.stride > 1:
            weights = self._weights_to_depth(weights)
        gemm(GG[self.name], weights.reshape(-1, self.window ** 2).T,
             self._weights.reshape(self.points, -1))
        return self._weights

    def _weights_to_depth(self, weights):
        """The r x r window of the space-to-depth of (outputs, channels, k, k) weights."""
        k, s, r = self.kernel, self.stride, self.window
        outputs, channels = weights.shape[:2]
        padded = np.zeros((outputs, channels, r * s, r * s), np.float32)
        padded[:, :, :k, :k] = weights
        return np.ascontiguousarray(padded.reshape(outputs, channels, r, s, r, s)
                                    .transpose(0, 1, 3, 5, 2, 4)).reshape(outputs, -1, r, r)

    def gradient_matrices(self, diff, share):
        """dU of each of `share` groups of chunks: the kernel's own, kept from pass to pass
        (fresh pages of 16 or 36 values a weight cost more than the zeros; so for U), not
        zeroed: the first chunk's products write it (beta 0, weight_grad), which saves a pass
        writing zeros and the products' reading them."""
        while len(self._gradients) < share:
            self._gradients.append(np.empty((self.points, self.outputs, self.group_channels),
                                            np.float32))
        self._unwritten.update(id(matrix) for matrix in self._gradients[:share])
        return self._gradients[:share]

    def add_gradients(self, matrices, diff):
        """diff (outputs, channels, r, r) += G^T dU G, dU the matrices' sum (one no chunk
        wrote counts as zeros)."""
        for matrix in matrices:
            if id(matrix) in self._unwritten:
                self._unwritten.discard(id(matrix))
                matrix.fill(0)
        total = matrices[0]
        for extra in matrices[1:]:
            total += extra
        if self.stride == 1:
            gemm(total.reshape(self.points, -1).T, GG[self.name],
                 diff.reshape(-1, self.window ** 2), beta=1.0)
            return
        k, s, r = self.kernel, self.stride, self.window
        outputs, channels = diff.shape[:2]
        windows = np.empty((outputs, channels * s * s, r, r), np.float32)
        gemm(total.reshape(self.points, -1).T, GG[self.name], windows.reshape(-1, r * r))
        padded = windows.reshape(outputs, channels, s, s, r, r).transpose(0, 1, 4, 2, 5, 3)
        diff += padded.reshape(outputs, channels, r * s, r * s)[:, :, :k, :k]

    # -- the three passes -----------------------------------------------------------------------
    def forward(self, weights, bias, images, maps):
        tiles = self._tiles(images)
        products = self._scratch("winograd_products", images.shape[0], self.outputs)
        for outputs, channels in self.groups:
            batched_gemm(tiles[:, :, channels], weights[:, outputs].transpose(0, 2, 1),
                         products[:, :, outputs])
        self._maps(products, bias, maps)

    def weight_grad(self, images, maps_diff, diff, kept):
        tiles = self._tiles(images)
        grad = self.carry(maps_diff)
        # A matrix is one group's of chunks, which one thread runs in turn: its first chunk of
        # samples writes it (set operations hold the interpreter lock; no other thread has its
        # id). Products over no samples write nothing.
        beta = 1.0
        if images.shape[0] and id(diff) in self._unwritten:
            self._unwritten.discard(id(diff))
            beta = 0.0
        for outputs, channels in self.groups:
            batched_gemm(grad[:, :, outputs].transpose(0, 2, 1), tiles[:, :, channels],
                         diff[:, outputs], beta=beta)
        return grad

    def carry(self, maps_diff):
        """dM = A dY A^T per tile, (points, tiles, outputs)."""
        n, (th, tw), k = maps_diff.shape[0], self.tiles, self.outputs
        h, w = self.features_size
        dy = scratch("winograd_maps", (n, self.size * th, self.size * tw, k))
        grad = self._scratch("winograd_products", n, k)
        if self._compiled:
            adjoint = {"winograd": winograd_transforms.outputs_adjoint,
                       "winograd4": winograd_transforms.outputs4_adjoint,
                       "winograd_5x5": winograd_transforms.outputs5_adjoint,
                       "winograd4_5x5": winograd_transforms.outputs45_adjoint}[self.name]

            def part(first, last):
                winograd_transforms.channels_last(maps_diff, dy, 0, 0, first, last)
                adjoint(dy, grad, first, last)
            _in_parts(n, part)
            return grad
        dy[:, :h, :w] = maps_diff.transpose(0, 2, 3, 1)
        dy[:, h:] = 0
        dy[:, :h, w:] = 0
        # Columns first: (a, s) for the output row a of a tile and its tile point column s.
        columns = scratch("winograd_rows", (2, 4, n, th, tw, k))
        for a in range(2):
            rows = _strided(dy, 1, a, th)
            _outputs_adjoint([_strided(rows, 2, b, tw) for b in range(2)], columns[a])
        points = grad.reshape(4, 4, n, th, tw, k)
        for s in range(4):
            _outputs_adjoint(columns[:, s], points[:, s])
        return grad

    def image_grad(self, weights, maps_diff, image_diff, grad):
        n = image_diff.shape[0]
        tiles = self._scratch("winograd_tiles", n, self.channels)
        for outputs, channels in self.groups:
            batched_gemm(grad[:, :, outputs], weights[:, outputs], tiles[:, :, channels])
        (th, tw), (ph, pw), c = self.tiles, self.padded, self.channels
        image = scratch("winograd_image", (n, ph, pw, c))
        pad_h, pad_w = self.pad
        cropped = image[:, pad_h:, pad_w:]
        if self._compiled:
            def part(first, last):
                if self.side == 8:
                    winograd_transforms.untile8(tiles, image, first, last)
                elif self.side == 6:
                    winograd_transforms.untile6(tiles, image, self.size, first, last)
                else:       # the rows of one sample at a time, in this thread's buffer
                    rows = scratch("winograd_rows", (4, th, pw, c))
                    winograd_transforms.untile(tiles, image, rows, first, last)
                if self.stride > 1:
                    winograd_transforms.depth_to_space(image, image_diff, pad_h, pad_w,
                                                       self.stride, first, last)
                else:
                    winograd_transforms.channels_first(cropped, image_diff, self._no_bias,
                                                       False, first, last)
            _in_parts(n, part)
            return
        points = tiles.reshape(4, 4, n, th, tw, c)
        rows = scratch("winograd_rows", (4, n, th, pw, c))
        for r in range(4):
            _untile_rows(points[r], 2, rows[r])
        _untile_rows(rows, 1, image)
        _channels_first(cropped, image_diff, None)

    # -- transforms -----------------------------------------------------------------------------
    def _scratch(self, name, n, width):
        """A (points, tiles of n samples, width) buffer."""
        return scratch(name, (self.points, n * math.prod(self.tiles), width))

    def _tiles(self, images):
        """V = B^T d B of every tile of images (n, C, H, W), (points, tiles, C)."""
        n, (th, tw), (ph, pw), c = images.shape[0], self.tiles, self.padded, self.channels
        (h, w), (pad_h, pad_w) = self.image_size, self.pad
        image = scratch("winograd_image", (n, ph, pw, c))
        tiles = self._scratch("winograd_tiles", n, c)
        if self._compiled:
            def part(first, last):
                if self.stride > 1:
                    winograd_transforms.space_to_depth(images, image, pad_h, pad_w,
                                                       self.stride, first, last)
                else:
                    winograd_transforms.channels_last(images, image, pad_h, pad_w, first, last)
                if self.side == 8:
                    winograd_transforms.tiles8(image, tiles, first, last)
                elif self.side == 6:
                    winograd_transforms.tiles6(image, tiles, self.size, first, last)
                else:
                    winograd_transforms.tiles(image, tiles, first, last)
            _in_parts(n, part)
            return tiles
        image[:, :pad_h] = 0
        image[:, pad_h + h:] = 0
        image[:, pad_h:pad_h + h, :pad_w] = 0
        image[:, pad_h:pad_h + h, pad_w + w:] = 0
        image[:, pad_h:pad_h + h, pad_w:pad_w + w] = images.transpose(0, 2, 3, 1)
        rows = scratch("winograd_rows", (4, n, th, pw, c))
        _tile_rows(image, 1, rows)
        points = tiles.reshape(4, 4, n, th, tw, c)
        for r in range(4):
            _tile_rows(rows[r], 2, points[r])
        return tiles

    def _maps(self, products, bias, maps):
        """maps (n, K, h, w) = A^T M A of every tile (+ bias)."""
        n, (th, tw), k = maps.shape[0], self.tiles, self.outputs
        out = scratch("winograd_maps", (n, self.size * th, self.size * tw, k))
        if self._compiled:
            transform = {"winograd": winograd_transforms.outputs,
                         "winograd4": winograd_transforms.outputs4,
                         "winograd_5x5": winograd_transforms.outputs5,
                         "winograd4_5x5": winograd_transforms.outputs45}[self.name]
            with_bias = bias is not None

            def part(first, last):
                transform(products, out, first, last)
                winograd_transforms.channels_first(out, maps, bias if with_bias else
                                                   self._no_bias, with_bias, first, last)
            _in_parts(n, part)
            return
        points = products.reshape(4, 4, n, th, tw, k)
        columns = scratch("winograd_rows", (2, 4, n, th, tw, k))
        for s in range(4):
            _outputs(points[:, s], columns[:, s])
        for a in range(2):
            rows = _strided(out, 1, a, th)
            _outputs(columns[a], [_strided(rows, 2, b, tw) for b in range(2)])
        _channels_first(out, maps, bias)


def _in_parts(n, work):
    """work(first, last) on parts of n samples, one for each thread of the budget: one part in
    a chunk already shared out to the threads, where the budget is one thread."""
    share = min(budget(), n)
    if share <= 1:
        work(0, n)
        return
    spread([(n * i // share, n * (i + 1) // share) for i in range(share)],
           lambda bounds, _: work(*bounds))
