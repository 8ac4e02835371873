"""AnnotatedData (SSD, weiliu89/caffe branch ssd): images and their boxes from an LMDB of
AnnotatedDatum, augmented per image as SSD trains (syncsgd.io.annotated).

top[0] (n, C, H, W) the images; top[1] (1, 1, max(G, 1), 8) the boxes of the rank's images, one
row (image, label, instance, xmin, ymin, xmax, ymax, difficult) each, image counted in the
rank's slice (MultiBoxLoss's bottom 3); all -1 when no image has a box, as in SSD. Records that
name no annotation type (and no annotated_data_param.anno_type) give the Datum labels (n,)
instead, as in the fork. Batching,
sharding, prefetch and seek are HDF5Data's; each image's random choices come from a generator
keyed by (layer, batch, global sample index), the same on any number of ranks.
"""
import numpy as np

from syncsgd.context import Context
from syncsgd.errors import DataError, PrototxtError
from syncsgd.io import annotated as aug
from syncsgd.io.lmdb import is_lmdb
from syncsgd.layers.hdf5_data import HDF5DataLayer
from syncsgd.layers.registry import register
from syncsgd.proto import pb

# transform_param fields of SSD this layer does not implement: refused, never ignored.
REFUSED = ("crop_size", "crop_h", "crop_w", "mean_file", "noise_param")


def set_fields(message):
    """{name: value} of the fields set in a message (also for fields a schema may lack)."""
    return {field.name: value for field, value in message.ListFields()}


@register
class AnnotatedDataLayer(HDF5DataLayer):
    type = "AnnotatedData"
    fork = "weiliu89/caffe (ssd)"
    exact_bottoms = 0
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        data = self.param.data_param
        where = f"layer '{self.name}' ({self.type})"
        if not data.source or not is_lmdb(data.source):
            raise PrototxtError(f"{where}: data_param.source '{data.source}' is not an LMDB "
                                f"database of AnnotatedDatum; name the database folder")
        if data.batch_size < max(1, self.ctx.size):
            raise PrototxtError(f"{where}: data_param.batch_size {data.batch_size} must be at "
                                f"least the number of ranks ({self.ctx.size})")
        transform = self.param.transform_param
        fields = set_fields(transform)
        for name in REFUSED:
            if name in fields and fields[name]:
                raise PrototxtError(f"{where}: transform_param.{name} is not supported by "
                                    f"syncsgd's AnnotatedData; remove it")
        self.resize = fields.get("resize_param")
        if self.resize is not None:
            mode = self.resize.resize_mode
            if mode != pb.ResizeParameter.WARP:
                raise PrototxtError(f"{where}: transform_param.resize_param.resize_mode "
                                    f"{pb.ResizeParameter.Resize_mode.Name(mode)} is not "
                                    f"supported; use WARP")
            if self.resize.height < 1 or self.resize.width < 1:
                raise PrototxtError(f"{where}: transform_param.resize_param needs positive "
                                    f"height and width")
            if self.resize.prob != 1:
                raise PrototxtError(f"{where}: transform_param.resize_param.prob "
                                    f"{self.resize.prob} is not supported; use 1")
        self.distort = fields.get("distort_param")
        self.expand = fields.get("expand_param")
        if self.expand is not None and self.expand.max_expand_ratio < 1:
            raise PrototxtError(f"{where}: transform_param.expand_param.max_expand_ratio must "
                                f"be at least 1")
        self.emit = fields.get("emit_constraint")
        anno = self.param.annotated_data_param
        for s in anno.batch_sampler:
            if not 0 < s.sampler.min_scale <= s.sampler.max_scale <= 1 or \
                    not 0 < s.sampler.min_aspect_ratio <= s.sampler.max_aspect_ratio:
                raise PrototxtError(f"{where}: annotated_data_param.batch_sampler.sampler needs "
                                    f"0 < min_scale <= max_scale <= 1 and 0 < "
                                    f"min_aspect_ratio <= max_aspect_ratio")
        self.samplers = list(anno.batch_sampler)
        self.mirror = bool(transform.mirror)
        self.scale = np.float32(transform.scale)
        self.source = aug.AnnotatedSource(data.source, color=transform.force_color,
                                          gray=transform.force_gray)
        height, width, channels = self.source.first_shape
        if self.resize is not None:
            height, width = self.resize.height, self.resize.width
        self.out_shape = (channels, height, width)
        means = np.asarray(transform.mean_value, np.float32)
        if means.size not in (0, 1, channels):
            raise PrototxtError(f"{where}: transform_param has {means.size} mean_value "
                                f"entries for {channels} channels; give one or one per channel")
        self.mean = np.resize(means, channels) if means.size else None
        self.fill = np.rint(self.mean).clip(0, 255).astype(np.uint8) if means.size else 0
        self.typed = self.source.typed or anno.HasField("anno_type")
        self.names = ["data", "label"][:len(top)]
        self.batch_size = int(data.batch_size)
        self.shuffle = False
        self.batch = 0

    def reshape(self, bottom, top):
        first, count = self.ctx.shard(self.batch_size)
        self.ctx.batch_offset = first
        self.ctx.global_batch = self.batch_size
        top[0].reshape(count, *self.out_shape)
        if len(top) > 1 and not self.typed:
            top[1].reshape(count)
        elif len(top) > 1 and top[1].num_axes != 4:
            top[1].reshape(1, 1, 1, 8)

    def forward(self, bottom, top):
        self.reshape(bottom, top)
        rows, (images, labels) = self._feed().get()
        self._check(rows)
        np.copyto(top[0].data, images)
        if len(top) > 1:
            top[1].reshape(*labels.shape)
            np.copyto(top[1].data, labels)
        self.batch += 1

    def _reader(self, first, count):
        return AnnotatedReader(Augmentation(self), self.typed, self.source, self.batch_size,
                               Context(self.ctx.phase, seed=self.ctx.seed), self.name, first,
                               count)


class Augmentation:
    """The layer's per-image settings, apart from the layer (the prefetch thread holds it)."""

    def __init__(self, layer):
        for name in ("distort", "expand", "fill", "emit", "samplers", "resize",
                     "out_shape", "mirror", "mean", "scale", "name", "type"):
            setattr(self, name, getattr(layer, name))

    def sample(self, image, boxes, encoded, rng):
        """One image's augmentation in SSD's order: (float32 (C, H, W), boxes). As in the
        fork, in any phase (a test net sets none of it), and for a raw (not encoded) record
        without distortion and with expansion filled with byte 32, as the fork's Datum path
        does. The fork re-encodes each augmented image as JPEG; syncsgd keeps the pixels."""
        if self.distort is not None and encoded:
            image = aug.distort(image, self.distort, rng)
        if self.expand is not None:
            fill = self.fill if encoded else 32
            image, boxes = aug.expand(image, boxes, self.expand, fill, self.emit, rng)
        if self.samplers:
            crops = aug.sample_crops(boxes, self.samplers, rng)
            if len(crops):
                image, boxes = aug.crop(image, boxes, crops[int(rng.integers(len(crops)))],
                                        self.emit)
        if self.resize is not None:
            image, boxes = aug.resize(image, boxes, self.resize, rng)
        if image.shape[:2] != self.out_shape[1:]:
            raise DataError(f"layer '{self.name}' ({self.type}): an image of "
                                f"{image.shape[:2]} in a batch of {self.out_shape[1:]}; give "
                                f"transform_param.resize_param or convert to one size")
        boxes = aug.transform_boxes(boxes, np.array([0, 0, 1, 1], np.float32), self.emit)
        out = image.astype(np.float32).transpose(2, 0, 1)
        if self.mirror and rng.random() < 0.5:
            out = out[:, :, ::-1]
            boxes[:, [2, 4]] = 1 - boxes[:, [4, 2]]
        if self.mean is not None:
            out = out - self.mean[:, None, None]
        return out * self.scale, boxes


class AnnotatedReader:
    """Makes this rank's part of batch k in the prefetch thread: (rows, (images, labels)); it
    holds neither the layer nor the net's context, as HDF5Data's BatchReader."""

    def __init__(self, augmentation, typed, source, batch_size, ctx, name, first, count):
        self.augmentation, self.typed = augmentation, typed
        self.source, self.batch_size = source, batch_size
        self.ctx, self.name, self.first, self.count = ctx, name, first, count

    def __call__(self, k):
        position = k * self.batch_size + self.first + np.arange(self.count, dtype=np.int64)
        rows = position % self.source.total
        images = np.empty((self.count,) + self.augmentation.out_shape, np.float32)
        labels, plain = [], np.empty(self.count, np.float32)
        for i, (image, boxes, encoded, label) in enumerate(self.source.read(rows.tolist())):
            rng = self.ctx.rng(self.name, "augment", k, int(position[i]))
            images[i], boxes = self.augmentation.sample(image, boxes, encoded, rng)
            labels.append(np.column_stack([np.full(len(boxes), i, np.float32), boxes]))
            plain[i] = label
        if not self.typed:
            return rows, (images, plain)
        labels = np.concatenate(labels) if labels else np.zeros((0, 8), np.float32)
        if not len(labels):
            labels = np.full((1, 8), -1, np.float32)
        return rows, (images, labels.reshape(1, 1, -1, 8))
