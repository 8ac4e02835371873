"""N ranks train the same net as one process: weights equal within 1e-5 relative, test scores
identical, snapshots portable across rank counts, failures end the job."""
import os
import time

import numpy as np
import pytest

import mpirun

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mpi_train.py")

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        include { phase: TRAIN }
        dummy_data_param { shape { dim: 10 dim: 3 dim: 12 dim: 12 } shape { dim: 10 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } } }
layer { name: "tdata" type: "DummyData" top: "data" top: "label"
        include { phase: TEST }
        dummy_data_param { shape { dim: 7 dim: 3 dim: 12 dim: 12 } shape { dim: 7 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 alpha: 0.1 } }
layer { name: "fc1" type: "InnerProduct" bottom: "norm1" top: "fc1"
        inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc2" bottom: "label" top: "acc" include { phase: TEST } }
"""


# conv1 has no bias: BatchNorm cancels it, so its true gradient is 0 and adaptive solvers would
# amplify the rounding noise that stands in for it (differently on 1 and N ranks).


def write_solver(tmp_path, kind, extra=""):
    (tmp_path / "net.prototxt").write_text(NET)
    rules = {"SGD": 'type: "SGD" momentum: 0.9 base_lr: 0.05',
             "Nesterov": 'type: "Nesterov" momentum: 0.9 base_lr: 0.05',
             "AdaGrad": 'type: "AdaGrad" base_lr: 0.05',
             "RMSProp": 'type: "RMSProp" base_lr: 0.01 rms_decay: 0.9',
             "AdaDelta": 'type: "AdaDelta" base_lr: 1 momentum: 0.95 delta: 1e-6',
             "Adam": 'type: "Adam" momentum: 0.9 momentum2: 0.999 base_lr: 0.01'}[kind]
    path = tmp_path / f"{kind}.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt" {rules} lr_policy: "fixed" '
                    f'weight_decay: 0.001 test_iter: 2 test_interval: 1000 '
                    f'test_initialization: false max_iter: 100 random_seed: 5 '
                    f'snapshot_prefix: "{tmp_path}/snap" {extra}')
    return path


def train(n, solver, iterations, out, *extra):
    mpirun.run(n, SCRIPT, solver, iterations, out, *extra)
    return dict(np.load(out))


def assert_same(a, b, rtol=1e-5):
    """Parameters and scores equal within rtol of each array's scale (traffic counts aside)."""
    keys = sorted(k for k in a if k not in ("bytes_sent", "lanes"))
    assert keys == sorted(k for k in b if k not in ("bytes_sent", "lanes"))
    for key in keys:
        scale = max(float(np.abs(a[key]).max()), 1e-3)
        err = float(np.abs(a[key] - b[key]).max()) / scale
        assert err <= rtol, f"{key}: relative difference {err:.2e}"


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    runs = {}
    for kind in ("SGD", "Adam"):
        solver = write_solver(tmp, kind)
        runs[kind] = (solver, train(1, solver, 6, tmp / f"{kind}.npz"))
    return runs


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_ranks_match_one_process(tmp_path, single_runs, n, kind):
    solver, reference = single_runs[kind]
    result = train(n, solver, 6, tmp_path / "n.npz")
    assert_same(result, reference)
    assert result["score/acc"] == pytest.approx(reference["score/acc"], abs=1e-6)


LANES_NET = """
name: "laned"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 12 dim: 3 dim: 10 dim: 10 } shape { dim: 12 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 3.99 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc"
        include { phase: TEST } }
"""


def test_ranks_running_lanes_match_one_process(tmp_path):
    """Two threads per rank: the lanes carry the loss and accuracy too, summing them over the
    lanes and then over the ranks (the lanes' MPI call comes from the thread that started
    the pass)."""
    (tmp_path / "net.prototxt").write_text(LANES_NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" momentum: 0.9 base_lr: 0.1 '
                      'lr_policy: "fixed" test_iter: 2 test_interval: 1000 '
                      'test_initialization: false max_iter: 100 random_seed: 3')
    reference = train(1, solver, 5, tmp_path / "1.npz", "--threads", "1")
    laned = train(2, solver, 5, tmp_path / "2.npz", "--threads", "2")
    assert not reference["lanes"] and laned["lanes"]
    assert_same(laned, reference)
    assert laned["score/acc"] == pytest.approx(reference["score/acc"], abs=1e-6)
    assert laned["score/loss"] == pytest.approx(reference["score/loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["Nesterov", "AdaGrad", "RMSProp", "AdaDelta"])
def test_other_solver_types_match(tmp_path, kind):
    solver = write_solver(tmp_path, kind)
    assert_same(train(2, solver, 4, tmp_path / "n.npz"), train(1, solver, 4, tmp_path / "1.npz"))


@pytest.mark.parametrize("options", [
    "distributed_param { reduction: REDUCE_SCATTER bucket_bytes: 2000 }",
    "distributed_param { progress: POLL bucket_bytes: 100 }",
    "distributed_param { overlap: false }",
])
def test_reduction_strategies_match(tmp_path, single_runs, options):
    _, reference = single_runs["SGD"]
    solver = write_solver(tmp_path, "SGD", options)
    assert_same(train(3, solver, 6, tmp_path / "n.npz"), reference)


@pytest.mark.parametrize("options", ["", "distributed_param { reduction: REDUCE_SCATTER }"])
def test_clipping_and_iter_size_use_the_global_gradient(tmp_path, options):
    solver = write_solver(tmp_path, "SGD", "clip_gradients: 0.5 iter_size: 2 " + options)
    one = train(1, solver, 3, tmp_path / "1.npz")
    assert_same(train(3, solver, 3, tmp_path / "3.npz"), one)


def test_same_run_gives_the_same_bits(tmp_path):
    solver = write_solver(tmp_path, "SGD", "distributed_param { bucket_bytes: 500 }")
    first = train(3, solver, 3, tmp_path / "a.npz")
    second = train(3, solver, 3, tmp_path / "b.npz")
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def test_snapshot_on_4_resume_on_2(tmp_path, single_runs):
    solver = write_solver(tmp_path, "SGD")
    train(4, solver, 3, tmp_path / "a.npz", "--snapshot")
    state = tmp_path / "snap_iter_3.solverstate"
    assert state.exists()
    resumed = train(2, solver, 3, tmp_path / "b.npz", "--restore", state)
    _, reference = single_runs["SGD"]
    assert_same(resumed, reference)


def test_failing_rank_ends_the_job(tmp_path):
    solver = write_solver(tmp_path, "SGD")
    start = time.monotonic()
    result = mpirun.run(3, SCRIPT, solver, 5, tmp_path / "x.npz", "--fail-rank", 1,
                        timeout=60, check=False)
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    assert "deliberate failure on rank 1" in result.stderr + result.stdout


def test_mismatched_nets_are_refused_naming_rank_and_layer(tmp_path):
    solver = write_solver(tmp_path, "SGD")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    (other_dir / "net.prototxt").write_text(NET.replace("num_output: 16", "num_output: 17"))
    other = other_dir / "SGD.prototxt"
    other.write_text(solver.read_text().replace(str(tmp_path / "net.prototxt"),
                                                str(other_dir / "net.prototxt")))
    result = mpirun.run(2, SCRIPT, solver, 2, tmp_path / "x.npz", "--other-solver", other,
                        timeout=60, check=False)
    assert result.returncode != 0
    output = result.stderr + result.stdout
    assert "rank 1 differs from rank 0" in output and "layer 'fc1'" in output


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fault", ["raise", "kill", "stall"])
def test_rank_faults_end_every_rank(tmp_path, n, fault):
    solver = write_solver(tmp_path, "SGD", "distributed_param { stall_timeout: 4 }")
    start = time.monotonic()
    result = mpirun.run(n, SCRIPT, solver, 6, tmp_path / "x.npz", "--fault", fault,
                        "--fault-rank", n - 1, timeout=90, check=False)
    elapsed = time.monotonic() - start
    output = result.stderr + result.stdout
    assert result.returncode != 0, output
    assert elapsed < 30, f"took {elapsed:.0f} s"
    if fault == "raise":
        assert "deliberate failure in layer 'loss'" in output
    if fault == "stall":
        assert f"rank(s) {n - 1} did not arrive" in output


def test_timeline_shows_reductions_overlapping_backward(tmp_path):
    solver = write_solver(tmp_path, "SGD", "distributed_param { bucket_bytes: 1000 } "
                                           "snapshot_after_train: false")
    trace = tmp_path / "trace.json"
    mpirun.run(2, "-m", "syncsgd.cli", "train", "--solver", solver, "--iterations", 3,
               "--timeline", trace)
    import json
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        reduces = [e for e in mine if e["cat"] == "comm"]
        backward = [e for e in mine if e["cat"] == "backward"]
        assert reduces and backward and any(e["name"] == "update" for e in mine)
        # In the first iteration, a reduction starts before that iteration's backward is over.
        first_update = min(e["ts"] for e in mine if e["name"] == "update")
        backward_end = max(b["ts"] + b["dur"] for b in backward if b["ts"] < first_update)
        assert min(e["ts"] for e in reduces) < backward_end


def write_hdf5_solver(tmp_path, extra=""):
    import h5py
    rng = np.random.default_rng(0)
    for split, rows in (("train", 37), ("test", 12)):
        with h5py.File(tmp_path / f"{split}.h5", "w") as f:
            f["data"] = rng.standard_normal((rows, 3, 10, 10)).astype(np.float32)
            f["label"] = rng.integers(0, 4, rows).astype(np.float32)
        (tmp_path / f"{split}.txt").write_text(f"{tmp_path}/{split}.h5\n")
    net = f"""
    layer {{ name: "train" type: "HDF5Data" top: "data" top: "label" include {{ phase: TRAIN }}
            hdf5_data_param {{ source: "{tmp_path}/train.txt" batch_size: 10 shuffle: true }}
            transform_param {{ mirror: true crop_size: 8 scale: 0.5 mean_value: 0.1 }} }}
    layer {{ name: "test" type: "HDF5Data" top: "data" top: "label" include {{ phase: TEST }}
            hdf5_data_param {{ source: "{tmp_path}/test.txt" batch_size: 7 }}
            transform_param {{ crop_size: 8 scale: 0.5 mean_value: 0.1 }} }}
    layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "pool" type: "Pooling" bottom: "conv" top: "pool"
            pooling_param {{ pool: AVE kernel_size: 2 stride: 2 }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
            inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
    layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc"
            include {{ phase: TEST }} }}
    """
    (tmp_path / "net.prototxt").write_text(net)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" base_lr: 0.1 momentum: 0.9 '
                      f'lr_policy: "fixed" test_iter: 2 test_interval: 1000 '
                      f'test_initialization: false max_iter: 100 random_seed: 9 '
                      f'snapshot_prefix: "{tmp_path}/snap" {extra}')
    return solver


def test_hdf5_data_with_shuffle_and_transforms_matches(tmp_path):
    solver = write_hdf5_solver(tmp_path)
    one = train(1, solver, 9, tmp_path / "1.npz")
    assert_same(train(3, solver, 9, tmp_path / "3.npz"), one)


@pytest.mark.parametrize("n", [2, 4])
def test_unreadable_data_on_one_rank_ends_the_job_naming_the_file(tmp_path, n):
    solver = write_hdf5_solver(tmp_path)
    start = time.monotonic()
    result = mpirun.run(n, SCRIPT, solver, 8, tmp_path / "x.npz", "--fault", "unreadable",
                        "--fault-rank", n - 1, timeout=90, check=False)
    output = result.stderr + result.stdout
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    # A read ahead in flight when the files closed may find the handle gone instead of the
    # open failing: either error names the file and says what to do.
    assert (f"{tmp_path}/train.h5: reading rows of dataset" in output
            or f"HDF5 file '{tmp_path}/train.h5' changed during training" in output), output


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_resume_after_a_fault_reproduces_the_uninterrupted_run(tmp_path, fault):
    one = tmp_path / "one"       # its own snapshots: a state must pair with its run's weights
    one.mkdir()
    uninterrupted = train(1, write_hdf5_solver(one, "snapshot: 2"), 6, one / "straight.npz")
    solver = write_hdf5_solver(tmp_path, "snapshot: 2")
    failed = mpirun.run(4, SCRIPT, solver, 6, tmp_path / "x.npz", "--fault", fault,
                        "--fault-rank", 2, timeout=90, check=False)
    assert failed.returncode != 0
    resumed = train(3, solver, 4, tmp_path / "resumed.npz", "--restore",
                    tmp_path / "snap_iter_2.solverstate")
    assert_same(resumed, uninterrupted)


PYCAFFE_SCRIPT = """
import os, sys
import numpy as np
import syncsgd
solver = syncsgd.get_solver(sys.argv[1])
solver.step(int(sys.argv[2]))
np.savez(f"{sys.argv[3]}.{os.getpid()}.npz", batch=solver.net.blobs["data"].shape[0],
         **{f"{name}/{i}": b.data for name, blobs in solver.net.params.items()
            for i, b in enumerate(blobs)})
solver.close()
"""


def test_plain_pycaffe_script_trains_over_the_launched_ranks(tmp_path, single_runs):
    """`mpiexec -n 2 python script.py` with nothing but get_solver(path): each rank holds half of
    the global batch of 10, and both end with the one-process weights."""
    import subprocess
    import sys
    solver, reference = single_runs["SGD"]
    script = tmp_path / "script.py"
    script.write_text(PYCAFFE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=mpirun.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([mpirun.mpiexec(), "-n", "2", sys.executable, str(script), str(solver), "6",
                    str(tmp_path / "w")], check=True, timeout=120, env=env, cwd=mpirun.ROOT)
    runs = sorted(tmp_path.glob("w.*.npz"))
    assert len(runs) == 2
    expected = {k: v for k, v in reference.items() if "/" in k and not k.startswith("score/")}
    for run in runs:
        weights = dict(np.load(run))
        assert int(weights.pop("batch")) == 5
        assert_same(weights, expected)
