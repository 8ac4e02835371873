"""Region (YOLOv2's output in lwplw/caffe_yolov2, a fork of gklz1982/caffe-yolov2's family):
puts the prediction map into darknet's box-major order and activates what the fork activates, so
that the fork's Python post-processing (which applies the logistic to x and y itself) reads it.

The (N, C, H, W) bottom, C = boxes_of_each_grid * (coords + 1 + classes), becomes a top of the
same shape whose values are laid out (N, H * W, boxes, coords + 1 + classes): per box the
logistic of entry 4 (objectness) and, with `softmax`, a softmax over the `classes` entries from
entry 5; x, y, w and h pass unchanged. The fork reads entries 4 and 5 whatever `coords` says,
so only coords 4 is accepted. The fork's C++ never reads `softmax` (its flag is left
uninitialised); the field is read here as its prototxt files mean it.

Inference only: the fork's backward leaves the bottom's gradient untouched; here it refuses.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class RegionLayer(Layer):
    type = "Region"
    fork = "lwplw/caffe_yolov2"
    exact_bottoms = 1
    exact_tops = 1
    sample_wise = True

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.region_param
        if p.coords != 4:
            self.fail(f"region_param.coords {p.coords}: the fork reads objectness at entry 4 "
                      "and classes from entry 5, so coords must be 4")
        if p.boxes_of_each_grid == 0:
            self.fail("region_param.boxes_of_each_grid must be positive")
        self.classes, self.boxes, self.softmax = p.classes, p.boxes_of_each_grid, p.softmax
        self.entries = p.coords + 1 + p.classes

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4 or shape[1] != self.boxes * self.entries:
            self.fail(f"the bottom must be (N, C, H, W) with C = boxes_of_each_grid * "
                      f"(coords + 1 + classes) = {self.boxes * self.entries}, got {shape}")
        top[0].reshape_like(bottom[0])

    def forward(self, bottom, top):
        n, c = bottom[0].shape[:2]
        # (N, C, H*W) -> (N, H*W, C): box k of cell i is entries [k*E, (k+1)*E) of row i.
        boxes = top[0].data.reshape(n, -1, c)
        np.copyto(boxes, bottom[0].data.reshape(n, c, -1).transpose(0, 2, 1))
        boxes = boxes.reshape(n, -1, self.boxes, self.entries)
        objectness = boxes[..., 4].astype(np.float64)
        boxes[..., 4] = 1.0 / (1.0 + np.exp(-objectness))
        if self.softmax and self.classes:
            scores = boxes[..., 5:]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            self.fail("Region has no backward (the fork's leaves the gradient untouched): "
                      "keep it off the path from the parameters to a loss")
