"""YoloDetectionOutput (YOLOv2's detection head, eric612/MobileNet-YOLO), for inference: decodes
the region map into boxes, keeps those whose objectness times best class probability reaches
confidence_threshold, and suppresses overlaps over all classes at once.

Bottoms: one or two (N, num_box * (5 + num_classes), S, S) maps, each box's entries x, y, w, h,
objectness, class scores; the fork takes S from the width for both sides, so maps must be
square. Box centres are (col + sigmoid(x)) / S, sizes exp(w) * biases[2k] / S; classes get a
softmax. Top (1, 1, D, 7): (image, label + 1, confidence, xmin, ymin, xmax, ymax), best first,
not clipped; with no detection one row (image, -1, ..., -1) per image.

As in the fork, the boxes of every image of the batch (and of both maps) go through one
suppression and every row says image 0: deploy nets run one image at a time. No backward, as in
the fork (its Backward_cpu is NOT_IMPLEMENTED).
"""
import numpy as np

from syncsgd.boxes import nms
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


def sigmoid(x):
    """The forks' `1. / (1. + exp(-x))`: in double, stored as float."""
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def yolo_rows(num, centres, labels, scores, nms_threshold):
    """The forks' (D, 7) detections from (K, 4) centre boxes (x, y, w, h), their labels and
    scores: best first, a box dropped when it overlaps a kept one by nms_threshold or more
    (whatever the labels); one row (image, -1, ...) per image when nothing is left."""
    if not len(scores):
        rows = np.full((num, 7), -1, np.float32)
        rows[:, 0] = np.arange(num)
        return rows
    half = centres[:, 2:] / np.float32(2)
    corners = np.concatenate([centres[:, :2] - half, centres[:, :2] + half], axis=1)
    sizes = centres[:, 2] * centres[:, 3]
    # The fork drops at iou >= threshold; nms drops above its limit: the float32 just below.
    limit = np.nextafter(np.float32(nms_threshold), np.float32(-np.inf))
    kept = nms(corners, sizes, scores, -np.inf, limit, 1.0, -1)
    rows = np.zeros((len(kept), 7), np.float32)
    rows[:, 1] = labels[kept] + 1
    rows[:, 2] = scores[kept]
    rows[:, 3:] = corners[kept]
    return rows


def write_rows(top, rows):
    top.reshape(1, 1, len(rows), 7)
    np.copyto(top.data.reshape(-1, 7), rows)


@register
class YoloDetectionOutputLayer(Layer):
    type = "YoloDetectionOutput"
    fork = "eric612/MobileNet-YOLO"
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.yolo_detection_output_param
        if not p.HasField("num_classes") or not p.num_classes:
            self.fail("yolo_detection_output_param.num_classes is required and must be "
                      "positive")
        if p.num_box == 0 or len(p.biases) < 2 * p.num_box:
            self.fail(f"yolo_detection_output_param needs num_box > 0 and 2 * num_box "
                      f"({2 * p.num_box}) biases, got {len(p.biases)}")
        self.classes, self.num_box = p.num_classes, p.num_box
        self.threshold = np.float32(p.confidence_threshold)
        self.nms_threshold = p.nms_threshold
        self.biases = np.asarray(p.biases, np.float32)[:2 * p.num_box].reshape(-1, 2)

    def reshape(self, bottom, top):
        entries = self.num_box * (5 + self.classes)
        for i, b in enumerate(bottom):
            shape = b.shape
            if len(shape) != 4 or shape[1] != entries or shape[2] != shape[3] or \
                    shape[0] != bottom[0].shape[0]:
                self.fail(f"bottom {i} must be a square (N, num_box * (5 + num_classes), S, "
                          f"S) map with C = {entries} and the batch of bottom 0, got {shape}")
        top[0].reshape(1, 1, max(bottom[0].shape[0], 1), 7)

    def forward(self, bottom, top):
        centres, labels, scores = [], [], []
        for b in bottom:
            box, label, score = self._predictions(b.data)
            keep = score >= self.threshold
            centres.append(box[keep])
            labels.append(label[keep])
            scores.append(score[keep])
        write_rows(top[0], yolo_rows(bottom[0].shape[0], np.concatenate(centres),
                                     np.concatenate(labels), np.concatenate(scores),
                                     self.nms_threshold))

    def _predictions(self, data):
        """Every box of a map in the fork's order (image, row, column, box): (K, 4) centre
        boxes, the best class and its probability times objectness."""
        n, _, side, _ = data.shape
        # (N, num_box, entries, S, S) -> (N, S, S, num_box, entries)
        x = data.reshape(n, self.num_box, -1, side, side).transpose(0, 3, 4, 1, 2)
        grid = np.arange(side, dtype=np.float32)
        size = np.float32(side)
        box = np.empty(x.shape[:-1] + (4,), np.float32)
        box[..., 0] = (grid[None, None, :, None] + sigmoid(x[..., 0])) / size
        box[..., 1] = (grid[None, :, None, None] + sigmoid(x[..., 1])) / size
        box[..., 2:] = np.exp(x[..., 2:4]) * self.biases / size
        scores = x[..., 5:] - x[..., 5:].max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        label = scores.argmax(axis=-1)
        best = np.take_along_axis(scores, label[..., None], axis=-1)[..., 0]
        return box.reshape(-1, 4), label.reshape(-1), (sigmoid(x[..., 4]) * best).reshape(-1)

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            self.fail("YoloDetectionOutput has no backward, as in the fork")
