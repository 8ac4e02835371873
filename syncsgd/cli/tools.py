"""The verbs around training: parse-log, plot, draw, convert and mean.

They stand in for Caffe's tools/extra/parse_log.py, tools/extra/plot_training_log.py,
python/draw_net.py, convert_imageset and compute_image_mean, so a Caffe workflow needs no
second tool.
"""
from syncsgd.cli.flags import flag
from syncsgd.errors import SyncSGDError


def register(verbs):
    """Add the verbs to an argparse sub-parsers object."""
    p = verbs.add_parser("parse-log", help="a training log -> LOG.train and LOG.test CSV tables")
    p.add_argument("logfile_path", metavar="LOG", help="syncsgd or Caffe training log")
    p.add_argument("output_dir", metavar="OUTDIR", help="folder for LOG.train and LOG.test")
    flag(p, "delimiter", default=",", help="column separator (default ,)")
    flag(p, "verbose", action="store_true", help="say what was written")
    p.set_defaults(run=cmd_parse_log)

    p = verbs.add_parser("plot", help="training loss, test accuracy and test loss of logs")
    p.add_argument("logs", nargs="+", metavar="LOG", help="syncsgd or Caffe training logs")
    flag(p, "out", required=True, help="picture to write (.png, .svg, .pdf)")
    flag(p, "xaxis", choices=["iters", "seconds"], default="iters",
         help="iterations (default) or seconds since the start")
    flag(p, "labels", help="comma-separated names of the runs (default: file names)")
    p.set_defaults(run=cmd_plot)

    p = verbs.add_parser("draw", help="picture of a net's layer graph")
    flag(p, "model", required=True, help="net prototxt")
    flag(p, "out", required=True, help="picture to write (.png, .svg, .pdf)")
    flag(p, "rankdir", default="LR", choices=["LR", "TB", "BT", "RL"],
         help="direction of the data flow (default LR)")
    flag(p, "phase", default="ALL", help="TRAIN, TEST or ALL (default: every layer)")
    flag(p, "engine", default="auto", choices=["auto", "graphviz", "matplotlib"],
         help="renderer (default: Graphviz when installed, else matplotlib)")
    p.set_defaults(run=cmd_draw)

    p = verbs.add_parser("convert", help="image folder + 'path label' list -> LMDB or HDF5")
    p.add_argument("root", metavar="ROOTFOLDER", help="folder the list's paths are relative to")
    p.add_argument("listfile", metavar="LISTFILE", help="one 'relative/path label' per line")
    p.add_argument("out", metavar="DB_NAME", help="LMDB folder, or .h5 file (HDF5)")
    flag(p, "backend", choices=["lmdb", "hdf5"],
         help="output kind (default: hdf5 when DB_NAME ends in .h5, else lmdb)")
    flag(p, "gray", action="store_true", help="store one gray channel")
    flag(p, "shuffle", action="store_true", help="shuffle the images (seeded)")
    flag(p, "seed", type=int, default=1, help="seed of --shuffle (default 1)")
    flag(p, "resize_height", type=int, default=0, help="resize every image (with width)")
    flag(p, "resize_width", type=int, default=0, help="resize every image (with height)")
    flag(p, "check_size", action="store_true", help="require one size for all images")
    flag(p, "encoded", action="store_true", help="store encoded images (LMDB)")
    flag(p, "encode_type", default="", help="png or jpg (implies --encoded; default: as "
                                            "the file)")
    p.set_defaults(run=cmd_convert)

    p = verbs.add_parser("mean", help="mean image of a data set -> .binaryproto")
    p.add_argument("input", metavar="INPUT_DB", help="LMDB folder or HDF5 list file")
    p.add_argument("output", metavar="OUTPUT_FILE", nargs="?",
                   help=".binaryproto to write (a transform_param mean_file)")
    flag(p, "dataset", default="data", help="HDF5 dataset to average (default data)")
    p.set_defaults(run=cmd_mean)


def cmd_parse_log(args):
    from syncsgd.logs import parse_log, write_tables
    log = parse_log(args.logfile_path)
    written = write_tables(log, args.output_dir, delimiter=args.delimiter)
    if args.verbose or not written:
        print("\n".join(f"wrote {path}" for path in written) or
              f"no training or test output in '{args.logfile_path}'; nothing written")
    return 0


def cmd_plot(args):
    from syncsgd.plot import plot_logs
    labels = args.labels.split(",") if args.labels else None
    print(f"wrote {plot_logs(args.logs, args.out, args.xaxis, labels)}")
    return 0


def cmd_draw(args):
    from syncsgd.draw import draw_net, phase_value
    engine = draw_net(args.model, args.out, args.rankdir, phase_value(args.phase), args.engine)
    print(f"wrote {args.out} ({engine})")
    return 0


def cmd_convert(args):
    from syncsgd.io.convert import convert_imageset
    if (args.resize_height > 0) != (args.resize_width > 0):
        raise SyncSGDError("give both --resize_height and --resize_width (or neither)")
    size = (args.resize_height, args.resize_width) if args.resize_height > 0 else None
    backend = args.backend or ("hdf5" if args.out.endswith((".h5", ".hdf5")) else "lmdb")
    count = convert_imageset(args.root, args.listfile, args.out, backend, args.gray, size,
                             args.shuffle, args.seed, args.encoded, args.encode_type,
                             args.check_size)
    print(f"wrote {count} images to {args.out} ({backend})")
    return 0


def cmd_mean(args):
    from syncsgd.io.convert import compute_mean
    from syncsgd.io.mean import save_mean
    mean = compute_mean(args.input, args.dataset)
    if args.output:
        save_mean(args.output, mean)
        print(f"wrote {args.output} (shape {mean.shape})")
    channels = mean.reshape(mean.shape[0], -1).mean(axis=1) if mean.ndim > 1 else mean
    for c, value in enumerate(channels.tolist()):
        print(f"mean_value channel [{c}]: {value:g}")
    return 0
