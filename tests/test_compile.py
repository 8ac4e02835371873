"""Prototxt compilation: parse errors, legacy upgrades, phase/stage filtering, Split insertion."""
import os

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN
from syncsgd.compile import compile_net, read_text, upgrade_net
from syncsgd.errors import PrototxtError
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

PROTOTXT = os.path.join(CAFFE_FIXTURES, "prototxt")


def net_text(tmp_path, text, name="net.prototxt"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_parse_error_names_file_line_and_column(tmp_path):
    path = net_text(tmp_path, 'name: "x"\nlayer {\n  name: "a"\n  typo: "Input"\n}\n')
    with pytest.raises(PrototxtError) as e:
        read_text(path, pb.NetParameter())
    assert f"{path}:4:3" in str(e.value) and "typo" in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(PrototxtError, match="no such file"):
        compile_net(str(tmp_path / "absent.prototxt"), TEST)


def test_v1_layers_upgrade_to_current_form():
    param, _ = compile_net(str(CAFFE_FIXTURES / "weights/lenet-v1-pl8787/lenet_train.prototxt"),
                           TRAIN)
    types = [l.type for l in param.layer]
    assert types[0] == "Data" and "Convolution" in types and types[-1] == "SoftmaxWithLoss"
    conv = next(l for l in param.layer if l.type == "Convolution")
    assert [p.lr_mult for p in conv.param] == [1.0, 2.0]
    data = param.layer[0]
    assert data.transform_param.scale == pytest.approx(0.00390625)
    assert not data.data_param.HasField("scale")


def test_v1_deploy_with_input_dim_gets_an_input_layer():
    param, _ = compile_net(os.path.join(PROTOTXT, "yxliwhu_NYUD-FCN8s",
                                        "VGG_ILSVRC_16_layers_deploy.prototxt"), TEST)
    first = param.layer[0]
    assert first.type == "Input" and first.name == "input"
    assert list(first.input_param.shape[0].dim) == [10, 3, 224, 224]
    assert not param.input and not param.input_dim


def test_v0_layers_upgrade():
    text = """
    name: "v0"
    layers { layer { name: "data" type: "data" source: "x" batchsize: 4 scale: 0.5 }
             top: "data" top: "label" }
    layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
    layers { layer { name: "conv1" type: "conv" num_output: 8 kernelsize: 3 stride: 2
                     blobs_lr: 1 blobs_lr: 2 } bottom: "pad1" top: "conv1" }
    layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 }
             bottom: "conv1" top: "pool1" }
    """
    param = text_format.Parse(text, pb.NetParameter())
    upgrade_net(param)
    names = [l.name for l in param.layer]
    assert names == ["data", "conv1", "pool1"]
    conv = param.layer[1]
    assert list(conv.bottom) == ["data"]
    assert list(conv.convolution_param.pad) == [2]
    assert list(conv.convolution_param.kernel_size) == [3]
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert param.layer[2].pooling_param.pool == pb.PoolingParameter.AVE
    assert param.layer[0].data_param.batch_size == 4
    assert param.layer[0].transform_param.scale == 0.5


def test_phase_and_stage_rules(tmp_path):
    path = net_text(tmp_path, """
    layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "t" type: "ReLU" bottom: "x" top: "t" include { phase: TRAIN } }
    layer { name: "s" type: "ReLU" bottom: "x" top: "s" include { stage: "deploy" } }
    layer { name: "n" type: "ReLU" bottom: "x" top: "n" exclude { stage: "deploy" } }
    layer { name: "l" type: "ReLU" bottom: "x" top: "l" include { min_level: 2 } }
    """)
    names = lambda *a, **k: [l.name for l in compile_net(path, *a, **k)[0].layer
                             if l.type != "Split"]
    assert names(TRAIN) == ["a", "t", "n"]
    assert names(TEST) == ["a", "n"]
    assert names(TEST, stages=["deploy"]) == ["a", "s"]
    assert names(TEST, level=2) == ["a", "n", "l"]


def test_include_and_exclude_together_is_an_error(tmp_path):
    path = net_text(tmp_path, 'layer { name: "a" type: "Input" top: "x" '
                              'include { phase: TEST } exclude { phase: TRAIN } }')
    with pytest.raises(PrototxtError, match="both include and exclude"):
        compile_net(path, TEST)


def test_splits_named_as_caffe_names_them(tmp_path):
    path = net_text(tmp_path, """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }
    layer { name: "a" type: "Sigmoid" bottom: "data" top: "a" }
    layer { name: "b" type: "TanH" bottom: "data" top: "b" }
    layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
    """)
    param, _ = compile_net(path, TEST)
    split = param.layer[2]
    assert split.type == "Split" and split.name == "data_relu_0_split"
    assert list(split.bottom) == ["data"]
    assert list(split.top) == ["data_relu_0_split_0", "data_relu_0_split_1"]
    assert list(param.layer[3].bottom) == ["data_relu_0_split_0"]
    assert list(param.layer[4].bottom) == ["data_relu_0_split_1"]


def test_loss_weighted_top_that_is_also_read_gets_a_split(tmp_path):
    path = net_text(tmp_path, """
    layer { name: "data" type: "Input" top: "x" top: "y"
            input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "l" type: "EuclideanLoss" bottom: "x" bottom: "y" top: "l" loss_weight: 2 }
    layer { name: "r" type: "ReLU" bottom: "l" top: "r" }
    """)
    param, _ = compile_net(path, TEST)
    split = next(l for l in param.layer if l.type == "Split")
    assert list(split.loss_weight) == [2.0, 0.0]
    assert not param.layer[1].loss_weight


def test_missing_bottom_names_the_layer(tmp_path):
    path = net_text(tmp_path, """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 } } }
    layer { name: "r" type: "ReLU" bottom: "dta" top: "r" }
    """)
    with pytest.raises(PrototxtError, match="layer 'r' .* reads bottom 'dta'"):
        compile_net(path, TEST)


# -- model-zoo files: fork fields, unsupported types, duplicate names, mixed layer forms --------

@pytest.fixture
def warnings_logged():
    """The messages syncsgd's logger warns with during the test."""
    import logging
    from syncsgd import log

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    keep = Keep()
    saved_level = log.LOGGER.level
    log.LOGGER.addHandler(keep)
    log.LOGGER.setLevel(min(saved_level or logging.WARNING, logging.WARNING))
    yield keep.messages
    log.LOGGER.removeHandler(keep)
    log.LOGGER.setLevel(saved_level)


INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }\n'


def test_a_mistyped_type_gets_a_suggestion(tmp_path):
    path = net_text(tmp_path, 'layer { name: "d" type: "Inptu" top: "x" }')
    with pytest.raises(PrototxtError, match="unknown layer type 'Inptu' .*did you mean 'Input'"):
        compile_net(path, TEST)


def test_every_unsupported_type_is_named_at_once(tmp_path):
    path = net_text(tmp_path, INPUT + """
    layer { name: "dense1" type: "DenseBlock" bottom: "data" top: "dense1" }
    layer { name: "relu" type: "ReLU" bottom: "dense1" top: "relu" }
    layer { name: "dense2" type: "DenseBlock" bottom: "relu" top: "dense2" }
    layer { name: "odd" type: "Mystery" bottom: "dense2" top: "odd" }
    """)
    with pytest.raises(PrototxtError) as e:
        compile_net(path, TEST)
    message = str(e.value)
    assert ("unknown layer types 'DenseBlock' (layers 'dense1', 'dense2'), 'Mystery' "
            "(layer 'odd')") in message
    assert "ReLU" not in message


def test_a_fork_param_names_its_layer_type_and_the_other_missing_types(tmp_path):
    path = net_text(tmp_path, INPUT + """
    layer { name: "dense1" type: "DenseBlock" bottom: "data" top: "dense1"
            denseblock_param { numTransition: 8 growthRate: 12 } }
    layer { name: "ctc" type: "WarpCTCLoss" bottom: "dense1" top: "loss" }
    """)
    with pytest.raises(PrototxtError) as e:
        compile_net(path, TEST)
    message = str(e.value)
    assert f"{path}:4:" in message
    assert ("layer 'dense1' sets `denseblock_param`: its type 'DenseBlock' is not a syncsgd "
            "layer type") in message
    assert "'WarpCTCLoss' (layer 'ctc')" in message


@pytest.mark.parametrize("body, expected", [
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 pad_out: true }',
     "layer 'p' (Pooling) sets `pad_out` in PoolingParameter, a Caffe fork's field"),
    ('type: "Pooling" quantize_param { bits: 8 }',
     "layer 'p' (Pooling) sets `quantize_param`, a Caffe fork's field that syncsgd's Pooling "
     "does not have; remove it"),
])
def test_a_fork_field_of_a_supported_type_names_layer_and_field(tmp_path, body, expected):
    path = net_text(tmp_path, INPUT + f'layer {{ name: "p" {body} bottom: "data" top: "p" }}\n')
    with pytest.raises(PrototxtError) as e:
        compile_net(path, TEST)
    assert expected in str(e.value) and "unknown layer type" not in str(e.value)


def test_ceil_mode_becomes_round_mode(tmp_path):
    pooling = 'type: "Pooling" bottom: "data" top: "{0}" pooling_param {{ kernel_size: 2 {1} }}'
    path = net_text(tmp_path, INPUT.replace("dim: 2", "dim: 2 dim: 4") + "\n".join(
        f'layer {{ name: "{name}" {pooling.format(name, setting)} }}' for name, setting in
        [("floor", "ceil_mode: false"), ("ceil", "ceil_mode: true"), ("plain", "")]))
    param, _ = compile_net(path, TEST)
    modes = {l.name: l.pooling_param for l in param.layer if l.type == "Pooling"}
    assert modes["floor"].round_mode == pb.PoolingParameter.FLOOR
    assert modes["ceil"].round_mode == pb.PoolingParameter.CEIL
    assert not any(m.HasField("ceil_mode") for m in modes.values())
    assert not modes["plain"].HasField("round_mode")


def test_ceil_mode_and_round_mode_must_agree(tmp_path):
    path = net_text(tmp_path, INPUT + 'layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                    'pooling_param { kernel_size: 1 ceil_mode: false round_mode: CEIL } }')
    with pytest.raises(PrototxtError, match="ceil_mode false and round_mode CEIL"):
        compile_net(path, TEST)


DUPLICATES = INPUT.replace("dim: 2", "dim: 3") + """
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "a"
        inner_product_param { num_output: 2 weight_filler { type: "constant" value: 1 } } }
layer { name: "fc" type: "InnerProduct" bottom: "a" top: "b"
        inner_product_param { num_output: 2 weight_filler { type: "constant" value: 3 } } }
layer { name: "fc_1" type: "ReLU" bottom: "b" top: "c" }
"""


def test_duplicate_names_load_as_in_caffe(tmp_path, warnings_logged):
    import syncsgd
    path = net_text(tmp_path, DUPLICATES)
    net = syncsgd.Net(path, TEST)
    assert list(net.layer_dict) == ["data", "fc", "fc_2", "fc_1"]
    assert list(net.blobs) == ["data", "a", "b", "c"]
    assert len(warnings_logged) == 1
    warning = warnings_logged[0]
    assert "2 layers are named 'fc'" in warning and "the first (InnerProduct) gets the weights " \
        "named 'fc'" in warning and "'fc_2'" in warning
    # Weights named "fc" go to the first layer so named, as Caffe's CopyTrainedLayersFrom does.
    weights = pb.NetParameter()
    layer = weights.layer.add(name="fc", type="InnerProduct")
    for shape, value in (((2, 3), 5.0), ((2,), 0.5)):
        blob = layer.blobs.add()
        blob.shape.dim.extend(shape)
        blob.data.extend([value] * int(np.prod(shape)))
    (tmp_path / "w.caffemodel").write_bytes(weights.SerializeToString())
    net.copy_from(str(tmp_path / "w.caffemodel"))
    assert (net.params["fc"][0].data == 5).all() and (net.params["fc_2"][0].data == 3).all()


def test_layer_and_legacy_layers_mixed_load_in_file_order(tmp_path, warnings_logged):
    path = net_text(tmp_path, INPUT + """
    layers { name: "relu" type: RELU bottom: "data" top: "r" }
    layer { name: "sigmoid" type: "Sigmoid" bottom: "r" top: "s" }
    layers { name: "ip" type: INNER_PRODUCT bottom: "s" top: "ip" blobs_lr: 2
             inner_product_param { num_output: 1 } }
    """)
    param, _ = compile_net(path, TEST)
    assert [(l.name, l.type) for l in param.layer] == [
        ("data", "Input"), ("relu", "ReLU"), ("sigmoid", "Sigmoid"), ("ip", "InnerProduct")]
    assert param.layer[3].param[0].lr_mult == 2 and not param.layers
    assert any("file order" in w for w in warnings_logged)


def test_layer_and_legacy_layers_mixed_in_a_message_say_how_to_convert():
    param = text_format.Parse(INPUT + 'layers { name: "relu" type: RELU bottom: "data" '
                              'top: "r" }', pb.NetParameter())
    with pytest.raises(PrototxtError) as e:
        compile_net(param, TEST)
    message = str(e.value)
    assert "`layer` (1) and the legacy `layers` (1)" in message
    assert "give the prototxt's path" in message
    assert 'type: "Convolution" param { lr_mult: 1 decay_mult: 1 }' in message
