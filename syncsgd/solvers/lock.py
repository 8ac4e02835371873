"""One run per snapshot prefix: `<snapshot_prefix>.lock`, beside the snapshots.

Two runs writing the same `<prefix>_iter_N` files can leave one run's weights beside the other's
state, each file with a valid checksum. The lock file names its owner (host, pid and the process's
start time, so a recycled pid is not taken for the owner); it is created with O_EXCL, so of two
runs starting together exactly one gets it. A lock whose owner ran on this host and has ended
(killed, crashed, aborted by MPI) is stale and is taken over. A lock from another host cannot be
checked from here: the message says how to remove it.

One process may take the same prefix several times (a script that trains, then resumes in the
same process); the file goes when the last holder releases it, or when the process exits.
"""
import atexit
import errno
import os
import socket

from syncsgd import log
from syncsgd.errors import SnapshotError

_held = {}          # absolute lock path -> number of holders in this process


def lock_path(prefix):
    return f"{prefix}.lock"


class PrefixLock:
    def __init__(self, prefix):
        self.prefix = prefix
        self.path = lock_path(prefix)
        self.key = None             # the lock's absolute path while held (the cwd may change)

    def acquire(self):
        """Take the prefix for this process, or raise SnapshotError naming the owner and the fix.
        Creating the file is also the check that snapshots can be written there."""
        if self.key is not None:
            return
        key = os.path.abspath(self.path)
        if key not in _held:
            self._create()
        _held[key] = _held.get(key, 0) + 1
        self.key = key

    def release(self):
        key, self.key = self.key, None
        if key is None or key not in _held:
            return
        _held[key] -= 1
        if _held[key] == 0:
            del _held[key]
            _remove_if_mine(key)

    def _create(self):
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
            for _ in range(2):
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    self._take_over_if_stale()
                    continue
                _write_owner(fd, self.path)
                return
        except OSError as e:
            # makedirs says "File exists" when a path component is a regular file
            reason = os.strerror(errno.ENOTDIR) if isinstance(e, FileExistsError) else \
                e.strerror or str(e)
            raise SnapshotError(
                f"cannot write snapshots to snapshot_prefix '{self.prefix}': "
                f"{e.filename or directory}: {reason}; the prefix's directory must exist (or be "
                "possible to create) and be writable: fix it or set snapshot_prefix elsewhere") \
                from None
        raise SnapshotError(f"{self.path}: could not take this snapshot lock; another run is "
                            "starting on the same snapshot_prefix")

    def _take_over_if_stale(self):
        """Remove the lock if its owner has ended on this host; else raise naming the owner."""
        text = _read(self.path)
        if text is None:                  # released meanwhile: try again
            return
        owner = _parse(text)
        if owner is None:
            raise SnapshotError(
                f"{self.path}: snapshot lock of unknown owner (unreadable or empty: a run is "
                "starting, or one died while taking it); if no run uses this snapshot_prefix, "
                "delete the lock file")
        host, pid, started = owner
        if host != socket.gethostname():
            raise SnapshotError(
                f"{self.path}: snapshot_prefix is in use by pid {pid} on host {host}; wait for "
                "that run to end, give this run another snapshot_prefix, or delete the lock "
                "file if that run is over")
        if _alive(pid, started):
            raise SnapshotError(
                f"{self.path}: snapshot_prefix is in use by a running job (pid {pid} on this "
                "host); wait for it to end or give this run another snapshot_prefix")
        if _read(self.path) != text:      # another run took it over meanwhile: look again
            return
        log.info(f"Taking over the stale snapshot lock {self.path} of pid {pid} on {host}, "
                 "which is no longer running")
        _remove(self.path)


def _write_owner(fd, path):
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}\n"
                 .encode())
        os.fsync(fd)
    except OSError:
        os.close(fd)
        _remove(path)
        raise
    os.close(fd)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _parse(text):
    """(host, pid, start time or None) from a lock file's line, None if it is not one."""
    fields = (text or "").split()
    if len(fields) != 3 or not fields[1].isdigit():
        return None
    return fields[0], int(fields[1]), None if fields[2] == "-" else fields[2]


def _alive(pid, started):
    """Whether `pid` on this host is still the process that wrote the lock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state not in "ZX" and (started is None or start == started)


def _proc_stat(pid):
    """(state, start time in clock ticks since boot) from /proc/PID/stat, None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()     # the command name may hold spaces
    return fields[0], fields[19]


def _start_time(pid):
    stat = _proc_stat(pid)
    return "-" if stat is None else stat[1]


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_if_mine(path):
    """Remove a lock this process wrote, not one another run took over since (a forked child
    exiting must not remove its parent's lock either)."""
    owner = _parse(_read(path))
    if owner is not None and owner[:2] == (socket.gethostname(), os.getpid()):
        _remove(path)


@atexit.register
def _release_all():
    for path in list(_held):
        _remove_if_mine(path)
    _held.clear()
