"""Every update rule and lr policy against Caffe's formulas, computed independently here."""
import math
import os
from dataclasses import replace

import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd.proto import pb
from syncsgd.solvers.lr_policy import learning_rate

NET = """
name: "linear"
layer { name: "data" type: "DummyData" top: "x" top: "y"
        dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
                           data_filler { type: "%s" std: 1 value: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss" }
"""


def make_solver(tmp_path, solver_text, filler="gaussian"):
    param = text_format.Parse(solver_text, pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(NET % filler, pb.NetParameter()))
    param.random_seed = 7
    param.snapshot_prefix = str(tmp_path / "snap")
    return syncsgd.get_solver(param)


def gradients(w, b, x, y):
    """d loss / d (w, b) for loss = sum((x w^T + b - y)^2) / (2 N), in float64."""
    d = (x @ w.T + b - y) / x.shape[0]
    return d.T @ x, d.sum(0)


class Reference:
    """Caffe's update rules in float64, written from the formulas in Caffe's solvers."""

    def __init__(self, kind, p, shapes):
        self.kind, self.p, self.t = kind, p, 0
        self.h = [np.zeros(s) for s in shapes]
        self.h2 = [np.zeros(s) for s in shapes]

    def update(self, i, g, rate):
        p, h, h2 = self.p, self.h, self.h2
        if self.kind == "SGD":
            h[i] = p.momentum * h[i] + rate * g
            return h[i]
        if self.kind == "Nesterov":
            old = h[i].copy()
            h[i] = p.momentum * h[i] + rate * g
            return (1 + p.momentum) * h[i] - p.momentum * old
        if self.kind == "AdaGrad":
            h[i] += g * g
            return rate * g / (np.sqrt(h[i]) + p.delta)
        if self.kind == "RMSProp":
            h[i] = p.rms_decay * h[i] + (1 - p.rms_decay) * g * g
            return rate * g / (np.sqrt(h[i]) + p.delta)
        if self.kind == "AdaDelta":
            h[i] = p.momentum * h[i] + (1 - p.momentum) * g * g
            step = g * np.sqrt((h2[i] + p.delta) / (h[i] + p.delta))
            h2[i] = p.momentum * h2[i] + (1 - p.momentum) * step * step
            return rate * step
        if self.kind == "Adam":
            h[i] = p.momentum * h[i] + (1 - p.momentum) * g
            h2[i] = p.momentum2 * h2[i] + (1 - p.momentum2) * g * g
            t = self.t + 1
            corr = math.sqrt(1 - p.momentum2 ** t) / (1 - p.momentum ** t)
            return rate * corr * h[i] / (np.sqrt(h2[i]) + p.delta)
        raise AssertionError(self.kind)


SOLVERS = {
    "SGD": 'type: "SGD" base_lr: 0.1 momentum: 0.9',
    "Nesterov": 'type: "Nesterov" base_lr: 0.1 momentum: 0.9',
    "AdaGrad": 'type: "AdaGrad" base_lr: 0.1',
    "RMSProp": 'type: "RMSProp" base_lr: 0.01 rms_decay: 0.95',
    "AdaDelta": 'type: "AdaDelta" base_lr: 1.0 momentum: 0.95 delta: 1e-6',
    "Adam": 'type: "Adam" base_lr: 0.01 momentum: 0.9 momentum2: 0.999',
}


@pytest.mark.parametrize("kind", sorted(SOLVERS))
@pytest.mark.parametrize("reg", ["L2", "L1"])
def test_update_rule_matches_caffe_formula(tmp_path, kind, reg):
    text = SOLVERS[kind] + f' lr_policy: "step" gamma: 0.5 stepsize: 2 weight_decay: 0.01 ' \
                           f'regularization_type: "{reg}" max_iter: 5'
    solver = make_solver(tmp_path, text)
    assert type(solver).__name__ == f"{kind}Solver"
    p = solver.param
    w_blob, b_blob = solver.net.params["ip"]
    ref = Reference(kind, p, [w_blob.shape, b_blob.shape])
    for it in range(5):
        w, b = w_blob.data.astype(np.float64), b_blob.data.astype(np.float64)
        solver.step(1)
        x = solver.net.blobs["x"].data.astype(np.float64)
        y = solver.net.blobs["y"].data.astype(np.float64)
        gw, gb = gradients(w, b, x, y)
        gw = gw + 0.01 * (w if reg == "L2" else np.sign(w))   # decay_mult 1 on w, 0 on b
        rate = 0.1 * 0.5 ** (it // 2) if kind in ("SGD", "Nesterov", "AdaGrad") else \
            p.base_lr * 0.5 ** (it // 2)
        w_expect = w - ref.update(0, gw, rate * 1)
        b_expect = b - ref.update(1, gb, rate * 2)
        ref.t += 1
        np.testing.assert_allclose(w_blob.data, w_expect, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(b_blob.data, b_expect, rtol=2e-4, atol=1e-6)


def test_iter_size_and_clipping(tmp_path):
    solver = make_solver(tmp_path, 'type: "SGD" base_lr: 0.5 lr_policy: "fixed" iter_size: 3 '
                                   'clip_gradients: 0.05 max_iter: 3', filler="constant")
    w_blob, b_blob = solver.net.params["ip"]
    for _ in range(3):
        w, b = w_blob.data.astype(np.float64), b_blob.data.astype(np.float64)
        solver.step(1)
        x = solver.net.blobs["x"].data.astype(np.float64)
        y = solver.net.blobs["y"].data.astype(np.float64)
        gw, gb = gradients(w, b, x, y)     # the same on each of the 3 passes: constant data
        # Caffe clips the accumulated gradient (3 passes) before dividing by iter_size.
        norm = 3 * math.sqrt((gw ** 2).sum() + (gb ** 2).sum())
        scale = min(1.0, 0.05 / norm)
        assert scale < 1.0
        np.testing.assert_allclose(w_blob.data, w - 0.5 * scale * gw, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(b_blob.data, b - 1.0 * scale * gb, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("policy,extra,expect", [
    ("fixed", "", lambda it: 0.1),
    ("step", "gamma: 0.1 stepsize: 3", lambda it: 0.1 * 0.1 ** (it // 3)),
    ("exp", "gamma: 0.9", lambda it: 0.1 * 0.9 ** it),
    ("inv", "gamma: 0.01 power: 0.75", lambda it: 0.1 * (1 + 0.01 * it) ** -0.75),
    ("multistep", "gamma: 0.5 stepvalue: 2 stepvalue: 5",
     lambda it: 0.1 * 0.5 ** ((it >= 2) + (it >= 5))),
    ("poly", "power: 2 max_iter: 10", lambda it: 0.1 * (1 - it / 10) ** 2),
    ("sigmoid", "gamma: -0.5 stepsize: 4", lambda it: 0.1 / (1 + math.exp(0.5 * (it - 4)))),
])
def test_lr_policies(policy, extra, expect):
    param = text_format.Parse(f'base_lr: 0.1 lr_policy: "{policy}" {extra}',
                              pb.SolverParameter())

    class State:
        current_step = 0
    state = State()
    for it in range(10):
        assert learning_rate(param, it, state) == pytest.approx(expect(it), rel=1e-6)


def test_legacy_solver_type_enum(tmp_path):
    solver = make_solver(tmp_path, "solver_type: ADAM base_lr: 0.01 lr_policy: 'fixed'")
    assert isinstance(solver, syncsgd.AdamSolver)


def test_unknown_solver_type_is_named(tmp_path):
    with pytest.raises(syncsgd.errors.PrototxtError, match="unknown solver type 'Adamm'"):
        make_solver(tmp_path, 'type: "Adamm" base_lr: 0.1')


@pytest.mark.parametrize("reg", ["L2", "L1"])
def test_iter_size_clipping_and_weight_decay_together(tmp_path, reg):
    """The update folds 1/iter_size and the clipping factor into one scale of the accumulated
    gradient and adds the weight decay in the same pass: Caffe's order, clip, divide, decay."""
    solver = make_solver(tmp_path, 'type: "SGD" base_lr: 0.5 momentum: 0.9 lr_policy: "fixed" '
                                   f'iter_size: 2 clip_gradients: 0.05 weight_decay: 0.1 '
                                   f'regularization_type: "{reg}" max_iter: 3', filler="constant")
    w_blob, b_blob = solver.net.params["ip"]
    hw, hb = np.zeros(w_blob.shape), np.zeros(b_blob.shape)
    for _ in range(3):
        w, b = w_blob.data.astype(np.float64), b_blob.data.astype(np.float64)
        solver.step(1)
        x = solver.net.blobs["x"].data.astype(np.float64)
        y = solver.net.blobs["y"].data.astype(np.float64)
        gw, gb = gradients(w, b, x, y)     # the same on both passes: constant data
        scale = min(1.0, 0.05 / (2 * math.sqrt((gw ** 2).sum() + (gb ** 2).sum())))
        assert scale < 1.0
        hw = 0.9 * hw + 0.5 * (scale * gw + 0.1 * (w if reg == "L2" else np.sign(w)))
        hb = 0.9 * hb + 1.0 * scale * gb     # decay_mult 0 on the bias
        np.testing.assert_allclose(w_blob.data, w - hw, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(b_blob.data, b - hb, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(SOLVERS))
def test_snapshot_diff_holds_the_applied_step(tmp_path, kind):
    """As in Caffe, a snapshot with snapshot_diff stores the step of the last update as the
    diff. Without a reader the step goes straight into the weights, bit for bit the same."""
    text = SOLVERS[kind] + ' lr_policy: "fixed" weight_decay: 0.01 max_iter: 3'
    solver = make_solver(tmp_path / "diff", text + " snapshot: 3 snapshot_diff: true")
    plain = make_solver(tmp_path / "plain", text)
    solver.step(2)
    plain.step(2)
    before = [blob.data.astype(np.float64) for blob in solver.net.params["ip"]]
    solver.step(1)
    plain.step(1)
    model = pb.NetParameter.FromString((tmp_path / "diff" / "snap_iter_3.caffemodel").read_bytes())
    stored = {layer.name: layer.blobs for layer in model.layer}["ip"]
    for old, blob, proto, other in zip(before, solver.net.params["ip"], stored,
                                       plain.net.params["ip"]):
        step = np.asarray(proto.diff, np.float32).reshape(blob.shape)
        assert np.abs(step).max() > 0
        np.testing.assert_allclose(step, old - blob.data, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(blob.data, other.data)


def test_unknown_regularization_type_is_named(tmp_path):
    solver = make_solver(tmp_path, 'type: "SGD" base_lr: 0.1 lr_policy: "fixed" '
                                   'weight_decay: 0.1 regularization_type: "L3"')
    with pytest.raises(syncsgd.errors.PrototxtError, match="unknown regularization_type 'L3'"):
        solver.step(1)


@pytest.mark.parametrize("kind", sorted(SOLVERS))
@pytest.mark.parametrize("keep_step", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reg", ["L1", "L2"])
def test_blocked_update_is_the_whole_slice_update(tmp_path, monkeypatch, thread_budget, kind,
                                                  keep_step, threads, reg):
    """The update walks a parameter in blocks, shared out to threads from update_spread_min
    elements: elementwise, so blocks of 2 on one thread, or of 4 (a short last block of the 6
    weights) on the thread pool, give the one-block result bit for bit (SGD with L2 decay: on BLAS's
    level-1 calls, where each of these 6 weights is rounded as one short call rounds it)."""
    from syncsgd.solvers import gradient
    thread_budget(threads)
    text = SOLVERS[kind] + (f' lr_policy: "fixed" weight_decay: 0.01 regularization_type: '
                            f'"{reg}" iter_size: 2 clip_gradients: 0.05')
    whole = make_solver(tmp_path / "whole", text)
    blocked = make_solver(tmp_path / "blocked", text)
    whole.keep_step = blocked.keep_step = keep_step
    whole.step(3)
    monkeypatch.setattr(gradient, "THRESHOLDS", replace(gradient.THRESHOLDS, update_block=2,
                                                        update_spread_min=0))
    blocked.step(3)
    for a, b in zip(whole.net.params["ip"], blocked.net.params["ip"]):
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(a.diff, b.diff)
    for a, b in zip(whole.history, blocked.history):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("decay", [0.0, 0.01])
@pytest.mark.parametrize("keep_step", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("momentum,scale", [(0.9, 0.5), (0.0, 1.0)])
def test_sgd_on_blas_level1_calls_matches_the_ufunc_rule(monkeypatch, thread_budget, decay,
                                                         keep_step, threads, momentum, scale):
    """Gradient.momentum_step (saxpy / sscal / scopy a block) computes what `apply` with SGD's
    ufunc rule computes, up to rounding (fused multiply-adds), on slices that start inside
    larger arrays, in several blocks with a short last one, shared out or not; in blocks of
    64 it gives one call's bits. L1 decay, strided, read-only, non-float32 and mismatched
    arrays are left to `apply`."""
    from syncsgd.kernels import blas
    from syncsgd.solvers import gradient, sgd
    if blas.level1() is None:
        pytest.skip("numpy's BLAS has no saxpy/sscal/scopy here")
    thread_budget(threads)

    rng = np.random.default_rng(5)
    size = 9001
    diff, data, history = (rng.standard_normal(size + 3).astype(np.float32)[3:]
                           for _ in range(3))
    rate, momentum = np.float32(0.05), np.float32(momentum)

    def run(way, block):
        monkeypatch.setattr(gradient, "THRESHOLDS", replace(
            gradient.THRESHOLDS, update_block=block, update_spread_min=4000))
        d, w, h = (np.concatenate([np.zeros(5, np.float32), a])[5:] for a in (diff, data,
                                                                              history))
        grad = gradient.Gradient(d, w, scale, decay, "L2", keep_step)
        if way == "level1":
            assert grad.momentum_step(h, momentum, rate)
        else:
            grad.apply(lambda g, spare, hb: sgd._momentum(g, hb, momentum, rate) or hb, [h])
        return d, w, h
    fast, ufuncs = run("level1", 1000), run("ufuncs", 1000)
    for a, b in zip(fast, ufuncs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(run("level1", 64), run("level1", 1 << 20)):
        np.testing.assert_array_equal(a, b)
    expected = momentum * history.astype(np.float64) + rate * (scale * diff + decay * data)
    np.testing.assert_allclose(fast[2], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fast[1], data - expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fast[0], fast[2] if keep_step else diff)
    l1 = gradient.Gradient(diff.copy(), data.copy(), 1.0, 0.01, "L1", False)
    assert not l1.momentum_step(history.copy(), momentum, rate)
    frozen = data.copy()
    frozen.flags.writeable = False
    for d, w, h in [(diff[::2], data[::2], history[::2]), (diff, frozen, history),
                    (diff.astype(np.float64), data, history), (diff, data, history[1:])]:
        assert not gradient.Gradient(d, w, 1.0, 0.01, "L2", False).momentum_step(h, momentum,
                                                                                  rate)


def test_sgd_with_l2_decay_steps_on_blas_level1_calls(tmp_path, monkeypatch):
    from syncsgd.kernels import blas
    from syncsgd.solvers import gradient
    if blas.level1() is None:
        pytest.skip("numpy's BLAS has no saxpy/sscal/scopy here")
    taken = []
    real = gradient.Gradient.momentum_step
    monkeypatch.setattr(gradient.Gradient, "momentum_step",
                        lambda self, *args: taken.append(real(self, *args)) or taken[-1])
    make_solver(tmp_path, SOLVERS["SGD"] + ' lr_policy: "fixed" weight_decay: 0.01').step(2)
    assert taken == [True] * 4      # two parameters, two iterations


def test_one_process_training_never_loads_mpi(tmp_path):
    """The solver reaches other ranks only through its sync object: on one process that is
    LocalSync, so training and snapshots import no mpi4py."""
    import subprocess
    import sys
    script = f"""
import pathlib, sys
import test_solvers
solver = test_solvers.make_solver(pathlib.Path({str(tmp_path)!r}),
                                  'type: "SGD" base_lr: 0.1 lr_policy: "fixed"')
solver.step(2)
solver.snapshot()
assert type(solver.sync).__name__ == "LocalSync"
assert "mpi4py" not in sys.modules, "one-process training imported mpi4py"
"""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def imported_modules(package):
    """Every module named by an import statement anywhere in syncsgd/<package>/ (also inside
    functions), resolved to absolute names."""
    import ast
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "syncsgd",
                        package)
    names = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
    return names


@pytest.mark.parametrize("package, forbidden", [
    ("solvers", ("mpi4py", "syncsgd.parallel.")),   # only syncsgd.parallel's default_sync
    ("plan", ("syncsgd.parallel", "syncsgd.solvers")),
    ("layers", ("syncsgd.parallel", "syncsgd.solvers", "syncsgd.plan", "mpi4py")),
])
def test_packages_import_in_one_direction(package, forbidden):
    """parallel may use plan (mode choice) and layers, never the reverse: no import cycle."""
    bad = sorted(m for m in imported_modules(package) if m.startswith(forbidden))
    assert not bad, f"syncsgd/{package} imports {bad}"


def test_callbacks_fire_each_iteration_before_the_update(tmp_path):
    """pycaffe's add_callback: on_start once per iteration, on_gradients_ready with the
    gradients in place and before the update (zeroing them leaves plain SGD's weights alone)."""
    solver = make_solver(tmp_path, 'type: "SGD" base_lr: 0.1 lr_policy: "fixed"')
    before = [b.data.copy() for b in solver.net.params["ip"]]
    seen = []

    def zero_gradients():
        seen.append(float(np.abs(solver.net.params["ip"][0].diff).sum()))
        for blob in solver.net.params["ip"]:
            blob.diff[...] = 0
    solver.add_callback(lambda: seen.append("start"), zero_gradients)
    solver.step(2)
    assert seen[0::2] == ["start", "start"] and all(g > 0 for g in seen[1::2])
    for a, b in zip(before, solver.net.params["ip"]):
        np.testing.assert_array_equal(a, b.data)


def test_share_weights_gives_a_net_the_trained_weights(tmp_path):
    solver = make_solver(tmp_path, 'type: "SGD" base_lr: 0.1 lr_policy: "fixed"')
    net = syncsgd.Net(solver.net.param, syncsgd.TEST)
    solver.share_weights(net)
    solver.step(1)
    for a, b in zip(net.params["ip"], solver.net.params["ip"]):
        assert a.data is b.data
