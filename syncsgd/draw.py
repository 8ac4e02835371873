"""Pictures of a net's layer graph, as Caffe's draw_net.py draws them: layers as boxes coloured
by type (or, when the net declares parallelism, by strategy), blobs as octagons, arrows for the
data flow. Rendered by Graphviz (the `graphviz` package and its `dot` program) when present,
else laid out in layers and drawn with matplotlib.

The module is pycaffe's caffe.draw too: get_pydot_graph, draw_net (the picture's bytes) and
draw_net_to_file take a NetParameter (or a prototxt path) as pycaffe's do.

An in-place layer (ReLU, Dropout, ...) gets its own copy of the blob it rewrites, so the
picture reads as a chain rather than a loop. The net is drawn as written (no Split layers);
with a phase, only that phase's layers are drawn.
"""
import html
import io
import os
from dataclasses import dataclass, field

from syncsgd import TEST, TRAIN
from syncsgd.compile import filter_net, load_net_param, upgrade_net
from syncsgd.errors import SyncSGDError
from syncsgd.plot import MissingPackage, matplotlib_figure
from syncsgd.proto import pb

RANKDIRS = ("LR", "TB", "BT", "RL")
BLOB_COLOR = "#eeeeee"
CATEGORY_COLORS = {
    "data": "#9ecae1", "convolution": "#fb6a4a", "pooling": "#fdae6b",
    "inner product": "#bc80bd", "activation": "#ccebc5", "normalization": "#ffed6f",
    "loss / output": "#fccde5", "other": "#d9d9d9",
}
STRATEGY_COLORS = {"data": "#8dd3c7", "model": "#fb8072", "hybrid": "#bebada",
                   "auto": "#ffffb3"}
CATEGORIES = {
    "data": {"Input", "Data", "HDF5Data", "ImageData", "DummyData", "MemoryData", "WindowData"},
    "convolution": {"Convolution", "Deconvolution"},
    "pooling": {"Pooling", "SPP"},
    "inner product": {"InnerProduct", "Embed"},
    "activation": {"ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "BNLL", "Exp",
                   "Log", "Threshold", "Dropout"},
    "normalization": {"LRN", "BatchNorm", "Scale", "Bias", "MVN"},
    "loss / output": {"Accuracy", "Softmax", "ArgMax"},
}


@dataclass
class Node:
    id: str
    label: str
    color: str
    is_layer: bool


@dataclass
class Graph:
    name: str
    nodes: list = field(default_factory=list)
    edges: list = field(default_factory=list)     # (source id, target id)
    legend: dict = field(default_factory=dict)    # legend entry -> colour, in first-use order


def phase_value(text):
    """TRAIN/TEST -> syncsgd.TRAIN/TEST; ALL (or None) -> None (every layer)."""
    if text is None or str(text).upper() == "ALL":
        return None
    try:
        return {"TRAIN": TRAIN, "TEST": TEST}[str(text).upper()]
    except KeyError:
        raise SyncSGDError(f"phase must be TRAIN, TEST or ALL, got '{text}'") from None


def net_graph(model, phase=None, display_lrm=False):
    """The Graph of a prototxt path or NetParameter, for one phase or (None) all layers;
    display_lrm adds the learning-rate multipliers of convolutions and inner products."""
    param, source = load_net_param(_our_message(model))
    upgrade_net(param, source)
    if phase is not None:
        state = pb.NetState(phase=phase)
        if param.HasField("state"):
            state.MergeFrom(param.state)
            state.phase = phase
        param = filter_net(param, state, source)
    by_strategy = any(lp.HasField("parallel_param") for lp in param.layer)
    graph = Graph(param.name or os.path.basename(source))
    latest = {}   # blob name -> id of the node holding its current value
    for i, lp in enumerate(param.layer):
        if by_strategy:
            key, note = strategy(lp)
            color = STRATEGY_COLORS[key]
        else:
            key, note = category(lp.type), ""
            color = CATEGORY_COLORS[key]
        graph.legend.setdefault(key, color)
        lrm = lr_mults(lp) if display_lrm else ""
        label = "\n".join(part for part in (lp.name, lp.type, details(lp), lrm, note) if part)
        for name in lp.bottom:       # inputs never produced get their node first
            if name not in latest:
                latest[name] = _blob(graph, name)
        layer_id = f"L{i}"
        graph.nodes.append(Node(layer_id, label, color, True))
        graph.edges.extend((latest[name], layer_id) for name in lp.bottom)
        for name in lp.top:
            if name in lp.bottom or name not in latest:
                latest[name] = _blob(graph, name)
            graph.edges.append((layer_id, latest[name]))
    return graph


def _our_message(model):
    """A NetParameter of another schema module (Caffe's own caffe_pb2) as syncsgd's, through
    its wire format; paths and syncsgd messages as they are."""
    if hasattr(model, "SerializeToString") and not isinstance(model, pb.NetParameter):
        return pb.NetParameter.FromString(model.SerializeToString())
    return model


def lr_mults(lp):
    """`lr mult: w, b` of a learning layer (Convolution, Deconvolution, InnerProduct), as
    pycaffe's draw shows it; empty for other layers and when both are zero."""
    if lp.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        return ""
    mults = [p.lr_mult for p in lp.param[:2]] + [1.0] * (2 - min(len(lp.param), 2))
    return f"lr mult: {mults[0]:.1f}, {mults[1]:.1f}" if any(mults) else ""


def _blob(graph, name):
    node = Node(f"B{len(graph.nodes)}", name, BLOB_COLOR, False)
    graph.nodes.append(node)
    return node.id


def category(type_name):
    for name, types in CATEGORIES.items():
        if type_name in types:
            return name
    return "loss / output" if type_name.endswith("Loss") else "other"


def strategy(lp):
    """(data / model / hybrid / auto, the label's note) from parallel_param (default data)."""
    mode = pb.ParallelParameter.Mode.Name(lp.parallel_param.mode).lower()
    if mode == "hybrid":
        return mode, f"{mode}, {lp.parallel_param.groups} groups"
    return mode, mode


def details(lp):
    """One short line of the parameters that shape the layer's output."""
    t = lp.type
    if t in ("Convolution", "Deconvolution"):
        p = lp.convolution_param
        kh = p.kernel_h or (p.kernel_size[0] if p.kernel_size else 0)
        kw = p.kernel_w or (p.kernel_size[-1] if p.kernel_size else 0)
        stride = p.stride_h or (p.stride[0] if p.stride else 1)
        pad = p.pad_h or (p.pad[0] if p.pad else 0)
        return f"{p.num_output} @ {kh}x{kw} s{stride} p{pad}"
    if t == "Pooling":
        p = lp.pooling_param
        pool = pb.PoolingParameter.PoolMethod.Name(p.pool)
        if p.global_pooling:
            return f"{pool} global"
        kh = p.kernel_h or p.kernel_size
        kw = p.kernel_w or p.kernel_size
        return f"{pool} {kh}x{kw} s{p.stride_h or p.stride}"
    if t == "InnerProduct":
        return f"{lp.inner_product_param.num_output} outputs"
    if t == "Input" and lp.input_param.shape:
        return "x".join(str(d) for d in lp.input_param.shape[0].dim)
    if t in ("Data", "HDF5Data"):
        param = lp.data_param if t == "Data" else lp.hdf5_data_param
        return f"batch {param.batch_size}"
    if t == "Dropout":
        return f"ratio {lp.dropout_param.dropout_ratio:g}"
    if t == "LRN":
        return f"size {lp.lrn_param.local_size}"
    if t == "Python":
        return f"{lp.python_param.module}.{lp.python_param.layer}"
    return ""


FORMATS = ("png", "svg", "pdf", "raw")


def draw_net(caffe_net, rankdir, ext="png", phase=None, display_lrm=False, engine="auto"):
    """pycaffe's draw_net: the picture's bytes in format `ext` (png, svg, pdf, or raw: the
    Graphviz dot text). engine: "graphviz", "matplotlib", or "auto" (Graphviz when both its
    package and `dot` are present)."""
    return render(net_graph(caffe_net, phase, display_lrm), rankdir, ext, engine)[0]


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False,
                     engine="auto"):
    """pycaffe's draw_net_to_file: the picture in the format of the file's extension. Returns
    the engine used."""
    data, used = render(net_graph(caffe_net, phase, display_lrm), rankdir,
                        os.path.splitext(filename)[1].lstrip("."), engine, filename)
    with open(filename, "wb") as f:
        f.write(data)
    return used


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """pycaffe's get_pydot_graph: the net's graph as a pydot.Dot (needs the pydot package).
    label_edges is accepted for pycaffe's signature; the layer boxes carry what pycaffe writes
    on the edges (batch size, number of outputs)."""
    try:
        import pydot
    except ImportError:
        raise MissingPackage("get_pydot_graph needs the pydot package: pip install pydot") \
            from None
    source = graphviz_source(net_graph(caffe_net, phase, display_lrm), rankdir)
    return pydot.graph_from_dot_data(source)[0]


def render(graph, rankdir, fmt, engine="auto", name=None):
    """(picture bytes, engine used) of a Graph; `name` is the file named in errors."""
    if rankdir not in RANKDIRS:
        raise SyncSGDError(f"rankdir must be one of {', '.join(RANKDIRS)}, got '{rankdir}'")
    fmt = fmt.lower()
    if fmt not in FORMATS:
        what = f"the picture format of '{name}'" if name else f"picture format '{fmt}'"
        raise SyncSGDError(f"cannot draw {what}; use .png, .svg, .pdf or .raw (dot text)")
    if engine not in ("auto", "graphviz", "matplotlib"):
        raise SyncSGDError(f"engine must be auto, graphviz or matplotlib, got '{engine}'")
    if fmt == "raw":
        return graphviz_source(graph, rankdir).encode(), "graphviz"
    if engine in ("auto", "graphviz"):
        try:
            return render_graphviz(graph, rankdir, fmt), "graphviz"
        except MissingPackage:
            if engine == "graphviz":
                raise
    return render_matplotlib(graph, rankdir, fmt), "matplotlib"


def _graphviz():
    try:
        import graphviz
    except ImportError:
        raise MissingPackage("drawing with Graphviz needs the graphviz package: "
                             "pip install graphviz (and Graphviz's dot program)") from None
    return graphviz


def graphviz_digraph(graph, rankdir):
    """The graphviz.Digraph of a Graph: boxes, octagons, a title and a legend of colours."""
    graphviz = _graphviz()
    cells = "".join(f'<TD BGCOLOR="{color}" BORDER="1">{html.escape(key)}</TD>'
                    for key, color in graph.legend.items())
    title = f'<TR><TD COLSPAN="{len(graph.legend)}"><B>{html.escape(graph.name)}</B></TD></TR>'
    dot = graphviz.Digraph(graph.name, graph_attr={
        "rankdir": rankdir, "labelloc": "t", "fontname": "Helvetica", "fontsize": "11",
        "label": f'<<TABLE BORDER="0" CELLSPACING="4">{title}<TR>{cells}</TR></TABLE>>'},
        node_attr={"fontname": "Helvetica", "fontsize": "10"})
    for node in graph.nodes:
        if node.is_layer:
            dot.node(node.id, node.label, shape="box", style="rounded,filled",
                     fillcolor=node.color)
        else:
            dot.node(node.id, node.label, shape="octagon", style="filled",
                     fillcolor=node.color, fontsize="9")
    dot.edges(graph.edges)
    return dot


def graphviz_source(graph, rankdir):
    """The dot text of a Graph (no dot program needed)."""
    return graphviz_digraph(graph, rankdir).source


def render_graphviz(graph, rankdir, fmt):
    """The picture's bytes, from the `graphviz` package and Graphviz's dot program."""
    graphviz = _graphviz()
    try:
        return graphviz_digraph(graph, rankdir).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise MissingPackage("drawing with Graphviz needs its dot program (Debian/Ubuntu: "
                             "apt-get install graphviz)") from None


def layout(graph):
    """{node id: (rank, position)}: rank is the longest path from a source, positions order
    the nodes of a rank by the mean position of their predecessors (fewer crossings)."""
    preds = {node.id: [] for node in graph.nodes}
    succs = {node.id: [] for node in graph.nodes}
    for src, dst in graph.edges:
        preds[dst].append(src)
        succs[src].append(dst)
    waiting = {node_id: len(p) for node_id, p in preds.items()}
    ready = [node.id for node in graph.nodes if not preds[node.id]]
    rank = {}
    while ready:                  # Kahn's order; the graph has no cycles (in-place tops are
        node_id = ready.pop(0)    # new nodes)
        rank[node_id] = max((rank[p] + 1 for p in preds[node_id]), default=0)
        for nxt in succs[node_id]:
            waiting[nxt] -= 1
            if not waiting[nxt]:
                ready.append(nxt)
    if len(rank) != len(graph.nodes):
        raise SyncSGDError(f"net '{graph.name}': its blobs form a cycle (a top read by an "
                           f"earlier layer); draw one phase with --phase")
    by_rank = {}
    for node in graph.nodes:
        by_rank.setdefault(rank[node.id], []).append(node.id)
    position = {}
    for r in sorted(by_rank):
        ids = by_rank[r]
        order = sorted(range(len(ids)), key=lambda k: (
            sum(position[p] for p in preds[ids[k]]) / len(preds[ids[k]])
            if preds[ids[k]] else k, k))
        width = len(ids)
        for slot, k in enumerate(order):
            position[ids[k]] = slot - (width - 1) / 2
    return {node_id: (rank[node_id], position[node_id]) for node_id in rank}


def render_matplotlib(graph, rankdir, fmt):
    """The picture's bytes, the layered layout drawn with matplotlib: boxes sized to their
    labels, arrows ending at the boxes' edges (found from the boxes' drawn extents)."""
    Figure = matplotlib_figure("drawing a net without Graphviz")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Patch
    places = layout(graph)
    across = rankdir in ("LR", "RL")
    step_rank, step_pos = (2.6, 1.4) if across else (1.6, 2.6)
    flip = -1 if rankdir in ("RL", "TB") else 1

    def xy(node_id):
        r, p = places[node_id]
        return (flip * r * step_rank, -p * step_pos) if across else \
            (p * step_pos, flip * r * step_rank)

    coords = {node_id: xy(node_id) for node_id in places}
    xs = [c[0] for c in coords.values()]
    ys = [c[1] for c in coords.values()]
    inch = 0.75                 # inches per layout unit
    width = max((max(xs) - min(xs) + 3.0) * inch, 6.0)
    columns = max(1, min(len(graph.legend), int(width // 1.6)))
    header = 0.45 + 0.25 * -(-len(graph.legend) // columns)   # inches: title, legend rows
    height = (max(ys) - min(ys) + 2.0) * inch + header
    fig = Figure(figsize=(width, height), dpi=100)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1 - header / height))
    ax.set_xlim(min(xs) - 1.5, max(xs) + 1.5)
    ax.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
    ax.set_axis_off()
    texts = {}
    for node in graph.nodes:
        style = "round,pad=0.4" if node.is_layer else "round4,pad=0.3"
        texts[node.id] = ax.text(*coords[node.id], node.label, ha="center", va="center",
                                 fontsize=8 if node.is_layer else 7, zorder=3,
                                 bbox={"boxstyle": style, "fc": node.color, "ec": "#555555"})
    canvas.draw()
    to_data = ax.transData.inverted()
    half = {}
    for node_id, text in texts.items():
        (x0, y0), (x1, y1) = to_data.transform(
            text.get_bbox_patch().get_window_extent(canvas.get_renderer()).get_points())
        half[node_id] = (abs(x1 - x0) / 2, abs(y1 - y0) / 2)
    for src, dst in graph.edges:
        start, end = _clipped(coords[src], coords[dst], half[src], half[dst])
        ax.annotate("", xy=end, xytext=start, zorder=2,
                    arrowprops={"arrowstyle": "-|>", "color": "#444444", "lw": 0.8,
                                "shrinkA": 0, "shrinkB": 0})
    handles = [Patch(facecolor=color, edgecolor="#555555", label=key)
               for key, color in graph.legend.items()]
    fig.legend(handles=handles, loc="upper center", ncol=columns, fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 1 - 0.35 / height))
    fig.suptitle(graph.name, fontsize=10, y=1 - 0.05 / height, va="top")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt)
    return buffer.getvalue()


def _clipped(p, q, half_p, half_q):
    """The segment p -> q shortened to start and end on the edges of the boxes (half sizes
    half_p, half_q) centred on p and q."""
    dx, dy = q[0] - p[0], q[1] - p[1]

    def fraction(half):
        limits = [h / abs(d) for h, d in zip(half, (dx, dy)) if d]
        return min(limits + [0.5])

    a, b = fraction(half_p), 1 - fraction(half_q)
    return (p[0] + a * dx, p[1] + a * dy), (p[0] + b * dx, p[1] + b * dy)
