"""Caffe's learning-rate policies (SGDSolver::GetLearningRate)."""
import math

from syncsgd import log
from syncsgd.errors import PrototxtError


def learning_rate(param, iteration, state):
    """The rate at `iteration`. `state` holds `current_step`, which multistep advances."""
    try:
        rate = _rate(param, iteration, state)
    except (OverflowError, ZeroDivisionError):
        rate = math.inf
    if isinstance(rate, complex) or not math.isfinite(rate):
        raise PrototxtError(
            f"lr_policy '{param.lr_policy}' gives no finite learning rate at iteration "
            f"{iteration} from base_lr {param.base_lr:g}, gamma {param.gamma:g}, power "
            f"{param.power:g}, stepsize {param.stepsize}, max_iter {param.max_iter}; fix these "
            "values in the solver")
    return rate


def _rate(param, iteration, state):
    policy = param.lr_policy
    base, gamma = param.base_lr, param.gamma
    if policy == "fixed":
        rate = base
    elif policy == "step":
        if param.stepsize <= 0:
            raise PrototxtError("lr_policy 'step' needs stepsize > 0 in the solver")
        state.current_step = iteration // param.stepsize
        rate = base * gamma ** state.current_step
    elif policy == "exp":
        rate = base * gamma ** iteration
    elif policy == "inv":
        rate = base * (1.0 + gamma * iteration) ** (-param.power)
    elif policy == "multistep":
        if state.current_step < len(param.stepvalue) and \
                iteration >= param.stepvalue[state.current_step]:
            state.current_step += 1
            log.info(f"MultiStep Status: Iteration {iteration}, step = {state.current_step}")
        rate = base * gamma ** state.current_step
    elif policy == "poly":
        rate = base * (1.0 - iteration / param.max_iter) ** param.power
    elif policy == "sigmoid":
        rate = base * (1.0 / (1.0 + math.exp(-gamma * (iteration - param.stepsize))))
    else:
        raise PrototxtError(f"unknown lr_policy '{policy}'; use one of fixed, step, exp, inv, "
                            "multistep, poly, sigmoid")
    return rate
