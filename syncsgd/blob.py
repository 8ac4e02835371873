"""Blob: a named pair of float32 arrays (values and gradients), as in Caffe."""
import math
import os
import threading
import weakref
from collections import namedtuple

import numpy as np

from syncsgd.errors import ShapeError

# Where a model-parallel activation sits in the global (samples, features) matrix: rows
# first_sample.., features [first_feature, first_feature + local width) of `features`.
FeatureSlice = namedtuple("FeatureSlice", "first_sample first_feature features")
# One array of a blob, for kernels that read or write it in a form (0: data, 1: diff).
Side = namedtuple("Side", "blob side")

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
    """`data` and `diff` are float32 arrays of `shape`; writing into them changes the net.

    Between layers that run on oneDNN, values may instead sit in a blocked layout the primitives
    chose (a "form", kernels/onednn.Form), ahead of the arrays, as Caffe's SyncedMemory keeps
    them on the GPU: reading `data` or `diff` first brings the array up to date, and from then on
    the array is what counts. As with pycaffe on a GPU, an array kept from before a forward or
    backward pass is stale once the pass has run; read `data` / `diff` again. Only blobs whose
    layers all take forms (the net sets `takes_forms`) get one.
    """

    def __init__(self, shape=(), name=""):
        self.name = name
        self.layout = None    # a FeatureSlice for model-parallel activations, else None
        self.takes_forms = False
        self._root = None     # the blob whose rows this one views (lanes), else None
        self._lock = threading.Lock()   # held while an array is brought up to date
        self._views = []      # weak references to the blobs viewing this one's rows
        self._ahead = [False, False]    # some form of the family is ahead: data, diff
        self._forms = [None, None]      # this blob's forms, and whether each is ahead
        self._form_ahead = [False, False]
        self._cleared = False           # diff cleared but not yet zeroed (clear_diff)
        self._data = np.zeros(0, np.float32)
        self._diff = np.zeros(0, np.float32)
        self.reshape(*shape)

    @property
    def data(self):
        if self._ahead[0]:
            self._sync(0)
        return self._data

    @data.setter
    def data(self, array):
        self._drop(0)
        self._data = array

    @property
    def diff(self):
        if self._ahead[1]:
            self._sync(1)
        if self._cleared:
            self._zero_diff()
        return self._diff

    @diff.setter
    def diff(self, array):
        self._drop(1)
        self._cleared = False
        self._diff = array

    def clear_diff(self):
        """Zero the diff, lazily: the first kernel to add a gradient into it (gradient_target)
        overwrites it instead, saving a pass over the array and the kernel's read of it; any
        other reader of `diff` finds zeros."""
        self.overwrite(1)
        self._cleared = True

    @property
    def cleared(self):
        """Whether the diff was cleared and nothing has written it since (it reads as zeros)."""
        return self._cleared

    def gradient_target(self):
        """(diff array, beta) for a kernel that adds a gradient into the diff as
        diff = beta * diff + gradient: beta 0 when the diff was cleared (the kernel must then
        write every element), else 1."""
        with self._lock:
            cleared, self._cleared = self._cleared, False
        return self.diff, 0.0 if cleared else 1.0

    def _zero_diff(self):
        with self._lock:
            if self._cleared:
                self._diff.fill(0)
                self._cleared = False

    def array(self, side):
        """The data (side 0) or diff (1) array as it is, not brought up to date: for telling
        arrays apart, not for reading values."""
        return self._data if side == 0 else self._diff

    def view_rows(self, root, begin, end):
        """Make this blob a view of rows begin..end of `root` (a lane's share of the batch),
        brought up to date with it."""
        self.data, self.diff = root.data[begin:end], root.diff[begin:end]
        self.takes_forms = root.takes_forms
        self._root = root
        root._views = [ref for ref in root._views if ref() is not None] + [weakref.ref(self)]

    def _family(self):
        """This blob and, for a root, its live views: the blobs its reader brings up to date."""
        if self._root is not None:
            return [self]
        return [self] + [v for v in (ref() for ref in self._views) if v is not None]

    def __getstate__(self):
        """Pickled and copied up to date, as plain arrays: forms, views and the lock stay."""
        state = dict(self.__dict__, _data=self.data, _diff=self.diff, _root=None, _views=[],
                     _ahead=[False, False], _forms=[None, None], _form_ahead=[False, False],
                     _cleared=False)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def behind(self, side):
        """Whether a form (this blob's or a view's) holds newer values of `side` than the
        array, which reading `data` / `diff` brings up to date."""
        return any(blob._form_ahead[side] for blob in self._family())

    def form(self, side):
        """The form ahead of the array of `side` (0 data, 1 diff), or None."""
        return self._forms[side] if self._form_ahead[side] else None

    def spare_form(self, side):
        """This blob's last form of `side`, ahead or not, to be written again."""
        return self._forms[side]

    def keep(self, side, form):
        """`form` now holds the values of `side`, newer than the array and than any view's
        form, which is dropped. A lane's view also marks its root, whose readers bring every
        view's rows up to date."""
        for blob in self._family():
            blob._form_ahead[side] = False
        self._forms[side], self._form_ahead[side] = form, True
        self._ahead[side] = True
        if side == 1:
            self._cleared = False
            if self._root is not None:
                self._root._cleared = False
        if self._root is not None:
            self._root._ahead[side] = True

    def overwrite(self, side):
        """The array of `side`, for a layer to overwrite whole: the forms ahead of it (a root's
        and its views') are dropped, not brought up to date."""
        for blob in self._family():
            blob._form_ahead[side] = blob._ahead[side] = False
        if side == 1:
            self._cleared = False
        return self.array(side)

    def _drop(self, side):
        """The array of `side` is replaced: this blob's form is no longer ahead of it."""
        self._form_ahead[side] = False

    def settle(self):
        """Bring both arrays up to date with this blob's own forms, not its views': before
        lanes read their views, which see their root's array only (each lane brings only its
        own forms up to date, so that no lane touches another's)."""
        with self._lock:
            for side in (0, 1):
                if self._form_ahead[side]:
                    self._forms[side].to_plain(self.array(side))
                    self._form_ahead[side] = False

    def _sync(self, side):
        """Bring the array of `side` up to date, a root's with its views' forms too. Threads
        sharing a layer's chunks read the same blob: a flag clears only once its array holds
        the values, and the others wait for that."""
        with self._lock:
            family = self._family()
            for blob in family:
                if blob._form_ahead[side]:
                    blob._forms[side].to_plain(blob.array(side))
                    blob._form_ahead[side] = False
            for blob in family:
                blob._ahead[side] = False

    @property
    def shape(self):
        return self._data.shape

    @property
    def count(self):
        return self._data.size

    @property
    def num_axes(self):
        return self._data.ndim

    # pycaffe's legacy 4-D accessors, which users' Python layers still use.
    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def _legacy(self, axis):
        shape = self._data.shape
        return shape[axis] if axis < len(shape) else 1

    def reshape(self, *shape):
        """Resize to `shape`; the arrays are kept when the shape is unchanged, so views stay valid."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        shape = tuple(int(d) for d in shape)
        if shape == self._data.shape:
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
