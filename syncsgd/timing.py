"""Per-layer forward/backward timing of a net: what `caffe time` reports.

Library code rather than part of the command line, because the planner's calibration times real
layers with it too.
"""
import time

import numpy as np

from syncsgd import TRAIN
from syncsgd.compile import load_net_param
from syncsgd.net import Net


def timing_net(model, phase=TRAIN, ctx=None, batch=None, level=0, stages=()):
    """A net for timing: backward forced through every layer, inputs filled with noise, except
    labels (by name), zero as `caffe time` leaves every input, so that a loss accepts them;
    `batch` replaces the batch dimension of the Input layers; level and stages select layers
    as the NetState does."""
    param, _ = load_net_param(model)
    param.force_backward = True
    if batch:
        for layer in param.layer:
            if layer.type == "Input":
                for shape in layer.input_param.shape:
                    shape.dim[0] = batch
    net = Net(param, phase, level=level, stages=stages, ctx=ctx)
    rng = np.random.default_rng(0)
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = 0 if "label" in name else rng.standard_normal(blob.shape)
    return net


def time_net(net, iterations=50, warmup=1, progress=None):
    """Average milliseconds per layer and per pass over `iterations` rounds of two passes each:
    one layer at a time (each layer's own time, its kernels on all the threads), then one
    whole pass as the solver runs it (Net.forward_backward from cleared parameter gradients,
    the sample-wise layers carried in lanes: syncsgd/lanes.py), which gives the pass's time.
    `caffe time` likewise times the passes its training runs; a net without lanes runs the
    same kernels both ways. progress(iteration, seconds) follows the whole passes."""
    n = len(net.layers)
    forward = np.zeros(n)
    backward = np.zeros(n)
    totals = []
    for it in range(warmup + iterations):
        net.loss = 0.0
        fwd = np.zeros(n)
        bwd = np.zeros(n)
        for i in range(n):
            t = time.perf_counter()
            net.forward_layer(i)
            fwd[i] = time.perf_counter() - t
        net.seed_loss_diffs()
        for i in reversed(range(n)):
            t = time.perf_counter()
            net.backward_layer(i)
            bwd[i] = time.perf_counter() - t
        start = time.perf_counter()
        net.forward_backward(clear=True)
        elapsed = time.perf_counter() - start
        if it >= warmup:
            forward += fwd
            backward += bwd
            totals.append(elapsed)
            if progress is not None:
                progress(it - warmup + 1, elapsed)
    forward *= 1000.0 / iterations
    backward *= 1000.0 / iterations
    return {
        "layers": [{"name": layer.name, "type": layer.type, "forward_ms": float(f),
                    "backward_ms": float(b)}
                   for layer, f, b in zip(net.layers, forward, backward)],
        "forward_ms": float(forward.sum()),
        "backward_ms": float(backward.sum()),
        "total_ms": float(np.mean(totals) * 1000.0),
    }
