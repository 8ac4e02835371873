"""Convert images or an .npz archive to an HDF5 file (and its list file) for an HDF5Data layer.

    python tools/convert_hdf5.py images ROOT/ LISTFILE OUT.h5 [--resize H,W] [--gray] [--shuffle]
    python tools/convert_hdf5.py npz ARRAYS.npz OUT.h5 [--shuffle]

images: LISTFILE has one "relative/path label" per line, as for Caffe's convert_imageset. Images
are stored as "data" float32 (N, C, H, W) with values 0..255 in Caffe's BGR channel order (or one
gray channel), labels as "label" float32 (N,). Reading images needs Pillow.
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
from syncsgd.io.hdf5 import write_chunks, write_list  # noqa: E402

CHUNK = 256   # rows per write


def read_image_list(list_path):
    """[(relative path, int label)]; the label follows the last space, as in convert_imageset."""
    if not os.path.isfile(list_path):
        raise DataError(f"image list '{list_path}' not found")
    entries = []
    with open(list_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            path, _, label = line.strip().rpartition(" ")
            try:
                entries.append((path, int(label)))
            except ValueError:
                raise DataError(f"{list_path}:{n}: expected 'relative/path label', got "
                                f"'{line.strip()}'") from None
            if not path:
                raise DataError(f"{list_path}:{n}: missing image path before the label")
    if not entries:
        raise DataError(f"image list '{list_path}' lists no images")
    return entries


def image_loader(root, gray, size):
    """A function: relative path -> (C, H, W) float32 array in BGR (or gray) channel order."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading images needs Pillow: pip install Pillow "
                        "(the npz converter works without it)") from None

    def load(rel):
        path = os.path.join(root, rel)
        try:
            with Image.open(path) as img:
                img = img.convert("L" if gray else "RGB")
                if size is not None:
                    img = img.resize((size[1], size[0]), Image.BILINEAR)
                pixels = np.asarray(img, np.float32)
        except OSError as exc:
            raise DataError(f"cannot read image '{path}': {exc}") from None
        return pixels[None] if gray else pixels[:, :, ::-1].transpose(2, 0, 1)

    return load


def image_blocks(entries, load, shape):
    for start in range(0, len(entries), CHUNK):
        batch = entries[start:start + CHUNK]
        data = np.empty((len(batch),) + shape, np.float32)
        for i, (rel, _) in enumerate(batch):
            image = load(rel)
            if image.shape != shape:
                raise DataError(f"image '{rel}' has shape {image.shape}, the first one {shape}; "
                                f"pass --resize H,W to give all images one size")
            data[i] = image
        yield {"data": data, "label": np.array([label for _, label in batch], np.float32)}


def convert_images(args, order):
    entries = read_image_list(args.listfile)
    entries = [entries[i] for i in order(len(entries))]
    load = image_loader(args.root, args.gray, args.resize)
    shape = load(entries[0][0]).shape
    rows = {"data": (shape, np.float32), "label": ((), np.float32)}
    spec = {"converter": "images", "list": os.path.abspath(args.listfile), "shape": list(shape)}
    write_chunks(args.out, len(entries), rows, image_blocks(entries, load, shape), spec,
                 os.path.basename(args.out))


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
