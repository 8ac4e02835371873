"""AdaDelta (Zeiler), as Caffe's AdaDeltaSolver: history holds squared gradients, then squared
updates (2N blobs, in that order, as Caffe stores them in a .solverstate)."""
import numpy as np

from syncsgd.solvers.registry import register
from syncsgd.solvers.solver import Solver


@register("AdaDelta", 4)
class AdaDeltaSolver(Solver):
    history_sets = 2

    def compute_update(self, grad, histories, local_rate):
        grad_sq, update_sq = histories
        momentum = np.float32(self.param.momentum)
        delta = np.float32(self.param.delta)
        rate = np.float32(local_rate)
        grad.evaluate("momentum * grad_sq + (1 - momentum) * {grad} * {grad}", grad_sq,
                      grad_sq=grad_sq, momentum=momentum)
        # The update before the learning rate goes into diff (as in Caffe): update_sq needs it
        # and its old value. From here on diff holds it, not the gradient.
        grad.evaluate("{grad} * sqrt((update_sq + delta) / (grad_sq + delta))", grad.diff,
                      grad_sq=grad_sq, update_sq=update_sq, delta=delta)
        grad.evaluate("momentum * update_sq + (1 - momentum) * diff * diff", update_sq,
                      update_sq=update_sq, momentum=momentum)
        grad.step("rate * diff", rate=rate)
