"""Convolution, and the base it shares with Deconvolution (Caffe's BaseConvolutionLayer).

The GEMM kernels below are Caffe's engine; Convolution layers with engine DEFAULT run on oneDNN's
kernels instead (onednn.py) where those measured faster (see ConvolutionLayer).

Both run the same three GEMMs on channel-major columns (see im2col.py); they differ only in which
side is the image and which the feature map:
  Convolution:   bottom = image, top = features = W @ im2col(bottom)
  Deconvolution: bottom = features, top = image = col2im(W^T @ bottom)
The weights are (conv_out, image_channels / group, kh, kw) in both, conv_out being the feature
channels, as in Caffe. Only 2-D convolution over axis 1 of (N, C, H, W) blobs is supported.

How the GEMMs run is chosen per layer shape, from measurements on 2 cores (the constants below):
- batched: one GEMM over a chunk of samples, through a (conv_out, n*h*w) feature matrix that
  costs a transposed copy of the feature maps each way; best when the maps are small (CIFAR,
  LeNet), where per-sample products would be too small to run at full speed. Stride-1 layers
  then build their columns over whole padded rows (im2col.WideIm2Col);
- per sample: one GEMM per sample reading its block of the columns and writing straight into
  its feature maps, with no copies; best for large maps (VGG, AlexNet's first layers).
Batched stride-1 layers of 16 to 128 channels use MEC's row lowering instead of im2col
(im2col.RowLowering): one GEMM per output row over kw times the image, not kh*kw times; their
image gradient, for "same" convolutions, is the same kind of convolution of the feature-map
gradient with the flipped weights.
The batch is processed in chunks whose columns fit in the cache, shared out to the process's
threads (see _for_chunks). Parameter gradients accumulate inside the GEMM (beta = 1), the bias is
added in the pass that lays out the feature maps (or preset before an accumulating GEMM), and the
column and feature buffers are shared by all layers (im2col.scratch) rather than held per layer.
"""
import numpy as np

from syncsgd import log
from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.kernels.blas import gemm, spread_dealt, threads
from syncsgd.kernels.im2col import (Im2Col, RowLowering, WideIm2Col, claim, conv_out_size, holds,
                                   scratch)
from syncsgd.kernels.onednn import Convolution as OneDNNConvolution
from syncsgd.kernels.onednn import Unavailable
from syncsgd.layers.registry import register
from syncsgd.proto import pb

# Columns are made and consumed in chunks of samples whose columns fit in this many bytes (at
# least one sample), so that im2col's output is still in cache when the GEMM reads it; chunks are
# shared out to the process's threads (each with one BLAS thread and its own buffers). With one
# chunk the forward columns stay in the shared buffer for backward; with several, backward redoes
# im2col per chunk, from cache again.
COLUMN_BUDGET_BYTES = 4 << 20
# Feature maps of at least this many pixels run one GEMM per sample (see the module docstring).
PER_SAMPLE_PIXELS = 3000
# Batched stride-1 layers use WideIm2Col when its GEMM is at most this much larger.
WIDE_LIMIT = 1.6
# Batched stride-1 single-group layers lower rows (RowLowering) when the lowered side has at
# least LOWERING_MIN_CHANNELS channels and the GEMMs LOWERING_MIN_CHANNELS to
# LOWERING_MAX_OUTPUTS rows (output channels): im2col's copying costs most next to small GEMMs,
# and GEMMs of a few rows are slow (CIFAR-10 quick's conv1 image gradient, 32 -> 3 channels:
# 80 ms lowered). Measured, forward and backward on 2 cores: CIFAR-10 quick's 32-channel layers
# 1.4-1.6x faster than WideIm2Col, LeNet's conv2 (20 -> 50) 1.4x faster forward; 1 and 3
# channels 1.2-1.3x slower (one core, forward); VGG-A's 256 -> 512 at 28x28 1.4x slower forward.
LOWERING_MIN_CHANNELS = 16
LOWERING_MAX_OUTPUTS = 128
# The image gradient as a convolution computes one value per image pixel from the whole padded
# feature-map gradient: used while that GEMM is at most this much larger than the forward one
# ("same" convolutions: equal; LeNet's unpadded conv2: 2.25x). Otherwise the lowering's gradient
# is summed back (RowLowering.unlower): LeNet's conv2 3.0 ms against 7.8 flipped and 5.4 by
# col2im; CIFAR-10 quick's conv2 ("same") 27 against 19 flipped.
FLIPPED_LIMIT = 1.3
# ... in chunks of samples whose row GEMMs have at least this many columns (n * out_w): narrower
# products run well below the GEMM rate however well the lowering fits the cache. (CIFAR-10
# quick's conv2 on 2 threads, forward / backward: chunks of 5 samples (80 columns) 26.7 / 52.9
# ms, 17 (272) 21.9 / 45.4, 25 (400) 21.1 / 42.7, 50 22.2 / 43.2; conv3 alike.)
LOWERED_MIN_COLUMNS = 400
# Stride-1 Convolution layers with at least this many weights per group take their weight
# gradient from the GEMMs, not oneDNN (see ConvolutionLayer).
GEMM_WEIGHT_GRAD_FROM = 1 << 20


def _pair(param, field, prefix, default, partner_default=None):
    """A (h, w) pair from a repeated field (0, 1 or 2 values) or its prefix_h / prefix_w forms
    (dilation has none: prefix None).

    Caffe lets pad_h or pad_w come alone (the other is 0); kernel and stride need both.
    """
    values = list(getattr(param, field))
    h, w = f"{prefix}_h", f"{prefix}_w"
    if prefix and (param.HasField(h) or param.HasField(w)):
        if values:
            raise ValueError(f"give either {field} or {h} and {w}, not both")
        if partner_default is None and not (param.HasField(h) and param.HasField(w)):
            raise ValueError(f"{h} and {w} must be given together")
        return tuple(getattr(param, f) if param.HasField(f) else partner_default
                     for f in (h, w))
    if not values:
        if default is None:
            raise ValueError(f"{field} is required (once, or once per spatial axis), or {h} and "
                             f"{w}")
        return default, default
    if len(values) <= 2:
        return values[0], values[-1]
    raise ValueError(f"{field} is given {len(values)} times; give it once or once per spatial "
                     f"axis (2)")


def _planes(maps):
    """(n, c, h, w) -> a (n, c, h*w) view (also for n = 0, where reshape cannot infer h*w)."""
    n, c, h, w = maps.shape
    return maps.reshape(n, c, h * w)


class ConvolutionBase(Layer):
    """Parameters, weights and GEMM kernels shared by Convolution and Deconvolution."""
    min_bottoms = 1
    min_tops = 1
    reverse = False                        # True for Deconvolution: the image is the top
    column_budget = COLUMN_BUDGET_BYTES    # may be lowered per layer (tests force chunking)
    per_sample_pixels = PER_SAMPLE_PIXELS  # may be changed per layer (tests run both ways)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        if len(bottom) != len(top):
            self.fail(f"takes one top per bottom, got {len(bottom)} bottoms and {len(top)} tops")
        p = self.param.convolution_param
        axis = canonical_axis(p.axis, bottom[0].num_axes, self)
        if axis != 1 or bottom[0].num_axes != 4:
            self.fail(f"only 2-D convolution over axis 1 of (N, C, H, W) blobs is supported; got "
                      f"convolution_param.axis {p.axis} on a {bottom[0].num_axes}-axis bottom "
                      f"{bottom[0].shape}")
        try:
            self.kernel = _pair(p, "kernel_size", "kernel", None)
            self.stride = _pair(p, "stride", "stride", 1)
            self.pad = _pair(p, "pad", "pad", 0, partner_default=0)
            self.dilation = _pair(p, "dilation", None, 1)
        except ValueError as e:
            self.fail(f"convolution_param: {e}")
        for name, pair in (("kernel size", self.kernel), ("stride", self.stride),
                           ("dilation", self.dilation)):
            if min(pair) <= 0:
                self.fail(f"convolution_param {name} must be positive, got {pair}")
        self.num_output, self.group, self.bias_term = p.num_output, p.group, p.bias_term
        channels = bottom[0].shape[1]
        if self.num_output <= 0:
            self.fail("convolution_param.num_output must be set to a positive number")
        if self.group <= 0 or channels % self.group or self.num_output % self.group:
            self.fail(f"convolution_param.group {self.group} must divide both the bottom's "
                      f"{channels} channels and num_output {self.num_output}")
        self.channels = channels
        # conv_out: feature channels (the GEMM rows); image_channels: the side im2col reads.
        self.conv_out, self.image_channels = ((channels, self.num_output) if self.reverse
                                              else (self.num_output, channels))
        weight_shape = (self.conv_out, self.image_channels // self.group) + self.kernel
        shapes = [weight_shape] + ([(self.num_output,)] if self.bias_term else [])
        if not self.blobs:
            fillers = (p.weight_filler, p.bias_filler)
            for i, shape in enumerate(shapes):
                blob = Blob(shape, name=f"{self.name}.{('weight', 'bias')[i]}")
                fill(blob.data, fillers[i], self.ctx.rng(self.name, i))
                self.blobs.append(blob)
        elif [b.shape for b in self.blobs] != shapes:
            self.fail(f"parameter blobs have shapes {[b.shape for b in self.blobs]}, expected "
                      f"{shapes}")
        self._workspace_key = None
        self._ones = np.ones((0, 1), np.float32)

    # -- reshape --------------------------------------------------------------------------------
    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4 or shape[1] != self.channels:
            self.fail(f"bottom shape {shape} does not fit: expected (N, {self.channels}, H, W) "
                      f"as at setup")
        for b in bottom[1:]:
            if b.shape != shape:
                self.fail(f"all bottoms must have the same shape; got {shape} and {b.shape}")
        bottom_size = tuple(shape[2:])
        top_size = self._top_size(bottom_size)
        if min(top_size) <= 0:
            self.fail(f"output size {top_size} from input {bottom_size} is empty: check "
                      f"kernel {self.kernel}, pad {self.pad}, stride {self.stride}, dilation "
                      f"{self.dilation}")
        image_size, features_size = ((top_size, bottom_size) if self.reverse
                                     else (bottom_size, top_size))
        num = shape[0]
        for t in top:
            t.reshape(num, self.num_output, *top_size)
        pixels = int(np.prod(features_size))
        self._per_sample = pixels >= self.per_sample_pixels
        key = (image_size, features_size, self._per_sample)
        if key != self._workspace_key:
            self._workspace_key = key
            self._im2col = self._kernels(image_size, features_size)
            self._lowering = self._flipped = None
            if self._lowers(self.image_channels, self.conv_out):
                self._lowering = RowLowering(self.image_channels, image_size, self.kernel,
                                             self.pad)
            if (self._lowers(self.conv_out, self.image_channels)
                    and all(p < k for p, k in zip(self.pad, self.kernel))
                    and np.prod(image_size) <= FLIPPED_LIMIT * pixels):
                self._flipped = RowLowering(self.conv_out, features_size, self.kernel,
                                            tuple(k - 1 - p for p, k in zip(self.pad, self.kernel)))
        # The feature matrix's grid per sample: out_h rows of `width` values, the first out_w
        # of which are the feature maps' (width > out_w for WideIm2Col).
        self._grid = (features_size[0], getattr(self._im2col, "width", features_size[1]),
                      features_size[1])
        self._pixels = self._im2col.pixels
        sample_bytes = [4 * self._im2col.rows * self._pixels] if self._lowering is None \
            else [self._lowering.sample_bytes]
        if self._flipped is not None:
            sample_bytes.append(self._flipped.sample_bytes)
        chunk = max(1, min(num, self.column_budget // max(sample_bytes)))
        share = threads()
        if not self._per_sample and share > 1:
            # Work for every thread, twice (LeNet's conv1: chunks of 62 and 2 samples before).
            chunk = max(1, min(chunk, -(-num // (2 * share))))
        if self._lowering is not None:
            # ... but row GEMMs of at least LOWERED_MIN_COLUMNS columns.
            chunk = min(num, max(chunk, -(-LOWERED_MIN_COLUMNS // features_size[1])))
        if share > 1 and num:
            # Equal chunks, as many per thread (threads take fixed groups of chunks): CIFAR-10
            # quick's conv3 had chunks of 32, 32, 32 and 4 samples, 64 for one thread, 36 for
            # the other.
            count = -(-num // chunk)
            chunk = -(-num // (-(-count // share) * share))
        self._num, self._chunk = num, chunk

    def _kernels(self, image_size, features_size):
        """WideIm2Col where it applies and the extra columns cost little, else Im2Col."""
        wide = WideIm2Col(self.image_channels, image_size, self.kernel, self.pad, self.dilation)
        if (self.stride == (1, 1) and not self._per_sample
                and wide.width <= WIDE_LIMIT * features_size[1]):
            return wide
        return Im2Col(self.image_channels, image_size, self.kernel, self.pad, self.stride,
                      self.dilation)

    def _lowers(self, channels, outputs):
        """Whether a batched convolution from `channels` to `outputs` channels (the forward one,
        or the image gradient's) runs on RowLowering."""
        return (not self.reverse and not self._per_sample and self.stride == (1, 1)
                and self.dilation == (1, 1) and self.group == 1
                and LOWERING_MIN_CHANNELS <= min(channels, outputs)
                and outputs <= LOWERING_MAX_OUTPUTS)

    def _top_size(self, bottom_size):
        raise NotImplementedError

    # -- kernels: maps are (n, conv_out, h, w) feature maps, cols (rows, n*h*w) columns -------
    def _chunks(self):
        return [(n0, min(n0 + self._chunk, self._num)) for n0 in range(0, self._num, self._chunk)]

    def _groups(self):
        """Per group: its rows of the (conv_out, rows / group) weights and of the columns."""
        m, k = self.conv_out // self.group, self._im2col.rows // self.group
        return [(slice(g * m, (g + 1) * m), slice(g * k, (g + 1) * k))
                for g in range(self.group)]

    def _pairs(self, maps, cols):
        """(map block, column block) of each sample (per-sample mode) or of the whole batch
        (batched mode: the maps copied into the shared feature matrix)."""
        n = maps.shape[0]
        if self._per_sample:
            p = self._pixels
            planes = maps.reshape(n, self.conv_out, p)
            return [(planes[s], cols[:, s * p:(s + 1) * p]) for s in range(n)]
        features = scratch("features", (self.conv_out, n * self._pixels))
        rows, width, valid = self._grid
        grid = features.reshape(self.conv_out, n, rows, width)
        grid[..., :valid] = maps.transpose(1, 0, 2, 3)
        grid[..., valid:] = 0
        return [(features, cols)]

    def _weights_times(self, cols, maps, add_bias):
        """maps = W @ cols (+ bias)."""
        w = self.blobs[0].data.reshape(self.conv_out, -1)
        n = maps.shape[0]
        bias = self.blobs[1].data[:, None, None] if add_bias and self.bias_term else None
        if self._per_sample:
            p = self._pixels
            planes = maps.reshape(n, self.conv_out, p)
            if bias is not None:
                planes[...] = bias[:, 0]
            for s in range(n):
                for rows, ks in self._groups():
                    gemm(w[rows], cols[ks, s * p:(s + 1) * p], planes[s, rows],
                         beta=0.0 if bias is None else 1.0)
            return
        features = scratch("features", (self.conv_out, n * self._pixels))
        for rows, ks in self._groups():
            gemm(w[rows], cols[ks], features[rows])
        rows, width, valid = self._grid
        batched = features.reshape(self.conv_out, n, rows, width)[..., :valid].transpose(
            1, 0, 2, 3)
        if bias is not None:
            np.add(batched, bias, out=maps)
        else:
            np.copyto(maps, batched)

    def _weights_transposed_times(self, pairs, cols):
        """cols = W^T @ maps, for the (maps, columns) blocks of _pairs."""
        w = self.blobs[0].data.reshape(self.conv_out, -1)
        for block, target in pairs:
            for rows, ks in self._groups():
                gemm(w[rows].T, block[rows], target[ks])

    def _accumulate_weight_grad(self, pairs, diff):
        """diff += maps @ cols^T, for the (maps, columns) blocks of _pairs; diff is the weight
        gradient as a (conv_out, rows / group) matrix."""
        for block, cols in pairs:
            for rows, ks in self._groups():
                gemm(block[rows], cols[ks].T, diff[rows], beta=1.0)

    def _for_chunks(self, work, shared=True, gradient=False):
        """work(n0, n1, weight_diff) for every chunk of the batch. When `shared` the chunks are
        shared out to the process's threads; otherwise they run in turn and each GEMM is split
        over the threads instead. With `gradient`, weight_diff is where the chunk adds its
        weight gradient: the weight diff as a (conv_out, rows / group) matrix, or for a layer
        that lowers rows a (conv_out, kh*kw*C) matrix in the lowering's order. Shared chunks are
        dealt into one group per thread (blas.spread_dealt); groups beyond the first, and the
        lowering, get matrices of their own, added into the diff in order at the end.

        Measured on 2 cores: sharing wins for batched layers (CIFAR-10 quick: 230 against
        290 ms per iteration) and for the backward pass of per-sample layers, whose im2col and
        col2im then run in parallel too; the forward pass of per-sample layers (VGG-A) is
        faster with split GEMMs over samples in turn, whose columns stay in the cache."""
        chunks = self._chunks()
        share = min(threads(), len(chunks)) if shared else 1
        diff = self.blobs[0].diff.reshape(self.conv_out, -1)
        if not gradient:
            matrices = [None] * share
        elif self._lowering is None:
            matrices = [diff] + [np.zeros_like(diff) for _ in range(share - 1)]
        else:
            matrices = [np.zeros((self.conv_out, self._lowering.rows), np.float32)
                        for _ in range(share)]
        if share <= 1:
            for n0, n1 in chunks:
                work(n0, n1, matrices[0])
        else:
            spread_dealt(chunks, lambda chunk, group: work(*chunk, matrices[group]), share)
        if not gradient:
            return
        total = matrices[0]          # the diff itself unless the layer lowers rows
        for extra in matrices[1:]:
            total += extra
        if self._lowering is not None:
            kh, kw = self.kernel
            diff += total.reshape(self.conv_out, kh, kw, -1).transpose(0, 3, 1, 2).reshape(
                self.conv_out, -1)

    def _add_bias(self, maps):
        if self.bias_term:
            planes = _planes(maps)
            planes += self.blobs[1].data[:, None]

    def _accumulate_bias_grad(self, maps_diff):
        """bias.diff += maps_diff summed over samples and pixels (a GEMV, then n additions)."""
        if self.bias_term:
            n, c, h, w = maps_diff.shape
            if self._ones.shape[0] != h * w:
                self._ones = np.ones((h * w, 1), np.float32)
            sums = np.empty((n * c, 1), np.float32)
            gemm(maps_diff.reshape(n * c, h * w), self._ones, sums)
            self.blobs[1].diff += sums.reshape(n, c).sum(axis=0)


@register
class ConvolutionLayer(ConvolutionBase):
    """engine DEFAULT runs on oneDNN (onednn.py) where it is available and implements the
    layer's shape, else on the GEMM kernels above; engine CAFFE always on the GEMM kernels.

    Per direction, on 2 cores against the GEMM kernels: oneDNN's forward was faster on every
    shape measured (1.1x VGG-A's 512-channel layers to 2.5x CIFAR-10 quick's conv1). Its
    backward was slower for batched stride-1 unpadded layers (LeNet's conv1 weight gradient
    5.8 against 3.1 ms, conv2's image gradient 4.3 against 3.1), which keep the whole backward
    pass on GEMMs. Its weight gradient was slower for stride-1 layers with per-sample maps or
    with at least GEMM_WEIGHT_GRAD_FROM weights per group, which keep that on GEMMs: in VGG-A
    at batch 8, backward per layer with GEMM against oneDNN weight gradients, conv3_2 (per
    sample) 504 against 673 ms, conv4_2 (2.4M weights) 497 against 664, conv5_1 135 against
    162. AlexNet's strided conv1, its grouped conv2 and conv5 (128 outputs per group) and
    CIFAR-10 quick's layers were 1.1-2.0x faster on oneDNN both ways.
    """
    type = "Convolution"
    gemm_weight_grad_from = GEMM_WEIGHT_GRAD_FROM   # may be changed per layer (tests)
    _unavailable_noted = False

    def _top_size(self, bottom_size):
        return tuple(conv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                     self.stride, self.dilation))

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self._onednn, self._onednn_key = None, None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        # Primitives split their work for the team they were built for, whatever the team
        # is when they run: a new share of the cores builds them anew.
        key = (bottom[0].shape, top[0].shape, threads())
        if key != self._onednn_key:
            self._onednn_key = key
            self._onednn = self._onednn_primitives(*key[:2])
        stride_1 = self.stride == (1, 1)
        self._onednn_image = self._onednn is not None and not (
            stride_1 and not self._per_sample and self.pad == (0, 0))
        large = self.blobs[0].count // self.group >= self.gemm_weight_grad_from
        self._onednn_weights = self._onednn_image and not (
            stride_1 and (self._per_sample or large))

    def _onednn_primitives(self, images, maps):
        if self.param.convolution_param.engine == pb.ConvolutionParameter.CAFFE:
            return None
        try:
            return OneDNNConvolution(images, maps, self.kernel, self.pad, self.stride,
                                     self.dilation, self.group, self.bias_term)
        except Unavailable as e:
            if not ConvolutionLayer._unavailable_noted:
                ConvolutionLayer._unavailable_noted = True
                log.info(f"{self.name}: convolutions run as GEMMs: {e}")
            return None

    def forward(self, bottom, top):
        if self._onednn is not None:
            bias = self.blobs[1].data if self.bias_term else None
            for bot, t in zip(bottom, top):
                self._onednn.forward(bot.data, self.blobs[0].data, bias, t.data)
            return
        lowered = self._lowered_weights() if self._lowering is not None else None
        for b, (bot, t) in enumerate(zip(bottom, top)):
            def work(n0, n1, _):
                if lowered is not None:
                    self._lowered_forward(self._lowering, lowered, bot.data[n0:n1],
                                          t.data[n0:n1], self.bias_term)
                    return
                cols = self._im2col.im2col(bot.data[n0:n1])
                self._weights_times(cols, t.data[n0:n1], add_bias=True)
            self._for_chunks(work, shared=not self._per_sample)
            if lowered is None and len(self._chunks()) == 1:
                claim("columns", (self, b))    # backward reuses them if no layer intervened

    def backward(self, top, propagate_down, bottom):
        if not self._onednn_weights:
            self._gemm_backward(top, [d and not self._onednn_image for d in propagate_down],
                                bottom)
        if not self._onednn_image:
            return
        weights, bias = self.blobs[0], self.blobs[1] if self.bias_term else None
        for t, down, bot in zip(top, propagate_down, bottom):
            self._onednn.backward(
                bot.data, t.diff, weights.data, bot.diff if down else None,
                weights.diff if self._onednn_weights else None,
                bias.diff if bias is not None and self._onednn_weights else None)

    def _gemm_backward(self, top, propagate_down, bottom):
        flipped = self._flipped_weights() if self._flipped is not None else None
        lowered = self._lowered_weights() if self._lowering is not None and flipped is None \
            else None
        # Last bottom first: forward left its columns in the buffer.
        for b in reversed(range(len(bottom))):
            t, bot = top[b], bottom[b]
            self._accumulate_bias_grad(t.diff)

            def work(n0, n1, diff):
                maps_diff, image_diff = t.diff[n0:n1], bot.diff[n0:n1]
                if self._lowering is not None:
                    grad = self._lowered_weight_grad(bot.data[n0:n1], maps_diff, diff)
                else:
                    if self._onednn is None and holds("columns", (self, b)):
                        cols = self._im2col.columns(n1 - n0)
                    else:
                        cols = self._im2col.im2col(bot.data[n0:n1])
                    pairs = self._pairs(maps_diff, cols)
                    self._accumulate_weight_grad(pairs, diff)
                if not propagate_down[b]:
                    return
                if flipped is not None:
                    self._lowered_forward(self._flipped, flipped, maps_diff, image_diff, False)
                elif lowered is not None:
                    self._lowered_image_grad(lowered, grad, image_diff)
                else:
                    self._weights_transposed_times(pairs, cols)
                    self._im2col.col2im(cols, image_diff)
            self._for_chunks(work, gradient=True)

    def _lowered_weights(self):
        """W as the (num_output, kh*kw*C) matrix RowLowering's windows multiply."""
        w = self.blobs[0].data
        return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).reshape(self.num_output, -1)

    def _flipped_weights(self):
        """The weights of the image gradient as a convolution of the feature-map gradient
        (padded by kernel - 1 - pad) in RowLowering's order: a (channels, kh*kw*num_output)
        matrix with W'[c, i, j, m] = W[m, c, kh-1-i, kw-1-j]."""
        w = self.blobs[0].data
        return np.ascontiguousarray(w.transpose(1, 2, 3, 0)[:, ::-1, ::-1]).reshape(
            self.channels, -1)

    def _lowered_forward(self, lowering, weights, images, maps, add_bias):
        """maps (n, M, h, w) = the stride-1 convolution of images (n, C, H, W) with `weights`
        (M, kh*kw*C) (+ bias): one GEMM per output row, then one copy into the maps."""
        n = images.shape[0]
        rows, width = lowering.out_size
        lowered = lowering.lower(images)
        out = scratch("features", (rows, weights.shape[0], n * width))
        for y in range(rows):
            gemm(weights, lowering.window(lowered, y).T, out[y])
        batched = out.reshape(rows, weights.shape[0], n, width).transpose(2, 1, 0, 3)
        if add_bias:
            np.add(batched, self.blobs[1].data[:, None, None], out=maps)
        else:
            np.copyto(maps, batched)

    def _lowered_weight_grad(self, images, maps_diff, diff):
        """diff (num_output, kh*kw*C) += the weight gradient, row by row of the feature maps."""
        n = images.shape[0]
        rows, width = self._lowering.out_size
        lowered = self._lowering.lower(images)
        grad = scratch("features", (rows, self.num_output, n * width))
        np.copyto(grad.reshape(rows, self.num_output, n, width), maps_diff.transpose(2, 1, 0, 3))
        for y in range(rows):
            gemm(grad[y], self._lowering.window(lowered, y), diff, beta=1.0)
        return grad

    def _lowered_image_grad(self, weights, grad, image_diff):
        """image_diff = the gradient of the lowered matrix, W^T times the feature-map gradient
        `grad` (rows, num_output, n*out_w) row by row into the windows they came from, summed
        back over the image (RowLowering.unlower): the transposed convolution with no padding
        computed, where the flipped one would multiply zeros (LeNet's unpadded conv2)."""
        lowering = self._lowering
        lowered = scratch("lowered_grad", (grad.shape[2], lowering.width))
        lowered.fill(0)
        for y in range(grad.shape[0]):
            gemm(grad[y].T, weights, lowering.window(lowered, y), beta=1.0)
        lowering.unlower(lowered, image_diff)
