"""Handwritten digits for the example scripts: scikit-learn's 8x8 digits drawn as MNIST draws
its digits (a 20x20 box centred in 28x28, white on black, values in [0, 1])."""
import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def mnist_like(first=0, count=None):
    """(images (N, 28, 28) float32 in [0, 1], labels (N,))."""
    digits = load_digits()
    end = None if count is None else first + count
    images, labels = digits.images[first:end], digits.target[first:end]
    out = np.zeros((len(images), 28, 28), np.float32)
    for i, image in enumerate(images):
        pixels = Image.fromarray((image / 16.0 * 255).astype(np.uint8))
        out[i, 4:24, 4:24] = np.asarray(pixels.resize((20, 20), Image.BILINEAR)) / 255.0
    return out, labels.astype(np.float32)


def write_png_files(images, prefix="digit"):
    names = []
    for i, image in enumerate(images):
        name = f"{prefix}_{i}.png"
        Image.fromarray((image * 255).round().astype(np.uint8)).save(name)
        names.append(name)
    return names


def write_hdf5(path, images, labels):
    """An HDF5Data source: the .h5 file and the list file naming it (path + '.txt')."""
    import h5py
    with h5py.File(path, "w") as f:
        f["data"] = images[:, None].astype(np.float32)
        f["label"] = labels.astype(np.float32)
    with open(path + ".txt", "w") as f:
        f.write(path + "\n")
    return path + ".txt"
