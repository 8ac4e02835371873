"""YOLO ports from public repositories (tests/zoo/README.md names each file's origin), built by
syncsgd as their authors wrote them, on seeded weights (tests/test_zoo_opencv.py's fill_seeded).

OpenCV's Caffe importer runs none of their heads (its Region needs the anchors as a weight blob,
and it has no YoloDetectionOutput or Yolov3DetectionOutput), so each net is checked in two
parts: the head's bottoms equal OpenCV's forward of the net without its head (max error within
1e-4 of the largest value, as in tests/test_zoo_opencv.py), and the head's top equals the
references of tests/test_layers_fork_yolo.py, written from the forks' C++, run on those
bottoms: detections compared as sets of boxes, once with the net's own confidence_threshold and
once with a threshold low enough that many boxes meet NMS.
"""
import os

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.layers import known_types
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, make_layer, run_forward
from tests.test_layers_fork import detections
from tests.test_layers_fork_yolo import region_reference, yolo_v2_reference, yolo_v3_reference
from tests.test_zoo_opencv import (ZOO, assert_agrees, fill_seeded, input_arrays, layer_types,
                                   net_at_size, producer)

cv2 = pytest.importorskip("cv2")

# id -> (prototxt under tests/zoo, input height and width to run at). The default suite runs
# one net per head type; the slow ones (50M parameters, or a second net for a head) are kept for
# `pytest -m slow`.
NETS = {
    "tiny_yolov2_region": ("lwplw_caffe_yolov2/examples/yolov2/yolov2_tiny_3.prototxt",
                           (32, 32)),
    "yolov2_darknet19": ("eric612_MobileNet-YOLO/models/darknet/darknet19_deploy.prototxt",
                         (64, 64)),
    "yolov2_mobilenet_lite": (("eric612_MobileNet-YOLO/models/yolov2/"
                               "mobilenet_yolo_lite_deploy.prototxt"), (64, 64)),
    "yolov3_tiny": ("eric612_MobileNet-YOLO/models/darknet_yolov3/yolov3-tiny.prototxt",
                    (32, 32)),
    # Not 32x32: OpenCV 4.14's depthwise 3x3 convolution is wrong on a 1x1 map (conv13/dw).
    "yolov3_mobilenet_lite": (("eric612_MobileNet-YOLO/models/yolov3/"
                               "mobilenet_yolov3_lite_deploy.prototxt"), (64, 64)),
}
SLOW = {"yolov2_darknet19", "yolov3_mobilenet_lite"}
KEYS = [pytest.param(key, marks=pytest.mark.slow) if key in SLOW else key for key in sorted(NETS)]

HEADS = ("Region", "YoloDetectionOutput", "Yolov3DetectionOutput")
# OpenCV has no DepthwiseConvolution: the ports' layer is a Convolution whose group, which their
# files set, is the number of channels.
OPENCV_TYPES = {"DepthwiseConvolution": "Convolution"}
# A confidence threshold under which most boxes of the seeded nets survive it.
LOW_THRESHOLD = 0.05


class Run:
    """One net built, seeded, saved and run forward; `head` is its YOLO layer's parameter."""

    def __init__(self, key, folder):
        relative, size = NETS[key]
        path = os.path.join(ZOO, relative)
        missing = sorted(layer_types(path) - set(known_types()))
        if missing:
            pytest.skip(f"syncsgd lacks layer types {', '.join(missing)}")
        self.folder, self.param = folder, net_at_size(path, size)
        self.net = syncsgd.Net(self.param, syncsgd.TEST)
        self.inputs = input_arrays(self.net, seed=2)
        fill_seeded(self.net, self.inputs, seed=1)
        self.weights = str(folder / "seeded.caffemodel")
        self.net.save(self.weights)
        self.net.forward(**self.inputs)
        heads = [lp for lp in self.param.layer if lp.type in HEADS]
        assert len(heads) == 1, [lp.name for lp in heads]
        self.head = heads[0]

    def bottoms(self):
        return [self.net.blobs[name].data for name in self.head.bottom]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    runs = {}

    def build(key):
        if key not in runs:
            runs[key] = Run(key, tmp_path_factory.mktemp(key))
        return runs[key]
    return build


@pytest.mark.parametrize("key", KEYS)
def test_yolo_trunk_equals_opencv(built, key):
    run = built(key)
    trunk = pb.NetParameter()
    trunk.CopyFrom(run.param)
    del trunk.layer[list(trunk.layer).index(run.head)]
    for layer in trunk.layer:
        layer.type = OPENCV_TYPES.get(layer.type, layer.type)
    prototxt = run.folder / "trunk.prototxt"
    prototxt.write_text(text_format.MessageToString(trunk))
    cv = cv2.dnn.readNetFromCaffe(str(prototxt), run.weights)
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    for name, array in run.inputs.items():
        cv.setInput(array, name)
    # OpenCV names a layer by its top where they differ (mobilenet_yolo_lite's "conv22_indoor").
    known = set(cv.getLayerNames())
    names = [name if name in known else blob
             for name, blob in ((producer(trunk, blob)[0], blob) for blob in run.head.bottom)]
    for blob, theirs in zip(run.head.bottom, cv.forward(names)):
        ours = run.net.blobs[blob].data
        assert ours.shape == theirs.shape, (blob, ours.shape, theirs.shape)
        assert_agrees(blob, ours, theirs)


PARAMS = {"YoloDetectionOutput": "yolo_detection_output_param",
          "Yolov3DetectionOutput": "yolov3_detection_output_param"}


def head_with_threshold(head, threshold):
    """The head's layer with another confidence_threshold."""
    param = pb.LayerParameter()
    param.CopyFrom(head)
    getattr(param, PARAMS[head.type]).confidence_threshold = threshold
    return make_layer(text_format.MessageToString(param), phase=syncsgd.TEST)


def fork_detections(head, maps, threshold):
    if head.type == "YoloDetectionOutput":
        p = head.yolo_detection_output_param
        return yolo_v2_reference(maps, p.num_classes, list(p.biases)[:2 * p.num_box], threshold,
                                 p.nms_threshold)
    p = head.yolov3_detection_output_param
    group = len(p.mask) // len(maps)
    masks = [p.mask[t * group:t * group + p.num_box] for t in range(len(maps))]
    return yolo_v3_reference(maps, p.num_classes, list(p.biases), masks, p.anchors_scale,
                             threshold, p.nms_threshold, p.gaussian_box)


@pytest.mark.parametrize("key", KEYS)
def test_yolo_head_equals_the_fork(built, key):
    run = built(key)
    maps, top = run.bottoms(), run.net.blobs[run.head.top[0]].data
    if run.head.type == "Region":
        p = run.head.region_param
        np.testing.assert_allclose(top, region_reference(maps[0], p.classes,
                                                         p.boxes_of_each_grid, p.softmax),
                                   rtol=1e-6, atol=1e-7)
        return
    own = getattr(run.head, PARAMS[run.head.type]).confidence_threshold
    low = run_forward(head_with_threshold(run.head, LOW_THRESHOLD), blobs_from(maps))[0].data
    for rows, threshold in ((top, own), (low, LOW_THRESHOLD)):
        expected = detections(fork_detections(run.head, maps, threshold))
        ours = detections(rows)
        assert ours.shape == expected.shape, (threshold, ours.shape, expected.shape)
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)
    assert len(detections(low)) >= 5
