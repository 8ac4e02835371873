"""Parameter gradients cleared lazily inside the solver's step (Blob.clear_diff,
Net.forward_backward(clear=True)): the layers that compute a gradient write it over a cleared
diff instead of adding it to zeros, every other reader finds zeros, and by the end of the pass
every array holds its values, so a pass gives the gradients a pass after an explicit zero fill
gives. Outside the step pycaffe's contract holds: clear_param_diffs zeroes the arrays users
hold, and parameters at lr_mult 0 get no gradient (Caffe's param_propagate_down)."""
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
    """A pass that clears lazily on diffs holding garbage, then `passes` - 1 passes more (which
    add to it, as iter_size does), gives the gradients of an explicit zero fill: oneDNN's and
    the GEMM kernels' weight and bias gradients, weights shared by two layers (the first of
    them to run overwrites, the second adds) and lanes (two threads)."""
    with threads.limited_budget(2):
        reference = make_net(monkeypatch, lanes)
        reference.clear_param_diffs()
        for _ in range(passes):
            reference.forward_backward()
        net = make_net(monkeypatch, lanes)
        net.forward_backward()    # a pass first: the lanes are built before the clear
        garbage(net)
        for k in range(passes):
            net.forward_backward(clear=k == 0)
            assert (net.lanes.engaged is not None) == lanes
    assert net.layers[1].plan.weight_grad == ("onednn" if onednn.available() else "columns")
    for want, got in zip(gradients(reference), gradients(net)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_clear_param_diffs_zeroes_the_arrays_users_hold(monkeypatch):
    """pycaffe's test_clear_param_diffs: an array taken before the clear reads zeros after it."""
    net = make_net(monkeypatch, False)
    net.forward_backward()
    held = [info.blob.diff for info in net.learnable_params]
    assert all(np.any(d) for d in held)
    net.clear_param_diffs()
    assert all(not np.any(d) for d in held)


@pytest.mark.parametrize("lanes", [False, True])
def test_a_lazy_clear_leaves_no_diff_cleared_after_the_pass(monkeypatch, lanes):
    """Inside the pass a diff nothing writes (conv1's at lr_mult 0) is zeroed in its array by the
    time its layer's backward hooks run (the reducer sends the arrays as they are), and after
    the pass no diff is left cleared: an array a user holds is the gradient."""
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    param = text_format.Parse(NET, pb.NetParameter())
    for _ in range(2):
        param.layer[1].param.add(lr_mult=0)
    with threads.limited_budget(2):
        net = Net(param, TRAIN)
        net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((8, 3, 10, 10))
        garbage(net)
        held = [info.blob.diff for info in net.learnable_params]
        seen = {}
        conv1 = net.layer_names.index("conv1")
        net.backward_hooks.append(lambda i: i == conv1 and seen.update(
            conv1=[b.array(1).copy() for b in net.layers[conv1].blobs]))
        net.forward_backward(clear=True)
    assert all(not np.any(d) for d in seen["conv1"])
    assert not any(info.blob.cleared for info in net.learnable_params)
    for info, array in zip(net.learnable_params, held):
        assert array is info.blob.array(1)
        frozen = info.layer_name == "conv1"
        assert np.any(array) != frozen and np.all(np.abs(array) < 1e3)


@pytest.mark.parametrize("frozen", [{"conv1": (0, 0), "conv2": (0, 0), "ip1": (1, 0)},
                                    {"conv1": (0, 1), "conv2": (1, 0), "ip1": (0, 1)},
                                    {"conv1": (1, 0), "conv2": (0, 1)}])
@pytest.mark.parametrize("lanes", [False, True])
def test_parameters_at_lr_mult_0_get_no_gradient(monkeypatch, lanes, frozen):
    """Caffe's param_propagate_down: a backward leaves the diff of a parameter at lr_mult 0
    as it was (here: garbage), for oneDNN's convolution (conv1), the GEMM one (conv2) and a
    fully connected layer (ip1), weights or bias alone or both, and the others' gradients are
    unchanged."""
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    with threads.limited_budget(2):
        reference = make_net(monkeypatch, lanes)
        reference.clear_param_diffs()
        reference.forward_backward()
        param = text_format.Parse(NET, pb.NetParameter())
        for layer in param.layer:
            for mult in frozen.get(layer.name, ()):
                layer.param.add(lr_mult=mult)
        net = Net(param, TRAIN)
        net.blobs["data"].data[...] = reference.blobs["data"].data
        net.blobs["label"].data[...] = reference.blobs["label"].data
        net.clear_param_diffs()
        for name in frozen:
            for blob, mult in zip(net.params[name], frozen[name]):
                if not mult:
                    blob.diff[...] = 1e3
        net.forward_backward()
        assert (net.lanes.engaged is not None) == lanes
    for name, blobs in net.params.items():
        for k, (blob, want) in enumerate(zip(blobs, reference.params[name])):
            if k < len(frozen.get(name, ())) and not frozen[name][k]:
                np.testing.assert_array_equal(blob.diff, 1e3)
            else:
                np.testing.assert_allclose(blob.diff, want.diff, rtol=1e-5, atol=1e-6)
