"""Scale: multiplies bottom[0] by a learned blob, or by bottom[1], broadcast as in Bias; an optional
learned bias follows (Caffe's ScaleLayer, which ResNet uses in place after BatchNorm).

A learned scale of one value per channel (axis 1) runs on oneDNN as a normalisation with mean
0 and variance 1, one pass each way in the layout of the blob's form, its backward giving the
scale's and bias's gradients (kernels/normalization.py)."""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.kernels.normalization import ChannelNormalization, usable
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
        self._onednn = None

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
        if channels and usable(bottom[0]):
            if self._onednn is None:
                bias = self.param.scale_param.bias_term
                self._onednn = ChannelNormalization(0.0, True, bias)
                self._vectors = [np.zeros(shape[1], np.float32), np.ones(shape[1], np.float32)]
                self._grads = [np.zeros(shape[1], np.float32) for _ in self.blobs]
            if top[0] is not bottom[0]:
                top[0].reshape_like(bottom[0])
            return
        self._onednn = None
        if top[0] is bottom[0]:
            # In place, backward still needs the input for the scale gradient.
            if self._saved.shape != bottom[0].shape:
                self._saved = np.zeros(bottom[0].shape, np.float32)
        else:
            top[0].reshape_like(bottom[0])

    def _operand(self, blob):
        return blob.data.reshape(1, self._dims[1], 1)

    def forward(self, bottom, top):
        if self._onednn is not None:
            self._onednn.forward(bottom[0], top[0], *self._vectors,
                                 *[b.data for b in self.blobs])
            return
        x = bottom[0].data
        if top[0] is bottom[0]:
            np.copyto(self._saved, x)
        y = top[0].data.reshape(self._dims)
        np.multiply(x.reshape(self._dims), self._operand(self._scale(bottom)), out=y)
        if self.param.scale_param.bias_term:
            np.add(y, self._operand(self.blobs[-1]), out=y)

    def backward(self, top, propagate_down, bottom):
        if self._onednn is not None:
            self._onednn.backward(top[0], bottom[0], propagate_down[0], *self._vectors,
                                  self.blobs[0].data, *self._grads)
            for k, grad in enumerate(self._grads):
                if self.propagates_param(k):
                    diff, beta = self.blobs[k].gradient_target()
                    if beta:
                        diff += grad
                    else:
                        np.copyto(diff, grad)
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
