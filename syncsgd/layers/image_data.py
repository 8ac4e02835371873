"""ImageData: minibatches of image files named in a list file, each rank decoding only its slice."""
from syncsgd.errors import PrototxtError
from syncsgd.io.image_files import ImageListSource
from syncsgd.io.transform import DataTransformer
from syncsgd.layers.data import LEGACY_TRANSFORM
from syncsgd.layers.hdf5_data import HDF5DataLayer
from syncsgd.layers.registry import register


@register
class ImageDataLayer(HDF5DataLayer):
    """Caffe's ImageData layer: image_data_param.source lists "path label" lines; top[0] the
    images (BGR, or gray with is_color: false), top[1] the labels.

    Batching is HDF5Data's: batch_size is the global minibatch, batch k covers list entries
    [k*B, (k+1)*B) of the epoch order, wrapping at the end, and each rank decodes only the
    files of its own slice, a thread ahead. With shuffle, every epoch (the first too, as in
    Caffe) has its own order, drawn from the run seed and so the same on every rank. rand_skip
    passes over a random number (below rand_skip) of entries before the first batch, drawn from
    the run seed as well. transform_param applies to the images per global sample index.

    Difference from Caffe: every image must come out in one size (Caffe allows varying sizes
    with batch_size 1); set new_height and new_width for lists of mixed sizes.
    """
    type = "ImageData"
    exact_bottoms = 0
    exact_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        param = self.param.image_data_param
        where = f"layer '{self.name}' ({self.type})"
        if not param.source:
            raise PrototxtError(f"{where}: image_data_param.source is empty; name a text file "
                                f"with one 'path label' line per image")
        if param.batch_size < 1:
            raise PrototxtError(f"{where}: image_data_param.batch_size must be at least 1")
        if (param.new_height > 0) != (param.new_width > 0):
            raise PrototxtError(f"{where}: image_data_param new_height and new_width must be set "
                                f"together (or neither)")
        legacy = [name for name in LEGACY_TRANSFORM if param.HasField(name)]
        if legacy:
            raise PrototxtError(f"{where}: image_data_param.{legacy[0]} is the pre-2014 place of "
                                f"a transformation; move it to transform_param")
        size = (int(param.new_height), int(param.new_width)) if param.new_height else None
        self.names = list(ImageListSource.names)
        self.batch_size = int(param.batch_size)
        self.shuffle = bool(param.shuffle)
        self.source = ImageListSource(param.source, param.root_folder, param.is_color, size)
        if param.rand_skip:
            if param.rand_skip > self.source.total:
                raise PrototxtError(f"{where}: image_data_param.rand_skip {param.rand_skip} "
                                    f"exceeds the {self.source.total} images listed")
            self.skip = int(self.ctx.rng(self.name, "rand_skip").integers(param.rand_skip))
        self.transformer = DataTransformer(self.param.transform_param, self.ctx.phase,
                                       self.source.row_shape("data"), where)
        self.batch = 0
