"""Weights in and out in Caffe's formats: binary .caffemodel (NetParameter, current or legacy V1)
and .caffemodel.h5 (`/data/<layer>/<i>`), matched to layers by name as Caffe does.

Both go one parameter at a time between the net's arrays and the file, so a snapshot or a load
needs no second copy of the weights: binary files are written and read in protobuf's wire format
directly (the same bytes protobuf makes; protobuf itself parses only legacy and unusual files)."""
import hashlib
import io
import os
from collections import OrderedDict
from contextlib import contextmanager
from urllib.parse import quote

import h5py
import numpy as np
from google.protobuf.message import DecodeError

from syncsgd import log
from syncsgd.compile import upgrade_net
from syncsgd.proto.files import read_binary
from syncsgd.errors import PrototxtError, WeightsError
from syncsgd.proto import pb


def is_hdf5(path):
    return str(path).endswith(".h5") or (os.path.isfile(path) and h5py.is_hdf5(path))


LEGACY_FIELDS = ("num", "channels", "height", "width")


def is_legacy(proto):
    """Caffe's rule (Blob::ShapeEquals, Blob::FromProto): a BlobProto that sets any of the legacy
    num/channels/height/width has their 4-D shape; any other has `shape`, and one with neither
    (how Caffe writes a 0-d blob, such as PReLU's channel_shared slope) has the shape ()."""
    return any(proto.HasField(name) for name in LEGACY_FIELDS)


def proto_shape(proto):
    """The blob's stored shape, legacy 4-D or `shape` (see is_legacy)."""
    if is_legacy(proto):
        return tuple(getattr(proto, name) for name in LEGACY_FIELDS)
    return tuple(int(d) for d in proto.shape.dim)


def shapes_fit(stored, target, legacy):
    """Caffe's Blob::ShapeEquals: a legacy 4-D shape fits a blob of up to 4 axes whose shape,
    padded on the left with 1s, is the same (an InnerProduct weight stored as 1x1xMxN); any
    other shape must be the blob's."""
    if not legacy:
        return tuple(stored) == tuple(target)
    if len(target) > 4:
        return False
    return tuple(stored) == (1,) * (4 - len(target)) + tuple(target)


def blob_array(proto, target_shape, where):
    """A float32 array of `target_shape` from a BlobProto, checking the stored shape fits."""
    legacy = is_legacy(proto)
    stored = proto_shape(proto)
    if not shapes_fit(stored, target_shape, legacy):
        raise WeightsError(f"{where}: stored shape {stored} does not fit the net's "
                           f"{tuple(target_shape)}")
    values = proto.double_data if len(proto.double_data) else proto.data
    expected = int(np.prod(target_shape, dtype=np.int64))
    if len(values) != expected:
        raise WeightsError(f"{where}: holds {len(values)} values, shape {tuple(target_shape)} "
                           f"needs {expected} (truncated file?)")
    return np.asarray(values, np.float32).reshape(target_shape)


class StoredBlob:
    """One parameter as a weight file holds it: the stored shape, whether that is the legacy
    4-D num/channels/height/width, how many values there are, and how to read them. Values are
    read only when asked, into the caller's buffer, so one parameter at a time is in memory."""

    def __init__(self, shape, legacy, count, read_into):
        self.shape = tuple(shape)
        self.legacy = legacy
        self.count = count
        self._read_into = read_into

    def read_into(self, out):
        """Fill the flat float32 array `out` (`count` values)."""
        self._read_into(out)

    def values(self):
        out = np.empty(self.count, np.float32)
        self._read_into(out)
        return out


def read_weights(path):
    """OrderedDict layer name -> {blob index: (array, stored shape, legacy flag)}, from either
    format, with every value in memory (copy_from reads one parameter at a time instead)."""
    with open_weights(path) as layers:
        return OrderedDict((name, {i: (b.values(), b.shape, b.legacy) for i, b in blobs.items()})
                           for name, blobs in layers.items())


@contextmanager
def open_weights(path):
    """OrderedDict layer name -> {blob index: StoredBlob} of either format, layers without blobs
    included (Caffe reports those it ignores too), the file kept open for reading the values.
    Caffe's HDF5 files leave out a shared parameter under the layers that borrow it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise WeightsError(f"{path}: no such weight file")
    if is_hdf5(path):
        with _open_hdf5(path) as f:
            yield _index_hdf5(f, path)
        return
    with open(path, "rb") as f:
        layers = _index_binary(f, path)
        if layers is None:
            layers = _parse_with_protobuf(path)
        if not layers:
            raise WeightsError(f"{path}: contains no layers; is it a .caffemodel?")
        yield layers


def _parse_with_protobuf(path):
    """Legacy V1 files and encodings the streaming reader leaves to protobuf (unpacked floats,
    groups): the whole message in memory, upgraded as a net prototxt would be."""
    try:
        param = read_binary(path, pb.NetParameter())
        upgrade_net(param, path)
    except PrototxtError as e:
        raise WeightsError(f"{e}; expected a binary .caffemodel or an HDF5 .caffemodel.h5") \
            from None
    return OrderedDict((layer.name, {i: _proto_blob(b) for i, b in enumerate(layer.blobs)})
                       for layer in param.layer)


def _proto_blob(proto):
    values = _values(proto)
    return StoredBlob(proto_shape(proto), is_legacy(proto), values.size,
                      lambda out: np.copyto(out, values))


def _values(proto):
    values = proto.double_data if len(proto.double_data) else proto.data
    return np.asarray(values, np.float32)


# Protobuf's wire format (protobuf.dev, "Encoding"): each field is a varint tag
# (number << 3 | wire type) and its payload; LEN payloads (messages, strings, packed repeated
# numbers) start with their byte length as a varint.
VARINT, I64, LEN, I32 = 0, 1, 2, 5
NET_V1_LAYERS, NET_LAYER = 2, 100
LAYER_NAME, LAYER_BLOBS = 1, 7
BLOB_LEGACY_DIMS = {1: 0, 2: 1, 3: 2, 4: 3}     # num, channels, height, width
BLOB_DATA, BLOB_SHAPE, BLOB_DOUBLE_DATA = 5, 7, 8


# Protobuf's largest message, which Caffe's and OpenCV's readers keep to. Streamed, a larger
# file would read and write in bounded memory, but nothing else could read it.
PROTOBUF_LIMIT = (1 << 31) - 1


class _Unusual(Exception):
    """An encoding the streaming reader leaves to protobuf's parser."""


class _Corrupt(Exception):
    """Bytes that no protobuf writer makes: a truncated or damaged file."""


def _index_binary(f, path):
    """The layers of a binary NetParameter, walking its wire format without reading the values
    (their file offsets are kept); None for files left to protobuf's parser."""
    wire, size = _Wire(f, path), _checked_size(f, path)
    layers = OrderedDict()
    try:
        for number, kind, start, end in wire.fields(0, size):
            if number == NET_V1_LAYERS and kind == LEN:
                return None
            if number == NET_LAYER and kind == LEN:
                name, blobs = _index_layer(wire, start, end)
                layers[name] = blobs
    except _Unusual:
        return None
    except _Corrupt as e:
        raise WeightsError(f"{path}: not a binary NetParameter (truncated or corrupt?): {e}") \
            from None
    return layers


def read_message_blobs(path, message, field_number):
    """Parse the binary `message` from `path`, all but its repeated BlobProto field
    `field_number`, which is returned as a list of StoredBlob (values read when asked)."""
    with open(path, "rb") as f:
        wire, size = _Wire(f, path), _checked_size(f, path)
        blobs, rest, previous = [], [], 0
        try:
            for number, kind, start, end in wire.fields(0, size):
                if number == field_number and kind == LEN:
                    blobs.append(_index_blob(wire, start, end))
                else:
                    rest.append(wire.read(previous, end))
                previous = end
            message.MergeFromString(b"".join(rest))
        except _Unusual:
            read_binary(path, message)
            field = getattr(message, message.DESCRIPTOR.fields_by_number[field_number].name)
            blobs = [_proto_blob(proto) for proto in field]
        except (_Corrupt, DecodeError) as e:
            raise WeightsError(f"{path}: not a binary {message.DESCRIPTOR.name} (truncated or "
                               f"corrupt?): {e}") from None
    return blobs


def _checked_size(f, path):
    size = os.fstat(f.fileno()).st_size
    if size > PROTOBUF_LIMIT:
        raise WeightsError(f"{path}: {size} bytes is larger than the {PROTOBUF_LIMIT} bytes "
                           "a protobuf may have")
    return size


def _index_layer(wire, start, end):
    name, blobs = "", {}
    for number, kind, s, e in wire.fields(start, end):
        if number == LAYER_NAME and kind == LEN:
            name = wire.text(s, e)
        elif number == LAYER_BLOBS and kind == LEN:
            blobs[len(blobs)] = _index_blob(wire, s, e)
    return name, blobs


def _index_blob(wire, start, end):
    """A StoredBlob reading its packed values from the file, float32 or float64 (Caffe's rule:
    double_data when it holds any value, else data); its shape as is_legacy says."""
    legacy_dims, legacy, shape = [0, 0, 0, 0], False, None
    segments = {BLOB_DATA: [], BLOB_DOUBLE_DATA: []}
    for number, kind, s, e in wire.fields(start, end):
        if number in BLOB_LEGACY_DIMS and kind == VARINT:
            legacy_dims[BLOB_LEGACY_DIMS[number]] = _int32(s)
            legacy = True
        elif number == BLOB_SHAPE and kind == LEN:
            shape = (shape or pb.BlobShape())
            try:
                shape.MergeFromString(wire.read(s, e))
            except DecodeError as error:
                raise _Corrupt(f"blob shape at byte {s}: {error}") from None
        elif number in segments:
            if kind != LEN:
                raise _Unusual()
            width = 8 if number == BLOB_DOUBLE_DATA else 4
            if (e - s) % width:
                raise _Corrupt(f"packed values at byte {s} are {e - s} bytes, not a multiple "
                               f"of {width}")
            segments[number].append((s, (e - s) // width))
    doubles = segments[BLOB_DOUBLE_DATA]
    kept, dtype = (doubles, "<f8") if sum(n for _, n in doubles) else \
        (segments[BLOB_DATA], "<f4")
    if legacy:
        stored = tuple(legacy_dims)
    else:
        stored = tuple(int(d) for d in shape.dim) if shape is not None else ()
    count = sum(n for _, n in kept)
    return StoredBlob(stored, legacy, count,
                      lambda out: wire.read_values(kept, np.dtype(dtype), out))


def _int32(value):
    """A varint as the int32 field it encodes (negative values are ten-byte varints)."""
    value &= (1 << 32) - 1
    return value - (1 << 32) if value >= 1 << 31 else value


class _Wire:
    """Reads protobuf fields from a file region by region, seeking past what is not asked for."""

    def __init__(self, f, path):
        self.f = f
        self.path = path

    def fields(self, start, end):
        """(number, wire type, start, end) of each field in [start, end); a VARINT field's
        `start` is its value."""
        position = start
        while position < end:
            tag, position = self.varint(position, end)
            number, kind = tag >> 3, tag & 7
            if number == 0:
                raise _Corrupt(f"field number 0 at byte {position}")
            if kind == VARINT:
                value, position = self.varint(position, end)
                yield number, kind, value, position
                continue
            if kind == LEN:
                length, position = self.varint(position, end)
                field_end = position + length
            elif kind in (I64, I32):
                field_end = position + (8 if kind == I64 else 4)
            else:
                raise _Unusual()
            if field_end > end:
                raise _Corrupt(f"a field at byte {position} runs past the end of its message "
                               f"(byte {field_end} of {end})")
            yield number, kind, position, field_end
            position = field_end

    def varint(self, position, end):
        self.f.seek(position)
        data = self.f.read(min(10, end - position))
        value = 0
        for i, byte in enumerate(data):
            value |= (byte & 0x7F) << (7 * i)
            if byte < 0x80:
                return value, position + i + 1
        raise _Corrupt(f"a number at byte {position} is cut off or longer than ten bytes")

    def read(self, start, end):
        self.f.seek(start)
        data = self.f.read(end - start)
        if len(data) != end - start:
            raise _Corrupt(f"the file ends at byte {start + len(data)}, inside a field that "
                           f"runs to byte {end}")
        return data

    def text(self, start, end):
        try:
            return self.read(start, end).decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"a layer name at byte {start} is not UTF-8 text") from None

    def read_values(self, segments, dtype, out):
        """The packed values of `segments` [(offset, count)] into the float32 array `out`:
        straight into it for float32, through bounded chunks for float64. The file is opened
        again if the index that found them has closed it."""
        if self.f.closed:
            with open(self.path, "rb") as f:
                _Wire(f, self.path).read_values(segments, dtype, out)
            return
        position = 0
        for offset, count in segments:
            self.f.seek(offset)
            if dtype == np.float32:
                self._read_exactly(memoryview(out[position:position + count]).cast("B"), offset)
            else:
                for first in range(0, count, DOUBLE_CHUNK):
                    n = min(DOUBLE_CHUNK, count - first)
                    chunk = np.empty(n, dtype)
                    self._read_exactly(memoryview(chunk).cast("B"), offset)
                    out[position + first:position + first + n] = chunk
            position += count

    def _read_exactly(self, view, offset):
        if self.f.readinto(view) != len(view):
            raise WeightsError(f"{self.path}: the file ended inside the values at byte {offset}; "
                               "it was truncated or changed while being read")


DOUBLE_CHUNK = 1 << 20     # float64 values converted per read


# An HDF5 group that holds a layer whose name cannot be its group path keeps the name here.
NAME_ATTRIBUTE = "layer_name"


# What h5py raises for a damaged file: OSError from HDF5 itself, the others from h5py's
# reading of broken headers, links and attributes.
HDF5_ERRORS = (OSError, KeyError, RuntimeError, ValueError, TypeError)


@contextmanager
def _open_hdf5(path):
    try:
        f = h5py.File(path, "r")
    except HDF5_ERRORS as e:
        raise WeightsError(f"{path}: cannot read as HDF5: {e}") from None
    with f:
        yield f


def _index_hdf5(f, path):
    try:
        if "data" not in f:
            raise WeightsError(f"{path}: no /data group; not a Caffe HDF5 weight file "
                               f"(top-level keys: {sorted(f.keys())})")
        layers = OrderedDict()
        for key, item in f["data"].items():
            if not isinstance(item, h5py.Group):
                raise WeightsError(f"{path}: /data/{key} is a dataset, not a layer's group")
            _read_layer_group(item, key, layers, path)
    except HDF5_ERRORS as e:
        raise WeightsError(f"{path}: cannot read as HDF5 (damaged file?): {e}") from None
    return layers


def _read_layer_group(group, name, layers, path):
    """Caffe names a layer's group by the layer name, and HDF5 reads each "/" in a name as a
    step into a nested group (`conv1/7x7_s2` is group `7x7_s2` in group `conv1`). So a group is
    a layer when it holds blob datasets, or nothing at all (a layer without parameters); a group
    holding only groups is a step of longer names. Its subgroups are layers too."""
    name = _attribute_text(group.attrs.get(NAME_ATTRIBUTE, name))
    blobs, children = {}, []
    for key, item in group.items():
        if isinstance(item, h5py.Group):
            children.append((key, item))
        elif not isinstance(item, h5py.Dataset):
            raise WeightsError(f"{path}: {group.name}/{key} cannot be read (damaged file?)")
        elif key.isdigit():
            blobs[int(key)] = hdf5_blob(item, path)
        else:
            raise WeightsError(f"{path}: {item.name} is not a blob index")
    if blobs or not children:
        if name in layers:
            raise WeightsError(f"{path}: two groups hold layer '{name}'")
        layers[name] = blobs
    for key, child in children:
        _read_layer_group(child, f"{name}/{key}", layers, path)


def hdf5_blob(dataset, path):
    """A StoredBlob of an HDF5 dataset, read straight into the caller's buffer; the file is
    opened again if it has been closed since."""
    shape, name = dataset.shape, dataset.name

    def read_into(out):
        try:
            if not out.size:
                return
            if dataset.id.valid:
                dataset.read_direct(out.reshape(shape))
                return
            with h5py.File(path, "r") as f:
                f[name].read_direct(out.reshape(shape))
        except HDF5_ERRORS as e:
            raise WeightsError(f"{path}: cannot read {name} (damaged file?): {e}") from None
    return StoredBlob(shape, False, int(np.prod(shape, dtype=np.int64)), read_into)


def _attribute_text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def hdf5_group_paths(names_and_counts):
    """Layer name -> its group path under /data, for layers given as (name, number of blobs).

    Caffe's path is the layer name. Names that HDF5 cannot hold as a path (an empty or "." part,
    or a path that another layer's blob dataset already takes, as `fc/1` beside a layer `fc` with
    two blobs) get a group of their own at the top whose NAME_ATTRIBUTE keeps the name."""
    plain = {name for name, _ in names_and_counts if _is_group_path(name)}
    datasets = {f"{name}/{i}" for name, count in names_and_counts if name in plain
                for i in range(count)}
    paths, taken = {}, {name.split("/")[0] for name in plain}
    for name, _ in names_and_counts:
        parts = name.split("/")
        if name in plain and not any("/".join(parts[:k]) in datasets
                                     for k in range(1, len(parts) + 1)):
            paths[name] = name
            continue
        base = quote(name, safe="").replace(".", "%2E") or "%"
        path, k = base, 1
        while path in taken:
            path, k = f"{base}~{k}", k + 1
        taken.add(path)
        paths[name] = path
    return paths


def _is_group_path(name):
    return all(part not in ("", ".") for part in name.split("/"))


def full_shape(shape, part):
    """The Caffe shape of a parameter of which a model-parallel rank holds `part`."""
    if part is None:
        return tuple(shape)
    shape = list(shape)
    shape[part.axis] = part.total
    return tuple(shape)


def take_part(array, part):
    """This rank's slice of a full parameter (the whole array when `part` is None)."""
    if part is None:
        return array
    index = [slice(None)] * array.ndim
    index[part.axis] = slice(part.start, part.stop)
    return array[tuple(index)]


def copy_from(net, path, complete=False):
    """Copy weights into layers of the same name, as Caffe does: source layers without a match
    are logged and ignored, target layers with parameters that the file does not hold keep their
    fillers (logged), and a file that fills none of them is an error (weights of another net).
    With `complete` (resuming a snapshot) every layer with parameters must be in the file.
    A file with a SHA-256 record must match it. Files hold whole parameters; a model-parallel
    layer takes its slice. One parameter at a time is read, straight into the net's blob when
    the layer holds all of it (so a file that fails a check part way has changed the blobs read
    before; Caffe aborts there)."""
    path = os.fspath(path)
    if os.path.exists(path):
        verify_checksum(path)
    borrowed = borrowed_blobs(net)
    filled = set()
    with open_weights(path) as source:
        if complete:
            _check_complete(net, path, source, borrowed)
        for name, blobs in source.items():
            layer = net.layer_dict.get(name)
            if layer is None:
                log.info(f"Ignoring source layer {name}")
                continue
            needed = {k for k in range(len(layer.blobs)) if (name, k) not in borrowed}
            if not needed <= set(blobs) or not set(blobs) <= set(range(len(layer.blobs))):
                raise WeightsError(
                    f"{path}: layer '{name}' has {len(blobs)} blobs in the file but "
                    f"{len(layer.blobs)} in the net ({layer.type}); is this file for another "
                    "net?")
            for i, stored in sorted(blobs.items()):
                _copy_blob(layer, i, stored, f"{path}: layer '{name}' blob {i}")
            if layer.blobs:
                filled.add(name)
        _report_unfilled(net, path, source, filled)


def _check_complete(net, path, source, borrowed):
    missing = [layer.name for layer in net.layers if layer.name not in source and
               any((layer.name, k) not in borrowed for k in range(len(layer.blobs)))]
    if missing:
        raise WeightsError(f"{path}: holds no weights for layer '{missing[0]}'"
                           f"{f' (nor {_some(missing[1:])})' if missing[1:] else ''}, which "
                           "a snapshot of this net must have: the file is damaged or from "
                           "another net; resume from an intact snapshot")


def _copy_blob(layer, i, stored, where):
    target = layer.blobs[i]
    part = layer.blob_parts.get(i)
    expected = full_shape(target.shape, part)
    if not shapes_fit(stored.shape, expected, stored.legacy) or \
            stored.count != np.prod(expected, dtype=np.int64):
        raise WeightsError(f"{where}: the file has shape {stored.shape}, the net expects "
                           f"{expected}; is this file for another net?")
    whole = part is None and target.data.flags.c_contiguous
    values = target.data.reshape(-1) if whole else np.empty(stored.count, np.float32)
    stored.read_into(values)
    bad = _count_non_finite(values)
    if bad:
        raise WeightsError(f"{where} holds {bad} NaN or infinite values; the file is damaged "
                           "or came from a diverged run")
    if not whole:
        target.data[...] = take_part(values.reshape(expected), part)


def _count_non_finite(values):
    """Summed in float64, which float32 values cannot overflow, the total is finite exactly when
    every value is; only then is nothing counted (in bounded pieces, no mask of the whole)."""
    if np.isfinite(np.add.reduce(values, dtype=np.float64)):
        return 0
    step = 1 << 22
    return sum(int(np.count_nonzero(~np.isfinite(values[k:k + step])))
               for k in range(0, values.size, step))


def borrowed_blobs(net):
    """(layer name, blob index) of each blob that is another layer's shared parameter (Caffe
    stores a shared parameter only under its owner)."""
    owner = {id(p.blob): (p.layer_name, p.index) for p in net.learnable_params}
    return {(layer.name, k) for layer in net.layers for k, blob in enumerate(layer.blobs)
            if owner.get(id(blob), (layer.name, k)) != (layer.name, k)}


def _report_unfilled(net, path, source, filled):
    kept = [layer.name for layer in net.layers if layer.blobs and layer.name not in filled]
    if not kept:
        return
    if not filled:
        held = [name for name, blobs in source.items() if blobs]
        raise WeightsError(
            f"{path}: no layer name in the file matches a layer of net '{net.name}' with "
            f"parameters (the file's: {_some(held) or 'none'}; the net's: {_some(kept)}); "
            "is this file for another net?")
    log.LOGGER.warning(f"{len(kept)} layers with parameters keep their initial values, "
                       f"{path} has none for them: {', '.join(kept)}")


def _some(names, limit=8):
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def layer_arrays(net, full=None):
    """[(layer, [(data, diff) per blob])] with `full` {(layer name, k): (data, diff)} replacing
    model-parallel slices by the whole parameters gathered from the group."""
    full = full or {}
    return [(layer, [full.get((layer.name, k), (blob.data, blob.diff))
                     for k, blob in enumerate(layer.blobs)]) for layer in net.layers]


def _net_pieces(net, write_diff, full):
    """The NetParameter Caffe's Net::ToProto writes (every layer's parameters and blobs) as the
    pieces of bytes protobuf would serialize it to, the values of each parameter straight from
    its array: saving needs no copy of the weights in memory."""
    yield pb.NetParameter(name=net.name).SerializeToString()
    for layer, arrays in layer_arrays(net, full):
        fields = _message_pieces(layer.param, LAYER_BLOBS,
                                [list(_blob_pieces(data, diff if write_diff else None))
                                 for data, diff in arrays])
        yield _tag(NET_LAYER, LEN) + _varint(_length(fields))
        yield from fields


def write_message(path, message, field_number, arrays, checksum=False):
    """Write `message` with `arrays` as its repeated BlobProto field `field_number` (a
    SolverState's history), atomically, one array at a time from memory to the file."""
    _check_binary_size(path, sum(np.size(array) for array in arrays))
    blobs = [list(_blob_pieces(array)) for array in arrays]
    return atomic_write(path, lambda tmp: _write_bytes(
        tmp, _message_pieces(message, field_number, blobs)), checksum)


def _message_pieces(message, field_number, blobs):
    """The bytes `message` serializes to with `blobs` (lists of pieces from _blob_pieces) as its
    repeated BlobProto field `field_number`, in pieces. Protobuf serializes the other fields,
    with an empty BlobProto where each blob goes (two bytes: tag, zero length); the blobs,
    written here, take those places."""
    shell = type(message)()
    shell.CopyFrom(message)
    field = getattr(shell, shell.DESCRIPTOR.fields_by_number[field_number].name)
    del field[:]
    for _ in blobs:
        field.add()
    data = shell.SerializeToString()
    tag = _tag(field_number, LEN)
    pieces, start, blobs = [], 0, iter(blobs)
    for number, kind, s, e in _Wire(io.BytesIO(data), "<message>").fields(0, len(data)):
        if number == field_number and kind == LEN:
            blob = next(blobs)
            pieces += [data[start:s - len(tag) - 1], tag + _varint(_length(blob))] + blob
            start = e
    return pieces + [data[start:]]


def _blob_pieces(data, diff=None):
    """A BlobProto's bytes in field-number order, as protobuf writes them: packed data (5) and
    diff (6) as little-endian float32 views of the arrays, then the shape (7)."""
    for number, array in ((pb.BlobProto.DATA_FIELD_NUMBER, data),
                          (pb.BlobProto.DIFF_FIELD_NUMBER, diff)):
        if array is None or not np.size(array):
            continue
        values = memoryview(np.ascontiguousarray(array, dtype="<f4").reshape(-1)).cast("B")
        yield _tag(number, LEN) + _varint(len(values))
        yield values
    shape = pb.BlobProto()
    shape.shape.dim.extend(int(d) for d in np.shape(data))
    yield shape.SerializeToString()


def _length(pieces):
    return sum(len(piece) for piece in pieces)


def _tag(number, kind):
    return _varint(number << 3 | kind)


def _varint(n):
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def save(net, path, write_diff=False, full=None, checksum=False, hdf5=None):
    """Binary .caffemodel, or Caffe's HDF5 layout when `hdf5` (default: `path` ends in .h5);
    written atomically, with a PATH.sha256 record when `checksum` (snapshots). Returns the file's
    SHA-256 when `checksum`, else None. Either way one parameter at a time goes to the file."""
    path = os.fspath(path)
    if path.endswith(".h5") if hdf5 is None else hdf5:
        return atomic_write(path, lambda tmp: _write_hdf5(net, tmp, write_diff, full), checksum)
    values = sum(np.size(array) for _, arrays in layer_arrays(net, full) for array, _ in arrays)
    _check_binary_size(path, values * (2 if write_diff else 1))
    return atomic_write(path, lambda tmp: _write_bytes(tmp, _net_pieces(net, write_diff, full)),
                        checksum)


def _check_binary_size(path, values):
    if 4 * values > PROTOBUF_LIMIT:
        raise WeightsError(f"{path}: {values} float values make a binary file larger than the "
                           f"{PROTOBUF_LIMIT} bytes a protobuf may have (Caffe could not read "
                           "it); save as HDF5 (a path ending in .h5, or snapshot_format: HDF5)")


def _write_bytes(path, pieces):
    with open(path, "wb") as f:
        for piece in pieces:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())


def _write_hdf5(net, path, write_diff, full):
    """Caffe's Net::ToHDF5 layout: /data/<layer>/<i> with a shared parameter only under its
    owner, /diff/<layer>/<i> with every blob's gradient."""
    layers = layer_arrays(net, full)
    borrowed = borrowed_blobs(net)
    paths = hdf5_group_paths([(layer.name, len(arrays)) for layer, arrays in layers])
    with h5py.File(path, "w") as f:
        for which, group_name in enumerate(["data"] + (["diff"] if write_diff else [])):
            group = f.create_group(group_name)
            for layer, arrays in layers:
                sub = group.require_group(paths[layer.name])
                if paths[layer.name] != layer.name:
                    sub.attrs[NAME_ATTRIBUTE] = layer.name
                for i, pair in enumerate(arrays):
                    if group_name == "diff" or (layer.name, i) not in borrowed:
                        sub.create_dataset(str(i), data=np.asarray(pair[which], np.float32))


def atomic_write(path, write, checksum=False):
    """Write through `write(tmp_path)`, then rename over `path`: readers never see half a file.

    With `checksum`, PATH.sha256 records the new file's digest, which is returned. The old record
    is removed before the rename and the new one written after it, so a crash at any point leaves
    either a file with its matching record or a file with none, never a mismatched pair."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = file_sha256(tmp) if checksum else None
        if checksum and os.path.exists(path + ".sha256"):
            os.remove(path + ".sha256")
        os.replace(tmp, path)
        _fsync_directory(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if digest is not None:
        _write_checksum(path, digest)
    return digest


def _fsync_directory(directory):
    """Make the rename itself durable (a crash right after it keeps the new file)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_checksum(path, digest):
    """Record the file's SHA-256 beside it (`PATH.sha256`, sha256sum's format)."""

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(f"{digest}  {os.path.basename(path)}\n")
    atomic_write(path + ".sha256", write)


def verify_checksum(path):
    """Compare a file with its recorded SHA-256; True if checked, False if none was recorded."""
    record = path + ".sha256"
    if not os.path.exists(record):
        return False
    with open(record) as f:
        fields = f.read().split()
    expected = fields[0] if fields else ""
    actual = file_sha256(path)
    if actual != expected:
        raise WeightsError(f"{path}: SHA-256 {actual[:16]}... does not match the {expected[:16]}... "
                           f"recorded in {record} when it was written: the file is corrupt or "
                           "was changed; resume from an earlier snapshot")
    return True


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
