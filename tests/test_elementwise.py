"""Split's and Eltwise's passes over arrays of several pieces (kernels/elementwise.py): every
piece written, the ragged last one included, each output from its own inputs; arrays that are
not contiguous take the whole-array path. With a ReLU folded in (Eltwise.absorb), the sum is
clamped as numpy's maximum clamps it, on the compiled loop and on numpy's passes alike; with a
ReLU's gradient folded in (ReLU.absorb of a Split), the sum is masked as the ReLU masks it."""
import numpy as np
import pytest

from syncsgd.blob import Blob
from syncsgd.kernels.elementwise import scaled_copies, weighted_sum
from tests.gradcheck import blobs_from, make_layer, run_forward

SIZE = 3 * (1 << 18) + 12345        # three whole pieces and a ragged one


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("coeffs", [(1, 1), (1, -2, 0.5), (0.25,)])
def test_weighted_sum_covers_every_piece(coeffs):
    xs = [rand(SIZE, seed=k) for k in range(len(coeffs))]
    y = np.full(SIZE, np.nan, np.float32)
    weighted_sum(xs, [np.float32(c) for c in coeffs], y)
    expect = sum(np.float64(c) * x for c, x in zip(coeffs, xs))
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numba", ["1", "0"])
@pytest.mark.parametrize("coeffs", [(1, 1), (1, -0.5), (1, 1, 1)])
def test_a_clamped_sum_is_numpys_maximum(monkeypatch, numba, coeffs):
    monkeypatch.setenv("SYNCSGD_NUMBA", numba)
    xs = [rand(SIZE, seed=k) for k in range(len(coeffs))]
    xs[0][:4] = [np.nan, -0.0, 0.0, np.inf]
    xs[1][:4] = [1.0, -0.0, -0.0, 1.0]
    coeffs = [np.float32(c) for c in coeffs]
    y = np.full(SIZE, np.nan, np.float32)
    weighted_sum(xs, coeffs, y, relu=True)
    expect = xs[0] + xs[1] if coeffs[1] == 1 else xs[0] * coeffs[0] + coeffs[1] * xs[1]
    for x, c in zip(xs[2:], coeffs[2:]):
        expect = expect + c * x
    np.testing.assert_array_equal(y, np.maximum(expect, 0))
    assert not np.signbit(y[1:3]).any()             # -0 becomes 0, as numpy's maximum gives
    assert np.isnan(y[0]) and y[3] == np.inf


def test_a_clamped_sum_of_strided_arrays(monkeypatch):
    monkeypatch.setenv("SYNCSGD_NUMBA", "1")
    base = rand(64, 2 * 4096)
    x = base[:, ::2]
    y = np.zeros((64, 2 * 4096), np.float32)[:, 1::2]
    weighted_sum([x, x], [1, 1], y, relu=True)
    np.testing.assert_array_equal(y, np.maximum(x + x, 0))


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("numba", ["1", "0"])
@pytest.mark.parametrize("tops", [2, 3, 1])
def test_a_masked_sum_is_the_relus_gradient_of_the_sum(monkeypatch, numba, tops):
    """To the bit: the sum as the Split writes it, then dy * (y > 0) as the ReLU's backward
    (-0 where a negative dy is masked, NaN for an infinite one)."""
    monkeypatch.setenv("SYNCSGD_NUMBA", numba)
    xs = [rand(SIZE, seed=k) for k in range(tops)]
    y = rand(SIZE, seed=7)
    y[:5] = [np.nan, -0.0, 0.0, -1.0, 2.0]
    xs[0][:5] = [1.0, 1.0, -1.0, np.inf, np.inf]
    for x in xs[1:]:
        x[:5] = 0.0
    ones = [np.float32(1)] * tops
    out = np.full(SIZE, np.nan, np.float32)
    weighted_sum(xs, ones, out, mask=y)
    expect = np.empty(SIZE, np.float32)
    weighted_sum(xs, ones, expect)
    np.testing.assert_array_equal(out, np.multiply(expect, y > 0))
    assert np.signbit(out[2]) and out[0] == out[1] == 0 and np.isnan(out[3]) and out[4] == np.inf


def test_scaled_copies_covers_every_piece():
    x = rand(SIZE)
    ys = [np.full(SIZE, np.nan, np.float32) for _ in range(3)]
    scaled_copies(x, [1, np.float32(-3), 1], ys)
    np.testing.assert_array_equal(ys[0], x)
    np.testing.assert_array_equal(ys[1], np.float32(-3) * x)
    np.testing.assert_array_equal(ys[2], x)


def test_strided_arrays_are_written_in_place():
    base = rand(64, 2 * 4096)
    x = base[:, ::2]                 # not contiguous: no flat view
    y = np.zeros((64, 2 * 4096), np.float32)[:, 1::2]
    weighted_sum([x, x], [1, 1], y)
    np.testing.assert_array_equal(y, 2 * x)
    outs = [np.zeros((64, 2 * 4096), np.float32)[:, ::2] for _ in range(2)]
    scaled_copies(x, [1, 2], outs)
    np.testing.assert_array_equal(outs[0], x)
    np.testing.assert_array_equal(outs[1], 2 * x)


def test_split_of_several_pieces():
    x = rand(4, 8, 150, 200)         # 960,000 values
    layer = make_layer("type: 'Split'")
    bottom = blobs_from([x])
    top = run_forward(layer, bottom, 3)
    for t in top:
        np.testing.assert_array_equal(t.data, x)
    dys = [rand(*x.shape, seed=k + 1) for k in range(3)]
    for t, dy in zip(top, dys):
        t.diff[...] = dy
    bottom[0].diff.fill(np.nan)
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(bottom[0].diff, (dys[0] + dys[1]) + dys[2], rtol=1e-6,
                               atol=1e-6)


def test_eltwise_sum_of_several_pieces():
    xs = [rand(4, 8, 150, 200, seed=k) for k in range(3)]
    layer = make_layer("type: 'Eltwise' eltwise_param { operation: SUM coeff: 1 coeff: -2 "
                       "coeff: 0.5 }")
    bottom = blobs_from(xs)
    (top,) = run_forward(layer, bottom)
    np.testing.assert_allclose(top.data, xs[0] - 2 * xs[1] + 0.5 * xs[2], rtol=1e-5,
                               atol=1e-5)
    dy = rand(*xs[0].shape, seed=9)
    top.diff[...] = dy
    for b in bottom:
        b.diff.fill(np.nan)
    layer.backward([top], [True, False, True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, dy)
    assert np.isnan(bottom[1].diff).all()       # not propagated: left alone
    np.testing.assert_array_equal(bottom[2].diff, np.float32(0.5) * dy)


def test_split_tops_do_not_alias():
    layer = make_layer("type: 'Split'")
    bottom = blobs_from([rand(4, 8, 150, 200)])
    top = run_forward(layer, bottom, 2)
    top[0].data[...] = 7
    assert not (top[1].data == 7).any() and not (bottom[0].data == 7).any()
    assert isinstance(top[1], Blob)


# -- Split in a net: the tops hold the bottom's values unless a consumer runs in place on one --
SPLIT_NET = """
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 6 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "x"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "split" type: "Split" bottom: "x" top: "y1" top: "y2" }
layer { name: "relu" type: "ReLU" bottom: "y1" top: "%s" }
layer { name: "square" type: "Power" bottom: "y2" top: "sq" power_param { power: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "%s" bottom: "sq" top: "s" }
"""


def split_net(in_place):
    from google.protobuf import text_format

    from syncsgd import TRAIN
    from syncsgd.net import Net
    from syncsgd.proto import pb
    top = "y1" if in_place else "r"
    net = Net(text_format.Parse(SPLIT_NET % (top, top), pb.NetParameter()), TRAIN)
    net.blobs["data"].data[...] = rand(4, 6, seed=3)
    return net


@pytest.mark.parametrize("in_place", [False, True])
def test_split_shares_only_where_no_consumer_runs_in_place(in_place):
    net = split_net(in_place)
    assert net.layer_dict["split"].tops_read_only == (not in_place)
    net.forward()
    w, b = (blob.data for blob in net.layer_dict["ip"].blobs)
    x = net.blobs["data"].data @ w.T + b
    assert (x < 0).any()
    shared = [np.shares_memory(net.blobs[t].data, net.blobs["x"].data) for t in ("y1", "y2")]
    assert shared == [not in_place] * 2
    # The square reads y2 before any ReLU, in place or not, and its gradient reads it again.
    np.testing.assert_allclose(net.blobs["s"].data, np.maximum(x, 0) + x * x, rtol=1e-5)
    net.blobs["s"].diff[...] = 1
    net.backward(start="sum")
    np.testing.assert_allclose(net.blobs["x"].diff, (x > 0) + 2 * x, rtol=1e-5)
    np.testing.assert_allclose(net.blobs["x"].data, x, rtol=1e-5)
