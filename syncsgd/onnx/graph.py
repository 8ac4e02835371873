"""The ONNX graph under construction: nodes, weights, unique tensor names, and which tensor holds
each Caffe blob's current value.

A Caffe blob may be written several times (in-place layers) where ONNX names each value once, so
a blob's tensor changes as the layers are converted; the blob's last version takes the blob's own
name (what net.blobs[name] holds after a forward pass), earlier ones fresh names.
"""
import numpy as np
import onnx
from onnx import TensorProto, helper


class Graph:
    """Nodes and weights in the order they are made; `op` adds a node, `const` a weight. The
    weights go straight into the model (`proto`): they can be hundreds of megabytes, and each
    copy of them costs seconds."""

    def __init__(self, opset, reserved, fixed_batch):
        self.opset = opset
        # Whether dimension 0 of the inputs is the net's own: converters may then build constant
        # shapes that hold it; otherwise they take it from a tensor at run time.
        self.fixed_batch = fixed_batch
        self.proto = onnx.ModelProto()
        self.nodes = []
        self.tensors = {}           # Caffe blob name -> the tensor holding its current value
        self.inputs = []            # graph input names
        # A pooling mask tensor (Caffe's h * W + w) -> (ONNX MaxPool indices, plane size), so
        # that MaxUnpool can take the indices as they are.
        self.pool_indices = {}
        self.where = ""             # the layer being converted, for readable tensor names
        self._used = set(reserved)  # names given out, and blob names kept for their blobs
        self._made = {}             # node output name -> index of its node

    def fresh(self, base):
        """A tensor name not used before, `base` when free."""
        name, k = base, 1
        while name in self._used:
            name, k = f"{base}_{k}", k + 1
        self._used.add(name)
        return name

    def const(self, array, what="const"):
        """A weight holding `array` (float32 unless integer); returns its name."""
        array = np.asarray(array)
        array = np.ascontiguousarray(array, np.float32 if array.dtype.kind == "f" else None)
        name = self.fresh(f"{self.where}/{what}")
        tensor = self.proto.graph.initializer.add()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.raw_data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        return name

    def ints(self, values, what="shape"):
        return self.const(np.asarray(values, np.int64), what)

    def op(self, kind, inputs, outputs=1, **attrs):
        """Add a node; returns its output name (a list of `outputs` names when more than one)."""
        names = [self.fresh(f"{self.where}/{kind}") for _ in range(outputs)]
        self._made.update((name, len(self.nodes)) for name in names)
        self.nodes.append(helper.make_node(kind, list(inputs), names, name=names[0], **attrs))
        return names if outputs > 1 else names[0]

    def reduce(self, kind, x, axes, keepdims=1):
        """A Reduce* node over `axes`: an attribute before opset 18 (ReduceSum: 13), then an
        input."""
        if self.opset >= 18 or kind == "ReduceSum":
            return self.op(kind, [x, self.ints(axes, "axes")], keepdims=keepdims)
        return self.op(kind, [x], axes=list(axes), keepdims=keepdims)

    def shape_of(self, like, shape):
        """`shape` as an int64 tensor, its dimension 0 taken from tensor `like` at run time
        unless the batch is the net's."""
        if self.fixed_batch:
            return self.ints(shape)
        first = self.op("Slice", [self.op("Shape", [like]), self.ints([0]), self.ints([1])])
        return self.op("Concat", [first, self.ints(shape[1:])], axis=0)

    def rename(self, old, new):
        """Give tensor `old`, made by a node, the name `new` everywhere."""
        first = self._made.pop(old)
        for node in self.nodes[first:]:
            for names in (node.input, node.output):
                for k, name in enumerate(names):
                    if name == old:
                        names[k] = new
        for blob, tensor in self.tensors.items():
            if tensor == old:
                self.tensors[blob] = new
        if old in self.pool_indices:
            self.pool_indices[new] = self.pool_indices.pop(old)
        self._used.add(new)
        self._made[new] = first

    def settle(self, blob):
        """Name the tensor holding a blob's last version after the blob, unless it is an
        input, a weight, or also another blob's (a Split's tops share their bottom's)."""
        tensor = self.tensors[blob]
        if tensor == blob or blob in self.inputs or tensor not in self._made:
            return
        if all(t != tensor for b, t in self.tensors.items() if b != blob):
            self.rename(tensor, blob)

    def model(self, name, inputs, outputs, producer):
        """The ModelProto: inputs and outputs are (name, shape or None) pairs, shapes holding
        ints or dimension names. Nodes and weights no output depends on are left out."""
        needed = {name for name, _ in outputs}
        nodes = []
        for node in reversed(self.nodes):
            if needed.intersection(node.output):
                nodes.append(node)
                needed.update(node.input)
        graph = self.proto.graph
        for k in reversed(range(len(graph.initializer))):
            if graph.initializer[k].name not in needed:
                del graph.initializer[k]
        graph.name = name
        graph.node.extend(nodes[::-1])
        graph.input.extend(_value(*i) for i in inputs)
        graph.output.extend(_value(*o) for o in outputs)
        opset = self.proto.opset_import.add(domain="", version=self.opset)
        self.proto.ir_version = helper.find_min_ir_version_for([opset])
        self.proto.producer_name, self.proto.producer_version = producer
        return self.proto


def skeleton(model):
    """`model` with its float weights as inputs of their shapes instead: shape inference and
    the checker read only those (and the integer weights, which give shapes), and copying the
    values costs seconds."""
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    graph = light.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            graph.input.append(helper.make_tensor_value_info(tensor.name, TensorProto.FLOAT,
                                                             tensor.dims))
        else:
            graph.initializer.append(tensor)
    return light


def _value(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
