"""What the loss layers share: a scalar first top, Caffe's normalisers, and the reduction over
ranks.

Each rank holds a slice of the global batch. A loss sums over its slice, the sums and counts are
added over all ranks, and every rank divides the global sum by the normaliser of the global counts:
all report the one-process loss, and their gradients (local derivative / global normaliser) add up
to the one-process gradient (docs/method.md, "Data parallelism").
"""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.softmax import split_at_axis
from syncsgd.proto import pb

FULL = pb.LossParameter.FULL
VALID = pb.LossParameter.VALID
BATCH_SIZE = pb.LossParameter.BATCH_SIZE
NONE = pb.LossParameter.NONE

FLT_MIN = np.float32(np.finfo(np.float32).tiny)   # log() never sees 0, as in Caffe
# Caffe's kLOG_THRESHOLD: the floor MultinomialLogisticLoss and InfogainLoss put under
# probabilities before the log (SoftmaxWithLoss uses FLT_MIN instead).
LOG_THRESHOLD = np.float32(1e-20)


def normalization_mode(loss_param, default):
    """The `normalization` field if set, else the legacy `normalize` bool, else the default."""
    if loss_param.HasField("normalization"):
        return loss_param.normalization
    if loss_param.HasField("normalize"):
        return VALID if loss_param.normalize else BATCH_SIZE
    return default


def normaliser(mode, valid, batch, full):
    """Caffe's get_normalizer: never below 1, so an all-ignored batch gives loss 0, not NaN."""
    count = {FULL: full, VALID: valid, BATCH_SIZE: batch, NONE: 1.0}[mode]
    return max(1.0, float(count))


# What labels_as_int writes for a NaN or an infinity: integers no class index can be, which
# checked_labels names as what they were.
INT64 = np.iinfo(np.int64)
NOT_A_NUMBER = {INT64.min: "NaN", INT64.min + 1: "-inf", INT64.max: "+inf"}


def labels_as_int(labels, out):
    """Labels arrive as float32; Caffe truncates them to int. A plain cast turns NaN, infinities
    and values beyond int64 into one platform-dependent number; those get the markers above
    (values beyond int64 the nearest integer that is not a marker)."""
    flat = labels.reshape(out.shape)
    with np.errstate(invalid="ignore"):
        np.copyto(out, flat, casting="unsafe")
    # Two reductions rule out NaN (which they propagate) and huge values without the masks
    # below: a loss's glue holds the interpreter lock the other lanes wait for (lanes.py).
    if flat.size and -2.0 ** 63 < flat.min() and flat.max() < 2.0 ** 63:
        return out
    huge = ~(np.abs(flat) < 2.0 ** 63)      # NaN compares false, so it is caught too
    if huge.any():
        x = flat[huge]
        out[huge] = np.select([np.isnan(x), x == -np.inf, x == np.inf, x > 0],
                              [INT64.min, INT64.min + 1, INT64.max, INT64.max - 1], INT64.min + 2)
    return out


def checked_labels(layer, labels, channels, ignore_label):
    """(valid mask, labels usable as indices): ignored positions point at class 0."""
    if ignore_label is None:
        if labels.size and (labels.min() < 0 or labels.max() >= channels):
            layer.fail(bad_label_message(labels, (labels < 0) | (labels >= channels), channels,
                                         layer.ctx.batch_offset))
        return np.ones(labels.shape, bool), labels
    valid = labels != ignore_label
    bad = valid & ((labels < 0) | (labels >= channels))
    if bad.any():
        layer.fail(bad_label_message(labels, bad, channels, layer.ctx.batch_offset))
    return valid, np.where(valid, labels, 0)


def bad_label_message(labels, bad, channels, batch_offset):
    """Names the first bad label by its sample in the global batch (and its position within the
    sample, for labels with spatial positions)."""
    position = np.unravel_index(int(np.flatnonzero(bad)[0]), labels.shape)
    value = int(labels[position])
    where = f"sample {batch_offset + int(position[0])} of the batch"
    if labels.ndim > 1 and labels[0].size > 1:
        where += f" (position {int(np.ravel_multi_index(position[1:], labels.shape[1:]))})"
    if value in NOT_A_NUMBER:
        return (f"the label of {where} is {NOT_A_NUMBER[value]}; labels must be class indices "
                f"0..{channels - 1}: fix the label data")
    fix = f"or make {value} the layer's ignore_label" if abs(value) < 2 ** 31 else "data"
    return f"label {value} of {where} is outside 0..{channels - 1}; fix the labels {fix}"


class LossLayer(Layer):
    is_loss = True
    exact_bottoms = 2
    exact_tops = 1

    normaliser = 1.0   # of the last forward pass, for backward
    class_axis = 1     # the softmax's axis (reshape_class_scores): 0 mixes the samples
    ignore_label = None    # set by the losses that take loss_param.ignore_label

    @property
    def batch_sums(self):
        """The loss is a whole-batch sum (global_loss) of per-sample terms, unless a second top
        (SoftmaxWithLoss's probabilities) holds values per sample, a third bottom may not be per
        sample (InfogainLoss's matrix), or the softmax runs across the samples (axis 0)."""
        return len(self.param.top) == 1 and len(self.param.bottom) <= 2 and self.class_axis >= 1

    def reshape(self, bottom, top):
        self.part_rows = bottom[0].shape[0] if bottom[0].num_axes else 1   # this part's samples
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            self.fail(f"the data {bottom[0].shape} and label {bottom[1].shape} bottoms must have "
                      f"the same first dimension (number of samples)")
        top[0].reshape()

    def global_loss(self, top, mode, local_sum, valid, batch, full):
        """top[0] = the one-process loss from this part's sum and counts; remembers the
        normaliser. Where every label counts (no ignore_label, or a normaliser that does not
        count valid labels) and the context knows the samples over all parts in advance (a
        lane's: lanes.py), the normaliser needs no sum, and the loss's sum waits for the end of
        the pass (ctx.sum_later) instead of making every part meet in the middle of it."""
        samples, rows = self.ctx.samples_total, self.part_rows
        if samples is not None and (mode != VALID or self.ignore_label is None) \
                and rows and batch % rows == 0 and full % rows == 0:
            # Every sample counts the same in every part (a softmax's axis 2 makes `batch` the
            # rows times the first axis after them): the counts of all parts, from this one's.
            positions = full // rows * samples
            self.normaliser = normaliser(mode, positions, batch // rows * samples, positions)

            def write(totals):
                top[0].data[...] = totals[0] / self.normaliser
            self.ctx.sum_later(np.array([local_sum], np.float64), write)
            return
        totals = self.ctx.allreduce_sum(np.array([local_sum, valid, batch, full], np.float64))
        self.normaliser = normaliser(mode, *totals[1:])
        top[0].data[...] = totals[0] / self.normaliser

    def gradient_scale(self, top):
        """Loss weight (the top's diff) over the global normaliser."""
        return np.float32(float(top[0].diff.flat[0]) / self.normaliser)

    def reshape_class_scores(self, bottom, top, axis, what):
        """For losses over a softmax of bottom[0] at `axis` (`what`: the field naming it): the
        (outer, classes, inner) split in self.dims, one label per outer x inner checked, and
        self.prob, the probabilities' buffer (top[1] when the layer has it, else its own)."""
        axis = self.class_axis = canonical_axis(axis, bottom[0].num_axes, self)
        self.dims = split_at_axis(bottom[0].shape, axis)
        outer, classes, inner = self.dims
        if outer * inner != bottom[1].count:
            self.fail(f"{bottom[1].count} labels for {outer * inner} predictions: with "
                      f"prediction shape {bottom[0].shape} and {what} {axis} the label blob "
                      f"needs {outer * inner} values in 0..{classes - 1}")
        if len(top) > 1:
            top[1].reshape_like(bottom[0])
            self.prob = top[1].data
        else:
            if self.own_prob is None or self.own_prob.shape != bottom[0].shape:
                self.own_prob = np.empty(bottom[0].shape, np.float32)
            self.prob = self.own_prob
        return self.dims

    def refuse_label_gradient(self, propagate_down):
        if len(propagate_down) > 1 and propagate_down[1]:
            self.fail("cannot backpropagate to the labels (bottom 1); "
                      "set `propagate_down: false` for it")
