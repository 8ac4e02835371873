"""Every net we ship or read from real Caffe users builds with syncsgd.Net in each phase it
declares, with the blob shapes Caffe gives it.

Data layers read sources that are not on disk (LMDB, HDF5 lists), so each is swapped for a
DummyData layer with the same tops, the batch size of its own param and the sample shape the net
was designed for. Batches are cut to 2 so the whole file stays fast and small in memory; the
ImageNet-sized nets get batch 1 and constant fillers and are only set up and reshaped, the small
ones also run forward.
"""
import gc
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOTXT = os.path.join(CAFFE_FIXTURES, "prototxt")
MODELS = os.path.join(HERE, "..", "models")

DATA_TYPES = {"Data", "HDF5Data", "ImageData", "WindowData", "MemoryData"}
V1_DATA_TYPES = {pb.V1LayerParameter.LayerType.Value(name)
                 for name in ("DATA", "HDF5_DATA", "IMAGE_DATA", "WINDOW_DATA", "MEMORY_DATA")}


@dataclass(frozen=True)
class Spec:
    """What the test needs to know about one net: the shape of one input sample, whether it is
    heavy (batch 1, no forward), and blob shapes (without the batch axis) Caffe gives it."""
    sample: tuple
    heavy: bool = False
    shapes: dict = field(default_factory=dict)


LENET = {"conv1": (20, 24, 24), "pool1": (20, 12, 12), "conv2": (50, 8, 8), "pool2": (50, 4, 4),
         "ip1": (500,), "ip2": (10,)}
CIFAR_QUICK = {"conv1": (32, 32, 32), "pool1": (32, 16, 16), "conv2": (32, 16, 16),
               "pool2": (32, 8, 8), "conv3": (64, 8, 8), "pool3": (64, 4, 4), "ip1": (64,),
               "ip2": (10,)}
CIFAR_FULL = {"pool1": (32, 16, 16), "pool2": (32, 8, 8), "pool3": (64, 4, 4), "ip1": (10,)}
ALEXNET = {"conv1": (96, 55, 55), "norm1": (96, 55, 55), "pool1": (96, 27, 27),
           "conv2": (256, 27, 27), "pool2": (256, 13, 13), "conv3": (384, 13, 13),
           "conv5": (256, 13, 13), "pool5": (256, 6, 6), "fc6": (4096,), "fc7": (4096,),
           "fc8": (1000,)}
CAFFENET = {"conv1": (96, 55, 55), "pool1": (96, 27, 27), "pool2": (256, 13, 13),
            "pool5": (256, 6, 6), "fc6": (4096,), "fc8": (1000,)}
GOOGLENET = {"conv1/7x7_s2": (64, 112, 112), "pool1/3x3_s2": (64, 56, 56),
             "pool2/3x3_s2": (192, 28, 28), "inception_3a/output": (256, 28, 28),
             "inception_3b/output": (480, 28, 28), "pool3/3x3_s2": (480, 14, 14),
             "inception_4e/output": (832, 14, 14), "pool4/3x3_s2": (832, 7, 7),
             "inception_5b/output": (1024, 7, 7), "pool5/7x7_s1": (1024, 1, 1)}
GOOGLENET_TRAIN = dict(GOOGLENET, **{"loss1/ave_pool": (512, 4, 4), "loss1/fc": (1024,),
                                     "loss2/ave_pool": (528, 4, 4), "loss3/classifier": (1000,)})
RESNET = {"conv1": (64, 112, 112), "pool1": (64, 56, 56), "res2c": (256, 56, 56),
          "res3a": (512, 28, 28), "res4a": (1024, 14, 14), "res5c": (2048, 7, 7),
          "pool5": (2048, 1, 1), "fc1000": (1000,), "prob": (1000,)}
RESNET_TRAIN = {blob: shape for blob, shape in RESNET.items() if blob != "prob"}
VGG16 = {"conv1_2": (64, 224, 224), "pool1": (64, 112, 112), "pool2": (128, 56, 56),
         "pool3": (256, 28, 28), "pool4": (512, 14, 14), "pool5": (512, 7, 7), "fc6": (4096,),
         "fc8": (1000,)}
VGG_A = {"conv1_1": (64, 224, 224), "pool1": (64, 112, 112), "pool2": (128, 56, 56),
         "pool3": (256, 28, 28), "pool4": (512, 14, 14), "pool5": (512, 7, 7), "fc6": (4096,),
         "fc8": (1000,)}
OVERFEAT = {"conv1": (96, 56, 56), "pool1": (96, 28, 28), "conv2": (256, 24, 24),
            "pool2": (256, 12, 12), "pool5": (1024, 6, 6), "fc6": (3072,), "fc8": (1000,)}
CDDNN = {"fc1": (2048,), "fc7": (2048,), "senones": (9304,)}

MNIST, CIFAR, CROP227, CROP224 = (1, 28, 28), (3, 32, 32), (3, 227, 227), (3, 224, 224)
BVLC = "BVLC_caffe/"
SPECS = {
    # tests/fixtures/caffe/prototxt/
    BVLC + "examples/mnist/lenet.prototxt": Spec(MNIST, shapes=LENET),
    BVLC + "examples/mnist/lenet_train_test.prototxt": Spec(MNIST, shapes=LENET),
    BVLC + "examples/cifar10/cifar10_quick.prototxt": Spec(CIFAR, shapes=CIFAR_QUICK),
    BVLC + "examples/cifar10/cifar10_quick_train_test.prototxt": Spec(CIFAR, shapes=CIFAR_QUICK),
    BVLC + "examples/cifar10/cifar10_full_train_test.prototxt": Spec(CIFAR, shapes=CIFAR_FULL),
    BVLC + "models/bvlc_alexnet/deploy.prototxt": Spec(CROP227, True, ALEXNET),
    BVLC + "models/bvlc_alexnet/train_val.prototxt": Spec(CROP227, True, ALEXNET),
    BVLC + "models/bvlc_reference_caffenet/deploy.prototxt": Spec(CROP227, True, CAFFENET),
    BVLC + "models/bvlc_reference_caffenet/train_val.prototxt": Spec(CROP227, True, CAFFENET),
    BVLC + "models/bvlc_googlenet/deploy.prototxt": Spec(CROP224, True, GOOGLENET),
    BVLC + "models/bvlc_googlenet/train_val.prototxt": Spec(CROP224, True, GOOGLENET_TRAIN),
    "KaimingHe_deep-residual-networks/ResNet-50-deploy.prototxt": Spec(CROP224, True, RESNET),
    "KaimingHe_deep-residual-networks/ResNet-101-deploy.prototxt": Spec(CROP224, True, RESNET),
    "KaimingHe_deep-residual-networks/ResNet-152-deploy.prototxt": Spec(CROP224, True, RESNET),
    "yxliwhu_NYUD-FCN8s/VGG_ILSVRC_16_layers_deploy.prototxt": Spec(CROP224, True, VGG16),
    # models/
    "lenet/deploy.prototxt": Spec(MNIST, shapes=LENET),
    "lenet/train_val.prototxt": Spec(MNIST, shapes=LENET),
    "cifar10_quick/deploy.prototxt": Spec(CIFAR, shapes=CIFAR_QUICK),
    "cifar10_quick/train_val.prototxt": Spec(CIFAR, shapes=CIFAR_QUICK),
    "cifar10_full/deploy.prototxt": Spec(CIFAR, shapes=CIFAR_FULL),
    "cifar10_full/train_val.prototxt": Spec(CIFAR, shapes=CIFAR_FULL),
    "alexnet/deploy.prototxt": Spec(CROP227, True, ALEXNET),
    "alexnet/train_val.prototxt": Spec(CROP227, True, ALEXNET),
    "vgg_a/deploy.prototxt": Spec(CROP224, True, VGG_A),
    "vgg_a/train_val.prototxt": Spec(CROP224, True, VGG_A),
    "overfeat_fast/deploy.prototxt": Spec((3, 231, 231), True, OVERFEAT),
    "overfeat_fast/train_val.prototxt": Spec((3, 231, 231), True, OVERFEAT),
    "cddnn/deploy.prototxt": Spec((440,), shapes=CDDNN),
    "cddnn/train_val.prototxt": Spec((440,), shapes=CDDNN),
    "googlenet/deploy.prototxt": Spec(CROP224, True, GOOGLENET),
    "googlenet/train_val.prototxt": Spec(CROP224, True, GOOGLENET_TRAIN),
    "resnet50/deploy.prototxt": Spec(CROP224, True, RESNET),
    "resnet50/train_val.prototxt": Spec(CROP224, True, RESNET_TRAIN),
}


def discovered():
    """Relative name -> absolute path of every net prototxt on disk (solvers left out)."""
    found = {}
    for root, base in ((PROTOTXT, PROTOTXT), (MODELS, MODELS)):
        for directory, _, files in os.walk(root):
            for name in files:
                if name.endswith(".prototxt") and "solver" not in name:
                    path = os.path.join(directory, name)
                    found[os.path.relpath(path, base).replace(os.sep, "/")] = path
    return found


NETS = discovered()


def phases(name):
    """A train/val or train/test net declares both phases; a deploy net only TEST."""
    base = os.path.basename(name)
    return [syncsgd.TRAIN, syncsgd.TEST] if "train" in base else [syncsgd.TEST]


CASES = [pytest.param(name, phase, id=f"{name}-{'TRAIN' if phase == syncsgd.TRAIN else 'TEST'}")
         for name in sorted(NETS) for phase in phases(name)]


def batch_cap(spec):
    return 1 if spec.heavy else 2


def dummy_for(layer, sample, cap):
    """A DummyData layer standing in for a data layer: same name, tops and phase rules; tops
    shaped (batch, *sample) for the data and (batch,) for every other top (labels, zero)."""
    batch = None
    for name in ("data_param", "hdf5_data_param", "image_data_param", "window_data_param",
                 "memory_data_param"):
        if layer.HasField(name):
            batch = getattr(layer, name).batch_size
    assert batch, f"data layer '{layer.name}' gives no batch_size"
    crop = layer.transform_param.crop_size
    if crop:
        assert sample[-2:] == (crop, crop), \
            f"the sample table says {sample} but '{layer.name}' crops to {crop}"
    batch = min(batch, cap)
    dummy = pb.LayerParameter(name=layer.name, type="DummyData", top=list(layer.top))
    dummy.include.extend(layer.include)
    dummy.exclude.extend(layer.exclude)
    p = dummy.dummy_data_param
    for i in range(len(layer.top)):
        p.shape.add().dim.extend((batch,) + tuple(sample) if i == 0 else (batch,))
        p.data_filler.add().CopyFrom(
            pb.FillerParameter(type="gaussian", std=1.0) if i == 0
            else pb.FillerParameter(type="constant", value=0))
    return dummy


def runnable(path, spec):
    """The net of `path` as a NetParameter with data layers swapped for DummyData and every batch
    (Input shapes, legacy input_dim/input_shape, data batch_size) cut to the spec's cap."""
    with open(path) as f:
        param = text_format.Parse(f.read(), pb.NetParameter())
    cap = batch_cap(spec)
    assert not any(v1.type in V1_DATA_TYPES for v1 in param.layers), \
        "the helper swaps data layers of the current `layer` format only"
    for i, layer in enumerate(param.layer):
        if layer.type in DATA_TYPES:
            param.layer[i].CopyFrom(dummy_for(layer, spec.sample, cap))
        elif layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = min(shape.dim[0], cap)
    for shape in param.input_shape:
        shape.dim[0] = min(shape.dim[0], cap)
    for k in range(0, len(param.input_dim), 4):
        param.input_dim[k] = min(param.input_dim[k], cap)
    if spec.heavy:
        constant_fillers(param)
    return param


def constant_fillers(param):
    """Make every weight filler constant: drawing 10^8 random weights would dominate the time of
    a test about graph construction and shapes."""
    for layer in list(param.layer) + list(param.layers):
        for descriptor, value in layer.ListFields():
            if descriptor.message_type is None or descriptor.is_repeated:
                continue
            for sub, filler in value.ListFields():
                if sub.message_type is pb.FillerParameter.DESCRIPTOR and not sub.is_repeated:
                    filler.CopyFrom(pb.FillerParameter(type="constant", value=0.5))


def data_batch(param):
    """The batch the edited net declares for its `data` blob (every phase agrees)."""
    batches = {layer.dummy_data_param.shape[0].dim[0] if layer.type == "DummyData"
               else layer.input_param.shape[0].dim[0]
               for layer in param.layer if "data" in layer.top}
    batches.update(param.input_dim[:1])
    batches.update(shape.dim[0] for shape in param.input_shape[:1])
    assert len(batches) == 1, f"the data blob has batches {batches}"
    return batches.pop()


def declared_in(layer, phase):
    """Caffe's NetStateRule check for rules that name a phase only (all these nets use)."""
    rules = list(layer.include) or list(layer.exclude)
    assert all(not (r.stage or r.not_stage or r.HasField("min_level") or r.HasField("max_level"))
               for r in rules), f"{layer.name}: only phase rules are expected"
    hit = any(not r.HasField("phase") or r.phase == phase for r in rules)
    return hit if layer.include else not hit


def expected_layers(param, phase):
    """Layer names Caffe builds in `phase`, before Split insertion; a legacy `input` becomes a
    layer named "input"."""
    names = ["input"] if param.input else []
    return names + [layer.name for layer in list(param.layer) + list(param.layers)
                    if declared_in(layer, phase)]


def test_every_net_on_disk_has_a_spec():
    assert len(NETS) >= 25, f"expected the fixtures and the model zoo, found {sorted(NETS)}"
    assert sorted(NETS) == sorted(SPECS), "add new nets to SPECS (sample shape, known blobs)"


def run_forward(net):
    """Forward a light net (random values into Input blobs, DummyData fills itself): every blob
    is finite, probabilities sum to one, losses are positive."""
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(net.blobs[name].shape).astype(np.float32)
              for name in net.inputs}
    out = net.forward(**inputs)
    for name, blob in net.blobs.items():
        assert np.isfinite(blob.data).all(), f"blob '{name}' is not finite after forward"
    if "prob" in out:
        np.testing.assert_allclose(out["prob"].reshape(len(out["prob"]), -1).sum(1), 1,
                                   rtol=1e-5)
    for layer in net.param.layer:
        if layer.type == "SoftmaxWithLoss":
            assert float(net.blobs[layer.top[0]].data) > 0, f"{layer.name} gives no loss"


@pytest.mark.parametrize("name,phase", CASES)
def test_builds_with_caffe_shapes(name, phase):
    spec = SPECS[name]
    param = runnable(NETS[name], spec)
    batch = data_batch(param)
    assert 1 <= batch <= batch_cap(spec)
    net = syncsgd.Net(param, phase)
    try:
        built = [name for name, layer in net.layer_dict.items() if layer.type != "Split"]
        assert built == expected_layers(param, phase)
        assert net.blobs["data"].shape == (batch,) + spec.sample
        for layer in net.param.layer:
            if layer.type in ("SoftmaxWithLoss", "Accuracy"):
                assert net.blobs[layer.top[0]].shape == (), f"{layer.name} gives a scalar"
        for blob, shape in spec.shapes.items():
            assert blob in net.blobs, f"no blob '{blob}' in {name}"
            assert net.blobs[blob].shape == (batch,) + shape, f"{name}: blob '{blob}'"
        if not spec.heavy:
            run_forward(net)
    finally:
        del net
        gc.collect()
