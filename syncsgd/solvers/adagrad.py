"""AdaGrad (Duchi et al.), as Caffe's AdaGradSolver."""
import numexpr as ne
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaGrad", 2)
class AdaGradSolver(Solver):
    """history += grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, diff, histories, local_rate):
        history, = histories
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        ne.evaluate("history + diff * diff", out=history, casting="same_kind")
        ne.evaluate("rate * diff / (sqrt(history) + delta)", out=diff, casting="same_kind")
