"""Convolution kernels chosen by timing (kernels/tuning.py, plans.convolution_candidates): every
candidate computes the same values, the choice is kept on disk and reused, the fixed-rules switch
and a broken cache behave, and processes timing at once agree."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

import mpirun
from syncsgd import TRAIN
from syncsgd.kernels import onednn, plans, tuning, winograd
from syncsgd.kernels.plans import THRESHOLDS, plan_convolution
from syncsgd.layers import convolution
from syncsgd.net import Net
from syncsgd.proto import pb

from gradcheck import blobs_from, make_layer, run_forward

pytestmark = pytest.mark.skipif(not onednn.available(), reason="oneDNN not loadable here")

# 8 x 16 x 12 x 12 images (chunks of several samples), 32 maps of 3 x 3 windows: at least
# TIMED_FLOPS however strided or grouped, so timed, and quick to time.
TEXT = ("name: 'conv' type: 'Convolution' convolution_param { num_output: 32 kernel_size: 3 %s "
        "weight_filler { type: 'gaussian' std: 0.1 } bias_filler { type: 'gaussian' } }")
SHAPE = (8, 16, 12, 12)
TIMED_FLOPS = 5e5


@pytest.fixture
def timed(monkeypatch):
    """Kernels timed (the suite runs the fixed rules: conftest.py), convolutions of TIMED_FLOPS
    and more among them."""
    monkeypatch.delenv("SYNCSGD_KERNELS", raising=False)
    thresholds = replace(THRESHOLDS, timed_min_flops=TIMED_FLOPS)
    monkeypatch.setattr(convolution, "THRESHOLDS", thresholds)
    monkeypatch.setattr(convolution.ConvolutionBase, "thresholds", thresholds)


@pytest.fixture
def cache(timed, tmp_path, monkeypatch):
    """A cache folder of the test's own, and this process's memory of earlier choices gone."""
    monkeypatch.setenv("SYNCSGD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    return tmp_path


def cache_entries(folder):
    (path,) = [p for p in folder.iterdir() if p.suffix == ".json"]
    return json.loads(path.read_text())["choices"]


def choices_of_layers(entries):
    """The keys of each direction's choices, without those of the gradients timed together."""
    return [key for key in entries if "gradients_after" not in json.loads(key)]


def passes(layer, x, dy, params=True):
    """(top, bottom diff, parameter diffs) of one forward and backward pass."""
    bottom = blobs_from([x])
    (top,) = run_forward(layer, bottom)
    top.diff[...] = dy
    for b in layer.blobs:
        b.diff[...] = 0
    layer.param_propagate_down = None if params else [False] * len(layer.blobs)
    layer.backward([top], [True], bottom)
    return top.data.copy(), bottom[0].diff.copy(), [b.diff.copy() for b in layer.blobs]


def close(have, want):
    assert abs(want).max() > 0
    np.testing.assert_allclose(have, want, rtol=2e-4, atol=2e-4 * abs(want).max())


@pytest.mark.parametrize("settings", ["pad: 1", "pad: 1 group: 2", "stride: 2"])
def test_every_candidate_of_every_direction_computes_the_fixed_rules_values(
        settings, cache, monkeypatch):
    """Each direction on each kernel oneDNN offers, or on the GEMM kernels, with the others on
    the GEMM kernels (so an image gradient runs with no weight gradient before it, or after
    oneDNN's), gives the fixed rules' values; so does a pass whose parameters are not learned,
    which leaves their diffs alone."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(SHAPE, np.float32)
    monkeypatch.setenv("SYNCSGD_KERNELS", "rules")
    layer = make_layer(TEXT % settings)
    run_forward(layer, blobs_from([x]))
    dy = rng.standard_normal(layer._top_batch, np.float32)
    reference = passes(layer, x, dy)
    monkeypatch.delenv("SYNCSGD_KERNELS")
    candidates = layer._candidates(layer.geometry, layer.plan.threads, "DEFAULT")
    assert set(candidates) == set(onednn.DIRECTIONS)
    assert all(["gemm"] in options and len(options) > 2 for options in candidates.values())
    for direction, options in candidates.items():
        for candidate in options:
            forced = {d: list(plans.GEMM) for d in candidates}
            forced[direction] = candidate
            monkeypatch.setattr(tuning, "choice", lambda key, candidates, prepare, label: (
                {"backward": candidates["backward"][0]} if "backward" in candidates else forced))
            for params in (True, False):
                top, bottom_diff, diffs = passes(make_layer(TEXT % settings), x, dy, params)
                close(top, reference[0])
                close(bottom_diff, reference[1])
                for have, want in zip(diffs, reference[2]):
                    if params:
                        close(have, want)
                    else:
                        assert not have.any()


def test_a_choice_is_timed_once_kept_on_disk_and_reused(cache, monkeypatch):
    """Each direction's choice, and the gradients' together where it was timed (a second entry,
    keyed by the first: gradient_pairs), are what the layer runs, and what a new process reads."""
    x = np.random.default_rng(0).standard_normal(SHAPE, np.float32)
    layer = make_layer(TEXT % "pad: 1")
    run_forward(layer, blobs_from([x]))
    (key,) = choices_of_layers(cache_entries(cache))
    entry = cache_entries(cache)[key]
    assert json.loads(key)["geometry"]["num"] == SHAPE[0]
    assert set(entry) == set(onednn.DIRECTIONS)
    paired = [e["backward"] for k, e in cache_entries(cache).items()
              if json.loads(k).get("gradients_after") == entry]
    candidates = layer._candidates(layer.geometry, layer.plan.threads, "DEFAULT")
    assert len(paired) == (plans.gradient_pairs(entry, candidates) is not None)
    final = paired[0] if paired else entry
    for direction in onednn.DIRECTIONS:
        assert getattr(layer.plan, direction) == (final[direction][0] if final[direction][0]
                                                  != "gemm" else getattr(layer.plan, direction))
        assert (getattr(layer.plan, direction) == "onednn") == (final[direction][0] == "onednn")

    def no_timing(*args):
        raise AssertionError("timed again")
    monkeypatch.setattr(tuning, "_fastest", no_timing)
    monkeypatch.setattr(tuning, "_MEMORY", {})      # as a new process: from the file
    again = make_layer(TEXT % "pad: 1")
    run_forward(again, blobs_from([x]))
    assert again.plan == layer.plan


# "r" takes forms (only ReLU and a convolution touch it) but gets none: the ReLU passes on the
# layout of its bottom, a BatchNorm's array. "p" gets the pooling's form.
ARRAY_OR_FORM = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 16 dim: 12
                                                                     dim: 12 } } }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "n" }
layer { name: "relu" type: "ReLU" bottom: "n" top: "r" }
layer { name: "conv_r" type: "Convolution" bottom: "r" top: "cr"
        convolution_param { num_output: 32 kernel_size: 3 } }
layer { name: "pool" type: "Pooling" bottom: "n" top: "p"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv_p" type: "Convolution" bottom: "p" top: "cp"
        convolution_param { num_output: 32 kernel_size: 3 } }
"""


def test_gradient_pairs_are_a_mixed_choice_and_each_winograd_kernel_on_both():
    onednn_kernel, four, two = ["onednn", "any", "jit"], ["winograd4"], ["winograd"]
    candidates = {"forward": [["gemm"], four, onednn_kernel],
                  "weight_grad": [["gemm"], four, two, onednn_kernel],
                  "image_grad": [["gemm"], four, onednn_kernel]}
    mixed = {"forward": onednn_kernel, "weight_grad": onednn_kernel, "image_grad": four}
    assert plans.gradient_pairs(mixed, candidates) == [
        mixed, {"forward": onednn_kernel, "weight_grad": four, "image_grad": four}]
    both = {**mixed, "weight_grad": four}
    assert plans.gradient_pairs(both, candidates) is None
    neither = {d: ["gemm"] for d in candidates}
    assert len(plans.gradient_pairs(neither, candidates)) == 2
    no_winograd = {d: [c for c in options if c[0] not in ("winograd", "winograd4")]
                   for d, options in candidates.items()}
    assert plans.gradient_pairs(neither, no_winograd) is None


def test_gradients_timed_together_run_as_chosen(cache, monkeypatch):
    """Where each direction alone chose another kernel for the image gradient than for the
    weight gradient, both run together on each Winograd kernel too (the runs are real), and the
    plan takes the pair chosen; its values are the fixed rules'."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal(SHAPE, np.float32)
    monkeypatch.setenv("SYNCSGD_KERNELS", "rules")
    layer = make_layer(TEXT % "pad: 1")
    run_forward(layer, blobs_from([x]))
    dy = rng.standard_normal(layer._top_batch, np.float32)
    reference = passes(layer, x, dy)
    monkeypatch.delenv("SYNCSGD_KERNELS")
    real_fastest, timed_pairs = tuning._fastest, []

    def fastest(direction, candidates, prepare):
        _, times = real_fastest(direction, candidates, prepare)
        if direction == "backward":
            timed_pairs.append(candidates)
            return candidates[-1], times
        return ({"weight_grad": ["gemm"]}.get(direction) or
                next(c for c in candidates if c[0].startswith("winograd"))), times
    monkeypatch.setattr(tuning, "_fastest", fastest)
    layer = make_layer(TEXT % "pad: 1")
    top, bottom_diff, diffs = passes(layer, x, dy)
    (pairs,) = timed_pairs
    first_winograd = pairs[0]["image_grad"]
    assert pairs[0]["weight_grad"] == ["gemm"] and first_winograd[0].startswith("winograd")
    assert len(pairs) == 1 + len(winograd.names(layer.geometry))
    assert (layer.plan.weight_grad, layer.plan.image_grad) == tuple(pairs[-1]["image_grad"] * 2)
    assert layer.plan.forward == first_winograd[0]
    close(top, reference[0])
    close(bottom_diff, reference[1])
    for have, want in zip(diffs, reference[2]):
        close(have, want)


def test_images_are_timed_in_the_layout_they_come_in(cache):
    """A convolution's images are timed in the blocked layout only where the layer before
    leaves them in a form (Blob.gets_forms), not wherever they take one."""
    net = Net(text_format.Parse(ARRAY_OR_FORM, pb.NetParameter()), TRAIN)
    r, p = net.blobs["r"], net.blobs["p"]
    assert r.takes_forms and not r.gets_forms
    pooled_on_onednn = net.layer_dict["pool"].plan.forward == "onednn"
    assert p.takes_forms and p.gets_forms == pooled_on_onednn
    forms = {json.loads(key)["geometry"]["image_size"][0]: json.loads(key)["forms"][0]
             for key in cache_entries(cache) if "geometry" in json.loads(key)}
    assert forms == {12: False, 6: pooled_on_onednn}


def clocked_candidates(monkeypatch, costs, spell):
    """prepare for tuning._fastest over candidates that take costs[name] seconds a run on a fake
    clock, 10 more during the calls numbered in `spell` (1 is the first run of all); and the
    list of the calls made."""
    clock, calls = [0.0], []
    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def prepare(direction, candidate):
        def run():
            calls.append(candidate)
            clock[0] += costs[candidate] + (10.0 if len(calls) in spell else 0.0)
        return run
    return prepare, calls


@pytest.mark.parametrize("spell", [{2, 3, 4}, {3}])
def test_a_spell_of_load_slows_every_candidate_alike(monkeypatch, spell):
    # One after another, a's first runs (calls 1-4) would all fall in the first spell and b
    # win; a given up after the first round would lose to the second.
    prepare, calls = clocked_candidates(monkeypatch, {"a": 2.0, "b": 3.0}, spell)
    chosen, times = tuning._fastest("forward", ["a", "b"], prepare)
    assert chosen == "a" and times == {'"a"': 2.0, '"b"': 3.0}
    assert calls == ["a", "b"] * (1 + tuning.RUNS)


def test_a_candidate_far_behind_sits_out_the_last_rounds(monkeypatch):
    prepare, calls = clocked_candidates(monkeypatch, {"a": 2.0, "b": 3.5}, spell=set())
    assert tuning._fastest("forward", ["a", "b"], prepare)[0] == "a"
    assert calls.count("a") == 1 + tuning.RUNS and calls.count("b") == 3


def test_the_fixed_rules_switch_times_nothing(cache, monkeypatch):
    monkeypatch.setenv("SYNCSGD_KERNELS", "rules")
    layer = make_layer(TEXT % "pad: 1")
    run_forward(layer, blobs_from([np.ones(SHAPE, np.float32)]))
    assert not list(cache.iterdir())
    assert layer.plan == plan_convolution(layer.geometry, layer.plan.threads, "DEFAULT", True,
                                          layer.thresholds)


def test_small_convolutions_keep_the_fixed_rules(cache):
    layer = make_layer(TEXT % "pad: 1")
    run_forward(layer, blobs_from([np.ones((1, 4, 6, 6), np.float32)]))
    assert not list(cache.iterdir())


@pytest.mark.parametrize("damage", ["{not json", '{"choices": {"x": 1}}', ""])
def test_a_damaged_or_stale_cache_is_timed_again_and_written_whole(cache, damage):
    x = np.ones(SHAPE, np.float32)
    run_forward(make_layer(TEXT % "pad: 1"), blobs_from([x]))
    (path,) = [p for p in cache.iterdir() if p.suffix == ".json"]
    good = json.loads(path.read_text())
    key = choices_of_layers(good["choices"])[0]
    if damage:
        path.write_text(damage)
    else:       # a kernel oneDNN no longer offers
        good["choices"][key]["forward"] = ["onednn", "any", "jit:no_such_isa"]
        path.write_text(json.dumps(good))
    tuning._MEMORY.clear()
    run_forward(make_layer(TEXT % "pad: 1"), blobs_from([x]))
    assert set(cache_entries(cache)[key]) == set(onednn.DIRECTIONS)
    assert cache_entries(cache)[key]["forward"][-1] != "jit:no_such_isa"
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]


def test_an_unwritable_cache_folder_still_runs_and_says_so(timed, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SYNCSGD_KERNEL_CACHE", str(blocker / "kernels"))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    monkeypatch.setattr(tuning, "_UNWRITABLE", [])
    x = np.ones(SHAPE, np.float32)
    said = []
    monkeypatch.setattr(tuning.log, "info", said.append)
    for _ in range(2):
        run_forward(make_layer(TEXT % "pad: 1"), blobs_from([x]))
    assert len(choices_of_layers(tuning._MEMORY)) == 1 and len(tuning._MEMORY) <= 2
    assert len([line for line in said if "SYNCSGD_KERNEL_CACHE" in line]) == 1


CHILD = """
import json, sys
from dataclasses import replace
import numpy as np
sys.path.insert(0, sys.argv[1])
from gradcheck import blobs_from, make_layer, run_forward
from syncsgd.layers import convolution
from syncsgd.net import Net
from syncsgd.proto import pb
thresholds = replace(convolution.THRESHOLDS, timed_min_flops=%r)
convolution.THRESHOLDS = convolution.ConvolutionBase.thresholds = thresholds
layer = make_layer(sys.argv[2])
run_forward(layer, blobs_from([np.ones(%r, np.float32)]))
print(json.dumps([layer.plan.forward, layer.plan.image_grad, layer.plan.weight_grad,
                  layer.plan.onednn_kernels]))
""" % (TIMED_FLOPS, SHAPE)


def test_processes_timing_at_once_take_turns_and_agree(cache):
    """Two processes start on an empty cache together: one times, the other waits for the
    lock and reads its result, so both run the same kernels and the file has one entry."""
    tests = os.path.dirname(__file__)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, tests, TEXT % "pad: 1"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [child.communicate(timeout=120)[0] for child in children]
    finally:
        for child in children:
            child.kill()
    assert all(child.returncode == 0 for child in children)
    assert outputs[0] == outputs[1]
    assert len(choices_of_layers(cache_entries(cache))) == 1 and len(cache_entries(cache)) <= 2


# -- Products -------------------------------------------------------------------------------------
def product_operands(rng, m=96, k=160, n=192):
    """(a, b, out) with a transposed view among them, as the weight gradient's product."""
    a = rng.standard_normal((k, m), np.float32).T
    return a, rng.standard_normal((k, n), np.float32), rng.standard_normal((m, n), np.float32)


def batch_operands(rng, count=4, m=48, k=40, n=36):
    """(a, b, out) as Winograd's: a a transposed view, out the columns of one group."""
    a = rng.standard_normal((count, k, m), np.float32).transpose(0, 2, 1)
    b = rng.standard_normal((count, k, n), np.float32)
    out = rng.standard_normal((count, m, n + 8), np.float32)[:, :, 4:n + 4]
    return a, b, out


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_every_product_candidate_computes_the_product_once(beta, thread_budget):
    from syncsgd.kernels.blas import _Product
    thread_budget(2)
    rng = np.random.default_rng(5)
    a, b, out = product_operands(rng)
    want = a.astype(np.float64) @ b + beta * out
    candidates = plans.gemm_candidates(*a.shape, b.shape[1], 1.0, beta, ("T", "N", "N"), 2,
                                       True, True, replace(THRESHOLDS, timed_min_gemm_flops=0))
    assert {c["kernel"] for c in candidates} == {"onednn", "blas"}
    assert {c["split"] for c in candidates} == {"none", "columns", "rows", "sum"}
    for candidate in candidates:
        have = out.copy()
        _Product(a, b, have, beta, 1.0, 2, plans.GemmPlan(**candidate)).run(a, b, have)
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4 * abs(want).max())


def test_a_timed_product_writes_its_result_once_and_is_kept(cache, monkeypatch, thread_budget):
    """Timing runs the candidates on a copy of out: the caller's beta-1 product adds once."""
    from syncsgd.kernels import blas
    thread_budget(2)
    monkeypatch.setattr(plans, "THRESHOLDS", replace(THRESHOLDS, timed_min_gemm_flops=0))
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    rng = np.random.default_rng(6)
    a, b, out = product_operands(rng)
    want = a.astype(np.float64) @ b + out
    blas.gemm(a, b, out, beta=1.0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * abs(want).max())
    (key, entry), = cache_entries(cache).items()
    assert json.loads(key)["product"] == [96, 160, 192] and set(entry) == {"product"}
    monkeypatch.setattr(tuning, "_fastest", lambda *args: pytest.fail("timed again"))
    blas.gemm(a, b, out, beta=1.0)


@pytest.mark.parametrize("kind", ["product", "batch"])
def test_products_beside_a_timing_take_the_rules_and_are_not_kept(kind, cache, monkeypatch,
                                                                 thread_budget):
    from syncsgd.kernels import blas
    thread_budget(2)
    monkeypatch.setattr(plans, "THRESHOLDS", replace(THRESHOLDS, timed_min_gemm_flops=0))
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    operands, multiply = {"product": (product_operands, blas.gemm),
                          "batch": (batch_operands, blas.batched_gemm)}[kind]
    a, b, out = operands(np.random.default_rng(7))
    monkeypatch.setattr(tuning, "_TIMING", ["another"])
    multiply(a, b, out)
    assert not blas._PRODUCTS.cache and not list(cache.iterdir())
    monkeypatch.setattr(tuning, "_TIMING", [])
    multiply(a, b, out)
    # kept: the product, or the batch (beside the products of a gemm each, if those won)
    kept = [key for key in blas._PRODUCTS.cache if (key[0] == "batched") == (kind == "batch")]
    assert len(kept) == 1 and cache_entries(cache)


def test_products_inside_a_timing_take_a_choice_made_before(cache, monkeypatch, thread_budget):
    """tuning.cached answers without the locks a timing holds: a product timed before keeps
    its choice beside a timing, and is kept."""
    from syncsgd.kernels import blas
    thread_budget(2)
    monkeypatch.setattr(plans, "THRESHOLDS", replace(THRESHOLDS, timed_min_gemm_flops=0))
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    a, b, out = product_operands(np.random.default_rng(8))
    blas.gemm(a, b, out)
    (chosen,) = blas._PRODUCTS.cache.values()
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    monkeypatch.setattr(tuning, "_TIMING", ["another"])
    monkeypatch.setattr(tuning, "_MEMORY", {})            # from the file
    blas.gemm(a, b, out)
    (again,) = blas._PRODUCTS.cache.values()
    assert not again.provisional and again.plan == chosen.plan


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_every_batched_product_candidate_computes_each_product_once(beta, cache, monkeypatch,
                                                                    thread_budget):
    from syncsgd.kernels import blas
    thread_budget(2)
    a, b, out = batch_operands(np.random.default_rng(10))
    want = np.einsum("pmk,pkn->pmn", a.astype(np.float64), b) + beta * out
    count, m, k = a.shape
    candidates = plans.batched_gemm_candidates(count, m, k, b.shape[2], beta, True, True,
                                               replace(THRESHOLDS, timed_min_gemm_flops=0))
    assert candidates == ["onednn", "loop"]
    built = []
    real = onednn.MatMul
    monkeypatch.setattr(onednn, "MatMul", lambda *args: built.append(args) or real(*args))
    for candidate in candidates:
        monkeypatch.setattr(plans, "batched_gemm_candidates", lambda *args: [candidate])
        monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
        have = out.copy()
        if not beta:
            have[...] = np.nan                 # beta 0: the old values never matter
        blas.batched_gemm(a, b, have, beta=beta)
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4 * abs(want).max())
        assert len(built) == 1          # the batch's one primitive, none for the loop
    assert built[0][0].ndim == 3
    assert blas.batched_gemm(a[:0], b[:0], out[:0]).size == 0            # no products
    assert blas.batched_gemm(a[:, :0], b, out[:, :0]).size == 0          # of no rows


def test_a_timed_batch_writes_its_result_once_and_is_kept(cache, monkeypatch, thread_budget):
    from syncsgd.kernels import blas
    thread_budget(2)
    monkeypatch.setattr(plans, "THRESHOLDS", replace(THRESHOLDS, timed_min_gemm_flops=0))
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    a, b, out = batch_operands(np.random.default_rng(11))
    want = np.einsum("pmk,pkn->pmn", a.astype(np.float64), b) + out
    blas.batched_gemm(a, b, out, beta=1.0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * abs(want).max())
    batches = {k: v for k, v in cache_entries(cache).items() if "batched" in json.loads(k)}
    (key, entry), = batches.items()
    assert json.loads(key)["batched"] == [4, 48, 40, 36]
    assert json.loads(key)["layouts"] == ["T", "N", "N"] and entry["product"] in ("onednn", "loop")
    monkeypatch.setattr(tuning, "_fastest", lambda *args: pytest.fail("timed again"))
    blas.batched_gemm(a, b, out, beta=1.0)
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    monkeypatch.setattr(tuning, "_TIMING", ["another"])
    blas.batched_gemm(a, b, out, beta=1.0)       # beside a timing: the choice made before
    (kept,) = [p for key, p in blas._PRODUCTS.cache.items() if key[0] == "batched"]
    assert not kept.provisional


def test_winograd_candidates_are_timed_on_timed_products(cache, monkeypatch, thread_budget):
    """Winograd's candidates run once before the layer's timing, so that inside it their
    products run on choices of their own, not on the fixed rules planned at every call; and
    on their own chunks (plans.timing_convolution)."""
    from syncsgd.kernels import blas
    thread_budget(2)
    monkeypatch.setattr(plans, "THRESHOLDS", replace(THRESHOLDS, timed_min_gemm_flops=0))
    monkeypatch.setattr(blas, "_PRODUCTS", type(blas._PRODUCTS)())
    running, seen = [], []
    real_fastest = tuning._fastest

    def fastest(direction, candidates, prepare):
        def watched(d, candidate):
            run = prepare(d, candidate)
            name = ("+".join(c[0] for c in candidate.values()) if d == "backward"
                    else candidate[0] if isinstance(candidate, list) else "product")
            return run and (lambda: (running.append(name), run(), running.pop()))
        return real_fastest(direction, candidates, watched)

    def watch(real_init):
        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            if running:
                seen.append((running[-1], self.provisional))
        return init
    monkeypatch.setattr(tuning, "_fastest", fastest)
    for kind in (blas._Product, blas._Batched):
        monkeypatch.setattr(kind, "__init__", watch(kind.__init__))
    x = np.random.default_rng(9).standard_normal(SHAPE, np.float32)
    run_forward(make_layer(TEXT % "pad: 1"), blobs_from([x]))
    # Products made inside the timing (a thread's own are kept from the run before) were timed.
    assert not any(provisional for name, provisional in seen if "winograd" in name)
    assert any("batched" in json.loads(key) for key in cache_entries(cache))
    g = plans.ConvolutionGeometry(64, 256, 256, (14, 14), (14, 14), (3, 3), (1, 1), (1, 1),
                                  (1, 1), 1)
    timing = plans.timing_convolution(g, 2, "DEFAULT", "forward", ["winograd"])
    alone = plans.timed_convolution(g, 2, "DEFAULT", {d: ["winograd"] for d in onednn.DIRECTIONS})
    assert timing.chunk == alone.chunk != plans.plan_convolution(g, 2, "DEFAULT", False).chunk


NET = """
name: "timed"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 16 dim: 16 dim: 24 dim: 24 } shape { dim: 16 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "uniform" min: 0 max: 3.99 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 4 stride: 4 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


@pytest.mark.mpi
def test_two_ranks_timing_kernels_train_as_one_process(tmp_path):
    """With timed kernels (as users run), 2 ranks on one host time their 8-sample convolution
    once between them (their cache holds one entry for it, one thread each) and train as one
    process does with its own timed kernels: weights within float tolerance."""
    (tmp_path / "net.prototxt").write_text(NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path}/net.prototxt" type: "SGD" momentum: 0.9 base_lr: 0.01 '
                      'lr_policy: "fixed" max_iter: 100 random_seed: 5 '
                      f'snapshot_prefix: "{tmp_path}/snap"')
    env = {k: v for k, v in os.environ.items() if k != "SYNCSGD_KERNELS"}
    env["SYNCSGD_KERNEL_CACHE"] = str(tmp_path / "kernels")
    script = os.path.join(os.path.dirname(__file__), "mpi_train.py")
    runs = {}
    for n in (1, 2):
        mpirun.launch([mpirun.mpiexec(), "-n", n, sys.executable, "-m", "mpi4py", script, solver,
                       4, tmp_path / f"{n}.npz"], env=env)
        runs[n] = dict(np.load(tmp_path / f"{n}.npz"))
    convolutions = [json.loads(key) for key in choices_of_layers(cache_entries(tmp_path / "kernels"))
                    if "geometry" in json.loads(key)]
    assert sorted((c["geometry"]["num"], c["threads"]) for c in convolutions) == [(8, 1), (16, 2)]
    params = [key for key in runs[1] if key.startswith(("conv/", "fc/"))]
    assert len(params) == 4
    for key in params:
        scale = float(np.abs(runs[1][key]).max())
        assert float(np.abs(runs[2][key] - runs[1][key]).max()) <= 1e-4 * scale, key
