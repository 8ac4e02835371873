"""Caffe layers as ONNX nodes: one converter per layer type, in TEST-phase semantics.

A converter takes the Graph and a Step (the built layer, its bottoms' tensors and shapes, its
tops' shapes) and returns one tensor name per top. Weights come from the layer's blobs; shapes
come from the built net, except the batch dimension, which converters leave to the tensors
(0 and -1 in Reshape targets, Graph.shape_of) so that a model exported with another or a
dynamic batch stays right.

Where ONNX differs from Caffe the converter says how it matches Caffe: pooling's output size,
padding and divisor, LRN within a channel, the forks' Interp (align-corners bilinear) and
Upsample (max-unpooling by the pooling mask).
"""
import numpy as np
from onnx import TensorProto, helper

from syncsgd.blob import Blob
from syncsgd.errors import SyncSGDError
from syncsgd.layers.base import canonical_axis
from syncsgd.proto import pb

CONVERTERS = {}      # Caffe layer type -> converter(graph, step) -> top tensor names

# Why some well-known types have no ONNX form, for the error message.
NO_FORM = {
    "DetectionOutput": "non-maximum suppression over decoded boxes",
    "Python": "a Python layer runs code the model cannot carry",
    "Accuracy": "a training and testing metric",
    "PSROIPooling": "ONNX has no position-sensitive region pooling",
}


def converts(*types):
    def register(convert):
        for kind in types:
            CONVERTERS[kind] = convert
        return convert
    return register


def no_form(layer, why=""):
    """The error for a layer the export stops at, offering the export up to it."""
    why = why or NO_FORM.get(layer.type, "")
    if layer.type.endswith("Loss"):
        why = why or "a training loss"
    detail = f" ({why})" if why else ""
    return SyncSGDError(
        f"layer '{layer.name}' ({layer.type}) has no ONNX form{detail}; export the net up to it "
        f"with `--until {layer.name}` (Python: until='{layer.name}'), its bottoms becoming the "
        "model's outputs")


class Step:
    """One layer to convert: `ins` are its bottoms' tensors, `shapes` and `top_shapes` the
    blobs' shapes in the built net."""

    def __init__(self, layer, ins, bottoms, tops):
        self.layer, self.param, self.ins, self.bottoms = layer, layer.param, ins, bottoms
        self.shapes = [b.shape for b in bottoms]
        self.top_shapes = [t.shape for t in tops]

    def refuse(self, why):
        raise no_form(self.layer, why)

    def weight(self, g, k):
        """The layer's blob k as a weight."""
        return g.const(self.layer.blobs[k].data, f"blob{k}")


def scalar(g, value):
    return g.const(np.float32(value), "scalar")


def trailing_ones(array, rank, axis):
    """`array` (an operand over axes axis.. of a rank-`rank` tensor) shaped to broadcast."""
    return array.reshape(array.shape + (1,) * (rank - axis - array.ndim))


# -- no computation -------------------------------------------------------------------------------
@converts("Split")
def _split(g, s):
    return [s.ins[0]] * len(s.top_shapes)


@converts("Silence")
def _silence(g, s):
    return []


@converts("Dropout")
def _dropout(g, s):
    p = s.param.dropout_param
    if p.scale_train:
        return [s.ins[0]]
    return [g.op("Mul", [s.ins[0], scalar(g, np.float32(1.0 - p.dropout_ratio))])]


@converts("PriorBox")
def _prior_box(g, s):
    """The boxes depend on the shapes only: the layer's forward gives them once."""
    boxes = Blob(s.top_shapes[0])
    s.layer.forward(s.bottoms, [boxes])
    return [g.const(boxes.data, "priors")]


@converts("Parameter")
def _parameter(g, s):
    return [s.weight(g, 0)]


# -- elementwise ----------------------------------------------------------------------------------
UNARY = {"Sigmoid": "Sigmoid", "TanH": "Tanh", "AbsVal": "Abs", "BNLL": "Softplus"}


@converts(*UNARY)
def _unary(g, s):
    return [g.op(UNARY[s.layer.type], s.ins)]


@converts("ReLU")
def _relu(g, s):
    slope = s.param.relu_param.negative_slope
    if slope:
        return [g.op("LeakyRelu", s.ins, alpha=slope)]
    return [g.op("Relu", s.ins)]


@converts("ReLU6")
def _relu6(g, s):
    p = s.param.relu6_param
    if p.negative_slope:
        x = g.op("LeakyRelu", s.ins, alpha=p.negative_slope)
        return [g.op("Min", [x, scalar(g, p.threshold)])]
    return [g.op("Clip", [s.ins[0], scalar(g, 0), scalar(g, p.threshold)])]


@converts("Clip")
def _clip(g, s):
    p = s.param.clip_param
    return [g.op("Clip", [s.ins[0], scalar(g, p.min), scalar(g, p.max)])]


@converts("ELU")
def _elu(g, s):
    return [g.op("Elu", s.ins, alpha=s.param.elu_param.alpha)]


@converts("PReLU")
def _prelu(g, s):
    rank = len(s.shapes[0])
    slope = s.layer.blobs[0].data
    slope = slope.reshape(1) if slope.ndim == 0 else trailing_ones(slope, rank, 1)
    return [g.op("PRelu", [s.ins[0], g.const(slope, "slope")])]


def _affine(g, x, scale, shift):
    """scale * x + shift, leaving out a multiplication by 1 and an addition of 0."""
    if scale != 1:
        x = g.op("Mul", [x, scalar(g, scale)])
    if shift != 0:
        x = g.op("Add", [x, scalar(g, shift)])
    return x


@converts("Power")
def _power(g, s):
    p = s.param.power_param
    x = s.ins[0]
    if p.power * p.scale == 0:      # a constant, as Caffe fills it
        value = 1.0 if p.power == 0 else float(np.float32(p.shift) ** np.float32(p.power))
        return [g.op("ConstantOfShape", [g.op("Shape", [x])],
                     value=helper.make_tensor("value", TensorProto.FLOAT, [1], [value]))]
    y = _affine(g, x, p.scale, p.shift)
    if p.power != 1:
        y = g.op("Pow", [y, scalar(g, p.power)])
    return [y if y != x else g.op("Identity", [x])]


def _log_base(base):
    return 1.0 if base == -1 else float(np.log(base))


@converts("Exp")
def _exp(g, s):
    p = s.param.exp_param
    ln_base = _log_base(p.base)
    y = g.op("Exp", [_affine(g, s.ins[0], ln_base * p.scale, 0)])
    return [_affine(g, y, float(np.exp(ln_base * p.shift)), 0)]


@converts("Log")
def _log(g, s):
    p = s.param.log_param
    y = g.op("Log", [_affine(g, s.ins[0], p.scale, p.shift)])
    ln_base = _log_base(p.base)
    return [_affine(g, y, 1 / ln_base, 0)]


@converts("Threshold")
def _threshold(g, s):
    above = g.op("Greater", [s.ins[0], scalar(g, s.param.threshold_param.threshold)])
    return [g.op("Cast", [above], to=TensorProto.FLOAT)]


@converts("Swish")
def _swish(g, s):
    x = s.ins[0]
    gate = g.op("Sigmoid", [_affine(g, x, s.param.swish_param.beta, 0)])
    return [g.op("Mul", [x, gate])]


@converts("Eltwise")
def _eltwise(g, s):
    layer = s.layer
    op = s.param.eltwise_param.operation
    if op == pb.EltwiseParameter.SUM:
        terms = [_affine(g, x, float(c), 0) for x, c in zip(s.ins, layer.coeff)]
        return [g.op("Sum", terms)]
    if op == pb.EltwiseParameter.MAX:
        return [g.op("Max", s.ins)]
    y = s.ins[0]
    for x in s.ins[1:]:
        y = g.op("Mul", [y, x])
    return [y]


def _operand(g, s, axis_field):
    """Scale's and Bias's operand (bottom 1, or the learned blob) shaped to broadcast over
    bottom 0 from its axis (a scalar operand ignores the axis, as in Caffe)."""
    rank = len(s.shapes[0])
    if len(s.ins) == 1:
        return _learned(g, s.layer.blobs[0].data, rank, axis_field, "blob0")
    shape = s.shapes[1]
    extra = rank - canonical_axis(axis_field, rank) - len(shape) if shape else 0
    if not extra:
        return s.ins[1]
    return g.op("Reshape", [s.ins[1], g.ints([0] * len(shape) + [1] * extra)])


def _learned(g, data, rank, axis_field, what):
    """A learned operand as a weight shaped to broadcast from its axis (a scalar's is none)."""
    if data.ndim:
        data = trailing_ones(data, rank, canonical_axis(axis_field, rank))
    return g.const(data, what)


@converts("Scale")
def _scale(g, s):
    p = s.param.scale_param
    y = g.op("Mul", [s.ins[0], _operand(g, s, p.axis)])
    if p.bias_term:
        bias = _learned(g, s.layer.blobs[-1].data, len(s.shapes[0]), p.axis, "bias")
        y = g.op("Add", [y, bias])
    return [y]


@converts("Bias")
def _bias(g, s):
    return [g.op("Add", [s.ins[0], _operand(g, s, s.param.bias_param.axis)])]


@converts("Axpy")
def _axpy(g, s):
    a, x, y = s.ins
    extra = len(s.shapes[1]) - len(s.shapes[0])
    if extra:
        a = g.op("Reshape", [a, g.ints([0, 0] + [1] * extra)])
    return [g.op("Add", [g.op("Mul", [x, a]), y])]


# -- normalisation --------------------------------------------------------------------------------
def _batch_statistics(g, s, eps):
    """(x - mean) / sqrt(var + eps) with the batch's own per-channel mean and (biased) variance,
    as Caffe's BatchNorm without use_global_stats and the forks' BN in their batch modes."""
    x = s.ins[0]
    axes = [0] + list(range(2, len(s.shapes[0])))
    centred = g.op("Sub", [x, g.reduce("ReduceMean", x, axes)])
    variance = g.reduce("ReduceMean", g.op("Mul", [centred, centred]), axes)
    return g.op("Div", [centred, g.op("Sqrt", [g.op("Add", [variance, scalar(g, eps)])])])


@converts("BatchNorm")
def _batch_norm(g, s):
    p = s.param.batch_norm_param
    if len(s.shapes[0]) < 2:
        s.refuse(f"a bottom of shape {s.shapes[0]}, without a channel axis")
    if p.HasField("use_global_stats") and not p.use_global_stats:
        return [_batch_statistics(g, s, p.eps)]
    blobs = s.layer.blobs
    factor = blobs[2].data[0]
    factor = np.float32(0.0 if factor == 0 else 1.0 / factor)
    channels = s.shapes[0][1]
    return [g.op("BatchNormalization",
                 [s.ins[0], g.const(np.ones(channels), "scale"),
                  g.const(np.zeros(channels), "shift"), g.const(blobs[0].data * factor, "mean"),
                  g.const(blobs[1].data * factor, "variance")], epsilon=p.eps)]


@converts("BN")
def _bn(g, s):
    layer = s.layer
    if len(s.top_shapes) > 1:
        s.refuse("the batch mean and variance tops of bn_mode LEARN")
    channels, rank = s.shapes[0][1], len(s.shapes[0])

    def per_channel(k):
        return layer.blobs[k].data.reshape(channels)
    if layer.stats == "moving":
        return [g.op("BatchNormalization",
                     [s.ins[0]] + [g.const(per_channel(k), f"blob{k}") for k in range(4)],
                     epsilon=layer.eps)]
    x = s.ins[0] if layer.stats == "none" else _batch_statistics(g, s, layer.eps)
    scale, shift = (g.const(trailing_ones(per_channel(k), rank, 1), f"blob{k}") for k in (0, 1))
    return [g.op("Add", [g.op("Mul", [x, scale]), shift])]


@converts("LRN")
def _lrn(g, s):
    p = s.param.lrn_param
    x = s.ins[0]
    if p.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
        # ONNX divides alpha by the window size as Caffe does.
        return [g.op("LRN", [x], size=p.local_size, alpha=p.alpha, beta=p.beta, bias=p.k)]
    # WITHIN_CHANNEL: 1 + alpha / size^2 * (zero-padded window sum of x^2), to the power -beta;
    # the average of a symmetric zero-padded window always divides by size^2.
    pad = (p.local_size - 1) // 2
    mean = g.op("AveragePool", [g.op("Mul", [x, x])], kernel_shape=[p.local_size] * 2,
                pads=[pad] * 4, count_include_pad=1)
    scale = _affine(g, mean, p.alpha, 1.0)
    return [g.op("Div", [x, g.op("Pow", [scale, scalar(g, p.beta)])])]


@converts("Normalize")
def _normalize(g, s):
    layer = s.layer
    x = s.ins[0]
    rank = len(s.shapes[0])
    axes = list(range(1, rank)) if layer.across_spatial else [1]
    squares = g.reduce("ReduceSumSquare", x, axes)
    norm = g.op("Sqrt", [g.op("Add", [squares, scalar(g, layer.eps)])])
    scale = layer.blobs[0].data
    scale = scale if scale.ndim == 0 else trailing_ones(scale, rank, 1)
    return [g.op("Mul", [g.op("Div", [x, norm]), g.const(scale, "scale")])]


@converts("MVN")
def _mvn(g, s):
    p = s.param.mvn_param
    x = s.ins[0]
    if len(s.shapes[0]) != 4:        # Caffe reads the bottom as (num, channels, height, width)
        x = g.op("Reshape", [x, g.ints([0] + list(s.top_shapes[0][1:]))])
    axes = [1, 2, 3] if p.across_channels else [2, 3]
    y = g.op("Sub", [x, g.reduce("ReduceMean", x, axes)])
    if p.normalize_variance:
        std = g.op("Sqrt", [g.reduce("ReduceMean", g.op("Mul", [y, y]), axes)])
        y = g.op("Div", [y, g.op("Add", [std, scalar(g, p.eps)])])
    return [y]


@converts("Softmax")
def _softmax(g, s):
    axis = canonical_axis(s.param.softmax_param.axis, len(s.shapes[0]))
    return [g.op("Softmax", s.ins, axis=axis)]


# -- weighted layers ------------------------------------------------------------------------------
@converts("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution", "Deconvolution")
def _convolution(g, s):
    layer = s.layer
    if layer.axis != 1:
        s.refuse(f"convolution_param.axis {layer.axis}: ONNX convolves from axis 1")
    if not layer.kernel:
        s.refuse("a convolution of a blob without spatial axes")
    weights = [s.weight(g, 0)] + ([s.weight(g, 1)] if layer.bias_term else [])
    kind = "ConvTranspose" if layer.reverse else "Conv"
    return [g.op(kind, [x] + weights, kernel_shape=list(layer.kernel),
                 strides=list(layer.stride), pads=list(layer.pad) * 2,
                 dilations=list(layer.dilation), group=layer.group) for x in s.ins]


@converts("InnerProduct")
def _inner_product(g, s):
    p = s.param.inner_product_param
    shape = s.shapes[0]
    axis = canonical_axis(p.axis, len(shape))
    x = s.ins[0]
    if len(shape) != 2 or axis != 1:
        x = g.op("Flatten", [x], axis=axis)                 # (rows, inputs)
    weights = [s.weight(g, 0)] + ([s.weight(g, 1)] if p.bias_term else [])
    y = g.op("Gemm", [x] + weights, transB=0 if p.transpose else 1)
    top = s.top_shapes[0]
    if len(top) != 2:
        target = list(top) if axis == 0 else [-1] + list(top[1:])
        y = g.op("Reshape", [y, g.ints(target)])
    return [y]


@converts("Embed")
def _embed(g, s):
    index = g.op("Cast", s.ins, to=TensorProto.INT64)
    y = g.op("Gather", [s.weight(g, 0), index], axis=0)
    if s.param.embed_param.bias_term:
        y = g.op("Add", [y, s.weight(g, 1)])
    return [y]


# -- pooling and resizing -------------------------------------------------------------------------
def pool(g, x, average, size, kernel, stride, pad, pooled, mask=False):
    """Caffe's pooling of x (N, C, *size) into `pooled` windows per axis (its ceil-or-floor
    rule already applied). The padding at the end is given explicitly, so that ONNX's floor
    rule gives Caffe's count. MAX ignores the padding. AVE divides by the window's part inside
    the image and its padding, which is the whole window unless the last windows pass the padded
    image: ONNX then divides by the whole window too (count_include_pad), and a constant map
    rescales those windows to Caffe's divisor. Returns the output, and with `mask` also the
    MaxPool indices."""
    end = [max(0, (n - 1) * st + k - sz - p)
           for n, st, k, sz, p in zip(pooled, stride, kernel, size, pad)]
    window = dict(kernel_shape=list(kernel), strides=list(stride), pads=list(pad) + end)
    if not average:
        return g.op("MaxPool", [x], outputs=2 if mask else 1, **window)
    y = g.op("AveragePool", [x], count_include_pad=1, **window)
    if all(e <= p for e, p in zip(end, pad)):
        return y
    # Per axis, how much of each window lies in the padded image [-pad, size + pad).
    covered = [np.minimum(k, sz + 2 * p - np.arange(n) * st)
               for n, st, k, sz, p in zip(pooled, stride, kernel, size, pad)]
    rescale = np.prod(kernel) / np.multiply.outer(*covered)
    return g.op("Mul", [y, g.const(rescale, "divisor")])


@converts("Pooling")
def _pooling(g, s):
    layer = s.layer
    average = layer.method == pb.PoolingParameter.AVE
    size, pooled = s.shapes[0][2:], s.top_shapes[0][2:]
    mask = len(s.top_shapes) > 1
    if layer.global_pooling and not mask:
        return [g.op("GlobalAveragePool" if average else "GlobalMaxPool", s.ins)]
    kernel = size if layer.global_pooling else layer.kernel
    out = pool(g, s.ins[0], average, size, kernel, layer.stride, layer.pad, pooled, mask)
    if not mask:
        return [out]
    y, indices = out
    # ONNX's indices count from the start of the tensor; Caffe's mask from its plane's.
    plane = size[0] * size[1]
    caffe = g.op("Cast", [g.op("Mod", [indices, g.ints(plane, "plane")])], to=TensorProto.FLOAT)
    g.pool_indices[caffe] = (indices, plane)
    return [y, caffe]


@converts("SPP")
def _spp(g, s):
    from syncsgd.layers.pooling import pooled_size
    from syncsgd.layers.spp import level_pooling
    p = s.param.spp_param
    size = s.shapes[0][2:]
    levels = []
    for level in range(p.pyramid_height):
        q = level_pooling(level, size, p.pool)
        kernel, stride, pad = (q.kernel_h, q.kernel_w), (q.stride_h, q.stride_w), (q.pad_h,
                                                                                   q.pad_w)
        pooled = [pooled_size(*a, True) for a in zip(size, kernel, pad, stride)]
        levels.append(pool(g, s.ins[0], q.pool == pb.PoolingParameter.AVE, size, kernel,
                           stride, pad, pooled))
    if len(levels) == 1:
        return levels
    return [g.op("Concat", [g.op("Flatten", [y], axis=1) for y in levels], axis=1)]


@converts("ROIPooling")
def _roi_pooling(g, s):
    """ONNX's MaxRoiPool is Fast R-CNN's: corners scaled and rounded, bins floor/ceil."""
    p = s.param.roi_pooling_param
    rois = g.op("Reshape", [s.ins[1], g.ints([-1, 5])])
    return [g.op("MaxRoiPool", [s.ins[0], rois], pooled_shape=[p.pooled_h, p.pooled_w],
                 spatial_scale=p.spatial_scale)]


@converts("Upsample")
def _upsample(g, s):
    """Max-unpooling: each value goes to its window's argmax. MaxPool's indices serve as they
    are when the top's plane is the pooled image's; otherwise Caffe's mask (an index in the
    plane) is moved to each plane's start in the top."""
    n, c = s.shapes[0][:2]
    size = s.top_shapes[0][2:]
    plane = size[0] * size[1]
    indices, pooled_plane = g.pool_indices.get(s.ins[1], (None, None))
    if pooled_plane != plane:
        if not g.fixed_batch:
            s.refuse("a mask that does not come from a pooling of the top's size, with another "
                     "batch than the net's; export with the net's batch")
        starts = (np.arange(n * c, dtype=np.int64) * plane).reshape(n, c, 1, 1)
        indices = g.op("Add", [g.op("Cast", [s.ins[1]], to=TensorProto.INT64),
                               g.ints(starts, "starts")])
    shape = g.shape_of(s.ins[0], [n, c] + list(size))
    return [g.op("MaxUnpool", [s.ins[0], indices, shape], kernel_shape=[1, 1],
                 strides=[1, 1])]


@converts("Interp")
def _interp(g, s):
    """The forks' bilinear resizing with aligned corners, after cropping (pad_beg, pad_end
    <= 0)."""
    p = s.param.interp_param
    x = s.ins[0]
    n, c, h, w = s.shapes[0]
    if p.pad_beg or p.pad_end:
        start = -p.pad_beg
        stops = [h + p.pad_end, w + p.pad_end]
        x = g.op("Slice", [x, g.ints([start, start]), g.ints(stops), g.ints([2, 3])])
    sizes = g.shape_of(s.ins[0], [n, c] + list(s.top_shapes[0][2:]))
    return [g.op("Resize", [x, "", "", sizes], mode="linear",
                 coordinate_transformation_mode="align_corners")]


# -- shapes -------------------------------------------------------------------------------------
@converts("Concat")
def _concat(g, s):
    return [g.op("Concat", s.ins, axis=s.layer.axis)]


@converts("Slice")
def _slice(g, s):
    axis = s.layer.axis
    sizes = [shape[axis] for shape in s.top_shapes]
    if len(sizes) == 1:
        return [g.op("Identity", s.ins)]
    return g.op("Split", [s.ins[0], g.ints(sizes, "split")], outputs=len(sizes), axis=axis)


@converts("Flatten")
def _flatten(g, s):
    p = s.param.flatten_param
    shape = s.shapes[0]
    start, end = (canonical_axis(a, len(shape)) for a in (p.axis, p.end_axis))
    if start == 1 and end == len(shape) - 1:
        return [g.op("Flatten", s.ins, axis=1)]
    target = [0] * start + [-1] + list(shape[end + 1:])
    return [g.op("Reshape", [s.ins[0], g.ints(target)])]


@converts("Reshape")
def _reshape(g, s):
    """Caffe's dims go to the same places in the target: 0 copies the bottom's dimension there
    in both, -1 is inferred in both; the axes before `axis` are copied (0), those after
    `num_axes` written out."""
    p = s.param.reshape_param
    shape = s.shapes[0]
    n = len(shape)
    start = p.axis if p.axis >= 0 else n + p.axis + 1
    end = n if p.num_axes == -1 else start + p.num_axes
    target = [0] * start + list(p.shape.dim) + list(shape[end:])
    return [g.op("Reshape", [s.ins[0], g.ints(target)])]


@converts("Crop")
def _crop(g, s):
    window = s.layer.window
    axes = [i for i, (cut, size) in enumerate(zip(window, s.shapes[0]))
            if (cut.start, cut.stop) != (0, size)]
    if not axes:
        return [g.op("Identity", s.ins[:1])]
    return [g.op("Slice", [s.ins[0], g.ints([window[i].start for i in axes]),
                           g.ints([window[i].stop for i in axes]), g.ints(axes)])]


@converts("Permute", "Transpose")
def _transpose(g, s):
    order = s.layer.order if s.layer.type == "Permute" else s.layer.dims
    return [g.op("Transpose", s.ins, perm=[int(a) for a in order])]


def _reversed(g, x, axes):
    """x read backwards along `axes` (a Slice with step -1)."""
    if not axes:
        return g.op("Identity", [x])
    last = np.iinfo(np.int64).min
    return g.op("Slice", [x, g.ints([-1] * len(axes)), g.ints([last] * len(axes)),
                          g.ints(axes), g.ints([-1] * len(axes))])


@converts("Reverse")
def _reverse(g, s):
    return [_reversed(g, s.ins[0], [s.layer.axis])]


@converts("Flip")
def _flip(g, s):
    p = s.param.flip_param
    rank = len(s.shapes[0])
    axes = [a for a, wanted in ((2, p.flip_height), (3, p.flip_width)) if wanted and a < rank]
    return [_reversed(g, s.ins[0], axes)]


@converts("ShuffleChannel")
def _shuffle_channel(g, s):
    group = s.layer.group
    shape = s.shapes[0]
    x = g.op("Reshape", [s.ins[0], g.ints([0, group, shape[1] // group, -1])])
    x = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    return [g.op("Reshape", [x, g.ints([0] + list(shape[1:]))])]


@converts("Reorg")
def _reorg(g, s):
    """darknet's reorg as a reshape, a transpose and a reshape: read as (C / s^2, H, s, W, s)
    per sample, the top is (s, s, C / s^2, H, W) in that order (reverse: the inverse)."""
    layer = s.layer
    st = layer.stride
    _, c, h, w = s.shapes[0]
    if layer.reverse:
        grouped, perm = [0, st, st, c // (st * st), h, w], [0, 3, 4, 1, 5, 2]
    else:
        grouped, perm = [0, c // (st * st), h, st, w, st], [0, 3, 5, 1, 2, 4]
    x = g.op("Reshape", [s.ins[0], g.ints(grouped)])
    x = g.op("Transpose", [x], perm=perm)
    return [g.op("Reshape", [x, g.ints([0] + list(s.top_shapes[0][1:]))])]


@converts("Tile")
def _tile(g, s):
    p = s.param.tile_param
    rank = len(s.shapes[0])
    repeats = [1] * rank
    repeats[canonical_axis(p.axis, rank)] = p.tiles
    return [g.op("Tile", [s.ins[0], g.ints(repeats, "repeats")])]


REDUCTIONS = {pb.ReductionParameter.SUM: "ReduceSum", pb.ReductionParameter.ASUM: "ReduceL1",
              pb.ReductionParameter.SUMSQ: "ReduceSumSquare",
              pb.ReductionParameter.MEAN: "ReduceMean"}


@converts("Reduction")
def _reduction(g, s):
    p = s.param.reduction_param
    rank = len(s.shapes[0])
    axes = list(range(canonical_axis(p.axis, rank), rank))
    return [_affine(g, g.reduce(REDUCTIONS[p.operation], s.ins[0], axes, keepdims=0),
                    p.coeff, 0)]


@converts("ArgMax")
def _argmax(g, s):
    """top_k 1 only: ONNX's TopK ranks equal values the other way round from Caffe."""
    p = s.param.argmax_param
    if p.top_k != 1:
        s.refuse(f"argmax_param.top_k {p.top_k} (ONNX breaks ties the other way; top_k 1 "
                 "exports)")
    x, axis = s.ins[0], s.layer.axis
    if axis is not None and p.out_max_val:
        return [g.reduce("ReduceMax", x, [axis])]
    if axis is None:                     # each sample flattened: (N, 1 or 2, 1)
        x = g.op("Flatten", [x], axis=1)
    index = g.op("Cast", [g.op("ArgMax", [x], axis=axis or 1, keepdims=1,
                                select_last_index=1)], to=TensorProto.FLOAT)
    if axis is not None:
        return [index]
    if p.out_max_val:
        index = g.op("Concat", [index, g.reduce("ReduceMax", x, [1])], axis=1)
    return [g.op("Reshape", [index, g.ints([0] + list(s.top_shapes[0][1:]))])]
