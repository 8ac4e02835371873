"""HDF5 sources read row by row, and the helpers that write them.

A source is a text file listing HDF5 files, one path per line, as in Caffe's HDF5Data layer. The
rows of a dataset across all listed files form one virtual sequence, so a rank can read any slice
of any batch without loading the rest of the data.
"""
import json
import os
import sys
from collections import OrderedDict

import h5py
from h5py import h5s
import numpy as np
from tqdm import tqdm

from syncsgd.errors import DataError
from syncsgd.io.identity import Identity, change_of, changed_error, span

OPEN_FILES = 16   # HDF5 handles kept open at once; long lists are reopened as needed


def read_list(list_path):
    """The HDF5 paths named by a list file, resolved like Caffe (against the current directory)
    and, failing that, against the list file's own directory."""
    if not os.path.isfile(list_path):
        raise DataError(f"HDF5 list file '{list_path}' not found; hdf5_data_param.source must name "
                        f"a text file with one HDF5 path per line")
    with open(list_path) as f:
        entries = [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    if not entries:
        raise DataError(f"HDF5 list file '{list_path}' lists no files; "
                        f"write one HDF5 path per line")
    base = os.path.dirname(os.path.abspath(list_path))
    paths = []
    for n, entry in entries:
        beside = os.path.join(base, entry)
        path = entry if os.path.exists(entry) else beside
        if not os.path.exists(path):
            raise DataError(f"{list_path}:{n}: HDF5 file '{entry}' not found (looked in "
                            f"'{os.getcwd()}' and '{base}'); fix the path or build the data set")
        if not h5py.is_hdf5(path):
            raise DataError(f"{list_path}:{n}: '{path}' is not an HDF5 file; list only .h5 files "
                            f"(convert other data with tools/convert_hdf5.py)")
        paths.append(path)
    return paths


class H5Source:
    """The datasets `names` of every file in a list file, seen as one sequence of rows each.

    Each file's Identity and dataset shapes and types are recorded when the source is made and
    checked on every read (and when a file is reopened): a source that changes under a run is a
    DataError naming the file, the dataset and the rows, never zeros or other data.
    """

    def __init__(self, list_path, names):
        self.list_path = list_path
        self.names = list(names)
        self.paths = read_list(list_path)
        # Checks and reopening use absolute paths: a later chdir must not look like a change.
        self._list_abspath = os.path.abspath(list_path)
        self._abspaths = [os.path.abspath(p) for p in self.paths]
        self.list_identity = Identity.of(os.stat(self._list_abspath))
        self.row_shapes = {}
        self.identities = []     # per file: Identity
        self.datasets = []       # per file: {name: (shape, dtype)}
        counts = [self._inspect(path) for path in self.paths]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        if self.total == 0:
            raise DataError(f"HDF5 source '{list_path}': its files hold no rows; "
                            f"add data to them or list other files")
        self._handles = OrderedDict()

    def _inspect(self, path):
        """Check one file against the others, record what it is; return its row count."""
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise DataError(f"HDF5 file '{path}' cannot be opened ({e}); it may be truncated or "
                            "corrupt: rebuild or re-copy it") from None
        with f:
            self.identities.append(Identity.of(os.fstat(f.id.get_vfd_handle())))
            present = sorted(k for k, v in f.items() if isinstance(v, h5py.Dataset))
            rows = {}
            for name in self.names:
                ds = f.get(name)
                if not isinstance(ds, h5py.Dataset):
                    raise DataError(f"HDF5 file '{path}' has no dataset '{name}' (datasets "
                                    f"present: {', '.join(present) or 'none'}); each top of the "
                                    f"layer must name a dataset in every listed file")
                if ds.dtype.kind not in "biuf":
                    raise DataError(f"HDF5 file '{path}': dataset '{name}' has non-numeric type "
                                    f"{ds.dtype}; store numbers (float32 preferred)")
                if ds.ndim == 0:
                    raise DataError(f"HDF5 file '{path}': dataset '{name}' is a scalar; store one "
                                    f"row per sample along the first axis")
                shape = ds.shape[1:]
                known = self.row_shapes.setdefault(name, (shape, path))
                if known[0] != shape:
                    raise DataError(f"HDF5 dataset '{name}' has rows of shape {shape} in '{path}' "
                                    f"but {known[0]} in '{known[1]}'; every listed file must "
                                    f"hold rows of one shape")
                rows[name] = ds.shape[0]
            self.datasets.append(dataset_layout(f, self.names))
        if len(set(rows.values())) > 1:
            counts = ", ".join(f"'{k}': {v}" for k, v in rows.items())
            raise DataError(f"HDF5 file '{path}': datasets have different row counts ({counts}); "
                            f"each file must hold one row per sample in every dataset")
        return next(iter(rows.values()))

    def row_shape(self, name):
        return self.row_shapes[name][0]

    def _dataset(self, index, name, local):
        """An open dataset, keeping at most OPEN_FILES files open (least recently used closed).
        A file opened again must still be the file inspected at the start."""
        f = self._handles.pop(index, None)
        if f is None:
            if len(self._handles) >= OPEN_FILES:
                self._handles.popitem(last=False)[1].close()
            f = h5py.File(self._abspaths[index], "r")
            change = (self.identities[index].changes(Identity.of(os.fstat(f.id.get_vfd_handle())))
                      or layout_changes(self.datasets[index], dataset_layout(f, self.names)))
            if change:
                f.close()
                raise changed_error(f"HDF5 file '{self.paths[index]}'", change, local, [name])
        self._handles[index] = f
        return f[name]

    def _check_file(self, index, local, names):
        """Raise DataError when file `index` is no longer the file inspected at the start."""
        change = change_of(self.identities[index], self._abspaths[index])
        if change:
            raise changed_error(f"HDF5 file '{self.paths[index]}'", change, local, names)

    def check(self, rows):
        """Raise DataError when the list file or a file holding the global `rows` changed since
        the source was made: one stat per file. The HDF5Data layer calls it for each batch as the
        net takes it, so a batch read ahead before a change is not trained on either."""
        rows = np.unique(np.asarray(rows, np.int64))
        change = change_of(self.list_identity, self._list_abspath)
        if change:
            raise changed_error(f"HDF5 list file '{self.list_path}'", change, rows, self.names,
                                "global ")
        for index, local in self._per_file(rows):
            self._check_file(index, local, self.names)

    def _per_file(self, distinct):
        """(file index, file-local rows) for sorted distinct global rows, one pair per file."""
        if not distinct.size:
            return
        file_of = np.searchsorted(self.offsets, distinct, side="right") - 1
        new_file = np.flatnonzero(np.diff(file_of)) + 1
        for lo, hi in zip([0, *new_file.tolist()], [*new_file.tolist(), distinct.size]):
            index = int(file_of[lo])
            yield index, distinct[lo:hi] - self.offsets[index]

    def read(self, name, rows):
        """float32 array (len(rows), *row_shape) of the given global rows, in the given order.

        Only those rows are read: the distinct rows, sorted, are grouped per file into runs of
        consecutive rows, and each file is read with one hyperslab selection (the union of its
        runs) straight into the float32 buffer (HDF5 converts the stored type). Each file is
        checked (one stat) after its read, so a change before or during the read raises.
        """
        rows = np.asarray(rows, np.int64)
        distinct, inverse = np.unique(rows, return_inverse=True)
        buf = np.empty((distinct.size,) + self.row_shape(name), np.float32)
        if not distinct.size:
            return buf
        done = 0
        for index, local in self._per_file(distinct):
            gaps = np.flatnonzero(np.diff(local) != 1) + 1
            runs = np.stack([local[np.r_[0, gaps]], local[np.r_[gaps - 1, local.size - 1]] + 1], 1)
            try:
                read_runs(self._dataset(index, name, local), runs, buf[done:done + local.size])
            except (OSError, KeyError, RuntimeError) as e:
                self._check_file(index, local, [name])
                raise DataError(f"{self.paths[index]}: reading rows of dataset '{name}' failed at "
                                f"{span(local)} ({e}); the file may be truncated, corrupt or "
                                f"unreadable: restore it or restart the run") from None
            self._check_file(index, local, [name])
            done += local.size
        if distinct.size == rows.size and np.array_equal(distinct, rows):
            return buf
        return buf[inverse]

    def close(self):
        while self._handles:
            self._handles.popitem()[1].close()


def dataset_layout(f, names):
    """{name: (shape, dtype)} of the datasets `names` of an open HDF5 file (None if absent)."""
    out = {}
    for name in names:
        ds = f.get(name)
        out[name] = (ds.shape, ds.dtype.str) if isinstance(ds, h5py.Dataset) else None
    return out


def layout_changes(old, new):
    """How the datasets of `new` differ from `old`, in words; "" when they do not."""
    return ", ".join(f"dataset '{name}' {old[name]} -> {new[name]}" for name in old
                     if old[name] != new[name])


def read_runs(dataset, runs, out):
    """Read rows [start, stop) of `dataset` for each (start, stop) in `runs` (sorted, disjoint)
    into the C-contiguous array `out`, in one HDF5 read."""
    row_shape = dataset.shape[1:]
    space = dataset.id.get_space()
    space.select_none()
    for start, stop in runs.tolist():
        space.select_hyperslab((start,) + (0,) * len(row_shape), (stop - start,) + row_shape,
                               op=h5s.SELECT_OR)
    dataset.id.read(h5s.create_simple(out.shape), space, out)


# -- writing ------------------------------------------------------------------------------------

def progress(total, desc):
    """A tqdm bar that stays quiet when stdout is not a terminal (logs, CI)."""
    return tqdm(total=total, desc=desc, unit="row", disable=not sys.stdout.isatty())


def list_entry(path):
    """How a list file names `path`: relative to the current directory (the repository root,
    where the tools run) when inside it, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, os.getcwd())
    return path if rel.startswith(os.pardir) else rel


def write_list(list_path, h5_paths):
    """Write a list file atomically."""
    tmp = f"{list_path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(_list_text(h5_paths))
    os.replace(tmp, list_path)


def _list_text(h5_paths):
    return "".join(list_entry(p) + "\n" for p in h5_paths)


def write_chunks(path, count, rows, blocks, spec, desc):
    """Write an HDF5 file of `count` rows per dataset from consecutive blocks, never holding the
    whole set in memory.

    rows: {name: (row_shape, dtype)}; blocks: iterable of {name: array of rows}. The file is
    written under a temporary name and renamed into place only when complete, so a crash never
    leaves a half-written file where a reader expects data. `spec` (JSON-able: how the file was
    made) is stored as an attribute that up_to_date() compares.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f, progress(count, desc) as bar:
            sets = {name: f.create_dataset(name, (count,) + tuple(shape), dtype)
                    for name, (shape, dtype) in rows.items()}
            done = 0
            for block in blocks:
                n = len(next(iter(block.values())))
                for name, array in block.items():
                    sets[name][done:done + n] = array
                done += n
                bar.update(n)
            if done != count:
                raise ValueError(f"{path}: wrote {done} rows, expected {count}")
            f.attrs["syncsgd_spec"] = _spec_text(spec)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_arrays(path, arrays, spec, desc, chunk=4096):
    """write_chunks for arrays already in memory: {name: array with one row per sample}."""
    count = len(next(iter(arrays.values())))
    rows = {name: (a.shape[1:], a.dtype) for name, a in arrays.items()}
    blocks = ({name: a[i:i + chunk] for name, a in arrays.items()} for i in range(0, count, chunk))
    write_chunks(path, count, rows, blocks, spec, desc)


def up_to_date(spec_by_path, list_files):
    """True when every HDF5 file exists with the given spec and every list file
    (path -> list of HDF5 paths) names them as write_list would."""
    for path, spec in spec_by_path.items():
        try:
            with h5py.File(path, "r") as f:
                if f.attrs.get("syncsgd_spec") != _spec_text(spec):
                    return False
        except OSError:
            return False
    for list_path, h5_paths in list_files.items():
        try:
            with open(list_path) as f:
                if f.read() != _list_text(h5_paths):
                    return False
        except OSError:
            return False
    return True


def _spec_text(spec):
    return json.dumps(spec, sort_keys=True)
