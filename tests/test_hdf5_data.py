"""HDF5Data layer and the HDF5 data path: batch order, rank slicing, shuffle, transforms,
prefetch, errors, and the dataset builders."""
import gc
import importlib.util
import os
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from syncsgd import TEST, TRAIN
from syncsgd.blob import Blob
from syncsgd.errors import DataError, PrototxtError
from syncsgd.io import hdf5 as h5io
from syncsgd.io.mean import load_mean, save_mean
from syncsgd.io.prefetch import Prefetcher
from syncsgd.layers.hdf5_data import BatchReader
from tests.gradcheck import make_layer

REPO = Path(__file__).resolve().parents[1]
SEED = 1701


# -- helpers ------------------------------------------------------------------------------------

def write_h5(path, **arrays):
    with h5py.File(path, "w") as f:
        for name, array in arrays.items():
            f[name] = array
    return str(path)


def write_list(path, entries):
    Path(path).write_text("".join(f"{e}\n" for e in entries))
    return str(path)


def numbered_source(tmp_path, sizes, row_shape=(2, 3)):
    """Files holding consecutive global rows: label = global row, data = row + pattern."""
    paths, start = [], 0
    pattern = np.arange(np.prod(row_shape), dtype=np.float32).reshape(row_shape) / 100
    for i, n in enumerate(sizes):
        rows = np.arange(start, start + n, dtype=np.float32)
        data = rows.reshape((n,) + (1,) * len(row_shape)) + pattern
        paths.append(write_h5(tmp_path / f"part{i}.h5", data=data, label=rows))
        start += n
    return write_list(tmp_path / "list.txt", paths)


def layer_text(source, batch, shuffle=False, transform="", tops=("data", "label")):
    top_lines = " ".join(f'top: "{t}"' for t in tops)
    return (f'name: "src" type: "HDF5Data" {top_lines} '
            f'hdf5_data_param {{ source: "{source}" batch_size: {batch} '
            f'shuffle: {"true" if shuffle else "false"} }} {transform}')


@pytest.fixture
def open_layer(layer_factory):
    """Factory for set-up HDF5Data layers (rank r of size s); all are closed at the end."""

    def make(source, batch, shuffle=False, transform="", rank=0, size=1, phase=TRAIN, seed=SEED,
             tops=("data", "label")):
        return layer_factory(layer_text(source, batch, shuffle, transform, tops), rank, size,
                             phase, seed, tops)
    return make


def batches(layer, top, n):
    """The tops' arrays of the next n forward passes."""
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append([b.data.copy() for b in top])
    return out


# -- batch order --------------------------------------------------------------------------------

def test_batches_follow_rows_and_wrap_across_files(tmp_path, open_layer):
    source = numbered_source(tmp_path, [5, 3, 4])
    layer, top = open_layer(source, 5)
    assert top[0].shape == (5, 2, 3) and top[1].shape == (5,)
    for k, (data, label) in enumerate(batches(layer, top, 6)):
        expected = (k * 5 + np.arange(5)) % 12
        np.testing.assert_array_equal(label, expected)
        np.testing.assert_array_equal(data[:, 0, 0], expected)
        np.testing.assert_allclose(data[:, 1, 2], expected + 0.05, rtol=1e-6)


def test_batch_larger_than_data_repeats_rows(tmp_path, open_layer):
    source = numbered_source(tmp_path, [2, 1])
    layer, top = open_layer(source, 7)
    (_, label), = batches(layer, top, 1)
    np.testing.assert_array_equal(label, np.arange(7) % 3)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch,size", [(7, 3), (8, 2), (3, 3)])
def test_rank_slices_concatenate_to_one_process_batch(tmp_path, open_layer, shuffle, batch, size):
    source = numbered_source(tmp_path, [4, 6, 3])
    whole = batches(*open_layer(source, batch, shuffle), 5)
    parts = []
    for rank in range(size):
        layer, top = open_layer(source, batch, shuffle, rank=rank, size=size)
        first, count = layer.ctx.shard(batch)
        assert layer.ctx.batch_offset == first and layer.ctx.global_batch == batch
        assert top[0].shape[0] == count
        parts.append(batches(layer, top, 5))
    for k in range(5):
        for t in range(2):
            joined = np.concatenate([parts[r][k][t] for r in range(size)])
            np.testing.assert_array_equal(joined, whole[k][t])


def test_a_global_batch_smaller_than_the_ranks_is_refused(tmp_path, open_layer):
    source = numbered_source(tmp_path, [4])
    with pytest.raises(PrototxtError, match="batch_size 2 is the global batch, split over 3 "
                                            "ranks: it must be at least the number of ranks"):
        open_layer(source, 2, False, rank=2, size=3)


def test_shuffle_is_a_new_permutation_each_epoch_and_fixed_by_seed(tmp_path, open_layer):
    source = numbered_source(tmp_path, [5, 7])
    epochs = [label for _, label in batches(*open_layer(source, 12, shuffle=True), 3)]
    for label in epochs:
        np.testing.assert_array_equal(np.sort(label), np.arange(12))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], np.arange(12))
    again = [label for _, label in batches(*open_layer(source, 12, shuffle=True), 3)]
    np.testing.assert_array_equal(np.array(again), np.array(epochs))
    other = [label for _, label in batches(*open_layer(source, 12, shuffle=True, seed=7), 1)]
    assert not np.array_equal(other[0], epochs[0])


def test_state_resumes_the_batch_sequence(tmp_path, open_layer):
    source = numbered_source(tmp_path, [4, 5])
    layer, top = open_layer(source, 4, shuffle=True)
    seen = batches(layer, top, 5)
    assert layer.state() == {"batch": 5}
    resumed, top2 = open_layer(source, 4, shuffle=True, rank=1, size=2)
    resumed.set_state({"batch": 3})
    later = batches(resumed, top2, 2)
    for k in range(2):
        np.testing.assert_array_equal(later[k][1], seen[3 + k][1][2:])
    resumed.seek(1)
    np.testing.assert_array_equal(batches(resumed, top2, 1)[0][1], seen[1][1][2:])


def test_relative_paths_fall_back_to_the_list_directory(tmp_path, open_layer):
    write_h5(tmp_path / "a.h5", data=np.zeros((3, 2), np.float32), label=np.arange(3.0))
    source = write_list(tmp_path / "list.txt", ["a.h5"])
    layer, top = open_layer(source, 2)
    (_, label), = batches(layer, top, 1)
    np.testing.assert_array_equal(label, [0, 1])


def test_integer_data_is_converted_to_float32(tmp_path, open_layer):
    data = np.arange(12, dtype=np.uint8).reshape(4, 3)
    source = write_list(tmp_path / "l.txt", [write_h5(tmp_path / "a.h5", data=data)])
    layer, top = open_layer(source, 4, tops=("data",))
    (out,), = batches(layer, top, 1)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, data)


# -- reading only what is needed ----------------------------------------------------------------

def test_only_the_batch_rows_are_read(tmp_path, open_layer, monkeypatch):
    source = numbered_source(tmp_path, [6, 5, 9])
    offsets = {"part0.h5": 0, "part1.h5": 6, "part2.h5": 11}
    calls = []
    real = h5io.read_runs

    def recording(dataset, runs, out):   # the main thread's reads: the reader below
        if threading.current_thread() is threading.main_thread():
            calls.append((dataset.name, runs + offsets[os.path.basename(dataset.file.filename)]))
        real(dataset, runs, out)

    monkeypatch.setattr(h5io, "read_runs", recording)
    for shuffle in (False, True):
        layer, top = open_layer(source, 7, shuffle, rank=1, size=3)
        first, count = layer.ctx.shard(7)
        own = h5io.H5Source(source, layer.names)
        reader = BatchReader(own, layer.names, layer.transformer, 7, shuffle, layer.ctx,
                             layer.name, first, count)
        for k in range(4):
            calls.clear()
            label = reader(k)[1][1]
            layer.forward([], top)
            np.testing.assert_array_equal(top[1].data, label)
            for name in ("/data", "/label"):
                read = [np.arange(a, b) for n, runs in calls if n == name for a, b in runs]
                np.testing.assert_array_equal(np.sort(np.concatenate(read)), np.sort(label))
        own.close()


def test_huge_dataset_is_never_loaded(tmp_path, open_layer):
    rows = 2**26   # 64 GiB of float32 if it were read whole
    with h5py.File(tmp_path / "huge.h5", "w") as f:
        f.create_dataset("data", (rows, 256), np.float32, chunks=(1024, 256), fillvalue=0.5)
        f.create_dataset("label", (rows,), np.float32, chunks=(4096,), fillvalue=3.0)
    source = write_list(tmp_path / "l.txt", [tmp_path / "huge.h5"])
    layer, top = open_layer(source, 4)
    layer.set_state({"batch": rows // 4 - 1})
    data, label = batches(layer, top, 1)[0]
    assert data.shape == (4, 256) and np.all(data == 0.5) and np.all(label == 3.0)


# -- transforms ---------------------------------------------------------------------------------

def image_source(tmp_path, n=10, shape=(3, 6, 7), seed=0):
    data = np.random.default_rng(seed).uniform(0, 255, (n,) + shape).astype(np.float32)
    path = write_h5(tmp_path / "img.h5", data=data, label=np.arange(n, dtype=np.float32))
    return write_list(tmp_path / "img.txt", [path]), data


def transform_text(body, mean_file=None):
    if mean_file is not None:
        body += f' mean_file: "{mean_file}"'
    return f"transform_param {{ {body} }}"


def windows(image, crop):
    """All (crop window, mirrored window) candidates of one (C, H, W) image: loop reference."""
    _, h, w = image.shape
    for y in range(h - crop + 1):
        for x in range(w - crop + 1):
            window = image[:, y:y + crop, x:x + crop]
            yield (y, x, False), window
            yield (y, x, True), window[:, :, ::-1]


def test_mean_value_and_scale_match_reference(tmp_path, open_layer):
    source, data = image_source(tmp_path)
    text = transform_text("scale: 0.5 mean_value: 10 mean_value: 20 mean_value: 30")
    layer, top = open_layer(source, 4, transform=text)
    (out, _), = batches(layer, top, 1)
    reference = np.empty_like(data[:4])
    for i in range(4):
        for c, m in enumerate([10.0, 20.0, 30.0]):
            reference[i, c] = (data[i, c] - m) * 0.5
    np.testing.assert_allclose(out, reference, rtol=1e-6, atol=1e-4)
    layer, top = open_layer(source, 4, transform=transform_text("mean_value: 7"))
    (out, _), = batches(layer, top, 1)
    np.testing.assert_allclose(out, data[:4] - 7.0, rtol=1e-6, atol=1e-4)


def test_mean_file_and_centre_crop_in_test_phase(tmp_path, open_layer):
    source, data = image_source(tmp_path)
    mean = np.random.default_rng(1).uniform(0, 100, (1, 3, 6, 7)).astype(np.float32)
    save_mean(tmp_path / "mean.binaryproto", mean[0])
    np.testing.assert_array_equal(load_mean(tmp_path / "mean.binaryproto"), mean)
    text = transform_text("scale: 0.25 crop_size: 4", tmp_path / "mean.binaryproto")
    layer, top = open_layer(source, 5, transform=text, phase=TEST)
    assert top[0].shape == (5, 3, 4, 4)
    (out, label), = batches(layer, top, 1)
    y, x = (6 - 4) // 2, (7 - 4) // 2
    for i in range(5):
        reference = (data[i] - mean[0])[:, y:y + 4, x:x + 4] * 0.25
        np.testing.assert_allclose(out[i], reference, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(label, np.arange(5))


def test_random_crop_and_mirror_are_valid_varied_and_repeatable(tmp_path, open_layer):
    source, data = image_source(tmp_path, n=40, shape=(2, 7, 9))
    text = transform_text("crop_size: 5 mirror: true mean_value: 1 mean_value: 2")
    layer, top = open_layer(source, 20, transform=text)
    runs = batches(layer, top, 2)
    choices = []
    for out, label in runs:
        for i, row in enumerate(label.astype(int)):
            shifted = data[row] - np.array([1.0, 2.0], np.float32)[:, None, None]
            found = [c for c, window in windows(shifted, 5)
                     if np.allclose(window, out[i], atol=1e-4)]
            assert found, f"sample {i} is no crop/mirror of its row"
            choices.append(found[0])
    assert len({c[:2] for c in choices}) > 5
    assert 5 < sum(c[2] for c in choices) < 35
    again = batches(*open_layer(source, 20, transform=text), 2)
    for k in range(2):
        np.testing.assert_array_equal(again[k][0], runs[k][0])


def test_transforms_per_sample_are_the_same_when_the_batch_is_split(tmp_path, open_layer):
    source, _ = image_source(tmp_path, n=9, shape=(3, 8, 8))
    text = transform_text("crop_size: 5 mirror: true scale: 0.1")
    whole = batches(*open_layer(source, 7, shuffle=True, transform=text), 3)
    parts = [batches(*open_layer(source, 7, True, text, rank=r, size=3), 3) for r in range(3)]
    for k in range(3):
        joined = np.concatenate([parts[r][k][0] for r in range(3)])
        np.testing.assert_array_equal(joined, whole[k][0])


# -- prefetch -----------------------------------------------------------------------------------

def test_prefetch_thread_stops_on_close(tmp_path, open_layer):
    source = numbered_source(tmp_path, [10])
    layer, top = open_layer(source, 3)
    layer.forward([], top)
    thread = layer._prefetch.thread
    assert thread.is_alive()
    layer.close()
    assert not thread.is_alive()
    layer.forward([], top)   # reopens after close, from the next batch
    np.testing.assert_array_equal(top[1].data, [3, 4, 5])


def test_prefetch_thread_stops_when_the_layer_is_garbage_collected(tmp_path):
    source = numbered_source(tmp_path, [10])

    def start_and_drop():
        layer = make_layer(layer_text(source, 3))
        layer.ctx.owner = layer   # a reference cycle, as a net holding its context makes
        top = [Blob(), Blob()]
        layer.setup([], top)
        layer.reshape([], top)
        layer.forward([], top)
        return layer._prefetch.thread

    thread = start_and_drop()
    gc.collect()
    assert not thread.is_alive()


def test_prefetch_reraises_the_producers_exception():
    failure = ValueError("row 2 is broken")

    def produce(k):
        if k == 2:
            raise failure
        return k * 10

    prefetcher = Prefetcher(produce, start=0)
    assert [prefetcher.get(), prefetcher.get()] == [0, 10]
    for _ in range(2):
        with pytest.raises(ValueError, match="row 2 is broken") as info:
            prefetcher.get()
        assert info.value is failure
    prefetcher.close()
    assert not prefetcher.thread.is_alive()


def test_read_error_in_thread_surfaces_in_forward(tmp_path, open_layer):
    source = numbered_source(tmp_path, [4])
    layer, top = open_layer(source, 2)
    os.remove(tmp_path / "part0.h5")
    with pytest.raises(DataError, match=r"part0.h5' changed during training \(deleted\) while "
                                        r"reading rows 0..1 of dataset 'data'; .* restore"):
        layer.forward([], top)
    assert not layer._prefetch.thread.is_alive()


# -- errors -------------------------------------------------------------------------------------

def setup_layer(source, batch=2, transform="", tops=("data", "label")):
    layer = make_layer(layer_text(source, batch, transform=transform, tops=tops))
    top = [Blob() for _ in tops]
    layer.setup([], top)
    return layer


def one_file_source(tmp_path, **arrays):
    return write_list(tmp_path / "list.txt", [write_h5(tmp_path / "a.h5", **arrays)])


def plain(tmp_path, data_shape=(4, 3)):
    return one_file_source(tmp_path, data=np.zeros(data_shape, np.float32),
                           label=np.zeros(data_shape[0], np.float32))


def missing_list(tmp_path):
    return str(tmp_path / "absent.txt")


def missing_h5(tmp_path):
    return write_list(tmp_path / "list.txt", [tmp_path / "nope.h5"])


def not_h5(tmp_path):
    (tmp_path / "fake.h5").write_text("hello")
    return write_list(tmp_path / "list.txt", [tmp_path / "fake.h5"])


def missing_dataset(tmp_path):
    return one_file_source(tmp_path, data=np.zeros((3, 2)), extra=np.zeros(3))


def uneven_rows(tmp_path):
    return one_file_source(tmp_path, data=np.zeros((3, 2)), label=np.zeros(4))


def shapes_differ(tmp_path):
    a = write_h5(tmp_path / "a.h5", data=np.zeros((3, 2)), label=np.zeros(3))
    b = write_h5(tmp_path / "b.h5", data=np.zeros((3, 5)), label=np.zeros(3))
    return write_list(tmp_path / "list.txt", [a, b])


def strings(tmp_path):
    return one_file_source(tmp_path, data=np.array([b"a", b"b"]), label=np.zeros(2))


def empty_list(tmp_path):
    return write_list(tmp_path / "list.txt", ["", "  "])


def no_rows(tmp_path):
    return one_file_source(tmp_path, data=np.zeros((0, 2)), label=np.zeros(0))


@pytest.mark.parametrize("make,message", [
    (missing_list, r"HDF5 list file '.*absent.txt' not found; hdf5_data_param.source must name"),
    (missing_h5, r"list.txt:1: HDF5 file '.*nope.h5' not found .*fix the path or build"),
    (not_h5, r"list.txt:1: '.*fake.h5' is not an HDF5 file"),
    (missing_dataset, r"a.h5' has no dataset 'label' \(datasets present: data, extra\); each top"),
    (uneven_rows, r"a.h5': datasets have different row counts \('data': 3, 'label': 4\)"),
    (shapes_differ, r"'data' has rows of shape \(5,\) in '.*b.h5' but \(2,\) in '.*a.h5'"),
    (strings, r"a.h5': dataset 'data' has non-numeric type \|S1; store numbers"),
    (empty_list, r"list.txt' lists no files; write one HDF5 path per line"),
    (no_rows, r"its files hold no rows"),
])
def test_data_errors_name_the_file_and_the_fix(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        setup_layer(make(tmp_path))


def test_mean_file_errors(tmp_path):
    source = plain(tmp_path, (4, 3, 6, 7))
    save_mean(tmp_path / "small.binaryproto", np.zeros((3, 5, 5)))
    with pytest.raises(DataError, match=r"mean file '.*small.binaryproto' has shape "
                                        r"\(1, 3, 5, 5\) but data rows have shape \(3, 6, 7\)"):
        setup_layer(source, transform=transform_text("", tmp_path / "small.binaryproto"))
    with pytest.raises(DataError, match="mean file '.*absent.binaryproto' not found"):
        setup_layer(source, transform=transform_text("", tmp_path / "absent.binaryproto"))
    (tmp_path / "junk.binaryproto").write_bytes(b"\xff\xff\xff")
    with pytest.raises(DataError, match="junk.binaryproto' is not a binary BlobProto"):
        setup_layer(source, transform=transform_text("", tmp_path / "junk.binaryproto"))


@pytest.mark.parametrize("batch,transform,message", [
    (0, "", "batch_size must be at least 1"),
    (2, 'transform_param { mean_value: 1 mean_file: "m" }', "both mean_file and mean_value"),
    (2, "transform_param { mean_value: 1 mean_value: 2 }", "2 mean_value entries for 3 channels"),
    (2, "transform_param { crop_size: 7 }", r"crop_size 7 exceeds the data height x width"),
    (2, "transform_param { crop_h: 4 crop_w: 4 }", "crop_h is SSD's, read only by its "
                                                   "AnnotatedData layer"),
    (2, "transform_param { expand_param { prob: 0.5 } }", "expand_param is SSD's"),
])
def test_parameter_errors(tmp_path, batch, transform, message):
    with pytest.raises(PrototxtError, match=message):
        setup_layer(plain(tmp_path, (4, 3, 6, 7)), batch, transform)


def test_crop_needs_image_rows(tmp_path):
    with pytest.raises(DataError, match=r"need rows of shape \(channels, height, width\)"):
        setup_layer(plain(tmp_path), transform="transform_param { mirror: true }")


# -- dataset builders ---------------------------------------------------------------------------

def load_script(name):
    path = REPO / name
    spec = importlib.util.spec_from_file_location(path.stem + "_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_builds_a_lenet_shaped_set(tmp_path, open_layer):
    from sklearn.datasets import load_digits
    digits = load_script("data/digits.py")
    assert digits.main(["--out", str(tmp_path)]) == 0
    with h5py.File(tmp_path / "train.h5") as train, h5py.File(tmp_path / "test.h5") as test:
        assert train["data"].shape == (1497, 1, 28, 28) and train["label"].shape == (1497,)
        assert test["data"].shape == (300, 1, 28, 28) and test["label"].shape == (300,)
        assert train["data"].dtype == np.float32 and train["label"].dtype == np.float32
        images, labels = train["data"][:], np.concatenate([train["label"][:], test["label"][:]])
    assert images.min() == 0 and 0.9 < images.max() <= 1
    assert not images[:, :, :3].any() and not images[:, :, :, -3:].any()   # the 4-pixel border
    np.testing.assert_array_equal(np.bincount(labels.astype(int)),
                                  np.bincount(load_digits().target))
    assert (tmp_path / "train.txt").read_text() == f"{tmp_path / 'train.h5'}\n"
    layer, top = open_layer(str(tmp_path / "test.txt"), 64)
    layer.forward([], top)
    assert top[0].shape == (64, 1, 28, 28)

    stamp = os.stat(tmp_path / "train.h5").st_mtime_ns
    digits.main(["--out", str(tmp_path)])
    assert os.stat(tmp_path / "train.h5").st_mtime_ns == stamp   # up to date: skipped
    digits.main(["--out", str(tmp_path), "--augment", "1"])
    with h5py.File(tmp_path / "train.h5") as train:
        assert train["data"].shape == (2 * 1497, 1, 28, 28)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_list_files_name_paths_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "digits").mkdir(parents=True)
    h5io.write_list("data/digits/train.txt", [tmp_path / "data" / "digits" / "train.h5"])
    assert (tmp_path / "data/digits/train.txt").read_text() == "data/digits/train.h5\n"


def test_synthetic_set_is_seeded_and_class_dependent(tmp_path, monkeypatch):
    synthetic = load_script("data/synthetic.py")
    monkeypatch.setattr(synthetic, "CHUNK_ELEMENTS", 7 * 12)   # several chunks of 7 rows
    for out in ("a", "b"):
        synthetic.main(["--shape", "3,2,2", "--classes", "3", "--train", "60", "--test", "9",
                        "--out", str(tmp_path / out)])
    with h5py.File(tmp_path / "a/train.h5") as a, h5py.File(tmp_path / "b/train.h5") as b:
        data, label = a["data"][:], a["label"][:]
        np.testing.assert_array_equal(data, b["data"][:])
    assert data.shape == (60, 3, 2, 2) and set(label) <= {0, 1, 2}
    means = np.stack([data[label == c].mean(0) for c in range(3)])
    assert np.abs(means[0] - means[1]).max() > 0.5
    assert (tmp_path / "a/test.txt").read_text() == f"{tmp_path / 'a/test.h5'}\n"


def test_convert_npz_and_images(tmp_path, open_layer, capsys):
    convert = load_script("tools/convert_hdf5.py")
    x = np.arange(5 * 2 * 3, dtype=np.int64).reshape(5, 2, 3)
    np.savez(tmp_path / "arrays.npz", data=x, label=np.arange(5))
    assert convert.main(["npz", str(tmp_path / "arrays.npz"), str(tmp_path / "out.h5")]) == 0
    layer, top = open_layer(str(tmp_path / "out.txt"), 5)
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, x)
    np.testing.assert_array_equal(top[1].data, np.arange(5))
    assert convert.main(["npz", str(tmp_path / "arrays.npz"), str(tmp_path / "s.h5"),
                         "--shuffle"]) == 0
    with h5py.File(tmp_path / "s.h5") as f:
        order = f["label"][:].astype(int)
        np.testing.assert_array_equal(f["data"][:], x[order])
    assert sorted(order) == list(range(5)) and list(order) != list(range(5))
    np.savez(tmp_path / "bad.npz", data=x, label=np.arange(4))
    assert convert.main(["npz", str(tmp_path / "bad.npz"), str(tmp_path / "bad.h5")]) == 1
    assert "same, non-zero number of rows" in capsys.readouterr().err
    assert not (tmp_path / "bad.h5").exists()

    pil = pytest.importorskip("PIL.Image")
    rgb = np.random.default_rng(0).integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
    for i in range(2):
        pil.fromarray(rgb[i]).save(tmp_path / f"im{i}.png")
    (tmp_path / "images.txt").write_text("im0.png 3\nim1.png 7\n")
    assert convert.main(["images", str(tmp_path), str(tmp_path / "images.txt"),
                         str(tmp_path / "im.h5")]) == 0
    with h5py.File(tmp_path / "im.h5") as f:
        np.testing.assert_array_equal(f["data"][:], rgb[..., ::-1].transpose(0, 3, 1, 2))
        np.testing.assert_array_equal(f["label"][:], [3, 7])
    assert convert.main(["images", str(tmp_path), str(tmp_path / "images.txt"),
                         str(tmp_path / "g.h5"), "--gray", "--resize", "3,2"]) == 0
    with h5py.File(tmp_path / "g.h5") as f:
        assert f["data"].shape == (2, 1, 3, 2)
