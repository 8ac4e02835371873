"""RMSProp (Tieleman and Hinton), as Caffe's RMSPropSolver."""
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("RMSProp", 3)
class RMSPropSolver(Solver):
    """history = decay * history + (1 - decay) * grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, grad, histories, local_rate):
        history, = histories
        rms_decay = np.float32(self.param.rms_decay)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        grad.evaluate("rms_decay * history + (1 - rms_decay) * {grad} * {grad}", history,
                      history=history, rms_decay=rms_decay)
        grad.step("rate * {grad} / (sqrt(history) + delta)", history=history, rate=rate,
                  delta=delta)
