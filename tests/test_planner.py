"""The planner (syncsgd/plan): per-layer FLOPs and bytes against values worked out by hand here,
the paper's balance equations (docs/method.md "Balance equations") on every conv and FC layer of
real nets, G*, the collective and iteration-time models, the strategy flip for FC layers as the
per-node batch shrinks, cluster files, the `plan` command's JSON (CONTRACT.md) and choose_modes
for AUTO."""
import argparse
import contextlib
import functools
import io
import json
import math
import os

import numpy as np
import pytest

from syncsgd.errors import SyncSGDError
from syncsgd.plan import balance
from syncsgd.plan.balance import (DATA, HYBRID, MODEL, Placement, Planner, Step,
                                  allgather_time, allreduce_time, data_parallel_ratio,
                                  expected_max_normal, g_star, hybrid_volume, iteration_time,
                                  min_node_batch, model_parallel_ratio)
from syncsgd.plan.calibrate import network_parameters
from syncsgd.plan.cluster import (ClusterError, cluster_from_dict, load_cluster,
                                  shipped_clusters)
from syncsgd.cli.plan import register
from syncsgd.plan.modes import choose_modes
from syncsgd.plan.report import build_report
from syncsgd.plan.costs import LayerCost, build_planning_net, net_costs, planning_param
from syncsgd.proto import pb

S = 4   # bytes per fp32 value

TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2 } }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "norm" type: "LRN" bottom: "pool" top: "norm" lrn_param { local_size: 3 } }
layer { name: "fc1" type: "InnerProduct" bottom: "norm" top: "fc1"
        inner_product_param { num_output: 10 } }
layer { name: "relu" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
        inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc2" top: "prob" }
"""

# Worked out by hand, per sample: (forward, backward-data, weight-gradient FLOPs, learnable
# values, output values). conv1: 3x9x9 -> 4x9x9, 4*3*3*3 weights + 4 biases, 4*27*81 MACs.
# conv2 (group 2, dilation 2 so the kernel spans 5, stride 2, pad 2): 9 -> (9+4-5)//2+1 = 5,
# weights 6 x (4/2) x 3 x 3 = 108 + 6, MACs 108 * 25. pool: 5 -> ceil(3/2)+1 = 3, 6x3x3 = 54
# outputs of 4 compares, MAX backward one per output. LRN over 3 channels: (3 + 5) forward and
# (3 + 6) backward per value. fc1: 54 -> 10. ReLU: 1 and 1. fc2: 10 -> 5. Softmax: 4 and 3.
HAND = {
    "conv1": (2 * 4 * 27 * 81, 2 * 4 * 27 * 81, 2 * 4 * 27 * 81, 112, 4 * 81),
    "conv2": (2 * 108 * 25, 2 * 108 * 25, 2 * 108 * 25, 114, 6 * 25),
    "pool": (54 * 4, 54, 0, 0, 54),
    "norm": (54 * 8, 54 * 9, 0, 0, 54),
    "fc1": (2 * 540, 2 * 540, 2 * 540, 550, 10),
    "relu": (10, 10, 0, 0, 10),
    "fc2": (2 * 50, 2 * 50, 2 * 50, 55, 5),
    "prob": (20, 15, 0, 0, 5),
}

TRAIN_VAL = """
name: "tiny_tv"
layer { name: "train_data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "missing/train.txt" batch_size: 32 } }
layer { name: "test_data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "missing/test.txt" batch_size: 4 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "fc1" type: "InnerProduct" bottom: "conv1" top: "fc1"
        inner_product_param { num_output: 256 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
        inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "fc2" bottom: "label" top: "accuracy"
        include { phase: TEST } }
"""
DEPLOY = """
name: "tiny_tv"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
"""

CLUSTER = {"name": "test", "node": {"peak_flops": 1e12, "cores": 10, "comm_cores": 0,
                                     "memory_bandwidth": 1e11,
                                     "efficiency": {"default": 1.0}},
           "network": {"bandwidth": 1e9, "latency": 1e-6, "overlap": 0.0,
                       "allreduce": "ring"}}


def cluster(**changes):
    raw = json.loads(json.dumps(CLUSTER))
    for key, value in changes.items():
        section, field = key.split("__")
        raw[section][field] = value
    return cluster_from_dict(raw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.prototxt"
    path.write_text(TINY)
    net, batch = build_planning_net(str(path))
    return net, net_costs(net), batch, path


@pytest.fixture(scope="module")
def tiny_train_val(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tv")
    (folder / "train_val.prototxt").write_text(TRAIN_VAL)
    (folder / "deploy.prototxt").write_text(DEPLOY)
    return folder / "train_val.prototxt"


@pytest.fixture(scope="module")
def zoo():
    """Costs and batch-1 nets of small zoo models (grouped convolutions in alexnet)."""
    out = {}
    for name in ("lenet", "cifar10_quick", "alexnet"):
        net, batch = build_planning_net(name)
        out[name] = (net, net_costs(net), batch)
    return out


# -- per-layer costs ------------------------------------------------------------------------

def test_tiny_net_costs_equal_hand_computed_values(tiny):
    _, costs, batch, _ = tiny
    assert batch is None                               # a deploy net names no batch
    by_name = {c.name: c for c in costs}
    for name, (fwd, bwd_data, wgrad, weights, outputs) in HAND.items():
        c = by_name[name]
        assert (c.forward, c.backward_data, c.weight_grad) == (fwd, bwd_data, wgrad), name
        assert c.weights == weights and c.weight_bytes == S * weights, name
        assert c.output_elems == outputs, name
        assert c.flops(7) == 7 * (fwd + bwd_data + wgrad)
    assert by_name["conv1"].input_elems == 3 * 81
    assert by_name["conv2"].geometry["out"] == (5, 5)
    assert by_name["conv2"].geometry["group"] == 2
    assert by_name["fc1"].geometry["ifm"] == 54


def test_report_bytes_and_flops_scale_with_the_global_batch(tiny):
    _, costs, _, _ = tiny
    report = build_report(costs, 64, cluster(), [1, 4])
    rows = {r["name"]: r for r in report["layers"]}
    for name, (fwd, bwd_data, wgrad, weights, outputs) in HAND.items():
        assert rows[name]["flops"] == 64 * (fwd + bwd_data + wgrad)
        assert rows[name]["weight_bytes"] == S * weights
        assert rows[name]["output_bytes"] == S * 64 * outputs
    assert rows["conv1"]["input_bytes"] == S * 64 * 3 * 81


def test_deconvolution_eltwise_and_split_costs(tmp_path):
    path = tmp_path / "branchy.prototxt"
    path.write_text("""
        layer { name: "data" type: "Input" top: "data"
                input_param { shape { dim: 3 dim: 4 dim: 5 dim: 5 } } }
        layer { name: "up" type: "Deconvolution" bottom: "data" top: "up"
                convolution_param { num_output: 2 kernel_size: 3 stride: 2 } }
        layer { name: "a" type: "Convolution" bottom: "up" top: "a"
                convolution_param { num_output: 2 kernel_size: 1 } }
        layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "up" top: "sum" }
    """)
    net, _ = build_planning_net(str(path))
    costs = {c.name: c for c in net_costs(net)}
    # Deconvolution: weights (4, 2, 3, 3) applied at each of the 5x5 input positions; output
    # (5 - 1) * 2 + 3 = 11.
    assert costs["up"].forward == 2 * 72 * 25 and costs["up"].output_elems == 2 * 121
    split = next(c for c in costs.values() if c.type == "Split")
    assert split.backward_data == 2 * 121            # two consumers: one add per value
    assert costs["sum"].forward == 2 * 121 and costs["sum"].backward_data == 0


def test_train_val_is_planned_with_inputs_in_place_of_data_layers(tiny_train_val):
    param, batch = planning_param(str(tiny_train_val))
    assert batch == 32                                 # the TRAIN data layer's batch_size
    types = [lp.type for lp in param.layer]
    assert "HDF5Data" not in types and "Accuracy" not in types
    data = param.layer[0]
    assert data.type == "Input" and list(data.top) == ["data", "label"]
    assert [list(s.dim) for s in data.input_param.shape] == [[1, 2, 6, 6], [1]]
    net, _ = build_planning_net(str(tiny_train_val))
    costs = {c.name: c for c in net_costs(net)}
    assert costs["fc1"].forward == 2 * 8 * 36 * 256


# -- the paper's balance equations ----------------------------------------------------------

def _gemm_layers(net):
    for layer, top in zip(net.layers, net.top_vecs):
        if layer.type in ("Convolution", "InnerProduct"):
            yield layer, top


@pytest.mark.parametrize("node_batch", [1, 4, 32])
@pytest.mark.parametrize("ov", [0.0, 0.5, 1.0])
def test_data_parallel_ratio_is_the_closed_form_for_every_conv_and_fc(tiny, zoo, node_batch,
                                                                      ov):
    nets = [tiny[:2]] + [v[:2] for v in zoo.values()]
    checked = 0
    for net, costs in nets:
        by_name = {c.name: c for c in costs}
        for layer, top in _gemm_layers(net):
            shape = top[0].shape
            outw_outh = shape[3] * shape[2] if len(shape) == 4 else 1
            expected = 6 * outw_outh * node_batch / (S * (2 - ov))
            got = data_parallel_ratio(by_name[layer.name], node_batch, ov=ov)
            assert got == pytest.approx(expected, rel=1e-12), layer.name
            checked += 1
    assert checked >= 20


def test_min_node_batch_and_model_ratio_closed_forms(zoo):
    _, costs, _ = zoo["alexnet"]
    for c in costs:
        if not c.is_gemm:
            continue
        out = c.geometry["out"][0] * c.geometry["out"][1]
        assert min_node_batch(c, 2e12, 1e10, ov=0.5) == pytest.approx(
            2e12 / 1e10 * S * 1.5 / (6 * out))
        # 6 ifm (ofm / N) kw kh outw outh MB / (s ifm inw inh MB (2 - ov))
        k = c.geometry["kernel"][0] * c.geometry["kernel"][1]
        ifm_per_group = c.geometry["ifm"] // c.geometry["group"]
        expected = 6 * ifm_per_group * (c.geometry["ofm"] / 8) * k * out / (
            S * c.input_elems * 2.0)
        assert model_parallel_ratio(c, 8) == pytest.approx(expected), c.name
    # The FC case of the paper: 0.75 * ofm / N for fp32 without overlap.
    fc7 = next(c for c in costs if c.name == "fc7")
    assert model_parallel_ratio(fc7, 16) == pytest.approx(0.75 * 4096 / 16)


def test_g_star_is_the_closed_form_and_minimises_the_hybrid_volume():
    fc6 = LayerCost("fc6", "InnerProduct", 1, 1, 1, weights=25088 * 4096,
                    gemm_weights=25088 * 4096, input_elems=25088, output_elems=4096,
                    geometry={"ifm": 25088, "ofm": 4096})
    # The paper's examples (docs/method.md "Balance equations").
    assert g_star(25088, 4096, 64, 256) == pytest.approx(2.157, abs=1e-3)
    assert g_star(25088, 4096, 128, 512) == pytest.approx(4.314, abs=1e-3)
    for nodes, batch in ((64, 256), (128, 512), (16, 64), (256, 4096)):
        star = g_star(25088, 4096, nodes, batch)
        assert star == pytest.approx(math.sqrt(nodes * batch * (25088 + 4096) /
                                               (25088 * 4096)))
        grid = np.linspace(star / 4, star * 4, 20001)
        volumes = [hybrid_volume(fc6, g, nodes, batch) for g in grid]
        assert grid[int(np.argmin(volumes))] == pytest.approx(star, rel=1e-3)
        # and the volume is the paper's 2 s (W G / N + (ifm + ofm) MB / G)
        assert hybrid_volume(fc6, 2, nodes, batch) == pytest.approx(
            2 * S * (25088 * 4096 * 2 / nodes + 29184 * batch / 2))


# -- collectives and the iteration ----------------------------------------------------------

def test_collectives_follow_latency_plus_bytes_over_bandwidth():
    n = 8e6
    for ov in (0.0, 0.3, 1.0):
        ring = cluster(network__overlap=ov, network__allreduce="ring")
        halving = cluster(network__overlap=ov, network__allreduce="recursive_halving")
        auto = cluster(network__overlap=ov, network__allreduce="auto")
        for p in (2, 3, 8, 64):
            moved = 2 * (p - 1) / p * n * (2 - ov) / 1e9
            assert allreduce_time(n, p, ring) == pytest.approx(2 * (p - 1) * 1e-6 + moved)
            assert allreduce_time(n, p, halving) == pytest.approx(
                2 * math.ceil(math.log2(p)) * 1e-6 + moved)
            assert allreduce_time(n, p, auto) == pytest.approx(
                min(allreduce_time(n, p, ring), allreduce_time(n, p, halving)))
            assert allgather_time(n, p, ring) == pytest.approx(
                (p - 1) * 1e-6 + (p - 1) / p * n * (2 - ov) / 1e9)
        assert allreduce_time(n, 1, ring) == 0.0


def test_iteration_time_overlaps_gradient_reduction_with_backward():
    first = Step(forward=1.0, backward=2.0)
    last = Step(forward=1.0, backward=1.0, gradient_comm=1.5)
    assert iteration_time([first, Step(forward=1.0, backward=1.0)]) == pytest.approx(5.0)
    # The last layer's reduction (1.5 s) hides behind the first layer's backward (2 s).
    assert iteration_time([first, last]) == pytest.approx(5.0)
    # Without overlap it follows backward: the next forward of `last` waits for it.
    assert iteration_time([first, last], overlap=False) == pytest.approx(6.5)
    # It also hides behind the next forward of the layers before it (3 s in all); the rest of a
    # longer one shows up in the iteration.
    for comm, seconds in ((3.0, 5.0), (4.0, 6.0)):
        assert iteration_time([first, Step(forward=1.0, backward=1.0, gradient_comm=comm)]) == \
            pytest.approx(seconds)
    # Blocking exchanges are on the critical path.
    assert iteration_time([first, Step(forward=1.0, backward=1.0, forward_comm=0.25,
                                       backward_comm=0.25)]) == pytest.approx(5.5)


def test_straggler_term_uses_the_expected_maximum_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    values = [expected_max_normal(n) for n in (2, 4, 16, 128)]
    assert values == sorted(values)


# -- the plan -------------------------------------------------------------------------------

def test_fc_layers_flip_from_data_to_model_or_hybrid_as_the_node_batch_shrinks(tiny_train_val):
    net, _ = build_planning_net(str(tiny_train_val))
    costs = net_costs(net)
    net_cluster = cluster(network__bandwidth=1e10)
    nodes = 8
    choices = []
    for node_batch in (4096, 1024, 256, 64, 16, 4, 1):
        placements, _ = Planner(costs, node_batch * nodes, net_cluster).choose(nodes)
        by_name = {c.name: p for c, p in zip(costs, placements) if c.is_gemm}
        assert by_name["conv1"].strategy == DATA
        choices.append(by_name["fc1"].strategy)
    assert choices[0] == DATA and choices[-1] in (MODEL, HYBRID), choices
    flip = choices.index(next(c for c in choices if c != DATA))
    assert all(c != DATA for c in choices[flip:]), choices
    # The balance equation agrees: fc1 is network-bound data-parallel below its minimum MBn.
    fc1 = next(c for c in costs if c.name == "fc1")
    assert min_node_batch(fc1, 1e12, 1e10) == pytest.approx(100 * S * 2 / 6)


def test_split_layers_share_one_group_count_and_only_fc_layers_split(zoo):
    _, costs, batch = zoo["alexnet"]
    planner = Planner(costs, 256, cluster(network__bandwidth=5e9))
    for nodes in (4, 16, 64):
        placements, seconds = planner.choose(nodes)
        split = {p.groups for c, p in zip(costs, placements) if p.strategy != DATA}
        assert len(split) <= 1
        for c, p in zip(costs, placements):
            if p.strategy != DATA:
                assert c.type == "InnerProduct"
        # never worse than data parallelism throughout
        assert seconds <= planner.time(planner.uniform(DATA, nodes), nodes) + 1e-12


def test_speedup_is_one_node_time_over_n_node_time(tiny_train_val):
    net, batch = build_planning_net(str(tiny_train_val))
    single, points = Planner(net_costs(net), batch, cluster()).plan([1, 2, 4])
    assert points[0].speedup == pytest.approx(1.0) and points[0].iteration_s == single
    for p in points:
        assert p.speedup == pytest.approx(single / p.iteration_s)
        assert p.efficiency == pytest.approx(p.speedup / p.nodes)


# -- cluster files --------------------------------------------------------------------------

def test_shipped_clusters_load_and_cite_a_source_for_every_number():
    assert {"paper-fdr", "paper-10gbe", "this-machine"} <= set(shipped_clusters())
    for name in ("paper-fdr", "paper-10gbe", "this-machine"):
        c = load_cluster(name)
        raw = c.raw
        for section in ("node", "network"):
            for key, value in raw[section].items():
                if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
                    assert f"{section}.{key}" in raw["sources"], (name, section, key)
        assert c.compute_rate("Convolution", 1) > 0
    fdr = load_cluster("paper-fdr")
    assert fdr.peak_flops == pytest.approx(2 * 14 * 2.6e9 * 32)
    assert fdr.bandwidth == pytest.approx(6.8e9)


def test_cluster_errors_name_the_field(tmp_path):
    with pytest.raises(ClusterError, match="network.bandwidth"):
        cluster_from_dict({"node": {"peak_flops": 1e12}, "network": {}})
    with pytest.raises(ClusterError, match="overlap"):
        cluster(network__overlap=1.5)
    with pytest.raises(ClusterError, match="allreduce"):
        cluster(network__allreduce="tree")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ClusterError, match="bad.json"):
        load_cluster(str(bad))
    with pytest.raises(ClusterError, match="shipped"):
        load_cluster("no-such-cluster")
    c = cluster().with_overrides(node_flops=5e12, bandwidth=2e9, overlap=1.0)
    assert (c.peak_flops, c.bandwidth, c.overlap) == (5e12, 2e9, 1.0)


def test_network_parameters_recover_latency_bandwidth_and_overlap():
    alpha, bw = 3e-6, 2e9
    sizes = [8, 4096, 1 << 18, 1 << 21, 1 << 24]
    measured = {"one_way": {n: alpha + n / bw for n in sizes},
                "exchange": {n: alpha + 1.25 * n / bw for n in sizes},
                "allreduce": {n: 2 * alpha + n * 1.25 / bw for n in sizes}}
    latency, bandwidth, overlap = network_parameters(measured)
    assert overlap == pytest.approx(0.75, abs=1e-3)
    assert latency == pytest.approx(alpha, rel=0.01)
    assert bandwidth == pytest.approx(bw, rel=0.01)


# -- the command ----------------------------------------------------------------------------

def run_plan(*argv):
    parser = argparse.ArgumentParser(prog="syncsgd")
    register(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["plan", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.run(args) == 0
    return out.getvalue()


def test_plan_json_follows_the_contract(tiny_train_val):
    report = json.loads(run_plan("--model", str(tiny_train_val), "--nodes", "1,2,4",
                                 "--cluster", "paper-fdr", "--json"))
    assert report["batch"] == 32
    for row in report["layers"]:
        assert {"name", "type", "flops", "weight_bytes", "comp_comm_ratio", "strategy",
                "groups"} <= set(row)
        assert row["strategy"] in ("data", "model", "hybrid")
        assert row["flops"] == pytest.approx(row["forward_flops"] + row["backward_data_flops"] +
                                             row["weight_grad_flops"])
    fc1 = next(r for r in report["layers"] if r["name"] == "fc1")
    assert fc1["flops"] == 32 * 3 * 2 * 8 * 36 * 256
    assert fc1["weight_bytes"] == S * (288 * 256 + 256)
    assert fc1["comp_comm_ratio"] == pytest.approx(6 * 32 / 4 / (S * (2 - 1.0)))
    assert [p["nodes"] for p in report["points"]] == [1, 2, 4]
    for p in report["points"]:
        assert {"nodes", "iteration_s", "speedup", "efficiency"} <= set(p)
    assert report["points"][0]["speedup"] == pytest.approx(1.0)


def test_plan_flags_in_both_spellings_overrides_and_table(tiny_train_val, tmp_path):
    a = json.loads(run_plan("-model", str(tiny_train_val), "-nodes", "2,1", "-batch", "64",
                            "-node_flops", "1e12", "-bandwidth", "1e9", "-json"))
    b = json.loads(run_plan("--model", str(tiny_train_val), "--nodes", "1,2", "--batch", "64",
                            "--node-flops", "1e12", "--bandwidth", "1e9", "--json"))
    assert a == b and a["batch"] == 64 and a["cluster"] == "command line"
    text = run_plan("--model", str(tiny_train_val), "--nodes", "1,4", "--overlap", "0.5")
    assert "fc1" in text and "speedup" in text and "ov 0.5" in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "speedup.png"
    run_plan("--model", str(tiny_train_val), "--nodes", "1,2,4", "--plot", str(png), "--json")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_of_a_deploy_net_needs_a_batch(tiny):
    with pytest.raises(SyncSGDError, match="--batch"):
        run_plan("--model", os.fspath(tiny[3]), "--nodes", "1,2")


def test_choose_modes_gives_parallel_param_values(tiny_train_val):
    wide = {"name": "w", "node": {"peak_flops": 1e13}, "network": {"bandwidth": 1e8},
            "sources": {}}
    modes = choose_modes(str(tiny_train_val), 8, batch=8, cluster=cluster_from_dict(wide))
    assert set(modes) == {"conv1", "fc1", "fc2"}
    assert modes["conv1"] == (pb.ParallelParameter.DATA, 1)
    split = [m for m in modes.values() if m[0] != pb.ParallelParameter.DATA]
    assert split and all(m[0] in (pb.ParallelParameter.MODEL, pb.ParallelParameter.HYBRID)
                         for m in split)
    assert len({g for _, g in split}) == 1


def test_placement_candidates_respect_layer_width():
    narrow = LayerCost("fc", "InnerProduct", 1, 1, 1, weights=40, gemm_weights=40,
                       input_elems=10, output_elems=4, geometry={"ifm": 10, "ofm": 4, "axis": 1})
    assert balance.split_placement(narrow, 8, 2) == Placement(HYBRID, 2)     # 4 wide groups
    assert balance.split_placement(narrow, 8, 1) is None                    # 8 > 4 outputs
    assert balance.split_placement(narrow, 8, 3) is None                    # 3 does not divide 8


def test_shared_host_ranks_split_the_cores():
    host = cluster(node__shared_host=True, node__cores=4,
                   node__efficiency={"Convolution": 0.8, "default": 1.0},
                   node__efficiency_one_core={"Convolution": 0.25})
    full = 1e12 * 0.8
    assert host.compute_rate("Convolution", 1) == pytest.approx(full)
    assert host.compute_rate("Convolution", 4) == pytest.approx(1e12 * 0.25)   # one core each
    assert host.compute_rate("Convolution", 2) == pytest.approx(1e12 * (0.25 + 0.55 / 3))
    assert host.compute_rate("Convolution", 8) == pytest.approx(1e12 * 0.125)  # half a core
    assert host.node_memory_bandwidth(8) == pytest.approx(0.5e11)
    # without a one-core measurement a rank gets its share of the whole host's rate
    assert host.compute_rate("Pooling", 4) == pytest.approx(1e12 / 4)


def test_calibration_times_every_layer_with_all_cores_and_one(tiny_train_val):
    from syncsgd.plan.calibrate import measure_layers
    records, totals = measure_layers(str(tiny_train_val), 4, iterations=1, rounds=1)
    assert {r["layer"] for r in records} >= {"conv1", "fc1", "fc2", "relu1", "loss"}
    for r in records:
        assert r["seconds"] > 0 and r["seconds_one_core"] > 0 and r["flops"] > 0
    fc1 = next(r for r in records if r["layer"] == "fc1")
    assert fc1["flops"] == 4 * 3 * 2 * 288 * 256
    assert fc1["shape"].startswith("InnerProduct 288 -> 256")
    assert len(totals) == 1


@functools.lru_cache(maxsize=None)
def zoo_costs(model):
    """LayerCosts of a zoo model; VGG-A and OverFeat-FAST hold 0.6 GB of weights at batch 1,
    so each is built once."""
    from syncsgd.plan.report import model_costs
    return model_costs(model)[0]


@pytest.mark.parametrize("model, batch, nodes, paper", [
    ("vgg_a", 256, 64, 53), ("vgg_a", 512, 128, 90), ("overfeat_fast", 256, 64, 42),
    ("cddnn", 256, 16, 6.5)])
def test_paper_cluster_predicts_the_papers_speedups_within_25_percent(model, batch, nodes,
                                                                       paper):
    """The paper's headline scaling results (Das et al., Distributed Deep Learning Using
    Synchronous SGD) as anchors (docs/planner.md, validation 5a)."""
    _, (point,) = Planner(zoo_costs(model), batch, load_cluster("paper-fdr")).plan([nodes])
    assert point.speedup == pytest.approx(paper, rel=0.25)


def test_choose_modes_reads_sample_shapes_from_the_hdf5_data(tmp_path):
    import h5py
    from google.protobuf import text_format
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["data"] = np.zeros((3, 2, 6, 6), np.float32)
        f["label"] = np.zeros((3,), np.float32)
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'd.h5'}\n")
    net = text_format.Parse(TRAIN_VAL.replace("missing/train.txt", str(tmp_path / "list.txt")),
                            pb.NetParameter())
    param, batch = planning_param(net)
    assert batch == 32 and list(param.layer[0].input_param.shape[0].dim) == [1, 2, 6, 6]
    modes = choose_modes(net, 4, cluster="paper-fdr")
    assert set(modes) == {"conv1", "fc1", "fc2"}
