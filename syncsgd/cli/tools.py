"""The verbs around training: parse-log, plot, draw, convert, mean, extract_features and
summarize.

They stand in for Caffe's tools/extra/parse_log.py, tools/extra/plot_training_log.py,
python/draw_net.py, convert_imageset, compute_image_mean, extract_features and
tools/extra/summarize.py, with their positional arguments, so a Caffe workflow needs no second
tool.
"""
import argparse
import os
import sys

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

    from syncsgd.plot import chart_help
    p = verbs.add_parser(
        "plot", help="curves of training logs: `plot CHART_TYPE OUT.png LOG...` as Caffe's "
                     "plot_training_log.py, or `plot LOG... --out OUT` for three panels",
        epilog="chart types:\n" + chart_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", metavar="ARG",
                   help="CHART_TYPE OUT LOG... (Caffe's order), or LOG... with --out")
    flag(p, "out", help="picture of the three panels: training loss, test accuracy, test "
                        "loss (.png, .svg, .pdf)")
    flag(p, "xaxis", choices=["iters", "seconds"], default="iters",
         help="iterations (default) or seconds since the start")
    flag(p, "labels", help="comma-separated names of the runs (default: file names)")
    p.set_defaults(run=cmd_plot)

    p = verbs.add_parser("draw", help="picture of a net's layer graph: `draw NET.prototxt "
                                      "OUT.png` as Caffe's draw_net.py, or --model/--out")
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="INPUT_NET_PROTO_FILE OUTPUT_IMAGE_FILE (instead of --model, --out)")
    flag(p, "model", help="net prototxt")
    flag(p, "out", help="picture to write (.png, .svg, .pdf, or .raw for Graphviz's text)")
    flag(p, "rankdir", default="LR", choices=["LR", "TB", "BT", "RL"],
         help="direction of the data flow (default LR)")
    flag(p, "phase", default="ALL", help="TRAIN, TEST or ALL (default: every layer)")
    flag(p, "display_lrm", action="store_true",
         help="show the learning-rate multipliers of convolutions and inner products")
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

    p = verbs.add_parser("extract_features", aliases=["extract-features"],
                         help="blobs of a trained net over its data, to LMDB or HDF5 (Caffe's "
                              "extract_features)")
    p.add_argument("weights", metavar="PRETRAINED_NET_PARAM", help=".caffemodel(.h5)")
    p.add_argument("model", metavar="FEATURE_EXTRACTION_PROTO", help="net prototxt (TEST "
                                                                     "phase) with a data layer")
    p.add_argument("blobs", metavar="BLOB_NAMES", help="blob names, comma-separated")
    p.add_argument("dbs", metavar="DB_NAMES", help="one output per blob, comma-separated")
    p.add_argument("batches", metavar="NUM_MINI_BATCHES", type=int, help="batches to run")
    p.add_argument("db_type", metavar="DB_TYPE", help="lmdb (Datum records, as Caffe writes "
                                                      "them) or hdf5")
    p.add_argument("device", metavar="CPU|GPU", nargs="*",
                   help="Caffe's optional device arguments, ignored: syncsgd runs on the CPU")
    p.set_defaults(run=cmd_extract_features)

    p = verbs.add_parser("summarize", help="one table row per layer: type, params, bottoms -> "
                                           "tops, kernel (Caffe's tools/extra/summarize.py)")
    p.add_argument("filename", metavar="NET", help="net prototxt to summarize")
    flag(p, "max_width", type=int, default=30, help="maximum column width (default 30)")
    flag(p, "color", choices=["auto", "always", "never"], default="auto",
         help="ANSI colours of the blobs (default: when printing to a terminal)")
    p.set_defaults(run=cmd_summarize)


def cmd_parse_log(args):
    from syncsgd.logs import parse_log, write_tables
    log = parse_log(args.logfile_path)
    written = write_tables(log, args.output_dir, delimiter=args.delimiter)
    if args.verbose or not written:
        print("\n".join(f"wrote {path}" for path in written) or
              f"no training or test output in '{args.logfile_path}'; nothing written")
    return 0


def cmd_plot(args):
    from syncsgd.plot import chart_help, plot_chart, plot_logs
    labels = args.labels.split(",") if args.labels else None
    if args.out:
        print(f"wrote {plot_logs(args.logs, args.out, args.xaxis, labels)}")
        return 0
    if len(args.logs) < 3 or not args.logs[0].isdigit():
        raise SyncSGDError("plot: give CHART_TYPE OUT.png LOG... (chart types below), or "
                           "LOG... --out OUT\n" + chart_help())
    chart_type, out, logs = int(args.logs[0]), args.logs[1], args.logs[2:]
    print(f"wrote {plot_chart(chart_type, out, logs, labels)}")
    return 0


def cmd_draw(args):
    from syncsgd.draw import draw_net_to_file, phase_value
    if args.files and (args.model or args.out) or len(args.files) not in (0, 2):
        raise SyncSGDError("draw: give INPUT_NET_PROTO_FILE OUTPUT_IMAGE_FILE, or --model and "
                           "--out")
    model, out = args.files or (args.model, args.out)
    if not model or not out:
        raise SyncSGDError("draw: give INPUT_NET_PROTO_FILE OUTPUT_IMAGE_FILE, or --model and "
                           "--out")
    print(f"Drawing net to {out}")
    engine = draw_net_to_file(model, out, args.rankdir, phase_value(args.phase),
                              args.display_lrm, args.engine)
    print(f"wrote {out} ({engine})")
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


def cmd_extract_features(args):
    """Caffe's extract_features: run the TEST net NUM_MINI_BATCHES times and store each
    named blob, one record per sample: LMDB keys are the sample index as ten digits and values
    Datums with float_data, as Caffe writes them; HDF5 files hold a float32 dataset named
    after the blob. The databases are written once all batches have run, because each is built
    whole and then moved into place."""
    import numpy as np

    from syncsgd import TEST, log
    from syncsgd.net import Net
    blobs, dbs = args.blobs.split(","), args.dbs.split(",")
    if len(blobs) != len(dbs):
        raise SyncSGDError(f"extract_features: {len(blobs)} blob names but {len(dbs)} database "
                           "names; give one database per blob")
    kind = args.db_type.lower()
    if kind not in ("lmdb", "hdf5"):
        raise SyncSGDError(f"extract_features: DB_TYPE '{args.db_type}' is not supported; use "
                           "lmdb or hdf5" + (" (LevelDB is not supported)" if kind == "leveldb"
                                             else ""))
    for path in dbs:
        if os.path.exists(path):
            raise SyncSGDError(f"extract_features: '{path}' already exists; remove it or "
                               "choose another name")
    log.configure()
    if args.device and args.device[0].upper() == "GPU":
        log.info(f"{' '.join(args.device)}: syncsgd runs on the CPU; ignored")
    net = Net(args.model, TEST, weights=args.weights)
    for name in blobs:
        if name not in net.blobs:
            raise SyncSGDError(f"extract_features: unknown feature blob name {name} in the "
                               f"network {args.model}")
    log.info("Extracting Features")
    batches = {name: [] for name in blobs}
    for batch in range(args.batches):
        net.ctx.iteration = batch          # data layers that draw (DummyData) draw anew
        net.forward()
        for name in blobs:
            batches[name].append(net.blobs[name].data.copy())
    for name, path in zip(blobs, dbs):
        features = np.concatenate(batches[name]) if batches[name] else np.zeros((0,))
        if kind == "lmdb":
            from syncsgd.io.lmdb import write_lmdb
            write_lmdb(path, _datum_records(features))
        else:
            import h5py
            with h5py.File(path, "w") as f:
                f.create_dataset(name, data=features.astype(np.float32))
        log.info(f"Extracted features of {len(features)} query images for feature blob {name}")
    net.close()
    log.info("Successfully extracted the features!")
    return 0


def _datum_records(features):
    """(key, serialized Datum) per sample of an (N, ...) array; a Datum's channels, height and
    width are the blob's legacy axes 1-3 (1 where the blob has fewer)."""
    from syncsgd.proto import pb
    shape = list(features.shape[1:4]) + [1] * (4 - min(features.ndim, 4))
    for n, sample in enumerate(features):
        datum = pb.Datum(channels=shape[0], height=shape[1], width=shape[2])
        datum.float_data.extend(sample.ravel().tolist())
        yield f"{n:010d}".encode(), datum.SerializeToString()


def cmd_summarize(args):
    from syncsgd.summarize import format_table, summarize_net
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    for line in format_table(summarize_net(args.filename), args.max_width, color):
        print(line)
    return 0
