"""Real mobile, SE and segmentation nets that use the fork types ReLU6, DepthwiseConvolution,
Axpy and BN (tests/zoo/README.md names each file's origin), built by syncsgd as published and
run beside a reference on the same seeded weights.

The reference is the net written in BVLC's layers with the forks' semantics (`bvlc_form`):
ReLU6 -> Clip; DepthwiseConvolution -> Convolution (group = channels: the fork's CPU path);
Axpy(a, x, y) ->
Reshape a to (N, C), two-bottom Scale of x on axis 0, Eltwise SUM with y; PSPNet's BN (frozen,
or in TEST) -> BatchNorm with use_global_stats and the BN's eps, then Scale with bias; SegNet's
and ENet's BN in bn_mode INFERENCE -> Scale with bias. The reference is seeded as
tests/test_zoo_opencv.py seeds nets, and its values reach the fork-form net in the forks' blob
order through a .caffemodel that syncsgd writes and reads back.

OpenCV runs the reference where it can. It has no DepthwiseConvolution or BN, and its Axpy
computes a * y + x where the fork's axpy_layer.cpp computes a * x + y; it has ReLU6, but it
convolves a 1x1 map with padding wrongly in a depthwise convolution, which MobileNetv2-SSDLite
does at any input size (both shown below). SegNet and ENet need SegNet's Upsample, which
OpenCV's Caffe importer lacks. For those nets syncsgd runs the reference: a documented check of
the fork layers inside whole nets against BVLC's layers, whose own values are checked against
numpy references of the forks' C++ (and ReLU6 against OpenCV) in
tests/test_layers_fork_mobile_seg.py.

Sizes are small. Where a net fixes a size for its published input, that size is rewritten to
the one it becomes at the small input (`adjust`): PSPNet's pyramid pooling kernels and Interp
sizes, SegNet's Upsample output sizes (scale 2 instead), SE-ResNet-50's 7x7 final pooling
(global instead).
"""
import os

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.proto import pb
from tests.test_layers_fork import detections
from tests.test_zoo_opencv import (ZOO, assert_agrees, compared_blobs, fill_seeded, input_arrays,
                                   net_at_size, opencv_forward, producer, reload_weights)

cv2 = pytest.importorskip("cv2")

PSP_FEATURE = 6      # PSPNet's last feature map at a 41x41 input (60 at its 473x473)


def pyramid_at(param, size=PSP_FEATURE, published=60):
    """PSPNet's pyramid pooling (bins 1, 2, 3, 6 over a published x published map) and the
    Interp layers back to that map, for a size x size map."""
    for layer in param.layer:
        p = layer.pooling_param
        if layer.type == "Pooling" and p.pool == p.AVE and published % p.kernel_size == 0:
            p.kernel_size = p.stride = size * p.kernel_size // published
        if layer.type == "Interp" and layer.interp_param.height == published:
            layer.interp_param.height = layer.interp_param.width = size


def upsample_by_two(param):
    """SegNet's Upsample layers, whose output sizes are set for 360x480 (upsample_h and
    upsample_w, or pad_out_h), as plain scale 2: the same at inputs whose pooled sizes are even."""
    for layer in param.layer:
        if layer.type == "Upsample":
            layer.upsample_param.Clear()
            layer.upsample_param.scale = 2


def global_last_pool(param):
    """SE-ResNet-50's 7x7 average pooling of the 7x7 map as global pooling."""
    for layer in param.layer:
        if layer.type == "Pooling" and layer.pooling_param.kernel_size == 7:
            layer.pooling_param.ClearField("kernel_size")
            layer.pooling_param.ClearField("stride")
            layer.pooling_param.global_pooling = True


# id -> (prototxt, input height and width, rewrite for that size or None, OpenCV runs the
# reference). fill_seeded's forward per layer and the two runs dominate the time: sizes are
# the smallest the nets' strides allow.
NETS = {
    "mobilenet_v2_ssdlite": ("chuanqi305_MobileNetv2-SSDLite/ssdlite/voc/deploy.prototxt",
                             (96, 96), None, False),
    "mobilenet_depthwise": (("yonghenglh6_DepthwiseConvolution/example/"
                             "depthwised_mobilenet_deploy.prototxt"), (48, 48), None, True),
    "se_resnet50": ("hujie-frank_SENet/models/SE-ResNet-50.prototxt", (32, 32),
                    global_last_pool, True),
    "pspnet50_ade20k": ("hszhao_PSPNet/evaluation/prototxt/pspnet50_ADE20K_473.prototxt",
                        (41, 41), pyramid_at, True),
    "enet": ("TimoSaemann_ENet/prototxts/enet_deploy_final.prototxt", (32, 32), None, False),
    "segnet": ("alexgkendall_SegNet-Tutorial/Models/segnet_inference.prototxt", (32, 32),
               upsample_by_two, False),
    "segnet_basic": ("alexgkendall_SegNet-Tutorial/Models/segnet_basic_inference.prototxt",
                     (32, 32), upsample_by_two, False),
}


def bvlc_form(param):
    """The net with each fork layer replaced by BVLC layers computing the same (see the module
    docstring); blob names are kept, and a BN's parameters live in layers named after it."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        out.layer.extend(bvlc_layers(layer))
    return out


def bvlc_layers(layer):
    name, top = layer.name, layer.top[0] if layer.top else None
    if layer.type == "ReLU6":
        p = layer.relu6_param
        assert p.negative_slope == 0, f"{name}: a leaky ReLU6 has no BVLC form"
        clip = pb.LayerParameter(name=name, type="Clip", bottom=layer.bottom, top=[top])
        clip.clip_param.min, clip.clip_param.max = 0, p.threshold
        return [clip]
    if layer.type == "DepthwiseConvolution":
        conv = pb.LayerParameter()
        conv.CopyFrom(layer)
        conv.type = "Convolution"
        return [conv]
    if layer.type == "Axpy":
        a, x, y = layer.bottom
        reshape = pb.LayerParameter(name=f"{name}/a", type="Reshape", bottom=[a],
                                    top=[f"{name}/a"])
        reshape.reshape_param.shape.dim.extend([0, -1])
        scale = pb.LayerParameter(name=f"{name}/ax", type="Scale", bottom=[x, f"{name}/a"],
                                  top=[f"{name}/ax"])
        scale.scale_param.axis = 0
        add = pb.LayerParameter(name=name, type="Eltwise", bottom=[f"{name}/ax", y], top=[top])
        return [reshape, scale, add]
    if layer.type == "BN":
        p = layer.bn_param
        if p.HasField("bn_mode"):
            assert p.bn_mode == p.INFERENCE, f"{name}: a deploy net's SegNet BN is INFERENCE"
            scale = pb.LayerParameter(name=name, type="Scale", bottom=layer.bottom, top=[top])
            scale.scale_param.bias_term = True
            return [scale]
        norm = pb.LayerParameter(name=name, type="BatchNorm", bottom=layer.bottom, top=[top])
        norm.batch_norm_param.use_global_stats = True
        norm.batch_norm_param.eps = p.eps
        scale = pb.LayerParameter(name=f"{name}/scale", type="Scale", bottom=[top], top=[top])
        scale.scale_param.bias_term = True
        return [norm, scale]
    return [layer]


def fork_values(net, reference):
    """Give each layer of the fork-form `net` the reference's seeded values, BN's in the forks'
    blob order: SegNet's [scale, shift], PSPNet's [slope, bias, mean, variance]."""
    for name, layer in net.layer_dict.items():
        if not layer.blobs:
            continue
        theirs = [b.data for b in reference.layer_dict[name].blobs]
        if layer.type == "BN" and not layer.segnet:
            mean, var, factor = theirs
            scale, shift = [b.data for b in reference.layer_dict[f"{name}/scale"].blobs]
            theirs = [scale, shift, mean / factor[0], var / factor[0]]
        for blob, values in zip(layer.blobs, theirs, strict=True):
            blob.data[...] = values.reshape(blob.shape)


def opencv_outputs(tmp_path, param, reference, inputs, names):
    prototxt, weights = str(tmp_path / "bvlc.prototxt"), str(tmp_path / "bvlc.caffemodel")
    with open(prototxt, "w") as f:
        f.write(text_format.MessageToString(param))
    reference.save(weights)
    return opencv_forward(prototxt, weights, inputs, names)


@pytest.mark.parametrize("key", sorted(NETS))
def test_fork_net_equals_its_bvlc_form(tmp_path, key):
    relative, size, adjust, with_opencv = NETS[key]
    param = net_at_size(os.path.join(ZOO, relative), size)
    if adjust is not None:
        adjust(param)
    bvlc = bvlc_form(param)
    reference = syncsgd.Net(bvlc, syncsgd.TEST)
    inputs = input_arrays(reference, seed=2)
    fill_seeded(reference, inputs, seed=1)
    names = compared_blobs(reference, bvlc)
    assert names, "the net has no output to compare"
    if with_opencv:
        theirs = opencv_outputs(tmp_path, bvlc, reference, inputs, names)
    else:
        reference.forward(**inputs)
        theirs = {layer: reference.blobs[blob].data.copy() for layer, blob in names.items()}

    net = syncsgd.Net(param, syncsgd.TEST)
    fork_values(net, reference)
    weights = str(tmp_path / "fork.caffemodel")
    net.save(weights)
    reload_weights(net, weights)
    net.forward(**inputs)
    for layer_name, blob in names.items():
        ours, want = net.blobs[blob].data, theirs[layer_name]
        if producer(bvlc, blob)[1] == "DetectionOutput":
            ours, want = detections(ours), detections(want)
        assert_agrees(blob, ours, want)


def test_opencv_axpy_is_not_the_forks(tmp_path):
    """Why SE-ResNet-50 is compared in its BVLC form: OpenCV 4's Axpy scales its third bottom
    where the fork's scales the second (a * y + x, not a * x + y)."""
    text = """input: "d" input_shape { dim: 1 dim: 3 dim: 4 dim: 4 }
        layer { name: "a" type: "Pooling" bottom: "d" top: "a"
                pooling_param { pool: AVE global_pooling: true } }
        layer { name: "x" type: "Power" bottom: "d" top: "x" power_param { scale: 2 } }
        layer { name: "y" type: "Power" bottom: "d" top: "y" power_param { shift: 3 } }
        layer { name: "f" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "f" }"""
    path = tmp_path / "axpy.prototxt"
    path.write_text(text)
    d = np.random.default_rng(0).uniform(0.5, 1.5, (1, 3, 4, 4)).astype(np.float32)
    cv = cv2.dnn.readNetFromCaffe(str(path))
    cv.setInput(d, "d")
    theirs = cv.forward("f")
    net = syncsgd.Net(str(path), syncsgd.TEST)
    net.forward(d=d)
    a = d.mean(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(net.blobs["f"].data, a * (2 * d) + (d + 3), rtol=1e-6)
    np.testing.assert_allclose(theirs, a * (d + 3) + 2 * d, rtol=1e-6)


def test_opencv_depthwise_of_a_one_pixel_map_is_not_a_convolution(tmp_path):
    """Why MobileNetv2-SSDLite is not compared with OpenCV: its last depthwise 3x3 convolutions
    (pad 1) see 1x1 maps, where only the kernel's centre meets the input; OpenCV 4 gives other
    values."""
    path = tmp_path / "dw.prototxt"
    path.write_text("""input: "d" input_shape { dim: 1 dim: 4 dim: 1 dim: 1 }
        layer { name: "c" type: "Convolution" bottom: "d" top: "c" convolution_param {
                num_output: 4 group: 4 kernel_size: 3 pad: 1 bias_term: false } }""")
    net = syncsgd.Net(str(path), syncsgd.TEST)
    rng = np.random.default_rng(0)
    weights = net.params["c"][0].data
    weights[...] = rng.uniform(0.5, 1.5, weights.shape)
    net.save(str(tmp_path / "dw.caffemodel"))
    d = rng.uniform(0.5, 1.5, (1, 4, 1, 1)).astype(np.float32)
    net.forward(d=d)
    cv = cv2.dnn.readNetFromCaffe(str(path), str(tmp_path / "dw.caffemodel"))
    cv.setInput(d, "d")
    want = weights[:, 0, 1, 1] * d.ravel()
    np.testing.assert_allclose(net.blobs["c"].data.ravel(), want, rtol=1e-6)
    assert np.abs(cv.forward("c").ravel() - want).max() > 1e-3 * np.abs(want).max()
