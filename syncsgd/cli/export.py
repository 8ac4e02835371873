"""The `export` verb: a trained deploy net as an ONNX model (syncsgd/onnx), optionally checked
against syncsgd's forward in ONNX Runtime."""
from syncsgd.cli.flags import flag
from syncsgd.errors import SyncSGDError


def register(verbs):
    """Add `export` to an argparse sub-parsers object."""
    p = verbs.add_parser("export", help="a deploy net and its weights as an ONNX model")
    flag(p, "model", required=True, help="deploy prototxt (TEST phase), with Input layers")
    flag(p, "weights", help=".caffemodel or .caffemodel.h5 (default: the fillers' weights)")
    flag(p, "out", required=True, help="ONNX file to write")
    flag(p, "opset", type=int, help="ONNX opset (default 17)")
    flag(p, "batch", help="first dimension of the inputs: a number, or a name for a dynamic "
                          "one (default: the prototxt's)")
    flag(p, "until", metavar="LAYER", help="export only the layers before LAYER")
    flag(p, "check", action="store_true",
         help="run the model in ONNX Runtime and syncsgd on the same random input and "
              "compare the outputs")
    p.set_defaults(run=cmd_export)


def cmd_export(args):
    from syncsgd import TEST, log
    from syncsgd.compile import load_net_param, upgrade_net
    from syncsgd.net import Net
    from syncsgd.onnx import TOLERANCE, check, export, refuse_data_layers
    log.configure(enabled=False)
    param, source = load_net_param(args.model)
    upgrade_net(param, source)
    refuse_data_layers(param, source)          # any phase's, before the net opens a data source
    net = Net(args.model, TEST, weights=args.weights)
    batch = args.batch
    if batch is not None and batch.isdigit():
        batch = int(batch)
    model = export(net, args.out, args.opset, batch, args.until)
    outputs = ", ".join(o.name for o in model.graph.output)
    print(f"wrote {args.out} (opset {model.opset_import[0].version}; inputs "
          f"{', '.join(i.name for i in model.graph.input)}; outputs {outputs})")
    if not args.check:
        return 0
    failed = []
    for name, (error, scale) in check(net, args.out, args.until).items():
        print(f"output {name}: max |onnxruntime - syncsgd| {error:.3g}, max |syncsgd| "
              f"{scale:.3g}")
        if error > TOLERANCE * scale:
            failed.append(name)
    if failed:
        raise SyncSGDError(f"ONNX Runtime differs from syncsgd by more than {TOLERANCE:g} of "
                           f"the output's scale on {', '.join(failed)}")
    return 0
