"""pycaffe's `caffe.proto.caffe_pb2`: the generated schema under Caffe's module name (the same
message classes as syncsgd.proto.pb)."""
from syncsgd.proto.syncsgd_pb2 import *  # noqa: F401,F403
