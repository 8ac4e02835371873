"""A trained net as an ONNX model (`syncsgd export`), and its check in ONNX Runtime.

export() walks a net built in the TEST phase layer by layer: Input layers become the graph's
inputs (names and shapes from the prototxt, the batch fixed or dynamic), each other layer goes
through its converter (layers.py) into ONNX nodes with its weights, and the net's outputs become
the graph's. A layer with no ONNX form stops the export naming it; `until` exports the layers
before one. check() runs the model in ONNX Runtime and the net in syncsgd on the same input.

Needs the `onnx` package (`pip install syncsgd[onnx]`); check() also `onnxruntime`.
"""
from importlib.metadata import version

import numpy as np

from syncsgd import TEST
from syncsgd.errors import SyncSGDError

try:
    import onnx
except ImportError:
    raise SyncSGDError("the ONNX export needs the onnx package: pip install syncsgd[onnx] "
                       "(or pip install onnx)") from None

from syncsgd.onnx.graph import Graph, skeleton  # noqa: E402 (after the check above)
from syncsgd.onnx.layers import CONVERTERS, Step, no_form  # noqa: E402

DEFAULT_OPSET = 17     # PyTorch's default: read by most runtimes in use
MIN_OPSET = 13         # Softmax over one axis; Split and Squeeze taking inputs
TOLERANCE = 1e-4       # check(): max |difference| <= TOLERANCE * max |syncsgd's output|


def refuse_data_layers(param, source):
    """Refuse a net that reads a data source: the export takes a deploy net, whose Input layer
    (or input / input_shape fields) names the inputs and their shapes."""
    for lp in param.layer:
        if lp.type.endswith("Data"):
            raise SyncSGDError(
                f"{source}: layer '{lp.name}' ({lp.type}) reads samples from a data source; "
                "export the deploy version of the net, which takes its inputs from an Input "
                "layer (or input: / input_shape fields) with their shapes")


def export(net, path, opset=None, batch=None, until=None):
    """Write `net` (a syncsgd.Net in the TEST phase, with its current weights) to `path` as an
    ONNX model; returns the onnx.ModelProto.

    opset: the ONNX opset (default DEFAULT_OPSET). batch: None keeps each input's first
    dimension as the prototxt gives it, an int replaces it, a string makes it a dynamic
    dimension of that name. until: a layer name; only the layers before it are exported, the
    blobs they make that none of them reads becoming the outputs. Inputs no exported layer
    reads are left out."""
    opset = DEFAULT_OPSET if opset is None else int(opset)
    _check_arguments(net, opset, batch)
    stop = _stop(net, until)
    read = {name for i in range(stop) for name in net.param.layer[i].bottom}
    inputs = [name for i in range(stop) if net.layers[i].type == "Input"
              for name in net.param.layer[i].top if name in read]
    batches = {net.blobs[name].shape[0] for name in inputs if net.blobs[name].shape}
    g = Graph(opset, reserved={blob.name for i in range(stop) for blob in net.top_vecs[i]},
              fixed_batch=batch is None or batches <= {batch})
    last = {blob.name: i for i in range(stop) for blob in net.top_vecs[i]}
    for i in range(stop):
        _convert(g, net, i, last)
    outputs = [name for name in _outputs(net, stop) if g.tensors[name] not in g.inputs]
    for name in outputs:
        if name in g.inputs:
            raise SyncSGDError(f"blob '{name}' is both an input and, written in place, an "
                               "output of the net; give the in-place layers' top a new name")
        if g.tensors[name] != name:
            g.rename(g.op("Identity", [g.tensors[name]]), name)

    def shape(name):
        return [batch if k == 0 and batch is not None else d
                for k, d in enumerate(net.blobs[name].shape)]
    model = g.model(net.name or "net", [(name, shape(name)) for name in inputs],
                    [(name, list(net.blobs[name].shape) if batch is None else None)
                     for name in outputs], ("syncsgd", version("syncsgd")))
    _settle_output_shapes(model, net, batch is not None)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return model


def _check_arguments(net, opset, batch):
    if net.phase != TEST:
        raise SyncSGDError("export takes a net built in the TEST phase: "
                           "syncsgd.Net(model, syncsgd.TEST, weights=...)")
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise SyncSGDError(f"opset {opset}: the export writes opsets {MIN_OPSET} to {newest} "
                           "(this onnx package's newest)")
    if isinstance(batch, int) and batch < 1:
        raise SyncSGDError(f"batch {batch}: give a positive number, or a name for a dynamic "
                           "batch")
    refuse_data_layers(net.param, net.source)


def _stop(net, until):
    """How many layers (from the first) the export takes."""
    if until is None:
        return len(net.layers)
    if until not in net.layer_dict:
        raise SyncSGDError(f"--until {until}: the net has no layer of that name; its layers "
                           f"are {', '.join(net.layer_names)}")
    stop = net.layer_names.index(until)
    if not any(net.layers[i].type != "Input" for i in range(stop)):
        raise SyncSGDError(f"--until {until}: no layer before it to export")
    return stop


def _convert(g, net, i, last):
    """Layer i into the graph; the tops it is the last to write take their blobs' names."""
    layer, bottoms, tops = net.layers[i], net.bottom_vecs[i], net.top_vecs[i]
    if layer.type == "Input":
        for blob in tops:
            g.inputs.append(blob.name)
            g.tensors[blob.name] = blob.name
        return
    convert = CONVERTERS.get(layer.type)
    if convert is None:
        raise no_form(layer)
    g.where = layer.name
    made = convert(g, Step(layer, [g.tensors[b.name] for b in bottoms], bottoms, tops))
    for blob, tensor in zip(tops, made):
        g.tensors[blob.name] = tensor
        if last[blob.name] == i:
            g.settle(blob.name)


def _outputs(net, stop):
    """The blobs of the first `stop` layers that none of them reads after making them (the
    net's outputs when it is whole); a net whose results all go to Silence layers (as Caffe
    deploy nets do to keep them from the log) gives those."""
    consumed, made, silenced = set(), [], []
    for i in range(stop):
        lp = net.param.layer[i]
        consumed.update(lp.bottom)
        if lp.type == "Silence":
            silenced.extend(lp.bottom)
        for name in lp.top:
            consumed.discard(name)
            if name not in made:
                made.append(name)
    outputs = sorted(name for name in made if name not in consumed)
    return outputs or sorted(set(silenced))


def _settle_output_shapes(model, net, inferred):
    """Infer every tensor's shape strictly (a converter's mistake stops here) and check the
    graph, on its skeleton; with `inferred`, the outputs take the shapes ONNX finds (dimensions
    it cannot find left unnamed), else they keep the net's, which inference must agree with."""
    found = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=True, data_prop=True)
    if inferred:
        for output, value in zip(model.graph.output, found.graph.output):
            if value.type.tensor_type.HasField("shape"):
                output.CopyFrom(value)
            else:
                output.CopyFrom(onnx.helper.make_tensor_value_info(
                    output.name, onnx.TensorProto.FLOAT, [None] * net.blobs[output.name].num_axes))
    onnx.checker.check_model(skeleton(model))


def check(net, path, until=None, inputs=None, seed=0):
    """Run the ONNX model at `path` in ONNX Runtime and `net` forward (up to the layer before
    `until`) on the same inputs: `inputs`, or uniform noise in [-1, 1) of the net's input
    shapes (dimension 0 as the model fixes it). The net is reshaped to the inputs' shapes.
    Returns {output: (max |ONNX Runtime - syncsgd|, max |syncsgd|)}."""
    try:
        import onnxruntime
    except ImportError:
        raise SyncSGDError("checking the model needs onnxruntime: pip install onnxruntime") \
            from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if inputs is None:
        rng = np.random.default_rng(seed)
        inputs = {}
        for spec in session.get_inputs():
            shape = list(net.blobs[spec.name].shape)
            if shape and isinstance(spec.shape[0], int):
                shape[0] = spec.shape[0]
            inputs[spec.name] = rng.uniform(-1, 1, shape).astype(np.float32)
    stop = _stop(net, until)
    if any(net.blobs[name].shape != value.shape for name, value in inputs.items()):
        for name, value in inputs.items():
            net.blobs[name].reshape(*value.shape)
        for i in range(stop):           # net.reshape() up to `until`: the rest may not fit
            net.layers[i].reshape(net.bottom_vecs[i], net.top_vecs[i])
    net.forward(end=net.layer_names[stop - 1], **inputs)
    names = [spec.name for spec in session.get_outputs()]
    feed = {spec.name: inputs[spec.name] for spec in session.get_inputs()}
    results = {}
    for name, theirs in zip(names, session.run(names, feed)):
        ours = net.blobs[name].data
        if theirs.shape != ours.shape:
            raise SyncSGDError(f"output '{name}': ONNX Runtime gives shape {theirs.shape}, "
                               f"syncsgd {ours.shape}")
        results[name] = (float(np.abs(theirs - ours).max(initial=0)),
                         float(np.abs(ours).max(initial=0)))
    return results
