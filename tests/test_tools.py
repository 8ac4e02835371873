"""The tools around training: parse-log, plot, draw, convert, mean, the LMDB Data layer and
the Python layer type."""
import argparse
import contextlib
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from syncsgd import TEST, TRAIN, log
from syncsgd.blob import Blob
from syncsgd.errors import DataError, PrototxtError, SyncSGDError
from syncsgd.io.mean import load_mean
from syncsgd.logs import parse_log, read_table, write_tables
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer

REPO = Path(__file__).resolve().parents[1]
SEED = 1701
N_IMAGES = 60
SIDE = 28


# -- helpers ------------------------------------------------------------------------------------

def pil():
    """Pillow's Image module (the test is skipped without Pillow)."""
    return pytest.importorskip("PIL.Image")


def digit_like(label, rng):
    """A 28x28 gray image: dark noise with a bright block whose place is the class."""
    img = rng.integers(0, 40, (SIDE, SIDE)).astype(np.uint8)
    r, c = divmod(label, 4)
    img[r * 9 + 1:r * 9 + 8, c * 7:c * 7 + 6] = 200 + int(rng.integers(0, 50))
    return img


def make_image_folder(root, n=N_IMAGES, color=False):
    """PNG files in per-class folders and their 'path label' list; returns (list path, {path:
    pixels as written})."""
    rng = np.random.default_rng(3)
    lines, pixels = [], {}
    for i in range(n):
        label = i % 10
        img = digit_like(label, rng)
        if color:
            img = np.stack([img, 255 - img, rng.integers(0, 256, img.shape).astype(np.uint8)], -1)
        rel = f"class{label}/img {i:03d}.png"      # a space in the name, as lists allow
        (root / f"class{label}").mkdir(parents=True, exist_ok=True)
        pil().fromarray(img).save(root / rel)
        lines.append(f"{rel} {label}")
        pixels[rel] = img
    listfile = root / "list.txt"
    listfile.write_text("\n".join(lines) + "\n")
    return listfile, pixels


def as_caffe(img):
    """(H, W) or (H, W, 3 RGB) uint8 -> (C, H, W) float32 in Caffe's BGR order."""
    img = np.asarray(img, np.float32)
    return img[None] if img.ndim == 2 else img[:, :, ::-1].transpose(2, 0, 1)


def run_cli(argv):
    """Run a verb through a parser built as syncsgd.cli builds it."""
    from syncsgd.cli.tools import register
    parser = argparse.ArgumentParser(prog="syncsgd")
    register(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


@contextlib.contextmanager
def logging_to(path):
    with open(path, "w") as stream:
        log.configure(enabled=True, stream=stream)
        try:
            yield
        finally:
            log.configure()                 # back to stderr


def png(path):
    return np.asarray(pil().open(path).convert("RGB"))


def pixels_near(image, rgb, tolerance=8):
    return int((np.abs(image.astype(int) - rgb).max(axis=-1) <= tolerance).sum())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One folder of PNGs converted (gray, shuffled with one seed) to LMDB raw, LMDB encoded
    and HDF5."""
    lmdb = pytest.importorskip("lmdb")
    del lmdb
    root = tmp_path_factory.mktemp("images")
    listfile, pixels = make_image_folder(root / "png")
    out = {"root": root, "list": listfile, "pixels": pixels}
    common = ["--gray", "--shuffle", "--seed", "7"]
    for name, extra in (("lmdb", []), ("lmdb_enc", ["--encoded"]), ("h5", [])):
        target = root / (f"{name}.h5" if name == "h5" else name)
        assert run_cli(["convert", str(root / "png"), str(listfile), str(target)] + common
                       + extra) == 0
        out[name] = str(target)
    out["h5_list"] = str(root / "h5.txt")
    return out


@pytest.fixture
def open_layer(layer_factory):
    """Set-up data layers from LayerParameter text (see conftest.layer_factory)."""
    return layer_factory


def data_text(source, batch, transform="", backend="LMDB", extra=""):
    return (f'name: "d" type: "Data" top: "data" top: "label" '
            f'data_param {{ source: "{source}" batch_size: {batch} backend: {backend} {extra} }} '
            f'{transform}')


def hdf5_text(source, batch, transform=""):
    return (f'name: "d" type: "HDF5Data" top: "data" top: "label" '
            f'hdf5_data_param {{ source: "{source}" batch_size: {batch} }} {transform}')


def batches(layer, top, n):
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append([b.data.copy() for b in top])
    return out


# -- convert and the LMDB source ----------------------------------------------------------------

def test_convert_stores_the_images_in_caffe_layout(data):
    from syncsgd.io.hdf5 import H5Source
    from syncsgd.io.lmdb import LMDBSource
    entries = [line.rsplit(" ", 1) for line in Path(data["list"]).read_text().splitlines()]
    order = np.random.default_rng(7).permutation(len(entries))
    source = LMDBSource(data["lmdb"])
    h5 = H5Source(data["h5_list"], ["data", "label"])
    try:
        rows = np.arange(N_IMAGES)
        images = source.read("data", rows)
        assert images.shape == (N_IMAGES, 1, SIDE, SIDE) and images.dtype == np.float32
        for k in (0, 1, 17, N_IMAGES - 1):
            rel, label = entries[order[k]]
            assert source.key(k) == f"{k:08d}_{rel}".encode()
            np.testing.assert_array_equal(images[k], as_caffe(data["pixels"][rel]))
            assert source.read("label", rows)[k] == int(label)
        np.testing.assert_array_equal(h5.read("data", rows), images)
        np.testing.assert_array_equal(h5.read("label", rows), source.read("label", rows))
    finally:
        source.close()
        h5.close()


def test_convert_color_resize_and_encoded(tmp_path):
    pytest.importorskip("lmdb")
    from syncsgd.io.lmdb import LMDBSource
    listfile, pixels = make_image_folder(tmp_path / "png", n=6, color=True)
    run_cli(["convert", str(tmp_path / "png"), str(listfile), str(tmp_path / "raw")])
    run_cli(["convert", "-encoded", str(tmp_path / "png"), str(listfile), str(tmp_path / "enc")])
    run_cli(["convert", str(tmp_path / "png"), str(listfile), str(tmp_path / "small"),
             "--resize_height", "14", "--resize_width", "10", "--encode_type", "png"])
    raw, enc, small = (LMDBSource(str(tmp_path / n)) for n in ("raw", "enc", "small"))
    try:
        rows = np.arange(6)
        order = [raw.key(i).decode().split("_", 1)[1] for i in rows]
        expected = np.stack([as_caffe(pixels[rel]) for rel in order])
        np.testing.assert_array_equal(raw.read("data", rows), expected)   # BGR, unshuffled
        np.testing.assert_array_equal(enc.read("data", rows), expected)   # PNG is lossless
        assert small.read("data", rows).shape == (6, 3, 14, 10)
        first = pil().fromarray(pixels[order[0]]).resize((10, 14), pil().BILINEAR)
        np.testing.assert_array_equal(small.read("data", rows)[0], as_caffe(first))
    finally:
        for source in (raw, enc, small):
            source.close()


def test_convert_errors(tmp_path, data):
    listfile = tmp_path / "bad.txt"
    listfile.write_text("a.png notanumber\n")
    with pytest.raises(DataError, match="expected 'relative/path label'"):
        run_cli(["convert", str(tmp_path), str(listfile), str(tmp_path / "x")])
    listfile.write_text("missing.png 1\n")
    with pytest.raises(DataError, match="cannot read image"):
        run_cli(["convert", str(tmp_path), str(listfile), str(tmp_path / "x")])
    with pytest.raises(DataError, match="already exists"):
        run_cli(["convert", str(data["root"] / "png"), str(data["list"]), data["lmdb"]])
    with pytest.raises(SyncSGDError, match="both --resize_height"):
        run_cli(["convert", str(tmp_path), str(listfile), str(tmp_path / "y"),
                 "--resize_height", "4"])


def test_lmdb_written_as_caffe_writes_it(tmp_path, open_layer, monkeypatch):
    """Databases made without syncsgd's writer: convert_mnist_data's "%08d" keys with raw
    records, float_data records, encoded JPEG/PNG records; and a map that has to grow."""
    lmdb = pytest.importorskip("lmdb")
    import io as bytes_io
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (5, 3, 4, 6)).astype(np.uint8)
    env = lmdb.open(str(tmp_path / "caffe_db"), map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i, image in enumerate(images):
            datum = pb.Datum(channels=3, height=4, width=6, data=image.tobytes(), label=i)
            txn.put(b"%08d" % i, datum.SerializeToString())
    env.close()
    layer, top = open_layer(data_text(str(tmp_path / "caffe_db"), 5))
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, images)
    np.testing.assert_array_equal(top[1].data, np.arange(5))

    env = lmdb.open(str(tmp_path / "float_db"), map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i in range(3):
            datum = pb.Datum(channels=1, height=2, width=2, label=i,
                             float_data=[i + 0.25, -1.5, 2.0, 0.0])
            txn.put(b"%08d" % i, datum.SerializeToString())
    env.close()
    layer, top = open_layer(data_text(str(tmp_path / "float_db"), 2))
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data[:, 0, 0, 0], [0.25, 1.25])

    gray = rng.integers(0, 256, (4, 6)).astype(np.uint8)
    buf = bytes_io.BytesIO()
    pil().fromarray(gray).save(buf, format="PNG")
    monkeypatch.setattr("syncsgd.io.lmdb.FIRST_MAP_SIZE", 1 << 15)   # forces the map to grow
    from syncsgd.io.lmdb import write_lmdb
    record = pb.Datum(encoded=True, data=buf.getvalue(), label=3).SerializeToString()
    write_lmdb(str(tmp_path / "enc_db"), ((b"%08d" % i, record) for i in range(400)))
    for force, channels in (("", 1), ("force_color: true", 3)):
        layer, top = open_layer(data_text(str(tmp_path / "enc_db"), 2,
                                          f"transform_param {{ {force} }}"))
        layer.forward([], top)
        assert top[0].shape == (2, channels, 4, 6)
        np.testing.assert_array_equal(top[0].data[1, -1], gray)


# -- the Data layer -----------------------------------------------------------------------------

TRANSFORM = 'transform_param { scale: 0.00390625 mirror: true crop_size: 24 }'


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_data_layer_gives_the_batches_of_hdf5data(data, open_layer, phase):
    """Same images, same transforms (random crops and mirrors in TRAIN), across epoch ends."""
    lmdb_layer, lmdb_top = open_layer(data_text(data["lmdb"], 7, TRANSFORM), phase=phase)
    h5_layer, h5_top = open_layer(hdf5_text(data["h5_list"], 7, TRANSFORM), phase=phase)
    assert lmdb_top[0].shape == (7, 1, 24, 24) and lmdb_top[1].shape == (7,)
    for ours, theirs in zip(batches(lmdb_layer, lmdb_top, 20), batches(h5_layer, h5_top, 20)):
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_array_equal(ours[1], theirs[1])


def test_data_layer_reads_records_in_order_and_wraps(data, open_layer):
    from syncsgd.io.lmdb import LMDBSource
    source = LMDBSource(data["lmdb"])
    everything = source.read("data", np.arange(N_IMAGES))
    source.close()
    layer, top = open_layer(data_text(data["lmdb"], 25))
    got = np.concatenate([b[0] for b in batches(layer, top, 3)])       # 75 = 60 + 15
    np.testing.assert_array_equal(got, np.concatenate([everything, everything[:15]]))


@pytest.mark.parametrize("size", [2, 3])
def test_rank_slices_and_seek_match_one_process(data, open_layer, size):
    one, one_top = open_layer(data_text(data["lmdb_enc"], 8, TRANSFORM))
    whole = batches(one, one_top, 9)
    parts = []
    for rank in range(size):
        layer, top = open_layer(data_text(data["lmdb_enc"], 8, TRANSFORM), rank, size)
        layer.seek(4)
        parts.append(batches(layer, top, 5))
        assert layer.ctx.global_batch == 8
    for k in range(5):
        for t in range(2):
            np.testing.assert_array_equal(np.concatenate([p[k][t] for p in parts]),
                                          whole[4 + k][t])


def test_data_layer_with_a_label_less_top_and_a_mean_file(data, open_layer, tmp_path):
    mean_path = tmp_path / "mean.binaryproto"
    assert run_cli(["mean", data["lmdb"], str(mean_path)]) == 0
    mean = load_mean(str(mean_path))
    assert mean.shape == (1, 1, SIDE, SIDE)
    from syncsgd.io.lmdb import LMDBSource
    source = LMDBSource(data["lmdb"])
    images = source.read("data", np.arange(N_IMAGES))
    source.close()
    np.testing.assert_allclose(mean[0], images.mean(axis=0), rtol=1e-6, atol=1e-4)
    hdf5_mean = tmp_path / "h5mean.binaryproto"
    run_cli(["mean", data["h5_list"], str(hdf5_mean)])
    np.testing.assert_allclose(load_mean(str(hdf5_mean)), mean, rtol=1e-6)
    with pytest.raises(DataError, match="give the list file"):
        run_cli(["mean", data["h5"]])
    text = data_text(data["lmdb"], 5, f'transform_param {{ mean_file: "{mean_path}" }}')
    layer, top = open_layer(text.replace(' top: "label"', ""), tops=("data",))
    layer.forward([], top)
    np.testing.assert_allclose(top[0].data, images[:5] - mean[0], atol=1e-4)


@pytest.mark.parametrize("extra, message", [
    ("LEVELDB", "LEVELDB"),
    ("LMDB scale: 2", "move it to transform_param"),
])
def test_data_layer_parameter_errors(data, open_layer, extra, message):
    backend, _, more = extra.partition(" ")
    with pytest.raises(PrototxtError, match=message):
        open_layer(data_text(data["lmdb"], 4, backend=backend, extra=more))


def test_data_layer_source_errors(tmp_path, open_layer, data):
    pytest.importorskip("lmdb")
    with pytest.raises(DataError, match="not found"):
        open_layer(data_text(str(tmp_path / "nowhere"), 4))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a readable LMDB"):
        open_layer(data_text(str(tmp_path / "plain"), 4))
    layer, top = open_layer(data_text(data["lmdb"], 4, extra="rand_skip: 5"))  # noted, ignored
    layer.forward([], top)


# -- LeNet on LMDB, its log, parse-log and plot -------------------------------------------------

def lenet_files(tmp_path, train_layer, test_layer, max_iter):
    """LeNet's train_val with the given data layers (text) and a short solver."""
    net = text_format.Parse((REPO / "models/lenet/train_val.prototxt").read_text(),
                            pb.NetParameter())
    for k, layer_text in enumerate((train_layer, test_layer)):
        replacement = text_format.Parse(layer_text, pb.LayerParameter())
        replacement.include.add().phase = TRAIN if k == 0 else TEST
        net.layer[k].CopyFrom(replacement)
    net_path = tmp_path / "train_val.prototxt"
    net_path.write_text(text_format.MessageToString(net))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(textwrap.dedent(f"""\
        net: "{net_path}"
        test_iter: 2  test_interval: 10
        base_lr: 0.01  momentum: 0.9  weight_decay: 0.0005
        lr_policy: "inv"  gamma: 0.0001  power: 0.75
        display: 5  max_iter: {max_iter}  random_seed: 1
        snapshot_after_train: false  snapshot_prefix: "{tmp_path}/lenet"
        """))
    return solver


def train_logged(solver_path, log_path):
    from syncsgd.solvers import get_solver
    with logging_to(log_path):
        solver = get_solver(str(solver_path))
        try:
            solver.solve()
        finally:
            solver.close()


def data_layer(name, source, batch):
    return (f'name: "{name}" type: "Data" top: "data" top: "label" '
            f'transform_param {{ scale: 0.00390625 }} '
            f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}')


def h5_layer(name, source, batch):
    return (f'name: "{name}" type: "HDF5Data" top: "data" top: "label" '
            f'transform_param {{ scale: 0.00390625 }} '
            f'hdf5_data_param {{ source: "{source}" batch_size: {batch} }}')


@pytest.fixture(scope="module")
def lenet_logs(data, tmp_path_factory):
    """LeNet trained 20 iterations from the LMDB, and 10 from the HDF5 of the same images."""
    logs = {}
    for kind, make, source, iterations in (("lmdb", data_layer, data["lmdb"], 20),
                                           ("h5", h5_layer, data["h5_list"], 10)):
        folder = tmp_path_factory.mktemp(f"lenet_{kind}")
        solver = lenet_files(folder, make("train", source, 8), make("test", source, 10),
                             iterations)
        logs[kind] = folder / f"lenet_{kind}.log"
        train_logged(solver, logs[kind])
    return logs


def inv_rate(iteration):
    return 0.01 * (1 + 0.0001 * iteration) ** -0.75


def test_lenet_trains_on_lmdb_exactly_as_on_hdf5(lenet_logs):
    lmdb_log, h5_log = parse_log(lenet_logs["lmdb"]), parse_log(lenet_logs["h5"])
    train = [row["loss"] for row in lmdb_log.train]
    assert train[0] > 2.0 and train[-1] < 0.5 * train[0]
    assert lmdb_log.test[-1]["accuracy"] > lmdb_log.test[0]["accuracy"]
    # the same batches give the same run: every output the shorter HDF5 run logged, the LMDB
    # run logged too (the HDF5 run's last rate is older: it stopped at iteration 10)
    for ours, theirs in ((lmdb_log.train, h5_log.train), (lmdb_log.test, h5_log.test)):
        assert len(theirs) == 2
        assert [dict(r, Seconds=0, LearningRate=0) for r in ours[:2]] == \
            [dict(r, Seconds=0, LearningRate=0) for r in theirs]


def test_parse_log_of_a_syncsgd_run(lenet_logs, tmp_path):
    assert run_cli(["parse-log", str(lenet_logs["lmdb"]), str(tmp_path)]) == 0
    train = read_table(tmp_path / "lenet_lmdb.log.train")
    test = read_table(tmp_path / "lenet_lmdb.log.test")
    header = (tmp_path / "lenet_lmdb.log.train").read_text().splitlines()[0]
    assert header == "NumIters,Seconds,LearningRate,loss"
    assert (tmp_path / "lenet_lmdb.log.test").read_text().splitlines()[0] == \
        "NumIters,Seconds,LearningRate,accuracy,loss"
    assert [r["NumIters"] for r in train] == [0, 5, 10, 15]
    assert [r["NumIters"] for r in test] == [0, 10, 20]
    for row in train + test:
        assert row["LearningRate"] == pytest.approx(inv_rate(min(row["NumIters"], 15)),
                                                    rel=1e-5)
    seconds = [r["Seconds"] for r in train]
    assert seconds[0] >= 0 and seconds == sorted(seconds)
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] > 0 for r in test)
    text = Path(lenet_logs["lmdb"]).read_text()
    smoothed = parse_log(lenet_logs["lmdb"]).losses
    assert [s[0] for s in smoothed] == [0, 5, 10, 15, 20]
    assert f"Iteration 20, loss = {log.fmt(smoothed[-1][2])}" in text


CAFFE_LOG = """\
Log file created at: 2023/12/31 23:59:50
I1231 23:59:50.000000 31337 caffe.cpp:218] Using GPUs 0
I1231 23:59:50.100000 31337 solver.cpp:44] Initializing solver from parameters:
test_iter: 100
base_lr: 0.01
I1231 23:59:58.400000 31337 solver.cpp:310] Solving LeNet
I1231 23:59:58.400010 31337 solver.cpp:311] Learning Rate Policy: inv
I1231 23:59:58.500000 31337 solver.cpp:367] Iteration 0, Testing net (#0)
I1231 23:59:58.900000 31337 solver.cpp:434]     Test net output #0: accuracy = 0.0856
I1231 23:59:58.900000 31337 solver.cpp:434]     Test net output #1: loss = 2.33511 (* 1 = 2.33511 loss)
I1231 23:59:59.000000 31337 solver.cpp:243] Iteration 0, loss = 2.30388
I1231 23:59:59.000000 31337 solver.cpp:259]     Train net output #0: loss = 2.30388 (* 1 = 2.30388 loss)
I1231 23:59:59.000000 31337 sgd_solver.cpp:138] Iteration 0, lr = 0.01
I1231 23:59:59.900000 31337 solver.cpp:243] Iteration 100 (111.1 iter/s, 0.9s/100 iters), loss = 0.211357
I1231 23:59:59.900000 31337 solver.cpp:259]     Train net output #0: loss = 0.211357 (* 1 = 0.211357 loss)
I1231 23:59:59.900000 31337 sgd_solver.cpp:138] Iteration 100, lr = 0.00992565
W0101 00:00:00.100000 31337 data_layer.cpp:73] Restarting data prefetching from start.
[1,0]<stdout>:I0101 00:00:01.400000 31337 solver.cpp:367] Iteration 200, Testing net (#0)
I0101 00:00:01.800000 31337 solver.cpp:434]     Test net output #0: accuracy = 0.9712
I0101 00:00:01.800000 31337 solver.cpp:434]     Test net output #1: loss = 0.0872346 (* 1 = 0.0872346 loss)
I0101 00:00:01.900000 31337 solver.cpp:243] Iteration 200 (52.6 iter/s, 1.9s/100 iters), loss = 1.5e-01
I0101 00:00:01.900000 31337 solver.cpp:259]     Train net output #0: loss = 0.15 (* 1 = 0.15 loss)
I0101 00:00:01.900000 31337 sgd_solver.cpp:138] Iteration 200, lr = 0.00985258
a line some tool printed without a prefix: Iteration 999, loss = 9
I0101 00:00:02.400000 31337 solver.cpp:447] Snapshotting to binary proto file lenet_iter_300.caffemodel
I0101 00:00:02.500000 31337 solver.cpp:332] Iteration 300, loss = 0.05
I0101 00:00:02.500000 31337 solver.cpp:352] Iteration 300, Testing net (#0)
I0101 00:00:02.900000 31337 solver.cpp:434]     Test net output #0: accuracy = 0.9801
I0101 00:00:02.900000 31337 solver.cpp:434]     Test net output #1: loss = -nan (* 1 = -nan loss)
I0101 00:00:02.900000 31337 solver.cpp:337] Optimization Done.
"""


def test_parse_log_of_a_caffe_log(tmp_path):
    path = tmp_path / "caffe.INFO"
    path.write_text(CAFFE_LOG)
    parsed = parse_log(str(path), year=2023)
    nan = float("nan")
    assert parsed.train == [
        {"NumIters": 0, "Seconds": 0.6, "LearningRate": 0.01, "loss": 2.30388},
        {"NumIters": 100, "Seconds": 1.5, "LearningRate": 0.00992565, "loss": 0.211357},
        {"NumIters": 200, "Seconds": 3.5, "LearningRate": 0.00985258, "loss": 0.15},
    ]
    expected_test = [(0, 0.5, 0.01, 0.0856, 2.33511), (200, 3.4, 0.00985258, 0.9712, 0.0872346),
                     (300, 4.5, 0.00985258, 0.9801, nan)]
    assert len(parsed.test) == 3
    for row, (it, s, lr, acc, loss) in zip(parsed.test, expected_test):
        assert (row["NumIters"], row["LearningRate"], row["accuracy"]) == (it, lr, acc)
        assert row["Seconds"] == pytest.approx(s, abs=1e-6)
        assert row["loss"] == loss or (math.isnan(loss) and math.isnan(row["loss"]))
    assert [(it, loss) for it, _, loss in parsed.losses] == \
        [(0, 2.30388), (100, 0.211357), (200, 0.15), (300, 0.05)]
    for row in parsed.train:
        row["Seconds"] = round(row["Seconds"], 6)
    written = write_tables(parsed, str(tmp_path / "out"))
    assert [Path(p).name for p in written] == ["caffe.INFO.train", "caffe.INFO.test"]
    assert Path(written[0]).read_text().splitlines() == [
        "NumIters,Seconds,LearningRate,loss", "0,0.6,0.01,2.30388",
        "100,1.5,0.00992565,0.211357", "200,3.5,0.00985258,0.15"]
    assert Path(written[1]).read_text().splitlines()[-1].endswith(",0.9801,nan")


def test_parse_log_without_output_writes_nothing(tmp_path, capsys):
    path = tmp_path / "empty.log"
    path.write_text("I0101 00:00:00.000000 1 x.cpp:1] Solving nothing\n")
    assert run_cli(["parse-log", str(path), str(tmp_path / "out")]) == 0
    assert not list((tmp_path / "out").iterdir())
    assert "nothing written" in capsys.readouterr().out
    with pytest.raises(SyncSGDError, match="not found"):
        run_cli(["parse-log", str(tmp_path / "none.log"), str(tmp_path)])


def test_plot_several_runs(lenet_logs, tmp_path):
    pytest.importorskip("matplotlib")
    caffe = tmp_path / "caffe.log"
    caffe.write_text(CAFFE_LOG)
    out = tmp_path / "curves.png"
    assert run_cli(["plot", str(lenet_logs["lmdb"]), str(caffe), "--out", str(out),
                    "--labels", "syncsgd,caffe"]) == 0
    image = png(out)
    assert image.shape == (450, 1500, 3)
    assert (image[2, 2] == 255).all() and (image[-2, -2] == 255).all()
    assert pixels_near(image, (31, 119, 180)) > 100       # first run: C0
    assert pixels_near(image, (255, 127, 14)) > 100       # second run: C1
    seconds = tmp_path / "seconds.svg"
    run_cli(["plot", str(lenet_logs["lmdb"]), "--out", str(seconds), "--xaxis", "seconds"])
    assert "seconds" in seconds.read_text() or "<svg" in seconds.read_text()


def test_plot_rejects_logs_without_curves(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.log"
    path.write_text("nothing here\n")
    with pytest.raises(SyncSGDError, match="no training or test output"):
        run_cli(["plot", str(path), "--out", str(tmp_path / "x.png")])


def test_plot_scaling(tmp_path):
    pytest.importorskip("matplotlib")
    from syncsgd.plot import plot_scaling
    rows = [{"model": m, "ranks": str(n), "images_per_s": 100 * n * e ** k,
             "speedup": n * e ** k, "efficiency": e ** k}
            for m, e in (("lenet", 0.95), ("vgg_a", 0.8)) for k, n in enumerate((1, 2, 4, 8))]
    out = tmp_path / "scaling.png"
    plot_scaling(rows, str(out))
    image = png(out)
    assert image.shape == (450, 1500, 3)
    assert (image[1, 1] == 255).all()
    assert pixels_near(image, (31, 119, 180)) > 100 and pixels_near(image, (255, 127, 14)) > 100


def test_missing_matplotlib_is_a_clear_import_error(monkeypatch):
    import syncsgd.plot as plot
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_scaling([{"model": "m", "ranks": 1, "images_per_s": 1, "speedup": 1,
                            "efficiency": 1}], "x.png")


# -- draw ---------------------------------------------------------------------------------------

LENET = str(REPO / "models/lenet/train_val.prototxt")
CONV_RGB = (0xfb, 0x6a, 0x4a)


def test_draw_graph_structure():
    from syncsgd.draw import CATEGORY_COLORS, net_graph
    graph = net_graph(LENET, TEST)
    labels = [n.label.split("\n")[0] for n in graph.nodes if n.is_layer]
    assert labels == ["test_data", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2",
                      "accuracy", "loss"]
    by_label = {n.label.split("\n")[0]: n for n in graph.nodes if n.is_layer}
    assert by_label["conv1"].color == CATEGORY_COLORS["convolution"]
    assert "20 @ 5x5 s1 p0" in by_label["conv1"].label
    ip1_blobs = [n.id for n in graph.nodes if not n.is_layer and n.label == "ip1"]
    assert len(ip1_blobs) == 2                         # the in-place ReLU gets its own copy
    relu = by_label["relu1"].id
    assert (ip1_blobs[0], relu) in graph.edges and (relu, ip1_blobs[1]) in graph.edges
    assert len(net_graph(LENET).nodes) == len(graph.nodes) + 1    # ALL: both data layers


def test_draw_colours_by_strategy_when_the_net_declares_parallelism():
    from syncsgd.draw import STRATEGY_COLORS, net_graph
    net = text_format.Parse((REPO / "models/lenet/deploy.prototxt").read_text(),
                            pb.NetParameter())
    for layer in net.layer:
        if layer.name == "ip1":
            layer.parallel_param.mode = pb.ParallelParameter.MODEL
        if layer.name == "ip2":
            layer.parallel_param.mode = pb.ParallelParameter.HYBRID
            layer.parallel_param.groups = 2
    graph = net_graph(net)
    colors = {n.label.split("\n")[0]: n.color for n in graph.nodes if n.is_layer}
    assert colors["ip1"] == STRATEGY_COLORS["model"]
    assert colors["ip2"] == STRATEGY_COLORS["hybrid"]
    assert colors["conv1"] == STRATEGY_COLORS["data"]
    assert list(graph.legend) == ["data", "model", "hybrid"]


@pytest.mark.parametrize("engine", ["matplotlib", "graphviz"])
def test_draw_pictures(tmp_path, engine):
    pytest.importorskip("matplotlib")
    from syncsgd.draw import draw_net_to_file
    from syncsgd.plot import MissingPackage
    try:
        used = draw_net_to_file(LENET, str(tmp_path / "net.png"), "LR", None, engine=engine)
    except MissingPackage as exc:
        pytest.skip(str(exc))
    assert used == engine
    image = png(tmp_path / "net.png")
    assert image.shape[1] > 2 * image.shape[0] > 200            # left to right: wide
    assert (image[1, 1] == 255).all()
    assert pixels_near(image, CONV_RGB, 2) > 500                 # the two convolutions
    assert run_cli(["draw", "--model", LENET, "--out", str(tmp_path / "net.svg"), "--rankdir",
                    "TB", "--phase", "TEST", "--engine", engine]) == 0
    svg = (tmp_path / "net.svg").read_text()
    assert "<svg" in svg and "train_data" not in svg
    tall = png_after_draw(tmp_path, engine)
    assert tall.shape[0] > tall.shape[1]


def png_after_draw(tmp_path, engine):
    from syncsgd.draw import draw_net_to_file
    draw_net_to_file(LENET, str(tmp_path / "tall.png"), "TB", TRAIN, engine=engine)
    return png(tmp_path / "tall.png")


def test_draw_falls_back_to_matplotlib_without_graphviz(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from syncsgd.draw import draw_net_to_file
    from syncsgd.plot import MissingPackage
    monkeypatch.setitem(sys.modules, "graphviz", None)
    assert draw_net_to_file(LENET, str(tmp_path / "n.svg"), phase=TEST) == "matplotlib"
    assert "conv1" in (tmp_path / "n.svg").read_text()
    with pytest.raises(MissingPackage, match="pip install graphviz"):
        draw_net_to_file(LENET, str(tmp_path / "n.svg"), engine="graphviz")


def test_draw_errors(tmp_path):
    from syncsgd.draw import draw_net_to_file
    with pytest.raises(SyncSGDError, match="rankdir"):
        draw_net_to_file(LENET, str(tmp_path / "x.png"), "XY")
    with pytest.raises(SyncSGDError, match="picture format"):
        draw_net_to_file(LENET, str(tmp_path / "x.gif"))
    with pytest.raises(SyncSGDError, match="phase"):
        run_cli(["draw", "--model", LENET, "--out", str(tmp_path / "x.png"), "--phase", "X"])


# -- the Python layer ---------------------------------------------------------------------------

PY_LAYERS = '''
import ast
import numpy as np
from syncsgd.python_layers.layer import PythonLayer


class ScaleShift(PythonLayer):
    """y = w[c] * x + b[c] per channel; w starts at param_str's 'init'."""

    def setup(self, bottom, top):
        init = ast.literal_eval(self.param_str).get("init", 1.0)
        channels = bottom[0].data.shape[1]
        self.blobs.add_blob(channels)
        self.blobs.add_blob(channels)
        self.blobs[0].data[...] = init
        self.seen_phase = self.phase

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def per_channel(self, k, x):
        return self.blobs[k].data.reshape((1, -1) + (1,) * (x.ndim - 2))

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = x * self.per_channel(0, x) + self.per_channel(1, x)

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        others = tuple(a for a in range(x.ndim) if a != 1)
        self.blobs[0].diff[...] += (dy * x).sum(axis=others)
        self.blobs[1].diff[...] += dy.sum(axis=others)
        if propagate_down[0]:
            bottom[0].diff[...] = dy * self.per_channel(0, x)


class EuclideanLoss(PythonLayer):
    """pycaffe's example loss layer, with the gradient scaled by the top's diff (the loss
    weight) as Caffe's own EuclideanLoss does."""

    def reshape(self, bottom, top):
        self.diff = np.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].data.shape[0] / 2.0

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if propagate_down[i]:
                sign = 1 if i == 0 else -1
                bottom[i].diff[...] = sign * top[0].diff[0] * self.diff / self.diff.shape[0]
'''


@pytest.fixture
def py_module(tmp_path, monkeypatch):
    """A module of user layers under a fresh name, importable like a user's own."""
    name = f"user_layers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PY_LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def python_text(module, layer, param_str="", bottoms=("x",), tops=("y",), extra=""):
    lines = " ".join([f'bottom: "{b}"' for b in bottoms] + [f'top: "{t}"' for t in tops])
    return (f'name: "py" type: "Python" {lines} python_param {{ module: "{module}" '
            f'layer: "{layer}" param_str: "{param_str}" }} {extra}')


def test_python_layer_follows_pycaffe_protocol_and_gradients(py_module):
    rng = np.random.default_rng(0)
    layer = make_layer(python_text(py_module, "ScaleShift", "{'init': 1.5}"))
    x = rng.standard_normal((4, 3, 2)).astype(np.float32)
    check_gradient(layer, blobs_from([x]), threshold=2e-3)
    layer = make_layer(python_text(py_module, "ScaleShift", "{'init': 1.5}"), TEST)
    top, bottom = Blob(name="y"), blobs_from([x])
    layer.setup(bottom, [top])
    assert layer.impl.param_str == "{'init': 1.5}" and layer.impl.seen_phase == TEST
    layer.reshape(bottom, [top])
    layer.forward(bottom, [top])
    np.testing.assert_allclose(top.data, 1.5 * x, rtol=1e-6)
    assert [b.shape for b in layer.blobs] == [(3,), (3,)]
    loss = make_layer(python_text(py_module, "EuclideanLoss", bottoms=("a", "b"),
                                  tops=("loss",)))
    a, b = rng.standard_normal((2, 5, 3)).astype(np.float32)
    check_gradient(loss, blobs_from([a, b]))


def test_python_layer_trains_in_a_net(py_module, tmp_path):
    import h5py
    from syncsgd import Net
    from syncsgd.solvers import get_solver
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    labels = np.argmax(x @ rng.standard_normal((6, 4)), axis=1).astype(np.float32)
    with h5py.File(tmp_path / "train.h5", "w") as f:
        f["data"], f["label"] = x, labels
    (tmp_path / "train.txt").write_text(f"{tmp_path / 'train.h5'}\n")
    net_path = tmp_path / "net.prototxt"
    net_path.write_text(textwrap.dedent(f"""\
        name: "PyNet"
        layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
                hdf5_data_param {{ source: "{tmp_path / 'train.txt'}" batch_size: 16 }} }}
        layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
        layer {{ {python_text(py_module, "ScaleShift", "{'init': 0.5}", ("ip",), ("scaled",))} }}
        layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "scaled" bottom: "label"
                top: "loss" }}
        """))
    solver_path = tmp_path / "solver.prototxt"
    solver_path.write_text(f'net: "{net_path}" base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
                           f'max_iter: 60 random_seed: 1 snapshot_after_train: false '
                           f'snapshot_prefix: "{tmp_path}/py"')
    solver = get_solver(str(solver_path))
    try:
        solver.step(1)
        first = solver.net.loss
        py = solver.net.layer_dict["py"]
        assert py.type == "Python" and solver.net.params["py"] is py.blobs
        solver.step(59)
        solver.net.forward()
        assert solver.net.loss < 0.5 * first
        assert not np.allclose(py.blobs[0].data, 0.5)        # the layer's own weights learned
        saved = tmp_path / "py.caffemodel"
        solver.net.save(str(saved))
        again = Net(str(net_path), str(saved), TEST)
        np.testing.assert_array_equal(again.params["py"][0].data, py.blobs[0].data)
        again.close()
    finally:
        solver.close()


def test_python_layer_errors(py_module, tmp_path):
    with pytest.raises(PrototxtError, match="cannot be imported; add the folder"):
        make_layer(python_text("no_such_module_xyz", "L"))
    with pytest.raises(PrototxtError, match="has no class 'Missing'"):
        make_layer(python_text(py_module, "Missing"))
    with pytest.raises(PrototxtError, match="needs `module`"):
        make_layer(python_text("", "L"))
    broken = f"{py_module}_broken"
    (tmp_path / f"{broken}.py").write_text("import a_dependency_that_is_missing\n")
    try:
        with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_missing"):
            make_layer(python_text(broken, "L"))
    finally:
        sys.modules.pop(broken, None)


def test_python_layer_base_class_asks_for_the_missing_methods():
    from syncsgd.python_layers.layer import PythonLayer
    with pytest.raises(NotImplementedError, match="must define reshape"):
        PythonLayer().reshape([], [])


# -- the verbs ----------------------------------------------------------------------------------

def test_register_adds_every_verb_with_both_flag_spellings():
    from syncsgd.cli.tools import register
    parser = argparse.ArgumentParser(prog="syncsgd")
    register(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["draw", "-model", "m.prototxt", "--out", "n.svg", "-rankdir", "TB"])
    assert (args.model, args.out, args.rankdir, args.phase) == ("m.prototxt", "n.svg", "TB",
                                                                 "ALL")
    args = parser.parse_args(["convert", "-gray", "--resize_height", "8", "-resize_width", "6",
                              "root", "list.txt", "db"])
    assert (args.gray, args.resize_height, args.resize_width, args.backend) == \
        (True, 8, 6, None)
    args = parser.parse_args(["plot", "a.log", "b.log", "-out", "c.png"])
    assert args.logs == ["a.log", "b.log"] and args.xaxis == "iters"
    args = parser.parse_args(["mean", "db"])
    assert args.output is None and args.dataset == "data"
    args = parser.parse_args(["parse-log", "x.log", "out", "-delimiter", ";"])
    assert args.delimiter == ";"
