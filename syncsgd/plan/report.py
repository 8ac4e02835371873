"""The planner's report: per-layer costs, balance and strategy at the largest node count, and the
predicted scaling over node counts (the `plan --json` object of CONTRACT.md), as data or a table.
"""
from syncsgd.plan import balance
from syncsgd.plan.cluster import Cluster, cluster_from_dict, load_cluster
from syncsgd.plan.costs import DTYPE_BYTES, build_planning_net, net_costs

DEFAULT_CLUSTER = "paper-fdr"


def resolve_cluster(spec=None, node_flops=None, bandwidth=None, overlap=None):
    """A Cluster from a file or shipped name, or from --node_flops and --bandwidth alone."""
    if isinstance(spec, Cluster):
        cluster = spec
    elif spec is None and node_flops is not None and bandwidth is not None:
        cluster = cluster_from_dict({
            "name": "command line", "node": {"peak_flops": node_flops},
            "network": {"bandwidth": bandwidth, "overlap": overlap or 0.0},
            "sources": {"node.peak_flops": "--node_flops", "network.bandwidth": "--bandwidth"}})
    else:
        cluster = load_cluster(spec or DEFAULT_CLUSTER)
    return cluster.with_overrides(node_flops=node_flops, bandwidth=bandwidth, overlap=overlap)


def model_costs(model):
    """(LayerCosts per sample, TRAIN data batch or None) of a model."""
    net, data_batch = build_planning_net(model)
    return net_costs(net), data_batch


def build_report(costs, batch, cluster, node_counts, model_name="", overlap=True):
    """The `plan --json` object (CONTRACT.md) plus the details behind it."""
    planner = balance.Planner(costs, batch, cluster, overlap)
    single, points = planner.plan(node_counts)
    target = points[-1]
    node_batch = batch / target.nodes
    ov = cluster.overlap
    layers = []
    for cost, placement, step in zip(costs, target.placements, target.steps):
        gemm = cost.is_gemm
        rate = cluster.compute_rate(cost.type, target.nodes, cost.shape_key())
        ratio = balance.data_parallel_ratio(cost, node_batch, ov=ov)
        row = {
            "name": cost.name, "type": cost.type,
            "flops": cost.flops(batch),
            "weight_bytes": cost.weight_bytes,
            "comp_comm_ratio": ratio,
            "strategy": placement.strategy if gemm else balance.DATA,
            "groups": placement.groups if gemm else target.nodes,
            "forward_flops": cost.forward * batch,
            "backward_data_flops": cost.backward_data * batch,
            "weight_grad_flops": cost.weight_grad * batch,
            "input_bytes": DTYPE_BYTES * cost.input_elems * batch,
            "output_bytes": DTYPE_BYTES * cost.output_elems * batch,
            "f_over_bw": rate / cluster.bandwidth,
            "min_node_batch": balance.min_node_batch(cost, rate, cluster.bandwidth, ov=ov),
            "bound": (None if ratio is None else
                      "compute" if ratio >= rate / cluster.bandwidth else "network"),
            "model_comp_comm_ratio": balance.model_parallel_ratio(cost, target.nodes, ov=ov),
            "g_star": (balance.g_star(cost.geometry["ifm"], cost.geometry["ofm"],
                                      target.nodes, batch)
                       if cost.type == "InnerProduct" and gemm else None),
            "node_flops": step.flops, "node_comm_bytes": step.comm_bytes,
            "compute_s": step.compute, "comm_s": step.comm,
            "blocking_comm_s": step.forward_comm + step.backward_comm,
        }
        layers.append(row)
    report = {
        "model": model_name, "batch": batch, "cluster": cluster.name,
        "cluster_file": cluster.path, "layer_nodes": target.nodes,
        "single_node_s": single,
        "layers": layers,
        "points": [_point_row(point, costs, single) for point in points],
    }
    return report


def _point_row(point, costs, single):
    split = [p for c, p in zip(costs, point.placements) if c.is_gemm and p.strategy != "data"]
    return {
        "nodes": point.nodes, "iteration_s": point.iteration_s, "speedup": point.speedup,
        "efficiency": point.efficiency,
        "groups": split[0].groups if split else point.nodes,
        "strategies": {c.name: p.strategy for c, p in zip(costs, point.placements) if c.is_gemm},
        "uniform_speedup": {s: single / t if t else None for s, t in point.per_strategy.items()},
    }


def _si(value, unit=""):
    if value is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def print_report(report, cluster):
    n = report["layer_nodes"]
    batch = report["batch"]
    print(f"Plan for {report['model']}: global minibatch {batch}, cluster {cluster.name} "
          f"({_si(cluster.peak_flops, 'FLOP/s')} peak per node, {_si(cluster.bandwidth, 'B/s')}"
          f", latency {cluster.latency * 1e6:.3g} us, ov {cluster.overlap:g})")
    print(f"\nPer layer at N = {n} nodes (MBn = {batch / n:.4g}); FLOPs per iteration "
          "(forward + backward-data + weight gradient); ratio = data-parallel FLOP/byte, "
          f"compute-bound when >= F/BW")
    header = ("layer", "type", "FLOPs", "weights", "out act.", "ratio", "F/BW", "min MBn",
              "bound", "strategy", "G", "G*", "sent/node", "compute", "comm")
    rows = []
    for layer in report["layers"]:
        if not layer["flops"] and not layer["weight_bytes"]:
            continue
        rows.append((
            layer["name"], layer["type"], _si(layer["flops"]), _si(layer["weight_bytes"], "B"),
            _si(layer["output_bytes"], "B"),
            f"{layer['comp_comm_ratio']:.3g}" if layer["comp_comm_ratio"] is not None else "-",
            f"{layer['f_over_bw']:.3g}" if layer["comp_comm_ratio"] is not None else "-",
            f"{layer['min_node_batch']:.3g}" if layer["min_node_batch"] is not None else "-",
            layer["bound"] or "-", layer["strategy"], str(layer["groups"]),
            f"{layer['g_star']:.2f}" if layer["g_star"] is not None else "-",
            _si(layer["node_comm_bytes"], "B"),
            f"{layer['compute_s'] * 1e3:.3g} ms", f"{layer['comm_s'] * 1e3:.3g} ms"))
    _table(header, rows)
    print(f"\nPredicted scaling (one node: {report['single_node_s']:.4g} s per iteration); "
          "speedup of the planner's per-layer choice and of each strategy used throughout:")
    header = ("nodes", "MBn", "iteration", "speedup", "efficiency", "G", "data", "model",
              "hybrid")
    rows = []
    for p in report["points"]:
        u = p["uniform_speedup"]
        rows.append((str(p["nodes"]), f"{batch / p['nodes']:.4g}", f"{p['iteration_s']:.4g} s",
                     f"{p['speedup']:.3g}x", f"{100 * p['efficiency']:.0f}%", str(p["groups"]),
                     *(f"{u[s]:.3g}x" if u[s] else "-" for s in balance.STRATEGIES)))
    _table(header, rows)


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths))))
