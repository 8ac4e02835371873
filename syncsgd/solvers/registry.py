"""Solver classes by Caffe's `type` string and legacy `solver_type` enum value."""
from syncsgd.errors import PrototxtError

_BY_NAME = {}
_BY_ENUM = {}


def register(name, enum_value):
    def wrap(cls):
        cls.type = name
        _BY_NAME[name] = cls
        _BY_ENUM[enum_value] = cls
        return cls
    return wrap


def solver_class(param, source="<solver>"):
    """Caffe's rule: `type` if set, else the legacy `solver_type` enum."""
    if param.HasField("type") or not param.HasField("solver_type"):
        try:
            return _BY_NAME[param.type]
        except KeyError:
            raise PrototxtError(f"{source}: unknown solver type '{param.type}'; use one of "
                                f"{', '.join(sorted(_BY_NAME))}") from None
    return _BY_ENUM[param.solver_type]
