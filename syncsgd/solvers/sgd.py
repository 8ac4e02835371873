"""SGD with momentum and Nesterov's accelerated gradient, as Caffe's SGDSolver/NesterovSolver."""
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver

# history = momentum * history + lr * grad, the update both rules make
_MOMENTUM = "momentum * history + rate * {grad}"


@register("SGD", 0)
class SGDSolver(Solver):
    """history = momentum * history + lr * grad; step = history."""

    def compute_update(self, grad, histories, local_rate):
        history, = histories
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)
        grad.evaluate(_MOMENTUM, history, history=history, momentum=momentum, rate=rate)
        grad.step("history", history=history)


@register("Nesterov", 1)
class NesterovSolver(Solver):
    """step = (1 + momentum) * history_new - momentum * history_old, computed as
    momentum * history_new + lr * grad (momentum * history_old = history_new - lr * grad), so
    the old history need not be kept."""

    def compute_update(self, grad, histories, local_rate):
        history, = histories
        momentum = np.float32(self.param.momentum)
        rate = np.float32(local_rate)
        grad.evaluate(_MOMENTUM, history, history=history, momentum=momentum, rate=rate)
        grad.step(_MOMENTUM, history=history, momentum=momentum, rate=rate)
