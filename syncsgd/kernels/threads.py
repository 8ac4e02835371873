"""The process's thread budget: how many threads its kernels may use.

One number, held here and nowhere else: the GEMM pool, the layers' chunking and oneDNN's OpenMP
team read it (budget()), and set_budget gives it to OpenBLAS and numexpr as well, so that code
outside the kernels (numpy's own products, numexpr expressions) keeps to the same share. Each
rank of a job gets its share of the cores it may run on (syncsgd.parallel calls set_budget).
"""
import os


def usable_cores():
    """The set of cores this process may run on (its affinity mask: a cpuset or the launcher's
    binding; os.cpu_count() counts the whole machine)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


class Budget:
    """The count, and the one-thread rule for work already shared out.

    Until set_budget is called the count is the one OpenBLAS started with (its environment
    variables, else the cores), read once. While a pool of threads runs shared-out work
    (blas.spread), every kernel called from that work runs on one thread: the work is already
    split over the budget.
    """

    def __init__(self):
        self.count = None
        self.shared_out = 0

    def __call__(self):
        if self.shared_out:
            return 1
        if self.count is None:
            from syncsgd.kernels.blas import openblas_threads
            self.count = openblas_threads()
        return self.count


BUDGET = Budget()


def budget():
    """The threads this process's kernels may use now."""
    return BUDGET()


def set_budget(count):
    """Give this process `count` threads: the kernels', OpenBLAS's and numexpr's."""
    count = max(1, int(count))
    BUDGET.count = count
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(count)
    except ImportError:
        pass
    import numexpr
    numexpr.set_num_threads(min(count, numexpr.MAX_THREADS))   # more only prints an error
    return count


class shared_out:
    """Inside: the budget's threads are busy with one piece of work each, so a kernel called
    from any of them runs on one thread."""

    def __enter__(self):
        BUDGET.shared_out += 1

    def __exit__(self, *exc):
        BUDGET.shared_out -= 1


class limited_budget:
    """The budget set to `count` inside the block and restored after it (to time or run one
    thread's share)."""

    def __init__(self, count):
        self.count = count

    def __enter__(self):
        self.saved = BUDGET.count or budget()     # the process's count, not shared-out work's 1
        set_budget(self.count)

    def __exit__(self, *exc):
        set_budget(self.saved)
