"""One module per layer type; importing this package registers them all.

Attribute access by a Caffe type name (`syncsgd.layers.Convolution(...)`) is pycaffe's
`caffe.layers` of net_spec, so `from syncsgd import layers as L` works as in pycaffe scripts.
"""
import importlib
import pkgutil

from syncsgd.layers.registry import create, known_types, layer_class, register

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["create", "known_types", "layer_class", "register"]


def __getattr__(name):
    if name.startswith("_") or not name[:1].isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from syncsgd.net_spec import layers
    return getattr(layers, name)
