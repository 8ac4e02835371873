"""Caffe's TransformationParameter applied to a batch of rows: (x - mean) * scale, then crop and
mirror.

Random choices (crop offsets in TRAIN, mirror flags) are drawn per GLOBAL sample index from a
counter-based stream keyed by (seed, layer, batch), so a batch split over ranks gets exactly the
transforms it would get on one process.
"""
import numpy as np

from syncsgd import TRAIN
from syncsgd.context import uniform_rows
from syncsgd.errors import DataError, PrototxtError
from syncsgd.io.mean import fit_mean, load_mean


# TransformationParameter's fields from the SSD fork (weiliu89/caffe), which only AnnotatedData
# implements.
SSD_FIELDS = {"resize_param", "noise_param", "emit_constraint", "crop_h", "crop_w",
              "distort_param", "expand_param"}


class DataTransformer:
    """Transforms rows of shape `row_shape`; `where` names the layer in error messages."""

    def __init__(self, param, phase, row_shape, where):
        ssd = [f.name for f, _ in param.ListFields() if f.name in SSD_FIELDS]
        if ssd:
            raise PrototxtError(f"{where}: transform_param.{ssd[0]} is SSD's, read only by its "
                                f"AnnotatedData layer; remove it or use AnnotatedData")
        self.scale = float(param.scale)
        self.crop = int(param.crop_size)
        self.mirror = bool(param.mirror)
        self.random_crop = phase == TRAIN
        self.row_shape = tuple(row_shape)
        self.mean = self._mean(param, where)
        if self.crop or self.mirror:
            if len(self.row_shape) != 3:
                raise DataError(f"{where}: transform_param crop_size/mirror need rows of shape "
                                f"(channels, height, width), got {self.row_shape}")
            if self.crop > min(self.row_shape[1:]):
                raise PrototxtError(f"{where}: transform_param.crop_size {self.crop} exceeds the "
                                    f"data height x width {self.row_shape[1:]}; use a smaller crop")
        self.out_shape = (self.row_shape[:1] + (self.crop, self.crop) if self.crop
                          else self.row_shape)

    def _mean(self, param, where):
        if param.HasField("mean_file") and len(param.mean_value):
            raise PrototxtError(f"{where}: transform_param has both mean_file and mean_value; "
                                f"keep one")
        if param.HasField("mean_file"):
            return fit_mean(load_mean(param.mean_file), self.row_shape, param.mean_file)
        if not len(param.mean_value):
            return None
        values = np.asarray(param.mean_value, np.float32)
        channels = self.row_shape[0] if self.row_shape else 1
        if values.size == 1:
            return values[0]
        if values.size != channels:
            raise PrototxtError(f"{where}: transform_param has {values.size} mean_value entries "
                                f"for {channels} channels; give one value or one per channel")
        return values.reshape((channels,) + (1,) * (len(self.row_shape) - 1))

    @property
    def identity(self):
        return self.mean is None and self.scale == 1 and not self.crop and not self.mirror

    def apply(self, x, seed, key, first):
        """Transformed copy of the batch `x` (n, *row_shape), whose rows are global samples
        first, first+1, ...; `x` itself is overwritten."""
        if self.mean is not None:
            np.subtract(x, self.mean, out=x)
        if self.scale != 1:
            np.multiply(x, np.float32(self.scale), out=x)
        if not (self.crop or self.mirror):
            return x
        return self._crop_mirror(x, uniform_rows(seed, key, first, len(x), 3))

    def _crop_mirror(self, x, u):
        """Gather each sample's window (mirrored where flagged) with one take_along_axis.

        u: (n, 3) uniforms: crop row offset, crop column offset, mirror flag."""
        n, channels, height, width = x.shape
        out_h, out_w = self.out_shape[1:]
        if self.crop and self.random_crop:
            h_off = np.minimum((u[:, 0] * (height - out_h + 1)).astype(np.intp), height - out_h)
            w_off = np.minimum((u[:, 1] * (width - out_w + 1)).astype(np.intp), width - out_w)
        else:
            h_off = np.full(n, (height - out_h) // 2, np.intp)
            w_off = np.full(n, (width - out_w) // 2, np.intp)
        rows = h_off[:, None] + np.arange(out_h)                      # (n, out_h)
        cols = w_off[:, None] + np.arange(out_w)                      # (n, out_w)
        if self.mirror:
            flip = u[:, 2] < 0.5
            cols[flip] = cols[flip, ::-1]
        flat = (rows[:, :, None] * width + cols[:, None, :]).reshape(n, 1, out_h * out_w)
        picked = np.take_along_axis(x.reshape(n, channels, height * width), flat, axis=2)
        return picked.reshape(n, channels, out_h, out_w)
