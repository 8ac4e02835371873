"""Caffe's tool verbs: train, test, time and device_query, with the `caffe` tool's flags and log
lines.

`train` and `test` run on every rank under mpiexec; only rank 0 logs. The GPU flags of Caffe's
command lines (`-gpu 0`, `-gpu all`) are accepted and ignored: syncsgd runs on the CPU.

A scheduler ending a job (Slurm's preemption, time limit or scancel) sends SIGTERM first: `train`
then snapshots (-sigterm_effect), ends with TERMINATED_STATUS and one line naming the snapshot,
and the same command with --auto-resume continues from it when the job runs again.
"""
import argparse
import json
import os
import platform
import sys

from syncsgd import TEST, TRAIN
from syncsgd.cli.flags import flag

TERMINATED_STATUS = 143     # 128 + SIGTERM, as a shell reports a process that SIGTERM ended


def register(verbs):
    """Add train, test, time and device_query to an argparse sub-parsers object."""
    p = verbs.add_parser("train", help="train a net with a solver (under mpiexec: distributed)")
    flag(p, "solver", required=True, help="solver prototxt")
    flag(p, "weights", help="comma-separated .caffemodel(.h5) files to fine-tune from")
    flag(p, "snapshot", help=".solverstate(.h5) to resume from")
    flag(p, "auto_resume", action="store_true",
         help="resume from the newest intact snapshot of the solver's snapshot_prefix if there is "
              "one (else start, with --weights if given): the command a requeued job reruns")
    flag(p, "iterations", type=int, help="override the solver's max_iter")
    flag(p, "timeline", help="write a Chrome trace of every rank's layer and reduction spans")
    flag(p, "sigint_effect", default="stop", choices=["stop", "snapshot", "none"])
    flag(p, "sighup_effect", default="snapshot", choices=["stop", "snapshot", "none"])
    flag(p, "sigterm_effect", default="snapshot", choices=["stop", "snapshot", "none"],
         help="SIGTERM (a scheduler about to kill the job): snapshot, then end (default); stop: "
              f"end without one; either exits with status {TERMINATED_STATUS}")
    _net_state_flags(p, "the train net's")
    p.set_defaults(run=cmd_train)

    p = verbs.add_parser("test", help="score a trained model on its TEST-phase data")
    flag(p, "model", required=True, help="net prototxt (TEST phase is used)")
    flag(p, "weights", required=True, help=".caffemodel or .caffemodel.h5")
    flag(p, "iterations", type=int, default=50)
    _net_state_flags(p, "the net's")
    p.set_defaults(run=cmd_test)

    p = verbs.add_parser("time", help="time forward and backward of each layer")
    flag(p, "model", required=True, help="net prototxt")
    flag(p, "iterations", type=int, default=50)
    flag(p, "phase", type=_phase, default=TRAIN, help="TRAIN (default) or TEST")
    flag(p, "batch", type=int, help="replace the batch size of the net's Input layers")
    flag(p, "json", action="store_true", help="print one JSON object")
    _net_state_flags(p, "the net's")
    p.set_defaults(run=cmd_time)

    p = verbs.add_parser("device_query", aliases=["device-query"],
                         help="what `caffe device_query` shows: here, the CPU (there is no GPU)")
    _caffe_flags(p)
    p.set_defaults(run=cmd_device_query)


def _caffe_flags(parser):
    """The flags every verb of Caffe's tool takes: -gpu, and glog's -log_dir."""
    flag(parser, "log_dir", help="also write glog's log files in this folder (as GLOG_log_dir)")
    flag(parser, "gpu", help="accepted for Caffe's command lines (-gpu 0, -gpu all) and "
                             "ignored: syncsgd runs on the CPU")


def _net_state_flags(parser, whose):
    _caffe_flags(parser)
    flag(parser, "level", type=int, default=0, help=f"{whose} NetState level (default 0)")
    flag(parser, "stage", action="append", default=[],
         help=f"{whose} NetState stages: comma list, or the flag repeated")


def _phase(text):
    try:
        return {"TRAIN": TRAIN, "TEST": TEST}[text.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError("phase must be TRAIN or TEST") from None


def stages(args):
    """The stages of every -stage flag, comma lists split, in order (empty names dropped)."""
    return [name for value in args.stage for name in value.split(",") if name]


def _world():
    """The MPI world when run under mpiexec with more than one rank, else None."""
    from syncsgd.parallel import world
    return world()


def _start_logging(args, comm):
    """Log on rank 0 only, to stderr and, with --log_dir, to glog's files; say once that the
    GPU flag is ignored."""
    from syncsgd import log
    log.configure(enabled=comm is None or comm.rank == 0, log_dir=args.log_dir,
                  program="syncsgd")
    if args.gpu:
        log.info(f"-gpu {args.gpu}: syncsgd runs on the CPU; the flag is ignored")
    log.info("Use CPU.")


def _net_with_state(model, args):
    """The model's NetParameter with Caffe's -level and -stage set in its state, as the caffe
    tool does (the level replaces the file's, the stages are added); without those flags the
    path itself, so that errors keep naming the file."""
    from syncsgd.compile import load_net_param
    if not (args.level or args.stage):
        return model
    param, _ = load_net_param(model)
    param.state.level = args.level
    param.state.stage.extend(stages(args))
    return param


def _solver_with_state(args):
    """The solver's SolverParameter with -level and -stage in its train_state, as the caffe
    tool sets them; without those flags the path itself (net paths in it may then be read
    beside the solver file, and errors name it)."""
    from syncsgd.solvers.solver import load_solver_param
    if not (args.level or args.stage):
        return args.solver
    param, _ = load_solver_param(args.solver)
    param.train_state.level = args.level
    param.train_state.stage.extend(stages(args))
    return param


def cmd_train(args):
    from syncsgd import log
    from syncsgd.solvers import get_solver
    from syncsgd.solvers.solver import Terminated
    if args.snapshot and args.weights:
        raise SystemExit("syncsgd train: give --snapshot (resume) or --weights (fine-tune), "
                         "not both")
    if args.snapshot and args.auto_resume:
        raise SystemExit("syncsgd train: give --snapshot (this state) or --auto-resume (the "
                         "newest of snapshot_prefix), not both")
    comm = _world()
    _start_logging(args, comm)
    solver = get_solver(_solver_with_state(args))
    solver.signal_effects = {"SIGINT": args.sigint_effect, "SIGHUP": args.sighup_effect,
                             "SIGTERM": args.sigterm_effect}
    if args.iterations is not None:
        solver.param.max_iter = args.iterations
    resume = args.snapshot or (_newest_snapshot(solver) if args.auto_resume else None)
    for path in (args.weights.split(",") if args.weights and not resume else []):
        log.info(f"Finetuning from {path}")
        solver.net.copy_from(path)
    if args.timeline:
        solver.enable_timeline(args.timeline)
    log.info("Starting Optimization")
    try:
        solver.solve(resume)
    except Terminated as e:
        solver.close()
        if solver.rank == 0:
            print(f"syncsgd train: SIGTERM: training ended at iteration {e.iteration}; the "
                  f"last snapshot is {e.snapshot or 'none'}; run the same command with "
                  "--auto-resume to continue", file=sys.stderr, flush=True)
        _end_mpi(comm)
        return TERMINATED_STATUS
    solver.close()
    return 0


def _end_mpi(comm):
    """Finalize MPI now that every rank has agreed to end: under `python -m mpi4py` a non-zero
    exit status would otherwise abort the job, which launchers report as ranks killed."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if comm is not None:
        comm.watch(0)   # the watchdog says goodbye to the other ranks over MPI
    mpi.Finalize()


def _newest_snapshot(solver):
    """--auto-resume's state: the newest intact one under snapshot_prefix, or None (logged)."""
    from syncsgd import log
    state = solver.newest_snapshot()
    prefix = solver.param.snapshot_prefix
    log.info(f"--auto-resume: resuming from {state}" if state else
             f"--auto-resume: no snapshot of {prefix} to resume from; starting at iteration 0")
    return state


def cmd_test(args):
    from syncsgd.evaluate import evaluate
    _start_logging(args, _world())
    evaluate(_net_with_state(args.model, args), args.weights, args.iterations)
    return 0


def cmd_time(args):
    """Caffe's `caffe time` report in glog lines (rank 0 only), or one JSON object."""
    from syncsgd import log
    from syncsgd.timing import time_net, timing_net
    comm = _world()
    first = comm is None or comm.rank == 0
    if args.json:
        log.configure(enabled=False)
    else:
        _start_logging(args, comm)
    net = timing_net(args.model, args.phase, batch=args.batch, level=args.level,
                     stages=stages(args))
    log.info("*** Benchmark begins ***")
    log.info(f"Testing for {args.iterations} iterations.")
    report = time_net(net, args.iterations, progress=lambda it, s: log.info(
        f"Iteration: {it} forward-backward time: {log.fmt(s * 1000)} ms."))
    if args.json:
        if first:
            print(json.dumps(report))
        return 0
    log.info("Average time per layer: ")
    for layer in report["layers"]:
        log.info(f"{layer['name']:>10}\tforward: {log.fmt(layer['forward_ms'])} ms.")
        log.info(f"{layer['name']:>10}\tbackward: {log.fmt(layer['backward_ms'])} ms.")
    log.info(f"Average Forward pass: {log.fmt(report['forward_ms'])} ms.")
    log.info(f"Average Backward pass: {log.fmt(report['backward_ms'])} ms.")
    log.info(f"Average Forward-Backward: {log.fmt(report['total_ms'])} ms.")
    log.info(f"Total Time: {log.fmt(report['total_ms'] * args.iterations)} ms.")
    log.info("*** Benchmark ends ***")
    return 0


def cmd_device_query(args):
    """Caffe's CPU-only build prints "Querying GPUs" and nothing more; this says why and shows
    the CPU the nets run on. Exit status 0, with or without -gpu (Caffe's CPU-only build
    aborts on -gpu; here the flag is ignored everywhere)."""
    from syncsgd import log
    log.configure(log_dir=args.log_dir, program="syncsgd")
    log.info(f"Querying GPUs {args.gpu or ''}".rstrip())
    log.info("No GPU: syncsgd runs on the CPU (there is no CUDA device to query)")
    log.info(f"CPU: {cpu_model()}")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log.info(f"CPU cores: {os.cpu_count()} ({usable} usable by this process)")
    return 0


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
