"""Caffe's tool verbs: train, test and time, with the `caffe` tool's flags and log lines.

`train` and `test` run on every rank under mpiexec; only rank 0 logs.
"""
import argparse
import json

from syncsgd import TEST, TRAIN
from syncsgd.cli.flags import flag


def register(verbs):
    """Add train, test and time to an argparse sub-parsers object."""
    p = verbs.add_parser("train", help="train a net with a solver (under mpiexec: distributed)")
    flag(p, "solver", required=True, help="solver prototxt")
    flag(p, "weights", help="comma-separated .caffemodel(.h5) files to fine-tune from")
    flag(p, "snapshot", help=".solverstate(.h5) to resume from")
    flag(p, "iterations", type=int, help="override the solver's max_iter")
    flag(p, "timeline", help="write a Chrome trace of every rank's layer and reduction spans")
    flag(p, "sigint_effect", default="stop", choices=["stop", "snapshot", "none"])
    flag(p, "sighup_effect", default="snapshot", choices=["stop", "snapshot", "none"])
    p.set_defaults(run=cmd_train)

    p = verbs.add_parser("test", help="score a trained model on its TEST-phase data")
    flag(p, "model", required=True, help="net prototxt (TEST phase is used)")
    flag(p, "weights", required=True, help=".caffemodel or .caffemodel.h5")
    flag(p, "iterations", type=int, default=50)
    p.set_defaults(run=cmd_test)

    p = verbs.add_parser("time", help="time forward and backward of each layer")
    flag(p, "model", required=True, help="net prototxt")
    flag(p, "iterations", type=int, default=50)
    flag(p, "phase", type=_phase, default=TRAIN, help="TRAIN (default) or TEST")
    flag(p, "batch", type=int, help="replace the batch size of the net's Input layers")
    flag(p, "json", action="store_true", help="print one JSON object")
    p.set_defaults(run=cmd_time)


def _phase(text):
    try:
        return {"TRAIN": TRAIN, "TEST": TEST}[text.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError("phase must be TRAIN or TEST") from None


def _log_on_rank_zero():
    """Only rank 0 of an MPI launch logs (world() is None on one process)."""
    from syncsgd import log
    from syncsgd.parallel import world
    comm = world()
    log.configure(enabled=comm is None or comm.rank == 0)


def cmd_train(args):
    from syncsgd import log
    from syncsgd.solvers import get_solver
    if args.snapshot and args.weights:
        raise SystemExit("syncsgd train: give --snapshot (resume) or --weights (fine-tune), "
                         "not both")
    _log_on_rank_zero()
    solver = get_solver(args.solver)
    solver.signal_effects = {"SIGINT": args.sigint_effect, "SIGHUP": args.sighup_effect}
    if args.iterations is not None:
        solver.param.max_iter = args.iterations
    for path in (args.weights.split(",") if args.weights else []):
        log.info(f"Finetuning from {path}")
        solver.net.copy_from(path)
    if args.timeline:
        solver.enable_timeline(args.timeline)
    solver.solve(args.snapshot)
    solver.close()
    return 0


def cmd_test(args):
    from syncsgd.evaluate import evaluate
    _log_on_rank_zero()
    evaluate(args.model, args.weights, args.iterations)
    return 0


def cmd_time(args):
    from syncsgd.timing import time_net, timing_net
    net = timing_net(args.model, args.phase, batch=args.batch)
    if not args.json:
        print("*** Benchmark begins ***")
        print(f"Testing for {args.iterations} iterations.")
    report = time_net(net, args.iterations, progress=None if args.json else (
        lambda it, s: print(f"Iteration: {it} forward-backward time: {s * 1000:.3f} ms.")))
    if args.json:
        print(json.dumps(report))
        return 0
    print("Average time per layer:")
    width = max(len(l["name"]) for l in report["layers"])
    for layer in report["layers"]:
        print(f"{layer['name']:>{width}}\tforward: {layer['forward_ms']:.4f} ms.")
        print(f"{layer['name']:>{width}}\tbackward: {layer['backward_ms']:.4f} ms.")
    print(f"Average Forward pass: {report['forward_ms']:.4f} ms.")
    print(f"Average Backward pass: {report['backward_ms']:.4f} ms.")
    print(f"Average Forward-Backward: {report['total_ms']:.4f} ms.")
    print("*** Benchmark ends ***")
    return 0
