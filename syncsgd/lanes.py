"""Lanes: each thread of one process carries a contiguous part of the batch through a run of
sample-wise layers, forward and backward, instead of the threads meeting inside every layer.

Why: on small layers (LeNet, CIFAR-10 quick) sharing each layer's kernels out to the threads and
collecting them again costs more than the work, and the Python between kernels holds one core
while the other waits; two single-thread ranks of the same code were faster than one process
with two threads (docs/performance.md, "Lanes").

A lane holds its own copy of each layer of the run, set up for its rows of the batch. Its blobs
are views of the net's blobs (rows of axis 0), so what it computes lands in the net's blobs, where
users and the layers outside the run see it. Lane 0's parameters are the net's own blobs; the
other lanes' share their values and keep gradients of their own, added into the net's in lane
order, so a rerun gives the same bits, as they become ready: a lane whose backward ends adds
those of the layers every lane has finished, so a lane that finishes well ahead adds the top
layers' while the others still run the layers below. Inside a lane every kernel runs on one
thread (the budget's shared_out rule). A run needs a Convolution: fully connected nets already
run their large products at full speed on all threads, and lanes would only add the gradient
sums.

Losses and accuracy join a run as ranks take them: their samples meet only in the sums they take
through ctx.allreduce_sum, which a lane's context adds over the lanes (then over the ranks). A run
that reaches the net's last layer then carries a training pass forward and straight back in one
hand-off of the threads (Net.forward_backward), where waking a thread costs about what a small
layer does (docs/performance.md, "Lanes: a pass in one hand-off").
"""
import threading
import weakref

import numpy as np

from syncsgd import switches
from syncsgd.blob import Blob
from syncsgd.context import shard_range
from syncsgd.errors import SyncSGDError
from syncsgd.kernels.blas import spread
from syncsgd.kernels.threads import budget, shared_out
from syncsgd.layers import create

# A layer with a parameter blob larger than this ends a run: summing its gradient over the lanes
# would cost more than lanes gain on its (large) products (docs/performance.md, "Lanes").
MAX_LAYER_PARAMS = 1 << 21


def find_run(net):
    """(first, last) indices of the longest run of layers lanes can carry, or None."""
    best, start = None, None
    for i in range(len(net.layers) + 1):
        if i < len(net.layers) and _fits(net, i) and (
                start is None or _batch(net, i) == _batch(net, start)):
            start = i if start is None else start
            continue
        if start is not None and any(net.layers[j].type == "Convolution"
                                     for j in range(start, i)):
            if best is None or i - start > best[1] - best[0] + 1:
                best = (start, i - 1)
        start = i if i < len(net.layers) and _fits(net, i) else None
    return best


def _same_memory(a, b):
    """Whether two arrays are the same values in memory (a layer such as Reshape hands on a new
    view of the same memory at every pass)."""
    return a is b or (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                      and a.shape == b.shape and a.strides == b.strides)


def _batch(net, i):
    """The batch size of layer i's blobs (a batch_sums layer's bottoms: its tops are whole-batch
    values), or None when they differ."""
    blobs = net.bottom_vecs[i] + ([] if net.layers[i].batch_sums else net.top_vecs[i])
    sizes = {b.shape[0] if b.num_axes else None for b in blobs}
    return sizes.pop() if len(sizes) == 1 else None


def _fits(net, i):
    """Whether lanes can carry layer i: sample-wise (or a whole-batch sum such as a loss; other
    loss-weighted layers not), one batch size, small weights."""
    layer = net.layers[i]
    return ((layer.batch_sums or (layer.sample_wise and not any(net.loss_weights[i])))
            and _batch(net, i) is not None
            and all(b.count <= MAX_LAYER_PARAMS for b in layer.blobs))


def _check_reshape_keeps_state(layer, bottom, top):
    """Lanes reshape their layers once, when built, never before a pass (Lanes._forward): that is
    right only for a layer whose reshape derives nothing but sizes and buffers from its bottoms'
    shapes, so that a second reshape to the same shapes changes nothing. Checked here, once per
    lane layer, by doing that second reshape: a layer that breaks the rule is an error."""
    before = dict(vars(layer))
    shapes = [blob.shape for blob in top]
    layer.reshape(bottom, top)
    changed = [name for name, value in vars(layer).items()
               if name not in before or not _same_state(before[name], value)]
    changed += [blob.name for blob, shape in zip(top, shapes) if blob.shape != shape]
    if changed:
        raise SyncSGDError(
            f"layer '{layer.name}' ({layer.type}) cannot run in lanes: reshaping it again to the "
            f"same shapes changed {', '.join(changed)}. A sample_wise or batch_sums layer's "
            "reshape may derive only sizes and buffers from its bottoms' shapes "
            "(layers/base.py); fix the layer, or run with SYNCSGD_LANES=0")


def _same_state(a, b):
    """Whether an attribute a second reshape left as it was: the same object, or an equal
    value."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    try:
        return bool(a == b)
    except Exception:         # objects without a truth-valued equality: compare identity
        return False


class LaneSums:
    """allreduce_sum for the lanes' layers: every lane gets the same total, its parts added in
    lane order (the same bits in every lane and every rerun), then summed over the ranks by the
    thread that started the pass (MPI is called from that thread only).

    Each lane's calls alternate between two sets of buffers: a lane can be at most one call ahead
    of another, since every call waits for all lanes to arrive.

    Sums nothing in the pass reads (later()) wait for its end instead (finish()): the lanes then
    meet only where they start and end, and no lane sleeps in the middle of the pass for one
    that started later (waking a thread costs about 0.1 ms: docs/performance.md, "Lanes: a
    pass in one hand-off")."""

    def __init__(self, count, ctx):
        self.ctx = ctx
        self.barrier = threading.Barrier(count)
        self.parts = [[None] * count, [None] * count]
        self.totals = [None, None]
        self.calls = [0] * count
        self.deferred = [[] for _ in range(count)]    # each lane's (part, done) of later()
        self.leader = None

    def start(self):
        """Before a pass: a barrier an earlier failed pass broke is whole again."""
        self.barrier.reset()
        self.calls = [0] * len(self.calls)
        for parts in self.deferred:
            parts.clear()
        self.leader = threading.get_ident()

    def later(self, t, array, done):
        """Lane t's part of a sum whose total goes to done(total) (lane 0's) once every lane
        has finished the pass (finish)."""
        self.deferred[t].append((np.array(array, copy=True), done))

    def finish(self):
        """After a pass every lane finished: each deferred sum, its parts in lane order (one
        process only: LaneContext.sum_later)."""
        for calls in zip(*self.deferred):
            calls[0][1](_in_order([part for part, _ in calls]))

    def abort(self):
        """A lane failed: the others stop waiting for it (threading.BrokenBarrierError)."""
        self.barrier.abort()

    def __call__(self, t, array):
        k = self.calls[t] % 2
        self.calls[t] += 1
        parts = self.parts[k]
        parts[t] = np.array(array, copy=True)
        self.barrier.wait()
        if self.ctx.size > 1:
            if threading.get_ident() == self.leader:
                self.totals[k] = self.ctx.allreduce_sum(_in_order(parts))
            self.barrier.wait()
            array[...] = self.totals[k]
        else:
            array[...] = _in_order(parts)
        return array


def _in_order(parts):
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


class LaneContext:
    """The net's Context as one lane sees it: its first row's place in the global batch, and
    sums over the lanes. On one process it knows the samples of all lanes (`samples`) before
    any sum, and sum_later waits for the end of the pass. No layer of the run reads what
    sum_later holds back: those are whole-batch values (a loss, accuracy), whose size is not
    the run's batch (at least the lane count)."""

    def __init__(self, ctx, t, begin, sums, samples):
        self._ctx, self._t, self._begin, self._sums = ctx, t, begin, sums
        self.samples_total = samples if ctx.size == 1 else None

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    @property
    def batch_offset(self):
        return self._ctx.batch_offset + self._begin

    def allreduce_sum(self, array):
        return self._sums(self._t, array)

    def alone(self):
        return False        # its sums add up the lanes' parts

    def sum_later(self, array, done):
        # On several ranks at once: a rank without lanes (fewer samples than threads, one
        # thread) sums in layer order, and each MPI sum must meet the same sum on every rank.
        if self._ctx.size > 1:
            done(self.allreduce_sum(array))
        else:
            self._sums.later(self._t, array, done)


class Lanes:
    """The lanes of one run of a net's layers, for `count` threads; built from the net's current
    blobs, and told apart from stale ones by current()."""

    def __init__(self, net, first, last, count):
        self._net = weakref.ref(net)       # the net owns its lanes, not the other way round
        self.first, self.last, self.count = first, last, count
        self.indices = range(first, last + 1)
        num = self.samples = net.bottom_vecs[first][0].shape[0]
        self._views = []      # (net blob, its data, its diff) the lanes view, for current()
        self._params = []     # (layer index, blob index, lane blob, lane), checked by current()
        self.lanes = []
        self.sums = LaneSums(count, net.ctx)
        self._progress = [None] * count    # the last layer each lane's backward finished
        self._summing = threading.Lock()
        self._unsummed = []     # groups of layers whose gradients no lane has taken to add yet
        self._groups = {}       # (lo, hi) -> _sum_groups(lo, hi)
        with shared_out():
            for t in range(count):
                start, rows = shard_range(num, t, count)
                self.lanes.append(self._lane(start, start + rows, t))

    @property
    def net(self):
        return self._net()

    def _lane(self, begin, end, t):
        net, views, lane = self.net, {}, []

        def view(blob):
            if blob not in views:
                mine = Blob(name=blob.name)
                mine.view_rows(blob, begin, end)
                views[blob] = mine
                if t == 0:
                    self._views.append((blob, blob.data, blob.diff))
            return views[blob]
        for i in self.indices:
            source = net.layers[i]
            layer = create(source.param, LaneContext(net.ctx, t, begin, self.sums,
                                                     self.samples))
            layer.param_propagate_down = source.param_propagate_down
            for k, blob in enumerate(source.blobs):
                if t == 0:
                    mine = blob
                else:
                    mine = Blob(name=blob.name)
                    mine.data = blob.data
                    # np.zeros's untouched pages take no memory until a backward writes them
                    # (a test net never does).
                    mine.diff = np.zeros(blob.diff.shape, np.float32)
                layer.blobs.append(mine)
                self._params.append((i, k, mine, t))
            bottom = [view(b) for b in net.bottom_vecs[i]]
            # Whole-batch values: the same in every lane, which all write them to the net's blob.
            top = net.top_vecs[i] if source.batch_sums else [view(b) for b in net.top_vecs[i]]
            layer.setup(bottom, top)
            layer.reshape(bottom, top)
            _check_reshape_keeps_state(layer, bottom, top)
            lane.append((layer, bottom, top))
        return lane

    def current(self, count):
        """Whether these lanes still view the net's arrays (no reshape, no new weights since)."""
        if count != self.count:
            return False
        for blob, data, diff in self._views:
            if not (_same_memory(blob.array(0), data) and _same_memory(blob.array(1), diff)):
                return False
        layers = self.net.layers
        for i, k, mine, t in self._params:
            blob = layers[i].blobs[k]
            if (mine is not blob) if t == 0 else not _same_memory(mine.array(0), blob.array(0)):
                return False
        return True

    def forward(self, lo, hi):
        """Layers lo..hi (net indices, inclusive) forward, each lane on its rows."""
        self._settle()
        self._run(lambda t: self._forward(t, lo, hi))

    def backward(self, lo, hi):
        """Layers hi..lo backward, the lanes' parameter gradients added into the net's."""
        self._settle()
        self._start_backward(lo, hi)
        self._run(lambda t: self._backward(t, lo, hi))

    def forward_backward(self, lo, hi):
        """forward(lo, hi) then backward(lo, hi), each lane straight from one to the other."""
        self._settle()
        self._start_backward(lo, hi)
        self._run(lambda t: (self._forward(t, lo, hi), self._backward(t, lo, hi)))

    def _settle(self):
        """The lanes read their views, which see the net's arrays: bring those up to date with
        the forms the net's own layers left (blob.py)."""
        for blob, _, _ in self._views:
            blob.settle()

    def _run(self, work):
        """work(t) for every lane t, on the threads (no thread waits for another to start
        it). A lane's error stops the others at their next sum (LaneSums); the error of the
        first failing lane, in lane order, is raised."""
        self.sums.start()
        errors = [None] * self.count

        def lane(t, _):
            try:
                work(t)
            except BaseException as e:          # re-raised below, on the calling thread
                errors[t] = e
                self.sums.abort()
        spread(range(self.count), lane, self.count)
        failed = [e for e in errors if e is not None]
        for e in failed:
            if not isinstance(e, threading.BrokenBarrierError):
                raise e
        if failed:
            raise failed[0]
        self.sums.finish()

    def _forward(self, t, lo, hi):
        """Unlike Net.forward_layer, no reshape before each layer: the lanes' layers were
        reshaped when built, and their blobs keep those shapes while the lanes are current
        (new arrays or shapes in the net build new lanes), so the layers' reshapes, Python
        under the interpreter lock the lanes share, would only find nothing to change (a layer
        that may join a run derives only sizes and buffers from its bottoms' shapes in reshape:
        layers/base.py)."""
        for layer, bottom, top in self.lanes[t][lo - self.first:hi - self.first + 1]:
            layer.forward(bottom, top)

    def _start_backward(self, lo, hi):
        """Before a backward pass: the groups of layers whose gradients the lanes will add.
        Lane 0 adds into the net's own blobs, and so writes over a diff the solver's step
        cleared (Blob.clear_diff) where it is the first to write it."""
        if (lo, hi) not in self._groups:
            self._groups[lo, hi] = self._sum_groups(lo, hi)
        self._progress = [hi + 1] * self.count
        self._unsummed = list(self._groups[lo, hi])

    def _sum_groups(self, lo, hi):
        """The layers of lo..hi whose gradients the lanes sum (fixed while the lanes are
        current), as groups, each in descending layer order, the groups in the order they become
        ready. Layers that add into one array (a shared parameter) form one group, summed once
        every lane has finished all of them, by one thread: a fixed order, and no two threads
        adding into the array."""
        net = self.net
        writers = {}                      # a net parameter's diff array -> its layers in the run
        for i, k, mine, t in self._params:
            if not t and lo <= i <= hi:
                writers.setdefault(id(mine.array(1)), []).append(i)
        parent = {}

        def root(i):
            while parent[i] != i:
                i = parent[i]
            return i
        for shared in writers.values():
            learning = [i for i in shared if net.layer_need_backward[i]]
            for i in learning:
                parent.setdefault(i, i)
                parent[root(i)] = root(learning[0])
        groups = {}
        for i in parent:
            groups.setdefault(root(i), []).append(i)
        return sorted((sorted(g, reverse=True) for g in groups.values()), key=lambda g: -g[-1])

    def _add_ready(self):
        """Add the other lanes' parameter gradients into the net's (lane 0's), in lane order,
        for each group of layers (_start_backward) every lane's backward has finished and no
        lane has taken yet. Each lane calls it as its backward ends; the last adds the rest."""
        layers = self.net.layers
        while True:
            with self._summing:
                if not self._unsummed or max(self._progress) > self._unsummed[0][-1]:
                    return
                group = self._unsummed.pop(0)
            for i in group:
                for k, total in enumerate(layers[i].blobs):
                    if not layers[i].propagates_param(k):
                        continue
                    for t in range(1, self.count):
                        part = self.lanes[t][i - self.first][0].blobs[k]
                        np.add(total.diff, part.diff, out=total.diff)

    def _backward(self, t, lo, hi):
        net = self.net
        for i in range(hi, lo - 1, -1):
            layer, bottom, top = self.lanes[t][i - self.first]
            if not net.layer_need_backward[i]:
                continue
            if t:
                for blob in layer.blobs:
                    blob.clear_diff()
            layer.backward(top, net.bottom_need_backward[i], bottom)
            self._progress[t] = i
        self._add_ready()


class LaneRunner:
    """A net's lanes: found once, built when first used, rebuilt when the net's blobs, weights or
    thread budget change. Backward goes through the lanes exactly when the forward did, since
    each layer keeps what its forward saw (pooling's argmax, a ReLU's input) for its backward."""

    def __init__(self, net):
        self._net = weakref.ref(net)
        self.run = find_run(net) if switches.lanes() else None
        self.lanes = None
        self.engaged = None   # the Lanes the run's last forward went through, or None

    @property
    def net(self):
        return self._net()

    def forward_at(self, i):
        """The Lanes to run forward from layer i (a layer of the run), or None for the layers'
        own forward. A pass entering the run past its first layer stays with what the run's
        earlier layers last ran on: the lanes only if they ran there."""
        if self.run is None or not self.run[0] <= i <= self.run[1]:
            return None
        engaged, self.engaged = self.engaged, None
        if self.net.debug_info:
            return None
        count = budget()
        if i > self.run[0]:
            if engaged is not None and engaged.current(count):
                self.engaged = engaged
            return self.engaged
        if count < 2 or self.net.bottom_vecs[self.run[0]][0].shape[0] < count:
            return None
        if self.lanes is None or not self.lanes.current(count):
            self.lanes = None
            net = self.net
            batches = set()
            for j in range(self.run[0], self.run[1] + 1):    # the blobs take their new shapes
                net.layers[j].reshape(net.bottom_vecs[j], net.top_vecs[j])
                batches.add(_batch(net, j))
            if len(batches) != 1 or None in batches:
                return None            # reshaped so that the run's blobs no longer share a batch
            self.lanes = Lanes(net, *self.run, count)
        self.engaged = self.lanes
        return self.lanes

    def backward_at(self, i):
        """The Lanes to run backward from layer i, if the forward went through them."""
        if self.engaged is None or not self.run[0] <= i <= self.run[1]:
            return None
        if not self.engaged.current(self.engaged.count):
            raise SyncSGDError(f"net '{self.net.name}': its blobs or weights were replaced "
                               "between forward and backward (a reshape or share_with); "
                               "run forward again before backward")
        return self.engaged

    def serial(self, i):
        """Layer i ran its own forward: a backward through the lanes would use stale state."""
        if self.run is not None and self.run[0] <= i <= self.run[1]:
            self.engaged = None
