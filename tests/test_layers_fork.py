"""The model zoo's fork layers (SSD's Normalize, Permute, PriorBox and DetectionOutput,
ShuffleChannel, ConvolutionDepthwise, Interp, SegNet's Upsample): numpy references written from
the forks' definitions, the shared gradient checker, and equality with OpenCV's Caffe importer
(cv2.dnn.readNetFromCaffe) for every type OpenCV implements (all but Upsample)."""
import re

import numpy as np
import pytest

import syncsgd
from syncsgd.errors import ShapeError
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.paths import TESTS


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- Permute --------------------------------------------------------------------------------------

def test_permute_is_a_transpose_and_completes_the_order():
    x = rand(2, 3, 4, 5)
    top = run_forward(make_layer('name: "p" type: "Permute" permute_param { order: 0 order: 2 '
                                 'order: 3 order: 1 }'), blobs_from([x]))
    np.testing.assert_array_equal(top[0].data, x.transpose(0, 2, 3, 1))
    # Axes the order leaves out follow in their old order.
    top = run_forward(make_layer('name: "p" type: "Permute" permute_param { order: 2 }'),
                      blobs_from([x]))
    np.testing.assert_array_equal(top[0].data, x.transpose(2, 0, 1, 3))


def test_permute_gradient():
    layer = make_layer('name: "p" type: "Permute" permute_param { order: 0 order: 3 order: 1 '
                       'order: 2 }')
    assert check_gradient(layer, blobs_from([rand(2, 3, 2, 4)])) > 0


@pytest.mark.parametrize("order", ["order: 4", "order: 1 order: 1"])
def test_permute_refuses_a_bad_order(order):
    with pytest.raises(ShapeError, match="permute_param order"):
        run_forward(make_layer(f'name: "p" type: "Permute" permute_param {{ {order} }}'),
                    blobs_from([rand(1, 2, 3, 4)]))


# -- ShuffleChannel -------------------------------------------------------------------------------

def test_shuffle_channel_matches_the_fork():
    x = rand(2, 6, 3, 2)
    top = run_forward(make_layer('name: "s" type: "ShuffleChannel" '
                                 'shuffle_channel_param { group: 2 }'), blobs_from([x]))
    # The fork: input channel i * (C / group) + j goes to output channel j * group + i.
    expected = np.empty_like(x)
    for i in range(2):
        for j in range(3):
            expected[:, j * 2 + i] = x[:, i * 3 + j]
    np.testing.assert_array_equal(top[0].data, expected)


def test_shuffle_channel_gradient():
    layer = make_layer('name: "s" type: "ShuffleChannel" shuffle_channel_param { group: 3 }')
    assert check_gradient(layer, blobs_from([rand(2, 6, 2, 3)])) > 0


def test_shuffle_channel_group_must_divide_the_channels():
    with pytest.raises(ShapeError, match="group 4 must divide"):
        run_forward(make_layer('name: "s" type: "ShuffleChannel" '
                               'shuffle_channel_param { group: 4 }'),
                    blobs_from([rand(1, 6, 2, 2)]))


# -- ConvolutionDepthwise -------------------------------------------------------------------------

DEPTHWISE = ('convolution_param {{ num_output: {out} kernel_size: 3 pad: 1 stride: {stride} '
             'weight_filler {{ type: "gaussian" std: 0.5 }} bias_filler {{ type: "gaussian" '
             'std: 0.5 }} }}')


@pytest.mark.parametrize("shape", [(2, 4, 6, 5), (2, 4, 3, 6, 5)], ids=["2-D", "3-D"])
def test_depthwise_is_a_convolution_with_one_group_per_channel(shape):
    x = rand(*shape)
    depthwise = make_layer('name: "d" type: "ConvolutionDepthwise" '
                           + DEPTHWISE.format(out=8, stride=2))
    as_given = depthwise.param
    ours = run_forward(depthwise, blobs_from([x]))[0].data
    assert depthwise.blobs[0].shape == (8, 1) + (3,) * (len(shape) - 2)
    grouped = make_layer('name: "d" type: "Convolution" '
                         + DEPTHWISE.format(out=8, stride=2).replace("stride: 2", "stride: 2 "
                                                                     "group: 4"))
    grouped.blobs = depthwise.blobs
    np.testing.assert_allclose(ours, run_forward(grouped, blobs_from([x]))[0].data,
                               rtol=1e-5, atol=1e-5)
    assert depthwise.group == 4
    # The LayerParameter the layer was made from keeps what the file says.
    assert not as_given.convolution_param.HasField("group")


def test_depthwise_gradient():
    layer = make_layer('name: "d" type: "ConvolutionDepthwise" '
                       + DEPTHWISE.format(out=3, stride=1))
    assert check_gradient(layer, blobs_from([rand(2, 3, 4, 4)])) > 0


def test_depthwise_outputs_must_be_a_multiple_of_the_channels():
    with pytest.raises(ShapeError, match="num_output 5 must be a multiple of 4"):
        run_forward(make_layer('name: "d" type: "ConvolutionDepthwise" '
                               + DEPTHWISE.format(out=5, stride=1)), blobs_from([rand(1, 4, 3, 3)]))


# -- Normalize ------------------------------------------------------------------------------------

def normalize_reference(x, scale, across_spatial, eps=1e-10):
    n, c = x.shape[:2]
    planes = x.reshape(n, c, -1).astype(np.float64)
    axes = (1, 2) if across_spatial else (1,)
    norm = np.sqrt((planes ** 2).sum(axis=axes, keepdims=True) + eps)
    return (planes / norm * np.reshape(scale, (1, -1, 1))).reshape(x.shape)


NORMALIZE = ('name: "n" type: "Normalize" norm_param {{ across_spatial: {across} '
             'channel_shared: {shared} scale_filler {{ type: "gaussian" std: 2 mean: 3 }} }}')


@pytest.mark.parametrize("across", ["true", "false"])
@pytest.mark.parametrize("shared", ["true", "false"])
def test_normalize_matches_the_reference(across, shared):
    x = rand(2, 3, 4, 5)
    layer = make_layer(NORMALIZE.format(across=across, shared=shared))
    top = run_forward(layer, blobs_from([x]))
    assert layer.blobs[0].shape == (() if shared == "true" else (3,))
    np.testing.assert_allclose(top[0].data, normalize_reference(x, layer.blobs[0].data,
                                                                across == "true"),
                               rtol=1e-5, atol=1e-6)


def test_normalize_scale_starts_at_one_without_a_filler():
    layer = make_layer('name: "n" type: "Normalize" norm_param { channel_shared: false }')
    run_forward(layer, blobs_from([rand(1, 3, 2, 2)]))
    np.testing.assert_array_equal(layer.blobs[0].data, np.ones(3, np.float32))


@pytest.mark.parametrize("across", ["true", "false"])
@pytest.mark.parametrize("shared", ["true", "false"])
def test_normalize_gradient(across, shared):
    layer = make_layer(NORMALIZE.format(across=across, shared=shared))
    assert check_gradient(layer, blobs_from([rand(2, 3, 2, 3)])) > 0


# -- Interp ---------------------------------------------------------------------------------------

def interp_reference(x, out_h, out_w, crop=0, inner=None):
    """PSPNet's caffe_cpu_interp2, pixel by pixel, on the cropped input."""
    n, c, h, w = x.shape
    in_h, in_w = inner or (h, w)
    x = x[:, :, crop:crop + in_h, crop:crop + in_w]
    ratio_h = np.float32((in_h - 1) / (out_h - 1)) if out_h > 1 else np.float32(0)
    ratio_w = np.float32((in_w - 1) / (out_w - 1)) if out_w > 1 else np.float32(0)
    out = np.zeros((n, c, out_h, out_w), np.float64)
    for i in range(out_h):
        r = ratio_h * np.float32(i) if (in_h, in_w) != (out_h, out_w) else i
        y0 = int(r)
        dy = 1 if y0 < in_h - 1 else 0
        ly = r - y0
        for j in range(out_w):
            s = ratio_w * np.float32(j) if (in_h, in_w) != (out_h, out_w) else j
            x0 = int(s)
            dx = 1 if x0 < in_w - 1 else 0
            lx = s - x0
            out[:, :, i, j] = ((1 - ly) * ((1 - lx) * x[:, :, y0, x0] + lx * x[:, :, y0, x0 + dx])
                               + ly * ((1 - lx) * x[:, :, y0 + dy, x0]
                                       + lx * x[:, :, y0 + dy, x0 + dx]))
    return out


@pytest.mark.parametrize("settings, size", [
    ("zoom_factor: 3", (10, 13)),
    ("shrink_factor: 2", (2, 3)),
    ("shrink_factor: 2 zoom_factor: 3", (4, 7)),
    ("height: 7 width: 2", (7, 2)),
    ("height: 4 width: 5", (4, 5)),          # the input's size: a copy
])
def test_interp_sizes_and_values_follow_the_fork(settings, size):
    x = rand(2, 3, 4, 5)
    top = run_forward(make_layer(f'name: "i" type: "Interp" interp_param {{ {settings} }}'),
                      blobs_from([x]))
    assert top[0].shape == (2, 3) + size
    np.testing.assert_allclose(top[0].data, interp_reference(x, *size), rtol=1e-5, atol=1e-6)


def test_interp_crops_by_negative_padding():
    x = rand(1, 2, 6, 7)
    top = run_forward(make_layer('name: "i" type: "Interp" interp_param { zoom_factor: 2 '
                                 'pad_beg: -1 pad_end: -2 }'), blobs_from([x]))
    assert top[0].shape == (1, 2, 5, 7)
    np.testing.assert_allclose(top[0].data, interp_reference(x, 5, 7, crop=1, inner=(3, 4)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("settings", ["zoom_factor: 2", "height: 3 width: 7",
                                      "zoom_factor: 2 pad_beg: -1 pad_end: -1"])
def test_interp_gradient(settings):
    layer = make_layer(f'name: "i" type: "Interp" interp_param {{ {settings} }}')
    assert check_gradient(layer, blobs_from([rand(2, 2, 4, 5)])) > 0


@pytest.mark.parametrize("settings, message", [
    ("pad_beg: 1 zoom_factor: 2", "cropping only"),
    ("height: 3", "needs zoom_factor"),
    ("zoom_factor: 0", "at least 1"),
])
def test_interp_refuses_bad_settings(settings, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(f'name: "i" type: "Interp" interp_param {{ {settings} }}'),
                    blobs_from([rand(1, 1, 3, 3)]))


# -- Upsample -------------------------------------------------------------------------------------

def pooled_with_mask(x, settings="kernel_size: 2 stride: 2"):
    pool = make_layer(f'name: "p" type: "Pooling" pooling_param {{ pool: MAX {settings} }}')
    return run_forward(pool, blobs_from([x]), n_top=2)


def upsample_reference(values, mask, out_h, out_w):
    n, c = values.shape[:2]
    out = np.zeros((n, c, out_h * out_w), np.float32)
    for i in range(n):
        for j in range(c):
            out[i, j, mask[i, j].astype(np.int64).ravel()] = values[i, j].ravel()
    return out.reshape(n, c, out_h, out_w)


@pytest.mark.parametrize("settings, size", [
    ("scale: 2", (6, 8)),
    ("upsample_h: 5 upsample_w: 7", (5, 7)),
    ("scale_h: 2 scale_w: 2 pad_out_h: true", (5, 8)),
])
def test_upsample_puts_values_back_where_the_mask_says(settings, size):
    x = rand(2, 3, *size, seed=3)
    pooled, mask = pooled_with_mask(x)
    top = run_forward(make_layer(f'name: "u" type: "Upsample" upsample_param {{ {settings} }}'),
                      [pooled, mask])
    assert top[0].shape == (2, 3) + size
    np.testing.assert_array_equal(top[0].data, upsample_reference(pooled.data, mask.data, *size))
    # Unpooling keeps each window's maximum where it was and zeroes the rest.
    kept = top[0].data != 0
    np.testing.assert_array_equal(top[0].data[kept], x[kept])


def test_upsample_gradient():
    pooled, mask = pooled_with_mask(rand(2, 2, 4, 6))
    layer = make_layer('name: "u" type: "Upsample" upsample_param { scale: 2 }')
    assert check_gradient(layer, [pooled, mask], check_bottom=[0]) > 0
    assert not layer.allow_force_backward(1)


def test_upsample_refuses_a_mask_outside_the_top():
    pooled, mask = pooled_with_mask(rand(1, 1, 6, 6))
    with pytest.raises(ShapeError, match="mask index out of range"):
        run_forward(make_layer('name: "u" type: "Upsample" upsample_param { upsample_h: 2 '
                               'upsample_w: 2 }'), [pooled, mask])


# -- PriorBox -------------------------------------------------------------------------------------

def prior_box_reference(height, width, img, min_sizes, max_sizes, ratios, flip, clip,
                        variance, step=None, offset=0.5):
    """SSD's PriorBoxLayer::Forward_cpu, location by location."""
    all_ratios = [1.0]
    for r in ratios:
        if all(abs(r - a) >= 1e-6 for a in all_ratios):
            all_ratios += [r, 1 / r] if flip else [r]
    step_h, step_w = step or (img[0] / height, img[1] / width)
    boxes = []
    for h in range(height):
        for w in range(width):
            cx, cy = (w + offset) * step_w, (h + offset) * step_h
            for s, small in enumerate(min_sizes):
                sizes = [(small, small)]
                if max_sizes:
                    sizes.append((np.sqrt(small * max_sizes[s]),) * 2)
                sizes += [(small * np.sqrt(r), small / np.sqrt(r)) for r in all_ratios
                          if abs(r - 1) >= 1e-6]
                for bw, bh in sizes:
                    boxes.append([(cx - bw / 2) / img[1], (cy - bh / 2) / img[0],
                                  (cx + bw / 2) / img[1], (cy + bh / 2) / img[0]])
    boxes = np.array(boxes).ravel()
    if clip:
        boxes = np.clip(boxes, 0, 1)
    return np.stack([boxes, np.resize(variance, boxes.size)])[None]


@pytest.mark.parametrize("settings, kwargs", [
    ("min_size: 4 max_size: 9 aspect_ratio: 2 flip: true clip: true variance: 0.1",
     dict(min_sizes=[4], max_sizes=[9], ratios=[2], flip=True, clip=True, variance=[0.1])),
    ("min_size: 3 min_size: 5 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 2 flip: false "
     "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 3 offset: 0.25",
     dict(min_sizes=[3, 5], max_sizes=[], ratios=[2, 3], flip=False, clip=False,
          variance=[0.1, 0.1, 0.2, 0.2], step=(3, 3), offset=0.25)),
])
def test_prior_box_matches_the_reference(settings, kwargs):
    feature, image = rand(1, 2, 3, 4), rand(1, 3, 12, 20)
    top = run_forward(make_layer(f'name: "p" type: "PriorBox" prior_box_param {{ {settings} }}'),
                      blobs_from([feature, image]))
    np.testing.assert_allclose(top[0].data, prior_box_reference(3, 4, (12, 20), **kwargs),
                               rtol=0, atol=1e-6)


def test_prior_box_image_size_can_be_given():
    top = run_forward(make_layer('name: "p" type: "PriorBox" prior_box_param { min_size: 2 '
                                 'img_h: 10 img_w: 8 }'), blobs_from([rand(1, 1, 2, 2),
                                                                       rand(1, 1, 3, 3)]))
    expected = prior_box_reference(2, 2, (10, 8), [2], [], [], True, False, [0.1])
    np.testing.assert_allclose(top[0].data, expected, atol=1e-6)


def test_prior_box_needs_min_size():
    with pytest.raises(ShapeError, match="needs min_size"):
        run_forward(make_layer('name: "p" type: "PriorBox" prior_box_param { max_size: 3 }'),
                    blobs_from([rand(1, 1, 2, 2), rand(1, 1, 4, 4)]))


# -- DetectionOutput ------------------------------------------------------------------------------

def detection_layer(settings):
    return make_layer(f'name: "d" type: "DetectionOutput" detection_output_param {{ {settings} }}')


def priors_blob(boxes, variance=(0.1, 0.1, 0.2, 0.2)):
    boxes = np.asarray(boxes, np.float32)
    return np.stack([boxes.ravel(), np.tile(np.float32(variance), len(boxes))])[None]


# Three priors: 0 and 1 overlap by 0.81 (IoU), 2 lies apart.
PRIORS = [[0.1, 0.1, 0.5, 0.5], [0.12, 0.12, 0.52, 0.52], [0.6, 0.6, 0.9, 0.8]]


def test_detection_output_decodes_suppresses_and_orders():
    loc = np.zeros((1, 12), np.float32)
    loc[0, 8:12] = [1.0, -1.0, 0.5, 0.0]     # prior 2 moved and widened (CENTER_SIZE)
    # Classes: 0 background, 1 and 2. Prior 1 outscores prior 0 in class 1: prior 0 suppressed.
    conf = np.array([[0.1, 0.5, 0.4, 0.1, 0.8, 0.1, 0.2, 0.3, 0.5]], np.float32)
    layer = detection_layer("num_classes: 3 nms_param { nms_threshold: 0.5 } "
                            "code_type: CENTER_SIZE confidence_threshold: 0.25")
    top = run_forward(layer, blobs_from([loc, conf, priors_blob(PRIORS)]))
    rows = top[0].data.reshape(-1, 7)
    w, h = 0.3 * np.exp(0.2 * 0.5), 0.2
    cx, cy = 0.75 + 0.1 * 1.0 * 0.3, 0.7 + 0.1 * -1.0 * 0.2
    moved = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
    expected = np.array([[0, 1, 0.8] + PRIORS[1],
                         [0, 1, 0.3] + moved,
                         [0, 2, 0.5] + moved,
                         [0, 2, 0.4] + PRIORS[0]], np.float32)
    # Class 2's priors 0 and 1 (0.4, 0.1): 1 is below the threshold.
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-6)


def test_detection_output_keep_top_k_over_classes_and_corner_code():
    loc = np.full((1, 12), 0.5, np.float32)                      # CORNER: prior + 0.1 * 0.5...
    conf = np.array([[0.0, 0.9, 0.2, 0.0, 0.1, 0.7, 0.0, 0.3, 0.6]], np.float32)
    layer = detection_layer("num_classes: 3 nms_param { nms_threshold: 0.9 } code_type: CORNER "
                            "keep_top_k: 2")
    rows = run_forward(layer, blobs_from([loc, conf, priors_blob(PRIORS)]))[0].data.reshape(-1, 7)
    assert rows[:, :3].tolist() == [[0, 1, pytest.approx(0.9)], [0, 2, pytest.approx(0.7)]]
    shift = np.float32([0.1, 0.1, 0.2, 0.2]) * 0.5
    np.testing.assert_allclose(rows[0, 3:], np.float32(PRIORS[0]) + shift, atol=1e-6)


def test_detection_output_per_class_locations():
    priors = priors_blob(PRIORS[:2])
    loc = np.zeros((1, 2, 3, 4), np.float32)
    loc[0, :, 2] = [0.5, 0, 0, 0]             # class 2's boxes shifted right (CORNER, * 0.1)
    conf = np.array([[0.2, 0.7, 0.1, 0.2, 0.1, 0.7]], np.float32)
    layer = detection_layer("num_classes: 3 share_location: false nms_param { nms_threshold: "
                            "0.5 } code_type: CORNER confidence_threshold: 0.5")
    rows = run_forward(layer, blobs_from([loc.reshape(1, -1), conf, priors]))[0].data
    rows = rows.reshape(-1, 7)
    np.testing.assert_allclose(rows[:, 3:], [PRIORS[0], np.add(PRIORS[1], [0.05, 0, 0, 0])],
                               atol=1e-6)
    assert rows[:, 1].tolist() == [1, 2]


def test_detection_output_without_detections_gives_one_empty_row_per_image():
    layer = detection_layer("num_classes: 2 confidence_threshold: 0.99 code_type: CENTER_SIZE")
    loc, conf = np.zeros((2, 12), np.float32), np.full((2, 6), 0.5, np.float32)
    rows = run_forward(layer, blobs_from([loc, conf, priors_blob(PRIORS)]))[0].data
    np.testing.assert_array_equal(rows.reshape(-1, 7), [[0] + [-1] * 6, [1] + [-1] * 6])


def test_detection_output_adaptive_nms():
    # Neighbours overlap by 0.82 (IoU), boxes 0 and 2 by 0.68. At 0.85 all three survive; with
    # eta 0.9 the threshold is 0.765 once box 0 is kept: box 1 is suppressed, box 2 is not.
    boxes = [[0.1, 0.1, 0.5, 0.5], [0.12, 0.12, 0.52, 0.52], [0.14, 0.14, 0.54, 0.54]]
    conf = np.array([[0.0, 0.9, 0.0, 0.8, 0.0, 0.7]], np.float32)
    for eta, scores in (("1", [0.9, 0.8, 0.7]), ("0.9", [0.9, 0.7])):
        layer = detection_layer(f"num_classes: 2 nms_param {{ nms_threshold: 0.85 eta: {eta} }} "
                                "code_type: CORNER")
        rows = run_forward(layer, blobs_from([np.zeros((1, 12), np.float32), conf,
                                              priors_blob(boxes)]))[0].data.reshape(-1, 7)
        np.testing.assert_allclose(rows[:, 2], scores, atol=1e-6)


def test_detection_output_checks_its_bottoms():
    layer = detection_layer("num_classes: 3")
    with pytest.raises(ShapeError, match="3 priors and 3 classes"):
        run_forward(layer, blobs_from([np.zeros((1, 12), np.float32),
                                       np.zeros((1, 6), np.float32), priors_blob(PRIORS)]))


# -- against OpenCV -------------------------------------------------------------------------------

def seeded_net(tmp_path, text, std=0.1):
    """A Net from prototxt text with gaussian weights of `std`, saved where OpenCV reads them."""
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(text)
    net = syncsgd.Net(str(prototxt), syncsgd.TEST)
    rng = np.random.default_rng(7)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.shape).astype(np.float32) * std
    weights = tmp_path / "net.caffemodel"
    net.save(str(weights))
    return net, str(prototxt), str(weights) if net.params else ""


def opencv_forward(prototxt, weights, x, names):
    cv2 = pytest.importorskip("cv2")
    cv = cv2.dnn.readNetFromCaffe(prototxt, weights)
    cv.setInput(x)
    return dict(zip(names, cv.forward(names)))


def compare_with_opencv(tmp_path, text, names, shape, std=0.1, atol=1e-5, weights=True):
    net, prototxt, saved = seeded_net(tmp_path, text, std)
    if not weights:      # both keep their initial values
        net, saved = syncsgd.Net(prototxt, syncsgd.TEST), ""
    x = np.random.default_rng(1).random(shape, dtype=np.float32)
    net.forward(data=x)
    theirs = opencv_forward(prototxt, saved, x, names)
    for name in names:
        ours = net.blobs[name].data
        assert ours.shape == theirs[name].shape, name
        scale = max(1.0, float(np.abs(theirs[name]).max()))
        np.testing.assert_allclose(ours, theirs[name], rtol=0, atol=atol * scale, err_msg=name)


def input_text(shape):
    return 'input: "data"\ninput_shape { ' + " ".join(f"dim: {d}" for d in shape) + " }\n"


def test_opencv_agrees_on_the_feature_layers(tmp_path):
    shape = (2, 4, 5, 6)
    text = input_text(shape) + """
    layer { name: "shuffle" type: "ShuffleChannel" bottom: "data" top: "shuffle"
            shuffle_channel_param { group: 2 } }
    layer { name: "permute" type: "Permute" bottom: "shuffle" top: "permute"
            permute_param { order: 0 order: 2 order: 3 order: 1 } }
    layer { name: "zoom" type: "Interp" bottom: "data" top: "zoom" interp_param { zoom_factor: 3 } }
    layer { name: "resize" type: "Interp" bottom: "data" top: "resize"
            interp_param { height: 7 width: 4 } }
    layer { name: "depthwise" type: "ConvolutionDepthwise" bottom: "data" top: "depthwise"
            convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 } }
    layer { name: "norm" type: "Normalize" bottom: "data" top: "norm"
            norm_param { across_spatial: false channel_shared: false } }
    layer { name: "floor" type: "Pooling" bottom: "data" top: "floor"
            pooling_param { pool: MAX kernel_size: 2 stride: 2 ceil_mode: false } }
    layer { name: "ceil" type: "Pooling" bottom: "data" top: "ceil"
            pooling_param { pool: AVE kernel_size: 2 stride: 2 ceil_mode: true } }
    """
    names = ["shuffle", "permute", "zoom", "resize", "depthwise", "norm", "floor", "ceil"]
    compare_with_opencv(tmp_path, text, names, shape, std=1.0)


def test_opencv_agrees_on_a_shared_scale_normalize(tmp_path):
    # No weight file (syncsgd writes a 0-axis blob with an empty shape, which OpenCV refuses):
    # both start from a scale of 1. OpenCV has no per-channel scale across_spatial.
    shape = (2, 3, 4, 4)
    text = input_text(shape) + """
    layer { name: "norm" type: "Normalize" bottom: "data" top: "norm"
            norm_param { across_spatial: true channel_shared: true } }
    layer { name: "norm_pixels" type: "Normalize" bottom: "data" top: "norm_pixels"
            norm_param { across_spatial: false } }
    """
    compare_with_opencv(tmp_path, text, ["norm", "norm_pixels"], shape, weights=False)


def ssd_head(share_location=True, code_type="CENTER_SIZE", keep_top_k=30, classes=3):
    """A two-scale SSD head as SSD's scripts write it: Normalize on the first feature map, per
    scale a loc and a conf convolution, Permute and Flatten, a PriorBox, then Concat, softmax
    over the classes and DetectionOutput."""
    loc_classes = 1 if share_location else classes
    share = str(share_location).lower()
    scales = [("1", "norm1", 4, "min_size: 8 max_size: 16 aspect_ratio: 2 flip: true clip: true"),
              ("2", "conv2", 6, "min_size: 16 max_size: 28 aspect_ratio: 2 aspect_ratio: 3 "
                                "flip: true clip: false step: 8 offset: 0.5")]
    text = input_text((2, 3, 32, 32)) + """
    layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
            convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2 } }
    layer { name: "norm1" type: "Normalize" bottom: "conv1" top: "norm1"
            norm_param { across_spatial: false channel_shared: false } }
    layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
            convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2 } }
    """
    for k, source, priors, prior_settings in scales:
        for kind, outputs in (("loc", priors * loc_classes * 4), ("conf", priors * classes)):
            text += f"""
    layer {{ name: "{kind}{k}" type: "Convolution" bottom: "{source}" top: "{kind}{k}"
            convolution_param {{ num_output: {outputs} kernel_size: 3 pad: 1 }} }}
    layer {{ name: "{kind}{k}_perm" type: "Permute" bottom: "{kind}{k}" top: "{kind}{k}_perm"
            permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
    layer {{ name: "{kind}{k}_flat" type: "Flatten" bottom: "{kind}{k}_perm"
            top: "{kind}{k}_flat" flatten_param {{ axis: 1 }} }}"""
        text += f"""
    layer {{ name: "prior{k}" type: "PriorBox" bottom: "{source}" bottom: "data" top: "prior{k}"
            prior_box_param {{ {prior_settings} variance: 0.1 variance: 0.1 variance: 0.2
                               variance: 0.2 }} }}"""
    text += f"""
    layer {{ name: "loc" type: "Concat" bottom: "loc1_flat" bottom: "loc2_flat" top: "loc" }}
    layer {{ name: "conf" type: "Concat" bottom: "conf1_flat" bottom: "conf2_flat" top: "conf" }}
    layer {{ name: "priors" type: "Concat" bottom: "prior1" bottom: "prior2" top: "priors"
            concat_param {{ axis: 2 }} }}
    layer {{ name: "conf_reshape" type: "Reshape" bottom: "conf" top: "conf_reshape"
            reshape_param {{ shape {{ dim: 0 dim: -1 dim: {classes} }} }} }}
    layer {{ name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax"
            softmax_param {{ axis: 2 }} }}
    layer {{ name: "conf_flatten" type: "Flatten" bottom: "conf_softmax" top: "conf_flatten" }}
    layer {{ name: "detection_out" type: "DetectionOutput" bottom: "loc" bottom: "conf_flatten"
            bottom: "priors" top: "detection_out"
            detection_output_param {{ num_classes: {classes} share_location: {share}
              background_label_id: 0 nms_param {{ nms_threshold: 0.45 top_k: 60 }}
              code_type: {code_type} keep_top_k: {keep_top_k} confidence_threshold: 0.3 }} }}
    """
    return text


def detections(rows):
    """Real detection rows (score > 0), sorted by image, label and falling score: SSD groups
    them by label, OpenCV sorts each image's by score and pads with zero rows."""
    rows = rows.reshape(-1, 7)
    rows = rows[rows[:, 2] > 0]
    return rows[np.lexsort((-rows[:, 2], rows[:, 1], rows[:, 0]))]


@pytest.mark.parametrize("share_location, code_type", [(True, "CENTER_SIZE"),
                                                       (False, "CORNER")])
def test_ssd_head_boxes_equal_opencv(tmp_path, share_location, code_type):
    text = ssd_head(share_location, code_type)
    net, prototxt, weights = seeded_net(tmp_path, text, std=0.1)
    x = np.random.default_rng(1).random((2, 3, 32, 32), dtype=np.float32)
    net.forward(data=x)
    names = ["prior1", "prior2", "norm1", "detection_out"]
    theirs = opencv_forward(prototxt, weights, x, names)
    for name in ("prior1", "prior2", "norm1"):
        np.testing.assert_allclose(net.blobs[name].data, theirs[name], rtol=0, atol=1e-5)
    ours = detections(net.blobs["detection_out"].data)
    # Both images reach keep_top_k, so the comparison covers that cut as well as NMS.
    assert len(ours) == 2 * 30 and set(ours[:, 0]) == {0, 1} and set(ours[:, 1]) == {1, 2}
    np.testing.assert_allclose(ours, detections(theirs["detection_out"]), rtol=0, atol=1e-5)
    assert net.blobs["detection_out"].shape == (1, 1, 60, 7)


# -- where each type comes from -------------------------------------------------------------------

def test_layer_type_list_names_the_fork_of_every_type_bvlc_lacks():
    import syncsgd.parallel.layers   # noqa: F401  (its internal types must not be listed)
    from tests.test_oracle import BVLC_TYPES
    types = syncsgd.layer_type_list()
    assert all(isinstance(name, str) for name in types) and types == sorted(types)
    # BVLC's list above is of a build without OpenCV, which leaves out its two image readers.
    bvlc = set(BVLC_TYPES) | {"ImageData", "WindowData"}
    assert {name for name in types if not name.fork} == bvlc
    assert syncsgd.layer_type_list()[types.index("PriorBox")].fork == "weiliu89/caffe (ssd)"


def test_the_guide_lists_every_fork_type_with_its_fork():
    guide = (TESTS.parent / "docs" / "guide.md").read_text()
    section = guide[guide.index("### The forks' layers"):]
    section = section[:section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for name in syncsgd.layer_type_list():
        if name.fork:
            row = [r for r in rows if re.search(rf"\b{name}\b", r)]
            assert row, f"docs/guide.md's fork table does not list {name}"
            for fork in name.fork.split(", "):
                assert fork.split(" (")[0] in row[0], f"{name}: the row does not name {fork}"
