"""BatchNorm: normalise each channel by its batch mean and variance (TRAIN) or by the stored
moving averages (use_global_stats), as Caffe's BatchNormLayer; a Scale layer usually follows.

The statistics are over the GLOBAL batch: per-channel sums and the element count go through
ctx.allreduce_sum, so a net split over ranks normalises exactly as one process would.
Blobs (never learned): [0] mean sum, [1] variance sum, [2] the normalising factor, shape (1,);
the moving averages are blobs[0] / blobs[2] and blobs[1] / blobs[2].

With stored statistics (use_global_stats; TEST by default) it is an elementwise pass, run on
oneDNN one pass each way in the layout of the blob's form (kernels/normalization.py). Batch
statistics take passes of this layer's own on any number of ranks: their float64 sums keep
one process and N ranks within 1e-5 of each other after training, which oneDNN's float32
statistics (relative errors of a few 1e-6 per pass) did not. Those passes go over the blob's
(sample, channel) rows in blocks (kernels/rows.py): numpy's below, or in place where Numba
runs the compiled ones, two each way (kernels/batch_stats.py), the sums added up over the
ranks between them; on one process, with no sums to wait for, one pass over blocks of
channels that each block takes through both while it is in the cache, the same bits. In a
net, in place with batch statistics, the layer absorbs the Scale in place after it (absorb):
its last pass writes x_norm * scale + bias, and its backward takes the sums the Scale's
backward took, a pass fewer each way; on the compiled passes also the plain ReLU in place
after that Scale (absorb_relu).
"""
import numpy as np

from syncsgd import TEST
from syncsgd.blob import Blob
from syncsgd.kernels import batch_stats, compiled
from syncsgd.kernels.normalization import ChannelNormalization, usable
from syncsgd.kernels.rows import Rows
from syncsgd.kernels.scratch import scratch
from syncsgd.layers.base import Fusion, Layer
from syncsgd.layers.registry import register


def uses_global_stats(param, phase):
    """Caffe's rule: use_global_stats where set, else TEST uses the stored statistics."""
    p = param.batch_norm_param
    return p.use_global_stats if p.HasField("use_global_stats") else phase == TEST


@register
class BatchNormLayer(Layer):
    type = "BatchNorm"
    passes_forms = True      # with stored statistics, where it takes forms
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = True

    @classmethod
    def forms_for(cls, param, phase):
        return uses_global_stats(param, phase)

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.batch_norm_param
        self._global_stats = uses_global_stats(self.param, self.ctx.phase)
        self.takes_forms = self._global_stats
        self._fraction = p.moving_average_fraction
        self._eps = p.eps
        if bottom[0].num_axes < 1:
            self.fail("bottom must have at least one axis (num)")
        self._channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        if not self.blobs:
            for i, shape in enumerate([(self._channels,), (self._channels,), (1,)]):
                self.blobs.append(Blob(shape, name=f"{self.name}.stat{i}"))
        for i in range(len(self.blobs)):
            if len(self.param.param) == i:
                self.param.param.add(lr_mult=0.0, decay_mult=0.0)
            elif self.param.param[i].lr_mult != 0:
                self.fail(f"param {i} has lr_mult {self.param.param[i].lr_mult}; batch "
                          f"statistics are not learned, set lr_mult: 0 or drop the param entry")
        self._std = np.ones(self._channels, np.float32)          # sqrt(var + eps), for backward
        # For the passes over blocks of channels: the batch's mean and variance as they come,
        # the scale and shift where no Scale is absorbed, the sums of backward's g, g x_norm.
        self._mean_now = np.zeros(self._channels, np.float32)
        self._var_now = np.zeros(self._channels)
        self._ones = np.ones(self._channels, np.float32)
        self._no_shift = np.zeros(self._channels, np.float32)
        self._g_sums = np.zeros((2, self._channels))
        self._written = False       # gradient_sums wrote this pass's gradient
        self._shape = None
        self._mean = np.zeros(self._channels, np.float32)         # the stored statistics
        self._var = np.zeros(self._channels, np.float32)
        self._onednn = ChannelNormalization(self._eps, False, False)
        self._ran_onednn = False
        self._fusion = None         # with the Scale after it (absorb)
        self._scale = None
        self._relu_fusion = None    # with the ReLU after that Scale (absorb_relu)
        # Batch statistics in place take the compiled passes (kernels/batch_stats.py).
        self.compiled = (not self._global_stats and top[0] is bottom[0]
                          and compiled.available())

    def absorb(self, follower, bottom, top, follower_bottom, follower_top):
        """With batch statistics, in place: the Scale of one value per channel that follows in
        place, as in a ResNet. Its forward then folds into this layer's last pass, y = x_norm *
        scale + bias, and its backward's sums (of dy and dy * x_norm) serve this layer's too,
        instead of a pass writing scale * dy between them (Scale.absorbed_by)."""
        if (self._global_stats or top[0] is not bottom[0] or follower.type != "Scale"
                or follower_top[0] is not top[0]
                or not follower.absorbable(follower_bottom, follower_top)):
            return None
        self._fusion, self._scale = Fusion(), follower
        follower.absorbed_by(self, self._fusion)
        return self._fusion

    def absorb_relu(self, relu, bottom, top):
        """Through the Scale this layer absorbed (Scale.absorb): the plain ReLU in place after
        it, where the compiled passes run, which clamp the output and mask the gradient in
        their loops instead of a pass each way (kernels/batch_stats.py). Not where a later
        layer runs in place on the ReLU's top: the mask is recomputed from x - mean, and the
        ReLU's own backward reads the blob as that layer left it."""
        if (not self.compiled or relu.type != "ReLU" or relu.slope != 0
                or top[0] is not bottom[0] or relu.tops_rewritten_later):
            return None
        self._relu_fusion = Fusion()
        relu.folded_into(self)
        return self._relu_fusion

    def relu_folded(self, backward=False):
        """Whether the last forward pass did the absorbed ReLU's forward (all three layers ran
        in it), and with `backward`, whether the pass at hand does its backward too."""
        f, r = self._fusion, self._relu_fusion
        done = r is not None and f.forward and r.forward
        return done and f.backward and r.backward if backward else done

    def gradient_sums(self, dy, scale=None):
        """For backward where the compiled passes run: the sums of g and of g * (x - mean)
        per channel over this process's samples, in float64, g the gradient of the absorbed
        Scale's output, or of this layer's (dy, masked where the ReLU's backward is folded
        in). On one process the same pass over blocks of channels writes the gradient over dy
        too (batch_stats.gradient_channels), `scale` the Scale's values (None: no Scale), and
        this layer's backward then has nothing left to do."""
        d = dy.reshape(self._rows.shape)
        slope, bias = self._rows.flat(3), self._rows.flat(4)
        relu = self.relu_folded(backward=True)
        x, mean = self._kept
        if self.ctx.alone():
            g = self._g_sums
            self._rows.run_channels(lambda c0, c1: batch_stats.gradient_channels(
                d, x, mean, slope, bias, relu, self._channels, c0, c1, self._count,
                self._ones if scale is None else scale, self._std, *self._row_sums,
                self._rows.flat(5), self._rows.flat(6), self._rows.flat(7), g[0], g[1]))
            self._written = True
            return g[0], g[1]
        sums, dots = self._row_sums
        self._rows.run(lambda lo, hi: batch_stats.sums(d, x, mean, slope, bias, relu, lo, hi,
                                                       sums, dots))
        return self._channel_totals(sums), self._channel_totals(dots)

    def _channel_totals(self, row_sums):
        """Each channel's rows summed over the samples in order, as batch_stats.channel_total
        sums them on one process (numpy's sum over that axis goes pairwise for one channel);
        zeros for no samples (a rank holding none of the batch)."""
        n = self._rows.of[0]
        if n == 0:
            return np.zeros(self._channels)
        return row_sums.reshape(n, -1).cumsum(axis=0)[-1]

    def std(self):
        """sqrt(var + eps) per channel, of the last forward with batch statistics."""
        return self._std

    def normalised(self):
        """(x - mean as (sample, channel) rows, std()) of the last forward with batch
        statistics: x_norm is their quotient. Where the compiled forward kept x rather than
        x - mean, it is centred here (a Scale whose backward runs without this layer's)."""
        x, mean = self._kept
        if mean is self._zeros:
            return x, self._std
        if self._centred is None:
            self._centred = np.empty(self._rows.shape, np.float32)
        np.subtract(x, mean.reshape(-1, 1), out=self._centred)
        return self._centred, self._std

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 1 and shape[1] != self._channels:
            self.fail(f"bottom has {shape[1]} channels, the layer was set up for {self._channels}")
        if top[0] is not bottom[0]:
            top[0].reshape(shape)
        if shape != self._shape:
            self._shape = shape
            # Row buffers: 0 and 1 sums, 2 the mean, 3 and 4 forward's factors (kept for the
            # ReLU's mask), 5 to 7 backward's, 8 zeros.
            self._rows = Rows(shape, 9)
            self._row_sums = np.zeros((2, self._rows.shape[0]))     # the compiled passes'
            # In place, forward overwrites x. The numpy passes keep x - mean; the compiled
            # ones keep x itself where the blob can take this array for the output instead
            # (Blob.exchange_data), a pass writing one array fewer, else x - mean here.
            self._spare = np.zeros(shape, np.float32)
            self._centred = None if self.compiled else self._spare.reshape(self._rows.shape)
            self._zeros = self._rows.flat(8)
            self._kept = (self._spare.reshape(self._rows.shape), self._zeros)

    def forward(self, bottom, top):
        if self._fusion is not None:
            self._fusion.sums = None
        self._written = False
        self._ran_onednn = self._global_stats and usable(bottom[0])
        if self._global_stats:
            factor = self.blobs[2].data[0]
            factor = np.float32(0.0 if factor == 0 else 1.0 / factor)
            np.multiply(self.blobs[0].data, factor, out=self._mean)
            np.multiply(self.blobs[1].data, factor, out=self._var)
            if self._ran_onednn:
                self._onednn.forward(bottom[0], top[0], self._mean, self._var)
                return
        x = bottom[0].data.reshape(self._rows.shape)
        y = top[0].data.reshape(self._rows.shape)
        xc = self._centred
        if self.compiled:
            self._compiled_forward(top[0], x)
            return
        if self._global_stats:
            mean, var = self._mean, self._var
        else:
            c = self._channels
            self._rows.run(lambda lo, hi: self._rows.sums(0, x, lo, hi))
            totals = np.append(self._rows.totals(0), x.size / c)
            self.ctx.allreduce_sum(totals)
            self._count = totals[c]
            mean = (totals[:c] / self._count).astype(np.float32)
        m = self._rows.per_row(2, mean)

        def centre(lo, hi):
            np.subtract(x[lo:hi], m[lo:hi], out=xc[lo:hi])
            if not self._global_stats:
                self._rows.dots(1, xc, xc, lo, hi)
        self._rows.run(centre)
        if not self._global_stats:
            var = self.ctx.allreduce_sum(self._rows.totals(1)) / self._count
            self._update_moving_averages(mean, var)
        np.sqrt(np.asarray(var, np.float32) + np.float32(self._eps), out=self._std)
        if self._global_stats:
            sd = self._rows.per_row(3, self._std)
            self._rows.run(lambda lo, hi: np.divide(xc[lo:hi], sd[lo:hi], out=y[lo:hi]))
            return
        slope, bias = self._affine()

        def affine(lo, hi):
            np.multiply(xc[lo:hi], slope[lo:hi], out=y[lo:hi])
            if bias is not None:
                np.add(y[lo:hi], bias[lo:hi], out=y[lo:hi])
        self._rows.run(affine)

    def _affine(self):
        """y = x_norm * slope + bias per row (buffers 3 and 4; bias None for none): x_norm, or
        with the Scale absorbed x_norm * scale + bias, in one pass."""
        fused = self._fusion is not None and self._fusion.forward
        scale = self._scale.blobs if fused else []
        slope = self._rows.per_row(3, (scale[0].data if fused else np.float32(1)) / self._std)
        bias = self._rows.per_row(4, scale[1].data) if len(scale) > 1 else None
        return slope, bias

    def _compiled_forward(self, blob, x):
        """Batch statistics in place in two passes: the sums and sums of squares of each row,
        then the output, the ReLU's clamp too where it is folded in; on one process both in
        one pass over blocks of channels (batch_stats.normalise_channels). The output goes
        to the spare array, which the blob takes in exchange for x (kept for backward); where
        it cannot, over x, x - mean going to the spare."""
        relu = self.relu_folded()
        spare = self._spare.reshape(self._rows.shape)
        kept = blob.exchange_data(self._spare)
        if kept is None:
            y, self._kept = x, (spare, self._zeros)
        else:
            self._spare = kept
            y, self._kept = spare, (x, self._rows.flat(2))
        if self.ctx.alone():
            self._count = x.size / self._channels
            fused = self._fusion is not None and self._fusion.forward
            scale = [b.data for b in self._scale.blobs] if fused else []
            factor = scale[0] if scale else self._ones
            shift = scale[1] if len(scale) > 1 else self._no_shift
            mean, var = self._mean_now, self._var_now
            self._rows.run_channels(lambda c0, c1: batch_stats.normalise_channels(
                x, y, spare, kept is None, self._channels, c0, c1, self._count,
                np.float32(self._eps), factor, shift, relu, *self._row_sums, self._zeros,
                self._rows.flat(2), self._rows.flat(3), self._rows.flat(4), mean, var,
                self._std))
            self._update_moving_averages(mean, var)
            return
        self._statistics(x)
        slope, bias = self._affine()
        if bias is None:
            bias = self._rows.per_row(4, 0.0)
        m = self._rows.flat(2)
        self._rows.run(lambda lo, hi: batch_stats.normalise(
            x, y, spare, kept is None, m, slope.reshape(-1), bias.reshape(-1), relu, lo, hi))

    def _statistics(self, x):
        """The first of the two passes: the rows' sums and sums of squares, added up over the
        ranks; the channels' mean (as buffer 2's rows), std and moving averages."""
        c = self._channels
        sums, squares = self._row_sums
        zeros = self._zeros
        self._rows.run(lambda lo, hi: batch_stats.sums(x, x, zeros, zeros, zeros, False, lo,
                                                       hi, sums, squares))
        totals = np.concatenate([self._channel_totals(sums), self._channel_totals(squares),
                                 [x.size / c]])
        self.ctx.allreduce_sum(totals)
        self._count = totals[2 * c]
        mean = totals[:c] / self._count
        var = np.maximum(totals[c:2 * c] / self._count - mean * mean, 0.0)
        mean = mean.astype(np.float32)
        self._update_moving_averages(mean, var)
        np.sqrt(var.astype(np.float32) + np.float32(self._eps), out=self._std)
        self._rows.per_row(2, mean)

    def _update_moving_averages(self, mean, var):
        m = self._count
        f = np.float32(self._fraction)
        self.blobs[2].data *= f
        self.blobs[2].data += 1
        self.blobs[0].data[...] = mean + f * self.blobs[0].data
        correction = m / (m - 1) if m > 1 else 1.0
        unbiased = np.float32(correction) * var.astype(np.float32)
        self.blobs[1].data[...] = unbiased + f * self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self._ran_onednn:
            self._onednn.backward(top[0], bottom[0], True, self._mean, self._var)
            return
        dy = top[0].diff.reshape(self._rows.shape)
        dx = bottom[0].diff.reshape(self._rows.shape)
        if self._global_stats:
            sd = self._rows.per_row(3, self._std)
            self._rows.run(lambda lo, hi: np.divide(dy[lo:hi], sd[lo:hi], out=dx[lo:hi]))
            return
        # dx = (g - mean(g) - x_norm * mean(g * x_norm)) / std, x_norm = centred / std, g the
        # gradient of x_norm: dy, or scale * dy where the Scale is absorbed, whose backward ran
        # first and left the sums of dy and dy * centred (per channel, this process's samples).
        c = self._channels
        xc = self._centred
        sums, scale = (self._fusion.sums, self._scale.blobs[0].data) if (
            self._fusion is not None and self._fusion.sums is not None) else (None, 1.0)
        if sums is not None:
            self._fusion.sums = None
        elif self.compiled:
            sums = self.gradient_sums(dy)
        else:
            def row_sums(lo, hi):
                self._rows.sums(0, dy, lo, hi)
                self._rows.dots(1, dy, xc, lo, hi)
            self._rows.run(row_sums)
            sums = self._rows.totals(0), self._rows.totals(1)
        if self._written:       # by gradient_sums, on one process
            self._written = False
            return
        totals = np.concatenate(sums)
        self.ctx.allreduce_sum(totals)
        totals /= self._count
        std = self._std.astype(np.float64)
        g = np.asarray(scale, np.float64) / std
        # dx = dy * g / std - mean(dy) * g / std - centred * mean(dy * centred) * g / std^3
        slope = self._rows.per_row(5, g)
        shift = self._rows.per_row(6, totals[:c] * g)
        tilt = self._rows.per_row(7, totals[c:] * g / (std * std))
        if self.compiled:
            relu = self.relu_folded(backward=True)
            forward_slope, forward_bias = self._rows.flat(3), self._rows.flat(4)
            x, mean = self._kept
            self._rows.run(lambda lo, hi: batch_stats.gradient(
                dx, x, mean, forward_slope, forward_bias, relu, slope.reshape(-1),
                shift.reshape(-1), tilt.reshape(-1), lo, hi))
            return

        def gradient(lo, hi):
            # dy and dx may be one array (in place): each block is read before it is written.
            out = dx[lo:hi]
            product = scratch("batch_norm_product", (hi - lo, self._rows.shape[1]))
            np.multiply(xc[lo:hi], tilt[lo:hi], out=product)
            np.multiply(dy[lo:hi], slope[lo:hi], out=out)
            np.subtract(out, shift[lo:hi], out=out)
            np.subtract(out, product, out=out)
        self._rows.run(gradient)
