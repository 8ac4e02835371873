"""One module per layer type, imported when a net first names its type (registry.py).

Attribute access by a Caffe type name (`syncsgd.layers.Convolution(...)`) is pycaffe's
`caffe.layers` of net_spec, so `from syncsgd import layers as L` works as in pycaffe scripts.
"""
from syncsgd.layers.registry import create, is_known, known_types, layer_class, register

__all__ = ["create", "is_known", "known_types", "layer_class", "register"]


def __getattr__(name):
    if name.startswith("_") or not name[:1].isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from syncsgd.net_spec import layers
    return getattr(layers, name)
