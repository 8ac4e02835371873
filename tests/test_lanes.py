"""Lanes (syncsgd.lanes): a net whose threads each carry part of the batch through its
sample-wise layers computes what the same net computes layer by layer, within float rounding,
whatever the pass (whole, partial, after a reshape or new weights), and reruns to the bit."""
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TRAIN
from syncsgd.net import Net
from syncsgd.proto import pb

NET = """
name: "lanes"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: %(n)d dim: 3 dim: 12 dim: 12 } shape { dim: %(n)d } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 3
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sig" type: "Sigmoid" bottom: "ip1" top: "ip1" }
%(middle)s
layer { name: "ip2" type: "InnerProduct" bottom: "%(last)s" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
DROPOUT = """layer { name: "drop" type: "Dropout" bottom: "ip1" top: "drop"
                     dropout_param { dropout_ratio: 0.5 } }"""


def net_param(n=10, dropout=False):
    text = NET % {"n": n, "middle": DROPOUT if dropout else "",
                  "last": "drop" if dropout else "ip1"}
    return text_format.Parse(text, pb.NetParameter())


def make_net(monkeypatch, lanes, n=10, **kwargs):
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    net = Net(net_param(n, **kwargs), TRAIN)
    fill(net, seed=0)
    return net


def fill(net, seed):
    rng = np.random.default_rng(seed)
    n = net.blobs["data"].shape[0]
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 4, n)


def results(net):
    """Every blob's values and diff and every parameter gradient, copied."""
    blobs = {name: (b.data.copy(), b.diff.copy()) for name, b in net.blobs.items()}
    params = {name: [b.diff.copy() for b in bs] for name, bs in net.params.items()}
    return blobs, params


def clear(net):
    """Zero the gradients of the net's current parameter blobs (after share_with they are
    another net's, which clear_param_diffs does not reach)."""
    for blobs in net.params.values():
        for blob in blobs:
            blob.diff[...] = 0


def step(net):
    clear(net)
    net.forward()
    net.backward()
    return results(net)


def assert_close(a, b, rtol=1e-5):
    for (blobs_a, params_a), (blobs_b, params_b) in [(a, b)]:
        for name in blobs_a:
            for x, y in zip(blobs_a[name], blobs_b[name]):
                np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.abs(x).max(),
                                           err_msg=name)
        for name in params_a:
            for x, y in zip(params_a[name], params_b[name]):
                np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.abs(x).max(),
                                           err_msg=f"{name} gradient")


def test_the_run_is_the_sample_wise_layers_around_the_convolutions(monkeypatch):
    net = make_net(monkeypatch, lanes=True)
    names = [layer.name for layer in net.layers]
    assert net.lanes.run == (names.index("conv1"), names.index("loss"))
    with_dropout = make_net(monkeypatch, lanes=True, dropout=True)
    names = [layer.name for layer in with_dropout.layers]
    assert with_dropout.lanes.run == (names.index("conv1"), names.index("sig"))
    assert make_net(monkeypatch, lanes=False).lanes.run is None


def test_no_run_without_a_convolution():
    text = """layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 } } }
              layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
                      inner_product_param { num_output: 2 } }"""
    assert Net(text_format.Parse(text, pb.NetParameter()), TRAIN).lanes.run is None


@pytest.mark.parametrize("n", [10, 7, 2])
def test_lanes_compute_what_the_layers_compute(monkeypatch, thread_budget, n):
    thread_budget(2)
    plain = make_net(monkeypatch, lanes=False, n=n)
    laned = make_net(monkeypatch, lanes=True, n=n)
    expected, got = step(plain), step(laned)
    assert laned.lanes.engaged is not None and laned.lanes.engaged.count == 2
    assert plain.loss > 0 and abs(laned.loss - plain.loss) < 1e-5 * plain.loss
    assert any(np.abs(g).max() > 0 for gs in got[1].values() for g in gs)
    assert_close(expected, got)


def test_lanes_rerun_to_the_bit(monkeypatch, thread_budget):
    thread_budget(2)
    first, again = make_net(monkeypatch, lanes=True), make_net(monkeypatch, lanes=True)
    a, b = step(first), step(again)
    for name in a[1]:
        for x, y in zip(a[1][name], b[1][name]):
            np.testing.assert_array_equal(x, y)


def test_one_thread_runs_no_lanes(monkeypatch, thread_budget):
    thread_budget(1)
    net = make_net(monkeypatch, lanes=True)
    step(net)
    assert net.lanes.engaged is None


@pytest.mark.parametrize("whole_net", [True, False])
@pytest.mark.parametrize("shape", [(6, 3, 12, 12), (10, 3, 11, 11)])
def test_a_new_input_shape_rebuilds_the_lanes(monkeypatch, thread_budget, whole_net, shape):
    """A new batch size or image size, after net.reshape() or with only the input reshaped
    (forward reshapes every layer, as pycaffe scripts rely on; the lanes' layers are not
    reshaped at every pass, so new shapes must build new lanes)."""
    thread_budget(2)
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)
    step(laned)
    before = laned.lanes.lanes
    for net in (plain, laned):
        net.blobs["data"].reshape(*shape)
        net.blobs["label"].reshape(shape[0])
        if whole_net:
            net.reshape()
        fill(net, seed=3)
    assert_close(step(plain), step(laned))
    assert laned.lanes.lanes is not before and laned.blobs["ip2"].shape == (shape[0], 4)
    assert laned.blobs["conv2"].shape == (shape[0], 6, 4, 4)


def test_a_net_with_lanes_is_freed_without_the_garbage_collector(monkeypatch, thread_budget):
    thread_budget(2)
    net = make_net(monkeypatch, lanes=True)
    step(net)
    gone = weakref.ref(net)
    del net
    assert gone() is None


def test_lanes_follow_new_weights(monkeypatch, thread_budget):
    thread_budget(2)
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)
    step(laned)
    laned.share_with(plain)                 # new parameter arrays
    assert_close(step(plain), step(laned))
    plain.params["conv2"][0].data[...] *= 2   # the same arrays, new values
    assert_close(step(plain), step(laned))


def test_partial_passes_and_layers_run_one_by_one(monkeypatch, thread_budget):
    thread_budget(2)
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)

    def partial(net):
        step(net)
        net.blobs["pool1"].data[...] *= 0.5
        net.forward(start="conv2")
        clear(net)
        net.backward(start="ip1", end="pool1", ip1=np.ones(net.blobs["ip1"].shape))
        return results(net)
    assert_close(partial(plain), partial(laned))

    def one_by_one(net):
        # As `syncsgd time` runs them: the backward must not use the lanes' state from the
        # earlier forward.
        fill(net, seed=4)
        clear(net)
        for i in range(len(net.layers)):
            net.forward_layer(i)
        net.backward()
        return results(net)
    assert_close(one_by_one(plain), one_by_one(laned))
    assert laned.lanes.engaged is None


@pytest.mark.parametrize("dropout", [True, False])     # without: the loss is in the lanes
def test_training_with_lanes_equals_training_without(monkeypatch, thread_budget, tmp_path,
                                                     dropout):
    thread_budget(2)
    weights = {}
    for lanes in (False, True):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        param = text_format.Parse("base_lr: 0.1 momentum: 0.9 lr_policy: 'fixed' "
                                  "weight_decay: 0.001 random_seed: 5 iter_size: 2",
                                  pb.SolverParameter())
        net = net_param(8, dropout=dropout)
        net.layer[0].CopyFrom(text_format.Parse(
            """name: "data" type: "DummyData" top: "data" top: "label"
               dummy_data_param { shape { dim: 8 dim: 3 dim: 12 dim: 12 } shape { dim: 8 }
                                  data_filler { type: "gaussian" std: 1 }
                                  data_filler { type: "uniform" min: 0 max: 3.9 } }""",
            pb.LayerParameter()))
        param.net_param.CopyFrom(net)
        param.snapshot_prefix = str(tmp_path / f"lanes{lanes}")
        solver = syncsgd.get_solver(param)
        solver.step(4)
        assert (solver.net.lanes.engaged is not None) == lanes
        weights[lanes] = [b.data.copy() for bs in solver.net.params.values() for b in bs]
    for plain, laned in zip(weights[False], weights[True]):
        np.testing.assert_allclose(laned, plain, rtol=1e-4, atol=1e-5)


def test_a_run_does_not_join_layers_of_different_batch_sizes(monkeypatch):
    """Two branches in a row, one on 4 samples and one on 2: no rows to split alike."""
    monkeypatch.setenv("SYNCSGD_LANES", "1")
    text = """layer { name: "x" type: "Input" top: "a" top: "b"
                      input_param { shape { dim: 4 dim: 2 dim: 5 dim: 5 }
                                    shape { dim: 2 dim: 2 dim: 5 dim: 5 } } }
              layer { name: "conv_a" type: "Convolution" bottom: "a" top: "ca"
                      convolution_param { num_output: 3 kernel_size: 3 } }
              layer { name: "conv_b" type: "Convolution" bottom: "b" top: "cb"
                      convolution_param { num_output: 3 kernel_size: 3 } }
              layer { name: "relu_b" type: "ReLU" bottom: "cb" top: "cb" }"""
    net = Net(text_format.Parse(text, pb.NetParameter()), TRAIN)
    assert net.lanes.run == (2, 3)


def scripted_spread(schedule):
    """A stand-in for blas.spread that runs lane t of each call on the thread the schedule names
    for it ("A" or "B", two threads of their own), one lane after the other."""
    from concurrent.futures import ThreadPoolExecutor

    from syncsgd.kernels.threads import shared_out
    threads = {"A": ThreadPoolExecutor(1), "B": ThreadPoolExecutor(1)}
    calls = iter(schedule)

    def spread(items, work, share=None):
        where = next(calls)
        with shared_out():
            for item in items:
                threads[where[item]].submit(work, item, 0).result()
    return spread


def test_a_lane_backward_on_another_thread_does_not_reuse_old_columns(monkeypatch,
                                                                       thread_budget):
    """Convolutions on im2col GEMMs keep their columns for backward in the thread's buffer. A
    lane's backward on a thread that still holds that layer's columns from an earlier pass must
    not take them for this pass's."""
    from syncsgd import lanes
    thread_budget(2)
    param = net_param(dropout=True)       # the run ends before the loss: no sums over the lanes
    for layer in param.layer:
        if layer.type == "Convolution":
            layer.convolution_param.engine = pb.ConvolutionParameter.CAFFE
    monkeypatch.setenv("SYNCSGD_LANES", "0")
    plain = Net(param, TRAIN)
    monkeypatch.setenv("SYNCSGD_LANES", "1")
    laned = Net(param, TRAIN)
    monkeypatch.setattr(lanes, "spread", scripted_spread(
        [{0: "B", 1: "A"}, {0: "A", 1: "A"},      # pass 1: lane 0 forward on B
         {0: "A", 1: "A"}, {0: "B", 1: "A"}]))    # pass 2: lane 0 backward on B
    for seed in (0, 1):
        fill(plain, seed), fill(laned, seed)
        expected, got = step(plain), step(laned)
    assert laned.lanes.engaged is not None
    assert_close(expected, got)


def test_a_pass_entering_the_run_in_the_middle_follows_its_earlier_layers(monkeypatch,
                                                                          thread_budget):
    """A serial pass (one thread), then a partial one from inside the run with two threads:
    the lanes' copies of the earlier layers never ran, so the partial pass is serial too."""
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)
    results_of = []
    for net in (plain, laned):
        thread_budget(1)
        net.forward()
        thread_budget(2)
        net.blobs["pool1"].data[...] *= 0.5
        net.forward(start="conv2")
        clear(net)
        net.backward()
        results_of.append(results(net))
    assert laned.lanes.engaged is None
    assert_close(*results_of)


def test_blobs_replaced_between_forward_and_backward_is_an_error(monkeypatch, thread_budget):
    from syncsgd.errors import SyncSGDError
    thread_budget(2)
    laned, other = make_net(monkeypatch, lanes=True), make_net(monkeypatch, lanes=False)
    laned.forward()
    laned.share_with(other)
    with pytest.raises(SyncSGDError, match="replaced between forward and backward.*forward "
                                           "again"):
        laned.backward()


def test_a_reshape_layer_ahead_of_the_run_does_not_rebuild_the_lanes(monkeypatch,
                                                                     thread_budget):
    """Reshape hands on a new view of the same memory at every pass."""
    thread_budget(2)
    text = """layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 6 dim: 432 } } }
              layer { name: "r" type: "Reshape" bottom: "x" top: "data"
                      reshape_param { shape { dim: 0 dim: 3 dim: 12 dim: 12 } } }
              layer { name: "conv" type: "Convolution" bottom: "data" top: "c"
                      convolution_param { num_output: 4 kernel_size: 3
                                          weight_filler { type: "gaussian" std: 0.3 } } }
              layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }"""
    monkeypatch.setenv("SYNCSGD_LANES", "1")
    net = Net(text_format.Parse(text, pb.NetParameter()), TRAIN)
    net.forward()
    built = net.lanes.lanes
    for _ in range(3):
        net.forward()
    assert built is not None and net.lanes.lanes is built


def test_a_training_pass_goes_forward_and_back_in_the_lanes_at_once(monkeypatch, thread_budget):
    """forward_backward (the solver's pass): the loss in the lanes, summed over them."""
    thread_budget(2)
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)
    expected = step(plain)
    calls = []
    monkeypatch.setattr(laned.lanes, "backward_at", lambda i: calls.append(i))
    clear(laned)
    loss = laned.forward_backward()
    # No second hand-off: backward asks about the layers below the run only.
    assert all(i < laned.lanes.run[0] for i in calls) and laned.lanes.engaged is not None
    assert loss == pytest.approx(plain.loss, rel=1e-6) and loss == laned.loss
    assert_close(expected, results(laned))


def test_syncsgd_time_times_the_pass_training_runs(monkeypatch, thread_budget):
    """time_net (`syncsgd time`): per-layer times from passes one layer at a time, the pass's
    time from whole passes as the solver runs them, through the lanes."""
    from syncsgd.timing import time_net
    thread_budget(2)
    laned = make_net(monkeypatch, lanes=True)
    fill(laned, seed=2)
    clock, passes, engaged = [0.0], [], []
    real = laned.forward_backward

    def forward_backward(*args, **kwargs):
        clock[0] += 1.0            # a whole pass takes one second of the patched clock
        loss = real(*args, **kwargs)
        engaged.append(laned.lanes.engaged is not None)
        return loss
    monkeypatch.setattr(laned, "forward_backward", forward_backward)
    monkeypatch.setattr("syncsgd.timing.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    report = time_net(laned, iterations=3, warmup=1, progress=lambda it, s: passes.append(s))
    assert engaged == [True] * 4 and passes == [1.0] * 3
    assert report["total_ms"] == 1000.0
    assert report["forward_ms"] == report["backward_ms"] == 0.0    # no layer inside a pass
    assert [layer["name"] for layer in report["layers"]] == [layer.name for layer in laned.layers]


ACCURACY = 'name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" top: "per_class"'


def test_accuracy_and_the_loss_are_sums_over_the_whole_batch(monkeypatch, thread_budget):
    thread_budget(2)
    nets = []
    for lanes in (False, True):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        param = net_param(n=9)
        param.layer.add().CopyFrom(text_format.Parse(ACCURACY, pb.LayerParameter()))
        net = Net(param, TRAIN)
        fill(net, seed=2)
        net.forward()
        nets.append(net)
    plain, laned = nets
    assert laned.lanes.run[1] == len(laned.layers) - 1 and laned.lanes.engaged is not None
    for name in ("loss", "acc", "per_class"):
        np.testing.assert_allclose(laned.blobs[name].data, plain.blobs[name].data, rtol=1e-6)


def test_a_bad_label_in_the_second_lane_names_its_sample(monkeypatch, thread_budget):
    """The lane that fails raises its error to the caller (the other lane's pass goes on to its
    end: the loss's sum does not make them meet), and the next pass runs."""
    from syncsgd.errors import SyncSGDError
    thread_budget(2)
    plain, laned = make_net(monkeypatch, lanes=False), make_net(monkeypatch, lanes=True)
    laned.blobs["label"].data[7] = 9
    with pytest.raises(SyncSGDError, match="label 9 of sample 7 of the batch"):
        laned.forward_backward()
    laned.blobs["label"].data[...] = plain.blobs["label"].data
    expected = step(plain)
    clear(laned)
    laned.forward_backward()
    assert_close(expected, results(laned))


@pytest.mark.parametrize("ignore_label", [None, 3])
def test_sums_nothing_in_the_pass_reads_wait_for_its_end(monkeypatch, thread_budget,
                                                         ignore_label):
    """On one process a loss whose normaliser needs no sum (every label counts) and accuracy
    sum over the lanes after the pass: no lane waits for another in the middle of it. With an
    ignore_label the normaliser counts the valid labels of every lane, which the lanes then
    sum as they reach the loss. Either way the results are those without lanes."""
    from syncsgd import lanes
    thread_budget(2)
    nets = []
    for with_lanes in (False, True):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if with_lanes else "0")
        param = net_param(n=9)
        if ignore_label is not None:
            param.layer[-1].loss_param.ignore_label = ignore_label
        param.layer.add().CopyFrom(text_format.Parse(ACCURACY, pb.LayerParameter()))
        net = Net(param, TRAIN)
        fill(net, seed=3)
        nets.append(net)
    plain, laned = nets
    met = []
    sums = lanes.LaneSums.__call__
    monkeypatch.setattr(lanes.LaneSums, "__call__",
                        lambda self, t, array: met.append(t) or sums(self, t, array))
    expected = step(plain)
    clear(laned)
    laned.forward_backward()
    assert laned.lanes.engaged is not None
    assert sorted(met) == ([] if ignore_label is None else [0, 1])
    assert_close(expected, results(laned))
    for name in ("loss", "acc", "per_class"):
        np.testing.assert_allclose(laned.blobs[name].data, plain.blobs[name].data, rtol=1e-6)


def both_ways(monkeypatch, text, inputs):
    """[(net, its forward_backward loss)] for the net of `text` without lanes, then with them,
    its input blobs set from {name: values}."""
    runs = []
    for lanes in (False, True):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        net = Net(text_format.Parse(text, pb.NetParameter()), TRAIN)
        for name, values in inputs.items():
            net.blobs[name].data[...] = values
        clear(net)
        runs.append((net, net.forward_backward()))
    return runs


@pytest.mark.parametrize("normalization", ["VALID", "BATCH_SIZE", "FULL"])
def test_a_softmax_on_axis_2_sums_after_the_pass_with_the_whole_batch_s_normaliser(
        monkeypatch, thread_budget, normalization):
    """Axis 2: the loss's `batch` counts rows times the first axis after them, not samples;
    the normaliser of the whole batch, known before the sums, must still be one process's. (No
    bias: its gradient would be a sum over axis 2 of softmax gradients, zero but for rounding,
    which no relative tolerance compares.)"""
    thread_budget(2)
    text = """layer { name: "x" type: "Input" top: "data" top: "label"
                      input_param { shape { dim: 6 dim: 2 dim: 6 dim: 6 }
                                    shape { dim: 6 dim: 3 dim: 4 } } }
              layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
                      convolution_param { num_output: 3 kernel_size: 3 bias_term: false
                                          weight_filler { type: "gaussian" std: 0.3 } } }
              layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv" bottom: "label"
                      top: "loss" softmax_param { axis: 2 }
                      loss_param { normalization: %s } }""" % normalization
    rng = np.random.default_rng(4)
    (plain, plain_loss), (net, loss) = both_ways(monkeypatch, text, {
        "data": rng.standard_normal((6, 2, 6, 6)), "label": rng.integers(0, 4, (6, 3, 4))})
    assert net.lanes.engaged is not None
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert_close(results(plain), results(net))


@pytest.mark.parametrize("loss", [
    # The softmax across the samples: 4 classes are the 4 samples, one label per column.
    'type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" softmax_param { axis: 0 }',
    # The infogain matrix as a third bottom, as many rows as the batch has samples.
    'type: "InfogainLoss" bottom: "ip" bottom: "label" bottom: "H"',
])
def test_a_loss_whose_samples_meet_outside_its_sums_stays_out_of_the_lanes(
        monkeypatch, thread_budget, loss):
    thread_budget(2)
    text = """layer { name: "x" type: "Input" top: "data" top: "label" top: "H"
                      input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } shape { dim: 4 }
                                    shape { dim: 4 dim: 4 } } }
              layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
                      convolution_param { num_output: 3 kernel_size: 3
                                          weight_filler { type: "gaussian" std: 0.3 } } }
              layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
                      inner_product_param { num_output: 4
                                            weight_filler { type: "gaussian" std: 0.3 } } }
              layer { name: "loss" top: "loss" %s }""" % loss
    (_, plain_loss), (net, loss) = both_ways(monkeypatch, text, {
        "data": np.random.default_rng(1).standard_normal((4, 2, 6, 6)),
        "label": [0, 3, 1, 2], "H": np.eye(4) + 0.1})
    losses = [plain_loss, loss]
    names = [layer.name for layer in net.layers]
    assert net.lanes.run == (names.index("conv"), names.index("ip"))
    assert net.lanes.engaged is not None and losses[1] == pytest.approx(losses[0], rel=1e-6)


def cleared_pass(net, garbage=7.0, built=False):
    """A training pass as the solver's step runs it (forward_backward(clear=True)), over diffs
    that hold `garbage` (clearing is lazy: a diff nothing writes must still read as zeros). A
    first pass builds the lanes, which read the diffs, unless they are `built`."""
    if not built:
        net.forward_backward()
    for blobs in net.params.values():
        for blob in blobs:
            blob.diff[...] = garbage
    net.forward_backward(clear=True)
    return results(net)


@pytest.mark.parametrize("frozen", [None, "conv1"])
def test_lane_0_writes_over_cleared_diffs_and_leaves_unwritten_ones_cleared(
        monkeypatch, thread_budget, frozen):
    """Lane 0 takes the net's cleared diffs and its kernels write over them; a layer that needs
    no backward (conv1 on the data, its parameters at lr_mult 0) writes no gradient, and its
    diffs read as zeros."""
    thread_budget(2)
    nets = []
    for lanes in (False, True):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        param = net_param()
        for layer in param.layer:
            if layer.name == frozen:
                layer.param.add(lr_mult=0)
                layer.param.add(lr_mult=0)
        net = Net(param, TRAIN)
        fill(net, seed=0)
        nets.append(net)
    plain, laned = nets
    laned.forward_backward()                  # builds the lanes
    ip1 = laned.lanes.lanes.lanes[0][5][0]
    assert ip1.name == "ip1"
    handed = []
    backward = ip1.backward
    monkeypatch.setattr(ip1, "backward", lambda *args: handed.append(
        [b.cleared for b in ip1.blobs]) or backward(*args))
    expected, got = cleared_pass(plain), cleared_pass(laned, built=True)
    assert handed == [[True, True]] and not any(b.cleared for b in ip1.blobs)
    assert_close(expected, got)
    if frozen:
        assert all(not np.any(g) for g in got[1][frozen])
    assert all(np.any(g) for name, gs in got[1].items() if name != frozen for g in gs)
    # Lane 0's blobs keep no clear of their own: the next pass over diffs that were not
    # cleared adds into them.
    laned.forward_backward()
    for name, gs in results(laned)[1].items():
        for g, first in zip(gs, got[1][name]):
            np.testing.assert_allclose(g, 2 * first, rtol=1e-5, atol=1e-6)


SHARED = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 4 dim: 6 dim: 6 } shape { dim: 6 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a"
        param { name: "w" } param { name: "b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "conv_b" type: "Convolution" bottom: "a" top: "b"
        param { name: "w" } param { name: "b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "b" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def delay(lane_layer, seconds, before=None):
    """Make one lane's layer wait before its backward: `seconds`, or for the event `before`."""
    backward = lane_layer.backward

    def late(top, propagate_down, bottom):
        if before is not None:
            assert before.wait(10)
        time.sleep(seconds)
        backward(top, propagate_down, bottom)
    lane_layer.backward = late


def test_a_parameter_two_layers_of_the_run_share_is_summed_to_the_bit(monkeypatch,
                                                                      thread_budget):
    """Both layers add into the one diff (it is zeroed, not written over by the first), and the
    lanes' parts join in one order whichever lane finishes first: the two layers' sums are
    one group, added once every lane has finished both."""
    thread_budget(2)
    runs = []
    for lanes, slow in ((False, None), (True, None), (True, 0), (True, 1)):
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        net = Net(text_format.Parse(SHARED, pb.NetParameter()), TRAIN)
        rng = np.random.default_rng(1)
        net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = rng.integers(0, 3, 6)
        net.forward_backward()                    # builds the lanes
        if slow is not None:
            conv_a = net.lanes.lanes.lanes[slow][0][0]
            assert conv_a.name == "conv_a"
            delay(conv_a, 0.2)
        runs.append((net, cleared_pass(net, built=True)))
    (plain, expected), (laned, got) = runs[:2]
    assert laned.lanes.engaged is not None and laned.lanes.run[0] == 1
    assert laned.params["conv_a"][0].diff is laned.params["conv_b"][0].diff
    assert_close(expected, got)
    for _, other in runs[2:]:
        for name in got[1]:
            for x, y in zip(got[1][name], other[1][name]):
                np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("slow", [0, 1])
def test_gradients_add_up_to_the_bit_whichever_lane_finishes_first(monkeypatch, thread_budget,
                                                                   slow):
    """The lane that finishes first adds the others' gradients of the layers they have all
    finished (the top ones) while the slow lane runs its lowest layer; the sums, in lane
    order, are the same bits either way."""
    thread_budget(2)
    reference = make_net(monkeypatch, lanes=True)
    expected = cleared_pass(reference)
    net = make_net(monkeypatch, lanes=True)
    net.forward_backward()                    # builds the lanes
    lanes = net.lanes.lanes
    slow_conv1, fast_conv1 = lanes.lanes[slow][0][0], lanes.lanes[1 - slow][0][0]
    assert slow_conv1.name == fast_conv1.name == "conv1"
    reached = threading.Event()
    seen = {}
    backward = slow_conv1.backward

    def late(top, propagate_down, bottom):
        # The fast lane ends its pass (and adds what is ready) once this lane is here.
        reached.set()
        time.sleep(0.3)
        seen["ip2"] = net.params["ip2"][0].array(1).copy()
        backward(top, propagate_down, bottom)
    monkeypatch.setattr(slow_conv1, "backward", late)
    delay(fast_conv1, 0, before=reached)
    got = cleared_pass(net, built=True)
    for name in expected[1]:
        for x, y in zip(expected[1][name], got[1][name]):
            np.testing.assert_array_equal(x, y, err_msg=name)
    # ip2's total was complete while the slow lane still ran conv1.
    np.testing.assert_array_equal(seen["ip2"], got[1]["ip2"][0])


def test_a_layer_whose_reshape_changes_state_is_refused_by_the_lanes(monkeypatch, thread_budget):
    """Lanes reshape their layers only when built: a sample-wise layer whose reshape does more
    than size buffers (here: counts its calls) would go wrong silently, so building lanes with
    it is an error that names it."""
    from syncsgd.errors import SyncSGDError
    from syncsgd.layers.relu import ReLU
    thread_budget(2)
    reshape = ReLU.reshape

    def counting(self, bottom, top):
        reshape(self, bottom, top)
        self.calls = getattr(self, "calls", 0) + 1
    monkeypatch.setattr(ReLU, "reshape", counting)
    net = make_net(monkeypatch, lanes=True)
    with pytest.raises(SyncSGDError, match=r"'relu1' \(ReLU\) cannot run in lanes: .*calls"):
        net.forward()
