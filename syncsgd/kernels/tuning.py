"""Kernel choices made by timing the candidates once on this machine, as cuDNN's find does, and
kept on disk per CPU so that every later run (and every rank of a job) takes the same ones.

plans.py says which kernels may run a piece of work (its candidates) and what a choice makes of
its plan; this module only times candidates and remembers the fastest. A cache file holds the
choices of one kind of machine: the CPU's model and flags, oneDNN's version and the ISA it may
use (ONEDNN_MAX_CPU_ISA), numpy's BLAS, so a machine of another kind, or the same one with
another cap, times afresh. Processes of one host take turns on a lock file while they time a
key, so that ranks started together time a layer once and read each other's result; a cache
that cannot be read is timed again and written anew, one that cannot be written is kept in
memory and said once in the log. SYNCSGD_KERNEL_CACHE names the folder (default
~/.cache/syncsgd/kernels); SYNCSGD_KERNELS=rules skips all this for the fixed rules.
"""
import fcntl
import functools
import hashlib
import json
import os
import platform
import threading
import time

from syncsgd import log, switches

# Rounds of timed runs after each candidate's first (which builds it and warms the caches), and
# the ratio to the best so far past which a candidate is not run again.
RUNS = 3
GIVE_UP = 1.5
# What a cache entry's choices mean: a change to the candidates or the timing bumps it.
VERSION = 12

_LOCK = threading.Lock()
_MEMORY = {}          # key -> choice: this process's view of the cache file
_UNWRITABLE = []
_TIMING = []          # the label of the work being timed, while a timing runs
_FILE = [None, {}]    # (path, mtime, size) and the entries of the cache file cached() read


def busy():
    """Whether a timing runs (in any thread): work it runs, or that runs beside it, takes the
    fixed rules for now rather than timing itself inside another's timing."""
    return bool(_TIMING)


@functools.cache
def machine():
    """What makes a kernel's speed differ between machines, as a dict of strings (read once: the
    ISA cap and the libraries are fixed once oneDNN and numpy have loaded)."""
    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "cpu family", "model") and name not in cpu:
                    cpu[name] = value.strip()
    except OSError:
        cpu["model name"] = platform.processor() or platform.machine()
    from threadpoolctl import threadpool_info
    from syncsgd.kernels import compiled, onednn
    blas = sorted(f"{lib.get('internal_api')} {lib.get('version')} {lib.get('architecture')}"
                  for lib in threadpool_info() if lib.get("user_api") == "blas")
    return {"cpu": cpu.get("model name", ""),
            "family": f"{cpu.get('cpu family', '')}/{cpu.get('model', '')}",
            "flags": hashlib.sha1(cpu.get("flags", "").encode()).hexdigest()[:12],
            "isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "onednn": onednn.version() if onednn.available() else "none",
            "blas": "; ".join(blas), "compiled": compiled.version() or "none",
            "version": str(VERSION)}


def cache_path():
    """The cache file of this kind of machine."""
    identity = machine()
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(switches.kernel_cache(), f"{digest}.json")


def _read(path):
    try:
        with open(path) as f:
            entries = json.load(f).get("choices", {})
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _write(path, entries):
    """The whole file anew, through a temporary file and a rename: a reader sees the old file
    or the new one, never half of one."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump({"machine": machine(), "choices": entries}, f, indent=0, sort_keys=True)
    os.replace(temporary, path)


def _fastest(direction, candidates, prepare):
    """The candidate whose runs take least time, and each one's best time in seconds. The
    candidates run in rounds, each once a round, so that a spell of other load on the machine
    slows all of them alike rather than the one that happened to run then; from the second
    round on, a candidate past GIVE_UP times the best sits out the rounds left (after one
    round only, a spell of load could put the fastest out)."""
    runs = {}
    for candidate in candidates:
        run = prepare(direction, candidate)
        if run is not None:
            run()
            runs[json.dumps(candidate)] = run
    times = dict.fromkeys(runs, float("inf"))
    for round_ in range(RUNS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name] = min(times[name], time.perf_counter() - start)
        if round_:
            best = min(times.values())
            runs = {name: run for name, run in runs.items() if times[name] <= GIVE_UP * best}
    return json.loads(min(times, key=times.get)), times


def _valid(entry, candidates):
    return (isinstance(entry, dict) and set(entry) == set(candidates)
            and all(entry[d] in candidates[d] for d in candidates))


def cached(key, candidates):
    """The choice `choice` would return without timing, or None where it would time: read
    without taking the locks, so that it answers inside a timing too (where products are
    planned at every call: the file is parsed again only when it changed)."""
    text = json.dumps(key, sort_keys=True)
    entry = _MEMORY.get(text)
    if not _valid(entry, candidates):
        entry = _file_entries().get(text)
    return entry if _valid(entry, candidates) else None


def _file_entries():
    """The cache file's entries, kept while the file's size and time stay the same."""
    path = cache_path()
    try:
        info = os.stat(path)
    except OSError:
        return {}
    stamp = (path, info.st_mtime_ns, info.st_size)
    if _FILE[0] != stamp:
        _FILE[:] = [stamp, _read(path)]
    return _FILE[1]


def choice(key, candidates, prepare, label=None):
    """{direction: the candidate to run} for the work named by `key` (a JSON-able value), from
    the cache or by timing: candidates is {direction: [candidate, ...]} (JSON-able values),
    prepare(direction, candidate) builds what runs it and returns a function that runs it once
    (or None where the candidate cannot run this work). `label` names the work in the log."""
    text = json.dumps(key, sort_keys=True)
    with _LOCK:
        entry = _MEMORY.get(text)
        if _valid(entry, candidates):
            return entry
        path = cache_path()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = open(f"{path}.lock", "a")
        except OSError as e:
            lock = None
            _say_unwritable(path, e)
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            entries = _read(path)
            entry = entries.get(text)
            if not _valid(entry, candidates):
                entry, report = {}, []
                _TIMING.append(label or text)
                try:
                    for direction, options in candidates.items():
                        entry[direction], times = _fastest(direction, options, prepare)
                        report.append(f"{direction} {entry[direction]} "
                                      f"({1e3 * min(times.values()):.2f} ms, of {len(times)})")
                finally:
                    _TIMING.pop()
                log.info(f"kernels timed for {label or text}: " + "; ".join(report))
                entries[text] = entry
                if lock is not None:
                    try:
                        _write(path, entries)
                    except OSError as e:
                        _say_unwritable(path, e)
            _MEMORY[text] = entry
            return entry
        finally:
            if lock is not None:
                lock.close()


def _say_unwritable(path, error):
    if not _UNWRITABLE:
        _UNWRITABLE.append(path)
        log.info(f"kernel choices are not kept on disk ({error}); set SYNCSGD_KERNEL_CACHE to a "
                 "writable folder to keep them")
