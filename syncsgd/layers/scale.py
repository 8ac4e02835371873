"""Scale: multiplies bottom[0] by a learned blob, or by bottom[1], broadcast as in Bias; an optional
learned bias follows (Caffe's ScaleLayer, which ResNet uses in place after BatchNorm).

A learned scale of one value per channel (axis 1), as ResNet's, takes one pass each way: on a
blob in a form's layout (blob.py), oneDNN's normalisation with mean 0 and variance 1, whose
backward gives the scale's and bias's gradients (kernels/normalization.py); on an array, the
blocks of (sample, channel) rows of kernels/rows.py, which sum the gradients per row and then
per channel in float64 as BatchNorm does. In place after a BatchNorm with batch statistics, the
BatchNorm does this layer's forward and most of its backward (absorbed_by)."""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.kernels.normalization import ChannelNormalization, usable
from syncsgd.kernels.rows import Rows
from syncsgd.layers.base import Layer
from syncsgd.layers.bias import broadcast_dims, learned_shape, operand_grad
from syncsgd.layers.registry import register
from syncsgd.proto import pb


@register
class ScaleLayer(Layer):
    type = "Scale"
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    in_place_ok = True
    takes_forms = True
    passes_forms = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.scale_param
        if not self.blobs:
            # With bottom[1] as the scale, the bias spans as many axes as bottom[1] has.
            num_axes = bottom[1].num_axes if len(bottom) > 1 else p.num_axes
            shape = learned_shape(self, bottom[0].shape, p.axis, num_axes, "scale_param")
            if len(bottom) == 1:
                filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant",
                                                                                    value=1.0)
                self._add_blob(shape, "scale", filler)
            if p.bias_term:
                self._add_blob(shape, "bias", p.bias_filler)
        self._saved = np.zeros(0, np.float32)
        self._onednn = None         # a ChannelNormalization, for values in a form's layout
        self._rows = None           # the channel values' passes on arrays
        self._ran_onednn = False
        self._leader = self._fusion = None      # the BatchNorm before that absorbed this layer
        self._from_leader = False   # whether the leader's last forward did this layer's

    def absorbable(self, bottom, top):
        """Whether a BatchNorm in place before this layer may absorb it: one value per channel,
        in place, on arrays."""
        return len(bottom) == 1 and top[0] is bottom[0] and self._rows is not None

    def absorb(self, follower, bottom, top, follower_bottom, follower_top):
        """Absorbed by a BatchNorm: the ReLU after this layer, which that BatchNorm may take
        on (BatchNorm.absorb_relu)."""
        if (self._leader is None or follower.type != "ReLU" or len(follower_top) != 1
                or follower_top[0] is not top[0]):
            return None
        return self._leader.absorb_relu(follower, follower_bottom, follower_top)

    def absorbed_by(self, leader, fusion):
        """Where fusion.forward, `leader` (BatchNorm) writes this layer's output and keeps
        x_norm's parts (leader.normalised()), which this layer's backward then reads for its
        input; where also fusion.backward, that backward leaves the leader its sums of dy and
        dy * (x - mean) (fusion.sums) instead of writing scale * dy."""
        self._leader, self._fusion = leader, fusion

    def _add_blob(self, shape, role, filler):
        blob = Blob(shape, name=f"{self.name}.{role}")
        fill(blob.data, filler, self.ctx.rng(self.name, len(self.blobs)))
        self.blobs.append(blob)

    def _scale(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        self._dims = broadcast_dims(self, bottom[0].shape, self.param.scale_param.axis,
                                    self._scale(bottom).shape, "the scale")
        shape = bottom[0].shape
        channels = len(bottom) == 1 and len(shape) >= 2 and self._dims[:2] == shape[:2]
        if channels and self._onednn is None and usable(bottom[0]):
            self._onednn = ChannelNormalization(0.0, True, self.param.scale_param.bias_term)
            self._vectors = [np.zeros(shape[1], np.float32), np.ones(shape[1], np.float32)]
            self._grads = [np.zeros(shape[1], np.float32) for _ in self.blobs]
        if not channels:
            self._rows = None
        elif self._rows is None or self._rows.of != shape:
            # Row buffers: 0 the scale, 1 the bias, 2 and 3 their gradients' sums.
            self._rows = Rows(shape, 4)
        if top[0] is not bottom[0]:
            top[0].reshape_like(bottom[0])
        elif not channels:
            self._keep_input(shape)

    def _keep_input(self, shape):
        """In place, backward still needs the input for the scale gradient: a buffer for it."""
        if self._saved.shape != shape:
            self._saved = np.zeros(shape, np.float32)

    def _operand(self, blob):
        return blob.data.reshape(1, self._dims[1], 1)

    def forward(self, bottom, top):
        self._from_leader = self._fusion is not None and self._fusion.forward
        if self._from_leader:
            self._ran_onednn = False
            return
        self._ran_onednn = (self._rows is not None and self._onednn is not None and
                            bottom[0].form(0) is not None)
        if self._ran_onednn:
            self._onednn.forward(bottom[0], top[0], *self._vectors,
                                 *[b.data for b in self.blobs])
            return
        if self._rows is not None:
            self._rows_forward(bottom[0], top[0])
            return
        x = bottom[0].data
        if top[0] is bottom[0]:
            np.copyto(self._saved, x)
        y = top[0].data.reshape(self._dims)
        np.multiply(x.reshape(self._dims), self._operand(self._scale(bottom)), out=y)
        if self.param.scale_param.bias_term:
            np.add(y, self._operand(self.blobs[-1]), out=y)

    def _rows_forward(self, bottom, top):
        shape = self._rows.shape
        in_place = top is bottom
        x = bottom.data.reshape(shape)
        y = x if in_place else top.overwrite(0).reshape(shape)
        if in_place:
            self._keep_input(bottom.shape)
            saved = self._saved.reshape(shape)
        scale = self._rows.per_row(0, self.blobs[0].data)
        bias = self._rows.per_row(1, self.blobs[1].data) if len(self.blobs) > 1 else None

        def work(lo, hi):
            if in_place:
                np.copyto(saved[lo:hi], x[lo:hi])
            np.multiply(x[lo:hi], scale[lo:hi], out=y[lo:hi])
            if bias is not None:
                np.add(y[lo:hi], bias[lo:hi], out=y[lo:hi])
        self._rows.run(work)

    def _rows_backward(self, top, propagate, bottom):
        shape = self._rows.shape
        dy = top.diff.reshape(shape)
        fused = self._from_leader and self._fusion.backward and propagate
        if fused and self._leader.compiled:
            totals = self._leader.gradient_sums(dy, self.blobs[0].data)
            self._fusion.sums = totals
            self._add_grads([totals[1] / self._leader.std(), totals[0]])
            return
        std = None
        if self._from_leader:       # the input was x_norm = centred / std
            x, std = self._leader.normalised()
        else:
            x = (self._saved if top is bottom else bottom.data).reshape(shape)
        dx = None
        if propagate and not fused:
            dx = dy if top is bottom else bottom.overwrite(1).reshape(shape)
        want = [self.propagates_param(k) for k in range(len(self.blobs))]
        dots, sums = want[0] or fused, (len(want) > 1 and want[1]) or fused
        scale = self._rows.per_row(0, self.blobs[0].data)

        def work(lo, hi):
            # In place dx is dy: the block's sums are taken before it is overwritten.
            if dots:
                self._rows.dots(3, dy, x, lo, hi)
            if sums:
                self._rows.sums(2, dy, lo, hi)
            if dx is not None:
                np.multiply(dy[lo:hi], scale[lo:hi], out=dx[lo:hi])
        self._rows.run(work)
        totals = [self._rows.totals(3) if dots else None, self._rows.totals(2) if sums else None]
        if fused:
            self._fusion.sums = totals[1], totals[0]
        if std is not None and dots:
            totals[0] = totals[0] / std
        self._add_grads(totals)

    def _add_grads(self, grads):
        """The gradients of the scale and the bias, where the net asks for them."""
        for k in range(len(self.blobs)):
            if self.propagates_param(k):
                self._add_grad(k, grads[k])

    def _add_grad(self, k, grad):
        diff, beta = self.blobs[k].gradient_target()
        if beta:
            diff += grad.astype(np.float32)
        else:
            diff[...] = grad

    def backward(self, top, propagate_down, bottom):
        if self._rows is not None and not self._ran_onednn:
            self._rows_backward(top[0], propagate_down[0], bottom[0])
            return
        if self._ran_onednn:
            self._onednn.backward(top[0], bottom[0], propagate_down[0], *self._vectors,
                                  self.blobs[0].data, *self._grads)
            for k, grad in enumerate(self._grads):
                if self.propagates_param(k):
                    self._add_grad(k, grad)
            return
        # Parameter gradients first: in place, the bottom diff overwrites the top diff.
        dy = top[0].diff.reshape(self._dims)
        if self.param.scale_param.bias_term and self.propagates_param(len(self.blobs) - 1):
            operand_grad(self.blobs[-1].diff, True, dy)
        x = (self._saved if top[0] is bottom[0] else bottom[0].data).reshape(self._dims)
        if len(bottom) == 1:
            if self.propagates_param(0):
                operand_grad(self.blobs[0].diff, True, dy, x)
        elif propagate_down[1]:
            operand_grad(bottom[1].diff, False, dy, x)
        if propagate_down[0]:
            np.multiply(dy, self._operand(self._scale(bottom)),
                        out=bottom[0].diff.reshape(self._dims))
