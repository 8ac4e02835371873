"""Forms (blob.py, kernels/onednn.Form): between layers that run on oneDNN a blob's values may
stay in the blocked layout the primitives chose. The net then computes exactly what it computes
with every layer reordering to NCHW (SYNCSGD_FORMS=0), with and without lanes, and what users
read and write through `data` / `diff` is what the layers see."""
import gc
import pickle
import threading
import time
import weakref

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN
from syncsgd.blob import ARRAY, FORM, ROOT, VIEWS, Blob
from syncsgd.kernels import normalization, onednn
from syncsgd.net import Net
from syncsgd.proto import pb

pytestmark = pytest.mark.skipif(not onednn.available(), reason="oneDNN does not load here")

# Channel counts that are not multiples of the blocks (8 or 16) put padding in the forms.
NET = """
name: "forms"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: %(n)d dim: 3 dim: 12 dim: 12 } shape { dim: %(n)d } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 20 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 12 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "relu2" }
layer { name: "pool2" type: "Pooling" bottom: "relu2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
        convolution_param { num_output: 6 kernel_size: 1
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv3" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def make_net(monkeypatch, forms, lanes=True, n=8):
    """The test net; SYNCSGD_FORMS, read as layers run, holds until the next make_net."""
    monkeypatch.setenv("SYNCSGD_FORMS", "1" if forms else "0")
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    net = Net(text_format.Parse(NET % {"n": n}, pb.NetParameter()), TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 4, n)
    return net


# A ResNet block: BatchNorm, Scale and ReLU in place after each convolution, a Split and an
# Eltwise SUM shortcut; 20 channels put padding in the channel blocks.
RESIDUAL = """
name: "residual"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 3 dim: 10 dim: 10 } shape { dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 20 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
                      bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2a" type: "Convolution" bottom: "conv1" top: "conv2a"
        convolution_param { num_output: 20 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn2a" type: "BatchNorm" bottom: "conv2a" top: "conv2a" }
layer { name: "scale2a" type: "Scale" bottom: "conv2a" top: "conv2a"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "relu2a" type: "ReLU" bottom: "conv2a" top: "conv2a" }
layer { name: "conv2b" type: "Convolution" bottom: "conv2a" top: "conv2b"
        convolution_param { num_output: 20 kernel_size: 1
                            weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn2b" type: "BatchNorm" bottom: "conv2b" top: "bn2b" }
layer { name: "scale2b" type: "Scale" bottom: "bn2b" top: "scale2b"
        scale_param { filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "scale2b" top: "sum"
        eltwise_param { coeff: 1 coeff: 0.5 } }
layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def residual_net(monkeypatch, forms, lanes, onednn_norm=True, phase=TRAIN, stored=False):
    """RESIDUAL with BatchNorm and Scale on oneDNN, or on their numpy passes; `stored`: its
    BatchNorms set use_global_stats and hold statistics."""
    from syncsgd.layers import batch_norm, scale
    for module in (batch_norm, scale):
        monkeypatch.setattr(module, "usable",
                            normalization.usable if onednn_norm else lambda blob: False)
    monkeypatch.setenv("SYNCSGD_FORMS", "1" if forms else "0")
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    text = RESIDUAL
    if stored:
        text = text.replace('type: "BatchNorm"',
                            'type: "BatchNorm" batch_norm_param { use_global_stats: true }')
    net = Net(text_format.Parse(text, pb.NetParameter()), phase)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape) * 2 + 1
    net.blobs["label"].data[...] = rng.integers(0, 4, 6)
    for name in ("bn1", "bn2a", "bn2b"):
        mean, var, factor = net.params[name]
        mean.data[...] = np.linspace(-1, 1, 20)
        var.data[...] = np.linspace(0.5, 2, 20)
        factor.data[...] = 2
    return net


def assert_close(a, b):
    for name in a[0]:
        for x, y in zip(a[0][name], b[0][name]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-5, err_msg=name)
    for name in a[1]:
        for x, y in zip(a[1][name], b[1][name]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-5, err_msg=f"{name} gradient")


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("stored", [True, False])
def test_batch_norm_scale_eltwise_and_split_keep_forms(monkeypatch, thread_budget, lanes,
                                                       stored):
    """On oneDNN, in the forms' layout and in plain arrays, the block computes what the numpy
    passes compute, over two passes (in place, BatchNorm and Scale trade forms with the blob
    at every pass). With stored statistics the layers between the convolutions write forms;
    with batch statistics BatchNorm's blobs are arrays (its float64 sums read them)."""
    thread_budget(2)
    expected, _, _ = passes(residual_net(monkeypatch, forms=False, lanes=lanes,
                                         onednn_norm=False, stored=stored))
    assert_close(expected, passes(residual_net(monkeypatch, forms=False, lanes=lanes,
                                               stored=stored))[0])
    net = residual_net(monkeypatch, forms=True, lanes=lanes, stored=stored)
    kept = recording_forms(monkeypatch)
    got, _, _ = passes(net)
    assert_close(expected, got)
    assert float(net.loss) > 0
    assert net.blobs["conv1"].takes_forms == stored and net.blobs["sum"].takes_forms
    if stored and not lanes and not conv1_kernel(net).f_maps.same:   # conv1 left a form
        # bn1 and scale1 in place, the Split's tops and their gradients' sum, Eltwise's top
        # and its bottoms' gradients. (A lane's Split reads its view of conv1, not conv1's
        # form: blob.py.)
        assert {("conv1", 0), ("conv1_relu1_0_split_0", 0), ("conv1_relu1_0_split_1", 0),
                ("conv1", 1), ("sum", 0), ("conv1_relu1_0_split_1", 1)} <= set(kept)


def test_split_tops_hold_the_bottoms_form_or_array(monkeypatch, thread_budget):
    """The Split's tops take conv1's form, or its array when a pass starts at the Split after a
    user wrote conv1; a later pass in forms gives them arrays of their own again. The sums
    after each pass are those of the net without forms."""
    thread_budget(2)
    split = "conv1_relu1_0_split"
    tops = [f"{split}_0", f"{split}_1"]
    seen = []
    for forms in (False, True):
        net = residual_net(monkeypatch, forms=forms, lanes=False, stored=True, phase=TEST)
        v = np.random.default_rng(5).standard_normal(net.blobs["conv1"].shape)
        net.forward()
        if forms and net.blobs["conv1"].head(0) is FORM:
            assert all(net.blobs[t].form(0) is net.blobs["conv1"].form(0) for t in tops)
        first = net.blobs["sum"].data.copy()
        net.blobs["conv1"].data[...] = v
        net.forward(start=split)
        assert all(np.shares_memory(net.blobs[t].data, net.blobs["conv1"].data) for t in tops)
        np.testing.assert_array_equal(net.blobs[tops[1]].data, v.astype(np.float32))
        second = net.blobs["sum"].data.copy()
        net.forward()
        in_form = net.blobs["conv1"].head(0) is FORM
        conv1 = net.blobs["conv1"].data
        for t in tops:
            np.testing.assert_array_equal(net.blobs[t].data, conv1)
            assert np.shares_memory(net.blobs[t].data, conv1) == (not in_form)
        seen.append((first, second, net.blobs["sum"].data.copy()))
    for a, b in zip(*seen):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_batch_norm_with_stored_statistics_on_forms(monkeypatch, thread_budget):
    """TEST phase: BatchNorm normalises by its stored averages, on forms as in numpy."""
    thread_budget(2)
    outputs = []
    for forms, onednn_norm in [(False, False), (True, True)]:
        net = residual_net(monkeypatch, forms, False, onednn_norm, phase=TEST)
        assert net.blobs["conv1"].takes_forms == forms
        net.forward()
        outputs.append({name: b.data.copy() for name, b in net.blobs.items()})
    for name in outputs[0]:
        np.testing.assert_allclose(outputs[1][name], outputs[0][name], rtol=1e-4, atol=2e-5,
                                   err_msg=name)


def results(net):
    blobs = {name: (b.data.copy(), b.diff.copy()) for name, b in net.blobs.items()}
    params = {name: [b.diff.copy() for b in bs] for name, bs in net.params.items()}
    return blobs, params


def assert_same(a, b):
    for name in a[0]:
        for x, y in zip(a[0][name], b[0][name]):
            np.testing.assert_array_equal(x, y, err_msg=name)
    for name in a[1]:
        for x, y in zip(a[1][name], b[1][name]):
            np.testing.assert_array_equal(x, y, err_msg=f"{name} gradient")


def passes(net, count=2):
    """`count` forward and backward passes; returns the last one's results and which blobs
    were behind a form after its forward and after its backward."""
    for _ in range(count):
        for blobs in net.params.values():
            for blob in blobs:
                blob.diff[...] = 0
        net.forward()
        after_forward = {name for name, b in net.blobs.items() if b.head(0) is not ARRAY}
        net.backward()
        after_backward = {name for name, b in net.blobs.items() if b.head(1) is not ARRAY}
    return results(net), after_forward, after_backward


def recording_forms(monkeypatch):
    """The (blob name, side) of every form a layer writes from now on."""
    kept, keep = [], Blob.keep
    monkeypatch.setattr(Blob, "keep", lambda blob, side, form: kept.append(
        (blob.name, side)) or keep(blob, side, form))
    return kept


# AlexNet's LRNs: across channels after a convolution's ReLU, within a channel after pooling.
# oneDNN's JIT kernels for them need whole channel blocks: 32 channels, not 20.
LRN = """
name: "lrn"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 6 dim: 3 dim: 13 dim: 13 } shape { dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: %(channels)d kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { local_size: 5 alpha: 0.5 beta: 0.75 k: 2 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm2" type: "LRN" bottom: "pool1" top: "norm2"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL } }
layer { name: "pool2" type: "Pooling" bottom: "norm2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("channels", [32, 20])
@pytest.mark.parametrize("lanes", [False, True])
def test_lrn_on_forms_computes_what_its_passes_compute(monkeypatch, thread_budget, lanes,
                                                       channels):
    """Where oneDNN has JIT kernels for LRN in the forms' layout (AVX-512), the LRNs run on them
    and keep forms; elsewhere on their numpy passes. Either way the net computes what it
    computes on arrays, over two passes."""
    thread_budget(2)

    def lrn_net(forms):
        monkeypatch.setenv("SYNCSGD_FORMS", "1" if forms else "0")
        monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
        net = Net(text_format.Parse(LRN % {"channels": channels}, pb.NetParameter()), TRAIN)
        rng = np.random.default_rng(0)
        net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = rng.integers(0, 4, 6)
        return net
    expected, _, _ = passes(lrn_net(False))
    net = lrn_net(True)
    kept = recording_forms(monkeypatch)
    got, _, _ = passes(net)
    assert_close(expected, got)
    layers = [net.layer_dict[name] for name in ("norm1", "norm2")]
    if lanes:
        engaged = net.lanes.engaged
        assert engaged is not None
        layers = [engaged.lanes[0][net.layer_names.index(name) - engaged.first][0]
                  for name in ("norm1", "norm2")]
    for layer, top, bottom in zip(layers, ("norm1", "norm2"), ("conv1", "pool1")):
        kernel = layer._onednn[1] if layer._onednn else None
        assert layer._ran_onednn == (kernel is not None)
        if kernel is not None:
            assert not any(name.startswith("ref") for name in kernel.kernels)
            assert (top, 0) in kept and (bottom, 1) in kept
    # Read between forward and backward, the LRNs' operands are arrays again: backward
    # reorders them into its layout.
    for blob in net.params["conv1"] + net.params["ip"]:
        blob.diff[...] = 0
    net.forward()
    for blob in net.blobs.values():
        blob.data
    net.backward()
    assert_close(expected, results(net))


def test_only_blobs_that_form_layers_alone_touch_take_forms(monkeypatch):
    net = make_net(monkeypatch, forms=True)
    taking = {name for name, b in net.blobs.items() if b.takes_forms}
    # relu2 (out of place) and pool2 are touched by layers that all take forms; conv3 feeds an
    # InnerProduct, data comes from an Input layer.
    assert taking == {"conv1", "pool1", "conv2", "relu2", "pool2"}


@pytest.mark.parametrize("threads, lanes", [(1, False), (2, False), (2, True)])
def test_forms_compute_what_arrays_compute(monkeypatch, thread_budget, threads, lanes):
    thread_budget(threads)
    expected, _, _ = passes(make_net(monkeypatch, forms=False, lanes=lanes))
    net = make_net(monkeypatch, forms=True, lanes=lanes)
    kept = recording_forms(monkeypatch)
    got, after_forward, _ = passes(net)
    assert (net.lanes.engaged is not None) == lanes
    # Forms were really used: pooling runs on channel blocks, so its output and its input's
    # gradient are written as forms whatever the CPU. Which blobs then stay in one until
    # results() reads them depends on the layouts the CPU's kernels choose: conv1's output
    # where its kernel keeps a layout that is not NCHW.
    assert {("pool1", 0), ("conv1", 1)} <= set(kept)
    assert ("conv1" in after_forward) == (not conv1_kernel(net).f_maps.same)
    assert float(net.loss) > 0
    assert_same(expected, got)


def conv1_kernel(net):
    """The oneDNN convolution that ran conv1: lane 0's where lanes ran, else the net's."""
    layer, i = net.layer_dict["conv1"], net.layer_names.index("conv1")
    lanes = net.lanes.engaged
    if lanes is not None and lanes.first <= i <= lanes.last:
        layer = lanes.lanes[0][i - lanes.first][0]
    return layer._kernels["onednn"].primitives


def test_forms_off_keeps_every_array_current(monkeypatch, thread_budget):
    thread_budget(2)
    _, after_forward, after_backward = passes(make_net(monkeypatch, forms=False))
    assert after_forward == after_backward == set()


@pytest.mark.parametrize("lanes", [False, True])
def test_what_users_write_is_what_later_layers_read(monkeypatch, thread_budget, lanes):
    thread_budget(2)
    pool1 = np.random.default_rng(1).standard_normal((8, 20, 6, 6)).astype(np.float32)
    outs, written = [], []
    kept = recording_forms(monkeypatch)
    for forms in (False, True):
        net = make_net(monkeypatch, forms=forms, lanes=lanes)     # SYNCSGD_FORMS holds for it
        net.forward()
        written.append(("pool1", 0) in kept)
        net.blobs["pool1"].data[...] = pool1          # over the form's values
        net.forward(start="conv2")
        outs.append(results(net))
    assert written == [False, True]
    np.testing.assert_array_equal(outs[1][0]["pool1"][0], pool1)
    assert_same(outs[0], outs[1])


class FakeForm:
    """A form whose to_plain writes known values (slowly, to let threads race)."""

    def __init__(self, values, delay=0.0):
        self.values, self.delay, self.calls = values, delay, 0

    def to_plain(self, array):
        self.calls += 1
        time.sleep(self.delay)
        array[...] = self.values


def test_reading_brings_the_array_up_to_date_once():
    blob = Blob((2, 3))
    form = FakeForm(np.full((2, 3), 5.0, np.float32))
    blob.keep(0, form)
    assert blob.head(0) is FORM and blob.head(1) is ARRAY and blob.form(0) is form
    assert (blob.diff == 0).all() and form.calls == 0          # the other side is untouched
    assert (blob.data == 5).all() and (blob.data == 5).all()
    assert form.calls == 1 and blob.head(0) is ARRAY and blob.form(0) is None
    assert blob.spare_form(0) is form                           # kept to be written again


def test_overwrite_and_assignment_drop_the_form():
    blob = Blob((4,))
    form = FakeForm(np.ones(4, np.float32))
    blob.keep(1, form)
    blob.overwrite(1)[...] = 7
    assert (blob.diff == 7).all() and form.calls == 0
    blob.keep(0, form)
    blob.data = np.full(4, 3, np.float32)
    assert (blob.data == 3).all() and form.calls == 0


def test_views_root_reads_bring_every_view_up_to_date():
    root = Blob((4, 2))
    top, bottom = Blob(), Blob()
    top.view_rows(root, 0, 2)
    bottom.view_rows(root, 2, 4)
    forms = [FakeForm(np.full((2, 2), v, np.float32)) for v in (1.0, 2.0)]
    top.keep(0, forms[0])
    bottom.keep(0, forms[1])
    assert root.head(0) is VIEWS
    assert (top.data == 1).all() and forms[1].calls == 0   # a view reads only its own form
    np.testing.assert_array_equal(root.data[:, 0], [1, 1, 2, 2])
    assert forms[1].calls == 1 and bottom.head(0) is ARRAY


def root_and_view():
    """A 4-value blob and a view of its first two rows, as lanes make them."""
    root, view = Blob((4,)), Blob()
    view.view_rows(root, 0, 2)
    return root, view


def test_a_roots_new_form_drops_its_views_older_ones():
    root, view = root_and_view()
    old = FakeForm(np.full(2, 9.0, np.float32))
    view.keep(1, old)
    root.keep(1, FakeForm(np.arange(4, dtype=np.float32)))
    np.testing.assert_array_equal(root.diff, [0, 1, 2, 3])
    assert old.calls == 0


def test_a_view_sees_its_roots_newer_values_and_writes_over_them_row_by_row():
    """The root's own form (or cleared zeros) is newer for every row: a view reads it, and a
    view writing its rows first brings the root up to date, so that the other rows keep the
    root's values whatever order readers and writers come in."""
    root, view = root_and_view()
    mine = FakeForm(np.arange(4, dtype=np.float32))
    root.keep(0, mine)
    assert view.head(0) is ROOT
    np.testing.assert_array_equal(view.data, [0, 1])
    root.keep(0, mine)
    view.keep(0, FakeForm(np.full(2, 7.0, np.float32)))
    np.testing.assert_array_equal(root.data, [7, 7, 2, 3])
    root.diff[...] = 5
    root.clear_diff()
    view.overwrite(1)[...] = 1
    np.testing.assert_array_equal(root.diff, [1, 1, 0, 0])


def test_settle_brings_only_the_roots_own_forms_up_to_date():
    root, view = root_and_view()
    mine = FakeForm(np.full(4, 4.0, np.float32))
    root.keep(0, mine)
    root.settle()
    assert mine.calls == 1 and (view.data == 4).all()
    theirs = FakeForm(np.full(2, 8.0, np.float32))
    view.keep(0, theirs)
    root.settle()
    assert theirs.calls == 0


def test_threads_reading_one_blob_all_see_its_values():
    blob = Blob((1000,))
    form = FakeForm(np.full(1000, 2.0, np.float32), delay=0.05)
    blob.keep(0, form)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(float(blob.data.min())))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [2.0] * 4 and form.calls == 1


def test_blobs_go_with_their_last_reference():
    """No reference cycles: a net's activations are freed when it goes, not at the next
    garbage collection."""
    gc.disable()
    try:
        root, view = root_and_view()
        refs = [weakref.ref(root), weakref.ref(view)]
        root.keep(0, FakeForm(np.zeros(4, np.float32)))
        del root, view
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_a_pickled_blob_is_up_to_date_and_plain():
    root, view = root_and_view()
    view.keep(1, FakeForm(np.full(2, 6.0, np.float32)))
    copy = pickle.loads(pickle.dumps(root))
    np.testing.assert_array_equal(copy.diff, [6, 6, 0, 0])
    assert copy.head(1) is ARRAY and copy.form(1) is None
    copy.data[...] = 1              # its own arrays
    assert (root.data == 0).all()
