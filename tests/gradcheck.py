"""The shared numeric gradient checker (Caffe's GradientChecker rule), used by every layer test.

The objective is L = sum_i sum(w_i * top_i.data) with fixed random weights w_i, so the analytic
gradient is one backward pass with top diffs w_i. Each input element (or parameter element) is moved
by +-step; central differences estimate dL/dx, which must equal the analytic value within
threshold * max(|analytic|, |estimate|, 1). Points within `kink_range` of a non-differentiable kink
(ReLU at 0, max ties) can be skipped by passing `kink` (a function of the value).
"""
import numpy as np

from syncsgd import TRAIN
from syncsgd.blob import Blob
from syncsgd.context import Context
from syncsgd.layers import create
from syncsgd.proto import pb
from google.protobuf import text_format


def make_layer(text, phase=TRAIN, seed=1701):
    """A layer from the text of a LayerParameter (without the surrounding `layer { }`)."""
    param = text_format.Parse(text, pb.LayerParameter())
    return create(param, Context(phase, seed=seed))


def blobs_from(arrays):
    out = []
    for i, a in enumerate(arrays):
        b = Blob(np.shape(a), name=f"b{i}")
        b.data[...] = a
        out.append(b)
    return out


def run_forward(layer, bottom, n_top=1):
    top = [Blob(name=f"t{i}") for i in range(n_top)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top


def check_gradient(layer, bottom, n_top=1, step=1e-2, threshold=1e-3, check_bottom=None,
                   check_params=True, kink=None, kink_range=-1.0, seed=0, top_index=None,
                   max_points=200):
    """Assert the layer's backward matches central differences. Returns the number of points.

    check_bottom: indices of bottoms to check (default all); top_index: restrict the objective to
    one top. Up to `max_points` elements per blob are checked, chosen at random.
    """
    rng = np.random.default_rng(seed)
    top = run_forward(layer, bottom, n_top)
    tops = range(len(top)) if top_index is None else [top_index]
    weights = {i: rng.standard_normal(top[i].shape).astype(np.float32) for i in tops}

    def objective():
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        return sum(float(np.dot(top[i].data.ravel().astype(np.float64),
                                weights[i].ravel().astype(np.float64))) for i in tops)

    objective()
    for b in bottom:
        b.diff[...] = 0
    for p in layer.blobs:
        p.diff[...] = 0
    for i in range(len(top)):
        top[i].diff[...] = weights[i] if i in weights else 0
    if check_bottom is None:
        check_bottom = list(range(len(bottom)))
    propagate = [i in check_bottom for i in range(len(bottom))]
    layer.backward(top, propagate, bottom)

    targets = [("bottom", i, bottom[i]) for i in check_bottom]
    if check_params:
        targets += [("param", j, p) for j, p in enumerate(layer.blobs)]
    analytic = {(kind, i): blob.diff.copy() for kind, i, blob in targets}
    checked = 0
    for kind, i, blob in targets:
        flat = blob.data.reshape(-1)
        picks = np.arange(flat.size)
        if flat.size > max_points:
            picks = rng.choice(flat.size, max_points, replace=False)
        for k in picks:
            original = flat[k]
            if kink is not None and abs(kink(original)) < kink_range:
                continue
            flat[k] = original + step
            plus = objective()
            flat[k] = original - step
            minus = objective()
            flat[k] = original
            estimate = (plus - minus) / (2 * step)
            computed = float(analytic[(kind, i)].reshape(-1)[k])
            scale = max(abs(computed), abs(estimate), 1.0)
            assert abs(computed - estimate) <= threshold * scale, (
                f"{layer.type} '{layer.name}': d/d {kind}[{i}] element {k}: "
                f"analytic {computed:.6g} vs numeric {estimate:.6g}")
            checked += 1
    objective()
    return checked
