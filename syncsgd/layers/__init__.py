"""One module per layer type; importing this package registers them all."""
import importlib
import pkgutil

from syncsgd.layers.registry import create, known_types, layer_class, register

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["create", "known_types", "layer_class", "register"]
