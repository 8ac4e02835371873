"""Caffe LMDB databases of `Datum` records, read by record index and written in transactions.

A source opened here answers the same questions as an HDF5 source (`total`, `row_shape(name)`,
`read(name, rows)`), with two rows per record: "data" (the image, channels x height x width,
BGR as Caffe stores it) and "label". So the Data layer shares HDF5Data's batching, sharding,
transforms and prefetch, and a rank reads only the records of its own slice.
"""
import importlib
import io
import os
import shutil
import threading
import weakref

import numpy as np

from syncsgd.errors import DataError
from syncsgd.io.identity import WatchedFile
from syncsgd.proto import pb

GRAY_MODES = {"1", "L", "LA", "I", "I;16", "F"}   # Pillow modes OpenCV decodes to one channel
WRITE_BATCH = 1000                                # records per write transaction
FIRST_MAP_SIZE = 1 << 26                          # bytes; doubled whenever the map fills up

_OPEN = {}                 # real path -> [environment, number of users]
_OPEN_LOCK = threading.Lock()


def require(module, pip_name, purpose):
    """Import an optional package, or raise a DataError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{purpose} needs the '{pip_name}' package: pip install {pip_name}") \
            from None


def is_lmdb(path):
    """Whether `path` is an LMDB environment (a folder with data.mdb, or the data file itself)."""
    return os.path.isfile(os.path.join(path, "data.mdb")) or (
        os.path.isfile(path) and path.endswith(".mdb"))


def open_env(path):
    """The environment at `path`, opened read-only once per process (LMDB allows no second
    handle) and shared by every source reading it; release with close_env."""
    lmdb = require("lmdb", "lmdb", "reading LMDB databases")
    if not os.path.exists(path):
        raise DataError(f"LMDB database '{path}' not found; data_param.source must name the "
                        f"database folder (make one with `syncsgd convert`)")
    key = os.path.realpath(path)
    with _OPEN_LOCK:
        if key not in _OPEN:
            try:
                # lock=False: training only reads, and read-only copies (no writable lock
                # file) work too
                env = lmdb.open(path, readonly=True, lock=False, subdir=os.path.isdir(path),
                                max_readers=512)
            except lmdb.Error as exc:
                raise DataError(f"'{path}' is not a readable LMDB database ({exc}); convert "
                                f"the data with `syncsgd convert` or Caffe's convert_imageset "
                                f"-backend lmdb") from None
            _OPEN[key] = [env, 0]
        _OPEN[key][1] += 1
        return _OPEN[key][0]


def close_env(env):
    """Release one use of an environment from open_env; the last use closes it."""
    with _OPEN_LOCK:
        for key, entry in list(_OPEN.items()):
            if entry[0] is env:
                entry[1] -= 1
                if not entry[1]:
                    del _OPEN[key]
                    env.close()
                return


class LMDBSource:
    """The records of one LMDB database, in key order (the order Caffe's cursor reads them).

    The keys are indexed once when opened (packed into one bytes object), so record i is one
    lookup away and each rank reads only its own records. Encoded images are decoded with
    Pillow: to their native channel count, or to 3 (`color`) or 1 (`gray`) channels, as Caffe's
    DataTransformer does with force_color / force_gray.
    """

    names = ("data", "label")

    def __init__(self, path, color=False, gray=False):
        if color and gray:
            raise DataError("force_color and force_gray exclude each other; keep one")
        self.path = path
        self.color, self.gray = color, gray
        self.env = open_env(path)
        self.watched = WatchedFile(os.path.join(path, "data.mdb") if os.path.isdir(path) else path,
                                   f"LMDB database '{path}'")
        self.close = weakref.finalize(self, close_env, self.env)   # also when collected
        with self.env.begin() as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
        if not keys:
            self.close()
            raise DataError(f"LMDB database '{path}' holds no records")
        self.total = len(keys)
        self._keys = b"".join(keys)
        self._ends = np.cumsum([len(k) for k in keys], dtype=np.int64)
        self._cached = (None, None)
        self._describe(self._values([0])[0])

    def _describe(self, first):
        """Learn the row shapes from the first record's bytes (a subclass reading other
        records than Datum learns what it needs)."""
        image, _ = decode_datum(first, self.color, self.gray, self.key(0), self.path)
        self._row_shapes = {"data": image.shape, "label": ()}

    def check(self, rows):
        """Raise DataError when the database file changed since the source was opened (one
        stat); the data layers call it for each batch as the net takes it."""
        self.watched.check(rows, self.names)

    def key(self, index):
        start = int(self._ends[index - 1]) if index else 0
        return self._keys[start:int(self._ends[index])]

    def row_shape(self, name):
        return self._row_shapes[name]

    def read(self, name, rows):
        """float32 array (len(rows), *row_shape(name)) of records `rows`. Both rows of a record
        are decoded together; the last batch is kept so that reading its other row is free."""
        rows = np.asarray(rows, np.int64)
        tag = rows.tobytes()
        if self._cached[0] != tag:
            self._cached = (tag, self._decode(rows))
        return self._cached[1][name]

    def _values(self, rows):
        keys = [self.key(i) for i in rows]
        with self.env.begin() as txn:
            pairs = txn.cursor().getmulti(keys)
        if len(pairs) != len(keys):
            raise DataError(f"LMDB database '{self.path}' changed while being read; "
                            f"do not write to a database during training")
        return [value for _, value in pairs]

    def _decode(self, rows):
        shape = self._row_shapes["data"]
        data = np.empty((len(rows),) + shape, np.float32)
        labels = np.empty(len(rows), np.float32)
        # one record at a time: each is its own protobuf message (and maybe a PNG or JPEG)
        for i, (row, value) in enumerate(zip(rows.tolist(), self._values(rows))):
            data[i], labels[i] = decode_datum(value, self.color, self.gray, self.key(row),
                                              self.path, shape)
        return {"data": data, "label": labels}


def decode_datum(value, color, gray, key, path, shape=None):
    """(image (C, H, W), label) of a serialized Datum; `shape`, when given, is the shape every
    record must have."""
    datum = pb.Datum()
    try:
        datum.ParseFromString(value)
    except Exception as exc:  # protobuf raises its own DecodeError or RuntimeError by version
        raise DataError(f"LMDB '{path}': record {key!r} is not a Caffe Datum ({exc})") from None
    if datum.encoded:
        image = decode_image(datum.data, color, gray, f"LMDB '{path}': record {key!r}")
    elif datum.data:
        expected = datum.channels * datum.height * datum.width
        if len(datum.data) != expected:
            raise DataError(f"LMDB '{path}': record {key!r} holds {len(datum.data)} bytes for "
                            f"{datum.channels}x{datum.height}x{datum.width}; the record is damaged")
        image = np.frombuffer(datum.data, np.uint8).reshape(
            datum.channels, datum.height, datum.width)
    else:
        expected = datum.channels * datum.height * datum.width
        if len(datum.float_data) != expected:
            raise DataError(f"LMDB '{path}': record {key!r} holds {len(datum.float_data)} "
                            f"float_data values for {datum.channels}x{datum.height}x"
                            f"{datum.width}; the record is damaged")
        image = np.asarray(datum.float_data, np.float32).reshape(
            datum.channels, datum.height, datum.width)
    if shape is not None and image.shape != shape:
        raise DataError(f"LMDB '{path}': record {key!r} has shape {image.shape} but the first "
                        f"record {shape}; a batch needs one shape (convert with "
                        f"--resize_height/--resize_width)")
    return image, float(datum.label)


def decode_image(data, color, gray, where):
    """An encoded image (PNG, JPEG, ...) as a uint8 (C, H, W) array in BGR or gray order;
    `where` names the record or file in the error message."""
    image_module = require("PIL.Image", "pillow", "decoding encoded images")
    try:
        with image_module.open(io.BytesIO(data)) as img:
            native_gray = img.mode in GRAY_MODES
            pixels = np.asarray(img.convert("L" if gray or (native_gray and not color)
                                            else "RGB"))
    except OSError as exc:
        raise DataError(f"{where} holds an image Pillow cannot decode ({exc})") from None
    if pixels.ndim == 2:
        return pixels[None]
    return pixels[:, :, ::-1].transpose(2, 0, 1)


def write_lmdb(path, records, progress=None):
    """Write (key, serialized value) pairs into a new LMDB database at `path`.

    The database is built under a temporary name and renamed into place when complete. The map
    starts small and doubles when full, so no huge sparse file is needed up front.
    """
    lmdb = require("lmdb", "lmdb", "writing LMDB databases")
    if os.path.exists(path):
        raise DataError(f"'{path}' already exists; remove it or choose another output name "
                        f"(a database is never overwritten)")
    tmp = f"{path}.tmp-{os.getpid()}"
    env = lmdb.open(tmp, map_size=FIRST_MAP_SIZE, subdir=True)
    try:
        batch = []
        for pair in records:
            batch.append(pair)
            if len(batch) == WRITE_BATCH:
                _commit(env, batch, lmdb)
                _advance(progress, len(batch))
                batch = []
        _commit(env, batch, lmdb)
        _advance(progress, len(batch))
        env.close()
        os.replace(tmp, path)
    finally:
        env.close()
        if os.path.exists(tmp):
            shutil.rmtree(tmp)


def _commit(env, batch, lmdb):
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in batch:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)


def _advance(progress, count):
    if progress is not None:
        progress.update(count)
