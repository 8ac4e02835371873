"""SSD's annotated images (weiliu89/caffe, branch ssd): LMDB records of AnnotatedDatum, and the
augmentation its AnnotatedData layer applies per image (photometric distortion, expansion,
sampling a crop by its overlap with the boxes, resizing, mirroring) with the boxes following.

Random draws come from the generator the caller passes (keyed by the global sample index), so a
batch split over ranks gets the augmentation one process gives it. Boxes are (n, 7) float32 rows
(group_label, instance_id, xmin, ymin, xmax, ymax, difficult) in [0, 1] image coordinates.
"""
import numpy as np

from syncsgd.boxes import box_sizes, overlaps
from syncsgd.errors import DataError
from syncsgd.io.lmdb import LMDBSource, require
from syncsgd.proto import pb

F32 = np.float32


class AnnotatedSource(LMDBSource):
    """The AnnotatedDatum records of one LMDB, in key order; read(rows) gives per record
    (image, boxes, encoded, label): the uint8 (H, W, C) BGR image as OpenCV decodes it, its
    boxes, whether it was stored encoded (the fork augments raw images differently) and the
    Datum's label. `typed`: whether the first record gives an annotation type (the fork's
    has_type; without it the layer gives the Datum labels instead of boxes)."""

    def _describe(self, first):
        record = pb.AnnotatedDatum()
        record.ParseFromString(first)
        self.typed = record.HasField("type")
        ((image, _, _, _),) = self.read([0])
        self.first_shape = image.shape

    def read(self, rows):
        return [self._decode_one(row, value)
                for row, value in zip(rows, self._values(list(rows)))]

    def _decode_one(self, row, value):
        record = pb.AnnotatedDatum()
        where = f"LMDB '{self.path}': record {self.key(row)!r}"
        try:
            record.ParseFromString(value)
        except Exception as exc:  # protobuf's DecodeError or RuntimeError, by version
            raise DataError(f"{where} is not an AnnotatedDatum ({exc})") from None
        if record.type != pb.AnnotatedDatum.BBOX:
            raise DataError(f"{where}: annotation type {record.type} is not BBOX")
        return (decode_image(record.datum, self.color, self.gray, where), boxes_of(record),
                record.datum.encoded, record.datum.label)


def decode_image(datum, color, gray, where):
    """uint8 (H, W, C) of a Datum, as the fork's OpenCV decoding gives it."""
    if datum.encoded:
        cv2 = require("cv2", "opencv-python-headless", "decoding SSD's encoded images")
        flag = cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE if gray else \
            cv2.IMREAD_UNCHANGED
        image = cv2.imdecode(np.frombuffer(datum.data, np.uint8), flag)
        if image is None:
            raise DataError(f"{where} holds an image OpenCV cannot decode")
        return image[:, :, None] if image.ndim == 2 else image
    size = datum.channels * datum.height * datum.width
    if len(datum.data) != size or not size:
        raise DataError(f"{where} holds {len(datum.data)} bytes for {datum.channels}x"
                        f"{datum.height}x{datum.width} (AnnotatedData reads uint8 images)")
    return np.frombuffer(datum.data, np.uint8).reshape(
        datum.channels, datum.height, datum.width).transpose(1, 2, 0)


def boxes_of(record):
    rows = [(group.group_label, anno.instance_id, anno.bbox.xmin, anno.bbox.ymin,
             anno.bbox.xmax, anno.bbox.ymax, anno.bbox.difficult)
            for group in record.annotation_group for anno in group.annotation]
    return np.array(rows, F32).reshape(-1, 7)


# -- boxes -----------------------------------------------------------------------------------
def clip_boxes(boxes):
    return np.clip(boxes, F32(0), F32(1))


def coverage(a, b):
    """(A, B): the part of each box of `a` that each box of `b` covers (SSD's BBoxCoverage)."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    sides = np.minimum(a[:, None, 2:], b[None, :, 2:]) - lo
    inter = np.where((sides >= 0).all(axis=2), sides[..., 0] * sides[..., 1], F32(0))
    size = box_sizes(a)[:, None]
    return np.divide(inter, size, out=np.zeros_like(inter), where=inter > 0)


def transform_boxes(boxes, crop, emit):
    """SSD's TransformAnnotation for a crop box (in the image's [0, 1] coordinates): the boxes
    that meet the emit constraint and overlap the crop, projected into it and clipped."""
    xy = boxes[:, 2:6]
    if emit is not None:
        if emit.emit_type == pb.EmitConstraint.CENTER:
            cx, cy = (xy[:, 0] + xy[:, 2]) / 2, (xy[:, 1] + xy[:, 3]) / 2
            keep = (cx >= crop[0]) & (cx <= crop[2]) & (cy >= crop[1]) & (cy <= crop[3])
        else:
            keep = coverage(xy, crop[None])[:, 0] > F32(emit.emit_overlap)
        boxes, xy = boxes[keep], xy[keep]
    inside = ~((xy[:, 0] >= crop[2]) | (xy[:, 2] <= crop[0]) |
               (xy[:, 1] >= crop[3]) | (xy[:, 3] <= crop[1]))
    boxes = boxes[inside].copy()
    size = np.array([crop[2] - crop[0], crop[3] - crop[1]] * 2, F32)
    boxes[:, 2:6] = clip_boxes((boxes[:, 2:6] - np.tile(crop[:2], 2)) / size)
    return boxes[box_sizes(boxes[:, 2:6]) > 0]


# -- augmentation ----------------------------------------------------------------------------
def uniform(rng, low, high, size=None):
    return (F32(low) + (F32(high) - F32(low)) * rng.random(size, np.float32)).astype(F32)


def convert(image, alpha, beta):
    """OpenCV's convertTo on uint8: rounded and saturated."""
    return np.clip(np.rint(image.astype(F32) * F32(alpha) + F32(beta)), 0, 255).astype(np.uint8)


def distort(image, p, rng):
    """SSD's ApplyDistort: brightness, contrast (before or after the colour changes), saturation,
    hue, channel order, each with its probability."""
    cv2 = require("cv2", "opencv-python-headless", "SSD's distort_param")

    def hsv(image, channel, alpha, beta):
        converted = cv2.cvtColor(image, cv2.COLOR_BGR2HSV)
        converted[..., channel] = convert(converted[..., channel], alpha, beta)
        return cv2.cvtColor(converted, cv2.COLOR_HSV2BGR)

    def brightness(image):
        if rng.random() < p.brightness_prob:
            delta = uniform(rng, -p.brightness_delta, p.brightness_delta)
            return convert(image, 1, delta) if delta != 0 else image
        return image

    def contrast(image):
        if rng.random() < p.contrast_prob:
            delta = uniform(rng, p.contrast_lower, p.contrast_upper)
            return convert(image, delta, 0) if abs(delta - 1) > 1e-3 else image
        return image

    def saturation(image):
        if rng.random() < p.saturation_prob:
            return hsv(image, 1, uniform(rng, p.saturation_lower, p.saturation_upper), 0)
        return image

    def hue(image):
        if rng.random() < p.hue_prob:
            delta = uniform(rng, -p.hue_delta, p.hue_delta)
            return hsv(image, 0, 1, delta) if delta != 0 else image
        return image

    if image.shape[2] != 3:
        raise DataError(f"distort_param needs colour images, got {image.shape[2]} channel(s)")
    steps = (brightness, contrast, saturation, hue) if rng.random() > 0.5 else \
        (brightness, saturation, hue, contrast)
    for step in steps:
        image = step(image)
    if rng.random() < p.random_order_prob:
        image = np.ascontiguousarray(image[..., rng.permutation(3)])
    return image


def expand(image, boxes, p, fill, emit, rng):
    """SSD's ExpandImage: the image at a random place of a larger canvas filled with the mean."""
    if rng.random() > p.prob or abs(p.max_expand_ratio - 1) < 1e-2:
        return image, boxes
    ratio = uniform(rng, 1, p.max_expand_ratio)
    height, width = image.shape[:2]
    big_h, big_w = int(height * ratio), int(width * ratio)
    top = np.floor(uniform(rng, 0, big_h - height))
    left = np.floor(uniform(rng, 0, big_w - width))
    canvas = np.empty((big_h, big_w, image.shape[2]), np.uint8)
    canvas[...] = fill
    canvas[int(top):int(top) + height, int(left):int(left) + width] = image
    crop = np.array([-left / width, -top / height, (big_w - left) / width,
                     (big_h - top) / height], F32)
    return canvas, transform_boxes(boxes, crop, emit)


def sample_crops(boxes, samplers, rng):
    """SSD's GenerateBatchSamples: per batch_sampler, up to max_trials random boxes, kept when
    they meet the sample_constraint (at most max_sample of them)."""
    found = []
    for s in samplers:
        if not s.use_original_image:
            continue
        trials = s.max_trials
        scale = uniform(rng, s.sampler.min_scale, s.sampler.max_scale, trials)
        ratio = uniform(rng, s.sampler.min_aspect_ratio, s.sampler.max_aspect_ratio, trials)
        ratio = np.clip(ratio, scale ** 2, 1 / scale ** 2)
        width, height = scale * np.sqrt(ratio), scale / np.sqrt(ratio)
        left = uniform(rng, 0, 1, trials) * (1 - width)
        top = uniform(rng, 0, 1, trials) * (1 - height)
        crops = np.stack([left, top, left + width, top + height], axis=1).astype(F32)
        crops = crops[satisfied(crops, boxes[:, 2:6], s.sample_constraint)]
        if s.HasField("max_sample"):
            crops = crops[:s.max_sample]
        found.append(crops)
    return np.concatenate(found) if found else np.zeros((0, 4), F32)


def satisfied(crops, objects, c):
    """SSD's SatisfySampleConstraint, which (as written in the fork) accepts a crop when some
    object passes the first constraint given (jaccard, then sample, then object coverage)."""
    for names, values in (
            (("min_jaccard_overlap", "max_jaccard_overlap"),
             lambda: overlaps(crops, box_sizes(crops), objects, box_sizes(objects))),
            (("min_sample_coverage", "max_sample_coverage"), lambda: coverage(crops, objects)),
            (("min_object_coverage", "max_object_coverage"),
             lambda: coverage(objects, crops).T)):
        low, high = names
        if c.HasField(low) or c.HasField(high):
            v = values()
            ok = np.ones(v.shape, bool)
            if c.HasField(low):
                ok &= v >= F32(getattr(c, low))
            if c.HasField(high):
                ok &= v <= F32(getattr(c, high))
            return ok.any(axis=1)
    return np.ones(len(crops), bool)


def crop(image, boxes, box, emit):
    """SSD's CropImage: the pixels of a [0, 1] box (clipped, truncated to whole pixels)."""
    box = clip_boxes(box)
    height, width = image.shape[:2]
    scaled = box * np.array([width, height, width, height], F32)
    left, top = int(scaled[0]), int(scaled[1])
    w, h = int(scaled[2] - scaled[0]), int(scaled[3] - scaled[1])
    return image[top:top + h, left:left + w].copy(), transform_boxes(boxes, box, emit)


INTERPOLATION = {pb.ResizeParameter.LINEAR: "INTER_LINEAR", pb.ResizeParameter.AREA: "INTER_AREA",
                 pb.ResizeParameter.NEAREST: "INTER_NEAREST",
                 pb.ResizeParameter.CUBIC: "INTER_CUBIC",
                 pb.ResizeParameter.LANCZOS4: "INTER_LANCZOS4"}


def resize(image, boxes, p, rng):
    """SSD's WARP resize to (height, width), one of interp_mode at random; boxes clipped."""
    cv2 = require("cv2", "opencv-python-headless", "SSD's resize_param")
    modes = list(p.interp_mode) or [pb.ResizeParameter.LINEAR]
    mode = modes[int(rng.integers(len(modes)))]
    out = cv2.resize(image, (p.width, p.height), interpolation=getattr(cv2, INTERPOLATION[mode]))
    return (out[:, :, None] if out.ndim == 2 else out), warp_boxes(boxes, image.shape[:2],
                                                                   (p.height, p.width))


def warp_boxes(boxes, old, new):
    """SSD's UpdateBBoxByResizePolicy for WARP, with its float32 steps: to pixels, scaled,
    clipped to the new image, back to [0, 1]."""
    (old_h, old_w), (new_h, new_w) = (np.float32(old), np.float32(new))
    scale = np.array([old_w, old_h, old_w, old_h], F32)
    size = np.array([new_w, new_h, new_w, new_h], F32)
    pixels = boxes[:, 2:6] * scale * size / scale
    boxes = boxes.copy()
    boxes[:, 2:4] = np.maximum(F32(0), pixels[:, :2])
    boxes[:, 4:6] = np.minimum(size[2:], pixels[:, 2:])
    boxes[:, 2:6] /= size
    return boxes
