"""A net as one table row per layer, the listing of Caffe's tools/extra/summarize.py: name,
type, parameter specs, bottoms -> tops and the convolution/pooling arguments, blobs coloured
alike where one layer's top is another's bottom.

Cells read as in Caffe's tool: `(name x2 Dx0)` for ParamSpecs with a name, an lr_mult or a
decay_mult other than 1; `k/s+p n/g` for a convolution (kernel, stride, pad, outputs, group)
and `k/s+p` for a pooling; `w * top` for a top with a loss weight; a top no layer reads is
underlined, a bottom no layer writes has a red background.
"""
import re

from syncsgd.compile import load_net_param, upgrade_net

COLORS = ["92", "93", "94", "95", "97", "96", "42", "43;30", "100", "444", "103;30", "107;30"]
DISCONNECTED = "41"
ANSI = re.compile(r"\033\[[\d;]+m")


def summarize_net(model):
    """The table's rows (lists of 7 strings with ANSI colours) of a prototxt path or
    NetParameter, upgraded from legacy formats first."""
    param, source = load_net_param(model)
    upgrade_net(param, source)
    unread = set()
    for lp in param.layer:
        unread |= set(lp.top)
        unread -= set(lp.bottom)
    colors = {}
    rows = []
    for lp in param.layer:
        tops = []
        for k, top in enumerate(lp.top):
            color = colors.setdefault(top, COLORS[len(colors) % len(COLORS)])
            text = "\033[1;4m" + top if top in unread else top
            if k < len(lp.loss_weight):
                text = f"{lp.loss_weight[k]} * {text}"
            tops.append(f"\033[{color}m{text}\033[0m")
        bottoms = [f"\033[{colors.get(b, DISCONNECTED)}m{b}\033[0m" for b in lp.bottom]
        kind = (f"{lp.python_param.module}.{lp.python_param.layer}" if lp.type == "Python"
                else lp.type)
        specs = [_spec(p) for p in lp.param]
        param_text = f"({', '.join(specs)})" if any(specs) else ""
        rows.append([lp.name, kind, param_text, ", ".join(bottoms), "->", ", ".join(tops),
                     _arguments(lp)])
    return rows


def _spec(p):
    parts = [p.name] if p.name else []
    if p.lr_mult != 1:
        parts.append(f"x{p.lr_mult}")
    if p.decay_mult != 1:
        parts.append(f"Dx{p.decay_mult}")
    return " ".join(parts)


def _arguments(lp):
    conv = lp.convolution_param
    if lp.type in ("Convolution", "Deconvolution") and len(conv.kernel_size) == 1:
        text = str(conv.kernel_size[0])
        if conv.stride and conv.stride[0] != 1:
            text += f"/{conv.stride[0]}"
        if conv.pad and conv.pad[0] != 0:
            text += f"+{conv.pad[0]}"
        text += f" {conv.num_output}"
        return text + (f"/{conv.group}" if conv.group != 1 else "")
    if lp.type == "Pooling":
        pool = lp.pooling_param
        text = str(pool.kernel_size)
        if pool.stride != 1:
            text += f"/{pool.stride}"
        return text + (f"+{pool.pad}" if pool.pad != 0 else "")
    return ""


def printed_len(text):
    return len(ANSI.sub("", text))


def format_table(rows, max_width=30, color=True):
    """The rows as lines of space-separated columns, each as narrow as its widest cell plus
    one but at most `max_width`; a longer cell overflows into the next column only as far as
    it must. Without `color` the ANSI codes are left out."""
    if not rows:
        return []
    widths = [min(max(printed_len(row[j]) + 1 for row in rows), max_width)
              for j in range(len(rows[0]))]
    lines = []
    for row in rows:
        line = ""
        right = 0
        for cell, width in zip(row, widths):
            right += width
            line += cell + " "
            line += " " * max(right - printed_len(line), 0)
        lines.append(line if color else ANSI.sub("", line))
    return lines
