"""BVLC Caffe's smaller layer types: the neurons BNLL, Clip, Exp, Log, Swish and Threshold, and
ArgMax, Reduction, MVN, Tile, Parameter, Embed, BatchReindex and Filter.

Each is checked against a numpy reference written here from Caffe's definition, with the shared
numeric gradient checker where it has a backward, for its parameter errors, inside a Net built from
prototxt text, and against OpenCV's Caffe importer (cv2.dnn) for the types OpenCV implements.
OpenCV ignores log_param, swish_param.beta and puts MVN's eps inside the square root, so those are
compared at their defaults only.
"""
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.blob import Blob
from syncsgd.errors import ShapeError
from syncsgd.layers import known_types
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def uniform(lo, hi, *shape, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def forward(text, *arrays, n_top=1):
    top = run_forward(make_layer(f"name: 'l' {text}"), blobs_from(arrays), n_top)
    return [t.data.copy() for t in top]


def backward(text, arrays, dys, propagate):
    """Forward, then backward from top diffs `dys`; returns the layer and the bottom diffs."""
    layer = make_layer(f"name: 'l' {text}")
    bottom = blobs_from(arrays)
    top = run_forward(layer, bottom, len(dys))
    for t, dy in zip(top, dys):
        t.diff[...] = dy
    layer.backward(top, propagate, bottom)
    return layer, [b.diff.copy() for b in bottom]


def f64(x):
    return x.astype(np.float64)


# -- neurons ------------------------------------------------------------------------------------
def sigmoid_ref(x):
    return 1 / (1 + np.exp(-f64(x)))


NEURONS = [
    ("type: 'BNLL'", lambda x: np.log1p(np.exp(f64(x)))),
    ("type: 'Clip' clip_param { min: -0.5 max: 1.25 }", lambda x: np.clip(x, -0.5, 1.25)),
    ("type: 'Clip' clip_param { min: 0.3 max: 0.3 }", lambda x: np.full_like(x, 0.3)),
    ("type: 'Exp'", lambda x: np.exp(f64(x))),
    ("type: 'Exp' exp_param { base: 2 scale: 0.5 shift: 1 }", lambda x: 2 ** (1 + 0.5 * f64(x))),
    ("type: 'Exp' exp_param { scale: -1.5 shift: -0.5 }", lambda x: np.exp(-0.5 - 1.5 * f64(x))),
    ("type: 'Exp' exp_param { base: 0.5 }", lambda x: 0.5 ** f64(x)),
    ("type: 'Log' log_param { shift: 6 }", lambda x: np.log(6 + f64(x))),
    ("type: 'Log' log_param { base: 10 scale: 2 shift: 16 }",
     lambda x: np.log10(16 + 2 * f64(x))),
    ("type: 'Log' log_param { base: 2 scale: -0.5 shift: 6 }",
     lambda x: np.log2(6 - 0.5 * f64(x))),
    ("type: 'Swish'", lambda x: x * sigmoid_ref(x)),
    ("type: 'Swish' swish_param { beta: 2.5 }", lambda x: x * sigmoid_ref(2.5 * x)),
    ("type: 'Swish' swish_param { beta: -0.5 }", lambda x: x * sigmoid_ref(-0.5 * x)),
    ("type: 'Threshold'", lambda x: (x > 0).astype(np.float32)),
    ("type: 'Threshold' threshold_param { threshold: 0.7 }",
     lambda x: (x > 0.7).astype(np.float32)),
]
NEURON_IDS = [t for t, _ in NEURONS]


@pytest.mark.parametrize("text,ref", NEURONS, ids=NEURON_IDS)
def test_neuron_forward(text, ref):
    x = randn(2, 3, 4, 5) * 2
    x.flat[:4] = 0, 0.7, -0.5, 1.25       # on the threshold and the clip bounds
    (y,) = forward(text, x)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, ref(x), rtol=2e-6, atol=1e-6)


def test_bnll_and_exp_stay_finite_far_out():
    x = np.array([-200, -90, -50, 0, 50, 90, 200], np.float32)
    (y,) = forward("type: 'BNLL'", x)
    np.testing.assert_allclose(y, np.maximum(x, 0) + np.log1p(np.exp(-np.abs(f64(x)))),
                               rtol=1e-6, atol=1e-37)
    _, (dx,) = backward("type: 'BNLL'", [x], [np.ones_like(x)], [True])
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx, sigmoid_ref(x), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("text", [
    "type: 'BNLL'",
    "type: 'Clip' clip_param { min: -0.5 max: 1.25 }",
    "type: 'Exp'",
    "type: 'Exp' exp_param { base: 2 scale: 0.5 shift: 1 }",
    "type: 'Log' log_param { shift: 6 }",
    "type: 'Log' log_param { base: 10 scale: 2 shift: 16 }",
    "type: 'Swish'",
    "type: 'Swish' swish_param { beta: 2.5 }",
    "type: 'Swish' swish_param { beta: -0.5 }",
])
def test_neuron_gradient(text):
    x = randn(2, 3, 3, 4, seed=1) * 2
    # Clip's kinks sit at its bounds; keep the checker's steps off them.
    kink = {"kink": lambda v: min(abs(v + 0.5), abs(v - 1.25)), "kink_range": 0.02}
    assert check_gradient(make_layer(f"name: 'l' {text}"), blobs_from([x]),
                          **(kink if "Clip" in text else {})) > 50


def test_clip_gradient_passes_inside_closed_range():
    x = np.array([-1, -0.5, 0, 1.25, 2], np.float32)
    _, (dx,) = backward("type: 'Clip' clip_param { min: -0.5 max: 1.25 }", [x],
                        [np.full(5, 3, np.float32)], [True])
    np.testing.assert_array_equal(dx, [0, 3, 3, 3, 0])


def test_threshold_backward_is_zero():
    x = randn(3, 4)
    _, (dx,) = backward("type: 'Threshold'", [x], [randn(3, 4, seed=1)], [True])
    np.testing.assert_array_equal(dx, 0)


@pytest.mark.parametrize("text", NEURON_IDS)
def test_neuron_in_place_matches_separate_top(text):
    x, dy = randn(2, 3, 4, 5, seed=3) * 2, randn(2, 3, 4, 5, seed=4)
    want = []
    for in_place in (False, True):
        layer = make_layer(f"name: 'l' {text}")
        bottom = blobs_from([x])
        top = bottom if in_place else [Blob()]
        for _ in range(2):              # a second pass reuses the buffers
            bottom[0].data[...] = x
            layer.setup(bottom, top)
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
            y = top[0].data.copy()
            top[0].diff[...] = dy
            layer.backward(top, [True], bottom)
            want.append((y, bottom[0].diff.copy()))
    for got in want[1:]:
        np.testing.assert_allclose(got[0], want[0][0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[1], want[0][1], rtol=1e-6, atol=1e-7)


# -- ArgMax -------------------------------------------------------------------------------------
def argmax_ref(x, top_k, out_max_val, axis):
    """Caffe's loop: per vector, (value, index) pairs sorted descending, the first top_k."""
    def ranked(values):
        return sorted(((v, j) for j, v in enumerate(values)), reverse=True)[:top_k]

    if axis is None:
        rows = x.reshape(x.shape[0], -1)
        out = np.ones([x.shape[0], 2 if out_max_val else 1, top_k] + [1] * (x.ndim - 3))
        for i, row in enumerate(rows):
            pairs = ranked(row)
            out[i, 0, :].flat = [j for _, j in pairs]
            if out_max_val:
                out[i, 1, :].flat = [v for v, _ in pairs]
        return out
    moved = np.moveaxis(x, axis, -1)
    out = np.zeros(moved.shape[:-1] + (top_k,))
    for idx in np.ndindex(moved.shape[:-1]):
        out[idx] = [v if out_max_val else j for v, j in ranked(moved[idx])]
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("top_k,out_max_val,axis", [
    (1, False, None), (3, False, None), (2, True, None), (1, True, None),
    (1, False, 1), (2, False, 1), (2, True, 1), (2, False, -1), (1, True, 0), (2, True, 2)])
def test_argmax_forward(top_k, out_max_val, axis):
    x = np.round(randn(2, 3, 4, 2, seed=5) * 2) / 2      # ties, which rank the higher index first
    param = f"top_k: {top_k} out_max_val: {str(out_max_val).lower()}"
    if axis is not None:
        param += f" axis: {axis}"
    (y,) = forward(f"type: 'ArgMax' argmax_param {{ {param} }}", x)
    want = argmax_ref(x, top_k, out_max_val, axis)
    assert y.shape == want.shape
    np.testing.assert_array_equal(y, want)


def test_argmax_pads_small_bottoms_to_three_axes():
    x = randn(4, 6)
    (y,) = forward("type: 'ArgMax'", x)
    assert y.shape == (4, 1, 1)
    np.testing.assert_array_equal(y.reshape(4), x.argmax(axis=1))


def test_argmax_backward_zero_for_indices_refused_for_values():
    x = randn(2, 5)
    _, (dx,) = backward("type: 'ArgMax'", [x], [np.ones((2, 1, 1), np.float32)], [True])
    np.testing.assert_array_equal(dx, 0)
    with pytest.raises(ShapeError, match="out_max_val"):
        backward("type: 'ArgMax' argmax_param { out_max_val: true axis: 1 }", [x],
                 [np.ones((2, 1), np.float32)], [True])


# -- Reduction ----------------------------------------------------------------------------------
REDUCTIONS = {"SUM": lambda r: r.sum(1), "ASUM": lambda r: np.abs(r).sum(1),
              "SUMSQ": lambda r: (r * r).sum(1), "MEAN": lambda r: r.mean(1)}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@pytest.mark.parametrize("axis,coeff", [(0, 1), (1, -0.5), (2, 2), (-1, 1)])
def test_reduction_forward_and_gradient(op, axis, coeff):
    x = randn(2, 3, 4, seed=6)
    text = f"type: 'Reduction' reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}"
    (y,) = forward(text, x)
    lead = x.shape[:axis % 3]
    assert y.shape == lead
    want = coeff * REDUCTIONS[op](f64(x).reshape(int(np.prod(lead)), -1))
    np.testing.assert_allclose(y.reshape(-1), want, rtol=1e-5, atol=1e-6)
    kink = {"kink": lambda v: v, "kink_range": 0.02} if op == "ASUM" else {}
    assert check_gradient(make_layer(f"name: 'l' {text}"), blobs_from([x]), **kink) == x.size


def test_reduction_default_is_sum_of_everything():
    x = randn(2, 3)
    (y,) = forward("type: 'Reduction'", x)
    assert y.shape == ()
    np.testing.assert_allclose(y, f64(x).sum(), rtol=1e-6)


# -- MVN ----------------------------------------------------------------------------------------
def mvn_ref(x, normalize_variance=True, across_channels=False, eps=1e-9):
    x4 = f64(x).reshape(x.shape + (1,) * (4 - x.ndim))
    axes = (1, 2, 3) if across_channels else (2, 3)
    c = x4 - x4.mean(axis=axes, keepdims=True)
    if normalize_variance:
        c /= np.sqrt((c * c).mean(axis=axes, keepdims=True)) + eps
    return c


MVN_PARAMS = [{}, {"across_channels": True}, {"normalize_variance": False},
              {"normalize_variance": False, "across_channels": True}, {"eps": 0.25},
              {"eps": 0.25, "across_channels": True}]
# Where eps is small against the std, Caffe's backward (syncsgd's) is the exact gradient.
MVN_EXACT = [p for p in MVN_PARAMS if "eps" not in p]


def mvn_text(params):
    fields = " ".join(f"{k}: {str(v).lower()}" for k, v in params.items())
    return f"type: 'MVN' mvn_param {{ {fields} }}"


@pytest.mark.parametrize("params", MVN_PARAMS, ids=str)
def test_mvn_forward(params):
    x = randn(2, 3, 4, 5, seed=7) * 3 + 1
    (y,) = forward(mvn_text(params), x)
    np.testing.assert_allclose(y, mvn_ref(x, **params), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", MVN_EXACT, ids=str)
def test_mvn_gradient(params):
    x = randn(2, 3, 2, 3, seed=8) * 0.3
    assert check_gradient(make_layer(f"name: 'l' {mvn_text(params)}"), blobs_from([x])) > 0


def test_mvn_gradient_equals_caffes_formula_for_small_eps():
    x, dy = randn(2, 3, 4, 5, seed=9), randn(2, 3, 4, 5, seed=10)
    (y,) = forward("type: 'MVN'", x)
    _, (dx,) = backward("type: 'MVN'", [x], [dy], [True])
    y, g = y.reshape(6, -1), f64(dy).reshape(6, -1)
    std = np.sqrt(((f64(x) - f64(x).mean(axis=(2, 3), keepdims=True)) ** 2).mean(
        axis=(2, 3)).reshape(6, 1)) + 1e-9
    caffe = (g - g.mean(1, keepdims=True) - y * (g * y).mean(1, keepdims=True)) / std
    np.testing.assert_allclose(dx.reshape(6, -1), caffe, rtol=1e-4, atol=1e-5)


def test_mvn_constant_rows_and_low_rank_bottoms():
    x = np.zeros((2, 3, 2, 2), np.float32)
    x[1] = 4
    (y,) = forward("type: 'MVN'", x)
    np.testing.assert_array_equal(y, 0)
    _, (dx,) = backward("type: 'MVN'", [x], [randn(2, 3, 2, 2)], [True])
    assert np.isfinite(dx).all()
    (y,) = forward("type: 'MVN' mvn_param { across_channels: true }", randn(3, 4))
    assert y.shape == (3, 4, 1, 1)       # Caffe's top is legacy 4-D
    np.testing.assert_allclose(y, mvn_ref(randn(3, 4), across_channels=True), atol=1e-5)


# -- Tile ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis,tiles", [(0, 2), (1, 3), (2, 1), (-1, 2)])
def test_tile_forward_and_gradient(axis, tiles):
    x = randn(2, 3, 4, seed=11)
    text = f"type: 'Tile' tile_param {{ axis: {axis} tiles: {tiles} }}"
    (y,) = forward(text, x)
    reps = [1, 1, 1]
    reps[axis] = tiles
    np.testing.assert_array_equal(y, np.tile(x, reps))
    assert check_gradient(make_layer(f"name: 'l' {text}"), blobs_from([x])) == x.size


# -- Parameter ----------------------------------------------------------------------------------
def test_parameter_forward_backward_and_gradient():
    layer = make_layer("name: 'p' type: 'Parameter' parameter_param { shape { dim: 2 dim: 3 } }")
    top = run_forward(layer, [])
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (2, 3)
    np.testing.assert_array_equal(top[0].data, 0)
    layer.blobs[0].data[...] = randn(2, 3)
    layer.blobs[0].diff[...] = 1
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, layer.blobs[0].data)
    top[0].diff[...] = randn(2, 3, seed=1)
    layer.backward(top, [], [])
    np.testing.assert_allclose(layer.blobs[0].diff, 1 + randn(2, 3, seed=1))
    assert check_gradient(layer, []) == 6


def test_parameter_refuses_bottoms():
    with pytest.raises(ShapeError, match="'p'"):
        run_forward(make_layer("name: 'p' type: 'Parameter'"), blobs_from([randn(2)]))


# -- Embed --------------------------------------------------------------------------------------
EMBED = ("type: 'Embed' embed_param { num_output: 4 input_dim: 6 "
         "weight_filler { type: 'gaussian' } bias_filler { type: 'uniform' min: -1 max: 1 } }")


def test_embed_forward_and_gradient():
    index = np.array([[0, 5, 2], [2, 2, 1]], np.float32)
    layer = make_layer(f"name: 'e' {EMBED}")
    (top,) = run_forward(layer, blobs_from([index]))
    weight, bias = layer.blobs[0].data, layer.blobs[1].data
    assert weight.shape == (6, 4) and bias.shape == (4,) and np.abs(weight).sum() > 0
    assert top.shape == (2, 3, 4)
    np.testing.assert_allclose(top.data, weight[index.astype(int)] + bias, rtol=1e-6)
    # Repeated indices (2 three times) accumulate into one weight row.
    assert check_gradient(layer, blobs_from([index]), check_bottom=[]) == 24 + 4


def test_embed_without_bias_and_default_fillers():
    index = np.array([3, 0, 3], np.float32)
    layer = make_layer("name: 'e' type: 'Embed' embed_param { num_output: 2 input_dim: 4 "
                       "bias_term: false }")
    (top,) = run_forward(layer, blobs_from([index]))
    assert len(layer.blobs) == 1
    np.testing.assert_array_equal(top.data, np.zeros((3, 2)))   # Caffe's default: constant 0
    top.diff[...] = [[1, 2], [3, 4], [5, 6]]
    layer.backward([top], [False], blobs_from([index]))
    np.testing.assert_array_equal(layer.blobs[0].diff, [[3, 4], [0, 0], [0, 0], [6, 8]])


@pytest.mark.parametrize("bad", [6, -1, 1.5])
def test_embed_refuses_bad_indices(bad):
    with pytest.raises(ShapeError, match="integer index in \\[0, 6\\)"):
        forward(EMBED, np.array([1, bad], np.float32))


def test_embed_refuses_gradient_to_indices():
    with pytest.raises(ShapeError, match="propagate_down"):
        backward(EMBED, [np.array([1, 2], np.float32)], [np.ones((2, 4), np.float32)], [True])


# -- BatchReindex -------------------------------------------------------------------------------
def test_batch_reindex_forward_and_gradient():
    x = randn(4, 2, 3, seed=12)
    index = np.array([2, 0, 2, 3, 2], np.float32)
    (y,) = forward("type: 'BatchReindex'", x, index)
    np.testing.assert_array_equal(y, x[[2, 0, 2, 3, 2]])
    # Row 2 feeds three top rows and row 1 none: accumulation and zeros both checked.
    layer = make_layer("name: 'l' type: 'BatchReindex'")
    assert check_gradient(layer, blobs_from([x, index]), check_bottom=[0]) == x.size
    _, (dx, _) = backward("type: 'BatchReindex'", [x, index], [np.ones((5, 2, 3), np.float32)],
                          [True, False])
    np.testing.assert_array_equal(dx[:, 0, 0], [1, 0, 3, 1])


def test_batch_reindex_refuses_gradient_to_indices():
    with pytest.raises(ShapeError, match="bottom 1"):
        backward("type: 'BatchReindex'", [randn(3, 2), np.array([0, 1], np.float32)],
                 [np.ones((2, 2), np.float32)], [True, True])


# -- Filter -------------------------------------------------------------------------------------
def test_filter_forward_and_gradient():
    data, label = randn(5, 2, 3, seed=13), np.arange(5, dtype=np.float32).reshape(5, 1)
    selector = np.array([0, 1, 0, 2.5, -1], np.float32).reshape(5, 1, 1)
    ys = forward("type: 'Filter' top: 'a' top: 'b'", data, label, selector, n_top=2)
    keep = [1, 3, 4]
    np.testing.assert_array_equal(ys[0], data[keep])
    np.testing.assert_array_equal(ys[1], label[keep])
    layer = make_layer("name: 'l' type: 'Filter' top: 'a' top: 'b'")
    assert check_gradient(layer, blobs_from([data, label, selector]), n_top=2,
                          check_bottom=[0, 1]) == data.size + label.size
    _, (dx, _) = backward("type: 'Filter'", [data, selector], [np.ones((3, 2, 3), np.float32)],
                             [True, False])
    np.testing.assert_array_equal(dx[:, 0, 0], [0, 1, 0, 1, 1])


def test_filter_resizes_with_the_selector_and_may_keep_nothing():
    layer = make_layer("name: 'l' type: 'Filter'")
    bottom = blobs_from([randn(3, 2), np.zeros(3, np.float32)])
    (top,) = run_forward(layer, bottom)
    assert top.shape == (0, 2)
    top.diff[...] = 0
    layer.backward([top], [True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff, 0)
    bottom[1].data[...] = [1, 1, 0]
    layer.reshape(bottom, [top])
    layer.forward(bottom, [top])
    np.testing.assert_array_equal(top.data, bottom[0].data[:2])


def test_filter_refuses_gradient_to_selector():
    with pytest.raises(ShapeError, match="selector"):
        backward("type: 'Filter'", [randn(2, 2), np.ones(2, np.float32)],
                 [np.ones((2, 2), np.float32)], [True, True])


# -- parameter and shape errors -----------------------------------------------------------------
BAD = [
    ("type: 'BNLL'", [(2,), (2,)], "takes 1 bottom"),
    ("type: 'Clip'", [(2,)], "needs both min and max"),
    ("type: 'Clip' clip_param { min: 1 max: 0 }", [(2,)], "min 1.0 is above"),
    ("type: 'Exp' exp_param { base: -2 }", [(2,)], "exp_param.base must be positive"),
    ("type: 'Exp' exp_param { base: 0 }", [(2,)], "exp_param.base must be positive"),
    ("type: 'Log' log_param { base: 1 }", [(2,)], "base 1 has no logarithm"),
    ("type: 'Log' log_param { base: -3 }", [(2,)], "log_param.base must be positive"),
    ("type: 'ArgMax' argmax_param { top_k: 0 }", [(2, 3)], "top_k must be at least 1"),
    ("type: 'ArgMax' argmax_param { top_k: 7 }", [(2, 3, 2)], "top_k 7 is more than the 6"),
    ("type: 'ArgMax' argmax_param { top_k: 4 axis: 1 }", [(2, 3, 5)], "top_k 4 is more than"),
    ("type: 'ArgMax' argmax_param { axis: 3 }", [(2, 3, 5)], "axis 3 out of range"),
    ("type: 'Reduction' reduction_param { axis: 3 }", [(2, 3, 5)], "axis 3 out of range"),
    ("type: 'Reduction' reduction_param { axis: -4 }", [(2, 3, 5)], "axis -4 out of range"),
    ("type: 'MVN'", [(2, 3, 2, 2, 2)], "at most 4 axes"),
    ("type: 'Tile'", [(2, 3)], "tiles must be set"),
    ("type: 'Tile' tile_param { tiles: 0 }", [(2, 3)], "tiles must be positive"),
    ("type: 'Tile' tile_param { tiles: 2 axis: 2 }", [(2, 3)], "axis 2 out of range"),
    ("type: 'Embed' embed_param { input_dim: 3 }", [(2,)], "num_output must be set"),
    ("type: 'Embed' embed_param { num_output: 3 }", [(2,)], "input_dim must be set"),
    ("type: 'BatchReindex'", [(3, 2), (2, 1)], "must be a 1-D blob"),
    ("type: 'BatchReindex'", [(3, 2)], "takes 2 bottom"),
    ("type: 'Filter'", [(3, 2), (3, 2), (3,)], "one top per filtered bottom"),
    ("type: 'Filter'", [(3,)], "at least 2 bottom"),
    ("type: 'Filter'", [(3, 2), (3, 2)], "selector \\(last bottom\\) must have shape"),
    ("type: 'Filter'", [(3, 2), (4, 1)], "bottom 0 has shape \\(3, 2\\) but the selector has 4"),
]


@pytest.mark.parametrize("text,shapes,message", BAD, ids=[f"{t} {s}" for t, s, _ in BAD])
def test_bad_params_and_shapes_are_refused(text, shapes, message):
    with pytest.raises(ShapeError, match=f"'l'.*{message}"):
        forward(text, *[np.zeros(s, np.float32) for s in shapes])


@pytest.mark.parametrize("index", [[0, 3], [-1, 0], [0.5, 1]])
def test_batch_reindex_refuses_bad_indices(index):
    with pytest.raises(ShapeError, match="integer index in \\[0, 3\\)"):
        forward("type: 'BatchReindex'", randn(3, 2), np.array(index, np.float32))


# -- inside a Net -------------------------------------------------------------------------------
# (layer text, {input name: array}, tops, bottoms that take a gradient)
NETS = [
    ("type: 'BNLL'", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Clip' clip_param { min: -0.2 max: 0.4 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Exp' exp_param { base: 3 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Log' log_param { shift: 5 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Swish' swish_param { beta: 1.5 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Threshold' threshold_param { threshold: 0.2 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'ArgMax' argmax_param { top_k: 2 }", {"x": randn(2, 3, 4)}, 1, [0]),
    ("type: 'Reduction' reduction_param { operation: SUMSQ axis: 1 }", {"x": randn(2, 3, 4)}, 1,
     [0]),
    ("type: 'MVN'", {"x": randn(2, 3, 4, 4)}, 1, [0]),
    ("type: 'Tile' tile_param { tiles: 3 }", {"x": randn(2, 3)}, 1, [0]),
    ("type: 'Parameter' parameter_param { shape { dim: 2 dim: 2 } }", {}, 1, []),
    (EMBED, {"x": np.array([[1, 0], [5, 5]], np.float32)}, 1, []),
    ("type: 'BatchReindex'", {"x": randn(3, 2), "i": np.array([2, 2, 0, 1], np.float32)}, 1, [0]),
    ("type: 'Filter'", {"x": randn(3, 2), "y": randn(3, 1, 2),
                        "s": np.array([1, 0, 1], np.float32)}, 2, [0, 1]),
]


def net_text(layer, inputs, n_top):
    shapes = "".join(f" shape {{ {' '.join(f'dim: {d}' for d in a.shape)} }}"
                     for a in inputs.values())
    data = "".join(f" top: '{name}'" for name in inputs)
    bottoms = "".join(f" bottom: '{name}'" for name in inputs)
    tops = "".join(f" top: 'out{j}'" for j in range(n_top))
    text = "name: 'catalogue' force_backward: true\n"
    if inputs:
        text += f"layer {{ name: 'data' type: 'Input'{data} input_param {{{shapes} }} }}\n"
    return text + f"layer {{ name: 'l'{bottoms}{tops} {layer} }}\n"


@pytest.mark.parametrize("layer,inputs,n_top,grads", NETS, ids=[t for t, *_ in NETS])
def test_builds_and_runs_in_a_net(tmp_path, layer, inputs, n_top, grads):
    path = tmp_path / "net.prototxt"
    path.write_text(net_text(layer, inputs, n_top))
    net = syncsgd.Net(str(path), syncsgd.TRAIN)
    assert net.layer_dict["l"].type == text_format.Parse(layer, pb.LayerParameter()).type
    for k, p in enumerate(net.params.get("l", [])):
        p.data[...] = randn(*p.shape, seed=40 + k)      # Parameter starts at zeros
    out = net.forward(**inputs)
    # The same layer on its own: same values, same gradients.
    alone = make_layer(f"name: 'l' {layer}")
    bottom = blobs_from(list(inputs.values()))
    tops = [Blob() for _ in range(n_top)]
    alone.setup(bottom, tops)
    for mine, theirs in zip(alone.blobs, net.params.get("l", [])):
        mine.data[...] = theirs.data          # the net's seed draws other initial weights
    alone.reshape(bottom, tops)
    alone.forward(bottom, tops)
    for j, t in enumerate(tops):
        np.testing.assert_array_equal(out[f"out{j}"], t.data)
    dys = {f"out{j}": randn(*t.shape, seed=20 + j) for j, t in enumerate(tops)}
    for p in net.params.get("l", []):
        p.diff[...] = 0
    diffs = net.backward(**dys)
    for t, dy in zip(tops, dys.values()):
        t.diff[...] = dy
    alone.backward(tops, [i in grads for i in range(len(bottom))], bottom)
    for i in grads:
        np.testing.assert_allclose(diffs[list(inputs)[i]], bottom[i].diff, rtol=1e-6, atol=1e-7)
    for got, want in zip(net.params.get("l", []), alone.blobs):
        np.testing.assert_allclose(got.diff, want.diff, rtol=1e-6, atol=1e-7)


def test_registered_under_caffe_type_names():
    assert {"BNLL", "Clip", "Exp", "Log", "Swish", "Threshold", "ArgMax", "Reduction", "MVN",
            "Tile", "Parameter", "Embed", "BatchReindex", "Filter"} <= set(known_types())


# -- OpenCV -------------------------------------------------------------------------------------
OPENCV = [
    ("type: 'BNLL'", 2), ("type: 'Exp'", 2),
    ("type: 'Exp' exp_param { base: 2 scale: 0.5 shift: 1 }", 2),
    ("type: 'Log'", 1), ("type: 'Swish'", 2), ("type: 'MVN'", 2),
    ("type: 'MVN' mvn_param { across_channels: true }", 2),
    ("type: 'MVN' mvn_param { normalize_variance: false }", 2),
    # Types OpenCV's Caffe importer may not create: compared where it does.
    ("type: 'Clip' clip_param { min: -0.5 max: 0.5 }", 2), ("type: 'Threshold'", 2),
    ("type: 'ArgMax' argmax_param { axis: 1 }", 2),
    ("type: 'Reduction' reduction_param { axis: 1 }", 2),
    ("type: 'Tile' tile_param { tiles: 2 }", 2),
]


@pytest.mark.parametrize("layer,scale", OPENCV, ids=[t for t, _ in OPENCV])
def test_equals_opencv(tmp_path, layer, scale):
    cv2 = pytest.importorskip("cv2")
    x = uniform(0.05, scale, 2, 3, 4, 5, seed=30) if "Log" in layer else randn(2, 3, 4, 5) * scale
    path = tmp_path / "net.prototxt"
    path.write_text(net_text(layer, {"x": x}, 1))
    try:
        cv = cv2.dnn.readNetFromCaffe(str(path))
        cv.setInput(x)
        theirs = cv.forward("l")
    except cv2.error as e:
        if "Can't create layer" in str(e) or "not implemented" in str(e).lower():
            pytest.skip(f"OpenCV {cv2.__version__} does not implement this Caffe layer")
        raise
    ours = syncsgd.Net(str(path), syncsgd.TEST).forward(x=x)["out0"]
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
