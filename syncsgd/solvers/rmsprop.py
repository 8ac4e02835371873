"""RMSProp (Tieleman and Hinton), as Caffe's RMSPropSolver."""
import numpy as np

from syncsgd.solvers.gradient import mean_of_squares, over_root
from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("RMSProp", 3)
class RMSPropSolver(Solver):
    """history = decay * history + (1 - decay) * grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, grad, histories, local_rate):
        rms_decay = np.float32(self.param.rms_decay)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)

        def update(g, spare, history):
            t = spare[0]
            mean_of_squares(history, g, rms_decay, t)
            return over_root(g, history, rate, delta, t)
        grad.apply(update, histories)
