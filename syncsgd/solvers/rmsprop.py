"""RMSProp (Tieleman and Hinton), as Caffe's RMSPropSolver."""
import numexpr as ne
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("RMSProp", 3)
class RMSPropSolver(Solver):
    """history = decay * history + (1 - decay) * grad^2; step = lr * grad / (sqrt(history) + delta)."""

    def compute_update(self, diff, histories, local_rate):
        history, = histories
        decay = np.float32(self.param.rms_decay)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        ne.evaluate("decay * history + (1 - decay) * diff * diff", out=history,
                    casting="same_kind")
        ne.evaluate("rate * diff / (sqrt(history) + delta)", out=diff, casting="same_kind")
