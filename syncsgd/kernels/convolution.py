"""The kernels a convolution's plan (plans.plan_convolution) names, one class each.

Maps are (n, conv_out, h, w) feature maps, images (n, C, H, W); the columns kernel takes any
number of spatial axes: (n, conv_out, *features_size) and (n, C, *image_size). The GEMM kernels
work on one chunk of samples at a time, with the same three methods: forward(weights, bias,
images, maps), weight_grad(images, maps_diff, diff, kept) -> what image_grad may reuse, and
image_grad(weights, maps_diff, image_diff, carried); `weights` is what weight_matrix made of the
layer's weights for the pass, `diff` a matrix from gradient_matrices. Where no weight gradient
ran on the kernel (oneDNN or another kernel computed it, or none is wanted), carry(maps_diff)
makes what image_grad takes instead. Parameter gradients accumulate inside the GEMM (beta = 1),
and the column and feature buffers are shared by all layers (scratch.py) rather than held per
layer. Winograd's F(2x2, 3x3), F(4x4, 3x3) and F(2x2, 5x5) (winograd.py) have the same methods.
OneDNN runs the whole batch in one call per direction.
"""
import math

import numpy as np

from syncsgd.kernels.blas import gemm
from syncsgd.kernels.onednn import Convolution as OneDNNConvolution
from syncsgd.kernels.plans import column_layout, flipped_lowering, row_lowering
from syncsgd.kernels.scratch import scratch
from syncsgd.kernels.winograd import VARIANTS as WINOGRAD_VARIANTS, Winograd


def build(plan, geometry, bias):
    """The kernels `plan` names, by name, for `geometry` (bias: whether the layer has one);
    raises onednn.Unavailable when oneDNN lacks the shape."""
    g, built = geometry, {}
    names = {plan.forward, plan.weight_grad, plan.image_grad}
    if "onednn" in names:
        choices = plan.onednn_kernels and tuple(c or ("any", None) for c in plan.onednn_kernels)
        built["onednn"] = OneDNN((g.num, g.image_channels) + g.image_size,
                                 (g.num, g.conv_out) + g.features_size, g.kernel, g.pad,
                                 g.stride, g.dilation, g.group, bias, plan.channels_last,
                                 choices)
    if "columns" in names:
        built["columns"] = Columns(column_layout(g, plan.columns), g.conv_out, g.group,
                                   plan.per_sample, g.features_size)
    if names & {"lowered", "unlowered"}:
        built["lowered"] = built["unlowered"] = Lowered(row_lowering(g), g.conv_out)
    if "flipped" in names:
        built["flipped"] = Flipped(flipped_lowering(g), g.image_channels)
    for name in WINOGRAD_VARIANTS:
        if name in names:
            built[name] = Winograd(g, name)
    return built


class Columns:
    """im2col (or WideIm2Col) and GEMMs over channel-major columns: batched, one GEMM over a
    chunk through a (conv_out, n*h*w) feature matrix that costs a transposed copy of the maps
    each way, for small maps; or per sample, one GEMM per sample reading its block of the
    columns and writing straight into its maps, for large ones. Deconvolution runs the same
    GEMMs in the other order."""

    def __init__(self, layout, conv_out, group, per_sample, features_size):
        self.layout, self.conv_out, self.per_sample = layout, conv_out, per_sample
        self.pixels = layout.pixels
        # The feature matrix's grid per sample: `rows` rows of `width` values, the first `valid`
        # of which are the feature maps' (width > valid for WideIm2Col); a row is a line along
        # the last spatial axis (one value without spatial axes).
        *lines, valid = features_size or (1,)
        self.grid = (math.prod(lines), getattr(layout, "width", valid), valid)
        # Per group: its rows of the (conv_out, rows / group) weights and of the columns.
        m, k = conv_out // group, layout.rows // group
        self.groups = [(slice(g * m, (g + 1) * m), slice(g * k, (g + 1) * k))
                       for g in range(group)]

    def weight_matrix(self, weights):
        return weights.reshape(self.conv_out, -1)

    def gradient_matrices(self, diff, share):
        """Where each of `share` groups of chunks adds its weight gradient: the diff as a
        (conv_out, rows / group) matrix for the first, matrices of their own for the others."""
        diff = diff.reshape(self.conv_out, -1)
        return [diff] + [np.zeros_like(diff) for _ in range(share - 1)]

    def add_gradients(self, matrices, diff):
        total = matrices[0]          # the diff itself
        for extra in matrices[1:]:
            total += extra

    def forward(self, weights, bias, images, maps):
        self.weights_times(weights, bias, self.layout.im2col(images), maps)

    def weight_grad(self, images, maps_diff, diff, kept):
        """kept: the shared column buffer still holds forward's columns of `images`."""
        cols = self.layout.columns(images.shape[0]) if kept else self.layout.im2col(images)
        pairs = self.pairs(maps_diff, cols)
        self.accumulate_weight_grad(pairs, diff)
        return pairs, cols

    def image_grad(self, weights, maps_diff, image_diff, carried):
        pairs, cols = carried
        self.weights_transposed_times(weights, pairs, cols)
        self.layout.col2im(cols, image_diff)

    def carry(self, maps_diff):
        """The (maps, columns) blocks image_grad writes W^T @ maps into, without im2col."""
        cols = self.layout.columns(maps_diff.shape[0])
        return self.pairs(maps_diff, cols), cols

    def pairs(self, maps, cols):
        """(map block, column block) of each sample (per sample) or of the whole chunk (batched:
        the maps copied into the shared feature matrix)."""
        n = maps.shape[0]
        if self.per_sample:
            p = self.pixels
            planes = maps.reshape(n, self.conv_out, p)
            return [(planes[s], cols[:, s * p:(s + 1) * p]) for s in range(n)]
        features = scratch("features", (self.conv_out, n * self.pixels))
        rows, width, valid = self.grid
        grid = features.reshape(self.conv_out, n, rows, width)
        grid[..., :valid] = self._lines(maps).transpose(1, 0, 2, 3)
        grid[..., valid:] = 0
        return [(features, cols)]

    def _lines(self, maps):
        """maps (n, conv_out, *features_size) as (n, conv_out, rows, valid) lines (a view)."""
        rows, _, valid = self.grid
        return maps.reshape(maps.shape[0], self.conv_out, rows, valid)

    def weights_times(self, weights, bias, cols, maps):
        """maps = W @ cols (+ bias, a (conv_out,) array or None)."""
        n = maps.shape[0]
        bias = bias[:, None, None] if bias is not None else None
        if self.per_sample:
            p = self.pixels
            planes = maps.reshape(n, self.conv_out, p)
            if bias is not None:
                planes[...] = bias[:, 0]
            for s in range(n):
                for rows, ks in self.groups:
                    gemm(weights[rows], cols[ks, s * p:(s + 1) * p], planes[s, rows],
                         beta=0.0 if bias is None else 1.0)
            return
        features = scratch("features", (self.conv_out, n * self.pixels))
        for rows, ks in self.groups:
            gemm(weights[rows], cols[ks], features[rows])
        rows, width, valid = self.grid
        batched = features.reshape(self.conv_out, n, rows, width)[..., :valid].transpose(
            1, 0, 2, 3)
        if bias is not None:
            np.add(batched, bias, out=self._lines(maps))
        else:
            np.copyto(self._lines(maps), batched)

    def weights_transposed_times(self, weights, pairs, cols):
        """cols = W^T @ maps, for the (maps, columns) blocks of pairs()."""
        for block, target in pairs:
            for rows, ks in self.groups:
                gemm(weights[rows].T, block[rows], target[ks])

    def accumulate_weight_grad(self, pairs, diff):
        """diff += maps @ cols^T, for the (maps, columns) blocks of pairs(); diff is the weight
        gradient as a (conv_out, rows / group) matrix."""
        for block, cols in pairs:
            for rows, ks in self.groups:
                gemm(block[rows], cols[ks].T, diff[rows], beta=1.0)


def lowered_convolution(lowering, weights, bias, images, maps):
    """maps (n, M, h, w) = the stride-1 convolution of images (n, C, H, W) with `weights`
    (M, kh*kw*C) (+ bias): one GEMM per output row, then one copy into the maps."""
    n = images.shape[0]
    rows, width = lowering.out_size
    lowered = lowering.lower(images)
    out = scratch("features", (rows, weights.shape[0], n * width))
    for y in range(rows):
        gemm(weights, lowering.window(lowered, y).T, out[y])
    batched = out.reshape(rows, weights.shape[0], n, width).transpose(2, 1, 0, 3)
    if bias is not None:
        np.add(batched, bias[:, None, None], out=maps)
    else:
        np.copyto(maps, batched)


class Lowered:
    """MEC's row lowering (im2col.RowLowering) for batched stride-1 single-group convolutions:
    one GEMM per output row over kw times the image, not kh*kw times. Its image gradient
    ("unlowered") sums the lowering's gradient back over the image: the transposed convolution
    with no padding computed, where the flipped one would multiply zeros."""

    def __init__(self, lowering, num_output):
        self.lowering, self.num_output = lowering, num_output

    def weight_matrix(self, weights):
        """W as the (num_output, kh*kw*C) matrix the lowering's windows multiply."""
        return np.ascontiguousarray(weights.transpose(0, 2, 3, 1)).reshape(self.num_output, -1)

    def gradient_matrices(self, diff, share):
        """A (num_output, kh*kw*C) matrix, in the lowering's order, per group of chunks."""
        return [np.zeros((self.num_output, self.lowering.rows), np.float32)
                for _ in range(share)]

    def add_gradients(self, matrices, diff):
        total = matrices[0]
        for extra in matrices[1:]:
            total += extra
        kh, kw = self.lowering.kernel
        diff = diff.reshape(self.num_output, -1)
        diff += total.reshape(self.num_output, kh, kw, -1).transpose(0, 3, 1, 2).reshape(
            self.num_output, -1)

    def forward(self, weights, bias, images, maps):
        lowered_convolution(self.lowering, weights, bias, images, maps)

    def weight_grad(self, images, maps_diff, diff, kept):
        """diff (num_output, kh*kw*C) += the weight gradient, row by row of the feature maps;
        returns the maps' gradient as (rows, num_output, n*out_w) for image_grad."""
        lowered = self.lowering.lower(images)
        grad = self.carry(maps_diff)
        for y in range(grad.shape[0]):
            gemm(grad[y], self.lowering.window(lowered, y), diff, beta=1.0)
        return grad

    def carry(self, maps_diff):
        """The maps' gradient as the (rows, num_output, n*out_w) rows image_grad takes."""
        n = maps_diff.shape[0]
        rows, width = self.lowering.out_size
        grad = scratch("features", (rows, self.num_output, n * width))
        np.copyto(grad.reshape(rows, self.num_output, n, width), maps_diff.transpose(2, 1, 0, 3))
        return grad

    def image_grad(self, weights, maps_diff, image_diff, grad):
        """image_diff = W^T times the maps' gradient `grad` row by row into the windows they
        came from, summed back over the image (RowLowering.unlower)."""
        lowering = self.lowering
        lowered = scratch("lowered_grad", (grad.shape[2], lowering.width))
        lowered.fill(0)
        for y in range(grad.shape[0]):
            gemm(grad[y].T, weights, lowering.window(lowered, y), beta=1.0)
        lowering.unlower(lowered, image_diff)


class Flipped:
    """The image gradient of a "same" stride-1 convolution as the lowered convolution of the
    feature-map gradient (padded by kernel - 1 - pad) with the flipped weights."""

    def __init__(self, lowering, channels):
        self.lowering, self.channels = lowering, channels

    def weight_matrix(self, weights):
        """A (channels, kh*kw*num_output) matrix in the lowering's order, with
        W'[c, i, j, m] = W[m, c, kh-1-i, kw-1-j]."""
        return np.ascontiguousarray(weights.transpose(1, 2, 3, 0)[:, ::-1, ::-1]).reshape(
            self.channels, -1)

    def image_grad(self, weights, maps_diff, image_diff, carried):
        lowered_convolution(self.lowering, weights, None, maps_diff, image_diff)

    def carry(self, maps_diff):
        return None


class OneDNN:
    """oneDNN's primitives for the whole batch (onednn.Convolution), built for one shape and
    team size; backward computes the parameter gradients and, when asked, the image gradient
    in one call."""

    def __init__(self, images, maps, kernel, pad, stride, dilation, group, bias, channels_last,
                 choices):
        self.primitives = OneDNNConvolution(images, maps, kernel, pad, stride, dilation, group,
                                            bias, channels_last, choices)

    def forward(self, weights, bias, images, maps):
        self.primitives.forward(images, weights, bias, maps)

    def maps_in_form(self):
        """Whether forward writes the maps in a layout of its own (a form where they take
        one), not NCHW."""
        return not self.primitives.f_maps.direct

    def backward(self, images, maps_diff, weights, image_diff, weight_grad, bias_grad):
        """weight_grad and bias_grad: (diff, beta) pairs (Blob.gradient_target), or None."""
        self.primitives.backward(images, maps_diff, weights, image_diff, weight_grad, bias_grad)
