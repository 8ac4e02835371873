"""WindowData: R-CNN's training windows, cropped from images and warped to a square."""
import numpy as np

from syncsgd import log
from syncsgd.context import Context, uniform_rows
from syncsgd.errors import DataError, PrototxtError
from syncsgd.io.identity import WatchedFile
from syncsgd.io.image_files import read_file, read_image, resize_linear
from syncsgd.io.lmdb import decode_image
from syncsgd.io.mean import load_mean
from syncsgd.layers.hdf5_data import HDF5DataLayer
from syncsgd.layers.registry import register

# columns of a window row
IMAGE, LABEL, X1, Y1, X2, Y2 = range(6)
CHANNELS = 3   # Caffe's WindowData reads every image in colour


@register
class WindowDataLayer(HDF5DataLayer):
    """Caffe's WindowData layer (R-CNN fine-tuning): top[0] (batch, 3, crop, crop) warped
    windows, top[1] their labels.

    The window file lists, per image, "# index", the path (after root_folder), channels, height,
    width, the number of windows and one "label overlap x1 y1 x2 y2" line per window. Windows
    with overlap >= fg_threshold are foreground (label > 0), those with overlap < bg_threshold
    background (label 0), the rest unused. Each batch holds batch_size - int(batch_size *
    fg_fraction) background windows, then the foreground ones, each drawn uniformly with
    replacement and mirrored at random (transform_param.mirror), exactly as Caffe's
    load_batch; crop_mode "square" and context_pad widen the window first, and the part of it
    outside the image stays zero. Pixels become (pixel - mean) * window_data_param.scale.

    The draws come from the run seed per (batch, global sample index), so a batch split over
    ranks is the batch of one process; each rank decodes only its own windows, a thread ahead,
    and seek(k) resumes at batch k.

    Differences from Caffe: only the window sets a batch samples from must be non-empty (Caffe
    requires both, even with fg_fraction 0 or 1); transform_param.scale applies when
    window_data_param.scale is not set (Caffe ignores it, and so loses the scale of a legacy
    V1 net, whose upgrade moves it there).
    """
    type = "WindowData"
    exact_bottoms = 0
    exact_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        param = self.param.window_data_param
        transform = self.param.transform_param
        where = f"layer '{self.name}' ({self.type})"
        if not param.source:
            raise PrototxtError(f"{where}: window_data_param.source is empty; name a window file")
        if param.batch_size < 1:
            raise PrototxtError(f"{where}: window_data_param.batch_size must be at least 1")
        for field in ("mean_file", "crop_size", "mirror"):
            if param.HasField(field):
                raise PrototxtError(f"{where}: window_data_param.{field} is not read by "
                                    f"WindowData; set transform_param.{field}")
        if transform.scale != 1 and param.scale != 1:
            raise PrototxtError(f"{where}: both window_data_param.scale and "
                                f"transform_param.scale are set; keep one")
        self.scale = np.float32(param.scale if param.scale != 1 else transform.scale)
        if transform.crop_size < 1:
            raise PrototxtError(f"{where}: transform_param.crop_size must be set; it is the "
                                f"side of the warped windows")
        if param.crop_mode not in ("warp", "square"):
            raise PrototxtError(f"{where}: window_data_param.crop_mode must be 'warp' or "
                                f"'square', got '{param.crop_mode}'")
        self.crop = int(transform.crop_size)
        if 2 * param.context_pad >= self.crop:
            raise PrototxtError(f"{where}: window_data_param.context_pad {param.context_pad} "
                                f"leaves no window inside crop_size {self.crop}")
        self.paths, self.sizes, self.windows = read_window_file(param.source, param.root_folder,
                                                     param.fg_threshold, param.bg_threshold)
        self.watched = WatchedFile(param.source, f"window file '{param.source}'")
        self.batch_size = int(param.batch_size)
        self.num_fg = int(np.float32(self.batch_size) * np.float32(param.fg_fraction))
        for name, rows, needed in (("background", self.windows[0], self.batch_size - self.num_fg),
                                   ("foreground", self.windows[1], self.num_fg)):
            if needed and not len(rows):
                raise DataError(f"window file '{param.source}' has no {name} windows for "
                                f"fg_threshold {param.fg_threshold} and bg_threshold "
                                f"{param.bg_threshold}; change the thresholds or fg_fraction")
        self.mean = self._mean(transform, where)
        self.cache = ([read_file(path, f"window file '{param.source}': image {i}")
                       for i, path in enumerate(self.paths)]
                      if param.cache_images else None)
        self.batch = 0

    def _mean(self, transform, where):
        """The (3, crop, crop) float32 mean under the crop: the centre of the mean file, the
        mean values, or zeros."""
        if transform.HasField("mean_file") and len(transform.mean_value):
            raise PrototxtError(f"{where}: transform_param has both mean_file and mean_value; "
                                f"keep one")
        if transform.HasField("mean_file"):
            mean = load_mean(transform.mean_file)
            mean = mean[0] if mean.ndim == 4 and len(mean) == 1 else mean   # legacy (1, C, H, W)
            if mean.ndim != 3 or mean.shape[0] != CHANNELS:
                raise DataError(f"mean file '{transform.mean_file}' has shape {mean.shape}; "
                                f"WindowData needs a (3, height, width) mean")
            off = (mean.shape[2] - self.crop) // 2   # Caffe centres by the width on both axes
            if off < 0 or off + self.crop > mean.shape[1]:
                raise DataError(f"mean file '{transform.mean_file}' ({mean.shape[1]}x"
                                f"{mean.shape[2]}) is smaller than crop_size {self.crop}")
            return np.ascontiguousarray(mean[:, off:off + self.crop, off:off + self.crop])
        values = np.asarray(transform.mean_value, np.float32)
        if values.size not in (0, 1, CHANNELS):
            raise PrototxtError(f"{where}: transform_param has {values.size} mean_value entries; "
                                f"give one value or one per channel ({CHANNELS})")
        per_channel = np.broadcast_to(values if values.size else np.float32(0), (CHANNELS,))
        return np.broadcast_to(per_channel[:, None, None], (CHANNELS, self.crop, self.crop)).copy()

    def reshape(self, bottom, top):
        first, count = self.ctx.shard(self.batch_size)
        self.ctx.batch_offset = first
        self.ctx.global_batch = self.batch_size
        top[0].reshape(count, CHANNELS, self.crop, self.crop)
        top[1].reshape(count)

    def _reader(self, first, count):
        return WindowSampler(self, first, count)

    def _check(self, rows):
        self.watched.check(rows, list(self.param.top))


class WindowSampler:
    """Makes this rank's part of batch k in the prefetch thread; it copies what it needs from
    the layer instead of holding it, so the thread stops when the layer goes."""

    def __init__(self, layer, first, count):
        param = layer.param.window_data_param
        self.paths, self.sizes = layer.paths, layer.sizes
        self.windows, self.cache = layer.windows, layer.cache
        self.mean, self.crop = layer.mean, layer.crop
        self.batch_size, self.num_fg = layer.batch_size, layer.num_fg
        self.ctx = Context(layer.ctx.phase, seed=layer.ctx.seed)
        self.name, self.source = layer.name, param.source
        self.first, self.count = first, count
        self.context_pad, self.square = int(param.context_pad), param.crop_mode == "square"
        self.scale = layer.scale
        self.mirror = bool(layer.param.transform_param.mirror)

    def pick(self, k):
        """(windows (count, 6), mirror flags) of samples first.. of batch k: background for
        global indices below batch_size - num_fg, foreground after."""
        u = uniform_rows(self.ctx.seed, (self.name, "window", k), self.first, self.count, 2)
        is_fg = self.first + np.arange(self.count) >= self.batch_size - self.num_fg
        rows = np.empty((self.count, 6), np.int64)
        for fg in (False, True):
            here = is_fg == fg
            pool = self.windows[int(fg)]
            if here.any():
                rows[here] = pool[np.minimum((u[here, 0] * len(pool)).astype(np.intp),
                                             len(pool) - 1)]
        return rows, self.mirror & (u[:, 1] < 0.5)

    def __call__(self, k):
        rows, flip = self.pick(k)
        heights, widths = self.sizes[rows[:, IMAGE]].T
        boxes = warp_geometry(rows[:, X1:], heights, widths, flip, self.crop, self.context_pad,
                              self.square)
        data = np.zeros((self.count, CHANNELS, self.crop, self.crop), np.float32)
        for i, (x1, y1, x2, y2, out_w, out_h, pad_w, pad_h) in enumerate(boxes.tolist()):
            image = self.image(int(rows[i, IMAGE]))
            if x1 < 0 or y1 < 0 or x2 >= image.shape[2] or y2 >= image.shape[1] or x2 < x1 \
                    or y2 < y1:
                raise DataError(f"window file '{self.source}': window ({x1}, {y1}, {x2}, {y2}) "
                                f"of image {rows[i, IMAGE]} lies outside its "
                                f"{image.shape[2]}x{image.shape[1]} pixels")
            warped = resize_linear(image[:, y1:y2 + 1, x1:x2 + 1], out_h, out_w)
            if flip[i]:
                warped = warped[:, :, ::-1]
            place = (slice(None), slice(pad_h, pad_h + out_h), slice(pad_w, pad_w + out_w))
            data[i][place] = (warped - self.mean[place]) * self.scale
        samples = k * self.batch_size + self.first + np.arange(self.count)
        return samples, (data, rows[:, LABEL].astype(np.float32))

    def image(self, index):
        path, (height, width) = self.paths[index], self.sizes[index].tolist()
        where = f"window file '{self.source}': image {index}"
        if self.cache is not None:
            pixels = decode_image(self.cache[index], True, False, f"{where} '{path}'")
        else:
            pixels = read_image(path, True, where)
        if pixels.shape[1:] != (height, width):
            raise DataError(f"{where} '{path}' is {pixels.shape[2]}x{pixels.shape[1]} but the "
                            f"window file says {width}x{height}")
        return pixels


def warp_geometry(boxes, heights, widths, flip, crop, context_pad, square):
    """Caffe's window arithmetic, in its float32, for every sample at once.

    boxes (n, 4) x1 y1 x2 y2 inclusive; returns (n, 8) ints: the clipped source box, the size
    (out_w, out_h) it is warped to and where it goes in the crop (pad_w, pad_h)."""
    x1, y1, x2, y2 = (boxes[:, j].copy() for j in range(4))
    n = len(boxes)
    if not (context_pad > 0 or square):
        full = np.full(n, crop)
        return np.stack([x1, y1, x2, y2, full, full, np.zeros(n, np.int64),
                         np.zeros(n, np.int64)], axis=1)
    f32 = np.float32
    context_scale = f32(crop) / f32(crop - 2 * context_pad)
    half_h = ((y2 - y1 + 1) / 2.0).astype(f32)
    half_w = ((x2 - x1 + 1) / 2.0).astype(f32)
    center_x = x1.astype(f32) + half_w
    center_y = y1.astype(f32) + half_h
    if square:
        half_h = half_w = np.maximum(half_h, half_w)
    x1 = _round(center_x - half_w * context_scale)
    x2 = _round(center_x + half_w * context_scale)
    y1 = _round(center_y - half_h * context_scale)
    y2 = _round(center_y + half_h * context_scale)
    unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = np.maximum(0, -x1), np.maximum(0, -y1)
    pad_x2, pad_y2 = np.maximum(0, x2 - widths + 1), np.maximum(0, y2 - heights + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    scale_x = f32(crop) / unclipped_w.astype(f32)
    scale_y = f32(crop) / unclipped_h.astype(f32)
    out_w = _round((x2 - x1 + 1).astype(f32) * scale_x)
    out_h = _round((y2 - y1 + 1).astype(f32) * scale_y)
    pad_h = _round(pad_y1.astype(f32) * scale_y)
    pad_w = np.where(flip, _round(pad_x2.astype(f32) * scale_x),
                     _round(pad_x1.astype(f32) * scale_x))
    out_h = np.minimum(out_h, crop - pad_h)   # rounding may overshoot the crop
    out_w = np.minimum(out_w, crop - pad_w)
    return np.stack([x1, y1, x2, y2, out_w, out_h, pad_w, pad_h], axis=1)


def _round(values):
    """C's round (halves away from zero) of float32 values, as int64."""
    wide = values.astype(np.float64)
    return (np.sign(wide) * np.floor(np.abs(wide) + 0.5)).astype(np.int64)


def read_window_file(path, root_folder, fg_threshold, bg_threshold):
    """(image paths, int64 (images, 2) heights and widths, [background rows, foreground rows]);
    window rows are int64 (n, 6): image index, label, x1, y1, x2, y2."""
    try:
        with open(path) as f:
            tokens = [(token, n) for n, line in enumerate(f, 1) for token in line.split()]
    except OSError as exc:
        raise DataError(f"window file '{path}' cannot be read ({exc.strerror}); "
                        f"window_data_param.source must name it") from None
    if not tokens:
        raise DataError(f"window file '{path}' is empty")
    fg_threshold, bg_threshold = np.float32(fg_threshold), np.float32(bg_threshold)
    paths, sizes, windows = [], [], ([], [])
    counts = {0: 0}
    at = 0

    def take(kind, what):
        nonlocal at
        if at >= len(tokens):
            raise DataError(f"window file '{path}' ends where {what} was expected")
        token, line = tokens[at]
        at += 1
        try:
            return kind(token)
        except ValueError:
            raise DataError(f"{path}:{line}: expected {what}, got '{token}'") from None

    while at < len(tokens):
        line = tokens[at][1]
        if take(str, "'#'") != "#":
            raise DataError(f"{path}:{line}: expected '# image_index' to start an image")
        index = take(int, "the image index")
        if index != len(paths):
            raise DataError(f"{path}:{line}: image index {index} out of order; number images "
                            f"0, 1, 2, ... in file order")
        image_path = root_folder + take(str, "an image path")
        channels = take(int, "the channel count")
        height, width = take(int, "the image height"), take(int, "the image width")
        if channels != CHANNELS:
            raise DataError(f"{path}:{line}: image {index} has {channels} channels; WindowData "
                            f"reads every image in colour (3 channels)")
        paths.append(image_path)
        sizes.append((height, width))
        for _ in range(take(int, "the number of windows")):
            label = take(int, "a window label")
            overlap = take(np.float32, "a window overlap")
            box = [take(int, "a window coordinate") for _ in range(4)]
            if overlap >= fg_threshold:
                if label <= 0:
                    raise DataError(f"{path}:{tokens[at - 1][1]}: foreground window with label "
                                    f"{label}; foreground labels start at 1 (0 is background)")
                windows[1].append([index, label] + box)
                counts[label] = counts.get(label, 0) + 1
            elif overlap < bg_threshold:
                windows[0].append([index, 0] + box)
                counts[0] += 1
    log.info(f"window file '{path}': {len(paths)} images; windows per class: "
             + ", ".join(f"{label}: {counts[label]}" for label in sorted(counts)))
    return (paths, np.array(sizes, np.int64).reshape(-1, 2),
            [np.array(rows, np.int64).reshape(-1, 6) for rows in windows])
