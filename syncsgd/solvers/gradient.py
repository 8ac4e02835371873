"""What every update rule shares: the gradient it consumes and the step it applies, computed block
by block with in-place numpy ufuncs so that a parameter slice is read from memory about once and
no full-size temporary is made: the update is memory-bound.

Caffe's ApplyUpdate goes over a parameter five times: diff /= iter_size, diff += decay * data,
history = f(history, diff), diff = step, data -= diff. Here a slice is walked in blocks (the
block size, the kernel and the threads are kernels.plans.plan_update's choice); for each block
the regularised gradient

    g = scale * diff + decay * data       (L2; L1: decay * sign(data))

is written into a scratch block of the thread's own (scale: the clipping factor times
1 / iter_size), the rule updates its history blocks and computes the step from g, and the step
is subtracted from the weights, all while the block's diff, data, histories and scratch stay in
the core's caches, so each is read from memory once. A rule is a function of one block (see
`Gradient.apply`); for SGD:

    history *= momentum; g *= rate; history += g     -> step: history

SGD without L1 decay, the common case, takes a shorter road (`Gradient.momentum_step`): each
block in three to five BLAS level-1 calls on raw addresses (sscal, saxpy, scopy), no scratch
block.

Large slices are shared out block by block to the process's threads (syncsgd.kernels.blas.spread;
numpy's ufuncs release the GIL on blocks this large), smaller ones run on the calling thread.
Everything stays float32: constants are np.float32 scalars. numpy ufuncs, not numexpr: on
arrays of this size numexpr's per-call overhead outweighs its threads (docs/performance.md,
"Solver update").
"""
import threading

import numpy as np

from syncsgd.errors import PrototxtError
from syncsgd.kernels.blas import level1, spread
from syncsgd.kernels.plans import THRESHOLDS, plan_update
from syncsgd.kernels.threads import budget

SPARE = 2                # scratch blocks a rule may use besides g
_F4 = np.dtype(np.float32).itemsize

_REGULARIZATION = ("L2", "L1")
_scratch = threading.local()


def _scratch_blocks(length):
    """(g, spare): this thread's scratch for a block of `length` elements, g of that length and
    spare (SPARE, length), allocated on its first update."""
    full = getattr(_scratch, "blocks", None)
    if full is None or full[0].size < length:
        blocks = np.empty((1 + SPARE, max(length, THRESHOLDS.update_block)), np.float32)
        full = _scratch.blocks = (blocks[0], blocks[1:])
    if full[0].size == length:
        return full
    return full[0][:length], full[1][:, :length]


class Gradient:
    """One parameter slice (diff and data, flat contiguous views) as an update rule sees it:
    the diff backward accumulated, to be scaled by `scale` (clipping factor / iter_size), plus
    the weight decay `decay` of type `kind` (L2 or L1).

    `keep_step`: leave the applied step in diff afterwards, as Caffe does, for snapshot_diff and
    debug_info; otherwise the step goes straight into data and diff keeps the gradient that
    backward accumulated."""

    def __init__(self, diff, data, scale, decay, kind, keep_step, source="<solver>"):
        if decay and kind not in _REGULARIZATION:
            raise PrototxtError(f"{source}: unknown regularization_type '{kind}'; use L2 or L1")
        self.diff = diff
        self.data = data
        self.scale = np.float32(scale)
        self.decay = np.float32(decay)
        self.l1 = kind == "L1"
        self.keep_step = keep_step

    def apply(self, rule, histories):
        """data -= step, block by block, where step = rule(g, spare, *history_blocks): g is a
        writable scratch block holding the gradient, spare a (SPARE, len(g)) scratch array, and
        the history blocks are the same elements of `histories` (flat slices like data). The
        rule updates the histories in place and returns the step: g, a row of spare or a
        history block."""
        plan = self.plan(False)

        def work(span, worker):
            self._block(rule, histories, *span)
        if plan.shared:
            spread(self._spans(plan), work)
        else:
            for span in self._spans(plan):
                work(span, 0)

    def plan(self, momentum_rule, *histories):
        """plans.plan_update for this slice; momentum_rule: the rule is SGD's momentum step,
        which BLAS's level-1 calls can take where the gradient is linear in diff and data (no
        L1 decay) and the arrays (with `histories`) are writable contiguous float32 of one
        size."""
        arrays = (self.diff, self.data) + histories
        fits = not self.l1 and all(
            a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable and
            a.size == self.data.size for a in arrays)
        return plan_update(self.data.size, budget(), momentum_rule and fits,
                           level1() is not None, THRESHOLDS)

    def _spans(self, plan):
        """The (lo, hi) blocks of the slice."""
        size, block = self.data.size, plan.block
        return [(lo, min(lo + block, size)) for lo in range(0, size, block)]

    def momentum_step(self, history, momentum, rate):
        """SGD's update: history = momentum * history + rate * g; data -= history, each block in
        three to five BLAS level-1 calls on raw addresses (the L2 decay as one more axpy; an
        scopy to keep the step) with no scratch block, where numpy's BLAS has them, g is linear
        in diff and data (no L1 decay) and the three arrays are writable contiguous float32 of
        one size. Fewer calls and less Python a block than `apply`'s ufuncs, so two threads
        wait less for each other's interpreter lock, and three arrays a block stay in cache
        (docs/performance.md, "Solver update"). False where it cannot: the caller then uses
        `apply`.

        Some OpenBLAS kernels (Haswell, Zen) fuse multiply and add only in their vector loop,
        not on a call's last n % 32 elements: blocks, multiples of 32, give the same bits as
        one call over the slice, but a slice that starts inside a parameter (a rank's part)
        may round its last elements differently from a whole-parameter run."""
        plan = self.plan(True, history)
        if plan.kernel != "level1":
            return False
        axpy, scal, copy = level1()
        diff, data, hist = (a.ctypes.data for a in (self.diff, self.data, history))
        momentum, scaled, decayed = float(momentum), float(rate * self.scale), float(
            rate * self.decay)

        def work(span, worker):
            lo, hi = span
            n, at = hi - lo, lo * _F4
            scal(n, momentum, hist + at, 1)
            axpy(n, scaled, diff + at, 1, hist + at, 1)
            if decayed:
                axpy(n, decayed, data + at, 1, hist + at, 1)
            axpy(n, -1.0, hist + at, 1, data + at, 1)
            if self.keep_step:
                copy(n, hist + at, 1, diff + at, 1)
        spread(self._spans(plan), work, None if plan.shared else 1)
        return True

    def _block(self, rule, histories, lo, hi):
        g, spare = _scratch_blocks(hi - lo)
        diff, data = self.diff[lo:hi], self.data[lo:hi]
        self._gradient(g, spare[0], diff, data)
        step = rule(g, spare, *[history[lo:hi] for history in histories])
        data -= step
        if self.keep_step:
            diff[...] = step

    def _gradient(self, g, spare, diff, data):
        """g = scale * diff + decay * data (L2) or decay * sign(data) (L1), blocks of the same
        elements; `spare` may be overwritten."""
        if not self.decay:
            np.multiply(diff, self.scale, out=g)
            return
        if self.l1:
            np.sign(data, out=g)
            g *= self.decay
        else:
            np.multiply(data, self.decay, out=g)
        if self.scale == 1:
            g += diff
        else:
            np.multiply(diff, self.scale, out=spare)
            g += spare


# Pieces of formulas that several rules share, on blocks (t: a scratch block they overwrite).

def mean_of_squares(average, g, keep, t):
    """average = keep * average + (1 - keep) * g^2: the running mean of squares of RMSProp,
    AdaDelta and Adam."""
    np.multiply(g, g, out=t)
    t *= np.float32(1) - keep
    average *= keep
    average += t


def over_root(g, history, rate, delta, t):
    """g = rate * g / (sqrt(history) + delta): the step of AdaGrad and RMSProp."""
    np.sqrt(history, out=t)
    t += delta
    g *= rate
    g /= t
    return g
