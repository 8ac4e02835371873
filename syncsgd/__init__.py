"""syncsgd: Caffe-style deep learning, trained by synchronous SGD over MPI ranks."""
TRAIN = 0
TEST = 1
