"""pycaffe's net_spec through `import syncsgd as caffe`: what NetSpec writes is the prototxt Caffe
would get from the same script, and syncsgd builds and trains it."""
import io

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd as caffe
from syncsgd import layers as L
from syncsgd import log
from syncsgd import params as P
from syncsgd.proto import caffe_pb2


def lenet(batch):
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[batch, 1, 28, 28]), dict(dim=[batch])],
                                  data_filler=[dict(type="gaussian", std=1.0),
                                               dict(type="constant", value=3)], ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50,
                            weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"),
                           param=[dict(lr_mult=1), dict(lr_mult=2)])
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def test_lenet_from_netspec_is_the_prototxt_caffe_would_get(tmp_path):
    proto = lenet(4)
    text = str(proto)
    again = text_format.Parse(text, caffe_pb2.NetParameter())
    assert again == proto
    assert [l.name for l in proto.layer] == ["data", "conv1", "pool1", "conv2", "pool2", "fc1",
                                             "relu1", "score", "loss"]
    relu = proto.layer[6]
    assert list(relu.bottom) == list(relu.top) == ["fc1"]      # in_place
    assert proto.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert [p.lr_mult for p in proto.layer[5].param] == [1, 2]
    assert proto.layer[1].convolution_param.kernel_size == [5]   # a lone value, repeated field
    path = tmp_path / "lenet.prototxt"
    path.write_text(text)
    net = caffe.Net(str(path), caffe.TRAIN)
    assert net.blobs["pool2"].data.shape == (4, 50, 4, 4)
    net.forward()
    assert np.isfinite(net.blobs["loss"].data).all() and net.blobs["loss"].data > 0


def test_netspec_trains_with_a_solver(tmp_path):
    (tmp_path / "net.prototxt").write_text(str(lenet(8)))
    (tmp_path / "solver.prototxt").write_text(
        'net: "%s" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 10 display: 0 '
        'snapshot: 0 snapshot_after_train: false random_seed: 3' % (tmp_path / "net.prototxt"))
    solver = caffe.get_solver(str(tmp_path / "solver.prototxt"))
    solver.net.forward()
    first = float(solver.net.blobs["loss"].data)
    solver.step(10)
    solver.net.forward()
    assert float(solver.net.blobs["loss"].data) < first    # constant labels are easy to learn


def test_automatic_names_and_top_counts():
    data = L.DummyData(shape=dict(dim=[2, 3]))
    ip = L.InnerProduct(data, num_output=4)
    proto = ip.to_proto()
    assert [(l.name, list(l.top)) for l in proto.layer] == [
        ("DummyData1", ["DummyData1"]), ("InnerProduct1", ["InnerProduct1"])]
    a, b = L.Slice(ip, slice_point=[2], ntop=2)
    silence = L.Silence(a, b, ntop=0)
    assert silence.tops == () and silence.inputs == (a, b)
    proto = caffe.to_proto(a, b)
    assert [l.type for l in proto.layer] == ["DummyData", "InnerProduct", "Slice"]
    assert list(proto.layer[2].top) == ["Slice1", "Slice2"]


def test_generic_param_and_layer_fields():
    data = L.Input(shape=dict(dim=[1, 2]))
    top = L.InnerProduct(data, num_output=1, loss_weight=0.5, name="ignored_here",
                         propagate_down=[False], include=dict(phase=caffe.TEST),
                         inner_product_param=dict(bias_term=False))
    layer = top.to_proto().layer[1]
    assert layer.loss_weight == [0.5]
    assert layer.include[0].phase == caffe.TEST
    assert layer.inner_product_param.bias_term is False
    assert layer.inner_product_param.num_output == 1


def test_bad_uses_say_what_is_wrong():
    with pytest.raises(TypeError, match="ReLU input 0 is not a Top"):
        L.ReLU(np.zeros(3))
    with pytest.raises(AttributeError, match="no_such_field"):
        L.ReLU(L.Input(shape=dict(dim=[1])), no_such_field=1).to_proto()
    with pytest.raises(AttributeError, match="NoSuchParameter"):
        P.NoSuch.MAX
    with pytest.raises(ValueError, match="in_place"):
        L.Eltwise(L.Input(), L.Input(), in_place=True)


def test_layers_package_keeps_its_own_names():
    assert callable(L.known_types) and "Convolution" in L.known_types()
    assert L.create is caffe.layers.create
    with pytest.raises(AttributeError):
        L._private


def test_module_calls_of_pycaffe():
    stream = io.StringIO()
    log.configure(stream=stream)
    caffe._GPU_NOTED.clear()
    try:
        caffe.set_mode_cpu()
        caffe.set_device(0)
        caffe.set_mode_gpu()
        caffe.set_mode_gpu()
    finally:
        log.configure()
    assert stream.getvalue().count("no GPU mode") == 1
    assert "Convolution" in caffe.layer_type_list() and "InnerProduct" in caffe.layer_type_list()
    assert caffe.layer_type_list() == sorted(caffe.layer_type_list())
