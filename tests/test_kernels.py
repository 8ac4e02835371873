"""The kernels package: GEMM and its thread pool, the thread budget, chunked fillers, every
convolution and pooling path a plan can name (each against the plain path, and gradients), the
plan functions themselves, and the switch that makes a oneDNN which does not load an error."""
import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import fillers
from syncsgd.errors import SyncSGDError
from syncsgd.kernels import blas, onednn, plans, threads
from syncsgd.kernels.plans import (THRESHOLDS, ConvolutionGeometry, PoolingGeometry,
                                   plan_convolution, plan_pooling)
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward


# -- GEMM -----------------------------------------------------------------------------------------
@pytest.fixture
def gemm_thresholds():
    """use(**changes): gemm plans with THRESHOLDS so changed until the end of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(
            blas.planned_with(replace(THRESHOLDS, **changes)))


def layouts(a):
    """a, its column-major copy, and a view of it inside a wider array."""
    wide = np.zeros((a.shape[0], a.shape[1] + 3), np.float32)
    wide[:, :a.shape[1]] = a
    return [a, np.asfortranarray(a), wide[:, :a.shape[1]]]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shape", [(5, 7, 3), (300, 20, 40), (20, 3000, 25), (40, 30, 700)])
def test_gemm_matches_numpy_in_every_layout(shape, split, monkeypatch, thread_budget,
                                            gemm_thresholds):
    if split:    # pieces over two threads even for these small products
        gemm_thresholds(split_flops=0)
        monkeypatch.setattr(plans, "ALIGN", 2)
        thread_budget(2)
    m, k, n = shape
    rng = np.random.default_rng(0)
    a0, b0, c0 = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (m, n)))
    for a in layouts(a0):
        for b in layouts(b0):
            for out in layouts(c0.copy()):
                for beta in (0.0, 1.0):
                    out[...] = c0 if beta else np.nan     # beta 0: old values never matter
                    blas.gemm(a, b, out, beta=beta, alpha=0.5)
                    expected = 0.5 * (a0.astype(np.float64) @ b0) + beta * c0
                    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
@pytest.mark.parametrize("shape", [(5, 7, 3), (40, 30, 700), (300, 20, 40)])
def test_gemm_on_onednn_matches_numpy_in_every_layout(shape, monkeypatch, thread_budget,
                                                      gemm_thresholds):
    """Every product runs on oneDNN's matmul (onednn_flops 0) but those it cannot take or runs
    slowly (alpha != 1, a column-major out): transposed and strided views, beta 0 and 1, on both
    threads' own primitives."""
    gemm_thresholds(onednn_flops=0)
    monkeypatch.setattr(blas, "_PRODUCTS", threading.local())
    thread_budget(2)
    m, k, n = shape
    rng = np.random.default_rng(1)
    a0, b0, c0 = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (m, n)))
    built = []
    real = onednn.MatMul
    monkeypatch.setattr(onednn, "MatMul",
                        lambda *args, **kw: built.append(args[-1]) or real(*args, **kw))

    def check(_, worker):
        for a in layouts(a0):
            for b in layouts(b0):
                for out in layouts(c0.copy()):
                    for beta, alpha in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.5)):
                        out[...] = c0 if beta else np.nan
                        blas.gemm(a, b, out, beta=beta, alpha=alpha)
                        expected = alpha * (a0.astype(np.float64) @ b0) + beta * c0
                        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    blas.spread([0, 1], check, 2)
    # Per thread: 18 layouts (a column-major out stays on BLAS) x (beta 0, beta 1); alpha 0.5
    # never reaches oneDNN.
    assert len(built) == 2 * 18 * 2 and built.count(True) == built.count(False)


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
def test_a_weight_gradient_over_a_cleared_diff_runs_on_onednn_s_gemm_kernel(monkeypatch,
                                                                            gemm_thresholds):
    """dy.T @ x written over a cleared diff takes oneDNN's GEMM kernel; the same product added
    into the diff, one from a plain A, and a smaller weight gradient keep oneDNN's first
    choice."""
    gemm_thresholds(onednn_flops=0, gemm_kernel_output=80 * 96)
    monkeypatch.setattr(blas, "_PRODUCTS", threading.local())
    rng = np.random.default_rng(2)
    x, dy = (rng.standard_normal(s).astype(np.float32) for s in ((64, 96), (64, 80)))
    dw, dw_plain = np.full((80, 96), np.nan, np.float32), np.empty((80, 96), np.float32)
    dy_small, dw_small = dy[:, 1:].copy(), np.empty((79, 96), np.float32)
    products = [(dy.T, x, dw, 0.0), (dy.T, x, dw, 1.0), (dy.T.copy(), x, dw_plain, 0.0),
                (dy_small.T, x, dw_small, 0.0)]
    real = onednn.MatMul
    firsts = [real(a, b, out, bool(beta)).kernel for a, b, out, beta in products]
    built, asked = [], []
    monkeypatch.setattr(onednn, "MatMul", lambda *args, **kw: asked.append(kw["kernel"]) or
                        built.append(real(*args, **kw)) or built[-1])
    expected = dy.T.astype(np.float64) @ x
    for (a, b, out, beta), times in zip(products, (1, 2, 1, None)):
        blas.gemm(a, b, out, beta=beta)
        if times:     # the cleared diff's NaNs are overwritten, then the product added
            np.testing.assert_allclose(out, times * expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw_small, expected[1:], rtol=1e-4, atol=1e-4)
    # On every CPU: what gemm asks oneDNN for, and that it gets it (oneDNN's first choice may
    # be its GEMM kernel anyway, as on AVX2 machines).
    assert asked == [onednn.GEMM_KERNEL, None, None, None]
    assert built[0].kernel.startswith(onednn.GEMM_KERNEL)
    assert [m.kernel for m in built[1:]] == firsts[1:]


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
def test_a_matmul_asked_for_a_kernel_onednn_lacks_runs_its_first_choice():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((30, 40)).astype(np.float32), rng.standard_normal((40, 50))
    b = b.astype(np.float32)
    out = np.empty((30, 50), np.float32)
    product = onednn.MatMul(a, b, out, False, kernel="no such kernel")
    assert product.kernel == onednn.MatMul(a, b, out, False).kernel
    np.testing.assert_allclose(product(a, b, out), a.astype(np.float64) @ b, rtol=1e-4,
                               atol=1e-4)


def test_gemm_without_onednn_runs_on_blas(monkeypatch, gemm_thresholds):
    gemm_thresholds(onednn_flops=0)
    monkeypatch.setattr(onednn, "available", lambda: False)
    monkeypatch.setattr(onednn, "MatMul", None)         # never reached
    a, b = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
    out = np.empty((4, 2), np.float32)
    blas.gemm(a, b, out)
    np.testing.assert_array_equal(out, 3)


def test_spread_stops_and_waits_for_every_thread_when_work_fails(thread_budget):
    """A failing item: no thread takes another, and none still runs when spread raises (a lane
    left running would share out work of its own into the pool and hang the next call)."""
    thread_budget(2)
    started, running = [], []

    def work(item, worker):
        started.append(item)
        running.append(item)
        if item == 0:
            raise ValueError("item 0")
        time.sleep(0.05)
        running.remove(item)
    with pytest.raises(ValueError, match="item 0"):
        blas.spread(list(range(8)), work, 2)
    assert running == [0] and len(started) <= 3
    done = []
    blas.spread([1, 2], lambda item, worker: done.append(item), 2)     # the pool still works
    assert sorted(done) == [1, 2]


def test_spread_does_not_wait_for_a_worker_that_never_started(thread_budget):
    """Work the calling thread finished alone returns at once: a worker still busy (or asleep)
    is called off, not waited for."""
    import threading
    thread_budget(2)
    busy = threading.Event()
    blocker = blas._executor(1).submit(busy.wait, 10)    # the pool's one worker, held
    done, finished = [], threading.Event()

    def run():
        blas.spread([1, 2, 3], lambda item, worker: done.append((item, worker)), 2)
        finished.set()
    threading.Thread(target=run, daemon=True).start()
    try:
        assert finished.wait(5)
        assert done == [(1, 0), (2, 0), (3, 0)]
    finally:
        busy.set()
        blocker.result()
    later = []
    blas.spread([1, 2], lambda item, worker: later.append(item), 2)      # the pool still works
    assert sorted(later) == [1, 2]


@pytest.mark.parametrize("size, piece", [(0, 4), (3, 4), (8, 4), (11, 4)])
def test_in_pieces_covers_every_value_once(size, piece, monkeypatch):
    seen = np.zeros(size, int)
    order = []
    monkeypatch.setattr(blas, "spread", lambda items, work: [work(i, 0) for i in items[::-1]])
    blas.in_pieces(lambda p: (seen.__setitem__(p, seen[p] + 1), order.append(p)), size, piece)
    assert (seen == 1).all() and len(order) == max(1, -(-size // piece))


# -- convolution paths ----------------------------------------------------------------------------
def conv_layer(settings, x, **thresholds):
    """A Convolution on the GEMM kernels (engine CAFFE), whose paths these tests pick by its
    thresholds."""
    layer = make_layer('name: "c" type: "Convolution" convolution_param { engine: CAFFE '
                       f'{settings} weight_filler {{ type: "gaussian" std: 0.5 }} '
                       'bias_filler { type: "gaussian" std: 0.5 } }')
    layer.thresholds = replace(THRESHOLDS, **thresholds)
    bottom = blobs_from([x])
    return layer, bottom, run_forward(layer, bottom)


@pytest.mark.parametrize("settings", ["num_output: 6 kernel_size: 3 pad: 1",
                                      "num_output: 3 kernel_size: 3 pad: 1",
                                      "num_output: 6 kernel_size: 5 pad: 2",
                                      "num_output: 5 kernel_size: 2 pad: 2",
                                      "num_output: 4 kernel_size: 3 pad: 2 dilation: 2",
                                      "num_output: 4 kernel_size: 2 stride: 2 group: 2"])
def test_convolution_paths_agree(settings, thread_budget):
    """Batched or per-sample GEMMs, Im2Col, WideIm2Col or RowLowering (forward, and the image
    gradient as a convolution when the feature maps have enough channels), col2im, one chunk or
    several shared out to two threads: the same values, and correct gradients."""
    thread_budget(2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4, 7, 7)).astype(np.float32)
    dy = results = None
    # (per_sample_pixels, WIDE_LIMIT, LOWERING_MIN_CHANNELS, LOWERING_MAX_OUTPUTS, column
    # budget): the first is the plain path. x has 4 channels: at most 5 outputs lower only the
    # image gradient of 6-output layers, at most 3 only the forward of 3-output layers.
    lowered = set()
    for per_sample, wide, channels, outputs, budget in [
            (10**9, 0, 10**9, 128, 1 << 30), (1, 0, 10**9, 128, 1 << 30),
            (10**9, 100, 10**9, 128, 1 << 30), (10**9, 100, 1, 128, 1 << 30),
            (10**9, 100, 1, 5, 1 << 30), (10**9, 100, 1, 3, 1 << 30), (10**9, 100, 1, 128, 1),
            (1, 0, 10**9, 128, 1)]:
        layer, bottom, top = conv_layer(
            settings, x, per_sample_pixels=per_sample, wide_limit=wide,
            lowering_min_channels=channels, lowering_max_outputs=outputs,
            column_budget_bytes=budget)
        lowered.add((layer.plan.forward == "lowered", layer.plan.image_grad == "flipped"))
        if dy is None:
            dy = rng.standard_normal(top[0].shape).astype(np.float32)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        got = [top[0].data, bottom[0].diff, layer.blobs[0].diff, layer.blobs[1].diff]
        if results is None:
            results = [a.copy() for a in got]
        for value, expected in zip(got, results):
            np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
    if "dilation" in settings or "group" in settings:
        assert lowered == {(False, False)}
    elif "pad: 2" in settings and "kernel_size: 2" in settings:     # pad >= kernel: no flip
        assert lowered == {(False, False), (True, False)}
    else:
        assert {(True, True), (True, False) if "num_output: 3" in settings
                else (False, True)} < lowered
    # The last path: per-sample GEMMs, one sample per chunk, chunks on two threads.
    assert layer.plan.chunk == 1 and layer.plan.per_sample
    assert check_gradient(layer, blobs_from([x[:3]]), max_points=30) > 0


@pytest.mark.parametrize("flipped_limit", [100, 0])
def test_row_lowering_gradient_with_two_bottoms_and_chunks(flipped_limit, thread_budget):
    """The image gradient by the flipped lowering, or (limit 0) by unlowering."""
    thread_budget(2)
    layer = make_layer('name: "c" type: "Convolution" convolution_param { engine: CAFFE '
                       'num_output: 3 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 1 '
                       'weight_filler { type: "gaussian" std: 0.5 } '
                       'bias_filler { type: "gaussian" std: 0.5 } }')
    layer.thresholds = replace(THRESHOLDS, flipped_limit=flipped_limit, lowering_min_channels=1,
                               lowered_min_columns=1)
    rng = np.random.default_rng(2)
    bottom = blobs_from([rng.standard_normal((3, 2, 5, 4)).astype(np.float32),
                         rng.standard_normal((3, 2, 5, 4)).astype(np.float32)])
    run_forward(layer, bottom, n_top=2)
    assert layer.plan.forward == layer.plan.weight_grad == "lowered" and layer.plan.chunk == 1
    assert layer.plan.image_grad == ("flipped" if flipped_limit else "unlowered")
    assert check_gradient(layer, bottom, n_top=2, max_points=40) > 0


def test_weight_gradient_does_not_depend_on_which_thread_takes_which_chunk(monkeypatch,
                                                                          thread_budget):
    """Chunks shared out to threads add into per-group matrices: with the work run in another
    order and by other workers, the weight gradient must be the same to the bit (reruns are
    bit-identical whatever the timing)."""
    thread_budget(2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 16, 6, 6)).astype(np.float32)
    settings = "num_output: 8 kernel_size: 3 pad: 1"
    grads = []
    for order in (None, "shuffled"):
        def spread(items, work, share=None, order=order):
            indices = list(range(len(items)))
            if order:
                np.random.default_rng(len(items)).shuffle(indices)
            for step, i in enumerate(indices):
                work(items[i], (step + (order is not None)) % 2)
        monkeypatch.setattr(blas, "spread", spread)
        for channels in (1, 10**9):                    # lowered rows, and im2col
            layer, bottom, top = conv_layer(settings, x, per_sample_pixels=10**9,
                                            column_budget_bytes=1,
                                            lowering_min_channels=channels)
            top[0].diff[...] = rng.standard_normal(top[0].shape).astype(np.float32) \
                if not grads else grads[0][1]
            layer.backward(top, [False], bottom)
            grads.append((layer.blobs[0].diff.copy(), top[0].diff.copy()))
    assert layer.plan.chunk == 1
    for (first, _), (again, _) in zip(grads[:2], grads[2:]):
        np.testing.assert_array_equal(again, first)


# -- fillers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ['type: "gaussian" std: 0.3 sparse: 2', 'type: "msra"',
                                  'type: "xavier" variance_norm: AVERAGE'])
def test_chunked_fillers_draw_what_one_draw_gives(text, monkeypatch):
    filler = text_format.Parse(text, pb.FillerParameter())
    whole = np.empty((6, 5, 3), np.float32)
    fillers.fill(whole, filler, np.random.default_rng(4))
    monkeypatch.setattr(fillers, "CHUNK", 7)
    chunked = np.empty((6, 5, 3), np.float32)
    fillers.fill(chunked, filler, np.random.default_rng(4))
    np.testing.assert_array_equal(chunked, whole)


# -- pooling paths --------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", ["pool: MAX kernel_size: 3 stride: 2",
                                      "pool: MAX kernel_size: 2 stride: 2",
                                      "pool: MAX kernel_size: 3 stride: 2 pad: 1",
                                      "pool: AVE kernel_size: 3 stride: 2 pad: 1",
                                      "pool: AVE kernel_size: 2 stride: 2"])
def test_pooling_over_threads_matches_one_thread(settings, thread_budget):
    """The batch split into parts of one image plane for two threads: the values, mask and
    gradients of the whole batch at once."""
    x = np.random.default_rng(5).permutation(5 * 3 * 8 * 8).reshape(5, 3, 8, 8).astype(np.float32)
    results = []
    for values in (1 << 60, 0):
        thread_budget(2)
        layer = make_layer(f'name: "p" type: "Pooling" '
                           f'pooling_param {{ {settings} engine: CAFFE }}')
        layer.thresholds = replace(THRESHOLDS, pooling_part_values=values)
        bottom = blobs_from([x])
        top = run_forward(layer, bottom, n_top=2 if "MAX" in settings else 1)
        assert (layer.plan.part == 1) == (values == 0) and layer.plan.threads == 2
        top[0].diff[...] = np.arange(top[0].count, dtype=np.float32).reshape(top[0].shape)
        layer.backward(top, [True], bottom)
        results.append([t.data.copy() for t in top] + [bottom[0].diff.copy()])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_tiled_pooling_gradient(method):
    layer = make_layer(f'name: "p" type: "Pooling" pooling_param {{ pool: {method} '
                       'kernel_size: 2 stride: 2 }')
    x = np.random.default_rng(6).permutation(2 * 2 * 6 * 4).reshape(2, 2, 6, 4)
    bottom = blobs_from([(x * 0.1).astype(np.float32)])
    run_forward(layer, bottom)
    # The planes are the windows (no junk columns): backward writes each gradient once.
    assert (layer._rows.length, layer._cols.length) == layer._pooled
    assert check_gradient(layer, bottom) > 0


# -- the thread budget ----------------------------------------------------------------------------
def test_shared_out_work_runs_its_kernels_on_one_thread(thread_budget):
    """Work that spread() shares out over the budget must not share itself out again."""
    thread_budget(2)
    seen = []
    blas.spread([1, 2, 3], lambda item, worker: seen.append(threads.budget()))
    assert seen == [1, 1, 1] and threads.budget() == 2


def test_shared_out_is_each_thread_s_own(thread_budget):
    """One thread in shared-out work leaves another's budget whole, and threads entering and
    leaving spread() at once leave the budget and OpenBLAS's setting as they found them."""
    thread_budget(2)
    inside, outside = threading.Event(), []

    def hold(item, worker):
        if worker == 0:
            inside.set()
            time.sleep(0.05)

    def watch():
        inside.wait(5)
        outside.append(threads.budget())
    watcher = threading.Thread(target=watch)
    watcher.start()
    blas.spread([1, 2], hold)
    watcher.join()
    assert outside == [2]
    openblas = blas.openblas_threads()

    def busy():
        for _ in range(200):
            blas.spread([1, 2, 3], lambda item, worker: threads.budget())
    runners = [threading.Thread(target=busy) for _ in range(3)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    assert threads.budget() == 2 and blas.openblas_threads() == openblas


ONEDNN_ON_ANOTHER_THREAD = """
import threading, sys
import numpy as np
from syncsgd.kernels import onednn
rng = np.random.default_rng(0)
# (images, channels out, kernel, pad, stride, dilation, group): grouped, depthwise, strided,
# dilated, 1x1 and few-channel convolutions, whichever kernels oneDNN picks for them here.
shapes = [((2, 4, 9, 9), 6, 3, 1, 2, 1, 2), ((5, 2, 3, 4), 11, 2, 3, 1, 1, 1),
          ((3, 8, 7, 7), 8, 3, 1, 1, 1, 8), ((2, 16, 10, 10), 24, 3, 2, 1, 2, 1),
          ((4, 3, 12, 12), 5, 1, 0, 1, 1, 1), ((2, 20, 6, 6), 36, 3, 0, 1, 1, 4)]
for images, outputs, k, pad, stride, dilation, group in shapes:
    out = [(s + 2 * pad - dilation * (k - 1) - 1) // stride + 1 for s in images[2:]]
    maps = (images[0], outputs, *out)
    x = rng.random(images, np.float32)
    w = rng.random((outputs, images[1] // group, k, k), np.float32)
    b = rng.random(outputs, np.float32)
    dy = rng.random(maps, np.float32)
    runs = []
    for where in ("builder", "other"):
        conv = onednn.Convolution(images, maps, (k, k), (pad, pad), (stride, stride),
                                  (dilation, dilation), group, True)
        y, dx = np.zeros(maps, np.float32), np.zeros(images, np.float32)
        dw, db = np.zeros_like(w), np.zeros_like(b)

        def run():
            conv.forward(x, w, b, y)
            conv.backward(x, dy, w, dx, (dw, 0.0), (db, 0.0))
        if where == "builder":
            run()
        else:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        runs.append((y, dx, dw, db))
        print(where, images, conv.implementation, flush=True)
    for a, b_ in zip(*runs):
        assert np.array_equal(a, b_), (images, "differs on another thread")
    pool = onednn.Pooling(maps, (maps[0], maps[1], maps[2] // 2 + maps[2] % 2,
                                 maps[3] // 2 + maps[3] % 2), (2, 2), (0, 0), (2, 2), False)
    pooled = np.zeros(pool.maps.shape, np.float32)
    thread = threading.Thread(target=pool.forward, args=(y, pooled))
    thread.start()
    thread.join()
print("ok")
"""


def test_a_primitive_run_by_two_threads_at_once_is_an_error():
    """Its memory objects are pointed at one caller's arrays: a second caller is refused."""
    if not onednn.available():
        pytest.skip("oneDNN did not load")
    pool = onednn.Pooling((1, 8, 4, 4), (1, 8, 2, 2), (2, 2), (0, 0), (2, 2), False)
    images, maps = np.ones((1, 8, 4, 4), np.float32), np.zeros((1, 8, 2, 2), np.float32)
    with pool._turn:                  # another thread is inside
        with pytest.raises(SyncSGDError, match="two threads at once"):
            pool.forward(images, maps)
    pool.forward(images, maps)
    assert (maps == 1).all()


def test_with_checks_a_held_call_over_its_budget_is_an_error(monkeypatch):
    """SYNCSGD_CHECKS=1 times the library calls that keep the interpreter lock (oneDNN's small
    primitives, small sgemms): one over threads.HELD_CALL_SECONDS of CPU time is an error."""
    calls = []
    timed = threads.timed_held(lambda *args: calls.append(args) or 5, "a test call")
    assert timed(1, 2) == 5 and calls == [(1, 2)]
    monkeypatch.setattr(threads, "HELD_CALL_SECONDS", 0.0)
    with pytest.raises(SyncSGDError, match="a test call kept the interpreter lock"):
        timed(sum(range(10000)))
    if not onednn.available():
        return
    monkeypatch.setenv("SYNCSGD_CHECKS", "1")
    lib = onednn._Library()
    assert lib.held_execute.__name__ == "timed"
    monkeypatch.setattr(onednn, "_LIBRARY", lib)
    form = onednn.Form((1, 8, 4, 4), lib.desc((1, 8, 4, 4), lib.channel_blocks()))
    with pytest.raises(SyncSGDError, match="a oneDNN primitive kept the interpreter lock"):
        form.to_plain(np.empty((1, 8, 4, 4), np.float32))


@pytest.mark.parametrize("isa", ["default", "AVX2", "SSE41"])
def test_onednn_primitives_run_on_a_thread_other_than_their_builder(isa, tmp_path):
    """Lanes build their layers' primitives on the calling thread and run them on others. With
    oneDNN's library scratchpad, kept in the builder thread's thread_local, a GEMM-based
    convolution run elsewhere found no buffer and crashed (SIGSEGV; Note [scratchpads] in
    kernels/onednn.py). Run in a child process, under several instruction sets, so that a crash
    fails this test with its stack instead of ending the suite."""
    if not onednn.available():
        pytest.skip("oneDNN did not load")
    env = dict(os.environ)
    if isa != "default":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    script = tmp_path / "another_thread.py"
    script.write_text(ONEDNN_ON_ANOTHER_THREAD)
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), (
        f"exit status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


WAIT_POLICY = """
from syncsgd.kernels import onednn
onednn.library().omp.omp_display_env(1)
"""


@pytest.mark.parametrize("environment, spins", [
    ({}, str(onednn.SPIN_COUNT)),
    ({"GOMP_SPINCOUNT": "123"}, "123"),
    ({"OMP_WAIT_POLICY": "passive"}, "0"),
    ({"OMP_WAIT_POLICY": "active"}, "30000000000"),
])
def test_openmp_workers_spin_briefly_unless_the_environment_says(environment, spins):
    """The spin count libgomp took, as it reports it (omp_display_env): SPIN_COUNT, or what the
    user's variables ask for."""
    if not onednn.available() or onednn.library().omp is None:
        pytest.skip("oneDNN on libgomp did not load")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", WAIT_POLICY], env=dict(env, **environment),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"GOMP_SPINCOUNT = '{spins}'" in done.stderr, done.stderr[-3000:]


def test_set_budget_sizes_blas_and_numexpr(monkeypatch):
    import numexpr
    from threadpoolctl import threadpool_limits
    monkeypatch.setattr(threads.BUDGET, "count", threads.BUDGET.count)
    blas_before, numexpr_before = blas.openblas_threads(), numexpr.get_num_threads()
    try:
        assert threads.set_budget(1) == 1 and threads.budget() == 1
        assert numexpr.get_num_threads() == 1 and blas.openblas_threads() == 1
    finally:
        threadpool_limits(blas_before)
        numexpr.set_num_threads(numexpr_before)


# -- plans ----------------------------------------------------------------------------------------
def conv_geometry(**changes):
    """CIFAR-10 quick's conv2: 100 x 32 x 16 x 16, 5x5 "same", 32 outputs."""
    geometry = ConvolutionGeometry(100, 32, 32, (16, 16), (16, 16), (5, 5), (2, 2), (1, 1),
                                   (1, 1), 1)
    return replace(geometry, **changes)


def test_convolution_plan_engines():
    """CAFFE and Deconvolution keep to GEMMs; DEFAULT runs on oneDNN only where it loaded."""
    gemm = plan_convolution(conv_geometry(), 2, "CAFFE", True)
    assert (gemm.forward, gemm.weight_grad, gemm.image_grad) == ("lowered", "lowered", "flipped")
    assert plan_convolution(conv_geometry(), 2, "DEFAULT", False) == gemm
    assert plan_convolution(conv_geometry(reverse=True), 2, "DEFAULT", True).forward == "columns"
    dnn = plan_convolution(conv_geometry(), 2, "DEFAULT", True)
    assert (dnn.forward, dnn.weight_grad, dnn.image_grad) == ("onednn",) * 3
    # Unpadded stride-1 batched layers too, on one thread (a lane, a rank) or two.
    for count in (1, 2):
        unpadded = plan_convolution(conv_geometry(pad=(0, 0), image_size=(20, 20)), count,
                                    "DEFAULT", True)
        assert (unpadded.forward, unpadded.weight_grad, unpadded.image_grad) == ("onednn",) * 3
    assert plan_convolution(conv_geometry(pad=(0, 0), image_size=(20, 20)), 2, "CAFFE",
                            True).weight_grad == "lowered"


def test_convolution_plan_follows_its_thresholds():
    per_sample = plan_convolution(conv_geometry(), 1, "CAFFE", False,
                                  replace(THRESHOLDS, per_sample_pixels=256))
    assert per_sample.per_sample and per_sample.forward == "columns"
    assert per_sample.columns == "im2col" and per_sample.image_grad == "columns"
    one = plan_convolution(conv_geometry(), 1, "CAFFE", False,
                           replace(THRESHOLDS, column_budget_bytes=1, lowered_min_columns=1))
    assert one.chunk == 1 and not one.keep_columns
    # Two threads: equal chunks, as many per thread.
    two = plan_convolution(conv_geometry(num=9, image_channels=3), 2, "CAFFE", False)
    assert two.forward == "columns" and two.columns == "wide" and 9 / two.chunk <= 4


def test_pooling_plan():
    def plan(engine="DEFAULT", available=True, **changes):
        geometry = PoolingGeometry((2, 3, 9, 8), (2, 3, 4, 4), (3, 3), (0, 0), (2, 2), False, 1)
        return plan_pooling(replace(geometry, **changes), 2, engine, available)
    assert plan().forward == "onednn" and plan().fallback
    assert not plan(average=True).fallback
    assert plan(engine="CAFFE").forward == plan(available=False).forward == "numpy"
    assert plan(tops=2).forward == plan(average=True, pad=(1, 1)).forward == "numpy"
    whole = plan(maps=(2, 3, 1, 1), kernel=(9, 8), stride=(1, 1))
    assert whole.whole_image and whole.forward == "numpy"
    assert plan().part == THRESHOLDS.pooling_part_values // 72


def test_gemm_plan():
    """Which kernel runs a product, from its size, factors, layouts and the budget."""
    def plan(m=64, k=500, n=500, alpha=1.0, beta=0.0, layouts=("N", "N", "N"), threads=2,
             blas=True, available=True):
        return plans.plan_gemm(m, k, n, alpha, beta, layouts, threads, blas, available)
    t = THRESHOLDS
    assert plan() == plans.GemmPlan("onednn")            # 32 Mflop
    assert plan(layouts=None).kernel == plan(blas=False, available=False).kernel == "numpy"
    for other in (plan(alpha=0.5), plan(beta=0.5), plan(layouts=("N", "N", "T")),
                  plan(available=False)):
        assert other == plans.GemmPlan("blas", split="columns", threads=2)
    assert plan(blas=False, alpha=0.5).kernel == "numpy"
    assert plan(m=2048, n=2048, layouts=("T", "N", "N")).onednn_kernel == onednn.GEMM_KERNEL
    assert plan(m=2048, n=2048, layouts=("T", "N", "N"), beta=1.0).onednn_kernel is None
    wide = 2 * t.pieces_per_thread * 4 * plans.ALIGN
    assert plan(available=False, m=wide, n=wide - 1).split == "rows"
    assert plan(available=False, m=wide - 1, n=wide - 1, k=20000).split == "sum"
    assert plan(available=False, threads=1) == plans.GemmPlan("blas")
    small = plan(m=10, k=10, n=10)
    assert small == plans.GemmPlan("blas", held=True) and 2e3 < t.held_flops


def test_update_plan():
    t = THRESHOLDS
    big, small = t.update_spread_min, t.update_spread_min - 1
    assert plans.plan_update(big, 2, True, True) == plans.UpdatePlan("level1",
                                                                     2 * t.update_block, True)
    assert plans.plan_update(small, 2, True, True) == plans.UpdatePlan("level1",
                                                                       t.update_block, False)
    assert plans.plan_update(big, 1, False, True) == plans.UpdatePlan("ufuncs", t.update_block,
                                                                      False)
    assert plans.plan_update(big, 2, True, False).kernel == "ufuncs"


def test_choose_plans_again_without_onednn_where_it_lacks_the_shape(monkeypatch):
    """A plan whose oneDNN kernels cannot be built becomes the plan made without oneDNN."""
    monkeypatch.setattr(onednn, "available", lambda: True)
    geometry = PoolingGeometry((2, 3, 9, 8), (2, 3, 4, 4), (3, 3), (0, 0), (2, 2), False, 1)

    def build(plan):
        if plan.forward == "onednn":
            raise onednn.Unavailable("no such shape (test)")
        return "numpy kernel"
    plan, kernel = plans.choose(plan_pooling, build, geometry, 2, "DEFAULT")
    assert plan == plan_pooling(geometry, 2, "DEFAULT", False) and kernel == "numpy kernel"
    plan, kernel = plans.choose(plan_pooling, lambda plan: plan.forward, geometry, 2, "DEFAULT")
    assert plan.forward == kernel == "onednn"


# -- SYNCSGD_REQUIRE_ONEDNN -----------------------------------------------------------------------
def test_required_onednn_that_does_not_load_is_an_error(monkeypatch):
    def fail(*args):
        raise onednn.Unavailable("libdnnl.so.3 not loadable (test)")
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setattr(onednn._Library, "_load", staticmethod(fail))
    monkeypatch.delenv("SYNCSGD_REQUIRE_ONEDNN", raising=False)
    assert not onednn.available()        # not required: the layers fall back to GEMMs
    monkeypatch.setenv("SYNCSGD_REQUIRE_ONEDNN", "1")
    with pytest.raises(onednn.Required, match="SYNCSGD_REQUIRE_ONEDNN=1.*not loadable"):
        onednn.available()
    layer = make_layer('name: "c" type: "Convolution" convolution_param { num_output: 2 '
                       'kernel_size: 3 }')
    with pytest.raises(onednn.Required):
        run_forward(layer, blobs_from([np.zeros((1, 2, 5, 5), np.float32)]))


@pytest.mark.parametrize("size", [10, 3 << 20])
def test_all_finite_finds_every_non_finite_value_and_no_other(size, thread_budget):
    """all_finite (the solver's gradient check): false for a NaN or an infinity anywhere, in
    any piece, true for finite values whose squares overflow float32."""
    from syncsgd.kernels.blas import all_finite
    thread_budget(2)
    values = np.ones(size, np.float32)
    assert all_finite(values)
    values[size // 2] = 1e30             # its square overflows: still finite
    assert all_finite(values.reshape(-1, 2))
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, size // 3, size - 1):
            broken = values.copy()
            broken[where] = bad
            assert not all_finite(broken)
