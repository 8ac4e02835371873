"""Runs cases on BVLC Caffe, the reference syncsgd is compared with (tests/test_oracle.py).

It runs under the oracle's own Python (its pycaffe needs numpy < 2), so it imports nothing of
syncsgd: each case is a folder that tests/test_oracle.py wrote, and the results go back as files.

    source ~/.cache/bvlc-caffe-9b89154/env.sh && python tests/oracle_worker.py CASE_DIR...

A case folder holds meta.json, net.prototxt, inputs.npz (in.<blob>, topdiff.<blob>, and
memory.data / memory.labels for MemoryData) and weights.caffemodel (written by syncsgd), and for
a solver case solver.prototxt. The worker writes bvlc.npz (data.<blob> of every blob,
diff.<blob> of the net's inputs, param.<layer>.<i> and pdiff.<layer>.<i>) and, for a layer case,
bvlc.caffemodel (BVLC's own weight file, for syncsgd to load). Before each case it prints
"case NAME", so that a case that aborts Caffe (a failed CHECK) can be named by the caller.
"""
import json
import os
import sys

import numpy as np

import caffe
from oracle_drive import drive, set_inputs


def run_layer_case(folder, meta, arrays):
    """Forward (`passes` times), then the top diffs and one backward, as pycaffe users do."""
    phase = caffe.TRAIN if meta["phase"] == "TRAIN" else caffe.TEST
    weights = os.path.join(folder, "weights.caffemodel")
    proto = os.path.join(folder, "net.prototxt")
    net = caffe.Net(proto, weights, phase) if os.path.exists(weights) else caffe.Net(proto, phase)
    drive(net, meta, arrays)
    out = {f"data.{name}": blob.data for name, blob in net.blobs.items()}
    out.update((f"diff.{name}", net.blobs[name].diff) for name in meta["diffs"])
    out.update(param_arrays(net, diffs=True))
    np.savez(os.path.join(folder, "bvlc.npz"), **out)
    net.save(os.path.join(folder, "bvlc.caffemodel"))


def run_solver_case(folder, meta, arrays):
    """`steps` iterations of the solver from the given weights, on inputs that stay the same."""
    solver = caffe.get_solver(os.path.join(folder, "solver.prototxt"))
    solver.net.copy_from(os.path.join(folder, "weights.caffemodel"))
    set_inputs(solver.net, arrays)
    solver.step(meta["steps"])
    np.savez(os.path.join(folder, "bvlc.npz"), **param_arrays(solver.net, diffs=False))



def param_arrays(net, diffs):
    out = {}
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            out[f"param.{layer}.{i}"] = blob.data
            if diffs:
                out[f"pdiff.{layer}.{i}"] = blob.diff
    return out


def main(folders):
    for folder in folders:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        print("case", meta["name"], flush=True)
        with np.load(os.path.join(folder, "inputs.npz")) as data:
            arrays = {key: data[key] for key in data.files}
        if meta["kind"] == "solver":
            run_solver_case(folder, meta, arrays)
        else:
            run_layer_case(folder, meta, arrays)


if __name__ == "__main__":
    main(sys.argv[1:])
