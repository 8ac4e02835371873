"""Build a seeded synthetic classification set of any row shape, written in chunks.

Each class has its own mean row; a sample is its class mean plus unit Gaussian noise, so a net can
learn it. The class means live in a low-rank subspace (coefficients (classes, r) times a basis
(r, row)) so that even 1000 ImageNet-sized means never sit in memory.

    python data/synthetic.py --shape 3,224,224 --classes 1000 --train N --test M \
        --out data/imagenet_synth
    python data/synthetic.py --shape 440 --classes 9304 --train N --test M --out data/cddnn_synth

Writes OUT/train.h5, OUT/test.h5 (datasets "data" float32 (N, *shape), "label" float32 (N,)) and
the list files OUT/train.txt, OUT/test.txt. Skips the work when the files are already there, made
the same way, unless --force.
"""
import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from syncsgd.io.hdf5 import up_to_date, write_chunks, write_list  # noqa: E402

VERSION = 1
BASIS_ELEMENTS = 2**22     # budget of the mean basis (16 MB of float32)
MAX_RANK = 256
CHUNK_ELEMENTS = 2**24     # values generated and written at a time (64 MB of float32)
SPLITS = {"train": 0, "test": 1}


def class_means(seed, classes, row_size):
    """(coefficients (classes, r), basis (r, row_size)): class c's mean is coefficients[c] @ basis,
    with elements of unit variance."""
    rank = max(1, min(classes, row_size, MAX_RANK, BASIS_ELEMENTS // row_size))
    rng = np.random.default_rng([seed, 2])
    coefficients = rng.standard_normal((classes, rank), dtype=np.float32)
    basis = rng.standard_normal((rank, row_size), dtype=np.float32) / np.float32(np.sqrt(rank))
    return coefficients, basis


def blocks(seed, split, count, shape, classes, noise):
    """Consecutive {"data", "label"} blocks of one split; block i has its own seeded stream."""
    row_size = int(np.prod(shape))
    coefficients, basis = class_means(seed, classes, row_size)
    chunk = max(1, CHUNK_ELEMENTS // row_size)
    for i, start in enumerate(range(0, count, chunk)):
        n = min(chunk, count - start)
        rng = np.random.default_rng([seed, SPLITS[split], i])
        labels = rng.integers(classes, size=n)
        data = coefficients[labels] @ basis
        data += np.float32(noise) * rng.standard_normal((n, row_size), dtype=np.float32)
        yield {"data": data.reshape((n,) + shape), "label": labels.astype(np.float32)}


def build(out, shape, classes, counts, seed=1, noise=1.0, force=False):
    """Write the splits with a non-zero count into `out` unless already there, made the same way."""
    paths = {split: os.path.join(out, f"{split}.h5") for split, n in counts.items() if n > 0}
    lists = {os.path.join(out, f"{split}.txt"): [path] for split, path in paths.items()}
    specs = {path: {"builder": "synthetic", "version": VERSION, "shape": list(shape),
                    "classes": classes, "count": counts[split], "seed": seed, "noise": noise,
                    "split": split}
             for split, path in paths.items()}
    if not force and up_to_date(specs, lists):
        print(f"synthetic: {out} is up to date (use --force to rebuild)")
        return paths
    for split, path in paths.items():
        rows = {"data": (shape, np.float32), "label": ((), np.float32)}
        write_chunks(path, counts[split], rows,
                     blocks(seed, split, counts[split], shape, classes, noise),
                     specs[path], f"synthetic {split}")
        print(f"synthetic: wrote {path} ({counts[split]} rows of shape {shape})")
    for list_path, h5_paths in lists.items():
        write_list(list_path, h5_paths)
    return paths


def parse_shape(text):
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape wants positive integers like 3,224,224, "
                                         f"got '{text}'")
    return shape


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=parse_shape, required=True,
                        help="row shape, e.g. 3,224,224 or 440")
    parser.add_argument("--classes", type=int, required=True)
    parser.add_argument("--train", type=int, default=1000, help="training rows")
    parser.add_argument("--test", type=int, default=100, help="test rows (0: no test set)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--noise", type=float, default=1.0,
                        help="noise standard deviation (class means have unit variance)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if args.classes < 1 or args.train < 1 or args.test < 0:
        parser.error("--classes and --train must be >= 1, --test >= 0")
    build(args.out, args.shape, args.classes, {"train": args.train, "test": args.test},
          args.seed, args.noise, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
