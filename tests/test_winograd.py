"""Winograd's F(2x2, 3x3) and F(4x4, 3x3) (kernels/winograd.py): their three passes against a
float64 direct convolution and its adjoints, on odd and even sizes, every padding a 3x3 window
takes, groups, chunks summing one weight gradient; and the layer on them, each direction mixed
with the other kernels."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from syncsgd.kernels import compiled, onednn, plans, tuning
from syncsgd.kernels.plans import THRESHOLDS, ConvolutionGeometry
from syncsgd.kernels.winograd import Winograd, applies, sizes
from syncsgd.layers import convolution

from gradcheck import blobs_from, check_gradient, make_layer, run_forward


def windows(x, pad):
    """The 3x3 windows of x (n, C, H, W) padded by `pad`, (n, C, h, w, 3, 3) in float64."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    return np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))


def direct(x, w, pad, group=1):
    """The convolution of x (n, C, H, W) with w (K, C / group, 3, 3), stride 1, in float64."""
    xs, ws = np.split(windows(x, pad), group, axis=1), np.split(w.astype(np.float64), group)
    return np.concatenate([np.einsum("nchwij,kcij->nkhw", a, b) for a, b in zip(xs, ws)], 1)


def geometry(n, c, k, size, pad, group=1):
    out = tuple(s + 2 * pad - 2 for s in size)
    return ConvolutionGeometry(n, c, k, size, out, (3, 3), (pad, pad), (1, 1), (1, 1), group)


def relative(have, want):
    return np.abs(have - want).max() / np.abs(want).max()


needs_compiled = pytest.mark.skipif(not compiled.available(),
                                    reason="Numba not importable: F(4x4, 3x3) does not run")
TILES = [2, pytest.param(4, marks=needs_compiled)]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("n, c, k, size, pad, group", [
    (3, 5, 7, (6, 6), 1, 1), (2, 4, 6, (7, 5), 1, 1), (2, 3, 4, (9, 8), 0, 1),
    (2, 3, 2, (5, 6), 2, 1), (2, 16, 8, (1, 1), 1, 1), (2, 32, 48, (14, 14), 1, 1),
    (2, 6, 9, (7, 7), 1, 3), (3, 8, 4, (6, 5), 0, 2), (1, 12, 10, (10, 13), 1, 1)])
def test_the_three_passes_are_the_convolution_and_its_adjoints(n, c, k, size, pad, group, tile):
    """Forward against the direct convolution; the weight gradient <dY, conv(x, .)> and the
    image gradient <dY, conv(., w)> against the same sums in float64, the weight gradient
    added over two chunks into a diff that held values already."""
    rng = np.random.default_rng(n * c + k)
    x = rng.standard_normal((n, c) + size, np.float32)
    w = rng.standard_normal((k, c // group, 3, 3), np.float32)
    bias = rng.standard_normal(k, np.float32)
    g = geometry(n, c, k, size, pad, group)
    kernel = Winograd(g, tile)
    u = kernel.weight_matrix(w)
    y = np.empty((n, k) + g.features_size, np.float32)
    kernel.forward(u, bias, x, y)
    want = direct(x, w, pad, group) + bias[:, None, None]
    assert relative(y, want) < 1e-5

    dy = rng.standard_normal(y.shape, np.float32)
    dy64 = dy.astype(np.float64)
    want_dw = np.concatenate([
        np.einsum("nkhw,nchwij->kcij", a, b) for a, b in
        zip(np.split(dy64, group, axis=1), np.split(windows(x, pad), group, axis=1))])
    matrices = kernel.gradient_matrices(None, 2)
    half = n // 2
    kernel.weight_grad(x[:half], dy[:half], matrices[0], False)
    carried = kernel.weight_grad(x[half:], dy[half:], matrices[1], False)
    dw = np.full_like(w, 0.5)
    kernel.add_gradients(matrices, dw)
    assert relative(dw - 0.5, want_dw) < 1e-5

    # The image gradient: the transposed convolution, i.e. the flipped weights on dY padded
    # by 2 - pad, cropped where pad > 2 would leave nothing to crop.
    flipped = np.concatenate([part.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
                              for part in np.split(w, group)])
    want_dx = direct(dy, flipped, 2 - pad, group)
    dx = np.full_like(x, np.nan)
    kernel.image_grad(u, dy[half:], dx[half:], carried)
    kernel.image_grad(u, dy[:half], dx[:half], kernel.carry(dy[:half]))
    assert relative(dx, want_dx) < 1e-5


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


def test_f4x4_is_offered_where_its_compiled_transforms_run(monkeypatch):
    g = geometry(8, 64, 64, (28, 28), 1)
    offered = {d: [] for d in ("forward", "weight_grad", "image_grad")}
    for switch, tiles, names in (("1", (2, 4), [["winograd"], ["winograd4"]]),
                                 ("0", (2,), [["winograd"]])):
        monkeypatch.setenv("SYNCSGD_NUMBA", switch)
        if switch == "1" and not compiled.available():
            continue
        assert sizes() == tiles
        candidates = plans.convolution_candidates(g, 2, "DEFAULT", lambda: offered)
        assert all([c for c in candidates[d] if c[0].startswith("winograd")] == names
                   for d in offered)


def test_it_applies_to_3x3_stride_1_2d_convolutions_only():
    g = geometry(2, 8, 8, (10, 10), 1)
    assert applies(g) and applies(geometry(2, 8, 8, (10, 10), 1, 2))
    for change in [dict(kernel=(5, 5)), dict(stride=(2, 2)), dict(dilation=(2, 2)),
                   dict(reverse=True), dict(force_nd=True),
                   dict(kernel=(3, 3, 3), image_size=(4, 4, 4))]:
        assert not applies(SimpleNamespace(**{**g.__dict__, **change})), change


needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="oneDNN not loadable here: nothing is timed")

TEXT = ("name: 'conv' type: 'Convolution' convolution_param { num_output: 24 kernel_size: 3 "
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
            assert all(choice[d] in candidates[d] for d in choice)
            return choice
        monkeypatch.setattr(tuning, "choice", chosen)
    return force


@needs_onednn
@pytest.mark.parametrize("shared_tiles", [0, THRESHOLDS.winograd_shared_tiles])
@pytest.mark.parametrize("settings", ["pad: 0", "pad: 1", "pad: 1 group: 2"])
@pytest.mark.parametrize("mix", [
    ("winograd", "winograd", "winograd"), ("winograd", "gemm", "winograd"),
    ("gemm", "winograd", "gemm"), ("onednn", "winograd", "onednn"),
    ("winograd", "onednn", "winograd"),
    pytest.param(("winograd4", "winograd4", "winograd4"), marks=needs_compiled),
    pytest.param(("winograd4", "winograd", "onednn"), marks=needs_compiled),
    pytest.param(("gemm", "winograd4", "winograd"), marks=needs_compiled)])
def test_the_layer_on_winograd_computes_the_fixed_rules_values(mix, settings, shared_tiles,
                                                              forced, monkeypatch):
    """Each direction on Winograd beside the GEMM kernels and oneDNN, on 9 samples of 11x11:
    in chunks of several sizes shared out to the threads, or on Winograd alone (shared_tiles
    not 0: 36 or 9 tiles a sample) the whole batch in one chunk, each phase shared out."""
    thresholds = replace(convolution.THRESHOLDS, winograd_shared_tiles=shared_tiles)
    monkeypatch.setattr(convolution, "THRESHOLDS", thresholds)
    monkeypatch.setattr(convolution.ConvolutionBase, "thresholds", thresholds)
    rng = np.random.default_rng(len(settings))
    x = rng.standard_normal((9, 20, 11, 11), np.float32)
    monkeypatch.setenv("SYNCSGD_KERNELS", "rules")
    layer = make_layer(TEXT % settings)
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
    layer = make_layer(TEXT % settings)
    have = passes(layer)
    ran = [getattr(layer.plan, d) for d in ("forward", "weight_grad", "image_grad")]
    assert [n if n in ("onednn", "winograd", "winograd4") else "gemm" for n in ran] == list(mix)
    whole = shared_tiles > 0 and "gemm" not in mix and layer.plan.threads > 1
    assert (layer._chunks == [(0, 9)]) == whole
    for h, w in zip(have, want):
        np.testing.assert_allclose(h, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@needs_onednn
@pytest.mark.parametrize("name", ["winograd", pytest.param("winograd4", marks=needs_compiled)])
def test_the_numeric_gradient_of_the_layer_on_winograd(forced, name):
    forced({d: [name] for d in ("forward", "weight_grad", "image_grad")})
    layer = make_layer(TEXT.replace("24", "6") % "pad: 1")
    x = np.random.default_rng(5).standard_normal((2, 5, 7, 6), np.float32)
    check_gradient(layer, blobs_from([x]))
    assert layer.plan.forward == name


def test_winograd_runs_its_own_chunks_unless_a_gemm_kernel_shares_them(monkeypatch):
    """Chunks of at least winograd_tiles_per_channel (0.5) tiles per channel, one or more per
    thread, where every direction off oneDNN is on Winograd, or the whole batch where a
    thread's share holds fewer than winograd_shared_tiles (256); F(4x4, 3x3)'s tiles where it
    runs, for F(2x2, 3x3) too; the GEMM kernels' chunks (the ones they were timed on) where
    one of them runs too."""
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
    shared = {"forward": ["winograd"], "image_grad": ["gemm"], "weight_grad": ["gemm"]}
    gemm = plans.plan_convolution(geometry(64, 256, 256, (14, 14), 1), 2, "DEFAULT", False)
    assert plan(64, shared).chunk == gemm.chunk != 11
