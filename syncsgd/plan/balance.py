"""The balance equations (docs/method.md "Balance equations"), a cost model of collectives, and
the plan: for every layer the fastest of data, model and hybrid parallelism, and the predicted
iteration time, speedup and efficiency on N nodes.

Two levels, kept apart on purpose:
- The paper's equations (data_parallel_ratio, min_node_batch, model_parallel_ratio,
  hybrid_volume, g_star) state each layer's balance as the paper does: a layer is compute-bound
  when its FLOPs per communicated byte exceed F / BW.
- The time model (layer_step, iteration_time) prices one iteration on one node. Compute is a
  roofline, max(FLOPs / F, bytes touched / memory bandwidth). Model-parallel activation exchanges
  sit on the critical path; weight-gradient reductions run on the network while backpropagation
  continues, and each layer's next forward waits for its own ("Overlapping communication").
  Collectives follow the ring or recursive-halving algorithms: latency per step plus bytes over
  bandwidth, with the cluster's send/receive overlap ov. An iteration ends when the slowest node
  ends, so compute is stretched by the expected maximum of N nodes' run-to-run variation
  (node.jitter).
"""
import functools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from syncsgd.layers import layer_class
from syncsgd.plan.costs import DTYPE_BYTES

DATA, MODEL, HYBRID = "data", "model", "hybrid"
STRATEGIES = (DATA, MODEL, HYBRID)
SPLIT_TYPES = ("InnerProduct",)
# Momentum SGD per weight: about 4 FLOPs; reads weight, gradient, history, writes two of them.
UPDATE_FLOPS, UPDATE_BYTES = 4, 5 * DTYPE_BYTES


# -- the paper's balance equations --------------------------------------------------------------

def data_parallel_ratio(cost, node_batch, s=DTYPE_BYTES, ov=0.0):
    """FLOPs per byte of a data-parallel layer: 3 * 2 * MBn * MACs per sample over
    s * weights * (2 - ov) bytes, which is 6 * outw * outh * MBn / (s * (2 - ov))."""
    if not cost.gemm_weights:
        return None
    return cost.flops(node_batch) / (s * cost.gemm_weights * (2.0 - ov))


def min_node_batch(cost, node_flops, bandwidth, s=DTYPE_BYTES, ov=0.0):
    """Smallest per-node minibatch keeping a data-parallel layer compute-bound:
    MBn >= (F / BW) * s * (2 - ov) / (6 * outw * outh)."""
    if not cost.gemm_weights:
        return None
    return node_flops / bandwidth * s * (2.0 - ov) * cost.gemm_weights / cost.flops_per_sample


def model_parallel_ratio(cost, nodes, s=DTYPE_BYTES, ov=0.0):
    """FLOPs per byte of a model-parallel layer (outputs split N ways): 6 * ifm * (ofm / N) *
    kw * kh * outw * outh * MB over s * ifm * inw * inh * MB * (2 - ov); MB cancels."""
    if not cost.gemm_weights or not cost.input_elems:
        return None
    return cost.flops_per_sample / nodes / (s * cost.input_elems * (2.0 - ov))


def hybrid_volume(cost, groups, nodes, batch, s=DTYPE_BYTES):
    """Bytes one node moves for a hybrid layer of G groups: 2 s (W G / N + (ifm + ofm) MB / G)."""
    return 2.0 * s * (cost.gemm_weights * groups / nodes +
                      (cost.input_elems + cost.output_elems) * batch / groups)


def g_star(ifm, ofm, nodes, batch):
    """The G minimising hybrid_volume: sqrt(N * MB * (ifm + ofm) / (ifm * ofm))."""
    return math.sqrt(nodes * batch * (ifm + ofm) / (ifm * ofm))


# -- collectives ----------------------------------------------------------------------------

def _transfer(out_bytes, in_bytes, cluster):
    """Seconds to send and receive: the fraction ov of the smaller direction overlaps."""
    both = out_bytes + in_bytes - cluster.overlap * min(out_bytes, in_bytes)
    return both / cluster.bandwidth


def _latency(cluster, ranks, rounds):
    """Latency of `rounds` passes over `ranks` nodes: P - 1 ring steps or log2 P halving steps
    each, whichever the cluster's algorithm (or, with "auto", the cheaper)."""
    steps = {"ring": ranks - 1, "recursive_halving": math.ceil(math.log2(ranks))}
    allowed = steps if cluster.allreduce == "auto" else {cluster.allreduce: 0}
    return rounds * min(steps[a] for a in allowed) * cluster.latency


def allreduce_time(nbytes, ranks, cluster):
    """Sum `nbytes` over `ranks` nodes: reduce-scatter then all-gather, each node sending and
    receiving 2 (P - 1) / P * n bytes (both algorithms are bandwidth-optimal)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    moved = 2.0 * (ranks - 1) / ranks * nbytes
    return _latency(cluster, ranks, 2) + _transfer(moved, moved, cluster)


def allgather_time(nbytes, ranks, cluster):
    """Gather `nbytes` in all, 1/P from each node: (P - 1) / P * n bytes each way per node.
    A reduce-scatter of `nbytes` costs the same."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    moved = (ranks - 1) / ranks * nbytes
    return _latency(cluster, ranks, 1) + _transfer(moved, moved, cluster)


reduce_scatter_time = allgather_time


def alltoall_time(nbytes, ranks, cluster):
    """Redistribute `nbytes` held 1/P per node (split features to split samples)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    moved = (ranks - 1) / ranks * nbytes / ranks
    return (ranks - 1) * cluster.latency + _transfer(moved, moved, cluster)


@functools.lru_cache(maxsize=None)
def expected_max_normal(n):
    """E[max of n independent standard normal values] (0 for n = 1), by quadrature."""
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 3601)
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return float(np.trapezoid(x * n * pdf * cdf ** (n - 1), x))


def straggler_factor(cluster, nodes):
    """How much longer the slowest of N nodes computes than a typical one: 1 + jitter *
    E[max of N standard normals]. A synchronous iteration waits for the slowest node."""
    return 1.0 + cluster.jitter * expected_max_normal(nodes)


# -- one layer on one node ------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """How a layer is spread: G data-parallel replicas (`groups`), each splitting the layer's
    outputs over N / G nodes. data: G = N; model: G = 1; hybrid: 1 < G < N."""
    strategy: str
    groups: int


@dataclass
class Step:
    """One layer's share of an iteration on one node, in seconds."""
    forward: float = 0.0
    backward: float = 0.0
    update: float = 0.0          # weight update on the compute cores
    forward_comm: float = 0.0    # blocking: inputs gathered / redistributed before forward
    backward_comm: float = 0.0   # blocking: input gradients reduce-scattered after backward
    gradient_comm: float = 0.0   # overlapped: weight-gradient reduction (and a sharded update)
    flops: float = 0.0           # forward + backward FLOPs on this node
    comm_bytes: float = 0.0      # bytes this node sends for the layer

    @property
    def compute(self):
        return self.forward + self.backward + self.update

    @property
    def comm(self):
        return self.forward_comm + self.backward_comm + self.gradient_comm


def _roofline(flops, nbytes, rate, bandwidth):
    return max(flops / rate, nbytes / bandwidth if bandwidth else 0.0)


def layer_step(cost, placement, nodes, batch, cluster, split_inputs=(), needs_input_grad=True):
    """The Step of `cost` placed as `placement` on `nodes` nodes for global minibatch `batch`.

    `split_inputs` gives, per bottom, the group width P its producer left it split over by
    features (1: split by samples). Returns (Step, the width the outputs are split over).
    """
    s = DTYPE_BYTES
    groups = placement.groups if cost.is_gemm else nodes
    width = nodes // groups                          # P: nodes sharing one replica's outputs
    samples = math.ceil(batch / groups)              # samples one replica handles
    share = 1.0
    if width > 1:
        ofm = cost.geometry["ofm"]
        share = math.ceil(ofm / width) / ofm         # this node's part of the outputs
    rate = cluster.compute_rate(cost.type, nodes, cost.shape_key())
    memory = cluster.node_memory_bandwidth(nodes)
    stretch = straggler_factor(cluster, nodes)
    weights = cost.weights * share
    if cost.is_gemm:
        work = samples * share
        inputs, outputs = samples * cost.input_elems, samples * cost.output_elems * share
    else:                                            # elementwise work follows its data
        work = batch / nodes
        inputs, outputs = work * cost.input_elems, work * cost.output_elems
    step = Step(flops=work * cost.flops_per_sample)
    step.forward = stretch * _roofline(work * cost.forward, s * (weights + inputs + outputs),
                                       rate, memory)
    step.backward = stretch * _roofline(work * (cost.backward_data + cost.weight_grad),
                                        s * (3 * weights + 2 * (inputs + outputs)), rate, memory)

    # Activations: a model-parallel layer gathers its whole input inside its group; a layer that
    # needs whole samples redistributes inputs its producer left split by features.
    out_width = 1
    if width > 1:
        volume = s * samples * cost.input_elems
        step.forward_comm = allgather_time(volume, width, cluster)
        if needs_input_grad:
            step.backward_comm = reduce_scatter_time(volume, width, cluster)
        step.comm_bytes += volume * (width - 1) / width * (2 if needs_input_grad else 1)
        out_width = width
    elif any(p > 1 for p in split_inputs):
        if layer_class(cost.type).feature_local:     # runs on the split output as it is
            out_width = max(split_inputs)
        else:
            for p, elems in zip(split_inputs, cost.bottom_elems):
                volume = s * elems * batch * p / nodes       # the group's samples
                step.forward_comm += alltoall_time(volume, p, cluster)
                if needs_input_grad:
                    step.backward_comm += alltoall_time(volume, p, cluster)
                step.comm_bytes += volume * (p - 1) / p / p * (2 if needs_input_grad else 1)

    # Weights: replicas sum their gradients; the update runs where the weights live.
    update_rate = cluster.compute_rate("update", nodes)
    if weights:
        full = stretch * _roofline(UPDATE_FLOPS * weights, UPDATE_BYTES * weights, update_rate,
                                   memory)
        if groups > 1:
            step.gradient_comm = allreduce_time(s * weights, groups, cluster)
            step.comm_bytes += s * weights * 2 * (groups - 1) / groups
        if groups > 1 and cluster.update == "sharded":
            step.gradient_comm += full / groups      # each replica updates 1/G, then gathers
        else:
            step.update = full
    return step, out_width


# -- one iteration --------------------------------------------------------------------------

class _Timeline:
    """One node's compute cores and its network link. The link serves blocking activation
    exchanges at once and weight-gradient reductions first in, first out in the remaining time
    (reductions travel in small buckets, so an exchange never waits for a whole one)."""

    def __init__(self):
        self.now = 0.0
        self.queue = deque()                  # [layer, seconds left] of pending reductions

    def compute(self, seconds):
        end = self.now + seconds
        t = self.now
        while self.queue and t < end:
            item = self.queue[0]
            used = min(item[1], end - t)
            t += used
            item[1] -= used
            if item[1] <= 1e-15:
                self.queue.popleft()
        self.now = end

    def blocking(self, seconds):
        self.now += seconds                   # the link is busy: reductions make no progress

    def post(self, layer, seconds):
        if seconds > 0:
            self.queue.append([layer, seconds])

    def wait(self, layer):
        """Idle until `layer`'s reduction (and everything queued before it) is through."""
        ahead = 0.0
        for item in self.queue:
            ahead += item[1]
            if item[0] == layer:
                self.compute(ahead)
                return


def iteration_time(steps, overlap=True, iterations=3):
    """Seconds per iteration in steady state for per-layer Steps in net order.

    Forward: each layer waits for its weights (its last reduction and update), gathers its
    inputs, computes. Backward, last layer first: compute, reduce-scatter input gradients, post
    the weight-gradient reduction, which proceeds while earlier layers back-propagate. Without
    `overlap` the reductions start when backward is over and the next forward waits for all.
    """
    timeline = _Timeline()
    elapsed = 0.0
    for _ in range(iterations):
        start = timeline.now
        for i, step in enumerate(steps):
            timeline.wait(i)
            timeline.compute(step.update)
            timeline.blocking(step.forward_comm)
            timeline.compute(step.forward)
        for i in reversed(range(len(steps))):
            timeline.compute(steps[i].backward)
            timeline.blocking(steps[i].backward_comm)
            if overlap:
                timeline.post(i, steps[i].gradient_comm)
        if not overlap:
            for i in reversed(range(len(steps))):
                timeline.post(i, steps[i].gradient_comm)
            timeline.compute(sum(item[1] for item in timeline.queue))   # idle until done
        elapsed = timeline.now - start
    return elapsed


# -- the plan -------------------------------------------------------------------------------

def splittable(cost):
    """Whether syncsgd can split the layer over a group: InnerProduct over axis 1 (see
    syncsgd/compile.py check_modes); convolutions stay data-parallel, as in the paper."""
    return cost.is_gemm and cost.type in SPLIT_TYPES and cost.geometry.get("axis", 1) == 1


def split_placement(cost, nodes, groups):
    """The MODEL / HYBRID placement with `groups` groups, or None where it cannot be used: the
    layer is not splittable, or a group would be wider than the layer has outputs."""
    if not splittable(cost) or nodes <= 1 or groups >= nodes or nodes % groups:
        return None
    if nodes // groups > cost.geometry["ofm"]:
        return None
    return Placement(MODEL if groups == 1 else HYBRID, groups)


def divisors(n):
    return [g for g in range(1, n + 1) if n % g == 0]


@dataclass
class PointPlan:
    """The plan for one node count."""
    nodes: int
    placements: list
    steps: list
    iteration_s: float
    speedup: float = 1.0
    efficiency: float = 1.0
    per_strategy: dict = field(default_factory=dict)   # uniform strategy -> iteration seconds


class Planner:
    """Plans one net (a list of LayerCost) for one global minibatch on one cluster."""

    def __init__(self, costs, batch, cluster, overlap=True):
        self.costs, self.batch, self.cluster, self.overlap = costs, batch, cluster, overlap
        self._inputs = {name for c in costs if c.type == "Input" for name in c.tops}
        self._memo = {}

    def steps(self, placements, nodes):
        """Per-layer Steps for placements (one per layer; None is data-parallel)."""
        split = {}                           # blob name -> width its producer split it over
        steps = []
        for i, (cost, placement) in enumerate(zip(self.costs, placements)):
            placement = placement if cost.is_gemm and placement else Placement(DATA, nodes)
            widths = tuple(split.get(b, 1) for b in cost.bottoms)
            key = (i, placement, widths, nodes)
            if key not in self._memo:
                needs_grad = any(b not in self._inputs for b in cost.bottoms)
                self._memo[key] = layer_step(cost, placement, nodes, self.batch, self.cluster,
                                             widths, needs_grad)
            step, out_width = self._memo[key]
            for top in cost.tops:
                split[top] = out_width
            steps.append(step)
        return steps

    def time(self, placements, nodes):
        return iteration_time(self.steps(placements, nodes), self.overlap)

    def _split_all(self, nodes, groups):
        """Every splittable layer at `groups` groups, the rest data-parallel."""
        return [split_placement(c, nodes, groups) or Placement(DATA, nodes) for c in self.costs]

    def uniform(self, strategy, nodes):
        """One strategy throughout, as far as layers allow: data everywhere; model: every
        fully connected layer split over all N; hybrid: every one at the single best G (None
        when N has no divisor strictly between 1 and N)."""
        if strategy == DATA or nodes == 1:
            return self._split_all(nodes, nodes)
        if strategy == MODEL:
            return self._split_all(nodes, 1)
        trials = [self._split_all(nodes, g) for g in divisors(nodes)[1:-1]]
        return min(trials, key=lambda p: self.time(p, nodes), default=None)

    def choose(self, nodes, groups=None, fixed=None):
        """Per-layer placements minimising the iteration time, within what syncsgd runs: split
        layers share one G (`groups` if given, as when a prototxt splits some layers itself).
        `fixed` {layer index: split?} pins the layers the prototxt places itself, so that the
        others are chosen beside the placements they will really have. For each G, start with
        every free splittable layer split and return layers to data parallelism one at a time
        while that helps; keep the best G."""
        fixed = fixed or {}

        def pinned(placements, g):
            for i, split in fixed.items():
                option = split_placement(self.costs[i], nodes, g) if split else None
                placements[i] = option or Placement(DATA, nodes)
            return placements
        best = None
        if not any(fixed.values()):          # every layer data-parallel is allowed
            data = self._split_all(nodes, nodes)
            best = (self.time(data, nodes), data)
        for g in [groups] if groups else divisors(nodes)[:-1]:
            placements = pinned(self._split_all(nodes, g), g)
            seconds = self.time(placements, nodes)
            improved = True
            while improved:
                improved = False
                for i, cost in enumerate(self.costs):
                    option = split_placement(cost, nodes, g)
                    if option is None or i in fixed:
                        continue
                    other = Placement(DATA, nodes) if placements[i] == option else option
                    trial = placements[:i] + [other] + placements[i + 1:]
                    t = self.time(trial, nodes)
                    if t < seconds * (1 - 1e-9):
                        seconds, placements, improved = t, trial, True
            if best is None or seconds < best[0] * (1 - 1e-9):
                best = (seconds, placements)
        return best[1], best[0]

    def plan(self, node_counts):
        """(one-node seconds, [PointPlan per node count])."""
        single = self.time([None] * len(self.costs), 1)
        points = []
        for nodes in node_counts:
            placements, seconds = self.choose(nodes)
            point = PointPlan(nodes, placements, self.steps(placements, nodes), seconds,
                              single / seconds, single / seconds / nodes)
            for strategy in STRATEGIES:
                uniform = self.uniform(strategy, nodes)
                point.per_strategy[strategy] = uniform and self.time(uniform, nodes)
            points.append(point)
        return single, points
