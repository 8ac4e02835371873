"""The process's thread budget: how many threads its kernels may use.

One number, held here and nowhere else: the GEMM pool, the layers' chunking and oneDNN's OpenMP
team read it (budget()), and set_budget gives it to OpenBLAS and numexpr as well, so that code
outside the kernels (numpy's own products, numexpr expressions) keeps to the same share. Each
rank of a job gets its share of the cores it may run on (syncsgd.parallel calls set_budget), and
under Slurm no more than the CPUs Slurm gave its task.
"""
import os
import threading
import time

from syncsgd.launcher import slurm_cpus_per_task


def usable_cores():
    """The set of cores this process may run on (its affinity mask: a cpuset or the launcher's
    binding; os.cpu_count() counts the whole machine)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def within_allocation(count):
    """`count` threads, at most the CPUs Slurm gave this task (SLURM_CPUS_PER_TASK): where Slurm
    binds no task, the affinity mask is the whole node's, shared with other jobs."""
    return min(count, slurm_cpus_per_task() or count)


class Budget:
    """The count, and the one-thread rule for work already shared out.

    Until set_budget is called the count is the one OpenBLAS started with (its environment
    variables, else the cores of the affinity mask), read once, and at most the CPUs of a
    Slurm task (that limit is then set, for OpenBLAS too). A thread running shared-out work
    (blas.spread, a lane) runs every kernel it calls on one thread: the work is already split
    over the budget. That rule is each thread's own (a thread-local depth), so that threads entering
    and leaving shared-out work at once never see or change each other's.
    """

    def __init__(self):
        self.count = None
        self._local = threading.local()

    def __call__(self):
        if getattr(self._local, "shared_out", 0):
            return 1
        if self.count is None:
            from syncsgd.kernels.blas import openblas_threads
            started = openblas_threads()
            if within_allocation(started) < started:
                set_budget(within_allocation(started))
            else:
                self.count = started
        return self.count

    def enter_shared_out(self):
        self._local.shared_out = getattr(self._local, "shared_out", 0) + 1

    def leave_shared_out(self):
        self._local.shared_out -= 1


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
    """Inside: this thread runs one piece of shared-out work, so a kernel it calls runs on one
    thread."""

    def __enter__(self):
        BUDGET.enter_shared_out()

    def __exit__(self, *exc):
        BUDGET.leave_shared_out()


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


# A library call made keeping the interpreter lock (a ctypes.PyDLL function) stops every other
# thread of the process meanwhile: the lanes and the thread that runs MPI. Such calls are kept
# to a few microseconds; with SYNCSGD_CHECKS=1 one that takes more CPU time than this is an
# error.
HELD_CALL_SECONDS = 2e-3


def timed_held(call, what):
    """`call`, a library function that keeps the interpreter lock, as one that raises when it
    took more than HELD_CALL_SECONDS: what the libraries' bindings use with SYNCSGD_CHECKS=1."""
    def timed(*args):
        started = time.thread_time()      # this thread's CPU time: not the machine's load
        result = call(*args)
        seconds = time.thread_time() - started
        if seconds > HELD_CALL_SECONDS:
            from syncsgd.errors import SyncSGDError
            raise SyncSGDError(
                f"{what} kept the interpreter lock for {seconds * 1e3:.2f} ms (more than "
                f"{HELD_CALL_SECONDS * 1e3:.1f} ms): every other thread, the MPI one included, "
                "waited. Lower its threshold for held calls (onednn.HELD_VALUES, "
                "plans.Thresholds.held_flops) so that calls this large release the lock")
        return result
    return timed
