"""MemoryData: minibatches served from arrays handed over from Python."""
import numpy as np

from syncsgd import log
from syncsgd.errors import PrototxtError, ShapeError
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class MemoryDataLayer(Layer):
    """Caffe's MemoryData layer: top[0] (batch, channels, height, width) and top[1] the labels,
    from arrays given with set_input_arrays (pycaffe's Net.set_input_arrays) or reset.

    Batch k is rows [k*B, (k+1)*B) modulo the array length N (a multiple of batch_size B, as
    Caffe requires), so forward walks through the arrays and wraps around. batch_size is the
    global minibatch: every rank is given the same arrays and serves only its consecutive slice
    of each batch. The arrays are held, not copied, as in Caffe: changing them in place changes
    the batches still to come. seek(k) makes the next forward serve batch k (a resumed solver).

    The labels top is (batch, 1, 1, 1), as Caffe's (losses and Accuracy take either form).
    Difference from Caffe: AddDatumVector and AddMatVector are not provided.
    """
    type = "MemoryData"
    exact_bottoms = 0
    exact_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        param = self.param.memory_data_param
        self.batch_size = int(param.batch_size)
        self.row_shape = (int(param.channels), int(param.height), int(param.width))
        if self.batch_size * int(np.prod(self.row_shape)) <= 0:
            raise PrototxtError(f"layer '{self.name}' ({self.type}): memory_data_param "
                                f"batch_size, channels, height and width must all be set and "
                                f"positive")
        self.data = self.labels = None
        self.n = 0
        self.batch = 0

    def reshape(self, bottom, top):
        first, count = self.ctx.shard(self.batch_size)
        self.ctx.batch_offset = first
        self.ctx.global_batch = self.batch_size
        top[0].reshape(count, *self.row_shape)
        top[1].reshape(count, 1, 1, 1)

    def set_input_arrays(self, data, labels):
        """pycaffe's checks, then reset(data, labels, len(data)); labels may be (N,) or
        (N, 1, 1, 1)."""
        self._check_array(data, "data array", self.row_shape)
        self._check_array(labels, "labels array", None)
        if labels.ndim not in (1, 4) or labels.shape[1:] not in ((), (1, 1, 1)):
            self.fail(f"labels array must have shape (N,) or (N, 1, 1, 1), got {labels.shape}")
        if len(data) != len(labels):
            self.fail(f"data and labels must have the same first dimension, got {len(data)} "
                      f"and {len(labels)}")
        self.reset(data, labels.reshape(-1), len(data))

    def _check_array(self, array, what, row_shape):
        if not isinstance(array, np.ndarray) or array.dtype != np.float32:
            self.fail(f"{what} must be a float32 numpy array (use np.asarray(x, np.float32))")
        if not array.flags.c_contiguous:
            self.fail(f"{what} must be C contiguous (use np.ascontiguousarray)")
        if row_shape is not None and (array.ndim != 4 or array.shape[1:] != row_shape):
            self.fail(f"{what} must have shape (N, {', '.join(map(str, row_shape))}) to match "
                      f"memory_data_param, got {array.shape}")

    def reset(self, data, labels, n):
        """Serve the first n rows of data (N, C, H, W) and labels (N,), from batch 0 (Caffe's
        Reset)."""
        n = int(n)
        if n <= 0 or n % self.batch_size:
            self.fail(f"n = {n} must be a positive multiple of batch_size {self.batch_size}")
        if len(data) < n or len(labels) < n:
            self.fail(f"n = {n} exceeds the {min(len(data), len(labels))} rows given")
        if self.param.HasField("transform_param"):
            log.info(f"layer '{self.name}': {self.type} does not transform array data on "
                     f"reset; transform_param is ignored")
        self.data, self.labels, self.n = data, labels, n
        self.batch = 0

    def forward(self, bottom, top):
        if self.data is None:
            raise ShapeError(f"layer '{self.name}' ({self.type}) has no data; call "
                             f"net.set_input_arrays(data, labels) before forward")
        self.reshape(bottom, top)
        first, count = self.ctx.shard(self.batch_size)
        start = (self.batch * self.batch_size) % self.n + first
        np.copyto(top[0].data, self.data[start:start + count])
        np.copyto(top[1].data.reshape(-1), self.labels[start:start + count])
        self.batch += 1

    def seek(self, batch):
        """Make the next forward serve batch `batch` (0-based)."""
        self.batch = int(batch)
