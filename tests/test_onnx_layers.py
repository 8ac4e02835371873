"""Each layer converter of the ONNX export (syncsgd/onnx/layers.py) on small nets: the model run
in ONNX Runtime equals syncsgd's forward on the same input, max |difference| <= 1e-4 * max
|syncsgd's output|. The nets are exported with a dynamic batch and run at another batch than
the prototxt's where the layer allows it, so the converters' shapes are checked too.

Caffe's pooling output size (rounded up, the last window starting inside the image and its
padding) is checked on shapes where rounding down would give another size.
"""
import numpy as np
import onnx
import pytest

import syncsgd
from syncsgd import log
from syncsgd.errors import SyncSGDError
from syncsgd.onnx import TOLERANCE, check, export

pytest.importorskip("onnxruntime")

BATCH = 2            # the prototxt's batch; the dynamic-batch runs use BATCH + 1


def net_text(inputs, layers):
    """A deploy net: Input layers `inputs` {name: shape}, then the layers' text."""
    heads = "".join(f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param '
                    f'{{ shape {{ {" ".join(f"dim: {d}" for d in (BATCH,) + shape)} }} }} }}\n'
                    for name, shape in inputs.items())
    return f'name: "catalogue"\n{heads}{layers}'


def build(tmp_path, inputs, layers):
    path = tmp_path / "net.prototxt"
    path.write_text(net_text(inputs, layers))
    log.configure(enabled=False)
    net = syncsgd.Net(str(path), syncsgd.TEST)
    rng = np.random.default_rng(3)
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = rng.uniform(0.5, 1.5, blob.shape) * rng.choice([-1, 1], blob.shape)
        # Positive variances (and BatchNorm's scale factor, other than 1).
        positive = {"BatchNorm": layer.blobs[1:], "BN": layer.blobs[3:]}.get(layer.type, [])
        for blob in positive:
            blob.data[...] = np.abs(blob.data)
    return net


def assert_agrees(results):
    assert results, "the model has no output"
    for name, (error, scale) in results.items():
        assert np.isfinite(scale) and scale > 0, (name, scale)
        assert error <= TOLERANCE * scale, f"{name}: max error {error:.3g}, max |value| " \
                                           f"{scale:.3g}"


def conv(name, bottom, top, extra):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f'convolution_param {{ {extra} }} }}\n')


def one(kind, params="", bottoms=("data",), tops=("y",), name="layer"):
    """One layer's text."""
    links = "".join(f'bottom: "{b}" ' for b in bottoms) + "".join(f'top: "{t}" ' for t in tops)
    return f'layer {{ name: "{name}" type: "{kind}" {links}{params} }}\n'


IMAGE = {"data": (4, 9, 9)}
FLAT = {"data": (3, 4, 5)}
POOLED_MASK = (one("Pooling", "pooling_param { pool: MAX kernel_size: 2 stride: 2 }",
                   tops=("pool", "mask"), name="pool"))

# id -> (inputs, layers, dynamic batch). Each covers one converter or one of its branches.
CASES = {
    "conv_groups_dilation": (IMAGE, conv("c", "data", "y", "num_output: 6 group: 2 "
                             "kernel_size: 3 stride: 2 pad: 2 dilation: 2"), True),
    "conv_rectangular_no_bias": (IMAGE, conv("c", "data", "y", "num_output: 3 kernel_h: 3 "
                                 "kernel_w: 2 stride_h: 2 stride_w: 1 pad_w: 1 "
                                 "bias_term: false"), True),
    "conv_1d": ({"data": (3, 11)}, conv("c", "data", "y", "num_output: 2 kernel_size: 3"),
                True),
    "conv_two_bottoms": ({"data": (4, 9, 9), "other": (4, 9, 9)},
                         one("Convolution", "convolution_param { num_output: 2 kernel_size: 3 }",
                             ("data", "other"), ("y", "z")), True),
    "convolution_depthwise": (IMAGE, one("ConvolutionDepthwise", "convolution_param { "
                              "num_output: 8 kernel_size: 3 pad: 1 }"), True),
    "depthwise_convolution": (IMAGE, one("DepthwiseConvolution", "convolution_param { "
                              "num_output: 4 group: 4 kernel_size: 3 stride: 2 }"), True),
    "deconvolution_groups": (IMAGE, one("Deconvolution", "convolution_param { num_output: 6 "
                             "group: 2 kernel_size: 4 stride: 2 pad: 1 }"), True),
    "lrn_across": (IMAGE, one("LRN", "lrn_param { local_size: 3 alpha: 2 beta: 0.75 k: 1.5 }"),
                   True),
    "lrn_within": (IMAGE, one("LRN", "lrn_param { local_size: 3 alpha: 2 beta: 0.75 "
                              "norm_region: WITHIN_CHANNEL }"), True),
    "inner_product": (FLAT, one("InnerProduct", "inner_product_param { num_output: 7 }"), True),
    "inner_product_axis_2_transposed": (FLAT, one("InnerProduct", "inner_product_param { "
                                        "num_output: 7 axis: 2 transpose: true "
                                        "bias_term: false }"), True),
    "inner_product_axis_0": (FLAT, one("InnerProduct", "inner_product_param { num_output: 7 "
                                       "axis: 0 }"), False),
    "batch_norm_and_scale": (IMAGE, conv("c", "data", "y", "num_output: 3 kernel_size: 1")
                             + one("BatchNorm", "", ("y",), ("y",), "bn")
                             + one("Scale", "scale_param { bias_term: true }", ("y",), ("y",)),
                             True),
    "batch_norm_of_the_batch": (IMAGE, one("BatchNorm", "batch_norm_param { use_global_stats: "
                                "false }"), True),
    "bn_moving_averages": (IMAGE, one("BN", "bn_param { frozen: true }"), True),
    "bn_inference": (IMAGE, one("BN", "bn_param { bn_mode: INFERENCE }"), True),
    "bn_learn": (IMAGE, one("BN", "bn_param { bn_mode: LEARN }"), True),
    "scale_by_bottom_axis_0": ({"data": (4, 9, 9), "s": (4,)},
                               one("Scale", "scale_param { axis: 0 }", ("data", "s")), True),
    "scale_scalar": (IMAGE, one("Scale", "scale_param { num_axes: 0 bias_term: true }"), True),
    "scale_axis_2": (FLAT, one("Scale", "scale_param { axis: 2 num_axes: 1 }"), True),
    "bias_learned_and_bottom": ({"data": (3, 4, 5), "b": (3, 4)},
                                one("Bias", "", tops=("z",), name="b1")
                                + one("Bias", "bias_param { axis: 0 }", ("z", "b")), True),
    "eltwise_sum_coeff": ({"data": (3, 4), "other": (3, 4)},
                          one("Eltwise", "eltwise_param { coeff: 2 coeff: -0.5 }",
                              ("data", "other")), True),
    "eltwise_prod": ({"data": (3, 4), "other": (3, 4), "third": (3, 4)},
                     one("Eltwise", "eltwise_param { operation: PROD }",
                         ("data", "other", "third")), True),
    "eltwise_max": ({"data": (3, 4), "other": (3, 4)},
                    one("Eltwise", "eltwise_param { operation: MAX }", ("data", "other")),
                    True),
    "concat_and_slice": (FLAT, one("Slice", "slice_param { axis: 2 slice_point: 1 "
                                   "slice_point: 3 }", tops=("a", "b", "c"), name="s")
                         + one("Concat", "concat_param { axis: 1 }", ("c", "a")) +
                         one("Slice", "slice_param { axis: 3 slice_point: 2 }", ("b",),
                             ("d", "e"), "t"),
                         True),
    "softmax_axis_2": (FLAT, one("Softmax", "softmax_param { axis: 2 }"), True),
    "flatten_middle": ({"data": (3, 4, 5, 2)}, one("Flatten", "flatten_param { axis: 1 "
                                                   "end_axis: 2 }"), True),
    "flatten": (FLAT, one("Flatten"), True),
    "reshape_copy_and_infer": (FLAT, one("Reshape", "reshape_param { shape { dim: 0 dim: -1 "
                                         "dim: 2 } }"), True),
    "reshape_axis_num_axes": ({"data": (6, 4, 5)}, one("Reshape", "reshape_param { axis: 1 "
                              "num_axes: 1 shape { dim: 2 dim: 3 } }"), True),
    "crop_offsets": ({"data": (4, 9, 9), "like": (4, 5, 4)},
                     one("Crop", "crop_param { axis: 2 offset: 3 offset: 1 }", ("data", "like")),
                     True),
    "prelu_channels_and_shared": (IMAGE, one("PReLU", "", tops=("a",), name="p1")
                                  + one("PReLU", "prelu_param { channel_shared: true }", ("a",)),
                                  True),
    "neurons": (IMAGE, one("ELU", "elu_param { alpha: 0.7 }", tops=("a",), name="n1")
                + one("AbsVal", "", ("a",), ("b",), "n2") + one("BNLL", "", ("b",), ("c",), "n3")
                + one("TanH", "", ("c",), ("d",), "n4") + one("Sigmoid", "", ("d",), ("e",), "n5")
                + one("Swish", "swish_param { beta: 1.5 }", ("e",), ("y",)), True),
    "relus": (IMAGE, one("ReLU", "relu_param { negative_slope: 0.1 }", tops=("a",), name="r1")
              + one("ReLU6", "relu6_param { negative_slope: 0.2 threshold: 0.5 }", ("a",),
                    ("b",), "r2")
              + one("ReLU6", "", ("b",), ("c",), "r3") + one("ReLU", "", ("c",), ("d",), "r4")
              + one("Clip", "clip_param { min: -0.2 max: 0.3 }", ("data",), ("y",)), True),
    "power_exp_log": (IMAGE, one("Power", "power_param { power: 2 scale: 0.5 shift: 3 }",
                                 tops=("a",), name="p")
                      + one("Log", "log_param { base: 10 scale: 2 shift: 0.5 }", ("a",), ("b",),
                            "l")
                      + one("Exp", "exp_param { base: 2 scale: 0.5 shift: 0.1 }", ("b",)), True),
    "power_constant_and_threshold": (IMAGE, one("Power", "power_param { power: 0 }",
                                                tops=("a",), name="p")
                                     + one("Threshold", "threshold_param { threshold: 0.2 }",
                                           ("data",), ("b",), "t")
                                     + one("Eltwise", "", ("a", "b")), True),
    "dropout": (IMAGE, one("Dropout", "dropout_param { dropout_ratio: 0.3 scale_train: false "
                           "}", tops=("a",), name="d1")
                + one("Dropout", "dropout_param { dropout_ratio: 0.3 }", ("a",)), True),
    "permute_transpose": (FLAT, one("Permute", "permute_param { order: 0 order: 2 }",
                                    tops=("a",), name="p")
                          + one("Transpose", "transpose_param { dim: 2 dim: 0 dim: 1 dim: 3 }",
                                ("data",), ("b",), "t"), True),
    "shuffle_channel": ({"data": (6, 3, 3)}, one("ShuffleChannel",
                                                 "shuffle_channel_param { group: 3 }"), True),
    "reorg": ({"data": (8, 4, 6)}, one("Reorg", "reorg_param { stride: 2 }"), True),
    "reorg_reverse": ({"data": (8, 4, 6)}, one("Reorg", "reorg_param { stride: 2 reverse: "
                                                        "true }"), True),
    "normalize": (IMAGE, one("Normalize", "norm_param { across_spatial: false channel_shared: "
                                          "false }", tops=("a",), name="n1")
                  + one("Normalize", "", ("data",), ("b",), "n2"), True),
    "axpy": ({"a": (4, 1, 1), "x": (4, 9, 9), "y": (4, 9, 9)},
             one("Axpy", "", ("a", "x", "y"), ("z",)), True),
    "axpy_2d_scale": ({"a": (4,), "x": (4, 9, 9), "y": (4, 9, 9)},
                      one("Axpy", "", ("a", "x", "y"), ("z",)), True),
    "interp_zoom": (IMAGE, one("Interp", "interp_param { zoom_factor: 3 }"), True),
    "interp_shrink_cropped": (IMAGE, one("Interp", "interp_param { shrink_factor: 2 pad_beg: -1 "
                                                   "pad_end: -2 }"), True),
    "interp_size": (IMAGE, one("Interp", "interp_param { height: 4 width: 13 }"), True),
    "upsample_mask": ({"data": (4, 8, 8)},
                      POOLED_MASK + one("Upsample", "upsample_param { scale: 2 }",
                                        ("pool", "mask")), True),
    # Caffe's mask indexes the 7x7 pooled image; in the 8x9 top it lands elsewhere.
    "upsample_other_size": ({"data": (4, 7, 7)},
                            POOLED_MASK + one("Upsample", "upsample_param { upsample_h: 8 "
                                              "upsample_w: 9 }", ("pool", "mask")), False),
    "pooling_mask_output": ({"data": (4, 7, 7)}, POOLED_MASK, True),
    "prior_box": ({"data": (3, 32, 32), "map": (4, 4, 4)},
                  one("PriorBox", "prior_box_param { min_size: 8 max_size: 16 aspect_ratio: 2 "
                                  "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 "
                                  "clip: true }", ("map", "data")),
                  True),
    "tile": (FLAT, one("Tile", "tile_param { axis: 2 tiles: 3 }"), True),
    "reductions": (FLAT, one("Reduction", "reduction_param { axis: 1 coeff: 2 }",
                             tops=("a",), name="r1")
                   + one("Reduction", "reduction_param { operation: ASUM axis: 2 }", ("data",),
                         ("b",), "r2")
                   + one("Reduction", "reduction_param { operation: SUMSQ axis: -1 }",
                         ("data",), ("c",), "r3")
                   + one("Reduction", "reduction_param { operation: MEAN axis: 1 coeff: -1 }",
                         ("data",), ("d",), "r4"), True),
    "reduction_to_scalar": (FLAT, one("Reduction", "reduction_param { operation: MEAN }"),
                            False),
    "argmax": (FLAT, one("ArgMax", "argmax_param { axis: 2 }", tops=("a",), name="a1")
               + one("ArgMax", "argmax_param { axis: 1 out_max_val: true }", ("data",), ("b",),
                     "a2")
               + one("ArgMax", "", ("data",), ("c",), "a3")
               + one("ArgMax", "argmax_param { out_max_val: true }", ("data",), ("d",), "a4"),
               True),
    "mvn": (IMAGE, one("MVN", "", tops=("a",), name="m1")
            + one("MVN", "mvn_param { across_channels: true normalize_variance: false }",
                  ("data",), ("b",), "m2"), True),
    "mvn_3_axes": (FLAT, one("MVN", "mvn_param { eps: 0.01 }"), True),
    "flip_reverse": (IMAGE, one("Flip", "flip_param { flip_height: true }", tops=("a",),
                                name="f")
                     + one("Reverse", "reverse_param { axis: 1 }", ("data",), ("b",), "r"),
                     True),
    "parameter": ({"data": (3,)}, one("Parameter", "parameter_param { shape { dim: 2 dim: 3 } }",
                                      (), ("w",), "p")
                  + one("Silence", "", ("data",), (), "s"), True),
    "spp": (IMAGE, one("SPP", "spp_param { pyramid_height: 3 }", tops=("a",), name="s1")
            + one("SPP", "spp_param { pyramid_height: 2 pool: AVE }", ("data",), ("b",), "s2")
            + one("SPP", "spp_param { pyramid_height: 1 }", ("data",), ("c",), "s3"), True),
}


@pytest.mark.parametrize("key", sorted(CASES))
def test_layer_exports_equal(tmp_path, key):
    inputs, layers, dynamic = CASES[key]
    net = build(tmp_path, inputs, layers)
    path = tmp_path / "net.onnx"
    export(net, path, batch="N" if dynamic else None)
    batch = BATCH + 1 if dynamic else BATCH
    rng = np.random.default_rng(4)
    values = {name: rng.uniform(-1, 1, (batch,) + shape).astype(np.float32)
              for name, shape in inputs.items()}
    assert_agrees(check(net, path, inputs=values))


def test_roi_pooling_of_given_regions(tmp_path):
    """Fast R-CNN's region pooling: corners rounded half away from zero, a one-pixel region,
    an inverted one, one past the image."""
    net = build(tmp_path, {"data": (3, 12, 10), "rois": (5,)},
                one("ROIPooling", "roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: "
                                  "0.5 }", ("data", "rois")))
    path = tmp_path / "net.onnx"
    export(net, path, batch="N")         # the rois' count, here
    rois = np.array([[0, 1, 3, 13, 19], [1, 5, 5, 5, 5], [1, 9, 0, 2, 7], [0, 14, 18, 40, 40],
                     [1, 0, 0, 19, 23]], np.float32)
    features = np.random.default_rng(1).uniform(-1, 1, (BATCH, 3, 12, 10)).astype(np.float32)
    assert_agrees(check(net, path, inputs={"data": features, "rois": rois}))


def test_embed_takes_indices(tmp_path):
    net = build(tmp_path, {"data": (5,)}, one("Embed", "embed_param { num_output: 3 "
                                                       "input_dim: 7 }"))
    path = tmp_path / "net.onnx"
    export(net, path, batch="N")
    indices = np.random.default_rng(0).integers(0, 7, (4, 5)).astype(np.float32)
    assert_agrees(check(net, path, inputs={"data": indices}))


# Pooling geometry: (method, size, kernel, stride, pad, Caffe's output size, floor's size).
POOLINGS = [
    ("MAX", 8, 3, 2, 0, 4, 3),
    ("AVE", 8, 3, 2, 0, 4, 3),
    ("MAX", 8, 3, 2, 1, 5, 4),
    ("AVE", 8, 3, 2, 1, 5, 4),       # the last window passes the padded image: divisor cut
    ("AVE", 5, 3, 3, 1, 2, 2),       # ceil gives 3, but the third window starts in the pad
    ("MAX", 5, 3, 3, 1, 2, 2),
    ("AVE", 7, 3, 2, 1, 4, 4),       # as floor: the padding counts in every divisor
    ("AVE", 6, 4, 3, 2, 3, 3),
]


@pytest.mark.parametrize("method, size, kernel, stride, pad, caffe, floor", POOLINGS)
@pytest.mark.parametrize("rounding", ["CEIL", "FLOOR"])
def test_pooling_takes_caffes_output_size(tmp_path, method, size, kernel, stride, pad, caffe,
                                          floor, rounding):
    """ONNX's own rule rounds down; the export pads the end so that its windows are Caffe's,
    and ONNX Runtime's output has Caffe's size and values."""
    expected = caffe if rounding == "CEIL" else floor
    net = build(tmp_path, {"data": (2, size, size + 1)}, one(
        "Pooling", f"pooling_param {{ pool: {method} kernel_size: {kernel} stride: {stride} "
                   f"pad: {pad} round_mode: {rounding} }}"))
    assert net.blobs["y"].shape[2] == expected
    path = tmp_path / "net.onnx"
    model = export(net, path)
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == list(net.blobs["y"].shape)
    assert_agrees(check(net, path))


def test_pooling_global(tmp_path):
    net = build(tmp_path, IMAGE, one("Pooling", "pooling_param { pool: AVE global_pooling: "
                                                "true }", tops=("a",), name="p1")
                + one("Pooling", "pooling_param { pool: MAX global_pooling: true }", ("data",),
                      ("b",), "p2"))
    path = tmp_path / "net.onnx"
    model = export(net, path, batch="N")
    assert {n.op_type for n in model.graph.node} == {"GlobalAveragePool", "GlobalMaxPool"}
    assert_agrees(check(net, path))


@pytest.mark.parametrize("opset", [13, 18, 21])
def test_opsets(tmp_path, opset):
    """Reductions take their axes as an attribute before opset 18 and as an input from it."""
    net = build(tmp_path, IMAGE, one("Normalize", "", tops=("a",), name="n")
                + one("MVN", "", ("a",), ("b",), "m")
                + one("Softmax", "softmax_param { axis: 2 }", ("b",)))
    path = tmp_path / "net.onnx"
    model = export(net, path, opset=opset, batch="N")
    assert model.opset_import[0].version == opset
    assert_agrees(check(net, path))


def test_fixed_batch_other_than_the_prototxts(tmp_path):
    net = build(tmp_path, IMAGE, conv("c", "data", "a", "num_output: 3 kernel_size: 3") +
                one("InnerProduct", "inner_product_param { num_output: 2 }", ("a",)))
    path = tmp_path / "net.onnx"
    model = export(net, path, batch=5)
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.shape.dim[0].dim_value == 5
    assert_agrees(check(net, path))
    assert net.blobs["data"].shape[0] == 5       # check() ran the net at the model's batch


def test_check_sees_a_wrong_weight(tmp_path):
    """The comparison can fail: a model whose weights differ from the net's does."""
    net = build(tmp_path, IMAGE, conv("c", "data", "y", "num_output: 3 kernel_size: 3"))
    path = tmp_path / "net.onnx"
    model = export(net, path)
    weight = next(t for t in model.graph.initializer if len(t.dims) == 4)
    values = onnx.numpy_helper.to_array(weight).copy()
    values[0, 0, 0, 0] += 0.1
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(model, path)
    (error, scale), = check(net, path).values()
    assert error > TOLERANCE * scale


def test_a_layer_without_onnx_form_is_named_with_until(tmp_path):
    net = build(tmp_path, {"data": (5,), "label": ()},
                one("InnerProduct", "inner_product_param { num_output: 3 }", tops=("ip",),
                    name="ip")
                + one("Accuracy", "", ("ip", "label"), ("acc",), "accuracy"))
    with pytest.raises(SyncSGDError, match=r"layer 'accuracy' \(Accuracy\) has no ONNX form.*"
                                           r"--until accuracy"):
        export(net, tmp_path / "net.onnx")
    path = tmp_path / "until.onnx"
    model = export(net, path, until="accuracy")
    assert [o.name for o in model.graph.output] == ["ip"]
    assert [i.name for i in model.graph.input] == ["data"]      # the label feeds nothing
    assert_agrees(check(net, path, until="accuracy"))


def test_refusals_name_what_to_change(tmp_path):
    net = build(tmp_path, IMAGE, conv("c", "data", "y", "num_output: 3 kernel_size: 3"))
    with pytest.raises(SyncSGDError, match="no layer of that name; its layers are data, c"):
        export(net, tmp_path / "x.onnx", until="conv")
    with pytest.raises(SyncSGDError, match="no layer before it"):
        export(net, tmp_path / "x.onnx", until="c")
    with pytest.raises(SyncSGDError, match="opset 12: the export writes opsets 13 to"):
        export(net, tmp_path / "x.onnx", opset=12)
    with pytest.raises(SyncSGDError, match="batch 0: give a positive number"):
        export(net, tmp_path / "x.onnx", batch=0)
    train = syncsgd.Net(str(tmp_path / "net.prototxt"), syncsgd.TRAIN)
    with pytest.raises(SyncSGDError, match="TEST phase"):
        export(train, tmp_path / "x.onnx")
    dummy = tmp_path / "dummy.prototxt"
    dummy.write_text('layer { name: "source" type: "DummyData" top: "data" dummy_data_param { '
                     'shape { dim: 2 dim: 3 } } }\n' + one("ReLU"))
    with pytest.raises(SyncSGDError, match=r"layer 'source' \(DummyData\) reads samples from a "
                                           r"data source; export the deploy version"):
        export(syncsgd.Net(str(dummy), syncsgd.TEST), tmp_path / "x.onnx")
    in_place = tmp_path / "in_place.prototxt"
    in_place.write_text(net_text(IMAGE, one("ReLU", "", tops=("data",))))
    with pytest.raises(SyncSGDError, match="blob 'data' is both an input and, written in place, "
                                           "an output"):
        export(syncsgd.Net(str(in_place), syncsgd.TEST), tmp_path / "x.onnx")
