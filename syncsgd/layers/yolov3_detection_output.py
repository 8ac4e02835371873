"""Yolov3DetectionOutput (YOLOv3's detection head, eric612/MobileNet-YOLO), for inference: each
bottom is one scale's map; every (box, class) whose sigmoid class score times objectness is
above confidence_threshold becomes a detection, and overlaps are suppressed over all classes.

Bottom t: (N, num_box * (5 + num_classes), H, W), each box's entries x, y, w, h, objectness and
class scores (with gaussian_box, Gaussian YOLOv3's x, its uncertainty, y, ..., h, its
uncertainty, objectness and classes). Box k of bottom t uses anchor m = mask[t * len(mask) /
mask_group_num + k]: centre ((col + sigmoid(x)) / W, (row + sigmoid(y)) / H), size exp(w) *
biases[2m] / (W * anchors_scale[t]) by exp(h) * biases[2m + 1] / (H * anchors_scale[t]). Rows
as YoloDetectionOutput's: all images through one suppression, image 0 in every row, as in the
fork's CPU path. No backward, as in the fork (its Backward_cpu does nothing).
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register
from syncsgd.layers.yolo_detection_output import sigmoid, write_rows, yolo_rows


@register
class Yolov3DetectionOutputLayer(Layer):
    type = "Yolov3DetectionOutput"
    fork = "eric612/MobileNet-YOLO"
    min_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.yolov3_detection_output_param
        if not p.HasField("num_classes") or not p.num_classes or not p.num_box:
            self.fail("yolov3_detection_output_param needs num_classes and num_box above 0")
        scales = len(bottom)
        if p.mask_group_num != scales or len(p.anchors_scale) < scales:
            self.fail(f"yolov3_detection_output_param.mask_group_num ({p.mask_group_num}) "
                      f"must be the number of bottoms ({scales}), each with an anchors_scale "
                      f"(got {len(p.anchors_scale)})")
        group = len(p.mask) // scales
        if group * (scales - 1) + p.num_box > len(p.mask):
            self.fail(f"yolov3_detection_output_param.mask: {len(p.mask)} entries leave fewer "
                      f"than num_box {p.num_box} for each of {scales} bottoms")
        anchors = np.asarray(p.mask, np.int64).reshape(-1)
        anchors = [anchors[t * group:t * group + p.num_box] for t in range(scales)]
        if max(a.max() for a in anchors) * 2 + 1 >= len(p.biases):
            self.fail(f"yolov3_detection_output_param.mask names anchor "
                      f"{max(a.max() for a in anchors)}, but {len(p.biases)} biases hold "
                      f"{len(p.biases) // 2}")
        biases = np.asarray(p.biases, np.float32).reshape(-1, 2)
        self.anchors = [biases[a] for a in anchors]             # per bottom (num_box, 2)
        self.scales = [np.float32(s) for s in p.anchors_scale[:scales]]
        self.classes, self.num_box, self.gaussian = p.num_classes, p.num_box, p.gaussian_box
        self.entries = (9 if self.gaussian else 5) + self.classes
        self.threshold = np.float32(p.confidence_threshold)
        self.nms_threshold = p.nms_threshold

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom):
            shape = b.shape
            if len(shape) != 4 or shape[1] != self.num_box * self.entries or \
                    shape[0] != bottom[0].shape[0]:
                self.fail(f"bottom {i} must be (N, num_box * {self.entries}, H, W) with C = "
                          f"{self.num_box * self.entries} and the batch of bottom 0, got "
                          f"{shape}")
        top[0].reshape(1, 1, max(bottom[0].shape[0], 1), 7)

    def forward(self, bottom, top):
        centres, labels, scores = [], [], []
        for b, anchors, scale in zip(bottom, self.anchors, self.scales):
            box, score = self._predictions(b.data, anchors, scale)
            # In the fork's order: image, cell, box, class.
            image, cell, k, label = np.nonzero(score > self.threshold)
            centres.append(box[image, cell, k])
            labels.append(label)
            scores.append(score[image, cell, k, label])
        write_rows(top[0], yolo_rows(bottom[0].shape[0], np.concatenate(centres),
                                     np.concatenate(labels), np.concatenate(scores),
                                     self.nms_threshold))

    def _predictions(self, data, anchors, scale):
        """(N, H*W, num_box, 4) centre boxes and (N, H*W, num_box, classes) scores."""
        n, _, h, w = data.shape
        # (N, num_box, entries, H*W) -> (N, H*W, num_box, entries)
        x = data.reshape(n, self.num_box, self.entries, h * w).transpose(0, 3, 1, 2)
        if self.gaussian:
            uncertainty = sigmoid(x[..., [1, 3, 5, 7]]).astype(np.float64)
            certainty = 4.0 - uncertainty.sum(axis=-1)
            objectness = (sigmoid(x[..., 8]) * certainty / 4.0).astype(np.float32)
            offsets, sizes, classes = x[..., [0, 2]], x[..., [4, 6]], x[..., 9:]
        else:
            objectness = sigmoid(x[..., 4])
            offsets, sizes, classes = x[..., 0:2], x[..., 2:4], x[..., 5:]
        cell = np.arange(h * w)
        box = np.empty(x.shape[:-1] + (4,), np.float32)
        box[..., 0] = ((cell % w).astype(np.float32)[:, None] + sigmoid(offsets[..., 0])) \
            / np.float32(w)
        box[..., 1] = ((cell // w).astype(np.float32)[:, None] + sigmoid(offsets[..., 1])) \
            / np.float32(h)
        box[..., 2:] = np.exp(sizes) * anchors / (np.float32([w, h]) * scale)
        return box, sigmoid(classes) * objectness[..., None]

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            self.fail("Yolov3DetectionOutput has no backward, as in the fork")
