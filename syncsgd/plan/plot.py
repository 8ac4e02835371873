"""`syncsgd plan --plot`: predicted speedup against node count, per strategy (matplotlib is an
optional dependency, imported only here)."""
from syncsgd.errors import SyncSGDError

STYLES = {"data": ("data parallel throughout", "tab:blue", "s--"),
          "model": ("FC model parallel, conv data", "tab:orange", "^--"),
          "hybrid": ("FC hybrid (best single G), conv data", "tab:green", "v--")}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SyncSGDError("--plot needs matplotlib, which is not installed: "
                           "pip install 'syncsgd[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedup(report, path, anchors=()):
    """Draw the report's predicted speedups (planner and each uniform strategy) against the
    ideal, with optional measured `anchors` [(nodes, speedup, label)], and save to `path`."""
    plt = _pyplot()
    points = report["points"]
    nodes = [p["nodes"] for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=100)
    ax.plot(nodes, nodes, ":", color="gray", label="ideal")
    for strategy, (label, color, style) in STYLES.items():
        values = [(p["nodes"], p["uniform_speedup"][strategy]) for p in points
                  if p["uniform_speedup"].get(strategy) is not None]
        if values:
            ax.plot(*zip(*values), style, color=color, label=label, markersize=4, linewidth=1)
    ax.plot(nodes, [p["speedup"] for p in points], "o-", color="lightgray", linewidth=5,
            markersize=9, zorder=1, label="planner's per-layer choice")
    for n, speedup, label in anchors:
        ax.plot([n], [speedup], "*", markersize=14, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted speedup over one node")
    model = report.get("model", "")
    ax.set_title(f"{model}\nMB {report['batch']}, cluster {report['cluster']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
