"""What pycaffe promises its users beyond BVLC's own tests (tests/bvlc_pycaffe): a net ending in an
in-place layer has that blob as its output, set_random_seed makes nets and solvers repeatable, and
parameters at lr_mult 0 get no gradient (Caffe's param_propagate_down) in every layer that has
parameters."""
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TEST, TRAIN, context
from syncsgd.net import Net
from syncsgd.proto import pb


def parse(text):
    return text_format.Parse(text, pb.NetParameter())


FEATURES = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "fc6" type: "InnerProduct" bottom: "data" top: "fc6"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
"""


def test_a_blob_an_in_place_layer_produces_last_is_an_output():
    net = Net(parse(FEATURES), TEST)
    assert net.outputs == ["fc6"]
    net.blobs["data"].data[...] = np.arange(10).reshape(2, 5) - 4.5
    out = net.forward()
    assert list(out) == ["fc6"] and out["fc6"].min() >= 0 and out["fc6"].max() > 0


@pytest.fixture
def seed_reset(monkeypatch):
    monkeypatch.setitem(context._RANDOM_SEED, "seed", None)


DRAWN = """
layer { name: "data" type: "DummyData" top: "data"
        dummy_data_param { shape { dim: 4 dim: 6 } data_filler { type: "gaussian" } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" }
"""


def drawn(seed):
    if seed is not None:
        syncsgd.set_random_seed(seed)
    net = Net(parse(DRAWN), TRAIN)
    out = net.forward()["fc"].copy()
    return net.params["fc"][0].data.copy(), net.blobs["data"].data.copy(), out


def test_set_random_seed_seeds_fillers_data_and_dropout(seed_reset):
    first, again, other = drawn(5), drawn(5), drawn(6)
    for a, b, c in zip(first, again, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


def test_set_random_seed_seeds_a_solver_without_its_own(seed_reset, tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(DRAWN + """
        layer { name: "data2" type: "DummyData" top: "data2"
                dummy_data_param { shape { dim: 4 dim: 3 } } }
        layer { name: "loss" type: "EuclideanLoss" bottom: "fc" bottom: "data2" top: "loss" }""")
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}" base_lr: 0.1 lr_policy: "fixed" max_iter: 3 '
                      'snapshot_after_train: false')
    weights = []
    for _ in range(2):
        syncsgd.set_random_seed(11)
        s = syncsgd.get_solver(str(solver))
        assert s.seed == 11
        s.step(3)
        weights.append(s.net.params["fc"][0].data.copy())
        s.close()
    np.testing.assert_array_equal(*weights)


# One net per layer type with parameters: (the layer's text, its bottom shapes).
WITH_PARAMS = {
    "InnerProduct": ('type: "InnerProduct" inner_product_param { num_output: 3 '
                     'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" } }',
                     [(2, 4)]),
    "Convolution": ('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 '
                    'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" } }',
                    [(2, 2, 5, 5)]),
    "ConvolutionCaffe": ('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 '
                         'engine: CAFFE weight_filler { type: "gaussian" std: 1 } '
                         'bias_filler { type: "gaussian" } }', [(2, 2, 5, 5)]),
    "Deconvolution": ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 2 '
                      'stride: 2 weight_filler { type: "gaussian" std: 1 } '
                      'bias_filler { type: "gaussian" } }', [(2, 2, 3, 3)]),
    "Scale": ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
              'bias_filler { type: "gaussian" } }', [(2, 3, 4)]),
    "Bias": ('type: "Bias" bias_param { filler { type: "gaussian" } }', [(2, 3, 4)]),
    "PReLU": ('type: "PReLU" prelu_param { filler { type: "constant" value: 0.3 } }',
              [(2, 3, 4)]),
    "Embed": ('type: "Embed" propagate_down: false embed_param { input_dim: 5 num_output: 3 '
              'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }', [(4,)]),
    "Normalize": ('type: "Normalize" norm_param { channel_shared: false '
                  'scale_filler { type: "constant" value: 2 } }', [(2, 3, 4, 4)]),
    "Parameter": ('type: "Parameter" parameter_param { shape { dim: 3 dim: 4 } }', []),
}


def layer_net(kind, lr_mults):
    """The layer under test, its bottoms made by Parameter layers (so that they need backward
    without force_backward, which would make every parameter learn), its top a loss."""
    text, shapes = WITH_PARAMS[kind]
    sources = "".join(
        f'layer {{ name: "src{i}" type: "Parameter" top: "in{i}" parameter_param {{ shape {{ '
        + " ".join(f"dim: {d}" for d in shape) + " } } }\n" for i, shape in enumerate(shapes))
    bottoms = " ".join(f'bottom: "in{i}"' for i in range(len(shapes)))
    params = " ".join(f"param {{ lr_mult: {m} }}" for m in lr_mults)
    net = Net(parse(f'{sources}layer {{ name: "l" {bottoms} top: "out" loss_weight: 1 '
                    f'{params} {text} }}'), TRAIN)
    rng = np.random.default_rng(3)
    for i, shape in enumerate(shapes):
        values = rng.integers(0, 5, shape) if kind == "Embed" else rng.standard_normal(shape)
        net.params[f"src{i}"][0].data[...] = values
    return net


@pytest.mark.parametrize("kind", sorted(WITH_PARAMS))
def test_no_gradient_for_parameters_at_lr_mult_0(kind):
    """Each parameter alone at lr_mult 0: its diff keeps what it held, the others get the
    gradient they get when every parameter learns."""
    learning = layer_net(kind, [])
    count = len(learning.params["l"])
    dy = np.random.default_rng(4).standard_normal(learning.blobs["out"].shape)
    learning.forward()
    learning.clear_param_diffs()
    learning.backward(out=dy)
    for frozen in range(count):
        net = layer_net(kind, [0 if k == frozen else 1 for k in range(count)])
        net.forward()
        for blob in net.params["l"]:
            blob.diff[...] = 7
        net.backward(out=dy)
        for k, (blob, want) in enumerate(zip(net.params["l"], learning.params["l"])):
            if k == frozen:
                np.testing.assert_array_equal(blob.diff, 7, err_msg=f"{kind} blob {k}")
            else:
                np.testing.assert_allclose(blob.diff - 7, want.diff, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{kind} blob {k}")


BACKWARD_FLAGS = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 4 } shape { dim: 2 } } }
layer { name: "src" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" propagate_down: true
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "sum" type: "Eltwise" bottom: "ip" bottom: "p" top: "sum"
        propagate_down: true propagate_down: false }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "sum" bottom: "label" top: "loss" }
"""


def test_backward_flags_follow_caffes_net_init():
    """propagate_down, where given, decides for its bottom (Caffe's AppendBottom): true sends a
    gradient to `data`, which nothing else would; false on `p` leaves the Parameter layer that
    makes it with no backward at all, though its weight learns (every top skipped)."""
    net = Net(parse(BACKWARD_FLAGS), TRAIN)
    flags = dict(zip(net.layer_names, net.bottom_need_backward))
    needs = dict(zip(net.layer_names, net.layer_need_backward))
    assert flags["ip"] == [True] and flags["sum"] == [True, False]
    assert needs["ip"] and not needs["src"]
    net.blobs["data"].data[...] = 1
    net.forward_backward()
    assert np.any(net.blobs["data"].diff)
    forced = Net(parse("force_backward: true\n" + BACKWARD_FLAGS), TRAIN)
    assert dict(zip(forced.layer_names, forced.layer_need_backward))["src"]
