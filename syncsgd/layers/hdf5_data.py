"""HDF5Data: minibatches read straight from HDF5 files, each rank reading only its own slice."""
import numpy as np

from syncsgd.context import Context
from syncsgd.errors import PrototxtError
from syncsgd.io.hdf5 import H5Source
from syncsgd.io.prefetch import Prefetcher
from syncsgd.io.transform import DataTransformer
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register

CACHED_EPOCHS = 2   # a batch spans at most two epochs unless batch_size exceeds the data


@register
class HDF5DataLayer(Layer):
    """Caffe's HDF5Data layer: each top is the HDF5 dataset of the same name, read from every
    file listed in hdf5_data_param.source as one sequence of rows.

    batch_size is the global minibatch. Batch k covers rows [k*B, (k+1)*B) of the epoch order
    (wrapping into the next epoch at the end of the data); this rank reads only rows
    [first, first + count) of it, where (first, count) = ctx.shard(B), and tells the other layers
    through ctx.batch_offset and ctx.global_batch. With shuffle, epoch e's order is a permutation
    drawn from ctx.rng(name, "epoch", e), the same on every rank without communication.
    transform_param applies to the first top only, as in Caffe's data layers.

    A background thread reads batch k+1 while the net computes batch k; close() stops it (it
    also stops when the layer is garbage collected). Each batch's files are checked again as the
    net takes it, so a source that changes under the run stops it at the next forward.

    The layer counts its own batches. A solver saves state() -> {"batch": k} in its snapshot and
    calls set_state(that dict) on resume, or seek(k) when it knows how many batches were read, so
    training continues with the same batches on any number of ranks.
    """
    type = "HDF5Data"
    exact_bottoms = 0
    min_tops = 1

    def __init__(self, param, ctx):
        super().__init__(param, ctx)
        self.source = None
        self._prefetch = None
        self._prefetch_key = None
        self.skip = 0     # samples passed over before batch 0 (ImageData's rand_skip)

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        param = self.param.hdf5_data_param
        where = f"layer '{self.name}' ({self.type})"
        if not param.source:
            raise PrototxtError(f"{where}: hdf5_data_param.source is empty; name a text file "
                                f"listing HDF5 files")
        if param.batch_size < 1:
            raise PrototxtError(f"{where}: hdf5_data_param.batch_size must be at least 1")
        if param.batch_size < self.ctx.size:
            raise PrototxtError(f"{where}: hdf5_data_param.batch_size {param.batch_size} is the "
                                f"global batch, split over {self.ctx.size} ranks: it must be at "
                                "least the number of ranks; raise it or run on fewer ranks")
        self.names = list(self.param.top)
        if len(self.names) != len(top):
            raise PrototxtError(f"{where}: name every top after the HDF5 dataset it reads")
        self.batch_size = int(param.batch_size)
        self.shuffle = bool(param.shuffle)
        self.source = H5Source(param.source, self.names)
        self.transformer = DataTransformer(self.param.transform_param, self.ctx.phase,
                                       self.source.row_shape(self.names[0]), where)
        self.batch = 0

    def reshape(self, bottom, top):
        first, count = self.ctx.shard(self.batch_size)
        self.ctx.batch_offset = first
        self.ctx.global_batch = self.batch_size
        top[0].reshape(count, *self.transformer.out_shape)
        for blob, name in zip(top[1:], self.names[1:]):
            blob.reshape(count, *self.source.row_shape(name))

    def forward(self, bottom, top):
        self.reshape(bottom, top)
        rows, arrays = self._feed().get()
        self._check(rows)
        for blob, array in zip(top, arrays):
            np.copyto(blob.data, array)
        self.batch += 1

    def _check(self, rows):
        """The source has not changed since the run began (rows: the batch's global rows)."""
        self.source.check(rows)

    def state(self):
        return {"batch": self.batch}

    def set_state(self, state):
        self.seek(state["batch"])

    def seek(self, batch):
        """Make the next forward produce batch `batch` (0-based)."""
        self.batch = int(batch)
        self._stop_prefetch()

    def close(self):
        self._stop_prefetch()
        if self.source is not None:
            self.source.close()

    def _feed(self):
        """The prefetcher for this rank's slice, (re)started from self.batch when needed."""
        first, count = self.ctx.shard(self.batch_size)
        key = (first, count, self.ctx.seed)
        if self._prefetch is None or self._prefetch_key != key:
            self._stop_prefetch()
            self._prefetch = Prefetcher(self._reader(first, count), self.batch,
                                        name=f"{self.type} {self.name}")
            self._prefetch_key = key
        return self._prefetch

    def _reader(self, first, count):
        """The function of k that makes this rank's part of batch k, holding no reference to
        the layer (it runs in the prefetch thread)."""
        return BatchReader(self.source, self.names, self.transformer, self.batch_size,
                           self.shuffle, self.ctx, self.name, first, count, self.skip)

    def _stop_prefetch(self):
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None


class BatchReader:
    """Makes this rank's part of batch k. It runs in the prefetch thread, so it holds neither the
    layer nor the net's context (only a detached copy with the same seed): otherwise the thread
    would keep them alive and never be told to stop."""

    def __init__(self, source, names, transformer, batch_size, shuffle, ctx, name, first, count,
                 skip=0):
        self.source = source
        self.names = names
        self.transformer = transformer
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.ctx = Context(ctx.phase, seed=ctx.seed)
        self.name = name
        self.first = first
        self.count = count
        self.skip = skip
        self._orders = {}

    def rows(self, k):
        """Global row indices of samples first .. first+count-1 of batch k."""
        position = (self.skip + k * self.batch_size + self.first
                    + np.arange(self.count, dtype=np.int64))
        epoch, within = np.divmod(position, self.source.total)
        if not self.shuffle:
            return within
        rows = np.empty_like(within)
        for e in np.unique(epoch).tolist():
            here = epoch == e
            rows[here] = self._order(e)[within[here]]
        return rows

    def _order(self, epoch):
        if epoch not in self._orders:
            if len(self._orders) >= CACHED_EPOCHS:
                del self._orders[min(self._orders)]
            rng = self.ctx.rng(self.name, "epoch", epoch)
            self._orders[epoch] = rng.permutation(self.source.total)
        return self._orders[epoch]

    def __call__(self, k):
        """(global rows, [array per top]) of batch k."""
        rows = self.rows(k)
        arrays = [self.source.read(name, rows) for name in self.names]
        if not self.transformer.identity:
            arrays[0] = self.transformer.apply(arrays[0], self.ctx.seed,
                                               (self.name, "transform", k), self.first)
        return rows, arrays
