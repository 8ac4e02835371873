"""syncsgd against BVLC Caffe (commit 9b89154) itself: every layer type in a few configurations
(tests/oracle_cases.py), forward and backward with the same parameters, inputs and top diffs, and
the six solvers a few steps from the same weights.

BVLC's answers are kept in tests/golden/ (one .npz per case, see its README), so that the
comparison runs everywhere, CI included. Where the oracle is built (build script:
../shared/oracle/build-bvlc-caffe.sh; found through $CAFFE_ORACLE_DIR or
~/.cache/bvlc-caffe-9b89154), BVLC is also run live on the goldens' own inputs, so that they
cannot drift from what BVLC gives. To record them again (after adding or changing a case):

    python tests/test_oracle.py --record [CASE...]

Tops, bottom diffs and parameters with their diffs must agree within RTOL of each array's scale
(its largest magnitude in BVLC's answer), shapes exactly; weights after solver steps within
SOLVER_RTOL. Each case also loads the .caffemodel BVLC wrote into syncsgd.
"""
import json
import os
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import syncsgd
from syncsgd.errors import WeightsError
from syncsgd.proto import pb

from gradcheck import blobs_from, check_gradient, make_layer, run_forward
from oracle_drive import drive, set_inputs
from oracle_cases import (LAYER_CASES, NOT_COVERED, SOLVER_CASES, SOLVER_INPUTS, SOLVER_NET,
                          driven_tops, net_text, p_gauss, parse_layers, solver_text)

HERE = Path(__file__).resolve().parent

GOLDEN = HERE / "golden"
WORKER = HERE / "oracle_worker.py"
RTOL = 1e-4
SOLVER_RTOL = 1e-5
DRIFT_RTOL = 1e-5       # BVLC against its own recorded answers
SCALE_FLOOR = 1e-3      # an all-zero answer must be matched within RTOL * SCALE_FLOOR

# `caffe.layer_type_list()` of BVLC 9b89154 as built by the oracle script.
BVLC_TYPES = [
    "AbsVal", "Accuracy", "ArgMax", "BNLL", "BatchNorm", "BatchReindex", "Bias", "Clip", "Concat",
    "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData",
    "ELU", "Eltwise", "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data",
    "HDF5Output", "HingeLoss", "Im2col", "InfogainLoss", "InnerProduct", "Input", "LRN", "LSTM",
    "LSTMUnit", "Log", "MVN", "MemoryData", "MultinomialLogisticLoss", "PReLU", "Parameter",
    "Pooling", "Power", "Python", "RNN", "ReLU", "Reduction", "Reshape", "SPP", "Scale", "Sigmoid",
    "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax", "SoftmaxWithLoss", "Split", "Swish",
    "TanH", "Threshold", "Tile"]

PHASES = {"TRAIN": syncsgd.TRAIN, "TEST": syncsgd.TEST}
CASES = {case.name: case for case in LAYER_CASES}
SOLVERS = {case.name: case for case in SOLVER_CASES}


# -- the oracle ---------------------------------------------------------------------------------
def oracle_env():
    """The oracle's env file, or None. XDG_CACHE_HOME is not looked at: the test session points
    it at a temporary folder."""
    base = os.environ.get("CAFFE_ORACLE_DIR") or str(Path.home() / ".cache/bvlc-caffe-9b89154")
    env = Path(base) / "env.sh"
    return env if env.is_file() else None


@lru_cache(maxsize=1)
def oracle_problem():
    """Why the oracle cannot run here, or None when it can."""
    env = oracle_env()
    if env is None:
        return ("BVLC Caffe oracle not built (../shared/oracle/build-bvlc-caffe.sh; "
                "$CAFFE_ORACLE_DIR or ~/.cache/bvlc-caffe-9b89154)")
    result = _oracle_run(env, ["-c", "import caffe"])
    if result.returncode:
        return f"BVLC Caffe oracle at {env} does not run: {result.stderr[-300:]}"
    return None


@pytest.fixture
def oracle():
    """The oracle's env file; the test is skipped, saying why, where it cannot run."""
    problem = oracle_problem()
    if problem:
        pytest.skip(problem)
    return oracle_env()


def _oracle_run(env, args):
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean["GLOG_minloglevel"] = "2"
    return subprocess.run(["bash", "-c", 'source "$0" && exec python "$@"', str(env), *args],
                          capture_output=True, text=True, env=clean, timeout=1200)


def run_oracle(folders):
    """Run the worker over case folders in one process (restarted after a case that aborts
    Caffe). Returns {case name: error text} for the cases that failed."""
    env, failed, pending = oracle_env(), {}, list(folders)
    while pending:
        result = _oracle_run(env, [str(WORKER), *map(str, pending)])
        started = [line.split(" ", 1)[1] for line in result.stdout.splitlines()
                   if line.startswith("case ")]
        if result.returncode == 0:
            break
        if not started:
            raise RuntimeError(f"the oracle worker failed before any case: {result.stderr}")
        failed[started[-1]] = result.stderr[-2000:]
        pending = pending[len(started):]
    return failed


# -- goldens: a case's arrays, and BVLC's answers as bvlc.* --------------------------------------
def golden_path(name):
    return GOLDEN / f"{name}.npz"


def load_golden(name):
    with np.load(golden_path(name)) as data:
        return {key: data[key] for key in data.files}


def meta(golden):
    return json.loads(str(golden["meta"]))


def text(golden, key):
    return str(golden[key])


def case_arrays(case):
    """The bottoms, MemoryData arrays and files a case makes, as golden entries."""
    rng = case.rng(b"inputs")
    out = {f"in.{b}": make(rng) for b, make in case.inputs.items()}
    rng = case.rng(b"memory")
    out.update((f"memory.{k}", make(rng)) for k, make in case.memory.items())
    rng = case.rng(b"files")
    for name, content in case.files.items():
        data = content.encode() if isinstance(content, str) else content(rng)
        out[f"file.{name}"] = np.frombuffer(data, np.uint8)
    return out


def write_files(golden, folder):
    """The case's files in `folder`, with $DIR their folder."""
    for key, value in golden.items():
        if key.startswith("file."):
            data = value.tobytes().replace(b"$DIR", str(folder).encode())
            (Path(folder) / key[len("file."):]).write_bytes(data)


def new_golden(case, folder):
    """A case's golden without BVLC's answers: its net, inputs, parameters and top diffs.
    Learned bottoms become the parameters of their Parameter layers."""
    arrays = case_arrays(case)
    write_files(arrays, folder)
    proto = net_text(case, {b: arrays[f"in.{b}"].shape for b in case.inputs})
    net = build(proto, case.phase, folder)
    rng = case.rng(b"params")
    golden = {"proto": np.array(proto)}
    for layer, blobs in net.params.items():
        makers = case.params.get(layer, [p_gauss()] * len(blobs))
        for i, blob in enumerate(blobs):
            value = arrays.pop(f"in.{layer}") if layer in case.learned else \
                makers[i](rng, blob.shape)
            golden[f"param.{layer}.{i}"] = value
    if case.backward and not case.drive:
        set_params(net, golden)
        set_inputs(net, arrays)
        for _ in range(case.passes):
            net.forward()
        rng = case.rng(b"top diffs")
        for t in driven_tops(case):
            golden[f"topdiff.{t}"] = rng.standard_normal(net.blobs[t].shape).astype(np.float32)
    golden.update(arrays)
    golden["meta"] = np.array(json.dumps(
        {"name": case.name, "kind": "layer", "phase": case.phase, "passes": case.passes,
         "backward": case.backward, "diffs": list(case.inputs)}))
    return golden


def new_solver_golden(case):
    rng = case.rng(b"inputs")
    golden = {f"in.{b}": make(rng) for b, make in SOLVER_INPUTS.items()}
    golden["proto"] = np.array(SOLVER_NET)
    golden["solver"] = np.array(solver_text(case, "$DIR/net.prototxt"))
    golden["meta"] = np.array(json.dumps({"name": case.name, "kind": "solver",
                                          "steps": case.steps}))
    with tempfile.TemporaryDirectory() as folder:
        net = build(SOLVER_NET, "TRAIN", folder)
    rng = case.rng(b"params")
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            golden[f"param.{layer}.{i}"] = p_gauss()(rng, blob.shape)
    return golden


def write_case(golden, folder):
    """A folder the oracle worker runs: its net, meta, inputs and syncsgd-written weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_files(golden, folder)
    info = meta(golden)
    (folder / "net.prototxt").write_text(text(golden, "proto").replace("$DIR", str(folder)))
    if info["kind"] == "solver":
        (folder / "solver.prototxt").write_text(
            text(golden, "solver").replace("$DIR", str(folder)))
    (folder / "meta.json").write_text(json.dumps(info))
    np.savez(folder / "inputs.npz", **{k: v for k, v in golden.items()
                                       if k.split(".")[0] in ("in", "topdiff", "memory")})
    if any(key.startswith("param.") for key in golden):
        phase = "TRAIN" if info["kind"] == "solver" else info["phase"]
        net = build(text(golden, "proto"), phase, folder)
        set_params(net, golden)
        net.save(str(folder / "weights.caffemodel"))


def add_answers(golden, folder):
    """BVLC's answers from a worker's folder into the golden, as bvlc.*."""
    with np.load(Path(folder) / "bvlc.npz") as data:
        golden.update((f"bvlc.{k}", data[k]) for k in data.files)
    model = Path(folder) / "bvlc.caffemodel"
    if model.exists():
        golden["bvlc.caffemodel"] = np.frombuffer(model.read_bytes(), np.uint8)
    return golden


# -- running syncsgd -----------------------------------------------------------------------------
def build(proto, phase, folder):
    """A syncsgd net of `proto` written to folder/net.prototxt ($DIR the folder)."""
    path = Path(folder) / "net.prototxt"
    path.write_text(proto.replace("$DIR", str(folder)))
    return syncsgd.Net(str(path), PHASES[phase])


def set_params(net, golden):
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            blob.data[...] = golden[f"param.{layer}.{i}"]


def run_layer(golden, folder):
    """syncsgd's answers to a layer case, keyed as BVLC's."""
    info = meta(golden)
    write_files(golden, folder)
    net = build(text(golden, "proto"), info["phase"], folder)
    set_params(net, golden)
    drive(net, info, golden)
    return answers(net, golden)


def answers(net, golden):
    """syncsgd's arrays for each bvlc.* entry of the golden (None where it has none)."""
    out = {}
    for key in golden:
        if not key.startswith("bvlc.") or key == "bvlc.caffemodel":
            continue
        kind, _, name = key[len("bvlc."):].partition(".")
        if kind in ("data", "diff"):
            blob = net.blobs.get(name)
            out[key] = None if blob is None else getattr(blob, kind)
        else:
            layer, _, i = name.rpartition(".")
            blobs = net.params.get(layer, [])
            blob = blobs[int(i)] if int(i) < len(blobs) else None
            out[key] = None if blob is None else (blob.data if kind == "param" else blob.diff)
    return out


def run_solver(golden, folder):
    folder = Path(folder)
    info = meta(golden)
    (folder / "net.prototxt").write_text(text(golden, "proto"))
    path = folder / "solver.prototxt"
    path.write_text(text(golden, "solver").replace("$DIR", str(folder)))
    solver = syncsgd.get_solver(str(path))
    set_params(solver.net, golden)
    set_inputs(solver.net, golden)
    solver.step(info["steps"])
    return answers(solver.net, golden)


def mismatches(golden, ours, rtol):
    """[(key, what)] where the arrays `ours` differ from the golden's (BVLC's) beyond rtol of
    their scale."""
    out = []
    for key, actual in ours.items():
        expected = golden[key]
        if actual is None:
            out.append((key, "missing in syncsgd"))
            continue
        if np.shape(actual) != expected.shape:
            out.append((key, f"shape {np.shape(actual)}, BVLC's {expected.shape}"))
            continue
        error, scale = relative_error(actual, expected)
        if not error <= rtol:
            out.append((key, f"max difference {error:.3g} of the scale {scale:.3g}"))
    return out


def relative_error(actual, expected):
    """The largest difference over BVLC's largest magnitude (floored), and that scale."""
    if not expected.size:
        return 0.0, 0.0
    scale = max(float(np.max(np.abs(expected))), SCALE_FLOOR)
    diff = np.abs(np.asarray(actual, np.float64) - expected)
    return float(np.max(diff)) / scale if np.all(np.isfinite(diff)) else np.inf, scale


# -- the always-run comparisons ----------------------------------------------------------------
def test_every_bvlc_layer_type_has_cases():
    covered = {layer.type for case in LAYER_CASES for layer in parse_layers(case.layers)}
    covered.add("Input")
    missing = set(BVLC_TYPES) - covered - set(NOT_COVERED)
    assert not missing, f"BVLC layer types without a case: {sorted(missing)}"
    assert covered <= set(BVLC_TYPES), sorted(covered - set(BVLC_TYPES))


def test_goldens_match_the_cases():
    """A case changed without recording its golden again (or a golden left without its case)
    fails here: its net text and arrays must be those the case makes now."""
    names = {p.stem for p in GOLDEN.glob("*.npz")}
    expected = set(CASES) | {f"solver_{n}" for n in SOLVERS}
    assert names == expected, (f"record: python tests/test_oracle.py --record; missing "
                               f"{sorted(expected - names)}, stale {sorted(names - expected)}")
    for case in LAYER_CASES:
        golden = load_golden(case.name)
        arrays = case_arrays(case)
        shapes = {b: arrays[f"in.{b}"].shape for b in case.inputs}
        assert text(golden, "proto") == net_text(case, shapes), case.name
        for key, value in arrays.items():
            stored = golden.get(key, golden.get(f"param.{key[len('in.'):]}.0"))
            assert np.array_equal(stored, value), f"{case.name}: {key} changed"


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_matches_bvlc(name, tmp_path):
    golden = load_golden(name)
    bad = mismatches(golden, run_layer(golden, tmp_path), RTOL)
    assert not bad, f"{name}: syncsgd differs from BVLC Caffe: {bad}"


def cases_with_weights():
    """The cases whose golden holds parameters (and so a .caffemodel BVLC wrote)."""
    out = []
    for name in sorted(CASES):
        if golden_path(name).exists():
            with np.load(golden_path(name)) as data:
                if any(key.startswith("param.") for key in data.files):
                    out.append(name)
    return out


@pytest.mark.parametrize("name", cases_with_weights())
def test_weights_bvlc_wrote_load(name, tmp_path):
    """The .caffemodel BVLC saved after the case loads, with BVLC's values (0-d blobs of
    PReLU's channel_shared and Scale's num_axes 0 included)."""
    golden = load_golden(name)
    info = meta(golden)
    write_files(golden, tmp_path)
    net = build(text(golden, "proto"), info["phase"], tmp_path)
    model = tmp_path / "bvlc.caffemodel"
    model.write_bytes(golden["bvlc.caffemodel"].tobytes())
    net.copy_from(str(model))
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            assert np.array_equal(blob.data, golden[f"bvlc.param.{layer}.{i}"]), (layer, i)


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_solver_matches_bvlc(name, tmp_path):
    golden = load_golden(f"solver_{name}")
    bad = mismatches(golden, run_solver(golden, tmp_path), SOLVER_RTOL)
    assert not bad, f"{name}: weights after the steps differ from BVLC Caffe's: {bad}"


# -- the oracle, live ----------------------------------------------------------------------------
def test_bvlc_layer_types_are_the_listed_ones(oracle):
    result = _oracle_run(oracle, ["-c", "import caffe; print(' '.join(caffe.layer_type_list()))"])
    assert sorted(result.stdout.split()) == sorted(BVLC_TYPES)


def test_goldens_are_what_bvlc_gives(oracle, tmp_path):
    """BVLC run now on each golden's own net, weights and inputs gives the recorded answers."""
    goldens = {p.stem: load_golden(p.stem) for p in sorted(GOLDEN.glob("*.npz"))}
    for name, golden in goldens.items():
        write_case(golden, tmp_path / name)
    failed = run_oracle([tmp_path / name for name in goldens])
    assert not failed, failed
    drifted = {}
    for name, golden in goldens.items():
        live = add_answers({}, tmp_path / name)
        recorded = {k: v for k, v in golden.items() if k.startswith("bvlc.")}
        live.pop("bvlc.caffemodel", None)
        recorded.pop("bvlc.caffemodel", None)
        if set(live) != set(recorded):
            drifted[name] = f"other arrays: {sorted(set(live) ^ set(recorded))}"
        elif mismatches(recorded, live, DRIFT_RTOL):
            drifted[name] = mismatches(recorded, live, DRIFT_RTOL)
    assert not drifted, f"goldens no longer what BVLC gives (record them again): {drifted}"


# -- BVLC's behaviour syncsgd follows; each test failed before its fix -------------------------
PRELU_NET = """name: "n"
layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "p" type: "PReLU" bottom: "x" top: "y" prelu_param { channel_shared: %s } }
"""


def prelu_net(tmp_path, shared=True):
    path = tmp_path / "net.prototxt"
    path.write_text(PRELU_NET % str(shared).lower())
    return syncsgd.Net(str(path), syncsgd.TEST)


def one_blob_model(tmp_path, blob):
    """A .caffemodel whose layer 'p' holds the one BlobProto `blob`."""
    param = pb.NetParameter(name="n")
    param.layer.add(name="p", type="PReLU").blobs.add().CopyFrom(blob)
    path = tmp_path / "w.caffemodel"
    path.write_bytes(param.SerializeToString())
    return str(path)


@pytest.mark.parametrize("blob", [pb.BlobProto(data=[0.375]),
                                  pb.BlobProto(data=[0.375], num=1, channels=1, height=1,
                                               width=1)], ids=["no shape", "legacy 1x1x1x1"])
def test_zero_axis_blob_loads_as_bvlc_writes_it(tmp_path, blob):
    """BVLC writes a 0-d blob (PReLU's channel_shared slope, Scale's num_axes: 0) with neither
    `shape` nor the legacy dims, and its Blob::ShapeEquals takes that as the shape ()."""
    net = prelu_net(tmp_path)
    net.copy_from(one_blob_model(tmp_path, blob))
    assert net.params["p"][0].data.shape == () and net.params["p"][0].data == 0.375


def test_zero_axis_blob_given_in_the_prototxt_loads(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text((PRELU_NET % "true").replace("channel_shared: true }",
                                                 "channel_shared: true } blobs { data: 0.25 }"))
    assert syncsgd.Net(str(path), syncsgd.TEST).params["p"][0].data == 0.25


def test_zero_axis_history_resumes(tmp_path):
    """A solver state holding a 0-d history blob as Caffe writes it (no `shape`; syncsgd writes
    an empty one) restores."""
    (tmp_path / "net.prototxt").write_text(
        PRELU_NET % "true" + 'layer { name: "loss" type: "EuclideanLoss" bottom: "y" '
                             'bottom: "x" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path}/net.prototxt" base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
        f'max_iter: 10 snapshot_prefix: "{tmp_path}/s" display: 0')
    solver = syncsgd.get_solver(str(tmp_path / "solver.prototxt"))
    solver.net.blobs["x"].data[...] = np.arange(6).reshape(2, 3) - 2.5
    solver.step(2)
    solver.snapshot()
    path = tmp_path / "s_iter_2.solverstate"
    state = pb.SolverState.FromString(path.read_bytes())
    for blob in state.history:
        if not blob.shape.dim:
            blob.ClearField("shape")
    path.write_bytes(state.SerializeToString())
    os.remove(f"{path}.sha256")
    again = syncsgd.get_solver(str(tmp_path / "solver.prototxt"))
    again.restore(str(path))
    assert again.net.params["p"][0].data == solver.net.params["p"][0].data


@pytest.mark.parametrize("shared,blob,stored", [
    (False, pb.BlobProto(data=[0.375]), r"\(\)"),
    (True, pb.BlobProto(data=[0.375], shape=pb.BlobShape(dim=[1])), r"\(1,\)"),
    (True, pb.BlobProto(data=[0.375], num=1), r"\(1, 0, 0, 0\)")])
def test_mismatched_blobs_are_still_refused(tmp_path, shared, blob, stored):
    net = prelu_net(tmp_path, shared)
    path = one_blob_model(tmp_path, blob)
    expected = r"\(\)" if shared else r"\(3,\)"
    with pytest.raises(WeightsError, match=f"{path}: layer 'p' blob 0: the file has shape "
                                           f"{stored}, the net expects {expected}"):
        net.copy_from(path)


def test_memory_data_labels_are_4d_and_feed_losses(tmp_path):
    """Caffe's MemoryData labels are (N, 1, 1, 1); SoftmaxWithLoss and Accuracy take them as
    they take (N,) labels from an Input layer."""
    head = ('layer { name: "m" type: "MemoryData" top: "x" top: "label" memory_data_param { '
            'batch_size: 4 channels: 3 height: 1 width: 1 } }\n')
    tail = ('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" '
            'top: "loss" }\nlayer { name: "acc" type: "Accuracy" bottom: "x" bottom: "label" '
            'top: "acc" }\n')
    (tmp_path / "m.prototxt").write_text(head + tail)
    (tmp_path / "i.prototxt").write_text(
        'layer { name: "input" type: "Input" top: "x" top: "label" input_param { '
        'shape { dim: 4 dim: 3 dim: 1 dim: 1 } shape { dim: 4 } } }\n' + tail)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 1, 1)).astype(np.float32)
    label = np.array([0, 2, 1, 2], np.float32)
    memory = syncsgd.Net(str(tmp_path / "m.prototxt"), syncsgd.TRAIN)
    memory.set_input_arrays(x, label)
    memory.forward()
    assert memory.blobs["label"].shape == (4, 1, 1, 1)
    plain = syncsgd.Net(str(tmp_path / "i.prototxt"), syncsgd.TRAIN)
    plain.forward(x=x, label=label)
    for top in ("loss", "acc"):
        assert memory.blobs[top].data == pytest.approx(plain.blobs[top].data, rel=1e-6)


def mvn64(x, eps):
    rows = x.reshape(x.shape[0] * x.shape[1], -1)
    centred = rows - rows.mean(axis=1, keepdims=True)
    std = np.sqrt((centred ** 2).mean(axis=1, keepdims=True))
    return (centred / (std + eps)).reshape(x.shape)


@pytest.mark.parametrize("eps,low,high", [(1e-9, 0, 1e-6), (0.01, 2e-3, 1e-2)])
def test_mvn_backward_is_caffes_not_the_exact_gradient(eps, low, high):
    """MVN's backward is Caffe's formula (the goldens mvn_eps_0.01* check it against BVLC),
    which is the exact gradient only while eps is small against the std: at eps 1e-9 it agrees
    with float64 central differences, at 0.01 (unit std) it is off by about 5e-3 relative."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    layer = make_layer(f"name: 'm' type: 'MVN' mvn_param {{ eps: {eps} }}")
    bottom = blobs_from([x])
    top = run_forward(layer, bottom)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    x64, step = x.astype(np.float64), 1e-6
    exact = np.zeros_like(x64)
    for i in range(x.size):
        up, down = x64.copy(), x64.copy()
        up.flat[i] += step
        down.flat[i] -= step
        exact.flat[i] = np.sum((mvn64(up, eps) - mvn64(down, eps)) * dy) / (2 * step)
    error = np.max(np.abs(bottom[0].diff - exact)) / np.max(np.abs(exact))
    assert low <= error < high


def recurrent_text(kind):
    filler = "{ type: 'gaussian' std: 0.7 }"
    return (f"name: 'r' type: '{kind}' recurrent_param {{ num_output: 2 expose_hidden: true "
            f"weight_filler {filler} bias_filler {filler} }}")


@pytest.mark.parametrize("kind,states", [("RNN", 1), ("LSTM", 2)])
def test_exposed_states_carry_values_only(kind, states):
    """As in Caffe, the exposed final states' top diffs are ignored and the initial states get
    zero diffs (goldens rnn/lstm_expose_hidden check this against BVLC). So the backward is the
    exact gradient of a loss on the output (numeric check) but drops what a loss on the final
    states would send back into x."""
    rng = np.random.default_rng(1)
    cont = np.ones((3, 2), np.float32)
    cont[0, 1] = 0
    arrays = [rng.standard_normal((3, 2, 3)), cont] + [rng.standard_normal((1, 2, 2))] * states
    n_top = 1 + states
    assert check_gradient(make_layer(recurrent_text(kind)), blobs_from(arrays), n_top,
                          top_index=0, check_bottom=[0]) > 0
    layer = make_layer(recurrent_text(kind))
    bottom = blobs_from(arrays)
    top = run_forward(layer, bottom, n_top)
    top[0].diff[...] = rng.standard_normal(top[0].shape)
    layer.backward(top, [True, False] + [True] * states, bottom)
    dx = bottom[0].diff.copy()
    for t in top[1:]:
        t.diff[...] = rng.standard_normal(t.shape)
    layer.backward(top, [True, False] + [True] * states, bottom)
    assert np.array_equal(bottom[0].diff, dx)
    assert all(not b.diff.any() for b in bottom[2:])
    x, step = bottom[0].data, 1e-2
    x[0, 0, 0] += step
    up = run_forward(layer, bottom, n_top)[1].data.copy()
    x[0, 0, 0] -= 2 * step
    down = run_forward(layer, bottom, n_top)[1].data.copy()
    assert np.abs(up - down).max() / (2 * step) > 1e-2      # what a loss on h_T would send


# -- recording -----------------------------------------------------------------------------------
def record(names):
    """Make the goldens of the named cases (all when none) with the oracle; print how syncsgd
    compares with them."""
    problem = oracle_problem()
    if problem:
        sys.exit(problem)
    chosen = [c for c in LAYER_CASES if not names or c.name in names]
    solvers = [c for c in SOLVER_CASES if not names or f"solver_{c.name}" in names]
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        goldens = {}
        for case in chosen:
            folder = Path(tmp) / case.name
            folder.mkdir()
            try:
                goldens[case.name] = new_golden(case, folder)
            except Exception as e:      # reported, and the other cases recorded
                print(f"{case.name}: syncsgd cannot build it: {e}")
        for case in solvers:
            goldens[f"solver_{case.name}"] = new_solver_golden(case)
        for name, golden in goldens.items():
            write_case(golden, Path(tmp) / name)
        failed = run_oracle([Path(tmp) / name for name in goldens])
        for name, error in failed.items():
            print(f"{name}: BVLC failed:\n{error}")
        for name, golden in goldens.items():
            if name in failed:
                continue
            add_answers(golden, Path(tmp) / name)
            np.savez_compressed(golden_path(name), **golden)
            scratch = Path(tmp) / f"{name}.syncsgd"
            scratch.mkdir()
            ours = (run_solver(golden, scratch) if meta(golden)["kind"] == "solver"
                    else run_layer(golden, scratch))
            errors = [relative_error(v, golden[k])[0] if v is not None and
                      np.shape(v) == golden[k].shape else np.inf for k, v in ours.items()]
            bad = mismatches(golden, ours, SOLVER_RTOL if name.startswith("solver_") else RTOL)
            print(f"{name:40s} {len(ours):3d} arrays, max rel. difference "
                  f"{max(errors, default=0):.2e}{'  MISMATCH ' + str(bad) if bad else ''}")
    if not names:
        keep = set(goldens)
        for path in GOLDEN.glob("*.npz"):
            if path.stem not in keep:
                path.unlink()
    print(f"recorded {len(goldens) - len(failed)} goldens in {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/test_oracle.py --record [CASE...]")
    import logging
    logging.disable(logging.INFO)
    record(sys.argv[2:])
