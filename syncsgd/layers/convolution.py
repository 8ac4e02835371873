"""Convolution, and the base it shares with Deconvolution (Caffe's BaseConvolutionLayer).

Both run the same three GEMMs on channel-major columns (see im2col.py); they differ only in which
side is the image and which the feature map:
  Convolution:   bottom = image, top = features = W @ im2col(bottom)
  Deconvolution: bottom = features, top = image = col2im(W^T @ bottom)
The weights are (conv_out, image_channels / group, kh, kw) in both, conv_out being the feature
channels, as in Caffe. Only 2-D convolution over axis 1 of (N, C, H, W) blobs is supported.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.im2col import Im2Col, conv_out_size
from syncsgd.layers.registry import register

# Upper bound on one layer's column buffer. A batch whose columns need more is processed in chunks
# of samples (and backward then redoes im2col); below it the forward columns are kept for backward.
COLUMN_BUDGET_BYTES = 128 << 20


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
        self._weight_grad = np.zeros(self._grouped(self.blobs[0].data).shape, np.float32)
        self._workspace_key = None

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
        per_sample = 4 * self.image_channels * self.kernel[0] * self.kernel[1] * int(
            np.prod(features_size))
        chunk = max(1, min(num, self.column_budget // per_sample))
        key = (image_size, chunk)
        if key != self._workspace_key:
            self._workspace_key = key
            self._im2col = Im2Col(self.image_channels, image_size, self.kernel, self.pad,
                                  self.stride, self.dilation, chunk)
            # Feature maps in channel-major order (conv_out, chunk, h*w), the GEMM's other side.
            self._features = np.empty((self.conv_out, chunk, int(np.prod(features_size))),
                                      np.float32)
        self._num, self._chunk = num, chunk
        self._cols_of = None   # which bottom's columns the buffer holds, when they are complete

    def _top_size(self, bottom_size):
        raise NotImplementedError

    # -- kernels --------------------------------------------------------------------------------
    def _chunks(self):
        return [(n0, min(n0 + self._chunk, self._num)) for n0 in range(0, self._num, self._chunk)]

    def _grouped(self, weights):
        """Weights as a (group, conv_out/group, image_channels/group*kh*kw) view."""
        return weights.reshape(self.group, self.conv_out // self.group, -1)

    def _features_in(self, maps):
        """maps (n, conv_out, h, w) -> the channel-major feature buffer as (group, rows, n*h*w)."""
        n = maps.shape[0]
        self._features[:, :n] = _planes(maps).transpose(1, 0, 2)
        return self._grouped_features(n)

    def _grouped_features(self, n):
        return self._features[:, :n].reshape(self.group, self.conv_out // self.group, -1)

    def _features_out(self, n, maps):
        """The feature buffer for n samples -> maps (n, conv_out, h, w)."""
        _planes(maps)[...] = self._features[:, :n].transpose(1, 0, 2)

    def _columns(self, images):
        """im2col(images (n, image_channels, H, W)) as (group, rows, n*h*w)."""
        return self._im2col.im2col(images, self.group)

    def _weights_times(self, cols, n):
        """The feature buffer for n samples = W @ cols, as (group, rows, n*h*w)."""
        out = self._grouped_features(n)
        np.matmul(self._grouped(self.blobs[0].data), cols, out=out)
        return out

    def _features_to_image(self, features, out):
        """out (n, image_channels, H, W) = col2im(W^T @ features)."""
        n = out.shape[0]
        cols = self._im2col.columns(n, self.group)
        np.matmul(self._grouped(self.blobs[0].data).transpose(0, 2, 1), features, out=cols)
        self._im2col.col2im(n, out)

    def _accumulate_weight_grad(self, features, cols):
        np.matmul(features, cols.transpose(0, 2, 1), out=self._weight_grad)
        weight_diff = self._grouped(self.blobs[0].diff)
        weight_diff += self._weight_grad

    def _add_bias(self, maps):
        if self.bias_term:
            planes = _planes(maps)
            planes += self.blobs[1].data[:, None]

    def _accumulate_bias_grad(self, maps_diff):
        if self.bias_term:
            self.blobs[1].diff += _planes(maps_diff).sum(axis=(0, 2))


@register
class ConvolutionLayer(ConvolutionBase):
    type = "Convolution"

    def _top_size(self, bottom_size):
        return tuple(conv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                     self.stride, self.dilation))

    def forward(self, bottom, top):
        chunks = self._chunks()
        for b, (bot, t) in enumerate(zip(bottom, top)):
            for n0, n1 in chunks:
                self._weights_times(self._columns(bot.data[n0:n1]), n1 - n0)
                self._features_out(n1 - n0, t.data[n0:n1])
            self._add_bias(t.data)
            self._cols_of = b if len(chunks) == 1 else None

    def backward(self, top, propagate_down, bottom):
        # Last bottom first: forward left its columns in the buffer.
        for b in reversed(range(len(bottom))):
            t, bot = top[b], bottom[b]
            self._accumulate_bias_grad(t.diff)
            for n0, n1 in self._chunks():
                features = self._features_in(t.diff[n0:n1])
                if self._cols_of == b:
                    cols = self._im2col.columns(n1 - n0, self.group)
                else:
                    cols = self._columns(bot.data[n0:n1])
                # From here the column buffer is reused, for this bottom's diff or other bottoms.
                self._cols_of = None
                self._accumulate_weight_grad(features, cols)
                if propagate_down[b]:
                    self._features_to_image(features, bot.diff[n0:n1])
