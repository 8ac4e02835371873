"""Caffe's remaining data layers: ImageData (against OpenCV's imread and resize), MemoryData
(fed from Python, trained), WindowData (against a per-window port of Caffe's load_batch with
OpenCV), HDF5Output (round trip), their per-rank slices and their errors."""
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

import syncsgd
from syncsgd import TEST, TRAIN
from syncsgd.errors import DataError, PrototxtError, ShapeError
from syncsgd.io.image_files import resize_linear

cv2 = pytest.importorskip("cv2")
Image = pytest.importorskip("PIL.Image")

SEED = 1701


# -- helpers ------------------------------------------------------------------------------------

def write_images(folder, shapes, gray=False, seed=0):
    """PNG files i.png of random pixels, (h, w) each; returns their names."""
    rng = np.random.default_rng(seed)
    folder.mkdir(exist_ok=True)
    names = []
    for i, (h, w) in enumerate(shapes):
        pixels = rng.integers(0, 256, (h, w) if gray else (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        names.append(f"{i}.png")
    return names


def image_list(tmp_path, names, labels=None):
    labels = range(len(names)) if labels is None else labels
    path = tmp_path / "list.txt"
    path.write_text("".join(f"{n} {l}\n" for n, l in zip(names, labels)))
    return str(path)


def image_layer_text(source, batch, root, extra="", transform=""):
    return (f'name: "images" type: "ImageData" top: "data" top: "label" '
            f'image_data_param {{ source: "{source}" batch_size: {batch} root_folder: "{root}/" '
            f'{extra} }} {transform}')


def cv_chw(path, color=True, size=None):
    img = cv2.imread(str(path), cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE)
    if size is not None:
        img = cv2.resize(img, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return img[None] if img.ndim == 2 else img.transpose(2, 0, 1)


def batches(layer, top, n):
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append([b.data.copy() for b in top])
    return out


# -- the resize -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,new", [((7, 9), (13, 5)), ((20, 20), (10, 10)),
                                       ((16, 12), (5, 7)), ((5, 5), (17, 23)),
                                       ((31, 17), (8, 30)), ((1, 7), (3, 3)), ((6, 6), (6, 6))])
@pytest.mark.parametrize("channels", [1, 3])
def test_resize_equals_opencv_inter_linear_within_one_level(shape, new, channels):
    image = np.random.default_rng(3).integers(0, 256, (channels,) + shape, dtype=np.uint8)
    ours = resize_linear(image, *new)
    ref = cv2.resize(image.transpose(1, 2, 0), new[::-1], interpolation=cv2.INTER_LINEAR)
    ref = ref.reshape(new + (channels,)).transpose(2, 0, 1)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    assert np.abs(ours.astype(int) - ref).max() <= 1
    assert np.mean(ours != ref) < 0.3


def test_resize_of_a_constant_image_is_that_constant():
    image = np.full((3, 5, 8), 77, np.uint8)
    assert (resize_linear(image, 9, 3) == 77).all()


# -- ImageData ----------------------------------------------------------------------------------

def test_image_data_colour_images_are_opencv_bgr(tmp_path, layer_factory):
    names = write_images(tmp_path / "img", [(6, 8)] * 5)
    source = image_list(tmp_path, names, labels=[3, 1, 4, 1, 5])
    layer, top = layer_factory(image_layer_text(source, 5, tmp_path / "img"))
    assert top[0].shape == (5, 3, 6, 8) and top[1].shape == (5,)
    layer.forward([], top)
    for i, name in enumerate(names):
        np.testing.assert_array_equal(top[0].data[i], cv_chw(tmp_path / "img" / name))
    np.testing.assert_array_equal(top[1].data, [3, 1, 4, 1, 5])


def test_image_data_gray(tmp_path, layer_factory):
    gray = write_images(tmp_path / "g", [(5, 4)] * 2, gray=True)
    source = image_list(tmp_path, gray)
    layer, top = layer_factory(image_layer_text(source, 2, tmp_path / "g", "is_color: false"))
    assert top[0].shape == (2, 1, 5, 4)
    layer.forward([], top)
    for i, name in enumerate(gray):
        np.testing.assert_array_equal(top[0].data[i], cv_chw(tmp_path / "g" / name, False))
    # a gray file read in colour has three equal channels, as imread's IMREAD_COLOR gives
    layer, top = layer_factory(image_layer_text(source, 2, tmp_path / "g"))
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data[0], cv_chw(tmp_path / "g" / gray[0]))
    # colour read as gray: OpenCV's and Pillow's luma rounding may differ by one level
    colour = write_images(tmp_path / "c", [(5, 4)])
    layer, top = layer_factory(image_layer_text(image_list(tmp_path, colour), 1, tmp_path / "c",
                                                "is_color: false"))
    layer.forward([], top)
    assert np.abs(top[0].data[0] - cv_chw(tmp_path / "c" / colour[0], False)).max() <= 1


def test_image_data_resizes_mixed_sizes_as_opencv(tmp_path, layer_factory):
    names = write_images(tmp_path / "img", [(6, 8), (11, 5), (4, 4)])
    source = image_list(tmp_path, names)
    layer, top = layer_factory(image_layer_text(source, 3, tmp_path / "img",
                                                "new_height: 7 new_width: 9"))
    assert top[0].shape == (3, 3, 7, 9)
    layer.forward([], top)
    for i, name in enumerate(names):
        ref = cv_chw(tmp_path / "img" / name, size=(7, 9))
        assert np.abs(top[0].data[i] - ref).max() <= 1


def test_image_data_transform_crop_mirror_mean_scale(tmp_path, layer_factory):
    names = write_images(tmp_path / "img", [(6, 6)] * 2)
    source = image_list(tmp_path, names)
    transform = "transform_param { crop_size: 4 mean_value: 10 mean_value: 20 mean_value: 30 " \
                "scale: 0.5 }"
    layer, top = layer_factory(image_layer_text(source, 2, tmp_path / "img", "", transform),
                               phase=TEST)
    layer.forward([], top)
    for i, name in enumerate(names):
        ref = cv_chw(tmp_path / "img" / name).astype(np.float32)[:, 1:5, 1:5]
        ref = (ref - np.array([10, 20, 30], np.float32)[:, None, None]) * 0.5
        np.testing.assert_allclose(top[0].data[i], ref)


@pytest.mark.parametrize("size", [2, 3])
def test_image_data_rank_slices_are_the_one_process_batch(tmp_path, layer_factory, size):
    names = write_images(tmp_path / "img", [(6, 7)] * 7)
    source = image_list(tmp_path, names)
    text = image_layer_text(source, 5, tmp_path / "img", "shuffle: true rand_skip: 4",
                            "transform_param { crop_size: 5 mirror: true }")
    whole = batches(*layer_factory(text), 4)
    parts = [batches(*layer_factory(text, rank=r, size=size), 4) for r in range(size)]
    for k in range(4):
        for t in range(2):
            joined = np.concatenate([parts[r][k][t] for r in range(size)])
            np.testing.assert_array_equal(joined, whole[k][t])


def test_image_data_ranks_decode_only_their_slice(tmp_path, layer_factory, monkeypatch):
    from syncsgd.io import image_files
    names = write_images(tmp_path / "img", [(4, 4)] * 6)
    source = image_list(tmp_path, names)
    layer, top = layer_factory(image_layer_text(source, 6, tmp_path / "img"), rank=1, size=3)
    read = []
    real = image_files.read_image
    monkeypatch.setattr(image_files, "read_image",
                        lambda path, *a: read.append(Path(path).name) or real(path, *a))
    layer.seek(0)
    layer.forward([], top)
    assert read[:2] == ["2.png", "3.png"] and set(read) == {"2.png", "3.png"}  # and read-ahead
    np.testing.assert_array_equal(top[1].data, [2, 3])


def test_image_data_shuffle_is_seeded_and_a_permutation_per_epoch(tmp_path, layer_factory):
    names = write_images(tmp_path / "img", [(3, 3)] * 6)
    source = image_list(tmp_path, names)
    text = image_layer_text(source, 6, tmp_path / "img", "shuffle: true")
    epochs = [label for _, label in batches(*layer_factory(text), 3)]
    for label in epochs:
        np.testing.assert_array_equal(np.sort(label), np.arange(6))
    assert not np.array_equal(epochs[0], np.arange(6)) and not np.array_equal(epochs[0],
                                                                              epochs[1])
    again = [label for _, label in batches(*layer_factory(text), 3)]
    np.testing.assert_array_equal(again, epochs)
    other = [label for _, label in batches(*layer_factory(text, seed=5), 1)]
    assert not np.array_equal(other[0], epochs[0])


def test_image_data_rand_skip_and_seek(tmp_path, layer_factory):
    names = write_images(tmp_path / "img", [(3, 3)] * 5)
    source = image_list(tmp_path, names)
    text = image_layer_text(source, 2, tmp_path / "img", "rand_skip: 5")
    skips = set()
    for seed in range(8):
        layer, top = layer_factory(text, seed=seed)
        labels = [label for _, label in batches(layer, top, 4)]
        skip = int(labels[0][0])
        np.testing.assert_array_equal(np.concatenate(labels), (skip + np.arange(8)) % 5)
        skips.add(skip)
        layer.seek(1)
        np.testing.assert_array_equal(batches(layer, top, 1)[0][1], labels[1])
    assert len(skips) > 1 and skips <= set(range(5))


def test_image_data_errors_name_the_list_line(tmp_path, layer_factory):
    root = tmp_path / "img"
    names = write_images(root, [(4, 4), (5, 4)])
    with pytest.raises(DataError, match="not found"):
        layer_factory(image_layer_text(tmp_path / "none.txt", 1, root))
    bad = tmp_path / "bad.txt"
    bad.write_text("0.png 1\n\n1.png x\n")
    with pytest.raises(DataError, match=rf"{bad}:3: expected 'relative/path label'"):
        layer_factory(image_layer_text(bad, 1, root))
    missing = tmp_path / "missing.txt"
    missing.write_text("0.png 1\nnope.png 2\n")
    layer, top = layer_factory(image_layer_text(missing, 2, root))
    with pytest.raises(DataError, match=rf"{missing}:2: cannot read image '.*nope.png'"):
        layer.forward([], top)
    layer, top = layer_factory(image_layer_text(image_list(tmp_path, names), 2, root))
    with pytest.raises(DataError, match=r"list.txt:2: image .*1.png' is 5x4 but the first one "
                                        r"is 4x4; set image_data_param new_height"):
        layer.forward([], top)
    with pytest.raises(PrototxtError, match="new_height and new_width must be set together"):
        layer_factory(image_layer_text(image_list(tmp_path, names), 1, root, "new_height: 3"))
    with pytest.raises(PrototxtError, match="move it to transform_param"):
        layer_factory(image_layer_text(image_list(tmp_path, names), 1, root, "crop_size: 3"))
    (root / "junk.png").write_bytes(b"not an image")
    junk = tmp_path / "junk.txt"
    junk.write_text("junk.png 0\n")
    with pytest.raises(DataError, match=rf"{junk}:1: '.*junk.png' holds an image Pillow"):
        layer_factory(image_layer_text(junk, 1, root))


def test_image_data_net_trains_from_a_folder_of_pngs(tmp_path):
    names = write_images(tmp_path / "img", [(6, 6)] * 8)
    solver = write_image_solver(tmp_path, image_list(tmp_path, names, [i % 3 for i in range(8)]),
                                tmp_path / "img")
    s = syncsgd.get_solver(str(solver))
    before = s.net.params["ip"][0].data.copy()
    s.step(3)
    assert s.iter == 3 and not np.array_equal(before, s.net.params["ip"][0].data)
    s.close()


def write_image_solver(folder, source, root, extra_layers=""):
    net = f"""
    layer {{ name: "images" type: "ImageData" top: "data" top: "label"
            image_data_param {{ source: "{source}" root_folder: "{root}/" batch_size: 5
                               shuffle: true new_height: 5 new_width: 5 }}
            transform_param {{ crop_size: 4 mirror: true scale: 0.01 mean_value: 100 }} }}
    layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param {{ num_output: 3 kernel_size: 3
                                weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
            inner_product_param {{ num_output: 3 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
    {extra_layers}
    """
    (folder / "net.prototxt").write_text(net)
    solver = folder / "solver.prototxt"
    solver.write_text(f'net: "{folder}/net.prototxt" type: "SGD" base_lr: 0.1 momentum: 0.9 '
                      f'lr_policy: "fixed" max_iter: 4 random_seed: 3 '
                      f'snapshot_prefix: "{folder}/snap"')
    return solver


# -- MemoryData ---------------------------------------------------------------------------------

def memory_text(batch=4, shape=(2, 3, 3)):
    c, h, w = shape
    return (f'name: "mem" type: "MemoryData" top: "data" top: "label" memory_data_param '
            f'{{ batch_size: {batch} channels: {c} height: {h} width: {w} }}')


def memory_layer(text, rank=0, size=1):
    """A set-up MemoryData layer as rank `rank` of `size` (it has no thread to close)."""
    from syncsgd.blob import Blob
    from tests.gradcheck import make_layer
    layer = make_layer(text, TRAIN, SEED)
    layer.ctx.rank, layer.ctx.size = rank, size
    top = [Blob(name="data"), Blob(name="label")]
    layer.setup([], top)
    layer.reshape([], top)
    return layer, top


def memory_arrays(n=12, shape=(2, 3, 3), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n,) + shape).astype(np.float32),
            rng.integers(0, 3, n).astype(np.float32))


def test_memory_data_serves_consecutive_batches_and_wraps():
    data, labels = memory_arrays()
    layer, top = memory_layer(memory_text())
    assert top[0].shape == (4, 2, 3, 3) and top[1].shape == (4, 1, 1, 1)     # Caffe's labels
    layer.set_input_arrays(data, labels)
    for k in range(5):
        layer.forward([], top)
        rows = (k % 3) * 4 + np.arange(4)
        np.testing.assert_array_equal(top[0].data, data[rows])
        np.testing.assert_array_equal(top[1].data.reshape(-1), labels[rows])
    layer.reset(data, labels, 8)          # Caffe's Reset: the first n rows, from the start
    seen = [batches(layer, top, 1)[0][1].reshape(-1) for _ in range(3)]
    np.testing.assert_array_equal(np.concatenate(seen), labels[[0, 1, 2, 3, 4, 5, 6, 7, 0, 1,
                                                                2, 3]])
    layer.seek(1)
    np.testing.assert_array_equal(batches(layer, top, 1)[0][1].reshape(-1), labels[4:8])


def test_memory_data_rank_slices():
    data, labels = memory_arrays()
    whole = memory_layer(memory_text(batch=6))
    whole[0].set_input_arrays(data, labels)
    expected = batches(*whole, 3)
    parts = []
    for rank in range(4):
        layer, top = memory_layer(memory_text(batch=6), rank=rank, size=4)
        layer.set_input_arrays(data, labels)
        parts.append(batches(layer, top, 3))
        assert layer.ctx.global_batch == 6 and layer.ctx.batch_offset == layer.ctx.shard(6)[0]
    for k in range(3):
        for t in range(2):
            np.testing.assert_array_equal(np.concatenate([p[k][t] for p in parts]),
                                          expected[k][t])


def test_memory_data_checks_as_pycaffe():
    data, labels = memory_arrays()
    layer, top = memory_layer(memory_text())
    with pytest.raises(ShapeError, match="call net.set_input_arrays"):
        layer.forward([], top)
    with pytest.raises(ShapeError, match="multiple of batch_size 4"):
        layer.set_input_arrays(data[:10], labels[:10])
    with pytest.raises(ShapeError, match="float32"):
        layer.set_input_arrays(data.astype(np.float64), labels)
    with pytest.raises(ShapeError, match=r"shape \(N, 2, 3, 3\)"):
        layer.set_input_arrays(data.reshape(12, 2, 9, 1), labels)
    with pytest.raises(ShapeError, match="C contiguous"):
        layer.set_input_arrays(np.asfortranarray(data), labels)
    with pytest.raises(ShapeError, match="same first dimension"):
        layer.set_input_arrays(data, labels[:8])
    layer.set_input_arrays(data, labels.reshape(12, 1, 1, 1))   # pycaffe's 4-d labels
    layer.forward([], top)
    np.testing.assert_array_equal(top[1].data.reshape(-1), labels[:4])
    with pytest.raises(PrototxtError, match="positive"):
        memory_layer('name: "m" type: "MemoryData" top: "data" top: "label" '
                      'memory_data_param { batch_size: 2 channels: 1 height: 0 width: 3 }')


MEMORY_NET = """
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 4 channels: 2 height: 3 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def solver_for(tmp_path, net, name):
    (tmp_path / f"{name}.prototxt").write_text(net)
    solver = tmp_path / f"{name}_solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/{name}.prototxt" type: "SGD" base_lr: 0.2 '
                      f'momentum: 0.9 lr_policy: "fixed" max_iter: 10 random_seed: 2 '
                      f'snapshot_prefix: "{tmp_path}/{name}"')
    return str(solver)


def test_memory_data_trains_like_the_same_rows_from_hdf5(tmp_path):
    data, labels = memory_arrays()
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f["data"], f["label"] = data, labels
    (tmp_path / "rows.txt").write_text(f"{tmp_path}/rows.h5\n")
    hdf5_net = MEMORY_NET.replace(
        'type: "MemoryData"', 'type: "HDF5Data"').replace(
        "memory_data_param { batch_size: 4 channels: 2 height: 3 width: 3 }",
        f'hdf5_data_param {{ source: "{tmp_path}/rows.txt" batch_size: 4 }}')
    memory = syncsgd.get_solver(solver_for(tmp_path, MEMORY_NET, "mem"))
    memory.net.set_input_arrays(data, labels)
    reference = syncsgd.get_solver(solver_for(tmp_path, hdf5_net, "h5"))
    memory.step(5)
    reference.step(5)
    for a, b in zip(memory.net.params["ip"], reference.net.params["ip"]):
        np.testing.assert_array_equal(a.data, b.data)
    assert not np.allclose(memory.net.params["ip"][0].data, 0)
    memory.close()
    reference.close()


def test_net_set_input_arrays_needs_memory_data_first(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text('layer { name: "in" type: "Input" top: "x" '
                    'input_param { shape { dim: 2 dim: 3 } } }')
    with pytest.raises(PrototxtError, match="first layer is a MemoryData layer"):
        syncsgd.Net(str(path), TEST).set_input_arrays(*memory_arrays())


# -- WindowData ---------------------------------------------------------------------------------

WINDOWS = [  # per image: (height, width, [(label, overlap, x1, y1, x2, y2)])
    (20, 24, [(1, 0.9, 2, 3, 12, 15), (2, 0.7, 10, 0, 23, 19), (0, 0.1, 0, 0, 5, 5),
              (3, 0.4, 1, 1, 4, 4)]),
    (16, 18, [(2, 0.6, 5, 4, 17, 15), (0, 0.2, 3, 3, 9, 14), (1, 0.05, 0, 8, 17, 15)]),
]


def write_window_file(tmp_path):
    names = write_images(tmp_path / "win", [(h, w) for h, w, _ in WINDOWS], seed=4)
    lines = []
    for i, (name, (h, w, windows)) in enumerate(zip(names, WINDOWS)):
        lines += [f"# {i}", name, "3", str(h), str(w), str(len(windows))]
        lines += [" ".join(map(str, window)) for window in windows]
    path = tmp_path / "windows.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def window_text(source, root, batch=8, extra="", transform="crop_size: 10 mirror: true"):
    return (f'name: "win" type: "WindowData" top: "data" top: "label" '
            f'window_data_param {{ source: "{source}" root_folder: "{root}/" batch_size: {batch} '
            f'fg_fraction: 0.5 {extra} }} transform_param {{ {transform} }}')


def c_round(x):
    return int(math.copysign(math.floor(abs(float(x)) + 0.5), x))


def caffe_window(image, box, crop, context_pad, square, mirror, mean, scale):
    """One window as Caffe's load_batch makes it, scalar by scalar, with OpenCV."""
    f32 = np.float32
    x1, y1, x2, y2 = box
    rows, cols = image.shape[:2]
    pad_w = pad_h = 0
    size = (crop, crop)
    if context_pad > 0 or square:
        context_scale = f32(crop) / f32(crop - 2 * context_pad)
        half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
        cx, cy = f32(x1) + half_w, f32(y1) + half_h
        if square:
            half_h = half_w = max(half_h, half_w)
        x1, x2 = c_round(cx - half_w * context_scale), c_round(cx + half_w * context_scale)
        y1, y2 = c_round(cy - half_h * context_scale), c_round(cy + half_h * context_scale)
        uh, uw = y2 - y1 + 1, x2 - x1 + 1
        px1, py1 = max(0, -x1), max(0, -y1)
        px2, py2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
        x1, x2, y1, y2 = x1 + px1, x2 - px2, y1 + py1, y2 - py2
        sx, sy = f32(crop) / f32(uw), f32(crop) / f32(uh)
        w, h = c_round(f32(x2 - x1 + 1) * sx), c_round(f32(y2 - y1 + 1) * sy)
        px1, px2 = c_round(f32(px1) * sx), c_round(f32(px2) * sx)
        py1 = c_round(f32(py1) * sy)
        pad_h, pad_w = py1, (px2 if mirror else px1)
        size = (min(h, crop - pad_h), min(w, crop - pad_w))
    warped = cv2.resize(image[y1:y2 + 1, x1:x2 + 1], size[::-1], interpolation=cv2.INTER_LINEAR)
    if mirror:
        warped = cv2.flip(warped, 1)
    out = np.zeros((3, crop, crop), np.float32)
    region = (slice(None), slice(pad_h, pad_h + size[0]), slice(pad_w, pad_w + size[1]))
    out[region] = (warped.transpose(2, 0, 1) - mean[region]) * scale
    return out


@pytest.mark.parametrize("extra", ["", "context_pad: 2", 'crop_mode: "square"',
                                   'context_pad: 3 crop_mode: "square" cache_images: true'])
def test_window_data_equals_caffes_load_batch(tmp_path, layer_factory, extra):
    source = write_window_file(tmp_path)
    layer, top = layer_factory(window_text(source, tmp_path / "win", extra=extra + " scale: 0.5",
                                           transform="crop_size: 10 mirror: true "
                                                     "mean_value: 50 mean_value: 60 "
                                                     "mean_value: 70"))
    assert top[0].shape == (8, 3, 10, 10) and top[1].shape == (8,)
    param = layer.param.window_data_param
    mean = np.broadcast_to(np.array([50, 60, 70], np.float32)[:, None, None], (3, 10, 10))
    images = [cv2.imread(str(tmp_path / "win" / f"{i}.png")) for i in range(len(WINDOWS))]
    flips = []
    for k in range(3):
        rows, flip = layer._reader(0, 8).pick(k)
        flips.extend(flip.tolist())
        layer.forward([], top)
        labels = top[1].data
        assert (labels[:4] == 0).all() and (labels[4:] > 0).all()
        np.testing.assert_array_equal(labels, rows[:, 1])
        for i, row in enumerate(rows):
            ref = caffe_window(images[row[0]], row[2:], 10, param.context_pad,
                               param.crop_mode == "square", flip[i], mean, 0.5)
            assert np.abs(top[0].data[i] - ref).max() <= 0.5 + 1e-6   # one level, scaled
    assert any(flips) and not all(flips)


def test_window_data_sets_follow_thresholds(tmp_path, layer_factory):
    source = write_window_file(tmp_path)
    layer, _ = layer_factory(window_text(source, tmp_path / "win"))
    background, foreground = layer.windows
    # overlap >= 0.5 foreground with its label; < 0.5 background with label 0 (0.4 too)
    assert sorted(map(tuple, foreground[:, :2])) == [(0, 1), (0, 2), (1, 2)]
    assert len(background) == 4 and (background[:, 1] == 0).all()
    layer, _ = layer_factory(window_text(source, tmp_path / "win",
                                         extra="bg_threshold: 0.3 fg_threshold: 0.8"))
    assert len(layer.windows[1]) == 1 and len(layer.windows[0]) == 3


@pytest.mark.parametrize("size", [2, 3])
def test_window_data_rank_slices_are_the_one_process_batch(tmp_path, layer_factory, size):
    source = write_window_file(tmp_path)
    text = window_text(source, tmp_path / "win", batch=7, extra="context_pad: 2")
    whole = batches(*layer_factory(text), 3)
    parts = [batches(*layer_factory(text, rank=r, size=size), 3) for r in range(size)]
    for k in range(3):
        for t in range(2):
            np.testing.assert_array_equal(np.concatenate([p[k][t] for p in parts]), whole[k][t])


def test_window_data_mean_file(tmp_path, layer_factory):
    from syncsgd.io.mean import save_mean
    source = write_window_file(tmp_path)
    mean = np.random.default_rng(1).uniform(0, 255, (1, 3, 14, 14)).astype(np.float32)
    save_mean(str(tmp_path / "mean.binaryproto"), mean)
    layer, top = layer_factory(window_text(
        source, tmp_path / "win", transform=f'crop_size: 10 mean_file: "{tmp_path}/mean.'
                                            f'binaryproto"'))
    plain, plain_top = layer_factory(window_text(source, tmp_path / "win",
                                                 transform="crop_size: 10"))
    scaled, scaled_top = layer_factory(window_text(source, tmp_path / "win",
                                                   transform="crop_size: 10 scale: 0.25"))
    for each in (layer, plain, scaled):
        each.forward([], top if each is layer else plain_top if each is plain else scaled_top)
    np.testing.assert_allclose(top[0].data, plain_top[0].data - mean[0, :, 2:12, 2:12],
                               rtol=1e-6)
    np.testing.assert_allclose(scaled_top[0].data, plain_top[0].data * 0.25)


def test_window_data_errors(tmp_path, layer_factory):
    source = write_window_file(tmp_path)
    root = tmp_path / "win"
    with pytest.raises(DataError, match="cannot be read"):
        layer_factory(window_text(tmp_path / "none.txt", root))
    bad = tmp_path / "bad.txt"
    bad.write_text("# 0\n0.png\n3\n20\n24\n1\n1 0.9 2 3 x 15\n")
    with pytest.raises(DataError, match=rf"{bad}:7: expected a window coordinate, got 'x'"):
        layer_factory(window_text(bad, root))
    bad.write_text("# 0\n0.png\n3\n20\n24\n1\n0 0.9 2 3 4 15\n")
    with pytest.raises(DataError, match=rf"{bad}:7: foreground window with label 0"):
        layer_factory(window_text(bad, root))
    with pytest.raises(DataError, match="no background windows"):
        layer_factory(window_text(source, root, extra="bg_threshold: 0.01"))
    with pytest.raises(PrototxtError, match="crop_size must be set"):
        layer_factory(window_text(source, root, transform="mirror: true"))
    with pytest.raises(PrototxtError, match="both window_data_param.scale and transform_param"):
        layer_factory(window_text(source, root, extra="scale: 3",
                                  transform="crop_size: 8 scale: 2"))
    bad.write_text("# 0\nmissing.png\n3\n20\n24\n1\n1 0.9 2 3 4 15\n"
                   "# 1\nmissing.png\n3\n20\n24\n1\n0 0.1 2 3 4 15\n")
    layer, top = layer_factory(window_text(bad, root))
    with pytest.raises(DataError, match="image [01]: cannot read image '.*missing.png'"):
        layer.forward([], top)


# -- HDF5Output ---------------------------------------------------------------------------------

def test_hdf5_output_round_trip(tmp_path):
    data, labels = memory_arrays(8)
    out = tmp_path / "out.h5"
    path = tmp_path / "net.prototxt"
    path.write_text(MEMORY_NET.split('layer { name: "ip"')[0] +
                    f'layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label" '
                    f'hdf5_output_param {{ file_name: "{out}" }} }}')
    net = syncsgd.Net(str(path), TRAIN)
    net.set_input_arrays(data, labels)
    assert out.exists()
    net.forward()
    net.forward()
    net.forward()
    net.close()
    with h5py.File(out, "r") as f:
        assert f["data"].dtype == np.float32 and f["label"].shape == (12, 1, 1, 1)
        np.testing.assert_array_equal(f["data"][:], np.concatenate([data, data[:4]]))
        np.testing.assert_array_equal(f["label"][:, 0, 0, 0], np.concatenate([labels,
                                                                               labels[:4]]))
    (tmp_path / "list.txt").write_text(f"{out}\n")
    reader = syncsgd.Net(str(_hdf5_net(tmp_path)), TEST)
    reader.forward()
    np.testing.assert_array_equal(reader.blobs["data"].data, data[:4])
    reader.close()


def _hdf5_net(tmp_path):
    path = tmp_path / "reader.prototxt"
    path.write_text(f'layer {{ name: "in" type: "HDF5Data" top: "data" top: "label" '
                    f'hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 4 }} }}')
    return path


def test_hdf5_output_errors(tmp_path, layer_factory):
    from syncsgd.blob import Blob
    from tests.gradcheck import make_layer
    layer = make_layer(f'name: "o" type: "HDF5Output" bottom: "a" bottom: "b" '
                       f'hdf5_output_param {{ file_name: "{tmp_path}/no/such/dir/x.h5" }}')
    with pytest.raises(DataError, match="cannot create HDF5 file"):
        layer.setup([Blob((2, 3)), Blob((2,))], [])
    layer = make_layer('name: "o" type: "HDF5Output" bottom: "a" bottom: "b"')
    with pytest.raises(PrototxtError, match="file_name is empty"):
        layer.setup([Blob((2, 3)), Blob((2,))], [])
    layer = make_layer(f'name: "o" type: "HDF5Output" bottom: "a" bottom: "b" '
                       f'hdf5_output_param {{ file_name: "{tmp_path}/x.h5" }}')
    bottom = [Blob((2, 3)), Blob((3,))]
    layer.setup(bottom, [])
    with pytest.raises(ShapeError, match="same number of rows"):
        layer.reshape(bottom, [])
    layer.close()
    other = make_layer(f'name: "o" type: "HDF5Output" bottom: "a" bottom: "b" '
                       f'hdf5_output_param {{ file_name: "{tmp_path}/y.h5" }}')
    other.ctx.rank, other.ctx.size = 1, 2
    other.setup([Blob((2, 3)), Blob((2,))], [])
    assert not (tmp_path / "y.h5").exists()     # only rank 0 writes


# -- two ranks ----------------------------------------------------------------------------------

@pytest.mark.mpi
def test_cli_train_with_image_data_on_two_ranks_equals_one_process(tmp_path):
    import mpirun
    names = write_images(tmp_path / "img", [(7, 6), (5, 5), (6, 8)] * 3)
    source = image_list(tmp_path, names, [i % 3 for i in range(9)])
    runs = {}
    for n in (1, 2):
        folder = tmp_path / f"run{n}"
        folder.mkdir()
        out = folder / "seen.h5"
        writer = (f'layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label" '
                  f'hdf5_output_param {{ file_name: "{out}" }} }}')
        solver = write_image_solver(folder, source, tmp_path / "img", writer)
        mpirun.run(n, "-m", "syncsgd.cli", "train", "--solver", solver)
        with h5py.File(out, "r") as f:
            seen = f["data"][:], f["label"][:]
        net = syncsgd.Net(str(folder / "net.prototxt"), str(folder / "snap_iter_4.caffemodel"),
                          TEST)                  # (building it truncates seen.h5, as in Caffe)
        runs[n] = ({f"{k}/{i}": b.data.copy() for k, blobs in net.params.items()
                    for i, b in enumerate(blobs)},) + seen
        net.close()
    (one, one_data, one_label), (two, two_data, two_label) = runs[1], runs[2]
    assert one_data.shape == (20, 3, 4, 4)
    np.testing.assert_array_equal(two_data, one_data)     # the gathered batches, in order
    np.testing.assert_array_equal(two_label, one_label)
    for key in one:
        scale = max(float(np.abs(one[key]).max()), 1e-3)
        assert float(np.abs(one[key] - two[key]).max()) / scale <= 1e-5, key
