"""Maps Caffe type strings to layer classes; layer modules register themselves on import.

A module is imported when a net first asks for its type, not when syncsgd is: every MPI rank and
every command starts a Python that needs a few of the ~100 layer modules. Which module holds a
type is read from the modules' `type = "..."` lines (one layer type per module); a test checks
that what they declare is what they register."""
import importlib
import os
import re

from syncsgd.errors import PrototxtError

_REGISTRY = {}
_DECLARED = re.compile(r'^    type = "([A-Za-z0-9_]+)"$', re.M)
_MODULES = None     # type -> module of syncsgd.layers, read once (declared_types)


def register(cls):
    """Class decorator: make `cls` the implementation of layer type `cls.type`."""
    if cls.type in _REGISTRY and _REGISTRY[cls.type] is not cls:
        raise ValueError(f"layer type {cls.type!r} registered twice")
    _REGISTRY[cls.type] = cls
    return cls


class TypeName(str):
    """A layer type's name, as pycaffe's layer_type_list() gives it, that also says where the
    type comes from: `fork` is the Caffe fork that defined it, or "" for BVLC Caffe's own."""

    def __new__(cls, name, fork):
        self = super().__new__(cls, name)
        self.fork = fork
        return self


def declared_types():
    """{type: module name} of the layer modules in syncsgd/layers, from their source text. The
    map is published whole, so a thread never sees it half read."""
    global _MODULES
    if _MODULES is None:
        found = {}
        folder = os.path.dirname(__file__)
        for entry in sorted(os.listdir(folder)):
            if entry.endswith(".py") and not entry.startswith("_"):
                with open(os.path.join(folder, entry), encoding="utf-8") as f:
                    for name in _DECLARED.findall(f.read()):
                        found[name] = f"{__package__}.{entry[:-3]}"
        _MODULES = found
    return _MODULES


def is_known(type_name):
    """Whether some layer module implements `type_name`, without importing it."""
    return type_name in _REGISTRY or type_name in declared_types()


def known_types():
    """The types a prototxt may name (internal ones left out), sorted. Imports every layer
    module."""
    for module in set(declared_types().values()):
        importlib.import_module(module)
    return [TypeName(name, cls.fork) for name, cls in sorted(_REGISTRY.items())
            if not cls.internal]


def layer_class(type_name, where=""):
    if type_name not in _REGISTRY and type_name in declared_types():
        importlib.import_module(declared_types()[type_name])
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise PrototxtError(
            f"{where}unknown layer type '{type_name}'. Known types: {', '.join(known_types())}"
        ) from None


def create(param, ctx, where=""):
    return layer_class(param.type, where)(param, ctx)
