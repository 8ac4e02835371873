"""Adam (Kingma and Ba), as Caffe's AdamSolver: history holds the first moments, then the second
moments (2N blobs); beta1 = momentum, beta2 = momentum2, epsilon = delta."""
import math

import numpy as np

from syncsgd.errors import PrototxtError
from syncsgd.solvers.gradient import mean_of_squares
from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("Adam", 5)
class AdamSolver(Solver):
    """m = beta1 * m + (1 - beta1) * grad; v = beta2 * v + (1 - beta2) * grad^2;
    step = lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)."""
    history_sets = 2

    def compute_update(self, grad, histories, local_rate):
        beta1 = np.float32(self.param.momentum)
        beta2 = np.float32(self.param.momentum2)
        eps = np.float32(self.param.delta)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise PrototxtError(f"{self.source}: Adam needs momentum (beta1) and momentum2 (beta2) "
                                f"in [0, 1), got {beta1:g} and {beta2:g}")
        t = self.iter + 1
        correction = math.sqrt(1.0 - float(beta2) ** t) / (1.0 - float(beta1) ** t)
        rate = np.float32(local_rate * correction)
        new_share = np.float32(1) - beta1

        def update(g, spare, m, v):
            s = spare[0]
            np.multiply(g, new_share, out=s)
            m *= beta1
            m += s
            mean_of_squares(v, g, beta2, s)
            np.sqrt(v, out=s)
            s += eps
            np.multiply(m, rate, out=g)
            g /= s
            return g
        grad.apply(update, histories)
