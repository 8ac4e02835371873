"""py-faster-rcnn's region proposal layer (rbgirshick/py-faster-rcnn, lib/rpn/proposal_layer.py,
python_param { module: "rpn.proposal_layer" layer: "ProposalLayer" }), built in so that Faster
R-CNN's published test nets run without that repository on the path.

Bottoms: objectness probabilities (1, 2A, H, W) (background then object for A anchors),
box deltas (1, 4A, H, W) and im_info (1, 3): image height, width and scale. Tops: rois (R, 5),
rows (0, x1, y1, x2, y2), and optionally their scores (R, 1). As there: anchors of base size 16
for ratios 0.5, 1, 2 times `scales` (param_str, default 8, 16, 32) at every feat_stride-th
pixel, decoded with +1 pixel widths, clipped to the image, boxes under 16 * scale pixels
dropped, the best pre_nms_topN by score, greedy NMS at IoU 0.7 (a box overlapping a kept one
by that much or more goes), and the best post_nms_topN kept: 12000 / 2000 when training, 6000
/ 300 when testing (py-faster-rcnn's fast_rcnn/config.py defaults). Boxes are computed in
float32 as there; equal scores go higher index first (there, numpy's sort decides).
"""
import ast

import numpy as np

from syncsgd.errors import ShapeError
from syncsgd.python_layers.layer import PythonLayer

RATIOS = np.array([0.5, 1, 2])
BASE_SIZE = 16
MIN_SIZE = 16
NMS_THRESHOLD = np.float32(0.7)
TOP_N = {0: (12000, 2000), 1: (6000, 300)}     # phase (TRAIN, TEST) -> (before, after NMS)


def generate_anchors(scales):
    """(A, 4) anchors (x1, y1, x2, y2) around pixel (7.5, 7.5), ratio-major, in float64 with
    numpy's rounding (halves to even), as py-faster-rcnn's generate_anchors.py."""
    size = BASE_SIZE * BASE_SIZE
    widths = np.round(np.sqrt(size / RATIOS))
    heights = np.round(widths * RATIOS)
    widths = (widths[:, None] * scales).ravel()
    heights = (heights[:, None] * scales).ravel()
    center = 0.5 * (BASE_SIZE - 1)
    return np.stack([center - 0.5 * (widths - 1), center - 0.5 * (heights - 1),
                     center + 0.5 * (widths - 1), center + 0.5 * (heights - 1)], axis=1)


def decode(anchors, deltas):
    """py-faster-rcnn's bbox_transform_inv in the deltas' float32."""
    anchors = anchors.astype(np.float32)
    widths = anchors[:, 2] - anchors[:, 0] + np.float32(1)
    heights = anchors[:, 3] - anchors[:, 1] + np.float32(1)
    cx = anchors[:, 0] + np.float32(0.5) * widths
    cy = anchors[:, 1] + np.float32(0.5) * heights
    cx = deltas[:, 0] * widths + cx
    cy = deltas[:, 1] * heights + cy
    half_w = np.float32(0.5) * (np.exp(deltas[:, 2]) * widths)
    half_h = np.float32(0.5) * (np.exp(deltas[:, 3]) * heights)
    return np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)


def nms(boxes, threshold, limit):
    """Indices of rows of score-sorted (K, 4) boxes kept by py-faster-rcnn's cpu_nms (areas and
    overlaps with +1 pixel sides, in float32), stopping at `limit` kept."""
    one = np.float32(1)
    areas = (boxes[:, 2] - boxes[:, 0] + one) * (boxes[:, 3] - boxes[:, 1] + one)
    alive = np.ones(len(boxes), bool)
    kept = []
    for i in range(len(boxes)):
        if not alive[i]:
            continue
        kept.append(i)
        if len(kept) == limit:
            break
        rest = np.flatnonzero(alive[i + 1:]) + i + 1
        lo = np.maximum(boxes[i, :2], boxes[rest, :2])
        hi = np.minimum(boxes[i, 2:], boxes[rest, 2:])
        sides = np.maximum(np.float32(0), hi - lo + one)
        inter = sides[:, 0] * sides[:, 1]
        overlap = inter / (areas[i] + areas[rest] - inter)
        alive[rest[overlap >= threshold]] = False
    return np.asarray(kept, np.int64)


class ProposalLayer(PythonLayer):
    """py-faster-rcnn's ProposalLayer (see the module docstring)."""

    def setup(self, bottom, top):
        params = parse_param_str(self.param_str, self.where)
        if "feat_stride" not in params:
            raise ShapeError(f"{self.where}: param_str must give 'feat_stride' (the score "
                             f"map's stride in image pixels), e.g. \"'feat_stride': 16\"")
        self.stride = params["feat_stride"]
        scales = np.asarray(params.get("scales", (8, 16, 32)), np.float64).ravel()
        if not np.isfinite(self.stride) or self.stride <= 0 or not len(scales) or \
                not np.all(scales > 0):
            raise ShapeError(f"{self.where}: param_str needs a positive 'feat_stride' and "
                             f"positive 'scales', got {params}")
        self.anchors = generate_anchors(scales)
        self.before, self.after = TOP_N[self.phase]

    @property
    def where(self):
        name = self.layer_param.name if self.layer_param is not None else "?"
        return f"layer '{name}' (Python: rpn.proposal_layer.ProposalLayer, built in)"

    def reshape(self, bottom, top):
        a = len(self.anchors)
        scores, deltas, info = (b.shape for b in bottom[:3])
        if len(bottom) != 3 or not 1 <= len(top) <= 2:
            raise ShapeError(f"{self.where}: takes 3 bottoms (scores, deltas, im_info) and 1 "
                             f"or 2 tops (rois, scores), got {len(bottom)} and {len(top)}")
        if len(scores) != 4 or scores[:2] != (1, 2 * a) or deltas != (1, 4 * a) + scores[2:] \
                or bottom[2].count < 3:
            raise ShapeError(f"{self.where}: bottoms must be scores (1, {2 * a}, H, W), deltas "
                             f"(1, {4 * a}, H, W) and im_info (1, 3) for one image, got "
                             f"{scores}, {deltas} and {info}")
        top[0].reshape(1, 5)
        if len(top) > 1:
            top[1].reshape(1, 1)

    def forward(self, bottom, top):
        a = len(self.anchors)
        height, width = bottom[0].shape[2:]
        info = bottom[2].data.reshape(-1)[:3]
        shift_x = np.arange(width) * self.stride
        shift_y = np.arange(height) * self.stride
        shift_x, shift_y = np.meshgrid(shift_x, shift_y)
        shifts = np.stack([shift_x, shift_y, shift_x, shift_y], axis=-1).reshape(-1, 1, 4)
        anchors = (self.anchors[None] + shifts).reshape(-1, 4)      # (H*W*A, 4): (h, w, a)
        deltas = bottom[1].data[0].transpose(1, 2, 0).reshape(-1, 4)
        scores = bottom[0].data[0, a:].transpose(1, 2, 0).reshape(-1)
        boxes = decode(anchors, deltas)
        np.clip(boxes[:, 0::2], 0, np.maximum(info[1] - 1, 0), out=boxes[:, 0::2])
        np.clip(boxes[:, 1::2], 0, np.maximum(info[0] - 1, 0), out=boxes[:, 1::2])
        smallest = np.float32(MIN_SIZE) * info[2]
        one = np.float32(1)
        keep = np.flatnonzero((boxes[:, 2] - boxes[:, 0] + one >= smallest) &
                              (boxes[:, 3] - boxes[:, 1] + one >= smallest))
        order = keep[np.argsort(scores[keep], kind="stable")[::-1][:self.before]]
        kept = order[nms(boxes[order], NMS_THRESHOLD, self.after)]
        top[0].reshape(len(kept), 5)
        top[0].data[:, 0] = 0
        top[0].data[:, 1:] = boxes[kept]
        if len(top) > 1:
            top[1].reshape(len(kept), 1)
            top[1].data[:, 0] = scores[kept]


def parse_param_str(text, where):
    """The param_str dict, written as py-faster-rcnn's YAML flow mappings usually are
    ("'feat_stride': 16", with or without braces); PyYAML, when installed, reads the rest."""
    text = text.strip()
    try:
        value = ast.literal_eval(text if text.startswith("{") else "{" + text + "}")
    except (ValueError, SyntaxError, TypeError):
        try:
            import yaml
        except ImportError:
            raise ShapeError(f"{where}: cannot read param_str {text!r}; write it as "
                             f"\"'feat_stride': 16\"") from None
        value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise ShapeError(f"{where}: param_str {text!r} must be a mapping such as "
                         f"\"'feat_stride': 16\"")
    return value
