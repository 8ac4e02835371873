"""The YOLO ports' layers: Reorg (against the fork's loop, the gradient checker and OpenCV's
Caffe importer, which runs it at stride 2), Region, YoloDetectionOutput and
Yolov3DetectionOutput (against references written from their forks' C++ loop by loop; OpenCV's
Caffe importer runs none of them: its Region needs the anchors as a weight blob, and it has no
YOLO detection heads)."""
import numpy as np
import pytest

from syncsgd.errors import ShapeError
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_fork import detections, input_text, opencv_forward

F = np.float32


def rand(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F)


def sigmoid(v):
    return F(1.0 / (1.0 + np.exp(-float(v))))


# -- Reorg ----------------------------------------------------------------------------------------

def reorg_reference(x, stride, reverse):
    """eric612/MobileNet-YOLO's reorg_cpu, index by index (forward = reverse)."""
    n, c, h, w = x.shape
    flat, out = x.reshape(-1), np.empty(x.size, F)
    out_c = c // (stride * stride)
    for b in range(n):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    bottom_index = i + w * (j + h * (k + c * b))
                    offset = k // out_c
                    w2, h2 = i * stride + offset % stride, j * stride + offset // stride
                    top_index = w2 + w * stride * (h2 + h * stride * (k % out_c + out_c * b))
                    if reverse:
                        out[top_index] = flat[bottom_index]
                    else:
                        out[bottom_index] = flat[top_index]
    if reverse:
        return out.reshape(n, out_c, h * stride, w * stride)
    return out.reshape(n, c * stride * stride, h // stride, w // stride)


def reorg_layer(stride, reverse=False):
    return make_layer(f'name: "r" type: "Reorg" reorg_param {{ stride: {stride} '
                      f'reverse: {str(reverse).lower()} }}')


@pytest.mark.parametrize("stride, shape", [(2, (2, 8, 4, 6)), (3, (1, 18, 6, 3))])
@pytest.mark.parametrize("reverse", [False, True])
def test_reorg_follows_darknets_index_order(stride, shape, reverse):
    x = rand(*shape)
    top = run_forward(reorg_layer(stride, reverse), blobs_from([x]))[0].data
    np.testing.assert_array_equal(top, reorg_reference(x, stride, reverse))
    if not reverse:     # not a space-to-depth: top channel 1 is not bottom channel 0's (0, 1)
        assert not np.array_equal(top[:, 1], x[:, 0, ::stride, 1::stride])


@pytest.mark.parametrize("reverse", [False, True])
def test_reorg_gradient(reverse):
    assert check_gradient(reorg_layer(2, reverse), blobs_from([rand(2, 8, 4, 2)])) > 0


def test_reorg_equals_opencv(tmp_path):
    # OpenCV's Caffe importer ignores reorg_param and always uses stride 2.
    shape = (2, 12, 6, 4)
    prototxt = tmp_path / "reorg.prototxt"
    prototxt.write_text(input_text(shape) + 'layer { name: "reorg" type: "Reorg" bottom: "data" '
                                            'top: "reorg" reorg_param { stride: 2 } }\n')
    x = rand(*shape, seed=3)
    theirs = opencv_forward(str(prototxt), "", x, ["reorg"])["reorg"]
    ours = run_forward(reorg_layer(2), blobs_from([x]))[0].data
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("settings, shape, message", [
    ("", (1, 8, 4, 4), "stride is required"),
    ("stride: 2", (1, 8, 5, 4), "must divide"),
    ("stride: 2", (1, 6, 4, 4), "must divide"),
    ("stride: 2 reverse: true", (1, 6, 2, 2), "divisible by 4"),
])
def test_reorg_refuses_what_the_fork_cannot_do(settings, shape, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(f'name: "r" type: "Reorg" reorg_param {{ {settings} }}'),
                    blobs_from([rand(*shape)]))


# -- Region ---------------------------------------------------------------------------------------

def region_reference(x, classes, boxes, softmax):
    """lwplw/caffe_yolov2's RegionLayer::Forward_cpu: flatten, logistic, softmax."""
    n, c, h, w = x.shape
    area, size = h * w, 4 + 1 + classes
    src, out = x.reshape(-1), np.empty(x.size, F)
    for b in range(n):                                   # flatten(..., forward = true)
        for ch in range(c):
            for i in range(area):
                out[b * c * area + i * c + ch] = src[b * c * area + ch * area + i]
    for b in range(n):
        for i in range(area * boxes):
            index = size * i + b * area * c
            out[index + 4] = sigmoid(out[index + 4])
            if softmax:
                scores = out[index + 5:index + 5 + classes]
                e = np.exp(scores - scores.max())
                out[index + 5:index + 5 + classes] = e / e.sum()
    return out.reshape(x.shape)


@pytest.mark.parametrize("softmax", [True, False])
def test_region_matches_the_fork(softmax):
    x = rand(2, 2 * 8, 3, 4, scale=2.0)
    layer = make_layer('name: "r" type: "Region" region_param { classes: 3 coords: 4 '
                       f'boxes_of_each_grid: 2 softmax: {str(softmax).lower()} }}')
    top = run_forward(layer, blobs_from([x]))[0].data
    np.testing.assert_allclose(top, region_reference(x, 3, 2, softmax), rtol=1e-6, atol=1e-7)


def test_region_has_no_backward():
    layer = make_layer('name: "r" type: "Region" region_param { classes: 1 boxes_of_each_grid: 1 }')
    bottom = blobs_from([rand(1, 6, 2, 2)])
    top = run_forward(layer, bottom)
    assert not layer.allow_force_backward(0)
    layer.backward(top, [False], bottom)
    with pytest.raises(ShapeError, match="no backward"):
        layer.backward(top, [True], bottom)


@pytest.mark.parametrize("settings, message", [
    ("classes: 3 coords: 5", "coords must be 4"),
    ("classes: 2", "boxes_of_each_grid"),
])
def test_region_refuses_bad_settings(settings, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(f'name: "r" type: "Region" region_param {{ {settings} }}'),
                    blobs_from([rand(1, 16, 2, 2)]))


# -- the detection heads: the forks' ApplyNms and rows --------------------------------------------

def fork_iou(a, b):
    """box_iou of the forks' yolo_detection_output_layer.cpp, in float, of box a (x, y, w, h)
    with each row of b."""
    def overlap(x1, w1, x2, w2):
        left = np.maximum(F(x1 - w1 / F(2)), x2 - w2 / F(2))
        right = np.minimum(F(x1 + w1 / F(2)), x2 + w2 / F(2))
        return right - left
    w, h = overlap(a[0], a[2], b[:, 0], b[:, 2]), overlap(a[1], a[3], b[:, 1], b[:, 3])
    inter = np.where((w < 0) | (h < 0), F(0), w * h)
    return inter / (F(a[2] * a[3]) + b[:, 2] * b[:, 3] - inter)


def fork_rows(num, predictions, nms_threshold):
    """predictions: (confidence, class, x, y, w, h) in the fork's order; std::sort by falling
    confidence (ties are left in order here), ApplyNms, then the rows the fork writes."""
    if not predictions:
        return np.array([[i] + [-1] * 6 for i in range(num)], F)
    order = sorted(predictions, key=lambda p: -p[0])
    boxes = np.array([p[2:] for p in order], F)
    dropped = set()
    for i in range(len(order) - 1):
        if i in dropped:
            continue
        iou = fork_iou(boxes[i], boxes[i + 1:])
        dropped.update(i + 1 + np.flatnonzero(iou >= F(nms_threshold)))
    return np.array([[0, c + 1, s, x - w / 2, y - h / 2, x + w / 2, y + h / 2]
                     for k, (s, c, x, y, w, h) in enumerate(order) if k not in dropped], F)


# -- YoloDetectionOutput --------------------------------------------------------------------------

BIASES = [1.08, 1.19, 3.42, 4.41, 6.63, 11.38]


def yolo_v2_reference(maps, classes, biases, threshold, nms_threshold):
    """eric612's YoloDetectionOutputLayer::Forward_cpu on each bottom, box by box."""
    boxes = len(biases) // 2
    predictions = []
    for m in maps:
        n, c, side, _ = m.shape
        per = c // boxes
        for b in range(n):
            for j in range(side):
                for i in range(side):
                    for k in range(boxes):
                        v = m[b, k * per:(k + 1) * per, j, i]
                        x = F((F(i) + sigmoid(v[0])) / F(side))
                        y = F((F(j) + sigmoid(v[1])) / F(side))
                        w = F(np.exp(v[2]) * F(biases[2 * k]) / F(side))
                        h = F(np.exp(v[3]) * F(biases[2 * k + 1]) / F(side))
                        e = np.exp(v[5:5 + classes] - v[5:5 + classes].max())
                        p = e / e.sum()
                        confidence = F(sigmoid(v[4]) * p.max())
                        if confidence >= F(threshold):
                            predictions.append((confidence, int(p.argmax()), x, y, w, h))
    return fork_rows(maps[0].shape[0], predictions, nms_threshold)


def yolo_v2_layer(classes, threshold, nms_threshold=0.45, biases=BIASES):
    return make_layer(
        'name: "d" type: "YoloDetectionOutput" yolo_detection_output_param { '
        f'num_classes: {classes} num_box: {len(biases) // 2} confidence_threshold: {threshold} '
        f'nms_threshold: {nms_threshold} ' + " ".join(f"biases: {b}" for b in biases) + " }")


def test_yolo_v2_detections_match_the_fork():
    # Two images and two maps: all go through one suppression, as in the fork.
    maps = [rand(2, 3 * 9, 4, 4, seed=5, scale=2.0), rand(2, 3 * 9, 2, 2, seed=6, scale=2.0)]
    layer = yolo_v2_layer(4, 0.3, 0.3)
    rows = run_forward(layer, blobs_from(maps))[0].data
    expected = yolo_v2_reference(maps, 4, BIASES, 0.3, 0.3)
    assert 10 < len(expected) < 2 * 3 * 20        # both the threshold and NMS removed boxes
    ours = detections(rows)
    assert ours.shape == expected.shape and set(ours[:, 0]) == {0}
    np.testing.assert_allclose(ours, detections(expected), rtol=0, atol=2e-6)


def test_yolo_v2_without_detections_gives_one_row_per_image():
    rows = run_forward(yolo_v2_layer(2, 0.99), blobs_from([np.zeros((2, 21, 2, 2), F)]))[0].data
    np.testing.assert_array_equal(rows.reshape(-1, 7), [[0] + [-1] * 6, [1] + [-1] * 6])


@pytest.mark.parametrize("settings, shape, message", [
    ("num_box: 3 biases: 1 biases: 1", (1, 21, 2, 2), "2 \\* num_box"),
    ("num_box: 1 biases: 1 biases: 1", (1, 7, 2, 3), "square"),
    ("num_box: 1 biases: 1 biases: 1", (1, 8, 2, 2), "C = 7"),
    ("num_classes: 0 num_box: 1 biases: 1 biases: 1", (1, 5, 2, 2), "num_classes is required"),
])
def test_yolo_v2_refuses_bad_settings(settings, shape, message):
    settings = settings if "num_classes" in settings else "num_classes: 2 " + settings
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer('name: "d" type: "YoloDetectionOutput" '
                               f'yolo_detection_output_param {{ {settings} }}'),
                    blobs_from([rand(*shape)]))


# -- Yolov3DetectionOutput ------------------------------------------------------------------------

V3_BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]


def yolo_v3_reference(maps, classes, biases, masks, scales, threshold, nms_threshold,
                      gaussian=False):
    """eric612's Yolov3DetectionOutputLayer::Forward_cpu (CPU path), box by box."""
    size = (9 if gaussian else 5) + classes
    predictions = []
    for m, mask, scale in zip(maps, masks, scales):
        n, c, h, w = m.shape
        boxes = c // size
        for b in range(n):
            for s in range(h * w):
                for k in range(boxes):
                    v = m[b, k * size:(k + 1) * size].reshape(size, -1)[:, s]
                    if gaussian:
                        certainty = 4.0 - sum(float(sigmoid(v[e])) for e in (1, 3, 5, 7))
                        objectness = F(float(sigmoid(v[8])) * float(F(certainty)) / 4.0)
                        tx, ty, tw, th, first = v[0], v[2], v[4], v[6], 9
                    else:
                        objectness, tx, ty, tw, th, first = sigmoid(v[4]), *v[:4], 5
                    a = mask[k]
                    x = F((F(s % w) + sigmoid(tx)) / F(w))
                    y = F((F(s // w) + sigmoid(ty)) / F(h))
                    bw = F(np.exp(tw) * F(biases[2 * a]) / F(w * scale))
                    bh = F(np.exp(th) * F(biases[2 * a + 1]) / F(h * scale))
                    for cls in range(classes):
                        score = F(sigmoid(v[first + cls]) * objectness)
                        if score > F(threshold):
                            predictions.append((score, cls, x, y, bw, bh))
    return fork_rows(maps[0].shape[0], predictions, nms_threshold)


def yolo_v3_layer(classes, threshold, nms_threshold, gaussian=False):
    return make_layer(
        'name: "d" type: "Yolov3DetectionOutput" yolov3_detection_output_param { '
        f'num_classes: {classes} confidence_threshold: {threshold} nms_threshold: '
        f'{nms_threshold} gaussian_box: {str(gaussian).lower()} '
        + " ".join(f"biases: {b}" for b in V3_BIASES)
        + " mask: 3 mask: 4 mask: 5 mask: 0 mask: 1 mask: 2 mask_group_num: 2 "
          "anchors_scale: 32 anchors_scale: 16 }")


@pytest.mark.parametrize("gaussian", [False, True])
def test_yolo_v3_detections_match_the_fork(gaussian):
    entries = (9 if gaussian else 5) + 3
    maps = [rand(2, 3 * entries, 2, 3, seed=7, scale=2.0),
            rand(2, 3 * entries, 4, 6, seed=8, scale=2.0)]
    rows = run_forward(yolo_v3_layer(3, 0.4, 0.3, gaussian), blobs_from(maps))[0].data
    expected = yolo_v3_reference(maps, 3, V3_BIASES, [[3, 4, 5], [0, 1, 2]], [32, 16], 0.4, 0.3,
                                 gaussian)
    assert 10 < len(expected)
    ours = detections(rows)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, detections(expected), rtol=0, atol=2e-6)


@pytest.mark.parametrize("nms_threshold, labels", [(0.5, [1]), (0.51, [1, 2])])
def test_yolo_v3_suppresses_over_classes_from_the_iou_threshold_on(nms_threshold, labels):
    # One cell, two anchors with the same centre: a 1 x 1 box (class 0) and a 0.5 x 1 box
    # (class 1) inside it, of IoU 0.5 exactly. The fork drops the weaker at IoU >= threshold.
    layer = make_layer('name: "d" type: "Yolov3DetectionOutput" yolov3_detection_output_param '
                       '{ num_classes: 2 num_box: 2 biases: 1 biases: 1 biases: 0.5 biases: 1 '
                       'mask: 0 mask: 1 mask_group_num: 1 anchors_scale: 1 '
                       f'confidence_threshold: 0.1 nms_threshold: {nms_threshold} }}')
    x = np.array([0, 0, 0, 0, 10, 10, -20, 0, 0, 0, 0, 5, -20, 5], F).reshape(1, 14, 1, 1)
    rows = run_forward(layer, blobs_from([x]))[0].data.reshape(-1, 7)
    assert rows[:, 1].tolist() == labels
    np.testing.assert_allclose(rows[0], [0, 1, sigmoid(10) * sigmoid(10), 0, 0, 1, 1],
                               atol=1e-6)
    if len(labels) == 2:
        np.testing.assert_allclose(rows[1, 3:], [0.25, 0, 0.75, 1], atol=1e-7)
    assert not layer.allow_force_backward(0)


@pytest.mark.parametrize("settings, message", [
    ("mask: 0 mask: 1 mask: 2 anchors_scale: 32", "mask_group_num \\(2\\) must be"),
    ("mask: 0 mask_group_num: 1 anchors_scale: 32", "fewer than num_box"),
    ("mask: 0 mask: 1 mask: 7 mask_group_num: 1 anchors_scale: 32", "names anchor 7"),
])
def test_yolo_v3_refuses_bad_settings(settings, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer('name: "d" type: "Yolov3DetectionOutput" '
                               'yolov3_detection_output_param { num_classes: 2 '
                               + " ".join(f"biases: {b}" for b in V3_BIASES)
                               + f" {settings} }}"), blobs_from([rand(1, 21, 2, 2)]))
