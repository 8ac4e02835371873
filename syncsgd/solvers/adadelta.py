"""AdaDelta (Zeiler), as Caffe's AdaDeltaSolver: history holds squared gradients, then squared
updates (2N blobs, in that order, as Caffe stores them in a .solverstate)."""
import numexpr as ne
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaDelta", 4)
class AdaDeltaSolver(Solver):
    history_sets = 2

    def compute_update(self, diff, histories, local_rate):
        grad_sq, update_sq = histories
        momentum = np.float32(self.param.momentum)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        ne.evaluate("momentum * grad_sq + (1 - momentum) * diff * diff", out=grad_sq,
                    casting="same_kind")
        ne.evaluate("diff * sqrt((update_sq + delta) / (grad_sq + delta))", out=diff,
                    casting="same_kind")
        ne.evaluate("momentum * update_sq + (1 - momentum) * diff * diff", out=update_sq,
                    casting="same_kind")
        diff *= rate
