"""The environment switches that change how syncsgd runs, read here and nowhere else.

Each is read when the thing it governs is made, and kept there: a Net reads SYNCSGD_LANES and
SYNCSGD_FORMS as it is built, the oneDNN library SYNCSGD_ONEDNN as it loads, training its
cluster file as it plans. So a switch set in a script holds for what is built after it.

  SYNCSGD_LANES=0          no lanes: every layer shares its kernels out (lanes.py)
  SYNCSGD_FORMS=0          oneDNN layers reorder every result back to NCHW (blob.py's forms off)
  SYNCSGD_ONEDNN=0         no oneDNN: convolutions, pooling and products on numpy's BLAS
  SYNCSGD_REQUIRE_ONEDNN=1 a oneDNN that does not load is an error (CI, wherever it should)
  SYNCSGD_CLUSTER=FILE     the cluster training plans fully connected layers for (plan/modes.py)
  SYNCSGD_CHECKS=1         checks too costly for every run (held_call_check), for debugging
"""
import os

LANES = "SYNCSGD_LANES"
FORMS = "SYNCSGD_FORMS"
ONEDNN = "SYNCSGD_ONEDNN"
REQUIRE_ONEDNN = "SYNCSGD_REQUIRE_ONEDNN"
CLUSTER = "SYNCSGD_CLUSTER"
CHECKS = "SYNCSGD_CHECKS"


def _off(name):
    return os.environ.get(name, "1") == "0"


def lanes():
    return not _off(LANES)


def forms():
    return not _off(FORMS)


def onednn():
    return not _off(ONEDNN)


def require_onednn():
    return os.environ.get(REQUIRE_ONEDNN) == "1"


def checks():
    return os.environ.get(CHECKS) == "1"


def cluster():
    """The cluster file or shipped name SYNCSGD_CLUSTER gives, or None."""
    return os.environ.get(CLUSTER) or None
