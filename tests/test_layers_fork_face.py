"""Face recognition training layers from Caffe's forks: SphereFace's MarginInnerProduct, center
loss, AM-Softmax's LabelSpecificAdd and Flip. Values against numpy references written here from
the forks' C++ (SphereFace's psi from the paper's definition, independently of the fork's sign
formulas), gradient checks, the forks' own update rules where they are not the gradient, errors,
two ranks equal to one process (tops, bottom diffs and the ranks' summed parameter diffs), small
training runs, and the forks' real training nets (tests/zoo/) run forward and backward."""
import os

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TEST, TRAIN
from syncsgd.blob import Blob
from syncsgd.compile import load_net_param, upgrade_net
from syncsgd.context import Context
from syncsgd.errors import ShapeError
from syncsgd.layers import create
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_loss import as_two_ranks

ZOO = os.path.join(os.path.dirname(__file__), "zoo")
KINDS = {"SINGLE": 1, "DOUBLE": 2, "TRIPLE": 3, "QUADRUPLE": 4}
SCHEDULE = "base: 1000 gamma: 0.12 power: 1 lambda_min: 5"


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def labels(n, classes, seed=0):
    return np.random.default_rng(seed).integers(0, classes, n).astype(np.float32)


def margin_text(kind, n=5, extra="", tops=""):
    return (f"name: 'fc6' type: 'MarginInnerProduct' {tops} margin_inner_product_param {{ "
            f"num_output: {n} type: {kind} weight_filler {{ type: 'gaussian' }} {extra} }}")


def layer_with(text, weights=None, phase=TRAIN, iteration=0, rank=0, size=1, allreduce=None):
    """A layer as make_layer makes it, at ctx.iteration `iteration`, its parameters set to
    `weights` once set up (run_forward's setup keeps blobs that exist)."""
    ctx = Context(phase, seed=1701, rank=rank, size=size, allreduce=allreduce)
    ctx.iteration = iteration
    layer = create(text_format.Parse(text, pb.LayerParameter()), ctx)
    if weights is not None:
        for w in weights:
            layer.blobs.append(Blob(w.shape))
            layer.blobs[-1].data[...] = w
    return layer


# -- numpy references ----------------------------------------------------------------------------
def chebyshev(m, c):
    """T_m(c) = cos(m arccos c) and its derivative."""
    t = np.polynomial.chebyshev.Chebyshev.basis(m)
    return t(c), t.deriv()(c)


def margin_ref(x, w, label, m, lam):
    """SphereFace's forward in float64: psi(theta) = (-1)^k cos(m theta) - 2k on
    [k pi / m, (k + 1) pi / m] (the paper's definition) for the target scores, blended with the
    plain score: (lambda x.w + |x| psi) / (1 + lambda). Returns (top, normalised weights)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    w = w / np.linalg.norm(w, axis=1, keepdims=True)
    top = x @ w.T
    if m == 1:
        return top, w
    for i, y in enumerate(label.astype(int)):
        norm = np.linalg.norm(x[i])
        c = top[i, y] / norm
        k = np.floor(m * np.arccos(np.clip(c, -1, 1)) / np.pi)
        psi = (-1) ** k * chebyshev(m, c)[0] - 2 * k
        top[i, y] = (lam * top[i, y] + norm * psi) / (1 + lam)
    return top, w


def margin_backward_ref(x, w, label, m, lam, dy, unit=True):
    """The fork's CPU backward, loop for loop: each target score's bottom gradient
    coeff_w * w + coeff_x * x with (coeff_w, coeff_x) = (psi'(c), (psi - c psi') / |x|) scaled to
    unit length (or, with unit=False, not: the true gradient); weight gradient dy^T x."""
    x, w, dy = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    dx = np.zeros_like(x)
    for i, y in enumerate(label.astype(int)):
        norm = np.linalg.norm(x[i])
        for j in range(w.shape[0]):
            if j != y or m == 1:
                dx[i] += dy[i, j] * w[j]
                continue
            c = x[i] @ w[j] / norm
            k = np.floor(m * np.arccos(np.clip(c, -1, 1)) / np.pi)
            value, slope = chebyshev(m, c)
            psi, dpsi = (-1) ** k * value - 2 * k, (-1) ** k * slope
            cw, cx = dpsi, (psi - c * dpsi) / norm
            if unit:
                cw, cx = cw / np.hypot(cw, cx), cx / np.hypot(cw, cx)
            dx[i] += dy[i, j] / (1 + lam) * (cw * w[j] + cx * x[i])
            dx[i] += dy[i, j] * lam / (1 + lam) * w[j]
    return dx, dy.T @ x


def lambda_ref(iteration, base=1000.0, gamma=0.12, power=1.0, lambda_min=5.0):
    return max(base * (1 + gamma * iteration) ** -power, lambda_min)


def center_loss_ref(x, label, centers, weight=1.0):
    """The fork's loss, bottom gradient and centre update (-sum(x - c_j) / (1 + n_j))."""
    x, centers = x.astype(np.float64), centers.astype(np.float64)
    d = x - centers[label.astype(int)]
    update = np.zeros_like(centers)
    for j in range(len(centers)):
        mine = label.astype(int) == j
        update[j] = -d[mine].sum(axis=0) / (1 + mine.sum())
    return (d ** 2).sum() / len(x) / 2, d * weight / len(x), update


def label_add_ref(x, label, bias):
    top = x.astype(np.float64).reshape(len(x), -1)
    for i, y in enumerate(label.astype(int)):
        if top[i, y] > -bias:
            top[i, y] += bias
    return top.reshape(x.shape)


def flip_ref(x, width, height):
    """The fork's index loop over legacy (num, channels, height, width)."""
    shape = x.shape + (1,) * (4 - x.ndim)
    src = x.reshape(shape)
    out = np.empty(shape, x.dtype)
    n_, c_, h_, w_ = shape
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    out[n, c, h, w] = src[n, c, h_ - 1 - h if height else h,
                                          w_ - 1 - w if width else w]
    return out.reshape(x.shape)


def numeric_gradient(objective, array, step=1e-3):
    """Central differences of objective() over every element of `array` (float64 result)."""
    grad = np.zeros(array.shape)
    flat = array.reshape(-1)
    for k in range(flat.size):
        original = flat[k]
        flat[k] = original + step
        plus = objective()
        flat[k] = original - step
        minus = objective()
        flat[k] = original
        grad.reshape(-1)[k] = (plus - minus) / (2 * step)
    return grad


# -- MarginInnerProduct --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_margin_inner_product_forward(kind):
    x, y = randn(6, 2, 2) * 3, labels(6, 5)
    w = randn(5, 4, seed=1) * 2
    layer = layer_with(margin_text(kind, extra=SCHEDULE, tops="top: 'fc6' top: 'lambda'"),
                       [w], iteration=6)
    top, lam = run_forward(layer, blobs_from([x, y]), 2)
    assert lam.shape == (1,) and lam.data[0] == pytest.approx(lambda_ref(7), rel=1e-6)
    want, unit = margin_ref(x.reshape(6, 4), w, y, KINDS[kind], lambda_ref(7))
    np.testing.assert_allclose(top.data, want, rtol=1e-5, atol=1e-5)
    # The fork normalises the weight rows in place: the solver updates unit rows.
    np.testing.assert_allclose(layer.blobs[0].data, unit, rtol=1e-6)


def test_margin_inner_product_lambda_schedule_and_psi_range():
    """lambda = max(base (1 + gamma iter)^-power, lambda_min) with iter = `iteration` +
    ctx.iteration + 1; at lambda 0 a QUADRUPLE target score is |x| psi, psi in [-7, 1]."""
    x, y = randn(40, 3, seed=2), labels(40, 2, seed=3)
    w = randn(2, 3, seed=4)
    for step, want in ((0, lambda_ref(4)), (10, lambda_ref(14)), (10 ** 5, 5.0)):
        layer = layer_with(margin_text("QUADRUPLE", 2, SCHEDULE + " iteration: 3",
                                       "top: 'a' top: 'b'"), [w], iteration=step)
        _, lam = run_forward(layer, blobs_from([x, y]), 2)
        assert lam.data[0] == pytest.approx(want, rel=1e-6)
    layer = layer_with(margin_text("QUADRUPLE", 2, "base: 0"), [w])
    (top,) = run_forward(layer, blobs_from([x, y]))
    psi = top.data[np.arange(40), y.astype(int)] / np.linalg.norm(x, axis=1)
    assert psi.min() >= -7 - 1e-5 and psi.max() <= 1 + 1e-5 and psi.min() < -1


def test_margin_inner_product_single_gradient():
    """SINGLE is an inner product with unit weight rows: its bottom gradient is exact, and its
    weight gradient is exact for the unit rows (through the normalisation it is that gradient
    projected onto each row's tangent space)."""
    x, y = randn(4, 3, seed=5), labels(4, 3, seed=6)
    w = randn(3, 3, seed=7)
    layer = layer_with(margin_text("SINGLE", 3), [w])
    assert check_gradient(layer, blobs_from([x, y]), check_bottom=[0], check_params=False) > 0
    bottom = blobs_from([x, y])
    (top,) = run_forward(layer, bottom)
    dy = randn(4, 3, seed=8)
    top.diff[...] = dy
    layer.blobs[0].diff[...] = 0
    layer.backward([top], [False, False], bottom)
    unit = layer.blobs[0].data.copy()

    def objective():
        layer.blobs[0].data[...] = weights
        layer.forward(bottom, [top])
        return float((top.data.astype(np.float64) * dy).sum())
    weights = unit.copy()
    numeric = numeric_gradient(objective, weights)
    grad = layer.blobs[0].diff.astype(np.float64)
    tangent = grad - unit * (grad * unit).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(numeric, tangent, atol=2e-3)


@pytest.mark.parametrize("kind", ["DOUBLE", "TRIPLE", "QUADRUPLE"])
def test_margin_inner_product_backward_is_the_forks(kind):
    """The layer's backward equals the fork's (reference above), whose target terms are the true
    gradient (central differences of the layer's forward at a fixed iteration) with their two
    coefficients scaled to unit length; the weight gradient is dy^T x."""
    x, y = randn(4, 5, seed=9) * 2, labels(4, 3, seed=10)
    w = randn(3, 5, seed=11)
    lam = lambda_ref(3, base=0.5, gamma=1, lambda_min=0)      # small: the margin term counts
    layer = layer_with(margin_text(kind, 3, "base: 0.5 gamma: 1"), [w], iteration=2)
    bottom = blobs_from([x, y])
    (top,) = run_forward(layer, bottom)
    dy = randn(4, 3, seed=12)
    top.diff[...] = dy
    layer.backward([top], [True, False], bottom)
    unit = layer.blobs[0].data.copy()
    dx, dw = margin_backward_ref(x, unit, y, KINDS[kind], lam, dy)
    np.testing.assert_allclose(bottom[0].diff, dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-5)

    def objective():
        layer.forward(bottom, [top])
        return float((top.data.astype(np.float64) * dy).sum())
    numeric = numeric_gradient(objective, bottom[0].data)
    true_dx, _ = margin_backward_ref(x, unit, y, KINDS[kind], lam, dy, unit=False)
    np.testing.assert_allclose(numeric, true_dx, rtol=2e-3, atol=2e-3)
    assert np.abs(true_dx - dx).max() > 0.1       # the fork's is not the true gradient


def test_margin_inner_product_loads_the_forks_weights(tmp_path):
    """A .caffemodel as SphereFace's Caffe writes it (its margin_inner_product_param under fork
    number 147, syncsgd's swish_param) loads: one (num_output, K) weight, no bias."""
    param = text_format.Parse("""
        layer { name: "in" type: "Input" top: "x" top: "y"
                input_param { shape { dim: 2 dim: 4 } shape { dim: 2 } } }
        layer { name: "fc6" type: "MarginInnerProduct" bottom: "x" bottom: "y" top: "fc6"
                margin_inner_product_param { num_output: 3 type: DOUBLE
                                             weight_filler { type: "xavier" } } }""",
                              pb.NetParameter())
    w = randn(3, 4, seed=13)
    stored = pb.LayerParameter(name="fc6", type="MarginInnerProduct")
    stored.blobs.add(data=w.ravel()).shape.dim.extend(w.shape)
    fork_param = pb.MarginInnerProductParameter(num_output=3, type=1).SerializeToString()
    layer_bytes = stored.SerializeToString() + field(147, fork_param)
    path = tmp_path / "sphereface.caffemodel"
    path.write_bytes(field(100, layer_bytes))
    net = syncsgd.Net(param, TEST)
    net.copy_from(str(path))
    np.testing.assert_array_equal(net.params["fc6"][0].data, w)


def field(number, payload):
    """A length-delimited protobuf field."""
    def varint(v):
        out = bytearray()
        while v > 0x7F:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        return bytes(out + bytes([v]))
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def test_margin_inner_product_errors():
    x, y = randn(2, 4), labels(2, 3)
    with pytest.raises(ShapeError, match="num_output"):
        run_forward(make_layer("type: 'MarginInnerProduct'"), blobs_from([x, y]))
    with pytest.raises(ShapeError, match="outside 0..2"):
        run_forward(layer_with(margin_text("DOUBLE", 3)), blobs_from([x, y + 3]))
    with pytest.raises(ShapeError, match="one class index per row"):
        run_forward(layer_with(margin_text("DOUBLE", 3)), blobs_from([x, labels(3, 3)]))
    with pytest.raises(ShapeError, match="weight_filler"):
        text = "type: 'MarginInnerProduct' margin_inner_product_param { num_output: 3 }"
        run_forward(make_layer(text), blobs_from([x, y]))
    layer = layer_with(margin_text("DOUBLE", 3))
    run_forward(layer, blobs_from([x, y]))
    with pytest.raises(ShapeError, match="the weights take 4"):
        layer.reshape(blobs_from([randn(2, 5), y]), [Blob()])
    with pytest.raises(ShapeError, match=r"must be \(3, 4\)"):
        run_forward(layer_with(margin_text("DOUBLE", 3), [randn(3, 5)]), blobs_from([x, y]))
    bottom = blobs_from([x, y])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="propagate_down"):
        layer.backward(top, [True, True], bottom)


# -- CenterLoss ----------------------------------------------------------------------------------
CENTER = ("name: 'center' type: 'CenterLoss' center_loss_param { num_output: 4 "
          "center_filler { type: 'gaussian' } }")


def test_center_loss_value_gradient_and_update():
    x, y = randn(6, 2, 3, seed=14), labels(6, 4, seed=15)
    y[:3] = 2                              # one class three times, one maybe absent
    c = randn(4, 6, seed=16)
    layer = layer_with(CENTER, [c])
    bottom = blobs_from([x, y])
    (top,) = run_forward(layer, bottom)
    loss, dx, update = center_loss_ref(x.reshape(6, 6), y, c, weight=0.5)
    np.testing.assert_allclose(top.data, loss, rtol=1e-5)
    top.diff[...] = 0.5
    layer.blobs[0].diff[...] = 1.0        # Caffe accumulates parameter diffs
    layer.backward([top], [True, False], bottom)
    np.testing.assert_allclose(bottom[0].diff.reshape(6, 6), dx, rtol=1e-5, atol=1e-7)
    # The centres' update ignores the loss weight, as in the fork.
    np.testing.assert_allclose(layer.blobs[0].diff, update + 1, rtol=1e-5, atol=1e-6)
    assert check_gradient(layer_with(CENTER, [c]), blobs_from([x, y]), check_bottom=[0],
                          check_params=False) > 0


def test_center_loss_errors():
    x, y = randn(3, 4), labels(3, 4)
    with pytest.raises(ShapeError, match="num_output"):
        run_forward(make_layer("type: 'CenterLoss'"), blobs_from([x, y]))
    with pytest.raises(ShapeError, match="outside 0..3"):
        run_forward(make_layer(CENTER), blobs_from([x, y + 4]))
    with pytest.raises(ShapeError, match="axis 2"):
        run_forward(make_layer(CENTER.replace("}", "} axis: 2", 1)),
                    blobs_from([randn(3, 2, 2), y]))
    with pytest.raises(ShapeError, match="one class index per sample"):
        run_forward(make_layer(CENTER), blobs_from([x, randn(3, 2)]))
    layer = make_layer(CENTER)
    bottom = blobs_from([x, y])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="the centres 4"):
        layer.reshape(blobs_from([randn(3, 5), y]), top)
    with pytest.raises(ShapeError, match="propagate_down"):
        layer.backward(top, [True, True], bottom)


# -- LabelSpecificAdd ----------------------------------------------------------------------------
ADD = "type: 'LabelSpecificAdd' label_specific_add_param { bias: -0.35 }"


def test_label_specific_add_values_phases_and_gradient():
    x, y = np.random.default_rng(17).uniform(-1, 1, (8, 5)).astype(np.float32), labels(8, 5)
    (top,) = run_forward(make_layer(ADD), blobs_from([x, y]))
    np.testing.assert_allclose(top.data, label_add_ref(x, y, -0.35), rtol=1e-6)
    assert (top.data != x).sum() == (x[np.arange(8), y.astype(int)] > 0.35).sum() > 0
    for text in (ADD, ADD.replace("}", "transform_test: true }")):
        (top,) = run_forward(make_layer(text, phase=TEST), blobs_from([x, y]))
        np.testing.assert_array_equal(top.data, x)
    layer = make_layer(ADD)
    assert check_gradient(layer, blobs_from([x, y]), check_bottom=[0],
                          kink=lambda v: v - 0.35, kink_range=0.02) > 0
    # In place the diff passes through untouched.
    blob, label = blobs_from([x, y])
    layer.setup([blob, label], [blob])
    layer.reshape([blob, label], [blob])
    layer.forward([blob, label], [blob])
    np.testing.assert_allclose(blob.data, label_add_ref(x, y, -0.35), rtol=1e-6)
    blob.diff[...] = 3.0
    layer.backward([blob], [True, False], [blob, label])
    assert (blob.diff == 3.0).all()


def test_label_specific_add_annealed_bias():
    """bias = bias_base + (1 + gamma iter)^power - 1 clipped to [bias_min, bias_max], iter =
    `iteration` + ctx.iteration; the second top reports it."""
    x, y = randn(4, 3, seed=18) + 2, labels(4, 3, seed=19)
    text = ("type: 'LabelSpecificAdd' top: 'a' top: 'b' label_specific_add_param { "
            "bias_base: -0.1 bias_gamma: 0.5 bias_power: -1 bias_min: -0.35 bias_max: 0 "
            "iteration: 2 }")
    for step in (0, 3, 1000):
        want = min(max(-0.1 + (1 + 0.5 * (2 + step)) ** -1 - 1, -0.35), 0.0)
        top, bias = run_forward(layer_with(text, iteration=step), blobs_from([x, y]), 2)
        assert bias.data[0] == pytest.approx(want, rel=1e-6)
        np.testing.assert_allclose(top.data, label_add_ref(x, y, want), rtol=1e-6)


def test_label_specific_add_errors():
    with pytest.raises(ShapeError, match="one class index per sample"):
        run_forward(make_layer(ADD), blobs_from([randn(3, 4), labels(4, 4)]))
    with pytest.raises(ShapeError, match="outside 0..3"):
        run_forward(make_layer(ADD), blobs_from([randn(2, 4), np.array([1, 4], np.float32)]))


# -- Flip ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,shape", [
    ("", (2, 3, 4, 5)), ("flip_param { flip_height: true }", (2, 3, 4, 5)),
    ("flip_param { flip_width: false flip_height: true }", (2, 2, 3, 4)),
    ("flip_param { flip_height: true }", (2, 3, 4)), ("", (3, 4))])
def test_flip_values_and_gradient(params, shape):
    p = text_format.Parse(params, pb.LayerParameter()).flip_param
    x = randn(*shape, seed=20)
    layer = make_layer(f"type: 'Flip' {params}")
    (top,) = run_forward(layer, blobs_from([x]))
    np.testing.assert_array_equal(top.data, flip_ref(x, p.flip_width, p.flip_height))
    assert check_gradient(layer, blobs_from([x])) > 0


def test_flip_refuses_five_axes():
    with pytest.raises(ShapeError, match="4 axes"):
        run_forward(make_layer("type: 'Flip'"), blobs_from([randn(1, 2, 2, 2, 2)]))


# -- two ranks = one process ---------------------------------------------------------------------
def split_run(text, arrays, cut, weights, n_top=1, propagate=(True, False), iteration=0):
    """tests/test_layers_loss.two_rank_run with parameters: both ranks and one process start
    from `weights`, at ctx.iteration `iteration`. Returns (one process, [rank 0, rank 1]), each
    (top values, bottom diffs, parameter diffs)."""
    def run(rows, rank=0, size=1, allreduce=None):
        layer = layer_with(text, weights, iteration=iteration, rank=rank, size=size,
                           allreduce=allreduce)
        bottom = blobs_from([a[rows] for a in arrays])
        top = run_forward(layer, bottom, n_top)
        top[0].diff[...] = 1.7
        layer.backward(top, list(propagate), bottom)
        return ([t.data.copy() for t in top], [b.diff.copy() for b in bottom],
                [p.diff.copy() for p in layer.blobs])

    parts = (slice(0, cut), slice(cut, None))
    return run(slice(None)), as_two_ranks(lambda r, allreduce: run(parts[r], r, 2, allreduce))


def assert_split_with_params_equals_whole(text, arrays, cut, weights, n_top=1, sliced_tops=(),
                                          iteration=0):
    """The ranks' tops (or, for `sliced_tops`, the tops together), bottom diffs together and
    parameter diffs summed (the solver's gradient allreduce) equal one process's."""
    whole, ranks = split_run(text, arrays, cut, weights, n_top, iteration=iteration)
    for j, want in enumerate(whole[0]):
        got = ([np.concatenate([r[0][j] for r in ranks])] if j in sliced_tops
               else [r[0][j] for r in ranks])
        for g in got:
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.concatenate([r[1][0] for r in ranks]), whole[1][0],
                               rtol=1e-5, atol=1e-7)
    for k, want in enumerate(whole[2]):
        np.testing.assert_allclose(ranks[0][2][k] + ranks[1][2][k], want, rtol=1e-5,
                                   atol=1e-6)
    return whole


def test_center_loss_split_between_ranks():
    """Class 1 sits on both ranks, class 3 only on rank 1: each centre's update divides by its
    count over the global batch."""
    x = randn(7, 3, seed=21)
    y = np.array([1, 1, 0, 1, 3, 3, 2], np.float32)
    whole = assert_split_with_params_equals_whole(CENTER.replace("4", "5"), [x, y], 3,
                                                  [randn(5, 3, seed=22)])
    assert np.abs(whole[2][0]).max() > 0.1


@pytest.mark.parametrize("kind", ["SINGLE", "QUADRUPLE"])
def test_margin_inner_product_split_between_ranks(kind):
    x, y = randn(5, 4, seed=23), labels(5, 3, seed=24)
    assert_split_with_params_equals_whole(
        margin_text(kind, 3, SCHEDULE, "top: 'a' top: 'b'"), [x, y], 2,
        [randn(3, 4, seed=25)], n_top=2, sliced_tops=(0,), iteration=20)


def test_label_specific_add_split_between_ranks():
    x, y = randn(5, 4, seed=26), labels(5, 4, seed=27)
    assert_split_with_params_equals_whole(ADD, [x, y], 3, None, sliced_tops=(0,))


# -- training ------------------------------------------------------------------------------------
NET = """
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "%s" batch_size: 16 shuffle: true } }
layer { name: "fc5" type: "InnerProduct" bottom: "data" top: "fc5"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "fc6" type: "MarginInnerProduct" bottom: "fc5" bottom: "label" top: "fc6"
        top: "lambda"
        margin_inner_product_param { num_output: 4 type: QUADRUPLE
                                     weight_filler { type: "xavier" }
                                     base: 1000 gamma: 0.12 power: 1 lambda_min: 5 } }
layer { name: "softmax_loss" type: "SoftmaxWithLoss" bottom: "fc6" bottom: "label"
        top: "softmax_loss" }
"""
CENTER_LOSS = """
layer { name: "center_loss" type: "CenterLoss" bottom: "fc5" bottom: "label"
        top: "center_loss" param { lr_mult: 1 decay_mult: 0 } loss_weight: 0.1
        center_loss_param { num_output: 4 center_filler { type: "xavier" } } }
"""


@pytest.mark.parametrize("center", [False, True])
def test_sphereface_training_lowers_the_loss(tmp_path, center):
    """A SphereFace-style net (and one with center loss) on four clusters in 8-D, written to
    HDF5: 40 SGD steps lower the softmax loss (and the center loss)."""
    rng = np.random.default_rng(28)
    y = rng.integers(0, 4, 64)
    x = (rng.standard_normal((4, 8)) * 2)[y] + rng.standard_normal((64, 8)) * 0.5
    with h5py.File(tmp_path / "set.h5", "w") as f:
        f["data"] = x.astype(np.float32)
        f["label"] = y.astype(np.float32)
    (tmp_path / "set.txt").write_text(f"{tmp_path / 'set.h5'}\n")
    solver = text_format.Parse("type: 'SGD' base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' "
                               "max_iter: 40 display: 0 random_seed: 5", pb.SolverParameter())
    text = NET % (tmp_path / "set.txt") + (CENTER_LOSS if center else "")
    text_format.Parse(text, solver.net_param)
    solver = syncsgd.get_solver(solver)
    losses = []
    try:
        for _ in range(40):
            solver.step(1)
            blobs = solver.net.blobs
            losses.append([float(blobs[k].data) for k in blobs
                           if k in ("softmax_loss", "center_loss")])
        assert float(blobs["lambda"].data[0]) == pytest.approx(lambda_ref(40), rel=1e-6)
    finally:
        solver.close()
    first, last = np.mean(losses[:5], axis=0), np.mean(losses[-5:], axis=0)
    assert (last < 0.5 * first).all(), (first, last)


# -- the forks' real training nets ---------------------------------------------------------------
def training_net(path, channels, size, batch=2):
    """The TRAIN net of a training prototxt with its data layers (files the repository does not
    hold) replaced by an Input of `batch` images of `size` and their labels."""
    param, _ = load_net_param(path)
    upgrade_net(param, path)
    for layer in param.layer:
        if layer.type.endswith("Data"):
            new = pb.LayerParameter(name=layer.name, type="Input", top=layer.top,
                                    include=layer.include)
            new.input_param.shape.add(dim=[batch, channels] + list(size))
            new.input_param.shape.add(dim=[batch])
            layer.CopyFrom(new)
    return syncsgd.Net(param, TRAIN)


def feed(net, classes, seed):
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.uniform(-1, 1, net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, classes, net.blobs["label"].shape)


def test_sphereface_20_training_net():
    """SphereFace-20's training net (QUADRUPLE margin over 10572 identities) at 16x16: its fc6
    equals the reference on its own fc5 and weights, and backward reaches conv1_1."""
    path = os.path.join(ZOO, "wy1iu_sphereface/train/code/sphereface_model.prototxt")
    net = training_net(path, 3, (16, 16))
    feed(net, 10572, seed=29)
    net.forward()
    assert float(net.blobs["lambda"].data[0]) == pytest.approx(lambda_ref(1), rel=1e-6)
    fc6 = net.layer_dict["fc6"]
    want, _ = margin_ref(net.blobs["fc5"].data, fc6.blobs[0].data, net.blobs["label"].data, 4,
                         lambda_ref(1))
    np.testing.assert_allclose(net.blobs["fc6"].data, want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(net.blobs["softmax_loss"].data)
    net.backward()
    assert np.abs(fc6.blobs[0].diff).max() > 0
    assert np.isfinite(net.params["conv1_1"][0].diff).all()
    assert np.abs(net.params["conv1_1"][0].diff).max() > 0


def test_caffe_face_lenet_plus_plus_training_net():
    """caffe-face's LeNet++ MNIST training net (softmax + 0.01 center loss on the 2-D feature)
    at its own 28x28: center loss and the centres' update equal the reference."""
    path = os.path.join(ZOO, "ydwen_caffe-face/mnist_example/mnist_train_test.prototxt")
    net = training_net(path, 1, (28, 28), batch=4)
    feed(net, 10, seed=30)
    net.forward()
    centers = net.params["center_loss"][0].data
    loss, _, update = center_loss_ref(net.blobs["ip1"].data, net.blobs["label"].data, centers)
    np.testing.assert_allclose(net.blobs["center_loss"].data, loss, rtol=1e-5)
    net.clear_param_diffs()
    net.backward()
    np.testing.assert_allclose(net.params["center_loss"][0].diff, update, rtol=1e-5,
                               atol=1e-7)
    assert np.abs(net.params["conv1"][0].diff).max() > 0


LANES_NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 7 dim: 3 dim: 6 dim: 6 } shape { dim: 7 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "fc5" type: "InnerProduct" bottom: "conv" top: "fc5"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "center" type: "CenterLoss" bottom: "fc5" bottom: "label" top: "center_loss"
        center_loss_param { num_output: 4 center_filler { type: "gaussian" } } }
layer { name: "fc6" type: "MarginInnerProduct" bottom: "fc5" bottom: "label" top: "fc6"
        margin_inner_product_param { num_output: 4 type: DOUBLE
                                     weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc6" bottom: "label" top: "loss" }
"""


def test_center_loss_in_lanes(monkeypatch, thread_budget):
    """Threads carrying parts of the batch (syncsgd.lanes) through the convolution and the
    center loss give its loss and centre update as the layers one by one do."""
    thread_budget(2)
    results = []
    for lanes in ("0", "1"):
        monkeypatch.setenv("SYNCSGD_LANES", lanes)
        net = syncsgd.Net(text_format.Parse(LANES_NET, pb.NetParameter()), TRAIN)
        net.blobs["data"].data[...] = randn(7, 3, 6, 6, seed=31)
        net.blobs["label"].data[...] = [0, 1, 1, 1, 2, 3, 3]
        net.forward()
        net.backward()
        results.append((net.lanes.run, float(net.blobs["center_loss"].data),
                        net.params["center"][0].diff.copy()))
    names = [layer.name for layer in net.layers]
    assert results[0][0] is None and results[1][0][1] == names.index("center")
    assert results[1][1] == pytest.approx(results[0][1], rel=1e-5)
    np.testing.assert_allclose(results[1][2], results[0][2], rtol=1e-5, atol=1e-6)
