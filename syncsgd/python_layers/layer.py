"""pycaffe's Python layer protocol: the base class of Python layers (caffe.Layer), the user's
and the built-in ones alike, and its growable blob list. The net runs them through the
`Python` layer type (syncsgd/layers/python_layer.py)."""
from syncsgd.blob import Blob


class BlobList(list):
    """pycaffe's layer.blobs: a list of Blob that can grow."""

    def add_blob(self, *shape):
        blob = Blob(shape)
        self.append(blob)
        return blob


class PythonLayer:
    """Base class of user layers (pycaffe's caffe.Layer).

    The framework sets param_str, phase, blobs and ctx before calling setup; like pycaffe, it
    constructs the class with the layer's LayerParameter."""

    def __init__(self, param=None):
        self.layer_param = param
        self.param_str = param.python_param.param_str if param is not None else ""
        self.phase = None
        self.blobs = BlobList()
        self.ctx = None

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__} must define reshape(bottom, top)")

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__} must define forward(bottom, top)")

    def backward(self, top, propagate_down, bottom):
        pass
