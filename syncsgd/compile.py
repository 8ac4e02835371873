"""Prototxt -> the NetParameter a Net is built from: parsed, upgraded, phase-filtered, split.

Each step does what Caffe does to the same file (upgrade_proto.cpp, Net::FilterNet,
insert_splits.cpp), so blob and layer names, and therefore weight files, match Caffe's.
"""
import difflib
import os
import re
from collections import namedtuple

from google.protobuf import text_format

from syncsgd import log
from syncsgd.errors import PrototxtError
from syncsgd.proto import pb
from syncsgd.proto.files import read_file

def read_text(path, message):
    """Parse a prototxt file into `message`; errors name the file, line and column."""
    return _parse(read_file(path, "r"), message, path)


def _parse(text, message, path):
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        raise PrototxtError(_parse_error(text, e, path, message)) from None
    return message


def _parse_error(text, error, path, message):
    """The parse error as `path:line:col: detail`; for a field the schema lacks inside a layer
    of a net, the layer and its type instead, and every layer type of the file syncsgd lacks."""
    line, col = error.GetLine(), error.GetColumn()
    where = f"{path}:{line}:{col}" if line is not None else path
    detail = str(error).split(" : ", 1)[-1]
    unknown = re.search(r'Message type "syncsgd\.(\w+)" has no field named "(\w+)"', detail)
    if not isinstance(message, pb.NetParameter) or unknown is None or line is None:
        return f"{where}: {detail}"
    offset = sum(len(row) + 1 for row in text.split("\n")[:line - 1]) + col - 1
    layers = [e for e in top_level_entries(text) if e.field == "layer"]
    inside = [e for e in layers if e.start <= offset and (e.end is None or offset < e.end)]
    if not inside:
        return f"{where}: {detail}"
    name, type_name = (inside[0].fields.get(k, "?") for k in ("name", "type"))
    owner, field = unknown.groups()
    missing = unsupported_types((e.fields.get("name", "?"), e.fields.get("type", "?"))
                                for e in layers)
    if type_name in missing:
        reason = (f"layer '{name}' sets `{field}`: its type '{type_name}' is not a syncsgd "
                  "layer type")
    else:
        what = f"`{field}`" if owner == "LayerParameter" else f"`{field}` in {owner}"
        reason = (f"layer '{name}' ({type_name}) sets {what}, a Caffe fork's field that "
                  f"syncsgd's {type_name} does not have; remove it")
    if missing:
        reason += ". " + describe_unsupported(missing)
    return f"{where}: {reason}"


# One top-level message of a text proto: its field name, where it starts and ends (character
# offsets; end None if unterminated), and its own `name:` and `type:` strings.
Entry = namedtuple("Entry", "field start end fields")
_TOKEN = re.compile(r"""\s+|#[^\n]*|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[{}<>:;,\[\]]"""
                    r"""|[^\s{}<>:;,\[\]"'#]+""")


def top_level_entries(text):
    """The top-level messages of a text proto, in file order: the order of `layer` and
    `layers` entries, which the parsed message (one list per field) no longer has."""
    entries, depth, key = [], 0, None
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token[0].isspace() or token[0] == "#" or token == ":":
            continue
        if token in "{<":
            if depth == 0:
                entries.append(Entry(key, m.start(), None, {}))
            depth, key = depth + 1, None
        elif token in "}>":
            depth, key = depth - 1, None
            if depth == 0 and entries:
                entries[-1] = entries[-1]._replace(end=m.end())
        elif depth == 1 and key in ("name", "type") and token[0] in "\"'":
            entries[-1].fields.setdefault(key, token[1:-1])
            key = None
        else:
            key = token
    return entries


def load_message(source, message_type):
    """(message, where) from a text prototxt path, or a copy of a message of that type."""
    if isinstance(source, message_type):
        message = message_type()
        message.CopyFrom(source)
        return message, f"<{message_type.DESCRIPTOR.name}>"
    path = os.fspath(source)
    return read_text(path, message_type()), path


def load_net_param(model):
    """A NetParameter from a path (text prototxt) or an existing NetParameter (copied).

    A file mixing `layer` and the legacy `layers` (which Caffe refuses) is read in file order,
    the legacy entries upgraded: only the text still has that order.
    """
    if isinstance(model, pb.NetParameter):
        return load_message(model, pb.NetParameter)
    path = os.fspath(model)
    text = read_file(path, "r")
    param = _parse(text, pb.NetParameter(), path)
    if param.layer and param.layers and not any(v1.HasField("layer") for v1 in param.layers):
        _merge_in_file_order(param, text, path)
    return param, path


def _merge_in_file_order(param, text, path):
    order = [e.field for e in top_level_entries(text) if e.field in ("layer", "layers")]
    if order.count("layer") != len(param.layer) or order.count("layers") != len(param.layers):
        return      # not the file's top level as the scan saw it: upgrade_net refuses the mix
    current, legacy = iter(param.layer), iter(param.layers)
    merged = []
    for field in order:
        if field == "layer":
            merged.append(pb.LayerParameter())
            merged[-1].CopyFrom(next(current))
        else:
            v1 = pb.V1LayerParameter()
            v1.CopyFrom(next(legacy))
            _move_data_transform(v1)
            merged.append(_upgrade_v1_layer(v1, path))
    log.LOGGER.warning(
        f"{path}: mixes `layer` and the legacy `layers` ({len(param.layers)} of them), which "
        "Caffe refuses; read in file order, the legacy ones upgraded. The current form of "
        '`layers { type: CONVOLUTION blobs_lr: 1 ... }` is `layer { type: "Convolution" '
        "param { lr_mult: 1 } ... }`")
    del param.layer[:]
    del param.layers[:]
    param.layer.extend(merged)


def compile_net(model, phase, level=0, stages=()):
    """The net Caffe would build from `model` in `phase`: upgraded, filtered, with Split layers."""
    param, source = load_net_param(model)
    upgrade_net(param, source)
    state = pb.NetState(phase=phase, level=level, stage=list(stages))
    if param.HasField("state"):
        state.MergeFrom(param.state)
        state.phase = phase
    filtered = filter_net(param, state, source)
    check_types(filtered, source)
    check_modes(filtered, source)
    return rename_duplicates(insert_splits(filtered, source), source), source


# -- layer types and names --------------------------------------------------------------------

def unsupported_types(layers):
    """{type: [layer names]} of the (name, type) pairs whose type syncsgd has no layer for."""
    from syncsgd.layers import is_known
    missing = {}
    for name, type_name in layers:
        if not is_known(type_name):
            missing.setdefault(type_name, []).append(name)
    return missing


def describe_unsupported(missing):
    """One sentence naming every missing type with its layers, and likely typos' types."""
    from syncsgd.layers import known_types
    kinds = ", ".join(f"'{t}' (layer{'s' if len(names) > 1 else ''} "
                      f"{', '.join(repr(n) for n in names)})" for t, names in missing.items())
    guesses = {t: difflib.get_close_matches(t, known_types(), n=1) for t in missing}
    hints = "".join(f"; did you mean '{g[0]}' for '{t}'?" for t, g in guesses.items() if g)
    return (f"unknown layer type{'s' if len(missing) > 1 else ''} {kinds}: syncsgd has no "
            f"layer for {'them' if len(missing) > 1 else 'it'}{hints}; "
            "syncsgd.layer_type_list() names the types it has")


def check_types(param, source="<net>"):
    """Refuse a net with layer types syncsgd lacks, naming all of them at once."""
    missing = unsupported_types((layer.name, layer.type) for layer in param.layer)
    if missing:
        raise PrototxtError(f"{source}: {describe_unsupported(missing)}")


def rename_duplicates(param, source="<net>"):
    """Caffe builds a net whose layers share a name, and copies weights of that name into the
    first of them; so does syncsgd, naming the others name_1, name_2, ... (as OpenCV does) so
    that net.params and saved weights can tell them apart. Each renaming is logged."""
    taken = {layer.name for layer in param.layer}
    groups = {}
    for layer in param.layer:
        groups.setdefault(layer.name, []).append(layer)
    for name, layers in groups.items():
        renamed, k = [], 0
        for layer in layers[1:]:
            k += 1
            while f"{name}_{k}" in taken:
                k += 1
            layer.name = f"{name}_{k}"
            taken.add(layer.name)
            renamed.append(layer.name)
        if renamed:
            log.LOGGER.warning(
                f"{source}: {len(layers)} layers are named '{name}'; as in Caffe the first "
                f"({layers[0].type}) gets the weights named '{name}'; the others are renamed "
                f"{', '.join(repr(n) for n in renamed)}, the names their weights have in "
                "net.params and in saved files")
    return param


# -- upgrades ---------------------------------------------------------------------------------

V1_TYPE_NAMES = {
    "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DATA": "Data", "DECONVOLUTION": "Deconvolution", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# V0 type strings -> V1 enum names, and the V0 fields that move into each V1 *_param message.
V0_TYPES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION",
    "data": "DATA", "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING",
    "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}
V0_FIELDS = {
    "CONVOLUTION": ("convolution_param", {"num_output": "num_output", "biasterm": "bias_term",
                    "weight_filler": "weight_filler", "bias_filler": "bias_filler",
                    "pad": "pad", "kernelsize": "kernel_size", "group": "group",
                    "stride": "stride"}),
    "INNER_PRODUCT": ("inner_product_param", {"num_output": "num_output",
                      "biasterm": "bias_term", "weight_filler": "weight_filler",
                      "bias_filler": "bias_filler"}),
    "POOLING": ("pooling_param", {"pool": "pool", "kernelsize": "kernel_size",
                "stride": "stride", "pad": "pad"}),
    "DROPOUT": ("dropout_param", {"dropout_ratio": "dropout_ratio"}),
    "LRN": ("lrn_param", {"local_size": "local_size", "alpha": "alpha", "beta": "beta",
            "k": "k"}),
    "DATA": ("data_param", {"source": "source", "batchsize": "batch_size",
             "rand_skip": "rand_skip", "scale": "scale", "meanfile": "mean_file",
             "cropsize": "crop_size", "mirror": "mirror"}),
    "HDF5_DATA": ("hdf5_data_param", {"source": "source", "batchsize": "batch_size"}),
    "IMAGE_DATA": ("image_data_param", {"source": "source", "batchsize": "batch_size",
                   "rand_skip": "rand_skip", "shuffle_images": "shuffle",
                   "new_height": "new_height", "new_width": "new_width", "scale": "scale",
                   "meanfile": "mean_file", "cropsize": "crop_size", "mirror": "mirror"}),
    "CONCAT": ("concat_param", {"concat_dim": "concat_dim"}),
    "HDF5_OUTPUT": ("hdf5_output_param", {}),
}


def upgrade_net(param, source="<net>"):
    """Upgrade legacy V0/V1 layers, data-layer transforms and `input` fields, in place."""
    if any(v1.HasField("layer") for v1 in param.layers):
        _upgrade_v0(param, source)
    if param.layers:
        if param.layer:
            raise PrototxtError(
                f"{source}: uses both `layer` ({len(param.layer)}) and the legacy `layers` "
                f"({len(param.layers)}), and a parsed NetParameter no longer says in which "
                "order: give the prototxt's path instead (syncsgd reads such a file in file "
                "order), or convert each legacy entry, e.g. `layers { name: \"conv1\" type: "
                "CONVOLUTION blobs_lr: 1 weight_decay: 1 ... }` to `layer { name: \"conv1\" "
                'type: "Convolution" param { lr_mult: 1 decay_mult: 1 } ... }`')
        for v1 in param.layers:
            _move_data_transform(v1)
            param.layer.add().CopyFrom(_upgrade_v1_layer(v1, source))
        del param.layers[:]
    _upgrade_input(param, source)
    _upgrade_ceil_mode(param, source)
    return param


def _upgrade_ceil_mode(param, source):
    """A fork's pooling_param ceil_mode (false: FLOOR, true: CEIL) moved into round_mode."""
    pool = pb.PoolingParameter
    for layer in param.layer:
        p = layer.pooling_param
        if not (layer.HasField("pooling_param") and p.HasField("ceil_mode")):
            continue
        mode = pool.CEIL if p.ceil_mode else pool.FLOOR
        if p.HasField("round_mode") and p.round_mode != mode:
            raise PrototxtError(
                f"{source}: layer '{layer.name}': pooling_param has ceil_mode "
                f"{str(p.ceil_mode).lower()} and round_mode {pool.RoundMode.Name(p.round_mode)}, "
                "which disagree; keep one of them")
        p.round_mode = mode
        p.ClearField("ceil_mode")


def _upgrade_v0(param, source):
    """V0 (`layers { layer { type: "conv" ... } }`) -> V1, folding V0 padding layers into convs."""
    pads = {}   # blob produced by a padding layer -> (input blob, pad)
    kept = []
    for v1 in param.layers:
        if not v1.HasField("layer"):
            kept.append(v1)
            continue
        v0 = v1.layer
        if v0.type == "padding":
            pads[v1.top[0]] = (v1.bottom[0], v0.pad)
            continue
        if v0.type not in V0_TYPES:
            raise PrototxtError(f"{source}: legacy V0 layer '{v0.name}' has unknown type "
                                f"'{v0.type}'")
        new = pb.V1LayerParameter()
        new.CopyFrom(v1)
        new.ClearField("layer")
        new.name = v0.name
        new.type = pb.V1LayerParameter.LayerType.Value(V0_TYPES[v0.type])
        new.blobs.extend(v0.blobs)
        new.blobs_lr.extend(v0.blobs_lr)
        new.weight_decay.extend(v0.weight_decay)
        type_name = V0_TYPES[v0.type]
        if type_name in V0_FIELDS:
            target_name, fields = V0_FIELDS[type_name]
            target = getattr(new, target_name)
            for old, field in fields.items():
                if v0.HasField(old):
                    value = getattr(v0, old)
                    if target.DESCRIPTOR.fields_by_name[field].is_repeated:
                        getattr(target, field).append(value)
                    elif hasattr(value, "CopyFrom"):
                        getattr(target, field).CopyFrom(value)
                    else:
                        setattr(target, field, value)
            target.SetInParent()
        for i, bottom in enumerate(new.bottom):
            if bottom in pads:
                new.bottom[i], pad = pads[bottom]
                if type_name != "CONVOLUTION":
                    raise PrototxtError(f"{source}: V0 padding layer feeds '{v0.name}', which "
                                        "is not a convolution")
                new.convolution_param.pad[:] = [pad]
        kept.append(new)
    del param.layers[:]
    param.layers.extend(kept)


def _move_data_transform(v1):
    """Caffe moved scale/mean_file/crop_size/mirror from data params to transform_param."""
    for name in ("data_param", "image_data_param", "window_data_param"):
        if not v1.HasField(name):
            continue
        data = getattr(v1, name)
        for field in ("scale", "mean_file", "crop_size", "mirror"):
            if data.HasField(field):
                setattr(v1.transform_param, field, getattr(data, field))
                data.ClearField(field)


def _upgrade_v1_layer(v1, source):
    layer = pb.LayerParameter()
    layer.name = v1.name
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    layer.include.extend(v1.include)
    layer.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        enum_name = pb.V1LayerParameter.LayerType.Name(v1.type)
        if enum_name == "NONE":
            raise PrototxtError(f"{source}: legacy layer '{v1.name}' has type NONE")
        layer.type = V1_TYPE_NAMES[enum_name]
    layer.blobs.extend(v1.blobs)
    n_specs = max(len(v1.param), len(v1.blob_share_mode), len(v1.blobs_lr),
                  len(v1.weight_decay))
    for i in range(n_specs):
        spec = layer.param.add()
        if i < len(v1.param):
            spec.name = v1.param[i]
        if i < len(v1.blob_share_mode):
            spec.share_mode = v1.blob_share_mode[i]
        if i < len(v1.blobs_lr):
            spec.lr_mult = v1.blobs_lr[i]
        if i < len(v1.weight_decay):
            spec.decay_mult = v1.weight_decay[i]
    layer.loss_weight.extend(v1.loss_weight)
    for field, value in v1.ListFields():
        if field.name.endswith("_param") and field.name in layer.DESCRIPTOR.fields_by_name:
            getattr(layer, field.name).CopyFrom(value)
    return layer


def _upgrade_input(param, source):
    """Legacy `input:` + `input_shape`/`input_dim` become an Input layer named "input", first."""
    if not param.input:
        return
    n = len(param.input)
    shapes = []
    if param.input_shape:
        if len(param.input_shape) not in (1, n):
            raise PrototxtError(f"{source}: {n} inputs but {len(param.input_shape)} input_shape")
        shapes = list(param.input_shape)
    elif param.input_dim:
        if len(param.input_dim) != 4 * n:
            raise PrototxtError(f"{source}: input_dim needs 4 values per input "
                                f"({4 * n} for {n} inputs), got {len(param.input_dim)}")
        dims = list(param.input_dim)
        shapes = [pb.BlobShape(dim=dims[4 * i:4 * i + 4]) for i in range(n)]
    layer = pb.LayerParameter(name="input", type="Input", top=list(param.input))
    layer.input_param.shape.extend(shapes)
    layers = [layer] + list(param.layer)
    del param.layer[:]
    param.layer.extend(layers)
    for field in ("input", "input_shape", "input_dim"):
        param.ClearField(field)


# -- phase / level / stage filtering ------------------------------------------------------------

def state_meets_rule(state, rule):
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    if any(stage not in state.stage for stage in rule.stage):
        return False
    return not any(stage in state.stage for stage in rule.not_stage)


def filter_net(param, state, source="<net>"):
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    out.state.CopyFrom(state)
    for layer in param.layer:
        if layer.include and layer.exclude:
            raise PrototxtError(f"{source}: layer '{layer.name}' has both include and exclude "
                                "rules; use one of them")
        if layer.include:
            keep = any(state_meets_rule(state, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(state, r) for r in layer.exclude)
        if keep:
            kept = out.layer.add()
            kept.CopyFrom(layer)
            if not kept.HasField("phase"):
                kept.phase = state.phase
    return out


# -- Split insertion ----------------------------------------------------------------------------

def split_layer_name(layer_name, blob_name, top_index):
    return f"{blob_name}_{layer_name}_{top_index}_split"


def split_blob_name(layer_name, blob_name, top_index, split_index):
    return f"{blob_name}_{layer_name}_{top_index}_split_{split_index}"


def insert_splits(param, source="<net>"):
    """Give every blob read by more than one consumer a Split layer, named as Caffe names it."""
    last_top = {}                 # blob name -> (layer index, top index) of its latest producer
    source_of = {}                # (layer, bottom index) -> (layer, top index)
    consumers = {}                # (layer, top index) -> number of reads (loss counts as one)
    loss_weights = {}
    for i, layer in enumerate(param.layer):
        for j, name in enumerate(layer.bottom):
            if name not in last_top:
                raise PrototxtError(
                    f"{source}: layer '{layer.name}' ({layer.type}) reads bottom '{name}', which "
                    "no earlier layer produces in this phase; check the name and the "
                    "include/exclude rules of the layer that should produce it")
            source_of[(i, j)] = last_top[name]
            consumers[last_top[name]] = consumers.get(last_top[name], 0) + 1
        for j, name in enumerate(layer.top):
            last_top[name] = (i, j)
        for j, weight in enumerate(layer.loss_weight):
            loss_weights[(i, j)] = weight
            if weight:
                consumers[(i, j)] = consumers.get((i, j), 0) + 1

    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    next_split = {}
    for i, layer in enumerate(param.layer):
        copy = out.layer.add()
        copy.CopyFrom(layer)
        for j, name in enumerate(layer.bottom):
            src = source_of[(i, j)]
            if consumers.get(src, 0) > 1:
                k = next_split.get(src, 0)
                next_split[src] = k + 1
                copy.bottom[j] = split_blob_name(param.layer[src[0]].name, name, src[1], k)
        for j, name in enumerate(layer.top):
            count = consumers.get((i, j), 0)
            if count <= 1:
                continue
            weight = loss_weights.get((i, j), 0.0)
            split = out.layer.add()
            split.name = split_layer_name(layer.name, name, j)
            split.type = "Split"
            split.bottom.append(name)
            split.phase = copy.phase
            for k in range(count):
                split.top.append(split_blob_name(layer.name, name, j, k))
                if weight:
                    split.loss_weight.append(weight if k == 0 else 0.0)
            if weight:
                copy.ClearField("loss_weight")
                next_split[(i, j)] = next_split.get((i, j), 0) + 1
    return out


# -- parallelism settings ---------------------------------------------------------------------

_PP = pb.ParallelParameter
SPLIT_MODES = (_PP.MODEL, _PP.HYBRID)


def check_modes(param, source="<net>"):
    """Refuse parallel_param settings that cannot work on any number of ranks (every rank checks,
    also a single process, where every mode trains the same)."""
    for layer in param.layer:
        pp = layer.parallel_param
        if pp.mode in SPLIT_MODES and layer.type != "InnerProduct":
            raise PrototxtError(
                f"{source}: layer '{layer.name}' ({layer.type}) has parallel_param mode "
                f"{_PP.Mode.Name(pp.mode)}, but only InnerProduct layers can be split; use DATA")
        if pp.mode == _PP.HYBRID and pp.groups < 1:
            raise PrototxtError(f"{source}: layer '{layer.name}': HYBRID needs groups >= 1")
        if pp.mode in SPLIT_MODES and layer.inner_product_param.axis != 1:
            raise PrototxtError(f"{source}: layer '{layer.name}': model-parallel InnerProduct "
                                "needs inner_product_param.axis 1")
