"""Adam (Kingma and Ba), as Caffe's AdamSolver: history holds the first moments, then the second
moments (2N blobs); beta1 = momentum, beta2 = momentum2, epsilon = delta."""
import math

import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("Adam", 5)
class AdamSolver(Solver):
    history_sets = 2

    def compute_update(self, grad, histories, local_rate):
        m, v = histories
        beta1 = np.float32(self.param.momentum)
        beta2 = np.float32(self.param.momentum2)
        eps = np.float32(self.param.delta)
        t = self.iter + 1
        correction = math.sqrt(1.0 - float(beta2) ** t) / (1.0 - float(beta1) ** t)
        rate = np.float32(local_rate * correction)
        grad.evaluate("beta1 * m + (1 - beta1) * {grad}", m, m=m, beta1=beta1)
        grad.evaluate("beta2 * v + (1 - beta2) * {grad} * {grad}", v, v=v, beta2=beta2)
        grad.step("rate * m / (sqrt(v) + eps)", m=m, v=v, rate=rate, eps=eps)
