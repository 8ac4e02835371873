"""InnerProduct (fully connected): the axes from `axis` on are flattened into K inputs, the axes
before it into M independent rows; top is (rows..., num_output)."""
import math

import numpy as np

from syncsgd.blob import Blob
from syncsgd.errors import ShapeError
from syncsgd.fillers import fill
from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.kernels.blas import gemm
from syncsgd.layers.registry import register


@register
class InnerProductLayer(Layer):
    type = "InnerProduct"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.inner_product_param
        if p.num_output == 0:
            self.fail("inner_product_param.num_output must be set to a positive number")
        self._bias_term = p.bias_term
        _, self._k, self._axis = self._split(bottom[0])
        self._first, self._n = self.output_range(p.num_output)
        rows = slice(self._first, self._first + self._n)
        if not self.blobs:
            # Filled whole, then sliced: a layer holding some outputs starts from the same
            # weights as one holding all of them.
            shape = (self._k, p.num_output) if p.transpose else (p.num_output, self._k)
            try:
                # A Blob refuses a size beyond Caffe's limit or the machine before allocating.
                weight = Blob(shape, name=f"{self.name}.weight").data
            except ShapeError as e:
                self.fail(f"inner_product_param.num_output {p.num_output} with {self._k} inputs "
                          f"makes a weight too large: {e}")
            fill(weight, p.weight_filler, self.ctx.rng(self.name, 0))
            part = weight[:, rows] if p.transpose else weight[rows]
            self.blobs.append(Blob(part.shape, name=f"{self.name}.weight"))
            self.blobs[0].data[...] = part
            if p.bias_term:
                bias = np.zeros(p.num_output, np.float32)
                fill(bias, p.bias_filler, self.ctx.rng(self.name, 1))
                self.blobs.append(Blob((self._n,), name=f"{self.name}.bias"))
                self.blobs[1].data[...] = bias[rows]
        self._ones = np.ones((1, 0), np.float32)

    @property
    def sample_wise(self):
        """Per sample unless `axis` 0 flattens the whole batch into one row."""
        return self._axis >= 1

    def output_range(self, num_output):
        """(first, count) of the output neurons this layer computes: all of them."""
        return 0, num_output

    def _split(self, blob):
        """(M, K, axis) of a bottom: rows before `axis`, features from it on."""
        axis = canonical_axis(self.param.inner_product_param.axis, blob.num_axes, self)
        shape = blob.shape
        return math.prod(shape[:axis]), math.prod(shape[axis:]), axis

    def reshape(self, bottom, top):
        m, k, axis = self._split(bottom[0])
        if k != self._k:
            self.fail(f"bottom shape {bottom[0].shape} gives {k} inputs from axis {axis}, but "
                      f"the weights take {self._k}; fix the bottom shape or "
                      f"inner_product_param.axis")
        self._m, self._axis = m, axis
        top[0].reshape(bottom[0].shape[:axis] + (self._n,))

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._m, self._k)
        y = top[0].data.reshape(self._m, self._n)
        if self._bias_term:
            y[...] = self.blobs[1].data     # the GEMM adds the product to the bias (beta = 1)
        gemm(x, self._weight_kn(), y, beta=1.0 if self._bias_term else 0.0)

    def _weight_kn(self):
        """The weights as a (K, N) view, whichever order they are stored in."""
        w = self.blobs[0].data
        return w if self.param.inner_product_param.transpose else w.T

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self._m, self._n)
        x = bottom[0].data.reshape(self._m, self._k)
        # The gradients accumulate inside the GEMMs (beta = 1), as in Caffe, or overwrite a
        # cleared diff (beta = 0).
        if self.propagates_param(0):
            diff, beta = self.blobs[0].gradient_target()
            if self.param.inner_product_param.transpose:
                gemm(x.T, dy, diff, beta=beta)
            else:
                gemm(dy.T, x, diff, beta=beta)
        if self._bias_term and self.propagates_param(1):
            if self._ones.shape[1] != self._m:
                self._ones = np.ones((1, self._m), np.float32)
            diff, beta = self.blobs[1].gradient_target()
            gemm(self._ones, dy, diff.reshape(1, self._n), beta=beta)
        if propagate_down[0]:
            gemm(dy, self._weight_kn().T, bottom[0].diff.reshape(self._m, self._k))
