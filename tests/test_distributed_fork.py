"""The fork layers that train, over real MPI ranks: nets of them trained on 2 ranks equal the
one-process run (weights within 1e-5 of their scale), as tests/test_distributed.py shows for
BVLC's layers. Batch statistics (BN), loss normalisers (SmoothL1Loss, A-Softmax's softmax,
MultiBoxLoss's matches, CtcLoss's batch), CenterLoss's per-class counts and SSD's augmentation
draws must all be the global batch's for that to hold. The SSD and CRNN nets train through
`syncsgd train` on the LMDB and HDF5 sets the test writes."""
import numpy as np
import pytest
from google.protobuf import text_format

import mpirun
from syncsgd.weights import read_weights
from tests.test_distributed import assert_same, train
from tests.test_layers_fork_ocr import crnn_train_param, write_ocr_set
from tests.test_layers_fork_ssd_train import TINY_SSD, write_annotated_lmdb

pytestmark = pytest.mark.mpi

NET = """
name: "forks"
layer { name: "data" type: "DummyData" top: "data" top: "label" top: "target"
        dummy_data_param { shape { dim: 10 dim: 3 dim: 12 dim: 12 } shape { dim: 10 }
                           shape { dim: 10 dim: 4 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 4.99 }
                           data_filler { type: "gaussian" std: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BN" bottom: "conv1" top: "bn1"
        bn_param { slope_filler { type: "constant" value: 1 }
                   bias_filler { type: "constant" value: 0 } } }
layer { name: "relu1" type: "ReLU6" bottom: "bn1" top: "relu1" }
layer { name: "dw" type: "DepthwiseConvolution" bottom: "relu1" top: "dw"
        convolution_param { num_output: 8 group: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } } }
layer { name: "squeeze" type: "Pooling" bottom: "dw" top: "squeeze"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "excite" type: "Sigmoid" bottom: "squeeze" top: "excite" }
layer { name: "axpy" type: "Axpy" bottom: "excite" bottom: "dw" bottom: "bn1" top: "axpy" }
layer { name: "reorg" type: "Reorg" bottom: "axpy" top: "reorg" reorg_param { stride: 2 } }
layer { name: "flip" type: "Flip" bottom: "reorg" top: "flip" }
layer { name: "pool" type: "Pooling" bottom: "flip" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "feat" type: "InnerProduct" bottom: "pool" top: "feat"
        inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "asoftmax" type: "MarginInnerProduct" bottom: "feat" bottom: "label"
        top: "asoftmax"
        margin_inner_product_param { num_output: 5 type: DOUBLE base: 10 gamma: 0.1 power: 1
                                     lambda_min: 2 weight_filler { type: "xavier" } } }
layer { name: "margin" type: "LabelSpecificAdd" bottom: "asoftmax" bottom: "label"
        top: "margin" label_specific_add_param { bias: -0.2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "margin" bottom: "label" top: "loss" }
layer { name: "center" type: "CenterLoss" bottom: "feat" bottom: "label" top: "center"
        loss_weight: 0.01
        center_loss_param { num_output: 5 center_filler { type: "gaussian" std: 0.1 } } }
layer { name: "box" type: "InnerProduct" bottom: "feat" top: "box"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "box_loss" type: "SmoothL1Loss" bottom: "box" bottom: "target" top: "box_loss"
        smooth_l1_loss_param { sigma: 3 } }
"""


def test_fork_layers_train_on_two_ranks_as_on_one(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" base_lr: 0.05 momentum: 0.9 '
                      f'lr_policy: "fixed" weight_decay: 0.001 max_iter: 100 random_seed: 3 '
                      f'snapshot_prefix: "{tmp_path}/snap"')
    one = train(1, solver, 6, tmp_path / "1.npz")
    assert_same(train(2, solver, 6, tmp_path / "2.npz"), one)


# SSD's augmentation on top of the tiny SSD net: mirror, expansion, a sampled crop, resizing.
AUGMENTED = (
    "mirror: true expand_param {{ prob: 0.5 max_expand_ratio: 1.5 }} "
    "resize_param {{ prob: 1 resize_mode: WARP height: 32 width: 32 }} }} "
    "annotated_data_param {{ batch_sampler {{ max_sample: 1 max_trials: 20 "
    "sampler {{ min_scale: 0.5 max_scale: 1 min_aspect_ratio: 0.5 max_aspect_ratio: 2 }} "
    "sample_constraint {{ min_jaccard_overlap: 0.3 }} }} }}")


def cli_weights(n, tmp_path, net, iterations, name, resume=None):
    """`syncsgd train` of `net` on n ranks (from the `resume` solverstate if given); the final
    snapshot's weights, layer.i -> array."""
    solver = tmp_path / f"{name}.prototxt"
    solver.write_text(f'net: "{net}" type: "SGD" base_lr: 0.01 momentum: 0.9 '
                      f'lr_policy: "fixed" max_iter: {iterations} display: 1 random_seed: 4 '
                      f'snapshot_prefix: "{tmp_path}/{name}"')
    mpirun.run(n, "-m", "syncsgd.cli", "train", "--solver", solver,
               *(["--snapshot", resume] if resume else []))
    weights = read_weights(tmp_path / f"{name}_iter_{iterations}.caffemodel")
    return {f"{layer}/{i}": np.asarray(values).reshape(shape)
            for layer, blobs in weights.items() for i, (values, shape, _) in blobs.items()}


def test_ssd_trains_on_two_ranks_as_on_one(tmp_path):
    source = write_annotated_lmdb(tmp_path / "db", count=8, encoded=True)
    text = TINY_SSD.replace("transform_param {{ mean_value: 60 scale: 0.02 }}",
                            "transform_param {{ mean_value: 60 scale: 0.02 " + AUGMENTED)
    assert AUGMENTED in text
    net = tmp_path / "ssd.prototxt"
    net.write_text(text.format(source=source))
    one = cli_weights(1, tmp_path, net, 4, "one")
    assert_same(cli_weights(2, tmp_path, net, 4, "two"), one)


def test_crnn_ctc_trains_on_two_ranks_as_on_one(tmp_path):
    """Each of two steps from the same state, one process against two ranks: the first from the
    initial weights, the second from the one process's first snapshot (momentum, moving
    averages). Chained steps are not compared: the CRNN's ReLUs get values within 1e-6 of zero
    (after the first step, conv4 has one at 1.2e-6 in one run and below zero in the other,
    under ONEDNN_MAX_CPU_ISA=SSE41), and such a value's gradient is all or nothing. Nor are the
    biases of the convolutions that a BatchNorm with batch statistics follows: it takes each
    channel's mean out, so their gradient is zero but for float noise and their values stay
    about 1e-8, different in every run."""
    param = crnn_train_param(write_ocr_set(tmp_path / "train.h5"), 11)
    net = tmp_path / "crnn.prototxt"
    net.write_text(text_format.MessageToString(param))
    normalised = {layer.bottom[0] for layer in param.layer if layer.type == "BatchNorm"}
    noise = {f"{layer.name}/1" for layer in param.layer
             if layer.type == "Convolution" and layer.top[0] in normalised}
    assert len(noise) == 3
    start = tmp_path / "one_iter_1.solverstate"
    for iterations, resume in ((1, None), (2, start)):
        one = cli_weights(1, tmp_path, net, iterations, "one", resume)
        two = cli_weights(2, tmp_path, net, iterations, "two", resume)
        for key in noise:
            assert np.abs(one.pop(key)).max() < 1e-6 and np.abs(two.pop(key)).max() < 1e-6, key
        assert_same(two, one)
