"""Layers that do the next layer's work (Layer.absorb, Net._fuse): a BatchNorm with batch
statistics and the Scale in place after it, as in every ResNet block, compute what the two
compute apart (SYNCSGD_FUSE=0), values, gradients and statistics, in whole and partial passes;
where the compiled passes run (kernels/batch_stats.py) the BatchNorm also does the ReLU's work,
and those passes compute what numpy's do (SYNCSGD_NUMBA=0). An Eltwise SUM does the forward of
the ReLU in place after it."""
import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN
from syncsgd.net import Net
from syncsgd.proto import pb

NET = """
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 3 dim: 9 dim: 9 } shape { dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "scale1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "conv2" type: "Convolution" bottom: "c1" top: "c2"
        convolution_param { num_output: 4 kernel_size: 3 bias_term: false
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "c2" top: "c2" }
layer { name: "scale2" type: "Scale" bottom: "c2" top: "c2" }
layer { name: "c2s" type: "Split" bottom: "c2" top: "c2a" top: "c2b" }
layer { name: "sum" type: "Eltwise" bottom: "c2a" bottom: "c2b" top: "sum"
        eltwise_param { coeff: 1 coeff: -0.5 } }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def make_net(monkeypatch, fuse, numba=True, text=NET, lanes=False):
    monkeypatch.setenv("SYNCSGD_FUSE", "1" if fuse else "0")
    monkeypatch.setenv("SYNCSGD_NUMBA", "1" if numba else "0")
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    net = Net(text_format.Parse(text, pb.NetParameter()), TRAIN)
    rng = np.random.default_rng(4)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape) + 0.5
    net.blobs["label"].data[...] = rng.integers(0, 3, 6)
    for name in [n for n in ("scale1", "scale2") if n in net.layer_dict]:
        for blob in net.layer_dict[name].blobs:      # learned values away from 1 and 0
            blob.data[...] = rng.uniform(0.5, 2.0, blob.shape) * rng.choice([-1, 1], blob.shape)
    return net


def state(net):
    out = {f"{name}.data": b.data.copy() for name, b in net.blobs.items()}
    out.update({f"{name}.diff": b.diff.copy() for name, b in net.blobs.items()})
    for layer in net.layers:
        for k, blob in enumerate(layer.blobs):
            out[f"{layer.name}[{k}].data"] = blob.data.copy()
            out[f"{layer.name}[{k}].diff"] = blob.diff.copy()
    return out


def assert_same_passes(a, b, passes=3):
    """Forward and backward passes of nets a and b in turns: the same bits in every blob and
    parameter after each."""
    for _ in range(passes):
        for net in (a, b):
            net.forward()
            net.backward()
        state_a, state_b = state(a), state(b)
        for key in state_a:
            np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)


def assert_state_close(a, b):
    assert a.keys() == b.keys()
    for key in a:
        scale = max(float(np.abs(a[key]).max()), 1e-3)
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=2e-5 * scale, err_msg=key)


def fused_pairs(net):
    return sorted(net.layer_names[i] for i in net._fusions)


def test_fused_pairs_are_the_batch_norms_and_their_scales(monkeypatch):
    assert fused_pairs(make_net(monkeypatch, fuse=True)) == ["bn1", "bn2", "scale1", "sum"]
    assert fused_pairs(make_net(monkeypatch, fuse=True, numba=False)) == ["bn1", "bn2", "sum"]
    assert make_net(monkeypatch, fuse=False)._fusions == {}


def test_compiled_passes_compute_what_numpys_compute(monkeypatch):
    nets = [make_net(monkeypatch, fuse=True, numba=n) for n in (False, True)]
    for _ in range(2):
        for net in nets:
            net.forward()
            net.backward()
        assert_state_close(*[state(net) for net in nets])
    assert nets[1].layer_dict["bn1"].relu_folded(backward=True)      # folded in both ways
    assert not nets[0].layer_dict["bn1"].compiled
    assert nets[1].layer_dict["sum"].relu_folded()


@pytest.mark.parametrize("alone", [True, False])
def test_batch_norm_writes_beside_x_as_it_writes_over_it(monkeypatch, alone):
    """The compiled BatchNorm in place writes its output to an array the blob takes in exchange
    for x, which backward reads (Blob.exchange_data), and over x where the blob cannot
    exchange (lanes view it): the same bits either way, pass after pass, in blocks of
    channels on one process or in two passes as on several."""
    beside, over = make_net(monkeypatch, fuse=True), make_net(monkeypatch, fuse=True)
    for layer in beside.layers + over.layers:
        if not alone:
            layer.ctx.alone = lambda: False
    for name in ("c1", "c2"):
        over.blobs[name].exchange_data = lambda array: None
    for _ in range(3):
        arrays = [beside.blobs[name].array(0) for name in ("c1", "c2")]
        for net in (beside, over):
            net.forward()
            net.backward()
        assert all(beside.blobs[name].array(0) is not a for name, a in zip(("c1", "c2"), arrays))
        a, b = state(beside), state(over)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert beside.layer_dict["bn1"].relu_folded(backward=True)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("text", ["NET", "SHORTCUTS"])
def test_one_process_takes_blocks_of_channels_with_the_two_passes_bits(monkeypatch, fuse,
                                                                         text):
    """On one process (ctx.alone) the compiled BatchNorm takes each block of channels through
    its sums and then its output, or gradient, while it is in the cache: the bits of the
    two passes with the sums between, as several ranks take them, pass after pass, with the
    Scale and the ReLU folded in or apart."""
    from syncsgd.kernels import batch_stats
    ran = []
    for name in ("normalise_channels", "gradient_channels"):
        monkeypatch.setattr(batch_stats, name, lambda *args, kernel=getattr(batch_stats, name):
                            ran.append(kernel.__name__) or kernel(*args))
    blocks, passes = (make_net(monkeypatch, fuse=fuse, text=globals()[text]) for _ in range(2))
    for layer in passes.layers:
        layer.ctx.alone = lambda: False
    assert_same_passes(blocks, passes)
    counts = [len(blocks.layer_dict[name]._rows._channel_blocks) for name in ("bn1", "bn2")]
    assert min(counts) > 1
    # Three passes, forward and backward, of every block of channels of bn1 and bn2.
    assert len(ran) == 3 * 2 * sum(counts)


def test_fused_passes_compute_what_the_layers_compute_apart(monkeypatch):
    apart, fused = make_net(monkeypatch, fuse=False), make_net(monkeypatch, fuse=True)
    for net in (apart, fused):
        for layer in net.layers:
            for blob in layer.blobs:
                blob.diff[...] = 0.25      # gradients add into what the diffs hold
    for _ in range(2):
        for net in (apart, fused):
            net.forward()
            net.backward()
        assert_state_close(state(apart), state(fused))
    assert fused.layer_dict["scale1"]._from_leader       # the fused path really ran
    grads = fused.layer_dict["scale1"].blobs[0].diff
    assert np.abs(grads - 0.5).max() > 1e-3


def test_a_pass_ending_between_the_two_leaves_x_norm(monkeypatch):
    net = make_net(monkeypatch, fuse=True)
    net.forward(end="bn1")
    x = net.blobs["c1"].data
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(x.var(axis=(0, 2, 3)), 1, rtol=1e-3)
    apart = make_net(monkeypatch, fuse=False)
    apart.forward(end="bn1")
    np.testing.assert_allclose(x, apart.blobs["c1"].data, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start, end", [("scale1", "conv1"), ("relu1", "bn1"),
                                        ("scale1", "scale1"), ("bn1", "conv1"),
                                        ("relu1", "scale1"), ("relu1", "relu1")])
def test_partial_backward_passes_match(monkeypatch, start, end):
    nets = [make_net(monkeypatch, fuse=f) for f in (False, True)]
    rng = np.random.default_rng(9)
    dy = rng.standard_normal(nets[0].blobs["c1"].shape).astype(np.float32)
    assert_state_close(*partial_backward_states(nets, {"c1": dy}, start, end))


def partial_backward_states(nets, diffs, start, end):
    """Each net's state after a whole pass, then `diffs` ({blob name: array}) written, the
    parameters' diffs cleared and a backward pass from `start` to `end`."""
    results = []
    for net in nets:
        net.forward()
        net.backward()                       # every diff written once
        for name, value in diffs.items():
            net.blobs[name].diff[...] = value
        for layer in net.layers:
            for blob in layer.blobs:
                blob.diff[...] = 0
        net.backward(start=start, end=end)
        results.append(state(net))
    return results


@pytest.mark.parametrize("start, end", [(None, "scale1"), ("scale1", "relu1"),
                                        ("relu1", None), ("bn1", "relu1"), (None, "sum"),
                                        ("relu2", None), ("sum", "relu2")])
def test_partial_forward_passes_match(monkeypatch, start, end):
    """After a whole pass, a partial one (its layers work on what the last left in place)."""
    nets = [make_net(monkeypatch, fuse=f) for f in (False, True)]
    for net in nets:
        net.forward()
        net.forward(start=start, end=end)
    assert_state_close(*[state(net) for net in nets])


def test_fused_passes_after_a_new_batch_size(monkeypatch):
    apart, fused = make_net(monkeypatch, fuse=False), make_net(monkeypatch, fuse=True)
    rng = np.random.default_rng(11)
    data = rng.standard_normal((4, 3, 9, 9)).astype(np.float32)
    for net in (apart, fused):
        net.forward()
        net.backward()
        net.blobs["data"].reshape(4, 3, 9, 9)
        net.blobs["label"].reshape(4)
        net.reshape()
        net.blobs["data"].data[...] = data
        net.blobs["label"].data[...] = [0, 1, 2, 1]
        net.forward()
        net.backward()
    assert fused.blobs["c1"].shape[0] == 4
    assert_state_close(state(apart), state(fused))


# The Eltwise's sum of two with coefficients 1 (every ResNet shortcut) runs the compiled
# clamped sum; a Power in place after relu1 changes its top between its forward and backward.
VARIANTS = {
    "unit coefficients": NET.replace("eltwise_param { coeff: 1 coeff: -0.5 }", ""),
    "a layer in place after the ReLU": NET.replace(
        'layer { name: "conv2"',
        'layer { name: "shift" type: "Power" bottom: "c1" top: "c1" '
        'power_param { shift: -0.5 } }\nlayer { name: "conv2"'),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_compute_what_the_layers_compute_apart(monkeypatch, variant):
    text = VARIANTS[variant]
    nets = [make_net(monkeypatch, fuse=False, numba=False, text=text),
            make_net(monkeypatch, fuse=True, text=text)]
    for _ in range(2):
        for net in nets:
            net.forward()
            net.backward()
        assert_state_close(*[state(net) for net in nets])
    folded = nets[1].layer_dict["bn1"].relu_folded()
    assert folded == (variant == "unit coefficients")    # not under a later in-place layer


def test_a_layer_without_tops_after_a_scale(monkeypatch):
    text = NET.replace('layer { name: "conv2"',
                       'layer { name: "quiet" type: "Silence" bottom: "c1" }\n'
                       'layer { name: "conv2"')
    text = text.replace('layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" }\n', "")
    net = make_net(monkeypatch, fuse=True, text=text)
    assert "bn1" in fused_pairs(net)
    net.forward()


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_an_infinite_gradient_where_the_relu_is_off_gives_nan(monkeypatch):
    """As the ReLU's dy * (y > 0): inf * 0 is NaN, on every path."""
    results = []
    for fuse, numba in [(False, False), (True, True)]:
        net = make_net(monkeypatch, fuse=fuse, numba=numba)
        net.forward()
        net.backward()                               # every diff written once
        c1 = net.blobs["c1"]
        off = np.argwhere(c1.data <= 0)[0]
        dy = np.zeros(c1.shape, np.float32)
        dy[tuple(off)] = np.inf
        c1.diff[...] = dy
        net.backward(start="relu1", end="bn1")
        results.append(np.isfinite(c1.diff).all())
    assert results == [False, False]


# Two ResNet blocks' shortcuts: relu1 (folded into bn1's passes) and relu2 (after the Eltwise)
# each feed two consumers, through the Splits the net inserts, which the ReLUs absorb.
SHORTCUTS = NET[:NET.index('layer { name: "conv2"')] + """
layer { name: "conv2" type: "Convolution" bottom: "c1" top: "c2"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "c2" top: "c2" }
layer { name: "scale2" type: "Scale" bottom: "c2" top: "c2" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "conv3" type: "Convolution" bottom: "sum" top: "c3"
        convolution_param { num_output: 5 kernel_size: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "sum2" type: "Eltwise" bottom: "sum" bottom: "c3" top: "sum2" }
layer { name: "ip" type: "InnerProduct" bottom: "sum2" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


SPLIT_OF_RELU2 = "sum_relu2_0_split"


@pytest.mark.parametrize("shape", [(16,), (16, 1), (16, 1, 2, 3), (9, 2), (8, 5, 3, 1)])
def test_one_process_sums_the_samples_in_the_two_passes_order(monkeypatch, shape):
    """The channel totals add the samples in order on both paths: numpy's sum over the samples
    axis goes pairwise for one channel and 8 samples or more, which values far apart (1e16
    beside 1) tell apart. A BatchNorm on 1 axis, and on 2 and 4 with its Scale and ReLU."""
    text = f"""
    layer {{ name: "in" type: "Input" top: "x"
             input_param {{ shape {{ {" ".join(f"dim: {d}" for d in shape)} }} }} }}
    layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "x" }}
    force_backward: true"""
    if len(shape) > 1:
        text += """
        layer { name: "scale" type: "Scale" bottom: "x" top: "x" scale_param { bias_term: true } }
        layer { name: "relu" type: "ReLU" bottom: "x" top: "x" }"""
    monkeypatch.setenv("SYNCSGD_NUMBA", "1")
    nets = [Net(text_format.Parse(text, pb.NetParameter()), TRAIN) for _ in range(2)]
    for layer in nets[1].layers:
        layer.ctx.alone = lambda: False
    assert nets[0].layer_dict["bn"].compiled
    x = np.ones(shape, np.float32)
    x[0], x[min(8, shape[0] - 1)] = 1e16, -1e16
    rng = np.random.default_rng(2)
    dy = rng.standard_normal(shape).astype(np.float32)
    for net in nets:
        net.blobs["x"].data[...] = x
        for blob in net.layer_dict["scale"].blobs[:1] if len(shape) > 1 else []:
            blob.data[...] = 1.5
        net.forward()
        net.backward(x=dy)
    a, b = state(nets[0]), state(nets[1])
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_an_identity_shortcut_shares_the_sums_gradient(monkeypatch):
    """Eltwise SUM hands a bottom with coefficient 1 that no layer runs in place on (a split
    shortcut, a convolution's top) the top's diff itself (Blob.share_diff), and copies it for
    the bottom a BatchNorm and Scale run in place on: the same bits as copies, pass after
    pass."""
    shared, copied = (make_net(monkeypatch, fuse=True, text=SHORTCUTS) for _ in range(2))
    shortcut, branch = shared.bottom_names["sum"]
    assert shared.layer_dict["sum"].bottoms_kept == [True, False]
    assert shared.layer_dict["sum2"].bottoms_kept == [True, True]
    for name in [shortcut] + copied.bottom_names["sum2"]:
        copied.blobs[name].share_diff = lambda other: False
    assert_same_passes(shared, copied)
    assert shared.blobs[shortcut].diff is shared.blobs["sum"].diff
    assert shared.blobs[branch].diff is not shared.blobs["sum"].diff
    assert all(shared.blobs[name].diff is shared.blobs["sum2"].diff
               for name in shared.bottom_names["sum2"])
    assert copied.blobs[shortcut].diff is not copied.blobs["sum"].diff
    assert np.abs(shared.blobs["c1"].diff).max() > 1e-3


def test_the_relus_before_splits_absorb_them(monkeypatch):
    net = make_net(monkeypatch, fuse=True, text=SHORTCUTS)
    assert {"relu1", "relu2"} <= set(fused_pairs(net))
    assert net.layer_names[net.layer_names.index("relu2") + 1].endswith("split")
    assert "relu2" in fused_pairs(make_net(monkeypatch, fuse=True, numba=False,
                                           text=SHORTCUTS))


@pytest.mark.parametrize("numba", [True, False])
def test_absorbed_splits_compute_what_the_layers_compute_apart(monkeypatch, numba):
    nets = [make_net(monkeypatch, fuse=False, numba=False, text=SHORTCUTS),
            make_net(monkeypatch, fuse=True, numba=numba, text=SHORTCUTS)]
    split, masked = nets[1].layer_dict[SPLIT_OF_RELU2], []
    unspied = split.add_gradients

    def spy(top, bottom, mask=None):
        masked.append(mask is not None)
        unspied(top, bottom, mask)
    monkeypatch.setattr(split, "add_gradients", spy)
    for _ in range(2):
        for net in nets:
            net.forward()
            net.backward()
        assert_state_close(*[state(net) for net in nets])
    diff = nets[1].blobs["sum"].diff
    assert (diff[nets[1].blobs["sum"].data <= 0] == 0).all() and np.abs(diff).max() > 1e-3
    assert masked == [True, True]            # relu2 summed and masked in one pass


@pytest.mark.parametrize("start, end", [(SPLIT_OF_RELU2, "relu2"), (SPLIT_OF_RELU2, None),
                                        ("relu2", "sum"), (SPLIT_OF_RELU2, SPLIT_OF_RELU2),
                                        ("conv2", "relu1"), ("c1_relu1_0_split", "conv1")])
def test_partial_backward_passes_through_absorbed_splits(monkeypatch, start, end):
    """Each of the two does its own work in a pass that does not run both."""
    nets = [make_net(monkeypatch, fuse=f, text=SHORTCUTS) for f in (False, True)]
    rng = np.random.default_rng(5)
    diffs = {name: rng.standard_normal(nets[0].blobs[name].shape).astype(np.float32)
             for name in nets[0].blobs}
    assert_state_close(*partial_backward_states(nets, diffs, start, end))


# relu1 ends the lanes' run: its Split, carrying the ReLU's loss weight, cannot join it (Caffe
# moves a loss weight onto the Split's first top).
LANES_END_AT_THE_RELU = """
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 3 dim: 8 dim: 8 } shape { dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" loss_weight: 0.01 }
layer { name: "ipa" type: "InnerProduct" bottom: "c1" top: "a"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ipb" type: "InnerProduct" bottom: "c1" top: "b"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "loss" }
"""


def test_no_pair_fuses_where_lanes_run_one_of_the_two(monkeypatch, thread_budget):
    """Lanes run their own copies of their run's layers, which the net's pairs do not reach:
    a ReLU ending the run must not leave its Split's sum to them."""
    thread_budget(2)
    nets = [make_net(monkeypatch, fuse=f, text=LANES_END_AT_THE_RELU, lanes=True)
            for f in (False, True)]
    names = nets[1].layer_names
    assert nets[1].lanes.run[1] == names.index("relu1")
    assert "relu1" not in fused_pairs(nets[1])
    for _ in range(2):
        for net in nets:
            net.forward()
            net.backward()
        assert_state_close(*[state(net) for net in nets])
    assert np.abs(nets[1].blobs["c1"].diff).max() > 1e-3
