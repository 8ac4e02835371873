"""Model and hybrid parallelism for fully connected layers: rewrite a compiled net so that each
InnerProduct layer marked MODEL or HYBRID gets its inputs gathered in its group and its outputs
handed on in the layout the next layer needs (PAPER.md section 2).

Layouts are tracked per blob: "data" (this rank's samples, all features) or "model" (the group's
samples, this rank's feature slice). Elementwise layers keep a model layout (ReLU, Dropout, ...
work on any slice); every other layer gets data-layout bottoms.
"""
from syncsgd.compile import SPLIT_MODES, check_modes
from syncsgd.errors import PrototxtError
from syncsgd.proto import pb

_PP = pb.ParallelParameter
FEATURE_LOCAL = {"ReLU", "Dropout", "Sigmoid", "TanH", "AbsVal", "Power", "ELU", "Split"}


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
            elif name in model_blobs and layer.type not in FEATURE_LOCAL:
                kind = "ModelToData"
            else:
                continue
            new = f"{name}_{layer.name}_{kind.lower()}"
            out.layer.add(name=new, type=kind, bottom=[name], top=[new], phase=layer.phase)
            layer.bottom[j] = new
        if split:
            model_blobs.update(layer.top)
        elif layer.type in FEATURE_LOCAL and any(b in model_blobs for b in layer.bottom):
            model_blobs.update(layer.top)
        else:
            model_blobs.difference_update(layer.top)
        out.layer.add().CopyFrom(layer)
    return out, groups
