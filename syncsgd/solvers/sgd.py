"""SGD with momentum and Nesterov's accelerated gradient, as Caffe's SGDSolver/NesterovSolver.
Each rule is a function of one block of the parameter (see gradient.py)."""
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


def _momentum(g, history, momentum, rate):
    """history = momentum * history + rate * g, the update both rules make; g becomes rate * g."""
    g *= rate
    history *= momentum
    history += g


@register("SGD", 0)
class SGDSolver(Solver):
    """history = momentum * history + lr * grad; step = history."""

    def compute_update(self, grad, histories, local_rate):
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)
        if grad.momentum_step(histories[0], momentum, rate):
            return

        def update(g, spare, history):
            _momentum(g, history, momentum, rate)
            return history
        grad.apply(update, histories)


@register("Nesterov", 1)
class NesterovSolver(Solver):
    """step = (1 + momentum) * history_new - momentum * history_old, computed as
    momentum * history_new + lr * grad (momentum * history_old = history_new - lr * grad), so
    the old history need not be kept."""

    def compute_update(self, grad, histories, local_rate):
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)

        def update(g, spare, history):
            _momentum(g, history, momentum, rate)
            t = spare[0]
            np.multiply(history, momentum, out=t)
            g += t
            return g
        grad.apply(update, histories)
