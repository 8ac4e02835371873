"""tools/scaling.py: the table's figures from the runs, the one-line error of --torch without
PyTorch, and (with PyTorch) one short run of syncsgd and its DDP twin in turns."""
import csv
import importlib.util
import os
import subprocess
import sys
from argparse import Namespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Appended, not prepended: tools/time.py and tools/test.py must not shadow the standard library.
sys.path.append(os.path.join(ROOT, "tools"))
import scaling  # noqa: E402

# A small net with a data layer (replaced by constant DummyData) and its deploy twin (the
# sample shape).
TRAIN_VAL = """
name: "small"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "absent.txt" batch_size: 8 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "relu" type: "ReLU" bottom: "pool" top: "pool" }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
DEPLOY = """
name: "small"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 2 dim: 10 dim: 10 } } }
"""


def run(kind, ranks, iteration_s, **extra):
    """A worker's RESULT: PyTorch's fields, and syncsgd's communication figures too."""
    result = {"ranks": ranks, "threads": 2 // ranks, "global_batch": 8,
              "iteration_s": iteration_s, "images_per_s": 8 / iteration_s, "first_loss": 1.5}
    if kind == "syncsgd":
        result.update(comm_s=0.0, exposed_comm_s=0.0, raw_allreduce_s=None, fc_mode="DATA",
                      bytes_sent_per_rank=0.0, grad_bytes=4)
    result.update(extra)
    return result


def test_rows_give_each_framework_the_fraction_of_its_own_one_rank_throughput(capsys):
    runs = {("syncsgd", 1): [run("syncsgd", 1, 0.30), run("syncsgd", 1, 0.10),
                             run("syncsgd", 1, 0.20)],
            ("syncsgd", 2): [run("syncsgd", 2, 0.25, comm_s=0.02, exposed_comm_s=0.005,
                                 raw_allreduce_s=0.01)],
            ("pytorch", 1): [run("pytorch", 1, 0.40)],
            ("pytorch", 2): [run("pytorch", 2, 0.50), run("pytorch", 2, 0.80)]}
    rows = scaling.scaling_rows(runs, [1, 2], "small")
    one, two = rows
    assert one["iteration_s"] == 0.20                     # the median of three rounds
    assert two["torch_iteration_s"] == 0.50               # of two: the faster
    assert one["speedup"] == one["torch_speedup"] == 1.0
    assert two["speedup"] == pytest.approx(0.20 / 0.25)
    assert two["torch_speedup"] == pytest.approx(0.40 / 0.50)
    assert two["syncsgd_vs_torch"] == pytest.approx(0.50 / 0.25)
    assert two["hidden_fraction"] == pytest.approx(0.75)
    scaling.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "torch img/s" in lines[0]
    assert lines[2].split()[:8] == ["2", "DATA", "1", "32.0", "0.80", "16.0", "0.80", "2.00x"]
    plotted = scaling.plot_rows(rows)
    assert [r["model"] for r in plotted] == ["small"] * 2 + ["small (PyTorch DDP)"] * 2
    assert plotted[3]["efficiency"] == pytest.approx(two["torch_speedup"] / 2)


def test_one_rank_is_always_the_baseline():
    assert scaling.rank_counts("2,4") == [1, 2, 4]
    assert scaling.rank_counts("4,1,2") == [1, 4, 2]


def test_torch_without_pytorch_is_a_one_line_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        scaling.driver(Namespace(torch=True, ranks="1,2"))
    message = str(e.value)
    assert "\n" not in message and "--torch needs PyTorch" in message and "pip install" in message


def test_lenet_on_constant_data_keeps_normal_gradients():
    """At the solver's full rate LeNet's parameter gradients turned denormal from about the 25th
    step, and each step then took 13x as long: the measurement would depend on its length."""
    import numpy as np
    solver = scaling.build_solver(Namespace(
        solver=os.path.join(ROOT, "models", "lenet", "solver.prototxt"), batch=None,
        input=None, fc_mode=None, options=None))
    solver.step(35)
    tiny = np.finfo(np.float32).tiny
    for info in solver.net.learnable_params:
        magnitude = np.abs(info.blob.diff)
        assert not ((magnitude > 0) & (magnitude < tiny)).any()
    solver.close()


@pytest.mark.mpi
def test_syncsgd_and_pytorch_ddp_run_in_turns_on_the_same_net(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "train_val.prototxt").write_text(TRAIN_VAL)
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path / "train_val.prototxt"}"\nbase_lr: 0.01\n'
                      'momentum: 0.9\nlr_policy: "fixed"\nmax_iter: 10\n')
    out = tmp_path / "scaling.csv"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling.py"), "--torch",
                           "--solver", str(solver), "--ranks", "2", "--iterations", "2",
                           "--warmup", "1", "--timeout", "120", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torch img/s" in done.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["ranks"]) for r in rows] == [1, 2]
    for r in rows:
        assert int(r["global_batch"]) == 8
        # Same threads per rank: PyTorch's count follows WORLD_SIZE as syncsgd's follows mpiexec.
        assert r["torch_threads"] == r["threads"]
        assert float(r["torch_images_per_s"]) > 0
        # Same net, same initial weights, same constant data: the same first loss.
        assert float(r["torch_first_loss"]) == pytest.approx(float(r["first_loss"]), rel=1e-5)
    assert float(rows[0]["torch_speedup"]) == 1.0
    assert int(rows[1]["threads"]) == max(1, len(os.sched_getaffinity(0)) // 2)
