"""Per-layer work of a compiled net, per sample: FLOPs of forward, backward-data and weight
gradient, weight counts, and activation sizes at each layer boundary.

Everything is read from a built Net (shapes, weight blobs, layer parameters), never from a table
of known architectures. The planner builds it at batch 1 and scales analytically to any
minibatch: every cost here is linear in the number of samples.

Counting conventions (the paper's, docs/method.md "Balance equations"):
- Convolution, Deconvolution and InnerProduct count their GEMMs only, 2 FLOPs per multiply-add;
  backward-data and weight gradient cost one forward each, for every layer (Caffe skips the
  first layer's input gradient; the paper's balance equations do not, and neither does this).
  Biases are left out, as in models/README.md.
- Pooling counts one operation per window element (MAX backward: one per output), LRN its window
  sums plus a few operations per element, and elementwise layers the operations per element of
  ELEMENTWISE_OPS (a transcendental function counts as one).
"""
import os
from dataclasses import dataclass, field

import numpy as np

from syncsgd import TEST, TRAIN
from syncsgd.compile import compile_net, load_net_param
from syncsgd.errors import PrototxtError
from syncsgd.proto import pb

DTYPE_BYTES = 4                      # s in the paper: fp32
GEMM_TYPES = ("Convolution", "Deconvolution", "InnerProduct")
DATA_TYPES = ("Data", "HDF5Data", "ImageData", "MemoryData", "WindowData", "DummyData")

# FLOPs per element of the top (forward) and of the bottom gradient (backward).
ELEMENTWISE_OPS = {
    "ReLU": (1, 1), "PReLU": (2, 4), "ELU": (3, 3), "Sigmoid": (3, 2), "TanH": (3, 2),
    "AbsVal": (1, 1), "BNLL": (4, 4), "Power": (3, 4), "Exp": (2, 2), "Log": (2, 2),
    "Threshold": (1, 0), "Dropout": (1, 1), "Scale": (1, 2), "Bias": (1, 1),
    "BatchNorm": (5, 8), "Softmax": (4, 3), "SoftmaxWithLoss": (5, 1),
    "SigmoidCrossEntropyLoss": (5, 2), "EuclideanLoss": (3, 2),
}


@dataclass
class LayerCost:
    """One layer's work for ONE sample; `weights` and `weight_bytes` are per iteration."""
    name: str
    type: str
    forward: float = 0.0            # FLOPs
    backward_data: float = 0.0
    weight_grad: float = 0.0
    weights: int = 0                # learnable values, every blob (weights and bias)
    gemm_weights: int = 0           # values of the GEMM's weight matrix (blob 0 of conv / FC)
    input_elems: int = 0            # summed over bottoms
    bottom_elems: tuple = ()        # per bottom
    output_elems: int = 0           # summed over tops
    bottoms: tuple = ()
    tops: tuple = ()
    geometry: dict = field(default_factory=dict)   # ifm, ofm, kernel, stride, in, out, group

    @property
    def is_gemm(self):
        return self.type in GEMM_TYPES and self.gemm_weights > 0

    @property
    def flops_per_sample(self):
        return self.forward + self.backward_data + self.weight_grad

    @property
    def weight_bytes(self):
        return self.weights * DTYPE_BYTES

    def flops(self, samples):
        """Forward + backward-data + weight-gradient FLOPs for `samples` samples."""
        return samples * self.flops_per_sample

    def shape_key(self):
        """What a layer's speed depends on, as text: calibration measures rates per key."""
        g = self.geometry
        if not g.get("ofm"):
            return f"{self.type} {self.input_elems} -> {self.output_elems} per sample"
        kernel = "x".join(map(str, g["kernel"]))
        out = "x".join(map(str, g["out"]))
        return (f"{self.type} {g['ifm']} -> {g['ofm']} maps, kernel {kernel}, stride "
                f"{g['stride'][0]}, group {g['group']}, out {out}")


# -- building the net to plan ---------------------------------------------------------------

def find_model(model):
    """A prototxt path from a path, a model folder, or a zoo name under models/.

    A folder (or zoo name) means its train_val.prototxt, else its deploy.prototxt.
    """
    if isinstance(model, pb.NetParameter):
        return model
    candidates = [os.fspath(model)]
    if os.path.sep not in candidates[0] and not candidates[0].endswith(".prototxt"):
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        candidates += [os.path.join("models", candidates[0]),
                       os.path.join(repo, "models", candidates[0])]
    for path in candidates:
        if os.path.isdir(path):
            for name in ("train_val.prototxt", "deploy.prototxt"):
                if os.path.isfile(os.path.join(path, name)):
                    return os.path.join(path, name)
        elif os.path.isfile(path):
            return path
    raise PrototxtError(f"--model {model}: no such prototxt, model folder or zoo name "
                        "(give a .prototxt path, or a folder with train_val.prototxt)")


def planning_param(model, batch=1, fillers=False):
    """(NetParameter, data batch) of the net to plan, ready for Net(param, TRAIN) at `batch`.

    The net is compiled in the TRAIN phase (planning is about training); its data layers become
    Input layers of the same tops and every Input's first axis becomes `batch`. Unless `fillers`,
    weight fillers are dropped: weights do not change costs, and drawing 100 M random numbers
    would dominate planning time. The data batch is the TRAIN data layer's batch_size (None for a
    deploy net).
    """
    model = find_model(model)
    raw, source = load_net_param(model)
    param, _ = compile_net(raw, TRAIN)
    data_batch = None
    for lp in param.layer:
        if lp.type in DATA_TYPES:
            shapes, data_batch = _data_shapes(lp, source)
            _as_input(lp, shapes)
        if lp.type == "Input":
            for shape in lp.input_param.shape:
                if shape.dim:
                    shape.dim[0] = batch
        for sub in ("convolution_param", "inner_product_param"):
            if lp.HasField(sub) and not fillers:
                getattr(lp, sub).ClearField("weight_filler")
                getattr(lp, sub).ClearField("bias_filler")
    return param, data_batch


def _as_input(lp, shapes):
    tops = list(lp.top)
    name = lp.name
    lp.Clear()
    lp.name, lp.type = name, "Input"
    lp.top.extend(tops)
    for shape in shapes:
        lp.input_param.shape.add().dim.extend(shape)


def _data_shapes(lp, source):
    """Per-top shapes (batch axis first) of a data layer, and its batch_size."""
    if lp.type == "DummyData":
        p = lp.dummy_data_param
        shapes = [list(s.dim) for s in p.shape] or [
            [n, c, h, w] for n, c, h, w in zip(p.num, p.channels, p.height, p.width)]
        if len(shapes) == 1 and len(lp.top) > 1:
            shapes = shapes * len(lp.top)
        return shapes, shapes[0][0] if shapes else None
    if lp.type == "MemoryData":
        p = lp.memory_data_param
        return [[p.batch_size, p.channels, p.height, p.width], [p.batch_size]], p.batch_size
    batch = {"Data": lp.data_param.batch_size, "HDF5Data": lp.hdf5_data_param.batch_size,
             "ImageData": lp.image_data_param.batch_size,
             "WindowData": lp.window_data_param.batch_size}[lp.type]
    known = _deploy_shapes(source)
    if lp.type == "HDF5Data":
        known.update(_hdf5_shapes(lp))
    shapes = []
    for name in lp.top:
        if name in known:
            shapes.append([batch] + known[name][1:])
        elif "label" in name:
            shapes.append([batch])
        else:
            raise PrototxtError(
                f"{source}: layer '{lp.name}' ({lp.type}): cannot tell the shape of one sample "
                f"of top '{name}'; put a deploy.prototxt with an Input layer producing "
                f"'{name}' beside the net, or plan the deploy net with --batch")
    return shapes, batch


def _hdf5_shapes(lp):
    """Shapes (batch axis first, batch 1) of an HDF5Data layer's tops as its files store them,
    or {} when the files cannot be read (planning does not need the data to exist)."""
    from syncsgd.errors import DataError
    from syncsgd.io.hdf5 import H5Source
    try:
        source = H5Source(lp.hdf5_data_param.source, lp.top)
    except (DataError, OSError):
        return {}
    return {name: [1] + list(source.row_shape(name)) for name in lp.top}


def _deploy_shapes(source):
    """Input shapes by top name from the deploy.prototxt next to `source`, if there is one."""
    if not isinstance(source, str) or source.startswith("<"):
        return {}
    path = os.path.join(os.path.dirname(source), "deploy.prototxt")
    if not os.path.isfile(path):
        return {}
    param, _ = compile_net(path, TEST)
    shapes = {}
    for lp in param.layer:
        if lp.type == "Input":
            for j, name in enumerate(lp.top):
                p = lp.input_param.shape
                if p:
                    shapes[name] = list(p[min(j, len(p) - 1)].dim)
    return shapes


def build_planning_net(model):
    """(Net at batch 1, data batch or None) for costing `model` (path, folder, zoo name or
    NetParameter)."""
    from syncsgd.net import Net
    param, data_batch = planning_param(model, batch=1)
    return Net(param, TRAIN), data_batch


# -- costs from a built net -----------------------------------------------------------------

def net_costs(net, batch=1):
    """LayerCost of every layer of `net`, built with `batch` samples, in net order."""
    return [layer_cost(layer, bottom, top, batch)
            for layer, bottom, top in zip(net.layers, net.bottom_vecs, net.top_vecs)]


def layer_cost(layer, bottom, top, batch=1):
    """The LayerCost of one layer of a net built with `batch` samples, per sample."""
    def per_sample(blob):
        """Values of one sample: blobs with the batch as first axis; others (a loss) whole."""
        shape = blob.shape
        count = int(np.prod(shape, dtype=np.int64))
        return count // batch if shape and shape[0] == batch else count
    return _layer_cost(layer, bottom, top, per_sample)


def _layer_cost(layer, bottom, top, per_sample):
    cost = LayerCost(
        name=layer.name, type=layer.type,
        weights=sum(b.count for k, b in enumerate(layer.blobs) if _learned(layer, k)),
        input_elems=sum(per_sample(b) for b in bottom),
        bottom_elems=tuple(per_sample(b) for b in bottom),
        output_elems=sum(per_sample(t) for t in top),
        bottoms=tuple(layer.param.bottom), tops=tuple(layer.param.top))
    kind = layer.type
    if kind in GEMM_TYPES and layer.blobs:
        _gemm_cost(cost, layer, bottom, top, per_sample)
    elif kind == "Pooling":
        _pooling_cost(cost, layer, bottom, top, per_sample)
    elif kind == "LRN":
        _lrn_cost(cost, layer, top, per_sample)
    elif kind == "Eltwise":
        # SUM: n - 1 adds (n multiplies more with coefficients; backward scales by them or
        # copies); PROD: n - 1 multiplies, 2 per input back; MAX: n - 1 compares, n selects.
        n, count = len(bottom), per_sample(top[0])
        p = layer.param.eltwise_param
        scaled = n if p.operation == pb.EltwiseParameter.SUM and p.coeff else 0
        back = {pb.EltwiseParameter.SUM: scaled, pb.EltwiseParameter.PROD: 2 * n,
                pb.EltwiseParameter.MAX: n}[p.operation]
        cost.forward = float(count * (n - 1 + scaled))
        cost.backward_data = float(count * back)
    elif kind == "Split":
        cost.backward_data = float(per_sample(bottom[0]) * (len(top) - 1))
    elif kind in ELEMENTWISE_OPS:
        fwd, bwd = ELEMENTWISE_OPS[kind]
        count = per_sample(bottom[0]) if bottom else 0    # a loss's top is one value
        cost.forward, cost.backward_data = float(fwd * count), float(bwd * count)
        if kind in ("PReLU", "Scale", "Bias") and cost.weights:
            cost.weight_grad = 2.0 * per_sample(bottom[0])
    return cost


def _learned(layer, k):
    """Whether blob k gets a gradient to communicate: not with lr_mult 0, nor BatchNorm's stored
    statistics."""
    if layer.type == "BatchNorm":
        return False
    specs = layer.param.param
    return k >= len(specs) or specs[k].lr_mult != 0


def _gemm_cost(cost, layer, bottom, top, per_sample):
    w = layer.blobs[0]
    num_output = int(layer.param.convolution_param.num_output if layer.type != "InnerProduct"
                     else layer.param.inner_product_param.num_output)
    features = top[0] if layer.type != "Deconvolution" else bottom[0]
    # Output positions each weight is applied at: the feature maps' pixels (out_h * out_w in
    # 2-D) per sample, times the axes between the batch and the channels (1 for FC).
    positions = per_sample(features) // (num_output if layer.type != "Deconvolution"
                                         else layer.channels)
    macs = w.count * positions
    cost.forward = cost.backward_data = cost.weight_grad = 2.0 * macs
    cost.gemm_weights = w.count
    if layer.type == "InnerProduct":
        ifm = w.shape[0] if layer.param.inner_product_param.transpose else w.shape[1]
        cost.geometry = {"ifm": int(ifm), "ofm": num_output, "kernel": (1, 1), "stride": (1, 1),
                         "in": (1, 1), "out": (1, 1), "group": 1, "rows": positions,
                         "axis": int(layer.param.inner_product_param.axis)}
        return
    image, feats = (top[0], bottom[0]) if layer.type == "Deconvolution" else (bottom[0], top[0])
    spatial = layer.axis + 1             # the first axis after the channel axis
    cost.geometry = {"ifm": int(layer.channels), "ofm": num_output,
                     "kernel": tuple(layer.kernel), "stride": tuple(layer.stride),
                     "dilation": tuple(layer.dilation), "group": int(layer.group),
                     "in": tuple(bottom[0].shape[spatial:]), "out": tuple(feats.shape[spatial:]),
                     "image": tuple(image.shape[spatial:])}


def _pooling_cost(cost, layer, bottom, top, per_sample):
    out = per_sample(top[0])
    kernel = tuple(bottom[0].shape[2:]) if layer.global_pooling else tuple(layer.kernel)
    window = int(np.prod(kernel))
    cost.forward = float(out * window)
    cost.backward_data = float(out if layer.method == pb.PoolingParameter.MAX else out * window)
    cost.geometry = {"kernel": kernel, "stride": tuple(layer.stride),
                     "in": tuple(bottom[0].shape[2:]), "out": tuple(top[0].shape[2:])}


def _lrn_cost(cost, layer, top, per_sample):
    p = layer.param.lrn_param
    window = p.local_size if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS \
        else p.local_size ** 2
    count = per_sample(top[0])
    # forward: square, window sum, scale (2), power, multiply; backward: the same window sum of
    # dy * y / s and four more operations per element.
    cost.forward = float(count * (window + 5))
    cost.backward_data = float(count * (window + 6))
