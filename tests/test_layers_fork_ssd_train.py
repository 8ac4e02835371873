"""Detection training layers: py-faster-rcnn's SmoothL1Loss, SSD's MultiBoxLoss and AnnotatedData.

Values against numpy references written from the forks' C++ (loops, as the C++ has them),
gradient checks, 2 ranks = 1 process, errors, and a tiny SSD training net on an LMDB this
module writes."""
import json
import os

import cv2
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TRAIN
from syncsgd.compile import load_net_param
from syncsgd.context import Context
from syncsgd.errors import PrototxtError, ShapeError
from syncsgd.io.lmdb import write_lmdb
from syncsgd.layers import create
from syncsgd.proto import pb
from tests.gradcheck import blobs_from, check_gradient, make_layer, run_forward
from tests.test_layers_loss import as_two_ranks, assert_split_equals_whole



def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- SmoothL1Loss --------------------------------------------------------------------------------
def smooth_l1_ref(x, t, sigma=1.0, w_in=None, w_out=None):
    """rbgirshick/caffe-fast-rcnn's SmoothL1Forward, one element at a time."""
    s2 = sigma * sigma
    total = 0.0
    for k in np.ndindex(x.shape):
        d = float(x[k]) - float(t[k])
        d *= 1.0 if w_in is None else float(w_in[k])
        f = 0.5 * d * d * s2 if abs(d) < 1.0 / s2 else abs(d) - 0.5 / s2
        total += f * (1.0 if w_out is None else float(w_out[k]))
    return total / x.shape[0]


def test_smooth_l1_values_and_gradients():
    x, t = randn(4, 3, 2) * 2, randn(4, 3, 2, seed=1)
    w_in, w_out = np.abs(randn(4, 3, 2, seed=2)), np.abs(randn(4, 3, 2, seed=3))
    (loss,) = (b.data for b in run_forward(make_layer("type: 'SmoothL1Loss'"),
                                           blobs_from([x, t])))
    assert abs(float(loss) - smooth_l1_ref(x, t)) < 1e-5
    text = "type: 'SmoothL1Loss' smooth_l1_loss_param { sigma: 3 }"
    (loss,) = run_forward(make_layer(text), blobs_from([x, t, w_in, w_out]))
    assert abs(float(loss.data) - smooth_l1_ref(x, t, 3.0, w_in, w_out)) < 1e-5
    check_gradient(make_layer(text), blobs_from([x, t, w_in, w_out]), check_bottom=[0, 1],
                   step=1e-3)
    check_gradient(make_layer("type: 'SmoothL1Loss'"), blobs_from([x, t]), step=1e-3)


def test_smooth_l1_split_between_ranks():
    x, t = randn(5, 4), randn(5, 4, seed=1)
    assert_split_equals_whole("type: 'SmoothL1Loss' smooth_l1_loss_param { sigma: 2 }",
                              [x, t], cut=2, propagate=(True, True))


def test_smooth_l1_errors():
    x = randn(2, 3)
    with pytest.raises(ShapeError, match="outside weights"):
        run_forward(make_layer("type: 'SmoothL1Loss'"), blobs_from([x, x, x]))
    with pytest.raises(ShapeError, match="sigma"):
        run_forward(make_layer("type: 'SmoothL1Loss' smooth_l1_loss_param { sigma: 0 }"),
                    blobs_from([x, x]))
    with pytest.raises(ShapeError, match="shape"):
        run_forward(make_layer("type: 'SmoothL1Loss'"), blobs_from([x, randn(2, 4)]))


# -- MultiBoxLoss --------------------------------------------------------------------------------
def priors_grid(cells=4, sizes=(0.3, 0.55)):
    """PriorBox-like (1, 2, P*4): per cell of a cells x cells grid, one square per size."""
    boxes = []
    for y in range(cells):
        for x in range(cells):
            cx, cy = (x + 0.5) / cells, (y + 0.5) / cells
            boxes += [[cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2] for s in sizes]
    boxes = np.array(boxes, np.float32)
    out = np.empty((1, 2, boxes.size), np.float32)
    out[0, 0] = boxes.ravel()
    out[0, 1] = np.tile(np.float32([0.1, 0.1, 0.2, 0.2]), len(boxes))
    return out


def gt_rows(images, seed=0, per_image=2, classes=3):
    """AnnotatedData's (1, 1, G, 8) rows for images 0..images-1 (image 1 has no box)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(images):
        if i == 1:
            continue
        for _ in range(per_image):
            x0, y0 = rng.uniform(0, 0.6, 2)
            w, h = rng.uniform(0.2, 0.4, 2)
            rows.append([i, rng.integers(1, classes), 0, x0, y0, x0 + w, y0 + h, 0])
    return np.array(rows, np.float32).reshape(1, 1, -1, 8)


def jaccard(a, b):
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def multibox_ref(loc, conf, priors, labels, classes=3, ratio=3.0, threshold=0.5, neg=0.5,
                 mining=True, match_type="PER_PREDICTION"):
    """SSD's MultiBoxLoss forward (share_location, prior matching, CENTER_SIZE, SMOOTH_L1,
    SOFTMAX, VALID), with the C++'s loops over priors and ground truth."""
    num, count = loc.shape[0], priors.shape[-1] // 4
    pri = priors[0, 0].reshape(-1, 4).astype(np.float64)
    var = priors[0, 1].reshape(-1, 4).astype(np.float64)
    loc = loc.reshape(num, count, 4).astype(np.float64)
    conf = conf.reshape(num, count, classes).astype(np.float64)
    loc_sum = conf_sum = 0.0
    matches = 0
    for i in range(num):
        gts = [r for r in labels.reshape(-1, 8) if r[0] == i]
        match = [-1] * count
        best = [0.0] * count
        iou = {}
        for p in range(count):
            for g, r in enumerate(gts):
                o = jaccard(pri[p], r[3:7])
                if o > 1e-6:
                    best[p] = max(best[p], o)
                    iou[(p, g)] = o
        pool = list(range(len(gts)))
        while pool:
            top = (-1, -1, -1.0)
            for p in range(count):
                if match[p] != -1:
                    continue
                for g in pool:
                    if (p, g) in iou and iou[(p, g)] > top[2]:
                        top = (p, g, iou[(p, g)])
            if top[0] == -1:
                break
            match[top[0]], best[top[0]] = top[1], top[2]
            pool.remove(top[1])
        if match_type == "PER_PREDICTION":
            for p in range(count):
                if match[p] != -1:
                    continue
                cand = [(iou[(p, g)], g) for g in range(len(gts))
                        if (p, g) in iou and iou[(p, g)] >= threshold]
                if cand:
                    o, g = max(cand, key=lambda c: (c[0], -c[1]))
                    match[p], best[p] = g, o
        label = [int(gts[match[p]][1]) if match[p] > -1 else 0 for p in range(count)]

        def ce(p):
            z = conf[i, p] - conf[i, p].max()
            return -(z[label[p]] - np.log(np.exp(z).sum()))
        positives = [p for p in range(count) if match[p] > -1]
        matches += len(positives)
        for p in positives:
            g = gts[match[p]][3:7]
            pw, ph = pri[p, 2] - pri[p, 0], pri[p, 3] - pri[p, 1]
            target = [((g[0] + g[2]) / 2 - (pri[p, 0] + pri[p, 2]) / 2) / pw / var[p, 0],
                      ((g[1] + g[3]) / 2 - (pri[p, 1] + pri[p, 3]) / 2) / ph / var[p, 1],
                      np.log((g[2] - g[0]) / pw) / var[p, 2],
                      np.log((g[3] - g[1]) / ph) / var[p, 3]]
            for k in range(4):
                d = abs(loc[i, p, k] - target[k])
                loc_sum += 0.5 * d * d if d < 1 else d - 0.5
        if not mining:
            conf_sum += sum(ce(p) for p in range(count))
            continue
        if not gts:
            continue
        eligible = sorted(((ce(p), p) for p in range(count)
                           if match[p] == -1 and best[p] < neg), reverse=True)
        chosen = [p for _, p in eligible[:min(int(len(positives) * ratio), len(eligible))]]
        conf_sum += sum(ce(p) for p in positives + chosen)
    return (loc_sum + conf_sum) / max(1, matches)


MULTIBOX = ("type: 'MultiBoxLoss' propagate_down: true propagate_down: true "
            "propagate_down: false propagate_down: false "
            "multibox_loss_param {{ num_classes: 3 code_type: CENTER_SIZE {extra} }}")


def multibox_case(num=3, seed=0):
    count = 32
    return [randn(num, count * 4, seed=seed), randn(num, count * 3, seed=seed + 1),
            priors_grid(), gt_rows(num, seed=seed)]


@pytest.mark.parametrize("extra, kwargs", [
    ("", {}),
    ("match_type: BIPARTITE neg_pos_ratio: 2", {"match_type": "BIPARTITE", "ratio": 2.0}),
    ("mining_type: NONE", {"mining": False}),
    ("overlap_threshold: 0.3 neg_overlap: 0.4", {"threshold": 0.3, "neg": 0.4})])
def test_multibox_loss_equals_reference(extra, kwargs):
    arrays = multibox_case()
    (loss,) = run_forward(make_layer(MULTIBOX.format(extra=extra)), blobs_from(arrays))
    want = multibox_ref(*arrays, **kwargs)
    assert abs(float(loss.data) - want) <= 1e-5 * max(1, abs(want))


def test_multibox_loss_gradients():
    arrays = multibox_case(num=2, seed=4)
    check_gradient(make_layer(MULTIBOX.format(extra="")), blobs_from(arrays), check_bottom=[0],
                   step=1e-3, max_points=60)
    check_gradient(make_layer(MULTIBOX.format(extra="mining_type: NONE")), blobs_from(arrays),
                   check_bottom=[1], step=1e-3, max_points=60)


def multibox_ranks(text, arrays, cut, weight=1.3):
    """(one process (loss, loc diff, conf diff), the two ranks' joined) for a batch split at
    `cut`: each rank gets its images' labels with image ids counted in its slice."""
    loc, conf, priors, labels = arrays
    rows = labels.reshape(-1, 8)

    def run(ctx, part):
        layer = create(text_format.Parse(text, pb.LayerParameter()), ctx)
        bottom = blobs_from(part)
        top = run_forward(layer, bottom)
        top[0].diff[...] = weight
        layer.backward(top, [True, True, False, False], bottom)
        return float(top[0].data), bottom[0].diff.copy(), bottom[1].diff.copy()

    def part(rank):
        keep = rows[:, 0] < cut if rank == 0 else rows[:, 0] >= cut
        mine = rows[keep].copy()
        mine[:, 0] -= 0 if rank == 0 else cut
        sl = slice(0, cut) if rank == 0 else slice(cut, None)
        return [loc[sl], conf[sl], priors, mine.reshape(1, 1, -1, 8)]

    whole = run(Context(TRAIN, seed=1), arrays)
    ranks = as_two_ranks(lambda r, allreduce: run(
        Context(TRAIN, seed=1, rank=r, size=2, allreduce=allreduce), part(r)))
    return whole, ranks


@pytest.mark.parametrize("extra", ["", "mining_type: NONE",
                                   "loc_weight: 2 conf_loss_type: LOGISTIC"])
def test_multibox_loss_split_between_ranks(extra):
    whole, ranks = multibox_ranks(MULTIBOX.format(extra=extra), multibox_case(num=4), cut=1)
    for loss, _, _ in ranks:
        assert abs(loss - whole[0]) <= 1e-6 * max(1, abs(whole[0]))
    for k in (1, 2):
        np.testing.assert_allclose(np.concatenate([r[k] for r in ranks]), whole[k],
                                   rtol=1e-5, atol=1e-7)


def test_multibox_loss_errors():
    arrays = multibox_case(num=2)
    bad = {"num_classes": "type: 'MultiBoxLoss' multibox_loss_param { }",
           "HARD_EXAMPLE": MULTIBOX.format(extra="mining_type: HARD_EXAMPLE"),
           "share_location": MULTIBOX.format(extra="share_location: false"),
           "location values": MULTIBOX.format(extra="").replace("num_classes: 3",
                                                                  "num_classes: 4")}
    for message, text in bad.items():
        with pytest.raises(ShapeError, match=message):
            run_forward(make_layer(text), blobs_from(arrays))
    labels = arrays[3].copy()
    labels[0, 0, 0, 1] = 0
    with pytest.raises(ShapeError, match="background"):
        run_forward(make_layer(MULTIBOX.format(extra="")), blobs_from(arrays[:3] + [labels]))


# -- the fork itself (brocolli-caffe), through golden files ------------------------------------
# Each case: the layer under test, its seeded bottoms, and what the SSD fork gave for them,
# recorded by `python -m tests.test_layers_fork_ssd_train` with the fork built
# (tools/oracle/build-fork-caffe.sh) into tests/golden/fork/<case>.npz (README there).
FORK_ENV = os.environ.get("SSD_FORK_ENV",
                          os.path.expanduser("~/.cache/brocolli-caffe-9.0.2/env.sh"))
GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden", "fork")
WORKER = os.path.join(os.path.dirname(__file__), "oracle_worker.py")
BOTTOMS = ("loc", "conf", "priors", "label")


def multibox_text(extra):
    return (f"name: 'loss' type: 'MultiBoxLoss' bottom: 'loc' bottom: 'conf' "
            f"bottom: 'priors' bottom: 'label' top: 'loss' propagate_down: true "
            f"propagate_down: true propagate_down: false propagate_down: false "
            f"multibox_loss_param {{ num_classes: 3 {extra} }}")


def fork_cases():
    """name -> (layer text, bottoms {blob: array}); the bottoms are seeded by the name."""
    cases = {}
    for k, (extra, loss) in enumerate([
            ("code_type: CENTER_SIZE", ""),
            ("code_type: CENTER_SIZE match_type: BIPARTITE neg_pos_ratio: 1.5 "
             "overlap_threshold: 0.3 neg_overlap: 0.3", ""),
            ("code_type: CORNER mining_type: NONE loc_loss_type: L2 loc_weight: 2",
             "loss_param { normalization: FULL } "),
            ("code_type: CORNER_SIZE conf_loss_type: LOGISTIC encode_variance_in_target: true "
             "bp_inside: true", "loss_param { normalization: BATCH_SIZE } "),
            ("code_type: CENTER_SIZE share_location: false mining_type: NONE "
             "use_prior_for_matching: false", "")]):
        num = 3
        loc_classes = 3 if "share_location: false" in extra else 1
        arrays = multibox_case(num=num, seed=10 + k)
        arrays[0] = randn(num, 32 * loc_classes * 4, seed=20 + k) * 0.5
        cases[f"multibox_{k}"] = (loss + multibox_text(extra), dict(zip(BOTTOMS, arrays)))
    x, t = randn(3, 8) * 2, randn(3, 8, seed=1)
    cases["smooth_l1"] = ("name: 'loss' type: 'SmoothL1Loss' bottom: 'loc' bottom: 'conf' "
                          "top: 'loss'", {"loc": x, "conf": t})
    return cases


def fork_net(layer, bottoms):
    """The fork's net: Input bottoms, and a zero Bias (a learnable layer) before the bottoms
    whose gradient is compared, since a loss refuses a forced backward into bottom 1."""
    lines = ["name: 'case'"]
    for name, array in bottoms.items():
        dims = " ".join(f"dim: {d}" for d in array.shape)
        top = f"{name}_in" if name in COMPARED else name
        lines.append(f"layer {{ name: '{top}' type: 'Input' top: '{top}' "
                     f"input_param {{ shape {{ {dims} }} }} }}")
        if name in COMPARED:
            lines.append(f"layer {{ name: '{name}_bias' type: 'Bias' bottom: '{top}' "
                         f"top: '{name}' }}")
    lines.append(f"layer {{ {layer} }}")
    return "\n".join(lines)


COMPARED = ("loc", "conf")
ANNOTATED = ("name: 'data' type: 'AnnotatedData' top: 'data' top: 'label' "
             "transform_param { mean_value: 10 mean_value: 20 mean_value: 30 scale: 0.5 "
             "emit_constraint { emit_type: CENTER } } "
             "data_param { source: '$DIR/db' batch_size: 3 backend: LMDB }")


def run_fork(folder, net, bottoms, backward):
    """{data.<blob>, diff.<blob>} the fork gives for the net (oracle_worker.py's protocol)."""
    import subprocess
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "net.prototxt"), "w") as f:
        f.write(net)
    compared = [name for name in COMPARED if name in bottoms]
    meta = {"name": os.path.basename(folder), "kind": "layer", "phase": "TRAIN", "passes": 1,
            "backward": backward, "diffs": compared}
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    np.savez(os.path.join(folder, "inputs.npz"),
             **{f"in.{name}_in" if name in compared else f"in.{name}": value
                for name, value in bottoms.items()})
    subprocess.run(["bash", "-c", f"source '{FORK_ENV}' && python '{WORKER}' '{folder}'"],
                   check=True, capture_output=True, timeout=300)
    with np.load(os.path.join(folder, "bvlc.npz")) as out:
        return {key: out[key] for key in out.files if key.split(".", 1)[0] in ("data", "diff")}


def fork_loss_answers(folder, layer, bottoms):
    out = run_fork(folder, fork_net(layer, bottoms), bottoms, backward=True)
    return {"loss": out["data.loss"]} | {f"diff.{n}": out[f"diff.{n}"]
                                         for n in COMPARED if n in bottoms}


def fork_annotated_answers(folder):
    os.makedirs(folder, exist_ok=True)
    write_annotated_lmdb(os.path.join(folder, "db"), count=5)
    out = run_fork(folder, f"layer {{ {ANNOTATED.replace('$DIR', folder)} }}", {},
                   backward=False)
    return {"data": out["data.data"], "label": out["data.label"]}


def syncsgd_answers(layer, bottoms):
    top_layer = make_layer(layer)
    blobs = blobs_from(list(bottoms.values()))
    top = run_forward(top_layer, blobs)
    top[0].diff[...] = 1
    top_layer.backward(top, [True, True] + [False] * (len(blobs) - 2), blobs)
    answers = {"loss": top[0].data.copy()}
    answers.update((f"diff.{name}", blob.diff.copy())
                   for name, blob in zip(bottoms, blobs) if name in COMPARED)
    return answers


def assert_answers_equal(mine, fork, case, tolerance=2e-6):
    for key, want in fork.items():
        scale = max(1.0, float(np.abs(want).max()))
        err = float(np.abs(mine[key].reshape(want.shape) - want).max()) / scale
        assert err <= tolerance, f"{case}: {key} differs from the fork by {err:.3g} of {scale}"


def golden(name):
    path = os.path.join(GOLDEN_DIR, f"{name}.npz")
    if not os.path.exists(path):
        pytest.skip(f"{path} not recorded: run `python -m tests.test_layers_fork_ssd_train` "
                    f"with the SSD fork built")
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def forks_of(data):
    return {key[len("fork."):]: value for key, value in data.items() if key.startswith("fork.")}


@pytest.mark.parametrize("case", sorted(fork_cases()))
def test_equals_the_fork_golden(case):
    """Loss and bottom gradients equal what the SSD fork gave (recorded in tests/golden/fork)."""
    layer, bottoms = fork_cases()[case]
    data = golden(case)
    assert str(data["layer"]) == layer, f"{case}: the case changed since it was recorded"
    for name, value in bottoms.items():
        np.testing.assert_array_equal(data[f"in.{name}"], value)
    assert_answers_equal(syncsgd_answers(layer, bottoms), forks_of(data), case)


def test_annotated_data_equals_the_fork_golden(tmp_path):
    """Without random choices (no mirror or sampling), AnnotatedData's images and boxes equal
    the fork's: raw records (the fork is built without OpenCV, and brocolli-caffe's SSD
    version predates resize_param), mean and scale per channel, the emit constraint."""
    data = golden("annotated_data")
    assert str(data["layer"]) == ANNOTATED
    write_annotated_lmdb(tmp_path / "db", count=5)
    param = text_format.Parse(ANNOTATED.replace("$DIR", str(tmp_path)), pb.LayerParameter())
    layer = create(param, Context(TRAIN, seed=1))
    top = run_forward(layer, [], n_top=2)
    layer.close()
    fork = forks_of(data)
    np.testing.assert_array_equal(top[1].data, fork["label"])
    np.testing.assert_array_equal(top[0].data, fork["data"])


@pytest.mark.skipif(not os.path.exists(FORK_ENV), reason=f"the SSD fork is not built "
                    f"({FORK_ENV} missing; tools/oracle/build-fork-caffe.sh builds it)")
def test_fork_still_gives_the_goldens(tmp_path):
    """Run on the fork itself, one case (the default SSD configuration) gives the golden."""
    layer, bottoms = fork_cases()["multibox_0"]
    fork = fork_loss_answers(str(tmp_path / "multibox_0"), layer, bottoms)
    data = golden("multibox_0")
    for key, value in fork.items():
        np.testing.assert_array_equal(value, data[f"fork.{key}"])


def record_goldens(folder):
    """Run every fork case on the fork and write tests/golden/fork/<case>.npz."""
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    for case, (layer, bottoms) in sorted(fork_cases().items()):
        fork = fork_loss_answers(os.path.join(folder, case), layer, bottoms)
        np.savez_compressed(os.path.join(GOLDEN_DIR, f"{case}.npz"), layer=layer,
                            **{f"in.{n}": v for n, v in bottoms.items()},
                            **{f"fork.{k}": v for k, v in fork.items()})
        print(case, "recorded")
    fork = fork_annotated_answers(os.path.join(folder, "annotated_data"))
    np.savez_compressed(os.path.join(GOLDEN_DIR, "annotated_data.npz"), layer=ANNOTATED,
                        **{f"fork.{k}": v for k, v in fork.items()})
    print("annotated_data recorded")


# -- AnnotatedData and a tiny SSD training net ---------------------------------------------------
def write_annotated_lmdb(path, count=6, size=32, seed=0, encoded=False, typed=True):
    """An LMDB of AnnotatedDatum: BGR images (raw, or PNG when `encoded`) with one bright
    rectangle each, boxed (and, without `typed`, no annotation type: Datum labels n % 3)."""
    rng = np.random.default_rng(seed)
    records = []
    for n in range(count):
        image = rng.integers(0, 60, (3, size, size)).astype(np.uint8)
        x0, y0 = rng.integers(0, size // 2, 2)
        w, h = rng.integers(size // 4, size // 2, 2)
        image[:, y0:y0 + h, x0:x0 + w] = 200
        record = pb.AnnotatedDatum(type=pb.AnnotatedDatum.BBOX) if typed else \
            pb.AnnotatedDatum(datum=pb.Datum(label=n % 3))
        record.datum.channels, record.datum.height, record.datum.width = 3, size, size
        record.datum.data = image.tobytes()
        if encoded:
            record.datum.encoded = True
            record.datum.data = cv2.imencode(".png", image.transpose(1, 2, 0))[1].tobytes()
        group = record.annotation_group.add(group_label=1 + n % 2)
        box = group.annotation.add(instance_id=0).bbox
        box.xmin, box.ymin = x0 / size, y0 / size
        box.xmax, box.ymax = (x0 + w) / size, (y0 + h) / size
        records.append((f"{n:08d}".encode(), record.SerializeToString()))
    write_lmdb(str(path), records)
    return str(path)


def annotated_layer(source, extra="", batch=4, ctx=None):
    text = (f"name: 'data' type: 'AnnotatedData' top: 'data' top: 'label' "
            f"data_param {{ source: '{source}' batch_size: {batch} backend: LMDB }} {extra}")
    param = text_format.Parse(text, pb.LayerParameter())
    return create(param, ctx or Context(TRAIN, seed=3))


def test_annotated_data_reads_images_and_boxes(tmp_path):
    source = write_annotated_lmdb(tmp_path / "db")
    layer = annotated_layer(source, "transform_param { mean_value: 10 scale: 0.5 }")
    top = run_forward(layer, [], n_top=2)
    assert top[0].shape == (4, 3, 32, 32) and top[1].shape == (1, 1, 4, 8)
    rows = top[1].data.reshape(-1, 8)
    np.testing.assert_array_equal(rows[:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(rows[:, 1], [1, 2, 1, 2])
    for i, (_, _, _, x0, y0, x1, y1, _) in enumerate(rows):
        inside = top[0].data[i, 0, int(round(y0 * 32)):int(round(y1 * 32)),
                             int(round(x0 * 32)):int(round(x1 * 32))]
        assert np.all(inside == (200 - 10) * 0.5)
    layer.close()
    plain = annotated_layer(write_annotated_lmdb(tmp_path / "plain", typed=False), batch=5)
    top = run_forward(plain, [], n_top=2)
    np.testing.assert_array_equal(top[1].data, [0, 1, 2, 0, 1])
    plain.close()


def test_annotated_data_augments_boxes_with_the_images(tmp_path):
    """With mirror, expansion and crops sampled as SSD does, each output box still frames its
    bright rectangle, and two ranks get the images and boxes one process gets."""
    source = write_annotated_lmdb(tmp_path / "db", count=4, encoded=True)
    extra = ("transform_param { mirror: true expand_param { prob: 1 max_expand_ratio: 1.5 } "
             "resize_param { height: 32 width: 32 interp_mode: NEAREST } } "
             "annotated_data_param { batch_sampler { sampler { min_scale: 0.5 } "
             "sample_constraint { min_jaccard_overlap: 0.7 } max_trials: 20 max_sample: 1 } }")
    whole = annotated_layer(source, extra, batch=4)
    top = run_forward(whole, [], n_top=2)
    rows = top[1].data.reshape(-1, 8)
    assert len(rows) >= 1
    for row in rows:
        i, (x0, y0, x1, y1) = int(row[0]), row[3:7]
        image = top[0].data[i, 0]
        height, width = image.shape
        inside = image[int(np.ceil(y0 * height)) + 1:int(y1 * height) - 1,
                       int(np.ceil(x0 * width)) + 1:int(x1 * width) - 1]
        assert inside.size and np.all(inside == 200), (row, image)
    parts = []
    for rank in (0, 1):
        layer = annotated_layer(source, extra, batch=4, ctx=Context(TRAIN, seed=3, rank=rank,
                                                                      size=2))
        parts.append([t.data.copy() for t in run_forward(layer, [], n_top=2)])
        layer.close()
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), top[0].data)
    first, second = (p[1].reshape(-1, 8).copy() for p in parts)
    second[:, 0] += 2
    joined = np.concatenate([first, second])
    np.testing.assert_array_equal(joined, rows)
    whole.close()


def coverage_ref(a, b):
    """SSD's BBoxCoverage: the part of a that b covers."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return 0.0
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h / ((a[2] - a[0]) * (a[3] - a[1])) if w > 0 and h > 0 else 0.0


def satisfy_ref(crop, objects, c):
    """SSD's SatisfySampleConstraint, line by line."""
    tests = [("jaccard_overlap", lambda o: jaccard(crop, o)),
             ("sample_coverage", lambda o: coverage_ref(crop, o)),
             ("object_coverage", lambda o: coverage_ref(o, crop))]
    given = [(name, f) for name, f in tests if f"min_{name}" in c or f"max_{name}" in c]
    if not given:
        return True
    found = False
    for o in objects:
        for name, f in given:
            v = f(o)
            if v < c.get(f"min_{name}", -np.inf) or v > c.get(f"max_{name}", np.inf):
                break
            found = True
        else:
            if found:
                return True
    return found


def transform_ref(boxes, crop, center):
    """SSD's TransformAnnotation (no resize, no mirror) for one crop box, box by box."""
    out = []
    for b in boxes:
        x0, y0, x1, y1 = b[2:6]
        if center is not None:
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            if center and not (crop[0] <= cx <= crop[2] and crop[1] <= cy <= crop[3]):
                continue
            if not center and not coverage_ref([x0, y0, x1, y1], crop) > 0.3:
                continue
        if x0 >= crop[2] or x1 <= crop[0] or y0 >= crop[3] or y1 <= crop[1]:
            continue
        w, h = crop[2] - crop[0], crop[3] - crop[1]
        p = np.clip([(x0 - crop[0]) / w, (y0 - crop[1]) / h, (x1 - crop[0]) / w,
                     (y1 - crop[1]) / h], 0, 1)
        if p[2] > p[0] and p[3] > p[1]:
            out.append(list(b[:2]) + list(p) + [b[6]])
    return np.array(out, np.float32).reshape(-1, 7)


@pytest.mark.parametrize("constraint", [
    {}, {"min_jaccard_overlap": 0.3}, {"max_jaccard_overlap": 0.2},
    {"min_sample_coverage": 0.5, "min_object_coverage": 0.9},
    {"min_jaccard_overlap": 0.1, "max_sample_coverage": 0.5}, {"max_object_coverage": 0.4}])
def test_sampling_helpers_equal_the_forks_loops(constraint):
    from syncsgd.io import annotated as aug
    rng = np.random.default_rng(7)
    corner = rng.uniform(0, 0.6, (40, 2)).astype(np.float32)
    crops = np.concatenate([corner, corner + rng.uniform(0.1, 0.4, (40, 2))], axis=1)
    objects = np.concatenate([rng.uniform(0, 0.5, (3, 2)), rng.uniform(0.55, 1, (3, 2))],
                             axis=1).astype(np.float32)
    c = pb.SampleConstraint(**constraint)
    want = [satisfy_ref(crop, objects, constraint) for crop in crops]
    np.testing.assert_array_equal(aug.satisfied(crops.astype(np.float32), objects, c), want)
    boxes = np.column_stack([np.arange(3), np.zeros(3), objects, np.ones(3)]).astype(np.float32)
    for emit, center in ((None, None), (pb.EmitConstraint(), True),
                         (pb.EmitConstraint(emit_type=pb.EmitConstraint.MIN_OVERLAP,
                                            emit_overlap=0.3), False)):
        for crop in crops[:10]:
            np.testing.assert_allclose(aug.transform_boxes(boxes, crop, emit),
                                       transform_ref(boxes, crop, center), atol=1e-6)


def test_annotated_data_refuses_what_it_does_not_implement(tmp_path):
    source = write_annotated_lmdb(tmp_path / "db", count=2)
    with pytest.raises(PrototxtError, match="crop_size"):
        run_forward(annotated_layer(source, "transform_param { crop_size: 16 }"), [], n_top=2)


TINY_SSD = """
name: 'tiny_ssd'
layer {{ name: 'data' type: 'AnnotatedData' top: 'data' top: 'label'
  include {{ phase: TRAIN }}
  transform_param {{ mean_value: 60 scale: 0.02 }}
  data_param {{ source: '{source}' batch_size: 4 backend: LMDB }} }}
layer {{ name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1'
  convolution_param {{ num_output: 8 kernel_size: 3 stride: 2 pad: 1
    weight_filler {{ type: 'xavier' }} }} }}
layer {{ name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' }}
layer {{ name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2'
  convolution_param {{ num_output: 8 kernel_size: 3 stride: 2 pad: 1
    weight_filler {{ type: 'xavier' }} }} }}
layer {{ name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' }}
layer {{ name: 'loc' type: 'Convolution' bottom: 'conv2' top: 'loc'
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 weight_filler {{ type: 'xavier' }} }} }}
layer {{ name: 'loc_perm' type: 'Permute' bottom: 'loc' top: 'loc_perm'
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: 'loc_flat' type: 'Flatten' bottom: 'loc_perm' top: 'loc_flat' }}
layer {{ name: 'conf' type: 'Convolution' bottom: 'conv2' top: 'conf'
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 weight_filler {{ type: 'xavier' }} }} }}
layer {{ name: 'conf_perm' type: 'Permute' bottom: 'conf' top: 'conf_perm'
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: 'conf_flat' type: 'Flatten' bottom: 'conf_perm' top: 'conf_flat' }}
layer {{ name: 'priors' type: 'PriorBox' bottom: 'conv2' bottom: 'data' top: 'priors'
  prior_box_param {{ min_size: 10 max_size: 20 variance: 0.1 variance: 0.1 variance: 0.2
    variance: 0.2 clip: true }} }}
layer {{ name: 'loss' type: 'MultiBoxLoss' bottom: 'loc_flat' bottom: 'conf_flat'
  bottom: 'priors' bottom: 'label' top: 'loss'
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  loss_param {{ normalization: VALID }}
  multibox_loss_param {{ num_classes: 3 overlap_threshold: 0.4 neg_pos_ratio: 3
    neg_overlap: 0.4 code_type: CENTER_SIZE match_type: PER_PREDICTION }} }}
"""


def test_tiny_ssd_trains(tmp_path):
    source = write_annotated_lmdb(tmp_path / "db", count=8)
    (tmp_path / "net.prototxt").write_text(TINY_SSD.format(source=source))
    (tmp_path / "solver.prototxt").write_text(
        f"net: '{tmp_path / 'net.prototxt'}' base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' "
        f"max_iter: 100 random_seed: 5 snapshot_prefix: '{tmp_path / 'snap'}'")
    solver = syncsgd.get_solver(str(tmp_path / "solver.prototxt"))
    losses = []
    for _ in range(30):
        solver.step(1)
        losses.append(float(solver.net.blobs["loss"].data))
    assert np.mean(losses[-6:]) < 0.75 * losses[0], losses


ZOO = os.path.join(os.path.dirname(__file__), "zoo", "chuanqi305_MobileNet-SSD", "voc",
                   "MobileNetSSD_train.prototxt")


def test_mobilenet_ssd_train_net_builds_and_runs(tmp_path):
    """chuanqi305/MobileNet-SSD's training net as published, its AnnotatedData reading this
    module's LMDB at 96 x 96 and batch 2: it builds, and a forward and backward give a finite
    loss and gradients."""
    source = write_annotated_lmdb(tmp_path / "db", count=4, encoded=True)
    param, _ = load_net_param(ZOO)
    data = param.layer[0]
    assert data.type == "AnnotatedData"
    data.data_param.source, data.data_param.batch_size = source, 2
    data.transform_param.resize_param.height = data.transform_param.resize_param.width = 96
    (tmp_path / "net.prototxt").write_text(text_format.MessageToString(param))
    net = syncsgd.Net(str(tmp_path / "net.prototxt"), syncsgd.TRAIN)
    loss = net.forward()["mbox_loss"]
    net.backward()
    assert np.isfinite(loss).all() and float(loss) > 0
    assert np.isfinite(net.blobs["conv0"].diff).all() and net.blobs["conv0"].diff.any()


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        record_goldens(scratch)
