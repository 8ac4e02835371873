"""LSTMUnit: one LSTM step without peepholes, as Caffe's lstm_unit_layer.cpp; the LSTM layer runs
the same `unit_forward` / `unit_backward` once per time step.

Bottoms c_prev (1, N, D), x (1, N, 4D) with the gate inputs in Caffe's order (i, f, o, g),
cont (1, N); tops c and h (1, N, D):
    i = sigmoid(x_i)  f = cont * sigmoid(x_f)  o = sigmoid(x_o)  g = tanh(x_g)
    c = f * c_prev + i * g    h = o * tanh(c)
The forget gate's derivative is Caffe's f * (1 - f) with f already scaled by cont: exact for the
0/1 indicators Caffe's recurrent layers are meant for.
"""
import numexpr as ne
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.layers.sigmoid import sigmoid


def unit_forward(c_prev, x, cont, acts, c, tanh_c, h):
    """One step for N streams: c_prev (N, D), x (N, 4D), cont (N,). Writes the gate activations
    (N, 4D) into `acts`, and c, tanh(c), h (N, D)."""
    d = c_prev.shape[1]
    sigmoid(x[:, :3 * d], acts[:, :3 * d])
    np.tanh(x[:, 3 * d:], out=acts[:, 3 * d:])
    acts[:, d:2 * d] *= cont[:, None]
    i, f, o, g = (acts[:, k * d:(k + 1) * d] for k in range(4))
    ne.evaluate("f * c_prev + i * g", out=c)
    np.tanh(c, out=tanh_c)
    np.multiply(o, tanh_c, out=h)


def unit_backward(c_prev, acts, tanh_c, dc, dh, dc_prev, dx):
    """Gradients of one step from the top diffs dc, dh (N, D): into dc_prev (N, D) and the gate
    inputs dx (N, 4D); either may be None when not wanted."""
    d = c_prev.shape[1]
    i, f, o, g = (acts[:, k * d:(k + 1) * d] for k in range(4))
    dct = ne.evaluate("dc + dh * o * (1 - tanh_c * tanh_c)")
    if dc_prev is not None:
        np.multiply(dct, f, out=dc_prev)
    if dx is not None:
        ne.evaluate("dct * g * i * (1 - i)", out=dx[:, :d])
        ne.evaluate("dct * c_prev * f * (1 - f)", out=dx[:, d:2 * d])
        ne.evaluate("dh * tanh_c * o * (1 - o)", out=dx[:, 2 * d:3 * d])
        ne.evaluate("dct * i * (1 - g * g)", out=dx[:, 3 * d:])


@register
class LSTMUnitLayer(Layer):
    type = "LSTMUnit"
    exact_bottoms = 3
    exact_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self._acts = np.zeros((0, 0), np.float32)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2      # never into the sequence continuation indicators

    def reshape(self, bottom, top):
        c_prev, x, cont = (b.shape for b in bottom)
        if len(c_prev) != 3 or c_prev[0] != 1:
            self.fail(f"bottom c_prev has shape {c_prev}; it must be (1, streams, D)")
        n, d = c_prev[1:]
        if x != (1, n, 4 * d):
            self.fail(f"bottom x has shape {x}; it must be (1, streams, 4 * D) = {(1, n, 4 * d)} "
                      f"for c_prev {c_prev}")
        if cont != (1, n):
            self.fail(f"bottom cont has shape {cont}; it must be (1, streams) = {(1, n)}")
        top[0].reshape(1, n, d)
        top[1].reshape(1, n, d)
        if self._acts.shape != (n, 4 * d):
            self._acts = np.zeros((n, 4 * d), np.float32)
            self._tanh_c = np.zeros((n, d), np.float32)

    def forward(self, bottom, top):
        unit_forward(bottom[0].data[0], bottom[1].data[0], bottom[2].data[0], self._acts,
                     top[0].data[0], self._tanh_c, top[1].data[0])

    def backward(self, top, propagate_down, bottom):
        if not (propagate_down[0] or propagate_down[1]):
            return
        unit_backward(bottom[0].data[0], self._acts, self._tanh_c, top[0].diff[0],
                      top[1].diff[0], bottom[0].diff[0] if propagate_down[0] else None,
                      bottom[1].diff[0] if propagate_down[1] else None)
