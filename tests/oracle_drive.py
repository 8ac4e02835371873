"""How a layer case drives a net, the same on both sides of tests/test_oracle.py: through the
pycaffe API, which BVLC's pycaffe (tests/oracle_worker.py, under the oracle's own Python) and
syncsgd share. It imports nothing, so that both interpreters can."""


def set_inputs(net, arrays):
    """The bottoms the case gives (in.<blob>)."""
    for key, value in arrays.items():
        if key.startswith("in."):
            net.blobs[key[len("in."):]].data[...] = value


def drive(net, meta, arrays):
    """MemoryData's arrays and the inputs; forward `passes` times; then, for a case with a
    backward, zeroed parameter diffs, the top diffs (topdiff.<blob>) and one backward."""
    if "memory.data" in arrays:
        net.set_input_arrays(arrays["memory.data"], arrays["memory.labels"])
    set_inputs(net, arrays)
    for _ in range(meta["passes"]):
        net.forward()
    if meta["backward"]:
        # Parameter diffs first: BVLC's Parameter layer shares its top's diff with its blob.
        for blobs in net.params.values():
            for blob in blobs:
                blob.diff[...] = 0
        for key in arrays:
            if key.startswith("topdiff."):
                net.blobs[key[len("topdiff."):]].diff.reshape(-1)[:] = arrays[key].reshape(-1)
        net.backward()
