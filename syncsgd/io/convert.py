"""Data set tools: an image folder + list file to HDF5 or LMDB (Caffe's convert_imageset), and
the mean image of a data set (Caffe's compute_image_mean).

Images are stored as Caffe stores them: channels x height x width, BGR (or one gray channel),
values 0..255. In HDF5, "data" is float32 (N, C, H, W) and "label" float32 (N,), with a list
file beside it for an HDF5Data layer; in LMDB, each image is one `Datum` under the key
"%08d_<path>" (raw uint8 pixels, or the encoded file with --encoded).
"""
import io
import os

import h5py
import numpy as np

from syncsgd.errors import DataError
from syncsgd.io.hdf5 import H5Source, progress, write_chunks, write_list
from syncsgd.io.lmdb import GRAY_MODES, LMDBSource, is_lmdb, require, write_lmdb
from syncsgd.proto import pb

CHUNK = 256          # images per HDF5 write and rows per mean step
ENCODINGS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "bmp": "BMP"}


def read_image_list(list_path):
    """[(relative path, int label)]; the label follows the last space, as in convert_imageset."""
    return [(path, label) for path, label, _ in image_list_lines(list_path)]


def image_list_lines(list_path):
    """[(relative path, int label, line number)] of a list file (blank lines skipped), so that
    readers can name the line of an image that fails later."""
    if not os.path.isfile(list_path):
        raise DataError(f"image list '{list_path}' not found; write one 'relative/path label' "
                        f"per line")
    entries = []
    with open(list_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            path, _, label = line.strip().rpartition(" ")
            try:
                entries.append((path, int(label), n))
            except ValueError:
                raise DataError(f"{list_path}:{n}: expected 'relative/path label', got "
                                f"'{line.strip()}'") from None
            if not path:
                raise DataError(f"{list_path}:{n}: missing image path before the label")
    if not entries:
        raise DataError(f"image list '{list_path}' lists no images")
    return entries


class ImageReader:
    """Reads images as Caffe's convert_imageset does: gray or color, optionally resized to
    (height, width) (bilinear; Pillow's filter, so resized pixels differ slightly from
    OpenCV's)."""

    def __init__(self, root, gray=False, size=None):
        self.image = require("PIL.Image", "pillow", "reading images")
        self.root = root
        self.gray = gray
        self.size = size

    def open(self, rel):
        """(Pillow image converted as asked, the file's bytes, whether conversion changed it)."""
        path = os.path.join(self.root, rel)
        try:
            with open(path, "rb") as f:
                data = f.read()
            img = self.image.open(io.BytesIO(data))
            img.load()
        except OSError as exc:
            raise DataError(f"cannot read image '{path}': {exc}") from None
        native_gray = img.mode in GRAY_MODES
        converted = img.convert("L" if self.gray else "RGB")
        if self.size is not None:
            converted = converted.resize((self.size[1], self.size[0]), self.image.BILINEAR)
        changed = self.size is not None or native_gray != self.gray
        return converted, data, changed

    def array(self, rel):
        """uint8 (C, H, W) in BGR or gray order."""
        return to_chw(self.open(rel)[0])


def to_chw(img):
    pixels = np.asarray(img, np.uint8)
    return pixels[None] if pixels.ndim == 2 else pixels[:, :, ::-1].transpose(2, 0, 1)


def convert_imageset(root, list_path, out, backend="lmdb", gray=False, size=None, shuffle=False,
                     seed=1, encoded=False, encode_type="", check_size=False):
    """Write the listed images to `out` (an LMDB folder, or an .h5 file plus its list file
    OUT.txt). Returns the number of images. `size` is (height, width) or None."""
    entries = read_image_list(list_path)
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(entries))
        entries = [entries[i] for i in order]
    reader = ImageReader(root, gray, size)
    if backend == "hdf5":
        if encoded or encode_type:
            raise DataError("--encoded is for LMDB; HDF5 stores decoded pixels")
        write_hdf5_images(reader, entries, out)
    elif backend == "lmdb":
        write_lmdb_images(reader, entries, out, encoded or bool(encode_type), encode_type,
                          check_size)
    else:
        raise DataError(f"unknown backend '{backend}'; use lmdb or hdf5")
    return len(entries)


def write_hdf5_images(reader, entries, out):
    shape = reader.array(entries[0][0]).shape

    def blocks():
        for start in range(0, len(entries), CHUNK):
            batch = entries[start:start + CHUNK]
            data = np.empty((len(batch),) + shape, np.float32)
            for i, (rel, _) in enumerate(batch):
                data[i] = checked(reader.array(rel), shape, rel)
            yield {"data": data, "label": np.array([label for _, label in batch], np.float32)}

    rows = {"data": (shape, np.float32), "label": ((), np.float32)}
    spec = {"converter": "images", "entries": len(entries), "shape": list(shape)}
    write_chunks(out, len(entries), rows, blocks(), spec, os.path.basename(out))
    write_list(os.path.splitext(out)[0] + ".txt", [out])


def write_lmdb_images(reader, entries, out, encoded, encode_type, check_size):
    def records():
        shape = None
        for index, (rel, label) in enumerate(entries):
            datum = pb.Datum(label=label)
            img, data, changed = reader.open(rel)
            if encoded:
                datum.encoded = True
                datum.data = encoded_bytes(img, data, changed, rel, encode_type)
            else:
                pixels = to_chw(img)
                datum.channels, datum.height, datum.width = pixels.shape
                datum.data = pixels.tobytes()
            if check_size:
                shape = shape or img.size
                checked(img.size, shape, rel)
            yield f"{index:08d}_{rel}".encode(), datum.SerializeToString()

    with progress(len(entries), os.path.basename(out)) as bar:
        write_lmdb(out, records(), bar)


def encoded_bytes(img, data, changed, rel, encode_type):
    """The file itself when it already decodes to the stored image in the asked format, else
    the image re-encoded (format: encode_type, or the file's extension)."""
    ext = os.path.splitext(rel)[1].lstrip(".").lower()
    kind = (encode_type or ext).lower()
    if kind not in ENCODINGS:
        raise DataError(f"cannot encode '{rel}' as '{kind}'; pass --encode_type "
                        f"{'|'.join(sorted(ENCODINGS))}")
    if not changed and ENCODINGS.get(ext) == ENCODINGS[kind]:
        return data
    buf = io.BytesIO()
    img.save(buf, format=ENCODINGS[kind])
    return buf.getvalue()


def checked(value, expected, rel):
    shape = getattr(value, "shape", value)
    if shape != expected:
        raise DataError(f"image '{rel}' has size {shape}, the first one {expected}; pass "
                        f"--resize_height and --resize_width to give all images one size")
    return value


def open_source(path, dataset="data"):
    """An LMDB database, or an HDF5 list file (dataset `dataset`), as a row source."""
    if is_lmdb(path):
        return LMDBSource(path), "data"
    if not os.path.exists(path):
        raise DataError(f"'{path}' not found; give an LMDB database folder or an HDF5 list file")
    if h5py.is_hdf5(path):
        raise DataError(f"'{path}' is an HDF5 file; give the list file that names it (syncsgd "
                        f"convert writes {os.path.splitext(path)[0]}.txt beside it)")
    return H5Source(path, [dataset]), dataset


def compute_mean(path, dataset="data"):
    """The mean image (float32, one row's shape) of every row of an LMDB database or an HDF5
    list file, summed in float64 a chunk of rows at a time."""
    source, name = open_source(path, dataset)
    try:
        total = np.zeros(source.row_shape(name), np.float64)
        with progress(source.total, "mean") as bar:
            for start in range(0, source.total, CHUNK):
                rows = np.arange(start, min(start + CHUNK, source.total))
                total += source.read(name, rows).sum(axis=0, dtype=np.float64)
                bar.update(len(rows))
        return (total / source.total).astype(np.float32)
    finally:
        source.close()
