"""A thin layer over mpi4py: buffer-based calls on numpy arrays, no pickling in the training loop.

Two duplicated communicators keep traffic apart: `ctrl` for the small allreduces that layers make
in the main thread (loss normalisers, batch-norm sums), `grad` for gradient buckets driven by the
reducer's communication thread. Collectives on one communicator are then issued in the same order
on every rank, whatever the threads do.
"""
import hashlib

import numpy as np
from google.protobuf import text_format
from mpi4py import MPI

from syncsgd.errors import DistributedError
from syncsgd.kernels.threads import set_budget, usable_cores


class Communicator:
    def __init__(self, comm):
        self.world = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ctrl = comm.Dup()
        self.grad = comm.Dup()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_size = node.Get_size()
        limit_threads(node)
        node.Free()
        self.watchdog = None
        self._groups = {}
        self._auto_modes = None

    def partition(self, ctx):
        """A Net transform that splits model-parallel layers over this job's ranks and gives
        `ctx` the group communicator they use."""
        from syncsgd.parallel.partition import partition_net

        def transform(param):
            param, groups = partition_net(param, self.size, self._auto_choice(param))
            if groups is not None:
                if groups not in self._groups:
                    from syncsgd.parallel.groups import GroupComm
                    self._groups[groups] = GroupComm(self.world, groups)
                ctx.groups = self._groups[groups]
            return param
        return transform

    def _auto_choice(self, param):
        """For parallel_param AUTO: the planner's choice for the first (train) net, reused by
        the test nets so that both hold the same weight slices."""
        from syncsgd.proto import pb
        auto = pb.ParallelParameter.AUTO
        if not any(layer.parallel_param.mode == auto for layer in param.layer):
            return None
        if self._auto_modes is None:
            from syncsgd.plan.modes import choose_modes
            self._auto_modes = choose_modes(param, self.size)
        data = (pb.ParallelParameter.DATA, 1)
        return lambda layer: self._auto_modes.get(layer.name, data)

    def gather_part(self, array, part, groups):
        """The full parameter from every group member's slice `part` of it (all ranks call)."""
        moved = np.ascontiguousarray(np.moveaxis(array, part.axis, 0))
        rest = moved[0].size if moved.shape[0] else int(np.prod(moved.shape[1:]))
        rows = groups.feature_counts(part.total)
        full = np.empty((part.total,) + moved.shape[1:], np.float32)
        counts = [r * rest for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        groups.comm.Allgatherv(moved, [full, counts, displs, MPI.FLOAT])
        return np.moveaxis(full, 0, part.axis)

    def start_watchdog(self, timeout):
        """Name stalled ranks after `timeout` seconds without progress (0 disables)."""
        if timeout > 0 and self.watchdog is None:
            from syncsgd.parallel.watchdog import Watchdog
            self.watchdog = Watchdog(self.world, timeout)

    def arrive(self):
        if self.watchdog is not None:
            self.watchdog.arrive()

    def bcast_int(self, value):
        buf = np.array([value], np.int64)
        self.ctrl.Bcast(buf, root=0)
        return int(buf[0])

    def allreduce_small(self, array):
        """Sum a small array over ranks, in place (main thread only)."""
        self.arrive()
        self.ctrl.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array

    def barrier(self):
        self.ctrl.Barrier()

    def make_reducer(self, solver):
        from syncsgd.parallel.reducer import GradientReducer
        self.check_agreement(solver)
        self.start_watchdog(solver.param.distributed_param.stall_timeout)
        return GradientReducer(self, solver.net, solver.param.distributed_param)

    def check_agreement(self, solver):
        """Refuse to train when ranks built different nets or solvers, naming ranks and layer."""
        settings = type(solver.param)()
        settings.CopyFrom(solver.param)
        for path_field in ("net", "train_net", "test_net", "snapshot_prefix"):
            settings.ClearField(path_field)     # paths may differ between nodes; contents not
        parts = [("solver settings", text_format.MessageToString(settings).encode())]
        from syncsgd.weights import full_shape
        for layer in solver.net.layers:
            shapes = ";".join(str(full_shape(b.shape, layer.blob_parts.get(k)))
                              for k, b in enumerate(layer.blobs))
            parts.append((f"layer '{layer.name}'",
                          text_format.MessageToString(layer.param).encode() + shapes.encode()))
        digest = hashlib.sha256(b"".join(_digest(p) for _, p in parts)).digest()
        mine = np.frombuffer(digest, np.uint8).copy()
        everyone = np.empty((self.size, mine.size), np.uint8)
        self.ctrl.Allgather(mine, everyone)
        if (everyone == everyone[0]).all():
            return
        tables = self.ctrl.allgather([(name, _digest(p)) for name, p in parts])
        reference = tables[0]
        problems = []
        for r, table in enumerate(tables[1:], start=1):
            if table == reference:
                continue
            for (name0, d0), (name, d) in zip(reference, table):
                if name0 != name or d0 != d:
                    problems.append(f"rank {r} differs from rank 0 at {name} "
                                    f"(rank 0 has {name0})")
                    break
            else:
                problems.append(f"rank {r} has {len(table)} layers, rank 0 has {len(reference)}")
        raise DistributedError("ranks disagree on the net or solver: " + "; ".join(problems) +
                               ". Launch every rank with the same solver, net and files.")


def _digest(data):
    return hashlib.sha256(data).digest()


def limit_threads(node):
    """Give each rank its share of the cores it may run on: the cores of its affinity mask divided
    among the ranks on its node (communicator `node`) whose masks overlap it."""
    mine = usable_cores()
    sharers = sum(1 for cores in node.allgather(mine) if cores & mine)
    return set_budget(len(mine) // sharers)
