"""The two trainers tools/benchmark.py times: a syncsgd solver and its PyTorch twin.

The twin is built from the same compiled prototxt and receives syncsgd's initial weights; both
see the same random minibatch every iteration and train with SGD (momentum, weight decay,
lr_mult / decay_mult) from the model's solver.prototxt, so any difference in speed is the
frameworks' own. FLOPs are the planner's counts (syncsgd.plan.costs) of the work a training
iteration does: every layer's forward, its weight gradient where it has learned weights, and its
input gradient only where the net propagates one (neither framework computes the data layer's
gradient).
"""
import os
import time
from dataclasses import replace
from functools import reduce

import numpy as np

from syncsgd import TEST, TRAIN
from syncsgd.proto import pb

# The benchmarks measure speed, not learning, so the models' learning rates are scaled down; the
# work per iteration does not depend on the rate. At the full rate, random data can drive VGG-A
# to NaN within a few iterations, and scaling.py's constant data drives LeNet's loss to 0 and its
# gradients to denormals from about the 25th step, each step then taking 13x as long
# (docs/performance.md, "Denormals in the scaling runs").
LR_SCALE = 1e-3


def benchmark_param(model, batch, size=None, lr_scale=LR_SCALE):
    """(NetParameter, SolverParameter) for training `model` from random in-memory batches: the
    TRAIN net with its data layers turned into Input layers of `batch` samples (images `size`
    pixels square, or (h, w), when given), and the model's solver without tests, snapshots or
    display, its learning rate times `lr_scale`."""
    from syncsgd.compile import read_text
    from syncsgd.plan.costs import find_model, planning_param
    net_param, _ = planning_param(model, batch=batch, fillers=True)
    if size:
        height, width = (size, size) if isinstance(size, int) else size
        for lp in net_param.layer:
            if lp.type == "Input":
                for shape in lp.input_param.shape:
                    if len(shape.dim) == 4:
                        shape.dim[2], shape.dim[3] = height, width
    solver = pb.SolverParameter()
    path = find_model(model)
    solver_path = os.path.join(os.path.dirname(path), "solver.prototxt") \
        if isinstance(path, str) else None
    if solver_path and os.path.isfile(solver_path):
        read_text(solver_path, solver)
    else:
        solver.base_lr, solver.momentum, solver.weight_decay = 0.01, 0.9, 0.0005
        solver.lr_policy = "fixed"
    for field in ("net", "train_net", "test_net", "test_net_param", "test_iter", "test_state",
                  "snapshot_prefix"):
        solver.ClearField(field)
    solver.net_param.CopyFrom(net_param)
    solver.test_interval = solver.display = solver.snapshot = 0
    solver.test_initialization = False
    solver.snapshot_after_train = False
    solver.random_seed = 1
    solver.base_lr *= lr_scale
    return net_param, solver


def random_inputs(net, seed=0):
    """Values for each Input top: standard normal data, labels in 0..classes-1."""
    rng = np.random.default_rng(seed)
    classes = _classes(net)
    values = {}
    for name in net.inputs:
        shape = net.blobs[name].shape
        if "label" in name:
            values[name] = rng.integers(0, classes, shape).astype(np.float32)
        else:
            values[name] = rng.standard_normal(shape, dtype=np.float32)
    return values


def _classes(net):
    """Output count of the layer feeding the loss: the label range."""
    for layer, bottom in zip(net.layers, net.bottom_vecs):
        if layer.is_loss and len(bottom) > 1:
            return bottom[0].shape[1] if bottom[0].num_axes > 1 else 1
    return 1


def training_flops(net):
    """FLOPs of one training iteration of `net` (forward, weight gradients, needed input
    gradients), from the planner's per-layer counts."""
    from syncsgd.plan.costs import net_costs
    batch = net.blobs[net.inputs[0]].shape[0]
    total = 0.0
    for cost, layer_needs, bottom_needs in zip(net_costs(net, batch), net.layer_need_backward,
                                               net.bottom_need_backward):
        total += cost.forward
        if layer_needs and cost.weights:
            total += cost.weight_grad
        if layer_needs and any(bottom_needs):
            total += cost.backward_data
    return total * batch


class SyncsgdRunner:
    """A syncsgd solver training `model` on fixed random batches."""
    name = "syncsgd"

    def __init__(self, model, batch, size=None, lr_scale=LR_SCALE):
        from syncsgd.solvers import get_solver
        _, solver_param = benchmark_param(model, batch, size, lr_scale)
        self.solver = get_solver(solver_param)
        self.net = self.solver.net
        for name, value in random_inputs(self.net).items():
            self.net.blobs[name].data[...] = value
        self.flops = training_flops(self.net)
        self.input_shape = self.net.blobs[self.net.inputs[0]].shape[1:]
        self.update_seconds = []       # of each step's parameter update, for the report
        self._onednn_gemm = None       # the 1x1 convolution gemm_seconds times (False: none)
        update = self.solver.apply_update

        def timed_update(*args, **kwargs):
            start = time.perf_counter()
            update(*args, **kwargs)
            self.update_seconds.append(time.perf_counter() - start)
        self.solver.apply_update = timed_update

    def step(self):
        self.solver.step(1)
        return float(self.net.loss)

    def weights(self):
        """Every learnable blob's values, in net order."""
        return [info.blob.data for info in self.net.learnable_params]

    def gemm_seconds(self, n):
        """Seconds of one (n, n) @ (n, n) float32 product by each GEMM kernel syncsgd's layers
        can call: "blas" (syncsgd.kernels.blas on numpy's BLAS) and, where it loads, "onednn"
        (oneDNN's matmul, which syncsgd.kernels.blas.gemm runs for large products)."""
        from syncsgd.kernels import blas, onednn
        from syncsgd.kernels.plans import THRESHOLDS
        a = np.ones((n, n), np.float32)
        out = np.empty_like(a)
        with blas.planned_with(replace(THRESHOLDS, onednn_flops=float("inf"))):
            start = time.perf_counter()
            blas.gemm(a, a, out)
            seconds = {"blas": time.perf_counter() - start}
        if self._onednn_gemm is None:
            try:
                self._onednn_gemm = onednn.MatMul(a, a, out, False)
            except onednn.Unavailable:
                self._onednn_gemm = False
        if self._onednn_gemm:
            start = time.perf_counter()
            self._onednn_gemm(a, a, out)
            seconds["onednn"] = time.perf_counter() - start
        return seconds


class TorchTwin:
    """A PyTorch model computing what a syncsgd Net computes, layer by layer, from the Net's
    compiled NetParameter and weights. Supports the layer types of the benchmark's nets. It keeps
    no reference to the Net, whose memory can go once the twin is built.

    BatchNorm's blobs are statistics the forward updates, not weights: they are tensors without
    gradients (zero in gradients(), left alone by the optimizer), in net order among the params
    so that weights travel between the two frameworks blob by blob."""

    def __init__(self, net):
        import torch
        self.torch = torch
        self.phase = net.phase
        self.steps = []          # (LayerParameter, geometry, parameter tensors)
        by_blob = {}
        for layer in net.layers:
            tensors = []
            for blob in layer.blobs:
                if id(blob) not in by_blob:
                    by_blob[id(blob)] = torch.nn.Parameter(
                        torch.from_numpy(blob.data.copy()),
                        requires_grad=layer.type != "BatchNorm")
                tensors.append(by_blob[id(blob)])
            self.steps.append((layer.param, _geometry(layer), tensors))
        self.params = [by_blob[id(info.blob)] for info in net.learnable_params]
        self.loss_weights = [list(w) for w in net.loss_weights]

    def forward(self, inputs):
        """The weighted loss (a 0-d tensor) for the dict of input tensors."""
        blobs = dict(inputs)
        loss = 0.0
        for (lp, layer, tensors), weights in zip(self.steps, self.loss_weights):
            if lp.type == "Input":
                continue
            bottoms = [blobs[name] for name in lp.bottom]
            tops = self._apply(lp, layer, tensors, bottoms)
            for name, value, weight in zip(lp.top, tops, weights):
                blobs[name] = value
                if weight:
                    loss = loss + weight * value.sum()
        return loss

    def _apply(self, lp, layer, tensors, bottoms):
        torch = self.torch
        F = torch.nn.functional
        kind = lp.type
        x = bottoms[0]
        in_place = list(lp.top[:1]) == list(lp.bottom[:1])
        if kind == "Convolution":
            bias = tensors[1] if len(tensors) > 1 else None
            return [F.conv2d(x, tensors[0], bias, layer.stride, layer.pad, layer.dilation,
                             layer.group)]
        if kind == "InnerProduct":
            p = lp.inner_product_param
            axis = p.axis if p.axis >= 0 else x.dim() + p.axis
            flat = x.reshape(x.shape[:axis] + (-1,))
            weight = tensors[0].t() if p.transpose else tensors[0]
            bias = tensors[1] if len(tensors) > 1 else None
            return [F.linear(flat, weight, bias)]
        if kind == "Pooling":
            kernel = tuple(x.shape[2:]) if layer.global_pooling else layer.kernel
            ceil = layer.ceil_mode
            if layer.method == pb.PoolingParameter.MAX:
                return [F.max_pool2d(x, kernel, layer.stride, layer.pad, ceil_mode=ceil)]
            return [F.avg_pool2d(x, kernel, layer.stride, layer.pad, ceil_mode=ceil,
                                 count_include_pad=True)]
        if kind == "ReLU":
            slope = lp.relu_param.negative_slope
            if slope:
                return [F.leaky_relu(x, slope, inplace=in_place)]
            return [F.relu(x, inplace=in_place)]
        if kind == "Sigmoid":
            return [x.sigmoid_() if in_place else x.sigmoid()]
        if kind == "TanH":
            return [x.tanh_() if in_place else x.tanh()]
        if kind == "LRN" and lp.lrn_param.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
            p = lp.lrn_param
            return [F.local_response_norm(x, p.local_size, p.alpha, p.beta, p.k)]
        if kind == "Dropout":
            # Not in place (as torchvision's VGG): the ReLU before it needs its output.
            return [F.dropout(x, lp.dropout_param.dropout_ratio, True)]
        if kind == "Split":
            return [x] * len(lp.top)
        if kind == "Concat":
            p = lp.concat_param
            return [torch.cat(bottoms, p.concat_dim if p.HasField("concat_dim") else p.axis)]
        if kind == "Eltwise":
            return [self._eltwise(lp.eltwise_param, bottoms)]
        if kind == "BatchNorm":
            return [self._batch_norm(lp.batch_norm_param, tensors, x)]
        if kind == "Scale" and len(bottoms) == 1:
            p = lp.scale_param
            scale = tensors[0]
            axis = p.axis % x.dim()
            shape = (1,) * axis + tuple(scale.shape) + (1,) * (x.dim() - axis - scale.dim())
            if p.bias_term:
                return [torch.addcmul(tensors[1].reshape(shape), x, scale.reshape(shape))]
            return [x * scale.reshape(shape)]
        if kind == "Softmax" and lp.softmax_param.axis == 1:
            return [F.softmax(x, 1)]
        if kind == "SoftmaxWithLoss" and len(lp.top) == 1 and lp.softmax_param.axis == 1:
            ignore = lp.loss_param.ignore_label if lp.loss_param.HasField("ignore_label") \
                else -100
            return [F.cross_entropy(x.reshape(x.shape[0], x.shape[1], -1),
                                    bottoms[1].reshape(x.shape[0], -1).long(),
                                    ignore_index=ignore)]
        if kind == "Accuracy" and lp.accuracy_param.axis == 1:
            p = lp.accuracy_param
            with torch.no_grad():
                labels = bottoms[1].reshape((x.shape[0], 1) + x.shape[2:]).long()
                right = (x.topk(p.top_k, 1).indices == labels).any(1)
                if p.HasField("ignore_label"):
                    right = right[labels.squeeze(1) != p.ignore_label]
                return [right.float().mean()]
        raise NotImplementedError(f"layer '{lp.name}': the PyTorch twin has no {kind} "
                                  f"(with these settings)")

    def _eltwise(self, p, bottoms):
        """Caffe's Eltwise: SUM with coefficients, PROD or MAX of equally shaped bottoms."""
        torch = self.torch
        if p.operation == pb.EltwiseParameter.PROD:
            return reduce(torch.mul, bottoms)
        if p.operation == pb.EltwiseParameter.MAX:
            return reduce(torch.maximum, bottoms)
        coeffs = list(p.coeff) or [1.0] * len(bottoms)
        total = bottoms[0] if coeffs[0] == 1 else coeffs[0] * bottoms[0]
        for coeff, bottom in zip(coeffs[1:], bottoms[1:]):
            total = torch.add(total, bottom, alpha=coeff)
        return total

    def _batch_norm(self, p, stats, x):
        """Caffe's BatchNorm (no learned scale). stats are Caffe's blobs: sums of the batch means
        and of the unbiased batch variances, each sum weighted by moving_average_fraction per
        step, and the sum of those weights; the stored averages are sum / weight. TRAIN
        normalises by the batch's own mean and biased variance and adds this batch to the sums;
        use_global_stats (the default in TEST) normalises by the stored averages."""
        torch = self.torch
        F = torch.nn.functional
        mean_sum, var_sum, weight = stats
        global_stats = p.use_global_stats if p.HasField("use_global_stats") \
            else self.phase == TEST
        if global_stats:
            scale = 0.0 if weight.item() == 0 else 1.0 / weight.item()
            return F.batch_norm(x, mean_sum * scale, var_sum * scale, training=False, eps=p.eps)
        # momentum 1: PyTorch leaves exactly this batch's mean and unbiased variance in them.
        mean, var = torch.zeros_like(mean_sum), torch.zeros_like(var_sum)
        y = F.batch_norm(x, mean, var, training=True, momentum=1.0, eps=p.eps)
        with torch.no_grad():
            fraction = p.moving_average_fraction
            weight.mul_(fraction).add_(1.0)
            mean_sum.mul_(fraction).add_(mean)
            var_sum.mul_(fraction).add_(var)
        return y

    def gradients(self, inputs):
        """(loss, parameter gradients in net order, input gradients by name) of one pass over
        the dict of input arrays."""
        torch = self.torch
        for p in self.params:
            p.grad = None
        leaves = {name: torch.from_numpy(value.copy()).requires_grad_("label" not in name)
                  for name, value in inputs.items()}
        loss = self.forward(leaves)
        loss.backward()
        grads = [p.grad.numpy() if p.requires_grad else np.zeros(p.shape, np.float32)
                 for p in self.params]
        return (loss.item(), grads,
                {name: leaf.grad.numpy() for name, leaf in leaves.items()
                 if leaf.grad is not None})


def _geometry(layer):
    """What the twin needs of a syncsgd layer beyond its LayerParameter: the settings it parsed
    (convolution and pooling), as a plain namespace."""
    from types import SimpleNamespace
    names = ("stride", "pad", "dilation", "group", "kernel", "global_pooling", "ceil_mode",
             "method")
    return SimpleNamespace(**{n: getattr(layer, n) for n in names if hasattr(layer, n)})


class TorchRunner:
    """The PyTorch twin of a syncsgd net, trained with the same SGD settings."""
    name = "pytorch"

    def __init__(self, model, batch, size=None, lr_scale=LR_SCALE, weights_path=None):
        import torch
        from syncsgd.net import Net
        net_param, solver = benchmark_param(model, batch, size, lr_scale)
        # Only the graph and shapes are needed: no fillers, the weights come from the file.
        for lp in net_param.layer:
            for sub in ("convolution_param", "inner_product_param"):
                if lp.HasField(sub):
                    getattr(lp, sub).ClearField("weight_filler")
                    getattr(lp, sub).ClearField("bias_filler")
        net = Net(net_param, TRAIN)
        self.twin = TorchTwin(net)
        inputs = random_inputs(net)
        learnable = [(info.lr_mult, info.decay_mult) for info in net.learnable_params]
        del net
        if weights_path:
            with open(weights_path, "rb") as f:
                for p in self.twin.params:
                    f.readinto(memoryview(p.detach().numpy()).cast("B"))
        self.inputs = {name: torch.from_numpy(v) for name, v in inputs.items()}
        groups = [{"params": [p], "lr": solver.base_lr * lr_mult,
                   "weight_decay": solver.weight_decay * decay_mult}
                  for (lr_mult, decay_mult), p in zip(learnable, self.twin.params)]
        self.optimizer = torch.optim.SGD(groups, lr=solver.base_lr, momentum=solver.momentum)
        self.update_seconds = []
        self.forward = self.twin.forward

    def fill_inputs(self, value):
        """Every input (data and labels) constant from now on, as tools/scaling.py's DummyData."""
        for tensor in self.inputs.values():
            tensor.fill_(value)

    def distribute(self):
        """Train as this process's rank of the torch.distributed job it has joined: PyTorch's
        DistributedDataParallel averages the gradients over the ranks (in buckets, overlapped
        with backward) and starts every rank from rank 0's weights."""
        torch = self.twin.torch
        twin = self.twin

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.params = torch.nn.ParameterList(twin.params)

            def forward(self, inputs):
                return twin.forward(inputs)
        self.forward = torch.nn.parallel.DistributedDataParallel(Module())

    def step(self):
        self.optimizer.zero_grad()
        loss = self.forward(self.inputs)
        loss.backward()
        start = time.perf_counter()
        self.optimizer.step()
        self.update_seconds.append(time.perf_counter() - start)
        return loss.item()

    @staticmethod
    def gemm_seconds(n):
        """Seconds of one (n, n) product by PyTorch's own GEMM, for comparison."""
        import torch
        a = torch.ones(n, n)
        out = torch.empty(n, n)
        start = time.perf_counter()
        torch.mm(a, a, out=out)
        return {"pytorch": time.perf_counter() - start}
