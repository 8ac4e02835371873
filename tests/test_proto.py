"""The committed generated module must be exactly what protoc makes of proto/syncsgd.proto, and
the schema must read Caffe's own files."""
import glob
import os
import subprocess
import sys

import pytest
from google.protobuf import text_format, unknown_fields

from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_module_matches_schema(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}/proto",
                    f"--python_out={tmp_path}", f"{ROOT}/proto/syncsgd.proto"], check=True)
    fresh = (tmp_path / "syncsgd_pb2.py").read_text()
    committed = open(os.path.join(ROOT, "syncsgd", "proto", "syncsgd_pb2.py")).read()
    marker = "AddSerializedFile("
    fresh_desc = fresh[fresh.index(marker):].split("\n", 1)[0]
    committed_desc = committed[committed.index(marker):].split("\n", 1)[0]
    assert fresh_desc == committed_desc, (
        "syncsgd/proto/syncsgd_pb2.py is stale: regenerate it with "
        "`python -m grpc_tools.protoc -Iproto --python_out=syncsgd/proto proto/syncsgd.proto`")


# Fields numbered in the extension range: syncsgd's own, and the fork fields whose fork numbers
# BVLC (or an earlier fork here) uses for other fields.
EXTENSIONS = {
    "LayerParameter": {"parallel_param", "interp_param", "upsample_param",
                       "dense_image_data_param", "region_param", "ctc_decoder_param",
                       "lstm_param", "margin_inner_product_param", "center_loss_param"},
    "SolverParameter": {"distributed_param"},
    "PoolingParameter": {"ceil_mode"},
}
# Fork fields under the forks' own numbers, so that the forks' binary files read too.
FORK_NUMBERS = {"permute_param": 202, "prior_box_param": 203, "detection_output_param": 204,
                "norm_param": 206, "shuffle_channel_param": 164, "annotated_data_param": 200,
                "multibox_loss_param": 201, "bn_param": 152, "relu6_param": 503,
                "reorg_param": 149, "yolo_detection_output_param": 601,
                "yolov3_detection_output_param": 602, "ctc_loss_param": 157,
                "continuation_indicator_param": 158, "reverse_param": 160,
                "transpose_param": 8266710, "roi_pooling_param": 8266711,
                "smooth_l1_loss_param": 8266712, "psroi_pooling_param": 10001,
                "flip_param": 212, "label_specific_add_param": 241}


def test_extension_numbers_are_in_the_reserved_range():
    for message, names in EXTENSIONS.items():
        desc = getattr(pb, message).DESCRIPTOR
        ours = [f for f in desc.fields if f.name in names]
        assert len(ours) == len(names) and all(5000 <= f.number < 5100 for f in ours)
        others = [f for f in desc.fields if f not in ours and f.name not in FORK_NUMBERS]
        assert max(f.number for f in others) < 1000


def test_fork_fields_keep_the_forks_numbers():
    fields = pb.LayerParameter.DESCRIPTOR.fields_by_name
    assert {name: fields[name].number for name in FORK_NUMBERS} == FORK_NUMBERS


@pytest.mark.parametrize("path", sorted(glob.glob(f"{CAFFE_FIXTURES}/prototxt/**/*.prototxt",
                                                  recursive=True)))
def test_caffe_prototxt_parses(path):
    text = open(path).read()
    message = pb.SolverParameter() if "solver" in os.path.basename(path) else pb.NetParameter()
    text_format.Parse(text, message)
    # Text round trip: what we print, Caffe's parser (same field names) reads back identically.
    again = type(message)()
    text_format.Parse(text_format.MessageToString(message), again)
    assert again == message


def test_caffe_binary_files_parse():
    weights = os.path.join(CAFFE_FIXTURES, "weights")
    for name in ("lenet-ethereon/lenet_iter_10000.caffemodel",
                 "cifar10-quick-ictchase/cifar10_quick_iter_4000.caffemodel",
                 "lenet-v1-pl8787/lenet_iter_10000"):
        data = open(os.path.join(weights, name), "rb").read()
        net = pb.NetParameter.FromString(data)
        assert net.layer or net.layers
        # Every field is known to the schema (nothing dropped) and re-serialises byte for byte.
        assert len(unknown_fields.UnknownFieldSet(net)) == 0
        assert net.SerializeToString() == data
    state = pb.SolverState.FromString(
        open(os.path.join(weights, "cifar10-quick-ictchase/cifar10_quick_iter_4000.solverstate"),
             "rb").read())
    assert state.iter == 4000 and len(state.history) == 10
