"""Figures drawn with matplotlib (imported only when a figure is made): training curves of one
or more logs (three panels, or one of the eight charts of Caffe's
tools/extra/plot_training_log.py), and the scaling results of tools/scaling.py.

Figures are built with matplotlib's object API (no pyplot), so no GUI backend is touched and
plotting works on headless machines and from threads.
"""
import importlib

from syncsgd.errors import SyncSGDError

DPI = 100


class MissingPackage(SyncSGDError, ImportError):
    """An optional package a command needs is not installed (an ImportError too, so callers
    that treat plots as optional can catch that)."""


def matplotlib_figure(purpose):
    """matplotlib.figure.Figure, or MissingPackage saying how to install matplotlib."""
    try:
        return importlib.import_module("matplotlib.figure").Figure
    except ImportError:
        raise MissingPackage(f"{purpose} needs matplotlib: pip install matplotlib "
                             f"(or pip install 'syncsgd[plot]')") from None


def plot_logs(logs, out, xaxis="iters", labels=None):
    """Training loss, test accuracy and test loss of each log (a syncsgd.logs.Log or a path)
    against iterations or seconds, one colour per log, in three panels; saved to `out` (format
    from its extension). Returns `out`."""
    from syncsgd.logs import parse_log
    Figure = matplotlib_figure("syncsgd plot")
    logs = [parse_log(item) if not hasattr(item, "train") else item for item in logs]
    labels = labels or [log.name for log in logs]
    if len(labels) != len(logs):
        raise SyncSGDError(f"{len(labels)} labels for {len(logs)} logs; give one per log")
    if not any(log.train or log.test or log.losses for log in logs):
        raise SyncSGDError("no training or test output found in the log(s); are they syncsgd "
                           "or Caffe training logs?")
    x_index, x_label = (1, "seconds") if xaxis == "seconds" else (0, "iterations")
    fig = Figure(figsize=(15, 4.5), dpi=DPI, layout="constrained")
    panels = fig.subplots(1, 3)
    titles = ("training loss", "test accuracy", "test loss")
    for k, (log, label) in enumerate(zip(logs, labels)):
        color = f"C{k % 10}"
        for panel, series in zip(panels, curve_series(log)):
            for style, (name, points) in zip(("-", "--", ":", "-."), series.items()):
                if points:
                    xs = [p[x_index] for p in points]
                    ys = [p[2] for p in points]
                    panel.plot(xs, ys, style, color=color, marker="." if len(xs) < 30 else None,
                               label=f"{label}: {name}")
    for panel, title in zip(panels, titles):
        panel.set_title(title)
        panel.set_xlabel(x_label)
        panel.grid(True, alpha=0.3)
        if panel.lines:
            panel.legend(fontsize="small")
    fig.savefig(out)
    return out


def curve_series(log):
    """Three dicts (training loss, test accuracy, test loss) of name -> [(iter, s, value)].

    Training loss is the displayed (smoothed) loss when the log has it, else the train net's
    loss outputs; the test panels take the test outputs whose names contain "accuracy" or
    "loss"."""
    def outputs(rows, word):
        names = []
        for row in rows:
            names.extend(k for k in row if word in k.lower() and k not in names
                         and k not in ("NumIters", "Seconds", "LearningRate"))
        return {name: [(r["NumIters"], r["Seconds"], r[name]) for r in rows if name in r]
                for name in names}

    train = {"loss": list(log.losses)} if log.losses else outputs(log.train, "loss")
    return train, outputs(log.test, "accuracy"), outputs(log.test, "loss")


# plot_training_log.py's chart types, in its order: every y field against every x field.
CHART_TYPES = [f"{y}  vs. {x}" for y in ("Test accuracy", "Test loss", "Train learning rate",
                                         "Train loss") for x in ("Iters", "Seconds")]


def chart_help():
    return "\n".join(f"{k}: {name}" for k, name in enumerate(CHART_TYPES))


def chart_points(log, chart_type):
    """[(iteration, seconds, value)] of the y field of `chart_type` in a Log: the first test
    output named like accuracy or loss, the learning rate of the train rows, or the
    displayed training loss."""
    train, accuracy, test_loss = curve_series(log)
    y_field = CHART_TYPES[chart_type].split("  vs. ")[0]
    if y_field == "Train learning rate":
        return [(r["NumIters"], r["Seconds"], r["LearningRate"]) for r in log.train]
    series = {"Test accuracy": accuracy, "Test loss": test_loss, "Train loss": train}[y_field]
    return next(iter(series.values()), [])


def plot_chart(chart_type, out, logs, labels=None):
    """One chart of plot_training_log.py (chart_type 0-7, see CHART_TYPES) with a line per log
    (a syncsgd.logs.Log or a path), labelled by the log's file name without `.log` as Caffe's
    script does; saved to `out`. Returns `out`."""
    from syncsgd.logs import parse_log
    if not 0 <= chart_type < len(CHART_TYPES):
        raise SyncSGDError(f"{chart_type} is not a valid chart type; use one of\n{chart_help()}")
    Figure = matplotlib_figure("syncsgd plot")
    logs = [parse_log(item) if not hasattr(item, "train") else item for item in logs]
    labels = labels or [log.name[:-4] if log.name.endswith(".log") else log.name
                        for log in logs]
    if len(labels) != len(logs):
        raise SyncSGDError(f"{len(labels)} labels for {len(logs)} logs; give one per log")
    y_field, x_field = CHART_TYPES[chart_type].split("  vs. ")
    x_index = 1 if x_field == "Seconds" else 0
    fig = Figure(dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for k, (log, label) in enumerate(zip(logs, labels)):
        points = chart_points(log, chart_type)
        if not points:
            raise SyncSGDError(f"log '{log.name}' has no {y_field.lower()} to plot")
        ax.plot([p[x_index] for p in points], [p[2] for p in points], color=f"C{k % 10}",
                marker="osD^v<>ph*"[k % 10], linewidth=0.75, label=label)
    upper = "loss" in y_field or "learning rate" in y_field
    ax.legend(loc="upper right" if upper else "lower right", ncol=1)
    ax.set_title(CHART_TYPES[chart_type])
    ax.set_xlabel(x_field)
    ax.set_ylabel(y_field)
    fig.savefig(out)
    return out


def plot_scaling(rows, out):
    """Throughput, speedup and parallel efficiency against ranks, one line per model.

    rows: dicts with keys ranks, images_per_s, speedup, efficiency, model (values may be
    strings, as read back from a CSV). Saved to `out`; returns `out`."""
    Figure = matplotlib_figure("plotting scaling results")
    models = {}
    for row in rows:
        models.setdefault(str(row["model"]), []).append(row)
    if not models:
        raise SyncSGDError("no scaling rows to plot")
    fig = Figure(figsize=(15, 4.5), dpi=DPI, layout="constrained")
    panels = fig.subplots(1, 3)
    all_ranks = sorted({int(float(row["ranks"])) for row in rows})
    for k, (model, points) in enumerate(models.items()):
        points = sorted(points, key=lambda r: float(r["ranks"]))
        ranks = [float(r["ranks"]) for r in points]
        for panel, key in zip(panels, ("images_per_s", "speedup", "efficiency")):
            panel.plot(ranks, [float(r[key]) for r in points], "-o", color=f"C{k % 10}",
                       label=model)
    panels[1].plot(all_ranks, all_ranks, "--", color="gray", label="linear")
    panels[2].axhline(1.0, linestyle="--", color="gray", label="ideal")
    labels = ("images / s", "speedup", "parallel efficiency")
    for panel, label in zip(panels, labels):
        panel.set_xscale("log", base=2)
        panel.set_xticks(all_ranks, [str(r) for r in all_ranks])
        panel.set_xlabel("ranks")
        panel.set_title(label)
        panel.grid(True, alpha=0.3)
        panel.legend(fontsize="small")
    panels[2].set_ylim(0, max(1.1, 1.05 * max(float(r["efficiency"]) for r in rows)))
    fig.savefig(out)
    return out
