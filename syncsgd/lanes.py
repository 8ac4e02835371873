"""Lanes: each thread of one process carries a contiguous part of the batch through a run of
sample-wise layers, forward and backward, instead of the threads meeting inside every layer.

Why: on small layers (LeNet, CIFAR-10 quick) sharing each layer's kernels out to the threads and
collecting them again costs more than the work, and the Python between kernels holds one core
while the other waits; two single-thread ranks of the same code were faster than one process
with two threads (docs/performance.md, "Lanes").

A lane holds its own copy of each layer of the run, set up for its rows of the batch. Its blobs
are views of the net's blobs (rows of axis 0), so what it computes lands in the net's blobs, where
users and the layers outside the run see it. Its parameter values are the net's own arrays; its
parameter gradients are its own (lane 0 adds into the net's), added into the net's after backward
in lane order, so a rerun gives the same bits. Inside a lane every kernel runs on one thread (the
budget's shared_out rule). A run needs a Convolution: fully connected nets already run their large
products at full speed on all threads, and lanes would only add the gradient sums.
"""
import os
import weakref

import numpy as np

from syncsgd.blob import Blob
from syncsgd.context import shard_range
from syncsgd.errors import SyncSGDError
from syncsgd.kernels.blas import in_pieces, spread
from syncsgd.kernels.threads import budget, shared_out
from syncsgd.layers import create

# A layer with a parameter blob larger than this ends a run: summing its gradient over the lanes
# would cost more than lanes gain on its (large) products (docs/performance.md, "Lanes").
MAX_LAYER_PARAMS = 1 << 21


def enabled():
    """SYNCSGD_LANES=0 turns lanes off (every layer then shares its kernels out)."""
    return os.environ.get("SYNCSGD_LANES", "1") != "0"


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
    """The batch size of layer i's blobs, or None when they differ."""
    sizes = {b.shape[0] if b.num_axes else None for b in net.bottom_vecs[i] + net.top_vecs[i]}
    return sizes.pop() if len(sizes) == 1 else None


def _fits(net, i):
    """Whether lanes can carry layer i: sample-wise, not a loss, one batch size, small weights."""
    layer = net.layers[i]
    return (layer.sample_wise and not any(net.loss_weights[i]) and _batch(net, i) is not None
            and all(b.count <= MAX_LAYER_PARAMS for b in layer.blobs))


class Lanes:
    """The lanes of one run of a net's layers, for `count` threads; built from the net's current
    blobs, and told apart from stale ones by current()."""

    def __init__(self, net, first, last, count):
        self._net = weakref.ref(net)       # the net owns its lanes, not the other way round
        self.first, self.last, self.count = first, last, count
        self.indices = range(first, last + 1)
        num = net.bottom_vecs[first][0].shape[0]
        self._views = []      # (net blob, its data, its diff) the lanes view, for current()
        self._params = []     # (layer index, blob index, lane blob, lane), checked by current()
        self.lanes = []
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
            layer = create(source.param, net.ctx)
            for k, blob in enumerate(source.blobs):
                mine = Blob(name=blob.name)
                mine.data = blob.data
                # Other lanes' gradients: np.zeros's untouched pages take no memory until a
                # backward writes them (a test net never does).
                mine.diff = blob.diff if t == 0 else np.zeros(blob.diff.shape, np.float32)
                layer.blobs.append(mine)
                self._params.append((i, k, mine, t))
            bottom = [view(b) for b in net.bottom_vecs[i]]
            top = [view(b) for b in net.top_vecs[i]]
            layer.setup(bottom, top)
            layer.reshape(bottom, top)
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
            if not _same_memory(mine.array(0), blob.array(0)) or (
                    t == 0 and not _same_memory(mine.array(1), blob.array(1))):
                return False
        return True

    def forward(self, lo, hi):
        """Layers lo..hi (net indices, inclusive) forward, each lane on its rows."""
        self._settle()
        spread(range(self.count), lambda t, _: self._forward(t, lo, hi), self.count)

    def _settle(self):
        """The lanes read their views, which see the net's arrays: bring those up to date with
        the forms the net's own layers left (blob.py)."""
        for blob, _, _ in self._views:
            blob.settle()

    def _forward(self, t, lo, hi):
        for layer, bottom, top in self.lanes[t][lo - self.first:hi - self.first + 1]:
            layer.reshape(bottom, top)
            layer.forward(bottom, top)

    def backward(self, lo, hi):
        """Layers hi..lo backward, then the lanes' parameter gradients added into the net's."""
        self._settle()
        layers = self.net.layers
        for i, k, mine, t in self._params:
            if not t and lo <= i <= hi:
                layers[i].blobs[k].diff      # lane 0 adds into the net's diffs: zero them now
        spread(range(self.count), lambda t, _: self._backward(t, lo, hi), self.count)
        for i, k, mine, t in self._params:
            if t and lo <= i <= hi and self.net.layer_need_backward[i]:
                _add_into(layers[i].blobs[k].diff.reshape(-1), mine.diff.reshape(-1))

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


def _add_into(total, part):
    """total += part, shared out over the threads."""
    def add(piece):
        total[piece] += part[piece]
    in_pieces(add, total.size)


class LaneRunner:
    """A net's lanes: found once, built when first used, rebuilt when the net's blobs, weights or
    thread budget change. Backward goes through the lanes exactly when the forward did, since
    each layer keeps what its forward saw (pooling's argmax, a ReLU's input) for its backward."""

    def __init__(self, net):
        self._net = weakref.ref(net)
        self.run = find_run(net) if enabled() else None
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
