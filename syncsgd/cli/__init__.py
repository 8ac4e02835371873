"""The `syncsgd` command: Caffe's tool verbs, the planner and the tools around training.

Verbs: train, test, time, device_query (cli/caffe.py), plan (cli/plan.py), parse-log, plot, draw,
convert, mean, extract_features, summarize (cli/tools.py), upgrade_net_proto_text,
upgrade_net_proto_binary, upgrade_solver_proto_text (cli/upgrade.py), export (cli/export.py).

Each verb module's `register(verbs)` adds its verbs to the argparse sub-parsers, each verb setting
`run` to a function of the parsed arguments that returns the exit status. Errors a user can fix
(SyncSGDError) end in one line; under mpiexec, any failure on one rank ends the whole job.
"""
import argparse
import sys

from syncsgd.cli import caffe, export, plan, tools, upgrade
from syncsgd.errors import SyncSGDError


def build_parser():
    parser = argparse.ArgumentParser(prog="syncsgd", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for module in (caffe, plan, tools, upgrade, export):
        module.register(verbs)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    from syncsgd.parallel import abort_world
    try:
        return args.run(args)
    except SyncSGDError as e:
        message = f"syncsgd {args.verb}: error: {e}"
        abort_world(message)
        print(message, file=sys.stderr)
        return 1
    except BaseException as e:
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            import traceback
            abort_world(f"syncsgd {args.verb}: {traceback.format_exc()}")
        raise
