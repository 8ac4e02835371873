"""SoftmaxWithLoss, SigmoidCrossEntropyLoss, EuclideanLoss and Accuracy: values against numpy
references written here, every normalisation mode, numeric gradient checks, and the distributed
rule: a batch split between two ranks reports the one-process loss, and the ranks' gradients
together are the one-process gradient."""
import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN
from syncsgd.context import Context
from syncsgd.errors import ShapeError
from syncsgd.layers import create
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def labels(shape, classes, seed=0, ignore=None, ignored=0.0):
    """Random integer labels (as float32); a fraction `ignored` of them set to `ignore`."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, classes, shape).astype(np.float32)
    if ignore is not None:
        out[rng.random(shape) < ignored] = ignore
    return out


def loss_of(text, *arrays, n_top=1):
    top = run_forward(make_layer(text), blobs_from(arrays), n_top)
    return [t.data.copy() for t in top]


# -- numpy references ----------------------------------------------------------------------------
def softmax_loss_ref(x, label, axis=1, ignore=None, mode="VALID"):
    """Caffe's SoftmaxWithLoss with loops over (outer, inner) positions; float64."""
    x = np.moveaxis(x.astype(np.float64), axis, -1)          # (..., C)
    lab = label.reshape(x.shape[:-1])
    total, valid = 0.0, 0
    for idx in np.ndindex(lab.shape):
        if ignore is not None and lab[idx] == ignore:
            continue
        row = x[idx] - x[idx].max()
        p = np.exp(row) / np.exp(row).sum()
        total -= np.log(max(p[int(lab[idx])], np.finfo(np.float32).tiny))
        valid += 1
    outer = int(np.prod(x.shape[:axis]))
    norm = {"FULL": lab.size, "VALID": valid, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return total / max(1, norm)


def sigmoid_ce_ref(x, t, ignore=None, mode="BATCH_SIZE"):
    x, t = x.astype(np.float64), t.astype(np.float64)
    # -log sigmoid(x) = log(1 + exp(-x)); -log(1 - sigmoid(x)) = log(1 + exp(x))
    terms = t * np.logaddexp(0, -x) + (1 - t) * np.logaddexp(0, x)
    keep = np.ones(x.shape, bool) if ignore is None else t != ignore
    norm = {"FULL": x.size, "VALID": keep.sum(), "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return terms[keep].sum() / max(1, norm)


def accuracy_ref(x, label, top_k=1, axis=1, ignore=None):
    """Per position: correct when the label's score is among the top_k (ties count against)."""
    x = np.moveaxis(x.astype(np.float64), axis, -1)
    lab = label.reshape(x.shape[:-1])
    classes = x.shape[-1]
    hits, seen = np.zeros(classes), np.zeros(classes)
    for idx in np.ndindex(lab.shape):
        if ignore is not None and lab[idx] == ignore:
            continue
        c = int(lab[idx])
        seen[c] += 1
        others_as_high = sum(1 for k in range(classes) if k != c and x[idx][k] >= x[idx][c])
        hits[c] += others_as_high < top_k
    per_class = np.where(seen > 0, hits / np.maximum(seen, 1), 0)
    return hits.sum() / max(seen.sum(), 1), per_class


# -- SoftmaxWithLoss -----------------------------------------------------------------------------
MODES = ["FULL", "VALID", "BATCH_SIZE", "NONE"]


@pytest.mark.parametrize("mode", MODES)
def test_softmax_loss_modes(mode):
    x = randn(4, 5, 2, 3) * 3
    y = labels((4, 1, 2, 3), 5, ignore=255, ignored=0.3)
    text = ("type: 'SoftmaxWithLoss' loss_param { ignore_label: 255 "
            f"normalization: {mode} }}")
    (loss,) = loss_of(text, x, y)
    assert loss.shape == ()
    np.testing.assert_allclose(loss, softmax_loss_ref(x, y, ignore=255, mode=mode), rtol=1e-5)


def test_softmax_loss_in_row_pieces_on_threads(thread_budget):
    """Batches of more than 2^18 class scores run in row pieces shared out to the threads
    (softmax.in_rows): loss, probabilities and gradient as one piece computes them."""
    thread_budget(2)
    x, y = randn(600, 1000, seed=3) * 4, labels((600,), 1000, ignore=7, ignored=0.1)
    layer = make_layer("type: 'SoftmaxWithLoss' loss_param { ignore_label: 7 }")
    bottom = blobs_from([x, y])
    top = run_forward(layer, bottom, 2)
    shifted = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    prob = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(top[1].data, prob, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(top[0].data, softmax_loss_ref(x, y, ignore=7), rtol=1e-5)
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    valid = y != 7
    want = prob.copy()
    want[np.arange(600), y.astype(int) % 1000] -= 1
    want *= valid[:, None] / valid.sum()
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-4, atol=1e-8)


def test_softmax_in_row_pieces_on_threads(thread_budget):
    """The Softmax layer's forward and backward in row pieces (softmax.in_rows) against numpy."""
    thread_budget(2)
    x, dy = randn(700, 800, seed=4) * 3, randn(700, 800, seed=5)
    layer = make_layer("type: 'Softmax'")
    bottom = blobs_from([x])
    top = run_forward(layer, bottom)
    shifted = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    prob = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(top[0].data, prob, rtol=1e-4, atol=1e-7)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    want = (dy - (dy * prob).sum(axis=1, keepdims=True)) * prob
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-3, atol=1e-6)


def test_softmax_loss_defaults_and_legacy_normalize():
    x, y = randn(6, 4), labels((6,), 4)
    (loss,) = loss_of("type: 'SoftmaxWithLoss'", x, y)
    np.testing.assert_allclose(loss, softmax_loss_ref(x, y), rtol=1e-5)
    yi = labels((6,), 4, ignore=-1, ignored=0.5, seed=3)
    for normalize, mode in (("true", "VALID"), ("false", "BATCH_SIZE")):
        text = f"type: 'SoftmaxWithLoss' loss_param {{ ignore_label: -1 normalize: {normalize} }}"
        (loss,) = loss_of(text, x, yi)
        np.testing.assert_allclose(loss, softmax_loss_ref(x, yi, ignore=-1, mode=mode),
                                   rtol=1e-5)
    # An explicit normalization wins over the legacy flag.
    (loss,) = loss_of("type: 'SoftmaxWithLoss' loss_param { ignore_label: -1 normalize: false "
                      "normalization: NONE }", x, yi)
    np.testing.assert_allclose(loss, softmax_loss_ref(x, yi, ignore=-1, mode="NONE"), rtol=1e-5)


def test_softmax_loss_all_ignored_is_zero_not_nan():
    x, y = randn(3, 4), np.full(3, 7, np.float32)
    (loss,) = loss_of("type: 'SoftmaxWithLoss' loss_param { ignore_label: 7 }", x, y)
    assert loss == 0
    layer = make_layer("type: 'SoftmaxWithLoss' loss_param { ignore_label: 7 }")
    bottom = blobs_from([x, y])
    (top,) = run_forward(layer, bottom)
    top.diff[...] = 1
    layer.backward([top], [True, False], bottom)
    assert not bottom[0].diff.any()


def test_softmax_loss_second_top_is_the_probabilities():
    x = randn(2, 3, 4)
    y = labels((2, 4), 3)
    loss, prob = loss_of("type: 'SoftmaxWithLoss' softmax_param { axis: 1 }", x, y, n_top=2)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(prob, e / e.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(loss, softmax_loss_ref(x, y), rtol=1e-5)


def test_softmax_loss_other_axis():
    x = randn(2, 3, 5)
    y = labels((2, 3), 5)
    (loss,) = loss_of("type: 'SoftmaxWithLoss' softmax_param { axis: -1 }", x, y)
    np.testing.assert_allclose(loss, softmax_loss_ref(x, y, axis=2), rtol=1e-5)


@pytest.mark.parametrize("params", [
    "", "loss_param { ignore_label: 2 }",
    "loss_param { ignore_label: 2 normalization: FULL }",
    "loss_param { ignore_label: 2 normalization: BATCH_SIZE }",
    "loss_param { normalization: NONE }", "loss_param { normalize: false }"])
def test_softmax_loss_gradient(params):
    x = randn(3, 4, 2, 2, seed=1)
    y = labels((3, 1, 2, 2), 4, seed=2)      # spatial labels (N, 1, H, W)
    layer = make_layer(f"type: 'SoftmaxWithLoss' {params}")
    assert check_gradient(layer, blobs_from([x, y]), check_bottom=[0]) > 0


def test_softmax_loss_gradient_with_probability_top():
    x, y = randn(4, 3, seed=4), labels((4,), 3, seed=5)
    layer = make_layer("type: 'SoftmaxWithLoss' loss_weight: 1 loss_weight: 0")
    assert check_gradient(layer, blobs_from([x, y]), n_top=2, top_index=0,
                          check_bottom=[0]) > 0


def test_softmax_loss_errors():
    with pytest.raises(ShapeError, match="labels for"):
        loss_of("type: 'SoftmaxWithLoss'", randn(2, 3, 4), labels((2, 3), 3))
    with pytest.raises(ShapeError, match="outside 0..2"):
        loss_of("type: 'SoftmaxWithLoss'", randn(2, 3), np.array([0, 3], np.float32))
    layer = make_layer("name: 'sl' type: 'SoftmaxWithLoss'")
    bottom = blobs_from([randn(2, 3), labels((2,), 3)])
    (top,) = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="propagate_down"):
        layer.backward([top], [True, True], bottom)


def test_loss_layers_default_to_loss_weight_one():
    for t in ("SoftmaxWithLoss", "SigmoidCrossEntropyLoss", "EuclideanLoss"):
        assert make_layer(f"type: '{t}'").is_loss
    assert not make_layer("type: 'Accuracy'").is_loss


# -- SigmoidCrossEntropyLoss ---------------------------------------------------------------------
@pytest.mark.parametrize("params,mode", [
    ("", "BATCH_SIZE"), ("loss_param { normalization: VALID }", "VALID"),
    ("loss_param { normalization: FULL }", "FULL"), ("loss_param { normalization: NONE }", "NONE"),
    ("loss_param { normalize: true }", "VALID"), ("loss_param { normalize: false }", "BATCH_SIZE")])
def test_sigmoid_cross_entropy_modes(params, mode):
    x = randn(3, 4, 2) * 4
    x[0, 0, 0] = 60           # the stable form must not overflow
    t = np.random.default_rng(1).random((3, 4, 2)).astype(np.float32)
    (loss,) = loss_of(f"type: 'SigmoidCrossEntropyLoss' {params}", x, t)
    np.testing.assert_allclose(loss, sigmoid_ce_ref(x, t, mode=mode), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_sigmoid_cross_entropy_ignore_label(mode):
    x = randn(4, 5)
    t = labels((4, 5), 2, ignore=-1, ignored=0.4, seed=2)
    text = (f"type: 'SigmoidCrossEntropyLoss' loss_param {{ ignore_label: -1 "
            f"normalization: {mode} }}")
    (loss,) = loss_of(text, x, t)
    np.testing.assert_allclose(loss, sigmoid_ce_ref(x, t, ignore=-1, mode=mode), rtol=1e-5)


@pytest.mark.parametrize("params", [
    "", "loss_param { normalization: FULL }", "loss_param { ignore_label: -1 }",
    "loss_param { ignore_label: -1 normalization: VALID }"])
def test_sigmoid_cross_entropy_gradient(params):
    x = randn(3, 2, 4, seed=3) * 2
    t = labels((3, 2, 4), 2, ignore=-1, ignored=0.3, seed=4)
    if "ignore" not in params:
        t = np.random.default_rng(5).random(t.shape).astype(np.float32)
    layer = make_layer(f"type: 'SigmoidCrossEntropyLoss' {params}")
    assert check_gradient(layer, blobs_from([x, t]), check_bottom=[0]) > 0


# -- EuclideanLoss -------------------------------------------------------------------------------
def test_euclidean_loss_value_and_gradient():
    a, b = randn(4, 3, 2), randn(4, 6, seed=1)
    (loss,) = loss_of("type: 'EuclideanLoss'", a, b)
    ref = ((a.reshape(4, 6).astype(np.float64) - b) ** 2).sum() / (2 * 4)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert check_gradient(make_layer("type: 'EuclideanLoss'"), blobs_from([a, b])) > 0
    with pytest.raises(ShapeError, match="same number of elements"):
        loss_of("type: 'EuclideanLoss'", a, randn(4, 5))
    with pytest.raises(ShapeError, match="first dimension"):
        loss_of("type: 'EuclideanLoss'", randn(4, 6), randn(6, 4))


# -- Accuracy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_accuracy_top_k(top_k):
    x, y = randn(40, 6), labels((40,), 6, seed=1)
    acc, per_class = loss_of(f"type: 'Accuracy' accuracy_param {{ top_k: {top_k} }}", x, y,
                             n_top=2)
    ref, ref_per_class = accuracy_ref(x, y, top_k)
    assert acc.shape == () and per_class.shape == (6,)
    np.testing.assert_allclose(acc, ref, rtol=1e-6)
    np.testing.assert_allclose(per_class, ref_per_class, rtol=1e-6)
    assert 0 < ref < 1


def test_accuracy_ignore_label_and_spatial_axis():
    x = randn(3, 4, 2, 5)
    y = labels((3, 4, 2), 5, ignore=9, ignored=0.3, seed=2)
    acc, per_class = loss_of("type: 'Accuracy' accuracy_param { axis: 3 ignore_label: 9 "
                             "top_k: 2 }", x, y, n_top=2)
    ref, ref_per_class = accuracy_ref(x, y, top_k=2, axis=3, ignore=9)
    np.testing.assert_allclose(acc, ref, rtol=1e-6)
    np.testing.assert_allclose(per_class, ref_per_class, rtol=1e-6)


def test_accuracy_ties_count_against_and_empty_batch_is_zero():
    x = np.zeros((2, 3), np.float32)
    (acc,) = loss_of("type: 'Accuracy'", x, np.array([0, 1], np.float32))
    assert acc == 0
    (acc,) = loss_of("type: 'Accuracy' accuracy_param { top_k: 3 }", x,
                     np.array([0, 1], np.float32))
    assert acc == 1
    (acc,) = loss_of("type: 'Accuracy' accuracy_param { ignore_label: 1 }", x,
                     np.array([1, 1], np.float32))
    assert acc == 0


def test_accuracy_errors_and_zero_gradient():
    with pytest.raises(ShapeError, match="top_k 4"):
        loss_of("type: 'Accuracy' accuracy_param { top_k: 4 }", randn(2, 3), labels((2,), 3))
    with pytest.raises(ShapeError, match="labels for"):
        loss_of("type: 'Accuracy'", randn(2, 3, 2), labels((2,), 3))
    layer = make_layer("type: 'Accuracy'")
    bottom = blobs_from([randn(2, 3), labels((2,), 3)])
    bottom[0].diff[...] = 1
    top = run_forward(layer, bottom)
    layer.backward(top, [True, False], bottom)
    assert not bottom[0].diff.any()


# -- the distributed rule ------------------------------------------------------------------------
def as_two_ranks(run):
    """run(rank, allreduce) as two ranks whose allreduce really sums: a first pass records what
    each rank hands to allreduce, the second gives each rank an allreduce that adds the
    other's. Returns [rank 0's, rank 1's] results of the second pass."""
    handed = [None, None]

    def record(rank):
        def allreduce(array):
            handed[rank] = array.copy()
        return allreduce

    def add_other(rank):
        def allreduce(array):
            array += handed[1 - rank]
        return allreduce

    for rank in (0, 1):
        run(rank, record(rank))
    return [run(rank, add_other(rank)) for rank in (0, 1)]


def two_rank_run(text, arrays, cut, n_top=1, weight=1.7, propagate=(True, False)):
    """Run the layer as two ranks holding rows [:cut] and [cut:]. Returns per rank (top values,
    bottom diffs)."""
    def run(rank, allreduce):
        ctx = Context(TRAIN, seed=1, rank=rank, size=2, allreduce=allreduce)
        layer = create(text_format.Parse(text, pb.LayerParameter()), ctx)
        rows = slice(0, cut) if rank == 0 else slice(cut, None)
        bottom = blobs_from([a[rows] for a in arrays])
        top = run_forward(layer, bottom, n_top)
        top[0].diff[...] = weight
        layer.backward(top, list(propagate), bottom)
        return [t.data.copy() for t in top], [b.diff.copy() for b in bottom]

    return as_two_ranks(run)


def one_process_run(text, arrays, n_top=1, weight=1.7, propagate=(True, False)):
    layer = make_layer(text)
    bottom = blobs_from(arrays)
    top = run_forward(layer, bottom, n_top)
    top[0].diff[...] = weight
    layer.backward(top, list(propagate), bottom)
    return [t.data.copy() for t in top], [b.diff.copy() for b in bottom]


def assert_split_equals_whole(text, arrays, cut, n_top=1, propagate=(True, False),
                              sliced_tops=()):
    """Every rank's tops equal the one-process tops (or, for `sliced_tops`, the ranks' tops
    together do), and so do the ranks' bottom diffs together."""
    (tops, diffs) = one_process_run(text, arrays, n_top, propagate=propagate)
    ranks = two_rank_run(text, arrays, cut, n_top, propagate=propagate)
    for j, want in enumerate(tops):
        if j in sliced_tops:
            joined = np.concatenate([rank_tops[j] for rank_tops, _ in ranks])
            np.testing.assert_allclose(joined, want, rtol=1e-5, atol=1e-7)
            continue
        for rank_tops, _ in ranks:
            np.testing.assert_allclose(rank_tops[j], want, rtol=1e-5, atol=1e-7)
    for i, down in enumerate(propagate):
        if down:
            joined = np.concatenate([rank_diffs[i] for _, rank_diffs in ranks])
            np.testing.assert_allclose(joined, diffs[i], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_softmax_loss_split_between_ranks(mode):
    x = randn(6, 4, 3)
    y = labels((6, 3), 4, seed=1)
    y[:2] = 255            # rank 0 has many more ignored labels than rank 1
    text = f"type: 'SoftmaxWithLoss' loss_param {{ ignore_label: 255 normalization: {mode} }}"
    assert_split_equals_whole(text, [x, y], cut=3, n_top=2, sliced_tops=(1,))


def test_softmax_loss_split_legacy_normalize():
    x, y = randn(5, 3), labels((5,), 3, ignore=-1, ignored=0.4, seed=1)
    for flag in ("true", "false"):
        text = f"type: 'SoftmaxWithLoss' loss_param {{ ignore_label: -1 normalize: {flag} }}"
        assert_split_equals_whole(text, [x, y], cut=2)


@pytest.mark.parametrize("params", [
    "", "loss_param { ignore_label: -1 normalization: VALID }",
    "loss_param { normalization: FULL }"])
def test_sigmoid_cross_entropy_split_between_ranks(params):
    x = randn(5, 3, 2)
    t = labels((5, 3, 2), 2, ignore=-1, ignored=0.3, seed=2)
    assert_split_equals_whole(f"type: 'SigmoidCrossEntropyLoss' {params}", [x, t], cut=2)


def test_euclidean_loss_split_between_ranks():
    a, b = randn(5, 4), randn(5, 4, seed=1)
    assert_split_equals_whole("type: 'EuclideanLoss'", [a, b], cut=3, propagate=(True, True))


def test_accuracy_split_between_ranks():
    x = randn(7, 5, 2)
    y = labels((7, 2), 5, ignore=0, ignored=0.3, seed=3)
    text = "type: 'Accuracy' accuracy_param { top_k: 2 ignore_label: 0 }"
    assert_split_equals_whole(text, [x, y], cut=3, n_top=2, propagate=(False, False))


def test_rank_with_an_empty_slice():
    x, y = randn(3, 4), labels((3,), 4, seed=2)
    assert_split_equals_whole("type: 'SoftmaxWithLoss'", [x, y], cut=0)


def test_rank_gradients_sum_to_the_global_gradient_of_a_shared_input():
    """Both ranks see the same upstream weight w (x = w * z): the sum over ranks of
    d loss / d w equals the one-process derivative."""
    z = randn(6, 3)
    y = labels((6,), 3, seed=4)
    text = "type: 'SoftmaxWithLoss' loss_param { normalization: BATCH_SIZE }"
    (_, (whole_dx, _)) = one_process_run(text, [z * 0.7, y])
    ranks = two_rank_run(text, [z * 0.7, y], cut=4)
    per_rank = [float((dx * z[rows]).sum())
                for (_, (dx, _)), rows in zip(ranks, (slice(0, 4), slice(4, None)))]
    np.testing.assert_allclose(sum(per_rank), float((whole_dx * z).sum()), rtol=1e-5)
