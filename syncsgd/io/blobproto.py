"""pycaffe's converters between numpy arrays and Caffe's BlobProto / Datum messages (mean files,
LMDB records), with pycaffe's names and shapes."""
import numpy as np

from syncsgd.proto import pb


def blobproto_to_array(blob, return_diff=False):
    """The blob's data (or diff) shaped by its legacy num/channels/height/width when it has them,
    else by `shape`."""
    values = np.array(blob.diff if return_diff else blob.data)
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return values.reshape(blob.num, blob.channels, blob.height, blob.width)
    return values.reshape(tuple(blob.shape.dim))


def array_to_blobproto(arr, diff=None):
    """A BlobProto with `shape` and the values of `arr` (and `diff`)."""
    blob = pb.BlobProto()
    blob.shape.dim.extend(np.shape(arr))
    blob.data.extend(np.asarray(arr, np.float64).ravel())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, np.float64).ravel())
    return blob


def arraylist_to_blobprotovector_str(arraylist):
    """Arrays serialised as one BlobProtoVector."""
    vec = pb.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(arr) for arr in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(data):
    vec = pb.BlobProtoVector()
    vec.ParseFromString(data)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """A (K, H, W) array as a Datum: uint8 pixels in `data`, anything else in `float_data`."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = pb.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(np.float64).ravel())
    if label is not None:
        datum.label = label
    return datum


def datum_to_array(datum):
    """A Datum's values as (K, H, W): uint8 from `data`, float from `float_data`. An encoded
    (PNG/JPEG) datum has to be decoded first."""
    if len(datum.data):
        return np.frombuffer(datum.data, np.uint8).reshape(datum.channels, datum.height,
                                                           datum.width)
    return np.array(datum.float_data, np.float64).reshape(datum.channels, datum.height,
                                                          datum.width)
