"""The speed work of issue 7: the PyTorch twin computes what syncsgd computes, the benchmark runs,
and every fast path of the layers (GEMM splitting, per-sample / batched / wide convolution, the
image gradient as a convolution, chunks and pooling parts shared out to threads, chunked fillers)
gives the results of the plain path; the benchmark's report of the BLAS it ran."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TRAIN
from syncsgd.net import Net
from syncsgd.plan.costs import net_costs
from syncsgd.proto import pb

# The harness is tooling outside the package (tools/benchmark.py, tools/runners.py); appended,
# not prepended, so that tools/time.py and tools/test.py never shadow the standard library.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from benchmark import benchmark, format_table  # noqa: E402
from runners import TorchTwin, benchmark_param, random_inputs, training_flops  # noqa: E402

# Every layer type of the benchmark's nets, small: padded and strided convolution, MAX pooling
# with ceil rounding, AVE pooling, LRN, ReLU and Sigmoid in place, two fully connected layers.
TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 3 dim: 3 dim: 9 dim: 9 } shape { dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
        convolution_param { num_output: 5 kernel_size: 2 pad: 1
                            weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sig1" type: "Sigmoid" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def tiny_net():
    param = text_format.Parse(TINY, pb.NetParameter())
    param.force_backward = True
    net = Net(param, TRAIN)
    inputs = random_inputs(net, seed=3)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    return net, inputs


def test_torch_twin_computes_the_same_loss_and_gradients():
    pytest.importorskip("torch")
    net, inputs = tiny_net()
    net.clear_param_diffs()
    net.forward()
    net.backward()
    loss, grads, input_grads = TorchTwin(net).gradients(inputs)
    assert loss == pytest.approx(net.loss, rel=1e-5)
    assert len(grads) == len(net.learnable_params) == 8
    for info, grad in zip(net.learnable_params, grads):
        np.testing.assert_allclose(info.blob.diff, grad, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{info.layer_name}[{info.index}]")
    np.testing.assert_allclose(net.blobs["data"].diff, input_grads["data"], rtol=1e-4,
                               atol=1e-6)


def test_training_flops_are_the_planners_counts_of_the_work_done():
    net, _ = tiny_net()
    net.bottom_need_backward[1] = [False]        # as in a real net: no gradient for the data
    costs = net_costs(net, 3)
    everything = sum(c.forward + c.weight_grad + c.backward_data for c in costs)
    assert training_flops(net) == pytest.approx(3 * (everything - costs[1].backward_data))


def test_benchmark_runs_and_reports(tmp_path):
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    net_param, solver = benchmark_param(str(model), batch=2)
    assert [lp.input_param.shape[0].dim[0] for lp in net_param.layer[:1]] == [2]
    assert solver.test_interval == 0 and solver.net_param.name == "tiny"
    result = benchmark(str(model), batch=2, rounds=1, warmup=2, turn_seconds=0.05, lr_scale=1.0)
    speeds = result["frameworks"]
    assert speeds["syncsgd"]["images_per_s"] > 0 and speeds["syncsgd"]["peak_rss_mb"] > 0
    assert result["machine_gemm_gflops"] > 0
    if "pytorch" in speeds:
        assert result["speed_ratio"] > 0
        # Same weights, batch and update rule: the same loss before and after one update.
        assert speeds["pytorch"]["warmup_losses"] == pytest.approx(
            speeds["syncsgd"]["warmup_losses"], rel=1e-4)
        assert "| tiny.prototxt | 2 | 3x9x9 |" in format_table([result])
        assert result["gemm_gflops"]["pytorch"] > 0
        assert [lib["internal_api"] for lib in result["blas_libraries"]["pytorch"]
                if lib["internal_api"] == "torch"] == ["torch"]


def test_benchmark_json_names_the_blas_and_the_gemm_kernels(tmp_path, capsys):
    from benchmark import main
    from syncsgd.kernels import onednn
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    assert main(["--model", str(model), "--batch", "2", "--rounds", "1", "--warmup", "1",
                 "--no-torch", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    libraries = result["blas_libraries"]["syncsgd"]
    assert libraries and all(set(lib) == {"internal_api", "prefix", "architecture", "version",
                                          "num_threads"} for lib in libraries)
    from threadpoolctl import threadpool_info
    if any(lib["internal_api"] == "openblas" for lib in threadpool_info()):
        (openblas,) = [lib for lib in libraries if lib["internal_api"] == "openblas"]
        assert openblas["architecture"] and openblas["version"]
        assert openblas["num_threads"] == result["threads"]
    rates = result["gemm_gflops"]
    assert set(rates) == ({"blas", "onednn"} if onednn.available() else {"blas"})
    assert result["gemm_kernel"] == max(rates, key=rates.get)
    assert result["machine_gemm_gflops"] == rates[result["gemm_kernel"]] > 0
    s = result["frameworks"]["syncsgd"]
    assert s["fraction_of_gemm"] == pytest.approx(s["gflops"] / result["machine_gemm_gflops"])


def test_openblas_overrides_are_named_with_the_command_that_drops_them():
    from benchmark import openblas_overrides
    assert openblas_overrides(["--no-torch"], {"PATH": "/bin"}) is None
    warning = openblas_overrides(["--model", "a b"], {"OPENBLAS_CORETYPE": "Haswell",
                                                      "OPENBLAS_L2_SIZE": "1048576"})
    assert "OPENBLAS_CORETYPE=Haswell, OPENBLAS_L2_SIZE=1048576" in warning
    assert warning.endswith("env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python "
                            "tools/benchmark.py --model 'a b'")


def test_benchmark_warns_when_openblas_is_told_its_cpu(tmp_path):
    with open("/proc/cpuinfo") as f:
        if "avx2" not in f.read().split():
            pytest.skip("Haswell's kernels need AVX2")
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Only the child's environment: this test process's OpenBLAS settings stay as they are.
    # OPENBLAS_L2_SIZE, which the machine may set as well, is left out: the warning names
    # exactly the variables that are set.
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_L2_SIZE"}
    env.update(OPENBLAS_CORETYPE="Haswell",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "benchmark.py"),
                           "--model", str(model), "--batch", "2", "--rounds", "1", "--warmup",
                           "1", "--no-torch"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    command = f"env -u OPENBLAS_CORETYPE python tools/benchmark.py --model {model}"
    assert "benchmark: warning: OPENBLAS_CORETYPE=Haswell" in done.stderr
    assert command in done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("warning: OPENBLAS_CORETYPE=Haswell") and command in lines[-1]
    # The report shows the override took: OpenBLAS ran its Haswell kernels.
    (syncsgd,) = [line for line in lines if line.startswith("syncsgd: ")]
    assert "openblas" in syncsgd and "Haswell kernels" in syncsgd
