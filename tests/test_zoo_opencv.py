"""Real deploy nets from public repositories (tests/zoo/README.md names each file's origin), each
built by syncsgd as its authors wrote it and run forward beside OpenCV's Caffe importer
(cv2.dnn.readNetFromCaffe) on the same seeded weights: OpenCV reads them from the .caffemodel
syncsgd writes, syncsgd from the .caffemodel.h5 it writes.

Each output (and the input of a final Softmax, whose saturation would hide errors) must agree in
the max norm relative to OpenCV's: max|ours - theirs| <= 1e-4 * max|theirs|.

A net using a layer type syncsgd does not have yet is skipped with the missing types named, so
its test starts to run once they exist.
"""
import os

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.compile import load_net_param, upgrade_net
from syncsgd.errors import PrototxtError
from syncsgd.layers import known_types
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES
from tests.test_layers_fork import detections

cv2 = pytest.importorskip("cv2")

ZOO = os.path.join(os.path.dirname(__file__), "zoo")
PROTOTXT = os.path.join(CAFFE_FIXTURES, "prototxt")
RTOL = 1e-4

# id -> (prototxt, input height and width to run at, or None for the file's own). Sizes are
# small where the net allows it: global pooling, or fully connected layers whose weights are
# made for the size; nets whose last pooling has a fixed kernel keep their size.
NETS = {
    "cifar10_full": ("BVLC_caffe/examples/cifar10/cifar10_full.prototxt", None),
    "caffenet_full_conv": ("BVLC_caffe/examples/net_surgery/bvlc_caffenet_full_conv.prototxt",
                           (227, 227)),
    "mnist_siamese": ("BVLC_caffe/examples/siamese/mnist_siamese.prototxt", None),
    "rcnn_ilsvrc13": ("BVLC_caffe/models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt",
                      (99, 99)),
    "flickr_style": ("BVLC_caffe/models/finetune_flickr_style/deploy.prototxt", (99, 99)),
    "squeezenet_1.0": ("DeepScale_SqueezeNet/SqueezeNet_v1.0/deploy.prototxt", (99, 99)),
    "squeezenet_1.1": ("DeepScale_SqueezeNet/SqueezeNet_v1.1/deploy.prototxt", (67, 67)),
    "densenet_121": ("shicai_DenseNet-Caffe/DenseNet_121.prototxt", (64, 64)),
    "mobilenet_v1": ("shicai_MobileNet-Caffe/mobilenet_deploy.prototxt", (64, 64)),
    "mobilenet_v2": ("shicai_MobileNet-Caffe/mobilenet_v2_deploy.prototxt", (64, 64)),
    "mobilenet_ssd": ("chuanqi305_MobileNet-SSD/voc/MobileNetSSD_deploy.prototxt", None),
    "shufflenet_v1": ("farmingyard_ShuffleNet/shufflenet_1x_g3_deploy.prototxt", (64, 64)),
    "shufflenet_v2": ("farmingyard_ShuffleNet/shufflenet_v2_1x_deploy.prototxt", (64, 64)),
    "fcn8s": ("shelhamer_fcn.berkeleyvision.org/voc-fcn8s/deploy.prototxt", (64, 64)),
    "hed": ("s9xie_hed/examples/hed/deploy.prototxt", (64, 64)),
    "openpose_coco": (("CMU-Perceptual-Computing-Lab_openpose/models/pose/coco/"
                       "pose_deploy_linevec.prototxt"), (32, 32)),
    "mtcnn_pnet": (("kpzhang93_MTCNN_face_detection_alignment/code/codes/MTCNNv1/model/"
                    "det1.prototxt"), (24, 36)),
    "mtcnn_rnet": (("kpzhang93_MTCNN_face_detection_alignment/code/codes/MTCNNv1/model/"
                    "det2.prototxt"), None),
    "mtcnn_onet": (("kpzhang93_MTCNN_face_detection_alignment/code/codes/MTCNNv1/model/"
                    "det3.prototxt"), None),
    "mtcnn_lnet": (("kpzhang93_MTCNN_face_detection_alignment/code/codes/MTCNNv2/model/"
                    "det4.prototxt"), None),
    "colorization": ("richzhang_colorization/models/colorization_deploy_v2.prototxt",
                     (64, 64)),
    "places365_alexnet": ("CSAILVision_places365/deploy_alexnet_places365.prototxt", (99, 99)),
    "places365_googlenet": ("CSAILVision_places365/deploy_googlenet_places365.prototxt", None),
    "places365_vgg16": ("CSAILVision_places365/deploy_vgg16_places365.prototxt", (32, 32)),
    "age_net": ("GilLevi_AgeGenderDeepLearning/age_net_definitions/deploy.prototxt", (99, 99)),
    "gender_net": ("GilLevi_AgeGenderDeepLearning/gender_net_definitions/deploy.prototxt",
                   (99, 99)),
    "inception_v3": ("soeaver_caffe-model/cls/inception/deploy_inception-v3.prototxt",
                     (75, 75)),
    "inception_v4": ("soeaver_caffe-model/cls/inception/deploy_inception-v4.prototxt",
                     (75, 75)),
    "inception_resnet_v2": (("soeaver_caffe-model/cls/inception/"
                             "deploy_inception-resnet-v2.prototxt"), (75, 75)),
    "resnext50": ("soeaver_caffe-model/cls/resnext/deploy_resnext50-32x4d.prototxt", (64, 64)),
    "vgg19": ("soeaver_caffe-model/cls/vgg/deploy_vgg19-pytorch.prototxt", (32, 32)),
    "se_bn_inception": ("hujie-frank_SENet/models/SE-BN-Inception.prototxt", None),
    # SE-ResNet-50 (Axpy, which OpenCV computes as a * y + x) and SegNet (BN and Upsample, which
    # OpenCV lacks) are run by tests/test_zoo_mobile_seg.py, against the nets' BVLC forms.
    "nin_imagenet": ("AbhimanyuKulkarni_caffe/models/nin_imagenet/deploy.prototxt", None),
    "res10_ssd_face": ("mpolinowski_opencv-face-detection/face_detector/deploy.prototxt", None),
    # From the Caffe fixtures (tests/fixtures/caffe/README.md names their origin).
    "alexnet": (os.path.join(PROTOTXT, "BVLC_caffe/models/bvlc_alexnet/deploy.prototxt"),
                (99, 99)),
    "resnet50": (os.path.join(PROTOTXT, "KaimingHe_deep-residual-networks/"
                                        "ResNet-50-deploy.prototxt"), None),
    "vgg16_v1_layers": (os.path.join(PROTOTXT, "yxliwhu_NYUD-FCN8s/"
                                               "VGG_ILSVRC_16_layers_deploy.prototxt"), (32, 32)),
}

# Nets syncsgd builds and runs but OpenCV's importer cannot read.
OPENCV_CANNOT = {"nin_imagenet": "OpenCV loses the blobs of a file that mixes V1 `layers` with a "
                                 "current `layer`"}


def layer_types(path):
    """The layer types a prototxt uses, read without needing syncsgd's schema to know every field
    of a fork (V1 enum types upgraded to their names); data layers are replaced by net_at_size."""
    param = pb.NetParameter()
    with open(path) as f:
        text_format.Parse(f.read(), param, allow_unknown_field=True)
    legacy = pb.NetParameter(layers=param.layers)    # NIN mixes `layer` and `layers`
    upgrade_net(legacy, path)
    return {layer.type for layer in list(param.layer) + list(legacy.layer)
            if not layer.type.endswith("Data")}


def net_at_size(path, size):
    """The net's NetParameter with batch 1 and, if given, the input height and width `size`. A
    data layer reading files (SegNet's DenseImageData) becomes an Input of 3-channel images."""
    param, _ = load_net_param(path)
    upgrade_net(param, path)
    for layer in param.layer:
        if layer.type.endswith("Data"):
            layer.CopyFrom(pb.LayerParameter(name=layer.name, type="Input", top=layer.top[:1]))
            layer.input_param.shape.add(dim=[1, 3] + list(size))
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = 1
                if size is not None:
                    shape.dim[2:] = list(size)
    return param


def fill_seeded(net, inputs, seed):
    """Random parameters under which activations stay of order one through any depth: each
    layer's weights are drawn, the layer is run on `inputs`, and a layer with a weight matrix is
    rescaled to give outputs of unit deviation (LSUV, Mishkin and Matas, "All you need is a good
    init"). BatchNorm gets statistics with positive variances and a scale factor other than 1."""
    rng = np.random.default_rng(seed)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    for i, layer in enumerate(net.layers):
        for k, blob in enumerate(layer.blobs):
            blob.data[...] = seeded_values(rng, layer.type, k, blob.shape)
        net.forward_layer(i)
        if layer.type != "BatchNorm" and layer.blobs and layer.blobs[0].data.ndim >= 2:
            deviation = float(net.top_vecs[i][0].data.std())
            if deviation > 0:
                for blob in layer.blobs:
                    blob.data /= deviation
                net.forward_layer(i)


def seeded_values(rng, layer_type, k, shape):
    if layer_type == "BatchNorm":
        factor = rng.uniform(0.5, 2.0)
        return [normal(rng, 0.2, shape) * factor, uniform(rng, 0.5, 1.5, shape) * factor,
                np.full(shape, factor)][k]
    if layer_type == "PReLU":
        return uniform(rng, 0.0, 0.5, shape)
    if k == 0 and len(shape) >= 2:
        return normal(rng, np.sqrt(2.0 / np.prod(shape[1:])), shape)
    if k == 0 and layer_type == "Scale":
        return uniform(rng, 0.5, 1.5, shape)
    return normal(rng, 0.1, shape)


def normal(rng, std, shape):
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def uniform(rng, low, high, shape):
    return rng.random(shape, dtype=np.float32) * np.float32(high - low) + np.float32(low)


def producer(param, blob):
    """The last layer writing `blob` (after in-place layers), and that layer's type and bottoms."""
    layer = [lp for lp in param.layer if blob in lp.top][-1]
    return layer.name, layer.type, list(layer.bottom)


def compared_blobs(net, param):
    """OpenCV layer name -> syncsgd blob name: every output, what a Silence layer swallows (the
    colorization net's result), and the bottom of an output Softmax."""
    names = {}
    silenced = [b for lp in param.layer if lp.type == "Silence" for b in lp.bottom]
    for blob in list(net.outputs) + silenced:
        name, kind, bottoms = producer(param, blob)
        names[name] = blob
        if kind == "Softmax":
            names[producer(param, bottoms[0])[0]] = bottoms[0]
    return names


def input_arrays(net, seed):
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-1, 1, net.blobs[name].shape).astype(np.float32)
            for name in net.inputs}


@pytest.mark.parametrize("key", sorted(NETS))
def test_deploy_net_equals_opencv(tmp_path, key):
    relative, size = NETS[key]
    path = os.path.join(ZOO, relative)     # an absolute path (Caffe fixtures) stays as it is
    try:
        missing = sorted(layer_types(path) - set(known_types()))
        if missing:
            pytest.skip(f"syncsgd lacks layer types {', '.join(missing)}")
        param = net_at_size(path, size)
    except PrototxtError as e:
        pytest.skip(f"syncsgd cannot read the net yet: {e}")
    net = syncsgd.Net(param, syncsgd.TEST)
    inputs = input_arrays(net, seed=2)
    fill_seeded(net, inputs, seed=1)
    weights = str(tmp_path / "seeded.caffemodel")
    net.save(weights)
    # syncsgd runs on the same weights come back from HDF5: the zoo's layer names ("conv1/7x7_s2",
    # "fire2/squeeze1x1", "loss3/classifier") must survive that format too.
    snapshot = str(tmp_path / "seeded.caffemodel.h5")
    net.save(snapshot)
    reload_weights(net, snapshot)
    net.forward(**inputs)

    names = compared_blobs(net, net.param)
    assert names, "the net has no output to compare"
    if key in OPENCV_CANNOT:
        pytest.skip(OPENCV_CANNOT[key])
    theirs = opencv_forward(path, weights, inputs, names)
    for layer_name, blob in names.items():
        ours, reference = net.blobs[blob].data, theirs[layer_name]
        if net.layer_dict[producer(net.param, blob)[0]].type == "DetectionOutput":
            ours, reference = detections(ours), detections(reference)
        assert_agrees(blob, ours, reference)


def reload_weights(net, path):
    """Every parameter zeroed, then read back from `path`: the run uses what the file holds."""
    for layer in net.layers:
        for blob in layer.blobs:
            blob.data[...] = 0
    net.copy_from(path)


def opencv_forward(prototxt, weights, inputs, names):
    """OpenCV's values of `names` (layer name -> anything) for `inputs`, as a dict."""
    cv = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, array in inputs.items():
        cv.setInput(array, name)
    return dict(zip(names, cv.forward(list(names))))


def assert_agrees(blob, ours, theirs):
    """max|ours - theirs| <= RTOL * max|theirs|, the arrays having as many values."""
    assert ours.size == theirs.size, (blob, ours.shape, theirs.shape)
    scale = float(np.abs(theirs).max())
    assert scale > 0 and np.isfinite(scale), (blob, scale)
    error = float(np.abs(ours.reshape(theirs.shape) - theirs).max())
    assert error <= RTOL * scale, f"{blob}: max error {error:.3g}, max |value| {scale:.3g}"
