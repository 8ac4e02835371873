"""DenseImageData (alexgkendall/caffe-segnet): SegNet's training input, a list of
"image label_image" lines giving images and their per-pixel labels (a gray image whose values
are the class numbers), read, shuffled and split over ranks as ImageData reads its list."""
import numpy as np

from syncsgd.context import uniform_rows
from syncsgd.errors import DataError, PrototxtError
from syncsgd.io.identity import WatchedFile
from syncsgd.io.image_files import ImageListSource, read_image
from syncsgd.io.transform import DataTransformer
from syncsgd.layers.hdf5_data import BatchReader, HDF5DataLayer
from syncsgd.layers.registry import register


def dense_list_lines(list_path):
    """[(image path, label image path, line number)] of a list file (blank lines skipped)."""
    try:
        with open(list_path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise DataError(f"image list '{list_path}' cannot be read ({exc.strerror}); write one "
                        f"'image label_image' pair per line") from None
    entries = []
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        if len(words) != 2:
            raise DataError(f"{list_path}:{n}: expected 'image label_image', got "
                            f"'{line.strip()}'")
        entries.append((words[0], words[1], n))
    if not entries:
        raise DataError(f"image list '{list_path}' lists no images")
    return entries


def resize_nearest(image, height, width):
    """uint8 (C, H, W) -> (C, height, width) as cv::resize(..., INTER_NEAREST): source index
    floor(i * size / new_size), as SegNet resizes label images (labels must not blend)."""
    if image.shape[1:] == (height, width):
        return image
    rows = np.minimum((np.arange(height) * (image.shape[1] / height)).astype(np.intp),
                      image.shape[1] - 1)
    cols = np.minimum((np.arange(width) * (image.shape[2] / width)).astype(np.intp),
                      image.shape[2] - 1)
    return image[:, rows[:, None], cols]


class DenseImageListSource(ImageListSource):
    """ImageListSource's rows ("data", decoded only when read) with a "label" row per image: the
    label image, gray, resized by nearest neighbour, of the image's height and width."""

    def __init__(self, list_path, root_folder="", color=True, size=None):
        entries = dense_list_lines(list_path)
        self.list_path = list_path
        self.root = root_folder
        self.color = color
        self.size = size
        self.watched = WatchedFile(list_path, f"image list file '{list_path}'")
        self.paths = [root_folder + image for image, _, _ in entries]
        self.label_paths = [root_folder + label for _, label, _ in entries]
        self.lines = [line for _, _, line in entries]
        self.total = len(entries)
        self._shape = self.image(0).shape
        self._label_shape = (1,) + self._shape[1:]

    def label_image(self, row):
        where = f"{self.list_path}:{self.lines[row]}"
        pixels = read_image(self.label_paths[row], False, where)
        if self.size is not None:
            pixels = resize_nearest(pixels, *self.size)
        if pixels.shape != self._label_shape:
            raise DataError(f"{where}: label image '{self.label_paths[row]}' is "
                            f"{pixels.shape[1]}x{pixels.shape[2]} but its image is "
                            f"{self._shape[1]}x{self._shape[2]}; labels must match their images")
        return pixels

    def row_shape(self, name):
        return self._shape if name == "data" else self._label_shape

    def read(self, name, rows):
        if name == "data":
            return super().read(name, rows)
        return np.stack([self.label_image(row) for row in np.asarray(rows).tolist()]
                        ).astype(np.float32)


def windows(x, u, out_hw, mirror):
    """Each sample's (out_h, out_w) window of the (n, C, H, W) batch x at offsets drawn from the
    uniforms u (n, 3), mirrored where u[:, 2] < 0.5 and `mirror`: the same for image and label."""
    n, channels, height, width = x.shape
    out_h, out_w = out_hw
    h_off = np.minimum((u[:, 0] * (height - out_h + 1)).astype(np.intp), height - out_h)
    w_off = np.minimum((u[:, 1] * (width - out_w + 1)).astype(np.intp), width - out_w)
    rows = h_off[:, None] + np.arange(out_h)                           # (n, out_h)
    cols = w_off[:, None] + np.arange(out_w)                           # (n, out_w)
    if mirror:
        flip = u[:, 2] < 0.5
        cols[flip] = cols[flip, ::-1]
    flat = (rows[:, :, None] * width + cols[:, None, :]).reshape(n, 1, out_h * out_w)
    picked = np.take_along_axis(x.reshape(n, channels, height * width), flat, axis=2)
    return picked.reshape(n, channels, out_h, out_w)


class DenseBatchReader(BatchReader):
    """BatchReader whose random crop and mirror, drawn per global sample, move an image and its
    label image together; transform_param then applies to the images alone."""

    def __init__(self, *args, out_hw, mirror, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_hw = out_hw
        self.mirror = mirror

    def __call__(self, k):
        rows = self.rows(k)
        images, labels = (self.source.read(name, rows) for name in self.names)
        if self.mirror or self.out_hw != images.shape[2:]:
            u = uniform_rows(self.ctx.seed, (self.name, "window", k), self.first, len(rows), 3)
            images, labels = (windows(a, u, self.out_hw, self.mirror) for a in (images, labels))
        if not self.transformer.identity:
            images = self.transformer.apply(images, self.ctx.seed, (self.name, "transform", k),
                                            self.first)
        return rows, [images, labels]


@register
class DenseImageDataLayer(HDF5DataLayer):
    """SegNet's DenseImageData: dense_image_data_param.source lists "image label_image" lines;
    top[0] the images (BGR, or gray with is_color: false), top[1] the label images (N, 1, H, W).

    As in the fork: new_height/new_width resize images bilinearly and labels by nearest
    neighbour; mirror flips an image and its labels together; crop_height/crop_width take one
    random window of both, in TEST as in TRAIN; transform_param (scale, mean) applies to the
    images only, and its crop_size and mirror are refused (the fork stops on them too, since they
    would move an image without its labels). Batching, shuffle and rand_skip are ImageData's:
    batch_size is the global batch, each rank reads its slice, draws come from the run seed.
    """
    type = "DenseImageData"
    fork = "alexgkendall/caffe-segnet"
    exact_bottoms = 0
    exact_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.dense_image_data_param
        where = f"layer '{self.name}' ({self.type})"
        if not p.source:
            raise PrototxtError(f"{where}: dense_image_data_param.source is empty; name a text "
                                f"file with one 'image label_image' line per image")
        if p.batch_size < max(1, self.ctx.size):
            raise PrototxtError(f"{where}: dense_image_data_param.batch_size {p.batch_size} is "
                                f"the global batch: it must be at least 1 and the number of "
                                f"ranks ({self.ctx.size})")
        for a, b in (("new_height", "new_width"), ("crop_height", "crop_width")):
            if (getattr(p, a) > 0) != (getattr(p, b) > 0):
                raise PrototxtError(f"{where}: dense_image_data_param {a} and {b} must be set "
                                    f"together (or neither)")
        t = self.param.transform_param
        if t.crop_size or t.mirror:
            raise PrototxtError(f"{where}: transform_param crop_size and mirror would move the "
                                f"images but not their labels; use dense_image_data_param "
                                f"crop_height, crop_width and mirror")
        if p.HasField("mean_file"):
            raise PrototxtError(f"{where}: dense_image_data_param.mean_file is not read (nor "
                                f"by the fork); use transform_param.mean_file")
        size = (int(p.new_height), int(p.new_width)) if p.new_height else None
        self.names = ["data", "label"]
        self.batch_size = int(p.batch_size)
        self.shuffle = bool(p.shuffle)
        self.mirror = bool(p.mirror)
        self.source = DenseImageListSource(p.source, p.root_folder, p.is_color, size)
        channels, height, width = self.source.row_shape("data")
        self.out_hw = (int(p.crop_height), int(p.crop_width)) if p.crop_height else (height,
                                                                                      width)
        if self.out_hw[0] > height or self.out_hw[1] > width:
            raise PrototxtError(f"{where}: dense_image_data_param crop {self.out_hw} exceeds "
                                f"the images' {height}x{width}")
        if p.rand_skip:
            if p.rand_skip > self.source.total:
                raise PrototxtError(f"{where}: dense_image_data_param.rand_skip {p.rand_skip} "
                                    f"exceeds the {self.source.total} images listed")
            self.skip = int(self.ctx.rng(self.name, "rand_skip").integers(p.rand_skip))
        self.transformer = DataTransformer(t, self.ctx.phase, (channels,) + self.out_hw, where)
        self.batch = 0

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        top[1].reshape(top[0].shape[0], 1, *self.out_hw)

    def _reader(self, first, count):
        return DenseBatchReader(self.source, self.names, self.transformer, self.batch_size,
                                self.shuffle, self.ctx, self.name, first, count, self.skip,
                                out_hw=self.out_hw, mirror=self.mirror)
