"""Fully connected layers without a parallel_param mode take the planner's choice on several ranks
(CONTRACT.md "Distributed semantics"): an unset mode is told from an explicit DATA, the cluster is
SYNCSGD_CLUSTER's, else this host's calibration, else the shipped this-machine; rank 0 decides for
every rank, train and test nets get the same split, the log says why, one process is untouched,
and N ranks still train as one."""
import io
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from google.protobuf import text_format

import mpirun
from test_distributed import SCRIPT, assert_same, train

import syncsgd
from syncsgd import TEST, TRAIN, log
from syncsgd.compile import compile_net
from syncsgd.errors import SyncSGDError
from syncsgd.parallel.layers import MODEL_PARALLEL_INNER_PRODUCT
from syncsgd.parallel.partition import Partitioner, planned
from syncsgd.plan.cluster import ClusterError, cache_path
from syncsgd.plan.modes import choose_modes, training_cluster
from syncsgd.proto import pb

_PP = pb.ParallelParameter

DATA = """
name: "two_fc"
layer { name: "data" type: "DummyData" top: "data" top: "label" include { phase: TRAIN }
        dummy_data_param { shape { dim: 8 dim: 32 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 5.99 } } }
layer { name: "tdata" type: "DummyData" top: "data" top: "label" include { phase: TEST }
        dummy_data_param { shape { dim: 6 dim: 32 } shape { dim: 6 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 5.99 } } }
"""
INPUTS = """
name: "two_fc_deploy"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 32 } shape { dim: 8 } } }
"""
LAYERS = """
layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" FC1
        inner_product_param { num_output: 64 weight_filler { type: "xavier" }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "sig1" type: "Sigmoid" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" FC2
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc2" bottom: "label" top: "acc"
        include { phase: TEST } }
"""

# On 2 ranks the planner splits both FC layers of NET on SPLIT (slow network, slow nodes) and
# keeps both data-parallel on REPLICATE (fast, but 10 ms per message).
SPLIT = {"name": "split", "node": {"peak_flops": 1e9},
         "network": {"bandwidth": 1e6, "latency": 0.0}}
REPLICATE = {"name": "replicate", "node": {"peak_flops": 1e12},
             "network": {"bandwidth": 1e12, "latency": 1e-2}}


def net_text(fc1="", fc2="", data=DATA):
    return (data + LAYERS).replace("FC1", fc1).replace("FC2", fc2)


def write_solver(tmp_path, text):
    (tmp_path / "net.prototxt").write_text(text)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" base_lr: 0.1 momentum: 0.9 '
                    f'lr_policy: "fixed" weight_decay: 0.001 test_iter: 2 test_interval: 1000 '
                    f'test_initialization: false max_iter: 100 random_seed: 7 '
                    f'snapshot_prefix: "{tmp_path}/snap"')
    return path


@pytest.fixture
def clusters(tmp_path, monkeypatch):
    """{"split", "replicate"}: cluster files; this host's cache is an empty folder of this
    test's and SYNCSGD_CLUSTER unset (the subprocesses inherit both)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SYNCSGD_CLUSTER", raising=False)
    paths = {}
    for name, raw in (("split", SPLIT), ("replicate", REPLICATE)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(raw))
    return paths


@pytest.fixture
def captured_log():
    stream = io.StringIO()
    log.configure(stream=stream)
    yield stream
    log.configure()


# -- which layers the planner sets ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("", True), ("parallel_param { }", True), ("parallel_param { groups: 2 }", True),
    ("parallel_param { mode: AUTO }", True), ("parallel_param { mode: DATA }", False),
    ("parallel_param { mode: MODEL }", False),
    ("parallel_param { mode: HYBRID groups: 2 }", False)])
def test_an_unset_mode_goes_to_the_planner_an_explicit_one_does_not(text, expected):
    fc = text_format.Parse(f'name: "fc" type: "InnerProduct" {text}', pb.LayerParameter())
    assert planned(fc) is expected


def test_other_layers_go_to_the_planner_only_with_auto():
    conv = text_format.Parse('name: "c" type: "Convolution"', pb.LayerParameter())
    assert not planned(conv)
    conv.parallel_param.mode = _PP.AUTO
    assert planned(conv)


# -- the partitioner, on a stand-in for two ranks ---------------------------------------------

class _World:
    """What GroupComm asks of an MPI communicator."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Split(self, color, key):
        return None


def partitioner(size=2):
    """(Partitioner as rank 0 of `size`, the computations it asked rank 0 for)."""
    asked = []

    def from_root(compute):
        asked.append(compute)
        return compute()
    comm = types.SimpleNamespace(size=size, rank=0, world=_World(size))
    return Partitioner(comm, from_root), asked


def partitioned(part, text, phase):
    param, _ = compile_net(text_format.Parse(text, pb.NetParameter()), phase)
    out = part.transform(types.SimpleNamespace())(param)
    return {layer.name: (layer.type, layer.parallel_param.mode, layer.parallel_param.groups)
            for layer in out.layer if layer.name in ("fc1", "fc2")}


def test_unset_layers_take_the_planners_choice_in_train_and_test_nets(clusters, monkeypatch):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    part, asked = partitioner()
    split = (MODEL_PARALLEL_INNER_PRODUCT, _PP.MODEL, 1)
    assert partitioned(part, net_text(), TRAIN) == {"fc1": split, "fc2": split}
    assert partitioned(part, net_text(), TEST) == {"fc1": split, "fc2": split}
    assert len(asked) == 1                   # decided once, for the train net
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["replicate"]))
    part, _ = partitioner()
    kept = ("InnerProduct", _PP.DATA, 1)
    assert partitioned(part, net_text(), TRAIN) == {"fc1": kept, "fc2": kept}


def test_an_explicit_data_stays_data(clusters, monkeypatch):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    part, _ = partitioner()
    modes = partitioned(part, net_text(fc2="parallel_param { mode: DATA }"), TRAIN)
    assert modes == {"fc1": (MODEL_PARALLEL_INNER_PRODUCT, _PP.MODEL, 1),
                     "fc2": ("InnerProduct", _PP.DATA, 1)}


def test_the_prototxts_own_split_sets_the_planners_groups(clusters, monkeypatch):
    """On 4 ranks the planner alone puts fc1 in MODEL (G = 1), which cannot run beside the
    prototxt's HYBRID groups: 2; it plans at G = 2 instead."""
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    net = text_format.Parse(net_text(), pb.NetParameter())
    assert choose_modes(net, 4)["fc1"] == (_PP.MODEL, 1)
    part, _ = partitioner(4)
    modes = partitioned(part, net_text(fc2="parallel_param { mode: HYBRID groups: 2 }"), TRAIN)
    assert modes["fc1"] == (MODEL_PARALLEL_INNER_PRODUCT, _PP.HYBRID, 2)


def test_the_log_names_each_fc_layers_mode_and_why_once(clusters, monkeypatch, captured_log):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    part, _ = partitioner()
    text = net_text(fc2="parallel_param { mode: DATA }")
    partitioned(part, text, TRAIN)
    partitioned(part, text, TEST)
    lines = [line.split("] ", 1)[1] for line in captured_log.getvalue().splitlines()
             if "partition.py" in line]
    assert lines == [f"fc1: MODEL (planner, cluster {clusters['split']} (SYNCSGD_CLUSTER))",
                     "fc2: DATA (prototxt)"]
    assert "Creating Layer" not in captured_log.getvalue()     # the planner's net is not logged


def test_a_net_the_planner_cannot_price_trains_data_unless_auto(clusters, captured_log):
    """Without a data layer there is no global batch to plan for."""
    part, _ = partitioner()
    kept = ("InnerProduct", _PP.DATA, 1)
    assert partitioned(part, net_text(data=INPUTS), TRAIN) == {"fc1": kept, "fc2": kept}
    said = captured_log.getvalue()
    assert "The planner cannot price this net" in said and "no data layer" in said
    assert "fc1: DATA (default, the planner could not price the net)" in said
    part, _ = partitioner()
    with pytest.raises(SyncSGDError, match="no data layer"):
        partitioned(part, net_text("parallel_param { mode: AUTO }", data=INPUTS), TRAIN)


def test_one_process_never_plans(clusters, monkeypatch, tmp_path):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(tmp_path / "no-such-cluster.json"))
    solver = syncsgd.get_solver(str(write_solver(tmp_path, net_text())))
    assert [layer.type for layer in solver.net.layers if layer.name.startswith("fc")] == \
        ["InnerProduct", "InnerProduct"]
    solver.close()


# -- which cluster file ---------------------------------------------------------------------

def test_cluster_comes_from_the_variable_then_the_cache_then_the_shipped_file(clusters,
                                                                              monkeypatch):
    cluster, origin = training_cluster()
    assert (cluster.name, origin) == ("this-machine", "shipped this-machine")
    cache = cache_path()
    assert cache.startswith(str(clusters["split"].parent / "cache" / "syncsgd"))
    os.makedirs(os.path.dirname(cache))
    with open(cache, "w") as f:
        json.dump(SPLIT, f)
    cluster, origin = training_cluster()
    assert (cluster.name, origin) == ("split", cache)
    monkeypatch.setenv("SYNCSGD_CLUSTER", "paper-fdr")
    assert training_cluster()[0].name == "paper-fdr"


def test_a_broken_cache_warns_and_falls_back(clusters, captured_log):
    cache = cache_path()
    os.makedirs(os.path.dirname(cache))
    with open(cache, "w") as f:
        f.write('{"node": {"peak_flops": 1e9},')          # cut short
    cluster, origin = training_cluster()
    assert (cluster.name, origin) == ("this-machine", "shipped this-machine")
    warning, = [line for line in captured_log.getvalue().splitlines() if line.startswith("W")]
    assert cache in warning and "not valid JSON" in warning
    assert f"Delete {cache} or rerun `syncsgd plan --calibrate`" in warning


def test_a_bad_variable_is_an_error_naming_it(clusters, monkeypatch, tmp_path):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(tmp_path / "nope.json"))
    with pytest.raises(ClusterError, match=r"SYNCSGD_CLUSTER .*nope.json: no such file"):
        training_cluster()
    (tmp_path / "bad.json").write_text("[]")
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(tmp_path / "bad.json"))
    with pytest.raises(ClusterError, match=r"bad.json: needs a \"node\""):
        training_cluster()


def test_calibrate_writes_this_hosts_cache_and_out(clusters, monkeypatch, tmp_path):
    from test_planner import run_plan
    from syncsgd.plan import calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda progress: dict(SPLIT, name="measured"))
    printed = run_plan("--calibrate", "--out", str(tmp_path / "copy.json"))
    assert f"Wrote {cache_path()}" in printed and "copy.json" in printed
    assert json.loads((tmp_path / "copy.json").read_text())["name"] == "measured"
    cluster, origin = training_cluster()
    assert (cluster.name, origin) == ("measured", cache_path())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "copy.json"))    # a file, not a folder
    with pytest.raises(ClusterError, match="SYNCSGD_CLUSTER=FILE"):
        run_plan("--calibrate")


# -- under MPI --------------------------------------------------------------------------------

@pytest.mark.mpi
def test_two_ranks_train_the_default_split_as_one_process(clusters, monkeypatch, tmp_path):
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    solver = write_solver(tmp_path, net_text())
    reference = train(1, solver, 4, tmp_path / "one.npz")
    done = mpirun.run(2, SCRIPT, solver, 4, tmp_path / "two.npz")
    result = dict(np.load(tmp_path / "two.npz"))
    assert_same(result, reference)
    assert result["bytes_sent"][0] > 0                     # activations moved: it was split
    said = [line.split("] ", 1)[1] for line in done.stderr.splitlines() if "partition.py" in line]
    assert said == [f"fc{i}: MODEL (planner, cluster {clusters['split']} (SYNCSGD_CLUSTER))"
                    for i in (1, 2)]


AGREE = r"""
import sys
import syncsgd
from syncsgd.parallel import world
solver = syncsgd.get_solver(sys.argv[1])
solver.step(1)
classes = [type(l).__name__ for l in solver.net.layers if l.name in ("fc1", "fc2")]
sys.stdout.write(f"rank {world().rank}: {classes}\n")
sys.stdout.flush()
solver.close()
"""


@pytest.mark.mpi
def test_ranks_with_different_cluster_files_take_rank_0s_choice(clusters, tmp_path):
    assert set(choose_modes(text_format.Parse(net_text(), pb.NetParameter()), 2,
                            cluster=str(clusters["replicate"])).values()) == {(_PP.DATA, 1)}
    solver = write_solver(tmp_path, net_text())
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    rank = [sys.executable, "-m", "mpi4py", str(script), str(solver)]
    command = [mpirun.mpiexec(), "-n", "1", "-env", "SYNCSGD_CLUSTER", str(clusters["split"]),
               *rank, ":", "-n", "1", "-env", "SYNCSGD_CLUSTER", str(clusters["replicate"]),
               *rank]
    env = dict(os.environ, PYTHONPATH=mpirun.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env,
                          cwd=mpirun.ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    split = [MODEL_PARALLEL_INNER_PRODUCT] * 2
    said = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert said == [f"rank {r}: {split}" for r in (0, 1)]


def test_layers_sharing_weights_by_name_keep_data(clusters, monkeypatch, captured_log):
    """A siamese pair the planner would split apart (each on its own) keeps the shared weights
    whole, as such a net trained before the planner became the default."""
    monkeypatch.setenv("SYNCSGD_CLUSTER", str(clusters["split"]))
    shared = 'param { name: "w" } param { name: "b" }'
    text = net_text(fc1=shared).replace(
        'layer { name: "sig1"', f'''layer {{ name: "fc1b" type: "InnerProduct" bottom: "data"
        top: "fc1b" {shared} inner_product_param {{ num_output: 64 }} }}
        layer {{ name: "silence" type: "Silence" bottom: "fc1b" }}
        layer {{ name: "sig1"''')
    part, _ = partitioner()
    modes = partitioned(part, text, TRAIN)
    assert modes["fc1"] == ("InnerProduct", _PP.DATA, 1)
    assert "fc1: DATA (it shares weights by name with another layer)" in captured_log.getvalue()


def test_the_planner_chooses_beside_the_layers_the_prototxt_places(clusters):
    """On SPLIT the planner alone splits both layers; with fc1 pinned data-parallel (the
    prototxt's DATA), splitting fc2 alone no longer pays, and it says so."""
    net = text_format.Parse(net_text(), pb.NetParameter())
    split = str(clusters["split"])
    assert choose_modes(net, 2, cluster=split) == {"fc1": (_PP.MODEL, 1), "fc2": (_PP.MODEL, 1)}
    assert choose_modes(net, 2, cluster=split, fixed={"fc1": False}) == {
        "fc1": (_PP.DATA, 1), "fc2": (_PP.DATA, 1)}
    assert choose_modes(net, 2, cluster=split, fixed={"fc2": True})["fc2"] == (_PP.MODEL, 1)
