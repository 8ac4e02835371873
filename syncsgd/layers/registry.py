"""Maps Caffe type strings to layer classes; layer modules register themselves on import."""
from syncsgd.errors import PrototxtError

_REGISTRY = {}


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


def known_types():
    """The types a prototxt may name (internal ones left out), sorted."""
    return [TypeName(name, cls.fork) for name, cls in sorted(_REGISTRY.items())
            if not cls.internal]


def layer_class(type_name, where=""):
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise PrototxtError(
            f"{where}unknown layer type '{type_name}'. Known types: {', '.join(known_types())}"
        ) from None


def create(param, ctx, where=""):
    return layer_class(param.type, where)(param, ctx)
