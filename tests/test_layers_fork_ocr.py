"""The CRNN / OCR fork layers: senlinuc/caffe_ocr's Lstm, Reverse, Transpose and CTCGreedyDecoder,
jolibrain/caffe's ContinuationIndicator and CtcLoss. OpenCV implements none of them, so each is
checked against a numpy reference written from the fork's C++ (loops as the C++ has them), the
shared gradient checker, CtcLoss against a sum over all alignments, and the real CRNN nets in
tests/zoo (senlinuc_caffe_ocr, jolibrain_deepdetect) against those references."""
import itertools
import os

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.errors import ShapeError
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_loss import one_process_run, two_rank_run
from tests.test_zoo_opencv import ZOO, fill_seeded, input_arrays, net_at_size


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# -- Reverse -------------------------------------------------------------------------------------

def reverse_reference(x, axis):
    """reverse_layer.cpp's Forward_cpu: blocks of count(axis + 1) copied in reverse order within
    each of the count / count(axis) outer groups."""
    src = x.ravel()
    copy = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    steps = x.shape[axis]
    out = np.empty_like(src)
    for fix in range(src.size // (copy * steps)):
        target = (fix + 1) * copy * steps - copy
        for i in range(steps):
            start = (fix * steps + i) * copy
            out[target:target + copy] = src[start:start + copy]
            target -= copy
    return out.reshape(x.shape)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reverse_matches_the_fork(axis):
    x = rand(4, 3, 5)
    top = run_forward(make_layer(f"type: 'Reverse' reverse_param {{ axis: {axis} }}"),
                      blobs_from([x]))
    np.testing.assert_array_equal(top[0].data, reverse_reference(x, axis))


def test_reverse_gradient():
    check_gradient(make_layer("type: 'Reverse' reverse_param { axis: 1 }"),
                   blobs_from([rand(3, 4, 2)]))


@pytest.mark.parametrize("axis, message", [(-1, "0 or more"), (3, "not an axis")])
def test_reverse_refuses_a_bad_axis(axis, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(f"type: 'Reverse' reverse_param {{ axis: {axis} }}"),
                    blobs_from([rand(2, 3, 4)]))


# -- Transpose -----------------------------------------------------------------------------------

def transpose_reference(x, dims):
    """transpose_cpu: each bottom index split by the bottom's counts, the top index made of the
    bottom coordinates in `dims` order times the top's counts."""
    top_shape = [x.shape[d] for d in dims]
    bottom_counts = [int(np.prod(x.shape[i + 1:])) for i in range(x.ndim)]
    top_counts = [int(np.prod(top_shape[i + 1:])) for i in range(x.ndim)]
    out = np.empty(x.size, x.dtype)
    for index, value in enumerate(x.ravel()):
        rest, coords = index, []
        for count in bottom_counts:
            coords.append(rest // count)
            rest %= count
        out[sum(coords[dims[i]] * top_counts[i] for i in range(x.ndim))] = value
    return out.reshape(top_shape)


def transpose_text(dims):
    return "type: 'Transpose' transpose_param { " + " ".join(f"dim: {d}" for d in dims) + " }"


@pytest.mark.parametrize("dims", [(3, 2, 0, 1), (1, 0, 2, 3), (0, 3, 1, 2)])
def test_transpose_matches_the_fork(dims):
    x = rand(2, 3, 4, 5)
    top = run_forward(make_layer(transpose_text(dims)), blobs_from([x]))
    np.testing.assert_array_equal(top[0].data, transpose_reference(x, dims))


def test_transpose_gradient():
    check_gradient(make_layer(transpose_text((2, 0, 1))), blobs_from([rand(2, 3, 4)]))


@pytest.mark.parametrize("dims", [(0, 1, 2), (0, 1, 1, 2), (0, 1, 2, 4)])
def test_transpose_must_name_every_axis_once(dims):
    with pytest.raises(ShapeError, match="transpose_param.dim"):
        run_forward(make_layer(transpose_text(dims)), blobs_from([rand(2, 3, 4, 5)]))


# -- ContinuationIndicator -----------------------------------------------------------------------

@pytest.mark.parametrize("axis", [1, -3])
def test_continuation_indicator_starts_each_stream_at_step_zero(axis):
    layer = make_layer("type: 'ContinuationIndicator' "
                       f"continuation_indicator_param {{ time_step: 4 axis: {axis} }}")
    top = run_forward(layer, blobs_from([rand(5, 3, 2)]))
    want = np.ones((4, 3 if axis == 1 else 5), np.float32)
    want[0] = 0
    np.testing.assert_array_equal(top[0].data, want)


@pytest.mark.parametrize("settings, message", [("axis: 1", "time_step"),
                                               ("time_step: 3 axis: 3", "axis 3")])
def test_continuation_indicator_refuses_bad_settings(settings, message):
    layer = make_layer("type: 'ContinuationIndicator' "
                       f"continuation_indicator_param {{ {settings} }}")
    with pytest.raises(ShapeError, match=message):
        run_forward(layer, blobs_from([rand(5, 3, 2)]))


# -- Lstm ----------------------------------------------------------------------------------------

def lstm_text(hidden, clip=0.0):
    return (f"name: 'lstm' type: 'Lstm' lstm_param {{ num_output: {hidden} "
            f"clipping_threshold: {clip} weight_filler {{ type: 'gaussian' std: 0.5 }} "
            "bias_filler { type: 'gaussian' std: 0.5 } }")


def lstm_reference(x, w_x, w_h, b):
    """lstm_layer_Junhyuk.cpp's Forward_cpu without the clip bottom: zero initial states, no
    recurrent input and a closed forget gate at t = 0. Returns h and (gates, cells)."""
    t_steps, n, _ = x.shape
    d = w_h.shape[1]
    pre = x @ w_x.T + b
    gates, cells, h = np.zeros_like(pre), np.zeros((t_steps, n, d)), np.zeros((t_steps, n, d))
    for t in range(t_steps):
        if t > 0:
            pre[t] += h[t - 1] @ w_h.T
        gates[t, :, :d] = sigmoid(pre[t, :, :d])
        gates[t, :, d:2 * d] = sigmoid(pre[t, :, d:2 * d]) if t > 0 else 0
        gates[t, :, 2 * d:3 * d] = sigmoid(pre[t, :, 2 * d:3 * d])
        gates[t, :, 3 * d:] = np.tanh(pre[t, :, 3 * d:])
        i, f, o, g = np.split(gates[t], 4, axis=1)
        cells[t] = f * (cells[t - 1] if t > 0 else 0) + i * g
        h[t] = o * np.tanh(cells[t])
    return h, (gates, cells)


def lstm_backward_reference(x, w_x, w_h, h, gates, cells, dh, clip):
    """Backward_cpu: per step the gate diffs, clipped to +-clip before they reach h_{t-1}; W_h's
    gradient pairs step t's gate diffs with h_{t-1} (h_0 = 0)."""
    t_steps, n, d = h.shape
    dh, dc, pre_diff = dh.astype(np.float64).copy(), np.zeros_like(h), np.zeros_like(gates)
    for t in range(t_steps - 1, -1, -1):
        i, f, o, g = np.split(gates[t], 4, axis=1)
        c_prev = cells[t - 1] if t > 0 else np.zeros((n, d))
        tanh_c = np.tanh(cells[t])
        dc[t] += dh[t] * o * (1 - tanh_c ** 2)
        if t > 0:
            dc[t - 1] = dc[t] * f
        df = dc[t] * c_prev if t > 0 else 0
        pre_diff[t] = np.concatenate([dc[t] * g * i * (1 - i), df * f * (1 - f),
                                      dh[t] * tanh_c * o * (1 - o), dc[t] * i * (1 - g ** 2)],
                                     axis=1)
        if clip > 0:
            pre_diff[t] = np.clip(pre_diff[t], -clip, clip)
        if t > 0:
            dh[t - 1] += pre_diff[t] @ w_h
    flat = pre_diff.reshape(t_steps * n, -1)
    dw_x = flat.T @ x.reshape(t_steps * n, -1)
    dw_h = pre_diff[1:].reshape(-1, 4 * d).T @ h[:-1].reshape(-1, d)
    return (flat @ w_x).reshape(x.shape), dw_x, dw_h, flat.sum(axis=0)


def test_lstm_blobs_are_in_the_forks_order():
    layer = make_layer(lstm_text(3))
    run_forward(layer, blobs_from([rand(4, 2, 5)]))
    assert [b.shape for b in layer.blobs] == [(12, 5), (12, 3), (12,)]


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_lstm_matches_the_fork(clip):
    x = rand(5, 3, 4)
    layer = make_layer(lstm_text(3, clip))
    bottom = blobs_from([x])
    top = run_forward(layer, bottom)
    w_x, w_h, b = (blob.data.astype(np.float64) for blob in layer.blobs)
    h, (gates, cells) = lstm_reference(x.astype(np.float64), w_x, w_h, b)
    np.testing.assert_allclose(top[0].data, h, rtol=1e-5, atol=1e-6)

    dh = rand(*top[0].shape, seed=3) * 4
    top[0].diff[...] = dh
    layer.backward(top, [True], bottom)
    want = lstm_backward_reference(x.astype(np.float64), w_x, w_h, h, gates, cells, dh, clip)
    got = [bottom[0].diff] + [blob.diff for blob in layer.blobs]
    for ours, theirs in zip(got, want):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    if clip:     # the threshold did cut: the unclipped gradient differs
        unclipped = lstm_backward_reference(x.astype(np.float64), w_x, w_h, h, gates, cells, dh,
                                            0.0)
        assert np.abs(unclipped[0] - want[0]).max() > 0.01


def test_lstm_gradient():
    check_gradient(make_layer(lstm_text(3)), blobs_from([rand(4, 2, 3)]))


def test_lstm_equals_bvlc_lstm_started_by_a_continuation_indicator():
    """The same maths as BVLC's LSTM with cont = 0, 1, 1, ...: the reuse of LSTMUnit's steps."""
    x = rand(5, 2, 4)
    fork = make_layer(lstm_text(3))
    ours = run_forward(fork, blobs_from([x]))[0].data
    bvlc = make_layer("type: 'LSTM' recurrent_param { num_output: 3 }")
    cont = np.ones((5, 2), np.float32)
    cont[0] = 0
    bottom = blobs_from([x, cont])
    run_forward(bvlc, bottom)
    w_x, w_h, b = fork.blobs
    for blob, value in zip(bvlc.blobs, (w_x, b, w_h)):
        blob.data[...] = value.data
    np.testing.assert_allclose(run_forward(bvlc, bottom)[0].data, ours, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("text, shapes, message", [
    ("type: 'Lstm' lstm_param { }", [(3, 2, 4)], "num_output"),
    ("type: 'Lstm' lstm_param { num_output: 2 }", [(3, 2, 4), (3, 2)], "clip"),
    ("type: 'Lstm' lstm_param { num_output: 2 }", [(3, 8)], "time steps, streams"),
])
def test_lstm_refuses_bad_settings(text, shapes, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(text), blobs_from([rand(*s) for s in shapes]))


# -- CTCGreedyDecoder ----------------------------------------------------------------------------

def greedy_reference(scores, blank, merge=True):
    """CTCGreedyDecoderLayer::Decode and Forward_cpu: per sample, the first maximum of each step,
    kept unless blank or (merging) the previous step's class; -1 after the sequence."""
    t_steps, n, c = scores.shape
    if blank < 0:
        blank = c - 1
    out = np.full((n, t_steps), -1.0, np.float32)
    for s in range(n):
        previous, sequence = -1, []
        for t in range(t_steps):
            best = 0
            for k in range(1, c):
                if scores[t, s, k] > scores[t, s, best]:
                    best = k
            if best != blank and not (merge and best == previous):
                sequence.append(best)
            previous = best
        out[s, :len(sequence)] = sequence
    return out.reshape(n, t_steps, 1, 1)


def scores_with_repeats(t_steps, n, c, seed=0):
    """Scores whose best classes repeat and tie often (a tie's first class wins)."""
    rng = np.random.default_rng(seed)
    best = rng.integers(0, c, (t_steps, n))
    best[1::3] = best[::3][:len(best[1::3])]
    scores = rng.random((t_steps, n, c)).astype(np.float32)
    np.put_along_axis(scores, best[..., None], 2.0, axis=2)
    scores[2, 0, :] = 2.0
    return scores


@pytest.mark.parametrize("settings", ["", "blank_index: -1", "blank_index: 2",
                                      "ctc_merge_repeated: false"])
def test_greedy_decoder_matches_the_fork(settings):
    scores = scores_with_repeats(9, 4, 5)
    layer = make_layer(f"type: 'CTCGreedyDecoder' ctc_decoder_param {{ {settings} }}")
    top = run_forward(layer, blobs_from([scores]))
    param = text_format.Parse(f"{settings}", pb.CTCDecoderParameter())
    np.testing.assert_array_equal(
        top[0].data, greedy_reference(scores, param.blank_index, param.ctc_merge_repeated))


def edit_distance_reference(a, b):
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i, j in itertools.product(range(1, len(a) + 1), range(1, len(b) + 1)):
        d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1][-1]


def accuracy_reference(scores, labels, blank=0):
    """Forward_cpu's accuracy mode: 1 - mean(edit distance / longer length), exact fraction."""
    decoded = greedy_reference(scores, blank)[:, :, 0, 0]
    edits, exact = 0.0, 0
    for sequence, target in zip(decoded, labels):
        sequence = [int(v) for v in sequence if v >= 0]
        ended = [i for i, v in enumerate(target) if v < 0]
        target = [int(0.5 + v) for v in target[:ended[0] if ended else len(target)]]
        target = [v for v in target if v != blank]
        if max(len(target), len(sequence)) == 0:
            continue
        distance = edit_distance_reference(target, sequence)
        edits += distance / max(len(target), len(sequence))
        exact += distance == 0
    return [1 - edits / len(labels), exact / len(labels)]


def decoder_inputs():
    scores = scores_with_repeats(8, 5, 4, seed=1)
    labels = greedy_reference(scores, 0)[:, :4, 0, 0].copy()
    labels[1, 0] = 3 - labels[1, 0] if labels[1, 0] >= 0 else 1    # one edit
    labels[2, :] = -1                                               # empty target
    labels[3, 1:] = [0, 2, 2]                                       # blanks are skipped
    return scores, labels


def test_greedy_decoder_accuracy_matches_the_fork():
    scores, labels = decoder_inputs()
    top = run_forward(make_layer("type: 'CTCGreedyDecoder'"), blobs_from([scores, labels]))
    assert top[0].shape == (1, 2, 1, 1)
    np.testing.assert_allclose(top[0].data.ravel(), accuracy_reference(scores, labels),
                               rtol=1e-6)


class TimeMajor:
    """An array whose batch is axis 1, for two_rank_run, which gives each rank a[rows]."""

    def __init__(self, array):
        self.array = array

    def __getitem__(self, rows):
        return self.array[:, rows]

    def __array__(self, dtype=None, copy=None):
        return self.array


def test_greedy_decoder_accuracy_split_between_ranks():
    scores, labels = decoder_inputs()
    text = "type: 'CTCGreedyDecoder'"
    (want,), _ = one_process_run(text, [scores, labels], propagate=(False, False))
    for tops, _ in two_rank_run(text, [TimeMajor(scores), labels], cut=2,
                                propagate=(False, False)):
        np.testing.assert_allclose(tops[0], want, rtol=1e-6)


def test_greedy_decoder_refuses_bad_bottoms():
    with pytest.raises(ShapeError, match="time steps, samples, classes"):
        run_forward(make_layer("type: 'CTCGreedyDecoder'"), blobs_from([rand(4, 3)]))
    with pytest.raises(ShapeError, match="samples, length"):
        run_forward(make_layer("type: 'CTCGreedyDecoder'"),
                    blobs_from([rand(4, 3, 5), rand(2, 4)]))


# -- CtcLoss -------------------------------------------------------------------------------------

def ctc_text(classes, steps, blank=0):
    return (f"type: 'CtcLoss' ctc_loss_param {{ alphabet_size: {classes} time_step: {steps} "
            f"blank_label: {blank} }}")


def brute_force_cost(x, label, blank):
    """-log of the summed probability of every alignment (path of T classes) that collapses to
    `label` (repeats merged, blanks dropped), under the softmax of x (T, C)."""
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    total = 0.0
    for path in itertools.product(range(x.shape[1]), repeat=x.shape[0]):
        collapsed = [k for t, k in enumerate(path) if k != blank and (t == 0 or k != path[t - 1])]
        if collapsed == label:
            total += np.prod(p[np.arange(x.shape[0]), path])
    return -np.log(total)


LABELS = np.array([[1, 2, 0], [3, 3, 0], [0, 0, 0], [2, 0, 1]], np.float32)


@pytest.mark.parametrize("blank", [0, 2])
def test_ctc_loss_is_the_sum_over_alignments(blank):
    x = rand(5, 4, 4, seed=1).astype(np.float64).astype(np.float32)
    labels = np.where(LABELS == 0, blank, np.where(LABELS == blank, 0, LABELS))
    top = run_forward(make_layer(ctc_text(4, 5, blank)), blobs_from([x, labels]))
    costs = [brute_force_cost(x[:, n].astype(np.float64),
                              [int(v) for v in labels[n] if v != blank], blank)
             for n in range(4)]
    np.testing.assert_allclose(float(top[0].data), np.mean(costs), rtol=1e-5)


def test_ctc_loss_gradient():
    check_gradient(make_layer(ctc_text(4, 5)), blobs_from([rand(5, 1, 4), LABELS[:1]]),
                   check_bottom=[0])


def test_ctc_loss_gradient_is_of_the_batch_sum_as_in_the_fork():
    """warp-ctc's gradient is not divided by the batch: each half of the batch gets the same
    gradient alone as within the whole, while the loss reported is the batch mean."""
    x = rand(5, 4, 4, seed=2)
    _, (whole, _) = one_process_run(ctc_text(4, 5), [x, LABELS])
    for half in (slice(0, 2), slice(2, 4)):
        _, (alone, _) = one_process_run(ctc_text(4, 5), [x[:, half], LABELS[half]])
        np.testing.assert_allclose(whole[:, half], alone, rtol=1e-5, atol=1e-7)


def test_ctc_loss_of_a_label_too_long_for_the_steps_is_zero():
    """[3, 3] needs a blank between: 3 steps; in 2 warp-ctc gives cost 0 and no gradient."""
    x = rand(2, 2, 4, seed=3)
    labels = np.array([[3, 3], [1, 0]], np.float32)
    (loss,), (diff, _) = one_process_run(ctc_text(4, 2), [x, labels], weight=1.0)
    np.testing.assert_allclose(float(loss), brute_force_cost(x[:, 1].astype(np.float64), [1], 0)
                               / 2, rtol=1e-5)
    assert not diff[:, 0].any() and diff[:, 1].any()


def test_ctc_loss_split_between_ranks():
    x = rand(5, 4, 4, seed=4)
    (want,), (diff, _) = one_process_run(ctc_text(4, 5), [x, LABELS])
    ranks = two_rank_run(ctc_text(4, 5), [TimeMajor(x), LABELS], cut=1)
    for tops, _ in ranks:
        np.testing.assert_allclose(tops[0], want, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([diffs[0] for _, diffs in ranks], axis=1), diff,
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("text, labels, message", [
    ("type: 'CtcLoss' ctc_loss_param { time_step: 5 }", LABELS, "alphabet_size"),
    ("type: 'CtcLoss' ctc_loss_param { alphabet_size: 4 }", LABELS, "time_step"),
    (ctc_text(5, 5), LABELS, r"\(5, N, 5\)"),
    (ctc_text(4, 5), LABELS * 2, "label 4 of sample 0"),
    (ctc_text(4, 5), np.zeros((4, 3), np.float32), "every label"),
    (ctc_text(4, 5), LABELS[:3], "samples, length"),
])
def test_ctc_loss_refuses_bad_settings(text, labels, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(text), blobs_from([rand(5, 4, 4), labels]))


# -- Real CRNN nets ------------------------------------------------------------------------------

SENLINUC_RESNET = os.path.join(ZOO, "senlinuc_caffe_ocr/examples/ocr/resnet/deploy.prototxt")
DEEPDETECT_CRNN = os.path.join(ZOO, "jolibrain_deepdetect/templates/caffe/crnn")


def test_senlinuc_resnet_blstm_deploy_net():
    """ResNet + two bidirectional Lstm layers (Reverse, Lstm, Reverse) + CTCGreedyDecoder at
    32 x 64 with seeded weights: one backward branch equals the numpy Lstm of the reversed
    sequence, reversed back, and the decoder's output equals the fork's decoding of fc1x."""
    net = syncsgd.Net(net_at_size(SENLINUC_RESNET, (32, 64)), syncsgd.TEST)
    inputs = input_arrays(net, seed=2)
    fill_seeded(net, inputs, seed=1)
    net.forward(**inputs)
    scores = net.blobs["fc1x"].data
    assert scores.shape == (8, 1, 5990)
    assert net.blobs["result"].data.shape == (1, 8, 1, 1)
    np.testing.assert_array_equal(net.blobs["result"].data, greedy_reference(scores, 0))
    x = net.blobs["blstm_input"].data.astype(np.float64)
    w_x, w_h, b = (blob.data.astype(np.float64) for blob in net.params["rlstm1"])
    backwards = lstm_reference(x[::-1], w_x, w_h, b)[0][::-1]
    np.testing.assert_allclose(net.blobs["rlstm1"].data, backwards, rtol=1e-4, atol=1e-5)


def test_deepdetect_crnn_deploy_net():
    """ContinuationIndicator feeding BVLC's LSTM: 32 time steps whatever the image size."""
    net = syncsgd.Net(net_at_size(os.path.join(DEEPDETECT_CRNN, "deploy.prototxt"), (32, 16)),
                      syncsgd.TEST)
    inputs = input_arrays(net, seed=2)
    fill_seeded(net, inputs, seed=1)
    net.forward(**inputs)
    indicator = net.blobs["indicator"].data
    assert indicator.shape == (32, 1) and indicator[0] == 0 and (indicator[1:] == 1).all()
    probs = net.blobs["probs"].data
    assert probs.shape == (32, 1, 11)
    np.testing.assert_allclose(probs.sum(axis=2), 1, rtol=1e-5)


def crnn_train_param(listing, classes):
    """DeepDetect's CRNN training template with its data source and batch, and fc1's outputs as
    DeepDetect sets them from the service's classes."""
    param = pb.NetParameter()
    with open(os.path.join(DEEPDETECT_CRNN, "crnn.prototxt")) as f:    # its TEST phase's
        text_format.Parse(f.read(), param, allow_unknown_field=True)  # LabelsequenceAccuracy
    for layer in param.layer:
        if layer.type == "HDF5Data":
            layer.hdf5_data_param.source = listing
            layer.hdf5_data_param.batch_size = 4
        if layer.name == "fc1" and classes:
            layer.inner_product_param.num_output = classes
    return param


def write_ocr_set(path, rows=4):
    rng = np.random.default_rng(5)
    with h5py.File(path, "w") as f:
        f["data"] = rng.standard_normal((rows, 3, 32, 16)).astype(np.float32)
        f["label"] = np.where(rng.random((rows, 4)) < 0.8, rng.integers(1, 11, (rows, 4)),
                              0).astype(np.float32)
    listing = path.with_suffix(".txt")
    listing.write_text(f"{path}\n")
    return str(listing)


def test_deepdetect_crnn_template_as_published_names_the_mismatch(tmp_path):
    """fc1 has 91 outputs, ctc_loss_param.alphabet_size 11 (DeepDetect rewrites both)."""
    param = crnn_train_param(write_ocr_set(tmp_path / "train.h5"), classes=None)
    with pytest.raises(ShapeError, match=r"alphabet_size\) = \(32, N, 11\)"):
        syncsgd.Net(param, syncsgd.TRAIN)


def test_deepdetect_crnn_trains(tmp_path, monkeypatch):
    """A few SGD steps of the real training net on one batch: the CTC loss goes down."""
    monkeypatch.chdir(tmp_path)
    solver_param = text_format.Parse(
        'base_lr: 0.002 lr_policy: "fixed" momentum: 0.9 max_iter: 100 display: 0 '
        'random_seed: 3 snapshot_after_train: false', pb.SolverParameter())
    solver_param.net_param.CopyFrom(crnn_train_param(write_ocr_set(tmp_path / "train.h5"), 11))
    solver = syncsgd.get_solver(solver_param)
    losses = []
    try:
        for _ in range(5):
            solver.step(1)
            losses.append(float(solver.net.blobs["ctc_loss"].data))
    finally:
        solver.close()
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
