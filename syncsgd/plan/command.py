"""`syncsgd plan`: per-layer costs, balance and parallelism choice, and predicted scaling.

register(verbs) adds the sub-command to the `syncsgd` parser; choose_modes() is what training
calls for layers marked `parallel_param { mode: AUTO }`.
"""
import argparse
import json
import os

from syncsgd.errors import SyncSGDError
from syncsgd.plan import balance
from syncsgd.plan.cluster import Cluster, cluster_from_dict, load_cluster
from syncsgd.plan.costs import DTYPE_BYTES, build_planning_net, find_model, net_costs

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_CLUSTER = "paper-fdr"


def _flag(parser, name, **kwargs):
    """Caffe's -name and --name spellings, and --name-with-dashes for names with underscores."""
    spellings = [f"-{name}", f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **kwargs)


def _node_list(text):
    try:
        nodes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes takes a comma list of node counts like "
                                         f"1,2,4,8; got '{text}'") from None
    if not nodes or min(nodes) < 1:
        raise argparse.ArgumentTypeError("--nodes: node counts must be positive integers")
    return sorted(set(nodes))


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--batch must be a positive integer, got '{text}'")
    return value


def register(verbs):
    """Add `plan` to an argparse sub-parsers object (syncsgd/cli.py's `verbs`)."""
    p = verbs.add_parser("plan", help="predict per-layer balance, parallelism and speedup on a "
                                      "cluster (PAPER.md section 4)")
    _flag(p, "model", help="net prototxt (train_val or deploy), model folder or zoo name")
    _flag(p, "nodes", type=_node_list, default=list(DEFAULT_NODES),
          help="comma list of node counts (default 1,2,4,...,128)")
    _flag(p, "batch", type=_positive_int, help="global minibatch (default: the TRAIN data layer's "
                                     "batch_size; required for a deploy net)")
    _flag(p, "cluster", help="cluster JSON file or shipped name: paper-fdr (default unless "
                             "--node_flops and --bandwidth are given), paper-10gbe, this-machine")
    _flag(p, "node_flops", type=float, help="override: node peak FLOP/s")
    _flag(p, "bandwidth", type=float, help="override: network bytes/s per node and direction")
    _flag(p, "overlap", type=float, help="override: ov, fraction of send/receive that overlap")
    _flag(p, "json", action="store_true", help="print one JSON object (see CONTRACT.md)")
    _flag(p, "plot", help="write predicted speedup per node count and strategy to this PNG")
    _flag(p, "calibrate", action="store_true",
          help="measure this machine (GEMM rate per layer shape, memory, MPI on loopback) and "
               "write its cluster file")
    _flag(p, "out", help="with --calibrate: where to write (default: the shipped "
                         "this-machine.json)")
    p.set_defaults(run=cmd_plan)
    return p


# -- building blocks ------------------------------------------------------------------------

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


def choose_modes(net_param, nodes, batch=None, cluster=None):
    """{layer name: (ParallelParameter mode, groups)} for `nodes` ranks: the planner's choice for
    every layer with weights (split ones are InnerProduct layers sharing one G).

    `net_param` is a NetParameter or prototxt path, `batch` the global minibatch (default: its
    TRAIN data layer's), `cluster` a Cluster, file or shipped name (default: this-machine).
    """
    from syncsgd.proto import pb
    costs, data_batch = model_costs(net_param)
    batch = batch or data_batch
    if not batch:
        raise SyncSGDError("choose_modes: the net has no data layer; give the global batch")
    cluster = resolve_cluster(cluster or "this-machine")
    placements, _ = balance.Planner(costs, batch, cluster).choose(nodes)
    modes = {balance.DATA: pb.ParallelParameter.DATA, balance.MODEL: pb.ParallelParameter.MODEL,
             balance.HYBRID: pb.ParallelParameter.HYBRID}
    return {c.name: (modes[p.strategy], p.groups if p.strategy == balance.HYBRID else 1)
            for c, p in zip(costs, placements) if c.is_gemm}


# -- the command ----------------------------------------------------------------------------

def cmd_plan(args):
    if args.calibrate:
        return _calibrate(args)
    if not args.model:
        raise SyncSGDError("plan: give --model (a prototxt, model folder or zoo name), or "
                           "--calibrate")
    model = find_model(args.model)
    cluster = resolve_cluster(args.cluster, args.node_flops, args.bandwidth, args.overlap)
    costs, data_batch = model_costs(model)
    batch = args.batch or data_batch
    if not batch:
        raise SyncSGDError(f"plan: {model} has no TRAIN data layer to take the global minibatch "
                           "from; give --batch")
    report = build_report(costs, batch, cluster, args.nodes, str(model))
    if args.plot:
        from syncsgd.plan.plot import plot_speedup
        plot_speedup(report, args.plot)
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_report(report, cluster)
        if args.plot:
            print(f"Speedup plot written to {args.plot}")
    return 0


def _calibrate(args):
    from syncsgd.plan.calibrate import calibrate, write_cluster
    from syncsgd.plan.cluster import CLUSTER_DIR
    out = args.out or os.path.join(CLUSTER_DIR, "this-machine.json")
    cluster = calibrate(progress=lambda text: print(text, flush=True))
    write_cluster(cluster, out)
    print(f"Wrote {out}")
    return 0


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
