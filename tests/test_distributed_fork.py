"""The fork layers that train, over real MPI ranks: a net of them trained on 2 ranks equals the
one-process run (weights within 1e-5 of their scale), as tests/test_distributed.py shows for
BVLC's layers. Batch statistics (BN), loss normalisers (SmoothL1Loss, A-Softmax's softmax) and
CenterLoss's per-class counts must all be the global batch's for that to hold."""
import pytest

from tests.test_distributed import assert_same, train

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
