"""Ends a job that has stopped moving, naming the ranks it waits for, instead of letting it hang.

Every rank runs one watchdog thread. Each thread tells every other rank, several times per
timeout, its heartbeat: how many synchronisation points its training thread has reached and where
the last one was. The thread needs neither the training thread nor a collective, so it keeps
talking while training is blocked in MPI or busy in its own work; it falls silent only when the
whole process is (SIGSTOP, a hung or dead node, a cut link).

Each watchdog judges on its own, so that any one rank, rank 0 included, may be the one that stops:
- a rank not heard from for `timeout` seconds is named as not responding, where it was last seen;
- when every rank is heard but no rank's count has moved for `timeout`, the ranks with the lowest
  count are the ones the others wait for; if all counts are equal, all ranks are inside the same
  collective or computation, and only the network, MPI or a step longer than `timeout` explains it.
The lowest rank that still answers prints one line and aborts the job; the others do the same a
little later, in case it cannot.
"""
import atexit
import threading
import time

import numpy as np
from mpi4py import MPI

from syncsgd.parallel import abort_world

# Where a rank's training thread last was: Watchdog.mark() and arrive() take one of these.
START, PASS, GRADIENTS, SMALL, BOUNDARY, TEST, SNAPSHOT = range(7)
PLACES = ("start-up", "forward/backward", "the gradient reduction", "a small allreduce",
          "the check for signals after the update", "a test pass", "a snapshot")

_COUNT, _ITERATION, _POINT, _CLOSED = range(4)      # fields of a heartbeat


class Watchdog:
    def __init__(self, comm, timeout):
        self.comm = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.set_timeout(timeout)
        self.count = 0
        self.iteration = 0
        self.point = START
        now = time.monotonic()
        self.heard = np.full(self.size, now)                  # when each rank last spoke
        self.beats = np.zeros((self.size, 4), np.int64)       # each rank's last heartbeat
        self.moved = now                                      # when any count last changed
        self._since = None                                    # when the current fault was seen
        self._sends = []                                      # heartbeats not yet delivered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="syncsgd-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.close)        # before mpi4py finalises MPI: say goodbye

    def set_timeout(self, timeout):
        self.timeout = timeout
        self.poll = min(0.5, timeout / 6)     # heartbeat period
        self.recent = 3 * self.poll           # heard within this: certainly alive

    # -- the training thread ----------------------------------------------------------------
    def arrive(self, point=None):
        """The training thread reached a synchronisation point (no communication here)."""
        self.count += 1
        if point is not None:
            self.point = point

    def mark(self, point, iteration=None):
        """Where the training thread is, for the message that names a stalled rank."""
        self.point = point
        if iteration is not None:
            self.iteration = iteration

    def close(self):
        """Stop watching and tell the others this rank has finished, so its silence is no fault."""
        if self._stop.is_set() or MPI.Is_finalized():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._beat(closed=True)

    # -- the watchdog thread ----------------------------------------------------------------
    def _watch(self):
        while True:
            self._beat()
            if self._stop.wait(self.poll):
                return
            now = time.monotonic()
            self._receive(now)
            fault = self._fault(now)
            if fault is None:
                self._since = None
                continue
            self._since = self._since or now
            # The others give the reporter's abort time to end the job before they act.
            if self.rank == self._reporter() or now - self._since > 2 * self.recent + 5:
                abort_world(f"syncsgd watchdog: {fault[1]}. Ending the job.", status=3)

    def _beat(self, closed=False):
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        buf = np.array([self.count, self.iteration, self.point, closed], np.int64)
        for peer in range(self.size):
            if peer != self.rank:
                self._sends.append((self.comm.Isend([buf, MPI.INT64_T], dest=peer), buf))

    def _receive(self, now):
        buf = np.zeros(4, np.int64)
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, status=status):
            peer = status.Get_source()
            self.comm.Recv([buf, MPI.INT64_T], source=peer)
            self._record(peer, buf, now)
        self._record(self.rank, [self.count, self.iteration, self.point, 0], now)

    def _record(self, rank, beat, now):
        self.heard[rank] = now
        if beat[_COUNT] != self.beats[rank, _COUNT]:
            self.moved = now
        self.beats[rank] = beat

    def _fault(self, now):
        """(ranks named, message) when this rank sees the job stalled, else None."""
        live = [r for r in range(self.size) if not self.beats[r, _CLOSED]]
        silent = [r for r in live if now - self.heard[r] > self.timeout]
        if silent:
            waited = now - max(self.heard[r] for r in silent)
            return silent, (f"rank(s) {_names(silent)} stopped responding: nothing heard from "
                            f"them for {waited:.0f} s (last heard: {self._where(silent)}); the "
                            "process is stopped, hung, killed or unreachable; this rank is at "
                            f"{self._place(self.rank)}")
        stalled = now - self.moved
        if stalled <= self.timeout or any(now - self.heard[r] > self.recent for r in live):
            return None       # moving, or a rank falling silent: the rule above will name it
        low = min(self.beats[r, _COUNT] for r in live)
        late = [r for r in live if self.beats[r, _COUNT] == low]
        if len(late) == len(live) and low == 0:
            return None       # every rank still building its nets, before the first collective
        if len(late) == len(live):
            return late, (f"no rank has reached a synchronisation point for {stalled:.0f} s "
                          f"({self._where(late)}): all are inside the same collective or "
                          "computation (network or MPI failure, or one step slower than "
                          "stall_timeout in the solver's distributed_param)")
        return late, (f"rank(s) {_names(late)} did not arrive: the other ranks have waited "
                      f"{stalled:.0f} s for them ({self._where(late)}; stall_timeout in the "
                      "solver's distributed_param)")

    def _reporter(self):
        """The lowest rank still answering reports the fault."""
        now = time.monotonic()
        alive = [r for r in range(self.size)
                 if not self.beats[r, _CLOSED] and now - self.heard[r] <= self.recent]
        return min(alive) if alive else self.rank

    def _where(self, ranks):
        return "; ".join(f"rank {r} at {self._place(r)}" for r in ranks)

    def _place(self, rank):
        return f"iteration {self.beats[rank, _ITERATION]}, {PLACES[self.beats[rank, _POINT]]}"


def _names(ranks):
    return ", ".join(map(str, ranks))
