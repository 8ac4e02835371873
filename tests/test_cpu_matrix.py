"""The CPU matrix: the kernel tests, the layer tests of the oneDNN-backed layers, the lanes tests,
a short lanes stress run and a short training run, under each instruction set oneDNN may pick
its kernels for, with lanes on (and off, under SSE4.1).

oneDNN picks a kernel by shape and instruction set, so a bug may live in some kernels only: the
lanes' scratchpad crash (Note [scratchpads] in kernels/onednn.py) hit only kernels that take a
scratchpad, GEMM-based convolutions, which oneDNN picks for grouped or few-channel shapes on
AVX2 and for more under SSE4.1. ONEDNN_MAX_CPU_ISA caps what oneDNN uses and is read when the
library loads, so each combination runs in a child pytest; "default" leaves it unset (AVX-512
where the machine has it). A child that crashes fails its combination with the child's output,
faulthandler's stacks included."""
import os
from pathlib import Path

import pytest

from tests import child_pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = "SYNCSGD_CPU_MATRIX_CHILD"       # set in the children, which never run the matrix
pytestmark = pytest.mark.skipif(CHILD in os.environ, reason="inside a CPU matrix child")

# What each child runs: the kernels; the Convolution, Deconvolution, ConvolutionDepthwise,
# Pooling (and SPP, made of it), ReLU, LRN and InnerProduct layers (oneDNN's matmul); gradients
# over cleared diffs; forms; lanes; the short stress run and the training run. Left out: tests
# whose kernels do not depend on oneDNN's instruction set (OpenBLAS's GEMMs at alpha 0.5) or
# that choose it themselves in children of their own.
SELECTION = [
    "tests/test_kernels.py",
    "--deselect", "tests/test_kernels.py::test_gemm_matches_numpy_in_every_layout",
    "--deselect", "tests/test_kernels.py::test_onednn_primitives_run_on_a_thread_other_than_"
                  "their_builder",
    "tests/test_layers_spatial.py",
    "tests/test_layers_dense.py::test_inner_product_forward",
    "tests/test_layers_dense.py::test_inner_product_gradient",
    "tests/test_layers_dense.py::test_inner_product_accumulates_param_diffs",
    "tests/test_layers_dense.py::test_lrn_forward",
    "tests/test_layers_dense.py::test_lrn_gradient",
    "tests/test_layers_fork.py::test_depthwise_is_a_convolution_with_one_group_per_channel",
    "tests/test_layers_fork.py::test_depthwise_gradient",
    "tests/test_layers_simple.py::test_relu_in_pieces_on_threads",
    "tests/test_layers_catalogue_loss.py::test_spp_value",
    "tests/test_layers_catalogue_loss.py::test_spp_gradient",
    "tests/test_cleared_diffs.py",
    "tests/test_forms.py",
    "tests/test_lanes.py",
    "tests/test_lanes_stress.py",
]
SHORT_STRESS = {"SYNCSGD_STRESS_NETS": "12", "SYNCSGD_STRESS_PASSES": "4"}
TIMEOUT = 300


# The suite itself runs the instruction set unset with lanes on. The children run the capped
# sets with lanes on (threads sharing oneDNN's primitives, where the scratchpad crash was) and
# SSE4.1, whose GEMM-based kernels differ most, with lanes off too.
COMBINATIONS = [("AVX2", "1"), ("SSE41", "1"), ("SSE41", "0")]


@pytest.mark.parametrize("isa, lanes", COMBINATIONS)
def test_kernels_layers_lanes_and_training_under_each_instruction_set(isa, lanes):
    env = {name: value for name, value in os.environ.items() if name != "ONEDNN_MAX_CPU_ISA"}
    env.update(SHORT_STRESS, SYNCSGD_LANES=lanes, **{CHILD: "1"})
    if isa != "default":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    code, _, report = child_pytest.run(["-x", *SELECTION], env, REPO, TIMEOUT,
                                       f"ONEDNN_MAX_CPU_ISA={isa} SYNCSGD_LANES={lanes}")
    assert code == 0, report
