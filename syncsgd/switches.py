"""The environment switches that change how syncsgd runs, read here and nowhere else.

Each is read when the thing it governs is made, and kept there: a Net reads SYNCSGD_LANES,
SYNCSGD_FORMS and SYNCSGD_FUSE as it is built, the oneDNN library SYNCSGD_ONEDNN as it loads,
Numba SYNCSGD_NUMBA as the first compiled kernel is made, training its
cluster file as it plans. So a switch set in a script holds for what is built after it.

  SYNCSGD_LANES=0          no lanes: every layer shares its kernels out (lanes.py)
  SYNCSGD_FORMS=0          oneDNN layers reorder every result back to NCHW (blob.py's forms off)
  SYNCSGD_FUSE=0           no layer does the next one's work (Layer.absorb; Net._fuse)
  SYNCSGD_ONEDNN=0         no oneDNN: convolutions, pooling and products on numpy's BLAS
  SYNCSGD_NUMBA=0          no compiled kernels (kernels/compiled.py): numpy passes instead
  SYNCSGD_REQUIRE_ONEDNN=1 a oneDNN that does not load is an error (CI, wherever it should)
  SYNCSGD_CLUSTER=FILE     the cluster training plans fully connected layers for (plan/modes.py)
  SYNCSGD_CHECKS=1         checks too costly for every run (held_call_check), for debugging
  SYNCSGD_KERNELS=rules    kernels by the fixed rules (plans.py), not timed (tuning.py)
  SYNCSGD_KERNEL_CACHE=DIR where timed kernel choices are kept (default ~/.cache/syncsgd/kernels)
"""
import os

LANES = "SYNCSGD_LANES"
FORMS = "SYNCSGD_FORMS"
FUSE = "SYNCSGD_FUSE"
ONEDNN = "SYNCSGD_ONEDNN"
NUMBA = "SYNCSGD_NUMBA"
REQUIRE_ONEDNN = "SYNCSGD_REQUIRE_ONEDNN"
CLUSTER = "SYNCSGD_CLUSTER"
CHECKS = "SYNCSGD_CHECKS"
KERNELS = "SYNCSGD_KERNELS"
KERNEL_CACHE = "SYNCSGD_KERNEL_CACHE"


def _off(name):
    return os.environ.get(name, "1") == "0"


def lanes():
    return not _off(LANES)


def forms():
    return not _off(FORMS)


def fuse():
    return not _off(FUSE)


def onednn():
    return not _off(ONEDNN)


def numba():
    return not _off(NUMBA)


def require_onednn():
    return os.environ.get(REQUIRE_ONEDNN) == "1"


def checks():
    return os.environ.get(CHECKS) == "1"


def cluster():
    """The cluster file or shipped name SYNCSGD_CLUSTER gives, or None."""
    return os.environ.get(CLUSTER) or None


def timed_kernels():
    """Whether kernels are chosen by timing them (the default) rather than by the fixed rules."""
    return os.environ.get(KERNELS, "timed") != "rules"


def kernel_cache():
    """The folder of the timed kernel choices."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                           "syncsgd", "kernels")
    return os.environ.get(KERNEL_CACHE) or default
