"""Sigmoid: y = 1 / (1 + exp(-x)).

Computed with in-place numpy ufuncs, because numpy's float32 exp is vectorised and beats
numexpr's tanh form (docs/performance.md). exp(-x) overflows to inf for x < -88, which gives
exactly the limit 0; the overflow warning is silenced.
"""
import numpy as np

from syncsgd.kernels.blas import on_pieces
from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


def sigmoid(x, out):
    """out = 1 / (1 + exp(-x)); contiguous arrays run in pieces shared out to the threads."""
    on_pieces(_sigmoid, x, out)
    return out


def _sigmoid(x, out):
    with np.errstate(over="ignore"):     # per thread
        np.negative(x, out=out)
        np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)
    return out


@register
class Sigmoid(NeuronLayer):
    type = "Sigmoid"

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self._scratch = np.zeros(0, np.float32)

    def needs_input(self):
        return False

    def compute(self, x, y):
        sigmoid(x, y)

    def gradient(self, x, y, dy, dx):
        # dx = dy * y * (1 - y); dx may be dy.
        if self._scratch.shape != y.shape:
            self._scratch = np.empty(y.shape, np.float32)

        def piece(t, y, dy, dx):
            np.subtract(1, y, out=t)
            t *= y
            np.multiply(dy, t, out=dx)
        on_pieces(piece, self._scratch, y, dy, dx)
