"""Errors a user can act on: each names the file, line or field at fault and how to fix it."""


class SyncSGDError(Exception):
    """Base class; the command-line tools print these without a traceback."""


class PrototxtError(SyncSGDError):
    """A prototxt that does not parse, or a net that does not make sense."""


class FillerError(PrototxtError):
    """A weight filler whose settings cannot fill a blob; the net adds the layer's name."""


class ShapeError(SyncSGDError):
    """Blob shapes that do not fit a layer."""


class WeightsError(SyncSGDError):
    """A weight or solver-state file that cannot be read or does not fit the net."""


class SnapshotError(SyncSGDError):
    """A snapshot_prefix that cannot be written or is in use by another run, or a run that
    could save none of its snapshots."""


class DataError(SyncSGDError):
    """A data source (HDF5, LMDB, list file) that is missing or malformed."""


class DistributedError(SyncSGDError):
    """Ranks that disagree, stall or fail."""


class NumericalError(SyncSGDError):
    """A NaN or infinity in the loss or the gradients."""
