"""Training end to end: exact resume from both snapshot formats, Caffe's own CIFAR-10 solver
states, seeded repeatability, logs Caffe's parse_log.py reads, LeNet learning the digits, the
command line, and the errors a user sees for bad inputs."""
import datetime
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TEST, log
from syncsgd.cli import main as cli_main
from syncsgd.compile import upgrade_net
from syncsgd.errors import DataError, PrototxtError, WeightsError
from syncsgd.kernels.threads import limited_budget
from syncsgd.proto import pb
from syncsgd.solvers.solver import Solver
from tests.paths import CAFFE_FIXTURES

REPO = Path(__file__).resolve().parents[1]
CIFAR = CAFFE_FIXTURES / "weights" / "cifar10-quick-ictchase"
LENET_V1 = CAFFE_FIXTURES / "weights" / "lenet-v1-pl8787"

# A tiny net over 8x8 inputs whose result depends on data order (shuffled HDF5 rows), on
# dropout masks, and on which test rows a test pass reads (25 test rows, 20 per pass).
NET = """
name: "tiny"
layer { name: "train_data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "%(train)s" batch_size: 8 shuffle: true } }
layer { name: "test_data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "%(test)s" batch_size: 10 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: %(conv)d kernel_size: 3
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "drop" type: "Dropout" bottom: "pool" top: "pool"
        dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" }
                              bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

# multistep makes current_step part of the state; test passes at 0, 3, 6.
SOLVER = """
type: "SGD" base_lr: 0.05 momentum: 0.9 weight_decay: 0.001
lr_policy: "multistep" gamma: 0.5 stepvalue: 2 stepvalue: 5
display: 1 test_interval: 3 test_iter: 2 max_iter: 8 random_seed: 1234
snapshot_prefix: "snap/tiny"
"""

GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] ")

# Caffe's tools/extra/parse_log.py
RE_ITERATION = re.compile(r"Iteration (\d+)")
RE_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def restore_logger():
    """Tests reconfigure syncsgd's logger; put it back as it was afterwards."""
    logger = log.LOGGER
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


class LogCapture:
    def __init__(self):
        self.stream = io.StringIO()
        log.configure(stream=self.stream)

    def take(self):
        """The raw lines logged since the last call."""
        lines = self.stream.getvalue().splitlines()
        self.stream.seek(0)
        self.stream.truncate()
        return lines


def messages(lines):
    """The messages of glog's lines, without the prefix (everything up to the first '] '); the
    continuation lines of multi-line messages (parameter dumps) are left out."""
    return [line.split("] ", 1)[1] for line in lines if GLOG_PREFIX.match(line)]


def training_messages(lines):
    """The messages after the solver's start-up, without the iteration speeds (timings): what
    two runs of the same iterations log alike."""
    text = messages(lines)
    start = max((i + 1 for i, m in enumerate(text) if m.startswith("Training on ")), default=0)
    return [re.sub(r" \([^()]* iter/s, [^()]* iters\)", "", m) for m in text[start:]]


def write_set(path, rows, seed):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["data"] = rng.standard_normal((rows, 1, 8, 8)).astype(np.float32)
        f["label"] = rng.integers(0, 10, rows).astype(np.float32)
    listing = path.with_suffix(".txt")
    listing.write_text(f"{path}\n")
    return str(listing)


def sources(directory):
    return write_set(directory / "train.h5", 36, 1), write_set(directory / "test.h5", 25, 2)


def net_text(train, test, conv=4):
    return NET % {"train": train, "test": test, "conv": conv}


def solver_param(directory, extra="", conv=4):
    train, test = sources(directory)
    param = text_format.Merge(SOLVER + extra, pb.SolverParameter())   # extra overrides
    param.net_param.CopyFrom(text_format.Parse(net_text(train, test, conv), pb.NetParameter()))
    return param


def run(directory, monkeypatch, param, iterations, resume=None):
    """A new solver working in `directory` (snapshot paths are relative), optionally restored,
    stepped `iterations` times."""
    directory.mkdir()
    monkeypatch.chdir(directory)
    solver = syncsgd.get_solver(param)
    try:
        if resume:
            solver.restore(str(resume))
        solver.step(iterations)
    finally:
        solver.close()
    return solver


def param_arrays(net):
    return {(name, i): blob.data.copy() for name, blobs in net.params.items()
            for i, blob in enumerate(blobs)}


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), f"parameter {key} differs"


# -- 1. exact resume ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, ext, extra", [
    ("BINARYPROTO", ".solverstate", ""),
    ("HDF5", ".solverstate.h5", ""),
    # two histories per parameter, several batches per iteration, no test at iteration 0
    ("BINARYPROTO", ".solverstate", 'type: "Adam" momentum2: 0.999 iter_size: 2 '
                                    "test_initialization: false"),
    ("HDF5", ".solverstate.h5", 'type: "AdaDelta" base_lr: 1 momentum: 0.95 delta: 1e-6 '
                                "clip_gradients: 0.5")],
    ids=["binary", "hdf5", "binary-adam-iter_size", "hdf5-adadelta-clipping"])
def test_resume_is_exact(tmp_path, monkeypatch, fmt, ext, extra):
    k = 4
    param = solver_param(tmp_path, f"snapshot: {k} snapshot_format: {fmt} {extra}")
    logs = LogCapture()

    straight = run(tmp_path / "straight", monkeypatch, param, 2 * k)
    lines = training_messages(logs.take())
    cut = lines.index(f"Snapshotting solver state to "
                      f"{'HDF5 file' if fmt == 'HDF5' else 'binary proto file'} "
                      f"snap/tiny_iter_{k}{ext}")
    first_half, second_half = lines[:cut + 1], lines[cut + 1:]
    assert "Iteration 3, Testing net (#0)" in first_half
    assert ("Iteration 0, Testing net (#0)" in first_half) == ("test_init" not in extra)
    assert "Iteration 6, Testing net (#0)" in second_half

    run(tmp_path / "first", monkeypatch, param, k)
    state = tmp_path / "first" / "snap" / f"tiny_iter_{k}{ext}"
    assert state.exists()
    logs.take()
    # the state names its weights relative to "first"; from "resumed" they are found beside it
    resumed = run(tmp_path / "resumed", monkeypatch, param, k, resume=state)
    assert resumed.iter == straight.iter == 2 * k
    assert resumed.current_step == straight.current_step == 2
    assert_same_params(param_arrays(resumed.net), param_arrays(straight.net))
    for mine, theirs in zip(resumed.history, straight.history):
        assert np.array_equal(mine, theirs)
    assert training_messages(logs.take()) == second_half


def test_resume_depends_on_data_positions(tmp_path, monkeypatch):
    """Control for the test above: without seeking the data layers the run differs, so the
    identical result there really depends on data positions being restored."""
    param = solver_param(tmp_path, "snapshot: 4 display: 0")
    straight = run(tmp_path / "straight", monkeypatch, param, 8)
    monkeypatch.setattr(Solver, "_restore_data_positions", lambda self: None)
    resumed = run(tmp_path / "resumed", monkeypatch, param, 4,
                  resume=tmp_path / "straight" / "snap" / "tiny_iter_4.solverstate")
    a, b = param_arrays(resumed.net), param_arrays(straight.net)
    assert any(not np.array_equal(a[key], b[key]) for key in a)


# -- 2. Caffe's CIFAR-10 quick solver states ----------------------------------------------------

def cifar_solver_param(solver_file):
    """The fixture's solver over its train_test net, its LMDB Data layers (whose sources are
    absent) replaced by DummyData of the same shapes."""
    param = text_format.Parse((CIFAR / solver_file).read_text(), pb.SolverParameter())
    net = text_format.Parse((CIFAR / "cifar10_quick_train_test.prototxt").read_text(),
                            pb.NetParameter())
    replaced = 0
    for layer in net.layer:
        if layer.type == "Data":
            layer.type = "DummyData"
            layer.ClearField("data_param")
            layer.ClearField("transform_param")
            layer.dummy_data_param.shape.add().dim.extend([100, 3, 32, 32])
            layer.dummy_data_param.shape.add().dim.extend([100])
            replaced += 1
    assert replaced == 2
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    return param


def fixture_state(path):
    """(iter, learned_net, history arrays) read here with protobuf / h5py directly."""
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            history = [np.asarray(f["history"][str(i)]) for i in range(len(f["history"]))]
            return int(f["iter"][0]), f["learned_net"][()].decode(), history
    state = pb.SolverState()
    state.ParseFromString(path.read_bytes())
    history = [np.asarray(b.data, np.float32).reshape(tuple(b.shape.dim)) for b in state.history]
    return state.iter, state.learned_net, history


def fixture_weights(path):
    """layer name -> list of weight arrays, read here with protobuf / h5py directly."""
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            return {name: [np.asarray(g[str(i)]) for i in range(len(g))]
                    for name, g in f["data"].items() if len(g)}
    net = pb.NetParameter()
    net.ParseFromString(path.read_bytes())
    return {layer.name: [np.asarray(b.data, np.float32).reshape(tuple(b.shape.dim))
                         for b in layer.blobs] for layer in net.layer if layer.blobs}


@pytest.mark.parametrize("solver_file, state_file, iteration", [
    ("cifar10_quick_solver.prototxt", "cifar10_quick_iter_4000.solverstate", 4000),
    ("cifar10_quick_solver_lr1.prototxt", "cifar10_quick_iter_5000.solverstate.h5", 5000)],
    ids=["binary", "hdf5"])
def test_caffe_cifar10_state_restores(tmp_path, monkeypatch, solver_file, state_file, iteration):
    monkeypatch.chdir(tmp_path)
    state_path = CIFAR / state_file
    stored_iter, learned_net, history = fixture_state(state_path)
    assert stored_iter == iteration
    assert learned_net.startswith("examples/cifar10/")     # a path in the original repository
    solver = syncsgd.get_solver(cifar_solver_param(solver_file))
    try:
        solver.restore(str(state_path))
        assert solver.iter == iteration
        assert len(solver.history) == len(history) == 10
        for mine, theirs in zip(solver.history, history):
            assert mine.shape == theirs.shape
            assert np.array_equal(mine, theirs)
        weights = fixture_weights(CIFAR / Path(learned_net).name)
        assert list(weights) == ["conv1", "conv2", "conv3", "ip1", "ip2"]
        for net in [solver.net] + solver.test_nets:
            for name, arrays in weights.items():
                for blob, array in zip(net.params[name], arrays, strict=True):
                    assert np.array_equal(blob.data, array), (name, net.phase)
    finally:
        solver.close()


def legacy_lenet_train_net(name_loss_top):
    """The V1 LeNet train net (Dec 2014), upgraded, its leveldb DATA layer (absent source)
    replaced by DummyData of the same shapes."""
    net = text_format.Parse((LENET_V1 / "lenet_train.prototxt").read_text(), pb.NetParameter())
    upgrade_net(net)
    for layer in net.layer:
        if layer.type == "Data":
            layer.type = "DummyData"
            layer.ClearField("data_param")
            layer.ClearField("transform_param")
            layer.dummy_data_param.shape.add().dim.extend([64, 1, 28, 28])
            layer.dummy_data_param.shape.add().dim.extend([64])
        if layer.type == "SoftmaxWithLoss" and name_loss_top:
            layer.top.append("loss")
    return net


def test_caffe_legacy_v1_state_restores(tmp_path, monkeypatch):
    """A V1 state: histories stored with legacy 4-D shapes (a bias as 1x1x1xN), weights in a
    V1 .caffemodel named without extension."""
    monkeypatch.chdir(tmp_path)
    param = text_format.Parse((LENET_V1 / "lenet_solver.prototxt").read_text(),
                              pb.SolverParameter())
    param.ClearField("train_net")
    param.ClearField("test_net")
    param.ClearField("test_iter")
    param.train_net_param.CopyFrom(legacy_lenet_train_net(name_loss_top=True))
    state = pb.SolverState()
    state.ParseFromString((LENET_V1 / "lenet_iter_10000.solverstate").read_bytes())
    assert state.learned_net == "lenet_iter_10000"
    assert not state.history[1].HasField("shape") and state.history[1].width == 20
    solver = syncsgd.get_solver(param)
    try:
        solver.restore(str(LENET_V1 / "lenet_iter_10000.solverstate"))
        assert solver.iter == 10000
        assert len(solver.history) == len(state.history) == 8
        for mine, blob in zip(solver.history, state.history):
            assert np.array_equal(mine.ravel(), np.asarray(blob.data, np.float32))
        assert solver.history[1].shape == (20,)
        weights = pb.NetParameter()
        weights.ParseFromString((LENET_V1 / "lenet_iter_10000").read_bytes())
        stored = {v1.name: v1.blobs for v1 in weights.layers if v1.blobs}
        assert sorted(stored) == ["conv1", "conv2", "ip1", "ip2"]
        for name, blobs in stored.items():
            for blob, proto in zip(solver.net.params[name], blobs, strict=True):
                assert np.array_equal(blob.data.ravel(), np.asarray(proto.data, np.float32))
    finally:
        solver.close()


def test_loss_layer_without_top_trains_as_in_caffe():
    """Caffe's V1 LeNet names no top for its SOFTMAX_LOSS layer: Caffe gives it an anonymous
    one whose loss (weight 1) is the net's loss, but which is not a net output."""
    net = syncsgd.Net(legacy_lenet_train_net(name_loss_top=False), syncsgd.TRAIN)
    try:
        net.forward()
        assert net.loss > 0
        assert net.outputs == []
    finally:
        net.close()


# -- 3. random_seed -----------------------------------------------------------------------------

def test_random_seed_makes_runs_bit_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = solver_param(tmp_path, "display: 0")

    def solver_with(seed):
        param = pb.SolverParameter()
        param.CopyFrom(base)
        param.random_seed = seed
        return syncsgd.get_solver(param)

    def trained(solver, initial=None):
        try:
            if initial is not None:
                for (name, i), array in initial.items():
                    solver.net.params[name][i].data[...] = array
            solver.step(5)
            return param_arrays(solver.net)
        finally:
            solver.close()

    first, second, other = solver_with(7), solver_with(7), solver_with(8)
    start = param_arrays(first.net)
    assert_same_params(start, param_arrays(second.net))
    other_start = param_arrays(other.net)
    assert not np.array_equal(start[("conv", 0)], other_start[("conv", 0)])
    result = trained(first)
    assert_same_params(result, trained(second))
    assert any(not np.array_equal(result[key], start[key]) for key in start)
    # same initial weights, another seed: the data order and dropout masks alone change the run
    other_result = trained(other, initial=start)
    for key in result:
        assert not np.array_equal(result[key], other_result[key]), key


# -- 4. logs Caffe's parse_log.py reads ---------------------------------------------------------

def glog_time(line, year):
    """extract_seconds.py's parse of glog's time prefix."""
    fields = line.strip().split()
    month, day = int(fields[0][1:3]), int(fields[0][3:])
    stamp = fields[1]
    dot = stamp.rfind(".")
    hour, minute, second = (int(x) for x in stamp[:dot].split(":"))
    return datetime.datetime(year, month, day, hour, minute, second, int(stamp[dot + 1:]))


def parse_log(lines, year):
    """parse_log.py's reading: rows of outputs per iteration, with seconds and learning rate."""
    start = next(glog_time(line, year) for line in lines if "Solving" in line)
    iteration, rate = -1, float("nan")
    train, test = {}, {}
    for line in lines:
        match = RE_ITERATION.search(line)
        if match:
            iteration = int(match.group(1))
        if iteration == -1:
            continue
        seconds = (glog_time(line, year) - start).total_seconds()
        assert seconds >= 0
        match = RE_LEARNING_RATE.search(line)
        if match:
            rate = float(match.group(1))
        for regex, rows in ((RE_TRAIN_OUTPUT, train), (RE_TEST_OUTPUT, test)):
            match = regex.search(line)
            if match:
                row = rows.setdefault(iteration, {"lr": rate})
                row[match.group(2)] = float(match.group(3))
    return train, test


def test_log_lines_parse_as_caffe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    param = solver_param(tmp_path, "display: 2")
    param.max_iter = 6
    logs = LogCapture()
    solver = syncsgd.get_solver(param)
    try:
        solver.solve()
    finally:
        solver.close()
    lines = logs.take()
    # parse_log.py reads every line from "Solving" on as a glog line; only the parameter dumps
    # of the start-up have continuation lines, as in Caffe's logs
    solving = next(i for i, line in enumerate(lines) if "] Solving" in line)
    assert all(GLOG_PREFIX.match(line) for line in lines[solving:]), lines[solving:]
    text = messages(lines)
    assert text[-1] == "Optimization Done."
    year = datetime.date.today().year
    train, test = parse_log(lines, year)

    number = r"[-+]?[0-9.]+(?:e[-+]?\d+)?"
    losses, speeds = {}, {}
    for line in text:
        match = re.fullmatch(rf"Iteration (\d+)(?: \(({number}) iter/s, ({number})s/2 iters\))?"
                             rf", loss = ({number})", line)
        if match:
            losses[int(match.group(1))] = float(match.group(4))
            if match.group(2):
                speeds[int(match.group(1))] = float(match.group(2)), float(match.group(3))
    assert sorted(losses) == [0, 2, 4, 6]
    # Caffe's display line: iterations per second and seconds since the last display line
    # (none before the first); the line after training has no speed
    assert sorted(speeds) == [0, 2, 4] and speeds[0][0] == 0
    for per_s, lapse in (speeds[2], speeds[4]):
        assert lapse > 0 and per_s == pytest.approx(2 / lapse, rel=1e-4)
    rates = {int(m.group(1)): float(m.group(2)) for m in
             (re.fullmatch(rf"Iteration (\d+), lr = ({number})", line) for line in text) if m}
    assert rates == {0: 0.05, 2: 0.025, 4: 0.025}
    tested = [int(m.group(1)) for m in
              (re.fullmatch(r"Iteration (\d+), Testing net \(#0\)", line) for line in text) if m]
    assert tested == [0, 3, 6]
    train_lines = [line for line in text if "Train net output" in line]
    assert train_lines and all(re.fullmatch(
        rf"    Train net output #0: loss = ({number}) \(\* 1 = \1 loss\)", line)
        for line in train_lines), train_lines
    test_lines = [line for line in text if "Test net output" in line]
    assert len(test_lines) == 6 and all(re.fullmatch(
        rf"    Test net output #[01]: (accuracy|loss) = {number}( \(\* 1 = {number} loss\))?",
        line) for line in test_lines), test_lines

    assert sorted(train) == [0, 2, 4]
    for iteration, row in train.items():
        assert row["loss"] == losses[iteration]     # average_loss 1: the same value
    assert sorted(test) == [0, 3, 6]
    for row in test.values():
        assert set(row) == {"lr", "accuracy", "loss"}
        assert 0 <= row["accuracy"] <= 1
        assert row["accuracy"] * 20 == pytest.approx(round(row["accuracy"] * 20), abs=1e-4)
        assert row["loss"] > 0
    assert test[3]["lr"] == 0.025     # the last lr logged before that test pass


# -- 5. LeNet learns the digits -----------------------------------------------------------------

# ~0.96 after 100 iterations; 300 take 20-50 s on two busy cores, beyond this file's budget
LENET_ITERATIONS = 100


def test_lenet_learns_digits(tmp_path):
    spec = importlib.util.spec_from_file_location("digits_builder", REPO / "data" / "digits.py")
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    out = tmp_path / "digits"
    assert digits.main(["--out", str(out)]) == 0
    net = (REPO / "models" / "lenet" / "train_val.prototxt").read_text()
    for split in ("train", "test"):
        assert f'"data/digits/{split}.txt"' in net
        net = net.replace(f'"data/digits/{split}.txt"', f'"{out / split}.txt"')
    (tmp_path / "train_val.prototxt").write_text(net)
    solver_text = (REPO / "models" / "lenet" / "solver.prototxt").read_text()
    param = text_format.Parse(solver_text, pb.SolverParameter())
    param.net = str(tmp_path / "train_val.prototxt")
    param.snapshot_prefix = str(tmp_path / "lenet")
    param.display = 0
    param.test_interval = 0
    solver = syncsgd.get_solver(param)
    # one BLAS thread: on two cores shared with other jobs, two threads spin and run 2-4x slower
    try:
        with limited_budget(1):
            solver.step(LENET_ITERATIONS)
            scores = solver.test(0)
    finally:
        solver.close()
    assert param.test_iter[0] * 100 == 300        # the whole test set
    assert scores["accuracy"][0] >= 0.8, scores


# -- 6. the command line ------------------------------------------------------------------------

def cli(*args, cwd):
    done = subprocess.run([sys.executable, "-m", "syncsgd.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not any(map(GLOG_PREFIX.match, done.stdout.splitlines())), \
        "log lines belong on stderr, as glog writes them"
    return done.stderr


def test_cli_train_resume_and_test(tmp_path):
    train, test = sources(tmp_path)
    model = tmp_path / "net.prototxt"
    model.write_text(net_text(train, test))
    solver_file = tmp_path / "solver.prototxt"
    prefix = tmp_path / "snap" / "tiny"
    solver_file.write_text(SOLVER.replace('"snap/tiny"', f'"{prefix}"') + f'net: "{model}"\n')

    out = cli("train", "--solver", str(solver_file), "--iterations", "3", cwd=tmp_path)
    assert "Optimization Done." in out
    assert Path(f"{prefix}_iter_3.caffemodel").exists()
    assert Path(f"{prefix}_iter_3.solverstate").exists()

    out = cli("train", "-solver", str(solver_file), "-snapshot", f"{prefix}_iter_3.solverstate",
              "-iterations", "5", cwd=tmp_path)
    text = messages(out.splitlines())
    assert f"Restoring previous solver status from {prefix}_iter_3.solverstate" in text
    display = re.compile(r"Iteration (\d+)(?: \(.*\))?, loss = .*")
    trained = [int(m.group(1)) for m in map(display.fullmatch, text) if m]
    assert trained == [3, 4, 5]
    assert Path(f"{prefix}_iter_5.solverstate").exists()

    # the resumed run ends where five iterations in one go end
    solver = syncsgd.get_solver(str(solver_file))
    try:
        solver.step(5)
        expected = param_arrays(solver.net)
    finally:
        solver.close()
    weights = syncsgd.Net(str(model), TEST, weights=f"{prefix}_iter_5.caffemodel")
    assert_same_params(param_arrays(weights), expected)

    accuracy = 0.0
    for _ in range(2):
        accuracy += weights.forward()["accuracy"].item() / 2
    weights.close()
    out = cli("test", "--model", str(model), "--weights", f"{prefix}_iter_5.caffemodel",
              "--iterations", "2", cwd=tmp_path)
    assert f"accuracy = {log.fmt(accuracy)}" in messages(out.splitlines())


# -- 7. bad inputs ------------------------------------------------------------------------------

def test_missing_net_file_is_named(tmp_path, capsys):
    solver_file = tmp_path / "solver.prototxt"
    missing = tmp_path / "absent_net.prototxt"
    solver_file.write_text(f'net: "{missing}"\nbase_lr: 0.1\nmax_iter: 1\n')
    with pytest.raises(PrototxtError, match="absent_net.prototxt"):
        syncsgd.get_solver(str(solver_file))
    assert cli_main(["train", "--solver", str(solver_file)]) == 1
    err = capsys.readouterr().err
    assert "syncsgd train: error:" in err and "absent_net.prototxt" in err


@pytest.mark.parametrize("test_nets, test_iters", [(2, 1), (1, 2)])
def test_test_iter_count_must_match_test_nets(tmp_path, test_nets, test_iters):
    base = solver_param(tmp_path)
    param = pb.SolverParameter()
    param.CopyFrom(base)
    param.ClearField("net_param")
    param.train_net_param.CopyFrom(base.net_param)
    for _ in range(test_nets):
        param.test_net_param.add().CopyFrom(base.net_param)
    del param.test_iter[:]
    param.test_iter.extend([2] * test_iters)
    with pytest.raises(PrototxtError, match=rf"{test_nets} test net\(s\) but {test_iters} "
                                            r"test_iter"):
        syncsgd.get_solver(param)


def test_unknown_lr_policy_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = syncsgd.get_solver(solver_param(tmp_path, 'lr_policy: "cosine" display: 0'))
    try:
        with pytest.raises(PrototxtError, match="unknown lr_policy 'cosine'"):
            solver.step(1)
    finally:
        solver.close()


def test_unknown_regularization_type_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = syncsgd.get_solver(solver_param(tmp_path, 'regularization_type: "L3" display: 0'))
    try:
        with pytest.raises(PrototxtError, match="unknown regularization_type 'L3'"):
            solver.step(1)
    finally:
        solver.close()


def test_restoring_another_nets_state_names_the_blob(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = syncsgd.get_solver(solver_param(tmp_path, "display: 0", conv=5))
    try:
        _, state = other.snapshot()
    finally:
        other.close()
    solver = syncsgd.get_solver(solver_param(tmp_path, "display: 0"))
    try:
        before = param_arrays(solver.net)
        with pytest.raises(WeightsError, match=r"history blob 0 has shape \(5, 1, 3, 3\).*"
                                               r"\(4, 1, 3, 3\)"):
            solver.restore(state)
        assert solver.iter == 0     # nothing changed by the failed restore
        assert_same_params(param_arrays(solver.net), before)
    finally:
        solver.close()


@pytest.mark.parametrize("listed", [False, True])
def test_missing_hdf5_source_is_named(tmp_path, listed):
    param = solver_param(tmp_path)
    layer = param.net_param.layer[0]
    if listed:
        listing = tmp_path / "gone.txt"
        listing.write_text(f"{tmp_path / 'gone.h5'}\n")
        missing = "gone.h5"
    else:
        listing = tmp_path / "no_such_list.txt"
        missing = "no_such_list.txt"
    layer.hdf5_data_param.source = str(listing)
    with pytest.raises(DataError, match=missing):
        syncsgd.get_solver(param)
