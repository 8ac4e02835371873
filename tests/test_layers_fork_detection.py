"""The detection forks' layers: Fast R-CNN's ROIPooling, R-FCN's PSROIPooling and py-faster-rcnn's
proposal layer (a Python layer built in), against loop references written from the forks' code,
against OpenCV, by gradient checks, and split between two simulated ranks."""
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TEST, TRAIN
from syncsgd.context import Context
from syncsgd.errors import PrototxtError, ShapeError
from syncsgd.layers import create
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward

cv2 = pytest.importorskip("cv2")

ROI = 'name: "roi" type: "ROIPooling" roi_pooling_param {{ {} }}'
PSROI = 'name: "psroi" type: "PSROIPooling" psroi_pooling_param {{ {} }}'
PROPOSAL = ('name: "proposal" type: "Python" python_param { module: "rpn.proposal_layer" '
            'layer: "ProposalLayer" param_str: "%s" }')


def c_round(v):
    """C's round() of a float32, in float64 (exact)."""
    return math.floor(abs(float(v)) + 0.5) * (1 if v >= 0 else -1)


def distinct(shape, seed):
    """Values at least 0.1 apart (no ties for a max, no kink within a gradient check's step)."""
    rng = np.random.default_rng(seed)
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 5).astype(np.float32)


def rois_for(images, scale, size, seed, count=12):
    """Rois (image, x1, y1, x2, y2) in input pixels, some reaching outside the image, one on a
    .5 rounding boundary, one inverted (x2 < x1) and one wholly outside."""
    rng = np.random.default_rng(seed)
    h, w = size
    x = rng.uniform(-8, w / scale + 8, (count, 2))
    y = rng.uniform(-8, h / scale + 8, (count, 2))
    rois = np.stack([rng.integers(0, images, count), x.min(1), y.min(1), x.max(1), y.max(1)], 1)
    rois[0, 1:] = [2.5 / scale, 1.5 / scale, 6.5 / scale, 4.5 / scale]   # halves round away
    rois[1, 1:] = [5 / scale, 1 / scale, 2 / scale, 3 / scale]           # inverted
    rois[2, 1:] = [(w + 5) / scale, 0, (w + 9) / scale, 4 / scale]        # outside
    return rois.astype(np.float32)


def roi_reference(x, rois, ph, pw, scale):
    """Fast R-CNN's ROIPoolingLayer::Forward_cpu, loop for loop, and its GPU backward's
    gradient map (top position -> bottom flat index)."""
    n, c, height, width = x.shape
    out = np.zeros((len(rois), c, ph, pw), np.float32)
    argmax = -np.ones(out.shape, np.int64)
    f32 = np.float32
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh, ew, eh = (c_round(f32(v) * f32(scale)) for v in roi[1:])
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        bh, bw = f32(rh) / f32(ph), f32(rw) / f32(pw)
        for i in range(ph):
            for j in range(pw):
                hs = min(max(int(math.floor(f32(i) * bh)) + sh, 0), height)
                he = min(max(int(math.ceil(f32(i + 1) * bh)) + sh, 0), height)
                ws = min(max(int(math.floor(f32(j) * bw)) + sw, 0), width)
                we = min(max(int(math.ceil(f32(j + 1) * bw)) + sw, 0), width)
                if he <= hs or we <= ws:
                    continue
                for ch in range(c):
                    best, where = -np.inf, -1
                    for hh in range(hs, he):
                        for ww in range(ws, we):
                            if x[b, ch, hh, ww] > best:
                                best, where = x[b, ch, hh, ww], hh * width + ww
                    out[r, ch, i, j] = best
                    inverted = ew < sw or eh < sh
                    argmax[r, ch, i, j] = -1 if inverted else (b * c + ch) * height * width + where
    return out, argmax


def psroi_reference(x, rois, dim, group, scale):
    """R-FCN's PSROIPoolingForward kernel, one output at a time."""
    n, c, height, width = x.shape
    out = np.zeros((len(rois), dim, group, group), np.float32)
    f32 = np.float32
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh = f32(c_round(roi[1])) * f32(scale), f32(c_round(roi[2])) * f32(scale)
        ew, eh = f32(c_round(roi[3]) + 1) * f32(scale), f32(c_round(roi[4]) + 1) * f32(scale)
        bh = max(eh - sh, f32(0.1)) / f32(group)
        bw = max(ew - sw, f32(0.1)) / f32(group)
        for d in range(dim):
            for i in range(group):
                for j in range(group):
                    hs = min(max(int(math.floor(f32(i) * bh + sh)), 0), height)
                    he = min(max(int(math.ceil(f32(i + 1) * bh + sh)), 0), height)
                    ws = min(max(int(math.floor(f32(j) * bw + sw)), 0), width)
                    we = min(max(int(math.ceil(f32(j + 1) * bw + sw)), 0), width)
                    if he > hs and we > ws:
                        ch = (d * group + i) * group + j
                        out[r, d, i, j] = x[b, ch, hs:he, ws:we].astype(np.float64).mean()
    return out


def opencv_forward(layer_text, x, rois):
    """OpenCV's forward of one layer reading `data` and `rois`."""
    text = (f'input: "data" input_shape {{ {" ".join(f"dim: {d}" for d in x.shape)} }}\n'
            f'input: "rois" input_shape {{ dim: {len(rois)} dim: 5 }}\n'
            f'layer {{ {layer_text} bottom: "data" bottom: "rois" top: "out" }}\n')
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt") as f:
        f.write(text)
        f.flush()
        net = cv2.dnn.readNetFromCaffe(f.name)
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setInput(x, "data")
    net.setInput(rois, "rois")
    return net.forward()


# -- ROIPooling -----------------------------------------------------------------------------------

def test_roi_pooling_matches_the_fork_and_opencv():
    scale = 0.25
    x = distinct((2, 3, 9, 11), seed=0)
    rois = rois_for(2, scale, (9, 11), seed=1)
    text = ROI.format(f"pooled_h: 3 pooled_w: 2 spatial_scale: {scale}")
    layer = make_layer(text)
    bottom = blobs_from([x, rois])
    top = run_forward(layer, bottom)
    want, argmax = roi_reference(x, rois, 3, 2, scale)
    np.testing.assert_array_equal(top[0].data, want)
    np.testing.assert_array_equal(opencv_forward(text, x, rois), want)
    # backward: each output's gradient goes to its maximum (none from an inverted roi)
    top[0].diff[...] = np.random.default_rng(2).standard_normal(top[0].shape)
    layer.backward(top, [True, False], bottom)
    expected = np.zeros(x.size)
    np.add.at(expected, argmax[argmax >= 0], top[0].diff[argmax >= 0])
    np.testing.assert_allclose(bottom[0].diff.ravel(), expected, atol=1e-6)
    assert (argmax[1] == -1).all() and (top[0].data[1] != 0).any()


def test_roi_pooling_gradient():
    x = distinct((2, 2, 6, 7), seed=3)
    rois = np.array([[0, 0, 0, 5, 4], [1, 2, 1, 6, 5], [1, 0, 2, 3, 3]], np.float32)
    layer = make_layer(ROI.format("pooled_h: 2 pooled_w: 3 spatial_scale: 1"))
    assert check_gradient(layer, blobs_from([x, rois]), check_bottom=[0]) > 0


@pytest.mark.parametrize("settings, rois, message", [
    ("pooled_h: 0 pooled_w: 2", np.zeros((1, 5)), "pooled_h and pooled_w > 0"),
    ("pooled_h: 2 pooled_w: 2 spatial_scale: 0", np.zeros((1, 5)), "spatial_scale"),
    ("pooled_h: 2 pooled_w: 2", np.zeros((2, 4)), r"rois \(R, 5\)"),
    ("pooled_h: 2 pooled_w: 2", np.array([[2, 0, 0, 3, 3]]), "names image 2"),
])
def test_roi_pooling_refuses_bad_input(settings, rois, message):
    layer = make_layer(ROI.format(settings))
    with pytest.raises(ShapeError, match=message):
        run_forward(layer, blobs_from([np.zeros((2, 1, 4, 4), np.float32),
                                       np.asarray(rois, np.float32)]))


# -- PSROIPooling ---------------------------------------------------------------------------------

def test_psroi_pooling_matches_the_fork_and_opencv():
    scale = 0.5
    x = np.random.default_rng(4).standard_normal((2, 2 * 9, 8, 10)).astype(np.float32)
    rois = rois_for(2, scale, (8, 10), seed=5)
    text = PSROI.format(f"output_dim: 2 group_size: 3 spatial_scale: {scale}")
    top = run_forward(make_layer(text), blobs_from([x, rois]))
    want = psroi_reference(x, rois, 2, 3, scale)
    np.testing.assert_allclose(top[0].data, want, atol=2e-6)
    np.testing.assert_allclose(opencv_forward(text, x, rois), want, atol=2e-6)
    assert (want[2] == 0).all() and (want != 0).sum() > want.size // 2


def test_psroi_pooling_gradient():
    x = np.random.default_rng(6).standard_normal((2, 2 * 4, 5, 6)).astype(np.float32)
    rois = np.array([[0, 0, 0, 9, 7], [1, 3, 1, 11, 9], [1, -2, 4, 5, 8]], np.float32)
    layer = make_layer(PSROI.format("output_dim: 2 group_size: 2 spatial_scale: 0.5"))
    assert check_gradient(layer, blobs_from([x, rois]), check_bottom=[0]) > 0


@pytest.mark.parametrize("settings, channels, message", [
    ("output_dim: 2 group_size: 2", 8, "spatial_scale is required"),
    ("output_dim: 0 group_size: 2 spatial_scale: 1", 8, "output_dim and group_size > 0"),
    ("output_dim: 2 group_size: 2 spatial_scale: 1", 6, "output_dim \\* group_size\\^2 = 8"),
])
def test_psroi_pooling_refuses_bad_input(settings, channels, message):
    layer = make_layer(PSROI.format(settings))
    with pytest.raises(ShapeError, match=message):
        run_forward(layer, blobs_from([np.zeros((1, channels, 4, 4), np.float32),
                                       np.zeros((1, 5), np.float32)]))


# -- both ROI layers on two ranks -----------------------------------------------------------------

def rank_run(text, x, rois, diff, rank, offset):
    """Forward and backward (top diff `diff`) on one rank holding images [offset, offset +
    len(x))."""
    ctx = Context(TRAIN, seed=1, rank=rank, size=2)
    ctx.batch_offset, ctx.global_batch = offset, 4
    layer = create(text_format.Parse(text, pb.LayerParameter()), ctx)
    bottom = blobs_from([x, rois])
    top = run_forward(layer, bottom)
    top[0].diff[...] = diff
    layer.backward(top, [True, False], bottom)
    return top[0].data.copy(), bottom[0].diff.copy()


@pytest.mark.parametrize("text, channels", [
    (ROI.format("pooled_h: 2 pooled_w: 2 spatial_scale: 0.5"), 3),
    (PSROI.format("output_dim: 3 group_size: 2 spatial_scale: 0.5"), 12)])
@pytest.mark.parametrize("numbering", ["global", "local"])
def test_roi_layers_split_between_ranks(text, channels, numbering):
    """Four images, three rois each, on two ranks of two images: the rois a data layer slices
    with the images number them in the global batch, those a layer derives from the rank's
    images (py-faster-rcnn's proposals) from 0; either way the ranks make what one process
    makes, and their image gradients together equal its."""
    x = np.random.default_rng(7).standard_normal((4, channels, 6, 7)).astype(np.float32)
    rois = np.concatenate([rois_for(1, 0.5, (6, 7), seed=8 + i, count=3) for i in range(4)])
    rois[:, 0] = np.repeat(np.arange(4), 3)
    diff = np.random.default_rng(9).standard_normal((12, 3, 2, 2))     # both give 3 channels
    one = rank_run(text, x, rois, diff, 0, 0)
    parts = []
    for rank in (0, 1):
        mine = rois[6 * rank:6 * rank + 6].copy()
        if numbering == "local":
            mine[:, 0] -= 2 * rank
        parts.append(rank_run(text, x[2 * rank:2 * rank + 2], mine, diff[6 * rank:6 * rank + 6],
                              rank, 2 * rank))
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), one[0])
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), one[1], atol=1e-6)
    assert np.abs(one[1]).sum() > 0


# -- py-faster-rcnn's ProposalLayer, built in -----------------------------------------------------

def proposal_reference(prob, deltas, info, stride, scales, before, after):
    """py-faster-rcnn's ProposalLayer.forward with its helpers (generate_anchors,
    bbox_transform_inv, clip_boxes, _filter_boxes, cpu_nms), as written there."""
    def whctrs(a):
        w, h = a[2] - a[0] + 1, a[3] - a[1] + 1
        return w, h, a[0] + 0.5 * (w - 1), a[1] + 0.5 * (h - 1)

    def mkanchors(ws, hs, cx, cy):
        ws, hs = ws[:, None], hs[:, None]
        return np.hstack((cx - 0.5 * (ws - 1), cy - 0.5 * (hs - 1),
                          cx + 0.5 * (ws - 1), cy + 0.5 * (hs - 1)))

    w, h, cx, cy = whctrs(np.array([0, 0, 15, 15.0]))
    ws = np.round(np.sqrt(w * h / np.array([0.5, 1, 2])))
    ratio_anchors = mkanchors(ws, np.round(ws * np.array([0.5, 1, 2])), cx, cy)
    anchors = np.vstack([mkanchors(whctrs(a)[0] * scales, whctrs(a)[1] * scales, *whctrs(a)[2:])
                         for a in ratio_anchors])
    a = len(anchors)
    height, width = prob.shape[-2:]
    sx, sy = np.meshgrid(np.arange(width) * stride, np.arange(height) * stride)
    shifts = np.vstack((sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel())).transpose()
    anchors = (anchors.reshape((1, a, 4)) + shifts.reshape((1, -1, 4)).transpose((1, 0, 2)))
    anchors = anchors.reshape((-1, 4)).astype(np.float32)
    d = deltas.transpose((0, 2, 3, 1)).reshape((-1, 4))
    scores = prob[:, a:].transpose((0, 2, 3, 1)).reshape((-1, 1))
    widths = anchors[:, 2] - anchors[:, 0] + 1.0
    heights = anchors[:, 3] - anchors[:, 1] + 1.0
    ctr_x, ctr_y = anchors[:, 0] + 0.5 * widths, anchors[:, 1] + 0.5 * heights
    pcx, pcy = d[:, 0] * widths + ctr_x, d[:, 1] * heights + ctr_y
    pw, ph = np.exp(d[:, 2]) * widths, np.exp(d[:, 3]) * heights
    boxes = np.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], 1)
    boxes[:, 0::2] = np.maximum(np.minimum(boxes[:, 0::2], info[1] - 1), 0)
    boxes[:, 1::2] = np.maximum(np.minimum(boxes[:, 1::2], info[0] - 1), 0)
    ws, hs = boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1
    keep = np.where((ws >= 16 * info[2]) & (hs >= 16 * info[2]))[0]
    boxes, scores = boxes[keep], scores[keep]
    order = scores.ravel().argsort()[::-1][:before]
    boxes, scores = boxes[order], scores[order]
    areas = (boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)
    suppressed, kept = np.zeros(len(boxes), bool), []
    for i in range(len(boxes)):
        if suppressed[i]:
            continue
        kept.append(i)
        for j in range(i + 1, len(boxes)):
            if not suppressed[j]:
                iw = max(np.float32(0), min(boxes[i, 2], boxes[j, 2])
                         - max(boxes[i, 0], boxes[j, 0]) + 1)
                ih = max(np.float32(0), min(boxes[i, 3], boxes[j, 3])
                         - max(boxes[i, 1], boxes[j, 1]) + 1)
                inter = iw * ih
                suppressed[j] = inter / (areas[i] + areas[j] - inter) >= np.float32(0.7)
    kept = kept[:after]
    return np.hstack([np.zeros((len(kept), 1), np.float32), boxes[kept]]), scores[kept]


def rpn_outputs(height, width, seed, spread=0.3):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((1, 2, 9 * height, width)).astype(np.float32)
    e = np.exp(logits - logits.max(1, keepdims=True))
    prob = (e / e.sum(1, keepdims=True)).reshape(1, 18, height, width)
    deltas = (rng.standard_normal((1, 36, height, width)) * spread).astype(np.float32)
    return prob, deltas


def test_proposal_layer_is_built_in_and_matches_py_faster_rcnn(capsys):
    prob, deltas = rpn_outputs(7, 9, seed=9)
    info = np.array([[100, 140, 0.6]], np.float32)
    for phase, (before, after) in ((TEST, (6000, 300)), (TRAIN, (12000, 2000))):
        layer = make_layer(PROPOSAL % "'feat_stride': 16, 'scales': (4, 8)", phase=phase)
        assert "running syncsgd's built-in ProposalLayer" in capsys.readouterr().err
        rois, scores = run_forward(layer, blobs_from([prob[:, :12], deltas[:, :24], info]), 2)
        want_rois, want_scores = proposal_reference(prob[:, :12], deltas[:, :24], info[0], 16,
                                                    np.array([4, 8]), before, after)
        np.testing.assert_array_equal(rois.data, want_rois)
        np.testing.assert_array_equal(scores.data, want_scores)
    assert 20 < len(rois.data) < 6 * 7 * 9       # boxes were dropped by size and by NMS


def test_proposal_layer_matches_opencv():
    """OpenCV's Proposal type is the same layer (without the minimum size, so the image scale
    is made small enough to drop nothing); it returns post_nms_topn rows, zeros after ours."""
    prob, deltas = rpn_outputs(6, 8, seed=10, spread=0.2)
    info = np.array([[96, 128, 0.01]], np.float32)
    rois = run_forward(make_layer(PROPOSAL % "'feat_stride': 16", phase=TEST),
                       blobs_from([prob, deltas, info]), 1)[0].data
    text = ('input: "s" input_shape { dim: 1 dim: 18 dim: 6 dim: 8 }\n'
            'input: "d" input_shape { dim: 1 dim: 36 dim: 6 dim: 8 }\n'
            'input: "i" input_shape { dim: 1 dim: 3 }\n'
            'layer { name: "p" type: "Proposal" bottom: "s" bottom: "d" bottom: "i" top: "r" '
            'proposal_param { feat_stride: 16 ratio: 0.5 ratio: 1 ratio: 2 scale: 8 scale: 16 '
            'scale: 32 } }')
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt") as f:
        f.write(text)
        f.flush()
        net = cv2.dnn.readNetFromCaffe(f.name)
    for name, value in (("s", prob), ("d", deltas), ("i", info)):
        net.setInput(value, name)
    theirs = net.forward("p")
    assert 20 < len(rois) < 300
    np.testing.assert_allclose(rois, theirs[:len(rois)], atol=2e-5)
    assert not theirs[len(rois):].any()


def test_users_own_proposal_module_wins(tmp_path, monkeypatch):
    package = tmp_path / "rpn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "proposal_layer.py").write_text(
        "import syncsgd\n"
        "class ProposalLayer(syncsgd.Layer):\n"
        "    def reshape(self, bottom, top):\n"
        "        top[0].reshape(1, 5)\n"
        "    def forward(self, bottom, top):\n"
        "        top[0].data[...] = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prob, deltas = rpn_outputs(2, 2, seed=11)
    try:
        top = run_forward(make_layer(PROPOSAL % "'feat_stride': 16", phase=TEST),
                          blobs_from([prob, deltas, np.array([[32, 32, 1]], np.float32)]))
    finally:                                   # later tests must not find this module
        for name in ("rpn.proposal_layer", "rpn"):
            sys.modules.pop(name, None)
    assert (top[0].data == 7).all()


@pytest.mark.parametrize("param_str, message", [
    ("'scales': (8, 16)", "must give 'feat_stride'"),
    ("'feat_stride': 0", "positive 'feat_stride'"),
    ("[1, 2]", "must be a mapping"),
])
def test_proposal_layer_refuses_bad_param_str(param_str, message):
    prob, deltas = rpn_outputs(2, 2, seed=12)
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(PROPOSAL % param_str, phase=TEST),
                    blobs_from([prob, deltas, np.array([[32, 32, 1]], np.float32)]))


def test_proposal_layer_refuses_a_batch():
    prob, deltas = rpn_outputs(2, 2, seed=13)
    with pytest.raises(ShapeError, match="for one image"):
        run_forward(make_layer(PROPOSAL % "'feat_stride': 16", phase=TEST),
                    blobs_from([np.repeat(prob, 2, 0), np.repeat(deltas, 2, 0),
                                np.array([[32, 32, 1]] * 2, np.float32)]))


def test_an_unknown_python_module_is_still_an_error():
    with pytest.raises(PrototxtError, match="cannot be imported"):
        make_layer('name: "p" type: "Python" python_param { module: "rpn.proposal_layer" '
                   'layer: "AnchorTargetLayer" }')


# -- DetectionOutput that asks to save its detections ---------------------------------------------

def test_detection_output_with_save_output_param_loads(capsys):
    text = ('name: "d" type: "DetectionOutput" detection_output_param { num_classes: 2 '
            'save_output_param { output_directory: "/nonexistent/out" output_format: "VOC" } }')
    top = run_forward(make_layer(text), blobs_from([
        np.zeros((1, 4), np.float32), np.array([[0.2, 0.8]], np.float32),
        np.array([[[0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.2, 0.2]]], np.float32)]))
    assert "detections are not written to files" in capsys.readouterr().err
    np.testing.assert_allclose(top[0].data.ravel(), [0, 1, 0.8, 0.1, 0.1, 0.5, 0.5])


FORK_ENV = Path(os.environ.get("FORK_ORACLE_DIR")
                or Path.home() / ".cache/brocolli-caffe-9.0.2") / "env.sh"
FORK_RUN = """
import sys, numpy as np, caffe
arrays = np.load(sys.argv[2])
net = caffe.Net(sys.argv[1], caffe.TEST)
for name in ("loc", "conf", "prior"):
    net.blobs[name].reshape(*arrays[name].shape)
    net.blobs[name].data[...] = arrays[name]
net.forward()
np.save(sys.argv[3], net.blobs["out"].data)
"""


@pytest.mark.skipif(not FORK_ENV.exists(), reason="the SSD fork oracle is not built "
                    "(tools/oracle/build-fork-caffe.sh)")
def test_detection_output_equals_the_fork_when_keep_top_k_cuts(tmp_path):
    """S3FD's head: two classes, thousands of priors, nms top_k and keep_top_k both cutting;
    the fork itself (brocolli-caffe's SSD DetectionOutput, CPU) on the same inputs."""
    rng = np.random.default_rng(14)
    priors = 3000
    centers, sides = rng.random((priors, 2)), rng.uniform(0.02, 0.2, (priors, 1))
    boxes = np.concatenate([centers - sides / 2, centers + sides / 2], 1).astype(np.float32)
    logits = rng.standard_normal((priors, 2)) * 2
    conf = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    arrays = {"loc": (rng.standard_normal((1, priors * 4)) * 0.5).astype(np.float32),
              "conf": conf.reshape(1, -1).astype(np.float32),
              "prior": np.stack([boxes.ravel(), np.tile(np.float32([0.1, 0.1, 0.2, 0.2]),
                                                        priors)])[None]}
    text = "".join(f'input: "{name}" input_shape {{ {" ".join(f"dim: {d}" for d in a.shape)} }}\n'
                   for name, a in arrays.items())
    text += ('layer { name: "out" type: "DetectionOutput" bottom: "loc" bottom: "conf" '
             'bottom: "prior" top: "out" detection_output_param { num_classes: 2 '
             'background_label_id: 0 nms_param { nms_threshold: 0.3 top_k: 1000 } '
             'code_type: CENTER_SIZE keep_top_k: 150 confidence_threshold: 0.05 } }')
    (tmp_path / "net.prototxt").write_text(text)
    np.savez(tmp_path / "in.npz", **arrays)
    subprocess.run(["bash", "-c", f"source {FORK_ENV} && python -c '{FORK_RUN}' "
                    f"{tmp_path / 'net.prototxt'} {tmp_path / 'in.npz'} {tmp_path / 'out.npy'}"],
                   check=True, capture_output=True, cwd=tmp_path,
                   env={**os.environ, "GLOG_minloglevel": "2", "PYTHONPATH": ""})
    net = syncsgd.Net(str(tmp_path / "net.prototxt"), TEST)
    net.forward(**arrays)
    fork = np.load(tmp_path / "out.npy")
    assert fork.shape == (1, 1, 150, 7)
    np.testing.assert_allclose(net.blobs["out"].data, fork, atol=1e-6)


def test_the_types_are_listed_with_their_forks():
    forks = {name: name.fork for name in syncsgd.layer_type_list()}
    assert forks["ROIPooling"] == "rbgirshick/caffe-fast-rcnn"
    assert forks["PSROIPooling"] == "daijifeng001/caffe-rfcn"
