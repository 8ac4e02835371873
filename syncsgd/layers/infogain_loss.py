"""InfogainLoss: a multinomial logistic loss in which row `label` of an infogain matrix H
weighs the log-probability of every class, so that some confusions cost more than others
(H = identity is SoftmaxWithLoss). As in current BVLC Caffe the layer takes scores and applies
the softmax over infogain_loss_param.axis itself.

loss = -sum over positions of sum_l H[label, l] log(max(p_l, 1e-20)), divided by the
normaliser of loss_param.normalization (VALID by default). H (K x K for K classes) comes from
the binary BlobProto infogain_loss_param.source, or from a third bottom, which may change
between passes. An optional second top outputs the probabilities.
"""
import numpy as np

from syncsgd.proto.files import read_binary
from syncsgd.errors import PrototxtError
from syncsgd.layers.loss import (LOG_THRESHOLD, VALID, LossLayer, checked_labels, labels_as_int,
                                 normalization_mode)
from syncsgd.layers.registry import register
from syncsgd.layers.softmax import softmax_forward
from syncsgd.proto import pb


@register
class InfogainLoss(LossLayer):
    type = "InfogainLoss"
    exact_bottoms = None
    min_bottoms = 2
    max_bottoms = 3
    exact_tops = None
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        lp = self.param.loss_param
        if lp.HasField("normalize"):
            self.fail("loss_param.normalize is not read by InfogainLoss (as in Caffe); use "
                      "loss_param.normalization: VALID or BATCH_SIZE instead")
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.mode = normalization_mode(lp, VALID)
        self.stored = None
        if len(bottom) < 3:
            self.stored = self._read_matrix()
        self.own_prob = None
        self.log_prob = None

    def _read_matrix(self):
        p = self.param.infogain_loss_param
        if not p.HasField("source"):
            self.fail("needs the infogain matrix: set infogain_loss_param.source to a "
                      ".binaryproto file, or give the matrix as a third bottom")
        try:
            proto = read_binary(p.source, pb.BlobProto())
        except PrototxtError as e:
            self.fail(f"infogain_loss_param.source: {e}")
        values = proto.double_data if len(proto.double_data) else proto.data
        return np.asarray(values, np.float32)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        outer, classes, inner = self.reshape_class_scores(
            bottom, top, self.param.infogain_loss_param.axis, "infogain axis")
        count = self.stored.size if self.stored is not None else bottom[2].count
        if count != classes * classes:
            where = (f"infogain_loss_param.source '{self.param.infogain_loss_param.source}'"
                     if self.stored is not None else "the third bottom")
            self.fail(f"{where} holds {count} values; the infogain matrix for {classes} "
                      f"classes is {classes} x {classes}")
        if self.log_prob is None or self.log_prob.shape != self.dims:
            self.log_prob = np.empty(self.dims, np.float32)
            self.labels = np.empty((outer, inner), np.int64)
            self.scratch = np.empty((outer, 1, inner), np.float32)

    def allow_force_backward(self, bottom_index):
        """Neither the labels nor the infogain matrix take gradients."""
        return bottom_index == 0

    def _matrix(self, bottom):
        """H, from the file or the third bottom as it is now."""
        classes = self.dims[1]
        source = self.stored if self.stored is not None else bottom[2].data
        return source.reshape(classes, classes)

    def forward(self, bottom, top):
        outer, classes, inner = self.dims
        prob = self.prob.reshape(self.dims)
        softmax_forward(bottom[0].data.reshape(self.dims), prob, self.scratch)
        labels = labels_as_int(bottom[1].data, self.labels)
        self.valid, self.index = checked_labels(self, labels, classes, self.ignore_label)
        np.maximum(prob, LOG_THRESHOLD, out=self.log_prob)
        np.log(self.log_prob, out=self.log_prob)
        self.weights = self._matrix(bottom)[self.index]            # (outer, inner, K)
        per_position = np.einsum("oik,oki->oi", self.weights, self.log_prob,
                                 dtype=np.float64)
        loss = -per_position[self.valid].sum()
        valid = int(np.count_nonzero(self.valid))
        self.global_loss(top, self.mode, loss, valid, outer, outer * inner)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if len(propagate_down) > 2 and propagate_down[2]:
            self.fail("cannot backpropagate to the infogain matrix (bottom 2); set "
                      "`propagate_down: false` for it")
        if not propagate_down[0]:
            return
        # d loss / d x_l = p_l * sum_k H[label, k] - H[label, l], per position.
        row_sums = self.weights.sum(axis=2)                       # (outer, inner)
        dx = bottom[0].diff.reshape(self.dims)
        np.multiply(self.prob.reshape(self.dims), row_sums[:, None, :], out=dx)
        dx -= self.weights.transpose(0, 2, 1)
        weight = self.valid.astype(np.float32) * self.gradient_scale(top)
        np.multiply(dx, weight[:, None, :], out=dx)
