"""Solvers: the training loop (solver.py), one update rule per module, lr policies, snapshots."""
from syncsgd.solvers.adadelta import AdaDeltaSolver
from syncsgd.solvers.adagrad import AdaGradSolver
from syncsgd.solvers.adam import AdamSolver
from syncsgd.solvers.registry import solver_class
from syncsgd.solvers.rmsprop import RMSPropSolver
from syncsgd.solvers.sgd import NesterovSolver, SGDSolver
from syncsgd.solvers.solver import Solver, load_solver_param


def get_solver(solver, sync=None):
    """The solver the file's `type` (or legacy `solver_type`) names, as pycaffe's get_solver
    (`sync` as for Solver)."""
    param, source = load_solver_param(solver)
    return solver_class(param, source)(solver, sync=sync)


__all__ = ["get_solver", "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver",
           "RMSPropSolver", "AdaDeltaSolver", "AdamSolver"]
