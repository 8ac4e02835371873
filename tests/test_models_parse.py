"""Static checks of the model zoo under models/: every prototxt parses into Caffe's schema, its
layer graph is well formed, and an independent shape walk (Caffe's conv/pool/inner-product rules)
gives the sizes, parameter counts and forward FLOPs stated in the paper and models/README.md."""
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import text_format

from syncsgd.proto import pb

MODELS = Path(__file__).resolve().parents[1] / "models"
TRAIN, TEST = pb.TRAIN, pb.TEST
DATA_TYPES = {"Input", "HDF5Data", "Data", "ImageData", "MemoryData", "DummyData"}
LOSS_TYPES = {"SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss"}
SAME_SHAPE = {"ReLU", "Sigmoid", "TanH", "Dropout", "LRN", "Softmax", "BatchNorm", "Scale"}
SCALAR = LOSS_TYPES | {"Accuracy"}


@dataclass(frozen=True)
class Expected:
    sample_shape: tuple        # one input sample, without the batch axis
    fc_inputs: tuple           # input features of each InnerProduct, in net order
    classes: int
    weight_layers: int
    sources: tuple             # (TRAIN, TEST) HDF5 list files
    batches: tuple             # (TRAIN, TEST) global minibatch sizes
    aux_heads: tuple = ()      # name prefixes of train_val-only auxiliary classifiers
    accuracies: int = 1        # Accuracy layers in TEST


IMAGENET = ("data/imagenet_synth/train.txt", "data/imagenet_synth/test.txt")
CIFAR = ("data/cifar10/train.txt", "data/cifar10/test.txt")
EXPECTED = {
    "lenet": Expected((1, 28, 28), (800, 500), 10, 4,
                      ("data/digits/train.txt", "data/digits/test.txt"), (64, 100)),
    "cifar10_quick": Expected((3, 32, 32), (1024, 64), 10, 5, CIFAR, (100, 100)),
    "cifar10_full": Expected((3, 32, 32), (1024,), 10, 4, CIFAR, (100, 100)),
    "alexnet": Expected((3, 227, 227), (9216, 4096, 4096), 1000, 8, IMAGENET, (256, 50)),
    "vgg_a": Expected((3, 224, 224), (25088, 4096, 4096), 1000, 11, IMAGENET, (256, 50)),
    "overfeat_fast": Expected((3, 231, 231), (36864, 3072, 4096), 1000, 8, IMAGENET, (256, 50)),
    "cddnn": Expected((440,), (440,) + (2048,) * 7, 9304, 8,
                      ("data/cddnn_synth/train.txt", "data/cddnn_synth/test.txt"), (256, 256)),
    # BVLC's GoogLeNet trains two auxiliary classifiers, each with top-1 and top-5 accuracy.
    "googlenet": Expected((3, 224, 224), (1024,), 1000, 58, IMAGENET, (32, 50),
                          aux_heads=("loss1/", "loss2/"), accuracies=6),
    "resnet50": Expected((3, 224, 224), (2048,), 1000, 54, IMAGENET, (256, 50)),
}
PROTOTXTS = sorted(p for p in MODELS.rglob("*.prototxt") if p.name != "solver.prototxt")


def load(path):
    return text_format.Parse(Path(path).read_text(), pb.NetParameter())


def in_phase(layer, phase):
    """Caffe's NetStateRule filtering by phase alone (the zoo uses no levels or stages)."""
    for rule in list(layer.include) + list(layer.exclude):
        assert not (rule.HasField("min_level") or rule.HasField("max_level")
                    or rule.stage or rule.not_stage), f"{layer.name}: only phase rules are expected"
    if layer.include:
        return any(not r.HasField("phase") or r.phase == phase for r in layer.include)
    return not any(not r.HasField("phase") or r.phase == phase for r in layer.exclude)


def phase_layers(net, phase):
    return [layer for layer in net.layer if in_phase(layer, phase)]


def is_aux(layer, name):
    """Whether `layer` belongs to one of the net's auxiliary classifiers (train_val only)."""
    return layer.name.startswith(EXPECTED[name].aux_heads)


def phases_of(path):
    return (TRAIN, TEST) if path.name == "train_val.prototxt" else (TEST,)


# ---------------------------------------------------------------- shape walk


def _one(values, default, what):
    """The single value of a repeated Caffe geometry field (the zoo uses square geometry only)."""
    assert len(values) <= 1, f"{what}: the walk handles one value, got {list(values)}"
    return values[0] if values else default


def conv_out(size, kernel, stride, pad):
    return (size + 2 * pad - kernel) // stride + 1


def pool_out(size, kernel, stride, pad):
    out = math.ceil((size + 2 * pad - kernel) / stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@dataclass
class Cost:
    name: str
    type: str
    fan_in: int        # inputs feeding one output value
    params: int        # weights + biases
    weights: int
    macs: int          # multiply-accumulates per sample, forward


def walk(layers, input_shapes):
    """Blob shapes and per-layer costs, using only Caffe's conv/pool/inner-product/flatten rules.

    input_shapes maps the tops of HDF5 data layers to their shapes; Input layers give their own."""
    shapes, costs = {}, []
    for layer in layers:
        t, bottoms = layer.type, [shapes[b] for b in layer.bottom]
        if t == "Input":
            outs = [tuple(s.dim) for s in layer.input_param.shape]
        elif t == "HDF5Data":
            outs = [input_shapes[top] for top in layer.top]
        elif t == "Convolution":
            cp = layer.convolution_param
            assert not (cp.HasField("kernel_h") or cp.HasField("stride_h") or cp.dilation)
            k, s, p = (_one(cp.kernel_size, None, "kernel_size"), _one(cp.stride, 1, "stride"),
                       _one(cp.pad, 0, "pad"))
            n, c, h, w = bottoms[0]
            assert c % cp.group == 0 and cp.num_output % cp.group == 0, layer.name
            outs = [(n, cp.num_output, conv_out(h, k, s, p), conv_out(w, k, s, p))]
            fan_in = (c // cp.group) * k * k
            weights = cp.num_output * fan_in
            costs.append(Cost(layer.name, t, fan_in, weights + cp.num_output * cp.bias_term,
                              weights, weights * outs[0][2] * outs[0][3]))
        elif t == "Pooling":
            pp = layer.pooling_param
            assert pp.round_mode == pb.PoolingParameter.CEIL and not pp.HasField("kernel_h")
            n, c, h, w = bottoms[0]
            if pp.global_pooling:
                outs = [(n, c, 1, 1)]
            else:
                k, s, p = pp.kernel_size, pp.stride, pp.pad
                outs = [(n, c, pool_out(h, k, s, p), pool_out(w, k, s, p))]
        elif t == "InnerProduct":
            ip = layer.inner_product_param
            axis = ip.axis % len(bottoms[0])
            fan_in = math.prod(bottoms[0][axis:])
            outs = [bottoms[0][:axis] + (ip.num_output,)]
            weights = fan_in * ip.num_output
            costs.append(Cost(layer.name, t, fan_in, weights + ip.num_output * ip.bias_term,
                              weights, weights))
        elif t == "Flatten":
            axis = layer.flatten_param.axis % len(bottoms[0])
            outs = [bottoms[0][:axis] + (math.prod(bottoms[0][axis:]),)]
        elif t in SAME_SHAPE:
            outs = [bottoms[0]]
        elif t == "Eltwise":
            assert all(b == bottoms[0] for b in bottoms), layer.name
            outs = [bottoms[0]]
        elif t == "Concat":
            assert not layer.concat_param.HasField("concat_dim"), layer.name
            axis = layer.concat_param.axis % len(bottoms[0])
            assert all(b[:axis] + b[axis + 1:] == bottoms[0][:axis] + bottoms[0][axis + 1:]
                       for b in bottoms), layer.name
            outs = [bottoms[0][:axis] + (sum(b[axis] for b in bottoms),)
                    + bottoms[0][axis + 1:]]
        elif t in SCALAR:
            outs = [()]
        else:
            pytest.fail(f"layer {layer.name}: the shape walk does not know type {t}")
        assert len(outs) == len(layer.top), layer.name
        shapes.update(zip(layer.top, outs))
    return shapes, costs


def deploy_walk(name):
    net = load(MODELS / name / "deploy.prototxt")
    return walk(phase_layers(net, TEST), {})


def totals(name):
    """(parameters, weights, forward FLOPs per sample); FLOPs = 2 * MACs of conv and fc layers."""
    _, costs = deploy_walk(name)
    return (sum(c.params for c in costs), sum(c.weights for c in costs),
            2 * sum(c.macs for c in costs))


def human(x):
    """Four significant figures with an SI prefix: 132.9 M, 15.24 G, 431.1 k."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x} "


def readme_row(name):
    """The table row models/README.md must carry for this net, from the walk above."""
    exp = EXPECTED[name]
    params, _, flops = totals(name)
    shape = " x ".join(map(str, exp.sample_shape))
    return (f"| {name} | {shape} | {exp.weight_layers} | {params:,} ({human(params)}) "
            f"| {human(flops)}FLOP |")


# ---------------------------------------------------------------- tests


def test_zoo_is_complete():
    assert {p.parent.name for p in PROTOTXTS} == set(EXPECTED)
    for name in EXPECTED:
        assert {p.name for p in (MODELS / name).glob("*.prototxt")} == \
            {"deploy.prototxt", "train_val.prototxt", "solver.prototxt"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_solver_names_its_train_val(name):
    solver = text_format.Parse((MODELS / name / "solver.prototxt").read_text(),
                               pb.SolverParameter())
    assert solver.net == f"models/{name}/train_val.prototxt"
    assert solver.snapshot_prefix.startswith(f"runs/{name}/")
    assert len(solver.test_iter) == 1 and solver.test_interval > 0


@pytest.mark.parametrize("path", PROTOTXTS, ids=lambda p: str(p.relative_to(MODELS)))
def test_parses_in_current_layer_syntax(path):
    net = load(path)
    assert net.name and net.layer and not net.layers, "use `layer { }`, not V1 `layers { }`"
    assert not net.input and not net.input_shape, "declare inputs with an Input layer"


@pytest.mark.parametrize("path", PROTOTXTS, ids=lambda p: str(p.relative_to(MODELS)))
def test_layer_names_unique(path):
    names = [layer.name for layer in load(path).layer]
    assert all(names) and len(names) == len(set(names)), names


@pytest.mark.parametrize("path", PROTOTXTS, ids=lambda p: str(p.relative_to(MODELS)))
def test_every_bottom_comes_from_an_earlier_layer(path):
    net = load(path)
    for phase in phases_of(path):
        produced = set()
        for layer in phase_layers(net, phase):
            missing = set(layer.bottom) - produced
            assert not missing, f"{layer.name} (phase {phase}) reads unproduced {missing}"
            for top in layer.top:
                assert top not in produced or top in layer.bottom, \
                    f"{layer.name} overwrites {top} without being in place"
            produced.update(layer.top)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_train_val_data_loss_and_accuracy(name):
    exp = EXPECTED[name]
    net = load(MODELS / name / "train_val.prototxt")
    assert not any(layer.type == "Input" for layer in net.layer)
    for phase, source, batch in zip((TRAIN, TEST), exp.sources, exp.batches):
        layers = phase_layers(net, phase)
        data = [layer for layer in layers if layer.type in DATA_TYPES]
        assert len(data) == 1, f"phase {phase}: {[d.name for d in data]}"
        assert data[0].type == "HDF5Data" and list(data[0].top) == ["data", "label"]
        assert [r.phase for r in data[0].include] == [phase]
        assert data[0].hdf5_data_param.source == source
        assert data[0].hdf5_data_param.batch_size == batch
        losses = [layer for layer in layers if layer.type in LOSS_TYPES]
        assert [layer.type for layer in losses] == ["SoftmaxWithLoss"] * (1 + len(exp.aux_heads))
        accuracy = [layer for layer in layers if layer.type == "Accuracy"]
        assert len(accuracy) == (exp.accuracies if phase == TEST else 0)
        for head in losses + accuracy:
            assert head.bottom[1] == "label"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deploy_has_input_and_no_loss(name):
    net = load(MODELS / name / "deploy.prototxt")
    data = [layer for layer in net.layer if layer.type in DATA_TYPES]
    assert [(d.type, list(d.top)) for d in data] == [("Input", ["data"])]
    shape = tuple(data[0].input_param.shape[0].dim)
    assert 1 <= shape[0] <= 10 and shape[1:] == EXPECTED[name].sample_shape
    assert not any(layer.type in SCALAR for layer in net.layer)
    assert not any(layer.include or layer.exclude for layer in net.layer)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_deploy_and_train_val_share_the_body(name):
    """The two files must describe the same network between the data and the head (auxiliary
    classifiers are train_val's only)."""
    def body(path, drop):
        return [layer for layer in load(path).layer
                if layer.type not in drop and not is_aux(layer, name)]
    deploy = body(MODELS / name / "deploy.prototxt", DATA_TYPES)
    train_val = body(MODELS / name / "train_val.prototxt", DATA_TYPES | SCALAR)
    assert deploy[-1].type == "Softmax" and deploy[-1].top == ["prob"]
    assert deploy[:-1] == train_val


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shape_walk_gives_fc_inputs_and_classes(name):
    exp = EXPECTED[name]
    shapes, costs = deploy_walk(name)
    fc_inputs = tuple(c.fan_in for c in costs if c.type == "InnerProduct")
    assert fc_inputs == exp.fc_inputs
    assert len(costs) == exp.weight_layers
    assert shapes["prob"][1:] == (exp.classes,)

    net = load(MODELS / name / "train_val.prototxt")
    for phase, batch in zip((TRAIN, TEST), exp.batches):
        layers = phase_layers(net, phase)
        shapes, phase_costs = walk(layers,
                                   {"data": (batch,) + exp.sample_shape, "label": (batch,)})
        aux = {layer.name for layer in layers if is_aux(layer, name)}
        assert bool(aux) == bool(exp.aux_heads)
        assert [c for c in phase_costs if c.name not in aux] == costs
        assert all(shapes[top] == () for layer in layers if layer.type in LOSS_TYPES
                   for top in layer.top)
        assert shapes[costs[-1].name] == (batch, exp.classes)


def test_shape_rules_round_like_caffe():
    assert conv_out(231, 11, 4, 0) == 56 and pool_out(56, 2, 2, 0) == 28
    assert pool_out(32, 3, 2, 0) == 16      # ceil: a partial window at the border still counts
    assert conv_out(32, 3, 2, 0) == 15      # floor for convolution
    assert pool_out(5, 3, 2, 1) == 3        # the last window may not start inside the padding


def test_paper_derived_figures():
    """the paper (Das et al., 2016), section 6: VGG-A ~132.9 M params / 15.2 GFLOP, OverFeat-FAST ~145.9 M / 5.6 GFLOP,
    CD-DNN ~45 M weights."""
    params, _, flops = totals("vgg_a")
    assert round(params / 1e6, 1) == 132.9 and round(flops / 1e9, 1) == 15.2
    params, _, flops = totals("overfeat_fast")
    assert round(params / 1e6, 1) == 145.9 and round(flops / 1e9, 1) == 5.6
    _, weights, _ = totals("cddnn")
    assert round(weights / 1e6) == 45
    for name in ("vgg_a", "overfeat_fast"):
        _, costs = deploy_walk(name)
        fc = sum(c.params for c in costs if c.type == "InnerProduct")
        assert fc / sum(c.params for c in costs) > 0.85   # "about 90% of the weights" in fc6-fc8


def test_readme_table_matches_the_walk():
    text = (MODELS / "README.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\w+) \|.*\|$", text, re.M)}
    for name in EXPECTED:
        assert rows.get(name) == readme_row(name), f"README row for {name}"
