"""Mean images in Caffe's .binaryproto format (a serialized BlobProto)."""
import os

import numpy as np
from google.protobuf.message import DecodeError

from syncsgd.errors import DataError
from syncsgd.proto import pb


def load_mean(path):
    """The mean as a float32 array shaped as stored: `shape` if present, else the legacy
    (num, channels, height, width)."""
    if not os.path.isfile(path):
        raise DataError(f"mean file '{path}' not found; fix transform_param.mean_file or compute "
                        f"the mean of the training set")
    blob = pb.BlobProto()
    try:
        with open(path, "rb") as f:
            blob.ParseFromString(f.read())
    except DecodeError as exc:
        raise DataError(f"mean file '{path}' is not a binary BlobProto ({exc}); write it as "
                        f"Caffe's compute_image_mean does") from None
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    else:
        shape = (blob.num, blob.channels, blob.height, blob.width)
    values = blob.data if len(blob.data) else blob.double_data
    if len(values) != int(np.prod(shape)) or not len(values):
        raise DataError(f"mean file '{path}' holds {len(values)} values for shape {shape}; "
                        f"the file is damaged or not a mean image")
    return np.asarray(values, np.float32).reshape(shape)


def save_mean(path, mean):
    """Write `mean` with the legacy 4-D shape when it fits (what Caffe's tools read), else with
    `shape`."""
    mean = np.asarray(mean, np.float32)
    blob = pb.BlobProto()
    if mean.ndim <= 4:
        legacy = (1,) * (4 - mean.ndim) + mean.shape
        blob.num, blob.channels, blob.height, blob.width = legacy
    else:
        blob.shape.dim.extend(mean.shape)
    blob.data.extend(mean.ravel().tolist())
    with open(path, "wb") as f:
        f.write(blob.SerializeToString())


def fit_mean(mean, row_shape, path):
    """`mean` reshaped to one data row, if it is one row of that shape up to axes of size 1
    (a legacy (1, C, H, W) mean fits rows (C, H, W))."""
    def core(shape):
        return tuple(d for d in shape if d != 1)

    if mean.size != int(np.prod(row_shape)) or core(mean.shape) != core(row_shape):
        raise DataError(f"mean file '{path}' has shape {mean.shape} but data rows have shape "
                        f"{tuple(row_shape)}; compute the mean from this data set (before any "
                        f"crop)")
    return mean.reshape(row_shape)
