"""Real detection nets from public repositories (tests/zoo/README.md names each file's origin) that
use the detection forks' layers, built by syncsgd as published and run forward beside OpenCV on
the same seeded weights, as tests/test_zoo_opencv.py does for the others.

Faster R-CNN and R-FCN test nets take im_info (height, width, scale) beside the image, and their
region proposals come from py-faster-rcnn's Python layer, which syncsgd runs built in. OpenCV
runs the same layer as its own `Proposal` type, which has no minimum box size: im_info's scale
is made small enough that no box is dropped for its size, and OpenCV's copy of the net names
that type, asked for as many proposals as syncsgd made (it pads to post_nms_topn with zero rows,
and its fully connected layers would run on them all); both rank them by score. A DetectionOutput
head is compared as a set, each of syncsgd's rows beside the nearest of OpenCV's: S3FD keeps
hundreds of boxes whose scores lie closer together than two implementations' float rounding, so
rows sorted by score come in a different order from each (at 640 x 640 syncsgd, the SSD fork and
OpenCV keep the same 750 boxes, but sorted by score each pair differs by up to 0.9).
"""
import os
import re

import numpy as np
import pytest

import syncsgd
from tests.test_layers_fork import detections
from tests.test_zoo_opencv import (ZOO, assert_agrees, compared_blobs, fill_seeded, net_at_size,
                                   opencv_forward, producer)

cv2 = pytest.importorskip("cv2")

# id -> (prototxt, input height and width, im_info scale or None)
NETS = {
    "faster_rcnn_vgg_cnn_m_1024": (("rbgirshick_py-faster-rcnn/models/pascal_voc/VGG_CNN_M_1024/"
                                    "faster_rcnn_end2end/test.prototxt"), (64, 96), 0.01),
    "faster_rcnn_zf": (("rbgirshick_py-faster-rcnn/models/pascal_voc/ZF/faster_rcnn_end2end/"
                        "test.prototxt"), (64, 96), 0.01),
    "rfcn_resnet50": (("YuwenXiong_py-R-FCN/models/pascal_voc/ResNet-50/rfcn_end2end/"
                       "test_agnostic.prototxt"), (128, 160), 0.01),
    "s3fd": ("sfzhang15_SFD/models/VGGNet/WIDER_FACE/SFD/deploy.prototxt", (160, 160), None),
}

# py-faster-rcnn's proposal layer in OpenCV's words (its anchors: ratios 0.5, 1, 2).
PYTHON_PROPOSAL = re.compile(
    r"type:\s*['\"]Python['\"](.*?)python_param\s*\{[^}]*?module:\s*['\"]rpn\.proposal_layer"
    r"['\"][^}]*?param_str:\s*\"'feat_stride':\s*(\d+)\"\s*\}", re.S)
OPENCV_PROPOSAL = (r"type: 'Proposal'\1proposal_param {{ feat_stride: \2 ratio: 0.5 ratio: 1 "
                   r"ratio: 2 scale: 8 scale: 16 scale: 32 post_nms_topn: {} }}")
# OpenCV's LRN ignores lrn_param.k: k x (1 + (alpha / k) / n sum x^2)^-beta is written with
# k = 1 and a Power layer scaling by k^-beta after it.
LRN = re.compile(r"layer\s*\{\s*name:\s*\"(\w+)\"\s*type:\s*\"LRN\"\s*bottom:\s*\"\w+\"\s*"
                 r"top:\s*\"(\w+)\"\s*lrn_param\s*\{([^}]*)\}\s*\}", re.S)


def opencv_text(text, proposals):
    """The prototxt as OpenCV runs the same net: the Python proposal layer as its Proposal
    type keeping `proposals` boxes, LRN's k folded into alpha and a Power layer."""
    replaced, count = PYTHON_PROPOSAL.subn(OPENCV_PROPOSAL.format(proposals), text)
    assert count == text.count("rpn.proposal_layer"), "a proposal layer OpenCV's copy lacks"

    def fold(match):
        name, blob, fields = match.groups()
        values = dict(re.findall(r"(\w+):\s*([-\d.e]+)", fields))
        k = float(values.pop("k", 1))
        if k == 1:
            return match.group(0)
        values["alpha"] = repr(float(values.get("alpha", 1)) / k)
        power = k ** -float(values.get("beta", 0.75))
        lrn = " ".join(f"{key}: {value}" for key, value in values.items())
        return (match.group(0).replace(match.group(3), f" {lrn} ") +
                f'\nlayer {{ name: "{name}_k" type: "Power" bottom: "{blob}" top: "{blob}" '
                f'power_param {{ scale: {power!r} }} }}')
    return LRN.sub(fold, replaced)


def nearest_rows(ours, theirs):
    """`theirs` reordered to face `ours` row by row: each row of ours (image, label, score,
    box) beside the closest of theirs, every row of theirs used once."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    distance = np.abs(ours[:, None] - theirs[None]).max(axis=2)
    match = distance.argmin(axis=1)
    assert len(set(match.tolist())) == len(match), "two rows face the same row"
    return theirs[match]


def sized(path, size):
    """The net with batch 1 and images of `size`; other inputs (im_info) keep their shape."""
    param = net_at_size(path, None)
    for layer in param.layer:
        for shape in layer.input_param.shape:
            if len(shape.dim) == 4:
                shape.dim[2:] = list(size)
    return param


@pytest.mark.parametrize("key", sorted(NETS))
def test_detection_net_equals_opencv(tmp_path, key):
    relative, size, scale = NETS[key]
    path = os.path.join(ZOO, relative)
    net = syncsgd.Net(sized(path, size), syncsgd.TEST)
    rng = np.random.default_rng(2)
    inputs = {"data": rng.uniform(-1, 1, net.blobs["data"].shape).astype(np.float32)}
    if scale is not None:
        inputs["im_info"] = np.array([[size[0], size[1], scale]], np.float32)
    fill_seeded(net, inputs, seed=1)
    weights = str(tmp_path / "seeded.caffemodel")
    net.save(weights)
    net.forward(**inputs)

    names = compared_blobs(net, net.param)
    rows = len(net.blobs["rois"].data) if "rois" in net.blobs else 0
    if rows:
        assert 10 < rows < 300, rows         # proposals, fewer than py-faster-rcnn's cap
        names[producer(net.param, "rois")[0]] = "rois"
    reference = tmp_path / "opencv.prototxt"
    with open(path) as f:
        reference.write_text(opencv_text(f.read(), rows))
    theirs = opencv_forward(reference, weights, inputs, names)
    for layer_name, blob in names.items():
        ours, reference = net.blobs[blob].data, theirs[layer_name]
        if net.layer_dict[producer(net.param, blob)[0]].type == "DetectionOutput":
            ours = detections(ours)
            reference = nearest_rows(ours, detections(reference))
            assert len(ours) > 10
        assert_agrees(blob, ours, reference)
