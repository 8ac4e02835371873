"""Kernels compiled to machine code by Numba, for passes that numpy can only write as several
whole-array ufunc calls: one loop per output, its operands read while they are in the cache.

`kernel` is Numba's njit with the options every such kernel takes: nogil (the layers call them
from their own threads, on parts of the batch), error_model "numpy" (a division by zero gives
inf as numpy's does; without the check the loops vectorise: docs/performance.md, "LRN:
compiled"), and cache (compiled code kept on disk, keyed by the CPU, so a process compiles a
kernel once per machine). Numba compiles without fast-math: no contraction into FMAs and no
reordering, so a kernel's float32 results are numpy's to the bit where it makes the same
operations in the same order.

A kernel may call the kernels of its own module: Numba compiles them into it. (Numba's cache
does not see a change to a kernel in another file, so the callee stays in the caller's.)

Where Numba does not import, or SYNCSGD_NUMBA=0 when a layer is set up, available() is False
and the layer runs its numpy passes. The compiled code goes where NUMBA_CACHE_DIR says, else
next to this package, or where that is not writable into ~/.cache/syncsgd/numba.
"""
import functools
import os
import sys
import threading
import types

from syncsgd import switches

_LOCK = threading.RLock()     # a kernel's compilation compiles the kernels it calls


def _cache_dir():
    """NUMBA_CACHE_DIR for a package folder that is not writable (a system install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if "NUMBA_CACHE_DIR" not in os.environ and not os.access(here, os.W_OK):
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "syncsgd",
            "numba")


@functools.cache
def _numba():
    """The numba module, or None where it does not import (imported on first need: it takes
    a fifth of a second)."""
    _cache_dir()
    # Numba's array functions ask SciPy for a BLAS as they load, which loads SciPy's own
    # OpenBLAS: a second thread pool, outside the thread budget, that no kernel here calls.
    # They load with scipy.linalg hidden, and find none.
    hidden = "scipy.linalg" not in sys.modules
    if hidden:
        sys.modules["scipy.linalg"] = None
    try:
        import numba
        import numba.np.arraymath  # noqa: F401
    except ImportError:
        return None
    finally:
        if hidden:
            del sys.modules["scipy.linalg"]
    return numba


def available():
    """Whether compiled kernels run here: Numba imports and SYNCSGD_NUMBA is not 0 (read at
    each call, so that a layer set up after the switch changed follows it)."""
    return switches.numba() and _numba() is not None


def version():
    """Numba's version where compiled kernels run here, else None (tuning.machine: kernels
    with compiled parts run at other speeds)."""
    return _numba().__version__ if available() else None


def kernel(function):
    """`function` compiled by Numba on its first call. Callers check available() first."""
    compiled = None

    def dispatcher():
        nonlocal compiled
        if compiled is None:
            with _LOCK:
                if compiled is None:
                    compiled = _numba().njit(nogil=True, error_model="numpy",
                                             cache=True)(_calling_kernels(function))
        return compiled

    @functools.wraps(function)
    def call(*args):
        return (dispatcher() if compiled is None else compiled)(*args)
    call.dispatcher = dispatcher
    return call


def _calling_kernels(function):
    """`function` seeing the kernels it names as their Numba dispatchers, which Numba can
    compile into it (the names bound to `kernel`'s wrappers, which it cannot)."""
    named = {name: function.__globals__.get(name) for name in function.__code__.co_names}
    kernels = {name: value.dispatcher() for name, value in named.items()
               if hasattr(value, "dispatcher")}
    if not kernels:
        return function
    seeing = types.FunctionType(function.__code__, {**function.__globals__, **kernels},
                                function.__name__, function.__defaults__, function.__closure__)
    return functools.update_wrapper(seeing, function)
