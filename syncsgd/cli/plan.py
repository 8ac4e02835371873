"""`syncsgd plan`: per-layer costs, balance and parallelism choice, and predicted scaling.

Only the command line lives here; the planner itself is syncsgd.plan (docs/method.md, "Balance
equations"), which knows nothing of argparse.
"""
import argparse
import json

from syncsgd.cli.flags import flag
from syncsgd.errors import SyncSGDError
from syncsgd.plan.costs import find_model
from syncsgd.plan.report import build_report, model_costs, print_report, resolve_cluster

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128)


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
    """Add `plan` to an argparse sub-parsers object."""
    p = verbs.add_parser("plan", help="predict per-layer balance, parallelism and speedup on a "
                                      "cluster")
    flag(p, "model", help="net prototxt (train_val or deploy), model folder or zoo name")
    flag(p, "nodes", type=_node_list, default=list(DEFAULT_NODES),
         help="comma list of node counts (default 1,2,4,...,128)")
    flag(p, "batch", type=_positive_int, help="global minibatch (default: the TRAIN data layer's "
                                              "batch_size; required for a deploy net)")
    flag(p, "cluster", help="cluster JSON file or shipped name: paper-fdr (default unless "
                            "--node_flops and --bandwidth are given), paper-10gbe, this-machine")
    flag(p, "node_flops", type=float, help="override: node peak FLOP/s")
    flag(p, "bandwidth", type=float, help="override: network bytes/s per node and direction")
    flag(p, "overlap", type=float, help="override: ov, fraction of send/receive that overlap")
    flag(p, "json", action="store_true",
         help="print one JSON object: per-layer costs and strategy, predicted points")
    flag(p, "plot", help="write predicted speedup per node count and strategy to this PNG")
    flag(p, "calibrate", action="store_true",
         help="measure this machine (GEMM rate per layer shape, memory, MPI on loopback) and "
              "write its cluster file to this host's cache, which training plans with")
    flag(p, "out", help="with --calibrate: also write the cluster file here")
    p.set_defaults(run=cmd_plan)
    return p


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
    from syncsgd.plan.cluster import cache_path
    cluster = calibrate(progress=lambda text: print(text, flush=True))
    for path in ([args.out] if args.out else []) + [cache_path()]:
        write_cluster(cluster, path)
        print(f"Wrote {path}")
    return 0
