"""Gradient reduction overlapped with backpropagation (docs/method.md "Overlapping communication").

Parameters are grouped into buckets in the order backward makes their gradients ready (last layer
first). Each bucket owns one flat float32 buffer and the parameters' `diff` arrays become views
into it, so a finished bucket is reduced in place with no packing copies. When backward has passed
every layer that uses a bucket's parameters, the bucket is handed to the communication thread (or,
with progress POLL, started as a non-blocking collective that the training thread tests between
layers). Buckets are issued in the same fixed order on every rank.

ALLREDUCE: every rank gets the summed gradient and updates all weights.
REDUCE_SCATTER: every rank gets the sum of only its 1/N share of each bucket, updates that share
(the solver asks owned_segments() through its sync object), and the updated weights are
all-gathered, overlapping the next forward pass: a layer's forward waits only for the buckets
holding its parameters.
"""
import queue
import threading
import time

import numpy as np
from mpi4py import MPI

from syncsgd.context import shard_range
from syncsgd.errors import DistributedError
from syncsgd.proto import pb

_DP = pb.DistributedParameter


class Bucket:
    def __init__(self, index, params, size, comm, sharded):
        self.index = index
        self.comm = comm                  # world, or the replicas of a model-parallel slice
        self.sharded = sharded            # reduce-scatter + allgather instead of allreduce
        self.params = params              # [(param index, offset, count)]
        self.grad = np.zeros(size, np.float32)
        self.data = None                  # flat weights (REDUCE_SCATTER only)
        self.pending = 0                  # layers still to finish backward this pass
        self.inflight = None              # the collective under way (bound method), if any
        self.done = threading.Event()
        self.done.set()
        self.request = None               # its MPI request (progress POLL)
        self.error = None


class GradientReducer:
    def __init__(self, comm, net, options):
        self.comm = comm
        self.net = net
        self.mode = options.reduction
        self.overlap = options.overlap
        self.progress = options.progress
        self.timeline = None
        self.stats = {}
        self.reset_stats()
        params = net.learnable_params
        ready_at = self._ready_layers(net)
        order = sorted(range(len(params)), key=lambda i: (-ready_at[i], i))
        groups = net.ctx.groups
        self.replicas = groups.replicas.Dup() if groups is not None else None
        # Replicated parameters are summed over every rank; a model-parallel slice only over the
        # ranks holding the same slice in the other groups (none in pure MODEL mode).
        world = [i for i in order if params[i].part is None]
        sliced = [i for i in order if params[i].part is not None]
        size = max(1, options.bucket_bytes)
        self.buckets = self._make_buckets(params, world, size, comm.grad,
                                          self.mode == _DP.REDUCE_SCATTER)
        if sliced and self.replicas.Get_size() > 1:
            self.buckets += self._make_buckets(params, sliced, size, self.replicas, False,
                                               first_index=len(self.buckets))
        self.buckets.sort(key=lambda b: -max(ready_at[i] for i, _, _ in b.params))
        self.layer_buckets = {}           # layer index -> buckets whose params it uses
        self.bucket_layers = []
        for bucket in self.buckets:
            layers = set()
            for i, _, _ in bucket.params:
                layers.update(self.users[i])
            self.bucket_layers.append(sorted(layers))
            for layer in layers:
                self.layer_buckets.setdefault(layer, []).append(bucket)
        self.armed = False
        self._queue = queue.SimpleQueue()
        self._thread = None
        if self.progress == _DP.THREAD:
            self._thread = threading.Thread(target=self._serve, name="syncsgd-comm", daemon=True)
            self._thread.start()
        net.backward_hooks.append(self._after_backward)
        net.forward_hooks.append(self._before_forward)
        self._broadcast_weights()

    # -- setup --------------------------------------------------------------------------------
    def _ready_layers(self, net):
        """For each learnable param: the lowest layer index using it (ready when backward has
        passed that layer), and the set of layers using it."""
        blob_index = {id(p.blob): i for i, p in enumerate(net.learnable_params)}
        self.users = [set() for _ in net.learnable_params]
        for li, layer in enumerate(net.layers):
            for blob in layer.blobs:
                if id(blob) in blob_index:
                    self.users[blob_index[id(blob)]].add(li)
        return [min(u) for u in self.users]

    def _make_buckets(self, params, order, bucket_bytes, comm, sharded, first_index=0):
        buckets, current, size = [], [], 0
        for i in order:
            count = params[i].blob.count
            current.append((i, size, count))
            size += count
            if size * 4 >= bucket_bytes:
                buckets.append(Bucket(first_index + len(buckets), current, size, comm, sharded))
                current, size = [], 0
        if current:
            buckets.append(Bucket(first_index + len(buckets), current, size, comm, sharded))
        for bucket in buckets:
            if sharded:
                bucket.data = np.empty_like(bucket.grad)
                bucket.counts = [shard_range(bucket.grad.size, r, self.comm.size)[1]
                                 for r in range(self.comm.size)]
                bucket.first = int(np.sum(bucket.counts[:self.comm.rank]))
                bucket.recv = np.empty(bucket.counts[self.comm.rank], np.float32)
            for i, offset, count in bucket.params:
                blob = params[i].blob
                view = bucket.grad[offset:offset + count].reshape(blob.shape)
                view[...] = blob.diff
                blob.diff = view
                if sharded:
                    data = bucket.data[offset:offset + count].reshape(blob.shape)
                    data[...] = blob.data
                    blob.data = data
        return buckets

    def _broadcast_weights(self):
        """Every rank starts from rank 0's weights (fillers are seeded alike; this makes sure);
        a model-parallel slice from the same slice in group 0."""
        for info in self.net.learnable_params:
            comm = self.comm.grad if info.part is None else self.replicas
            comm.Bcast(info.blob.data, root=0)

    # -- one iteration ----------------------------------------------------------------------
    def begin(self, last_pass):
        """Arm the hooks for a forward/backward pass; only the last of iter_size passes reduces."""
        self.armed = last_pass
        if not last_pass:
            return
        self.comm.arrive()
        self.sync_reductions()
        for bucket, layers in zip(self.buckets, self.bucket_layers):
            bucket.pending = len(layers)

    def _after_backward(self, layer_index):
        if not self.armed:
            return
        for bucket in self.layer_buckets.get(layer_index, ()):
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap:
                self._launch(bucket, self._reduce)
        if self.progress == _DP.POLL:
            self._poll()

    def _before_forward(self, layer_index):
        for bucket in self.layer_buckets.get(layer_index, ()):
            self._wait(bucket)

    def finish(self):
        """Wait until every bucket's gradient is reduced (launching any not yet started)."""
        if not self.armed:
            return
        self.comm.arrive()
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket.pending > 0 or not self.overlap:
                bucket.pending = 0
                self._launch(bucket, self._reduce)
        for bucket in self.buckets:
            self._wait(bucket)
        self.armed = False
        self.stats["exposed_s"] += time.perf_counter() - start
        self.stats["iterations"] += 1

    def reset_stats(self):
        """Counters for the scaling tool: seconds the collectives ran, seconds the training thread
        waited for them after backward (the part overlap did not hide), bytes reduced."""
        self.stats.update(comm_s=0.0, exposed_s=0.0, bytes=0, bytes_sent=0, iterations=0)

    @staticmethod
    def _bytes_sent(bucket, reduced):
        """What this rank sends, counted as for the ring algorithms: a reduce-scatter sends every
        chunk but its own, an allgather its own chunk to each peer, an allreduce both."""
        n = bucket.comm.Get_size()
        rank = bucket.comm.Get_rank()
        own = shard_range(bucket.grad.size, rank, n)[1] * 4
        scatter = bucket.grad.nbytes - own
        gather = own * (n - 1)
        if bucket.sharded:
            return scatter if reduced else gather
        return scatter + gather

    def owned_segments(self):
        """(param index, slice) of the gradient this rank updates: all of every parameter, but
        only this rank's share of sharded buckets."""
        sharded = {i for b in self.buckets if b.sharded for i, _, _ in b.params}
        segments = [(i, slice(None)) for i in range(len(self.net.learnable_params))
                    if i not in sharded]
        for bucket in self.buckets:
            if not bucket.sharded:
                continue
            lo, hi = bucket.first, bucket.first + bucket.counts[self.comm.rank]
            for i, offset, count in bucket.params:
                a, b = max(lo, offset), min(hi, offset + count)
                if a < b:
                    segments.append((i, slice(a - offset, b - offset)))
        return segments

    def global_sumsq(self, segments):
        """The squared L2 norm of the whole (global) gradient, from this rank's segments: shares
        of sharded buckets are summed over all ranks, model-parallel slices over their group."""
        params = self.net.learnable_params
        sharded = {i for b in self.buckets if b.sharded for i, _, _ in b.params}
        parts = np.zeros(3)       # replicated whole, sharded shares, model-parallel slices
        for i, part in segments:
            d = params[i].blob.diff.reshape(-1)[part]
            kind = 2 if params[i].part is not None else (1 if i in sharded else 0)
            parts[kind] += float(np.dot(d, d))
        shares = parts[1:2].copy()
        self.comm.allreduce_small(shares)
        slices = parts[2:3].copy()
        if self.net.ctx.groups is not None:
            self.net.ctx.groups.comm.Allreduce(MPI.IN_PLACE, slices)
        return parts[0] + shares[0] + slices[0]

    def after_update(self):
        """REDUCE_SCATTER: start all-gathering each bucket's updated weights."""
        for bucket in self.buckets:
            if bucket.sharded:
                self._launch(bucket, self._allgather)

    def sync(self):
        """Wait for every outstanding collective (before tests, snapshots, the end)."""
        for bucket in self.buckets:
            self._wait(bucket)

    def sync_reductions(self):
        """Gradient buffers are about to be written: no reduction may still be reading them."""
        for bucket in self.buckets:
            if bucket.inflight == self._reduce:
                self._wait(bucket)

    def gather_history(self, history, n_params):
        """REDUCE_SCATTER keeps history current only in each rank's share: gather it whole."""
        sets = len(history) // max(1, n_params)
        for bucket in self.buckets:
            if not bucket.sharded:
                continue
            flat = np.empty_like(bucket.grad)
            for k in range(sets):
                for i, offset, count in bucket.params:
                    flat[offset:offset + count] = history[i + k * n_params].reshape(-1)
                displs = np.concatenate([[0], np.cumsum(bucket.counts)[:-1]])
                self.comm.grad.Allgatherv(MPI.IN_PLACE, [flat, bucket.counts, displs, MPI.FLOAT])
                for i, offset, count in bucket.params:
                    history[i + k * n_params].reshape(-1)[...] = flat[offset:offset + count]

    # -- collectives ------------------------------------------------------------------------
    def _reduce(self, bucket, start):
        comm = bucket.comm
        if bucket.sharded:
            return comm.Ireduce_scatter(bucket.grad, bucket.recv, bucket.counts, MPI.SUM) \
                if start else comm.Reduce_scatter(bucket.grad, bucket.recv, bucket.counts,
                                                  MPI.SUM)
        if start:
            return comm.Iallreduce(MPI.IN_PLACE, bucket.grad, MPI.SUM)
        comm.Allreduce(MPI.IN_PLACE, bucket.grad, MPI.SUM)
        return None

    def _allgather(self, bucket, start):
        # Place this rank's updated share of the weights, then gather everyone's.
        displs = np.concatenate([[0], np.cumsum(bucket.counts)[:-1]])
        spec = [bucket.data, bucket.counts, displs, MPI.FLOAT]
        if start:
            return bucket.comm.Iallgatherv(MPI.IN_PLACE, spec)
        bucket.comm.Allgatherv(MPI.IN_PLACE, spec)
        return None

    def _launch(self, bucket, op):
        bucket.done.clear()
        bucket.inflight = op
        bucket.started = time.perf_counter()
        if self.progress == _DP.THREAD:
            self._queue.put(bucket)
        else:
            bucket.request = op(bucket, True)

    def _serve(self):
        while True:
            bucket = self._queue.get()
            if bucket is None:
                return
            bucket.started = time.perf_counter()
            try:
                bucket.inflight(bucket, False)
            except Exception as e:     # handed to the training thread by _wait
                bucket.error = e
            bucket.ended = time.perf_counter()
            bucket.done.set()

    def _poll(self):
        for bucket in self.buckets:
            if bucket.request is not None and bucket.request.Test():
                bucket.request = None
                bucket.ended = time.perf_counter()
                bucket.done.set()

    def _wait(self, bucket):
        """Block until the bucket's collective has finished, then take its result."""
        if bucket.inflight is None:
            return
        if bucket.request is not None:
            bucket.request.Wait()
            bucket.request = None
            bucket.ended = time.perf_counter()
            bucket.done.set()
        bucket.done.wait()
        op, bucket.inflight = bucket.inflight, None
        if bucket.error is not None:
            error, bucket.error = bucket.error, None
            raise DistributedError(f"gradient bucket {bucket.index}: {error}") from error
        self.stats["bytes_sent"] += self._bytes_sent(bucket, op == self._reduce)
        if op == self._reduce:
            self.stats["comm_s"] += bucket.ended - bucket.started
            self.stats["bytes"] += bucket.grad.nbytes
            if bucket.sharded:
                bucket.grad[bucket.first:bucket.first + bucket.recv.size] = bucket.recv
        if self.timeline is not None:
            kind = "reduce" if op == self._reduce else "allgather"
            self.timeline.span(f"{kind} bucket {bucket.index}", "comm", bucket.started,
                               bucket.ended, tid=1)

    def close(self):
        if self.comm.watchdog is not None:
            self.comm.watchdog.close()
            self.comm.watchdog = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
