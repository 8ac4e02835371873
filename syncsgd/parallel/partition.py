"""Model and hybrid parallelism for fully connected layers: rewrite a compiled net so that each
InnerProduct layer marked MODEL or HYBRID becomes a ModelParallelInnerProduct whose inputs are
gathered in its group and whose outputs are handed on in the layout the next layer needs
(docs/method.md "Model and hybrid parallelism").

Layouts are tracked per blob: "data" (this rank's samples, all features) or "model" (the group's
samples, this rank's feature slice). Layers whose class declares `feature_local` (elementwise ones
such as ReLU and Dropout, and Split) keep a model layout; every other layer gets data-layout
bottoms.

Which layers are split: those the prototxt marks MODEL or HYBRID, and those the planner
(syncsgd/plan/modes.py) splits among the layers marked AUTO and the InnerProduct layers whose
prototxt sets no mode. An explicit DATA stays DATA.
"""
from syncsgd import log
from syncsgd.compile import SPLIT_MODES, check_modes
from syncsgd.errors import PrototxtError, SyncSGDError
from syncsgd.layers import layer_class
from syncsgd.parallel.layers import MODEL_PARALLEL_INNER_PRODUCT
from syncsgd.proto import pb

_PP = pb.ParallelParameter


def planned(layer):
    """Whether the planner sets the layer's mode: parallel_param AUTO, or an InnerProduct layer
    whose prototxt sets no mode (proto2 presence tells that from an explicit DATA)."""
    pp = layer.parallel_param
    explicit = layer.HasField("parallel_param") and pp.HasField("mode")
    return pp.mode == _PP.AUTO or (layer.type == "InnerProduct" and not explicit)


class Partitioner:
    """Net transforms for one solver's nets on the ranks of `comm` (a Communicator). The planner
    decides once, for the train net, on rank 0 for every rank (`from_root(compute)` returns rank
    0's compute() on every rank), so that hosts with different cluster files still agree and the
    test nets hold the same weight slices; all nets share one group communicator."""

    def __init__(self, comm, from_root):
        self.comm = comm
        self.from_root = from_root
        self._groups = {}
        self._plan = None           # (modes by layer name, why), once the planner has decided
        self._described = False

    def transform(self, ctx):
        """A Net transform that partitions the net and gives `ctx` the group it talks to."""
        def partition(param):
            out, groups = partition_net(param, self.comm.size, self._planned_choice(param))
            if not self._described:
                self._describe(param, out)
            if groups is not None:
                if groups not in self._groups:
                    from syncsgd.parallel.groups import GroupComm
                    self._groups[groups] = GroupComm(self.comm.world, groups)
                ctx.groups = self._groups[groups]
            return out
        return partition

    def _planned_choice(self, param):
        """choose(layer) -> (mode, groups) for the planned() layers, or None if there are none."""
        if not any(planned(layer) for layer in param.layer):
            return None
        if self._plan is None:
            self._plan = self.from_root(lambda: _plan(param, self.comm.size))
        modes, shared = self._plan[0], _sharing_weights(param)
        return lambda layer: (_PP.DATA, 1) if layer.name in shared and \
            layer.parallel_param.mode != _PP.AUTO else modes.get(layer.name, (_PP.DATA, 1))

    def _describe(self, param, out):
        """Log each InnerProduct layer's mode of the first (train) net, and why it has it."""
        self._described = True
        shared = _sharing_weights(param)
        why = {layer.name: "prototxt" if not planned(layer) else
               "it shares weights by name with another layer" if layer.name in shared and
               layer.parallel_param.mode != _PP.AUTO else self._plan[1]
               for layer in param.layer if layer.type == "InnerProduct"}
        for layer in out.layer:
            if layer.name in why:
                pp = layer.parallel_param
                groups = f" groups {pp.groups}" if pp.mode == _PP.HYBRID else ""
                log.info(f"{layer.name}: {_PP.Mode.Name(pp.mode)}{groups} ({why[layer.name]})")


def _sharing_weights(param):
    """Names of the layers with a parameter shared by name with another layer: a layer without a
    mode keeps them whole (DATA), since the planner may split the layers sharing them apart."""
    owners = {}
    for layer in param.layer:
        for spec in layer.param:
            if spec.name:
                owners.setdefault(spec.name, set()).add(layer.name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


def _plan(param, size):
    """(planner's modes by layer name, why) on `size` ranks, at the G of the layers the prototxt
    splits itself if any. AUTO needs the planner; layers that only leave the mode unset run DATA
    when it cannot price the net (a warning says why)."""
    from syncsgd.plan.modes import choose_modes, training_cluster
    cluster, origin = training_cluster()
    split = [layer.parallel_param for layer in param.layer
             if layer.parallel_param.mode in SPLIT_MODES]
    groups = next((pp.groups if pp.mode == _PP.HYBRID else 1 for pp in split), None)
    shared = _sharing_weights(param)
    fixed = {layer.name: layer.parallel_param.mode in SPLIT_MODES for layer in param.layer
             if layer.type == "InnerProduct" and (not planned(layer) or (
                 layer.name in shared and layer.parallel_param.mode != _PP.AUTO))}
    try:
        return (choose_modes(param, size, cluster=cluster, groups=groups, fixed=fixed),
                f"planner, cluster {origin}")
    except SyncSGDError as e:
        if any(layer.parallel_param.mode == _PP.AUTO for layer in param.layer):
            raise
        log.LOGGER.warning(f"The planner cannot price this net, so its fully connected layers "
                           f"run DATA: {e}. Set parallel_param {{ mode: DATA }} (or MODEL, "
                           f"HYBRID) on them to choose yourself")
        return {}, "default, the planner could not price the net"


def groups_of(param, size, choose=None, source="<net>"):
    """The number of groups G the split layers use on `size` ranks (None if nothing is split).
    planned() layers take `choose(layer)` -> (mode, groups), or DATA without a planner."""
    found = {}
    for layer in param.layer:
        pp = layer.parallel_param
        if planned(layer):
            mode, groups = choose(layer) if choose is not None else (_PP.DATA, 1)
            pp.mode, pp.groups = mode, groups
        if pp.mode == _PP.MODEL:
            found[layer.name] = 1
        elif pp.mode == _PP.HYBRID:
            found[layer.name] = pp.groups
    if not found:
        return None
    values = set(found.values())
    if len(values) > 1:
        raise PrototxtError(f"{source}: model-parallel layers must use the same number of "
                            f"groups, got {found}")
    groups = values.pop()
    if size % groups:
        raise PrototxtError(f"{source}: HYBRID groups: {groups} does not divide the {size} "
                            f"ranks; use a divisor of {size}")
    return groups


def partition_net(param, size, choose=None, source="<net>"):
    """(rewritten NetParameter, G) for `size` ranks; G is None when nothing is split."""
    check_modes(param, source)
    out = pb.NetParameter()
    out.CopyFrom(param)
    groups = groups_of(out, size, choose, source)
    if groups is None or size // groups == 1:
        for layer in out.layer:           # one rank per group: plain data parallelism
            layer.parallel_param.mode = _PP.DATA
        return out, None
    layers = list(out.layer)
    del out.layer[:]
    model_blobs = set()
    for layer in layers:
        split = layer.parallel_param.mode in SPLIT_MODES
        for j, name in enumerate(layer.bottom):
            if split:
                kind = "FeatureGather" if name in model_blobs else "GroupGather"
            elif name in model_blobs and not layer_class(layer.type).feature_local:
                kind = "ModelToData"
            else:
                continue
            new = f"{name}_{layer.name}_{kind.lower()}"
            out.layer.add(name=new, type=kind, bottom=[name], top=[new], phase=layer.phase)
            layer.bottom[j] = new
        if split:
            model_blobs.update(layer.top)
            layer.type = MODEL_PARALLEL_INNER_PRODUCT
        elif layer_class(layer.type).feature_local and any(b in model_blobs for b in layer.bottom):
            model_blobs.update(layer.top)
        else:
            model_blobs.difference_update(layer.top)
        out.layer.add().CopyFrom(layer)
    return out, groups
