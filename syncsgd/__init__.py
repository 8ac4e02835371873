"""syncsgd: Caffe-style deep learning, trained by synchronous SGD over MPI ranks.

The names here follow pycaffe, so `import syncsgd as caffe` runs pycaffe scripts: Net, TRAIN/TEST,
get_solver and the solver classes, NetSpec with `layers` and `params`, and the mode calls (there is
no GPU: set_mode_gpu and set_device only say so).
"""
TRAIN = 0
TEST = 1

from syncsgd import io  # noqa: E402,F401
from syncsgd.blob import Blob  # noqa: E402
from syncsgd.context import set_random_seed  # noqa: E402
from syncsgd.python_layers.layer import PythonLayer as Layer  # noqa: E402
from syncsgd.net import Net  # noqa: E402
from syncsgd.classifier import Classifier  # noqa: E402
from syncsgd.detector import Detector  # noqa: E402
from syncsgd.net_spec import NetSpec, params, to_proto  # noqa: E402
from syncsgd.solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver,  # noqa: E402
                             NesterovSolver, RMSPropSolver, SGDSolver, get_solver)

_GPU_NOTED = []


def set_mode_cpu():
    """Caffe's CPU mode: the only one there is."""


def set_mode_gpu():
    """Accepted so that GPU scripts run; training runs on the CPU, said once."""
    if not _GPU_NOTED:
        _GPU_NOTED.append(True)
        from syncsgd import log
        log.info("syncsgd has no GPU mode: set_mode_gpu() is ignored and everything runs on the "
                 "CPU")


def set_device(device_id):
    """Accepted for Caffe's GPU device choice; there is no device to choose."""


def init_log(*args, **kwargs):
    """pycaffe's init_log: Caffe's log lines from here on."""
    from syncsgd import log
    log.configure()


def layer_type_list():
    """Every registered layer type, as pycaffe's caffe.layer_type_list(); each name's `.fork`
    is the Caffe fork the type comes from ("" for BVLC Caffe's own)."""
    from syncsgd.layers import known_types
    return known_types()

__all__ = ["TRAIN", "TEST", "Net", "Blob", "Layer", "get_solver", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "Classifier",
           "Detector", "NetSpec", "layers",
           "params", "to_proto", "set_mode_cpu", "set_mode_gpu", "set_device", "init_log",
           "layer_type_list", "set_random_seed"]
