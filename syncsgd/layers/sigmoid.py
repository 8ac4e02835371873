"""Sigmoid: y = 1 / (1 + exp(-x)).

Computed with in-place numpy ufuncs, because numpy's float32 exp is vectorised and beats
numexpr's tanh form (docs/performance.md). exp(-x) overflows to inf for x < -88, which gives
exactly the limit 0; the overflow warning is silenced.
"""
import numpy as np

from syncsgd.kernels.blas import in_pieces
from syncsgd.layers.neuron import NeuronLayer
from syncsgd.layers.registry import register


def sigmoid(x, out):
    """out = 1 / (1 + exp(-x)); contiguous arrays run in pieces shared out to the threads."""
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return _sigmoid(x, out)
    x, y = x.reshape(-1), out.reshape(-1)
    in_pieces(lambda p: _sigmoid(x[p], y[p]), x.size)
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
        arrays = (self._scratch, y, dy, dx)

        def piece(t, y, dy, dx):
            np.subtract(1, y, out=t)
            t *= y
            np.multiply(dy, t, out=dx)
        if not all(a.flags.c_contiguous for a in arrays):
            piece(*arrays)
            return
        flat = [a.reshape(-1) for a in arrays]
        in_pieces(lambda p: piece(*(a[p] for a in flat)), y.size)
