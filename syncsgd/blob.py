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


# Where the current values of one side (data or diff) of a blob live: Blob._head.
ARRAY = "array"        # the numpy array
FORM = "form"          # this blob's oneDNN form (kernels/onednn.Form), newer than the array
VIEWS = "views"        # (a lanes root) some of its views' forms, each newer for its own rows
ROOT = "root"          # (a view) its root's form or cleared zeros, newer for every row
CLEARED = "cleared"    # (diff) zeros that nothing has written yet


class Blob:
    """`data` and `diff` are float32 arrays of `shape`; writing into them changes the net.

    Between layers that run on oneDNN, values may instead sit in a blocked layout the primitives
    chose (a "form", kernels/onednn.Form), ahead of the arrays, as Caffe's SyncedMemory keeps
    them on the GPU; and inside the solver's step a parameter's diff may be "cleared": zeros
    that the first kernel to add a gradient writes over instead of adding to. One field per side,
    `_head`, says where the current values are (ARRAY, FORM, VIEWS, ROOT, CLEARED), and only the
    accessors below change it: reading `data` / `diff` (or sync) brings the array up to date
    whatever the head, so a stale copy never wins. As with pycaffe on a GPU, an array kept from
    before a forward or backward pass that left a form may be stale: read `data` / `diff`
    again. Only blobs whose layers all take forms (the net sets `takes_forms`) get one.
    """

    def __init__(self, shape=(), name=""):
        self.name = name
        self.layout = None    # a FeatureSlice for model-parallel activations, else None
        self.takes_forms = False
        # Set by the net: the layer writing it leaves it in a form (Layer.leaves_forms), so
        # that a layer after it timing its kernels times them on a form, not on an array.
        self.gets_forms = False
        self._root = None     # the blob whose rows this one views (lanes), else None
        self._lock = threading.Lock()   # held while an array is brought up to date
        self._views = []      # weak references to the blobs viewing this one's rows
        self._head = [ARRAY, ARRAY]     # where each side's current values are
        self._forms = [None, None]      # this blob's last form of each side (ahead if FORM)
        self._data = np.zeros(0, np.float32)
        self._diff = np.zeros(0, np.float32)
        self.reshape(*shape)

    # -- reading: the array, up to date ---------------------------------------------------------
    @property
    def data(self):
        if self._head[0] is not ARRAY:
            self.sync(0)
        return self._data

    @data.setter
    def data(self, array):
        self._replace(0, array)

    @property
    def diff(self):
        if self._head[1] is not ARRAY:
            self.sync(1)
        return self._diff

    @diff.setter
    def diff(self, array):
        self._replace(1, array)

    def head(self, side):
        """Where the current values of `side` (0 data, 1 diff) are: ARRAY, FORM, VIEWS, ROOT
        or CLEARED."""
        return self._head[side]

    def sync(self, side):
        """Bring the array of `side` up to date. Threads sharing a layer's chunks read the same
        blob: the head becomes ARRAY only once the array holds the values, the others waiting
        on the lock meanwhile."""
        if self._root is not None and self._head[side] is ROOT:
            self._root.sync(side)
        with self._lock:
            head = self._head[side]
            if head is FORM:
                self._forms[side].to_plain(self.array(side))
            elif head is VIEWS:
                for view in self._live_views():
                    if view._head[side] is FORM:
                        view.sync(side)
            elif head is CLEARED:
                self.array(side).fill(0)
            self._head[side] = ARRAY

    def settle(self):
        """Bring both arrays up to date with this blob's own form or cleared zeros, not its
        views' forms: before lanes read their views (each lane brings only its own view's
        forms up to date, so that no lane touches another's)."""
        for side in (0, 1):
            if self._head[side] in (FORM, CLEARED):
                self.sync(side)

    def array(self, side):
        """The data (side 0) or diff (1) array as it is, not brought up to date: for telling
        arrays apart, not for reading values."""
        return self._data if side == 0 else self._diff

    def form(self, side):
        """The form holding the current values of `side`, or None when they are elsewhere."""
        return self._forms[side] if self._head[side] is FORM else None

    def spare_form(self, side):
        """This blob's last form of `side`, current or not, to be written again."""
        return self._forms[side]

    # -- writing --------------------------------------------------------------------------------
    def overwrite(self, side):
        """The array of `side`, for a kernel to write whole: what is ahead of it (a form, the
        views' forms, cleared zeros) is dropped, not brought up to date."""
        self._from_root(side)
        self._head[side] = ARRAY
        for view in self._live_views():
            view._head[side] = ARRAY
        return self.array(side)

    def keep(self, side, form):
        """`form` now holds the current values of `side`. A lane's view also marks its root,
        whose readers bring every view's rows up to date; a root's form is newer than every
        view's rows."""
        self._from_root(side)
        self._forms[side], self._head[side] = form, FORM
        if self._root is not None:
            self._root._head[side] = VIEWS
        for view in self._live_views():
            view._head[side] = ROOT

    def share_data(self, other):
        """Caffe's ShareData: this blob's data becomes `other`'s array, brought up to date,
        and writes to either show in both. Not between lanes' views or roots, whose arrays the
        views hold: there it returns False and changes nothing."""
        return self._share(other, 0)

    def share_diff(self, other):
        """Caffe's ShareDiff: share_data's counterpart for the diffs."""
        return self._share(other, 1)

    def _share(self, other, side):
        if self._viewed() or other._viewed():
            return False
        self._replace(side, other.data if side == 0 else other.diff)
        return True

    def _viewed(self):
        """Whether lanes view this blob or it is a lane's view: its arrays are shared rows."""
        return self._root is not None or bool(self._live_views())

    def exchange_data(self, array):
        """Make `array` (of this blob's shape) the data and return the array it replaces,
        brought up to date: for a layer in place that writes its output beside its input and
        keeps the input for backward, instead of copying it. Not where lanes view the blob
        (their views hold its array): there it returns None and changes nothing."""
        if self._viewed():
            return None
        old = self.data
        self._replace(0, array)
        return old

    def clear_diff(self):
        """Zero the diff lazily: the first kernel to add a gradient into it (gradient_target)
        writes over it instead, saving a pass over the array and the kernel's read of it; any
        reader of `diff` finds zeros. An array kept from before holds the old values until
        then, so only the solver's step (Net.forward_backward(clear=True)) and lanes' own
        blobs use this; Net.clear_param_diffs zeroes at once, as pycaffe users expect."""
        self._from_root(1)
        self._head[1] = CLEARED
        for view in self._live_views():
            view._head[1] = ROOT

    def zero_diff(self):
        """Zero the diff now (what pycaffe's clear_param_diffs does to each parameter)."""
        self.overwrite(1).fill(0)

    def gradient_target(self):
        """(diff array, beta) for a kernel that adds a gradient into the diff as
        diff = beta * diff + gradient: beta 0 when the diff was cleared (the kernel must then
        write every element), else 1."""
        with self._lock:
            cleared = self._head[1] is CLEARED
            if cleared:
                self._head[1] = ARRAY
        return self.diff, 0.0 if cleared else 1.0

    @property
    def cleared(self):
        """Whether the diff was cleared and nothing has written it since (it reads as zeros)."""
        return self._head[1] is CLEARED

    def _replace(self, side, array):
        """A new array for `side`: it is what counts from now on."""
        self._head[side] = ARRAY
        if side == 0:
            self._data = array
        else:
            self._diff = array

    def _from_root(self, side):
        """Before a view writes its rows: a root whose own form or zeros are newer for every
        row is brought up to date first, so that the other rows keep their values."""
        root = self._root
        if root is not None and root._head[side] in (FORM, CLEARED):
            root.sync(side)
        if root is not None and self._head[side] is ROOT:
            self._head[side] = ARRAY

    # -- lanes' views ---------------------------------------------------------------------------
    def view_rows(self, root, begin, end):
        """Make this blob a view of rows begin..end of `root` (a lane's share of the batch),
        brought up to date with it."""
        self.data, self.diff = root.data[begin:end], root.diff[begin:end]
        self.takes_forms, self.gets_forms = root.takes_forms, root.gets_forms
        self._root = root
        root._views = [ref for ref in root._views if ref() is not None] + [weakref.ref(self)]

    def _live_views(self):
        return [v for v in (ref() for ref in self._views) if v is not None]

    def __getstate__(self):
        """Pickled and copied up to date, as plain arrays: forms, views and the lock stay."""
        state = dict(self.__dict__, _data=self.data, _diff=self.diff, _root=None, _views=[],
                     _head=[ARRAY, ARRAY], _forms=[None, None])
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
