"""Convolution, and the base it shares with Deconvolution (Caffe's BaseConvolutionLayer).

Both run on channel-major columns (kernels/im2col.py) and differ only in which side is the image
and which the feature map:
  Convolution:   bottom = image, top = features = W @ im2col(bottom)
  Deconvolution: bottom = features, top = image = col2im(W^T @ bottom)
The weights are (conv_out, image_channels / group, kh, kw) in both, conv_out being the feature
channels, as in Caffe. As in BVLC Caffe, every axis after the channel axis (convolution_param.axis)
is spatial: (N, C, H, W) in 2-D, (N, C, L) in 1-D, (N, C, D, H, W) in 3-D, with weights
(conv_out, image_channels / group, k1, ..., kN), or none at all ((N, C): a convolution of one
pixel); the axes before the channel axis are samples, flattened into one batch axis for the
kernels (none for axis 0: the whole blob is one sample).

Which kernels run (oneDNN's, and which of them; GEMMs over columns, MEC's row lowering,
Winograd's F(2x2, 3x3) and F(4x4, 3x3); batched or per sample; the chunk size) is decided in one
place, kernels/plans.py, when the geometry or the thread budget changes: by timing each direction's
candidates once per machine (kernels/tuning.py), then the two gradients together where a Winograd
kernel could run both (plans.gradient_pairs), or, with SYNCSGD_KERNELS=rules or where there is
nothing to choose, by the fixed rules of plan_convolution. The layer runs the kernels its plan names
(kernels/convolution.py), the batch in chunks shared out to the budget's threads.
"""
import math

import numpy as np

from syncsgd.blob import Blob, Side
from syncsgd.fillers import fill
from syncsgd import switches
from syncsgd.kernels import convolution as kernels
from syncsgd.kernels import onednn, tuning
from syncsgd.kernels.blas import gemm, spread_dealt
from syncsgd.kernels.im2col import conv_out_size
from syncsgd.kernels.plans import (THRESHOLDS, ConvolutionGeometry, choose,
                                   convolution_candidates, gradient_pairs, plan_convolution,
                                   timed_convolution, timing_convolution)
from syncsgd.kernels.scratch import claim, holds, scratch
from syncsgd.kernels.threads import budget
from syncsgd.kernels.winograd import VARIANTS as WINOGRAD
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.registry import register
from syncsgd.proto import pb

def _per_axis(param, field, prefix, default, axes, partner_default=None):
    """One value per spatial axis (`axes` of them) from a repeated field (given once, or once per
    axis) or, in 2-D, its prefix_h / prefix_w forms (dilation has none: prefix None).

    Caffe lets pad_h or pad_w come alone (the other is 0); kernel and stride need both.
    """
    values = list(getattr(param, field))
    h, w = f"{prefix}_h", f"{prefix}_w"
    if prefix and (param.HasField(h) or param.HasField(w)):
        if axes != 2:
            raise ValueError(f"{h} and {w} are for 2-D convolutions, this one has {axes} spatial "
                             f"axes: give {field} once, or once per spatial axis")
        if values:
            raise ValueError(f"give either {field} or {h} and {w}, not both")
        if partner_default is None and not (param.HasField(h) and param.HasField(w)):
            raise ValueError(f"{h} and {w} must be given together")
        return tuple(getattr(param, f) if param.HasField(f) else partner_default
                     for f in (h, w))
    if len(values) == axes:
        return tuple(values)
    if len(values) == 1:
        return (values[0],) * axes
    if not values:
        if default is None:
            raise ValueError(f"{field} is required (once, or once per spatial axis)"
                             + (f", or {h} and {w}" if axes == 2 else ""))
        return (default,) * axes
    raise ValueError(f"{field} is given {len(values)} times; give it once or once per spatial "
                     f"axis ({axes})")


def _kernels_of(candidate):
    """The kernel candidates in a timed choice's candidate: itself, or a whole choice's."""
    return list(candidate.values()) if isinstance(candidate, dict) else [candidate]


def _planes(maps):
    """(n, c, *size) -> a (n, c, pixels) view (also for n = 0, where reshape cannot infer it)."""
    n, c = maps.shape[:2]
    return maps.reshape(n, c, math.prod(maps.shape[2:]))


def window_geometry(layer, p, axes):
    """(kernel, stride, pad, dilation) of a convolution_param, one value per spatial axis
    (`axes` of them), checked (Convolution, Deconvolution and Im2col read the same fields)."""
    try:
        geometry = (_per_axis(p, "kernel_size", "kernel", None, axes),
                    _per_axis(p, "stride", "stride", 1, axes),
                    _per_axis(p, "pad", "pad", 0, axes, partner_default=0),
                    _per_axis(p, "dilation", None, 1, axes))
    except ValueError as e:
        layer.fail(f"convolution_param: {e}")
    for name, values in zip(("kernel size", "stride", None, "dilation"), geometry):
        if name and any(v <= 0 for v in values):
            layer.fail(f"convolution_param {name} must be positive, got {values}")
    return geometry


def spatial_axes(layer, p, bottom):
    """(channel axis, number of spatial axes) of a convolution_param over `bottom`: as in BVLC,
    every axis after the channel axis is spatial."""
    axis = canonical_axis(p.axis, bottom.num_axes, layer)
    return axis, bottom.num_axes - axis - 1


class ConvolutionBase(Layer):
    """Parameters, weights, plan and chunking shared by Convolution and Deconvolution."""
    min_bottoms = 1
    min_tops = 1
    reverse = False                # True for Deconvolution: the image is the top
    thresholds = THRESHOLDS        # may be replaced per layer (tests force every path)

    @property
    def sample_wise(self):
        """Per sample unless axis 0 makes the blob's first axis the channels."""
        return self.axis >= 1

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        if len(bottom) != len(top):
            self.fail(f"takes one top per bottom, got {len(bottom)} bottoms and {len(top)} tops")
        p = self.param.convolution_param
        self.axis, axes = spatial_axes(self, p, bottom[0])
        self.kernel, self.stride, self.pad, self.dilation = window_geometry(self, p, axes)
        self.num_output, self.group, self.bias_term = p.num_output, p.group, p.bias_term
        self._passes = 0          # forward passes, which tell one pass's columns from another's
        channels = bottom[0].shape[self.axis]
        if self.num_output <= 0:
            self.fail("convolution_param.num_output must be set to a positive number")
        if channels == 0:
            self.fail(f"bottom '{bottom[0].name}' {bottom[0].shape} has no channels; check the "
                      "shape of the layer that makes it")
        if self.group <= 0 or channels % self.group or self.num_output % self.group:
            self.fail(f"convolution_param.group {self.group} must divide both the bottom's "
                      f"{channels} channels and num_output {self.num_output}")
        self.channels = channels
        self._checked_top_size(bottom[0].shape[self.axis + 1:])   # before allocating the weights
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
        self._plan_key = self.plan = self._kernels = None
        self._chunks = []
        self._ones = np.ones((0, 1), np.float32)

    # -- reshape --------------------------------------------------------------------------------
    def reshape(self, bottom, top):
        shape, axis = bottom[0].shape, self.axis
        if len(shape) != axis + 1 + len(self.kernel) or shape[axis] != self.channels:
            self.fail(f"bottom shape {shape} does not fit: expected {self.channels} channels on "
                      f"axis {axis} and {len(self.kernel)} spatial axes after it, as at setup")
        for b in bottom[1:]:
            if b.shape != shape:
                self.fail(f"all bottoms must have the same shape; got {shape} and {b.shape}")
        bottom_size = tuple(shape[axis + 1:])
        top_size = self._checked_top_size(bottom_size)
        for t in top:
            t.reshape(shape[:axis] + (self.num_output,) + top_size)
        key = (shape, budget())
        if key != self._plan_key:
            self._plan_key = key
            num = math.prod(shape[:axis])
            # The bottoms' and tops' arrays as the kernels take them: (num, channels, *size).
            self._bottom_batch = (num, self.channels) + bottom_size
            self._top_batch = (num, self.num_output) + top_size
            image_size, features_size = ((top_size, bottom_size) if self.reverse
                                         else (bottom_size, top_size))
            geometry = ConvolutionGeometry(
                num, self.image_channels, self.conv_out, image_size, features_size,
                self.kernel, self.pad, self.stride, self.dilation, self.group, self.reverse,
                axis, self.param.convolution_param.force_nd_im2col)
            self.geometry = geometry
            self._use_plan(geometry, key[1], bottom, top)

    def _use_plan(self, geometry, threads, bottom, top):
        """Plan the layer and build the kernels the plan names (plans.choose: planned again
        without oneDNN where it lacks the shape). Primitives split their work for the team they
        were built for: a new share of the cores builds them anew."""
        engine = pb.ConvolutionParameter.Engine.Name(self.param.convolution_param.engine)
        candidates = self._candidates(geometry, threads, engine)
        if candidates is None:
            self._set_plan(*choose(
                plan_convolution, lambda plan: kernels.build(plan, geometry, self.bias_term),
                geometry, threads, engine, thresholds=self.thresholds))
            return
        key = {"layer": type(self).__name__, "geometry": geometry.__dict__, "threads": threads,
               "engine": engine, "bias": self.bias_term,
               "forms": [self._images_in_forms(bottom[0]), top[0].takes_forms]}
        g = geometry
        size = "x".join(map(str, g.image_size))
        label = f"layer {self.name} ({g.num}x{g.image_channels}x{size} -> {g.conv_out} maps)"
        prepare = self._timer(g, threads, engine, bottom, top)
        choice = self._timed_choice(key, candidates, prepare, label)
        pairs = gradient_pairs(choice, candidates)
        if pairs is not None:
            choice = self._timed_choice({**key, "gradients_after": choice}, {"backward": pairs},
                                        prepare, f"{label}, both gradients")["backward"]
        plan = timed_convolution(geometry, threads, engine, choice, self.thresholds)
        self._set_plan(plan, kernels.build(plan, geometry, self.bias_term))

    @staticmethod
    def _timed_choice(key, candidates, prepare, label):
        """tuning.choice, Winograd's candidates run once first where it will time, so that their
        16 or 36 products are timed then: inside the layer's timing a product not timed yet
        takes the fixed rules, planned afresh at every call (tuning.busy). Not the GEMM
        kernels' ("Convolution: timed choice")."""
        if tuning.cached(key, candidates) is None:
            for direction, options in candidates.items():
                for candidate in options:
                    run = (any(c[0] in WINOGRAD for c in _kernels_of(candidate))
                           and prepare(direction, candidate))
                    if run:
                        run()
        return tuning.choice(key, candidates, prepare, label)

    def _set_plan(self, plan, built):
        self.plan, self._kernels = plan, built
        num = self._bottom_batch[0]
        chunk = max(plan.chunk, 1)     # the plan's chunk is 0 for an empty batch
        self._chunks = [(n0, min(n0 + chunk, num)) for n0 in range(0, num, chunk)]

    def _candidates(self, geometry, threads, engine):
        """The timed choice's candidates, or None for the fixed rules: those a test set
        (thresholds), SYNCSGD_KERNELS=rules, or no oneDNN."""
        if (not switches.timed_kernels() or self.thresholds is not THRESHOLDS
                or not onednn.available() or self.reverse or geometry.channel_axis != 1
                or len(geometry.kernel) != 2 or geometry.force_nd):
            return None
        g = geometry

        def offered():
            try:
                return onednn.ConvolutionKernels(
                    (g.num, g.image_channels) + g.image_size,
                    (g.num, g.conv_out) + g.features_size, g.kernel, g.pad, g.stride,
                    g.dilation, g.group, self.bias_term).names
            except onednn.Unavailable:
                return None
        return convolution_candidates(geometry, threads, engine, offered, self.thresholds)

    def _timer(self, geometry, threads, engine, bottom, top):
        """prepare(direction, candidate) for tuning.choice: a function that runs this layer's
        `direction` once on the candidate's kernels (direction "backward": both gradients, on
        the whole choice `candidate`), over random blobs of the bottom's and top's shapes; the
        layer's parameter gradients are restored after. The run is timed as
        it will run between the layers around it: a blob in forms (the maps where they take
        them, the images where they also get them: _images_in_forms) comes in the
        channel-blocked layout those layers keep, and a result in another layout is reordered
        into it inside the time; another blob is read and written as its array."""
        rng = np.random.default_rng(0)

        def blob(like, in_forms):
            made = Blob(like.shape, name=f"{self.name} timing")
            made.data[...] = rng.standard_normal(like.shape, np.float32)
            made.diff[...] = rng.standard_normal(like.shape, np.float32)
            made.takes_forms = in_forms
            blocked = onednn.Layout(like.shape) if in_forms else None
            if blocked is not None:
                blocked.put(made, 0)
                blocked.put(made, 1)
            return made, blocked
        (images, into_images), (maps, into_maps) = (
            blob(bottom[0], self._images_in_forms(bottom[0])), blob(top[0], top[0].takes_forms))
        results = {"forward": (into_maps, maps, 0), "image_grad": (into_images, images, 1)}

        def prepare(direction, candidate):
            if direction == "backward":      # a whole choice, both gradients run (gradient_pairs)
                plan = timed_convolution(geometry, threads, engine, candidate, self.thresholds)
            else:
                plan = timing_convolution(geometry, threads, engine, direction, candidate,
                                          self.thresholds)
            try:
                built = kernels.build(plan, geometry, self.bias_term)
            except onednn.Unavailable:
                return None
            result = results.get(direction, results["image_grad"] if direction == "backward"
                                 else (None,))
            return lambda: self._timed_run(plan, built, direction, images, maps, result)
        return prepare

    @staticmethod
    def _images_in_forms(bottom):
        """Whether the images come in a form: they take one and the layer writing them leaves
        one (Blob.gets_forms). Where they come as an array (a ResNet block's input, from an
        Eltwise of BatchNorms' arrays), a kernel in a blocked layout reorders them there, and
        its image gradient back, and the timing charges it."""
        return bottom.takes_forms and bottom.gets_forms

    def _timed_run(self, plan, built, direction, images, maps, result):
        """One run of `direction` on (plan, built), the layer's own plan and gradients kept;
        result: (Layout, blob, side) to charge for the result's layout, or (None,)."""
        kept = self.plan, self._kernels, self._chunks
        diffs = [b.diff.copy() for b in self.blobs]
        flags = self.param_propagate_down
        try:
            self._set_plan(plan, built)
            if direction == "forward":
                self.forward([images], [maps])
            elif direction == "backward":
                self.backward([maps], [True], [images])
            elif direction == "weight_grad":
                self.backward([maps], [False], [images])
            else:
                self.param_propagate_down = [False] * len(self.blobs)
                self.backward([maps], [True], [images])
            if result[0] is not None:
                result[0].take(*result[1:])
        finally:
            self.param_propagate_down = flags
            self.plan, self._kernels, self._chunks = kept
            for b, diff in zip(self.blobs, diffs):
                b.diff[...] = diff

    def _top_size(self, bottom_size):
        raise NotImplementedError

    def _checked_top_size(self, bottom_size):
        top_size = self._top_size(bottom_size)
        if any(size <= 0 for size in top_size):
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
        diff = self.blobs[0].diff if self.propagates_param(0) else self._discarded_weight_grad()
        matrices = ([None] * share if gradient is None
                    else gradient.gradient_matrices(diff, share))
        if share <= 1:
            for n0, n1 in chunks:
                work(n0, n1, matrices[0])
        else:
            spread_dealt(chunks, lambda chunk, group: work(*chunk, matrices[group]), share)
        if gradient is not None:
            gradient.add_gradients(matrices, diff)

    def _discarded_weight_grad(self):
        """Where a GEMM backward adds the gradient of weights at lr_mult 0 (Caffe computes none):
        the image gradient reuses what the weight gradient's kernel prepares."""
        discard = scratch("discarded_weight_grad", self.blobs[0].shape)
        discard.fill(0)
        return discard

    def _bias(self):
        return self.blobs[1].data if self.bias_term else None

    def _add_bias(self, maps):
        if self.bias_term:
            planes = _planes(maps)
            planes += self.blobs[1].data[:, None]

    def _accumulate_bias_grad(self, maps_diff):
        """bias.diff += maps_diff (n, c, *size) summed over samples and pixels (a GEMV, then n
        additions)."""
        if self.bias_term and self.propagates_param(1):
            planes = _planes(maps_diff)
            n, c, pixels = planes.shape
            if self._ones.shape[0] != pixels:
                self._ones = np.ones((pixels, 1), np.float32)
            sums = np.empty((n * c, 1), np.float32)
            gemm(planes.reshape(n * c, pixels), self._ones, sums)
            self.blobs[1].diff += sums.reshape(n, c).sum(axis=0)


@register
class ConvolutionLayer(ConvolutionBase):
    """engine DEFAULT runs on oneDNN where it loaded and its plan says so (kernels/plans.py),
    engine CAFFE always on the GEMM kernels."""
    type = "Convolution"
    takes_forms = True       # its oneDNN kernels read and write blobs' forms (blob.py)

    def _top_size(self, bottom_size):
        return tuple(conv_out_size(*a) for a in zip(bottom_size, self.kernel, self.pad,
                                                     self.stride, self.dilation))

    def leaves_forms(self, bottom):
        return self.plan.forward == "onednn" and self._kernels["onednn"].maps_in_form()

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
            images, maps = bot.data.reshape(self._bottom_batch), t.data.reshape(self._top_batch)

            def work(n0, n1, _):
                kernel.forward(weights, bias, images[n0:n1], maps[n0:n1])
            self._for_chunks(work, shared=plan.shared_forward)
            if plan.keep_columns:     # backward reuses them if no layer intervened
                claim("columns", (self, b, self._passes))

    def backward(self, top, propagate_down, bottom):
        """The parameter gradients and the image gradients each on the kernel the plan names:
        oneDNN's in one call for what runs on it, the GEMM kernels' chunk by chunk."""
        plan = self.plan
        params = self.propagates_param(0) or (self.bias_term and self.propagates_param(1))
        onednn_params = params and plan.weight_grad == "onednn"
        onednn_images = [down and plan.image_grad == "onednn" for down in propagate_down]
        if onednn_params or any(onednn_images):
            weights, bias = self.blobs[0], self.blobs[1] if self.bias_term else None
            for t, down, bot in zip(top, onednn_images, bottom):
                self._kernels["onednn"].backward(
                    Side(bot, 0), Side(t, 1), weights.data, Side(bot, 1) if down else None,
                    weights.gradient_target() if onednn_params and self.propagates_param(0)
                    else None,
                    bias.gradient_target() if onednn_params and bias is not None
                    and self.propagates_param(1) else None)
        gemm_params = params and plan.weight_grad != "onednn"
        gemm_images = [down and plan.image_grad != "onednn" for down in propagate_down]
        if gemm_params or any(gemm_images):
            self._gemm_backward(top, gemm_params, gemm_images, bottom)

    def _gemm_backward(self, top, params, propagate_down, bottom):
        """params: the parameter gradients run on the GEMM kernels (else oneDNN computed them,
        or none is wanted); propagate_down: which bottoms' gradients they compute."""
        plan = self.plan
        weight_kernel = self._kernels[plan.weight_grad] if params else None
        if any(propagate_down):
            image_kernel = self._kernels[plan.image_grad]
            image_weights = image_kernel.weight_matrix(self.blobs[0].data)
        # Last bottom first: forward left its columns in the buffer.
        for b in reversed(range(len(bottom))):
            if not (params or propagate_down[b]):
                continue
            images, image_diff = (a.reshape(self._bottom_batch)
                                  for a in (bottom[b].data, bottom[b].diff))
            maps_diff = top[b].diff.reshape(self._top_batch)
            if params:
                self._accumulate_bias_grad(maps_diff)

            def work(n0, n1, diff):
                if params:
                    kept = plan.keep_columns and holds("columns", (self, b, self._passes))
                    carried = weight_kernel.weight_grad(images[n0:n1], maps_diff[n0:n1], diff,
                                                        kept)
                if propagate_down[b] and not (params and image_kernel is weight_kernel):
                    carried = image_kernel.carry(maps_diff[n0:n1])
                if propagate_down[b]:
                    image_kernel.image_grad(image_weights, maps_diff[n0:n1],
                                            image_diff[n0:n1], carried)
            self._for_chunks(work, gradient=weight_kernel)
