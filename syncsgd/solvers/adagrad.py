"""AdaGrad (Duchi et al.), as Caffe's AdaGradSolver."""
import numpy as np

from syncsgd.solvers.gradient import over_root
from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaGrad", 2)
class AdaGradSolver(Solver):
    """history += grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, grad, histories, local_rate):
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)

        def update(g, spare, history):
            t = spare[0]
            np.multiply(g, g, out=t)
            history += t
            return over_root(g, history, rate, delta, t)
        grad.apply(update, histories)
