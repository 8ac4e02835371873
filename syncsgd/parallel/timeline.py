"""A Chrome trace (chrome://tracing, Perfetto) of every rank's layer, reduction and update spans,
so the overlap of communication with backpropagation can be seen.

Spans go into a fixed ring of records allocated (and touched) up front, so a run of any length
holds the same memory: the newest `limit` spans are kept.
"""
import json
import time

import numpy as np

from syncsgd.weights import atomic_write

_RECORD = np.dtype([("name", np.int32), ("category", np.int32), ("tid", np.int32),
                    ("start", np.float64), ("end", np.float64)])


class Timeline:
    def __init__(self, rank=0, limit=200_000):
        self.rank = rank
        self.records = np.empty(limit, _RECORD)
        self.records.view(np.uint8)[:] = 0        # touch every page now, not as spans arrive
        self.count = 0                     # spans recorded so far (the ring wraps)
        self.strings = {}                  # span names and categories -> ids
        self.t0 = time.perf_counter()

    def _id(self, text):
        return self.strings.setdefault(text, len(self.strings))

    def span(self, name, category, start, end, tid=0):
        record = self.records[self.count % self.records.size]
        record["name"], record["category"], record["tid"] = self._id(name), self._id(category), tid
        record["start"], record["end"] = start - self.t0, end - self.t0
        self.count += 1

    def events(self):
        """The kept spans as Chrome trace events, oldest first."""
        n = min(self.count, self.records.size)
        first = self.count - n
        order = [(first + i) % self.records.size for i in range(n)]
        text = {i: s for s, i in self.strings.items()}
        return [{"name": text[int(r["name"])], "cat": text[int(r["category"])], "ph": "X",
                 "pid": self.rank, "tid": int(r["tid"]), "ts": float(r["start"]) * 1e6,
                 "dur": float(r["end"] - r["start"]) * 1e6} for r in self.records[order]]

    def write(self, path, comm=None):
        """Gather every rank's events to rank 0, which writes one trace file."""
        events = self.events()
        if comm is not None:
            gathered = comm.ctrl.gather(events, root=0)
            if comm.rank != 0:
                return
            events = [e for rank_events in gathered for e in rank_events]
        meta = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t,
                 "args": {"name": "compute" if t == 0 else "communication"}}
                for pid in sorted({ev["pid"] for ev in events}) for t in (0, 1)]
        text = json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"})

        def write(tmp):
            with open(tmp, "w") as f:
                f.write(text)
        atomic_write(path, write)
