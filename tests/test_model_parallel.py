"""Model and hybrid parallelism of fully connected layers (docs/method.md "Model and hybrid
parallelism"): the same weights as one process, portable snapshots, and the bytes each rank
sends."""

import numpy as np
import pytest

import mpirun
from test_distributed import SCRIPT, assert_same, train

import syncsgd
from syncsgd.errors import PrototxtError

pytestmark = pytest.mark.mpi

VGG_LIKE = """
name: "vgg_like"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 10 dim: 3 dim: 8 dim: 8 } shape { dim: 10 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool2" top: "fc6" PARALLEL
        inner_product_param { num_output: 13 weight_filler { type: "gaussian" std: 0.1 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" }
layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7" PARALLEL
        inner_product_param { num_output: 11 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }
layer { name: "drop7" type: "Dropout" bottom: "fc7" top: "drop7" }
layer { name: "fc8" type: "InnerProduct" bottom: "drop7" top: "fc8" PARALLEL
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }
"""

CDDNN_LIKE = """
name: "cddnn_like"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 10 dim: 20 } shape { dim: 10 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 6.99 } } }
""" + "".join(f"""
layer {{ name: "fc{i}" type: "InnerProduct" bottom: "{'data' if i == 1 else f'fc{i - 1}'}"
        top: "fc{i}" PARALLEL
        inner_product_param {{ num_output: 18 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "sig{i}" type: "Sigmoid" bottom: "fc{i}" top: "fc{i}" }}""" for i in range(1, 4)) + """
layer { name: "fc4" type: "InnerProduct" bottom: "fc3" top: "fc4" PARALLEL
        inner_product_param { num_output: 7 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc4" bottom: "label" top: "loss" }
"""

MODES = {"DATA": "parallel_param { mode: DATA }", "MODEL": "parallel_param { mode: MODEL }",
         "HYBRID": "parallel_param { mode: HYBRID groups: 2 }",
         "AUTO": "parallel_param { mode: AUTO }"}


def write(tmp_path, net, mode, solver_extra=""):
    (tmp_path / "net.prototxt").write_text(net.replace("PARALLEL", MODES[mode]))
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" base_lr: 0.05 momentum: 0.9 '
                    f'lr_policy: "fixed" weight_decay: 0.001 max_iter: 100 random_seed: 3 '
                    f'snapshot_prefix: "{tmp_path}/snap" {solver_extra}')
    return path


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for name, net in (("vgg", VGG_LIKE), ("cddnn", CDDNN_LIKE)):
        tmp = tmp_path_factory.mktemp(name)
        out[name] = train(1, write(tmp, net, "DATA"), 4, tmp / "ref.npz")
    return out


@pytest.mark.parametrize("net", ["vgg", "cddnn"])
@pytest.mark.parametrize("mode", ["MODEL", "HYBRID", "DATA", "AUTO"])
def test_layouts_match_one_process(tmp_path, monkeypatch, references, net, mode):
    monkeypatch.setenv("SYNCSGD_CLUSTER", "this-machine")     # not this host's calibration
    text = VGG_LIKE if net == "vgg" else CDDNN_LIKE
    result = train(4, write(tmp_path, text, mode), 4, tmp_path / "n.npz")
    assert_same(result, references[net])
    if mode == "AUTO" and net == "cddnn":
        # The planner splits this all-FC net on this machine's cluster file (HYBRID, G=2).
        assert result["bytes_sent"][0] > 0


def test_one_process_trains_every_mode_the_same(tmp_path, references):
    result = train(1, write(tmp_path, VGG_LIKE, "HYBRID"), 4, tmp_path / "one.npz")
    assert_same(result, references["vgg"], rtol=0)


def test_hybrid_snapshot_loads_in_one_process(tmp_path):
    solver = write(tmp_path, VGG_LIKE, "HYBRID")
    train(4, solver, 3, tmp_path / "h.npz", "--snapshot")
    weights = tmp_path / "snap_iter_3.caffemodel"
    deploy = VGG_LIKE.replace("PARALLEL", "")
    (tmp_path / "plain.prototxt").write_text(deploy)
    net = syncsgd.Net(str(tmp_path / "plain.prototxt"), syncsgd.TEST, weights=str(weights))
    trained = np.load(tmp_path / "h.npz")
    for name, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            np.testing.assert_array_equal(blob.data, trained[f"{name}/{i}"])
    # ... and resumes on 2 ranks in MODEL layout from the same files.
    write(tmp_path, VGG_LIKE, "MODEL")
    resumed = train(2, solver, 1, tmp_path / "m.npz", "--restore",
                    tmp_path / "snap_iter_3.solverstate")
    (tmp_path / "ref").mkdir()
    reference = train(1, write(tmp_path / "ref", VGG_LIKE, "DATA"), 4, tmp_path / "ref.npz")
    assert_same(resumed, reference)


def cddnn_param_floats(out_rows):
    """Weights + biases of the cddnn-like net when each layer keeps `out_rows(F)` outputs."""
    sizes = [(20, 18), (18, 18), (18, 18), (18, 7)]
    return sum(out_rows(f) * (k + 1) for k, f in sizes)


@pytest.mark.parametrize("mode", ["DATA", "MODEL", "HYBRID"])
def test_bytes_sent_match_the_balance_equations(tmp_path, mode):
    """Bytes rank 0 sends in one iteration of the cddnn-like net on 4 ranks (batch 10, rank 0
    holds samples 0-2), counted by the communication module, against the balance equations
    (docs/method.md "Balance equations"):
    DATA   gradients go out and weights come back in: an allreduce of all W weights,
           (W - w_0) + 3 w_0 floats with w_0 = rank 0's quarter (ring reduce-scatter + allgather);
    MODEL  activations move, not weights: inputs gathered to all P=4 (n_0*20*(P-1) for fc1,
           MB*f*(P-1) for the others), their gradients reduce-scattered back (MB*(F-f)), the
           output all-to-all (MB-n_0)*f forward and n_0*(7-f) back; no weight traffic;
    HYBRID the same inside 2 groups of 2 (group 0 holds ranks 0-1's 3 + 3 samples), plus an
           allreduce of rank 0's weight slice with its replica in the other group
           ((W_s - w) + w floats, w = half of W_s)."""
    result = train(4, write(tmp_path, CDDNN_LIKE, mode), 1, tmp_path / "b.npz")
    group_bytes, grad_bytes = (int(v) for v in result["bytes_sent"])
    if mode == "DATA":
        w = cddnn_param_floats(lambda f: f)
        own = -(-w // 4)
        assert (group_bytes, grad_bytes) == (0, ((w - own) + 3 * own) * 4)
        return
    P, mb = (4, 10) if mode == "MODEL" else (2, 6)
    share = lambda f: -(-f // P)                      # rank 0's first share of F features
    n0 = 3
    floats = n0 * 20 * (P - 1)                         # data -> group (no gradient to data)
    floats += 3 * (mb * share(18) * (P - 1) + mb * (18 - share(18)))   # fc2..fc4 inputs
    floats += (mb - n0) * share(7) + n0 * (7 - share(7))               # fc4 -> loss and back
    assert group_bytes == floats * 4
    if mode == "MODEL":
        assert grad_bytes == 0
    else:
        w = cddnn_param_floats(share)
        own = -(-w // 2)
        assert grad_bytes == ((w - own) + own) * 4


def test_impossible_settings_are_refused(tmp_path):
    bad = VGG_LIKE.replace('name: "conv1" type: "Convolution" bottom: "data" top: "conv1"',
                           'name: "conv1" type: "Convolution" bottom: "data" top: "conv1" '
                           'parallel_param { mode: MODEL }')
    (tmp_path / "bad.prototxt").write_text(bad.replace("PARALLEL", ""))
    with pytest.raises(PrototxtError, match="only InnerProduct layers can be split"):
        syncsgd.Net(str(tmp_path / "bad.prototxt"), syncsgd.TRAIN)
    solver = write(tmp_path, VGG_LIKE, "HYBRID")
    text = (tmp_path / "net.prototxt").read_text().replace("groups: 2", "groups: 3")
    (tmp_path / "net.prototxt").write_text(text)
    result = mpirun.run(4, SCRIPT, solver, 1, tmp_path / "x.npz", timeout=60, check=False)
    assert result.returncode != 0
    assert "groups: 3 does not divide the 4 ranks" in result.stderr + result.stdout


def test_hybrid_timeline_shows_slice_reductions_and_activation_exchanges(tmp_path):
    """HYBRID's weight-slice reductions run on the communication thread, overlapping backward;
    the activation exchanges are the gather/scatter layers' own spans."""
    import json
    solver = write(tmp_path, CDDNN_LIKE, "HYBRID", "snapshot_after_train: false "
                                                    "distributed_param { bucket_bytes: 1000 }")
    trace = tmp_path / "trace.json"
    mpirun.run(4, "-m", "syncsgd.cli", "train", "--solver", solver, "--iterations", 2,
               "--timeline", trace)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    mine = [e for e in events if e["pid"] == 0]
    names = {e["name"] for e in mine}
    assert any(n.startswith("data_fc1_groupgather forward") for n in names)
    assert any("featuregather backward" in n for n in names)
    assert any("modeltodata forward" in n for n in names)
    reduces = [e for e in mine if e["cat"] == "comm"]
    first_update = min(e["ts"] for e in mine if e["name"] == "update")
    backward_end = max(e["ts"] + e["dur"] for e in mine
                       if e["cat"] == "backward" and e["ts"] < first_update)
    assert reduces and min(e["ts"] for e in reduces) < backward_end
