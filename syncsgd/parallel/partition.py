"""Model and hybrid parallelism for fully connected layers: rewrite a compiled net so that each
InnerProduct layer marked MODEL or HYBRID becomes a ModelParallelInnerProduct whose inputs are
gathered in its group and whose outputs are handed on in the layout the next layer needs
(docs/method.md "Model and hybrid parallelism").

Layouts are tracked per blob: "data" (this rank's samples, all features) or "model" (the group's
samples, this rank's feature slice). Layers whose class declares `feature_local` (elementwise ones
such as ReLU and Dropout, and Split) keep a model layout; every other layer gets data-layout
bottoms.
"""
from syncsgd.compile import SPLIT_MODES, check_modes
from syncsgd.errors import PrototxtError
from syncsgd.layers import layer_class
from syncsgd.parallel.layers import MODEL_PARALLEL_INNER_PRODUCT
from syncsgd.proto import pb

_PP = pb.ParallelParameter


class Partitioner:
    """Net transforms for one solver's nets on the ranks of `comm` (a Communicator). The train
    and test nets get the same split (AUTO is decided once, for the train net) and share one
    group communicator."""

    def __init__(self, comm):
        self.comm = comm
        self._groups = {}
        self._auto_modes = None

    def transform(self, ctx):
        """A Net transform that partitions the net and gives `ctx` the group it talks to."""
        def partition(param):
            param, groups = partition_net(param, self.comm.size, self._auto_choice(param))
            if groups is not None:
                if groups not in self._groups:
                    from syncsgd.parallel.groups import GroupComm
                    self._groups[groups] = GroupComm(self.comm.world, groups)
                ctx.groups = self._groups[groups]
            return param
        return partition

    def _auto_choice(self, param):
        """For parallel_param AUTO: the planner's choice for the first (train) net, reused by the
        test nets so that both hold the same weight slices."""
        if not any(layer.parallel_param.mode == _PP.AUTO for layer in param.layer):
            return None
        if self._auto_modes is None:
            from syncsgd.plan.modes import choose_modes
            self._auto_modes = choose_modes(param, self.comm.size)
        data = (_PP.DATA, 1)
        return lambda layer: self._auto_modes.get(layer.name, data)


def groups_of(param, size, choose=None, source="<net>"):
    """The number of groups G the split layers use on `size` ranks (None if nothing is split).
    AUTO layers take `choose(layer)` -> (mode, groups), or DATA without a planner."""
    found = {}
    for layer in param.layer:
        pp = layer.parallel_param
        if pp.mode == _PP.AUTO:
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
