"""Python: a layer written by the user in Python, with pycaffe's protocol, so custom layers
written for Caffe carry over.

    layer { name: "scale" type: "Python" bottom: "x" top: "y"
            python_param { module: "my_layers" layer: "Scale" param_str: "{'factor': 2}" } }

The module is imported by name (it must be importable: put its folder on PYTHONPATH, as with
Caffe) and `layer` names a class in it, normally a subclass of PythonLayer (syncsgd/python_layers/layer.py, re-exported as
syncsgd.Layer, pycaffe's caffe.Layer). The class defines setup(bottom, top),
reshape(bottom, top), forward(bottom, top) and backward(top, propagate_down, bottom); bottom and
top are lists of Blob (.data, .diff, .reshape(*shape)); it reads self.param_str and self.phase
and keeps learnable blobs in self.blobs (self.blobs.add_blob(*shape)), whose gradients backward
accumulates.

A well-known public layer (py-faster-rcnn's rpn.proposal_layer.ProposalLayer) runs from
syncsgd's own version when its module is not importable, as OpenCV runs it, and says so in the
log; the user's module wins whenever it can be imported.

On N ranks each rank's layer sees only its slice of the batch. A layer whose result depends on
the whole batch (a loss normalised by the batch size) should use self.ctx.global_batch and
self.ctx.allreduce_sum, as the built-in layers do, to match a one-process run.
"""
import importlib

import numpy as np

from syncsgd import log
from syncsgd.blob import Blob
from syncsgd.errors import PrototxtError
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.python_layers import builtin
from syncsgd.python_layers.layer import BlobList


# Optional methods the net and solver call on layers that have them (getattr with a default).
_FRAMEWORK_HOOKS = frozenset({"seek", "close"})


@register
class PythonModuleLayer(Layer):
    """Runs the user's class: every verb is passed on to it. self.blobs is the user object's
    blob list itself, so the net, solver and weight files see its parameters."""
    type = "Python"

    def __init__(self, param, ctx):
        super().__init__(param, ctx)
        self.impl = user_class(param)(param)
        self.impl.param_str = param.python_param.param_str
        self.impl.phase = ctx.phase
        self.impl.ctx = ctx
        if not isinstance(getattr(self.impl, "blobs", None), list):
            self.impl.blobs = BlobList()
        self.blobs = self.impl.blobs

    def setup(self, bottom, top):
        self.impl.setup(bottom, top)
        for k, blob in enumerate(self.blobs):
            if not isinstance(blob, Blob) or blob.data.dtype != np.float32:
                self.fail(f"self.blobs[{k}] must be a float32 Blob (use self.blobs.add_blob)")

    def reshape(self, bottom, top):
        self.impl.reshape(bottom, top)

    def forward(self, bottom, top):
        self.impl.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.impl.backward(top, list(propagate_down), bottom)

    def __getattr__(self, name):
        """In pycaffe net.layers[i] is the user's own object: its attributes read through, but
        for the hooks the net and solver look for on layers (a user's `close` is not ours)."""
        impl = self.__dict__.get("impl")
        if impl is None or name in _FRAMEWORK_HOOKS:
            raise AttributeError(name)
        return getattr(impl, name)


def user_class(param):
    """The class python_param names, imported from exactly the module it names; when that
    module is not importable, syncsgd's built-in version of a well-known public layer
    (syncsgd/python_layers), as OpenCV runs them."""
    where = f"layer '{param.name}' (Python)"
    module_name, class_name = param.python_param.module, param.python_param.layer
    if not module_name or not class_name:
        raise PrototxtError(f"{where}: python_param needs `module` (an importable module) and "
                            f"`layer` (a class in it)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name and not module_name.startswith(f"{exc.name}."):
            raise   # the user's module itself failed to import something: show that
        known = builtin(module_name, class_name)
        if known is not None:
            log.info(f"{where}: module '{module_name}' is not importable; running syncsgd's "
                     f"built-in {class_name} (from {known[1]})")
            return known[0]
        raise PrototxtError(f"{where}: python_param.module '{module_name}' cannot be imported; "
                            f"add the folder that holds {module_name.replace('.', '/')}.py to "
                            f"PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise PrototxtError(f"{where}: module '{module_name}' ({module.__file__}) has no class "
                            f"'{class_name}'; python_param.layer must name one")
    return cls
