"""Runs the N-D convolution cases of tests/test_convolution_nd.py on BVLC Caffe.

It runs under the oracle's own Python (its pycaffe needs numpy < 2) and imports nothing of
syncsgd:

    source ~/.cache/bvlc-caffe-9b89154/env.sh && python bvlc_run.py CASE.npz...

Each CASE.npz holds `net` (a prototxt: an Input "data", the layer "layer" with top "out",
force_backward) and the arrays in.bottom, in.top_diff and in.param<i>; the results go to
CASE.bvlc.npz beside it: top, bottom_diff and param<i>_diff after one forward and one backward.
"""
import os
import sys
import tempfile

import numpy as np

import caffe


def run(path):
    case = np.load(path)
    with tempfile.NamedTemporaryFile("w", suffix=".prototxt", delete=False) as f:
        f.write(str(case["net"]))
    try:
        net = caffe.Net(f.name, caffe.TRAIN)
    finally:
        os.unlink(f.name)
    params = net.params.get("layer", [])
    for i, blob in enumerate(params):
        blob.data[...] = case[f"in.param{i}"]
    net.blobs["data"].data[...] = case["in.bottom"]
    net.forward()
    net.blobs["out"].diff[...] = case["in.top_diff"]
    net.backward()
    out = {"top": net.blobs["out"].data, "bottom_diff": net.blobs["data"].diff}
    out.update((f"param{i}_diff", blob.diff) for i, blob in enumerate(params))
    np.savez(path[:-len(".npz")] + ".bvlc.npz", **out)


if __name__ == "__main__":
    caffe.set_mode_cpu()
    for path in sys.argv[1:]:
        run(path)
