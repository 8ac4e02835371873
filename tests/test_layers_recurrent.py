"""RNN, LSTM and LSTMUnit against per-step numpy references of Caffe's equations (written here from
BVLC's rnn_layer.cpp, lstm_layer.cpp and lstm_unit_layer.cpp), numeric gradient checks, sequence
resets by cont, the state carried between batches, expose_hidden, x_static, error messages, Caffe's
parameter order when loading a .caffemodel, and a short LSTM training run."""
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.blob import Blob
from syncsgd.errors import ShapeError
from syncsgd.proto import pb

from gradcheck import blobs_from, check_gradient, make_layer, run_forward

T, N, K, D, S = 4, 3, 3, 2, 2       # time steps, streams, inputs, num_output, static inputs


def randn(*shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def conts(t=T, n=N, zeros=((0, 0), (0, 1), (0, 2), (2, 1))):
    """Sequence indicators: 1 except at the (step, stream) pairs in `zeros`."""
    c = np.ones((t, n), np.float32)
    for step, stream in zeros:
        c[step, stream] = 0
    return c


def layer_text(kind, num_output=D, expose=False, std=0.7):
    filler = f"{{ type: 'gaussian' std: {std} }}"
    return (f"name: 'r' type: '{kind}' recurrent_param {{ num_output: {num_output} "
            f"weight_filler {filler} bias_filler {filler} "
            f"expose_hidden: {str(expose).lower()} }}")


def inputs(kind, static=False, expose=False, t=T, seed=0):
    """Bottom arrays x, cont, [x_static], [h_0, [c_0]] in Caffe's order."""
    arrays = [randn(t, N, K, seed=seed), conts(t)]
    if static:
        arrays.append(randn(N, S, seed=seed + 1))
    if expose:
        arrays.append(randn(1, N, D, seed=seed + 2, scale=0.5))
        if kind == "LSTM":
            arrays.append(randn(1, N, D, seed=seed + 3, scale=0.5))
    return arrays


def split_inputs(arrays, static):
    x, cont = arrays[:2]
    xs = arrays[2] if static else None
    states = [a[0] for a in arrays[3 if static else 2:]]
    return x, cont, xs, states


def ref_lstm(params, x, cont, xs=None, h0=None, c0=None):
    """Caffe's LSTM step by step in float64: outputs (T, N, D), h_T, c_T."""
    params = [p.astype(np.float64) for p in params]
    w_x, b = params[:2]
    w_s = params[2] if xs is not None else None
    w_h = params[-1]
    d = w_h.shape[1]
    h = np.zeros((x.shape[1], d)) if h0 is None else h0.astype(np.float64)
    c = np.zeros((x.shape[1], d)) if c0 is None else c0.astype(np.float64)
    out = []
    for t in range(x.shape[0]):
        ct = cont[t][:, None]
        gates = x[t].reshape(x.shape[1], -1) @ w_x.T + b + (ct * h) @ w_h.T
        if xs is not None:
            gates += xs.reshape(xs.shape[0], -1) @ w_s.T
        i, f, o = (sigmoid(gates[:, k * d:(k + 1) * d]) for k in range(3))
        g = np.tanh(gates[:, 3 * d:])
        c = ct * f * c + i * g
        h = o * np.tanh(c)
        out.append(h)
    return np.array(out), h, c


def ref_rnn(params, x, cont, xs=None, h0=None):
    """Caffe's RNN step by step in float64: outputs o (T, N, D), h_T."""
    params = [p.astype(np.float64) for p in params]
    w_x, b = params[:2]
    w_s = params[2] if xs is not None else None
    w_h, w_o, b_o = params[-3:]
    h = np.zeros((x.shape[1], w_h.shape[0])) if h0 is None else h0.astype(np.float64)
    out = []
    for t in range(x.shape[0]):
        a = x[t].reshape(x.shape[1], -1) @ w_x.T + b + (cont[t][:, None] * h) @ w_h.T
        if xs is not None:
            a += xs.reshape(xs.shape[0], -1) @ w_s.T
        h = np.tanh(a)
        out.append(np.tanh(h @ w_o.T + b_o))
    return np.array(out), h


def reference(kind, layer, arrays, static):
    x, cont, xs, states = split_inputs(arrays, static)
    params = [b.data for b in layer.blobs]
    if kind == "LSTM":
        return ref_lstm(params, x, cont, xs, *states)
    return ref_rnn(params, x, cont, xs, *states)


def n_tops(kind, expose):
    return 1 + (2 if kind == "LSTM" else 1) * expose


# -- forward against the references ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("expose", [False, True])
def test_forward_matches_reference(kind, static, expose):
    layer = make_layer(layer_text(kind, expose=expose))
    arrays = inputs(kind, static, expose)
    top = run_forward(layer, blobs_from(arrays), n_tops(kind, expose))
    expected = reference(kind, layer, arrays, static)
    assert top[0].shape == (T, N, D)
    np.testing.assert_allclose(top[0].data, expected[0], rtol=1e-5, atol=1e-6)
    if expose:
        for blob, final in zip(top[1:], expected[1:]):
            assert blob.shape == (1, N, D)
            np.testing.assert_allclose(blob.data[0], final, rtol=1e-5, atol=1e-6)


def test_multi_axis_input_is_flattened_from_axis_2():
    """As Caffe's InnerProduct at axis 2: x (T, N, 2, 3) has 6 inputs per stream."""
    layer = make_layer(layer_text("LSTM"))
    x = randn(T, N, 2, 3)
    top = run_forward(layer, blobs_from([x, conts()]))
    assert layer.blobs[0].shape == (4 * D, 6)
    expected = ref_lstm([b.data for b in layer.blobs], x, conts())[0]
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-5, atol=1e-6)


# -- parameters: Caffe's order and shapes ------------------------------------------------------

@pytest.mark.parametrize("static", [False, True])
def test_parameter_shapes_in_caffes_order(static):
    lstm = make_layer(layer_text("LSTM"))
    run_forward(lstm, blobs_from(inputs("LSTM", static)))
    # W_xc, b_c, [W_xc_static], W_hc
    expected = [(4 * D, K), (4 * D,)] + [(4 * D, S)] * static + [(4 * D, D)]
    assert [b.shape for b in lstm.blobs] == expected
    rnn = make_layer(layer_text("RNN"))
    run_forward(rnn, blobs_from(inputs("RNN", static)))
    # W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o
    expected = [(D, K), (D,)] + [(D, S)] * static + [(D, D), (D, D), (D,)]
    assert [b.shape for b in rnn.blobs] == expected
    names = ["W_xh", "b_h"] + ["W_xh_static"] * static + ["W_hh", "W_ho", "b_o"]
    assert [b.name for b in rnn.blobs] == [f"r.{n}" for n in names]
    names = ["W_xc", "b_c"] + ["W_xc_static"] * static + ["W_hc"]
    assert [b.name for b in lstm.blobs] == [f"r.{n}" for n in names]


def test_fillers_are_applied_and_seeded():
    text = ("name: 'r' type: 'LSTM' recurrent_param { num_output: 3 "
            "weight_filler { type: 'uniform' min: -0.1 max: 0.1 } "
            "bias_filler { type: 'constant' value: 0.25 } }")
    a, b = make_layer(text), make_layer(text)
    for layer in (a, b):
        run_forward(layer, blobs_from([randn(T, N, K), conts()]))
    assert np.all(a.blobs[1].data == 0.25)
    for blob in (a.blobs[0], a.blobs[2]):
        assert np.abs(blob.data).max() <= 0.1 and np.abs(blob.data).min() > 0
    assert not np.array_equal(a.blobs[0].data, a.blobs[2].data)    # W_xc, W_hc: own draws
    for p, q in zip(a.blobs, b.blobs):
        np.testing.assert_array_equal(p.data, q.data)


# -- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,expose", [(False, False), (True, False), (False, True),
                                           (True, True)])
def test_gradient(kind, static, expose):
    """x, x_static and every parameter, from the output h. With expose_hidden, h_0 and c_0 get
    no gradient and h_T's and c_T's diffs are ignored, as in BVLC (their values only are
    exposed: tests/test_oracle.py); cont is never checked."""
    layer = make_layer(layer_text(kind, expose=expose))
    arrays = inputs(kind, static, expose, t=3)
    assert check_gradient(layer, blobs_from(arrays), n_tops(kind, expose), top_index=0,
                          check_bottom=[0] + [2] * static) > 0


def test_gradient_leaves_cont_alone():
    layer = make_layer(layer_text("LSTM"))
    bottom = blobs_from(inputs("LSTM"))
    top = run_forward(layer, bottom)
    top[0].diff[...] = randn(T, N, D, seed=5)
    bottom[1].diff[...] = 7
    layer.backward(top, [True, True], bottom)
    assert np.all(bottom[1].diff == 7)
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)


def test_parameter_gradients_accumulate():
    layer = make_layer(layer_text("RNN"))
    bottom = blobs_from(inputs("RNN"))
    top = run_forward(layer, bottom)
    top[0].diff[...] = randn(T, N, D, seed=5)
    layer.backward(top, [True, False], bottom)
    once = [b.diff.copy() for b in layer.blobs]
    layer.backward(top, [True, False], bottom)
    for blob, first in zip(layer.blobs, once):
        np.testing.assert_allclose(blob.diff, 2 * first, rtol=1e-6, atol=1e-7)


# -- cont, the carried state and expose_hidden -------------------------------------------------

@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_cont_zero_starts_a_new_sequence(kind):
    """Stream 1 restarts at step 2: from there its outputs equal a fresh run on x[2:]."""
    layer = make_layer(layer_text(kind))
    x = randn(T, N, K)
    top = run_forward(layer, blobs_from([x, conts()]))
    fresh = make_layer(layer_text(kind))
    tail = run_forward(fresh, blobs_from([x[2:], conts(T - 2, zeros=((0, 0), (0, 1), (0, 2)))]))
    np.testing.assert_allclose(top[0].data[2:, 1], tail[0].data[:, 1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(top[0].data[2:, 0], tail[0].data[:, 0], atol=1e-3)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_state_carries_over_to_the_next_batch(kind):
    """Without expose_hidden, batch 2 starts from batch 1's final state where cont is 1 (as
    Caffe copies h_T, c_T into h_0, c_0), and from zero where cont is 0."""
    x = randn(2 * T, N, K)
    cont = conts(2 * T, zeros=((0, 0), (0, 1), (0, 2), (T, 2)))
    whole = run_forward(make_layer(layer_text(kind)), blobs_from([x, cont]))[0].data
    layer = make_layer(layer_text(kind))
    first = blobs_from([x[:T], cont[:T]])
    top = run_forward(layer, first)
    np.testing.assert_allclose(top[0].data, whole[:T], rtol=1e-5, atol=1e-6)
    second = blobs_from([x[T:], cont[T:]])
    layer.reshape(second, top)
    layer.forward(second, top)
    np.testing.assert_allclose(top[0].data, whole[T:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_exposed_states_chain_two_halves(kind):
    """h_T (and c_T) of the first half fed as h_0 (and c_0) of the second equal one run."""
    x = randn(2 * T, N, K)
    cont = conts(2 * T)
    whole = run_forward(make_layer(layer_text(kind)), blobs_from([x, cont]))[0].data
    states = 2 if kind == "LSTM" else 1
    zero = [np.zeros((1, N, D), np.float32)] * states
    first = run_forward(make_layer(layer_text(kind, expose=True)),
                        blobs_from([x[:T], cont[:T]] + zero), 1 + states)
    second = run_forward(make_layer(layer_text(kind, expose=True)),
                         blobs_from([x[T:], cont[T:]] + [b.data for b in first[1:]]),
                         1 + states)
    np.testing.assert_allclose(first[0].data, whole[:T], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second[0].data, whole[T:], rtol=1e-5, atol=1e-6)


def test_exposed_h0_is_reset_by_cont():
    layer = make_layer(layer_text("LSTM", expose=True))
    arrays = inputs("LSTM", expose=True)
    top = run_forward(layer, blobs_from(arrays), 3)
    zeroed = arrays[:2] + [np.zeros_like(arrays[2]), np.zeros_like(arrays[3])]
    again = run_forward(make_layer(layer_text("LSTM", expose=True)), blobs_from(zeroed), 3)
    # cont is 0 at step 0 for every stream: the given h_0, c_0 do not matter.
    np.testing.assert_allclose(top[0].data, again[0].data, rtol=1e-6, atol=1e-7)


def test_debug_info_logs_every_time_step(monkeypatch):
    lines = []
    monkeypatch.setattr(syncsgd.log, "info", lines.append)
    layer = make_layer(layer_text("LSTM").replace("recurrent_param {",
                                                  "recurrent_param { debug_info: true"))
    bottom = blobs_from(inputs("LSTM"))
    top = run_forward(layer, bottom)
    layer.backward(top, [True, False], bottom)
    assert [line.split(",")[1] for line in lines] == [f" timestep {t}" for t in
                                                      range(1, T + 1)] * 2
    assert lines[0].startswith("    [Forward] Layer r") and "[Backward]" in lines[-1]


# -- LSTMUnit ----------------------------------------------------------------------------------

def unit_reference(c_prev, x, cont):
    x = x.astype(np.float64)
    i, f, o = (sigmoid(x[..., k * D:(k + 1) * D]) for k in range(3))
    g = np.tanh(x[..., 3 * D:])
    f = f * cont[..., None]
    c = f * c_prev + i * g
    return c, o * np.tanh(c), (i, f, o, g)


def unit_inputs(cont=None):
    c_prev = randn(1, N, D, seed=1)
    x = randn(1, N, 4 * D, seed=2)
    cont = np.array([[1, 0, 1]], np.float32) if cont is None else cont
    return [c_prev, x, cont]


def test_lstm_unit_forward_matches_reference():
    layer = make_layer("name: 'u' type: 'LSTMUnit'")
    arrays = unit_inputs()
    top = run_forward(layer, blobs_from(arrays), 2)
    c, h, _ = unit_reference(*arrays)
    np.testing.assert_allclose(top[0].data, c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top[1].data, h, rtol=1e-5, atol=1e-6)
    # cont 0 drops c_prev entirely.
    np.testing.assert_allclose(top[0].data[0, 1], c[0, 1], rtol=1e-6)
    assert not layer.allow_force_backward(2)


def test_lstm_unit_gradient():
    layer = make_layer("name: 'u' type: 'LSTMUnit'")
    assert check_gradient(layer, blobs_from(unit_inputs()), 2, check_bottom=[0, 1]) > 0


def test_lstm_unit_fractional_cont_uses_caffes_forget_derivative():
    """For cont outside {0, 1} Caffe differentiates the forget gate as f (1 - f) with f already
    scaled by cont; kept, so weights trained in Caffe with such indicators train the same."""
    cont = np.full((1, N), 0.5, np.float32)
    arrays = unit_inputs(cont)
    layer = make_layer("name: 'u' type: 'LSTMUnit'")
    bottom = blobs_from(arrays)
    top = run_forward(layer, bottom, 2)
    dc, dh = randn(1, N, D, seed=3), randn(1, N, D, seed=4)
    top[0].diff[...], top[1].diff[...] = dc, dh
    layer.backward(top, [True, True, False], bottom)
    c, _, (i, f, o, g) = unit_reference(*arrays)
    dct = dc + dh * o * (1 - np.tanh(c) ** 2)
    np.testing.assert_allclose(bottom[1].diff[..., D:2 * D], dct * arrays[0] * f * (1 - f),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bottom[0].diff, dct * f, rtol=1e-5, atol=1e-6)


def test_lstm_backward_through_lstm_units_equals_the_unrolled_net():
    """The LSTM layer's gradients equal Caffe's unrolled net built from LSTMUnit layers and GEMMs
    here, step by step (the gate inputs computed in numpy, each step's unit a layer)."""
    lstm = make_layer(layer_text("LSTM"))
    x, cont = randn(T, N, K), conts()
    top = run_forward(lstm, blobs_from([x, cont]))
    dy = randn(T, N, D, seed=6)
    top[0].diff[...] = dy
    bottom = blobs_from([x, cont])
    lstm.backward(top, [True, False], bottom)
    w_x, b, w_h = (blob.data for blob in lstm.blobs)
    units, h = [], np.zeros((N, D), np.float32)
    c = Blob((1, N, D))
    for t in range(T):
        gates = x[t] @ w_x.T + b + (cont[t][:, None] * h) @ w_h.T
        unit = make_layer("name: 'u' type: 'LSTMUnit'")
        ins = [c] + blobs_from([gates[None], cont[t][None]])
        outs = run_forward(unit, ins, 2)
        units.append((unit, ins, outs))
        c, h = outs[0], outs[1].data[0]
    np.testing.assert_allclose(top[0].data, np.array([u[2][1].data[0] for u in units]),
                               rtol=1e-5, atol=1e-6)
    dh_next, dc_next = np.zeros((N, D), np.float32), np.zeros((N, D), np.float32)
    dw_h = np.zeros_like(w_h)
    dgates = []
    for t in range(T - 1, -1, -1):
        unit, ins, outs = units[t]
        outs[0].diff[0], outs[1].diff[0] = dc_next, dy[t] + dh_next
        unit.backward(outs, [True, True, False], ins)
        dg = ins[1].diff[0]
        dgates.insert(0, dg.copy())
        h_prev = units[t - 1][2][1].data[0] if t > 0 else np.zeros((N, D), np.float32)
        dw_h += dg.T @ (cont[t][:, None] * h_prev)
        dh_next = cont[t][:, None] * (dg @ w_h)
        dc_next = ins[0].diff[0].copy()
    dgates = np.array(dgates).reshape(T * N, 4 * D)
    np.testing.assert_allclose(lstm.blobs[0].diff, dgates.T @ x.reshape(T * N, K),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lstm.blobs[1].diff, dgates.sum(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lstm.blobs[2].diff, dw_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bottom[0].diff, (dgates @ w_x).reshape(T, N, K),
                               rtol=1e-4, atol=1e-5)


# -- errors ------------------------------------------------------------------------------------

def _bottoms(*shapes):
    return [Blob(s) for s in shapes]


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("text,shapes,message", [
    ("num_output: 0", [(T, N, K), (T, N)], "num_output must be set"),
    (None, [(T,), (T,)], "at least 2 axes"),
    (None, [(T, N, K), (T, N + 1)], "bottom cont has shape"),
    (None, [(T, N, K), (T, N, 1)], "bottom cont has shape"),
    (None, [(T, N, K), (T, N), (N + 1, S)], "x_static"),
    (None, [(T, N, K)], "takes 2..3 bottom"),
])
def test_bad_setups_are_refused(kind, text, shapes, message):
    param = text or f"num_output: {D}"
    layer = make_layer(f"name: 'r' type: '{kind}' recurrent_param {{ {param} }}")
    with pytest.raises(ShapeError, match=message) as err:
        layer.setup(_bottoms(*shapes), [Blob()])
    assert "'r'" in str(err.value) and kind in str(err.value)


def test_exposed_state_shape_is_checked():
    layer = make_layer(layer_text("LSTM", expose=True))
    bottom = _bottoms((T, N, K), (T, N), (1, N, D), (1, N, D + 1))
    top = [Blob(), Blob(), Blob()]
    layer.setup(bottom, top)
    with pytest.raises(ShapeError, match=r"bottom c_0 has shape \(1, 3, 3\)"):
        layer.reshape(bottom, top)
    with pytest.raises(ShapeError, match="takes 3 top"):
        make_layer(layer_text("LSTM", expose=True)).setup(bottom, [Blob()])


def test_changed_input_width_is_refused():
    layer = make_layer(layer_text("RNN"))
    top = run_forward(layer, blobs_from([randn(T, N, K), conts()]))
    with pytest.raises(ShapeError, match="W_xh takes 3"):
        layer.reshape(_bottoms((T, N, K + 1), (T, N)), top)


def test_more_time_steps_and_streams_after_setup():
    layer = make_layer(layer_text("LSTM"))
    top = run_forward(layer, blobs_from([randn(T, N, K), conts()]))
    x, cont = randn(T + 2, N + 1, K, seed=4), conts(T + 2, N + 1, zeros=[(0, k) for k in
                                                                         range(N + 1)])
    bottom = blobs_from([x, cont])
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    expected = ref_lstm([b.data for b in layer.blobs], x, cont)[0]
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shapes,message", [
    ([(N, D), (1, N, 4 * D), (1, N)], "c_prev has shape"),
    ([(1, N, D), (1, N, 3 * D), (1, N)], "bottom x has shape"),
    ([(1, N, D), (1, N, 4 * D), (1, N + 1)], "bottom cont has shape"),
])
def test_lstm_unit_bad_shapes(shapes, message):
    layer = make_layer("name: 'u' type: 'LSTMUnit'")
    bottom, top = _bottoms(*shapes), [Blob(), Blob()]
    layer.setup(bottom, top)
    with pytest.raises(ShapeError, match=message):
        layer.reshape(bottom, top)


# -- inside a Net, with weights in Caffe's layout ----------------------------------------------

NET = """
name: "seq"
layer { name: "in" type: "Input" top: "x" top: "cont" top: "xs"
        input_param { shape { dim: 4 dim: 3 dim: 3 } shape { dim: 4 dim: 3 }
                      shape { dim: 3 dim: 2 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" bottom: "xs" top: "h"
        recurrent_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "rnn" type: "RNN" bottom: "h" bottom: "cont" top: "o"
        recurrent_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "gates" type: "InnerProduct" bottom: "o" top: "gates"
        inner_product_param { num_output: 8 axis: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "c0" type: "DummyData" top: "c0" top: "cont1"
        dummy_data_param { shape { dim: 1 dim: 3 dim: 2 } shape { dim: 1 dim: 3 }
                           data_filler { type: "constant" value: 0.5 }
                           data_filler { type: "constant" value: 1 } } }
layer { name: "slice" type: "Slice" bottom: "gates" top: "g0" top: "grest"
        slice_param { axis: 0 slice_point: 1 } }
layer { name: "unit" type: "LSTMUnit" bottom: "c0" bottom: "g0" bottom: "cont1"
        top: "c1" top: "h1" }
layer { name: "silence" type: "Silence" bottom: "grest" }
"""


def caffe_weights(net):
    """A .caffemodel as Caffe would write it for NET: each layer's blobs in Caffe's order."""
    rng = np.random.default_rng(3)
    model = pb.NetParameter(name="seq")
    arrays = {}
    for name in ("lstm", "rnn", "gates"):
        layer = model.layer.add(name=name, type=net.layer_dict[name].type)
        arrays[name] = []
        for blob in net.params[name]:
            a = (0.5 * rng.standard_normal(blob.shape)).astype(np.float32)
            proto = layer.blobs.add()
            proto.shape.dim.extend(a.shape)
            proto.data.extend(a.ravel().tolist())
            arrays[name].append(a)
    return model, arrays


def test_net_from_prototxt_loads_caffe_weights(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    net = syncsgd.Net(str(tmp_path / "net.prototxt"), syncsgd.TEST)
    assert [net.layer_dict[n].type for n in ("lstm", "rnn", "unit")] == ["LSTM", "RNN",
                                                                          "LSTMUnit"]
    assert [p.shape for p in net.params["lstm"]] == [(8, 3), (8,), (8, 2), (8, 2)]
    assert [p.shape for p in net.params["rnn"]] == [(2, 2), (2,), (2, 2), (2, 2), (2,)]
    model, arrays = caffe_weights(net)
    (tmp_path / "w.caffemodel").write_bytes(model.SerializeToString())
    net.copy_from(str(tmp_path / "w.caffemodel"))
    x, cont, xs = randn(4, 3, 3), conts(), randn(3, 2, seed=1)
    out = net.forward(x=x, cont=cont, xs=xs)
    h = ref_lstm(arrays["lstm"], x, cont, xs)[0]
    o = ref_rnn(arrays["rnn"], h, cont)[0]
    np.testing.assert_allclose(net.blobs["h"].data, h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(net.blobs["o"].data, o, rtol=1e-4, atol=1e-5)
    w, b = arrays["gates"]
    gates = o[:1] @ w.T + b
    c1, h1, _ = unit_reference(np.full((1, 3, 2), 0.5), gates, np.ones((1, 3)))
    np.testing.assert_allclose(out["c1"], c1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["h1"], h1, rtol=1e-4, atol=1e-5)
    net.save(str(tmp_path / "again.caffemodel"))
    saved = pb.NetParameter.FromString((tmp_path / "again.caffemodel").read_bytes())
    lstm = next(layer for layer in saved.layer if layer.name == "lstm")
    assert [tuple(blob.shape.dim) for blob in lstm.blobs] == [(8, 3), (8,), (8, 2), (8, 2)]
    np.testing.assert_array_equal(np.array(lstm.blobs[3].data, np.float32).reshape(8, 2),
                                  arrays["lstm"][3])


def test_opencv_reads_caffes_lstm_if_it_can(tmp_path):
    cv2 = pytest.importorskip("cv2")
    text = ("name: 'seq' input: 'x' input_shape { dim: 4 dim: 3 dim: 3 } "
            "input: 'cont' input_shape { dim: 4 dim: 3 } "
            "layer { name: 'lstm' type: 'LSTM' bottom: 'x' bottom: 'cont' top: 'h' "
            "recurrent_param { num_output: 2 weight_filler { type: 'gaussian' std: 0.5 } "
            "bias_filler { type: 'gaussian' std: 0.5 } } }")
    (tmp_path / "lstm.prototxt").write_text(text)
    net = syncsgd.Net(str(tmp_path / "lstm.prototxt"), syncsgd.TEST)
    net.save(str(tmp_path / "lstm.caffemodel"))
    x, cont = randn(4, 3, 3), np.ones((4, 3), np.float32)
    cont[0] = 0
    try:
        cv_net = cv2.dnn.readNetFromCaffe(str(tmp_path / "lstm.prototxt"),
                                          str(tmp_path / "lstm.caffemodel"))
        cv_net.setInput(x, "x")
        cv_net.setInput(cont, "cont")
        theirs = cv_net.forward()
    except cv2.error as err:
        # OpenCV builds its LSTM at the first forward and reads the blobs as (W_h, W_x, b),
        # not Caffe's (W_xc, b_c, W_hc); the cont input has no counterpart there.
        reason = " ".join(str(err).split())
        pytest.skip(f"OpenCV's Caffe importer does not accept BVLC's LSTM: {reason}")
    ours = net.forward(x=x, cont=cont)["h"]
    np.testing.assert_allclose(theirs.reshape(ours.shape), ours, rtol=1e-4, atol=1e-5)


# -- training ----------------------------------------------------------------------------------

TRAIN_NET = """
name: "delay"
layer { name: "in" type: "Input" top: "x" top: "cont" top: "y"
        input_param { shape { dim: 6 dim: 16 dim: 1 } shape { dim: 6 dim: 16 }
                      shape { dim: 6 dim: 16 dim: 1 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
        recurrent_param { num_output: 8 weight_filler { type: "uniform" min: -0.3 max: 0.3 }
                          bias_filler { type: "constant" value: 0 } } }
layer { name: "out" type: "InnerProduct" bottom: "h" top: "pred"
        inner_product_param { num_output: 1 axis: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "pred" bottom: "y" top: "loss" }
"""


def test_lstm_learns_to_repeat_the_previous_input(tmp_path):
    """y_t = x_{t-1}: only the recurrent state can carry x_{t-1} to step t."""
    param = text_format.Parse("base_lr: 0.05 lr_policy: 'fixed' type: 'Adam' momentum: 0.9 "
                              "momentum2: 0.999 max_iter: 1000 display: 0",
                              pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(TRAIN_NET, pb.NetParameter()))
    param.random_seed = 5
    param.snapshot_prefix = str(tmp_path / "snap")
    solver = syncsgd.get_solver(param)
    rng = np.random.default_rng(0)
    x = rng.choice([-1.0, 1.0], size=(6, 16, 1)).astype(np.float32)
    y = np.zeros_like(x)
    y[1:] = x[:-1]
    net = solver.net
    net.blobs["x"].data[...] = x
    net.blobs["cont"].data[...] = 1
    net.blobs["cont"].data[0] = 0
    net.blobs["y"].data[...] = y
    net.forward()
    start = float(net.blobs["loss"].data)
    solver.step(60)
    net.forward()
    end = float(net.blobs["loss"].data)
    assert end < 0.2 * start, (start, end)
