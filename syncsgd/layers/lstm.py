"""LSTM: Caffe's long short-term memory layer (no peepholes), one LSTMUnit step per time step.

Parameters, in Caffe's order: W_xc (4D, input_dim), b_c (4D), [W_xc_static (4D, static_dim)],
W_hc (4D, D), the 4D gate rows in the order (i, f, o, g). Per step t:
    gates_t = W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t * h_{t-1})
    c_t, h_t = LSTMUnit(c_{t-1}, gates_t, cont_t)
Top h (T, N, D); with expose_hidden, bottoms h_0, c_0 and tops h_T, c_T (values only, as
Caffe: see recurrent.py).
"""
import numpy as np

from syncsgd.layers.lstm_unit import unit_backward, unit_forward
from syncsgd.layers.recurrent import RecurrentLayer
from syncsgd.layers.registry import register


@register
class LSTMLayer(RecurrentLayer):
    type = "LSTM"
    gates = 4
    states = ("h", "c")
    param_names = ("W_xc", "b_c", "W_xc_static", "W_hc")

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self._acts = np.zeros((0, 0, 0), np.float32)

    def reshape_buffers(self, t, n):
        if self._acts.shape != (t, n, 4 * self._d):
            self._acts = np.zeros((t, n, 4 * self._d), np.float32)   # i, f, o, g of each step
            self._c = np.zeros((t, n, self._d), np.float32)
            self._tanh_c = np.zeros((t, n, self._d), np.float32)
            self._dc = np.zeros((2, n, self._d), np.float32)      # dc_t, then dc_{t-1}

    def forward(self, bottom, top):
        self.start_forward(bottom)
        cont, h = bottom[1].data, top[0].data
        h_prev, c_prev = self._init
        for t in range(self._t):
            self.add_recurrent(t, cont, h_prev)
            unit_forward(c_prev, self._gate_buf[t], cont[t], self._acts[t], self._c[t],
                         self._tanh_c[t], h[t])
            h_prev, c_prev = h[t], self._c[t]
        self.finish_forward(top, (h_prev, c_prev))

    def backward(self, top, propagate_down, bottom):
        cont = bottom[1].data
        self._dh[...] = top[0].diff
        self._dc[0] = 0         # no gradient from c_T: none comes from the next batch (Caffe)
        for t in range(self._t - 1, -1, -1):
            c_prev = self._c[t - 1] if t > 0 else self._init[1]
            # The gate diffs overwrite step t's gate inputs, which backward no longer needs.
            unit_backward(c_prev, self._acts[t], self._tanh_c[t], self._dc[0], self._dh[t],
                          self._dc[1], self._gate_buf[t])
            self._dc[0] = self._dc[1]
            self.recurrent_backward(t, cont)
        self.finish_backward(propagate_down, bottom)
