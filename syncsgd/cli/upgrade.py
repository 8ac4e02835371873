"""Caffe's upgrade tools: upgrade_net_proto_text, upgrade_net_proto_binary and
upgrade_solver_proto_text rewrite legacy files in the current format, which Caffe reads.

The net upgrades are the ones every Net applies when it reads a file (syncsgd.compile:
V0 and V1 `layers`, data-layer transforms, `input` fields); the solver upgrade turns the legacy
`solver_type` enum into the `type` string. As Caffe's tools do, a file already current is
written unchanged with an error line saying so, and a file that does not parse gives exit
status 2.
"""
from google.protobuf import text_format

from syncsgd.errors import PrototxtError, SyncSGDError
from syncsgd.proto import pb


def register(verbs):
    """Add the three upgrade verbs to an argparse sub-parsers object."""
    for name, run, what in (
            ("upgrade_net_proto_text", cmd_upgrade_net_text, "net prototxt"),
            ("upgrade_net_proto_binary", cmd_upgrade_net_binary, "binary net (.caffemodel)"),
            ("upgrade_solver_proto_text", cmd_upgrade_solver_text, "solver prototxt")):
        p = verbs.add_parser(name, aliases=[name.replace("_", "-")],
                             help=f"rewrite a legacy {what} in the current format")
        p.add_argument("input", metavar="IN", help=f"legacy {what}")
        p.add_argument("output", metavar="OUT", help=f"where to write the current {what}")
        p.set_defaults(run=run)


def upgraded_net(param, source):
    """(a copy of `param` upgraded as a Net would, whether anything changed)."""
    from syncsgd.compile import upgrade_net
    new = pb.NetParameter()
    new.CopyFrom(param)
    upgrade_net(new, source)
    return new, new != param


def upgraded_solver(param, source):
    """(a copy of the SolverParameter with `type` for `solver_type` and its embedded nets
    upgraded, whether anything changed)."""
    from syncsgd.solvers.registry import solver_class
    new = pb.SolverParameter()
    new.CopyFrom(param)
    if new.HasField("solver_type"):
        legacy = solver_class(_without(new, "type"), source).type
        if new.HasField("type") and new.type != legacy:
            enum = pb.SolverParameter.SolverType.Name(new.solver_type)
            raise SyncSGDError(f"{source}: solver_type {enum} and type '{new.type}' disagree; "
                               "keep one of them")
        new.type = legacy
        new.ClearField("solver_type")
    for name in ("net_param", "train_net_param"):
        if new.HasField(name):
            getattr(new, name).CopyFrom(upgraded_net(getattr(new, name), source)[0])
    for net in new.test_net_param:
        net.CopyFrom(upgraded_net(net, source)[0])
    return new, new != param


def _without(param, field):
    copy = type(param)()
    copy.CopyFrom(param)
    copy.ClearField(field)
    return copy


def _upgrade(args, message, upgrade, binary=False):
    from syncsgd import log
    from syncsgd.compile import read_text
    from syncsgd.proto.files import read_binary
    log.configure()
    kind = "binary" if binary else "text"
    try:
        param = (read_binary if binary else read_text)(args.input, message)
    except PrototxtError as e:
        log.error(f"Failed to parse input {kind} file as {message.DESCRIPTOR.name}: {e}")
        return 2
    new, changed = upgrade(param, args.input)
    if not changed:
        log.error(f"File already in latest proto format: {args.input}")
    with open(args.output, "wb" if binary else "w") as f:
        f.write(new.SerializeToString() if binary else text_format.MessageToString(new))
    log.info(f"Wrote upgraded {message.DESCRIPTOR.name} {kind} proto to {args.output}")
    return 0


def cmd_upgrade_net_text(args):
    return _upgrade(args, pb.NetParameter(), upgraded_net)


def cmd_upgrade_net_binary(args):
    return _upgrade(args, pb.NetParameter(), upgraded_net, binary=True)


def cmd_upgrade_solver_text(args):
    return _upgrade(args, pb.SolverParameter(), upgraded_solver)
