"""pycaffe's Net surface beyond forward/backward (names, loss weights, backward from/to,
forward_all over any number of samples) and caffe.Classifier / caffe.Detector on a small net."""
import numpy as np
import pytest

import syncsgd as caffe

NET = """
name: "small"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.2 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""

LOSS_NET = """
name: "lossy"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 4 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        loss_weight: 2 }
"""


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "net.prototxt"
    model.write_text(NET)
    weights = tmp_path / "net.caffemodel"
    caffe.Net(str(model), caffe.TEST).save(str(weights))
    return str(model), str(weights)


def test_names_as_pycaffe_gives_them(tmp_path):
    (tmp_path / "n.prototxt").write_text(LOSS_NET)
    net = caffe.Net(str(tmp_path / "n.prototxt"), caffe.TRAIN)
    assert net._layer_names == ["data", "ip", "loss"]
    assert net._blob_names == ["data", "label", "ip", "loss"]
    assert net.top_names == {"data": ["data", "label"], "ip": ["ip"], "loss": ["loss"]}
    assert net.bottom_names == {"data": [], "ip": ["data"], "loss": ["ip", "label"]}
    assert list(net.blob_loss_weights.items()) == [("data", 0.0), ("label", 0.0), ("ip", 0.0),
                                                   ("loss", 2.0)]


def test_backward_runs_from_start_down_to_end(files):
    net = caffe.Net(files[0], caffe.TEST)
    net.forward(data=np.random.default_rng(0).standard_normal((4, 3, 8, 8)))
    dip = np.random.default_rng(1).standard_normal(net.blobs["ip"].diff.shape).astype(np.float32)
    net.blobs["ip"].diff[...] = dip
    out = net.backward(start="ip", end="ip")
    assert list(out) == ["conv"]
    w = net.params["ip"][0].data
    np.testing.assert_allclose(out["conv"].reshape(4, -1), dip @ w, rtol=1e-4, atol=1e-6)
    net.blobs["conv"].diff[...] = 0
    net.backward(start="relu", end="relu")      # below ip: conv's diff is not recomputed
    assert not net.blobs["conv"].diff.any()


def test_forward_all_takes_any_number_of_samples(files):
    net = caffe.Net(files[0], files[1], caffe.TEST)
    x = np.random.default_rng(2).standard_normal((10, 3, 8, 8)).astype(np.float32)
    out = net.forward_all(data=x, blobs=["ip"])
    assert out["prob"].shape == (10, 3) and out["ip"].shape == (10, 3)
    for first in (0, 4, 8):
        batch = np.zeros((4, 3, 8, 8), np.float32)
        part = x[first:first + 4]
        batch[:len(part)] = part
        expected = net.forward(data=batch)["prob"][:len(part)]
        np.testing.assert_allclose(out["prob"][first:first + 4], expected, rtol=1e-6)


def test_forward_backward_all_gives_input_gradients(files):
    net = caffe.Net(files[0], files[1], caffe.TEST)
    x = np.random.default_rng(3).standard_normal((6, 3, 8, 8)).astype(np.float32)
    dprob = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    outs, diffs = net.forward_backward_all(data=x, prob=dprob)
    assert outs["prob"].shape == (6, 3) and diffs["data"].shape == (6, 3, 8, 8)
    batch = np.zeros((4, 3, 8, 8), np.float32)
    batch[:2] = x[4:]
    top = np.zeros((4, 3), np.float32)
    top[:2] = dprob[4:]
    net.forward(data=batch)
    expected = net.backward(prob=top)["data"][:2]
    np.testing.assert_allclose(diffs["data"][4:], expected, rtol=1e-5, atol=1e-7)


def images(count=2, h=12, w=10):
    return [np.random.default_rng(10 + i).random((h, w, 3)).astype(np.float32)
            for i in range(count)]


def test_classifier_centre_crop_and_ten_crops(files):
    mean = np.array([0.2, 0.3, 0.4])
    clf = caffe.Classifier(files[0], files[1], image_dims=(12, 10), mean=mean, raw_scale=2.0,
                           channel_swap=(2, 1, 0))
    ims = images()
    centre = clf.predict(ims, oversample=False)
    assert centre.shape == (2, 3)
    t = clf.transformer
    manual = np.stack([t.preprocess("data", im[2:10, 1:9]) for im in ims])
    expected = clf.forward_all(data=manual)["prob"]
    np.testing.assert_allclose(centre, expected, rtol=1e-5)
    np.testing.assert_allclose(manual[0], (ims[0][2:10, 1:9].transpose(2, 0, 1)[::-1] * 2.0
                                           - mean[:, None, None]), rtol=1e-5, atol=1e-6)
    ten = clf.predict(ims)
    crops = caffe.io.oversample(ims, (8, 8))
    scores = clf.forward_all(data=np.stack([t.preprocess("data", c) for c in crops]))["prob"]
    np.testing.assert_allclose(ten, scores.reshape(2, 10, 3).mean(axis=1), rtol=1e-5)


def test_detector_scores_each_window(files, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    pixels = (np.random.default_rng(5).random((20, 16, 3)) * 255).astype(np.uint8)
    path = str(tmp_path / "im.png")
    Image.fromarray(pixels).save(path)
    det = caffe.Detector(files[0], files[1], raw_scale=255)
    windows = [np.array([0, 0, 8, 8]), np.array([4, 2, 20, 16])]
    found = det.detect_windows([(path, windows)])
    assert [d["filename"] for d in found] == [path, path]
    image = caffe.io.load_image(path)
    for d, w in zip(found, windows):
        crop = image[w[0]:w[2], w[1]:w[3]]
        x = det.transformer.preprocess("data", crop)
        np.testing.assert_array_equal(d["window"], w)
        expected = det.forward_all(data=x[None])["prob"][0]
        np.testing.assert_allclose(d["prediction"], expected, rtol=1e-5)


def test_detector_context_pad_fills_outside_with_the_mean(files):
    mean = np.array([0.5, 0.25, 0.125])
    det = caffe.Detector(files[0], files[1], mean=mean, raw_scale=1.0, context_pad=2)
    assert tuple(det.crop_dims) == (8, 8, 3)
    image = np.ones((10, 10, 3), np.float32)
    crop = det.crop(image, np.array([0, 0, 9, 9]))     # the window is the whole image
    assert crop.shape == (8, 8, 3)
    np.testing.assert_allclose(crop[0, 0], mean)        # context beyond the image: the mean
    np.testing.assert_allclose(crop[4, 4], 1.0)         # the image itself


def test_save_hdf5_writes_caffes_layout_whatever_the_name(files, tmp_path):
    h5py = pytest.importorskip("h5py")
    net = caffe.Net(files[0], files[1], caffe.TEST)
    path = str(tmp_path / "weights.bin")          # no .h5 ending, as in pycaffe's own test
    net.save_hdf5(path)
    assert h5py.is_hdf5(path)
    with h5py.File(path, "r") as f:
        assert sorted(f["data"]) == sorted(net._layer_names)     # a group per layer, as Caffe
        assert sorted(f["data/conv"]) == ["0", "1"] and not len(f["data/relu"])
    fresh = caffe.Net(files[0], caffe.TEST)
    for blobs in fresh.params.values():
        for blob in blobs:
            blob.data[...] = 0
    fresh.load_hdf5(path)
    for name, blobs in net.params.items():
        for ours, theirs in zip(fresh.params[name], blobs):
            np.testing.assert_array_equal(ours.data, theirs.data)
