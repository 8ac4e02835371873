"""The mobile, SE and segmentation forks' layer types: ReLU6, DepthwiseConvolution, Axpy, BN and
DenseImageData, against numpy references written from the forks' C++ (brocolli-caffe's
relu6_layer.cpp, yonghenglh6/DepthwiseConvolution, hujie-frank/SENet's axpy_layer.cpp, the BN
layers of hszhao/PSPNet and alexgkendall/caffe-segnet, SegNet's dense_image_data_layer.cpp),
ReLU6 against OpenCV (which has none of the others in its Caffe importer, or not as the fork
computes it), gradient checks, and 2 ranks = 1 process where the batch matters (BN's batch
statistics, DenseImageData's slices)."""
import numpy as np
import pytest

from syncsgd import TEST, TRAIN
from syncsgd.blob import Blob
from syncsgd.context import Context, shard_range
from syncsgd.errors import DataError, PrototxtError, ShapeError
from syncsgd.layers import create
from syncsgd.proto import pb
from google.protobuf import text_format
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_dense import FakeRanks, check_in_place, forward_backward
from tests.test_layers_fork import compare_with_opencv, input_text, rand


def randn(*shape, seed=0, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


# -- ReLU6 --------------------------------------------------------------------------------------

def relu6_reference(x, slope, threshold):
    return np.minimum(np.maximum(x, 0) + slope * np.minimum(x, 0), threshold)


@pytest.mark.parametrize("settings,slope,threshold", [
    ("", 0.0, 6.0), ("relu6_param { negative_slope: 0.2 threshold: 2.5 }", 0.2, 2.5)])
def test_relu6_matches_the_fork(settings, slope, threshold):
    x = randn(2, 3, 4, 5, scale=5)
    layer = make_layer(f"name: 'r' type: 'ReLU6' {settings}")
    (top,) = run_forward(layer, blobs_from([x]))
    np.testing.assert_allclose(top.data, relu6_reference(x, slope, threshold), rtol=1e-6)
    dy = randn(*x.shape, seed=1)
    top.diff[...] = dy
    bottom = blobs_from([x])
    layer.backward([top], [True], bottom)
    # The fork's: dy * ((x > 0) + slope * (x <= 0)) * (x < threshold).
    want = dy * ((x > 0) + slope * (x <= 0)) * (x < threshold)
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-6)
    check_in_place(f"name: 'r' type: 'ReLU6' {settings}", x)


def test_relu6_gradient():
    layer = make_layer("name: 'r' type: 'ReLU6' relu6_param { negative_slope: 0.1 threshold: 3 }")
    x = randn(2, 3, 4, 4, scale=3)
    assert check_gradient(layer, blobs_from([x]), kink=lambda v: min(abs(v), abs(v - 3)),
                          kink_range=0.02) > 0


def test_relu6_equals_opencv(tmp_path):
    shape = (2, 3, 4, 5)
    text = input_text(shape) + """
        layer { name: "s" type: "Power" bottom: "data" top: "s" power_param { scale: 20
                shift: -8 } }
        layer { name: "r" type: "ReLU6" bottom: "s" top: "r" }"""
    compare_with_opencv(tmp_path, text, ["r"], shape, weights=False)


def test_relu6_threshold_must_be_positive():
    with pytest.raises(ShapeError, match="threshold"):
        run_forward(make_layer("name: 'r' type: 'ReLU6' relu6_param { threshold: 0 }"),
                    blobs_from([rand(1, 2)]))


# -- DepthwiseConvolution -------------------------------------------------------------------------

def depthwise_text(channels, group=None, stride=1):
    group = channels if group is None else group
    return (f"name: 'd' type: 'DepthwiseConvolution' convolution_param {{ num_output: {channels} "
            f"group: {group} kernel_size: 3 pad: 1 stride: {stride} weight_filler {{ type: "
            f"'gaussian' std: 0.5 }} bias_filler {{ type: 'gaussian' std: 0.5 }} }}")


def depthwise_reference(x, w, b, stride):
    """The fork's GPU kernel: channel c with filter c, zero padding 1."""
    n, c, h, wd = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out_h, out_w = (h - 1) // stride + 1, (wd - 1) // stride + 1
    out = np.zeros((n, c, out_h, out_w), np.float64)
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i:i + stride * out_h:stride, j:j + stride * out_w:stride]
            out += window * w[None, :, 0, i, j, None, None]
    return out + b[None, :, None, None]


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_convolution_matches_the_forks_kernel(stride):
    x = rand(2, 4, 5, 6)
    layer = make_layer(depthwise_text(4, stride=stride))
    (top,) = run_forward(layer, blobs_from([x]))
    assert layer.blobs[0].shape == (4, 1, 3, 3)
    want = depthwise_reference(x, layer.blobs[0].data, layer.blobs[1].data, stride)
    np.testing.assert_allclose(top.data, want, rtol=1e-5, atol=1e-5)


def test_depthwise_convolution_gradient():
    assert check_gradient(make_layer(depthwise_text(3)), blobs_from([rand(2, 3, 4, 4)])) > 0


@pytest.mark.parametrize("group", [1, 2])
def test_depthwise_convolution_group_must_be_the_channels(group):
    with pytest.raises(ShapeError, match="group: 4"):
        run_forward(make_layer(depthwise_text(4, group=group)), blobs_from([rand(1, 4, 3, 3)]))


# -- Axpy -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale_shape", [(2, 3, 1, 1), (2, 3)])
def test_axpy_matches_the_fork(scale_shape):
    a, x, y = randn(*scale_shape), randn(2, 3, 4, 5, seed=1), randn(2, 3, 4, 5, seed=2)
    layer = make_layer("name: 'a' type: 'Axpy'")
    bottom = blobs_from([a, x, y])
    (top,) = run_forward(layer, bottom)
    a4 = a.reshape(2, 3, 1, 1)
    np.testing.assert_allclose(top.data, a4 * x + y, rtol=1e-6, atol=1e-6)
    dy = randn(*x.shape, seed=3)
    top.diff[...] = dy
    layer.backward([top], [True, True, True], bottom)
    np.testing.assert_allclose(bottom[0].diff.reshape(2, 3), (dy * x).sum(axis=(2, 3)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bottom[1].diff, dy * a4, rtol=1e-6)
    np.testing.assert_allclose(bottom[2].diff, dy)


def test_axpy_gradient():
    bottom = blobs_from([randn(2, 3, 1, 1), randn(2, 3, 3, 4, seed=1), randn(2, 3, 3, 4, seed=2)])
    assert check_gradient(make_layer("name: 'a' type: 'Axpy'"), bottom) > 0


@pytest.mark.parametrize("shapes,message", [
    ([(2, 3, 1, 1), (2, 3, 4, 4), (2, 3, 4, 5)], "one shape"),
    ([(2, 3, 2, 1), (2, 3, 4, 4), (2, 3, 4, 4)], "scale a"),
    ([(2, 4), (2, 3, 4, 4), (2, 3, 4, 4)], "scale a")])
def test_axpy_checks_its_bottoms(shapes, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer("name: 'a' type: 'Axpy'"), blobs_from([rand(*s) for s in shapes]))


# -- BN -------------------------------------------------------------------------------------------

GAUSS = "{ type: 'gaussian' std: 0.5 mean: 1 }"
SEGNET = f"bn_param {{ scale_filler {GAUSS} shift_filler {GAUSS} {{mode}} }}"
PSPNET = f"bn_param {{ slope_filler {GAUSS} bias_filler {GAUSS} momentum: 0.8 {{extra}} }}"


def segnet_text(mode="LEARN"):
    return "name: 'bn' type: 'BN' " + SEGNET.replace("{mode}", f"bn_mode: {mode}")


def pspnet_text(extra=""):
    return "name: 'bn' type: 'BN' " + PSPNET.replace("{extra}", extra)


def channel(v):
    return np.asarray(v).reshape(1, -1, 1, 1)


def batch_statistics(x):
    """Per-channel mean and biased variance over (N, H, W), in float64."""
    return x.mean(axis=(0, 2, 3), dtype=np.float64), x.var(axis=(0, 2, 3), dtype=np.float64)


def normalized(x, mean, var, eps):
    return (x - channel(mean)) / np.sqrt(channel(var) + eps)


def test_segnet_learn_normalizes_by_the_batch_and_gives_its_statistics():
    x = randn(3, 4, 5, 6, scale=2, shift=1)
    layer = make_layer(segnet_text())
    top = run_forward(layer, blobs_from([x]), n_top=3)
    assert [b.shape for b in layer.blobs] == [(1, 4, 1, 1)] * 2
    scale, shift = (b.data for b in layer.blobs)
    mean, var = batch_statistics(x)
    want = normalized(x, mean, var, 1e-9) * scale + shift
    np.testing.assert_allclose(top[0].data, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(top[1].data, channel(mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top[2].data, channel(var), rtol=1e-5)


def test_segnet_inference_is_scale_and_shift():
    x = randn(2, 3, 4, 4)
    layer = make_layer(segnet_text("INFERENCE"), phase=TRAIN)      # the phase does not matter
    (top,) = run_forward(layer, blobs_from([x]))
    scale, shift = (b.data for b in layer.blobs)
    np.testing.assert_allclose(top.data, x * scale + shift, rtol=1e-6, atol=1e-6)


def test_pspnet_train_normalizes_by_the_batch_and_moves_the_averages():
    x1, x2 = randn(3, 4, 2, 3, seed=1, scale=3, shift=1), randn(3, 4, 2, 3, seed=2, shift=-2)
    layer = make_layer(pspnet_text("eps: 1e-4"))
    (top,) = run_forward(layer, blobs_from([x1]))
    assert [b.shape for b in layer.blobs] == [(1, 4, 1, 1)] * 4
    slope, bias = layer.blobs[0].data.copy(), layer.blobs[1].data.copy()
    mean1, var1 = batch_statistics(x1)
    np.testing.assert_allclose(top.data, normalized(x1, mean1, var1, 1e-4) * slope + bias,
                               rtol=1e-5, atol=1e-5)
    (top,) = run_forward(layer, blobs_from([x2]))
    mean2, var2 = batch_statistics(x2)
    # avg = (1 - momentum) * batch + momentum * avg, from zeros; the variance stays biased.
    np.testing.assert_allclose(layer.blobs[2].data, channel(0.2 * mean2 + 0.8 * 0.2 * mean1),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[3].data, channel(0.2 * var2 + 0.8 * 0.2 * var1),
                               rtol=1e-5)


@pytest.mark.parametrize("text,phase", [(pspnet_text(), TEST),
                                        (pspnet_text("frozen: true"), TRAIN)],
                         ids=["test", "frozen"])
def test_pspnet_moving_averages_in_test_or_frozen(text, phase):
    x = randn(2, 3, 2, 2, shift=1)
    layer = make_layer(text, phase=phase)
    bottom = blobs_from([x])
    layer.setup(bottom, [Blob()])
    layer.blobs[2].data[...] = channel([0.5, -1.0, 0.2])
    layer.blobs[3].data[...] = channel([2.0, 0.25, 1.0])
    (top,) = run_forward(layer, bottom)
    slope, bias = layer.blobs[0].data, layer.blobs[1].data
    want = normalized(x, [0.5, -1.0, 0.2], [2.0, 0.25, 1.0], 1e-5) * slope + bias
    np.testing.assert_allclose(top.data, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[2].data, channel([0.5, -1.0, 0.2]))
    assert check_gradient(layer, bottom, check_params=False) > 0


def test_pspnet_frozen_learns_nothing():
    layer = make_layer(pspnet_text("frozen: true"))
    bottom = blobs_from([randn(2, 3, 2, 2)])
    (top,) = run_forward(layer, bottom)
    np.testing.assert_allclose(layer.blobs[3].data, 1.0)         # the fork starts it at 1
    assert [(s.lr_mult, s.decay_mult) for s in layer.param.param] == [(0, 0)] * 4
    top.diff[...] = 1
    layer.backward([top], [True], bottom)
    assert not any(b.diff.any() for b in layer.blobs)
    unfrozen = make_layer(pspnet_text())
    run_forward(unfrozen, blobs_from([randn(2, 3, 2, 2)]))
    assert [s.lr_mult for s in unfrozen.param.param] == [1, 1, 0, 0]


@pytest.mark.parametrize("text,phase", [
    (segnet_text(), TRAIN), (segnet_text("INFERENCE"), TRAIN), (pspnet_text(), TRAIN)],
    ids=["segnet-learn", "segnet-inference", "pspnet-train"])
def test_bn_gradient(text, phase):
    # Caffe's BatchNorm gradient test: step 1e-2, threshold 1e-3. In TRAIN PSPNet's moving
    # averages do not enter the output: their gradient is zero, as computed.
    layer = make_layer(text, phase=phase)
    assert check_gradient(layer, blobs_from([randn(3, 2, 3, 2, scale=2, shift=0.5)])) > 0


def test_pspnet_test_phase_parameter_gradients():
    """In TEST (not frozen) slope and bias still get dL/dslope = sum(dy * x_norm), dL/dbias =
    sum(dy), with x_norm from the moving averages."""
    x, dy = randn(2, 3, 2, 2), randn(2, 3, 2, 2, seed=1)
    layer = make_layer(pspnet_text(), phase=TEST)
    bottom = blobs_from([x])
    layer.setup(bottom, [Blob()])
    layer.blobs[2].data[...] = 0.3
    layer.blobs[3].data[...] = 2.0
    (top,) = run_forward(layer, bottom)
    top.diff[...] = dy
    layer.backward([top], [True], bottom)
    x_norm = (x - 0.3) / np.sqrt(2.0 + 1e-5)
    np.testing.assert_allclose(layer.blobs[0].diff, channel((dy * x_norm).sum(axis=(0, 2, 3))),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].diff, channel(dy.sum(axis=(0, 2, 3))), rtol=1e-5)
    np.testing.assert_allclose(bottom[0].diff, dy * layer.blobs[0].data / np.sqrt(2.0 + 1e-5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("text", [segnet_text(), segnet_text("INFERENCE"), pspnet_text()],
                         ids=["segnet-learn", "segnet-inference", "pspnet"])
def test_bn_in_place(text):
    check_in_place(text, randn(4, 3, 2, 2, shift=1))


@pytest.mark.parametrize("text,n_top,message", [
    ("bn_param { scale_filler { value: 1 } momentum: 0.9 }", 1, "mixes"),
    ("bn_param { bn_mode: INFERENCE }", 2, "one top"),
    ("bn_param { frozen: true }", 2, "one top"),
    ("bn_param { momentum: 1.5 }", 1, "momentum"),
    ("bn_param { eps: 0 }", 1, "eps")], ids=["mixed", "inference-tops", "pspnet-tops",
                                             "momentum", "eps"])
def test_bn_refuses_bad_settings(text, n_top, message):
    with pytest.raises(ShapeError, match=message):
        run_forward(make_layer(f"name: 'bn' type: 'BN' {text}"), blobs_from([rand(2, 3, 2, 2)]),
                    n_top=n_top)


@pytest.mark.parametrize("text", [segnet_text(), pspnet_text()], ids=["segnet", "pspnet"])
def test_bn_batch_statistics_over_ranks_are_the_global_batch(text):
    """Two ranks holding 3 and 2 of 5 samples give the one-process tops, bottom diffs, summed
    parameter diffs and (PSPNet) moving averages."""
    x, dy = randn(5, 3, 2, 2, scale=2, shift=1), randn(5, 3, 2, 2, seed=1)
    param = text_format.Parse(text, pb.LayerParameter())

    def run(ctx, rows):
        layer = create(param, ctx)
        y, dx = forward_backward(layer, blobs_from([x[rows]]), [Blob()], dy[rows])
        return y, dx, [b.diff.copy() for b in layer.blobs], [b.data.copy() for b in layer.blobs]

    whole = run(Context(TRAIN, seed=1701), slice(None))
    ranks = FakeRanks(2)
    parts = ranks.run(lambda r: run(ranks.context(r), slice(*_bounds(5, r, 2))))
    np.testing.assert_allclose(np.concatenate([p[0] for p in parts]), whole[0], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), whole[1], rtol=1e-4,
                               atol=1e-5)
    for k, want in enumerate(whole[2]):
        np.testing.assert_allclose(parts[0][2][k] + parts[1][2][k], want, rtol=1e-5, atol=1e-5)
    for part in parts:
        for got, want in zip(part[3], whole[3]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _bounds(total, rank, size):
    first, count = shard_range(total, rank, size)
    return first, first + count


# -- DenseImageData -------------------------------------------------------------------------------

IMAGES = 5


@pytest.fixture(scope="module")
def dense_list(tmp_path_factory):
    """Five 6x8 color images and their label images; label = (blue channel) // 32, so a label
    that moved with its image can be recognised."""
    Image = pytest.importorskip("PIL.Image")
    root = tmp_path_factory.mktemp("dense")
    rng = np.random.default_rng(3)
    lines = []
    for i in range(IMAGES):
        bgr = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(bgr[:, :, ::-1]).save(root / f"im{i}.png")
        Image.fromarray(bgr[:, :, 0] // 32).save(root / f"lab{i}.png")
        lines.append(f"im{i}.png lab{i}.png")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return root


def dense_text(root, settings="", batch=4, transform=""):
    return (f"name: 'd' type: 'DenseImageData' top: 'data' top: 'label' "
            f"dense_image_data_param {{ source: '{root}/list.txt' root_folder: '{root}/' "
            f"batch_size: {batch} {settings} }} {transform}")


def dense_run(text, ctx=None, batches=1):
    layer = create(text_format.Parse(text, pb.LayerParameter()), ctx or Context(TRAIN, seed=5))
    top = [Blob(), Blob()]
    layer.setup([], top)
    out = []
    for _ in range(batches):
        layer.forward([], top)
        out.append((top[0].data.copy(), top[1].data.copy()))
    layer.close()
    return out


def images(root, kind, rows):
    Image = pytest.importorskip("PIL.Image")
    out = []
    for i in rows:
        pixels = np.asarray(Image.open(root / f"{kind}{i}.png"))
        out.append(pixels[None] if pixels.ndim == 2 else pixels[:, :, ::-1].transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


def test_dense_image_data_reads_images_and_label_images(dense_list):
    transform = "transform_param { scale: 0.5 mean_value: 10 }"
    (first, second) = dense_run(dense_text(dense_list, transform=transform), batches=2)
    data, label = first
    assert data.shape == (4, 3, 6, 8) and label.shape == (4, 1, 6, 8)
    np.testing.assert_allclose(data, (images(dense_list, "im", range(4)) - 10) * 0.5)
    np.testing.assert_array_equal(label, images(dense_list, "lab", range(4)))  # not transformed
    np.testing.assert_array_equal(second[1], images(dense_list, "lab", [4, 0, 1, 2]))


def test_dense_image_data_resizes_labels_by_nearest_neighbour(dense_list):
    cv2 = pytest.importorskip("cv2")
    (data, label), = dense_run(dense_text(dense_list, "new_height: 11 new_width: 5"))
    assert data.shape == (4, 3, 11, 5)
    for i in range(4):
        want = cv2.resize(cv2.imread(str(dense_list / f"lab{i}.png"), cv2.IMREAD_GRAYSCALE),
                          (5, 11), interpolation=cv2.INTER_NEAREST)
        np.testing.assert_array_equal(label[i, 0], want)


def test_dense_image_data_crops_and_mirrors_image_and_label_together(dense_list):
    batches = dense_run(dense_text(dense_list, "crop_height: 4 crop_width: 5 mirror: true "
                                               "shuffle: true"), batches=3)
    flipped = 0
    for data, label in batches:
        assert data.shape == (4, 3, 4, 5) and label.shape == (4, 1, 4, 5)
        np.testing.assert_array_equal(label[:, 0], data[:, 0] // 32)
        full = images(dense_list, "im", range(IMAGES))
        for sample in data:
            found = [window_of(full[i], sample) for i in range(IMAGES)]
            assert sum(f is not None for f in found) == 1
            flipped += [f for f in found if f is not None][0]
    assert 0 < flipped < 12       # some mirrored, some not


def window_of(image, sample):
    """Whether `sample` is a window of `image` mirrored (True), unmirrored (False), or None."""
    h, w = sample.shape[1:]
    for flip in (False, True):
        source = image[:, :, ::-1] if flip else image
        for i in range(image.shape[1] - h + 1):
            for j in range(image.shape[2] - w + 1):
                if np.array_equal(source[:, i:i + h, j:j + w], sample):
                    return flip
    return None


def test_dense_image_data_split_over_ranks_equals_one_process(dense_list):
    text = dense_text(dense_list, "crop_height: 4 crop_width: 5 mirror: true shuffle: true", 5)
    whole = dense_run(text, Context(TRAIN, seed=5), batches=2)
    parts = [dense_run(text, Context(TRAIN, seed=5, rank=r, size=2), batches=2) for r in (0, 1)]
    for k in range(2):
        for top in (0, 1):
            np.testing.assert_array_equal(np.concatenate([p[k][top] for p in parts]),
                                          whole[k][top])


@pytest.mark.parametrize("settings,transform,error,message", [
    ("", "transform_param { mirror: true }", PrototxtError, "crop_size and mirror"),
    ("new_height: 4", "", PrototxtError, "new_width"),
    ("crop_height: 7 crop_width: 3", "", PrototxtError, "exceeds")])
def test_dense_image_data_refuses_bad_settings(dense_list, settings, transform, error, message):
    with pytest.raises(error, match=message):
        dense_run(dense_text(dense_list, settings, transform=transform))


def test_dense_image_data_names_a_bad_list_line(tmp_path):
    (tmp_path / "list.txt").write_text("only_one_path.png\n")
    with pytest.raises(DataError, match="list.txt:1"):
        dense_run(dense_text(tmp_path))
