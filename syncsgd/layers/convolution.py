"""Convolution, and the base it shares with Deconvolution (Caffe's BaseConvolutionLayer).

Both run on channel-major columns (kernels/im2col.py) and differ only in which side is the image
and which the feature map:
  Convolution:   bottom = image, top = features = W @ im2col(bottom)
  Deconvolution: bottom = features, top = image = col2im(W^T @ bottom)
The weights are (conv_out, image_channels / group, kh, kw) in both, conv_out being the feature
channels, as in Caffe. Only 2-D convolution over axis 1 of (N, C, H, W) blobs is supported.

Which kernels run (oneDNN, GEMMs over columns, MEC's row lowering; batched or per sample; the
chunk size) is decided in one place, kernels.plans.plan_convolution, when the geometry or the
thread budget changes; the layer runs the kernels its plan names (kernels/convolution.py), the
batch in chunks shared out to the budget's threads.
"""
import numpy as np

from syncsgd import log
from syncsgd.blob import Blob, Side
from syncsgd.fillers import fill
from syncsgd.kernels import convolution as kernels
from syncsgd.kernels import onednn
from syncsgd.kernels.blas import gemm, spread_dealt
from syncsgd.kernels.im2col import conv_out_size
from syncsgd.kernels.plans import THRESHOLDS, ConvolutionGeometry, plan_convolution
from syncsgd.kernels.scratch import claim, holds
from syncsgd.kernels.threads import budget
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register
from syncsgd.proto import pb

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


def window_geometry(layer, p):
    """(kernel, stride, pad, dilation) (h, w) pairs of a convolution_param, checked (Convolution,
    Deconvolution and Im2col read the same fields)."""
    try:
        geometry = (_pair(p, "kernel_size", "kernel", None), _pair(p, "stride", "stride", 1),
                    _pair(p, "pad", "pad", 0, partner_default=0), _pair(p, "dilation", None, 1))
    except ValueError as e:
        layer.fail(f"convolution_param: {e}")
    for name, pair in zip(("kernel size", "stride", None, "dilation"), geometry):
        if name and min(pair) <= 0:
            layer.fail(f"convolution_param {name} must be positive, got {pair}")
    return geometry


class ConvolutionBase(Layer):
    """Parameters, weights, plan and chunking shared by Convolution and Deconvolution."""
    sample_wise = True
    min_bottoms = 1
    min_tops = 1
    reverse = False                # True for Deconvolution: the image is the top
    thresholds = THRESHOLDS        # may be replaced per layer (tests force every path)

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
        self.kernel, self.stride, self.pad, self.dilation = window_geometry(self, p)
        self.num_output, self.group, self.bias_term = p.num_output, p.group, p.bias_term
        self._passes = 0          # forward passes, which tell one pass's columns from another's
        channels = bottom[0].shape[1]
        if self.num_output <= 0:
            self.fail("convolution_param.num_output must be set to a positive number")
        if channels == 0:
            self.fail(f"bottom '{bottom[0].name}' {bottom[0].shape} has no channels; check the "
                      "shape of the layer that makes it")
        if self.group <= 0 or channels % self.group or self.num_output % self.group:
            self.fail(f"convolution_param.group {self.group} must divide both the bottom's "
                      f"{channels} channels and num_output {self.num_output}")
        self.channels = channels
        self._checked_top_size(tuple(bottom[0].shape[2:]))    # before allocating the weights
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
        self._plan_key = self.plan = None
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
        top_size = self._checked_top_size(bottom_size)
        for t in top:
            t.reshape(shape[0], self.num_output, *top_size)
        key = (shape, budget())
        if key != self._plan_key:
            self._plan_key = key
            image_size, features_size = ((top_size, bottom_size) if self.reverse
                                         else (bottom_size, top_size))
            geometry = ConvolutionGeometry(
                shape[0], self.image_channels, self.conv_out, image_size, features_size,
                self.kernel, self.pad, self.stride, self.dilation, self.group, self.reverse)
            self._use_plan(geometry, key[1])
            num = geometry.num
            chunk = max(self.plan.chunk, 1)     # the plan's chunk is 0 for an empty batch
            self._chunks = [(n0, min(n0 + chunk, num)) for n0 in range(0, num, chunk)]

    def _use_plan(self, geometry, threads):
        """Plan the layer and build the kernels the plan names."""
        self.plan = plan_convolution(geometry, threads, "CAFFE", False, self.thresholds)
        self._kernels = kernels.build(self.plan, geometry, self.bias_term)

    def _top_size(self, bottom_size):
        raise NotImplementedError

    def _checked_top_size(self, bottom_size):
        top_size = self._top_size(bottom_size)
        if min(top_size) <= 0:
            self.fail(f"output size {top_size} from input {bottom_size} is empty: check "
                      f"kernel {self.kernel}, pad {self.pad}, stride {self.stride}, dilation "
                      f"{self.dilation}")
        return top_size

    # -- running the batch in chunks -----------------------------------------------------------
    def _for_chunks(self, work, shared=True, gradient=None):
        """work(n0, n1, weight_diff) for every chunk of the batch. When `shared` the chunks are
        shared out to the plan's threads; otherwise they run in turn and each GEMM is split
        over the threads instead. With `gradient`, the kernel that computes the weight
        gradient, weight_diff is the matrix from its gradient_matrices where the chunk adds its
        part. Shared chunks are dealt into one group per thread (blas.spread_dealt), so that
        what each group sums does not depend on timing (bit-identical reruns)."""
        chunks = self._chunks
        share = min(self.plan.threads, len(chunks)) if shared else 1
        diff = self.blobs[0].diff
        matrices = ([None] * share if gradient is None
                    else gradient.gradient_matrices(diff, share))
        if share <= 1:
            for n0, n1 in chunks:
                work(n0, n1, matrices[0])
        else:
            spread_dealt(chunks, lambda chunk, group: work(*chunk, matrices[group]), share)
        if gradient is not None:
            gradient.add_gradients(matrices, diff)

    def _bias(self):
        return self.blobs[1].data if self.bias_term else None

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
    """engine DEFAULT runs on oneDNN where it loaded and its plan says so (kernels/plans.py),
    engine CAFFE always on the GEMM kernels."""
    type = "Convolution"
    takes_forms = True       # its oneDNN kernels read and write blobs' forms (blob.py)
    _unavailable_noted = False

    def _top_size(self, bottom_size):
        return tuple(conv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                     self.stride, self.dilation))

    def _use_plan(self, geometry, threads):
        """Plan the layer and build its kernels; a oneDNN that lacks this shape plans it again
        without oneDNN. Primitives split their work for the team they were built for: a new
        share of the cores builds them anew."""
        engine = pb.ConvolutionParameter.Engine.Name(self.param.convolution_param.engine)
        self.plan = plan_convolution(geometry, threads, engine, onednn.available(),
                                     self.thresholds)
        try:
            self._kernels = kernels.build(self.plan, geometry, self.bias_term)
        except onednn.Unavailable as e:
            if not ConvolutionLayer._unavailable_noted:
                ConvolutionLayer._unavailable_noted = True
                log.info(f"{self.name}: convolutions run as GEMMs: {e}")
            self.plan = plan_convolution(geometry, threads, engine, False, self.thresholds)
            self._kernels = kernels.build(self.plan, geometry, self.bias_term)

    def forward(self, bottom, top):
        plan, bias = self.plan, self._bias()
        kernel = self._kernels[plan.forward]
        if plan.forward == "onednn":
            for bot, t in zip(bottom, top):
                kernel.forward(self.blobs[0].data, bias, Side(bot, 0), Side(t, 0))
            return
        weights = kernel.weight_matrix(self.blobs[0].data)
        # The pass's own columns only: the same layer's columns from an earlier pass may still
        # sit in another thread's buffer (lanes run on whichever thread is free).
        self._passes += 1
        for b, (bot, t) in enumerate(zip(bottom, top)):
            def work(n0, n1, _):
                kernel.forward(weights, bias, bot.data[n0:n1], t.data[n0:n1])
            self._for_chunks(work, shared=plan.shared_forward)
            if plan.keep_columns:     # backward reuses them if no layer intervened
                claim("columns", (self, b, self._passes))

    def backward(self, top, propagate_down, bottom):
        if self.plan.weight_grad != "onednn":
            self._gemm_backward(top, propagate_down, bottom)
            return
        # oneDNN's weight gradient and, where wanted, its image gradient.
        weights, bias = self.blobs[0], self.blobs[1] if self.bias_term else None
        for t, down, bot in zip(top, propagate_down, bottom):
            self._kernels["onednn"].backward(
                Side(bot, 0), Side(t, 1), weights.data, Side(bot, 1) if down else None,
                weights.gradient_target(), bias.gradient_target() if bias is not None else None)

    def _gemm_backward(self, top, propagate_down, bottom):
        plan = self.plan
        weight_kernel, image_kernel = self._kernels[plan.weight_grad], None
        if any(propagate_down):
            image_kernel = self._kernels[plan.image_grad]
            image_weights = image_kernel.weight_matrix(self.blobs[0].data)
        # Last bottom first: forward left its columns in the buffer.
        for b in reversed(range(len(bottom))):
            t, bot = top[b], bottom[b]
            self._accumulate_bias_grad(t.diff)

            def work(n0, n1, diff):
                maps_diff, image_diff = t.diff[n0:n1], bot.diff[n0:n1]
                kept = plan.keep_columns and holds("columns", (self, b, self._passes))
                carried = weight_kernel.weight_grad(bot.data[n0:n1], maps_diff, diff, kept)
                if propagate_down[b]:
                    image_kernel.image_grad(image_weights, maps_diff, image_diff, carried)
            self._for_chunks(work, gradient=weight_kernel)
