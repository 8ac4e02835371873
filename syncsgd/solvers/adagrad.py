"""AdaGrad (Duchi et al.), as Caffe's AdaGradSolver."""
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaGrad", 2)
class AdaGradSolver(Solver):
    """history += grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, grad, histories, local_rate):
        history, = histories
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        grad.evaluate("history + {grad} * {grad}", history, history=history)
        grad.step("rate * {grad} / (sqrt(history) + delta)", history=history, rate=rate,
                  delta=delta)
