"""The speed work of issue 7: the PyTorch twin computes what syncsgd computes, the benchmark runs,
and every fast path of the layers (GEMM splitting, per-sample / batched / wide convolution, the
image gradient as a convolution, chunks and pooling parts shared out to threads, chunked fillers)
gives the results of the plain path; the benchmark's report of the BLAS it ran. Issue 31: the
twin knows GoogLeNet's and ResNet-50's layer types, and --caffe times BVLC Caffe's `caffe time`
against `syncsgd time` in turns."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN
from syncsgd.net import Net
from syncsgd.plan.costs import net_costs
from syncsgd.proto import pb

# The harness is tooling outside the package (tools/benchmark.py, tools/runners.py); appended,
# not prepended, so that tools/time.py and tools/test.py never shadow the standard library.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import benchmark as bench  # noqa: E402
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


# The other layer types of GoogLeNet and ResNet-50, small: BatchNorm in place (set moving average
# fraction and eps) and not (defaults), Scale with and without bias, a convolution without bias,
# Eltwise SUM with coefficients, PROD and MAX over a three-way Split, Concat, global AVE pooling,
# and an auxiliary loss of weight 0.3.
BRANCHES = """
name: "branches"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
        batch_norm_param { moving_average_fraction: 0.9 eps: 0.01 } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "xavier" }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "conv3" type: "Convolution" bottom: "conv1" top: "conv3"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" bottom: "conv3" top: "sum"
        eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 } }
layer { name: "prod" type: "Eltwise" bottom: "conv2" bottom: "conv3" top: "prod"
        eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "conv2" bottom: "conv3" top: "max"
        eltwise_param { operation: MAX } }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "prod" bottom: "max" top: "cat" }
layer { name: "bn2" type: "BatchNorm" bottom: "cat" top: "bn2" }
layer { name: "scale2" type: "Scale" bottom: "bn2" top: "scale2"
        scale_param { filler { type: "gaussian" std: 0.5 } } }
layer { name: "pool" type: "Pooling" bottom: "scale2" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip_aux" type: "InnerProduct" bottom: "max" top: "ip_aux"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "aux_loss" type: "SoftmaxWithLoss" bottom: "ip_aux" bottom: "label"
        top: "aux_loss" loss_weight: 0.3 }
"""


def tiny_net(text=TINY, phase=TRAIN):
    param = text_format.Parse(text, pb.NetParameter())
    param.force_backward = True
    net = Net(param, phase)
    inputs = random_inputs(net, seed=3)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    return net, inputs


@pytest.mark.parametrize("text,phase,params", [(TINY, TRAIN, 8), (BRANCHES, TRAIN, 18),
                                               (BRANCHES, TEST, 18)],
                         ids=["tiny", "branches-TRAIN", "branches-TEST"])
def test_torch_twin_computes_the_same_loss_and_gradients(text, phase, params):
    """Two passes each, so that BatchNorm's sums take in a second batch through their moving
    average fraction (TRAIN), or normalise by stored averages (TEST, use_global_stats)."""
    pytest.importorskip("torch")
    net, inputs = tiny_net(text, phase)
    rng = np.random.default_rng(5)
    for layer in net.layers:
        if layer.type == "BatchNorm" and phase == TEST:
            mean_sum, var_sum, weight = layer.blobs
            weight.data[...] = 2.5
            mean_sum.data[...] = 2.5 * rng.standard_normal(mean_sum.shape)
            var_sum.data[...] = 2.5 * rng.uniform(0.5, 2.0, var_sum.shape)
    twin = TorchTwin(net)
    for _ in range(2):
        net.clear_param_diffs()
        net.forward()
        net.backward()
        loss, grads, input_grads = twin.gradients(inputs)
    assert loss == pytest.approx(net.loss, rel=1e-5)
    assert len(grads) == len(net.learnable_params) == len(twin.params) == params
    for info, grad, tensor in zip(net.learnable_params, grads, twin.params):
        where = f"{info.layer_name}[{info.index}]"
        np.testing.assert_allclose(info.blob.diff, grad, rtol=1e-4, atol=1e-6, err_msg=where)
        np.testing.assert_allclose(info.blob.data, tensor.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=where)     # BatchNorm's statistics
    np.testing.assert_allclose(net.blobs["data"].diff, input_grads["data"], rtol=1e-4,
                               atol=1e-6)


def test_torch_twin_accuracy_counts_the_top_k_and_skips_the_ignored():
    """GoogLeNet's TEST heads report top-1 and top-5 accuracy."""
    torch = pytest.importorskip("torch")
    net = Net(text_format.Parse("""
        layer { name: "in" type: "Input" top: "scores" top: "label"
                input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
        layer { name: "top2" type: "Accuracy" bottom: "scores" bottom: "label" top: "top2"
                accuracy_param { top_k: 2 ignore_label: 1 } }""", pb.NetParameter()), TEST)
    scores = np.array([[0.1, 0.5, 0.4], [0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]],
                      np.float32)
    labels = np.array([2, 2, 0, 1], np.float32)
    net.forward(scores=scores, label=labels)
    lp = [layer.param for layer in net.layers if layer.type == "Accuracy"][0]
    (top2,) = TorchTwin(net)._apply(lp, None, [], [torch.from_numpy(scores),
                                                    torch.from_numpy(labels)])
    # Labels in the top 2: yes, no, no; the last sample's label is ignored.
    assert top2.item() == pytest.approx(1 / 3) == float(net.blobs["top2"].data)


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
    result = benchmark(str(model), batch=2, rounds=1, warmup=1, turn_seconds=0.2, lr_scale=1.0)
    speeds = result["frameworks"]
    assert speeds["syncsgd"]["images_per_s"] > 0 and speeds["syncsgd"]["peak_rss_mb"] > 0
    for speed in speeds.values():
        # A turn lasts its time, however slow the first (warm-up) iteration was.
        assert speed["iterations"] * speed["iteration_ms"] >= 0.5 * 200
    assert result["machine_gemm_gflops"] > 0
    assert "caffe" not in result and format_table([result]).endswith("| - | - | - |")
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


# -- --caffe: BVLC Caffe's `caffe time` against `syncsgd time` -------------------------------------
def test_benchmark_finds_the_oracle_where_the_tests_do(tmp_path, monkeypatch):
    from test_oracle import oracle_env
    monkeypatch.setenv("CAFFE_ORACLE_DIR", str(tmp_path))
    assert bench.caffe_oracle() is None and oracle_env() is None
    (tmp_path / "env.sh").write_text("")
    assert bench.caffe_oracle() == str(oracle_env()) == str(tmp_path / "env.sh")
    monkeypatch.delenv("CAFFE_ORACLE_DIR")
    assert bench.caffe_oracle() == (str(oracle_env()) if oracle_env() else None)


def test_fwd_bwd_prototxt_is_the_train_net_with_inputs_and_force_backward(tmp_path):
    from syncsgd.timing import timing_net
    path = str(tmp_path / "fwd_bwd.prototxt")
    bench.write_fwd_bwd_prototxt("lenet", 5, None, path)
    param = text_format.Parse(open(path).read(), pb.NetParameter())
    assert param.force_backward and param.state.phase == TRAIN
    assert [(lp.type, list(lp.top)) for lp in param.layer[:1]] == [("Input", ["data", "label"])]
    assert [lp.type for lp in param.layer][-1] == "SoftmaxWithLoss"
    assert not any(lp.type == "HDF5Data" for lp in param.layer)
    net = timing_net(path)
    assert net.blobs["data"].shape == (5, 1, 28, 28) and net.blobs["data"].data.std() > 0.5
    # `caffe time` leaves every input at zero; `syncsgd time` leaves labels so, for the loss.
    assert net.blobs["label"].shape == (5,) and not net.blobs["label"].data.any()


def test_caffe_rounds_alternate_and_keep_each_minimum(monkeypatch):
    calls = []
    times = {"syncsgd": [5.0, 3.0, 4.0], "bvlc": [9.0, 12.0, 6.0]}

    def fake(kind):
        def run(*args):
            calls.append((kind, args))
            return times[kind][sum(k == kind for k, _ in calls) - 1]
        return run
    monkeypatch.setattr(bench, "time_syncsgd", fake("syncsgd"))
    monkeypatch.setattr(bench, "time_bvlc", fake("bvlc"))
    monkeypatch.setattr(bench, "PAUSE", 0)
    result = bench.caffe_comparison("net.prototxt", 2, 3, 7, "env.sh")
    assert [kind for kind, _ in calls] == ["syncsgd", "bvlc", "bvlc", "syncsgd", "syncsgd",
                                           "bvlc"]
    # One prototxt, iteration count and thread count for both.
    assert {args for _, args in calls} == {("net.prototxt", 7, 2), ("env.sh", "net.prototxt", 7,
                                                                     2)}
    assert result["rounds_ms"] == times
    assert (result["syncsgd_ms"], result["bvlc_ms"], result["ratio"]) == (3.0, 6.0, 2.0)
    calls.clear()
    alone = bench.caffe_comparison("net.prototxt", 2, 2, 7, None)
    assert [kind for kind, _ in calls] == ["syncsgd", "syncsgd"]
    assert alone["bvlc_ms"] is None and alone["ratio"] is None and alone["syncsgd_ms"] == 3.0


def test_caffe_time_against_syncsgd_time_on_a_tiny_net(tmp_path, capsys):
    from test_oracle import oracle_problem
    problem = oracle_problem()
    if problem:
        pytest.skip(problem)
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    assert bench.main(["--model", str(model), "--batch", "2", "--rounds", "1", "--warmup", "1",
                       "--no-torch", "--caffe", "--caffe-iterations", "3", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    c = result["caffe"]
    assert c["oracle"] == bench.caffe_oracle() and (c["iterations"], c["rounds"]) == (3, 1)
    assert c["threads"] == result["threads"]
    assert all(len(ms) == 1 and ms[0] > 0 for ms in c["rounds_ms"].values())
    assert (c["syncsgd_ms"], c["bvlc_ms"]) == (min(c["rounds_ms"]["syncsgd"]),
                                               min(c["rounds_ms"]["bvlc"]))
    assert c["ratio"] == pytest.approx(c["bvlc_ms"] / c["syncsgd_ms"])
    header, _, row = format_table([result]).splitlines()
    assert header.endswith("| syncsgd fwd+bwd ms | BVLC Caffe ms | ratio |")
    assert row.endswith(f"| {bench._ms(c['syncsgd_ms'])} | {bench._ms(c['bvlc_ms'])} "
                        f"| {c['ratio']:.2f}x |")


def test_caffe_where_the_oracle_is_absent_says_so_and_shows_dashes(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.setenv("CAFFE_ORACLE_DIR", str(tmp_path / "nowhere"))
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    assert bench.main(["--model", str(model), "--batch", "2", "--rounds", "1", "--warmup", "1",
                       "--no-torch", "--caffe", "--caffe-iterations", "1"]) == 0
    out, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if "--caffe" in line]
    assert "BVLC Caffe is not built" in line and "its columns show -" in line
    (row,) = [line for line in out.splitlines() if line.startswith("| tiny.prototxt |")]
    syncsgd_ms, caffe_ms, ratio = [cell.strip() for cell in row.split("|")[-4:-1]]
    assert float(syncsgd_ms.replace(",", "")) > 0 and caffe_ms == ratio == "-"
