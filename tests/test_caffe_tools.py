"""The `caffe` tool's flags and verbs and Caffe's extra tools, as Caffe users call them: -gpu,
-level, -stage, device_query, time's glog report (once under mpiexec), the upgrade tools,
extract_features, summarize, plot's chart types, draw's arguments and pycaffe's caffe.draw.

Where Caffe's own code is the judge (its schema, parse_log.py, summarize.py), the tests read it
from a Caffe checkout named by CAFFE_ROOT (e.g. `git clone https://github.com/BVLC/caffe`) and
skip without one; none of those is kept in this repository.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TEST, TRAIN
from syncsgd.cli import build_parser, main
from syncsgd.compile import compile_net
from syncsgd.proto import pb
from tests.paths import CAFFE_FIXTURES

ROOT = Path(__file__).resolve().parent.parent
PYTHONPATH = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [^\s\]]+\] (.*)$")


def caffe_file(relative):
    root = os.environ.get("CAFFE_ROOT")
    if not root or not (Path(root) / relative).is_file():
        pytest.skip(f"set CAFFE_ROOT to a BVLC Caffe checkout to compare with its {relative}")
    return Path(root) / relative


@pytest.fixture(scope="module")
def caffe_pb2(tmp_path_factory):
    """Caffe's own schema module, compiled from CAFFE_ROOT's caffe.proto."""
    proto = caffe_file("src/caffe/proto/caffe.proto")
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path_factory.mktemp("caffe_pb2")
    shutil.copy(proto, out / "caffe.proto")
    assert grpc_tools.main(["protoc", f"-I{out}", f"--python_out={out}", "caffe.proto"]) == 0
    sys.path.insert(0, str(out))
    try:
        import caffe_pb2
    finally:
        sys.path.remove(str(out))
    return caffe_pb2


@pytest.fixture(scope="module")
def schema(request):
    """Caffe's own schema module when CAFFE_ROOT is set, else syncsgd's (the same messages,
    which parse Caffe's files): what an upgraded file must parse with."""
    if os.environ.get("CAFFE_ROOT"):
        return request.getfixturevalue("caffe_pb2")
    return pb


def cli(*args, timeout=300):
    """Run `python -m syncsgd.cli ARGS`; returns (exit status, stdout and stderr together)."""
    result = subprocess.run([sys.executable, "-m", "syncsgd.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=timeout,
                            env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    return result.returncode, result.stdout


def fails(argv, capsys):
    """Run a verb in-process that must fail as a user error: its one-line message."""
    assert main(list(map(str, argv))) == 1
    return capsys.readouterr().err


def assert_glog_lines(output):
    """Every line is a glog line, but for the text protos that follow Caffe's "Initializing ...
    from parameters: " lines."""
    in_dump = False
    for line in output.splitlines():
        match = GLOG_LINE.match(line)
        if match:
            in_dump = match.group(1).endswith(" from parameters: ")
        else:
            assert in_dump, f"not a glog line: {line!r}\n{output}"


def messages(output):
    """The message part of every glog line of an output."""
    return [m.group(1) for m in map(GLOG_LINE.match, output.splitlines()) if m]


# -- -gpu, -level, -stage, device_query ---------------------------------------------------------

STAGED_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "y"
        dummy_data_param { shape { dim: 4 dim: 8 } shape { dim: 4 dim: 2 }
                           data_filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss" }
layer { name: "staged" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "staged_loss"
        include { stage: "b" stage: "c" } }
layer { name: "deep" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "deep_loss"
        include { min_level: 2 } }
layer { name: "unless_a" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "plain_loss"
        exclude { stage: "a" } }
"""
STATE_FLAGS = ["-stage", "a,b", "--stage", "c", "-level", "2"]


@pytest.fixture
def staged(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(STAGED_NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}" base_lr: 0.01 lr_policy: "fixed" max_iter: 0 display: 1 '
                      f'snapshot_after_train: false snapshot_prefix: "{tmp_path}/snap"')
    weights = tmp_path / "w.caffemodel"
    syncsgd.Net(str(net), TEST).save(str(weights))
    return net, solver, weights


def test_gpu_level_and_stage_parse_on_train_test_and_time():
    parser = build_parser()
    for verb, required in (("train", ["-solver", "s"]), ("test", ["-model", "m", "-weights", "w"]),
                           ("time", ["-model", "m"])):
        args = parser.parse_args([verb, *required, "-gpu", "all", *STATE_FLAGS])
        assert (args.gpu, args.level) == ("all", 2)
        from syncsgd.cli.caffe import stages
        assert stages(args) == ["a", "b", "c"]
        args = parser.parse_args([verb, *required])
        assert (args.gpu, args.level, args.stage) == (None, 0, [])


def test_train_sets_the_solver_train_state(staged, monkeypatch, capfd):
    _, solver_path, _ = staged
    import syncsgd.solvers
    made = []
    real = syncsgd.solvers.get_solver

    def recording(solver, sync=None):
        made.append(real(solver, sync=sync))
        return made[-1]

    monkeypatch.setattr(syncsgd.solvers, "get_solver", recording)
    assert main(["train", "-solver", str(solver_path), "-gpu", "0", *STATE_FLAGS]) == 0
    assert made[0].param.train_state.level == 2
    assert list(made[0].param.train_state.stage) == ["a", "b", "c"]
    layers = set(made[0].net.layer_dict)
    assert {"staged", "deep"} <= layers and "unless_a" not in layers
    assert main(["train", "-solver", str(solver_path)]) == 0
    layers = set(made[1].net.layer_dict)
    assert "unless_a" in layers and not {"staged", "deep"} & layers
    said = messages("".join(capfd.readouterr()))
    assert said.count("-gpu 0: syncsgd runs on the CPU; the flag is ignored") == 1
    assert said.count("Use CPU.") == 2


def test_test_builds_the_net_with_level_and_stages(staged, capfd):
    net, _, weights = staged
    assert main(["test", "-model", str(net), "-weights", str(weights), "-iterations", "1",
                 *STATE_FLAGS]) == 0
    said = messages("".join(capfd.readouterr()))
    scores = {m.split(" = ")[0] for m in said if " = " in m and not m.startswith("Batch")}
    assert {"loss", "staged_loss", "deep_loss"} <= scores and "plain_loss" not in scores
    assert main(["test", "-model", str(net), "-weights", str(weights), "-iterations", "1"]) == 0
    said = messages("".join(capfd.readouterr()))
    scores = {m.split(" = ")[0] for m in said if " = " in m and not m.startswith("Batch")}
    assert {"loss", "plain_loss"} <= scores and not {"staged_loss", "deep_loss"} & scores


def test_time_builds_the_net_with_level_and_stages(staged, capsys):
    import json
    net, _, _ = staged
    assert main(["time", "-model", str(net), "-iterations", "1", "--json", *STATE_FLAGS]) == 0
    names = [layer["name"] for layer in json.loads(capsys.readouterr().out)["layers"]]
    assert {"staged", "deep"} <= set(names) and "unless_a" not in names


def test_device_query_names_the_cpu_and_says_there_is_no_gpu():
    for flags in ([], ["-gpu", "0"], ["-gpu", "all"]):
        status, out = cli("device_query", *flags)
        assert status == 0, out
        said = messages(out)
        assert said[0] == " ".join(["Querying GPUs", *flags[1:]])
        assert any(m.startswith("No GPU: syncsgd runs on the CPU") for m in said)
        cpu = next(m for m in said if m.startswith("CPU: "))
        assert len(cpu) > len("CPU: ")
        assert f"CPU cores: {os.cpu_count()} " in "\n".join(said) + " "


# -- time: Caffe's glog report, once ------------------------------------------------------------

def caffe_time_report(said, layer_names):
    """Check the lines `caffe time` prints, in its order; returns {name: (forward, backward)}."""
    k = said.index("*** Benchmark begins ***")
    assert said[k + 1] == "Testing for 2 iterations."
    assert re.fullmatch(r"Iteration: 1 forward-backward time: [\d.e+-]+ ms\.", said[k + 2])
    k = said.index("Average time per layer: ")
    times = {}
    for i, name in enumerate(layer_names):
        fwd = re.fullmatch(rf" *{name}\tforward: ([\d.e+-]+) ms\.", said[k + 1 + 2 * i])
        bwd = re.fullmatch(rf" *{name}\tbackward: ([\d.e+-]+) ms\.", said[k + 2 + 2 * i])
        assert fwd and bwd, said[k + 1 + 2 * i:k + 3 + 2 * i]
        assert len(said[k + 1 + 2 * i].split("\t")[0]) == max(10, len(name))   # setw(10)
        times[name] = (float(fwd.group(1)), float(bwd.group(1)))
    tail = said[k + 1 + 2 * len(layer_names):]
    patterns = [rf"{what}: ([\d.e+-]+) ms\." for what in (
        "Average Forward pass", "Average Backward pass", "Average Forward-Backward", "Total Time")]
    values = [float(re.fullmatch(p, line).group(1)) for p, line in zip(patterns, tail)]
    assert tail[4] == "*** Benchmark ends ***"
    assert values[0] == pytest.approx(sum(f for f, _ in times.values()), rel=1e-3)
    assert values[3] == pytest.approx(2 * values[2], rel=1e-3)
    return times


LENET_DEPLOY_LAYERS = ["data", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "prob"]


def test_time_prints_caffes_report_in_glog_lines():
    status, out = cli("time", "-model", "models/lenet/deploy.prototxt", "-iterations", 2,
                      "-gpu", "0")
    assert status == 0, out
    assert_glog_lines(out)
    said = messages(out)
    assert said.count("-gpu 0: syncsgd runs on the CPU; the flag is ignored") == 1
    times = caffe_time_report(said, LENET_DEPLOY_LAYERS)
    assert times["conv1"][0] > 0


@pytest.mark.mpi
def test_time_under_mpiexec_reports_once():
    from mpirun import run
    result = run(2, "-m", "syncsgd.cli", "time", "-model", "models/lenet/deploy.prototxt",
                 "-iterations", 2)
    out = result.stdout + result.stderr
    said = messages(out)
    assert said.count("*** Benchmark ends ***") == 1
    caffe_time_report(said, LENET_DEPLOY_LAYERS)
    result = run(2, "-m", "syncsgd.cli", "time", "-model", "models/lenet/deploy.prototxt",
                 "-iterations", 1, "--json")
    assert result.stdout.count('"layers"') == 1


# -- the upgrade tools --------------------------------------------------------------------------

def test_upgrade_net_proto_text_of_a_v1_net(tmp_path, schema):
    legacy = CAFFE_FIXTURES / "prototxt/yxliwhu_NYUD-FCN8s/VGG_ILSVRC_16_layers_deploy.prototxt"
    out = tmp_path / "vgg.prototxt"
    status, log = cli("upgrade_net_proto_text", legacy, out)
    assert status == 0, log
    assert f"Wrote upgraded NetParameter text proto to {out}" in messages(log)
    text = out.read_text()
    theirs = text_format.Parse(text, schema.NetParameter())    # Caffe's schema reads it
    assert not theirs.layers and not theirs.input and len(theirs.layer) == 40
    assert theirs.layer[0].type == "Input" and theirs.layer[1].type == "Convolution"
    for phase in (TRAIN, TEST):                                   # the same net either way
        assert compile_net(str(out), phase)[0] == compile_net(str(legacy), phase)[0]
    again = tmp_path / "again.prototxt"
    status, log = cli("upgrade_net_proto_text", out, again)
    assert status == 0 and f"File already in latest proto format: {out}" in messages(log)
    assert again.read_text() == text


def test_upgrade_net_proto_binary_of_v1_weights(tmp_path, schema):
    folder = CAFFE_FIXTURES / "weights/lenet-v1-pl8787"
    out = tmp_path / "lenet.caffemodel"
    status, log = cli("upgrade_net_proto_binary", folder / "lenet_iter_10000", out)
    assert status == 0, log
    theirs = schema.NetParameter.FromString(out.read_bytes())
    assert not theirs.layers and [l.type for l in theirs.layer][:2] == ["Data", "Convolution"]
    conv = next(l for l in theirs.layer if l.name == "conv1")
    assert [p.lr_mult for p in conv.param] == [1, 2] and len(conv.blobs) == 2
    deploy = str(folder / "lenet.prototxt")
    old = syncsgd.Net(deploy, TEST, weights=str(folder / "lenet_iter_10000"))
    new = syncsgd.Net(deploy, TEST, weights=str(out))
    for name in old.params:
        for a, b in zip(old.params[name], new.params[name]):
            assert np.array_equal(a.data, b.data)
    x = np.random.default_rng(0).random(old.blobs["data"].shape, dtype=np.float32)
    assert np.array_equal(old.forward(data=x)["prob"], new.forward(data=x)["prob"])


def test_upgrade_solver_proto_text(tmp_path, schema):
    legacy = tmp_path / "old_solver.prototxt"
    legacy.write_text('net: "net.prototxt" base_lr: 0.01 solver_type: ADAGRAD max_iter: 10\n'
                      'net_param { name: "n" layers { name: "ip" type: INNER_PRODUCT '
                      'bottom: "x" top: "y" blobs_lr: 2 } }\n')
    out = tmp_path / "solver.prototxt"
    status, log = cli("upgrade_solver_proto_text", legacy, out)
    assert status == 0, log
    theirs = text_format.Parse(out.read_text(), schema.SolverParameter())
    assert theirs.type == "AdaGrad" and not theirs.HasField("solver_type")
    assert (theirs.base_lr, theirs.max_iter, theirs.net) == (pytest.approx(0.01), 10,
                                                             "net.prototxt")
    assert [(l.type, l.param[0].lr_mult) for l in theirs.net_param.layer] == \
        [("InnerProduct", 2)]
    status, log = cli("upgrade_solver_proto_text", out, tmp_path / "again.prototxt")
    assert status == 0 and f"File already in latest proto format: {out}" in messages(log)
    both = tmp_path / "both.prototxt"
    both.write_text('type: "Adam" solver_type: NESTEROV')
    status, log = cli("upgrade_solver_proto_text", both, tmp_path / "x.prototxt")
    assert status == 1 and "solver_type NESTEROV and type 'Adam' disagree" in log
    broken = tmp_path / "broken.prototxt"
    broken.write_text("base_lr: 0.01 no_such_field: 3")
    status, log = cli("upgrade_solver_proto_text", broken, tmp_path / "y.prototxt")
    assert status == 2 and "Failed to parse input text file as SolverParameter" in log
    assert not (tmp_path / "y.prototxt").exists()


def test_tools_wrappers_are_the_verbs(tmp_path):
    legacy = CAFFE_FIXTURES / "prototxt/yxliwhu_NYUD-FCN8s/VGG_ILSVRC_16_layers_deploy.prototxt"
    out = tmp_path / "vgg.prototxt"
    result = subprocess.run([sys.executable, str(ROOT / "tools/upgrade_net_proto_text.py"),
                             str(legacy), str(out)], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert "layer {" in out.read_text() and "layers {" not in out.read_text()
    for name, verb in (("upgrade_net_proto_binary", "upgrade_net_proto_binary"),
                       ("upgrade_solver_proto_text", "upgrade_solver_proto_text"),
                       ("extract_features", "extract_features"), ("summarize", "summarize"),
                       ("plot_training_log", "plot"), ("draw_net", "draw"),
                       ("device_query", "device_query")):
        result = subprocess.run([sys.executable, str(ROOT / f"tools/{name}.py"), "-h"],
                                capture_output=True, text=True, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert result.stdout.startswith(f"usage: syncsgd {verb} "), (name, result.stderr)


# -- extract_features ---------------------------------------------------------------------------

FEATURE_NET = """
name: "features"
layer { name: "data" type: "DummyData" top: "x"
        dummy_data_param { shape { dim: 3 dim: 2 dim: 2 dim: 2 }
                           data_filler { type: "uniform" } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "feat"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" }
                              bias_filler { type: "uniform" } } }
"""


@pytest.fixture
def feature_net(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(FEATURE_NET)
    weights = tmp_path / "w.caffemodel"
    trained = syncsgd.Net(str(net), TEST)
    trained.save(str(weights))
    w, b = (blob.data.copy() for blob in trained.params["ip"])
    return net, weights, w, b


def test_extract_features_to_lmdb_as_caffe_writes_it(tmp_path, feature_net):
    lmdb = pytest.importorskip("lmdb")
    net, weights, w, b = feature_net
    dbs = f"{tmp_path}/x_db,{tmp_path}/feat_db"
    status, out = cli("extract_features", weights, net, "x,feat", dbs, 2, "lmdb", "GPU", 0)
    assert status == 0, out
    said = messages(out)
    assert "Extracted features of 6 query images for feature blob feat" in said
    assert said[-1] == "Successfully extracted the features!"
    records = {}
    for name in ("x", "feat"):
        env = lmdb.open(f"{tmp_path}/{name}_db", readonly=True, lock=False)
        with env.begin() as txn:
            records[name] = [(k, pb.Datum.FromString(v)) for k, v in txn.cursor()]
        env.close()
    assert [k for k, _ in records["feat"]] == [b"%010d" % n for n in range(6)]
    assert {(d.channels, d.height, d.width) for _, d in records["x"]} == {(2, 2, 2)}
    assert {(d.channels, d.height, d.width) for _, d in records["feat"]} == {(5, 1, 1)}
    x = np.array([d.float_data for _, d in records["x"]], dtype=np.float32)   # (6, 8)
    feat = np.array([d.float_data for _, d in records["feat"]], dtype=np.float32)
    assert not any(d.data for _, d in records["x"])
    np.testing.assert_allclose(feat, x @ w.T + b, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(x[:3], x[3:])               # two batches, not one repeated


def test_extract_features_to_hdf5_and_errors(tmp_path, feature_net, capsys):
    import h5py
    net, weights, w, b = feature_net
    status, out = cli("extract_features", weights, net, "feat,x", f"{tmp_path}/f.h5,"
                      f"{tmp_path}/x.h5", 3, "hdf5")
    assert status == 0, out
    with h5py.File(tmp_path / "f.h5") as f, h5py.File(tmp_path / "x.h5") as g:
        feat, x = f["feat"][...], g["x"][...]
    assert feat.shape == (9, 5) and x.shape == (9, 2, 2, 2) and feat.dtype == np.float32
    np.testing.assert_allclose(feat, x.reshape(9, -1) @ w.T + b, rtol=1e-5, atol=1e-6)
    for args, message in (((f"{tmp_path}/a", 1, "leveldb"), "LevelDB is not supported"),
                          ((f"{tmp_path}/f.h5", 1, "hdf5"), "already exists"),
                          ((f"{tmp_path}/a,{tmp_path}/b", 1, "lmdb"), "1 blob names but 2")):
        assert message in fails(["extract_features", weights, net, "feat", *args], capsys)
    assert "unknown feature blob name fc7" in fails(
        ["extract_features", weights, net, "fc7", f"{tmp_path}/c", 1, "lmdb"], capsys)


# -- summarize ----------------------------------------------------------------------------------

SUMMARY_NET = """
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { name: "cw" lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 1 } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "py" type: "Python" bottom: "pool" bottom: "label" top: "out"
        python_param { module: "mine" layer: "Thing" } loss_weight: 0.5 }
"""


def test_summarize_prints_caffes_table(tmp_path, capsys):
    path = tmp_path / "net.prototxt"
    path.write_text(SUMMARY_NET)
    assert main(["summarize", str(path), "--color", "never"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "data Input                                    -> data              ",
        "conv Convolution (cw, x2.0 Dx0.0) data        -> conv      3/2+1 4 ",
        "pool Pooling                      conv        -> pool      2/2     ",
        "py   mine.Thing                   pool, label -> 0.5 * out         ",
    ]
    assert main(["summarize", str(path), "--max-width", "8", "--color", "always"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "\033[41mlabel\033[0m" in lines[3]                  # read, never written: red
    assert "\033[95m0.5 * \033[1;4mout\033[0m" in lines[3]     # written, never read: underlined
    assert lines[0] == "data Input                   -> \033[92mdata\033[0m            "
    assert lines[1].startswith("conv Convolution (cw, x2.0 Dx0.0) \033[92mdata\033[0m -> ")


def caffe_summarize(tmp_path, caffe_pb2, net_path):
    """The table of Caffe's own summarize.py (Python 2), run on Python 3 from a temporary copy
    with its two Python 2 idioms rewritten (the print statement, a list-returning map)."""
    script = caffe_file("tools/extra/summarize.py").read_text()
    script = script.replace("print row_str", "print(row_str)")
    script = script.replace("param_strs = map(format_param, lr.param)",
                            "param_strs = list(map(format_param, lr.param))")
    package = tmp_path / "shim" / "caffe" / "proto"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    shutil.copy(caffe_pb2.__file__, package / "caffe_pb2.py")
    (tmp_path / "summarize.py").write_text(script)
    result = subprocess.run([sys.executable, str(tmp_path / "summarize.py"), str(net_path)],
                            capture_output=True, text=True, check=True,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path / "shim")))
    return result.stdout


@pytest.mark.parametrize("net", ["models/lenet/train_val.prototxt", "summary"])
def test_summarize_matches_caffes_script(tmp_path, caffe_pb2, capsys, net):
    path = ROOT / net
    if net == "summary":
        path = tmp_path / "net.prototxt"
        path.write_text(SUMMARY_NET)
    theirs = caffe_summarize(tmp_path, caffe_pb2, path)
    assert main(["summarize", str(path), "--color", "always"]) == 0
    assert capsys.readouterr().out == theirs


# -- plot: plot_training_log.py's chart types ---------------------------------------------------

TRAINING_LOG = """\
I0101 10:00:00.000000  1 solver.cpp:1] Solving LeNet
I0101 10:00:01.000000  1 solver.cpp:1] Iteration 0, Testing net (#0)
I0101 10:00:01.000000  1 solver.cpp:1]     Test net output #0: accuracy = 0.1
I0101 10:00:01.000000  1 solver.cpp:1]     Test net output #1: loss = 2.3 (* 1 = 2.3 loss)
I0101 10:00:02.000000  1 solver.cpp:1] Iteration 0, loss = 2.4
I0101 10:00:02.000000  1 solver.cpp:1]     Train net output #0: loss = 2.4 (* 1 = 2.4 loss)
I0101 10:00:02.000000  1 solver.cpp:1] Iteration 0, lr = 0.01
I0101 10:00:04.000000  1 solver.cpp:1] Iteration 10, loss = 1.2
I0101 10:00:04.000000  1 solver.cpp:1]     Train net output #0: loss = 1.2 (* 1 = 1.2 loss)
I0101 10:00:04.000000  1 solver.cpp:1] Iteration 10, lr = 0.005
I0101 10:00:05.000000  1 solver.cpp:1] Iteration 20, Testing net (#0)
I0101 10:00:05.000000  1 solver.cpp:1]     Test net output #0: accuracy = 0.8
I0101 10:00:05.000000  1 solver.cpp:1]     Test net output #1: loss = 0.6 (* 1 = 0.6 loss)
I0101 10:00:06.000000  1 solver.cpp:1] Iteration 20, loss = 0.5
I0101 10:00:06.000000  1 solver.cpp:1] Iteration 20, lr = 0.0025
"""


def test_chart_types_are_plot_training_logs():
    from syncsgd.plot import CHART_TYPES
    assert CHART_TYPES == [
        "Test accuracy  vs. Iters", "Test accuracy  vs. Seconds", "Test loss  vs. Iters",
        "Test loss  vs. Seconds", "Train learning rate  vs. Iters",
        "Train learning rate  vs. Seconds", "Train loss  vs. Iters", "Train loss  vs. Seconds"]


def test_chart_points_of_each_type(tmp_path):
    from syncsgd.logs import parse_log
    from syncsgd.plot import chart_points
    path = tmp_path / "run.log"
    path.write_text(TRAINING_LOG)
    log = parse_log(str(path), year=2024)
    assert chart_points(log, 0) == [(0, 1.0, 0.1), (20, 5.0, 0.8)]
    assert chart_points(log, 3) == chart_points(log, 2) == [(0, 1.0, 2.3), (20, 5.0, 0.6)]
    assert chart_points(log, 4) == [(0, 2.0, 0.01), (10, 4.0, 0.005)]
    assert chart_points(log, 6) == [(0, 2.0, 2.4), (10, 4.0, 1.2), (20, 6.0, 0.5)]


def test_plot_chart_type_out_and_logs_positionally(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from test_tools import pixels_near, png
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    first.write_text(TRAINING_LOG)
    second.write_text(TRAINING_LOG.replace("loss = 0.5", "loss = 0.9"))
    for chart in range(8):
        out = tmp_path / f"chart{chart}.png"
        assert main(["plot", str(chart), str(out), str(first), str(second)]) == 0
        image = png(out)
        assert image.shape == (480, 640, 3)
        assert pixels_near(image, (31, 119, 180)) > 20 and pixels_near(image, (255, 127, 14)) > 20
    assert "8 is not a valid chart type" in fails(["plot", 8, tmp_path / "x.png", first], capsys)
    assert "7: Train loss  vs. Seconds" in fails(["plot", first, tmp_path / "x.png"], capsys)
    assert main(["plot", str(first), "--out", str(tmp_path / "panels.png")]) == 0
    assert png(tmp_path / "panels.png").shape == (450, 1500, 3)


# -- draw: draw_net.py's arguments and pycaffe's caffe.draw -------------------------------------

LENET = ROOT / "models/lenet/train_val.prototxt"


def test_draw_takes_draw_net_pys_arguments(tmp_path, capsys):
    out = tmp_path / "lenet.raw"
    assert main(["draw", str(LENET), str(out), "--rankdir", "TB", "--phase", "TRAIN",
                 "--display_lrm"]) == 0
    assert capsys.readouterr().out.startswith(f"Drawing net to {out}\n")
    text = out.read_text()
    assert "rankdir=TB" in text and "train_data" in text and "test_data" not in text
    assert text.count("lr mult: 1.0, 2.0") == 4
    assert main(["draw", "--model", str(LENET), "--out", str(out)]) == 0
    assert "lr mult" not in out.read_text() and "test_data" in out.read_text()
    for wrong in ([LENET], [LENET, out, "--model", LENET], []):
        assert "INPUT_NET_PROTO_FILE OUTPUT_IMAGE_FILE" in fails(["draw", *wrong], capsys)


def bvlc_nets():
    folder = CAFFE_FIXTURES / "prototxt/BVLC_caffe"
    return sorted(p for p in folder.rglob("*.prototxt") if "solver" not in p.name)


def test_pycaffe_draw_api_draws_every_reference_net(tmp_path):
    """pycaffe's test_draw.py: draw_net(NetParameter, 'LR') for every net prototxt."""
    pytest.importorskip("matplotlib")
    import syncsgd.draw as draw
    nets = bvlc_nets()
    assert len(nets) >= 10
    for path in nets:
        net = text_format.Parse(path.read_text(), pb.NetParameter())
        picture = draw.draw_net(net, "LR")
        assert picture.startswith(b"\x89PNG\r\n\x1a\n"), path
    engine = draw.draw_net_to_file(net, str(tmp_path / "last.svg"), "TB", TEST)
    assert engine in ("graphviz", "matplotlib") and "<svg" in (tmp_path / "last.svg").read_text()


def test_pycaffe_draw_takes_caffes_own_messages(caffe_pb2):
    import syncsgd.draw as draw
    net = text_format.Parse(LENET.read_text(), caffe_pb2.NetParameter())
    raw = draw.draw_net(net, "BT", "raw", caffe_pb2.TEST).decode()
    assert "rankdir=BT" in raw and "test_data" in raw and "train_data" not in raw


def test_get_pydot_graph(tmp_path):
    pydot = pytest.importorskip("pydot")
    import syncsgd.draw as draw
    net = text_format.Parse(LENET.read_text(), pb.NetParameter())
    graph = draw.get_pydot_graph(net, "LR", phase=TRAIN)
    assert isinstance(graph, pydot.Dot) and "rankdir=LR" in graph.to_string()
    nodes = [n for n in graph.get_nodes() if n.get_name() not in ("node", "graph", "edge")]
    ours = draw.net_graph(net, TRAIN)
    assert len(nodes) == len(ours.nodes) == 9 + 10      # layers, blobs (ip1 twice: in place)
    assert len(graph.get_edges()) == len(ours.edges)


def test_draw_with_graphviz_when_dot_is_installed(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot program is not installed (apt-get install graphviz)")
    pytest.importorskip("graphviz")
    import syncsgd.draw as draw
    net = text_format.Parse(LENET.read_text(), pb.NetParameter())
    assert draw.draw_net_to_file(net, str(tmp_path / "n.pdf"), engine="graphviz") == "graphviz"
    assert (tmp_path / "n.pdf").read_bytes().startswith(b"%PDF")


# -- Caffe's parse_log.py reads what `syncsgd train` writes -------------------------------------

def test_caffes_parse_log_reads_a_syncsgd_training_log(tmp_path):
    from syncsgd.logs import parse_log
    net = tmp_path / "net.prototxt"
    net.write_text(STAGED_NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(textwrap.dedent(f"""\
        net: "{net}" base_lr: 0.01 lr_policy: "step" gamma: 0.5 stepsize: 4 max_iter: 8
        display: 2 test_iter: 1 test_interval: 4 random_seed: 3
        snapshot_after_train: false snapshot_prefix: "{tmp_path}/snap"
        """))
    log = tmp_path / "train.log"
    with open(log, "w") as stderr:                      # `syncsgd train ... 2> train.log`
        done = subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", "-solver", solver],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                              timeout=300, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert done.returncode == 0, log.read_text()[-3000:]
    assert not messages(done.stdout), "log lines belong on stderr, as glog writes them"
    folder = tmp_path / "caffe"
    folder.mkdir()
    script = caffe_file("tools/extra/parse_log.py").read_text()
    script = script.replace("print 'Wrote %s' % output_filename",    # its one Python 2 line
                            "print('Wrote %s' % output_filename)")
    (folder / "parse_log.py").write_text(script)
    shutil.copy(caffe_file("tools/extra/extract_seconds.py"), folder)
    result = subprocess.run([sys.executable, str(folder / "parse_log.py"), str(log),
                             str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    import csv
    with open(tmp_path / "train.log.train") as f:
        train = list(csv.DictReader(f))
    with open(tmp_path / "train.log.test") as f:
        test = list(csv.DictReader(f))
    ours = parse_log(str(log))
    assert [int(float(r["NumIters"])) for r in train] == [0, 2, 4, 6]   # display: 2, max_iter 8
    assert [int(float(r["NumIters"])) for r in test] == [0, 4, 8]
    assert [float(r["loss"]) for r in train] == [r["loss"] for r in ours.train]
    assert [float(r["loss"]) for r in test] == [r["loss"] for r in ours.test]
    rates = {int(float(r["NumIters"])): float(r["LearningRate"]) for r in train}
    assert rates[2] == pytest.approx(0.01) and rates[6] == pytest.approx(0.005)
    assert all(float(r["Seconds"]) >= 0 for r in train + test)
