"""Bad input that used to end in a traceback or load silently: each is a one-line error naming the
file, field or rank and the fix. The weight readers are fuzzed with mutations of real files."""
import faulthandler
import os
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

import syncsgd
from syncsgd import TEST, TRAIN
from syncsgd.context import Context
from syncsgd.errors import PrototxtError, ShapeError, WeightsError
from syncsgd.solvers.snapshot import read_state
from tests import mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NET = """name: "two"
layer { name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 8 dim: 2 dim: 3 dim: 3 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv"
        convolution_param { num_output: CHANNELS kernel_size: 2 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def write_net(directory, channels=4, name="net.prototxt"):
    path = directory / name
    path.write_text(NET.replace("CHANNELS", str(channels)))
    return str(path)


def write_solver(directory, settings="max_iter: 2", net=None):
    net = net or write_net(directory)
    path = directory / "solver.prototxt"
    defaults = ['type: "SGD"', "base_lr: 0.1", 'lr_policy: "fixed"', "display: 0",
                "random_seed: 1", f'snapshot_prefix: "{directory}/snap"']
    kept = [d for d in defaults if d.split(":")[0] + ":" not in settings]
    path.write_text(f'net: "{net}" {" ".join(kept)} {settings}')
    return str(path)


def one_line(error):
    text = str(error.value)
    assert "\n" not in text, text
    return text


def cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "syncsgd.cli", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- sizes and counts ---------------------------------------------------------------------------

def test_inner_product_too_large_is_a_size_error_before_allocating(tmp_path):
    path = tmp_path / "big.prototxt"
    path.write_text('layer { name: "data" type: "Input" top: "data" '
                    'input_param { shape { dim: 1 dim: 800 } } }\n'
                    'layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" '
                    'inner_product_param { num_output: 100000000 } }')
    with pytest.raises(ShapeError) as e:
        syncsgd.Net(str(path), TEST)
    text = one_line(e)
    assert "layer 'ip1' (InnerProduct)" in text and "num_output 100000000" in text
    assert "(100000000, 800)" in text


@pytest.mark.parametrize("settings,words", [
    ("iter_size: 0", "iter_size is 0; it must be at least 1"),
    ("iter_size: -2", "iter_size is -2"),
    ("max_iter: -5", "max_iter is -5; it must not be negative"),
    ("average_loss: 0", "average_loss is 0"),
    ("display: -1", "display is -1; it must not be negative"),
    ("snapshot: -10", "snapshot is -10"),
    ("test_interval: -1", "test_interval is -1"),
    ('test_iter: 0 test_interval: 1 test_net: "NET"', "test_iter #0 is 0"),
    ('lr_policy: "poly" power: 1 max_iter: 0', "lr_policy 'poly'"),
])
def test_impossible_solver_values(tmp_path, settings, words):
    net = write_net(tmp_path)
    solver = write_solver(tmp_path, settings.replace("NET", net), net)
    with pytest.raises(PrototxtError) as e:
        syncsgd.get_solver(solver)
    text = one_line(e)
    assert words in text and solver in text
    assert words in cli("train", "--solver", solver)


def test_hdf5_global_batch_smaller_than_the_ranks(tmp_path):
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["data"] = np.zeros((4, 3), np.float32)
        f["label"] = np.zeros(4, np.float32)
    (tmp_path / "list.txt").write_text(f"{data}\n")
    net = tmp_path / "net.prototxt"
    net.write_text(f'layer {{ name: "d" type: "HDF5Data" top: "data" top: "label" '
                   f'hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 1 }} }}')
    for rank in (0, 1):
        with pytest.raises(PrototxtError) as e:
            syncsgd.Net(str(net), TRAIN, ctx=Context(TRAIN, rank=rank, size=2))
        text = one_line(e)
        assert "batch_size 1 is the global batch, split over 2 ranks" in text
        assert "at least the number of ranks" in text
    syncsgd.Net(str(net), TRAIN, ctx=Context(TRAIN, rank=1, size=1)).close()


# -- damaged and mismatched weight files --------------------------------------------------------

def saved(tmp_path, suffix, checksum=False):
    net = syncsgd.Net(write_net(tmp_path), TEST)
    path = str(tmp_path / f"w{suffix}")
    syncsgd.weights.save(net, path, checksum=checksum)
    return net, path


def test_hdf5_with_ten_bytes_changed_in_its_header(tmp_path):
    """Ten bytes set to 0xff at every even offset of the superblock, object headers, B-trees
    and heaps (where HDF5 reports "Unable to get group info", "Link iteration failed", ...)."""
    net, path = saved(tmp_path, ".caffemodel.h5")
    original = open(path, "rb").read()
    target = str(tmp_path / "changed.caffemodel.h5")
    messages = set()
    for at in range(0, min(len(original), 2600), 2):
        data = bytearray(original)
        data[at:at + 10] = b"\xff" * 10
        open(target, "wb").write(bytes(data))
        try:
            net.copy_from(target)
        except WeightsError as e:
            assert "\n" not in str(e) and target in str(e), (at, str(e))
            messages.add(str(e).split(": ")[1])
    assert "cannot read as HDF5 (damaged file?)" in messages


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
def test_a_checksum_record_that_does_not_match_is_refused_wherever_weights_load(tmp_path, suffix):
    net, path = saved(tmp_path, suffix, checksum=True)
    net.copy_from(path)
    with open(path + ".sha256") as f:
        record = f.read()
    with open(path + ".sha256", "w") as f:
        f.write("0" * 64 + record[64:])
    with pytest.raises(WeightsError, match="does not match") as e:
        net.copy_from(path)
    assert path in one_line(e)
    with pytest.raises(WeightsError, match="does not match"):
        syncsgd.Net(write_net(tmp_path), TEST, weights=path)
    assert "does not match" in cli("test", "--model", write_net(tmp_path), "--weights", path,
                                   "--iterations", "1")
    solver = write_solver(tmp_path, "max_iter: 1")
    assert "does not match" in cli("train", "--solver", solver, "--weights", path)


def snapshot_missing_a_layer(tmp_path):
    """An HDF5 snapshot whose weights lack layer 'conv', with no digest that would catch it
    first (as a state written by Caffe has none)."""
    solver = syncsgd.get_solver(write_solver(tmp_path, "max_iter: 2 snapshot_format: HDF5"))
    solver.step(1)
    model, state = solver.snapshot()
    solver.close()
    with h5py.File(model, "a") as f:
        del f["data/conv"]
    with h5py.File(state, "a") as f:
        del f["learned_net_sha256"]
    os.remove(model + ".sha256")
    os.remove(state + ".sha256")
    assert read_state(state).learned_net_sha256 == ""
    return model, state


def test_resume_needs_every_learnable_layer_but_copy_from_keeps_caffes_rule(tmp_path):
    model, state = snapshot_missing_a_layer(tmp_path)
    solver = syncsgd.get_solver(write_solver(tmp_path, "max_iter: 2 snapshot_format: HDF5"))
    with pytest.raises(WeightsError) as e:
        solver.restore(state)
    text = one_line(e)
    assert f"{model}: holds no weights for layer 'conv'" in text
    solver.close()
    assert "holds no weights for layer 'conv'" in cli(
        "train", "--solver", write_solver(tmp_path, "max_iter: 2"), "--snapshot", state)
    net = syncsgd.Net(write_net(tmp_path), TEST)
    before = net.params["conv"][0].data.copy()
    net.copy_from(model)                  # fine-tuning: conv keeps its filler, logged
    assert np.array_equal(net.params["conv"][0].data, before)


def test_train_and_test_nets_whose_shared_layer_differs(tmp_path):
    train, test = write_net(tmp_path, 4, "train.prototxt"), write_net(tmp_path, 5, "test.prototxt")
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'train_net: "{train}" test_net: "{test}" test_iter: 1 test_interval: 10 '
                      'base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    with pytest.raises(ShapeError) as e:
        syncsgd.get_solver(str(solver))
    text = one_line(e)
    assert "layer 'conv' (Convolution)" in text
    assert f"TRAIN net ({train}, [(4, 2, 2, 2), (4,)])" in text
    assert f"TEST net ({test}, [(5, 2, 2, 2), (5,)])" in text


NAN_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import syncsgd
    from syncsgd.errors import NumericalError
    solver = syncsgd.get_solver(sys.argv[1])
    solver.step(2)
    solver.net.params["ip"][0].data[0, 0] = np.nan
    try:
        solver.step(1)
    except NumericalError as e:
        with open(f"{sys.argv[2]}/rank{solver.rank}.txt", "w") as f:
            f.write(str(e))
    solver.close()
""")


def test_nan_on_two_ranks_names_the_last_snapshot_right_on_each(tmp_path):
    solver = write_solver(tmp_path, "max_iter: 10 snapshot: 2")
    script = tmp_path / "nan.py"
    script.write_text(NAN_SCRIPT)
    mpirun.run(2, script, solver, tmp_path, timeout=120)
    first, second = ((tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1))
    assert "iteration 2: layer 'ip' (InnerProduct) produced a non-finite value" in second
    assert f"the last snapshot is {tmp_path}/snap_iter_2.solverstate." in first
    assert "rank 0's log names the last snapshot." in second


# -- fuzz: mutations of small weight files ------------------------------------------------------

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def mutations(data, rng, flips):
    """(label, bytes): truncations at many offsets, single and ten-byte flips."""
    for end in sorted(set(np.linspace(0, len(data) - 1, 120).astype(int))):
        yield f"truncated at {end}", data[:end]
    for _ in range(flips):
        changed = bytearray(data)
        at = int(rng.integers(len(data)))
        width = int(rng.choice([1, 10]))
        changed[at:at + width] = rng.integers(0, 256, len(changed[at:at + width]),
                                              dtype=np.uint8).tobytes()
        yield f"{width} bytes changed at {at}", bytes(changed)


def deleted_groups(path, tmp_path):
    with h5py.File(path, "r") as f:
        names = []
        f.visit(names.append)
    for name in names:
        copy = tmp_path / "deleted.caffemodel.h5"
        copy.write_bytes(open(path, "rb").read())
        with h5py.File(copy, "a") as f:
            del f[name]
        yield f"/{name} deleted", copy.read_bytes()


@pytest.mark.parametrize("suffix", [".caffemodel", ".caffemodel.h5"])
def test_fuzz_weight_readers_give_one_line_errors(tmp_path, suffix):
    """Every mutation loads (a changed value can be a valid one) or raises a one-line
    WeightsError within 10 s and 1 GB above the start, every truncation the error; a hang ends
    the process."""
    net, path = saved(tmp_path, suffix)
    data = open(path, "rb").read()
    rng = np.random.default_rng(18)
    cases = list(mutations(data, rng, 300))
    if suffix.endswith(".h5"):
        cases += list(deleted_groups(path, tmp_path))
    target = str(tmp_path / f"m{suffix}")
    base = status("VmRSS")
    errors = []
    for label, content in cases:
        with open(target, "wb") as f:
            f.write(content)
        faulthandler.dump_traceback_later(10, exit=True)
        started = time.monotonic()
        try:
            net.copy_from(target)
        except WeightsError as e:
            assert "\n" not in str(e) and target in str(e), (label, str(e))
            errors.append(label)
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert time.monotonic() - started < 10, label
        assert status("VmHWM") - base < 2**30, label
    truncated = [label for label, _ in cases if label.startswith("truncated")]
    assert set(truncated) <= set(errors)


def test_hdf5_solver_state_with_its_header_changed(tmp_path):
    solver = syncsgd.get_solver(write_solver(tmp_path, "max_iter: 2 snapshot_format: HDF5"))
    solver.step(1)
    _, state = solver.snapshot()
    data = bytearray(open(state, "rb").read())
    data[40:50] = b"\xff" * 10
    open(state, "wb").write(bytes(data))
    os.remove(state + ".sha256")
    with pytest.raises(WeightsError) as e:
        solver.restore(state)
    assert state in one_line(e) and "HDF5" in one_line(e)
    solver.close()


@pytest.mark.parametrize("suffix", [".solverstate", ".solverstate.h5"])
def test_fuzz_solver_state_reader_gives_one_line_errors(tmp_path, suffix):
    from syncsgd.solvers.snapshot import State, write_state
    rng = np.random.default_rng(7)
    path = str(tmp_path / f"s{suffix}")
    write_state(path, State(3, "w.caffemodel", 1, [rng.standard_normal(n).astype(np.float32)
                                                   for n in (12, 3, 40)], "ab" * 32))
    target = str(tmp_path / f"m{suffix}")
    for label, content in mutations(open(path, "rb").read(), rng, 200):
        with open(target, "wb") as f:
            f.write(content)
        faulthandler.dump_traceback_later(10, exit=True)
        try:
            for stored in read_state(target).history:
                if stored.count < 10**6:      # restore checks the shape before reading
                    stored.values()
        except WeightsError as e:
            assert "\n" not in str(e) and target in str(e), (label, str(e))
        finally:
            faulthandler.cancel_dump_traceback_later()
