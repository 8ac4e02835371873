"""Scratch buffers shared by every layer of a thread.

Layers run one after another, so one buffer per purpose (columns, feature matrix, oneDNN's
blocked copies) serves them all, grown to the largest request, instead of one per layer: the
working set stays that of the largest layer. A buffer's contents do not survive another layer's
use unless its owner checks that it still holds them (claim / holds).
"""
import math
import threading

import numpy as np

_LOCAL = threading.local()


def scratch(name, shape):
    """A float32 buffer of `shape` shared by every layer of this thread under `name`; its old
    contents are undefined. Asked again for the same shape, it is the same array object (which
    oneDNN's calls recognise without asking numpy for its address)."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
        _LOCAL.owners = {}
        _LOCAL.views = {}
    _LOCAL.owners[name] = None
    shape = tuple(shape)
    view = _LOCAL.views.get(name)
    if view is not None and view.shape == shape:
        return view
    count = math.prod(shape)
    buffer = buffers.get(name)
    if buffer is None or buffer.size < count:
        _LOCAL.views.pop(name, None)
        buffers.pop(name, None)          # free the old buffer before making the larger one
        buffer = buffers[name] = np.empty(count, np.float32)
    view = _LOCAL.views[name] = buffer[:count].reshape(shape)
    return view


def claim(name, owner):
    """Mark scratch `name` as holding `owner`'s data (until the next scratch(name) call)."""
    _LOCAL.owners[name] = owner


def holds(name, owner):
    owners = getattr(_LOCAL, "owners", {})
    return owners.get(name) is not None and owners.get(name) == owner


def scratch_at_least(name, count):
    """A flat float32 buffer of at least `count` values for this thread under `name` (oneDNN's
    scratchpads, whose sizes differ from kernel to kernel): the same array object until a larger
    request replaces it, so a memory object pointed at it need not be pointed again."""
    grown = getattr(_LOCAL, "grown", None)
    if grown is None:
        grown = _LOCAL.grown = {}
    buffer = grown.get(name)
    if buffer is None or buffer.size < count:
        grown.pop(name, None)
        buffer = grown[name] = np.empty(count, np.float32)
    return buffer
