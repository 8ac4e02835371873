"""Data: minibatches of Caffe `Datum` records read from an LMDB database."""
from syncsgd import log
from syncsgd.errors import PrototxtError
from syncsgd.io.lmdb import LMDBSource
from syncsgd.io.transform import DataTransformer
from syncsgd.layers.hdf5_data import HDF5DataLayer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

LEGACY_TRANSFORM = ("scale", "mean_file", "crop_size", "mirror")


@register
class DataLayer(HDF5DataLayer):
    """Caffe's Data layer over LMDB: top[0] the images, top[1] (optional) the labels.

    Everything but the source is HDF5Data's: batch_size is the global minibatch, batch k is
    records [k*B, (k+1)*B) in key order (wrapping at the end, as Caffe's cursor does), each rank
    reads only its slice, transform_param is applied per global sample index, a thread
    prefetches the next batch, and seek(k) resumes at batch k on any number of ranks.

    Differences from Caffe: only the LMDB backend is read, and rand_skip is ignored (a random
    skip would give each rank a different sequence; shuffle the database when converting).
    """
    type = "Data"
    exact_bottoms = 0
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        param = self.param.data_param
        where = f"layer '{self.name}' ({self.type})"
        if not param.source:
            raise PrototxtError(f"{where}: data_param.source is empty; name an LMDB database "
                                f"folder")
        if param.batch_size < 1:
            raise PrototxtError(f"{where}: data_param.batch_size must be at least 1")
        if param.backend != pb.DataParameter.LMDB:
            raise PrototxtError(f"{where}: data_param.backend is LEVELDB (Caffe's default), "
                                f"which syncsgd does not read; convert the data to LMDB "
                                f"(`syncsgd convert`) and set `backend: LMDB`")
        legacy = [name for name in LEGACY_TRANSFORM if param.HasField(name)]
        if legacy:
            raise PrototxtError(f"{where}: data_param.{legacy[0]} is the pre-2014 place of a "
                                f"transformation; move it to transform_param")
        if param.rand_skip:
            log.info(f"{where}: rand_skip {param.rand_skip} ignored; every rank must read the "
                     f"same sequence (shuffle the database instead)")
        transform = self.param.transform_param
        self.names = list(LMDBSource.names[:len(top)])
        self.batch_size = int(param.batch_size)
        self.shuffle = False
        self.source = LMDBSource(param.source,
                                 color=transform.force_color or param.force_encoded_color,
                                 gray=transform.force_gray)
        self.transformer = DataTransformer(transform, self.ctx.phase,
                                       self.source.row_shape("data"), where)
        self.batch = 0
