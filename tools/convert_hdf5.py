"""Convert images or an .npz archive to an HDF5 file (and its list file) for an HDF5Data layer.

    python tools/convert_hdf5.py images ROOT/ LISTFILE OUT.h5 [--resize H,W] [--gray] [--shuffle]
    python tools/convert_hdf5.py npz ARRAYS.npz OUT.h5 [--shuffle]

images: LISTFILE has one "relative/path label" per line, as for Caffe's convert_imageset (the
same converter as `syncsgd convert --backend hdf5`). Images are stored as "data" float32
(N, C, H, W) with values 0..255 in Caffe's BGR channel order (or one gray channel), labels as
"label" float32 (N,). Reading images needs Pillow.
npz: every array of the archive becomes the dataset of the same name, as float32; all must have
the same number of rows.

The list file (OUT with .txt, or --list) names OUT. Rows are written in chunks under a temporary
name and renamed into place at the end.
"""
import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from syncsgd.errors import DataError, SyncSGDError  # noqa: E402
from syncsgd.io.convert import convert_imageset  # noqa: E402
from syncsgd.io.hdf5 import write_chunks, write_list  # noqa: E402

CHUNK = 256   # rows per write


def convert_images(args, order):
    convert_imageset(args.root, args.listfile, args.out, "hdf5", args.gray, args.resize,
                     args.shuffle, args.seed)


def convert_npz(args, order):
    if not os.path.isfile(args.npz):
        raise DataError(f"npz file '{args.npz}' not found")
    with np.load(args.npz) as archive:
        arrays = {name: archive[name] for name in archive.files}
    if not arrays:
        raise DataError(f"npz file '{args.npz}' holds no arrays")
    counts = {name: len(a) if a.ndim else 0 for name, a in arrays.items()}
    for name, a in arrays.items():
        if a.dtype.kind not in "biuf":
            raise DataError(f"npz array '{name}' has non-numeric type {a.dtype}; store numbers")
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise DataError(f"npz arrays must have the same, non-zero number of rows; got {counts}")
    count = next(iter(counts.values()))
    perm = order(count)
    rows = {name: (a.shape[1:], np.float32) for name, a in arrays.items()}
    blocks = ({name: a[perm[i:i + CHUNK]].astype(np.float32) for name, a in arrays.items()}
              for i in range(0, count, CHUNK))
    spec = {"converter": "npz", "source": os.path.abspath(args.npz)}
    write_chunks(args.out, count, rows, blocks, spec, os.path.basename(args.out))


def parse_size(text):
    try:
        size = tuple(int(d) for d in text.split(","))
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise argparse.ArgumentTypeError(f"--resize wants H,W like 224,224, got '{text}'")
    return size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    images = kinds.add_parser("images", help="image folder + 'relative/path label' list")
    images.add_argument("root", help="folder the list's paths are relative to")
    images.add_argument("listfile")
    images.add_argument("out", help="output .h5")
    images.add_argument("--resize", type=parse_size, metavar="H,W", help="resize every image")
    images.add_argument("--gray", action="store_true", help="store one gray channel")
    npz = kinds.add_parser("npz", help="arrays of an .npz archive")
    npz.add_argument("npz")
    npz.add_argument("out", help="output .h5")
    for sub in (images, npz):
        sub.add_argument("--shuffle", action="store_true", help="shuffle the rows (seeded)")
        sub.add_argument("--seed", type=int, default=1, help="seed of --shuffle")
        sub.add_argument("--list", help="list file to write (default: OUT with .txt)")
    args = parser.parse_args(argv)

    def order(n):
        return np.random.default_rng(args.seed).permutation(n) if args.shuffle else np.arange(n)

    try:
        (convert_images if args.kind == "images" else convert_npz)(args, order)
    except SyncSGDError as exc:
        print(f"convert_hdf5: error: {exc}", file=sys.stderr)
        return 1
    list_path = args.list or os.path.splitext(args.out)[0] + ".txt"
    write_list(list_path, [args.out])
    print(f"convert_hdf5: wrote {args.out} and {list_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
