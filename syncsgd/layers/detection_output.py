"""DetectionOutput (SSD, weiliu89/caffe), for inference: decodes the location predictions
against the priors, keeps per class the boxes that survive non-maximum suppression, then the
keep_top_k best of the image over all classes.

Bottoms: loc (N, P*L*4) with L = 1 when share_location else num_classes, conf (N, P*classes),
scores as probabilities, and PriorBox's (1, 2, P*4). Top (1, 1, D, 7), one row per detection:
(image, label, score, xmin, ymin, xmax, ymax), grouped by image then by label in increasing order,
best score first within a label; with no detection at all, one row (image, -1, ..., -1) per image,
as in SSD. Decoding and overlaps are computed in float32, as SSD does; boxes are not clipped.
A deploy net that asks SSD to save or draw its detections (save_output_param, visualize) loads,
with a log line saying that they are only in the top blob.
"""
import numpy as np

from syncsgd import log
from syncsgd.boxes import box_sizes, decode, nms
from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class DetectionOutputLayer(Layer):
    type = "DetectionOutput"
    fork = "weiliu89/caffe (ssd)"
    exact_bottoms = 3
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.detection_output_param
        if not p.HasField("num_classes"):
            self.fail("detection_output_param.num_classes is required")
        if p.save_output_param.output_directory or p.visualize:
            log.info(f"layer '{self.name}' (DetectionOutput): detections are not written to "
                     "files (save_output_param) nor drawn (visualize), as the SSD fork does; "
                     "read them from the top blob")
        nms_param = p.nms_param
        if nms_param.nms_threshold < 0 or not 0 < nms_param.eta <= 1:
            self.fail(f"nms_param needs nms_threshold >= 0 and 0 < eta <= 1, got "
                      f"{nms_param.nms_threshold} and {nms_param.eta}")
        self.classes, self.share = p.num_classes, p.share_location
        self.loc_classes = 1 if self.share else self.classes
        self.background = p.background_label_id
        self.code_type, self.variance_in_target = p.code_type, p.variance_encoded_in_target
        self.keep_top_k = p.keep_top_k
        self.threshold = (np.float32(p.confidence_threshold) if p.HasField("confidence_threshold")
                          else -np.inf)
        self.nms_threshold, self.eta = np.float32(nms_param.nms_threshold), nms_param.eta
        self.top_k = nms_param.top_k if nms_param.HasField("top_k") else -1

    def reshape(self, bottom, top):
        loc, conf, priors = (b.shape for b in bottom)
        if len(priors) < 3 or priors[-1] % 4:
            self.fail(f"bottom 2 must be PriorBox's (1, 2, P*4), got {priors}")
        self.priors = priors[-1] // 4
        num = loc[0]
        per_loc = self.priors * self.loc_classes * 4
        if conf[0] != num or bottom[0].count != num * per_loc or \
                bottom[1].count != num * self.priors * self.classes:
            self.fail(f"loc {loc} and conf {conf} must hold, per image, {per_loc} location "
                      f"values and {self.priors * self.classes} scores for {self.priors} "
                      f"priors and {self.classes} classes")
        top[0].reshape(1, 1, max(num, 1), 7)

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        loc = bottom[0].data.reshape(num, self.priors, self.loc_classes, 4)
        conf = bottom[1].data.reshape(num, self.priors, self.classes)
        prior_data = bottom[2].data.reshape(-1, self.priors, 4)
        priors, variances = prior_data[0], prior_data[-1]
        rows = []
        for i in range(num):
            boxes = {}
            for c in range(self.loc_classes):
                if self.share or c != self.background:
                    decoded = decode(loc[i, :, c], priors, variances, self.code_type,
                                     self.variance_in_target)
                    boxes[-1 if self.share else c] = (decoded, box_sizes(decoded))
            kept = {}
            for c in range(self.classes):
                if c != self.background:
                    kept[c] = nms(*boxes[-1 if self.share else c], conf[i, :, c],
                                  self.threshold, self.nms_threshold, self.eta, self.top_k)
            kept = self._best_of_image(kept, conf[i])
            for c in sorted(c for c in kept if len(kept[c])):
                index = np.asarray(kept[c], np.int64)
                block = np.empty((len(index), 7), np.float32)
                block[:, 0], block[:, 1] = i, c
                block[:, 2] = conf[i, index, c]
                block[:, 3:] = boxes[-1 if self.share else c][0][index]
                rows.append(block)
        if rows:
            out = np.concatenate(rows)
        else:
            out = np.full((num, 7), -1, np.float32)
            out[:, 0] = np.arange(num)
        top[0].reshape(1, 1, len(out), 7)
        np.copyto(top[0].data.reshape(-1, 7), out)

    def _best_of_image(self, kept, scores):
        """At most keep_top_k detections of one image over all classes, best first."""
        if self.keep_top_k < 0 or sum(len(v) for v in kept.values()) <= self.keep_top_k:
            return kept
        labels = np.concatenate([np.full(len(v), c) for c, v in kept.items()])
        indices = np.concatenate(list(kept.values()))
        order = np.argsort(-scores[indices, labels], kind="stable")[:self.keep_top_k]
        best = {}
        for k in order:
            best.setdefault(int(labels[k]), []).append(int(indices[k]))
        return best
