"""Prototxt compilation: parse errors, legacy upgrades, phase/stage filtering, Split insertion."""
import os

import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN
from syncsgd.compile import compile_net, read_text, upgrade_net
from syncsgd.errors import PrototxtError
from syncsgd.proto import pb

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "caffe-fixtures")
PROTOTXT = os.path.join(FIXTURES, "prototxt")


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
    param, _ = compile_net(os.path.join(FIXTURES, "weights/lenet-v1-pl8787/lenet_train.prototxt"),
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
