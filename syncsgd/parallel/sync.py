"""The one object a solver talks to about other ranks, here in its one-process form.

The training loop calls it at fixed points (Caffe's solver callbacks, Horovod's wrapped
optimizer): once per forward/backward pass, when gradients must be complete, after the update,
and around snapshots. On one process every call is the identity or does nothing, so the loop has
no branch for "is there MPI". MpiSync (syncsgd/parallel/mpi_sync.py) is the same interface over
ranks. Nothing here imports mpi4py.
"""
import numpy as np

from syncsgd.context import Context


class LocalSync:
    rank = 0
    size = 1

    def __init__(self):
        self.net = None
        self.requests = set()

    # -- building the nets ------------------------------------------------------------------
    def agree_seed(self, seed):
        """The random seed every rank uses (this rank's own on one process)."""
        return seed

    def context(self, phase, seed):
        """The Context of a net this solver builds: its shard of every batch, its allreduce."""
        return Context(phase, seed)

    def net_transform(self, ctx):
        """A NetParameter rewrite for Net(transform=...): the model-parallel partitioning."""
        return None

    def root_check(self, check):
        """Run `check()` on rank 0 (a test of files only rank 0 writes) and raise the
        SyncSGDError it raises on every rank, so that no rank waits for one that has failed."""
        check()

    def from_root(self, compute):
        """Rank 0's `compute()` on every rank (a small picklable value)."""
        return compute()

    def attach(self, net, solver_param):
        """Take charge of the train net's gradients (solver_param: agreement checks, options)."""
        self.net = net

    # -- one iteration ----------------------------------------------------------------------
    def begin_pass(self, last):
        """A forward/backward pass starts; `last` is the last of iter_size (the one reduced)."""

    def gradients_ready(self):
        """Return when every parameter's diff holds the global gradient."""

    def owned_segments(self):
        """(parameter index, slice) pieces of the parameters this rank updates."""
        return [(i, slice(None)) for i in range(len(self.net.learnable_params))]

    def global_sumsq(self, segments):
        """Squared L2 norm of the whole gradient, from this rank's `segments` (clip_gradients)."""
        params = self.net.learnable_params
        total = 0.0
        for i, part in segments:
            d = params[i].blob.diff.reshape(-1)[part]
            total += float(np.dot(d, d))
        return total

    def after_update(self):
        """This rank's segments hold their new weights."""

    def flush(self):
        """Wait for all outstanding communication (before tests, snapshots, the end)."""

    # -- signals ------------------------------------------------------------------------------
    def request(self, action):
        """This rank asks the whole job to "stop", "snapshot" or "terminate" (end after this
        iteration: SIGTERM); safe in a signal handler."""
        self.requests.add(action)

    def agreed_requests(self, phase, iteration):
        """At an iteration boundary of `phase` (every rank calls it at the same points): the
        set of actions requested on any rank that every rank takes now."""
        agreed, self.requests = self.requests, set()
        return agreed

    # -- whole state for snapshots ----------------------------------------------------------
    def whole_params(self):
        """{(layer name, blob index): (data, diff)} of parameters this rank holds a slice of,
        gathered whole (every rank calls); empty when every rank holds whole parameters."""
        return {}

    def whole_history(self, history):
        """The solver's history arrays as whole parameters, in the same order (every rank calls)."""
        return list(history)

    # -- diagnostics and the end --------------------------------------------------------------
    def start_timeline(self):
        from syncsgd.parallel.timeline import Timeline
        return Timeline(self.rank)

    def write_timeline(self, timeline, path):
        timeline.write(path)

    def stats(self):
        """Communication counters since reset_stats() (seconds, bytes): none on one process."""
        return {}

    def reset_stats(self):
        pass

    def close(self):
        pass
