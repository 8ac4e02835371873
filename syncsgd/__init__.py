"""syncsgd: Caffe-style deep learning, trained by synchronous SGD over MPI ranks.

The names here follow pycaffe: Net, TRAIN/TEST, get_solver and the solver classes.
"""
TRAIN = 0
TEST = 1

from syncsgd.blob import Blob  # noqa: E402
from syncsgd.layers.python_layer import PythonLayer as Layer  # noqa: E402
from syncsgd.net import Net  # noqa: E402
from syncsgd.solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver,  # noqa: E402
                             NesterovSolver, RMSPropSolver, SGDSolver, get_solver)

__all__ = ["TRAIN", "TEST", "Net", "Blob", "Layer", "get_solver", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver"]
