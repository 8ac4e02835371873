"""Every net in tests/zoo/ and models/ through the ONNX export (syncsgd/onnx), run in ONNX Runtime
beside syncsgd's forward on the same seeded weights and input.

A deploy net whose layers all have an ONNX form exports whole; one with a layer that has none
(DetectionOutput, Python, ...) stops with an error naming that layer, and exports up to it
(`until`). Nets that read a data source (train/val nets, SegNet's and CRNN's deploy files) are
refused naming the data layer; the deploy ones run here with an Input in its place, as
tests/test_zoo_opencv.py runs them. Sizes are small, as there (weights are drawn per layer so
that activations stay of order one: test_zoo_opencv.fill_seeded).

Agreement: max |ONNX Runtime - syncsgd| <= 1e-4 * max |syncsgd| for each output; an output a
Softmax makes is held to 1e-4 of its input's scale, since probabilities are only as exact as the
logits they come from (a saturated softmax turns the logits' rounding, 1e-7 of their scale, into
an error of that size in the probabilities).

The heaviest nets (40-135M weights, 3-25 s each on this 2-core machine) run only with
`pytest -m slow` (SLOW below); their layer types all run in the others and in
tests/test_onnx_layers.py.
"""
import os

import numpy as np
import pytest

import syncsgd
import tests.test_zoo_opencv as opencv_zoo
from syncsgd import log
from syncsgd.compile import load_net_param, upgrade_net
from syncsgd.errors import SyncSGDError
from syncsgd.onnx import TOLERANCE, check, refuse_data_layers, export
from tests.test_zoo_build import constant_fillers
from tests.test_zoo_mobile_seg import global_last_pool, pyramid_at, upsample_by_two
from tests.test_zoo_opencv import fill_seeded, input_arrays, net_at_size, producer

pytest.importorskip("onnxruntime")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z = "tests/zoo/"
MOBILE_YOLO = Z + "eric612_MobileNet-YOLO/models/"
MTCNN = Z + "kpzhang93_MTCNN_face_detection_alignment/code/codes/"
SOEAVER = Z + "soeaver_caffe-model/cls/"
FRCNN = Z + "rbgirshick_py-faster-rcnn/models/pascal_voc/"

# path -> (input height and width, or None for the file's own; rewrite for that size; the layer
# the export stops at, or None when it exports whole).
DEPLOY = {
    Z + "AbhimanyuKulkarni_caffe/models/nin_imagenet/deploy.prototxt": (None, None, None),
    Z + "BVLC_caffe/examples/cifar10/cifar10_full.prototxt": (None, None, None),
    Z + "BVLC_caffe/examples/net_surgery/bvlc_caffenet_full_conv.prototxt": ((227, 227), None,
                                                                            None),
    Z + "BVLC_caffe/examples/siamese/mnist_siamese.prototxt": (None, None, None),
    Z + "BVLC_caffe/models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt": ((67, 67), None, None),
    Z + "BVLC_caffe/models/finetune_flickr_style/deploy.prototxt": ((67, 67), None, None),
    Z + ("CMU-Perceptual-Computing-Lab_openpose/models/pose/coco/"
         "pose_deploy_linevec.prototxt"): ((32, 32), None, None),
    Z + "CSAILVision_places365/deploy_alexnet_places365.prototxt": ((67, 67), None, None),
    Z + "CSAILVision_places365/deploy_googlenet_places365.prototxt": ((64, 64),
                                                                     global_last_pool, None),
    Z + "CSAILVision_places365/deploy_vgg16_places365.prototxt": ((32, 32), None, None),
    Z + "DeepScale_SqueezeNet/SqueezeNet_v1.0/deploy.prototxt": ((67, 67), None, None),
    Z + "DeepScale_SqueezeNet/SqueezeNet_v1.1/deploy.prototxt": ((67, 67), None, None),
    Z + "GilLevi_AgeGenderDeepLearning/age_net_definitions/deploy.prototxt": ((67, 67), None,
                                                                              None),
    Z + "GilLevi_AgeGenderDeepLearning/gender_net_definitions/deploy.prototxt": ((67, 67), None,
                                                                                 None),
    Z + "TimoSaemann_ENet/prototxts/enet_deploy_final.prototxt": ((32, 32), None, None),
    Z + ("YuwenXiong_py-R-FCN/models/pascal_voc/ResNet-50/rfcn_end2end/"
         "test_agnostic.prototxt"): ((32, 32), None, "proposal"),
    Z + "alexgkendall_SegNet-Tutorial/Models/segnet_basic_inference.prototxt": (
        (32, 32), upsample_by_two, None),
    Z + "alexgkendall_SegNet-Tutorial/Models/segnet_inference.prototxt": (
        (32, 32), upsample_by_two, None),
    Z + "chuanqi305_MobileNet-SSD/voc/MobileNetSSD_deploy.prototxt": ((64, 64), None,
                                                                     "detection_out"),
    Z + "chuanqi305_MobileNetv2-SSDLite/ssdlite/voc/deploy.prototxt": ((64, 64), None,
                                                                      "detection_out"),
    MOBILE_YOLO + "darknet/darknet19_deploy.prototxt": ((32, 32), None, "detection_out"),
    MOBILE_YOLO + "darknet_yolov3/yolov3-tiny.prototxt": ((32, 32), None, "layer24-yolo"),
    MOBILE_YOLO + "yolov2/mobilenet_yolo_lite_deploy.prototxt": ((32, 32), None,
                                                                 "detection_out"),
    MOBILE_YOLO + "yolov3/mobilenet_yolov3_lite_deploy.prototxt": ((32, 32), None,
                                                                   "detection_out"),
    Z + "farmingyard_ShuffleNet/shufflenet_1x_g3_deploy.prototxt": ((32, 32), None, None),
    Z + "farmingyard_ShuffleNet/shufflenet_v2_1x_deploy.prototxt": ((32, 32), None, None),
    Z + "hszhao_PSPNet/evaluation/prototxt/pspnet50_ADE20K_473.prototxt": ((41, 41),
                                                                          pyramid_at, None),
    Z + "hujie-frank_SENet/models/SE-BN-Inception.prototxt": (None, None, None),
    Z + "hujie-frank_SENet/models/SE-ResNet-50.prototxt": ((32, 32), global_last_pool, None),
    Z + "jolibrain_deepdetect/templates/caffe/crnn/deploy.prototxt": ((32, 64), None,
                                                                     "indicator"),
    MTCNN + "MTCNNv1/model/det1.prototxt": ((24, 36), None, None),
    MTCNN + "MTCNNv1/model/det2.prototxt": (None, None, None),
    MTCNN + "MTCNNv1/model/det3.prototxt": (None, None, None),
    MTCNN + "MTCNNv2/model/det4.prototxt": (None, None, None),
    Z + "lwplw_caffe_yolov2/examples/yolov2/yolov2_tiny_3.prototxt": ((32, 32), None,
                                                                      "region1"),
    Z + "mpolinowski_opencv-face-detection/face_detector/deploy.prototxt": ((64, 64), None,
                                                                           "detection_out"),
    FRCNN + "VGG_CNN_M_1024/faster_rcnn_end2end/test.prototxt": ((64, 64), None, "proposal"),
    FRCNN + "ZF/faster_rcnn_end2end/test.prototxt": ((64, 64), None, "proposal"),
    Z + "richzhang_colorization/models/colorization_deploy_v2.prototxt": ((32, 32), None, None),
    Z + "s9xie_hed/examples/hed/deploy.prototxt": ((32, 32), None, None),
    Z + "senlinuc_caffe_ocr/examples/ocr/resnet/deploy.prototxt": ((32, 64), None, "lstm1"),
    Z + "sfzhang15_SFD/models/VGGNet/WIDER_FACE/SFD/deploy.prototxt": ((64, 64), None,
                                                                      "detection_out"),
    Z + "shelhamer_fcn.berkeleyvision.org/voc-fcn8s/deploy.prototxt": ((32, 32), None, None),
    Z + "shicai_DenseNet-Caffe/DenseNet_121.prototxt": ((32, 32), None, None),
    Z + "shicai_MobileNet-Caffe/mobilenet_deploy.prototxt": ((32, 32), None, None),
    Z + "shicai_MobileNet-Caffe/mobilenet_v2_deploy.prototxt": ((32, 32), None, None),
    SOEAVER + "inception/deploy_inception-resnet-v2.prototxt": ((75, 75), None, None),
    SOEAVER + "inception/deploy_inception-v3.prototxt": ((75, 75), None, None),
    SOEAVER + "inception/deploy_inception-v4.prototxt": ((75, 75), None, None),
    SOEAVER + "resnext/deploy_resnext50-32x4d.prototxt": ((32, 32), None, None),
    SOEAVER + "vgg/deploy_vgg19-pytorch.prototxt": ((32, 32), None, None),
    Z + "yonghenglh6_DepthwiseConvolution/example/depthwised_mobilenet_deploy.prototxt": (
        (32, 32), None, None),
    "models/alexnet/deploy.prototxt": ((67, 67), None, None),
    "models/cddnn/deploy.prototxt": (None, None, None),
    "models/cifar10_full/deploy.prototxt": (None, None, None),
    "models/cifar10_quick/deploy.prototxt": (None, None, None),
    "models/googlenet/deploy.prototxt": ((64, 64), global_last_pool, None),
    "models/lenet/deploy.prototxt": (None, None, None),
    "models/overfeat_fast/deploy.prototxt": ((71, 71), None, None),
    "models/resnet50/deploy.prototxt": ((32, 32), global_last_pool, None),
    "models/vgg_a/deploy.prototxt": ((32, 32), None, None),
}
SLOW = {Z + "BVLC_caffe/examples/net_surgery/bvlc_caffenet_full_conv.prototxt",
        Z + "shelhamer_fcn.berkeleyvision.org/voc-fcn8s/deploy.prototxt",
        MOBILE_YOLO + "darknet/darknet19_deploy.prototxt",
        Z + "hszhao_PSPNet/evaluation/prototxt/pspnet50_ADE20K_473.prototxt",
        SOEAVER + "inception/deploy_inception-resnet-v2.prototxt",
        SOEAVER + "inception/deploy_inception-v4.prototxt",
        Z + ("CMU-Perceptual-Computing-Lab_openpose/models/pose/coco/"
             "pose_deploy_linevec.prototxt"),
        FRCNN + "VGG_CNN_M_1024/faster_rcnn_end2end/test.prototxt",
        Z + ("YuwenXiong_py-R-FCN/models/pascal_voc/ResNet-50/rfcn_end2end/"
             "test_agnostic.prototxt"),
        # 2-3 s each, their layer types in lighter nets: VGG's in vgg_a, Inception's in
        # googlenet, ResNeXt's groups in AlexNet's and MobileNet's, DenseNet's concatenations
        # in googlenet's, SENet's in SE-ResNet-50.
        SOEAVER + "vgg/deploy_vgg19-pytorch.prototxt",
        Z + "CSAILVision_places365/deploy_vgg16_places365.prototxt",
        SOEAVER + "inception/deploy_inception-v3.prototxt",
        SOEAVER + "resnext/deploy_resnext50-32x4d.prototxt",
        Z + "shicai_DenseNet-Caffe/DenseNet_121.prototxt",
        Z + "hujie-frank_SENet/models/SE-BN-Inception.prototxt"}

# path -> the data layer the export refuses (the first in the file).
DATA = {
    Z + "chuanqi305_MobileNet-SSD/voc/MobileNetSSD_train.prototxt": "data",
    Z + "wy1iu_sphereface/train/code/sphereface_model.prototxt": "data",
    Z + "ydwen_caffe-face/mnist_example/mnist_train_test.prototxt": "mnist",
    Z + "alexgkendall_SegNet-Tutorial/Models/segnet_inference.prototxt": "data",
    Z + "alexgkendall_SegNet-Tutorial/Models/segnet_basic_inference.prototxt": "data",
    Z + "jolibrain_deepdetect/templates/caffe/crnn/deploy.prototxt": "crnn",
}
# CRNN's training net names a layer type (LabelsequenceAccuracy) syncsgd does not read.
UNREADABLE = {Z + "jolibrain_deepdetect/templates/caffe/crnn/crnn.prototxt"}


def nets_on_disk():
    found = set()
    for folder in ("tests/zoo", "models"):
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            found.update(os.path.relpath(os.path.join(directory, name), ROOT)
                         for name in files if name.endswith(".prototxt")
                         and "solver" not in name)
    return found


NETS = nets_on_disk()
TRAIN_VAL = sorted(path for path in NETS if path.endswith("train_val.prototxt"))


def test_every_net_is_here():
    listed = set(DEPLOY) | set(DATA) | set(TRAIN_VAL) | UNREADABLE
    assert NETS - listed == set(), "add these nets to the tables of this file"


opencv_zoo_values = opencv_zoo.seeded_values


def seeded_values(rng, layer_type, k, shape):
    """fill_seeded's values, with positive variances for the forks' BN (blob 3) as well, and
    uniform where it draws normal weights (the same deviation, five times faster to draw: the
    drawing took a tenth of this file's time)."""
    if layer_type == "BN" and k == 3:
        return opencv_zoo.uniform(rng, 0.5, 1.5, shape)
    if k == 0 and len(shape) >= 2:
        bound = np.sqrt(3 * 2.0 / np.prod(shape[1:]))
        return opencv_zoo.uniform(rng, -bound, bound, shape)
    return opencv_zoo_values(rng, layer_type, k, shape)


def seeded_net(path, size, rewrite, monkeypatch):
    param = net_at_size(os.path.join(ROOT, path), size)
    if rewrite is not None:
        rewrite(param)
    constant_fillers(param)         # the weights are drawn once, below
    log.configure(enabled=False)
    net = syncsgd.Net(param, syncsgd.TEST)
    inputs = input_arrays(net, seed=2)
    monkeypatch.setattr(opencv_zoo, "seeded_values", seeded_values)
    fill_seeded(net, inputs, seed=1)
    return net, inputs


def assert_agrees(net, results):
    """Each output within TOLERANCE of its scale (a Softmax's: of its input's, see above)."""
    assert results, "the model has no output"
    for name, (error, scale) in results.items():
        _, kind, bottoms = producer(net.param, name)
        if kind == "Softmax":
            scale = max(scale, float(np.abs(net.blobs[bottoms[0]].data).max()))
        assert np.isfinite(scale) and scale > 0, (name, scale)
        assert error <= TOLERANCE * scale, f"{name}: max error {error:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p
                                  for p in sorted(DEPLOY) if p in NETS])
def test_deploy_net_exports_and_equals_syncsgd(tmp_path, monkeypatch, path):
    size, rewrite, stop = DEPLOY[path]
    net, inputs = seeded_net(path, size, rewrite, monkeypatch)
    model = tmp_path / "net.onnx"
    if stop is not None:
        with pytest.raises(SyncSGDError, match=rf"layer '{stop}' \(\w+\) has no ONNX form.*"
                                               rf"--until {stop}"):
            export(net, model)
    export(net, model, batch="N", until=stop)
    rng = np.random.default_rng(3)
    two = {name: np.concatenate([value, rng.uniform(-1, 1, value.shape).astype(np.float32)])
           for name, value in inputs.items()}
    assert_agrees(net, check(net, model, until=stop, inputs=two))


@pytest.mark.parametrize("path", sorted(DATA) + TRAIN_VAL)
def test_nets_reading_data_are_refused_naming_the_layer(path):
    layer = DATA.get(path) or "train_data"
    param, source = load_net_param(os.path.join(ROOT, path))
    upgrade_net(param, source)
    with pytest.raises(SyncSGDError, match=rf"layer '{layer}' \(\w*Data\) reads samples from a "
                                           r"data source; export the deploy version"):
        refuse_data_layers(param, source)


def cli(*args):
    """`syncsgd export ARGS` in this process; returns the exit status."""
    from syncsgd.cli import main
    return main(["export", *map(str, args)])


def test_cli_refuses_a_train_net_before_reading_its_data(tmp_path, capsys):
    status = cli("--model", os.path.join(ROOT, "models/lenet/train_val.prototxt"),
                 "--out", tmp_path / "x.onnx")
    assert status == 1
    assert "layer 'train_data' (HDF5Data) reads samples" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_cli_exports_up_to_a_layer_and_checks(tmp_path, capsys):
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "data" type: "Input" top: "data" top: "label" input_param { '
                   'shape { dim: 2 dim: 5 } shape { dim: 2 } } }\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                   'inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }\n'
                   'layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" '
                   'top: "accuracy" }\n')
    assert cli("--model", net, "--out", tmp_path / "whole.onnx") == 1
    assert "layer 'accuracy' (Accuracy) has no ONNX form" in capsys.readouterr().err
    model = tmp_path / "net.onnx"
    assert cli("--model", net, "--out", model, "--until", "accuracy", "--opset", 13,
               "--check") == 0
    out = capsys.readouterr().out
    assert "(opset 13; inputs data; outputs ip)" in out
    assert "output ip: max |onnxruntime - syncsgd|" in out


@pytest.mark.mpi
def test_net_trained_on_two_ranks_exports_and_equals_syncsgd(tmp_path):
    """`syncsgd train` on 2 ranks (BatchNorm, Scale, ceil pooling, LRN, dropout, two fully
    connected layers the planner lays out), then tools/export_onnx.py on the snapshot with a
    dynamic batch and --check, then ONNX Runtime beside syncsgd at another batch."""
    import subprocess
    import sys

    import mpirun
    from tests.test_distributed import NET, write_solver
    solver = write_solver(tmp_path, "SGD")
    mpirun.run(2, "-m", "syncsgd.cli", "train", "--solver", solver, "--iterations", 4,
               timeout=120)
    weights = tmp_path / "snap_iter_4.caffemodel"
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text(deploy_of(NET, (1, 3, 12, 12)))
    model = tmp_path / "net.onnx"
    done = subprocess.run([sys.executable, "tools/export_onnx.py", "--model", deploy,
                           "--weights", weights, "--out", model, "--batch", "N", "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "output prob: max |onnxruntime - syncsgd|" in done.stdout

    log.configure(enabled=False)
    net = syncsgd.Net(str(deploy), syncsgd.TEST, weights=str(weights))
    trained = syncsgd.Net(str(tmp_path / "net.prototxt"), syncsgd.TEST)
    assert not np.allclose(trained.params["fc1"][0].data, net.params["fc1"][0].data)
    images = np.random.default_rng(5).standard_normal((3, 3, 12, 12)).astype(np.float32)
    assert_agrees(net, check(net, model, inputs={"data": images}))


def deploy_of(text, shape):
    """The deploy form of a train/test net: an Input of `shape` instead of its data layers, no
    loss or accuracy, a Softmax `prob` on the last layer's top."""
    from google.protobuf import text_format

    from syncsgd.proto import pb
    net = text_format.Parse(text, pb.NetParameter())
    kept = [lp for lp in net.layer
            if not lp.type.endswith(("Data", "Loss")) and lp.type != "Accuracy"]
    deploy = pb.NetParameter(name=net.name)
    deploy.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add(dim=shape)
    deploy.layer.extend(kept)
    deploy.layer.add(name="prob", type="Softmax", bottom=[kept[-1].top[0]], top=["prob"])
    return text_format.MessageToString(deploy)
