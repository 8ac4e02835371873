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
from syncsgd.weights import full_shape


class Communicator:
    def __init__(self, comm):
        self.world = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ctrl = comm.Dup()
        self.grad = comm.Dup()
        self.watchdog = None

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

    def bcast_object(self, value):
        """Rank 0's `value` (a small picklable object, outside the training loop) on every rank."""
        return self.ctrl.bcast(value, root=0)

    def allreduce_small(self, array):
        """Sum a small array over ranks, in place (main thread only)."""
        self.arrive()
        self.ctrl.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array

    def barrier(self):
        self.ctrl.Barrier()

    def check_agreement(self, net, solver_param):
        """Refuse to train when ranks built different nets or solvers, naming ranks and layer."""
        settings = type(solver_param)()
        settings.CopyFrom(solver_param)
        for path_field in ("net", "train_net", "test_net", "snapshot_prefix"):
            settings.ClearField(path_field)     # paths may differ between nodes; contents not
        parts = [("solver settings", text_format.MessageToString(settings).encode())]
        shapes = {}
        for info in net.learnable_params:
            shapes.setdefault(info.layer_name, []).append(str(full_shape(info.blob.shape,
                                                                         info.part)))
        for layer in net.layers:
            parts.append((f"layer '{layer.name}'",
                          text_format.MessageToString(layer.param).encode() +
                          ";".join(shapes.get(layer.name, ())).encode()))
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

