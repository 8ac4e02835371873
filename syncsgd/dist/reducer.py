"""Gradient reduction overlapped with backpropagation (PAPER.md section 3).

Parameters are grouped into buckets in the order backward makes their gradients ready (last layer
first). Each bucket owns one flat float32 buffer and the parameters' `diff` arrays become views
into it, so a finished bucket is reduced in place with no packing copies. When backward has passed
every layer that uses a bucket's parameters, the bucket is handed to the communication thread (or,
with progress POLL, started as a non-blocking collective that the training thread tests between
layers). Buckets are issued in the same fixed order on every rank.

ALLREDUCE: every rank gets the summed gradient and updates all weights.
REDUCE_SCATTER: every rank gets the sum of only its 1/N share of each bucket, updates that share
(the solver asks owned_segments()), and the updated weights are all-gathered, overlapping the next
forward pass: a layer's forward waits only for the buckets holding its parameters.
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
    def __init__(self, index, params, size):
        self.index = index
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
        self.buckets = self._make_buckets(params, order, max(1, options.bucket_bytes))
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

    def _make_buckets(self, params, order, bucket_bytes):
        buckets, current, size = [], [], 0
        for i in order:
            count = params[i].blob.count
            current.append((i, size, count))
            size += count
            if size * 4 >= bucket_bytes:
                buckets.append(Bucket(len(buckets), current, size))
                current, size = [], 0
        if current:
            buckets.append(Bucket(len(buckets), current, size))
        sharded = self.mode == _DP.REDUCE_SCATTER
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
        """Every rank starts from rank 0's weights (fillers are seeded alike; this makes sure)."""
        for info in self.net.learnable_params:
            self.comm.grad.Bcast(info.blob.data, root=0)

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
        self.stats.update(comm_s=0.0, exposed_s=0.0, bytes=0, iterations=0)

    def owned_segments(self):
        """(param index, slice) of the gradient this rank updates."""
        if self.mode != _DP.REDUCE_SCATTER:
            return [(i, slice(None)) for i in range(len(self.net.learnable_params))]
        segments = []
        for bucket in self.buckets:
            lo, hi = bucket.first, bucket.first + bucket.counts[self.comm.rank]
            for i, offset, count in bucket.params:
                a, b = max(lo, offset), min(hi, offset + count)
                if a < b:
                    segments.append((i, slice(a - offset, b - offset)))
        return segments

    def sum_over_owners(self, array):
        """Sum a small per-rank partial (e.g. a squared norm) when the update is sharded."""
        if self.mode == _DP.REDUCE_SCATTER:
            self.comm.allreduce_small(array)

    def after_update(self):
        """REDUCE_SCATTER: start all-gathering each bucket's updated weights."""
        if self.mode != _DP.REDUCE_SCATTER:
            return
        for bucket in self.buckets:
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
        if self.mode != _DP.REDUCE_SCATTER:
            return
        sets = len(history) // max(1, n_params)
        for bucket in self.buckets:
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
        if self.mode == _DP.REDUCE_SCATTER:
            return self.comm.grad.Ireduce_scatter(bucket.grad, bucket.recv, bucket.counts,
                                                  MPI.SUM) if start else \
                self.comm.grad.Reduce_scatter(bucket.grad, bucket.recv, bucket.counts, MPI.SUM)
        if start:
            return self.comm.grad.Iallreduce(MPI.IN_PLACE, bucket.grad, MPI.SUM)
        self.comm.grad.Allreduce(MPI.IN_PLACE, bucket.grad, MPI.SUM)
        return None

    def _allgather(self, bucket, start):
        # Place this rank's updated share of the weights, then gather everyone's.
        displs = np.concatenate([[0], np.cumsum(bucket.counts)[:-1]])
        spec = [bucket.data, bucket.counts, displs, MPI.FLOAT]
        if start:
            return self.comm.grad.Iallgatherv(MPI.IN_PLACE, spec)
        self.comm.grad.Allgatherv(MPI.IN_PLACE, spec)
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
        if op == self._reduce:
            self.stats["comm_s"] += bucket.ended - bucket.started
            self.stats["bytes"] += bucket.grad.nbytes
            if self.mode == _DP.REDUCE_SCATTER:
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
