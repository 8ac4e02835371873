"""Blob: a named pair of float32 arrays (values and gradients), as in Caffe."""
import math
import os
from collections import namedtuple

import numpy as np

from syncsgd.errors import ShapeError

# Where a model-parallel activation sits in the global (samples, features) matrix: rows
# first_sample.., features [first_feature, first_feature + local width) of `features`.
FeatureSlice = namedtuple("FeatureSlice", "first_sample first_feature features")

MAX_BLOB_ELEMENTS = 2**31 - 1  # Caffe's limit (INT_MAX); larger blobs are refused before allocation
try:
    _MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
except (ValueError, OSError, AttributeError):
    _MEMORY = 2**62


def check_shape(shape, name, arrays=1):
    """Refuse, before allocating, a float32 shape with a negative dimension, more elements than a
    Caffe blob may hold, or `arrays` arrays of it that would not fit in this machine's memory."""
    if any(d < 0 for d in shape):
        raise ShapeError(f"blob '{name}': negative dimension in shape {shape}")
    count = math.prod(shape)        # Python integers: numpy's int64 product can wrap around
    if count > MAX_BLOB_ELEMENTS:
        raise ShapeError(f"blob '{name}': shape {shape} has {count} elements, more than the "
                         f"{MAX_BLOB_ELEMENTS} a blob may hold; reduce the batch size or the "
                         "layer sizes")
    if 4 * arrays * count > _MEMORY:
        raise ShapeError(f"blob '{name}': shape {shape} needs {4 * arrays * count / 2**30:.1f} "
                         f"GiB, more than this machine's {_MEMORY / 2**30:.1f} GiB; reduce "
                         "the batch size or the layer sizes")


class Blob:
    """`data` and `diff` are float32 arrays of `shape`; writing into them changes the net."""

    def __init__(self, shape=(), name=""):
        self.name = name
        self.layout = None    # a FeatureSlice for model-parallel activations, else None
        self.data = np.zeros(0, np.float32)
        self.diff = np.zeros(0, np.float32)
        self.reshape(*shape)

    @property
    def shape(self):
        return self.data.shape

    @property
    def count(self):
        return self.data.size

    @property
    def num_axes(self):
        return self.data.ndim

    # pycaffe's legacy 4-D accessors, which users' Python layers still use.
    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def _legacy(self, axis):
        shape = self.data.shape
        return shape[axis] if axis < len(shape) else 1

    def reshape(self, *shape):
        """Resize to `shape`; the arrays are kept when the shape is unchanged, so views stay valid."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        shape = tuple(int(d) for d in shape)
        if shape == self.data.shape:
            return
        check_shape(shape, self.name, arrays=2)
        try:
            self.data = np.zeros(shape, np.float32)
            self.diff = np.zeros(shape, np.float32)
        except MemoryError:
            raise ShapeError(f"blob '{self.name}': no memory left for shape {shape} "
                             f"({8 * math.prod(shape) / 2**30:.2f} GiB with its gradient); "
                             "reduce the batch size or the layer sizes") from None

    def reshape_like(self, other):
        """Same shape, and the same place in the global activation matrix."""
        self.reshape(*other.shape)
        self.layout = other.layout

    def __repr__(self):
        return f"Blob({self.name!r}, shape={self.shape})"
