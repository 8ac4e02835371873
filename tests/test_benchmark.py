"""The speed work of issue 7: the PyTorch twin computes what syncsgd computes, the benchmark runs,
and every fast path of the layers (GEMM splitting, per-sample / batched / wide convolution, the
image gradient as a convolution, chunks and pooling parts shared out to threads, chunked fillers)
gives the results of the plain path."""
import os
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN, fillers
from syncsgd.kernels import blas
from syncsgd.layers import convolution, pooling
from syncsgd.net import Net
from syncsgd.plan.costs import net_costs
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward

# The harness is tooling outside the package (tools/benchmark.py, tools/runners.py); appended,
# not prepended, so that tools/time.py and tools/test.py never shadow the standard library.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from benchmark import benchmark, format_table  # noqa: E402
from runners import TorchTwin, benchmark_param, random_inputs, training_flops  # noqa: E402

# Every layer type of the benchmark's nets, small: padded and strided convolution, MAX pooling
# with ceil rounding, AVE pooling, LRN, ReLU and Sigmoid in place, two fully connected layers.
TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 3 dim: 3 dim: 9 dim: 9 } shape { dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
        convolution_param { num_output: 5 kernel_size: 2 pad: 1
                            weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sig1" type: "Sigmoid" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def tiny_net():
    param = text_format.Parse(TINY, pb.NetParameter())
    param.force_backward = True
    net = Net(param, TRAIN)
    inputs = random_inputs(net, seed=3)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    return net, inputs


def test_torch_twin_computes_the_same_loss_and_gradients():
    pytest.importorskip("torch")
    net, inputs = tiny_net()
    net.clear_param_diffs()
    net.forward()
    net.backward()
    loss, grads, input_grads = TorchTwin(net).gradients(inputs)
    assert loss == pytest.approx(net.loss, rel=1e-5)
    assert len(grads) == len(net.learnable_params) == 8
    for info, grad in zip(net.learnable_params, grads):
        np.testing.assert_allclose(info.blob.diff, grad, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{info.layer_name}[{info.index}]")
    np.testing.assert_allclose(net.blobs["data"].diff, input_grads["data"], rtol=1e-4,
                               atol=1e-6)


def test_training_flops_are_the_planners_counts_of_the_work_done():
    net, _ = tiny_net()
    net.bottom_need_backward[1] = [False]        # as in a real net: no gradient for the data
    costs = net_costs(net, 3)
    everything = sum(c.forward + c.weight_grad + c.backward_data for c in costs)
    assert training_flops(net) == pytest.approx(3 * (everything - costs[1].backward_data))


def test_benchmark_runs_and_reports(tmp_path):
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    net_param, solver = benchmark_param(str(model), batch=2)
    assert [lp.input_param.shape[0].dim[0] for lp in net_param.layer[:1]] == [2]
    assert solver.test_interval == 0 and solver.net_param.name == "tiny"
    result = benchmark(str(model), batch=2, rounds=1, warmup=2, turn_seconds=0.05, lr_scale=1.0)
    speeds = result["frameworks"]
    assert speeds["syncsgd"]["images_per_s"] > 0 and speeds["syncsgd"]["peak_rss_mb"] > 0
    assert result["machine_gemm_gflops"] > 0
    if "pytorch" in speeds:
        assert result["speed_ratio"] > 0
        # Same weights, batch and update rule: the same loss before and after one update.
        assert speeds["pytorch"]["warmup_losses"] == pytest.approx(
            speeds["syncsgd"]["warmup_losses"], rel=1e-4)
        assert "| tiny.prototxt | 2 | 3x9x9 |" in format_table([result])


# -- GEMM -----------------------------------------------------------------------------------------
def layouts(a):
    """a, its column-major copy, and a view of it inside a wider array."""
    wide = np.zeros((a.shape[0], a.shape[1] + 3), np.float32)
    wide[:, :a.shape[1]] = a
    return [a, np.asfortranarray(a), wide[:, :a.shape[1]]]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shape", [(5, 7, 3), (300, 20, 40), (20, 3000, 25), (40, 30, 700)])
def test_gemm_matches_numpy_in_every_layout(shape, split, monkeypatch):
    if split:    # pieces over two threads even for these small products
        monkeypatch.setattr(blas, "SPLIT_FLOPS", 0)
        monkeypatch.setattr(blas, "_ALIGN", 2)
        lib = blas._blas()
        if lib.get_threads is not None:
            monkeypatch.setattr(lib, "get_threads", lambda: 2)
            monkeypatch.setattr(lib, "set_threads", lambda n: None)
    m, k, n = shape
    rng = np.random.default_rng(0)
    a0, b0, c0 = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (m, n)))
    for a in layouts(a0):
        for b in layouts(b0):
            for out in layouts(c0.copy()):
                for beta in (0.0, 1.0):
                    out[...] = c0 if beta else np.nan     # beta 0: old values never matter
                    blas.gemm(a, b, out, beta=beta, alpha=0.5)
                    expected = 0.5 * (a0.astype(np.float64) @ b0) + beta * c0
                    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size, piece", [(0, 4), (3, 4), (8, 4), (11, 4)])
def test_in_pieces_covers_every_value_once(size, piece, monkeypatch):
    seen = np.zeros(size, int)
    order = []
    monkeypatch.setattr(blas, "spread", lambda items, work: [work(i, 0) for i in items[::-1]])
    blas.in_pieces(lambda p: (seen.__setitem__(p, seen[p] + 1), order.append(p)), size, piece)
    assert (seen == 1).all() and len(order) == max(1, -(-size // piece))


# -- convolution paths ----------------------------------------------------------------------------
def conv_layer(settings, x, per_sample_pixels, budget):
    """A Convolution on the GEMM kernels (engine CAFFE), whose paths these tests pick."""
    layer = make_layer('name: "c" type: "Convolution" convolution_param { engine: CAFFE '
                       f'{settings} weight_filler {{ type: "gaussian" std: 0.5 }} '
                       'bias_filler { type: "gaussian" std: 0.5 } }')
    layer.per_sample_pixels = per_sample_pixels
    layer.column_budget = budget
    bottom = blobs_from([x])
    return layer, bottom, run_forward(layer, bottom)


@pytest.mark.parametrize("settings", ["num_output: 6 kernel_size: 3 pad: 1",
                                      "num_output: 3 kernel_size: 3 pad: 1",
                                      "num_output: 6 kernel_size: 5 pad: 2",
                                      "num_output: 5 kernel_size: 2 pad: 2",
                                      "num_output: 4 kernel_size: 3 pad: 2 dilation: 2",
                                      "num_output: 4 kernel_size: 2 stride: 2 group: 2"])
def test_convolution_paths_agree(settings, monkeypatch):
    """Batched or per-sample GEMMs, Im2Col, WideIm2Col or RowLowering (forward, and the image
    gradient as a convolution when the feature maps have enough channels), col2im, one chunk or
    several shared out to two threads: the same values, and correct gradients."""
    monkeypatch.setattr(convolution, "threads", lambda: 2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4, 7, 7)).astype(np.float32)
    dy = results = None
    # (per_sample_pixels, WIDE_LIMIT, LOWERING_MIN_CHANNELS, LOWERING_MAX_OUTPUTS, column
    # budget): the first is the plain path. x has 4 channels: at most 5 outputs lower only the
    # image gradient of 6-output layers, at most 3 only the forward of 3-output layers.
    lowered = set()
    for per_sample, wide, channels, outputs, budget in [
            (10**9, 0, 10**9, 128, 1 << 30), (1, 0, 10**9, 128, 1 << 30),
            (10**9, 100, 10**9, 128, 1 << 30), (10**9, 100, 1, 128, 1 << 30),
            (10**9, 100, 1, 5, 1 << 30), (10**9, 100, 1, 3, 1 << 30), (10**9, 100, 1, 128, 1),
            (1, 0, 10**9, 128, 1)]:
        monkeypatch.setattr(convolution, "WIDE_LIMIT", wide)
        monkeypatch.setattr(convolution, "LOWERING_MIN_CHANNELS", channels)
        monkeypatch.setattr(convolution, "LOWERING_MAX_OUTPUTS", outputs)
        layer, bottom, top = conv_layer(settings, x, per_sample, budget)
        lowered.add((layer._lowering is not None, layer._flipped is not None))
        if dy is None:
            dy = rng.standard_normal(top[0].shape).astype(np.float32)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        got = [top[0].data, bottom[0].diff, layer.blobs[0].diff, layer.blobs[1].diff]
        if results is None:
            results = [a.copy() for a in got]
        for value, expected in zip(got, results):
            np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
    if "dilation" in settings or "group" in settings:
        assert lowered == {(False, False)}
    elif "pad: 2" in settings and "kernel_size: 2" in settings:     # pad >= kernel: no flip
        assert lowered == {(False, False), (True, False)}
    else:
        assert {(True, True), (True, False) if "num_output: 3" in settings
                else (False, True)} < lowered
    # The last path: per-sample GEMMs, one sample per chunk, chunks on two threads.
    assert layer._chunk == 1 and layer._per_sample
    assert check_gradient(layer, blobs_from([x[:3]]), max_points=30) > 0


@pytest.mark.parametrize("flipped_limit", [100, 0])
def test_row_lowering_gradient_with_two_bottoms_and_chunks(flipped_limit, monkeypatch):
    """The image gradient by the flipped lowering, or (limit 0) by unlowering."""
    monkeypatch.setattr(convolution, "FLIPPED_LIMIT", flipped_limit)
    monkeypatch.setattr(convolution, "LOWERING_MIN_CHANNELS", 1)
    monkeypatch.setattr(convolution, "LOWERED_MIN_COLUMNS", 1)
    monkeypatch.setattr(convolution, "threads", lambda: 2)
    layer = make_layer('name: "c" type: "Convolution" convolution_param { engine: CAFFE '
                       'num_output: 3 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 1 weight_filler { type: '
                       '"gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')
    rng = np.random.default_rng(2)
    bottom = blobs_from([rng.standard_normal((3, 2, 5, 4)).astype(np.float32),
                         rng.standard_normal((3, 2, 5, 4)).astype(np.float32)])
    run_forward(layer, bottom, n_top=2)
    assert layer._lowering is not None and layer._chunk == 1
    assert (layer._flipped is not None) == bool(flipped_limit)
    assert check_gradient(layer, bottom, n_top=2, max_points=40) > 0


def test_weight_gradient_does_not_depend_on_which_thread_takes_which_chunk(monkeypatch):
    """Chunks shared out to threads add into per-group matrices: with the work run in another
    order and by other workers, the weight gradient must be the same to the bit (reruns are
    bit-identical whatever the timing)."""
    monkeypatch.setattr(convolution, "threads", lambda: 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 16, 6, 6)).astype(np.float32)
    settings = "num_output: 8 kernel_size: 3 pad: 1"
    grads = []
    for order in (None, "shuffled"):
        def spread(items, work, share=None, order=order):
            indices = list(range(len(items)))
            if order:
                np.random.default_rng(len(items)).shuffle(indices)
            for step, i in enumerate(indices):
                work(items[i], (step + (order is not None)) % 2)
        monkeypatch.setattr(blas, "spread", spread)
        for channels in (1, 10**9):                    # lowered rows, and im2col
            monkeypatch.setattr(convolution, "LOWERING_MIN_CHANNELS", channels)
            layer, bottom, top = conv_layer(settings, x, 10**9, 1)
            top[0].diff[...] = rng.standard_normal(top[0].shape).astype(np.float32) \
                if not grads else grads[0][1]
            layer.backward(top, [False], bottom)
            grads.append((layer.blobs[0].diff.copy(), top[0].diff.copy()))
    assert layer._chunk == 1
    for (first, _), (again, _) in zip(grads[:2], grads[2:]):
        np.testing.assert_array_equal(again, first)


# -- fillers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ['type: "gaussian" std: 0.3 sparse: 2', 'type: "msra"',
                                  'type: "xavier" variance_norm: AVERAGE'])
def test_chunked_fillers_draw_what_one_draw_gives(text, monkeypatch):
    filler = text_format.Parse(text, pb.FillerParameter())
    whole = np.empty((6, 5, 3), np.float32)
    fillers.fill(whole, filler, np.random.default_rng(4))
    monkeypatch.setattr(fillers, "CHUNK", 7)
    chunked = np.empty((6, 5, 3), np.float32)
    fillers.fill(chunked, filler, np.random.default_rng(4))
    np.testing.assert_array_equal(chunked, whole)


# -- pooling paths --------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", ["pool: MAX kernel_size: 3 stride: 2",
                                      "pool: MAX kernel_size: 2 stride: 2",
                                      "pool: MAX kernel_size: 3 stride: 2 pad: 1",
                                      "pool: AVE kernel_size: 3 stride: 2 pad: 1",
                                      "pool: AVE kernel_size: 2 stride: 2"])
def test_pooling_over_threads_matches_one_thread(settings, monkeypatch):
    """The batch split into parts of one image plane for two threads: the values, mask and
    gradients of the whole batch at once."""
    x = np.random.default_rng(5).permutation(5 * 3 * 8 * 8).reshape(5, 3, 8, 8).astype(np.float32)
    results = []
    for values in (1 << 60, 0):
        monkeypatch.setattr(pooling, "PART_VALUES", values)
        monkeypatch.setattr(blas, "threads", lambda: 2)
        layer = make_layer(f'name: "p" type: "Pooling" pooling_param {{ {settings} }}')
        bottom = blobs_from([x])
        top = run_forward(layer, bottom, n_top=2 if "MAX" in settings else 1)
        assert len(layer._parts(5)) == (1 if values else 5)
        top[0].diff[...] = np.arange(top[0].count, dtype=np.float32).reshape(top[0].shape)
        layer.backward(top, [True], bottom)
        results.append([t.data.copy() for t in top] + [bottom[0].diff.copy()])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_tiled_pooling_gradient(method):
    layer = make_layer(f'name: "p" type: "Pooling" pooling_param {{ pool: {method} '
                       'kernel_size: 2 stride: 2 }')
    x = np.random.default_rng(6).permutation(2 * 2 * 6 * 4).reshape(2, 2, 6, 4)
    bottom = blobs_from([(x * 0.1).astype(np.float32)])
    run_forward(layer, bottom)
    # The planes are the windows (no junk columns): backward writes each gradient once.
    assert (layer._rows.length, layer._cols.length) == layer._pooled
    assert check_gradient(layer, bottom) > 0
