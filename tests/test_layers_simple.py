"""Elementwise (ReLU, ELU, Sigmoid, TanH, AbsVal, Power), Softmax, structural (Concat, Slice,
Split, Eltwise, Flatten, Reshape, Silence) and data (Input, DummyData) layers: forward values
against numpy references written here, numeric gradient checks, in-place use, and DummyData's
slicing of the global batch between ranks."""
import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN, Net
from syncsgd.blob import Blob
from syncsgd.context import Context
from syncsgd.errors import PrototxtError, ShapeError
from syncsgd.layers import create
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def uniform(lo, hi, *shape, seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def forward(text, *arrays, n_top=1):
    top = run_forward(make_layer(text), blobs_from(arrays), n_top)
    return [t.data.copy() for t in top]


def forward_backward(layer, bottom, top, dy):
    """Setup, forward, backward from top diffs `dy`; returns copies of top data and bottom diffs."""
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    out = [t.data.copy() for t in top]
    for t, d in zip(top, dy):
        t.diff[...] = d
    layer.backward(top, [True] * len(bottom), bottom)
    return out, [b.diff.copy() for b in bottom]


# -- neuron layers -------------------------------------------------------------------------------
def elu_ref(x, alpha):
    return np.where(x > 0, x, alpha * (np.exp(x.astype(np.float64)) - 1))


NEURONS = [
    ("type: 'ReLU'", lambda x: np.maximum(x, 0)),
    ("type: 'ReLU' relu_param { negative_slope: 0.1 }", lambda x: np.where(x > 0, x, 0.1 * x)),
    ("type: 'ReLU' relu_param { negative_slope: -0.5 }",
     lambda x: np.where(x > 0, x, -0.5 * x)),
    ("type: 'ELU'", lambda x: elu_ref(x, 1.0)),
    ("type: 'ELU' elu_param { alpha: 0.5 }", lambda x: elu_ref(x, 0.5)),
    ("type: 'ELU' elu_param { alpha: -0.3 }", lambda x: elu_ref(x, -0.3)),
    ("type: 'Sigmoid'", lambda x: 1 / (1 + np.exp(-x.astype(np.float64)))),
    ("type: 'TanH'", lambda x: np.tanh(x.astype(np.float64))),
    ("type: 'AbsVal'", np.abs),
    ("type: 'Power' power_param { power: 2 scale: 0.5 shift: -1 }",
     lambda x: (-1 + 0.5 * x) ** 2),
    ("type: 'Power' power_param { power: 3 scale: -0.5 shift: 1 }",
     lambda x: (1 - 0.5 * x) ** 3),
    ("type: 'Power' power_param { power: 1 scale: 2 shift: 0.5 }", lambda x: 0.5 + 2 * x),
    ("type: 'Power' power_param { power: 0 scale: 2 shift: 0.5 }", lambda x: np.ones_like(x)),
    ("type: 'Power' power_param { power: 2 scale: 0 shift: 3 }",
     lambda x: np.full_like(x, 9.0)),
]


@pytest.mark.parametrize("text,ref", NEURONS, ids=[t for t, _ in NEURONS])
def test_neuron_forward(text, ref):
    x = randn(2, 3, 4, 5) * 2
    x.flat[:3] = 0, 1e-3, -1e-3
    (y,) = forward(text, x)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, ref(x), rtol=1e-5, atol=1e-6)


def test_sigmoid_in_pieces_on_threads(thread_budget):
    """Blobs of more than 2^18 values run Sigmoid in pieces shared out to the threads, the
    overflow of exp(-x) for x < -88 silenced in each: forward as in float64, gradient from
    the float32 output."""
    import warnings
    thread_budget(2)
    x = randn(3, 200, 1000) * 10
    x[2, 199, -3:] = -100, -1000, 1000
    layer = make_layer("type: 'Sigmoid'")
    bottom = blobs_from([x])
    dy = randn(3, 200, 1000, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        top = run_forward(layer, bottom)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
    with np.errstate(over="ignore"):
        y = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(top[0].data, y, rtol=1e-5, atol=1e-7)
    y32 = top[0].data          # 1 - y near 1 is what float32 keeps of it, in any pieces
    np.testing.assert_allclose(bottom[0].diff, dy * (y32 * (1 - y32)), rtol=1e-6, atol=0)


def test_power_fractional_forward():
    x = uniform(0.5, 2, 3, 4)
    (y,) = forward("type: 'Power' power_param { power: 0.5 scale: 2 shift: 0.25 }", x)
    np.testing.assert_allclose(y, np.sqrt(0.25 + 2 * x), rtol=1e-6)


def kink_at_zero(v):
    return v


@pytest.mark.parametrize("text,kinked", [
    ("type: 'ReLU'", True),
    ("type: 'ReLU' relu_param { negative_slope: 0.1 }", True),
    ("type: 'ReLU' relu_param { negative_slope: -0.5 }", True),
    ("type: 'ELU'", False),
    ("type: 'ELU' elu_param { alpha: 0.5 }", True),
    ("type: 'Sigmoid'", False),
    ("type: 'TanH'", False),
    ("type: 'AbsVal'", True),
])
def test_neuron_gradient(text, kinked):
    x = randn(2, 3, 3, 4, seed=1) * 2
    kw = dict(kink=kink_at_zero, kink_range=0.02) if kinked else {}
    assert check_gradient(make_layer(text), blobs_from([x]), **kw) > 50


@pytest.mark.parametrize("power,scale,shift", [
    (0, 1, 0), (1, 1, 0), (1, -2, 0.5), (2, 1, 0), (2, 0.5, -1), (0.5, 1, 0), (0.5, 2, 0.25),
    (3, -0.5, 1), (-1, 1, 0.5), (2, 0, 3)])
def test_power_gradient(power, scale, shift):
    x = uniform(0.5, 2, 2, 3, 4, seed=2)   # positive, so fractional and negative powers apply
    text = f"type: 'Power' power_param {{ power: {power} scale: {scale} shift: {shift} }}"
    assert check_gradient(make_layer(text), blobs_from([x])) > 0


IN_PLACE = [t for t, _ in NEURONS] + [
    "type: 'Power' power_param { power: 0.5 scale: 2 shift: 0.25 }", "type: 'Softmax'",
    "type: 'Softmax' softmax_param { axis: 2 }"]


@pytest.mark.parametrize("text", IN_PLACE)
def test_in_place_matches_separate_top(text):
    x = randn(2, 3, 4, 5, seed=3) * 2
    if "0.5 scale" in text:
        x = np.abs(x) + 0.1
    dy = randn(*x.shape, seed=4)
    want_y, want_dx = forward_backward(make_layer(text), blobs_from([x]), [Blob()], [dy])
    blob = blobs_from([x])[0]
    got_y, got_dx = forward_backward(make_layer(text), [blob], [blob], [dy])
    np.testing.assert_allclose(got_y[0], want_y[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_dx[0], want_dx[0], rtol=1e-6, atol=1e-7)
    # A second pass reuses the kept-input buffer.
    blob.data[...] = x * 0.5
    got_y, got_dx = forward_backward(make_layer(text), [blob], [blob], [dy])
    want_y, want_dx = forward_backward(make_layer(text), blobs_from([x * 0.5]), [Blob()], [dy])
    np.testing.assert_allclose(got_y[0], want_y[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_dx[0], want_dx[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("in_place", [False, True])
def test_relu_in_pieces_on_threads(in_place, monkeypatch):
    """Pieces shared out to threads (in another order, the last one short) give the
    whole-array result."""
    from syncsgd.kernels import blas
    from syncsgd.layers import relu
    monkeypatch.setattr(relu, "in_pieces", lambda work, size: blas.in_pieces(work, size, 7))
    monkeypatch.setattr(blas, "spread", lambda items, work: [work(i, n % 2)
                                                            for n, i in enumerate(items[::-1])])
    x, dy = randn(3, 2, 5, 4), randn(3, 2, 5, 4, seed=1)
    blob = blobs_from([x])[0]
    top = blob if in_place else Blob()
    y, dx = forward_backward(make_layer("name: 'r' type: 'ReLU'"), [blob], [top], [dy])
    np.testing.assert_array_equal(y[0], np.maximum(x, 0))
    np.testing.assert_array_equal(dx[0], dy * (x > 0))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("numba", ["1", "0"])
def test_relu_gradient_is_numpys_to_the_bit(numba, in_place, monkeypatch):
    """The compiled gradient (kernels/relu.py) and numpy's dy * (y > 0): -0 for a negative dy
    where y <= 0, NaN for an infinite one, 0 where y is NaN."""
    monkeypatch.setenv("SYNCSGD_NUMBA", numba)
    x = np.array([1.5, -2.0, 0.0, -0.0, np.nan, 3.0, -1.0, 2.0, np.inf, -np.inf], np.float32)
    dy = np.array([-1.0, -3.0, 2.0, -4.0, 5.0, np.inf, np.inf, np.nan, -0.5, 1.0], np.float32)
    x, dy = np.tile(x, 41), np.tile(dy, 41)      # past a vector's width, with a tail
    blob = blobs_from([x])[0]
    with np.errstate(invalid="ignore"):          # inf * 0
        _, dx = forward_backward(make_layer("name: 'r' type: 'ReLU'"), [blob],
                                 [blob if in_place else Blob()], [dy])
        want = dy * (x > 0)
    np.testing.assert_array_equal(dx[0].view(np.int32), want.view(np.int32))


def test_neuron_refuses_two_bottoms():
    layer = make_layer("name: 'r' type: 'ReLU'")
    with pytest.raises(ShapeError, match="'r'"):
        run_forward(layer, blobs_from([randn(2), randn(2)]))


# -- softmax -------------------------------------------------------------------------------------
def softmax_ref(x, axis):
    x = x.astype(np.float64)
    out = np.empty_like(x)
    moved, dest = np.moveaxis(x, axis, -1), np.moveaxis(out, axis, -1)
    for idx in np.ndindex(moved.shape[:-1]):
        e = np.exp(moved[idx] - moved[idx].max())
        dest[idx] = e / e.sum()
    return out


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax_forward(axis):
    x = randn(2, 3, 4, 2) * 5
    x[0, 0, 0, 0] = 80      # must not overflow
    (y,) = forward(f"type: 'Softmax' softmax_param {{ axis: {axis} }}", x)
    np.testing.assert_allclose(y, softmax_ref(x, axis), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_softmax_gradient(axis):
    x = randn(2, 4, 3, 2, seed=5)
    text = f"type: 'Softmax' softmax_param {{ axis: {axis} }}"
    assert check_gradient(make_layer(text), blobs_from([x])) > 0


# -- concat / slice / split ----------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat_forward_and_gradient(axis):
    shapes = [[2, 3, 4, 2] for _ in range(3)]
    for k, size in enumerate([1, 2, 3]):
        shapes[k][axis] = size
    xs = [randn(*s, seed=k) for k, s in enumerate(shapes)]
    text = f"type: 'Concat' concat_param {{ axis: {axis} }}"
    (y,) = forward(text, *xs)
    np.testing.assert_array_equal(y, np.concatenate(xs, axis))
    assert check_gradient(make_layer(text), blobs_from(xs)) > 0


def test_concat_legacy_dim_and_errors():
    xs = [randn(2, 3, 2), randn(2, 3, 1)]
    (y,) = forward("type: 'Concat' concat_param { concat_dim: 2 }", *xs)
    np.testing.assert_array_equal(y, np.concatenate(xs, 2))
    with pytest.raises(ShapeError, match="not both"):
        forward("type: 'Concat' concat_param { concat_dim: 2 axis: 2 }", *xs)
    with pytest.raises(ShapeError, match="concat axis 1"):
        forward("type: 'Concat'", *xs)
    with pytest.raises(ShapeError, match="out of range"):
        forward("type: 'Concat' concat_param { axis: 3 }", *xs)


@pytest.mark.parametrize("axis,points", [(0, [1]), (1, [1, 3]), (2, []), (-1, [1])])
def test_slice_forward_and_gradient(axis, points):
    x = randn(2, 4, 4, 3, seed=6)
    n_top = len(points) + 1 if points else 2
    extra = "".join(f" slice_point: {p}" for p in points)
    text = f"type: 'Slice' slice_param {{ axis: {axis}{extra} }}"
    tops = forward(text, x, n_top=n_top)
    want = np.split(x, points or n_top, axis)
    assert len(tops) == len(want)
    for got, ref in zip(tops, want):
        np.testing.assert_array_equal(got, ref)
    assert check_gradient(make_layer(text), blobs_from([x]), n_top=n_top) > 0


def test_slice_legacy_dim_and_errors():
    x = randn(2, 6, 3)
    tops = forward("type: 'Slice' slice_param { slice_dim: 1 }", x, n_top=3)
    for got, ref in zip(tops, np.split(x, 3, 1)):
        np.testing.assert_array_equal(got, ref)
    with pytest.raises(ShapeError, match="split equally"):
        forward("type: 'Slice' slice_param { axis: 2 }", x, n_top=2)
    with pytest.raises(ShapeError, match="increase strictly"):
        forward("type: 'Slice' slice_param { axis: 1 slice_point: 4 slice_point: 2 }", x,
                n_top=3)
    with pytest.raises(ShapeError, match="one fewer"):
        forward("type: 'Slice' slice_param { axis: 1 slice_point: 2 }", x, n_top=3)


def test_split_copies_and_sums_gradients():
    x = randn(2, 3, 2)
    tops = forward("type: 'Split'", x, n_top=3)
    for t in tops:
        np.testing.assert_array_equal(t, x)
    layer = make_layer("type: 'Split'")
    top = [Blob() for _ in range(3)]
    dys = [randn(2, 3, 2, seed=k) for k in range(3)]
    _, (dx,) = forward_backward(layer, blobs_from([x]), top, dys)
    np.testing.assert_allclose(dx, dys[0] + dys[1] + dys[2], rtol=1e-6)
    top[0].data[...] = 7       # tops do not alias each other or the bottom
    assert not (top[1].data == 7).any()
    assert check_gradient(make_layer("type: 'Split'"), blobs_from([x]), n_top=2) > 0


# -- eltwise -------------------------------------------------------------------------------------
def separated(n_bottoms, shape, seed):
    """Bottoms whose values at each position differ by >= 0.2, so MAX has no near-ties."""
    rng = np.random.default_rng(seed)
    levels = np.arange(n_bottoms, dtype=np.float32) * 0.2
    ranks = np.argsort(rng.random((n_bottoms,) + shape), axis=0)
    base = rng.standard_normal(shape).astype(np.float32)
    return [base + levels[ranks[k]] for k in range(n_bottoms)]


def test_eltwise_forward():
    xs = [randn(2, 3, 4, seed=k) for k in range(3)]
    (s,) = forward("type: 'Eltwise' eltwise_param { operation: SUM coeff: 1 coeff: -2 "
                   "coeff: 0.5 }", *xs)
    np.testing.assert_allclose(s, xs[0] - 2 * xs[1] + 0.5 * xs[2], rtol=1e-5, atol=1e-6)
    (s,) = forward("type: 'Eltwise'", *xs)
    np.testing.assert_allclose(s, xs[0] + xs[1] + xs[2], rtol=1e-6)
    (p,) = forward("type: 'Eltwise' eltwise_param { operation: PROD }", *xs)
    np.testing.assert_allclose(p, xs[0] * xs[1] * xs[2], rtol=1e-6)
    (m,) = forward("type: 'Eltwise' eltwise_param { operation: MAX }", *xs)
    np.testing.assert_array_equal(m, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))


@pytest.mark.parametrize("params", [
    "operation: SUM", "operation: SUM coeff: 0.5 coeff: -1.5 coeff: 2",
    "operation: PROD", "operation: PROD stable_prod_grad: false", "operation: MAX"])
def test_eltwise_gradient(params):
    if "PROD" in params:
        xs = [uniform(0.5, 1.5, 2, 3, 4, seed=k) * (-1) ** k for k in range(3)]
    else:
        xs = separated(3, (2, 3, 4), seed=7)
    text = f"type: 'Eltwise' eltwise_param {{ {params} }}"
    assert check_gradient(make_layer(text), blobs_from(xs)) > 0


def test_eltwise_max_tie_goes_to_first_bottom():
    x = randn(2, 3)
    layer = make_layer("type: 'Eltwise' eltwise_param { operation: MAX }")
    dy = randn(2, 3, seed=1)
    _, dxs = forward_backward(layer, blobs_from([x, x, x]), [Blob()], [dy])
    np.testing.assert_array_equal(dxs[0], dy)
    assert not dxs[1].any() and not dxs[2].any()


def test_eltwise_errors():
    with pytest.raises(ShapeError, match="coeff"):
        forward("type: 'Eltwise' eltwise_param { coeff: 1 }", randn(2), randn(2))
    with pytest.raises(ShapeError, match="SUM only"):
        forward("type: 'Eltwise' eltwise_param { operation: PROD coeff: 1 coeff: 2 }",
                randn(2), randn(2))
    with pytest.raises(ShapeError, match="must agree"):
        forward("type: 'Eltwise'", randn(2, 3), randn(3, 2))


# -- flatten / reshape / silence -----------------------------------------------------------------
@pytest.mark.parametrize("params,shape", [
    ("", (2, 60)), ("axis: 2", (2, 3, 20)), ("axis: 0 end_axis: 1", (6, 4, 5)),
    ("axis: -2", (2, 3, 20)), ("axis: 1 end_axis: -2", (2, 12, 5))])
def test_flatten_is_a_view(params, shape):
    x = randn(2, 3, 4, 5)
    layer = make_layer(f"type: 'Flatten' flatten_param {{ {params} }}")
    bottom = blobs_from([x])
    (top,) = run_forward(layer, bottom)
    assert top.shape == shape
    np.testing.assert_array_equal(top.data, x.reshape(shape))
    assert np.shares_memory(top.data, bottom[0].data)
    assert np.shares_memory(top.diff, bottom[0].diff)
    assert check_gradient(layer, bottom) > 0


@pytest.mark.parametrize("kind", ["Flatten", "Reshape", "Concat", "Permute"])
def test_layers_that_cannot_run_in_place_are_refused_by_the_net(kind):
    param = text_format.Parse(
        'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } } '
        f'layer {{ name: "l" type: "{kind}" bottom: "x" top: "x" }}', pb.NetParameter())
    with pytest.raises(PrototxtError, match=f"a {kind} layer cannot run in place"):
        Net(param, TEST)


def test_flatten_backward_copies_when_diff_was_replaced():
    x = randn(2, 3, 4)
    layer = make_layer("type: 'Flatten'")
    bottom = blobs_from([x])
    (top,) = run_forward(layer, bottom)
    top.diff = randn(2, 12, seed=1)
    layer.backward([top], [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, top.diff.reshape(2, 3, 4))


@pytest.mark.parametrize("params,shape", [
    ("shape { dim: 0 dim: -1 }", (2, 60)),
    ("shape { dim: 0 dim: 2 dim: -1 dim: 5 }", (2, 2, 6, 5)),
    ("shape { dim: -1 }", (120,)),
    ("shape { dim: 1 dim: 1 } axis: 1 num_axes: 0", (2, 1, 1, 3, 4, 5)),
    ("shape { dim: 2 dim: 2 } axis: 2 num_axes: 1", (2, 3, 2, 2, 5)),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", (2, 3, 4, 5)),
    ("shape { dim: -1 dim: 10 } axis: -3", (2, 3, 2, 10)),
    ("shape { dim: 1 } axis: -1 num_axes: 0", (2, 3, 4, 5, 1)),
])
def test_reshape(params, shape):
    x = randn(2, 3, 4, 5)
    layer = make_layer(f"type: 'Reshape' reshape_param {{ {params} }}")
    bottom = blobs_from([x])
    (top,) = run_forward(layer, bottom)
    assert top.shape == shape
    np.testing.assert_array_equal(top.data.ravel(), x.ravel())
    assert np.shares_memory(top.data, bottom[0].data)
    assert check_gradient(layer, bottom, max_points=20) > 0


@pytest.mark.parametrize("params,message", [
    ("shape { dim: -1 dim: -1 }", "more than one -1"),
    ("shape { dim: 7 dim: -1 }", "cannot infer"),
    ("shape { dim: 5 dim: 5 }", "holds 25 elements"),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 dim: 0 }", "no axis 4"),
    ("shape { dim: 2 } axis: 5", "axis 5 out of range"),
    ("shape { dim: 2 } axis: 1 num_axes: 9", "go past"),
])
def test_reshape_errors(params, message):
    with pytest.raises(ShapeError, match=message):
        forward(f"type: 'Reshape' reshape_param {{ {params} }}", randn(2, 3, 4, 5))


def test_silence_zeroes_diffs():
    layer = make_layer("type: 'Silence'")
    bottom = blobs_from([randn(2, 3), randn(4)])
    for b in bottom:
        b.diff[...] = 5
    layer.setup(bottom, [])
    layer.reshape(bottom, [])
    layer.forward(bottom, [])
    layer.backward([], [True, False], bottom)
    assert not bottom[0].diff.any()
    assert (bottom[1].diff == 5).all()


# -- data layers ---------------------------------------------------------------------------------
def test_input_shapes():
    tops = [Blob(), Blob()]
    layer = make_layer("type: 'Input' input_param { shape { dim: 2 dim: 3 } }")
    layer.setup([], tops)
    assert [t.shape for t in tops] == [(2, 3), (2, 3)]
    layer = make_layer("type: 'Input' input_param { shape { dim: 2 dim: 3 } "
                       "shape { dim: 2 } }")
    layer.setup([], tops)
    assert [t.shape for t in tops] == [(2, 3), (2,)]
    tops[0].reshape(5, 1)          # the user's reshape survives the layer's reshape
    layer.reshape([], tops)
    layer.forward([], tops)
    assert tops[0].shape == (5, 1)
    unshaped = Blob((4, 4))
    make_layer("type: 'Input'").setup([], [unshaped])
    assert unshaped.shape == (4, 4)
    with pytest.raises(ShapeError, match="one shape for all tops or one per top"):
        make_layer("type: 'Input' input_param { shape { dim: 1 } shape { dim: 2 } }").setup(
            [], [Blob(), Blob(), Blob()])


def dummy(text, n_top, ctx=None, iteration=0):
    param = text_format.Parse("name: 'dd' type: 'DummyData' " + text, pb.LayerParameter())
    layer = create(param, ctx or Context(TRAIN, seed=5))
    layer.ctx.iteration = iteration
    tops = [Blob() for _ in range(n_top)]
    layer.setup([], tops)
    layer.reshape([], tops)
    layer.forward([], tops)
    return layer, tops


def test_dummy_data_shapes_and_constants():
    _, tops = dummy("dummy_data_param { shape { dim: 2 dim: 3 } }", 2)
    assert [t.shape for t in tops] == [(2, 3), (2, 3)]
    assert not tops[0].data.any() and not tops[1].data.any()
    _, tops = dummy("dummy_data_param { num: 2 num: 4 channels: 3 height: 1 width: 5 "
                    "data_filler { type: 'constant' value: 1.5 } "
                    "data_filler { type: 'constant' value: -2 } }", 2)
    assert [t.shape for t in tops] == [(2, 3, 1, 5), (4, 3, 1, 5)]
    assert (tops[0].data == 1.5).all() and (tops[1].data == -2).all()
    with pytest.raises(ShapeError, match="either shape or num"):
        dummy("dummy_data_param { num: 2 channels: 1 height: 1 width: 1 shape { dim: 1 } }", 1)
    with pytest.raises(ShapeError, match="once per top"):
        dummy("dummy_data_param { num: 2 num: 3 num: 4 channels: 1 height: 1 width: 1 }", 2)


def test_dummy_data_random_fill_repeats_per_iteration():
    text = ("dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } "
            "data_filler { type: 'gaussian' std: 1 } "
            "data_filler { type: 'constant' value: 3 } }")
    layer, tops = dummy(text, 2)
    first = tops[0].data.copy()
    assert first.std() > 0.1 and (tops[1].data == 3).all()
    layer.forward([], tops)
    np.testing.assert_array_equal(tops[0].data, first)      # same iteration, same values
    layer.ctx.iteration = 1
    layer.forward([], tops)
    assert not np.array_equal(tops[0].data, first)
    _, again = dummy(text, 2, iteration=1)
    np.testing.assert_array_equal(again[0].data, tops[0].data)


def test_dummy_data_ranks_hold_slices_of_the_global_batch():
    text = "dummy_data_param { shape { dim: 5 dim: 2 } data_filler { type: 'uniform' } }"
    _, (whole,) = dummy(text, 1, iteration=3)
    parts = [dummy(text, 1, Context(TRAIN, seed=5, rank=r, size=2), iteration=3)[1][0]
             for r in range(2)]
    assert [p.shape for p in parts] == [(3, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate([p.data for p in parts]), whole.data)


def test_every_layer_here_is_registered():
    from syncsgd.layers import known_types
    assert set(known_types()) >= {
        "ReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Softmax", "Concat", "Slice",
        "Split", "Eltwise", "Flatten", "Reshape", "Silence", "Input", "DummyData"}

