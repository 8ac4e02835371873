"""Image files read as Caffe's ImageData and WindowData layers read them with OpenCV: decoded to
BGR (or one gray channel) uint8 (C, H, W), resized like cv::resize with INTER_LINEAR.

OpenCV is not a dependency: Pillow decodes, and the resize below reproduces OpenCV's bilinear
sampling (half-pixel centres, edges clamped) in numpy, within one grey level of its fixed-point
rounding.
"""
import numpy as np

from syncsgd.errors import DataError
from syncsgd.io.convert import image_list_lines
from syncsgd.io.identity import WatchedFile
from syncsgd.io.lmdb import decode_image


def read_image(path, color, where):
    """The image file at `path` as uint8 (C, H, W): 3 channels BGR when `color` (as imread's
    IMREAD_COLOR), else 1 gray channel; `where` names the list entry in error messages."""
    return decode_image(read_file(path, where), color, not color, f"{where}: '{path}'")


def read_file(path, where):
    """The bytes of an image file, or a DataError that names `where` it was listed."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"{where}: cannot read image '{path}' ({exc.strerror}); fix the path "
                        f"or the root_folder") from None


def resize_linear(image, height, width):
    """uint8 (C, H, W) -> uint8 (C, height, width), as cv::resize(..., INTER_LINEAR)."""
    if image.shape[1:] == (height, width):
        return image
    rows, next_rows, wy = _taps(image.shape[1], height)
    cols, next_cols, wx = _taps(image.shape[2], width)
    pixels = image.astype(np.float32)
    wy = wy[:, None]
    across = pixels[:, rows] * (1 - wy) + pixels[:, next_rows] * wy          # (C, height, W)
    out = across[:, :, cols] * (1 - wx) + across[:, :, next_cols] * wx      # (C, height, width)
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)


def _taps(size, new_size):
    """Source index, next index and the weight of the next one, per output index: OpenCV's
    source coordinate (i + 0.5) * size / new_size - 0.5, clamped to the first and last pixel."""
    where = (np.arange(new_size) + 0.5) * (size / new_size) - 0.5
    index = np.floor(where).astype(np.intp)
    weight = (where - index).astype(np.float32)
    low, high = index < 0, index >= size - 1
    index[low], weight[low] = 0, 0
    index[high], weight[high] = size - 1, 0
    return index, np.minimum(index + 1, size - 1), weight


class ImageListSource:
    """The images of a Caffe image list ("path label" per line) as a row source for the data
    layers' batching (`total`, `row_shape(name)`, `read(name, rows)`): "data" rows are decoded
    only when read, so each rank decodes only its own slice.

    Paths are root_folder + path, as Caffe concatenates them. Every image must come out in the
    first image's shape (resize with `size` = (height, width) to make it so).
    """

    names = ("data", "label")

    def __init__(self, list_path, root_folder="", color=True, size=None):
        self.list_path = list_path
        self.root = root_folder
        self.color = color
        self.size = size
        entries = image_list_lines(list_path)
        self.watched = WatchedFile(list_path, f"image list file '{list_path}'")
        self.paths = [root_folder + path for path, _, _ in entries]
        self.lines = [line for _, _, line in entries]
        self.labels = np.array([label for _, label, _ in entries], np.float32)
        self.total = len(entries)
        self._shape = self.image(0).shape

    def check(self, rows):
        """Raise DataError when the list file changed since the source was made (one stat)."""
        self.watched.check(rows, self.names)

    def image(self, row):
        """uint8 (C, H, W) of list entry `row`, resized when a size is set."""
        where = f"{self.list_path}:{self.lines[row]}"
        pixels = read_image(self.paths[row], self.color, where)
        if self.size is not None:
            pixels = resize_linear(pixels, *self.size)
        return pixels

    def row_shape(self, name):
        return self._shape if name == "data" else ()

    def read(self, name, rows):
        """float32 (len(rows), *row_shape(name)) of list entries `rows`."""
        if name == "label":
            return self.labels[rows]
        out = np.empty((len(rows),) + self._shape, np.float32)
        for i, row in enumerate(np.asarray(rows).tolist()):   # one file each
            pixels = self.image(row)
            if pixels.shape != self._shape:
                raise DataError(f"{self.list_path}:{self.lines[row]}: image '{self.paths[row]}' "
                                f"is {pixels.shape[1]}x{pixels.shape[2]} but the first one is "
                                f"{self._shape[1]}x{self._shape[2]}; set image_data_param "
                                f"new_height and new_width to give all images one size")
            out[i] = pixels
        return out

    def close(self):
        """Nothing to release (each read opens its files); the data layers call it on every
        source."""
