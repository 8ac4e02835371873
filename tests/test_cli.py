"""The `syncsgd` command line as users and scripts call it: every flag in Caffe's and the GNU
spelling, the JSON reports of time and plan, and the signal effects of train."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from syncsgd.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def syncsgd(*args, timeout=300, check=True):
    result = subprocess.run([sys.executable, "-m", "syncsgd.cli", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def verb_parsers():
    verbs = next(a for a in build_parser()._actions if a.dest == "verb")
    return verbs.choices


def test_every_flag_of_every_verb_takes_caffes_and_the_gnu_spellings():
    parsers = verb_parsers()
    assert {"train", "test", "time", "device_query", "plan", "parse-log", "plot", "draw",
            "convert", "mean", "extract_features", "summarize", "upgrade_net_proto_text",
            "upgrade_net_proto_binary", "upgrade_solver_proto_text"} <= set(parsers)
    for verb, parser in parsers.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            name = action.dest
            wanted = {f"-{name}", f"--{name}"} | ({f"--{name.replace('_', '-')}"}
                                                  if "_" in name else set())
            assert set(action.option_strings) == wanted, (verb, action.option_strings)


def test_each_spelling_sets_the_same_value():
    parser = build_parser()
    for spelling in ("-sigint_effect", "--sigint_effect", "--sigint-effect"):
        args = parser.parse_args(["train", "-solver", "s.prototxt", spelling, "none"])
        assert (args.solver, args.sigint_effect, args.sighup_effect) == \
            ("s.prototxt", "none", "snapshot")
    args = parser.parse_args(["plan", "--node-flops", "1e12", "-bandwidth", "5e9"])
    assert (args.node_flops, args.bandwidth, args.model) == (1e12, 5e9, None)


def test_time_alexnet_json():
    out = syncsgd("time", "--model", "models/alexnet/deploy.prototxt", "--iterations", 2,
                  "--json")
    report = json.loads(out.stdout)
    assert set(report) >= {"layers", "forward_ms", "backward_ms", "total_ms"}
    names = [layer["name"] for layer in report["layers"]]
    assert names[:2] == ["data", "conv1"] and "fc8" in names
    for layer in report["layers"]:
        assert set(layer) >= {"name", "type", "forward_ms", "backward_ms"}
        assert layer["forward_ms"] >= 0 and layer["backward_ms"] >= 0
    assert report["forward_ms"] == pytest.approx(sum(l["forward_ms"] for l in report["layers"]))


def test_time_human_report_in_caffes_words():
    result = syncsgd("time", "-model", "models/lenet/deploy.prototxt", "-iterations", 2)
    out = result.stdout + result.stderr                # glog lines: stderr, as glog writes
    assert "*** Benchmark begins ***" in out and "Average Forward-Backward:" in out
    assert "conv1\tforward:" in out and "conv1\tbackward:" in out


def test_plan_json_matches_the_contract():
    out = syncsgd("plan", "--model", "models/vgg_a/deploy.prototxt", "--batch", 256, "--nodes",
                  "1,64", "--cluster", "paper-fdr", "--json")
    plan = json.loads(out.stdout)
    for layer in plan["layers"]:
        assert set(layer) >= {"name", "type", "flops", "weight_bytes", "comp_comm_ratio",
                              "strategy", "groups"}
        assert layer["strategy"] in ("data", "model", "hybrid")
    assert [p["nodes"] for p in plan["points"]] == [1, 64]
    assert plan["points"][1]["speedup"] > 10


def write_solver(tmp_path, snapshot=0):
    net = tmp_path / "net.prototxt"
    net.write_text("""
    layer { name: "data" type: "DummyData" top: "x" top: "y"
            dummy_data_param { shape { dim: 4 dim: 8 } shape { dim: 4 dim: 2 }
                               data_filler { type: "gaussian" } } }
    layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
            inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
    layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss" }
    """)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}" base_lr: 0.01 lr_policy: "fixed" max_iter: 10000000 '
                      f'display: 0 snapshot: {snapshot} snapshot_prefix: "{tmp_path}/snap"')
    return solver


def start_training(solver, *flags):
    return subprocess.Popen([sys.executable, "-m", "syncsgd.cli", "train", "--solver", solver,
                             *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for_training(proc):
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if "Learning Rate Policy" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)


def test_sighup_snapshots_and_sigint_stops_with_a_snapshot(tmp_path):
    proc = start_training(write_solver(tmp_path))
    wait_for_training(proc)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None                        # SIGHUP: snapshot and go on
    assert any(p.endswith(".solverstate") for p in os.listdir(tmp_path))
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
    assert "Optimization stopped early." in out
    states = sorted(p for p in os.listdir(tmp_path) if p.endswith(".solverstate"))
    assert len(states) == 2                           # the SIGHUP one and the final one


def test_sigint_effect_none_ignores_the_signal(tmp_path):
    proc = start_training(write_solver(tmp_path), "-sigint_effect", "none")
    wait_for_training(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None                        # ignored, as by Caffe
    proc.kill()
    proc.communicate(timeout=60)
    assert not any(p.endswith(".solverstate") for p in os.listdir(tmp_path))
