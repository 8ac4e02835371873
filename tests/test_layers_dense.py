"""InnerProduct, LRN, BatchNorm, Scale, Bias, PReLU and Dropout: forward values against numpy
references written here, numeric gradient checks, in-place use, and the distributed properties
(BatchNorm statistics and Dropout masks over a batch split between ranks)."""
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN
from syncsgd.blob import Blob
from syncsgd.context import Context, shard_range
from syncsgd.errors import ShapeError
from syncsgd.kernels import compiled, onednn
from syncsgd.layers import batch_norm, create, scale
from syncsgd.proto import pb

from gradcheck import blobs_from, check_gradient, make_layer, run_forward

GAUSS = "{ type: 'gaussian' std: 1 }"


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def forward_backward(layer, bottom, top, dy):
    """Setup, forward, then backward from top diff `dy`; returns top data and bottom diff copies."""
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    y = top[0].data.copy()
    top[0].diff[...] = dy
    layer.backward(top, [True] * len(bottom), bottom)
    return y, bottom[0].diff.copy()


def check_in_place(text, x, phase=TRAIN):
    """Run in place (top is bottom), the layer gives the values and gradients it gives apart."""
    dy = randn(*x.shape, seed=9)
    apart = make_layer(text, phase)
    y_ref, dx_ref = forward_backward(apart, blobs_from([x]), [Blob()], dy)
    together = make_layer(text, phase)
    blob = blobs_from([x])[0]
    y, dx = forward_backward(together, [blob], [blob], dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(together.blobs, apart.blobs):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(p.diff, q.diff, rtol=1e-5, atol=1e-6)


# -- InnerProduct ------------------------------------------------------------------------------

def ip_text(num_output=4, axis=1, transpose=False, bias=True):
    return (f"name: 'ip' type: 'InnerProduct' inner_product_param {{ num_output: {num_output} "
            f"axis: {axis} transpose: {str(transpose).lower()} bias_term: {str(bias).lower()} "
            f"weight_filler {GAUSS} bias_filler {GAUSS} }}")


IP_CASES = [((2, 3, 2, 2), 1, False, True), ((2, 3, 4), 2, False, True),
            ((3, 5), 1, True, True), ((2, 3, 2), 1, False, False), ((2, 2, 3), -1, True, False)]


@pytest.mark.parametrize("shape,axis,transpose,bias", IP_CASES)
def test_inner_product_forward(shape, axis, transpose, bias):
    x = randn(*shape)
    layer = make_layer(ip_text(4, axis, transpose, bias))
    (top,) = run_forward(layer, blobs_from([x]))
    a = axis % len(shape)
    k = int(np.prod(shape[a:]))
    w = layer.blobs[0].data
    assert w.shape == ((k, 4) if transpose else (4, k))
    weights = w.T if transpose else w
    rows = x.reshape(-1, k)
    expect = np.zeros((rows.shape[0], 4))
    for m in range(rows.shape[0]):
        for n in range(4):
            expect[m, n] = sum(float(rows[m, i]) * float(weights[n, i]) for i in range(k))
            if bias:
                expect[m, n] += layer.blobs[1].data[n]
    assert len(layer.blobs) == (2 if bias else 1)
    assert top.shape == shape[:a] + (4,)
    np.testing.assert_allclose(top.data.reshape(-1, 4), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,axis,transpose,bias", IP_CASES)
def test_inner_product_gradient(shape, axis, transpose, bias):
    layer = make_layer(ip_text(4, axis, transpose, bias))
    assert check_gradient(layer, blobs_from([randn(*shape)])) > 0


def test_inner_product_accumulates_param_diffs():
    layer = make_layer(ip_text())
    bottom = blobs_from([randn(2, 6)])
    top = run_forward(layer, bottom)
    top[0].diff[...] = randn(2, 4, seed=3)
    layer.backward(top, [True], bottom)
    once = [p.diff.copy() for p in layer.blobs]
    layer.backward(top, [True], bottom)
    for p, d in zip(layer.blobs, once):
        np.testing.assert_allclose(p.diff, 2 * d, rtol=1e-6)


def test_inner_product_errors():
    with pytest.raises(ShapeError, match="num_output"):
        run_forward(make_layer("name: 'ip' type: 'InnerProduct'"), blobs_from([randn(2, 3)]))
    layer = make_layer(ip_text())
    run_forward(layer, blobs_from([randn(2, 6)]))
    with pytest.raises(ShapeError, match="inputs from axis"):
        layer.reshape(blobs_from([randn(2, 5)]), [Blob()])


# -- LRN ---------------------------------------------------------------------------------------

def lrn_text(size, region="ACROSS_CHANNELS", alpha=1.0, beta=0.75, k=1.0):
    return (f"name: 'norm' type: 'LRN' lrn_param {{ local_size: {size} alpha: {alpha} "
            f"beta: {beta} k: {k} norm_region: {region} }}")


def lrn_reference(x, size, region, alpha, beta, k):
    n_, c_, h_, w_ = x.shape
    pad = (size - 1) // 2
    out = np.zeros(x.shape)
    for n, c, h, w in itertools.product(range(n_), range(c_), range(h_), range(w_)):
        if region == "ACROSS_CHANNELS":
            window = x[n, max(c - pad, 0):c + pad + 1, h, w]
            scale = k + alpha / size * np.sum(window.astype(np.float64) ** 2)
        else:
            window = x[n, c, max(h - pad, 0):h + pad + 1, max(w - pad, 0):w + pad + 1]
            scale = 1 + alpha / size ** 2 * np.sum(window.astype(np.float64) ** 2)
        out[n, c, h, w] = x[n, c, h, w] * scale ** -beta
    return out


LRN_CASES = [(5, "ACROSS_CHANNELS", 1.0, 0.75, 1.0), (3, "ACROSS_CHANNELS", 0.5, 0.6, 2.0),
             (1, "ACROSS_CHANNELS", 2.0, 0.75, 1.0), (9, "ACROSS_CHANNELS", 1.0, 0.75, 1.0),
             (3, "WITHIN_CHANNEL", 1.0, 0.75, 1.0), (5, "WITHIN_CHANNEL", 3.0, 0.5, 5.0)]


@pytest.mark.parametrize("size,region,alpha,beta,k", LRN_CASES)
def test_lrn_forward(size, region, alpha, beta, k):
    x = randn(2, 7, 4, 5)
    (top,) = run_forward(make_layer(lrn_text(size, region, alpha, beta, k)), blobs_from([x]))
    np.testing.assert_allclose(top.data, lrn_reference(x, size, region, alpha, beta, k),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size,region,alpha,beta,k", LRN_CASES)
def test_lrn_gradient(size, region, alpha, beta, k):
    layer = make_layer(lrn_text(size, region, alpha, beta, k))
    check_gradient(layer, blobs_from([randn(2, 7, 3, 4)]))


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
def test_lrn_in_parts_on_two_threads_equals_one_pass(region, thread_budget):
    """Parts of one sample shared out to two threads, each through a bordered buffer of its
    own, give the whole batch's values bit for bit, and their gradient checks."""
    from dataclasses import replace
    from syncsgd.kernels.plans import THRESHOLDS
    x, dy = randn(5, 6, 4, 5), randn(5, 6, 4, 5)
    results = []
    for threads, part_values in ((1, THRESHOLDS.lrn_part_values), (2, 1)):
        thread_budget(threads)
        layer = make_layer(lrn_text(5, region, 2.0, 0.75, 1.5))
        layer.thresholds = replace(THRESHOLDS, lrn_part_values=part_values)
        bottom = blobs_from([x])
        (top,) = run_forward(layer, bottom)
        top.diff[...] = dy
        layer.backward([top], [True], bottom)
        results.append((top.data.copy(), bottom[0].diff.copy()))
        if threads == 2:
            assert len(layer._parts) == 5
            check_gradient(layer, blobs_from([x]))
    for one, parts in zip(*results):
        np.testing.assert_array_equal(one, parts)


@pytest.fixture(params=["compiled", "numpy"])
def lrn_kernel(request, monkeypatch):
    """LRN across channels on its compiled loops (kernels/lrn.py) and on its numpy passes."""
    from syncsgd.kernels import compiled
    monkeypatch.setenv("SYNCSGD_NUMBA", "1" if request.param == "compiled" else "0")
    if request.param == "compiled" and not compiled.available():
        pytest.fail("Numba does not import: it is a dependency (pyproject.toml)")
    return request.param


@pytest.mark.parametrize("size,alpha,beta,k", [(5, 1e-4, 0.75, 1.0), (3, 0.5, 0.6, 2.0),
                                               (1, 2.0, 0.75, 1.0), (9, 1.0, 0.75, 1.0),
                                               (7, 0.3, 1.25, 0.5)])
def test_lrn_compiled_loops_compute_the_numpy_passes(size, alpha, beta, k, monkeypatch,
                                                     thread_budget):
    """The compiled loops give the numpy passes' values to the bit forward for beta 0.75 (same
    sums in the same order, the same square roots; exp and log may differ by an ulp), and
    their gradient within float32 rounding; windows wider than the channels included. Two
    threads, parts of two samples."""
    from dataclasses import replace
    from syncsgd.kernels.plans import THRESHOLDS
    thread_budget(2)
    x, dy = randn(5, 7, 6, 5) * 3, randn(5, 7, 6, 5)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("SYNCSGD_NUMBA", switch)
        layer = make_layer(lrn_text(size, "ACROSS_CHANNELS", alpha, beta, k))
        layer.thresholds = replace(THRESHOLDS, lrn_part_values=2 * 7 * 6 * 5)
        bottom = blobs_from([x])
        (top,) = run_forward(layer, bottom)
        assert layer._compiled == (switch == "1")
        top.diff[...] = dy
        layer.backward([top], [True], bottom)
        results[switch] = top.data.copy(), bottom[0].diff.copy()
    if beta == 0.75:
        np.testing.assert_array_equal(results["1"][0], results["0"][0])
    np.testing.assert_allclose(results["1"][0], results["0"][0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results["1"][1], results["0"][1], rtol=1e-5, atol=1e-6)


def test_lrn_compiled_gradient_checks(lrn_kernel):
    layer = make_layer(lrn_text(5, "ACROSS_CHANNELS", 2.0, 0.75, 1.5))
    check_gradient(layer, blobs_from([randn(3, 6, 3, 4)]))
    assert layer._compiled == (lrn_kernel == "compiled")


def test_lrn_rejects_even_size_and_non_4d():
    with pytest.raises(ShapeError, match="odd"):
        run_forward(make_layer(lrn_text(4)), blobs_from([randn(1, 3, 2, 2)]))
    with pytest.raises(ShapeError, match="4 axes"):
        run_forward(make_layer(lrn_text(3)), blobs_from([randn(2, 3)]))


# -- BatchNorm ---------------------------------------------------------------------------------

@pytest.fixture(params=["onednn", "numpy"])
def norm_kernel(request, monkeypatch):
    """BatchNorm with stored statistics and Scale on oneDNN, and on their numpy passes (where
    oneDNN does not load)."""
    if request.param == "numpy":
        for module in (batch_norm, scale):
            monkeypatch.setattr(module, "usable", lambda blob: False)
    elif not onednn.available():
        pytest.skip("oneDNN does not load here")
    return request.param


def bn_text(extra=""):
    return f"name: 'bn' type: 'BatchNorm' batch_norm_param {{ {extra} }}"


def bn_reference(x, mean, var, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)


def batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    return x.mean(axis=axes, dtype=np.float64), x.var(axis=axes, dtype=np.float64)


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (6, 4)])
def test_batch_norm_train_forward_and_moving_averages(shape):
    x1, x2 = randn(*shape, seed=1) * 3 + 1, randn(*shape, seed=2) * 0.5 - 2
    layer = make_layer(bn_text("moving_average_fraction: 0.9 eps: 1e-4"))
    (top,) = run_forward(layer, blobs_from([x1]))
    mean1, var1 = batch_stats(x1)
    np.testing.assert_allclose(top.data, bn_reference(x1, mean1, var1, 1e-4), rtol=1e-4,
                               atol=1e-4)
    (top,) = run_forward(layer, blobs_from([x2]))
    mean2, var2 = batch_stats(x2)
    np.testing.assert_allclose(top.data, bn_reference(x2, mean2, var2, 1e-4), rtol=1e-4,
                               atol=1e-4)
    m = x1.size / shape[1]
    correction = m / (m - 1)
    np.testing.assert_allclose(layer.blobs[2].data, [0.9 * 1 + 1], rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[0].data, mean2 + 0.9 * mean1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].data, correction * (var2 + 0.9 * var1), rtol=1e-5)


@pytest.mark.parametrize("numba", ["1", "0"])
def test_batch_norm_in_place_with_a_large_mean(monkeypatch, numba):
    """Batch statistics in place (the compiled one-pass sums where Numba runs): a mean 1e4
    times the spread costs the variance nothing that shows."""
    monkeypatch.setenv("SYNCSGD_NUMBA", numba)
    x = randn(8, 3, 7, 9, seed=3) * np.array([1.0, 0.01, 3.0], np.float32).reshape(1, 3, 1, 1)
    x += np.array([100.0, -100.0, 0.5], np.float32).reshape(1, 3, 1, 1)
    layer = make_layer(bn_text("eps: 1e-8"))
    blob = blobs_from([x])[0]
    layer.setup([blob], [blob])
    assert layer.compiled == (numba == "1")
    layer.reshape([blob], [blob])
    layer.forward([blob], [blob])
    mean, var = batch_stats(x)
    np.testing.assert_allclose(blob.data, bn_reference(x, mean, var, 1e-8), rtol=1e-3,
                               atol=2e-3)
    m = x.size / 3
    np.testing.assert_allclose(layer.blobs[1].data, var * m / (m - 1), rtol=1e-4)


def test_batch_norm_global_stats_forward(norm_kernel):
    x = randn(3, 2, 2, 2)
    for text, phase in [(bn_text("eps: 1e-3"), TEST),
                        (bn_text("use_global_stats: true eps: 1e-3"), TRAIN)]:
        layer = make_layer(text, phase)
        bottom = blobs_from([x])
        layer.setup(bottom, [Blob()])
        layer.blobs[0].data[...] = [1.0, -2.0]
        layer.blobs[1].data[...] = [4.0, 0.5]
        layer.blobs[2].data[...] = 2.0
        (top,) = run_forward(layer, bottom)
        expect = bn_reference(x, np.array([0.5, -1.0]), np.array([2.0, 0.25]), 1e-3)
        np.testing.assert_allclose(top.data, expect, rtol=1e-5, atol=1e-6)
        assert layer.blobs[2].data[0] == 2.0  # global stats leave the averages alone
    # A zero factor (no statistics yet) means mean 0, variance 0.
    layer = make_layer(bn_text(), TEST)
    (top,) = run_forward(layer, blobs_from([x]))
    np.testing.assert_allclose(top.data, x / np.sqrt(1e-5), rtol=1e-5)


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 4), (6,)])
def test_batch_norm_train_gradient(shape):
    # Caffe's own BatchNorm gradient test: step 1e-2, threshold 1e-3.
    layer = make_layer(bn_text())
    check_gradient(layer, blobs_from([randn(*shape) * 2 + 0.5]), check_params=False)


def test_batch_norm_global_stats_gradient(norm_kernel):
    layer = make_layer(bn_text("use_global_stats: true"))
    bottom = blobs_from([randn(3, 2, 2, 2)])
    layer.setup(bottom, [Blob()])
    layer.blobs[0].data[...] = [0.3, -0.2]
    layer.blobs[1].data[...] = [1.5, 0.7]
    layer.blobs[2].data[...] = 1.0
    check_gradient(layer, bottom, check_params=False)


def test_batch_norm_in_place(norm_kernel):
    check_in_place(bn_text(), randn(4, 3, 2, 2) + 1)
    check_in_place(bn_text(), randn(4, 3) + 1, phase=TEST)


def test_batch_norm_param_specs():
    layer = make_layer(bn_text())
    run_forward(layer, blobs_from([randn(2, 3)]))
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    assert [(s.lr_mult, s.decay_mult) for s in layer.param.param] == [(0, 0)] * 3
    run_forward(layer, blobs_from([randn(2, 3)]))  # a second setup keeps three entries
    assert len(layer.param.param) == 3
    layer = make_layer("name: 'bn' type: 'BatchNorm' param { lr_mult: 0 } param { lr_mult: 1 }")
    with pytest.raises(ShapeError, match="lr_mult"):
        run_forward(layer, blobs_from([randn(2, 3)]))


class FakeRanks:
    """Ranks as threads: allreduce_sum adds every rank's array, in rank order, for all of them."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size

    def context(self, rank, phase=TRAIN):
        def allreduce(array):
            self.slots[rank] = array.copy()
            self.barrier.wait()
            total = np.sum(self.slots, axis=0)
            self.barrier.wait()
            array[...] = total
        return Context(phase, seed=1701, rank=rank, size=self.size, allreduce=allreduce)

    def run(self, fn):
        with ThreadPoolExecutor(self.size) as pool:
            return [f.result() for f in [pool.submit(fn, r) for r in range(self.size)]]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("size,n", [(2, 6), (2, 5), (3, 7)])
def test_batch_norm_split_over_ranks_matches_one_process(size, n, in_place):
    xs = [randn(n, 3, 2, 2, seed=s) * 2 + s for s in (1, 2)]
    dys = [randn(n, 3, 2, 2, seed=s + 10) for s in (1, 2)]
    param = text_format.Parse(bn_text("moving_average_fraction: 0.5"), pb.LayerParameter())

    def train(ctx, rows):
        layer = create(param, ctx)
        tops, diffs = [], []
        for x, dy in zip(xs, dys):  # two steps, so the moving averages are checked as well
            bottom = blobs_from([x[rows]])
            top = bottom if in_place else [Blob()]      # in place: the compiled passes
            y, dx = forward_backward(layer, bottom, top, dy[rows])
            assert layer.compiled == (in_place and compiled.available())
            tops.append(y)
            diffs.append(dx)
        return tops, diffs, [b.data.copy() for b in layer.blobs]

    ref_tops, ref_diffs, ref_blobs = train(Context(TRAIN, seed=1701), slice(None))
    ranks = FakeRanks(size)

    def on_rank(rank):
        first, count = shard_range(n, rank, size)
        return train(ranks.context(rank), slice(first, first + count))

    results = ranks.run(on_rank)
    for step in range(2):
        top = np.concatenate([r[0][step] for r in results])
        diff = np.concatenate([r[1][step] for r in results])
        np.testing.assert_allclose(top, ref_tops[step], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(diff, ref_diffs[step], rtol=1e-4, atol=1e-5)
    for _, _, blobs in results:
        for got, want in zip(blobs, ref_blobs):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- Scale and Bias ----------------------------------------------------------------------------

def operand_view(operand, x_ndim, axis):
    """The operand reshaped so numpy broadcasts it against x starting at `axis`."""
    if operand.ndim == 0:
        return operand
    return operand.reshape((1,) * axis + operand.shape + (1,) * (x_ndim - axis - operand.ndim))


# (x shape, axis, num_axes) -> the learned operand covers x.shape[axis:axis+num_axes]
BROADCAST_CASES = [((2, 3, 2, 2), 1, 1), ((2, 3, 2, 2), 1, 2), ((2, 3, 2, 2), 0, -1),
                   ((2, 3, 4), -1, 1), ((2, 3, 2), 1, 0), ((4, 3), 0, 1)]


def scale_text(axis, num_axes, bias=False, filler=True):
    fillers = f"filler {GAUSS} bias_filler {GAUSS}" if filler else ""
    return (f"name: 'sc' type: 'Scale' scale_param {{ axis: {axis} num_axes: {num_axes} "
            f"bias_term: {str(bias).lower()} {fillers} }}")


@pytest.mark.parametrize("shape,axis,num_axes", BROADCAST_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_one_bottom(shape, axis, num_axes, bias, norm_kernel):
    x = randn(*shape)
    layer = make_layer(scale_text(axis, num_axes, bias))
    (top,) = run_forward(layer, blobs_from([x]))
    a = axis % len(shape)
    end = len(shape) if num_axes == -1 else a + num_axes
    assert layer.blobs[0].shape == shape[a:end]
    assert len(layer.blobs) == (2 if bias else 1)
    expect = x * operand_view(layer.blobs[0].data, len(shape), a)
    if bias:
        assert layer.blobs[1].shape == shape[a:end]
        expect = expect + operand_view(layer.blobs[1].data, len(shape), a)
    np.testing.assert_allclose(top.data, expect, rtol=1e-6, atol=1e-6)
    check_gradient(make_layer(scale_text(axis, num_axes, bias)), blobs_from([x]))


@pytest.mark.parametrize("shape,axis,num_axes", BROADCAST_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_scale_two_bottoms(shape, axis, num_axes, bias):
    a = axis % len(shape)
    end = len(shape) if num_axes == -1 else a + num_axes
    x, s = randn(*shape), randn(*shape[a:end], seed=4)
    layer = make_layer(scale_text(axis, num_axes, bias))
    (top,) = run_forward(layer, blobs_from([x, s]))
    assert len(layer.blobs) == (1 if bias else 0)
    expect = x * operand_view(s, len(shape), a)
    if bias:
        assert layer.blobs[0].shape == s.shape
        expect = expect + operand_view(layer.blobs[0].data, len(shape), a)
    np.testing.assert_allclose(top.data, expect, rtol=1e-6, atol=1e-6)
    check_gradient(make_layer(scale_text(axis, num_axes, bias)), blobs_from([x, s]))


def test_scale_default_fillers_and_in_place():
    layer = make_layer(scale_text(1, 1, bias=True, filler=False))
    run_forward(layer, blobs_from([randn(2, 3, 2)]))
    np.testing.assert_array_equal(layer.blobs[0].data, np.ones(3))
    np.testing.assert_array_equal(layer.blobs[1].data, np.zeros(3))
    check_in_place(scale_text(1, 2, bias=True), randn(2, 3, 2, 2))
    check_in_place(scale_text(1, 1, bias=True), randn(2, 3, 2, 2))
    check_in_place(scale_text(1, 0), randn(2, 3, 2, 2))


@pytest.mark.parametrize("in_place", [False, True])
def test_scale_per_channel_over_blocks_of_rows(in_place):
    """A scale per channel on an array, over more rows than a block holds (kernels/rows.py):
    values and gradients as float64 numpy gives them, the gradients added to what the diffs
    held."""
    x = randn(3, 5, 300, 300)
    dy = randn(*x.shape, seed=9)
    layer = make_layer(scale_text(1, 1, bias=True))
    blob = blobs_from([x])[0]
    top = blob if in_place else Blob()
    layer.setup([blob], [top])
    layer.reshape([blob], [top])
    assert layer._rows is not None and len(layer._rows._blocks) > 2
    scale_values, bias_values = (b.data.astype(np.float64).reshape(1, 5, 1, 1)
                                 for b in layer.blobs)
    for b in layer.blobs:
        b.diff[...] = 1.0
    layer.forward([blob], [top])
    np.testing.assert_allclose(top.data, x * scale_values + bias_values, rtol=1e-6, atol=1e-6)
    top.diff[...] = dy
    layer.backward([top], [True], [blob])
    np.testing.assert_allclose(blob.diff, dy * scale_values, rtol=1e-6, atol=1e-6)
    # float32 sums of 90,000 values a row: within 1e-6 of the sum of the terms' sizes
    for blob, terms in zip(layer.blobs, (dy.astype(np.float64) * x, dy.astype(np.float64))):
        np.testing.assert_allclose(blob.diff, 1 + terms.sum(axis=(0, 2, 3)), rtol=0,
                                   atol=1e-6 * np.abs(terms).sum(axis=(0, 2, 3)).max())


def test_scale_rejects_mismatched_operand():
    layer = make_layer(scale_text(1, 1))
    with pytest.raises(ShapeError, match="does not match"):
        run_forward(layer, blobs_from([randn(2, 3, 2), randn(2)]))
    with pytest.raises(ShapeError, match="num_axes"):
        run_forward(make_layer(scale_text(1, 3)), blobs_from([randn(2, 3, 2)]))


def bias_text(axis, num_axes, filler=True):
    fill = f"filler {GAUSS}" if filler else ""
    return f"name: 'bi' type: 'Bias' bias_param {{ axis: {axis} num_axes: {num_axes} {fill} }}"


@pytest.mark.parametrize("shape,axis,num_axes", BROADCAST_CASES)
def test_bias(shape, axis, num_axes):
    x = randn(*shape)
    a = axis % len(shape)
    end = len(shape) if num_axes == -1 else a + num_axes
    layer = make_layer(bias_text(axis, num_axes))
    (top,) = run_forward(layer, blobs_from([x]))
    assert layer.blobs[0].shape == shape[a:end]
    np.testing.assert_allclose(top.data, x + operand_view(layer.blobs[0].data, len(shape), a),
                               rtol=1e-6, atol=1e-6)
    check_gradient(make_layer(bias_text(axis, num_axes)), blobs_from([x]))
    b = randn(*shape[a:end], seed=5)
    layer = make_layer(bias_text(axis, num_axes))
    (top,) = run_forward(layer, blobs_from([x, b]))
    assert layer.blobs == []
    np.testing.assert_allclose(top.data, x + operand_view(b, len(shape), a), rtol=1e-6, atol=1e-6)
    check_gradient(make_layer(bias_text(axis, num_axes)), blobs_from([x, b]))


def test_bias_default_filler_and_in_place():
    layer = make_layer(bias_text(1, 1, filler=False))
    run_forward(layer, blobs_from([randn(2, 3)]))
    np.testing.assert_array_equal(layer.blobs[0].data, np.zeros(3))
    check_in_place(bias_text(1, 1), randn(2, 3, 2))


# -- PReLU -------------------------------------------------------------------------------------

def prelu_text(shared, filler=True):
    fill = "filler { type: 'uniform' min: -0.5 max: 0.8 }" if filler else ""
    return (f"name: 'pr' type: 'PReLU' prelu_param {{ channel_shared: {str(shared).lower()} "
            f"{fill} }}")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 2, 2), (4, 3)])
def test_prelu(shared, shape):
    x = randn(*shape)
    layer = make_layer(prelu_text(shared))
    (top,) = run_forward(layer, blobs_from([x]))
    slope = layer.blobs[0].data
    assert slope.shape == (() if shared else (shape[1],))
    expect = np.empty_like(x)
    for idx in itertools.product(*map(range, shape)):
        a = slope if shared else slope[idx[1]]
        expect[idx] = x[idx] if x[idx] > 0 else a * x[idx]
    np.testing.assert_allclose(top.data, expect, rtol=1e-6)
    check_gradient(make_layer(prelu_text(shared)), blobs_from([x]),
                   kink=lambda v: v, kink_range=0.02)


def test_prelu_default_filler_and_in_place():
    layer = make_layer(prelu_text(False, filler=False))
    run_forward(layer, blobs_from([randn(2, 3, 2)]))
    np.testing.assert_array_equal(layer.blobs[0].data, np.full(3, 0.25, np.float32))
    check_in_place(prelu_text(False), randn(2, 3, 2, 2))
    check_in_place(prelu_text(True), randn(3, 2))


def test_prelu_needs_two_axes():
    with pytest.raises(ShapeError, match="2 axes"):
        run_forward(make_layer(prelu_text(False)), blobs_from([randn(5)]))


# -- Dropout -----------------------------------------------------------------------------------

def dropout_text(ratio=0.5):
    return f"name: 'drop' type: 'Dropout' dropout_param {{ dropout_ratio: {ratio} }}"


def test_dropout_test_phase_is_identity():
    x = randn(3, 4, 2)
    layer = make_layer(dropout_text(0.7), TEST)
    y, dx = forward_backward(layer, blobs_from([x]), [Blob()], x * 2)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, x * 2)


@pytest.mark.parametrize("ratio", [0.5, 0.2, 0.9])
def test_dropout_mask_statistics(ratio):
    x = np.ones((50, 400), np.float32)
    (top,) = run_forward(make_layer(dropout_text(ratio)), blobs_from([x]))
    kept = top.data != 0
    assert abs(kept.mean() - (1 - ratio)) < 0.01
    np.testing.assert_allclose(top.data[kept], 1 / (1 - ratio), rtol=1e-6)


def test_dropout_mask_depends_on_iteration_only_through_the_key():
    x = randn(4, 10)
    layer = make_layer(dropout_text())
    first = run_forward(layer, blobs_from([x]))[0].data.copy()
    again = run_forward(layer, blobs_from([x]))[0].data.copy()
    layer.ctx.iteration = 1
    other = run_forward(layer, blobs_from([x]))[0].data.copy()
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first != 0, other != 0)


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_dropout_gradient(ratio):
    # The mask is fixed within an iteration, so the layer is linear and the check exact.
    check_gradient(make_layer(dropout_text(ratio)), blobs_from([randn(4, 3, 2)]))


def test_dropout_in_place():
    check_in_place(dropout_text(0.4), randn(4, 5))
    check_in_place(dropout_text(0.4), randn(4, 5), phase=TEST)


def test_dropout_split_batch_matches_one_piece():
    x, dy = randn(8, 3, 5), randn(8, 3, 5, seed=1)
    whole = make_layer(dropout_text(0.5))
    y_ref, dx_ref = forward_backward(whole, blobs_from([x]), [Blob()], dy)
    pieces = []
    for first, stop in [(0, 5), (5, 8)]:
        layer = make_layer(dropout_text(0.5))
        layer.ctx.batch_offset = first
        pieces.append(forward_backward(layer, blobs_from([x[first:stop]]), [Blob()],
                                       dy[first:stop]))
    np.testing.assert_array_equal(np.concatenate([p[0] for p in pieces]), y_ref)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), dx_ref)


def test_dropout_without_scale_train_scales_at_test_time():
    """Fast R-CNN's fork: kept values unscaled in TRAIN, every value times 1 - ratio in TEST."""
    x, dy = randn(3, 40), randn(3, 40, seed=1)
    text = "name: 'drop' type: 'Dropout' dropout_param { dropout_ratio: 0.25 scale_train: false }"
    y, dx = forward_backward(make_layer(text), blobs_from([x]), [Blob()], dy)
    kept = y != 0
    assert 0.5 < kept.mean() < 0.95
    np.testing.assert_array_equal(y[kept], x[kept])
    np.testing.assert_array_equal(dx, np.where(kept, dy, 0))
    y, dx = forward_backward(make_layer(text, TEST), blobs_from([x]), [Blob()], dy)
    np.testing.assert_array_equal(y, x * np.float32(0.75))
    np.testing.assert_array_equal(dx, dy * np.float32(0.75))
    check_in_place(text, randn(4, 5), phase=TEST)


def test_dropout_rejects_ratio_one():
    with pytest.raises(ShapeError, match="dropout_ratio"):
        run_forward(make_layer(dropout_text(1.0)), blobs_from([randn(2, 3)]))
