"""The Caffe-compatible schema, generated from proto/syncsgd.proto (see tests/test_proto.py)."""
from syncsgd.proto import syncsgd_pb2 as pb

__all__ = ["pb"]
