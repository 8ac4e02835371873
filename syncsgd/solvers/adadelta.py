"""AdaDelta (Zeiler), as Caffe's AdaDeltaSolver: history holds squared gradients, then squared
updates (2N blobs, in that order, as Caffe stores them in a .solverstate)."""
import numpy as np

from syncsgd.solvers.gradient import mean_of_squares
from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaDelta", 4)
class AdaDeltaSolver(Solver):
    """grad_sq = momentum * grad_sq + (1 - momentum) * grad^2;
    update = grad * sqrt((update_sq + delta) / (grad_sq + delta));
    update_sq = momentum * update_sq + (1 - momentum) * update^2; step = lr * update."""
    history_sets = 2

    def compute_update(self, grad, histories, local_rate):
        momentum = np.float32(self.param.momentum)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)

        def update(g, spare, grad_sq, update_sq):
            t, u = spare
            mean_of_squares(grad_sq, g, momentum, t)
            np.add(update_sq, delta, out=t)
            np.add(grad_sq, delta, out=u)
            t /= u
            np.sqrt(t, out=t)
            g *= t                                  # the update before the learning rate
            mean_of_squares(update_sq, g, momentum, t)
            g *= rate
            return g
        grad.apply(update, histories)
