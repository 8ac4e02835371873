"""Lazily cleared parameter gradients (Blob.clear_diff, Net.clear_param_diffs): the layers that
compute a gradient write it over a cleared diff instead of adding it to zeros, and every other
reader finds zeros, so a pass gives the gradients a pass after an explicit zero fill gives."""
import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN
from syncsgd.blob import Blob
from syncsgd.kernels import onednn, threads
from syncsgd.net import Net
from syncsgd.proto import pb

# Convolutions on oneDNN (padded) and on GEMMs (engine CAFFE), fully connected layers of which
# two share their weights by name, and a first layer without an image gradient.
NET = """
name: "cleared"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 10 dim: 10 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 3 engine: CAFFE
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv2" top: "ip1"
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.1 }
                              bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "sig" type: "Sigmoid" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { name: "shared_w" } param { name: "shared_b" }
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        param { name: "shared_w" } param { name: "shared_b" }
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip4" type: "InnerProduct" bottom: "ip3" top: "ip4"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip4" bottom: "label" top: "loss" }
"""


def make_net(monkeypatch, lanes):
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    net = Net(text_format.Parse(NET, pb.NetParameter()), TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 5, 8)
    return net


def gradients(net):
    return [info.blob.diff.copy() for info in net.learnable_params]


def garbage(net):
    """Values a lazily cleared diff must never add to (what an update left there, say)."""
    for info in net.learnable_params:
        info.blob.diff[...] = 1e3


def test_blob_clear_diff_reads_as_zeros_and_hands_beta_zero_once():
    blob = Blob((3, 4))
    blob.diff[...] = 7
    blob.clear_diff()
    assert np.all(blob.array(1) == 7)          # not written yet
    diff, beta = blob.gradient_target()
    assert beta == 0.0 and diff is blob.array(1)
    diff[...] = 2                               # the kernel writes every element
    assert blob.gradient_target()[1] == 1.0     # then the next one adds
    np.testing.assert_array_equal(blob.diff, 2)
    blob.clear_diff()
    np.testing.assert_array_equal(blob.diff, 0)  # any other reader finds zeros
    assert blob.gradient_target()[1] == 1.0
    blob.clear_diff()
    blob.overwrite(1)[...] = 3                  # written whole by a layer: no longer cleared
    np.testing.assert_array_equal(blob.diff, 3)
    blob.clear_diff()
    blob.diff = np.full((3, 4), 5, np.float32)  # a new array is what it holds
    np.testing.assert_array_equal(blob.diff, 5)


def test_a_cleared_blob_pickles_as_zeros():
    import pickle
    blob = Blob((2, 2))
    blob.diff[...] = 4
    blob.clear_diff()
    copy = pickle.loads(pickle.dumps(blob))
    np.testing.assert_array_equal(copy.diff, 0)
    assert copy.gradient_target()[1] == 1.0


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("passes", [1, 2])
def test_gradients_after_a_lazy_clear_equal_those_after_a_zero_fill(monkeypatch, lanes, passes):
    """clear_param_diffs on diffs holding garbage, then `passes` forward/backward passes (the
    second adds to the first, as iter_size does), give the gradients of an explicit zero fill:
    oneDNN's and the GEMM kernels' weight and bias gradients, weights shared by two layers
    (the first of them to run overwrites, the second adds) and lanes (two threads)."""
    with threads.limited_budget(2):
        reference = make_net(monkeypatch, lanes)
        for info in reference.learnable_params:
            info.blob.diff[...] = 0
        for _ in range(passes):
            reference.forward()
            reference.backward()
        net = make_net(monkeypatch, lanes)
        net.forward()             # a pass first: the lanes are built (from the diffs as they
        net.backward()            # are) before the clear
        garbage(net)
        net.clear_param_diffs()
        for _ in range(passes):
            net.forward()
            assert (net.lanes.engaged is not None) == lanes
            net.backward()
    assert net.layers[1].plan.weight_grad == ("onednn" if onednn.available() else "columns")
    for want, got in zip(gradients(reference), gradients(net)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_cleared_gradient_no_layer_wrote_reads_as_zeros(monkeypatch):
    """A cleared diff that no backward pass has written since reads as zeros, not as what it
    held."""
    net = make_net(monkeypatch, False)
    garbage(net)
    net.clear_param_diffs()
    for blob in net.params["ip4"]:
        np.testing.assert_array_equal(blob.diff, 0)
