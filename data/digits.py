"""Build a LeNet-shaped handwritten digits set from scikit-learn's bundled copy (no download).

scikit-learn ships 1797 8x8 digits with values 0..16. Each is scaled to [0, 1], upsampled
bilinearly to 20x20 and centred in a 28x28 field (MNIST puts its digits in a 20x20 box), then the
set is split with a fixed seed into train and test. `--augment K` adds K randomly rotated and
shifted copies of every training image.

Writes OUT/train.h5 and OUT/test.h5 (datasets "data" float32 (N, 1, 28, 28) and "label" float32
(N,)) and the list files OUT/train.txt and OUT/test.txt for an HDF5Data layer. Run from the
repository root: `python data/digits.py [--out data/digits] [--augment K] [--force]`.
"""
import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from syncsgd.io.hdf5 import up_to_date, write_arrays, write_list  # noqa: E402

VERSION = 1            # bump when the images this script makes change
BOX, FIELD = 20, 28    # MNIST's digit box and image size
MAX_ANGLE = np.deg2rad(12.0)
MAX_SHIFT = 2.0        # pixels


def resize_matrix(size_in, size_out):
    """(size_out, size_in) bilinear interpolation weights, pixel centres aligned."""
    source = np.clip((np.arange(size_out) + 0.5) * size_in / size_out - 0.5, 0, size_in - 1)
    low = np.floor(source).astype(int)
    high = np.minimum(low + 1, size_in - 1)
    frac = source - low
    weights = np.zeros((size_out, size_in))
    np.add.at(weights, (np.arange(size_out), low), 1 - frac)
    np.add.at(weights, (np.arange(size_out), high), frac)
    return weights


def lenet_images(images):
    """(N, 8, 8) values 0..16 -> (N, 1, 28, 28) float32 in [0, 1], digit in the central 20x20."""
    grow = resize_matrix(images.shape[-1], BOX)
    boxed = grow @ (images / 16.0) @ grow.T
    pad = (FIELD - BOX) // 2
    field = np.pad(boxed, ((0, 0), (pad, pad), (pad, pad)))
    return field[:, None].astype(np.float32)


def warp(images, angles, shifts):
    """Rotate each (N, 1, H, W) image by angles[i] radians about its centre and shift it by
    shifts[i] = (dy, dx) pixels, sampling bilinearly with zeros outside."""
    n, _, h, w = images.shape
    padded = np.pad(images[:, 0], ((0, 0), (1, 1), (1, 1)))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    cos = np.cos(angles)[:, None, None]
    sin = np.sin(angles)[:, None, None]
    dy = yy - cy - shifts[:, 0, None, None]
    dx = xx - cx - shifts[:, 1, None, None]
    # source coordinates in the zero-padded image (inverse rotation), kept inside it
    sy = np.clip(cos * dy + sin * dx + cy + 1, 0, h + 1)
    sx = np.clip(-sin * dy + cos * dx + cx + 1, 0, w + 1)
    y0 = np.minimum(np.floor(sy).astype(int), h)
    x0 = np.minimum(np.floor(sx).astype(int), w)
    fy, fx = sy - y0, sx - x0
    i = np.arange(n)[:, None, None]
    out = ((1 - fy) * (1 - fx) * padded[i, y0, x0] + (1 - fy) * fx * padded[i, y0, x0 + 1]
           + fy * (1 - fx) * padded[i, y0 + 1, x0] + fy * fx * padded[i, y0 + 1, x0 + 1])
    return out[:, None].astype(np.float32)


def augmented(images, labels, copies, rng):
    """The originals followed by `copies` randomly rotated and shifted versions of each."""
    if not copies:
        return images, labels
    base = np.repeat(images, copies, axis=0)
    angles = rng.uniform(-MAX_ANGLE, MAX_ANGLE, len(base))
    shifts = rng.uniform(-MAX_SHIFT, MAX_SHIFT, (len(base), 2))
    return (np.concatenate([images, warp(base, angles, shifts)]),
            np.concatenate([labels, np.repeat(labels, copies)]))


def build(out, augment=0, seed=1, test_count=300, force=False):
    """Write the set into `out` unless it is already there, made the same way."""
    paths = {split: os.path.join(out, f"{split}.h5") for split in ("train", "test")}
    lists = {os.path.join(out, f"{split}.txt"): [path] for split, path in paths.items()}
    common = {"builder": "digits", "version": VERSION, "seed": seed, "test_count": test_count}
    specs = {paths["train"]: dict(common, split="train", augment=augment),
             paths["test"]: dict(common, split="test")}
    if not force and up_to_date(specs, lists):
        print(f"digits: {out} is up to date (use --force to rebuild)")
        return paths

    from sklearn.datasets import load_digits
    digits = load_digits()
    images = lenet_images(digits.images)
    labels = digits.target.astype(np.float32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images))
    test, train = order[:test_count], order[test_count:]
    train_x, train_y = augmented(images[train], labels[train], augment, rng)
    shuffle = rng.permutation(len(train_x))
    split_data = {"train": (train_x[shuffle], train_y[shuffle]),
                  "test": (images[test], labels[test])}
    for split, (x, y) in split_data.items():
        write_arrays(paths[split], {"data": x, "label": y}, specs[paths[split]], f"digits {split}")
        print(f"digits: wrote {paths[split]} ({len(x)} images)")
    for list_path, h5_paths in lists.items():
        write_list(list_path, h5_paths)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "data", "digits"),
                        help="output directory (default: data/digits in the repository)")
    parser.add_argument("--augment", type=int, default=0, metavar="K",
                        help="add K rotated/shifted copies of each training image")
    parser.add_argument("--seed", type=int, default=1, help="seed of the split and augmentation")
    parser.add_argument("--test-count", type=int, default=300, help="images held out for test")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if args.augment < 0 or not 0 < args.test_count < 1797:
        parser.error("--augment must be >= 0 and --test-count between 1 and 1796")
    build(args.out, args.augment, args.seed, args.test_count, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
