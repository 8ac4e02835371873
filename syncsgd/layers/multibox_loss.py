"""MultiBoxLoss (SSD, weiliu89/caffe branch ssd): the training loss of SSD's detection head.

Per image, priors are matched to ground-truth boxes (bipartite, then per prediction above
overlap_threshold); matched priors regress the encoded box (smooth L1 or L2) and classify its
label, and the hardest unmatched priors (highest background loss) are kept as negatives, up to
neg_pos_ratio per positive. The sums are divided by the normaliser of the global batch (VALID:
the matches over all ranks), so ranks holding slices of the batch together equal one process.

Bottoms: loc (N, P*L*4), conf (N, P*classes), PriorBox's (1, 2, P*4) and AnnotatedData's labels
(1, 1, G, 8): rows (image, label, instance, xmin, ymin, xmax, ymax, difficult), image counted in
this rank's slice. As in SSD, the loc (conf) part counts only where propagate_down is true for
bottom 0 (1); the gradient of a picked row is copied back as the fork does.
"""
import numpy as np

from syncsgd.boxes import box_sizes, decode, encode, overlaps
from syncsgd.layers.base import Layer
from syncsgd.layers.loss import FLT_MIN, normaliser, normalization_mode
from syncsgd.layers.registry import register
from syncsgd.layers.smooth_l1_loss import smooth_l1
from syncsgd.proto import pb

_P = pb.MultiBoxLossParameter


def match(gt, preds, match_type, threshold, ignore_cross_boundary):
    """SSD's MatchBBox: (P,) index of the matched gt box (-1 none, -2 ignored) and (P,) overlap
    (the best over all gt boxes for an unmatched prediction). gt (G, 4), preds (P, 4)."""
    count = len(preds)
    indices = np.full(count, -1, np.int64)
    if not len(gt):
        return indices, np.zeros(count, np.float32)
    iou = overlaps(preds, box_sizes(preds), gt, box_sizes(gt))
    if ignore_cross_boundary:
        outside = ((preds < 0) | (preds > 1)).any(axis=1)
        indices[outside] = -2
        iou[outside] = 0
    present = iou > np.float32(1e-6)
    best = np.where(present, iou, np.float32(0)).max(axis=1)
    # Bipartite: the largest remaining overlap, first in (prediction, gt) order, pairs them.
    free = np.where(present & (indices == -1)[:, None], iou, np.float32(-1))
    for _ in range(len(gt)):
        flat = int(np.argmax(free))
        i, j = divmod(flat, len(gt))
        if free[i, j] < 0:
            break
        indices[i], best[i] = j, free[i, j]
        free[i, :] = -1
        free[:, j] = -1
    if match_type == _P.PER_PREDICTION:
        rest = np.flatnonzero(indices == -1)
        candidates = np.where(present[rest] & (iou[rest] >= np.float32(threshold)),
                              iou[rest], np.float32(-1))
        j = np.argmax(candidates, axis=1)
        found = candidates[np.arange(len(rest)), j] >= 0
        indices[rest[found]] = j[found]
        best[rest[found]] = candidates[np.arange(len(rest)), j][found]
    return indices, best


def softmax_rows(x):
    """Row softmax in float32, as Caffe's Softmax (max subtracted)."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@register
class MultiBoxLossLayer(Layer):
    type = "MultiBoxLoss"
    fork = "weiliu89/caffe (ssd)"
    is_loss = True
    exact_bottoms = 4
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.multibox_loss_param
        if not p.HasField("num_classes") or p.num_classes < 1:
            self.fail("multibox_loss_param.num_classes is required (at least 1)")
        self.p = p
        self.classes = p.num_classes
        self.loc_classes = 1 if p.share_location else self.classes
        self.background = p.background_label_id
        self.mining = p.mining_type
        if p.HasField("do_neg_mining") and p.do_neg_mining != (self.mining != _P.NONE):
            self.fail("do_neg_mining (deprecated) contradicts mining_type; drop do_neg_mining")
        if self.mining == _P.HARD_EXAMPLE:
            self.fail("mining_type HARD_EXAMPLE is not supported; use MAX_NEGATIVE or NONE")
        if self.mining != _P.NONE and not p.share_location:
            self.fail("negative mining needs share_location: true (as in SSD); set "
                      "mining_type: NONE to train per-class locations")
        if p.HasField("nms_param") and p.nms_param.nms_threshold > 0:
            self.fail("multibox_loss_param.nms_param (NMS among mined negatives) is not "
                      "supported; remove it")
        if p.conf_loss_type == _P.SOFTMAX and self.background >= self.classes:
            self.fail(f"background_label_id {self.background} must be below num_classes "
                      f"{self.classes} for the SOFTMAX confidence loss")
        if p.map_object_to_agnostic and self.classes != 2:
            self.fail("map_object_to_agnostic needs num_classes: 2 (background and object)")
        if p.neg_pos_ratio < 0:
            self.fail(f"multibox_loss_param.neg_pos_ratio {p.neg_pos_ratio} must be >= 0")
        self.mode = normalization_mode(self.param.loss_param, pb.LossParameter.VALID)
        down = list(self.param.propagate_down) or [True, True]
        self.counts_loc, self.counts_conf = bool(down[0]), bool(down[1])

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    def reshape(self, bottom, top):
        if bottom[2].num_axes < 3 or bottom[2].shape[-1] % 4:
            self.fail(f"bottom 2 must be PriorBox's (1, 2, P*4), got {bottom[2].shape}")
        self.priors = bottom[2].shape[-1] // 4
        num = bottom[0].shape[0]
        if bottom[1].shape[0] != num or bottom[0].count != num * self.priors * \
                self.loc_classes * 4 or bottom[1].count != num * self.priors * self.classes:
            self.fail(f"loc {bottom[0].shape} and conf {bottom[1].shape} must hold, per "
                      f"image, {self.priors * self.loc_classes * 4} location values and "
                      f"{self.priors * self.classes} scores for {self.priors} priors")
        if bottom[3].count % 8:
            self.fail(f"bottom 3 must be AnnotatedData's labels (1, 1, G, 8), got "
                      f"{bottom[3].shape}")
        top[0].reshape()

    def _ground_truth(self, labels, num):
        """Per image, (G, 4) boxes and (G,) labels, as SSD's GetGroundTruth."""
        rows = labels.reshape(-1, 8)
        rows = rows[rows[:, 0] != -1]
        if not self.p.use_difficult_gt:
            rows = rows[rows[:, 7] == 0]
        image = rows[:, 0].astype(np.int64)
        label = rows[:, 1].astype(np.int64)
        if (label == self.background).any():
            self.fail(f"the labels hold the background label {self.background}; ground truth "
                      f"boxes must have object labels")
        if len(image) and (image.min() < 0 or image.max() >= num):
            self.fail(f"a label row names image {int(image.max())}, but this rank holds {num} "
                      f"images; item ids count in the rank's slice of the batch")
        return [(rows[image == i, 3:7], label[image == i]) for i in range(num)]

    def _matches(self, gt, loc, priors, variances):
        """{label: (P,) match indices}, {label: (P,) overlaps} of one image (SSD's FindMatches)."""
        p = self.p
        boxes, labels = gt
        if not len(boxes):
            return {}, {}
        args = (p.match_type, p.overlap_threshold, p.ignore_cross_boundary_bbox)
        indices, overlaps = {}, {}
        if p.use_prior_for_matching:
            found, best = match(boxes, priors, *args)
            if p.share_location:
                return {-1: found}, {-1: best}
            for c in range(self.loc_classes):
                if c != self.background:
                    keep = (found > -1) & (labels[np.maximum(found, 0)] == c)
                    indices[c], overlaps[c] = np.where(keep, found, -1), best
            return indices, overlaps
        for c in range(self.loc_classes):
            label = -1 if p.share_location else c
            if label == self.background:
                continue
            decoded = decode(loc[:, c], priors, variances, p.code_type,
                             p.encode_variance_in_target)
            chosen = np.arange(len(boxes)) if label == -1 else np.flatnonzero(labels == c)
            found, best = match(boxes[chosen], decoded, *args)
            if len(chosen):     # gt indices of this class -> of the image
                found = np.where(found > -1, chosen[np.maximum(found, 0)], found)
            indices[label], overlaps[label] = found, best
        return indices, overlaps

    def forward(self, bottom, top):
        p = self.p
        num = bottom[0].shape[0]
        loc = bottom[0].data.reshape(num, self.priors, self.loc_classes, 4)
        conf = bottom[1].data.reshape(num, self.priors, self.classes)
        prior_data = bottom[2].data.reshape(-1, self.priors, 4)
        priors, variances = prior_data[0], prior_data[-1]
        truth = self._ground_truth(bottom[3].data, num)
        # Picked rows: loc (image, prior, loc class, gt box index) and conf (image, prior, label)
        loc_rows, conf_rows = [], []
        for i in range(num):
            indices, overlaps = self._matches(truth[i], loc[i], priors, variances)
            label_of = np.full(self.priors, self.background, np.int64)
            for c, found in indices.items():
                matched = np.flatnonzero(found > -1)
                loc_rows.append((i, matched, 0 if c == -1 else c, found[matched]))
                unset = matched[label_of[matched] == self.background]
                label_of[unset] = truth[i][1][found[unset]]
            positives = np.flatnonzero(label_of != self.background)
            if p.map_object_to_agnostic:
                label_of[positives] = self.background + 1
            if self.mining == _P.NONE:
                conf_rows.append((i, np.arange(self.priors), label_of))
                continue
            negatives = self._negatives(conf[i], label_of, indices, overlaps)
            picked = np.concatenate([positives, negatives])
            labels = np.concatenate([label_of[positives],
                                     np.full(len(negatives), self.background, np.int64)])
            conf_rows.append((i, picked, labels))
        self._loc_rows, self._conf_rows = loc_rows, conf_rows
        matches = sum(len(rows) for _, rows, _, _ in loc_rows)
        loc_sum = self._loc_loss(loc, truth, priors, variances) if matches else 0.0
        conf_sum = self._conf_loss(conf)
        local = (p.loc_weight * loc_sum if self.counts_loc else 0.0) + \
            (conf_sum if self.counts_conf else 0.0)
        totals = self.ctx.allreduce_sum(np.array(
            [local, matches, num, num * self.priors], np.float64))
        self.normaliser = normaliser(self.mode, totals[1], totals[2], totals[3])
        top[0].data[...] = totals[0] / self.normaliser

    def _negatives(self, conf, label_of, indices, overlaps):
        """SSD's MAX_NEGATIVE mining of one image: the unmatched priors overlapping no box by
        neg_overlap or more, highest background loss first, neg_pos_ratio per positive."""
        if not indices:
            return np.zeros(0, np.int64)
        p = self.p
        found, overlap = indices[-1], overlaps[-1]
        prob = softmax_rows(conf) if p.conf_loss_type == _P.SOFTMAX else None
        if prob is not None:
            loss = -np.log(np.maximum(prob[np.arange(self.priors), label_of], FLT_MIN))
        else:
            loss = logistic_terms(conf, one_hot(label_of, self.classes)).sum(axis=1)
        eligible = np.flatnonzero((found == -1) & (overlap < np.float32(p.neg_overlap)))
        positives = int(np.count_nonzero(found > -1))
        keep = min(int(np.float32(positives) * np.float32(p.neg_pos_ratio)), len(eligible))
        order = np.argsort(-loss[eligible], kind="stable")[:keep]
        return np.sort(eligible[order])

    def _loc_loss(self, loc, truth, priors, variances):
        p = self.p
        preds, targets = [], []
        for i, rows, c, gt_index in self._loc_rows:
            pred = loc[i, rows, c]
            target = encode(truth[i][0][gt_index], priors[rows], variances[rows], p.code_type,
                            p.encode_variance_in_target)
            if p.bp_inside:
                box = priors[rows] if p.use_prior_for_matching else decode(
                    pred, priors[rows], variances[rows], p.code_type,
                    p.encode_variance_in_target)
                pred = np.where((box < 0) | (box > 1), target, pred)
            if p.encode_variance_in_target:
                pred, target = pred / variances[rows], target / variances[rows]
            preds.append(pred)
            targets.append(target)
        diff = np.concatenate(preds) - np.concatenate(targets)
        if p.loc_loss_type == _P.L2:
            self._loc_slope = diff
            return float(np.dot(diff.ravel(), diff.ravel())) / 2
        value, self._loc_slope = smooth_l1(diff, 1.0)
        return float(value.sum(dtype=np.float64))

    def _conf_loss(self, conf):
        """The picked rows' loss (SoftmaxWithLoss or SigmoidCrossEntropyLoss, unnormalised) and
        its gradient per picked row in self._conf_slope."""
        scores = np.concatenate([conf[i, rows] for i, rows, _ in self._conf_rows]) \
            if self._conf_rows else np.zeros((0, self.classes), np.float32)
        labels = np.concatenate([lab for _, _, lab in self._conf_rows]) \
            if self._conf_rows else np.zeros(0, np.int64)
        if not len(scores):
            self._conf_slope = scores
            return 0.0
        rows = np.arange(len(labels))
        if self.p.conf_loss_type == _P.SOFTMAX:
            prob = softmax_rows(scores)
            total = float(-np.log(np.maximum(prob[rows, labels], FLT_MIN)).sum(dtype=np.float64))
            prob[rows, labels] -= 1
            self._conf_slope = prob
            return total
        target = one_hot(labels, self.classes)
        self._conf_slope = np.float32(0.5) * np.tanh(np.float32(0.5) * scores) + \
            np.float32(0.5) - target
        return float(logistic_terms(scores, target).sum(dtype=np.float64))

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 3 and (propagate_down[2] or propagate_down[3]):
            self.fail("cannot backpropagate to the priors or the labels (bottoms 2 and 3); "
                      "set `propagate_down: false` for them")
        scale = np.float32(float(top[0].diff.flat[0]) / self.normaliser)
        num = bottom[0].shape[0]
        if propagate_down[0]:
            diff = bottom[0].diff.reshape(num, self.priors, self.loc_classes, 4)
            diff[...] = 0
            start = 0
            for i, rows, c, _ in self._loc_rows:
                diff[i, rows, c] = self._loc_slope[start:start + len(rows)] * \
                    (np.float32(self.p.loc_weight) * scale)
                start += len(rows)
        if propagate_down[1]:
            diff = bottom[1].diff.reshape(num, self.priors, self.classes)
            diff[...] = 0
            start = 0
            for i, rows, _ in self._conf_rows:
                diff[i, rows] = self._conf_slope[start:start + len(rows)] * scale
                start += len(rows)


def one_hot(labels, classes):
    """(n, classes) float32 targets; a background id beyond the classes (which SSD allows for
    the LOGISTIC loss) gives an all-zero row."""
    target = np.zeros((len(labels), classes), np.float32)
    rows = np.flatnonzero(labels < classes)
    target[rows, labels[rows]] = 1
    return target


def logistic_terms(x, target):
    """Caffe's stable sigmoid cross-entropy per element."""
    positive = (x >= 0).astype(np.float32)
    return -(x * (target - positive) - np.log1p(np.exp(x - 2 * x * positive)))
