"""Names the ranks that stall a job instead of letting every rank hang.

Each rank counts the synchronisation points it reaches (iteration starts, gradient waits, small
allreduces) and sends the count to rank 0 on a communicator of its own. Rank 0 watches from a
thread: when no rank has moved for `timeout` seconds, the ranks with the lowest count are the ones
the others are waiting for. Rank 0 then aborts the job with their names and where they stopped.
"""
import sys
import threading
import time

import numpy as np
from mpi4py import MPI


class Watchdog:
    def __init__(self, comm, timeout, poll=0.5):
        self.comm = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.poll = poll
        self.count = 0
        self._sends = []              # (request, buffer) of counts not yet delivered
        self._stop = threading.Event()
        self._thread = None
        if self.rank == 0:
            self.counts = np.zeros(self.size, np.int64)
            self.changed = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="syncsgd-watchdog",
                                            daemon=True)
            self._thread.start()

    def arrive(self):
        """This rank reached a synchronisation point (cheap: one 8-byte message, not waited)."""
        self.count += 1
        if self.rank == 0:
            self._record(0, self.count)
            return
        self._sends = [(req, buf) for req, buf in self._sends if not req.Test()]
        buf = np.array([self.count], np.int64)
        self._sends.append((self.comm.Isend([buf, MPI.INT64_T], dest=0), buf))

    def _record(self, rank, count):
        if count != self.counts[rank]:
            self.counts[rank] = count
            self.changed = time.monotonic()

    def _watch(self):
        buf = np.zeros(1, np.int64)
        status = MPI.Status()
        while not self._stop.is_set():
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                self.comm.Recv([buf, MPI.INT64_T], source=status.Get_source())
                self._record(status.Get_source(), int(buf[0]))
            stalled = time.monotonic() - self.changed
            if self.timeout and stalled > self.timeout:
                self._abort(stalled)
            self._stop.wait(self.poll)

    def _abort(self, stalled):
        low = int(self.counts.min())
        late = [r for r in range(self.size) if self.counts[r] == low]
        if len(late) == self.size:
            message = (f"no rank has made progress for {stalled:.0f} s, all stuck at the same "
                       "collective (network or MPI failure?)")
        else:
            message = (f"rank(s) {', '.join(map(str, late))} did not arrive: the other ranks "
                       f"have waited {stalled:.0f} s for them (stall_timeout in the solver's "
                       "distributed_param)")
        sys.stderr.write(f"[rank 0] syncsgd watchdog: {message}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(3)

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
