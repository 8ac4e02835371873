"""A Chrome trace (chrome://tracing, Perfetto) of every rank's layer, reduction and update spans,
so the overlap of communication with backpropagation can be seen."""
import json
import time
from collections import deque

from syncsgd.weights import atomic_write


class Timeline:
    def __init__(self, rank=0, limit=500_000):
        self.rank = rank
        self.events = deque(maxlen=limit)     # bounded: a long run keeps the newest spans
        self.t0 = time.perf_counter()

    def span(self, name, category, start, end, tid=0):
        self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.rank,
                            "tid": tid, "ts": (start - self.t0) * 1e6,
                            "dur": (end - start) * 1e6})

    def write(self, path, comm=None):
        """Gather every rank's events to rank 0, which writes one trace file."""
        events = list(self.events)
        if comm is not None:
            gathered = comm.ctrl.gather(events, root=0)
            if comm.rank != 0:
                return
            events = [e for rank_events in gathered for e in rank_events]
        meta = [{"name": "thread_name", "ph": "M", "pid": e, "tid": t,
                 "args": {"name": "compute" if t == 0 else "communication"}}
                for e in sorted({ev["pid"] for ev in events}) for t in (0, 1)]
        text = json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"})

        def write(tmp):
            with open(tmp, "w") as f:
                f.write(text)
        atomic_write(path, write)
