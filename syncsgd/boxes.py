"""Box geometry of SSD (weiliu89/caffe, branch ssd) in float32 as the fork computes it: corner
boxes (xmin, ymin, xmax, ymax), their areas and Jaccard overlaps, the encoding of boxes against
priors and its inverse, and non-maximum suppression. Shared by the detection layers and SSD's
data augmentation (syncsgd/io/annotated.py)."""
import numpy as np

from syncsgd.proto import pb

_CODE = pb.PriorBoxParameter


def box_sizes(boxes):
    """Areas of (..., 4) corner boxes; 0 where a box is inverted, as SSD's BBoxSize."""
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    return np.where((w < 0) | (h < 0), np.float32(0), w * h)


def decode(loc, priors, variances, code_type, variance_in_target):
    """(P, 4) boxes from (P, 4) offsets and priors; variances (P, 4) unless encoded in target."""
    if not variance_in_target:
        loc = loc * variances
    if code_type == _CODE.CORNER:
        return priors + loc
    width = priors[:, 2] - priors[:, 0]
    height = priors[:, 3] - priors[:, 1]
    if code_type == _CODE.CORNER_SIZE:
        return priors + loc * np.stack([width, height, width, height], axis=1)
    cx = loc[:, 0] * width + (priors[:, 0] + priors[:, 2]) / np.float32(2)
    cy = loc[:, 1] * height + (priors[:, 1] + priors[:, 3]) / np.float32(2)
    half_w = np.exp(loc[:, 2]) * width / np.float32(2)
    half_h = np.exp(loc[:, 3]) * height / np.float32(2)
    return np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)


def encode(gt, priors, variances, code_type, variance_in_target):
    """SSD's EncodeBBox of (M, 4) gt boxes against (M, 4) priors: the inverse of decode."""
    if code_type == _CODE.CORNER:
        out = gt - priors
    else:
        width = priors[:, 2] - priors[:, 0]
        height = priors[:, 3] - priors[:, 1]
        sizes = np.stack([width, height, width, height], axis=1)
        if code_type == _CODE.CORNER_SIZE:
            out = (gt - priors) / sizes
        else:
            two = np.float32(2)
            out = np.stack([
                ((gt[:, 0] + gt[:, 2]) / two - (priors[:, 0] + priors[:, 2]) / two) / width,
                ((gt[:, 1] + gt[:, 3]) / two - (priors[:, 1] + priors[:, 3]) / two) / height,
                np.log((gt[:, 2] - gt[:, 0]) / width),
                np.log((gt[:, 3] - gt[:, 1]) / height)], axis=1)
    return out if variance_in_target else out / variances


def overlaps(a, a_sizes, b, b_sizes):
    """(A, B) Jaccard overlaps of corner boxes, in float32 as SSD's JaccardOverlap."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    sides = np.minimum(a[:, None, 2:], b[None, :, 2:]) - lo
    inter = np.where((sides > 0).all(axis=2), sides[..., 0] * sides[..., 1], np.float32(0))
    union = a_sizes[:, None] + b_sizes[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=inter > 0)


def nms(boxes, sizes, scores, threshold, nms_threshold, eta, top_k):
    """Indices SSD's ApplyNMSFast keeps: scores above `threshold`, best first (ties in index
    order), at most top_k of them, each kept when it overlaps no kept box by more than the
    current threshold (which eta < 1 lowers after each kept box while above 0.5)."""
    candidates = np.flatnonzero(scores > threshold)
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    if top_k > -1:
        candidates = candidates[:top_k]
    picked, picked_sizes = boxes[candidates], sizes[candidates]
    iou = overlaps(picked, picked_sizes, picked, picked_sizes)
    worst = np.zeros(len(candidates), np.float32)   # largest overlap with a kept box so far
    kept, limit = [], nms_threshold
    for j in range(len(candidates)):
        if worst[j] > limit:
            continue
        kept.append(j)
        np.maximum(worst, iou[j], out=worst)
        if eta < 1 and limit > 0.5:
            limit *= eta
    return candidates[kept]
