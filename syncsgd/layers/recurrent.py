"""The base of Caffe's recurrent layers (RNN, LSTM): recurrent_param, the bottoms and tops, the
input and recurrent weights they share, and the hidden state carried between batches.

Caffe builds an unrolled net of InnerProduct, Scale, Eltwise and LSTMUnit layers; here the same
equations run as one loop over the time steps, each step a GEMM over all N streams, and the input
projections of all time steps are one GEMM. The parameter blobs keep the unrolled net's order and
shapes, so weights trained in Caffe load:
    W_x (G, input_dim), b (G), [W_x_static (G, static_dim)], W_h (G, num_output), ...
with G = num_output (RNN) or 4 * num_output (LSTM's gates i, f, o, g).

Bottoms: x (T, N, ...), cont (T, N), [x_static (N, ...)], and with expose_hidden the initial
states (1, N, num_output) each; tops: the output (T, N, num_output) and with expose_hidden the
final states. cont_t multiplies the previous hidden state before the recurrent product, so 0 starts
a new sequence. Without expose_hidden the final states of one forward are the initial states of the
next (zero before the first), and no gradient crosses batches.

With expose_hidden the exposed states carry values only, as in Caffe, whose unrolled net shares
just their data with the bottoms and tops: the final states' top diffs are ignored and the initial
states get zero diffs. That is not the exact gradient where those diffs are not zero (a net that
chains two recurrent layers through the states), but it is what Caffe trains with, and syncsgd
follows Caffe so that training gives Caffe's results.
"""
import numpy as np

from syncsgd import log
from syncsgd.blob import Blob
from syncsgd.fillers import fill
from syncsgd.kernels.blas import gemm
from syncsgd.layers.base import Layer


class RecurrentLayer(Layer):
    gates = 1               # rows of the input and recurrent weights per output unit
    states = ("h",)         # the recurrent state blobs, in Caffe's bottom and top order
    # Caffe's parameter names in its order; the static weights exist only with x_static.
    param_names = ("W_x", "b", "W_x_static", "W_h")

    def setup(self, bottom, top):
        p = self.param.recurrent_param
        exposed = len(self.states) if p.expose_hidden else 0
        self.min_bottoms, self.max_bottoms = 2 + exposed, 3 + exposed
        self.exact_tops = 1 + exposed
        self.check_counts(bottom, top)
        if p.num_output == 0:
            self.fail("recurrent_param.num_output must be set to a positive number")
        self._d = p.num_output
        self._expose = p.expose_hidden
        self._static = len(bottom) > 2 + exposed
        self._check_sequence(bottom)
        self._input_dim = _features(bottom[0].shape, 2)
        self._static_dim = _features(bottom[2].shape, 1) if self._static else 0
        self._wh = 3 if self._static else 2       # index of the recurrent weights W_h
        self._first_state = 3 if self._static else 2     # bottom index of the exposed h_0
        if not self.blobs:
            g = self.gates * self._d
            shapes = [((g, self._input_dim), p.weight_filler), ((g,), p.bias_filler)]
            if self._static:
                shapes.append(((g, self._static_dim), p.weight_filler))
            shapes.append(((g, self._d), p.weight_filler))
            shapes += self.output_param_shapes()
            names = [n for n in self.param_names if self._static or not n.endswith("_static")]
            for i, ((shape, filler), name) in enumerate(zip(shapes, names)):
                blob = Blob(shape, name=f"{self.name}.{name}")
                fill(blob.data, filler, self.ctx.rng(self.name, i))
                self.blobs.append(blob)
        self._carry = np.zeros((len(self.states), 0, self._d), np.float32)
        self._gate_buf = np.zeros((0, 0, 0), np.float32)

    def output_param_shapes(self):
        """(shape, filler) of the parameters after W_h, for a subclass with an output layer."""
        return []

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1      # never into the sequence continuation indicators

    def _check_sequence(self, bottom):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2:
            self.fail(f"bottom x has shape {x.shape}; it needs at least 2 axes "
                      "(time steps, streams, ...)")
        t, n = x.shape[:2]
        if cont.shape != (t, n):
            self.fail(f"bottom cont has shape {cont.shape}; it must be (time steps, streams) = "
                      f"{(t, n)} like the first two axes of x {x.shape}")
        if self._static and (bottom[2].num_axes < 1 or bottom[2].shape[0] != n):
            self.fail(f"bottom x_static has shape {bottom[2].shape}; its first axis must be "
                      f"the {n} streams of x")

    def reshape(self, bottom, top):
        self._check_sequence(bottom)
        t, n = bottom[0].shape[:2]
        d, g, s = self._d, self.gates * self._d, len(self.states)
        if _features(bottom[0].shape, 2) != self._input_dim:
            self.fail(f"bottom x has shape {bottom[0].shape}, {_features(bottom[0].shape, 2)} "
                      f"inputs per stream, but {self.param_names[0]} takes {self._input_dim}")
        if self._static and _features(bottom[2].shape, 1) != self._static_dim:
            self.fail(f"bottom x_static has shape {bottom[2].shape}, but the static weights "
                      f"take {self._static_dim} inputs per stream")
        if self._expose:
            for k, name in enumerate(self.states):
                shape = bottom[self._first_state + k].shape
                if shape != (1, n, d):
                    self.fail(f"bottom {name}_0 has shape {shape}; it must be "
                              f"(1, streams, num_output) = {(1, n, d)}")
        self._t, self._n = t, n
        top[0].reshape(t, n, d)
        for k in range(s if self._expose else 0):
            top[1 + k].reshape(1, n, d)
        if self._carry.shape[1] != n:
            self._carry = np.zeros((s, n, d), np.float32)
        if self._gate_buf.shape != (t, n, g):
            self._gate_buf = np.zeros((t, n, g), np.float32)    # gate inputs, then their diffs
            self._hc = np.zeros((t, n, d), np.float32)          # cont_t * h_{t-1}
            self._dh = np.zeros((t, n, d), np.float32)          # gradient reaching h_t
            self._static_g = np.zeros((n, g), np.float32)      # W_x_static x_static, its diff
            self._init = np.zeros((s, n, d), np.float32)
            self._step = np.zeros((n, d), np.float32)
        self.reshape_buffers(t, n)

    def reshape_buffers(self, t, n):
        """Size a subclass's own per-step buffers."""

    # -- forward helpers ------------------------------------------------------------------------
    def start_forward(self, bottom):
        """The gate inputs of all steps from x (and x_static), and the initial states."""
        t, n, g = self._gate_buf.shape
        gates = self._gate_buf.reshape(t * n, g)
        gates[...] = self.blobs[1].data
        gemm(bottom[0].data.reshape(t * n, self._input_dim), self.blobs[0].data.T, gates,
             beta=1.0)
        if self._static:
            gemm(bottom[2].data.reshape(n, self._static_dim), self.blobs[2].data.T,
                 self._static_g)
            self._gate_buf += self._static_g
        if self._expose:
            for k in range(len(self.states)):
                self._init[k] = bottom[self._first_state + k].data[0]
        else:
            self._init[...] = self._carry

    def add_recurrent(self, t, cont, h_prev):
        """gates_t += W_h (cont_t * h_{t-1})."""
        np.multiply(h_prev, cont[t][:, None], out=self._hc[t])
        gemm(self._hc[t], self.blobs[self._wh].data.T, self._gate_buf[t], beta=1.0)

    def finish_forward(self, top, finals):
        """Hand the final states to the exposed tops, or keep them for the next batch."""
        for k, state in enumerate(finals):
            if self._expose:
                top[1 + k].data[0] = state
            else:
                self._carry[k] = state
        if self.param.recurrent_param.debug_info:
            self._log_steps("Forward", "gate input")

    # -- backward helpers -----------------------------------------------------------------------
    def recurrent_backward(self, t, cont):
        """From the gate diffs of step t > 0, add cont_t * W_h^T dgates_t to the gradient reaching
        h_{t-1}. Nothing reaches the initial state (step 0), as in Caffe."""
        if t == 0:
            return
        gemm(self._gate_buf[t], self.blobs[self._wh].data, self._step)
        self._step *= cont[t][:, None]
        self._dh[t - 1] += self._step

    def finish_backward(self, propagate_down, bottom):
        """Parameter gradients (accumulated, as Caffe) and input diffs from the gate diffs of all
        steps, now in the gate buffer; zero diffs for the exposed initial states."""
        t, n, g = self._gate_buf.shape
        dgates = self._gate_buf.reshape(t * n, g)
        x = bottom[0].data.reshape(t * n, self._input_dim)
        gemm(dgates.T, x, self.blobs[0].diff, beta=1.0)
        self.blobs[1].diff += dgates.sum(axis=0)
        gemm(dgates.T, self._hc.reshape(t * n, self._d), self.blobs[self._wh].diff, beta=1.0)
        if propagate_down[0]:
            gemm(dgates, self.blobs[0].data, bottom[0].diff.reshape(t * n, self._input_dim))
        if self._static:
            np.sum(self._gate_buf, axis=0, out=self._static_g)
            xs = bottom[2].data.reshape(n, self._static_dim)
            gemm(self._static_g.T, xs, self.blobs[2].diff, beta=1.0)
            if propagate_down[2]:
                gemm(self._static_g, self.blobs[2].data,
                     bottom[2].diff.reshape(n, self._static_dim))
        if self._expose:
            for k in range(len(self.states)):
                if propagate_down[self._first_state + k]:
                    bottom[self._first_state + k].diff[...] = 0
        if self.param.recurrent_param.debug_info:
            self._log_steps("Backward", "gate input diff")

    def _log_steps(self, direction, what):
        for t in range(self._t):
            log.info(f"    [{direction}] Layer {self.name}, timestep {t + 1}, {what}: "
                     f"{log.fmt(float(np.abs(self._gate_buf[t]).mean()))}")


def _features(shape, axis):
    """Inputs per stream: the product of the axes from `axis` on."""
    return int(np.prod(shape[axis:], dtype=np.int64))
