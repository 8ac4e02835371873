"""Winograd's F(2x2, 3x3), F(4x4, 3x3) and F(2x2, 5x5) (kernels/winograd.py): their three
passes against a float64 direct convolution and its adjoints, on odd and even sizes, every
padding a window takes, groups, chunks summing one weight gradient; and the layer on them, each
direction mixed with the other kernels."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from syncsgd.kernels import compiled, onednn, plans, tuning
from syncsgd.kernels.plans import THRESHOLDS, ConvolutionGeometry
from syncsgd.kernels.winograd import VARIANTS, Winograd, names
from syncsgd.layers import convolution

from gradcheck import blobs_from, check_gradient, make_layer, run_forward


def windows(x, pad, r=3, stride=1):
    """The r x r windows of x (n, C, H, W) padded by `pad`, every `stride` pixels,
    (n, C, h, w, r, r) in float64."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    return np.lib.stride_tricks.sliding_window_view(xp, (r, r), axis=(2, 3))[:, :, ::stride,
                                                                             ::stride]


def direct(x, w, pad, group=1, stride=1):
    """The convolution of x (n, C, H, W) with w (K, C / group, r, r), in float64."""
    xs = np.split(windows(x, pad, w.shape[-1], stride), group, axis=1)
    ws = np.split(w.astype(np.float64), group)
    return np.concatenate([np.einsum("nchwij,kcij->nkhw", a, b) for a, b in zip(xs, ws)], 1)


def geometry(n, c, k, size, pad, group=1, r=3):
    out = tuple(s + 2 * pad - r + 1 for s in size)
    return ConvolutionGeometry(n, c, k, size, out, (r, r), (pad, pad), (1, 1), (1, 1), group)


def relative(have, want):
    return np.abs(have - want).max() / np.abs(want).max()


needs_compiled = pytest.mark.skipif(
    not compiled.available(), reason="Numba not importable: F(4x4, 3x3) and F(2x2, 5x5) do not run")
KERNELS = ["winograd", pytest.param("winograd4", marks=needs_compiled),
           pytest.param("winograd4_5x5", marks=needs_compiled),
           pytest.param("winograd_5x5", marks=needs_compiled)]
# Relative errors against float64 within which a kernel's passes must come: F(4x4, 5x5)'s 8x8
# tiles scale by up to 21/4 each way and 1/90 on the weights, 2-14e-6 on the shapes here.
TOLERANCE = {"winograd4_5x5": 2e-5}


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("n, c, k, size, pad, group", [
    (3, 5, 7, (6, 6), 1, 1), (2, 4, 6, (7, 5), 1, 1), (2, 3, 4, (9, 8), 0, 1),
    (2, 3, 2, (5, 6), 2, 1), (2, 16, 8, (1, 1), 1, 1), (2, 32, 48, (14, 14), 1, 1),
    (2, 6, 9, (7, 7), 1, 3), (3, 8, 4, (6, 5), 0, 2), (1, 12, 10, (10, 13), 1, 1)])
def test_the_three_passes_are_the_convolution_and_its_adjoints(n, c, k, size, pad, group, name):
    """Forward against the direct convolution; the weight gradient <dY, conv(x, .)> and the
    image gradient <dY, conv(., w)> against the same sums in float64, the weight gradient
    added over two chunks into a diff that held values already. 5x5 windows take one more
    pixel of padding, so that the maps have the 3x3 ones' sizes."""
    r = VARIANTS[name][1]
    pad += (r - 3) // 2
    bound = TOLERANCE.get(name, 1e-5)
    rng = np.random.default_rng(n * c + k)
    x = rng.standard_normal((n, c) + size, np.float32)
    w = rng.standard_normal((k, c // group, r, r), np.float32)
    bias = rng.standard_normal(k, np.float32)
    g = geometry(n, c, k, size, pad, group, r)
    kernel = Winograd(g, name)
    u = kernel.weight_matrix(w)
    y = np.empty((n, k) + g.features_size, np.float32)
    kernel.forward(u, bias, x, y)
    want = direct(x, w, pad, group) + bias[:, None, None]
    assert relative(y, want) < bound

    dy = rng.standard_normal(y.shape, np.float32)
    dy64 = dy.astype(np.float64)
    want_dw = np.concatenate([
        np.einsum("nkhw,nchwij->kcij", a, b) for a, b in
        zip(np.split(dy64, group, axis=1), np.split(windows(x, pad, r), group, axis=1))])
    matrices = kernel.gradient_matrices(None, 2)
    half = n // 2
    kernel.weight_grad(x[:half], dy[:half], matrices[0], False)
    carried = kernel.weight_grad(x[half:], dy[half:], matrices[1], False)
    dw = np.full_like(w, 0.5)
    kernel.add_gradients(matrices, dw)
    assert relative(dw - 0.5, want_dw) < bound

    # The image gradient: the transposed convolution, i.e. the flipped weights on dY padded
    # by r - 1 - pad.
    flipped = np.concatenate([part.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
                              for part in np.split(w, group)])
    want_dx = direct(dy, flipped, r - 1 - pad, group)
    dx = np.full_like(x, np.nan)
    kernel.image_grad(u, dy[half:], dx[half:], carried)
    kernel.image_grad(u, dy[:half], dx[:half], kernel.carry(dy[:half]))
    assert relative(dx, want_dx) < bound


@needs_compiled
@pytest.mark.parametrize("name, window, stride, size, pad, group", [
    ("winograd4", 11, 4, (27, 27), 0, 1), ("winograd", 11, 4, (26, 29), 0, 1),
    ("winograd4", 11, 4, (26, 25), 1, 1), ("winograd4", 5, 2, (13, 12), 2, 2),
    ("winograd", 7, 3, (14, 16), 1, 1), ("winograd_5x5", 9, 2, (17, 19), 1, 1),
    ("winograd4_5x5", 9, 2, (17, 19), 1, 1), ("winograd4_5x5", 10, 2, (22, 21), 2, 2)])
def test_strided_windows_are_the_convolution_of_the_space_to_depth(name, window, stride, size,
                                                                   pad, group):
    """A k x k window with stride s on the image's space-to-depth (ceil(k / s) a side): the
    three passes against float64, the image gradient through the convolution's matrix (rows
    and columns no window reads among the sizes: their gradient is zero)."""
    n, c, k = 2, 3 * group, 4 * group
    rng = np.random.default_rng(window * stride + pad)
    x = rng.standard_normal((n, c) + size, np.float32)
    w = rng.standard_normal((k, c // group, window, window), np.float32)
    bias = rng.standard_normal(k, np.float32)
    out = tuple((extent + 2 * pad - window) // stride + 1 for extent in size)
    g = ConvolutionGeometry(n, c, k, size, out, (window, window), (pad, pad), (stride, stride),
                            (1, 1), group)
    assert name in names(g)
    kernel = Winograd(g, name)
    u = kernel.weight_matrix(w)
    y = np.empty((n, k) + out, np.float32)
    kernel.forward(u, bias, x, y)
    bound = TOLERANCE.get(name, 1e-5)
    assert relative(y, direct(x, w, pad, group, stride) + bias[:, None, None]) < bound

    dy = rng.standard_normal(y.shape, np.float32)
    (matrix,) = kernel.gradient_matrices(None, 1)
    carried = kernel.weight_grad(x, dy, matrix, False)
    dw = np.zeros_like(w)
    kernel.add_gradients([matrix], dw)
    want_dw = np.concatenate([
        np.einsum("nkhw,nchwij->kcij", a, b) for a, b in
        zip(np.split(dy.astype(np.float64), group, axis=1),
            np.split(windows(x, pad, window, stride), group, axis=1))])
    assert relative(dw, want_dw) < bound

    basis = np.eye(c * size[0] * size[1]).reshape((-1, c) + size)
    columns = direct(basis, w, pad, group, stride)          # conv of each basis image
    want_dx = np.einsum("pkhw,nkhw->np", columns, dy.astype(np.float64)).reshape(x.shape)
    dx = np.full_like(x, np.nan)
    kernel.image_grad(u, dy, dx, carried)
    assert relative(dx, want_dx) < bound


@pytest.mark.parametrize("n, c, k, size, pad, group", [
    (3, 5, 7, (6, 6), 1, 1), (2, 3, 4, (9, 8), 0, 1), (2, 3, 2, (5, 6), 2, 1),
    (2, 16, 8, (1, 1), 1, 1), (3, 8, 4, (6, 5), 0, 2), (2, 20, 24, (11, 7), 1, 1)])
def test_the_compiled_transforms_give_the_numpy_passes_values(n, c, k, size, pad, group,
                                                              monkeypatch):
    """kernels/winograd_transforms.py makes the numpy passes' operations in their order: the
    three passes' results are theirs to the bit."""
    from syncsgd.kernels import compiled
    rng = np.random.default_rng(7 * n + c)
    x = rng.standard_normal((n, c) + size, np.float32)
    w = rng.standard_normal((k, c // group, 3, 3), np.float32)
    bias = rng.standard_normal(k, np.float32)
    g = geometry(n, c, k, size, pad, group)
    dy = rng.standard_normal((n, k) + g.features_size, np.float32)
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("SYNCSGD_NUMBA", switch)
        kernel = Winograd(g)
        assert kernel._compiled == (switch == "1" and compiled.available())
        u = kernel.weight_matrix(w)
        y = np.empty((n, k) + g.features_size, np.float32)
        kernel.forward(u, bias, x, y)
        (dw,) = kernel.gradient_matrices(None, 1)
        carried = kernel.weight_grad(x, dy, dw, False)
        dx = np.empty_like(x)
        kernel.image_grad(u, dy, dx, carried)
        results.append([y, dw.copy(), dx, kernel.carry(dy).copy()])
    for have, want in zip(*results):
        np.testing.assert_array_equal(have, want)


def test_f4x4_and_the_5x5_kernels_are_offered_where_their_compiled_transforms_run(monkeypatch):
    three, five = geometry(8, 64, 64, (28, 28), 1), geometry(8, 64, 64, (28, 28), 2, r=5)
    offered = {d: [] for d in ("forward", "weight_grad", "image_grad")}
    for switch, want in (("1", ([["winograd"], ["winograd4"]],
                                [["winograd_5x5"], ["winograd4_5x5"]])),
                         ("0", ([["winograd"]], []))):
        monkeypatch.setenv("SYNCSGD_NUMBA", switch)
        if switch == "1" and not compiled.available():
            continue
        for g, kernels in zip((three, five), want):
            candidates = plans.convolution_candidates(g, 2, "DEFAULT", lambda: offered)
            assert all([c for c in candidates[d] if c[0].startswith("winograd")] == kernels
                       for d in offered)


@needs_compiled
@pytest.mark.parametrize("c, h, w, pad", [(3, 5, 7, (1, 2)), (16, 4, 4, (0, 0)),
                                          (37, 6, 3, (2, 1))])
def test_the_channels_last_image_and_back_are_numpys_transposes(c, h, w, pad):
    """channels_last places samples first..last of (n, C, h, w) at pad in a zeroed (n, ph, pw,
    C) image and leaves the other samples alone; channels_first crops one back, + bias."""
    from syncsgd.kernels import winograd_transforms
    rng = np.random.default_rng(1)
    images = rng.standard_normal((4, c, h, w), np.float32)
    image = np.full((4, h + 2 * pad[0] + 1, w + 2 * pad[1] + 2, c), np.nan, np.float32)
    winograd_transforms.channels_last(images, image, *pad, 1, 3)
    want = np.zeros_like(image[1:3])
    want[:, pad[0]:pad[0] + h, pad[1]:pad[1] + w] = images[1:3].transpose(0, 2, 3, 1)
    assert np.array_equal(image[1:3], want)
    assert np.isnan(image[[0, 3]]).all()
    bias = rng.standard_normal(c, np.float32)
    out = np.full_like(images, np.nan)
    for with_bias in (False, True):
        winograd_transforms.channels_first(image[:, pad[0]:, pad[1]:], out, bias, with_bias, 1, 3)
        want = images[1:3] + (bias[:, None, None] if with_bias else np.float32(0))
        assert np.array_equal(out[1:3], want)
        assert np.isnan(out[[0, 3]]).all()


@needs_compiled
def test_it_computes_2d_windows_of_3x3_and_5x5_after_the_stride():
    three, five = geometry(2, 8, 8, (10, 10), 1), geometry(2, 8, 8, (10, 10), 2, r=5)
    assert names(three) == names(geometry(2, 8, 8, (10, 10), 1, 2)) == ["winograd", "winograd4"]
    assert names(five) == ["winograd_5x5", "winograd4_5x5"]

    def changed(g, **change):
        return names(SimpleNamespace(**{**g.__dict__, **change}))
    # ceil(k / s) = 3 or 5: AlexNet's conv1 (11x11, stride 4) among them.
    for kernel, stride, want in [(11, 4, names(three)), (5, 2, names(three)),
                                 (9, 2, names(five)), (10, 2, names(five)),
                                 (3, 2, []), (7, 2, []), (1, 2, [])]:
        assert changed(three, kernel=(kernel, kernel), stride=(stride, stride)) == want
    for change in [dict(kernel=(7, 7)), dict(kernel=(3, 5)), dict(stride=(1, 2)),
                   dict(dilation=(2, 2)), dict(reverse=True), dict(force_nd=True),
                   dict(kernel=(3, 3, 3), image_size=(4, 4, 4))]:
        for g in (three, five):
            assert changed(g, **change) == [], change


needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="oneDNN not loadable here: nothing is timed")

TEXT = ("name: 'conv' type: 'Convolution' convolution_param { num_output: 24 kernel_size: %s "
        "%s weight_filler { type: 'gaussian' std: 0.1 } bias_filler { type: 'gaussian' } }")


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """force(choice): the layers made next run each direction on what `choice` names."""
    monkeypatch.delenv("SYNCSGD_KERNELS", raising=False)
    monkeypatch.setenv("SYNCSGD_KERNEL_CACHE", str(tmp_path))
    thresholds = replace(THRESHOLDS, timed_min_flops=1e4)
    monkeypatch.setattr(convolution, "THRESHOLDS", thresholds)
    monkeypatch.setattr(convolution.ConvolutionBase, "thresholds", thresholds)
    real = tuning.choice

    def force(choice):
        def chosen(key, candidates, prepare, label):
            if "geometry" not in key:
                return real(key, candidates, prepare, label)
            if "backward" in candidates:      # the gradients together: keep the forced ones
                return {"backward": candidates["backward"][0]}
            assert all(choice[d] in candidates[d] for d in choice)
            return choice
        monkeypatch.setattr(tuning, "choice", chosen)
    return force


@needs_onednn
@pytest.mark.parametrize("shared_tiles", [0, THRESHOLDS.winograd_shared_tiles])
@pytest.mark.parametrize("settings", ["pad: 0", "pad: 1", "pad: 1 group: 2"])
@pytest.mark.parametrize("window, mix", [
    ("3", ("winograd", "winograd", "winograd")), ("3", ("winograd", "gemm", "winograd")),
    ("3", ("gemm", "winograd", "gemm")), ("3", ("onednn", "winograd", "onednn")),
    ("3", ("winograd", "onednn", "winograd")),
    pytest.param("3", ("winograd4", "winograd4", "winograd4"), marks=needs_compiled),
    pytest.param("3", ("winograd4", "winograd", "onednn"), marks=needs_compiled),
    pytest.param("3", ("gemm", "winograd4", "winograd"), marks=needs_compiled),
    pytest.param("5", ("winograd_5x5", "winograd_5x5", "winograd_5x5"), marks=needs_compiled),
    pytest.param("5", ("winograd_5x5", "gemm", "onednn"), marks=needs_compiled),
    pytest.param("5", ("onednn", "winograd_5x5", "winograd_5x5"), marks=needs_compiled),
    pytest.param("5 stride: 2", ("winograd4", "winograd", "gemm"), marks=needs_compiled),
    pytest.param("5 stride: 2", ("onednn", "winograd4", "winograd4"), marks=needs_compiled),
    pytest.param("7 stride: 3", ("winograd", "onednn", "winograd4"), marks=needs_compiled),
    pytest.param("9 stride: 2", ("winograd_5x5",) * 3, marks=needs_compiled),
    pytest.param("5", ("winograd4_5x5",) * 3, marks=needs_compiled),
    pytest.param("5", ("winograd4_5x5", "onednn", "winograd_5x5"), marks=needs_compiled),
    pytest.param("5", ("gemm", "winograd4_5x5", "winograd4_5x5"), marks=needs_compiled),
    pytest.param("10 stride: 2", ("winograd4_5x5", "winograd4_5x5", "gemm"),
                 marks=needs_compiled)])
def test_the_layer_on_winograd_computes_the_fixed_rules_values(window, mix, settings,
                                                              shared_tiles, forced,
                                                              monkeypatch):
    """Each direction on Winograd beside the GEMM kernels and oneDNN, on 9 samples of 11x11:
    in chunks of several sizes shared out to the threads, or on Winograd alone (shared_tiles
    not 0: 36 or 9 tiles a sample) the whole batch in one chunk, each phase shared out.
    Strided windows run on the image's space-to-depth."""
    thresholds = replace(convolution.THRESHOLDS, winograd_shared_tiles=shared_tiles)
    monkeypatch.setattr(convolution, "THRESHOLDS", thresholds)
    monkeypatch.setattr(convolution.ConvolutionBase, "thresholds", thresholds)
    rng = np.random.default_rng(len(settings))
    x = rng.standard_normal((9, 20, 11, 11), np.float32)
    monkeypatch.setenv("SYNCSGD_KERNELS", "rules")
    layer = make_layer(TEXT % (window, settings))
    (top,) = run_forward(layer, blobs_from([x]))
    dy = rng.standard_normal(top.shape, np.float32)

    def passes(layer):
        bottom = blobs_from([x])
        (top,) = run_forward(layer, bottom)
        top.diff[...] = dy
        layer.backward([top], [True], bottom)
        return [top.data.copy(), bottom[0].diff.copy()] + [b.diff.copy() for b in layer.blobs]
    want = passes(layer)
    monkeypatch.delenv("SYNCSGD_KERNELS")
    candidates = layer._candidates(layer.geometry, layer.plan.threads, "DEFAULT")
    choice = {direction: next(c for c in candidates[direction] if c[0] == name)
              for direction, name in zip(("forward", "weight_grad", "image_grad"), mix)}
    forced(choice)
    layer = make_layer(TEXT % (window, settings))
    have = passes(layer)
    ran = [getattr(layer.plan, d) for d in ("forward", "weight_grad", "image_grad")]
    assert [n if n == "onednn" or n in VARIANTS else "gemm" for n in ran] == list(mix)
    whole = shared_tiles > 0 and "gemm" not in mix and layer.plan.threads > 1
    assert (layer._chunks == [(0, 9)]) == whole
    for h, w in zip(have, want):
        np.testing.assert_allclose(h, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@needs_onednn
@pytest.mark.parametrize("name, window", [
    ("winograd", "3"), pytest.param("winograd4", "3", marks=needs_compiled),
    pytest.param("winograd_5x5", "5", marks=needs_compiled),
    pytest.param("winograd4_5x5", "5", marks=needs_compiled),
    pytest.param("winograd4", "5 stride: 2", marks=needs_compiled)])
def test_the_numeric_gradient_of_the_layer_on_winograd(forced, name, window):
    forced({d: [name] for d in ("forward", "weight_grad", "image_grad")})
    layer = make_layer((TEXT % (window, "pad: 1")).replace("24", "6"))
    x = np.random.default_rng(5).standard_normal((2, 5, 7, 6), np.float32)
    # The layer is linear in its bottom and in each parameter, so central differences are exact
    # at any step; a long one keeps Winograd's rounding (F(2x2, 5x5)'s transforms scale by up
    # to 5 and down to 1/24) from swamping them: at 0.01, 1.1e-3 off on one point under
    # ONEDNN_MAX_CPU_ISA=SSE41.
    check_gradient(layer, blobs_from([x]), step=0.1)
    assert layer.plan.forward == name


def test_winograd_runs_its_own_chunks_unless_a_gemm_kernel_shares_them(monkeypatch):
    """Chunks of at least winograd_tiles_per_channel (0.5) tiles per channel and
    winograd_min_products multiply-adds a point, one or more per thread, where every direction
    off oneDNN is on Winograd, or the whole batch where a thread's share holds fewer than
    winograd_shared_tiles (256); F(4x4, 3x3)'s tiles where it runs, for F(2x2, 3x3) too; the
    GEMM kernels' chunks (the ones they were timed on) where one of them runs too."""
    def plan(num, choice, channels=256):
        return plans.timed_convolution(geometry(num, channels, channels, (14, 14), 1), 2,
                                       "DEFAULT", choice)
    onednn_kernel = ["onednn", "any", "jit"]
    alone = {"forward": ["winograd"], "image_grad": ["winograd"], "weight_grad": onednn_kernel}
    four = {**alone, "forward": ["winograd4"], "image_grad": ["winograd4"]}
    mixed = {**alone, "forward": ["winograd4"]}
    monkeypatch.setenv("SYNCSGD_NUMBA", "0")     # F(2x2, 3x3) alone: 49 tiles a sample
    # 128 tiles for 256 channels: 3 samples, 147 tiles; an even number of equal chunks; all 10
    # samples where a thread's 5 hold 245 tiles (11: its 6 hold 294); for 64 channels, 32
    # tiles: one sample.
    assert [plan(num, alone).chunk for num in (64, 16, 11, 10, 3)] == [3, 3, 3, 10, 3]
    assert plan(64, alone).shared_forward
    assert [plan(num, alone, 64).chunk for num in (64, 16)] == [1, 1]
    monkeypatch.setenv("SYNCSGD_NUMBA", "1")
    if compiled.available():
        # F(4x4, 3x3)'s 16 tiles a sample: chunks of 8 samples, but all 16 where a thread's 8
        # hold 128 tiles; the same for F(2x2, 3x3) beside it or alone.
        for choice in (four, mixed, alone):
            assert [plan(num, choice).chunk for num in (64, 32, 16, 3)] == [8, 8, 16, 3]
        # 5x5 windows take F(4x4, 5x5)'s tiles for F(2x2, 5x5) too. AlexNet's conv2 (27x27,
        # 96 -> 256 in 2 groups): 49 tiles a sample, 64 per channel of a group's 128 outputs
        # in 2 samples.
        conv2 = geometry(32, 96, 256, (27, 27), 2, 2, r=5)
        # LeNet's conv2 (12x12, 20 -> 50): 4 tiles a sample, products of 1000 multiply-adds a
        # tile and point, so 131 tiles or more (winograd_min_products): 33 samples, one chunk
        # a thread; but a thread's 32 samples hold 128 tiles, so the whole batch (and on one
        # thread, a lane's 32 samples).
        lenet = geometry(64, 20, 50, (12, 12), 0, r=5)
        for name in ("winograd_5x5", "winograd4_5x5"):
            five = {d: [name] for d in ("forward", "weight_grad", "image_grad")}
            assert plans.timed_convolution(conv2, 2, "DEFAULT", five).chunk == 2
            assert plans.timed_convolution(lenet, 2, "DEFAULT", five).chunk == 64
            assert plans.timed_convolution(
                geometry(32, 20, 50, (12, 12), 0, r=5), 1, "DEFAULT", five).chunk == 32
        # AlexNet's conv1 on its space-to-depth (48 -> 96 channels, 196 tiles a sample of
        # F(4x4)): one sample.
        four = {d: ["winograd4"] for d in ("forward", "weight_grad", "image_grad")}
        conv1 = ConvolutionGeometry(32, 3, 96, (227, 227), (55, 55), (11, 11), (0, 0), (4, 4),
                                    (1, 1), 1)
        assert plans.timed_convolution(conv1, 2, "DEFAULT", four).chunk == 1
    shared = {"forward": ["winograd"], "image_grad": ["gemm"], "weight_grad": ["gemm"]}
    gemm = plans.plan_convolution(geometry(64, 256, 256, (14, 14), 1), 2, "DEFAULT", False)
    assert plan(64, shared).chunk == gemm.chunk != 11
