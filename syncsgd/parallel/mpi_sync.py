"""The solver's synchronisation object over MPI ranks (the interface is LocalSync's, sync.py).

It owns what crosses ranks during training: the agreed seed, each net's shard of the batch and
its small allreduces, the model-parallel partitioning, and, once the train net exists, the
gradient reducer (reducer.py) that overlaps reductions with backpropagation. Requests to stop or
snapshot ride on the small allreduces (comm.py); it tells the watchdog where training is.
"""
from syncsgd import TEST
from syncsgd.context import Context
from syncsgd.errors import DistributedError, SyncSGDError
from syncsgd.parallel import watchdog
from syncsgd.parallel.partition import Partitioner
from syncsgd.parallel.reducer import GradientReducer


class MpiSync:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.partitioner = Partitioner(comm, self.from_root)
        self.net = None
        self.reducer = None
        self.iter_size = 1

    # -- building the nets ------------------------------------------------------------------
    def agree_seed(self, seed):
        return self.comm.bcast_int(seed)

    def context(self, phase, seed):
        return Context(phase, seed, self.rank, self.size, self.comm.allreduce_small)

    def net_transform(self, ctx):
        return self.partitioner.transform(ctx)

    def root_check(self, check):
        self.from_root(check)

    def from_root(self, compute):
        """Rank 0's `compute()` on every rank (a small picklable value), or the error it raised."""
        value = error = None
        if self.rank == 0:
            try:
                value = compute()
            except SyncSGDError as e:
                error = e
            except Exception as e:    # every rank must hear of it, or the others wait forever
                error = SyncSGDError(f"rank 0: {type(e).__name__}: {e}")
        value, error = self.comm.bcast_object((value, error))
        if error is not None:
            raise error
        return value

    def attach(self, net, solver_param):
        """Check that every rank built the same net and solver, set the watchdog's timeout, and
        take over the train net's gradients."""
        if self.reducer is not None:
            raise DistributedError("a synchronisation object serves one solver; give each "
                                   "solver its own (syncsgd.parallel.default_sync())")
        options = solver_param.distributed_param
        self.comm.check_agreement(net, solver_param)
        self.comm.watch(options.stall_timeout)
        self.net = net
        self.iter_size = solver_param.iter_size
        self.reducer = GradientReducer(self.comm, net, options)

    # -- one iteration ----------------------------------------------------------------------
    def begin_pass(self, last):
        self.comm.mark(watchdog.PASS, self.net.ctx.iteration // max(1, self.iter_size))
        self.reducer.begin(last)

    def gradients_ready(self):
        self.comm.mark(watchdog.GRADIENTS)
        self.reducer.finish()

    def owned_segments(self):
        return self.reducer.owned_segments()

    def global_sumsq(self, segments):
        return self.reducer.global_sumsq(segments)

    def after_update(self):
        self.reducer.after_update()

    def flush(self):
        self.reducer.sync()

    # -- signals ------------------------------------------------------------------------------
    def request(self, action):
        self.comm.request(action)

    def agreed_requests(self, phase, iteration):
        self.comm.mark(watchdog.TEST if phase == TEST else watchdog.BOUNDARY, iteration)
        return self.comm.agreed_requests()

    # -- whole state for snapshots ----------------------------------------------------------
    def whole_params(self):
        self.comm.mark(watchdog.SNAPSHOT)
        groups = self.net.ctx.groups
        return {(info.layer_name, info.index): (groups.gather_part(info.blob.data, info.part),
                                                groups.gather_part(info.blob.diff, info.part))
                for info in self.net.learnable_params if info.part is not None}

    def whole_history(self, history):
        """REDUCE_SCATTER keeps history current only in each rank's share and a model-parallel
        slice holds only its rows: gather both whole."""
        history = list(history)
        self.reducer.gather_history(history, len(self.net.learnable_params))
        params = self.net.learnable_params
        for i in range(len(history)):
            part = params[i % len(params)].part
            if part is not None:
                history[i] = self.net.ctx.groups.gather_part(history[i], part)
        return history

    # -- diagnostics and the end --------------------------------------------------------------
    def start_timeline(self):
        from syncsgd.parallel.timeline import Timeline
        self.comm.barrier()
        timeline = Timeline(self.rank)
        self.reducer.timeline = timeline
        return timeline

    def write_timeline(self, timeline, path):
        timeline.write(path, self.comm)

    def stats(self):
        """The reducer's counters, plus `group_bytes_sent` by model-parallel exchanges."""
        groups = self.net.ctx.groups
        return dict(self.reducer.stats,
                    group_bytes_sent=groups.bytes_sent if groups is not None else 0)

    def reset_stats(self):
        self.reducer.reset_stats()
        if self.net.ctx.groups is not None:
            self.net.ctx.groups.bytes_sent = 0

    def close(self):
        if self.reducer is not None:
            self.reducer.close()
