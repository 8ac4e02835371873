"""Accuracy: the fraction of samples whose label is among the top_k scores, over the global batch.

A prediction counts as correct when fewer than top_k other classes score at least as high as the
label's class (ties count against it, as in Caffe). The optional second top holds per-class
accuracy.
"""
import numpy as np

from syncsgd.layers.base import Layer, canonical_axis
from syncsgd.layers.loss import checked_labels, labels_as_int
from syncsgd.layers.registry import register
from syncsgd.layers.softmax import split_at_axis


@register
class Accuracy(Layer):
    type = "Accuracy"
    exact_bottoms = 2
    min_tops = 1
    max_tops = 2
    class_axis = 0     # set by reshape

    @property
    def batch_sums(self):
        """Its tops are whole-batch counts, unless the top-k runs across the samples (axis 0)."""
        return self.class_axis >= 1

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.accuracy_param
        self.top_k = p.top_k
        self.ignore_label = p.ignore_label if p.HasField("ignore_label") else None
        self.labels = None

    def reshape(self, bottom, top):
        axis = self.class_axis = canonical_axis(self.param.accuracy_param.axis,
                                                bottom[0].num_axes, self)
        self.dims = split_at_axis(bottom[0].shape, axis)
        outer, classes, inner = self.dims
        if self.top_k > classes:
            self.fail(f"top_k {self.top_k} is more than the {classes} classes on axis {axis}")
        if outer * inner != bottom[1].count:
            self.fail(f"{bottom[1].count} labels for {outer * inner} predictions: with "
                      f"prediction shape {bottom[0].shape} and axis {axis} the label blob needs "
                      f"{outer * inner} values in 0..{classes - 1}")
        if self.labels is None or self.labels.shape != (outer, inner):
            self.labels = np.empty((outer, inner), np.int64)
        top[0].reshape()
        if len(top) > 1:
            top[1].reshape(classes)

    def forward(self, bottom, top):
        outer, classes, inner = self.dims
        scores = bottom[0].data.reshape(self.dims)
        labels = labels_as_int(bottom[1].data, self.labels)
        valid, index = checked_labels(self, labels, classes, self.ignore_label)
        label_score = np.take_along_axis(scores, index[:, None, :], axis=1)
        at_least_as_high = np.count_nonzero(scores >= label_score, axis=1) - 1
        correct = valid & (at_least_as_high < self.top_k)
        sums = [np.count_nonzero(correct), np.count_nonzero(valid)]
        if len(top) > 1:
            sums += [np.bincount(labels[correct], minlength=classes),
                     np.bincount(labels[valid], minlength=classes)]

        def write(totals):
            top[0].data[...] = totals[0] / totals[1] if totals[1] else 0.0
            if len(top) > 1:
                hits, seen = totals[2:2 + classes], totals[2 + classes:]
                top[1].data[...] = np.divide(hits, seen, out=np.zeros(classes), where=seen > 0)
        self.ctx.sum_later(np.hstack(sums).astype(np.float64), write)

    def backward(self, top, propagate_down, bottom):
        """Accuracy is piecewise constant: where asked, its gradient is zero."""
        for i, down in enumerate(propagate_down):
            if down:
                bottom[i].diff.fill(0)
