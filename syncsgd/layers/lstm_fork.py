"""Lstm (senlinuc/caffe_ocr, Junhyuk Oh's LSTM): the LSTM of CRNN nets, a different layer from
BVLC's "LSTM". One bottom x (T, N, I) read as one sequence per stream, starting from zero states,
so no continuation indicators are needed; top h (T, N, num_output). The step maths are BVLC's
(LSTMUnit's unit_forward / unit_backward, gates i, f, o, g), with cont 0 at the first step and
1 after. What differs: the parameters' order, W_x (4H, I), W_h (4H, H), b (4H), as the fork's
.caffemodel stores them, and lstm_param.clipping_threshold, which bounds each step's gate-input
gradients before they reach the previous step, the parameters and x.
"""
import numpy as np

from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.kernels.blas import gemm
from syncsgd.layers.base import Layer
from syncsgd.layers.lstm_unit import unit_backward, unit_forward
from syncsgd.layers.registry import register


@register
class LstmLayer(Layer):
    type = "Lstm"
    fork = "senlinuc/caffe_ocr"
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.lstm_param
        if len(bottom) > 1:
            self.fail("the fork's optional second bottom (clip) is not supported: it indexes "
                      "the clip values as clip[t + n], which only works for one stream; use "
                      "BVLC's LSTM with a ContinuationIndicator for multi-sequence batches")
        if p.num_output == 0:
            self.fail("lstm_param.num_output must be set to a positive number")
        if bottom[0].num_axes < 3:
            self.fail(f"bottom has shape {bottom[0].shape}; it must be (time steps, streams, "
                      "inputs)")
        self._d, self._input_dim = p.num_output, bottom[0].shape[2]
        self._clip = np.float32(p.clipping_threshold)
        if not self.blobs:
            g = 4 * self._d
            for i, (shape, filler) in enumerate([((g, self._input_dim), p.weight_filler),
                                                 ((g, self._d), p.weight_filler),
                                                 ((g,), p.bias_filler)]):
                blob = Blob(shape, name=f"{self.name}.{('W_x', 'W_h', 'b')[i]}")
                fill(blob.data, filler, self.ctx.rng(self.name, i))
                self.blobs.append(blob)
        self._gates = np.zeros((0, 0, 0), np.float32)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 3 or bottom[0].count != shape[0] * shape[1] * self._input_dim:
            self.fail(f"bottom has shape {shape}; it must be (time steps, streams, "
                      f"{self._input_dim}) like at setup")
        t, n, d = shape[0], shape[1], self._d
        top[0].reshape(t, n, d)
        if self._gates.shape != (t, n, 4 * d):
            self._gates = np.zeros((t, n, 4 * d), np.float32)   # gate inputs, then their diffs
            self._acts = np.zeros((t, n, 4 * d), np.float32)
            self._c = np.zeros((t, n, d), np.float32)
            self._tanh_c = np.zeros((t, n, d), np.float32)
            self._dh = np.zeros((t, n, d), np.float32)
            self._dc = np.zeros((2, n, d), np.float32)
            self._zero = np.zeros((n, d), np.float32)          # h_0 and c_0
            self._cont = np.ones((t, n), np.float32)
            self._cont[0] = 0
        self._t, self._n = t, n

    def forward(self, bottom, top):
        w_x, w_h, b = (blob.data for blob in self.blobs)
        x = bottom[0].data.reshape(self._t * self._n, self._input_dim)
        gates = self._gates.reshape(self._t * self._n, -1)
        gates[...] = b
        gemm(x, w_x.T, gates, beta=1.0)
        h = top[0].data
        c_prev = self._zero
        for t in range(self._t):
            if t > 0:
                gemm(h[t - 1], w_h.T, self._gates[t], beta=1.0)
            unit_forward(c_prev, self._gates[t], self._cont[t], self._acts[t], self._c[t],
                         self._tanh_c[t], h[t])
            c_prev = self._c[t]

    def backward(self, top, propagate_down, bottom):
        w_x, w_h = self.blobs[0].data, self.blobs[1].data
        self._dh[...] = top[0].diff
        self._dc[0] = 0
        for t in range(self._t - 1, -1, -1):
            c_prev = self._c[t - 1] if t > 0 else self._zero
            unit_backward(c_prev, self._acts[t], self._tanh_c[t], self._dc[0], self._dh[t],
                          self._dc[1], self._gates[t])
            self._dc[0] = self._dc[1]
            if self._clip > 0:
                np.clip(self._gates[t], -self._clip, self._clip, out=self._gates[t])
            if t > 0:
                gemm(self._gates[t], w_h, self._dh[t - 1], beta=1.0)
        tn = self._t * self._n
        dgates = self._gates.reshape(tn, -1)
        if self.propagates_param(0):
            gemm(dgates.T, bottom[0].data.reshape(tn, self._input_dim), self.blobs[0].diff,
                 beta=1.0)
        if self.propagates_param(1) and self._t > 1:
            h = top[0].data
            gemm(self._gates[1:].reshape(-1, 4 * self._d).T, h[:-1].reshape(-1, self._d),
                 self.blobs[1].diff, beta=1.0)
        if self.propagates_param(2):
            self.blobs[2].diff += dgates.sum(axis=0)
        if propagate_down[0]:
            gemm(dgates, w_x, bottom[0].diff.reshape(tn, self._input_dim))
