"""Convolution, Deconvolution and Im2col over any number of spatial axes (BVLC's N-D layers):
against direct float64 references, numeric gradients and the 2-D kernels. Against BVLC Caffe
itself: the conv_1d, conv_3d, ..., im2col_3d cases of tests/oracle_cases.py.
"""
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN
from syncsgd.blob import Blob
from syncsgd.errors import ShapeError
from syncsgd.kernels import onednn
from syncsgd.kernels.plans import THRESHOLDS
from syncsgd.net import Net
from syncsgd.plan.costs import layer_cost
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward

FILLERS = ('weight_filler { type: "gaussian" std: 0.5 } '
           'bias_filler { type: "gaussian" std: 0.5 }')


def layer_text(kind, settings):
    return f'name: "c" type: "{kind}" convolution_param {{ {settings} {FILLERS} }}'


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def per_axis(settings, **values):
    """convolution_param text with a field given once per spatial axis: kernel_size=(3, 2)."""
    return settings + "".join(f" {field}: {v}" for field, vs in values.items() for v in vs)


# -- references (float64, one kernel offset at a time, written for clarity) -----------------------
def conv_reference(x, w, b, pad, stride, dilation, group):
    """y[n, m, o] = sum over c and kernel offsets k of x[n, c, o*stride + k*dilation - pad] *
    w[m, c, k], zero outside x."""
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    kernel = w.shape[2:]
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(p, p) for p in pad])
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1
           for size, k, p, s, d in zip(x.shape[2:], kernel, pad, stride, dilation)]
    mg = m // group
    y = np.zeros((n, m, *out))
    for offset in np.ndindex(*kernel):
        window = xp[(slice(None), slice(None)) + tuple(
            slice(k * d, k * d + s * (o - 1) + 1, s)
            for k, d, s, o in zip(offset, dilation, stride, out))]
        for g in range(group):
            y[:, g * mg:(g + 1) * mg] += np.einsum(
                "nc...,mc->nm...", window[:, g * cg:(g + 1) * cg],
                w[(slice(g * mg, (g + 1) * mg), slice(None)) + offset])
    if b is not None:
        y += b.reshape((1, m) + (1,) * len(out))
    return y


def deconv_reference(x, w, b, pad, stride, dilation, group):
    """Every input value scatters its kernel into the output, which is then cropped by pad."""
    n, c = x.shape[:2]
    mg = w.shape[1]
    kernel = w.shape[2:]
    full = [s * (size - 1) + d * (k - 1) + 1
            for size, k, s, d in zip(x.shape[2:], kernel, stride, dilation)]
    y = np.zeros((n, mg * group, *full))
    cg = c // group
    for offset in np.ndindex(*kernel):
        where = tuple(slice(k * d, k * d + s * (size - 1) + 1, s)
                      for k, d, s, size in zip(offset, dilation, stride, x.shape[2:]))
        for g in range(group):
            y[(slice(None), slice(g * mg, (g + 1) * mg)) + where] += np.einsum(
                "nc...,cm->nm...", x[:, g * cg:(g + 1) * cg].astype(np.float64),
                w[(slice(g * cg, (g + 1) * cg), slice(None)) + offset])
    y = y[(slice(None), slice(None)) + tuple(slice(p, f - p) for p, f in zip(pad, full))]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(full))
    return y


# -- N-D convolution and deconvolution --------------------------------------------------------
# name: (convolution_param settings, bottom shape, pad, stride, dilation, group)
CASES = {
    "1d": ("num_output: 3 kernel_size: 3", (2, 2, 7), (0,), (1,), (1,), 1),
    "1d_strided_padded_dilated_grouped_no_bias": (
        "num_output: 4 kernel_size: 3 stride: 2 pad: 2 dilation: 2 group: 2 bias_term: false",
        (2, 4, 9), (2,), (2,), (2,), 2),
    "3d": ("num_output: 2 kernel_size: 2", (2, 2, 3, 4, 3), (0,) * 3, (1,) * 3, (1,) * 3, 1),
    "3d_per_axis_grouped": (
        per_axis("num_output: 4 group: 2", kernel_size=(3, 2, 2), stride=(1, 2, 1),
                 pad=(1, 0, 1), dilation=(1, 1, 2)),
        (2, 4, 4, 5, 4), (1, 0, 1), (1, 2, 1), (1, 1, 2), 2),
    "3d_strided_padded_no_bias": (
        "num_output: 3 kernel_size: 3 stride: 2 pad: 1 bias_term: false", (1, 2, 5, 4, 5),
        (1,) * 3, (2,) * 3, (1,) * 3, 1),
    "4d": ("num_output: 2 kernel_size: 2 pad: 1 stride: 2", (1, 2, 3, 2, 3, 2), (1,) * 4,
           (2,) * 4, (1,) * 4, 1),
    "0d": ("num_output: 3", (4, 5), (), (), (), 1),
}
GRADIENT_CASES = [name for name in CASES if name[0] in "13"]
# How the plan runs the batch: (thresholds, threads): one GEMM over the whole batch, one per
# sample, or chunks of one sample shared out to two threads.
PATHS = {"batched": ({}, 1), "per_sample": ({"per_sample_pixels": 1}, 1),
         "chunks": ({"column_budget_bytes": 1}, 2)}


def nd_layer(kind, name, path, thread_budget):
    settings, shape, *_ = CASES[name]
    layer = make_layer(layer_text(kind, settings))
    thresholds, threads = PATHS[path]
    layer.thresholds = replace(THRESHOLDS, **thresholds)
    thread_budget(threads)
    return layer, blobs_from([randn(*shape)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("name", CASES)
def test_forward_matches_the_direct_reference(name, kind, path, thread_budget):
    settings, shape, pad, stride, dilation, group = CASES[name]
    layer, bottom = nd_layer(kind, name, path, thread_budget)
    top = run_forward(layer, bottom)
    assert layer.plan.forward == "columns" and layer.plan.columns == "im2col"
    assert layer.plan.per_sample == (path == "per_sample")
    assert len(layer._chunks) == (shape[0] if path == "chunks" else 1)
    w = layer.blobs[0].data
    b = layer.blobs[1].data if len(layer.blobs) > 1 else None
    reference = conv_reference if kind == "Convolution" else deconv_reference
    expected = reference(bottom[0].data, w, b, pad, stride, dilation, group)
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_gradient(name, kind, path, thread_budget):
    layer, bottom = nd_layer(kind, name, path, thread_budget)
    assert check_gradient(layer, bottom, max_points=25) > 0


def test_deconvolution_is_the_transpose_of_convolution_in_3d():
    """<conv(x), y> = <x, deconv(y)> with the same weights and no bias."""
    window = per_axis("group: 2 bias_term: false", kernel_size=(2, 3, 3), stride=(2, 1, 1),
                      pad=(1, 1, 0), dilation=(1, 2, 1))
    conv, deconv = (make_layer(layer_text(kind, f"num_output: {n} {window}"))
                    for kind, n in (("Convolution", 4), ("Deconvolution", 2)))
    x = randn(2, 2, 6, 6, 4)       # sizes the deconvolution gives back
    forward = run_forward(conv, blobs_from([x]))[0].data
    y = randn(*forward.shape, seed=1)
    run_forward(deconv, blobs_from([y]))
    deconv.blobs[0].data[...] = conv.blobs[0].data
    back = run_forward(deconv, blobs_from([y]))[0].data
    assert back.shape == x.shape
    assert np.isclose(np.vdot(forward, y), np.vdot(x, back), rtol=1e-4)


# -- 2-D through the N-D kernel ---------------------------------------------------------------
def kernel_kind(plan):
    """What makes a plan's forward columns: "onednn", "lowered", "wide" or "im2col"."""
    return plan.columns if plan.forward == "columns" else plan.forward


@pytest.mark.parametrize("engine", ["CAFFE", "DEFAULT"])
@pytest.mark.parametrize("settings, planar_kind", [
    ("num_output: 4 kernel_size: 3 pad: 1", "wide"),
    ("num_output: 20 kernel_size: 3", "lowered"),
    ("num_output: 3 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_w: 1", "im2col"),
    ("num_output: 4 kernel_size: 3 pad: 2 dilation: 2 group: 2", "wide")])
def test_force_nd_im2col_computes_what_the_2d_kernels_compute(settings, planar_kind, engine):
    """BVLC's force_nd_im2col only changes how the columns are made: the plan runs Im2Col's
    columns instead of the 2-D kernels (oneDNN, row lowering, wide columns), to the same
    values."""
    x, results, kinds = randn(4, 16, 7, 8), [], []
    for forced in (False, True):
        layer = make_layer(layer_text("Convolution", f"{settings} engine: {engine} "
                                      f"force_nd_im2col: {str(forced).lower()}"))
        bottom = blobs_from([x])
        top = run_forward(layer, bottom)
        top[0].diff[...] = randn(*top[0].shape, seed=1)
        layer.backward(top, [True], bottom)
        results.append([top[0].data, bottom[0].diff] + [b.diff for b in layer.blobs])
        kinds.append((kernel_kind(layer.plan), layer.plan.image_grad))
    on_onednn = engine == "DEFAULT" and onednn.available()
    assert kinds == [("onednn", "onednn") if on_onednn else (planar_kind, kinds[0][1]),
                     ("im2col", "columns")]
    for planar, nd in zip(*results):
        np.testing.assert_allclose(nd, planar, rtol=1e-5, atol=1e-5 * np.abs(planar).max())


# -- the channel axis ------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("axis, shape", [(2, (2, 3, 4, 6, 5)), (2, (2, 3, 4, 7)),
                                         (0, (4, 6, 5)), (-3, (2, 3, 4, 6, 5))])
def test_axes_before_the_channel_axis_are_samples(kind, axis, shape, stride):
    """As BVLC: (A, B, C, *size) with axis 2 is the convolution of A*B samples (C, *size); with
    axis 0 the whole blob is one sample, which lanes then must not cut. oneDNN, which reads the
    blobs themselves, is left out: the layer runs the GEMM kernels of engine CAFFE (2-D ones
    included: WideIm2Col for stride 1)."""
    settings = f"num_output: 3 kernel_size: 3 pad: 1 stride: {stride}"
    x = randn(*shape)
    channel = axis % len(shape)
    layer = make_layer(layer_text(kind, f"{settings} axis: {axis}"))
    bottom = blobs_from([x])
    top = run_forward(layer, bottom)
    flat = make_layer(layer_text(kind, f"{settings} engine: CAFFE"))
    samples = int(np.prod(shape[:channel]))
    flat_bottom = blobs_from([x.reshape((samples,) + shape[channel:])])
    expected = run_forward(flat, flat_bottom)
    assert top[0].shape == shape[:channel] + expected[0].shape[1:]
    assert layer.sample_wise == (channel > 0)
    assert layer.plan == flat.plan
    np.testing.assert_array_equal(top[0].data.reshape(expected[0].shape), expected[0].data)
    dy = randn(*expected[0].shape, seed=1)
    top[0].diff[...] = dy.reshape(top[0].shape)
    expected[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    flat.backward(expected, [True], flat_bottom)
    np.testing.assert_array_equal(bottom[0].diff.reshape(flat_bottom[0].shape),
                                  flat_bottom[0].diff)
    for ours, theirs in zip(layer.blobs, flat.blobs):
        np.testing.assert_array_equal(ours.diff, theirs.diff)


def test_lanes_carry_a_3d_net(monkeypatch, thread_budget):
    """3-D convolutions stay sample-wise: lanes run them, to the layer-by-layer values."""
    thread_budget(2)
    text = """
    layer { name: "data" type: "Input" top: "data" top: "label"
            input_param { shape { dim: 6 dim: 2 dim: 5 dim: 6 dim: 5 } shape { dim: 6 } } }
    layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
            convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 %s } }
    layer { name: "relu" type: "ReLU" bottom: "conv1" top: "conv1" }
    layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
            convolution_param { num_output: 3 kernel_size: 2 %s } }
    layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
            inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
    layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """ % (FILLERS, FILLERS)
    results = []
    for lanes in ("0", "1"):
        monkeypatch.setenv("SYNCSGD_LANES", lanes)
        net = Net(text_format.Parse(text, pb.NetParameter()), TRAIN)
        net.blobs["data"].data[...] = randn(6, 2, 5, 6, 5)
        net.blobs["label"].data[...] = np.arange(6) % 3
        net.forward()
        net.backward()
        results.append([net.blobs["conv2"].data.copy()]
                       + [b.diff.copy() for bs in net.params.values() for b in bs])
    assert net.lanes.engaged is not None and net.lanes.engaged.count == 2
    for plain, laned in zip(*results):
        np.testing.assert_allclose(laned, plain, rtol=1e-5, atol=1e-6)


# -- Im2col -----------------------------------------------------------------------------------
def im2col_reference(x, kernel, pad, stride, dilation):
    """(n, C, *size) -> (n, C*prod(kernel), *out), row (c, k1, ..., kN) as Caffe: the columns
    of a convolution whose weights pick one value each."""
    c = x.shape[1]
    rows = c * int(np.prod(kernel))
    picks = np.eye(rows).reshape((rows, c) + tuple(kernel))
    return conv_reference(x, picks, None, pad, stride, dilation, 1)


@pytest.mark.parametrize("settings, shape, kernel, pad, stride, dilation", [
    ("kernel_size: 3 stride: 2 pad: 1", (2, 3, 8), (3,), (1,), (2,), (1,)),
    (per_axis("", kernel_size=(2, 3, 2), stride=(1, 2, 1), pad=(1, 1, 0), dilation=(1, 1, 2)),
     (2, 2, 3, 5, 4), (2, 3, 2), (1, 1, 0), (1, 2, 1), (1, 1, 2)),
    ("kernel_size: 2 force_nd_im2col: true", (1, 2, 4, 3), (2, 2), (0, 0), (1, 1), (1, 1))])
def test_im2col_nd(settings, shape, kernel, pad, stride, dilation):
    layer_param = f'name: "i" type: "Im2col" convolution_param {{ {settings} }}'
    x = randn(*shape)
    top = run_forward(make_layer(layer_param), blobs_from([x]))
    np.testing.assert_array_equal(top[0].data, im2col_reference(x, kernel, pad, stride,
                                                                dilation).astype(np.float32))
    assert check_gradient(make_layer(layer_param), blobs_from([x]), max_points=40) > 0


# -- errors name the layer and the fix ---------------------------------------------------------
@pytest.mark.parametrize("kind, settings, shape, message", [
    ("Convolution", "num_output: 2 kernel_h: 2 kernel_w: 2", (1, 2, 4, 4, 4),
     r"kernel_h and kernel_w are for 2-D convolutions, this one has 3 spatial axes: give "
     "kernel_size once, or once per spatial axis"),
    ("Deconvolution", "num_output: 2 kernel_size: 2 pad_h: 1", (1, 2, 4),
     "pad_h and pad_w are for 2-D"),
    ("Convolution", "num_output: 2 kernel_size: 2 kernel_size: 2", (1, 2, 4, 4, 4),
     r"kernel_size is given 2 times; give it once or once per spatial axis \(3\)"),
    ("Convolution", "num_output: 2 kernel_size: 2 stride: 1 stride: 1 stride: 1 stride: 1",
     (1, 2, 4, 4, 4), r"stride is given 4 times"),
    ("Convolution", "num_output: 2", (1, 2, 4, 4, 4), r"kernel_size is required \(once, or "
     r"once per spatial axis\)$"),
    ("Convolution", "num_output: 2 kernel_size: 3 kernel_size: 9", (1, 2, 4, 8),
     r"output size \(2, 0\) from input \(4, 8\) is empty: check kernel \(3, 9\)"),
    ("Convolution", "num_output: 2 kernel_size: 2 dilation: 1 dilation: 0", (1, 2, 4, 4),
     r"dilation must be positive, got \(1, 0\)"),
    ("Im2col", "kernel_size: 2 axis: -1", (2, 4),
     r"needs a spatial axis after the channel axis: convolution_param.axis -1 of bottom "
     r"\(2, 4\) leaves none; set axis to the channel axis"),
])
def test_bad_geometry_names_the_layer_and_the_fix(kind, settings, shape, message):
    layer = make_layer(f'name: "bad" type: "{kind}" convolution_param {{ {settings} }}')
    with pytest.raises(ShapeError, match=f"layer 'bad' \\({kind}\\): .*{message}"):
        run_forward(layer, [Blob(shape)])


@pytest.mark.parametrize("kind", ["Convolution", "Im2col"])
def test_reshape_to_another_number_of_axes_is_refused(kind):
    layer = make_layer(layer_text(kind, "num_output: 2 kernel_size: 2"))
    bottom, top = [Blob((1, 2, 4, 4, 4))], [Blob()]
    layer.setup(bottom, top)
    bottom[0].reshape(1, 2, 4, 4)
    with pytest.raises(ShapeError, match="does not fit"):
        layer.reshape(bottom, top)


# -- the planner -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, settings, shape, positions", [
    ("Convolution", "num_output: 4 kernel_size: 3 pad: 1 stride: 2", (1, 2, 5, 6, 7),
     3 * 3 * 4),
    ("Deconvolution", "num_output: 4 kernel_size: 2 stride: 2", (1, 2, 3, 4, 5), 3 * 4 * 5),
    ("Convolution", "num_output: 4 kernel_size: 3 axis: 2", (1, 3, 2, 9), 3 * 7),
    ("Deconvolution", "num_output: 4 kernel_size: 3 axis: 2", (1, 3, 2, 9), 3 * 9)])
def test_planner_counts_nd_flops(kind, settings, shape, positions):
    """Each weight is applied once per feature-map position: 2 FLOPs each way per sample."""
    layer = make_layer(layer_text(kind, settings))
    bottom = [Blob(shape)]
    top = run_forward(layer, bottom)
    cost = layer_cost(layer, bottom, top, batch=1)
    assert cost.forward == cost.backward_data == cost.weight_grad == (
        2.0 * layer.blobs[0].count * positions)
    assert cost.geometry["ifm"] == layer.channels and len(cost.geometry["out"]) == len(
        layer.kernel)


def test_plan_command_plans_a_3d_net(tmp_path):
    net = tmp_path / "net3d.prototxt"
    net.write_text("""
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 2 dim: 6
            dim: 6 dim: 6 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 4 kernel_size: 3 } }
    layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
            convolution_param { num_output: 2 kernel_size: 3 } }""")
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "plan", "--model", str(net),
                           "--batch", "8", "--nodes", "1,2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "conv" in done.stdout and "up" in done.stdout
