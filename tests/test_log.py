"""Caffe's logs as glog writes them: on stderr with no set-up (command line and Python), only on
rank 0 of an MPI launch, GLOG_minloglevel / GLOG_log_dir / GLOG_logtostderr and --log_dir with
glog's file names, and the start-up lines Caffe prints while it builds the solver and its nets."""
import getpass
import io
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import log
from syncsgd.cli import main
from syncsgd.proto import pb

ROOT = Path(__file__).resolve().parent.parent
GLOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [^\s\]]+:\d+\] (.*)$")

NET = """
layer { name: "data" type: "DummyData" top: "x" top: "y"
        dummy_data_param { shape { dim: 4 dim: 8 } shape { dim: 4 dim: 2 }
                           data_filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "out" top: "out" }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss"
        loss_weight: 0.5 }
"""

# Caffe's Net::Init lines for NET: tops in order, in-place marked, the running sum of top bytes
NET_LINES = [
    "Creating Layer data", "data -> x", "data -> y", "Setting up data",
    "Top shape: 4 8 (32)", "Top shape: 4 2 (8)", "Memory required for data: 160",
    "Creating Layer ip", "ip <- x", "ip -> out", "Setting up ip",
    "Top shape: 4 2 (8)", "Memory required for data: 192",
    "Creating Layer relu", "relu <- out", "relu -> out (in-place)", "Setting up relu",
    "Top shape: 4 2 (8)", "Memory required for data: 224",
    "Creating Layer loss", "loss <- out", "loss <- y", "loss -> loss", "Setting up loss",
    "Top shape: (1)", "    with loss weight 0.5", "Memory required for data: 228",
    "loss needs backward computation.", "relu needs backward computation.",
    "ip needs backward computation.", "data does not need backward computation.",
    "This network produces output loss", "Network initialization done."]


@pytest.fixture(autouse=True)
def default_log():
    """Each test starts and ends with the default set-up (stderr, this process's settings)."""
    log.configure()
    yield
    log.configure()


def solver_file(tmp_path, settings="max_iter: 3 display: 1"):
    (tmp_path / "net.prototxt").write_text(NET)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{tmp_path}/net.prototxt" base_lr: 0.01 lr_policy: "fixed" '
                    f'test_iter: 1 test_interval: 100 random_seed: 2 {settings} '
                    f'snapshot_after_train: false snapshot_prefix: "{tmp_path}/snap"')
    return path


def glog_messages(text):
    return [m.group(2) for m in map(GLOG_LINE.match, text.splitlines()) if m]


def python(script, *args, **env):
    """Run `script` in a fresh interpreter with `env` added (launcher variables removed)."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MV2_", "GLOG_"))}
    environ.update(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=environ)


TRAIN_SCRIPT = """
import sys, syncsgd
solver = syncsgd.get_solver(sys.argv[1])
solver.step(2)
solver.close()
"""

NET_SCRIPT = """
import sys, syncsgd
from syncsgd import log
syncsgd.Net(sys.argv[1], syncsgd.TEST)
log.info("done")
"""


def test_python_logs_to_stderr_with_no_set_up(tmp_path):
    done = python(TRAIN_SCRIPT, solver_file(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    said = glog_messages(done.stderr)
    assert "Solver scaffolding done." in said
    assert any(re.fullmatch(r"Iteration 1 \([\d.e+-]+ iter/s, [\d.e+-]+s/1 iters\), "
                            r"loss = [\d.e+-]+", m) for m in said), said


@pytest.mark.parametrize("variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                      "MV2_COMM_WORLD_RANK"])
def test_only_rank_0_of_a_launch_logs(tmp_path, variable):
    solver_file(tmp_path)
    net = tmp_path / "net.prototxt"
    quiet = python(NET_SCRIPT, net, **{variable: "1"})
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    loud = python(NET_SCRIPT, net, **{variable: "0"})
    assert glog_messages(loud.stderr)[-1] == "done"


def test_min_log_level_hides_the_lower_levels(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setenv("GLOG_minloglevel", "1")
    log.configure(stream=stream)
    log.info("an info line")
    log.LOGGER.warning("a warning")
    log.error("an error")
    letters = [GLOG_LINE.match(line).group(1) for line in stream.getvalue().splitlines()]
    assert letters == ["W", "E"]


def glog_files(folder, program):
    """{severity: file name} of glog's files in `folder`, checking the names and links."""
    pattern = re.compile(rf"{re.escape(program)}\.{re.escape(socket.gethostname())}\."
                         rf"{re.escape(getpass.getuser())}\.log\.(INFO|WARNING|ERROR)\."
                         rf"\d{{8}}-\d{{6}}\.{os.getpid()}")
    found = {}
    for path in folder.iterdir():
        if path.is_symlink():
            continue
        match = pattern.fullmatch(path.name)
        assert match, path.name
        found[match.group(1)] = path.name
        assert os.readlink(folder / f"{program}.{match.group(1)}") == path.name
    return found


def test_log_dir_writes_glogs_files_and_stderr(tmp_path, monkeypatch):
    folder = tmp_path / "logs"
    monkeypatch.setenv("GLOG_log_dir", str(folder))
    stream = io.StringIO()
    log.configure(stream=stream, program="prog")
    log.info("one")
    log.LOGGER.warning("two")
    log.configure()
    files = glog_files(folder, "prog")
    assert sorted(files) == ["INFO", "WARNING"]         # no error logged: no ERROR file
    info = (folder / files["INFO"]).read_text().splitlines()
    assert info[0].startswith("Log file created at: ")
    assert info[1] == f"Running on machine: {socket.gethostname()}"
    assert info[3:] == stream.getvalue().splitlines()
    assert glog_messages("\n".join(info)) == ["one", "two"]
    assert glog_messages((folder / files["WARNING"]).read_text()) == ["two"]

    monkeypatch.setenv("GLOG_logtostderr", "1")         # glog: stderr only, no files
    log.configure(stream=io.StringIO(), log_dir=str(tmp_path / "none"))
    log.info("three")
    assert not (tmp_path / "none").exists()


def test_train_log_dir_flag(tmp_path, capfd):
    folder = tmp_path / "logs"
    assert main(["train", "-solver", str(solver_file(tmp_path)), "-log_dir", str(folder)]) == 0
    err = capfd.readouterr().err
    files = glog_files(folder, "syncsgd")
    assert list(files) == ["INFO"]
    logged = (folder / files["INFO"]).read_text().splitlines()[3:]
    assert logged == err.splitlines()                   # and everything on stderr too
    assert glog_messages(err)[-1] == "Optimization Done."


def test_start_up_prints_what_caffe_prints(tmp_path):
    path = solver_file(tmp_path)
    stream = io.StringIO()
    log.configure(stream=stream)
    solver = syncsgd.get_solver(str(path))
    solver.close()
    text = stream.getvalue()
    said = glog_messages(text)
    # the solver's parameters as a text proto, on the lines after the first
    first, rest = text.split("\n", 1)
    assert GLOG_LINE.match(first).group(2) == "Initializing solver from parameters: "
    dump = rest.split("\n", 1)[0]
    assert not GLOG_LINE.match(dump)
    proto = rest[:rest.index(next(line for line in rest.splitlines() if GLOG_LINE.match(line)))]
    assert text_format.Parse(proto, pb.SolverParameter()) == solver.param
    train = said.index(f"Creating training net from net file: {tmp_path}/net.prototxt")
    test = said.index(f"Creating test net (#0) specified by net file: {tmp_path}/net.prototxt")
    assert said[train + 1] == "Initializing net from parameters: "
    assert said[train + 2:test] == NET_LINES
    assert said[test + 2:test + 2 + len(NET_LINES)] == NET_LINES
    assert said[-2:] == ["Solver scaffolding done.", "Training on 1 rank"]


@pytest.mark.mpi
def test_two_ranks_log_once_naming_the_ranks_and_fc_modes(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    import mpirun
    path = solver_file(tmp_path, "max_iter: 2 display: 1")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([mpirun.mpiexec(), "-n", "2", sys.executable, "-c", TRAIN_SCRIPT,
                           str(path)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    said = glog_messages(done.stderr)
    assert said.count("Solver scaffolding done.") == 1
    assert said.count("Network initialization done.") == 2       # train and test net, once
    ranks = [m for m in said if m.startswith("Training on")]
    assert len(ranks) == 1 and re.fullmatch(
        r"Training on 2 ranks; fully connected layers ip: (DATA|MODEL|HYBRID \(groups: \d+\))",
        ranks[0]), ranks
    pids = {line.split()[2] for line in done.stderr.splitlines() if GLOG_LINE.match(line)}
    assert len(pids) == 1
