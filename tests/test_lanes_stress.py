"""Lanes under stress: many small random conv nets (seeded), each run for many training passes
with lanes and without, over every form of convolution and every layer type lanes can carry.

oneDNN picks its kernel by shape, group and instruction set, and lanes run primitives built on
the calling thread on their own threads (a GEMM-based convolution's scratchpad once crashed
there: Note [scratchpads] in kernels/onednn.py), so the nets vary what decides the kernel. What
lanes compute is what the layers compute without them, within float rounding, and reruns to the
bit; a net the lanes carry whole (every loss unnormalised) computes to the bit what each lane's
rows compute as a net of their own on one thread, its parameter gradients added in lane order.

SYNCSGD_STRESS_NETS and SYNCSGD_STRESS_PASSES size the run (tests/test_cpu_matrix.py runs a
short one under several instruction sets)."""
import os

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import syncsgd
from syncsgd import TRAIN, switches
from syncsgd.context import shard_range
from syncsgd.layers.pooling import pooled_size
from syncsgd.net import Net
from syncsgd.proto import pb

NETS = int(os.environ.get("SYNCSGD_STRESS_NETS", "60"))
PASSES = int(os.environ.get("SYNCSGD_STRESS_PASSES", "16"))
# Measured over 300 nets under each instruction set: lanes on and off differ by up to ~1e-6 of
# an array's largest value in activations and their gradients, ~2e-5 in parameter gradients.
RTOL, RTOL_GRADIENT = 1e-5, 1e-4


class NetMaker:
    """A random net as prototxt, layer by layer, with the shape (channels, height, width) of
    the blob the next layer reads. `exact`: the lanes carry it whole and each sample's terms of
    every loss count as they are (normalization NONE), so that each lane's rows make a net of
    their own whose results are the lanes' bits."""

    def __init__(self, seed, exact):
        self.rng = np.random.default_rng(seed)
        self.exact = exact
        self.batch = int(self.rng.integers(2 if exact else 1, 8))
        self.shape = (int(self.rng.choice([1, 1, 2, 3, 3, 4, 6])),
                      int(self.rng.integers(5, 14)), int(self.rng.integers(5, 14)))
        self.classes = int(self.rng.integers(2, 6))
        self.layers = []
        self.top = "data"
        self.inputs = {"data": (self.batch, *self.shape), "label": (self.batch,)}

    def pick(self, *options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p):
        return bool(self.rng.random() < p)

    def add(self, kind, body, top=None, bottoms=None, tops=None):
        name = f"{kind.lower()}{len(self.layers)}"
        top = top or name
        bottoms = bottoms or [self.top]
        tops = tops or [top]
        self.layers.append(f'layer {{ name: "{name}" type: "{kind}" '
                           + "".join(f'bottom: "{b}" ' for b in bottoms)
                           + "".join(f'top: "{t}" ' for t in tops) + body + " }")
        self.top = tops[0]
        return name

    def build(self):
        """Convolutions with activations, LRN and pooling between them, then fully connected
        layers, the losses and accuracy over the class scores; in a quarter of the nets that
        are not exact, a dropout after the convolutions or the first fully connected layer
        (the lanes' run ends before it)."""
        self.convolution(first=True)
        for _ in range(int(self.rng.integers(1, 5))):
            self.pick(self.convolution, self.activation, self.pooling, self.lrn)()
        dropout = None if self.exact or not self.chance(0.25) else self.pick("early", "late")
        if dropout == "early":
            self.dropout()
        if dropout == "late" or self.chance(0.6):
            self.inner_product(int(self.rng.integers(3, 12)))
            self.activation()
            if dropout == "late":
                self.dropout()
        self.inner_product(self.classes)
        self.losses()
        text = "\n".join([self.input_layer()] + self.layers)
        return text_format.Parse(text, pb.NetParameter())

    def input_layer(self):
        tops = "".join(f'top: "{name}" ' for name in self.inputs)
        shapes = "".join("shape { " + "".join(f"dim: {d} " for d in shape) + "} "
                         for shape in self.inputs.values())
        return (f'layer {{ name: "input" type: "Input" {tops}'
                f'input_param {{ {shapes}}} }}')

    def filler(self, fan_in):
        return f'weight_filler {{ type: "gaussian" std: {1.5 / np.sqrt(fan_in):.4f} }}'

    def convolution(self, first=False):
        """A Convolution in one of its forms (or, after the first, ConvolutionDepthwise or a
        small Deconvolution), its output no larger than 13 pixels."""
        channels, height, width = self.shape
        forms = ["plain", "padded", "strided", "dilated", "1x1", "rectangular", "grouped",
                 "depthwise"]
        if not first:
            forms += ["depthwise type", "deconvolution"]
        while True:
            form = self.pick(*forms)
            kind, group, outputs = "Convolution", 1, int(self.rng.integers(1, 9))
            kernel = [int(self.rng.integers(1, 4))] * 2
            pad, stride, dilation = [0, 0], [1, 1], 1
            if form == "plain":
                kernel = [int(self.rng.integers(2, 4))] * 2
            elif form == "padded":
                kernel = [3, 3]
                pad = [int(self.rng.integers(1, 3))] * 2
            elif form == "strided":
                stride = [int(self.rng.integers(2, 4))] * 2
                pad = [int(self.rng.integers(0, 2))] * 2
            elif form == "dilated":
                kernel = [int(self.rng.integers(2, 4))] * 2
                dilation = int(self.rng.integers(2, 4))
                pad = [int(self.rng.integers(0, dilation + 1))] * 2
            elif form == "1x1":
                kernel = [1, 1]
            elif form == "rectangular":
                kernel = [int(self.rng.integers(1, 4)), int(self.rng.integers(1, 4))]
                pad = [int(self.rng.integers(0, 2)), int(self.rng.integers(0, 2))]
                stride = [int(self.rng.integers(1, 3)), int(self.rng.integers(1, 3))]
            elif form == "grouped":
                divisors = [g for g in range(2, channels + 1) if channels % g == 0]
                if not divisors:
                    continue
                group = self.pick(*divisors)
                outputs = group * int(self.rng.integers(1, 4))
            elif form in ("depthwise", "depthwise type"):
                kernel = [3, 3]
                pad = [1, 1]
                group = channels
                outputs = channels * int(self.rng.integers(1, 3))
                if form == "depthwise type":
                    kind = "ConvolutionDepthwise"
            else:
                kind = "Deconvolution"
                kernel = [int(self.rng.integers(2, 4))] * 2
                stride = [int(self.rng.integers(1, 3))] * 2
                pad = [int(self.rng.integers(0, kernel[0]))] * 2
            if kind == "Deconvolution":
                size = [s * (x - 1) + k - 2 * p
                        for x, k, p, s in zip((height, width), kernel, pad, stride)]
            else:
                size = [(x + 2 * p - dilation * (k - 1) - 1) // s + 1
                        for x, k, p, s in zip((height, width), kernel, pad, stride)]
            if 1 <= min(size) and max(size) <= 13:
                break
        fields = [f"num_output: {outputs}", f"kernel_h: {kernel[0]} kernel_w: {kernel[1]}",
                  f"pad_h: {pad[0]} pad_w: {pad[1]}",
                  f"stride_h: {stride[0]} stride_w: {stride[1]}"]
        if dilation > 1:
            fields.append(f"dilation: {dilation}")
        if group > 1 and kind == "Convolution":
            fields.append(f"group: {group}")
        if self.chance(0.3):
            fields.append("bias_term: false")
        else:
            fields.append('bias_filler { type: "gaussian" std: 0.1 }')
        if self.chance(0.15):
            fields.append("engine: CAFFE")
        fan_in = (outputs if kind == "Deconvolution" else channels) // group * kernel[0] * kernel[1]
        fields.append(self.filler(fan_in))
        self.add(kind, "convolution_param { " + " ".join(fields) + " }")
        self.shape = (outputs, *size)

    def activation(self):
        """One of the elementwise layers, in place or not."""
        kind, body = self.pick(
            ("ReLU", ""), ("ReLU", "relu_param { negative_slope: 0.1 }"), ("Sigmoid", ""),
            ("TanH", ""), ("ELU", "elu_param { alpha: 0.7 }"), ("AbsVal", ""), ("BNLL", ""),
            ("Swish", "swish_param { beta: 1.5 }"), ("Clip", "clip_param { min: -1 max: 1 }"),
            ("Power", "power_param { power: 2 scale: 0.5 shift: 0.2 }"),
            ("Exp", "exp_param { scale: 0.3 }"), ("Log", "log_param { shift: 1 }"),
            ("Threshold", "threshold_param { threshold: 0.1 }"))
        if kind == "Log":            # log(1 + |x|): its argument stays positive
            self.add("AbsVal", "", top=self.top if self.chance(0.5) else None)
        self.add(kind, body, top=self.top if self.chance(0.5) else None)

    def pooling(self):
        """MAX or AVE, global or with a kernel, stride and pad (smaller than the kernel, as
        Caffe requires), rounding up or down; MAX sometimes with its mask as a second top."""
        channels, height, width = self.shape
        method = self.pick("MAX", "AVE")
        if self.chance(0.15):
            self.add("Pooling", f"pooling_param {{ pool: {method} global_pooling: true }}")
            self.shape = (channels, 1, 1)
            return
        kernel = int(self.rng.integers(2, 4))
        # A stride past the kernel can leave a window outside the image: Caffe's -FLT_MAX.
        stride = int(self.rng.integers(1, kernel + 1))
        pad = int(self.rng.integers(0, kernel)) if self.chance(0.5) else 0
        rounding = self.pick("CEIL", "CEIL", "CEIL", "FLOOR")
        if kernel > min(height, width) + 2 * pad:
            return self.activation()
        size = [pooled_size(x, kernel, pad, stride, rounding == "CEIL") for x in (height, width)]
        tops = [f"pool{len(self.layers)}", f"mask{len(self.layers)}"]
        self.add("Pooling", f"pooling_param {{ pool: {method} kernel_size: {kernel} "
                            f"stride: {stride} pad: {pad} round_mode: {rounding} }}",
                 tops=tops if method == "MAX" and self.chance(0.2) else tops[:1])
        self.shape = (channels, *size)

    def lrn(self):
        if self.chance(0.7):
            size = self.pick(3, 5)
            body = f"local_size: {size} alpha: 0.5 beta: 0.75 k: {self.pick(1, 2)}"
        else:
            body = "local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL"
        self.add("LRN", f"lrn_param {{ {body} }}")

    def dropout(self):
        self.add("Dropout", "dropout_param { dropout_ratio: 0.4 }",
                 top=self.top if self.chance(0.5) else None)

    def inner_product(self, outputs):
        fan_in = int(np.prod(self.shape))
        bias = "bias_term: false" if self.chance(0.3) else \
            'bias_filler { type: "gaussian" std: 0.1 }'
        self.add("InnerProduct", f"inner_product_param {{ num_output: {outputs} {bias} "
                                 f"{self.filler(fan_in)} }}")
        self.shape = (outputs, 1, 1)

    def losses(self):
        """SoftmaxWithLoss (any normalization, an ignore_label sometimes); sometimes a second
        loss on the same scores and Accuracy, whose shared bottoms make the net add Splits."""
        scores = self.top
        loss_param = []
        if self.exact:
            loss_param.append("normalization: NONE")
        else:
            loss_param.append("normalization: " + self.pick("VALID", "BATCH_SIZE", "NONE",
                                                            "FULL"))
        ignore_label = int(self.rng.integers(self.classes)) if self.chance(0.3) else None
        if ignore_label is not None:
            loss_param.append(f"ignore_label: {ignore_label}")
        weight = f"loss_weight: {self.pick(1, 0.5, 2)} "
        self.add("SoftmaxWithLoss", weight + "loss_param { " + " ".join(loss_param) + " }",
                 bottoms=[scores, "label"])
        second = self.pick(None, "SigmoidCrossEntropyLoss", *(
            () if self.exact else ("HingeLoss", "EuclideanLoss", "MultinomialLogisticLoss")))
        if second in ("SigmoidCrossEntropyLoss", "EuclideanLoss"):
            self.inputs["target"] = (self.batch, self.classes)
            body = "loss_param { normalization: NONE }" if self.exact else ""
            self.add(second, body, bottoms=[scores, "target"])
        elif second == "HingeLoss":
            self.add(second, f"hinge_loss_param {{ norm: {self.pick('L1', 'L2')} }}",
                     bottoms=[scores, "label"])
        elif second == "MultinomialLogisticLoss":
            prob = self.add("Sigmoid", "", bottoms=[scores])
            self.add(second, "", bottoms=[prob, "label"])
        if self.chance(0.6):
            top_k = int(self.rng.integers(1, self.classes))
            ignore = "" if ignore_label is None else f"ignore_label: {ignore_label}"
            tops = ["accuracy", "per_class"][:int(self.rng.integers(1, 3))]
            self.add("Accuracy", f"accuracy_param {{ top_k: {top_k} {ignore} }}",
                     bottoms=[scores, "label"], tops=tops)


def make(param, lanes, monkeypatch, batch=None):
    """The net of `param` with lanes on or off (read when a net is built), for `batch` samples
    if given."""
    if batch is not None:
        param = pb.NetParameter.FromString(param.SerializeToString())
        for shape in param.layer[0].input_param.shape:
            shape.dim[0] = batch
    monkeypatch.setenv("SYNCSGD_LANES", "1" if lanes else "0")
    return Net(param, TRAIN)


def inputs(rng, maker):
    values = {"data": rng.standard_normal(maker.inputs["data"], np.float32),
              "label": rng.integers(0, maker.classes, maker.batch).astype(np.float32)}
    if "target" in maker.inputs:
        values["target"] = rng.random(maker.inputs["target"], np.float32)
    return values


def run(net, values, iteration):
    """One training pass on `values`, in one of three ways by iteration: forward_backward
    after zeroing the parameter gradients' arrays; forward_backward(clear=True), the solver's
    lazy clear (the first kernel to write a gradient writes over it); forward, then backward.
    Returns {what: a copy} of every blob's data and diff and every parameter gradient, and the
    loss."""
    for name, value in values.items():
        net.blobs[name].data[...] = value
    net.ctx.iteration = iteration          # a new dropout mask at each pass
    way = iteration % 3
    if way != 1:
        for blobs in net.params.values():
            for blob in blobs:
                blob.diff[...] = 0
    if way == 2:
        net.forward()
        net.backward()
    else:
        net.forward_backward(clear=way == 1)
    arrays = {}
    for name, blob in net.blobs.items():
        arrays["data", name] = blob.data.copy()
        arrays["diff", name] = blob.diff.copy()
    for name, blobs in net.params.items():
        for k, blob in enumerate(blobs):
            arrays["gradient", name, k] = blob.diff.copy()
    return arrays, float(net.loss)


def assert_close(expected, got, what):
    """Within float rounding: rtol, and an atol of rtol times the array's largest value (sums
    of terms of both signs lose digits relative to the terms, not to the sum). A parameter
    gradient sums over the batch and, for a convolution, every position (a bias's over up to a
    thousand terms): RTOL_GRADIENT for those."""
    for key, x in expected[0].items():
        y = got[0][key]
        rtol = RTOL_GRADIENT if key[0] == "gradient" else RTOL
        atol = rtol * np.abs(x).max(initial=0)
        if not np.all(np.abs(y - x) <= atol + rtol * np.abs(x)):       # fast where they are
            np.testing.assert_allclose(y, x, rtol=rtol, atol=atol, err_msg=f"{what}: {key}")
    assert got[1] == pytest.approx(expected[1], rel=RTOL, abs=RTOL), f"{what}: loss"


def assert_same_bits(expected, got, what):
    """Every array of `expected` in `got`, to the bit."""
    for name, x in expected[0].items():
        assert np.array_equal(x, got[0][name], equal_nan=True), f"{what}: {name} differs"


def by_lane(nets, maker, values, iteration, whole):
    """What two lanes compute for an exact net (NetMaker): each lane's rows run as a net of
    their own (`nets`, on one thread, as a lane runs its kernels), the blobs laid side by side,
    the parameter gradients added in lane order as the lanes add them, and the losses summed.
    `whole`: the blobs of whole-batch values (losses, accuracy), left out."""
    parts = []
    for t, net in enumerate(nets):
        begin, rows = shard_range(maker.batch, t, len(nets))
        parts.append(run(net, {name: value[begin:begin + rows] for name, value in values.items()},
                         iteration))
    arrays = {}
    for key, first in parts[0][0].items():
        if key[0] == "gradient":
            arrays[key] = first.copy()
            for part in parts[1:]:
                np.add(arrays[key], part[0][key], out=arrays[key])
        elif key[1] not in whole:
            arrays[key] = np.concatenate([part[0][key] for part in parts])
    return arrays, sum(part[1] for part in parts)


@pytest.mark.parametrize("index", range(NETS))
def test_random_nets_compute_the_same_with_lanes_and_without(index, monkeypatch, thread_budget):
    """Lanes on against lanes off, pass by pass on fresh inputs; each lanes pass rerun to the
    bit; and for exact nets, each lane's rows as a net of their own, to the bit."""
    maker = NetMaker(seed=index, exact=index % 3 == 0)
    param = maker.build()
    thread_budget(2)
    plain, laned = make(param, False, monkeypatch), make(param, True, monkeypatch)
    types = [layer.type for layer in laned.layers]
    end = types.index("Dropout") - 1 if "Dropout" in types else len(types) - 1
    assert laned.lanes.run == (1, end), text_format.MessageToString(param)
    if maker.exact:
        thread_budget(1)
        lane_nets = [make(param, False, monkeypatch, shard_range(maker.batch, t, 2)[1])
                     for t in range(2)]
        whole = {blob.name for layer, tops in zip(laned.layers, laned.top_vecs)
                 if layer.batch_sums for blob in tops}
    rng = np.random.default_rng(1000 + index)
    for iteration in range(PASSES):
        values = inputs(rng, maker)
        what = f"net {index} pass {iteration}"
        thread_budget(2)
        expected = run(plain, values, iteration)
        got = run(laned, values, iteration)
        engaged = laned.lanes.engaged
        assert (engaged is not None and engaged.count == 2) == (maker.batch >= 2), what
        assert_close(expected, got, what)
        assert_same_bits(got, run(laned, values, iteration), what + " rerun")
        if maker.exact:
            thread_budget(1)
            split = by_lane(lane_nets, maker, values, iteration, whole)
            assert_same_bits(split, got, what + " by lane")
            assert got[1] == pytest.approx(split[1], rel=1e-6), what + " by lane: loss"


SMALL_NET = """
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "%s" batch_size: 8 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 6 group: 3 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_a_small_conv_net_learns(tmp_path, thread_budget):
    """A short training run, in lanes unless SYNCSGD_LANES=0 (the CPU matrix runs it both ways
    under each instruction set): one-channel images whose class is the quadrant a bright patch
    is in, through a few-channel and a grouped convolution; the loss stays finite and falls."""
    thread_budget(2)
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 4, 64)
    images = rng.normal(0, 0.3, (64, 1, 8, 8)).astype(np.float32)
    for image, label in zip(images, labels):
        row, col = divmod(int(label), 2)
        image[0, 4 * row:4 * row + 4, 4 * col:4 * col + 4] += 1
    with h5py.File(tmp_path / "train.h5", "w") as f:
        f["data"], f["label"] = images, labels.astype(np.float32)
    (tmp_path / "train.txt").write_text(f"{tmp_path / 'train.h5'}\n")
    param = text_format.Parse("base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' random_seed: 3",
                              pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(SMALL_NET % (tmp_path / "train.txt"),
                                               pb.NetParameter()))
    param.snapshot_prefix = str(tmp_path / "small")
    solver = syncsgd.get_solver(param)
    losses = []
    solver.add_callback(lambda: None, lambda: losses.append(solver.net.loss))
    try:
        solver.step(20)
    finally:
        solver.close()
    assert (solver.net.lanes.engaged is not None) == switches.lanes()
    assert np.isfinite(losses).all() and len(losses) == 20
    assert np.mean(losses[-4:]) < 0.2 * np.mean(losses[:4]), losses
