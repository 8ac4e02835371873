"""CtcLoss (jolibrain/caffe): connectionist temporal classification loss, the fork's binding of
Baidu's warp-ctc, for training CRNN nets on unsegmented label sequences.

Bottoms: activations (T, N, alphabet_size), time-major and before softmax (the loss takes the
softmax over the last axis), and labels (N, L) padded with blank_label, which the loss drops.
Every sample uses all time_step = T steps. Top: the batch's summed -log p(labels | x) over the
batch size. The gradient is warp-ctc's, of the summed loss: as in the fork it is not divided by
the batch size, so it is N times the gradient of the loss the top reports (a solver's learning
rate tuned on the fork trains the same here). A label sequence that cannot fit in T steps (its
length plus its repeated neighbours above T) costs 0 and gets no gradient, as warp-ctc does.
Over ranks, the loss divides the global sum by the global batch; the gradients need no
normaliser and add up to the one-process gradient.
"""
import numpy as np

from syncsgd.layers.loss import LossLayer, labels_as_int
from syncsgd.layers.registry import register


@register
class CtcLossLayer(LossLayer):
    type = "CtcLoss"
    fork = "jolibrain/caffe"
    batch_sums = False    # the batch is axis 1 of the activations, not the axis lanes cut

    def setup(self, bottom, top):
        self.check_counts(bottom, top)
        p = self.param.ctc_loss_param
        self.alphabet, self.time_step, self.blank = p.alphabet_size, p.time_step, p.blank_label
        if self.alphabet <= 0:
            self.fail("ctc_loss_param.alphabet_size must be set: the number of classes, blank "
                      "included")
        if self.time_step <= 0:
            self.fail("ctc_loss_param.time_step must be set to the number of time steps")
        if not 0 <= self.blank < self.alphabet:
            self.fail(f"ctc_loss_param.blank_label {self.blank} must be a class, "
                      f"0..{self.alphabet - 1}")
        self._labels = np.zeros((0, 0), np.int64)
        self._grad = np.zeros((0, 0, 0), np.float32)

    def reshape(self, bottom, top):
        x, y = bottom[0].shape, bottom[1].shape
        if len(x) != 3 or x[0] != self.time_step or x[2] != self.alphabet:
            self.fail(f"bottom 0 has shape {x}; it must be (time_step, samples, alphabet_size) "
                      f"= ({self.time_step}, N, {self.alphabet}): fix ctc_loss_param or the "
                      "layer below")
        if len(y) < 2 or y[0] != x[1] or bottom[1].count != y[0] * y[1]:
            self.fail(f"bottom 1 has shape {y}; the labels must be (samples, length) with the "
                      f"{x[1]} samples of the activations {x}")
        top[0].reshape()
        if self._grad.shape != x or self._labels.shape != y[:2]:
            self._labels = np.zeros(y[:2], np.int64)
            self._grad = np.zeros(x, np.float32)     # warp-ctc's gradient, made in forward

    def forward(self, bottom, top):
        labels = labels_as_int(bottom[1].data.reshape(self._labels.shape), self._labels)
        bad = (labels < 0) | (labels >= self.alphabet)
        if bad.any():
            n, k = np.argwhere(bad)[0]
            self.fail(f"label {labels[n, k]} of sample {self.ctx.batch_offset + n} of the batch "
                      f"is outside 0..{self.alphabet - 1} (alphabet_size): fix the labels")
        costs = ctc_costs(bottom[0].data, labels, self.blank, self._grad)
        totals = self.ctx.allreduce_sum(
            np.array([costs.sum(), labels.shape[0], (labels != self.blank).sum()], np.float64))
        if totals[2] == 0:
            self.fail(f"every label of the batch is the blank label {self.blank}; the fork "
                      "needs at least one other label per batch")
        top[0].data[...] = totals[0] / max(totals[1], 1.0)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if propagate_down[0]:
            np.multiply(self._grad, top[0].diff.flat[0], out=bottom[0].diff)


def ctc_costs(activations, labels, blank, grad):
    """-log p(labels | x) per sample from (T, N, C) activations and (N, L) labels padded with
    `blank`; writes d cost / d activations into grad (T, N, C). Forward-backward in log space
    over each sample's labels with blanks between (S = 2 * length + 1 states), all samples at
    once, one time step at a time."""
    t_steps, n, c = activations.shape
    shifted = activations.astype(np.float64) - activations.max(axis=2, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=2, keepdims=True))      # (T, N, C)
    states, lengths = extended_labels(labels, blank)                         # (N, S), (N,)
    s_max = states.shape[1]
    valid = np.arange(s_max) < (2 * lengths + 1)[:, None]
    skip = np.zeros((n, s_max), bool)        # a label may follow the label two states back
    skip[:, 2:] = (states[:, 2:] != blank) & (states[:, 2:] != states[:, :-2])
    emit = np.take_along_axis(log_p, np.broadcast_to(states, (t_steps, n, s_max)), axis=2)
    emit[:, ~valid] = -np.inf

    alpha = np.full((t_steps, n, s_max), -np.inf)
    alpha[0, :, :2] = emit[0, :, :2]
    for t in range(1, t_steps):
        prev = alpha[t - 1]
        reach = np.logaddexp(prev, shift(prev, 1))
        reach = np.where(skip, np.logaddexp(reach, shift(prev, 2)), reach)
        alpha[t] = reach + emit[t]
    beta = np.full((t_steps, n, s_max), -np.inf)
    rows = np.arange(n)
    last = 2 * lengths
    beta[-1, rows, last] = emit[-1, rows, last]
    beta[-1, rows[lengths > 0], last[lengths > 0] - 1] = \
        emit[-1, rows[lengths > 0], last[lengths > 0] - 1]
    skip_back = shift(skip, -2, False)       # state s + 2 may follow s
    for t in range(t_steps - 2, -1, -1):
        nxt = beta[t + 1]
        reach = np.logaddexp(nxt, shift(nxt, -1))
        reach = np.where(skip_back, np.logaddexp(reach, shift(nxt, -2)), reach)
        beta[t] = reach + emit[t]

    log_z = np.logaddexp(alpha[-1, rows, last],
                         np.where(lengths > 0, alpha[-1, rows, np.maximum(last - 1, 0)],
                                  -np.inf))
    feasible = lengths + repeated_neighbours(states, lengths) <= t_steps
    # Occupancy of each state: alpha * beta / (p(state's class) * p(labels | x)).
    with np.errstate(invalid="ignore"):
        occupancy = np.exp(alpha + beta - emit - np.where(feasible, log_z, 0.0)[:, None])
    occupancy[:, ~feasible] = 0
    occupancy[~np.isfinite(occupancy)] = 0
    index = (np.arange(t_steps * n).reshape(t_steps, n, 1) * c + states).ravel()
    per_class = np.bincount(index, occupancy.ravel(), minlength=t_steps * n * c)
    probs = np.exp(log_p)
    probs[:, ~feasible] = 0
    np.copyto(grad, probs - per_class.reshape(t_steps, n, c), casting="unsafe")
    return np.where(feasible, -log_z, 0.0)


def extended_labels(labels, blank):
    """Each sample's labels without the blank padding, blanks between and around them: (N, S)
    states padded with blank, and the labels' lengths."""
    kept = labels != blank
    lengths = kept.sum(axis=1)
    order = np.argsort(~kept, axis=1, kind="stable")
    compact = np.take_along_axis(labels, order, axis=1)
    states = np.full((labels.shape[0], 2 * labels.shape[1] + 1), blank, np.int64)
    states[:, 1::2] = np.where(np.arange(labels.shape[1]) < lengths[:, None], compact, blank)
    return states, lengths


def repeated_neighbours(states, lengths):
    """How many labels equal the label before them: each needs a blank step between."""
    labels = states[:, 1::2]
    same = labels[:, 1:] == labels[:, :-1]
    return (same & (np.arange(1, labels.shape[1]) < lengths[:, None])).sum(axis=1)


def shift(a, k, fill=-np.inf):
    """a moved k places along the last axis (right for k > 0), `fill` where nothing arrives."""
    out = np.full_like(a, fill)
    if k > 0:
        out[..., k:] = a[..., :-k]
    else:
        out[..., :k] = a[..., -k:]
    return out
