"""What a data file was when a source opened it, and the error when it changes under a run.

HDF5 reads past the end of a truncated file as zeros, an open handle keeps reading a file that
was replaced or deleted, and LMDB maps its file: none of them notices, so sources record each
file's identity and check it as the net takes each batch.
"""
import os
from collections import namedtuple

import numpy as np

from syncsgd.errors import DataError


class Identity(namedtuple("Identity", "size mtime_ns inode device")):
    """What a file was when a source opened it. HDF5 reads past the end of a truncated file as
    zeros, and an open handle keeps reading a file that was replaced or deleted, so a change to
    any field means the rows read may not be the rows the run started with."""
    __slots__ = ()

    @classmethod
    def of(cls, st):
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def changes(self, now):
        """How `now` differs from this, in words; "" when it does not."""
        return ", ".join(f"{field} {old} -> {new}"
                         for field, old, new in zip(self._fields, self, now) if old != new)


def change_of(recorded, path):
    """How the file at `path` now differs from its `recorded` Identity, in words; "" when it
    does not (one stat)."""
    try:
        return recorded.changes(Identity.of(os.stat(path)))
    except FileNotFoundError:
        return "deleted"
    except OSError as e:
        return f"it cannot be examined any more: {e.strerror or e}"


def changed_error(what, change, rows, names, scope=""):
    """The error for a source that changed while reading `rows` (sorted, distinct) of the
    datasets `names`; built only on failure, so the checks that pass cost no formatting."""
    quoted = ", ".join(f"'{n}'" for n in names)
    where = f"{scope}{span(rows)} of dataset{'s' if len(names) > 1 else ''} {quoted}"
    return DataError(f"{what} changed during training ({change}) while reading {where}; the run "
                     f"cannot trust its data any more: restore the source as it was when the run "
                     f"started, or restart the run")


def span(rows):
    """Rows (sorted, distinct) in words: 'row 5', 'rows 4..7', or '3 rows in 2..9'."""
    if not len(rows):
        return "no rows"
    lo, hi = int(rows[0]), int(rows[-1])
    if lo == hi:
        return f"row {lo}"
    return f"rows {lo}..{hi}" if hi - lo + 1 == len(rows) else f"{len(rows)} rows in {lo}..{hi}"


class WatchedFile:
    """One file a source reads, checked for change (one stat) as the net takes each batch."""

    def __init__(self, path, what):
        self.path = os.path.abspath(path)
        self.what = what                      # e.g. "LMDB database 'train_lmdb'"
        self.identity = Identity.of(os.stat(self.path))

    def check(self, rows, names):
        change = change_of(self.identity, self.path)
        if change:
            raise changed_error(self.what, change, np.unique(np.asarray(rows, np.int64)), names)
