"""Weights in and out in Caffe's formats: binary .caffemodel (NetParameter, current or legacy V1)
and .caffemodel.h5 (`/data/<layer>/<i>`), matched to layers by name as Caffe does."""
import hashlib
import os
from collections import OrderedDict

import h5py
import numpy as np

from syncsgd.compile import read_binary, upgrade_net
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
    format. Caffe's HDF5 files leave out a shared parameter under the layers that borrow it."""
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
        if layer.blobs:
            layers[layer.name] = {i: (_values(b), proto_shape(b), not b.HasField("shape"))
                                  for i, b in enumerate(layer.blobs)}
    if not layers and not param.layer:
        raise WeightsError(f"{path}: contains no layers; is it a .caffemodel?")
    return layers


def _values(proto):
    values = proto.double_data if len(proto.double_data) else proto.data
    return np.asarray(values, np.float32)


def _read_hdf5(path):
    layers = OrderedDict()
    try:
        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise WeightsError(f"{path}: no /data group; not a Caffe HDF5 weight file "
                                   f"(top-level keys: {sorted(f.keys())})")
            for name, group in f["data"].items():
                blobs = {}
                for key in group:
                    if not key.isdigit():
                        raise WeightsError(f"{path}: /data/{name}/{key} is not a blob index")
                    array = np.asarray(group[key], np.float32)
                    blobs[int(key)] = (array.reshape(-1), array.shape, False)
                layers[name] = blobs
    except OSError as e:
        raise WeightsError(f"{path}: cannot read as HDF5: {e}") from None
    return layers


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
    """Copy weights into layers of the same name; source layers without a match are ignored.
    Files hold whole parameters; a model-parallel layer takes its slice."""
    source = read_weights(path)
    owners = {(p.layer_name, p.index) for p in net.learnable_params}
    for name, blobs in source.items():
        layer = net.layer_dict.get(name)
        if layer is None:
            continue
        borrowed = {k for k in range(len(layer.blobs)) if (name, k) not in owners and
                    any(p.blob is layer.blobs[k] for p in net.learnable_params)}
        needed = set(range(len(layer.blobs))) - borrowed
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
            lp.blobs.add().CopyFrom(array_to_proto(data, diff if write_diff else None))
    return param


def array_to_proto(data, diff=None):
    proto = pb.BlobProto()
    proto.shape.dim.extend(int(d) for d in data.shape)
    proto.data.extend(np.asarray(data, np.float32).ravel().tolist())   # 4x faster than an array
    if diff is not None:
        proto.diff.extend(np.asarray(diff, np.float32).ravel().tolist())
    return proto


def save(net, path, write_diff=False, full=None, checksum=False):
    """Binary .caffemodel, or Caffe's HDF5 layout when `path` ends in .h5; written atomically,
    with a PATH.sha256 record when `checksum` (snapshots). Returns the file's SHA-256 when
    `checksum`, else None."""
    path = os.fspath(path)
    if path.endswith(".h5"):
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
    layers = layer_arrays(net, full)
    with h5py.File(path, "w") as f:
        for which, group_name in enumerate(["data"] + (["diff"] if write_diff else [])):
            group = f.create_group(group_name)
            for layer, arrays in layers:
                sub = group.require_group(layer.name)
                for i, pair in enumerate(arrays):
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
