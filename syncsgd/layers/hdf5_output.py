"""HDF5Output: writes its two bottoms to an HDF5 file as datasets "data" and "label"."""
import h5py
import numpy as np

from syncsgd.errors import DataError, PrototxtError
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register

NAMES = ("data", "label")


@register
class HDF5OutputLayer(Layer):
    """Caffe's HDF5Output layer: hdf5_output_param.file_name is created (truncated) when the
    net is built, and each forward writes bottom[0] to dataset "data" and bottom[1] to "label",
    in Caffe's 4-axis float32 layout (a (N,) label is stored (N, 1, 1, 1)).

    Each forward appends its rows to the datasets, so a run of k forwards leaves k batches in
    the file; Caffe creates the datasets again at every forward, which fails on the second.
    Over several ranks, the slices of the global batch are gathered (a sum of zero-padded
    slices, exact) and only rank 0 writes, so the file is the one a single process writes.
    """
    type = "HDF5Output"
    exact_bottoms = 2
    exact_tops = 0

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise PrototxtError(f"layer '{self.name}' ({self.type}): hdf5_output_param."
                                f"file_name is empty; name the HDF5 file to write")
        self.file = None
        if self.ctx.rank == 0:
            try:
                self.file = h5py.File(self.file_name, "w")
            except OSError as exc:
                raise DataError(f"layer '{self.name}' ({self.type}): cannot create HDF5 file "
                                f"'{self.file_name}' ({exc})") from None

    def reshape(self, bottom, top):
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            self.fail(f"data and label must have the same number of rows, got "
                      f"{bottom[0].shape} and {bottom[1].shape}")
        for blob in bottom:
            if len(blob.shape) > 4:
                self.fail(f"bottom '{blob.name}' has {len(blob.shape)} axes; Caffe's HDF5 "
                          f"output stores at most 4")

    def forward(self, bottom, top):
        rows = [self._gathered(blob) for blob in bottom]
        if self.file is None:
            return
        for name, array in zip(NAMES, rows):
            array = array.reshape(array.shape + (1,) * (4 - array.ndim))
            if name not in self.file:
                self.file.create_dataset(name, data=array, maxshape=(None,) + array.shape[1:],
                                         chunks=True)
                continue
            dataset = self.file[name]
            if dataset.shape[1:] != array.shape[1:]:
                self.fail(f"bottom rows changed shape from {dataset.shape[1:]} to "
                          f"{array.shape[1:]}; one HDF5 dataset holds rows of one shape")
            start = dataset.shape[0]
            dataset.resize(start + len(array), axis=0)
            dataset[start:] = array
        self.file.flush()

    def _gathered(self, blob):
        """The global batch of `blob` (float32), put together from every rank's slice."""
        ctx = self.ctx
        if ctx.size == 1 or ctx.global_batch is None:
            return blob.data
        first, count = ctx.shard(ctx.global_batch)
        if blob.shape[0] != count:
            self.fail(f"bottom '{blob.name}' has {blob.shape[0]} rows but this rank's slice "
                      f"of the global batch {ctx.global_batch} has {count}")
        full = np.zeros((ctx.global_batch,) + tuple(blob.shape[1:]), np.float64)
        full[first:first + count] = blob.data
        return ctx.allreduce_sum(full).astype(np.float32)

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
