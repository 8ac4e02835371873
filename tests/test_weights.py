"""Weight files in and out in Caffe's formats, checked against files real Caffe wrote.

OpenCV's Caffe importer (cv2.dnn.readNetFromCaffe) is the independent oracle for forward values;
h5py and the protobuf schema read the stored arrays directly.
"""
import os

import h5py
import numpy as np
import pytest

import syncsgd
from syncsgd.errors import WeightsError
from syncsgd.io.mean import fit_mean, load_mean, save_mean
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

WEIGHTS = os.path.join(CAFFE_FIXTURES, "weights")
LENET_DIR = os.path.join(WEIGHTS, "lenet-ethereon")
CIFAR_DIR = os.path.join(WEIGHTS, "cifar10-quick-ictchase")
V1_DIR = os.path.join(WEIGHTS, "lenet-v1-pl8787")

LENET_PROTO = os.path.join(LENET_DIR, "lenet.prototxt")
LENET_MODEL = os.path.join(LENET_DIR, "lenet_iter_10000.caffemodel")
CIFAR_PROTO = os.path.join(CIFAR_DIR, "cifar10_quick.prototxt")
CIFAR_MODEL = os.path.join(CIFAR_DIR, "cifar10_quick_iter_4000.caffemodel")
CIFAR_H5 = os.path.join(CIFAR_DIR, "cifar10_quick_iter_5000.caffemodel.h5")
V1_PROTO = os.path.join(V1_DIR, "lenet.prototxt")      # V1 `layers`, legacy input_dim
V1_MODEL = os.path.join(V1_DIR, "lenet_iter_10000")    # V1 NetParameter, 4-D legacy blobs

# Blobs OpenCV reports that no in-place layer overwrites later in syncsgd (ReLU on ip1 in LeNet,
# on conv2/pool1/conv3 in CIFAR-10 quick), so both sides hold the same values after forward.
LENET_BLOBS = ["conv1", "pool1", "conv2", "pool2", "ip2", "prob"]
CIFAR_BLOBS = ["conv1", "pool2", "pool3", "ip1", "ip2", "prob"]

# (prototxt, weights, batch, input scale, blobs to compare): each pair as real users load them.
PAIRS = {
    "lenet": (LENET_PROTO, LENET_MODEL, 64, 1.0, LENET_BLOBS),
    "cifar10_quick": (CIFAR_PROTO, CIFAR_MODEL, 4, 60.0, CIFAR_BLOBS),
    "lenet_v1": (V1_PROTO, V1_MODEL, 64, 1.0, LENET_BLOBS),
}


def stored_blobs(path):
    """Layer name -> list of float32 arrays as the binary file holds them (flat), read with the
    protobuf schema alone, current or V1 layers."""
    param = pb.NetParameter()
    with open(path, "rb") as f:
        param.ParseFromString(f.read())
    return {layer.name: [np.asarray(b.data, np.float32) for b in layer.blobs]
            for layer in list(param.layer) + list(param.layers) if layer.blobs}


def h5_blobs(path):
    with h5py.File(path, "r") as f:
        return {name: [np.asarray(group[str(i)]) for i in range(len(group))]
                for name, group in f["data"].items() if len(group)}


def random_input(net, batch, scale, seed=0):
    """Seeded input of the net's sample shape: uniform [0, 1) times `scale`, centred for CIFAR."""
    shape = (batch,) + net.blobs["data"].shape[1:]
    x = np.random.default_rng(seed).random(shape, dtype=np.float32)
    return x if scale == 1.0 else ((x - 0.5) * 2 * scale).astype(np.float32)


def syncsgd_forward(net, x):
    net.blobs["data"].reshape(*x.shape)
    net.reshape()
    net.forward(data=x)
    return net


def opencv_outputs(prototxt, weights, x, names):
    cv2 = pytest.importorskip("cv2")
    cv = cv2.dnn.readNetFromCaffe(prototxt, weights)
    cv.setInput(x)
    return dict(zip(names, cv.forward(names)))


def assert_close_to_opencv(net, reference):
    for name, theirs in reference.items():
        ours = net.blobs[name].data
        assert ours.shape == theirs.shape, name
        scale = max(1.0, float(np.abs(theirs).max()))
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * scale, err_msg=name)


def assert_params_equal(net, expected, exact_shapes=True):
    """Every layer in `expected` (name -> arrays) has exactly those values in the net."""
    assert expected
    for name, arrays in expected.items():
        blobs = net.params[name]
        assert len(blobs) == len(arrays), name
        for blob, array in zip(blobs, arrays):
            assert blob.data.dtype == np.float32
            if exact_shapes:
                assert blob.shape == array.shape, name
            assert np.array_equal(blob.data.ravel(), array.ravel()), name


def small_net(**ip1):
    """An Input of one MNIST digit and an InnerProduct named like LeNet's ip1."""
    param = pb.NetParameter(name="small")
    param.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(
        dim=[1, 1, 28, 28])
    layer = param.layer.add(name="ip1", type="InnerProduct", bottom=["data"], top=["ip1"])
    layer.inner_product_param.MergeFrom(pb.InnerProductParameter(**ip1))
    return syncsgd.Net(param, syncsgd.TEST)


# -- loading Caffe's files ----------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(PAIRS))
def test_caffe_weights_load_exactly_and_match_opencv(key):
    prototxt, weights, batch, scale, blobs = PAIRS[key]
    net = syncsgd.Net(prototxt, syncsgd.TEST, weights=weights)
    assert_params_equal(net, stored_blobs(weights), exact_shapes=False)
    x = random_input(net, batch, scale)
    syncsgd_forward(net, x)
    assert_close_to_opencv(net, opencv_outputs(prototxt, weights, x, blobs))
    probs = net.blobs["prob"].data
    np.testing.assert_allclose(probs.sum(1), 1, rtol=1e-5)


def test_pycaffe_positional_form_and_copy_from_agree():
    by_keyword = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST, weights=CIFAR_MODEL)
    positional = syncsgd.Net(CIFAR_PROTO, CIFAR_MODEL, syncsgd.TEST)
    copied = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST)
    copied.copy_from(CIFAR_MODEL)
    for name, blobs in by_keyword.params.items():
        for a, b, c in zip(blobs, positional.params[name], copied.params[name]):
            assert np.array_equal(a.data, b.data) and np.array_equal(a.data, c.data)


def test_legacy_4d_blobs_fit_current_shapes():
    """The V1 file stores ip1's weights as 1x1x500x800 and biases as 1x1x1xN."""
    param = pb.NetParameter()
    with open(V1_MODEL, "rb") as f:
        param.ParseFromString(f.read())
    ip1 = next(layer for layer in param.layers if layer.name == "ip1")
    assert not ip1.blobs[0].HasField("shape")
    legacy = [(b.num, b.channels, b.height, b.width) for b in ip1.blobs]
    assert legacy == [(1, 1, 500, 800), (1, 1, 1, 500)]

    net = syncsgd.Net(V1_PROTO, syncsgd.TEST, weights=V1_MODEL)
    assert net.params["ip1"][0].shape == (500, 800)
    assert net.params["ip1"][1].shape == (500,)
    assert net.params["conv1"][1].shape == (20,)
    stored = stored_blobs(V1_MODEL)
    assert np.array_equal(net.params["ip1"][0].data, stored["ip1"][0].reshape(500, 800))
    # The same legacy file loads into the current-format LeNet of another project.
    current = syncsgd.Net(LENET_PROTO, syncsgd.TEST, weights=V1_MODEL)
    for name, blobs in net.params.items():
        for a, b in zip(blobs, current.params[name]):
            assert np.array_equal(a.data, b.data)


def test_hdf5_weights_equal_the_stored_datasets():
    net = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST, weights=CIFAR_H5)
    expected = h5_blobs(CIFAR_H5)
    assert sorted(expected) == ["conv1", "conv2", "conv3", "ip1", "ip2"]
    assert_params_equal(net, expected)
    binary = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST, weights=CIFAR_MODEL)
    assert not np.array_equal(binary.params["conv1"][0].data, net.params["conv1"][0].data), \
        "the 5000-iteration h5 and the 4000-iteration binary should differ"


def test_hdf5_weights_are_recognised_by_content(tmp_path):
    """A .caffemodel.h5 renamed without the extension is still read as HDF5."""
    path = tmp_path / "weights"
    path.write_bytes(open(CIFAR_H5, "rb").read())
    net = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST, weights=str(path))
    assert_params_equal(net, h5_blobs(CIFAR_H5))


def test_double_precision_blobs_load_as_float32(tmp_path):
    """Caffe's Blob<double> writes double_data; values are rounded to float32."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((7, 784)), rng.standard_normal(7)]
    param = pb.NetParameter(name="double")
    layer = param.layer.add(name="ip1", type="InnerProduct")
    for array in arrays:
        blob = layer.blobs.add()
        blob.shape.dim.extend(array.shape)
        blob.double_data.extend(array.ravel().tolist())
    path = tmp_path / "double.caffemodel"
    path.write_bytes(param.SerializeToString())
    net = small_net(num_output=7)
    net.copy_from(str(path))
    assert_params_equal(net, {"ip1": [a.astype(np.float32) for a in arrays]})


def caffe_hdf5_shared_net():
    """ip_a and ip_b share the weight blob (param name "w"), each has its own bias."""
    param = pb.NetParameter(name="shared")
    param.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(dim=[2, 4])
    for name in ("ip_a", "ip_b"):
        layer = param.layer.add(name=name, type="InnerProduct", bottom=["data"], top=[name])
        layer.param.add(name="w")
        layer.inner_product_param.num_output = 3
        layer.inner_product_param.weight_filler.type = "gaussian"
    return syncsgd.Net(param, syncsgd.TEST)


def test_caffe_hdf5_with_shared_weights_loads(tmp_path):
    """Caffe's Net::ToHDF5 writes a shared param only under its owner layer."""
    net = caffe_hdf5_shared_net()
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    bias_a, bias_b = np.ones(3, np.float32), np.full(3, 2, np.float32)
    path = str(tmp_path / "shared.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f["data/ip_a/0"], f["data/ip_a/1"], f["data/ip_b/1"] = weight, bias_a, bias_b
        f.create_group("data/data")
    net.copy_from(path)
    assert net.params["ip_b"][0] is net.params["ip_a"][0]
    assert_params_equal(net, {"ip_a": [weight, bias_a], "ip_b": [weight, bias_b]})


def test_hdf5_group_without_the_layers_blobs_is_an_error(tmp_path):
    net = caffe_hdf5_shared_net()
    path = str(tmp_path / "empty.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f.create_group("data/ip_a")
    with pytest.raises(WeightsError, match="ip_a"):
        net.copy_from(path)


# -- saving ---------------------------------------------------------------------------------------

SOURCES = {   # a fixture file, the prototxt it fits, and how to read its arrays independently
    "binary": (LENET_PROTO, LENET_MODEL, stored_blobs),
    "hdf5": (CIFAR_PROTO, CIFAR_H5, h5_blobs),
    "v1": (V1_PROTO, V1_MODEL, stored_blobs),
}


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_save_load_round_trip_is_bit_exact(tmp_path, source, suffix):
    prototxt, weights, read = SOURCES[source]
    net = syncsgd.Net(prototxt, syncsgd.TEST, weights=weights)
    path = str(tmp_path / ("saved" + suffix))
    net.save(path)
    fresh = syncsgd.Net(prototxt, syncsgd.TEST)
    assert not np.array_equal(fresh.params["conv1"][0].data, net.params["conv1"][0].data)
    fresh.copy_from(path)
    for name, blobs in net.params.items():
        for a, b in zip(blobs, fresh.params[name]):
            assert a.shape == b.shape and np.array_equal(a.data, b.data), name
    # What was written is the fixture's values, read back without syncsgd.
    written = h5_blobs(path) if suffix.endswith(".h5") else stored_blobs(path)
    original = read(weights)
    assert sorted(written) == sorted(original)
    for name, arrays in original.items():
        for a, b in zip(written[name], arrays):
            assert np.array_equal(a.ravel(), b.ravel()), name


def test_saved_binary_is_stable_and_canonical(tmp_path):
    net = syncsgd.Net(LENET_PROTO, syncsgd.TEST, weights=LENET_MODEL)
    first, second = tmp_path / "a.caffemodel", tmp_path / "b.caffemodel"
    net.save(str(first))
    net.save(str(second))
    data = first.read_bytes()
    assert data == second.read_bytes()
    param = pb.NetParameter()
    param.ParseFromString(data)
    assert param.SerializeToString() == data
    assert not param.layers, "saved in the current `layer` format"
    shapes = {layer.name: [tuple(b.shape.dim) for b in layer.blobs] for layer in param.layer}
    assert shapes["ip1"] == [(500, 800), (500,)] and shapes["conv1"] == [(20, 1, 5, 5), (20,)]
    # Loading the saved file and saving again writes the same bytes.
    again = syncsgd.Net(LENET_PROTO, syncsgd.TEST, weights=str(first))
    third = tmp_path / "c.caffemodel"
    again.save(str(third))
    assert third.read_bytes() == data


def test_saved_hdf5_has_caffes_layout(tmp_path):
    net = syncsgd.Net(CIFAR_PROTO, syncsgd.TEST, weights=CIFAR_MODEL)
    path = str(tmp_path / "w.caffemodel.h5")
    net.save(path)
    with h5py.File(path, "r") as f:
        assert list(f.keys()) == ["data"]
        assert sorted(f["data"].keys()) == sorted(net.layer_names)   # a group per layer
        for name, blobs in net.params.items():
            for i, blob in enumerate(blobs):
                ds = f[f"data/{name}/{i}"]
                assert ds.dtype == np.float32 and ds.shape == blob.shape


@pytest.mark.parametrize("source", ["binary", "hdf5", "v1"])
def test_file_saved_by_syncsgd_loads_in_opencv(tmp_path, source):
    """Also puts the HDF5 weights (which OpenCV cannot read) under the OpenCV oracle, and a V1
    net's weights saved in the current format."""
    prototxt, weights, _ = SOURCES[source]
    key = {"binary": "lenet", "hdf5": "cifar10_quick", "v1": "lenet_v1"}[source]
    _, _, batch, scale, blobs = PAIRS[key]
    net = syncsgd.Net(prototxt, syncsgd.TEST, weights=weights)
    saved = str(tmp_path / "saved.caffemodel")
    net.save(saved)
    x = random_input(net, batch, scale, seed=1)
    syncsgd_forward(net, x)
    assert_close_to_opencv(net, opencv_outputs(prototxt, saved, x, blobs))


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", [LENET_MODEL, V1_MODEL], ids=["current", "v1"])
def test_weights_for_another_net_name_layer_and_both_shapes(weights):
    net = small_net(num_output=7)
    with pytest.raises(WeightsError) as e:
        net.copy_from(weights)
    message = str(e.value)
    assert "ip1" in message and "500, 800" in message and "7, 784" in message


def test_blob_count_mismatch_is_an_error():
    net = small_net(num_output=500, bias_term=False)
    with pytest.raises(WeightsError, match="ip1"):
        net.copy_from(LENET_MODEL)


@pytest.mark.parametrize("prototxt,weights,name,words", [
    (LENET_PROTO, LENET_MODEL, "half.caffemodel", ("truncated", "corrupt")),
    (CIFAR_PROTO, CIFAR_H5, "half.caffemodel.h5", ("HDF5",)),
], ids=["binary", "hdf5"])
def test_truncated_weight_file(tmp_path, prototxt, weights, name, words):
    data = open(weights, "rb").read()
    path = tmp_path / name
    path.write_bytes(data[:len(data) // 2])
    net = syncsgd.Net(prototxt, syncsgd.TEST)
    with pytest.raises(WeightsError) as e:
        net.copy_from(str(path))
    assert str(path) in str(e.value)
    assert any(word in str(e.value) for word in words), str(e.value)


@pytest.mark.parametrize("content", [b"", b'name: "LeNet"\nlayer { name: "x" }\n'],
                         ids=["empty", "text"])
def test_files_that_are_not_weights(tmp_path, content):
    path = tmp_path / "bogus.caffemodel"
    path.write_bytes(content)
    with pytest.raises(WeightsError):
        syncsgd.Net(LENET_PROTO, syncsgd.TEST).copy_from(str(path))


@pytest.mark.parametrize("name", ["absent.caffemodel", "absent.caffemodel.h5"])
def test_missing_weight_file(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(WeightsError, match="absent"):
        syncsgd.Net(LENET_PROTO, syncsgd.TEST, weights=path)


def test_hdf5_without_data_group(tmp_path):
    path = str(tmp_path / "other.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("conv1/0", data=np.zeros((20, 1, 5, 5), np.float32))
    with pytest.raises(WeightsError, match="/data"):
        syncsgd.Net(LENET_PROTO, syncsgd.TEST).copy_from(path)


# -- mean images ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path,row_shape,channel_means", [
    (os.path.join(CIFAR_DIR, "mean.binaryproto"), (3, 32, 32), (125.3, 123.0, 113.9)),
    (os.path.join(WEIGHTS, "resnet-mean", "ResNet_mean.binaryproto"), (3, 224, 224),
     (103.1, 115.9, 123.2)),
], ids=["cifar10", "resnet"])
def test_mean_files(tmp_path, path, row_shape, channel_means):
    mean = load_mean(path)
    assert mean.dtype == np.float32 and mean.shape == (1,) + row_shape   # legacy 4-D, as stored
    row = fit_mean(mean, row_shape, path)
    assert row.shape == row_shape
    blob = pb.BlobProto()
    with open(path, "rb") as f:
        raw = f.read()
    blob.ParseFromString(raw)
    assert np.array_equal(row.ravel(), np.asarray(blob.data, np.float32))
    np.testing.assert_allclose(row.reshape(3, -1).mean(1), channel_means, atol=0.1)
    # Writing it back gives Caffe's own bytes.
    out = tmp_path / "mean.binaryproto"
    save_mean(str(out), row)
    assert out.read_bytes() == raw


# -- layer names ---------------------------------------------------------------------------------

# Names from real nets (GoogLeNet, SqueezeNet, MobileNet), one whose last part is all digits, and
# names HDF5 cannot hold as a group path: "." and empty parts, "fc/1" beside a layer "fc" whose
# blob 1 takes the path, a name shaped like the escape itself.
LAYER_NAMES = ["conv1/7x7_s2", "fire2/squeeze1x1", "conv2_1/dw", "fc/1", "fc", "a/b/c", "fc/1/x",
               "名 with spaces", ".", "x/./y", "/lead", "trail/", "a//b", "a%2Fb", "~", "%"]


def named_net(names):
    """A chain of InnerProduct layers, one per name, each with a weight and a bias."""
    param = pb.NetParameter(name="names")
    param.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(dim=[1, 3])
    bottom = "data"
    for i, name in enumerate(names):
        layer = param.layer.add(name=name, type="InnerProduct", bottom=[bottom], top=[f"t{i}"])
        layer.inner_product_param.num_output = 3
        layer.inner_product_param.weight_filler.type = "gaussian"
        layer.inner_product_param.bias_filler.type = "gaussian"
        bottom = f"t{i}"
    return syncsgd.Net(param, syncsgd.TEST)


class Records(list):
    """Messages syncsgd logs while in a `with` block."""

    def __enter__(self):
        import logging
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.append((record.levelname, record.getMessage()))
        self.logger = logging.getLogger("syncsgd")
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
def test_any_layer_name_round_trips(tmp_path, suffix):
    net = named_net(LAYER_NAMES)
    path = str(tmp_path / ("names" + suffix))
    net.save(path)
    fresh = named_net(LAYER_NAMES)
    with Records() as records:
        fresh.copy_from(path)
    assert not [r for r in records if r[0] != "INFO" or "Ignoring" in r[1]], records
    for name in LAYER_NAMES:
        for a, b in zip(net.params[name], fresh.params[name]):
            assert np.array_equal(a.data, b.data), name
            assert not np.array_equal(a.data, np.zeros_like(a.data)), name


def test_hdf5_names_with_slashes_are_caffes_nested_groups(tmp_path):
    """Caffe's ToHDF5 creates each layer's group with the layer name as its HDF5 path; where that
    path is valid it is read here as the nested groups HDF5 makes of it."""
    net = named_net(LAYER_NAMES)
    path = str(tmp_path / "names.caffemodel.h5")
    net.save(path)
    with h5py.File(path, "r") as f:
        for name in ["conv1/7x7_s2", "fire2/squeeze1x1", "conv2_1/dw", "fc", "a/b/c",
                     "名 with spaces"]:
            for i, blob in enumerate(net.params[name]):
                assert np.array_equal(f[f"data/{name}/{i}"][()], blob.data), name
        assert isinstance(f["data/fc/1"], h5py.Dataset)        # fc's bias; "fc/1" goes aside
        escaped = {f["data"][key].attrs["layer_name"]: key for key in f["data"]
                   if "layer_name" in f["data"][key].attrs}
        assert sorted(escaped) == sorted(["fc/1", "fc/1/x", ".", "x/./y", "/lead", "trail/",
                                          "a//b"])
        assert len(set(escaped.values())) == len(escaped)


def test_hdf5_written_like_caffe_with_nested_and_digit_names_loads(tmp_path):
    """The file Caffe writes when a prefix layer exists (BVLC/caffe#5905: `xxx` and `xxx/bn`),
    and a layer whose last name part is digits, each loaded with no layer left out."""
    names = ["xxx", "xxx/bn", "fc/1"]
    net = named_net(names)
    rng = np.random.default_rng(5)
    arrays = {name: [rng.standard_normal(b.shape).astype(np.float32) for b in net.params[name]]
              for name in names}
    path = str(tmp_path / "caffe.caffemodel.h5")
    with h5py.File(path, "w") as f:
        f.create_group("data/data")
        for name in names:
            for i, array in enumerate(arrays[name]):
                f[f"data/{name}/{i}"] = array
    with Records() as records:
        net.copy_from(path)
    assert records == []
    assert_params_equal(net, arrays)


def test_ignored_source_layers_and_kept_fillers_are_logged():
    """LeNet's weights into a net that has LeNet's conv1 and a new layer: Caffe's message for
    each source layer without a match, and the list of layers left at their fillers."""
    param = pb.NetParameter(name="partial")
    param.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(
        dim=[1, 1, 28, 28])
    conv = param.layer.add(name="conv1", type="Convolution", bottom=["data"], top=["conv1"])
    conv.convolution_param.MergeFrom(pb.ConvolutionParameter(num_output=20, kernel_size=[5]))
    param.layer.add(name="new_fc", type="InnerProduct", bottom=["conv1"],
                    top=["new_fc"]).inner_product_param.num_output = 4
    net = syncsgd.Net(param, syncsgd.TEST)
    with Records() as records:
        net.copy_from(LENET_MODEL)
    ignored = [m for level, m in records if m.startswith("Ignoring source layer ")]
    stored = pb.NetParameter()
    with open(LENET_MODEL, "rb") as f:
        stored.ParseFromString(f.read())
    assert ignored == [f"Ignoring source layer {layer.name}" for layer in stored.layer
                       if layer.name not in ("data", "conv1")]
    assert "Ignoring source layer mnist" in ignored      # layers without blobs, as Caffe says
    warnings = [m for level, m in records if level == "WARNING"]
    assert len(warnings) == 1 and warnings[0].endswith(": new_fc") and LENET_MODEL in warnings[0]
    assert_params_equal(net, {"conv1": stored_blobs(LENET_MODEL)["conv1"]}, exact_shapes=False)


@pytest.mark.parametrize("weights", [LENET_MODEL, CIFAR_H5], ids=["binary", "hdf5"])
def test_weights_matching_no_layer_are_an_error(weights):
    """The symptom was a uniform softmax: GoogLeNet weights loaded into AlexNet, all ignored."""
    net = named_net(["conv1/7x7_s2", "loss3/classifier"])
    before = net.params["loss3/classifier"][0].data.copy()
    with pytest.raises(WeightsError) as e:
        net.copy_from(weights)
    message = str(e.value)
    assert weights in message and "conv1/7x7_s2" in message and "another net" in message
    assert "conv1" in message.split("the file's:")[1]
    assert np.array_equal(net.params["loss3/classifier"][0].data, before)


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
def test_duplicate_layer_names_round_trip_under_their_new_names(tmp_path, suffix):
    """Caffe's ToHDF5 crashes on two layers of one name (BVLC/caffe#2885); syncsgd renames the
    second (fc_1), so both formats keep both layers' weights."""
    param = pb.NetParameter(name="duplicates")
    param.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(dim=[1, 3])
    for bottom, top in [("data", "t0"), ("t0", "t1")]:
        layer = param.layer.add(name="fc", type="InnerProduct", bottom=[bottom], top=[top])
        layer.inner_product_param.num_output = 3
        layer.inner_product_param.weight_filler.type = "gaussian"
    net = syncsgd.Net(param, syncsgd.TEST)
    assert net._layer_names == ["data", "fc", "fc_1"]
    path = str(tmp_path / f"dup{suffix}")
    net.save(path)
    fresh = syncsgd.Net(param, syncsgd.TEST)
    for blobs in fresh.params.values():
        blobs[0].data[...] = 0
    fresh.copy_from(path)
    assert_params_equal(fresh, {name: [b.data for b in blobs] for name, blobs in net.params.items()})


def test_hdf5_shared_parameter_is_written_under_its_owner_only(tmp_path):
    net = caffe_hdf5_shared_net()
    path = str(tmp_path / "shared.caffemodel.h5")
    net.save(path, write_diff=True)
    with h5py.File(path, "r") as f:
        assert sorted(f["data/ip_a"]) == ["0", "1"] and sorted(f["data/ip_b"]) == ["1"]
        assert sorted(f["diff/ip_b"]) == ["0", "1"]
    fresh = caffe_hdf5_shared_net()
    fresh.copy_from(path)
    assert_params_equal(fresh, {name: [b.data for b in blobs]
                                for name, blobs in net.params.items()})


@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (2, 3, 4, 5), (300, 7)])
def test_blob_pieces_equal_protobufs_own_encoding(shape):
    """The packed bytes syncsgd writes are those protobuf writes from a list of floats."""
    from syncsgd.weights import _blob_pieces
    rng = np.random.default_rng(7)
    data = rng.standard_normal(shape)                       # float64: rounded to float32
    diff = rng.standard_normal(shape).astype(np.float32)[..., ::-1]   # not contiguous
    reference = pb.BlobProto()
    reference.shape.dim.extend(shape)
    reference.data.extend(data.astype(np.float32).ravel().tolist())
    written = b"".join(bytes(piece) for piece in _blob_pieces(data))
    assert written == reference.SerializeToString()
    reference.diff.extend(diff.ravel().tolist())
    written = b"".join(bytes(piece) for piece in _blob_pieces(data, diff))
    assert written == reference.SerializeToString()


def protobuf_net_param(net, write_diff):
    """Caffe's Net::ToProto built with protobuf's own API, values as Python lists."""
    param = pb.NetParameter(name=net.name)
    for layer in net.layers:
        lp = param.layer.add()
        lp.CopyFrom(layer.param)
        del lp.blobs[:]
        for blob in layer.blobs:
            proto = lp.blobs.add()
            proto.shape.dim.extend(blob.shape)
            proto.data.extend(blob.data.ravel().tolist())
            if write_diff:
                proto.diff.extend(blob.diff.ravel().tolist())
    return param


@pytest.mark.parametrize("write_diff", [False, True])
def test_streamed_binary_equals_protobufs_serialization(tmp_path, write_diff):
    """The file written piece by piece is byte for byte what SerializeToString makes, for a net
    whose layers carry fields on both sides of `blobs` (include, params, parallel_param)."""
    text = LENET_TRAIN_LIKE
    (tmp_path / "net.prototxt").write_text(text)
    net = syncsgd.Net(str(tmp_path / "net.prototxt"), syncsgd.TRAIN)
    rng = np.random.default_rng(3)
    for blobs in net.params.values():
        for blob in blobs:
            blob.diff[...] = rng.standard_normal(blob.shape)
    path = tmp_path / "w.caffemodel"
    net.save(str(path), write_diff=write_diff)
    assert path.read_bytes() == protobuf_net_param(net, write_diff).SerializeToString()


LENET_TRAIN_LIKE = """name: "mixed"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 1 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        include { phase: TRAIN } propagate_down: false
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        parallel_param { mode: DATA }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 }
                              bias_filler { type: "constant" value: 0.5 } } }
layer { name: "scalar" type: "Parameter" top: "p" parameter_param { shape { } } }
"""


MEMORY_SCRIPT = """
import os, sys
import syncsgd
from syncsgd.solvers.snapshot import State, read_state, write_state

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def extra(action):
    '''Peak RSS above the RSS before `action`: VmHWM reset through clear_refs.'''
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    action()
    return status("VmHWM") - base

net = syncsgd.Net(sys.argv[1], syncsgd.TEST)
size = sum(b.data.nbytes for blobs in net.params.values() for b in blobs)
print("weights", size)
for suffix in (".caffemodel", ".caffemodel.h5"):
    path = os.path.join(os.path.dirname(sys.argv[1]), "big" + suffix)
    print(suffix, "save", extra(lambda: syncsgd.weights.save(net, path, checksum=True)))
    net.params["ip2"][0].data[...] = 0
    print(suffix, "load", extra(lambda: net.copy_from(path)))
    assert (net.params["ip2"][0].data == 0.25).all()
    os.remove(path)
arrays = [b.data for blobs in net.params.values() for b in blobs]
for suffix in (".solverstate", ".solverstate.h5"):
    path = os.path.join(os.path.dirname(sys.argv[1]), "big" + suffix)
    state = State(1, "big.caffemodel", 0, arrays)
    print(suffix, "save", extra(lambda: write_state(path, state, checksum=True)))
    arrays[2][...] = 0                      # ip2's weights
    print(suffix, "load", extra(lambda: [stored.read_into(target.reshape(-1)) for stored, target
                                         in zip(read_state(path).history, arrays)]))
    assert (net.params["ip2"][0].data == 0.25).all()
    os.remove(path)
"""

BIG_NET = """name: "big"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1000 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 10000 weight_filler { type: "constant" value: 0.5 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4000 weight_filler { type: "constant" value: 0.25 } } }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        inner_product_param { num_output: 7500 weight_filler { type: "constant" value: 0.125 } } }
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs /proc/self/clear_refs to reset the peak RSS (Linux)")
def test_saving_and_loading_80m_parameters_needs_no_copy_of_them(tmp_path):
    """Both weight formats, with a checksum record as snapshots have, and solver states (both
    formats) holding as much: the peak RSS while writing and while reading stays within a
    quarter of the weights' size above what the process held."""
    import subprocess
    import sys
    (tmp_path / "big.prototxt").write_text(BIG_NET)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "big.prototxt")],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=root))
    assert result.returncode == 0, result.stderr
    figures = dict((" ".join(line.split()[:-1]), int(line.split()[-1]))
                   for line in result.stdout.splitlines())
    size = figures.pop("weights")
    assert size == 4 * (1000 * 10000 + 10000 * 4000 + 4000 * 7500 + 10000 + 4000 + 7500)
    assert len(figures) == 8
    for what, extra in figures.items():
        assert extra <= 0.25 * size, f"{what}: {extra / 2**20:.0f} MB above the baseline"


def test_streamed_solver_state_equals_protobufs_serialization(tmp_path):
    from syncsgd.solvers.snapshot import State, read_state, write_state
    rng = np.random.default_rng(5)
    history = [rng.standard_normal(shape).astype(np.float32) for shape in [(3, 4), (0,), (7,)]]
    path = str(tmp_path / "s.solverstate")
    write_state(path, State(12, "net_iter_12.caffemodel", 2, history, "ab" * 32))
    reference = pb.SolverState(iter=12, learned_net="net_iter_12.caffemodel", current_step=2,
                               learned_net_sha256="ab" * 32)
    for array in history:
        blob = reference.history.add()
        blob.shape.dim.extend(array.shape)
        blob.data.extend(array.ravel().tolist())
    assert open(path, "rb").read() == reference.SerializeToString()
    state = read_state(path)
    assert [(b.shape, b.legacy, b.values().tolist()) for b in state.history] == \
        [(a.shape, False, a.ravel().tolist()) for a in history]


def test_binary_files_beyond_protobufs_limit_are_refused_before_writing(tmp_path, monkeypatch):
    from syncsgd import weights
    from syncsgd.solvers.snapshot import State, write_state
    net = syncsgd.Net(LENET_PROTO, syncsgd.TEST)
    monkeypatch.setattr(weights, "PROTOBUF_LIMIT", 4 * 1000)
    for path, write in [(tmp_path / "w.caffemodel", lambda p: net.save(p)),
                        (tmp_path / "s.solverstate",
                         lambda p: write_state(p, State(0, "", 0, [np.zeros(1001, np.float32)])))]:
        with pytest.raises(WeightsError, match="larger than the 4000 bytes a protobuf may have"):
            write(str(path))
        assert not os.listdir(tmp_path)
    net.save(str(tmp_path / "w.caffemodel.h5"))
