"""CTCGreedyDecoder (senlinuc/caffe_ocr): a CRNN deploy net's last layer, turning per-step class
scores into label sequences without a language model. From (T, N, C) scores: the best class of
each step (the first on ties), a repeat of the previous step's class dropped (with
ctc_merge_repeated), then every blank dropped. One top, either
  the sequences (N, T, 1, 1), each padded with -1 after its labels, or, with the labels (N, L)
  as a second bottom, (1, 2, 1, 1): 1 - the mean edit distance over the longer length, and the
  fraction of samples decoded exactly, as the fork's accuracy mode. Labels end at the first
  negative value, are rounded, and blanks among them are skipped; a sample with an empty label
  and an empty decoding counts as exact in the first value only, as in the fork.
"""
import numpy as np

from syncsgd.layers.base import Layer
from syncsgd.layers.registry import register


@register
class CTCGreedyDecoderLayer(Layer):
    type = "CTCGreedyDecoder"
    fork = "senlinuc/caffe_ocr"
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.ctc_decoder_param
        self.blank_index, self.merge = p.blank_index, p.ctc_merge_repeated

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 3:
            self.fail(f"bottom 0 has shape {bottom[0].shape}; it must be the (time steps, "
                      "samples, classes) scores")
        t, n, c = bottom[0].shape
        if self.blank_index < 0:
            self.blank_index = c - 1     # once, as the fork
        if len(bottom) == 1:
            top[0].reshape(n, t, 1, 1)
            return
        labels = bottom[1].shape
        if len(labels) < 2 or labels[0] != n or bottom[1].count != n * labels[1]:
            self.fail(f"bottom 1 has shape {labels}; the labels must be (samples, length) = "
                      f"({n}, L) to go with the scores {bottom[0].shape}")
        top[0].reshape(1, 2, 1, 1)

    def decoded(self, scores):
        """(N, T) sequences padded with -1 from (T, N, C) scores."""
        best = scores.argmax(axis=2)                      # (T, N)
        keep = best != self.blank_index
        if self.merge:
            keep[1:] &= best[1:] != best[:-1]
        keep, best = keep.T, best.T
        order = np.argsort(~keep, axis=1, kind="stable")  # kept steps first, in time order
        labels = np.take_along_axis(best, order, axis=1)
        lengths = keep.sum(axis=1, keepdims=True)
        return np.where(np.arange(best.shape[1]) < lengths, labels, -1)

    def forward(self, bottom, top):
        sequences = self.decoded(bottom[0].data)
        if len(bottom) == 1:
            top[0].data.reshape(sequences.shape)[...] = sequences
            return
        n = sequences.shape[0]
        targets = bottom[1].data.reshape(n, bottom[1].shape[1])
        distance, exact = 0.0, 0
        for decoded, target in zip(sequences, targets):
            decoded = decoded[decoded >= 0]
            target = self.target_sequence(target)
            longest = max(len(decoded), len(target))
            if longest == 0:
                continue
            edits = edit_distance(target, decoded)
            distance += edits / longest
            exact += edits == 0
        totals = self.ctx.allreduce_sum(np.array([distance, exact, n], np.float64))
        samples = max(totals[2], 1.0)
        top[0].data.flat[:] = (1 - totals[0] / samples, totals[1] / samples)

    def target_sequence(self, target):
        ended = np.flatnonzero(target < 0)
        if ended.size:
            target = target[:ended[0]]
        target = (target + 0.5).astype(np.int64)
        return target[target != self.blank_index]


def edit_distance(a, b):
    """Levenshtein distance between two integer sequences, one row of the table at a time."""
    row = np.arange(len(b) + 1)
    for i, x in enumerate(a, 1):
        previous, row = row, np.empty_like(row)
        row[0] = i
        substitution = previous[:-1] + (np.asarray(b) != x)
        for j in range(1, len(b) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, substitution[j - 1])
    return int(row[-1])
