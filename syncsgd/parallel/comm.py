"""A thin layer over mpi4py: buffer-based calls on numpy arrays, no pickling in the training loop.

Two duplicated communicators keep traffic apart: `ctrl` for the small allreduces that layers make
in the main thread (loss normalisers, batch-norm sums), `grad` for gradient buckets driven by the
reducer's communication thread. Collectives on one communicator are then issued in the same order
on every rank, whatever the threads do.

Requests to stop or snapshot (a signal on one rank) ride on those small allreduces: each carries
the requests its rank made since the last one, so every rank has seen the same requests at any
point all ranks pass in the same order (Caffe's iteration boundaries), without a collective of
their own unless no small allreduce has happened since the previous boundary.
"""
import hashlib

import numpy as np
from google.protobuf import text_format
from mpi4py import MPI

from syncsgd.errors import DistributedError
from syncsgd.parallel.watchdog import SMALL, START, Watchdog
from syncsgd.proto import pb
from syncsgd.weights import full_shape

REQUESTS = ("stop", "snapshot", "terminate")


class Communicator:
    def __init__(self, comm):
        self.world = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ctrl = comm.Dup()
        self.grad = comm.Dup()
        # Watching starts now, so that start-up is covered too; a solver sets its own timeout.
        self.watchdog = Watchdog(comm, pb.DistributedParameter().stall_timeout)
        self._asked = np.zeros(len(REQUESTS), np.int64)    # made on this rank (signal handlers)
        self._sent = np.zeros(len(REQUESTS), np.int64)     # of those, carried to the others
        self._agreed = np.zeros(len(REQUESTS), np.int64)   # seen by every rank, not yet taken
        self._carried = False

    def watch(self, timeout):
        """Name stalled ranks after `timeout` seconds without progress (0 stops watching)."""
        if self.watchdog is not None and timeout <= 0:
            self.watchdog.close()
            self.watchdog = None
        elif self.watchdog is not None:
            self.watchdog.set_timeout(timeout)
        elif timeout > 0:
            self.watchdog = Watchdog(self.world, timeout)

    def arrive(self, point=None):
        if self.watchdog is not None:
            self.watchdog.arrive(point)

    def mark(self, point, iteration=None):
        """Where this rank is (syncsgd.parallel.watchdog's points), for the watchdog's message."""
        if self.watchdog is not None:
            self.watchdog.mark(point, iteration)

    def request(self, action):
        """This rank asks every rank for `action` (one of REQUESTS); safe in a signal handler."""
        self._asked[REQUESTS.index(action)] += 1

    def agreed_requests(self):
        """The actions any rank requested that every rank has now seen, as a set. Every rank
        calls this at the same points of its program."""
        if not self._carried:
            self.allreduce_small(np.zeros(0))
        agreed, self._agreed = self._agreed, np.zeros_like(self._agreed)
        self._carried = False
        return {action for action, n in zip(REQUESTS, agreed) if n > 0}

    def bcast_int(self, value):
        self.arrive(START)
        buf = np.array([value], np.int64)
        self.ctrl.Bcast(buf, root=0)
        return int(buf[0])

    def bcast_object(self, value):
        """Rank 0's `value` (a small picklable object, outside the training loop) on every rank."""
        return self.ctrl.bcast(value, root=0)

    def allreduce_small(self, array):
        """Sum a small array over ranks, in place (main thread only), carrying the requests."""
        self.arrive(SMALL)
        asked = self._asked.copy()
        buf = np.concatenate([array.reshape(-1), (asked - self._sent).astype(array.dtype)])
        self._sent = asked
        self.ctrl.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        array[...] = buf[:array.size].reshape(array.shape)
        self._agreed += buf[array.size:].astype(np.int64)
        self._carried = True
        return array

    def barrier(self):
        self.arrive()
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
        self.arrive(START)
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

