"""Weights in and out in Caffe's formats: binary .caffemodel (NetParameter, current or legacy V1)
and .caffemodel.h5 (`/data/<layer>/<i>`), matched to layers by name as Caffe does."""
import hashlib
import os
from collections import OrderedDict
from urllib.parse import quote

import h5py
import numpy as np

from syncsgd import log
from syncsgd.compile import upgrade_net
from syncsgd.proto.files import read_binary
from syncsgd.errors import PrototxtError, WeightsError
from syncsgd.proto import pb


def is_hdf5(path):
    return str(path).endswith(".h5") or (os.path.isfile(path) and h5py.is_hdf5(path))


def proto_shape(proto):
    """The blob's shape: `shape` if present, else the legacy 4-D num/channels/height/width."""
    if proto.HasField("shape"):
        return tuple(int(d) for d in proto.shape.dim)
    return (proto.num, proto.channels, proto.height, proto.width)


def shapes_fit(stored, target, legacy):
    """Caffe's Blob::ShapeEquals: a legacy 4-D shape fits a blob of up to 4 axes whose shape,
    padded on the left with 1s, is the same (an InnerProduct weight stored as 1x1xMxN)."""
    if not legacy:
        return tuple(stored) == tuple(target)
    if len(target) > 4:
        return False
    return tuple(stored) == (1,) * (4 - len(target)) + tuple(target)


def blob_array(proto, target_shape, where):
    """A float32 array of `target_shape` from a BlobProto, checking the stored shape fits."""
    legacy = not proto.HasField("shape")
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


def read_weights(path):
    """OrderedDict layer name -> {blob index: (array, stored shape, legacy flag)}, from either
    format, layers without blobs included (Caffe reports those it ignores too). Caffe's HDF5
    files leave out a shared parameter under the layers that borrow it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise WeightsError(f"{path}: no such weight file")
    if is_hdf5(path):
        return _read_hdf5(path)
    try:
        param = read_binary(path, pb.NetParameter())
        upgrade_net(param, path)
    except PrototxtError as e:
        raise WeightsError(f"{e}; expected a binary .caffemodel or an HDF5 .caffemodel.h5") \
            from None
    layers = OrderedDict()
    for layer in param.layer:
        layers[layer.name] = {i: (_values(b), proto_shape(b), not b.HasField("shape"))
                              for i, b in enumerate(layer.blobs)}
    if not layers:
        raise WeightsError(f"{path}: contains no layers; is it a .caffemodel?")
    return layers


def _values(proto):
    values = proto.double_data if len(proto.double_data) else proto.data
    return np.asarray(values, np.float32)


# An HDF5 group that holds a layer whose name cannot be its group path keeps the name here.
NAME_ATTRIBUTE = "layer_name"


def _read_hdf5(path):
    layers = OrderedDict()
    try:
        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise WeightsError(f"{path}: no /data group; not a Caffe HDF5 weight file "
                                   f"(top-level keys: {sorted(f.keys())})")
            for key, item in f["data"].items():
                if not isinstance(item, h5py.Group):
                    raise WeightsError(f"{path}: /data/{key} is a dataset, not a layer's group")
                _read_layer_group(item, key, layers, path)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read as HDF5: {e}") from None
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
        elif key.isdigit():
            array = np.asarray(item, np.float32)
            blobs[int(key)] = (array.reshape(-1), array.shape, False)
        else:
            raise WeightsError(f"{path}: {item.name} is not a blob index")
    if blobs or not children:
        if name in layers:
            raise WeightsError(f"{path}: two groups hold layer '{name}'")
        layers[name] = blobs
    for key, child in children:
        _read_layer_group(child, f"{name}/{key}", layers, path)


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


def copy_from(net, path):
    """Copy weights into layers of the same name, as Caffe does: source layers without a match
    are logged and ignored, target layers with parameters that the file does not hold keep their
    fillers (logged), and a file that fills none of them is an error (weights of another net).
    Files hold whole parameters; a model-parallel layer takes its slice."""
    source = read_weights(path)
    borrowed = borrowed_blobs(net)
    filled = set()
    for name, blobs in source.items():
        layer = net.layer_dict.get(name)
        if layer is None:
            log.info(f"Ignoring source layer {name}")
            continue
        needed = {k for k in range(len(layer.blobs)) if (name, k) not in borrowed}
        if not needed <= set(blobs) or not set(blobs) <= set(range(len(layer.blobs))):
            raise WeightsError(
                f"{path}: layer '{name}' has {len(blobs)} blobs in the file but "
                f"{len(layer.blobs)} in the net ({layer.type}); is this file for another net?")
        for i, (values, stored, legacy) in sorted(blobs.items()):
            target = layer.blobs[i]
            part = layer.blob_parts.get(i)
            expected = full_shape(target.shape, part)
            if not shapes_fit(stored, expected, legacy) or values.size != np.prod(expected):
                raise WeightsError(
                    f"{path}: layer '{name}' blob {i}: the file has shape {tuple(stored)}, the "
                    f"net expects {expected}; is this file for another net?")
            if not np.isfinite(values).all():
                bad = int(np.count_nonzero(~np.isfinite(values)))
                raise WeightsError(f"{path}: layer '{name}' blob {i} holds {bad} NaN or infinite "
                                   "values; the file is damaged or came from a diverged run")
            target.data[...] = take_part(values.reshape(expected), part)
        if layer.blobs:
            filled.add(name)
    _report_unfilled(net, path, source, filled)


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


def net_to_proto(net, write_diff=False, full=None):
    """The NetParameter Caffe's Net::ToProto writes: every layer's parameters and blobs."""
    param = pb.NetParameter(name=net.name)
    for layer, arrays in layer_arrays(net, full):
        lp = param.layer.add()
        lp.CopyFrom(layer.param)
        del lp.blobs[:]
        for data, diff in arrays:
            write_blob(lp.blobs.add(), data, diff if write_diff else None)
    return param


def array_to_proto(data, diff=None):
    return write_blob(pb.BlobProto(), data, diff)


def write_blob(proto, data, diff=None):
    """Fill the BlobProto `proto` with the arrays, parsing the values in from their packed wire
    form: a Python list on the way would hold a float object per value, for every parameter of
    the net at once."""
    proto.shape.dim.extend(int(d) for d in data.shape)
    wire = _packed_floats(pb.BlobProto.DATA_FIELD_NUMBER, data)
    if diff is not None:
        wire += _packed_floats(pb.BlobProto.DIFF_FIELD_NUMBER, diff)
    proto.MergeFromString(wire)
    return proto


def _packed_floats(field_number, array):
    """A packed repeated float field as protobuf writes it: tag, byte length, little-endian."""
    values = np.ascontiguousarray(array, dtype="<f4").tobytes()
    return _varint(field_number << 3 | 2) + _varint(len(values)) + values


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
    SHA-256 when `checksum`, else None."""
    path = os.fspath(path)
    if path.endswith(".h5") if hdf5 is None else hdf5:
        return atomic_write(path, lambda tmp: _write_hdf5(net, tmp, write_diff, full), checksum)
    else:
        data = net_to_proto(net, write_diff, full).SerializeToString()
        return atomic_write(path, lambda tmp: _write_bytes(tmp, data), checksum)


def _write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)
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
