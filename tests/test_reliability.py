"""Hostile files, numerical faults and interrupted snapshots end in clear errors and never
damage the last good snapshot."""
import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import weights
from syncsgd.errors import (NumericalError, PrototxtError, ShapeError, SyncSGDError,
                            WeightsError)
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 8 dim: 6 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 2.99 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "ip1"
        inner_product_param { num_output: WIDTH weight_filler { type: "xavier" } } }
EXTRA
layer { name: "ip2" type: "InnerProduct" bottom: "LAST" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def solver_param(tmp_path, extra_layer="", last="ip1", width=16, settings="base_lr: 0.1"):
    net = NET.replace("WIDTH", str(width)).replace("EXTRA", extra_layer).replace("LAST", last)
    param = text_format.Parse(f'type: "SGD" lr_policy: "fixed" random_seed: 1 '
                              f'snapshot_prefix: "{tmp_path}/snap" {settings}',
                              pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(net, pb.NetParameter()))
    return param


def test_nan_in_forward_stops_before_the_update_naming_the_layer(tmp_path):
    solver = syncsgd.get_solver(solver_param(
        tmp_path, 'layer { name: "root" type: "Power" bottom: "ip1" top: "root" '
                  'power_param { power: 0.5 } }', last="root"))
    before = [p.blob.data.copy() for p in solver.net.learnable_params]
    with pytest.raises(NumericalError, match=r"iteration 0: layer 'root' \(Power\) produced a "
                                             r"non-finite value .* no weight was changed"):
        solver.step(1)
    for old, p in zip(before, solver.net.learnable_params):
        np.testing.assert_array_equal(old, p.blob.data)


def test_divergence_names_the_last_snapshot(tmp_path):
    solver = syncsgd.get_solver(solver_param(tmp_path, settings="base_lr: 1e30 snapshot: 1"))
    with pytest.raises(NumericalError, match="last snapshot is .*snap_iter_"):
        solver.step(20)
    assert solver.last_snapshot and os.path.exists(solver.last_snapshot)


def test_checksum_mismatch_is_refused_on_resume(tmp_path):
    solver = syncsgd.get_solver(solver_param(tmp_path))
    solver.step(2)
    model, state = solver.snapshot()
    assert weights.verify_checksum(model) and weights.verify_checksum(state)
    data = bytearray(open(model, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(model, "wb").write(bytes(data))
    fresh = syncsgd.get_solver(solver_param(tmp_path))
    with pytest.raises(WeightsError, match="does not match"):
        fresh.restore(state)


def test_full_disk_keeps_training_and_the_last_snapshot(tmp_path, monkeypatch):
    solver = syncsgd.get_solver(solver_param(tmp_path))
    solver.step(1)
    good_model, good_state = solver.snapshot()
    good = open(good_model, "rb").read()

    def full(path, data):
        with open(path, "wb") as f:
            f.write(next(iter(data))[:10])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(weights, "_write_bytes", full)
    solver.step(1)
    assert solver.snapshot() is None
    solver.step(1)                                   # training goes on
    assert open(good_model, "rb").read() == good
    assert solver.last_snapshot == good_state
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_kill_during_snapshot_never_damages_earlier_snapshots(tmp_path):
    """SIGKILL at random moments of a run that snapshots a 16 MB net every iteration."""
    param = solver_param(tmp_path, width=700, settings="base_lr: 0.01 snapshot: 1 max_iter: 100000")
    param.net_param.layer[1].inner_product_param.num_output = 700
    x = param.net_param.layer[0].dummy_data_param.shape[0]
    x.dim[1] = 6000
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(param))
    rng = np.random.default_rng(0)
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-m", "syncsgd.cli", "train", "--solver",
                                 str(tmp_path / "solver.prototxt")], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = time.time()
        deadline = time.monotonic() + 120     # wait until this run is writing snapshots
        while not any(p.endswith(".caffemodel") and
                      os.path.getmtime(tmp_path / p) > started for p in os.listdir(tmp_path)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        models = sorted(p for p in os.listdir(tmp_path) if p.endswith(".caffemodel"))
        assert models
        for name in models:
            path = str(tmp_path / name)
            if os.path.exists(path + ".sha256"):
                assert weights.verify_checksum(path)
            assert weights.read_weights(path)["ip1"][0][0].size == 700 * 6000
        for name in (p for p in os.listdir(tmp_path) if p.endswith(".solverstate")):
            from syncsgd.solvers.snapshot import read_state
            assert read_state(str(tmp_path / name)).iter >= 1


def write_net(tmp_path, text):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,error,message", [
    ('layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 1000000 '
     'dim: 1000000 } } }', ShapeError, "more than the"),
    ('layer { name: "d" type: "Input" top: "x" input_param { shape { dim: -3 } } }',
     ShapeError, "negative dimension"),
    ('layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
     'layer { name: "a" type: "ReLU" bottom: "x" top: "y" }\n'
     'layer { name: "b" type: "ReLU" bottom: "y" top: "x" }', PrototxtError, "already produced"),
    ('layer { name: "d" type: "Inptu" top: "x" }', PrototxtError, "unknown layer type 'Inptu'"),
    ('layer { name: "d" type: "Input" top: "x" \n  input_param { shape { dim: 2 } }\n bad',
     PrototxtError, r"net.prototxt:3:2"),
])
def test_hostile_prototxt(tmp_path, text, error, message):
    with pytest.raises(error, match=message):
        syncsgd.Net(write_net(tmp_path, text), syncsgd.TEST)


def test_hostile_weight_files(tmp_path):
    net = syncsgd.Net(write_net(tmp_path, NET.replace("WIDTH", "4").replace("EXTRA", "")
                                .replace("LAST", "ip1")), syncsgd.TEST)
    huge = tmp_path / "huge.caffemodel"
    with open(huge, "wb") as f:
        f.truncate(2 * 2**30)                      # sparse: 2 GiB on paper, nothing on disk
    with pytest.raises(WeightsError, match="larger than"):
        net.copy_from(str(huge))
    net.save(str(tmp_path / "w.caffemodel"))
    param = pb.NetParameter.FromString(open(tmp_path / "w.caffemodel", "rb").read())
    blob = next(l for l in param.layer if l.name == "ip1").blobs[0]
    blob.data[3] = float("nan")
    (tmp_path / "nan.caffemodel").write_bytes(param.SerializeToString())
    with pytest.raises(WeightsError, match="1 NaN or infinite"):
        net.copy_from(str(tmp_path / "nan.caffemodel"))
    blob.data[3] = 0
    del blob.shape.dim[:]
    blob.shape.dim.extend([10**6, 10**6])          # declares 10^12 elements, holds 24
    (tmp_path / "big.caffemodel").write_bytes(param.SerializeToString())
    with pytest.raises(WeightsError, match=r"\(1000000, 1000000\)"):
        net.copy_from(str(tmp_path / "big.caffemodel"))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

TOKENS = ['layer', '{', '}', 'name:', 'type:', 'top:', 'bottom:', '"x"', '"y"', '"Input"',
          '"ReLU"', '"Convolution"', '"Pooling"', '"InnerProduct"', 'input_param', 'shape',
          'dim:', '1', '3', '0', '-1', '99999999999', 'convolution_param', 'num_output:',
          'kernel_size:', 'stride:', 'pad:', 'pooling_param', 'inner_product_param', 'axis:',
          'include', 'phase:', 'TRAIN', 'TEST', 'layers', 'input:', 'input_dim:', '#', '\n',
          '"', ':', 'group:', 'dilation:']


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_fuzz_prototxt_gives_clear_errors(tokens):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write(" ".join(tokens))
    try:
        syncsgd.Net(f.name, syncsgd.TEST)
    except SyncSGDError:
        pass
    finally:
        os.unlink(f.name)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=400), st.integers(0, 2))
def test_fuzz_weight_reader_gives_clear_errors(data, prefix):
    import tempfile
    real = open(os.path.join(CAFFE_FIXTURES, "weights", "lenet-ethereon",
                             "lenet_iter_10000.caffemodel"), "rb").read()
    head = [b"", real[:200], real[:5000]][prefix]
    with tempfile.NamedTemporaryFile(suffix=".caffemodel", delete=False) as f:
        f.write(head + data)
    try:
        weights.read_weights(f.name)
    except SyncSGDError:
        pass
    finally:
        os.unlink(f.name)


def hdf5_net(tmp_path, h5_path):
    (tmp_path / "list.txt").write_text(f"{h5_path}\n")
    return write_net(tmp_path, f'layer {{ name: "d" type: "HDF5Data" top: "data" top: "label" '
                               f'hdf5_data_param {{ source: "{tmp_path}/list.txt" '
                               f'batch_size: 4 }} }}')


def test_truncated_and_corrupt_hdf5_data(tmp_path):
    import h5py
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.random.default_rng(0).standard_normal((64, 3, 16, 16)).astype(np.float32)
        f["label"] = np.zeros(64, np.float32)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 3])
    with pytest.raises(SyncSGDError, match="d.h5"):
        syncsgd.Net(hdf5_net(tmp_path, path), syncsgd.TRAIN).forward()
    corrupt = bytearray(whole)
    corrupt[100:4000] = bytes(3900)
    path.write_bytes(bytes(corrupt))
    with pytest.raises(SyncSGDError, match="d.h5"):
        syncsgd.Net(hdf5_net(tmp_path, path), syncsgd.TRAIN).forward()


def test_corrupt_lmdb(tmp_path):
    pytest.importorskip("lmdb")
    db = tmp_path / "db"
    db.mkdir()
    (db / "data.mdb").write_bytes(os.urandom(8192))
    net = write_net(tmp_path, f'layer {{ name: "d" type: "Data" top: "data" top: "label" '
                              f'data_param {{ source: "{db}" batch_size: 2 backend: LMDB }} }}')
    with pytest.raises(SyncSGDError, match="db"):
        syncsgd.Net(net, syncsgd.TRAIN).forward()


def test_truncated_solverstate_and_mean_file(tmp_path):
    from syncsgd.io.mean import load_mean
    from syncsgd.solvers.snapshot import read_state
    fixtures = os.path.join(CAFFE_FIXTURES, "weights", "cifar10-quick-ictchase")
    for name, reader, error in (("cifar10_quick_iter_4000.solverstate", read_state, WeightsError),
                                ("mean.binaryproto", load_mean, SyncSGDError)):
        data = open(os.path.join(fixtures, name), "rb").read()
        cut = tmp_path / name
        cut.write_bytes(data[:len(data) // 2 + 3])
        with pytest.raises(error, match=name):
            reader(str(cut))
