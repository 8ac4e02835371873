"""Convolution, Deconvolution and Pooling against direct loop references and numeric gradients."""
import gc
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from syncsgd.blob import Blob
from syncsgd.errors import ShapeError, SyncSGDError
from syncsgd.kernels import onednn
from syncsgd.kernels.plans import THRESHOLDS, ConvolutionGeometry, plan_convolution
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward

FILLERS = ('weight_filler { type: "gaussian" std: 0.5 } '
           'bias_filler { type: "gaussian" std: 0.5 }')


def conv_text(settings, kind="Convolution"):
    return (f'name: "c" type: "{kind}" '
            f'convolution_param {{ {settings} {FILLERS} }}')


# How a Convolution runs: engine CAFFE (GEMMs only), DEFAULT (oneDNN where available, with its
# choice of GEMM or oneDNN backward), and DEFAULT with per-sample maps (oneDNN's backward for
# unpadded stride-1 layers too).
ENGINES = ("CAFFE", "DEFAULT", "DEFAULT_PER_SAMPLE")


def engine_layer(settings, engine):
    layer = make_layer(conv_text(f"{settings} engine: {engine.split('_')[0]}"))
    if engine == "DEFAULT_PER_SAMPLE":
        layer.thresholds = replace(THRESHOLDS, per_sample_pixels=1)
    return layer


def assert_engine(layer, engine):
    """The layer ran where `engine` says it must (oneDNN for DEFAULT when the library loads)."""
    assert (layer.plan.forward == "onednn") == (engine != "CAFFE" and onednn.available())


def without_onednn(monkeypatch):
    """The rest of the test runs as where oneDNN does not load (and is not required)."""
    monkeypatch.setattr(onednn, "_LIBRARY", onednn.Unavailable("library missing"))
    monkeypatch.delenv("SYNCSGD_REQUIRE_ONEDNN", raising=False)


def ran_on_onednn(layer):
    """Whether a Pooling layer's last forward pass ran on oneDNN (planned, and no fallback)."""
    return layer.plan.forward == "onednn" and not layer.pool_kernel.ran_numpy


def pool_text(settings, engine="DEFAULT"):
    return f'name: "p" type: "Pooling" pooling_param {{ {settings} engine: {engine} }}'


# How a Pooling layer runs: CAFFE on numpy, DEFAULT on oneDNN where it is available and computes
# Caffe's result (one top; AVE without padding).
POOL_ENGINES = ("CAFFE", "DEFAULT")


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def distinct(*shape, seed=0):
    """Values 0.1 apart in random order: no ties, and a 1e-2 step never reorders them."""
    count = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(count).reshape(shape) * 0.1
            - count * 0.05).astype(np.float32)


# -- references (float64, written for clarity, not speed) -----------------------------------------
def conv_reference(x, w, b, pad, stride, dilation, group):
    """Direct convolution: every output pixel is a dot product over its window."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dilation
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    y = np.zeros((n, m, oh, ow))
    for o in range(m):
        g = o // (m // group)
        for yy in range(oh):
            for xx in range(ow):
                for i in range(kh):
                    for j in range(kw):
                        pixel = xp[:, g * cg:(g + 1) * cg, yy * sh + i * dh, xx * sw + j * dw]
                        y[:, o, yy, xx] += pixel @ w[o, :, i, j]
        if b is not None:
            y[:, o] += b[o]
    return y


def deconv_reference(x, w, b, pad, stride, dilation, group):
    """Direct transposed convolution: every input pixel scatters its kernel into the output."""
    n, c, h, wd = x.shape
    _, mg, kh, kw = w.shape
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dilation
    oh = sh * (h - 1) + dh * (kh - 1) + 1 - 2 * ph
    ow = sw * (wd - 1) + dw * (kw - 1) + 1 - 2 * pw
    full = np.zeros((n, mg * group, oh + 2 * ph + sh * dh * kh, ow + 2 * pw + sw * dw * kw))
    cg = c // group
    for ci in range(c):
        g = ci // cg
        for yy in range(h):
            for xx in range(wd):
                for i in range(kh):
                    for j in range(kw):
                        full[:, g * mg:(g + 1) * mg, yy * sh + i * dh, xx * sw + j * dw] += (
                            x[:, ci, yy, xx, None].astype(np.float64) * w[ci, :, i, j])
    y = full[:, :, ph:ph + oh, pw:pw + ow]
    if b is not None:
        y = y + b[None, :, None, None]
    return y


def pool_reference(x, method, kernel, pad, stride, ceil_mode=True):
    """Caffe's pooling loop, one output pixel at a time (vectorised over N and C only)."""
    n, c, h, w = x.shape
    (kh, kw), (ph, pw), (sh, sw) = kernel, pad, stride
    rnd = math.ceil if ceil_mode else math.floor
    oh = int(rnd((h + 2 * ph - kh) / sh)) + 1
    ow = int(rnd((w + 2 * pw - kw) / sw)) + 1
    if ph or pw:
        if (oh - 1) * sh >= h + ph:
            oh -= 1
        if (ow - 1) * sw >= w + pw:
            ow -= 1
    top = np.zeros((n, c, oh, ow), np.float32)
    mask = np.full((n, c, oh, ow), -1.0, np.float32)
    for py in range(oh):
        for px in range(ow):
            y0, x0 = py * sh - ph, px * sw - pw
            if method == "MAX":
                y1, x1 = min(y0 + kh, h), min(x0 + kw, w)
                best = np.full((n, c), -np.finfo(np.float32).max, np.float32)
                where = np.full((n, c), -1.0)
                for yy in range(max(y0, 0), y1):
                    for xx in range(max(x0, 0), x1):
                        better = x[:, :, yy, xx] > best
                        best[better] = x[:, :, yy, xx][better]
                        where[better] = yy * w + xx
                top[:, :, py, px], mask[:, :, py, px] = best, where
            else:
                y1, x1 = min(y0 + kh, h + ph), min(x0 + kw, w + pw)
                size = (y1 - y0) * (x1 - x0)
                window = x[:, :, max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]
                top[:, :, py, px] = window.astype(np.float64).sum(axis=(2, 3)) / size
    return top, mask


# -- Convolution ----------------------------------------------------------------------------------
# (prototxt settings, bottom shape, pad, stride, dilation, group, bias)
CONV_CASES = {
    "plain": ("num_output: 4 kernel_size: 3", (2, 3, 6, 5), (0, 0), (1, 1), (1, 1), 1, True),
    "strided": ("num_output: 3 kernel_size: 3 stride: 2", (2, 2, 7, 8), (0, 0), (2, 2),
                (1, 1), 1, True),
    "padded": ("num_output: 3 kernel_size: 3 pad: 1", (2, 2, 5, 4), (1, 1), (1, 1), (1, 1), 1,
               True),
    "grouped": ("num_output: 4 kernel_size: 2 group: 2 pad: 1 stride: 2", (2, 4, 5, 5), (1, 1),
                (2, 2), (1, 1), 2, True),
    "dilated": ("num_output: 2 kernel_size: 3 dilation: 2 pad: 2", (2, 2, 7, 6), (2, 2),
                (1, 1), (2, 2), 1, True),
    "rectangular": ("num_output: 3 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0 stride_h: 2 "
                    "stride_w: 1", (2, 2, 6, 5), (1, 0), (2, 1), (1, 1), 1, True),
    "per_axis": ("num_output: 2 kernel_size: 2 kernel_size: 3 pad: 0 pad: 1 stride: 1 stride: 2 "
                 "dilation: 2 dilation: 1", (1, 3, 6, 7), (0, 1), (1, 2), (2, 1), 1, True),
    "pad_h_alone": ("num_output: 2 kernel_size: 3 pad_h: 1", (2, 2, 4, 5), (1, 0), (1, 1),
                    (1, 1), 1, True),
    "no_bias": ("num_output: 3 kernel_size: 2 bias_term: false", (2, 2, 4, 4), (0, 0), (1, 1),
                (1, 1), 1, False),
    "one_by_one": ("num_output: 5 kernel_size: 1", (3, 4, 3, 2), (0, 0), (1, 1), (1, 1), 1,
                   True),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_convolution_forward_matches_direct_loops(case, engine):
    settings, shape, pad, stride, dilation, group, bias = CONV_CASES[case]
    layer = engine_layer(settings, engine)
    x = randn(*shape)
    top = run_forward(layer, blobs_from([x]))
    assert_engine(layer, engine)
    w = layer.blobs[0].data
    assert w.shape[1] == shape[1] // group
    b = layer.blobs[1].data if bias else None
    assert len(layer.blobs) == (2 if bias else 1)
    expected = conv_reference(x, w, b, pad, stride, dilation, group)
    assert top[0].shape == expected.shape
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CONV_CASES)
def test_convolution_gradient(case, engine):
    settings, shape = CONV_CASES[case][:2]
    layer = engine_layer(settings, engine)
    assert check_gradient(layer, blobs_from([randn(*shape)]), max_points=60) > 0
    assert_engine(layer, engine)


@pytest.mark.parametrize("mode", ["DEFAULT", "DEFAULT_PER_SAMPLE"])
@pytest.mark.parametrize("settings, shape", [
    ("num_output: 16 kernel_size: 5 pad: 2", (6, 8, 9, 9)),               # all on oneDNN
    ("num_output: 6 kernel_size: 3 stride: 2 group: 2 pad: 1", (5, 4, 9, 8)),
    ("num_output: 5 kernel_size: 3", (4, 3, 8, 8)),                       # unpadded
    ("num_output: 50 kernel_size: 5", (4, 20, 12, 12)),                   # channels last
])
def test_onednn_matches_gemm_kernels_and_accumulates(settings, shape, mode):
    """Both engines give the same outputs and gradients, and both add parameter gradients into
    what the diffs held (Caffe's accumulation, for iter_size and shared weights)."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    x = randn(*shape)
    results = []
    for engine in ("CAFFE", mode):
        layer = engine_layer(settings, engine)
        bottom = blobs_from([x])
        top = run_forward(layer, bottom)
        top[0].diff[...] = randn(*top[0].shape, seed=1)
        for blob in layer.blobs:
            blob.diff[...] = 0.5
        layer.backward(top, [True], bottom)
        if engine != "CAFFE":
            assert layer.plan.weight_grad == layer.plan.image_grad == "onednn"
        results.append([top[0].data.copy(), bottom[0].diff.copy()]
                       + [blob.diff.copy() for blob in layer.blobs])
    assert not np.array_equal(results[0][0], 0)
    for gemm, dnn in zip(*results):
        np.testing.assert_allclose(dnn, gemm, rtol=1e-4, atol=1e-4)


def test_onednn_reruns_are_bit_identical():
    """Exact resume and N-rank equality need the same gradients from the same inputs."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    layer = engine_layer("num_output: 32 kernel_size: 5 pad: 2", "DEFAULT")
    bottom = blobs_from([randn(20, 16, 12, 12)])
    top = run_forward(layer, bottom)
    top[0].diff[...] = randn(*top[0].shape, seed=1)
    runs = []
    for _ in range(3):
        layer.forward(bottom, top)
        layer.blobs[0].diff[...] = 0
        layer.blobs[1].diff[...] = 0
        layer.backward(top, [True], bottom)
        runs.append([top[0].data.copy(), bottom[0].diff.copy(), layer.blobs[0].diff.copy(),
                     layer.blobs[1].diff.copy()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


def test_onednn_runs_on_the_process_share_of_the_cores(thread_budget):
    """A rank that shares the machine with others sizes oneDNN's OpenMP team to its share."""
    if not onednn.available() or onednn.library().omp is None:
        pytest.skip("oneDNN or its OpenMP runtime not loadable here")
    omp = onednn.library().omp

    layer = engine_layer("num_output: 3 kernel_size: 3 pad: 1", "DEFAULT")
    bottom = blobs_from([randn(2, 2, 5, 4)])
    built = []

    def teams(share):
        """The team size after a forward pass on this thread with `share` cores."""
        thread_budget(share)
        top = run_forward(layer, bottom) if not built else [Blob()]
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        built.append(layer.plan)
        return omp.omp_get_max_threads()
    try:
        assert [teams(2), teams(1)] == [2, 1]
        assert [plan.threads for plan in built] == [2, 1]      # planned for the new team
        # The setting holds per calling thread: another one (whose default team is all the
        # cores) must set its own, though the share is the one this thread set last.
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(teams, 1).result() == 1
    finally:
        thread_budget(None)
        onednn.library().set_threads()


def test_onednn_primitives_are_freed_with_their_layer_shape(monkeypatch):
    """A layer reshaped to new batch sizes builds new primitives; the old ones must be freed."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    lib = onednn.library()
    gc.collect()          # earlier tests' garbage is not counted as this layer's
    freed = []
    monkeypatch.setattr(lib, "destroy", lambda handles: freed.extend(k for k, _ in handles))
    layer = engine_layer("num_output: 3 kernel_size: 3 pad: 1", "DEFAULT")
    for num in (2, 3):
        run_forward(layer, blobs_from([randn(num, 2, 5, 4)]))
    assert not lib.created
    assert {"primitive", "primitive_desc", "memory", "memory_desc", "primitive_attr",
            "post_ops"} <= set(freed)
    count = len(freed)
    del layer
    gc.collect()
    assert len(freed) == 2 * count


def test_onednn_failing_while_it_runs_ends_with_a_clear_error(monkeypatch):
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    layer = engine_layer("num_output: 3 kernel_size: 3 pad: 1", "DEFAULT")
    bottom = blobs_from([randn(2, 2, 5, 4)])
    top = run_forward(layer, bottom)
    monkeypatch.setattr(onednn.library().lib, "dnnl_primitive_execute", lambda *args: 3)
    with pytest.raises(SyncSGDError, match="oneDNN failed running a primitive"):
        layer.forward(bottom, top)


def test_unavailable_onednn_falls_back_to_gemms(monkeypatch):
    without_onednn(monkeypatch)
    layer = engine_layer("num_output: 3 kernel_size: 3 pad: 1", "DEFAULT")
    x = randn(2, 2, 5, 4)
    top = run_forward(layer, blobs_from([x]))
    assert layer.plan.forward == "columns" and not onednn.available()
    w, b = layer.blobs[0].data, layer.blobs[1].data
    np.testing.assert_allclose(top[0].data, conv_reference(x, w, b, (1, 1), (1, 1), (1, 1), 1),
                               rtol=1e-5, atol=1e-5)


def test_pooling_on_onednn_is_freed_repeatable_and_falls_back():
    """Pooling's primitives are freed with their shape, reruns are bit-identical, and a forward
    pass the numpy kernels ran (NaN in the output; a shape oneDNN does not take) is the one
    backward follows."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    lib = onednn.library()
    layer = make_layer(pool_text("pool: MAX kernel_size: 2 stride: 3"))
    bottom = blobs_from([distinct(2, 3, 8, 8)])
    top = run_forward(layer, bottom)
    top[0].diff[...] = randn(*top[0].shape)
    runs = []
    for _ in range(2):
        layer.forward(bottom, top)
        layer.backward(top, [True], bottom)
        runs.append((top[0].data.copy(), bottom[0].diff.copy()))
    assert ran_on_onednn(layer)
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    handles = layer.pool_kernel.primitives._handles
    freed = []
    original = lib.destroy
    lib.destroy = lambda hs: (freed.extend(hs), original(hs))
    try:
        check_pooling_against_caffe("MAX", "2x2_s3", distinct(2, 3, 9, 9), layer, "DEFAULT")
    finally:
        lib.destroy = original
    assert layer.plan.forward == "numpy"     # a window starts past the image
    assert handles and freed == handles
    x = distinct(2, 3, 8, 8)
    x[1, 2, :2, :2] = np.nan
    with np.errstate(invalid="ignore"):
        check_pooling_against_caffe("MAX", "2x2_s3", x, layer, "DEFAULT")
    assert layer.plan.forward == "onednn" and not ran_on_onednn(layer)      # fell back


def test_unavailable_onednn_leaves_pooling_on_numpy(monkeypatch):
    without_onednn(monkeypatch)
    layer = make_layer(pool_text("pool: MAX kernel_size: 3 stride: 2"))
    check_pooling_against_caffe("MAX", "3x3_s2", distinct(2, 3, 9, 8), layer, "DEFAULT")
    assert layer.plan.forward == "numpy"


def test_convolution_chunked_batch_matches_whole_batch(thread_budget):
    """A column budget below one batch splits it into chunks; results must not change."""
    thread_budget(1)    # else chunks for 2 threads
    settings = "num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2 engine: CAFFE"
    x, dy = randn(5, 4, 7, 7), randn(5, 4, 4, 4, seed=1)
    results = []
    for budget in (None, 1):
        layer = make_layer(conv_text(settings))
        if budget is not None:
            layer.thresholds = replace(THRESHOLDS, column_budget_bytes=budget)   # 1 sample
        bottom = blobs_from([x])
        top = run_forward(layer, bottom)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy(), layer.blobs[0].diff.copy(),
                        layer.blobs[1].diff.copy()])
        assert layer.plan.chunk == (5 if budget is None else 1)
    for whole, chunked in zip(*results):
        np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    layer = make_layer(conv_text(settings))
    # chunks of 2, 2 and 1 samples
    layer.thresholds = replace(THRESHOLDS, column_budget_bytes=2 * 4 * 9 * 16 * 4)
    assert check_gradient(layer, blobs_from([x]), max_points=40) > 0


def test_convolution_several_bottoms_share_weights():
    layer = make_layer(conv_text("num_output: 2 kernel_size: 2"))
    x0, x1 = randn(2, 3, 4, 4), randn(2, 3, 4, 4, seed=1)
    top = run_forward(layer, blobs_from([x0, x1]), n_top=2)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    for t, x in zip(top, (x0, x1)):
        np.testing.assert_allclose(t.data, conv_reference(x, w, b, (0, 0), (1, 1), (1, 1), 1),
                                   rtol=1e-5, atol=1e-5)
    assert check_gradient(layer, blobs_from([x0, x1]), n_top=2, max_points=40) > 0


def test_convolution_default_fillers_are_caffe_constant_zero():
    layer = make_layer('name: "c" type: "Convolution" '
                       'convolution_param { num_output: 2 kernel_size: 3 }')
    run_forward(layer, blobs_from([randn(1, 2, 4, 4)]))
    assert layer.blobs[0].shape == (2, 2, 3, 3) and layer.blobs[1].shape == (2,)
    assert not layer.blobs[0].data.any() and not layer.blobs[1].data.any()


@pytest.mark.parametrize("settings, shape, message", [
    ("num_output: 2 kernel_size: 3 axis: 4", (1, 2, 5, 5), "axis 4 out of range"),
    ("num_output: 2 kernel_h: 3 kernel_w: 3", (1, 2, 5), "2-D convolutions.*1 spatial axes"),
    ("num_output: 2 kernel_size: 3 kernel_size: 3", (1, 2, 5, 5, 5), "2 times.*axis \\(3\\)"),
    ("num_output: 2", (1, 2, 5, 5), "kernel_size is required"),
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 2, 5, 5), "not both"),
    ("num_output: 2 kernel_h: 3", (1, 2, 5, 5), "together"),
    ("num_output: 2 kernel_size: 3 stride_w: 2", (1, 2, 5, 5), "together"),
    ("num_output: 2 kernel_size: 3 pad: 1 pad_h: 1", (1, 2, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 1 kernel_size: 2 kernel_size: 3", (1, 2, 5, 5), "3 times"),
    ("num_output: 3 kernel_size: 3 group: 2", (1, 2, 5, 5), "group"),
    ("num_output: 2 kernel_size: 3 group: 2", (1, 3, 5, 5), "group"),
    ("kernel_size: 3", (1, 2, 5, 5), "num_output"),
    ("num_output: 2 kernel_size: 3 stride: 0", (1, 2, 5, 5), "stride"),
    ("num_output: 2 kernel_size: 7", (1, 2, 5, 5), "empty"),
])
def test_convolution_refuses_bad_settings(settings, shape, message):
    layer = make_layer(conv_text(settings))
    with pytest.raises(ShapeError, match=message):
        run_forward(layer, [Blob(shape)])


def test_convolution_reshape_checks_channels():
    layer = make_layer(conv_text("num_output: 2 kernel_size: 3"))
    bottom, top = [Blob((1, 2, 5, 5))], [Blob()]
    layer.setup(bottom, top)
    bottom[0].reshape(1, 3, 5, 5)
    with pytest.raises(ShapeError, match="channels|does not fit"):
        layer.reshape(bottom, top)


def shape_of(text, shape, n_top=1):
    layer = make_layer(text)
    top = [Blob() for _ in range(n_top)]
    bottom = [Blob(shape)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    return top[0].shape


def test_alexnet_shapes():
    conv1 = conv_text("num_output: 96 kernel_size: 11 stride: 4")
    assert shape_of(conv1, (2, 3, 227, 227)) == (2, 96, 55, 55)
    pool = pool_text("pool: MAX kernel_size: 3 stride: 2")
    assert shape_of(pool, (2, 96, 55, 55)) == (2, 96, 27, 27)
    conv2 = conv_text("num_output: 256 pad: 2 kernel_size: 5 group: 2")
    assert shape_of(conv2, (2, 96, 27, 27)) == (2, 256, 27, 27)
    assert shape_of(pool, (2, 256, 27, 27)) == (2, 256, 13, 13)
    conv3 = conv_text("num_output: 384 pad: 1 kernel_size: 3")
    assert shape_of(conv3, (2, 256, 13, 13)) == (2, 384, 13, 13)
    assert shape_of(pool, (2, 256, 13, 13)) == (2, 256, 6, 6)


def test_cifar10_quick_shapes():
    conv = conv_text("num_output: 32 pad: 2 kernel_size: 5 stride: 1")
    assert shape_of(conv, (4, 3, 32, 32)) == (4, 32, 32, 32)
    for pool, size, pooled in (("MAX", 32, 16), ("AVE", 16, 8), ("AVE", 8, 4)):
        text = pool_text(f"pool: {pool} kernel_size: 3 stride: 2")
        assert shape_of(text, (4, 32, size, size)) == (4, 32, pooled, pooled)
    # Floor rounding drops the window that ceil rounding lets hang over the edge.
    floor = pool_text("pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR")
    assert shape_of(floor, (4, 32, 32, 32)) == (4, 32, 15, 15)


# -- Deconvolution --------------------------------------------------------------------------------
DECONV_CASES = {
    "stride2": ("num_output: 3 kernel_size: 4 stride: 2 pad: 1", (2, 2, 3, 4), (1, 1), (2, 2),
                (1, 1), 1, True),
    "stride2_odd": ("num_output: 2 kernel_size: 3 stride: 2", (2, 3, 3, 3), (0, 0), (2, 2),
                    (1, 1), 1, True),
    "grouped_dilated": ("num_output: 4 kernel_h: 2 kernel_w: 3 group: 2 dilation: 2 "
                        "bias_term: false", (2, 4, 3, 3), (0, 0), (1, 1), (2, 2), 2, False),
}


@pytest.mark.parametrize("case", DECONV_CASES)
def test_deconvolution_forward_matches_scatter_loops(case):
    settings, shape, pad, stride, dilation, group, bias = DECONV_CASES[case]
    layer = make_layer(conv_text(settings, "Deconvolution"))
    x = randn(*shape)
    top = run_forward(layer, blobs_from([x]))
    w = layer.blobs[0].data
    assert w.shape[:2] == (shape[1], layer.num_output // group)
    b = layer.blobs[1].data if bias else None
    expected = deconv_reference(x, w, b, pad, stride, dilation, group)
    assert top[0].shape == expected.shape
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", DECONV_CASES)
def test_deconvolution_gradient(case):
    settings, shape = DECONV_CASES[case][:2]
    layer = make_layer(conv_text(settings, "Deconvolution"))
    assert check_gradient(layer, blobs_from([randn(*shape)]), max_points=60) > 0


def test_deconvolution_is_the_transpose_of_convolution():
    """<conv(x), y> == <x, deconv(y)> for the same weights and no bias."""
    settings = "num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 bias_term: false"
    conv = make_layer(conv_text(settings))
    x = randn(2, 6, 7, 7)
    y_conv = run_forward(conv, blobs_from([x]))[0].data
    deconv = make_layer(conv_text(settings.replace("num_output: 4", "num_output: 6"),
                                  "Deconvolution"))
    y = randn(*y_conv.shape, seed=3)
    deconv.setup(blobs_from([y]), [Blob()])
    deconv.blobs[0].data[...] = conv.blobs[0].data
    x_deconv = run_forward(deconv, blobs_from([y]))[0].data
    assert x_deconv.shape == x.shape
    np.testing.assert_allclose(np.vdot(y_conv, y), np.vdot(x, x_deconv), rtol=1e-4)


def test_deconvolution_chunked_batch_matches_whole_batch():
    settings = "num_output: 2 kernel_size: 4 stride: 2 pad: 1"
    x, dy = randn(3, 2, 3, 3), randn(3, 2, 6, 6, seed=1)
    results = []
    for budget in (None, 1):
        layer = make_layer(conv_text(settings, "Deconvolution"))
        if budget is not None:
            layer.thresholds = replace(THRESHOLDS, column_budget_bytes=budget)
        bottom = blobs_from([x])
        top = run_forward(layer, bottom)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy(), layer.blobs[0].diff.copy()])
    for whole, chunked in zip(*results):
        np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)


# -- Pooling --------------------------------------------------------------------------------------
# (prototxt settings, bottom shape, method, kernel, pad, stride, ceil rounding)
POOL_CASES = {
    "max_ceil": ("pool: MAX kernel_size: 3 stride: 2", (2, 3, 8, 7), "MAX", (3, 3), (0, 0),
                 (2, 2), True),
    "max_padded": ("pool: MAX kernel_size: 3 stride: 2 pad: 1", (2, 2, 7, 6), "MAX", (3, 3),
                   (1, 1), (2, 2), True),
    "max_rect": ("pool: MAX kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0",
                 (2, 2, 5, 8), "MAX", (2, 3), (1, 0), (1, 2), True),
    "max_floor": ("pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR", (2, 2, 8, 8), "MAX",
                  (3, 3), (0, 0), (2, 2), False),
    "ave_ceil": ("pool: AVE kernel_size: 3 stride: 2", (2, 3, 8, 7), "AVE", (3, 3), (0, 0),
                 (2, 2), True),
    "ave_padded": ("pool: AVE kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 7), "AVE", (3, 3),
                   (1, 1), (2, 2), True),
    "ave_padded_overhang": ("pool: AVE kernel_size: 4 stride: 3 pad: 2", (2, 2, 7, 9), "AVE",
                            (4, 4), (2, 2), (3, 3), True),
    "ave_rect_floor": ("pool: AVE kernel_h: 3 kernel_w: 2 stride: 2 round_mode: FLOOR",
                       (2, 2, 7, 6), "AVE", (3, 2), (0, 0), (2, 2), False),
}


@pytest.mark.parametrize("case", POOL_CASES)
def test_pooling_forward_matches_caffe_loops(case):
    settings, shape, method, kernel, pad, stride, ceil_mode = POOL_CASES[case]
    x = distinct(*shape)
    layer = make_layer(pool_text(settings))
    n_top = 2 if method == "MAX" else 1
    top = run_forward(layer, blobs_from([x]), n_top=n_top)
    expected, mask = pool_reference(x, method, kernel, pad, stride, ceil_mode)
    assert top[0].shape == expected.shape
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-6, atol=1e-6)
    if method == "MAX":
        np.testing.assert_array_equal(top[1].data, mask)


@pytest.mark.parametrize("engine", POOL_ENGINES)
@pytest.mark.parametrize("case", POOL_CASES)
def test_pooling_gradient(case, engine):
    settings, shape = POOL_CASES[case][:2]
    layer = make_layer(pool_text(settings, engine))
    assert check_gradient(layer, blobs_from([distinct(*shape)])) > 0


@pytest.mark.parametrize("settings, tops, on_onednn", [
    ("pool: MAX kernel_size: 3 stride: 2", 1, True),
    ("pool: MAX kernel_size: 3 stride: 2 pad: 1", 1, True),
    ("pool: AVE kernel_size: 3 stride: 2", 1, True),
    ("pool: MAX kernel_size: 3 stride: 2", 2, False),          # the mask top
    ("pool: AVE kernel_size: 3 stride: 2 pad: 1", 1, False),   # Caffe's divisor counts padding
    ("pool: MAX kernel_size: 2 stride: 3", 1, False),          # a window past the image
    ("pool: MAX global_pooling: true", 1, False),
    ("pool: MAX kernel_size: 3 stride: 2 engine: CAFFE", 1, False),
])
def test_pooling_runs_on_onednn_where_it_computes_caffes_result(settings, tops, on_onednn):
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    layer = make_layer(f'name: "p" type: "Pooling" pooling_param {{ {settings} }}')
    run_forward(layer, blobs_from([distinct(2, 3, 9, 8)]), n_top=tops)
    assert (layer.plan.forward == "onednn") == on_onednn


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    x = distinct(2, 3, 5, 4)
    layer = make_layer(pool_text(f"pool: {method} global_pooling: true"))
    top = run_forward(layer, blobs_from([x]))
    assert top[0].shape == (2, 3, 1, 1)
    expected = x.max(axis=(2, 3)) if method == "MAX" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(top[0].data[:, :, 0, 0], expected, rtol=1e-6, atol=1e-6)
    assert check_gradient(layer, blobs_from([x])) > 0


def test_max_pooling_mask_top_and_gradient():
    x = distinct(2, 2, 6, 6)
    layer = make_layer(pool_text("pool: MAX kernel_size: 2 stride: 2 pad: 1"))
    top = run_forward(layer, blobs_from([x]), n_top=2)
    assert top[1].shape == top[0].shape
    assert check_gradient(layer, blobs_from([x]), n_top=2, top_index=0) > 0


def test_max_pooling_ties_go_to_the_first_in_window_order():
    x = np.zeros((1, 1, 3, 3), np.float32)
    x[0, 0, 2, 2] = -1
    layer = make_layer(pool_text("pool: MAX kernel_size: 2 stride: 1"))
    bottom = blobs_from([x])
    top = run_forward(layer, bottom, n_top=2)
    np.testing.assert_array_equal(top[1].data[0, 0], [[0, 1], [3, 4]])
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])


def test_max_pooling_passes_over_nan_as_caffe():
    x = distinct(1, 1, 2, 2)
    x[0, 0, 1, 1] = np.nan
    layer = make_layer(pool_text("pool: MAX kernel_size: 2"))
    top = run_forward(layer, blobs_from([x]), n_top=2)
    assert top[0].data[0, 0, 0, 0] == np.nanmax(x)
    assert top[1].data[0, 0, 0, 0] == np.nanargmax(x)


def test_windows_past_the_image_in_ceil_mode_are_caffe_values():
    """stride > kernel with ceil rounding: the last window holds no pixel."""
    x = distinct(1, 1, 6, 6)
    max_layer = make_layer(pool_text("pool: MAX kernel_size: 1 stride: 2"))
    top = run_forward(max_layer, blobs_from([x]), n_top=2)
    assert top[0].shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(top[0].data[0, 0, :3, :3], x[0, 0, ::2, ::2])
    assert (top[0].data[0, 0, 3] == -np.finfo(np.float32).max).all()
    assert (top[1].data[0, 0, :, 3] == -1).all()
    ave_layer = make_layer(pool_text("pool: AVE kernel_size: 1 stride: 2"))
    top = run_forward(ave_layer, blobs_from([x]))
    np.testing.assert_array_equal(top[0].data[0, 0, :3, :3], x[0, 0, ::2, ::2])
    assert not top[0].data[0, 0, 3].any() and np.isfinite(top[0].data).all()
    assert check_gradient(ave_layer, blobs_from([x])) > 0


def pool_backward_reference(x_shape, method, kernel, pad, stride, mask, dy):
    """Caffe's pooling backward: MAX adds each gradient at its mask index, AVE spreads it over
    the window clipped to the image, divided by the window clipped to the padded image."""
    n, c, h, w = x_shape
    (kh, kw), (ph, pw), (sh, sw) = kernel, pad, stride
    dx = np.zeros((n, c, h * w))
    for py in range(dy.shape[2]):
        for px in range(dy.shape[3]):
            if method == "MAX":
                for i in range(n):
                    for j in range(c):
                        if mask[i, j, py, px] >= 0:
                            dx[i, j, int(mask[i, j, py, px])] += dy[i, j, py, px]
                continue
            y0, x0 = py * sh - ph, px * sw - pw
            y1, x1 = min(y0 + kh, h + ph), min(x0 + kw, w + pw)
            size = (y1 - y0) * (x1 - x0)
            for yy in range(max(y0, 0), min(y1, h)):
                for xx in range(max(x0, 0), min(x1, w)):
                    dx[:, :, yy * w + xx] += dy[:, :, py, px] / size
    return dx.reshape(x_shape)


# Window geometries for the checks against Caffe's loops: overlapping windows, stride > kernel,
# padding with ceil overhang, rectangular kernels and strides.
# (prototxt settings, kernel, pad, stride, ceil rounding)
GEOMETRIES = {
    "3x3_s2": ("kernel_size: 3 stride: 2", (3, 3), (0, 0), (2, 2), True),
    "3x3_s2_pad1": ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (1, 1), (2, 2), True),
    "3x3_s1_pad1": ("kernel_size: 3 stride: 1 pad: 1", (3, 3), (1, 1), (1, 1), True),
    "3x3_s1": ("kernel_size: 3 stride: 1", (3, 3), (0, 0), (1, 1), True),
    "3x1_s1": ("kernel_h: 3 kernel_w: 1 stride: 1", (3, 1), (0, 0), (1, 1), True),
    "1x3_s12": ("kernel_h: 1 kernel_w: 3 stride_h: 1 stride_w: 2", (1, 3), (0, 0), (1, 2), True),
    "2x2_s2": ("kernel_size: 2 stride: 2", (2, 2), (0, 0), (2, 2), True),
    "4x4_s3_pad2": ("kernel_size: 4 stride: 3 pad: 2", (4, 4), (2, 2), (3, 3), True),
    "2x2_s3": ("kernel_size: 2 stride: 3", (2, 2), (0, 0), (3, 3), True),
    "1x1_s2": ("kernel_size: 1 stride: 2", (1, 1), (0, 0), (2, 2), True),
    "3x2_s21_floor": ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 round_mode: FLOOR",
                      (3, 2), (0, 0), (2, 1), False),
    "2x3_s12_pad10": ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0",
                      (2, 3), (1, 0), (1, 2), True),
    "whole": ("kernel_h: 9 kernel_w: 8", (9, 8), (0, 0), (1, 1), True),
    "whole_past": ("kernel_size: 10 stride: 3", (10, 10), (0, 0), (3, 3), True),
}


def check_pooling_against_caffe(method, geometry, x, layer=None, engine="CAFFE"):
    """Forward values, mask (MAX on engine CAFFE: the mask top keeps DEFAULT off oneDNN) and
    backward gradient against Caffe's loops; geometry is a key of GEOMETRIES or such a tuple; a
    new layer unless one is given."""
    if isinstance(geometry, str):
        geometry = GEOMETRIES[geometry]
    settings, kernel, pad, stride, ceil_mode = geometry
    layer = layer or make_layer(pool_text(f"pool: {method} {settings}", engine))
    bottom = blobs_from([x])
    mask_top = method == "MAX" and engine == "CAFFE"
    top = run_forward(layer, bottom, n_top=2 if mask_top else 1)
    with np.errstate(invalid="ignore"):
        expected, mask = pool_reference(x, method, kernel, pad, stride, ceil_mode)
    if method == "AVE":
        expected = np.nan_to_num(expected)      # windows past the image: 0, not 0 / 0
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-6, atol=1e-6)
    if method == "MAX":
        np.testing.assert_array_equal(top[0].data, expected)
    if mask_top:
        np.testing.assert_array_equal(top[1].data, mask)
    dy = np.random.default_rng(3).standard_normal(top[0].shape).astype(np.float32)
    top[0].diff[...] = dy
    bottom[0].diff[...] = np.nan         # every pixel must be written
    layer.backward(top, [True], bottom)
    want = pool_backward_reference(x.shape, method, kernel, pad, stride, mask, dy)
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-5, atol=1e-6)
    return layer


@pytest.mark.parametrize("engine", POOL_ENGINES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_max_pooling_ties_match_caffe(geometry, engine):
    """Many ties (values from {0, 1, 2}), and windows sharing rows and columns: the first maximum
    in raster order wins, in the values, the mask and the gradient."""
    x = np.random.default_rng(7).integers(0, 3, (2, 3, 9, 8)).astype(np.float32)
    check_pooling_against_caffe("MAX", geometry, x, engine=engine)


@pytest.mark.parametrize("engine", POOL_ENGINES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_pooling_matches_caffe_in_every_geometry(method, geometry, engine):
    layer = check_pooling_against_caffe(method, geometry, distinct(2, 3, 9, 8), engine=engine)
    # On 9 x 8 images: windows past the image with stride 3 (2x2_s3 and 1x1_s2's columns), and
    # global pooling, stay on numpy; so does AVE with padding.
    on_onednn = (engine == "DEFAULT" and onednn.available()
                 and geometry not in ("2x2_s3", "1x1_s2", "whole", "whole_past")
                 and not (method == "AVE" and any(GEOMETRIES[geometry][2])))
    assert ran_on_onednn(layer) == on_onednn


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_pooling_on_onednn_with_stride_past_the_kernel(method):
    layer = check_pooling_against_caffe(method, "2x2_s3", distinct(2, 3, 8, 8), engine="DEFAULT")
    assert ran_on_onednn(layer) == onednn.available()


def test_max_pooling_on_onednn_passes_over_nan_as_caffe():
    """NaN among other values: oneDNN skips them as Caffe does (no fallback needed here)."""
    x = distinct(2, 3, 9, 8)
    x[:, :, ::3, ::2] = np.nan
    with np.errstate(invalid="ignore"):
        layer = check_pooling_against_caffe("MAX", "3x3_s2", x, engine="DEFAULT")
    assert ran_on_onednn(layer) == onednn.available()


def test_pooling_backward_follows_the_forward_pass_that_ran(thread_budget):
    """A new share of the cores, or a new shape, between forward and backward rebuilds the
    primitives: backward must still use the argmax of the forward pass that ran."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    x, dy = randn(2, 16, 9, 9), randn(2, 16, 4, 4, seed=1)
    grads = []
    for engine, change in (("CAFFE", None), ("DEFAULT", "threads"), ("DEFAULT", "shape")):
        layer = make_layer(pool_text("pool: MAX kernel_size: 3 stride: 2", engine))
        bottom = blobs_from([x])
        top = run_forward(layer, bottom)
        top[0].diff[...] = dy
        if change == "threads":
            ran = layer.pool_kernel
            thread_budget(3)
            layer.reshape(bottom, top)
            assert layer.pool_kernel is not ran          # primitives rebuilt for the new team
            thread_budget(None)
        elif change == "shape":
            layer.reshape(blobs_from([randn(2, 16, 10, 10)]), [Blob()])
        layer.backward(top, [True], bottom)
        grads.append(bottom[0].diff.copy())
    for grad in grads[1:]:
        np.testing.assert_allclose(grad, grads[0], rtol=1e-6, atol=1e-6)


def _form_of(array, tag):
    """A form holding `array` in layout `tag` (a test's own: its descriptor is not freed)."""
    lib = onednn.library()
    plain = lib.desc(array.shape)
    form = onednn.Form(array.shape, lib.desc(array.shape, tag))
    reorder = onednn.Reorder(plain, form.md)        # kept alive while it runs
    lib.execute(reorder.primitive, {onednn.SRC: (lib.memory(plain), array),
                                    onednn.DST: (form.memory, form.values)})
    return form


@pytest.mark.parametrize("settings", ["pool: MAX kernel_size: 3 stride: 2",
                                      "pool: MAX kernel_size: 2 stride: 2",
                                      "pool: AVE kernel_size: 3 stride: 2"])
@pytest.mark.parametrize("layout", ["nhwc", "blocks"])
def test_pooling_reads_a_form_in_its_layout(settings, layout):
    """A bottom in a form (a convolution's maps, NHWC where its plan is channels last) is
    pooled in that layout where oneDNN has a JIT kernel for it, not reordered to the channel
    blocks and back: the values of the arrays' pass, ties and NaN included, and their
    gradients."""
    if not onednn.available():
        pytest.skip("oneDNN not loadable here")
    lib = onednn.library()
    tag = onednn._NHWC if layout == "nhwc" else lib.channel_blocks()
    x = np.round(randn(3, 20, 11, 11), 1)         # ties in many windows
    x[0, 1, 2:5, 3] = np.nan
    results = []
    for in_form in (False, True):
        layer = make_layer(pool_text(settings))
        bottom, top = blobs_from([x]), [Blob()]
        for blob in bottom + top:
            blob.takes_forms = True
        layer.setup(bottom, top)
        layer.reshape(bottom, top)
        if in_form:
            bottom[0].keep(0, _form_of(x, tag))
        with np.errstate(invalid="ignore"):
            layer.forward(bottom, top)
        top[0].diff[...] = randn(*top[0].shape, seed=1)
        layer.backward(top, [True], bottom)
        ran, kept = layer.pool_kernel.ran, bottom[0].form(1)
        if in_form and ran.kernel.startswith("jit") and not layer.pool_kernel.ran_numpy:
            assert ran.tag == tag and kept is not None and kept.tag == tag
        results.append((top[0].data.copy(), bottom[0].diff.copy()))
    (y, dx), (y_form, dx_form) = results
    np.testing.assert_array_equal(y_form, y)
    # Overlapping windows' gradients add up in the order of the layout's kernel.
    np.testing.assert_allclose(dx_form, dx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("engine", POOL_ENGINES)
@pytest.mark.parametrize("geometry", ["3x3_s2", "3x3_s2_pad1", "2x2_s2", "2x3_s12_pad10", "whole"])
def test_max_pooling_passes_over_nan_and_lowest_as_caffe(geometry, engine):
    """NaN, -inf and -FLT_MAX are never selected (Caffe compares with > from -FLT_MAX): windows
    holding only such values give -FLT_MAX, mask -1 and no gradient."""
    x = np.random.default_rng(8).integers(-2, 3, (2, 2, 9, 8)).astype(np.float32)
    lowest = -np.finfo(np.float32).max
    x[0, 0, :4, :4] = np.nan
    x[0, 1] = -np.inf
    x[0, 1, 4, 3] = np.nan
    x[1, 1, 2:7, 1:6] = -np.inf
    x[1, 0, 3:8, :] = lowest
    x[1, 1, ::3, ::2] = np.nan
    x[1, 1, 7, 7] = np.inf
    with np.errstate(invalid="ignore"):
        check_pooling_against_caffe("MAX", geometry, x, engine=engine)


def test_pooling_with_a_kernel_256_wide_matches_caffe():
    """Column offsets past 255 (two-byte codes)."""
    x = np.random.default_rng(10).integers(0, 5, (2, 2, 3, 300)).astype(np.float32)
    geometry = ("kernel_h: 2 kernel_w: 256 stride: 1", (2, 256), (0, 0), (1, 1), True)
    check_pooling_against_caffe("MAX", geometry, x)
    check_pooling_against_caffe("AVE", geometry, x)


def test_max_pooling_nan_in_one_part_of_the_batch(thread_budget):
    """The batch split over threads, a NaN in one part only."""
    thread_budget(2)
    x = np.random.default_rng(9).integers(0, 4, (5, 2, 9, 8)).astype(np.float32)
    x[3, 1, 2, 2] = np.nan
    x[4, 0, :3, :3] = -np.inf
    layer = make_layer(pool_text("pool: MAX kernel_size: 3 stride: 2", "CAFFE"))
    layer.thresholds = replace(THRESHOLDS, pooling_part_values=0)
    check_pooling_against_caffe("MAX", "3x3_s2", x, layer)
    assert layer.plan.part == 1 and layer.plan.threads == 2


@pytest.mark.parametrize("engine", POOL_ENGINES)
@pytest.mark.parametrize("geometry", ["2x2_s3", "3x3_s2", "3x3_s2_pad1", "whole"])
@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_one_pooling_layer_over_changing_shapes(method, geometry, engine):
    """One layer, run again and on other shapes (odd widths: padded column planes)."""
    layer = make_layer(pool_text(f"pool: {method} {GEOMETRIES[geometry][0]}", engine))
    for shape, seed in (((2, 3, 9, 8), 0), ((3, 2, 9, 9), 1), ((3, 2, 9, 9), 2), ((1, 3, 9, 8), 3)):
        check_pooling_against_caffe(method, geometry, distinct(*shape, seed=seed), layer, engine)


@pytest.mark.parametrize("settings, n_top, message", [
    ("pool: STOCHASTIC kernel_size: 2", 1, "STOCHASTIC"),
    ("pool: AVE kernel_size: 2", 2, "second top"),
    ("global_pooling: true kernel_size: 2", 1, "global_pooling"),
    ("global_pooling: true pad: 1", 1, "global_pooling"),
    ("stride: 2", 1, "kernel_size"),
    ("kernel_size: 2 kernel_h: 2 kernel_w: 2", 1, "kernel_size or both"),
    ("kernel_h: 2", 1, "kernel_size or both"),
    ("kernel_size: 2 pad: 2", 1, "smaller than the kernel"),
    ("kernel_size: 2 stride: 0", 1, "stride"),
    ("kernel_size: 9", 1, "empty"),
])
def test_pooling_refuses_bad_settings(settings, n_top, message):
    layer = make_layer(pool_text(settings))
    with pytest.raises(ShapeError, match=message):
        run_forward(layer, [Blob((1, 1, 4, 4))], n_top=n_top)


@pytest.mark.parametrize("text", [
    conv_text("num_output: 2 kernel_size: 3 pad: 1"),
    conv_text("num_output: 2 kernel_size: 3 stride: 2", "Deconvolution"),
    pool_text("pool: MAX kernel_size: 3 stride: 2"),
    pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"),
])
def test_empty_batch(text):
    layer = make_layer(text)
    bottom = [Blob((0, 2, 5, 5))]
    top = run_forward(layer, bottom)
    assert top[0].shape[:2] == (0, 2)
    layer.backward(top, [True], bottom)


FIRST_LAYER = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 1 dim: 12 dim: 12 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 5 engine: %s
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
def test_a_first_layer_takes_its_weight_gradient_from_onednn(thread_budget):
    """A net's first layer (unpadded, stride 1, as LeNet's) wants no image gradient; its
    weight and bias gradients from oneDNN are those the GEMMs compute."""
    from google.protobuf import text_format

    from syncsgd import TRAIN
    from syncsgd.net import Net
    from syncsgd.proto import pb
    thread_budget(1)
    grads = {}
    for engine in ("CAFFE", "DEFAULT"):
        net = Net(text_format.Parse(FIRST_LAYER % engine, pb.NetParameter()), TRAIN)
        rng = np.random.default_rng(0)
        net.blobs["data"].data[...] = rng.standard_normal((8, 1, 12, 12))
        net.blobs["label"].data[...] = rng.integers(0, 3, 8)
        net.forward()
        net.backward()
        grads[engine] = [b.diff.copy() for b in net.params["conv"]]
        planned = net.layer_dict["conv"].plan.weight_grad
        assert planned == ("onednn" if engine == "DEFAULT" else "columns")
    for ours, gemm in zip(grads["DEFAULT"], grads["CAFFE"]):
        assert np.abs(gemm).max() > 0
        np.testing.assert_allclose(ours, gemm, rtol=1e-4, atol=1e-5 * np.abs(gemm).max())


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
@pytest.mark.parametrize("settings", ["num_output: 4 kernel_size: 3",
                                      "num_output: 4 kernel_size: 3 pad: 1"])
def test_two_bottoms_with_either_gradient_wanted_match_gemms(settings):
    """A two-bottom convolution asked for one image gradient, the other, none and both in
    turn computes what the GEMM kernels compute."""
    x = [randn(3, 5, 7, 7, seed=s) for s in (0, 1)]
    layers = {e: engine_layer(settings, e) for e in ("CAFFE", "DEFAULT")}
    passes = {}
    for engine, layer in layers.items():
        bottom = blobs_from(x)
        top = run_forward(layer, bottom, n_top=2)
        for i, t in enumerate(top):
            t.diff[...] = randn(*t.shape, seed=10 + i)
        out = []
        for down in ([True, False], [False, True], [False, False], [True, True]):
            for b in bottom + layer.blobs:
                b.diff[...] = 0
            layer.backward(top, down, bottom)
            out.append([b.diff.copy() for b in bottom + layer.blobs])
        passes[engine] = out
    for gemm, dnn in zip(passes["CAFFE"], passes["DEFAULT"]):
        for g, d in zip(gemm, dnn):
            np.testing.assert_allclose(d, g, rtol=1e-4, atol=1e-4)
    assert np.abs(passes["CAFFE"][0][0]).max() > 0 and not passes["CAFFE"][0][1].any()


@pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")
@pytest.mark.parametrize("channels, outputs, last", [(20, 50, True), (32, 64, False),
                                                     (3, 20, False), (20, 8, False)])
def test_channels_the_blocked_layouts_would_pad_run_channels_last(channels, outputs, last):
    """A convolution with at least 16 channels on both sides, not a multiple of 16 on one, is
    planned channels last (NHWC); oneDNN keeps that layout where it has a brgemm kernel for it
    (AVX-512 CPUs), and otherwise, like the other plans, the layout it chooses."""
    geometry = ConvolutionGeometry(4, channels, outputs, (12, 12), (8, 8), (5, 5), (0, 0),
                                   (1, 1), (1, 1), 1)
    plan = plan_convolution(geometry, 1, "DEFAULT", True)
    assert plan.channels_last == last
    primitives = onednn.Convolution((4, channels, 12, 12), (4, outputs, 8, 8), (5, 5), (0, 0),
                                    (1, 1), (1, 1), 1, True, plan.channels_last)
    lib = onednn.library()
    nhwc = lib.desc((4, channels, 12, 12), onednn._NHWC)
    kept = last and primitives.implementation.startswith("brg")
    assert kept == last or not _avx512_allowed()
    assert lib.same(primitives.f_images.chosen, nhwc) == kept
    assert lib.same(primitives.w_maps.chosen, lib.desc((4, outputs, 8, 8), onednn._NHWC)) == kept


def _avx512_allowed():
    """Whether oneDNN may use AVX-512 here: the CPU has it and ONEDNN_MAX_CPU_ISA does not cap
    below it."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return _cpu_has("avx512f") and (cap in ("ALL", "DEFAULT") or cap.startswith("AVX512")
                                    or cap.startswith("AVX10"))


def _cpu_has(flag):
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False
