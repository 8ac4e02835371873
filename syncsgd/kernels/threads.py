"""The process's thread budget: how many cores its kernels may use.

Each rank gets its share of the cores it may run on; BLAS, numexpr and oneDNN are sized from
that one number, set here and nowhere else.
"""
import os


def usable_cores():
    """The set of cores this process may run on (its affinity mask: a cpuset or the launcher's
    binding; os.cpu_count() counts the whole machine)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def set_budget(count):
    """Give this process `count` threads for BLAS and numexpr."""
    count = max(1, int(count))
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(count)
    except ImportError:
        pass
    import numexpr
    numexpr.set_num_threads(min(count, numexpr.MAX_THREADS))   # more only prints an error
    return count


def budget():
    """The threads this process's kernels may use."""
    from syncsgd.kernels.blas import threads
    return threads()
