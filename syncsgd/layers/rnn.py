"""RNN: Caffe's simple recurrent layer with a tanh hidden state and a tanh output layer.

Parameters, in Caffe's order: W_xh (D, input_dim), b_h (D), [W_xh_static (D, static_dim)],
W_hh (D, D), W_ho (D, D), b_o (D). Per step t:
    h_t = tanh(W_xh x_t + b_h [+ W_xh_static x_static] + W_hh (cont_t * h_{t-1}))
    o_t = tanh(W_ho h_t + b_o)
Top o (T, N, D); with expose_hidden, bottom h_0 and top h_T (values only, as Caffe: see
recurrent.py).
"""
import numexpr as ne
import numpy as np

from syncsgd.kernels.blas import gemm
from syncsgd.layers.recurrent import RecurrentLayer
from syncsgd.layers.registry import register


@register
class RNNLayer(RecurrentLayer):
    type = "RNN"
    param_names = ("W_xh", "b_h", "W_xh_static", "W_hh", "W_ho", "b_o")

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self._h = np.zeros((0, 0, 0), np.float32)

    def output_param_shapes(self):
        p = self.param.recurrent_param
        return [((self._d, self._d), p.weight_filler), ((self._d,), p.bias_filler)]

    def reshape_buffers(self, t, n):
        if self._h.shape != (t, n, self._d):
            self._h = np.zeros((t, n, self._d), np.float32)     # h_t of each step
            self._dz = np.zeros((t, n, self._d), np.float32)    # gradient of W_ho h_t + b_o

    def forward(self, bottom, top):
        self.start_forward(bottom)
        cont = bottom[1].data
        h_prev = self._init[0]
        for t in range(self._t):
            self.add_recurrent(t, cont, h_prev)
            np.tanh(self._gate_buf[t], out=self._h[t])
            h_prev = self._h[t]
        w_ho, b_o = self.blobs[-2].data, self.blobs[-1].data
        o = top[0].data.reshape(-1, self._d)
        o[...] = b_o
        gemm(self._h.reshape(-1, self._d), w_ho.T, o, beta=1.0)
        np.tanh(o, out=o)
        self.finish_forward(top, (h_prev,))

    def backward(self, top, propagate_down, bottom):
        cont = bottom[1].data
        d = self._d
        dz = self._dz.reshape(-1, d)
        ne.evaluate("do * (1 - o * o)", local_dict={"o": top[0].data, "do": top[0].diff},
                    out=self._dz)
        w_ho, b_o = self.blobs[-2], self.blobs[-1]
        gemm(dz.T, self._h.reshape(-1, d), w_ho.diff, beta=1.0)
        b_o.diff += dz.sum(axis=0)
        gemm(dz, w_ho.data, self._dh.reshape(-1, d))
        for t in range(self._t - 1, -1, -1):
            # The gate diffs overwrite step t's gate inputs, which backward no longer needs.
            ne.evaluate("dh * (1 - h * h)", local_dict={"dh": self._dh[t], "h": self._h[t]},
                        out=self._gate_buf[t])
            self.recurrent_backward(t, cont)
        self.finish_backward(propagate_down, bottom)
