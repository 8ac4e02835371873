"""SGD with momentum and Nesterov's accelerated gradient, as Caffe's SGDSolver/NesterovSolver."""
import numexpr as ne
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("SGD", 0)
class SGDSolver(Solver):
    """history = momentum * history + lr * grad; step = history."""

    def compute_update(self, diff, histories, local_rate):
        history, = histories
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)
        ne.evaluate("momentum * history + rate * diff", out=history, casting="same_kind")
        diff[...] = history


@register("Nesterov", 1)
class NesterovSolver(Solver):
    """step = (1 + momentum) * history_new - momentum * history_old."""

    def compute_update(self, diff, histories, local_rate):
        history, = histories
        previous = history.copy()
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)
        ne.evaluate("momentum * history + rate * diff", out=history, casting="same_kind")
        ne.evaluate("(1 + momentum) * history - momentum * previous", out=diff,
                    casting="same_kind")
