"""ContrastiveLoss, HingeLoss, InfogainLoss, MultinomialLogisticLoss, Crop, Im2col and SPP:
values against numpy references written here from Caffe's formulas (loops), the shared numeric
gradient check on every input that takes a gradient, errors for bad parameters, equality with
OpenCV's Crop, each type built in a Net from prototxt text, a batch split between two ranks
giving the one-process loss and gradients, and a few dozen SGD steps lowering each new loss."""
import math

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.errors import ShapeError
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_loss import assert_split_equals_whole, labels, randn

LOG_THRESHOLD = 1e-20     # Caffe's kLOG_THRESHOLD


def distinct(*shape, seed=0):
    """Values 0.1 apart in random order: no ties, and a 1e-2 step never reorders them."""
    count = int(np.prod(shape))
    order = np.random.default_rng(seed).permutation(count).reshape(shape)
    return ((order - count / 2) * 0.1).astype(np.float32)


def forward(text, *arrays, n_top=1):
    top = run_forward(make_layer(text), blobs_from(arrays), n_top)
    return [t.data.copy() for t in top]


def write_matrix(path, matrix):
    """A binary BlobProto (.binaryproto) in the legacy 4-D shape, as Caffe's tools write."""
    blob = pb.BlobProto(num=1, channels=1, height=matrix.shape[0], width=matrix.shape[1])
    blob.data.extend(np.asarray(matrix, np.float32).ravel().tolist())
    path.write_bytes(blob.SerializeToString())
    return str(path)


# -- numpy references (float64, loops over Caffe's formulas) ------------------------------------
def contrastive_ref(a, b, sim, margin=1.0, legacy=False):
    total = 0.0
    for n in range(a.shape[0]):
        d2 = float(((a[n].astype(np.float64) - b[n]) ** 2).sum())
        if int(sim.ravel()[n]):
            total += d2
        elif legacy:
            total += max(margin - d2, 0.0)
        else:
            total += max(margin - math.sqrt(d2), 0.0) ** 2
    return total / a.shape[0] / 2


def hinge_ref(x, y, norm="L1"):
    rows = x.reshape(x.shape[0], -1).astype(np.float64)
    total = 0.0
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            t = 1 if j == int(y.ravel()[i]) else -1
            m = max(0.0, 1 - t * rows[i, j])
            total += m if norm == "L1" else m * m
    return total / rows.shape[0]


def multinomial_ref(p, y):
    rows = p.reshape(p.shape[0], -1).astype(np.float64)
    return -sum(math.log(max(rows[i, int(y.ravel()[i])], LOG_THRESHOLD))
                for i in range(rows.shape[0])) / rows.shape[0]


def infogain_ref(x, y, h, axis=1, ignore=None, mode="VALID"):
    x = np.moveaxis(x.astype(np.float64), axis, -1)          # (..., K)
    lab = y.reshape(x.shape[:-1])
    h = h.reshape(x.shape[-1], x.shape[-1]).astype(np.float64)
    total, valid = 0.0, 0
    for idx in np.ndindex(lab.shape):
        if ignore is not None and lab[idx] == ignore:
            continue
        e = np.exp(x[idx] - x[idx].max())
        p = e / e.sum()
        total -= sum(h[int(lab[idx]), k] * math.log(max(p[k], LOG_THRESHOLD))
                     for k in range(len(p)))
        valid += 1
    outer = int(np.prod(x.shape[:axis]))
    norm = {"FULL": lab.size, "VALID": valid, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return total / max(1, norm)


def crop_ref(x, like, axis, offsets):
    index = []
    for i, size in enumerate(x.shape):
        if i < axis:
            index.append(np.arange(size))
            continue
        start = 0 if not offsets else offsets[0] if len(offsets) == 1 else offsets[i - axis]
        index.append(np.arange(start, start + like[i]))
    return x[np.ix_(*index)]


def im2col_ref(x, kernel, pad=(0, 0), stride=(1, 1), dilation=(1, 1)):
    n, c, h, w = x.shape
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = kernel, pad, stride, dilation
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    out = np.zeros((n, c * kh * kw, oh, ow), np.float32)
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                row = (ch * kh + i) * kw + j
                for y in range(oh):
                    for xx in range(ow):
                        iy, ix = y * sh - ph + i * dh, xx * sw - pw + j * dw
                        if 0 <= iy < h and 0 <= ix < w:
                            out[:, row, y, xx] = x[:, ch, iy, ix]
    return out


def spp_ref(x, height, pool="MAX"):
    """Caffe's SPP levels (kernel ceil(size / bins), stride = kernel, pad half the shortfall)
    pooled with Caffe's window and divisor rules (CEIL rounding)."""
    n, c, h, w = x.shape
    levels = []
    for level in range(height):
        bins = 2 ** level
        geometry = []
        for size in (h, w):
            k = -(-size // bins)
            p = (k * bins - size + 1) // 2
            pooled = -(-(size + 2 * p - k) // k) + 1
            if p and (pooled - 1) * k >= size + p:
                pooled -= 1
            geometry.append((k, p, pooled, size))
        (kh, ph, oh, _), (kw, pw, ow, _) = geometry
        out = np.zeros((n, c, oh, ow))
        for py in range(oh):
            for px in range(ow):
                hs, ws = py * kh - ph, px * kw - pw
                he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                area = (he - hs) * (we - ws)
                window = x[:, :, max(hs, 0):min(he, h), max(ws, 0):min(we, w)]
                out[:, :, py, px] = (window.max(axis=(2, 3)) if pool == "MAX"
                                     else window.sum(axis=(2, 3)) / area)
        levels.append(out)
    if height == 1:
        return levels[0]
    return np.concatenate([level.reshape(n, -1) for level in levels], axis=1)


# -- ContrastiveLoss -----------------------------------------------------------------------------
def pairs(n=8, c=4, seed=0, kink=1.0):
    """Feature pairs at distances from 0.3 to 1.8 times `kink` (where the dissimilar pairs' hinge
    bends: the margin, or its square root for legacy_version), none within 0.25 of it;
    similar and dissimilar pairs alternate, the dissimilar ones on both sides of the kink."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, c)).astype(np.float32) * 0.5
    direction = rng.standard_normal((n, c))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    distance = np.resize([0.3, 0.5, 1.25, 0.6, 0.75, 1.5, 1.8, 0.4], n) * kink
    b = (a + direction * distance[:, None]).astype(np.float32)
    sim = (np.arange(n) % 2).astype(np.float32)
    return a, b, sim


@pytest.mark.parametrize("params,margin,legacy", [
    ("", 1.0, False), ("contrastive_loss_param { margin: 0.8 }", 0.8, False),
    ("contrastive_loss_param { legacy_version: true }", 1.0, True),
    ("contrastive_loss_param { margin: 2 legacy_version: true }", 2.0, True)])
def test_contrastive_loss_value(params, margin, legacy):
    a, b, sim = pairs(kink=math.sqrt(margin) if legacy else margin)
    (loss,) = forward(f"type: 'ContrastiveLoss' {params}", a, b, sim)
    assert loss.shape == ()
    ref = contrastive_ref(a, b, sim, margin, legacy)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    # Both kinds of pair contribute: dropping the dissimilar ones changes the loss.
    assert ref != contrastive_ref(a, b, np.ones_like(sim), margin, legacy)


def test_contrastive_loss_4d_features_and_truncated_labels():
    a, b, sim = pairs()
    (flat,) = forward("type: 'ContrastiveLoss'", a, b, sim)
    # (N, C, 1, 1) features, (N, 1, 1, 1) labels; 0.7 truncates to 0 (dissimilar), 1.5 to 1.
    fuzzy = np.where(sim > 0, 1.5, 0.7).astype(np.float32).reshape(-1, 1, 1, 1)
    (four_d,) = forward("type: 'ContrastiveLoss'", a[:, :, None, None], b, fuzzy)
    np.testing.assert_allclose(four_d, flat, rtol=1e-6)


@pytest.mark.parametrize("params,kink", [
    ("", 1.0), ("contrastive_loss_param { legacy_version: true margin: 2 }", math.sqrt(2)),
    ("contrastive_loss_param { margin: 0.5 }", 0.5)])
def test_contrastive_loss_gradient(params, kink):
    a, b, sim = pairs(seed=3, kink=kink)
    layer = make_layer(f"type: 'ContrastiveLoss' {params}")
    assert check_gradient(layer, blobs_from([a, b, sim]), check_bottom=[0, 1]) > 0


def test_contrastive_loss_backward_is_caffes():
    """Caffe's gradient for a dissimilar pair inside the margin divides by d + 1e-4, not d."""
    a, b, sim = pairs()
    layer = make_layer("type: 'ContrastiveLoss'")
    bottom = blobs_from([a, b, sim])
    top = run_forward(layer, bottom)
    top[0].diff[...] = 2.0
    layer.backward(top, [True, True, False], bottom)
    d = (a - b).astype(np.float64)
    dist = np.linalg.norm(d, axis=1)
    coefficient = np.where(sim > 0, 1, np.where(dist < 1, -(1 - dist) / (dist + 1e-4), 0))
    want = 2.0 * coefficient[:, None] * d / len(a)
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bottom[1].diff, -want, rtol=1e-5, atol=1e-7)


def test_contrastive_loss_errors():
    a, b, sim = pairs()
    with pytest.raises(ShapeError, match="same N and C"):
        forward("type: 'ContrastiveLoss'", a, b[:, :3], sim)
    with pytest.raises(ShapeError, match=r"\(N, C, 1, 1\)"):
        forward("type: 'ContrastiveLoss'", a[:, :, None], np.repeat(b[:, :, None], 2, 2), sim)
    with pytest.raises(ShapeError, match="one label per pair"):
        forward("type: 'ContrastiveLoss'", a, b, np.zeros((8, 2), np.float32))
    with pytest.raises(ShapeError, match="first dimension"):
        forward("type: 'ContrastiveLoss'", a, b[:4], sim)
    layer = make_layer("name: 'c' type: 'ContrastiveLoss'")
    bottom = blobs_from([a, b, sim])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="similarity labels"):
        layer.backward(top, [True, True, True], bottom)
    assert layer.allow_force_backward(1) and not layer.allow_force_backward(2)


def test_contrastive_loss_split_between_ranks():
    a, b, sim = pairs()
    assert_split_equals_whole("type: 'ContrastiveLoss'", [a, b, sim], cut=3,
                              propagate=(True, True, False))


# -- HingeLoss -----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_value(norm):
    x = randn(5, 3, 2, 2)          # scores are the count / N values of each sample
    y = labels((5,), 12, seed=1)
    params = "" if norm == "L1" else "hinge_loss_param { norm: L2 }"
    (loss,) = forward(f"type: 'HingeLoss' {params}", x, y)
    np.testing.assert_allclose(loss, hinge_ref(x, y, norm), rtol=1e-5)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_gradient(norm):
    x, y = randn(4, 5, seed=2) * 2, labels((4,), 5, seed=3)
    layer = make_layer(f"type: 'HingeLoss' hinge_loss_param {{ norm: {norm} }}")
    # The hinges bend where a score is +-1.
    assert check_gradient(layer, blobs_from([x, y]), check_bottom=[0],
                          kink=lambda v: abs(v) - 1, kink_range=0.02) > 0


def test_hinge_loss_errors():
    with pytest.raises(ShapeError, match="outside 0..3"):
        forward("type: 'HingeLoss'", randn(2, 4), np.array([1, 4], np.float32))
    with pytest.raises(ShapeError, match="one label per sample"):
        forward("type: 'HingeLoss'", randn(2, 4), labels((2, 2), 4))
    layer = make_layer("type: 'HingeLoss'")
    bottom = blobs_from([randn(2, 4), labels((2,), 4)])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="propagate_down"):
        layer.backward(top, [True, True], bottom)


def test_hinge_loss_split_between_ranks():
    x, y = randn(6, 4), labels((6,), 4, seed=5)
    for norm in ("L1", "L2"):
        assert_split_equals_whole(f"type: 'HingeLoss' hinge_loss_param {{ norm: {norm} }}",
                                  [x, y], cut=2)


# -- MultinomialLogisticLoss ---------------------------------------------------------------------
def probabilities(n, k, seed=0):
    e = np.exp(randn(n, k, seed=seed))
    return (e / e.sum(1, keepdims=True)).astype(np.float32)


def test_multinomial_logistic_loss_value_and_threshold():
    p, y = probabilities(6, 4), labels((6, 1), 4, seed=1)
    (loss,) = forward("type: 'MultinomialLogisticLoss'", p, y)
    np.testing.assert_allclose(loss, multinomial_ref(p, y), rtol=1e-5)
    # A zero probability is floored at 1e-20, not log(0).
    p[0, int(y[0, 0])] = 0
    (loss,) = forward("type: 'MultinomialLogisticLoss'", p, y)
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, multinomial_ref(p, y), rtol=1e-5)


def test_multinomial_logistic_loss_gradient():
    p, y = probabilities(5, 3, seed=2) + 0.2, labels((5,), 3, seed=3)
    layer = make_layer("type: 'MultinomialLogisticLoss'")
    assert check_gradient(layer, blobs_from([p, y]), check_bottom=[0], step=1e-3) > 0


def test_multinomial_logistic_loss_errors():
    p = probabilities(2, 3)
    with pytest.raises(ShapeError, match="one label per sample"):
        forward("type: 'MultinomialLogisticLoss'", p, labels((2, 2), 3))
    with pytest.raises(ShapeError, match="outside 0..2"):
        forward("type: 'MultinomialLogisticLoss'", p, np.array([0, 5], np.float32))
    layer = make_layer("type: 'MultinomialLogisticLoss'")
    bottom = blobs_from([p, labels((2,), 3)])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="propagate_down"):
        layer.backward(top, [True, True], bottom)


def test_multinomial_logistic_loss_split_between_ranks():
    p, y = probabilities(5, 4), labels((5,), 4, seed=2)
    assert_split_equals_whole("type: 'MultinomialLogisticLoss'", [p, y], cut=3)


# -- InfogainLoss --------------------------------------------------------------------------------
MODES = ["FULL", "VALID", "BATCH_SIZE", "NONE"]


def infogain_matrix(k, seed=0):
    return (np.eye(k) + np.random.default_rng(seed).random((k, k)) * 0.5).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_infogain_loss_modes_with_matrix_file(tmp_path, mode):
    x = randn(3, 4, 2, 3) * 2
    y = labels((3, 1, 2, 3), 4, ignore=9, ignored=0.3)
    h = infogain_matrix(4)
    source = write_matrix(tmp_path / "h.binaryproto", h)
    text = (f"type: 'InfogainLoss' infogain_loss_param {{ source: '{source}' }} "
            f"loss_param {{ ignore_label: 9 normalization: {mode} }}")
    (loss,) = forward(text, x, y)
    np.testing.assert_allclose(loss, infogain_ref(x, y, h, ignore=9, mode=mode), rtol=1e-5)


def test_infogain_loss_third_bottom_axis_and_probability_top():
    x = randn(2, 3, 5)
    y = labels((2, 3), 5, seed=1)
    h = infogain_matrix(5, seed=2)
    loss, prob = forward("type: 'InfogainLoss' infogain_loss_param { axis: -1 }", x, y, h,
                         n_top=2)
    np.testing.assert_allclose(loss, infogain_ref(x, y, h, axis=2), rtol=1e-5)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(prob, e / e.sum(-1, keepdims=True), rtol=1e-5)


def test_infogain_loss_with_identity_is_softmax_loss():
    x, y = randn(6, 4, seed=3), labels((6,), 4, seed=4)
    (infogain,) = forward("type: 'InfogainLoss'", x, y, np.eye(4, dtype=np.float32))
    (softmax,) = forward("type: 'SoftmaxWithLoss'", x, y)
    np.testing.assert_allclose(infogain, softmax, rtol=1e-5)


@pytest.mark.parametrize("params", [
    "", "loss_param { ignore_label: 1 }", "loss_param { normalization: BATCH_SIZE }",
    "loss_param { ignore_label: 1 normalization: FULL }"])
def test_infogain_loss_gradient(params):
    x = randn(3, 4, 2, 2, seed=1)
    y = labels((3, 1, 2, 2), 4, seed=2)
    layer = make_layer(f"type: 'InfogainLoss' {params}")
    assert check_gradient(layer, blobs_from([x, y, infogain_matrix(4, seed=3)]),
                          check_bottom=[0]) > 0


def test_infogain_loss_gradient_from_matrix_file_with_probability_top(tmp_path):
    source = write_matrix(tmp_path / "h.binaryproto", infogain_matrix(3, seed=4))
    layer = make_layer(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{source}' }} "
                       "loss_weight: 1 loss_weight: 0")
    x, y = randn(4, 3, seed=5), labels((4,), 3, seed=6)
    assert check_gradient(layer, blobs_from([x, y]), n_top=2, top_index=0,
                          check_bottom=[0]) > 0


def test_infogain_loss_errors(tmp_path):
    x, y = randn(2, 3), labels((2,), 3)
    with pytest.raises(ShapeError, match="infogain_loss_param.source"):
        forward("type: 'InfogainLoss'", x, y)
    with pytest.raises(ShapeError, match="no such file"):
        forward(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{tmp_path}/none' }}",
                x, y)
    source = write_matrix(tmp_path / "h.binaryproto", infogain_matrix(4))
    with pytest.raises(ShapeError, match="3 x 3"):
        forward(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{source}' }}", x, y)
    with pytest.raises(ShapeError, match="third bottom holds 4 values"):
        forward("type: 'InfogainLoss'", x, y, np.eye(2, dtype=np.float32))
    with pytest.raises(ShapeError, match="normalization"):
        forward("type: 'InfogainLoss' loss_param { normalize: true }", x, y, np.eye(3))
    with pytest.raises(ShapeError, match="labels for"):
        forward("type: 'InfogainLoss'", randn(2, 3, 2), y, np.eye(3))
    layer = make_layer("type: 'InfogainLoss'")
    bottom = blobs_from([x, y, np.eye(3)])
    top = run_forward(layer, bottom)
    with pytest.raises(ShapeError, match="infogain matrix"):
        layer.backward(top, [True, False, True], bottom)
    with pytest.raises(ShapeError, match="labels"):
        layer.backward(top, [True, True, False], bottom)
    assert layer.allow_force_backward(0)
    assert not layer.allow_force_backward(1) and not layer.allow_force_backward(2)


def test_infogain_loss_split_between_ranks(tmp_path):
    source = write_matrix(tmp_path / "h.binaryproto", infogain_matrix(4, seed=5))
    x = randn(6, 4, 3)
    y = labels((6, 3), 4, seed=1)
    y[:2] = 255
    for mode in MODES:
        text = (f"type: 'InfogainLoss' infogain_loss_param {{ source: '{source}' }} "
                f"loss_param {{ ignore_label: 255 normalization: {mode} }}")
        assert_split_equals_whole(text, [x, y], cut=3, n_top=2, sliced_tops=(1,))


# -- Crop ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,axis,offsets", [
    ("", 2, []), ("crop_param { axis: 2 offset: 3 }", 2, [3]),
    ("crop_param { axis: 1 offset: 1 offset: 2 offset: 0 }", 1, [1, 2, 0]),
    ("crop_param { axis: -1 offset: 2 }", 3, [2]), ("crop_param { axis: 0 offset: 1 }", 0, [1])])
def test_crop_value(params, axis, offsets):
    x = randn(3, 4, 7, 8)
    like = (2, 2, 4, 5) if axis == 0 else (9, 2, 4, 5) if axis == 1 else (9, 9, 4, 5)
    (out,) = forward(f"type: 'Crop' {params}", x, np.zeros(like, np.float32))
    np.testing.assert_array_equal(out, crop_ref(x, like, axis, offsets))


def test_crop_gradient():
    layer = make_layer("type: 'Crop' crop_param { axis: 1 offset: 1 offset: 2 offset: 3 }")
    bottom = blobs_from([randn(2, 4, 6, 7), np.zeros((2, 2, 3, 3), np.float32)])
    assert check_gradient(layer, bottom, check_bottom=[0]) > 0
    # The reference bottom gives only a shape: its gradient is zero when asked for.
    top = run_forward(layer, bottom)
    top[0].diff[...] = 1
    bottom[1].diff[...] = 5
    layer.backward(top, [False, True], bottom)
    assert not bottom[1].diff.any()


def test_crop_errors():
    x = randn(2, 3, 6, 6)
    with pytest.raises(ShapeError, match="one per cropped axis"):
        forward("type: 'Crop' crop_param { axis: 2 offset: 1 offset: 1 offset: 1 }", x,
                np.zeros((2, 3, 2, 2), np.float32))
    with pytest.raises(ShapeError, match="out of bounds"):
        forward("type: 'Crop' crop_param { offset: 3 }", x, np.zeros((2, 3, 4, 4), np.float32))
    with pytest.raises(ShapeError, match="as many axes"):
        forward("type: 'Crop'", x, np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ShapeError, match="out of range"):
        forward("type: 'Crop' crop_param { axis: 4 }", x, x)


CROP_NET = """
layer {{ name: "data" type: "Input" top: "data"
        input_param {{ shape {{ dim: {data} }} }} }}
layer {{ name: "like" type: "Input" top: "like"
        input_param {{ shape {{ dim: {like} }} }} }}
layer {{ name: "crop" type: "Crop" bottom: "data" bottom: "like" top: "crop"
        crop_param {{ {params} }} }}
"""


@pytest.mark.parametrize("data,like,params", [
    ((1, 21, 60, 62), (1, 3, 22, 20), "axis: 2 offset: 19"),        # FCN-8s' score crop
    ((2, 5, 9, 9), (2, 3, 4, 6), "axis: 1 offset: 1 offset: 2 offset: 3"),
    ((2, 3, 8, 7), (2, 3, 5, 5), "")])
def test_crop_equals_opencv(tmp_path, data, like, params):
    cv2 = pytest.importorskip("cv2")
    path = tmp_path / "crop.prototxt"
    path.write_text(CROP_NET.format(data=" dim: ".join(map(str, data)),
                                    like=" dim: ".join(map(str, like)), params=params))
    x, ref = randn(*data), randn(*like, seed=1)
    net = syncsgd.Net(str(path), syncsgd.TEST)
    ours = net.forward(data=x, like=ref)["crop"]
    cv = cv2.dnn.readNetFromCaffe(str(path))
    cv.setInput(x, "data")
    cv.setInput(ref, "like")
    theirs = cv.forward("crop")
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


# -- Im2col --------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,kernel,pad,stride,dilation", [
    ("kernel_size: 3", (3, 3), (0, 0), (1, 1), (1, 1)),
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (1, 1), (2, 2), (1, 1)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1", (2, 3), (1, 0), (1, 2), (1, 1)),
    ("kernel_size: 2 dilation: 2 pad: 1", (2, 2), (1, 1), (1, 1), (2, 2))])
def test_im2col_value(params, kernel, pad, stride, dilation):
    x = randn(2, 3, 6, 7)
    (out,) = forward(f"type: 'Im2col' convolution_param {{ {params} }}", x)
    np.testing.assert_array_equal(out, im2col_ref(x, kernel, pad, stride, dilation))


def test_im2col_other_axis():
    """Axes before convolution_param.axis are samples: (2, 3, C, H, W) with axis 2."""
    x = randn(2, 3, 2, 5, 5)
    (out,) = forward("type: 'Im2col' convolution_param { kernel_size: 2 axis: 2 }", x)
    ref = im2col_ref(x.reshape(6, 2, 5, 5), (2, 2)).reshape(2, 3, 8, 4, 4)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("params", ["kernel_size: 3 pad: 1", "kernel_size: 2 stride: 2",
                                    "kernel_size: 3 stride: 2 dilation: 2 pad: 2"])
def test_im2col_gradient(params):
    layer = make_layer(f"type: 'Im2col' convolution_param {{ {params} }}")
    assert check_gradient(layer, blobs_from([randn(2, 2, 6, 5)])) > 0


def test_im2col_errors():
    x = randn(1, 2, 4, 4)
    with pytest.raises(ShapeError, match="kernel_size is required"):
        forward("type: 'Im2col'", x)
    with pytest.raises(ShapeError, match="needs a spatial axis"):
        forward("type: 'Im2col' convolution_param { kernel_size: 2 axis: -1 }", randn(2, 4))
    with pytest.raises(ShapeError, match="empty"):
        forward("type: 'Im2col' convolution_param { kernel_size: 5 }", x)
    with pytest.raises(ShapeError, match="stride must be positive"):
        forward("type: 'Im2col' convolution_param { kernel_size: 2 stride: 0 }", x)


# -- SPP -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("height", [1, 2, 3])
def test_spp_value(pool, height):
    x = randn(2, 3, 9, 13)
    (out,) = forward(f"type: 'SPP' spp_param {{ pyramid_height: {height} pool: {pool} }}", x)
    ref = spp_ref(x, height, pool)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_spp_output_length_does_not_depend_on_the_image_size():
    layer = make_layer("type: 'SPP' spp_param { pyramid_height: 3 }")
    bottom = blobs_from([randn(2, 4, 12, 12)])
    top = run_forward(layer, bottom)
    for h, w in ((12, 12), (17, 9), (8, 30)):
        x = randn(2, 4, h, w, seed=h)
        bottom[0].reshape(x.shape)
        bottom[0].data[...] = x
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        assert top[0].shape == (2, 4 * (1 + 4 + 16))
        np.testing.assert_allclose(top[0].data, spp_ref(x, 3), rtol=1e-6)
    # level 0 is the global maximum
    np.testing.assert_array_equal(top[0].data[:, :4], x.max(axis=(2, 3)))


@pytest.mark.parametrize("params", ["pyramid_height: 1", "pyramid_height: 3",
                                    "pyramid_height: 2 pool: AVE", "pyramid_height: 3 pool: AVE"])
def test_spp_gradient(params):
    layer = make_layer(f"type: 'SPP' spp_param {{ {params} }}")
    x = distinct(2, 2, 9, 11, seed=4)
    assert check_gradient(layer, blobs_from([x])) > 0


def test_spp_errors():
    x = randn(1, 2, 8, 8)
    with pytest.raises(ShapeError, match="pyramid_height must be set"):
        forward("type: 'SPP'", x)
    with pytest.raises(ShapeError, match="STOCHASTIC"):
        forward("type: 'SPP' spp_param { pyramid_height: 2 pool: STOCHASTIC }", x)
    with pytest.raises(ShapeError, match="4 axes"):
        forward("type: 'SPP' spp_param { pyramid_height: 2 }", randn(2, 8, 8))
    # 4 bins over 5 rows would need 2 rows of padding for kernels of 2 (Caffe refuses too).
    with pytest.raises(ShapeError, match="too high for a 5x8 image"):
        forward("type: 'SPP' spp_param { pyramid_height: 3 }", randn(1, 2, 5, 8))


# -- every type in a Net from prototxt text ------------------------------------------------------
def inputs(*named_shapes):
    return "".join(
        f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ '
        + " ".join(f"dim: {d}" for d in shape) + " } } }\n"
        for name, shape in named_shapes)


NETS = {
    "ContrastiveLoss": (inputs(("a", (4, 3)), ("b", (4, 3)), ("sim", (4,))),
                        'bottom: "a" bottom: "b" bottom: "sim" '
                        "contrastive_loss_param { margin: 2 }", ()),
    "HingeLoss": (inputs(("x", (4, 5)), ("y", (4,))), 'bottom: "x" bottom: "y" '
                  "hinge_loss_param { norm: L2 }", ()),
    "InfogainLoss": (inputs(("x", (4, 5)), ("y", (4,))), 'bottom: "x" bottom: "y" '
                     "infogain_loss_param { source: '%(h)s' }", ()),
    "MultinomialLogisticLoss": (inputs(("x", (4, 5)), ("y", (4,))),
                                'bottom: "x" bottom: "y"', ()),
    "Crop": (inputs(("x", (2, 3, 8, 8)), ("like", (2, 3, 5, 5))),
             'bottom: "x" bottom: "like" crop_param { axis: 2 offset: 2 }', (2, 3, 5, 5)),
    "Im2col": (inputs(("x", (2, 3, 6, 6))),
               'bottom: "x" convolution_param { kernel_size: 3 stride: 3 }', (2, 27, 2, 2)),
    "SPP": (inputs(("x", (2, 3, 6, 6))),
            'bottom: "x" spp_param { pyramid_height: 2 pool: AVE }', (2, 15)),
}


@pytest.mark.parametrize("kind", sorted(NETS))
def test_type_builds_in_a_net(tmp_path, kind):
    layers, params, shape = NETS[kind]
    h = write_matrix(tmp_path / "h.binaryproto", infogain_matrix(5))
    text = (f'name: "n" force_backward: true\n{layers}'
            f'layer {{ name: "l" type: "{kind}" {params % {"h": h}} top: "out" }}\n')
    net = syncsgd.Net(text_format.Parse(text, pb.NetParameter()), syncsgd.TRAIN)
    assert net.layer_dict["l"].type == kind
    feed = {}
    for seed, name in enumerate(net.inputs):
        blob_shape = net.blobs[name].shape
        feed[name] = (labels(blob_shape, 2, seed=seed) if name in ("y", "sim")
                      else np.abs(randn(*blob_shape, seed=seed)) + 0.1)
    out = net.forward(**feed)["out"]
    if kind.endswith("Loss"):
        assert out.shape == () and np.isfinite(out) and out > 0
        assert net.blob_loss_weights["out"] == 1
        net.backward()
    else:
        assert out.shape == shape
        net.backward(out=np.ones(shape, np.float32))
    assert np.abs(net.blobs["x" if "x" in net.blobs else "a"].diff).sum() > 0


# -- training with each new loss -----------------------------------------------------------------
TRAIN_NET = """
name: "train_%(kind)s"
layer { name: "data" type: "HDF5Data" %(tops)s
        hdf5_data_param { source: "%(source)s" batch_size: 32 } }
%(layers)s
"""


def ip(name, bottom, top, outputs, shared=False):
    share = 'param { name: "w" } param { name: "bias" } ' if shared else ""
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" '
            f"{share}inner_product_param {{ num_output: {outputs} "
            'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" } } }\n')


def classes(rows=32, seed=0):
    """Inputs in 6 dimensions whose class (of 4) is a linear function's argmax."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 6)).astype(np.float32)
    w = rng.standard_normal((6, 4))
    return x, np.argmax(x @ w, axis=1).astype(np.float32)


def train(tmp_path, kind, datasets, layers, steps=40, base_lr=0.1):
    """(loss before, loss after) `steps` SGD iterations on one fixed batch of 32 rows."""
    h5 = tmp_path / "train.h5"
    with h5py.File(h5, "w") as f:
        for name, array in datasets.items():
            f[name] = array
    listing = tmp_path / "train.txt"
    listing.write_text(f"{h5}\n")
    net = tmp_path / "net.prototxt"
    tops = " ".join(f'top: "{name}"' for name in datasets)
    net.write_text(TRAIN_NET % {"kind": kind, "tops": tops, "source": listing,
                                "layers": layers})
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{net}" type: "SGD" base_lr: {base_lr} momentum: 0.9 '
                           f'lr_policy: "fixed" max_iter: {steps} display: 0 random_seed: 5 '
                           f'snapshot_prefix: "{tmp_path}/snap"\n')
    solver = syncsgd.get_solver(str(solver_file))
    try:
        before = float(solver.net.forward()["loss"])
        solver.step(steps)
        after = float(solver.net.forward()["loss"])
    finally:
        solver.close()
    assert np.isfinite(before) and np.isfinite(after)
    return before, after


def test_hinge_loss_trains(tmp_path):
    x, y = classes()
    layers = ip("ip", "data", "score", 4) + \
        'layer { name: "loss" type: "HingeLoss" bottom: "score" bottom: "label" top: "loss" }'
    before, after = train(tmp_path, "HingeLoss", {"data": x, "label": y}, layers)
    assert after < 0.5 * before


def test_multinomial_logistic_loss_trains(tmp_path):
    x, y = classes(seed=1)
    layers = ip("ip", "data", "score", 4) + (
        'layer { name: "prob" type: "Softmax" bottom: "score" top: "prob" }\n'
        'layer { name: "loss" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "label" '
        'top: "loss" }')
    before, after = train(tmp_path, "MultinomialLogisticLoss", {"data": x, "label": y}, layers)
    assert after < 0.5 * before


def test_infogain_loss_trains(tmp_path):
    x, y = classes(seed=2)
    source = write_matrix(tmp_path / "h.binaryproto", infogain_matrix(4, seed=1))
    layers = ip("ip", "data", "score", 4) + (
        'layer { name: "loss" type: "InfogainLoss" bottom: "score" bottom: "label" top: "loss" '
        f'infogain_loss_param {{ source: "{source}" }} }}')
    before, after = train(tmp_path, "InfogainLoss", {"data": x, "label": y}, layers)
    # With off-diagonal weight in H the loss cannot reach 0: its least value for a sample of
    # class c is at p = H[c] / sum(H[c]). Training must close most of the gap to it.
    h = infogain_matrix(4, seed=1).astype(np.float64)
    rows = h[y.astype(int)]
    least = -(rows * np.log(rows / rows.sum(1, keepdims=True))).sum(1).mean()
    assert after - least < 0.5 * (before - least)


def test_contrastive_loss_trains(tmp_path):
    """A siamese pair of InnerProducts sharing their weights: pairs of the same class pulled
    together, others pushed at least the margin apart."""
    x, y = classes(rows=64, seed=3)
    a, b = x[:32], x[32:]
    sim = (y[:32] == y[32:]).astype(np.float32)
    assert 0 < sim.sum() < 32
    layers = ip("ip_a", "a", "feat_a", 3, shared=True) + \
        ip("ip_b", "b", "feat_b", 3, shared=True) + (
            'layer { name: "loss" type: "ContrastiveLoss" bottom: "feat_a" bottom: "feat_b" '
            'bottom: "sim" top: "loss" contrastive_loss_param { margin: 1 } }')
    before, after = train(tmp_path, "ContrastiveLoss", {"a": a, "b": b, "sim": sim}, layers,
                          base_lr=0.05)
    assert after < 0.7 * before
