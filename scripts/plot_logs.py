#!/usr/bin/env python3
"""Plots training runs from their logs, by group: is the change better than the baseline?

  scripts/plot_logs.py --group NAME=LOG_OR_DIR [--group NAME=LOG_OR_DIR...] -o OUT.png
                       [--target LOSS] [--title TEXT]
  scripts/plot_logs.py LOG_OR_DIR... -o OUT.png          (one group, named "runs")

Each --group adds logs to the group NAME (repeat a name to add more); e.g. --group old=logs/A
--group new=logs/B. Each group has its colour. Six panels:
  val loss against training time (s, the clock that stops during validation): each run thin,
  the group's mean thick with a band from its lowest to its highest run;
  the same, zoomed on the target (default 3.28, from 0.015 below to 0.025 above it, the region
  where records are decided; widened to the final losses when no run ends there);
  training loss against step, the group's mean of the runs that log it (--log-train-loss), else
  val loss against step;
  the final val loss of every run, one column of points per group, the mean as a bar;
  the training time of every run, likewise, with each group's difference to the first group;
  a table: n, mean and std of val loss and time, the t-test p of mean < target, and Welch's p of
  each group's time against the first group's.
A run whose log ends before its last step is drawn as far as it got and marked with an X
(truncated); one whose val loss became nan or inf is drawn to its last finite point and marked
with a star (diverged); neither counts in the means or the strip panels. A directory stands for
every *.txt file in it; logs are read as scripts/stats.py reads them: a file that is not a log
is listed and skipped, a copy of a log counted once. Needs matplotlib (in the project's .venv, which make
creates); it draws without a display (Agg backend).
Exit status: 0 written, 1 a missing file, no run in a group, no matplotlib, or the image could not
be written, 2 bad arguments.
"""
import argparse
import math
import os
import statistics
import sys

sys.dont_write_bytecode = True  # importing stats.py must leave no __pycache__ beside the scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats  # noqa: E402

ZOOM_BELOW, ZOOM_ABOVE = 0.015, 0.025  # the zoom panel's loss window around the target


def fail(message):
    print(f"plot_logs.py: error: {message}", file=sys.stderr)
    return 1


def parse_group(text):
    """"NAME=PATH" -> (NAME, PATH), for argparse."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=LOG_OR_DIR (e.g. old=logs/baseline)")
    return name, path


class Group:
    """A group's runs, sorted by what happened to them."""

    def __init__(self, name, runs):
        self.name = name
        self.finished = [r for r in runs if r.final is not None and math.isfinite(r.final[0])]
        self.diverged = [r for r in runs if r.final is not None and not math.isfinite(r.final[0])]
        self.diverged += [r for r in runs if r.final is None and not all(map(math.isfinite, losses(r)))]
        self.truncated = [r for r in runs if r.final is None and r not in self.diverged]

    def mean_curve(self):
        """(steps, mean time s, mean loss, min loss, max loss) over the finished runs, at the
        validation steps they all have."""
        if not self.finished:
            return [], [], [], [], []
        common = set.intersection(*({p[0] for p in r.val_points} for r in self.finished))
        steps = sorted(common)
        at = [{p[0]: p for p in r.val_points} for r in self.finished]
        times = [statistics.fmean(a[s][2] / 1000.0 for a in at) for s in steps]
        values = [[a[s][1] for a in at] for s in steps]
        return steps, times, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]

    def final_losses(self):
        return [r.final[0] for r in self.finished]

    def final_times(self):
        return [r.final[1] / 1000.0 for r in self.finished]


def losses(run):
    return [p[1] for p in run.val_points]


def finite_points(run):
    """The validation points up to the first non-finite loss: (steps, seconds, losses)."""
    points = []
    for step, loss, ms in run.val_points:
        if not math.isfinite(loss):
            break
        points.append((step, ms / 1000.0, loss))
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def load_groups(named_paths):
    """[(name, path)] -> [Group], in the order names first appear. Skipped files and duplicates are
    reported on stderr; raises stats.LogError for a missing path or a group with no run."""
    order, paths = [], {}
    for name, path in named_paths:
        if name not in paths:
            order.append(name)
            paths[name] = []
        paths[name].append(path)
    groups = []
    for name in order:
        runs = []
        for path in stats.expand(paths[name]):
            try:
                runs.append(stats.parse_log(path))
            except stats.NotALog as e:
                print(f"plot_logs.py: warning: {path}: skipped: {str(e).removeprefix(path + ': ')}", file=sys.stderr)
        runs, repeats = stats.drop_duplicates(runs)
        for run, earlier, why in repeats:
            print(f"plot_logs.py: warning: {run.path}: duplicate of {earlier.path}: {why}; drawn once", file=sys.stderr)
        if not runs:
            raise stats.LogError(f"group {name}: no log with a validation among {', '.join(paths[name])}")
        groups.append(Group(name, runs))
    return groups


# ---- panels ----

def draw_curves(ax, groups, colors, by_step=False):
    """Every run thin, each group's mean thick over a min-max band; truncated and diverged runs
    marked at their last point."""
    for g, color in zip(groups, colors):
        for r in g.finished + g.truncated + g.diverged:
            steps, secs, vals = finite_points(r)
            x = steps if by_step else secs
            style = "--" if r in g.truncated else "-"
            ax.plot(x, vals, style, color=color, linewidth=0.8, alpha=0.45)
            if r in g.truncated and x:
                ax.plot(x[-1], vals[-1], "X", color=color, markeredgecolor="black", markersize=11, zorder=5,
                        gid=f"truncated:{g.name}:{r.run_id}")
            if r in g.diverged and x:
                ax.plot(x[-1], vals[-1], "*", color=color, markeredgecolor="red", markersize=15, zorder=5,
                        gid=f"diverged:{g.name}:{r.run_id}")
        steps, secs, mean, lo, hi = g.mean_curve()
        if steps:
            x = steps if by_step else secs
            ax.fill_between(x, lo, hi, color=color, alpha=0.2, linewidth=0, gid=f"band:{g.name}")
            ax.plot(x, mean, "-o", color=color, linewidth=2.2, markersize=3.5, gid=f"mean:{g.name}",
                    label=f"{g.name}: mean of {len(g.finished)} (band: min-max)")


def status_legend(ax, groups):
    """Legend entries for the marks, only for what is drawn."""
    from matplotlib.lines import Line2D
    handles = [h for h in ax.get_legend_handles_labels()[0]]
    if any(g.truncated for g in groups):
        handles.append(Line2D([], [], linestyle="--", marker="X", color="gray", markeredgecolor="black",
                              markersize=9, label="truncated (log ends early)"))
    if any(g.diverged for g in groups):
        handles.append(Line2D([], [], linestyle="", marker="*", color="gray", markeredgecolor="red",
                              markersize=12, label="diverged (nan/inf)"))
    ax.legend(handles=handles, fontsize="small", loc="upper right")


def log_loss_axis(ax):
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    # Losses fall from ~10.8 to ~3.3: a log scale keeps the end of the runs readable.
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 1.2, 1.5, 2, 2.5, 3, 3.3, 3.6, 4, 5, 6, 8)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def zoom_window(groups, target):
    """The zoom panel's (y range, x range, widened?): around the target, or around the final
    losses when none lies near it."""
    finals = [v for g in groups for v in g.final_losses()]
    lo, hi, widened = target - ZOOM_BELOW, target + ZOOM_ABOVE, False
    if finals and not any(lo <= v <= hi for v in finals):
        pad = max(0.25 * (max(finals) - min(finals)), ZOOM_BELOW)
        lo, hi, widened = min(finals) - pad, max(finals) + pad, True
    ends = [t for g in groups for t in g.final_times()] or \
        [finite_points(r)[1][-1] for g in groups for r in g.truncated + g.diverged if finite_points(r)[1]]
    x_range = (0.9 * min(ends), 1.01 * max(ends)) if ends else None
    return (lo, hi), x_range, widened


def draw_strip(ax, groups, colors, values_of, ylabel, fmt, gid):
    """One column of points per group (evenly spread, not random, so the figure is reproducible),
    the mean as a black bar, labelled."""
    for k, (g, color) in enumerate(zip(groups, colors)):
        values = values_of(g)
        if not values:
            continue
        n = len(values)
        xs = [k + (0.0 if n == 1 else 0.25 * (2 * i / (n - 1) - 1)) for i in range(n)]
        ax.scatter(xs, values, color=color, edgecolor="black", linewidth=0.5, s=40, zorder=3, gid=f"{gid}:{g.name}")
        mean = statistics.fmean(values)
        ax.plot([k - 0.35, k + 0.35], [mean, mean], color="black", linewidth=2, gid=f"{gid}-mean:{g.name}")
        ax.annotate(f"{mean:{fmt}}", (k + 0.37, mean), va="center", fontsize="small")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g.name}\n({len(g.finished)} finished{left_out(g)})" for g in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def left_out(g):
    parts = [f"{len(g.truncated)} truncated"] * bool(g.truncated) + [f"{len(g.diverged)} diverged"] * bool(g.diverged)
    return "; " + ", ".join(parts) if parts else ""


def summary_rows(groups, target):
    """The table's rows: one a group."""
    rows = []
    base_losses, base_times = groups[0].final_losses(), groups[0].final_times()
    for k, g in enumerate(groups):
        vals, times = g.final_losses(), g.final_times()
        row = [g.name, str(len(vals))]
        if vals:
            std = f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else ""
            test = stats.one_sample_t_test_less(vals, target)
            row += [f"{statistics.fmean(vals):.4f}{std}", stats.format_p(test[2]) if test else "n/a",
                    f"{statistics.fmean(times):.2f}" + (f" ± {statistics.stdev(times):.2f}" if len(times) > 1 else "")]
        else:
            row += ["-", "-", "-"]
        for baseline, values, fmt in ((base_losses, vals, "+.4f"), (base_times, times, "+.2f s")):
            row.append(versus(baseline, values, fmt) if k else "(baseline)")
        rows.append(row)
    return rows


def versus(base, values, fmt):
    """The difference of the means, with Welch's two-sided p when both have spread."""
    if not base or not values:
        return "-"
    welch = stats.welch_t_test(base, values)
    diff = statistics.fmean(values) - statistics.fmean(base)
    number, _, unit = fmt.partition(" ")
    return f"{diff:{number}}" + (f" {unit}" if unit else "") + (f", p={stats.format_p(welch[2])}" if welch else "")


def build_figure(groups, target, title):
    """The figure (not saved); its axes in reading order: by time, zoom, by step, final losses,
    times, table."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = [f"C{k % 10}" for k in range(len(groups))]
    fig, grid = plt.subplots(2, 3, figsize=(19, 10.5))
    by_time, zoom, by_step = grid[0]
    finals, times, table = grid[1]

    draw_curves(by_time, groups, colors)
    by_time.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
    log_loss_axis(by_time)
    by_time.set(title="val loss by training time", xlabel="training time (s)", ylabel="val loss")
    status_legend(by_time, groups)

    draw_curves(zoom, groups, colors)
    zoom.axhline(target, color="gray", linestyle="--", linewidth=1)
    (lo, hi), x_range, widened = zoom_window(groups, target)
    zoom.set_ylim(lo, hi)
    if x_range:
        zoom.set_xlim(*x_range)
    zoom.set(title="zoom: the end of the runs" + (" (no run ends near the target)" if widened else
                                                  f" near the target {target}"),
             xlabel="training time (s)", ylabel="val loss")

    logged = [[r for r in g.finished + g.truncated if r.train_losses] for g in groups]
    if any(logged):
        for g, runs, color in zip(groups, logged, colors):
            for r in runs:
                by_step.plot([p[0] for p in r.train_losses], [p[1] for p in r.train_losses], color=color,
                             linewidth=0.7, alpha=0.35)
            steps, mean = train_loss_mean(runs)
            if steps:
                by_step.plot(steps, mean, color=color, linewidth=2, gid=f"train-mean:{g.name}",
                             label=f"{g.name}: mean of {len(runs)}")
        by_step.set(title="training loss by step", xlabel="step", ylabel="training loss")
        by_step.legend(fontsize="small", loc="upper right")
    else:
        draw_curves(by_step, groups, colors, by_step=True)
        by_step.set(title="val loss by step (no train_loss lines: --log-train-loss logs them)", xlabel="step",
                    ylabel="val loss")
    by_step.axhline(target, color="gray", linestyle="--", linewidth=1)
    log_loss_axis(by_step)

    draw_strip(finals, groups, colors, Group.final_losses, "final val loss", ".4f", "final")
    finals.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
    finals.set_title("final val loss of each run (bar: mean)")
    finals.legend(fontsize="small", loc="upper right")
    draw_strip(times, groups, colors, Group.final_times, "training time (s)", ".2f", "time")
    times.set_title("training time of each run (bar: mean)")

    table.axis("off")
    rows = summary_rows(groups, target)
    cells = table.table(cellText=rows, colLabels=["group", "n", "val loss", f"p(mean<{target})", "time (s)",
                                                  f"loss vs {groups[0].name}", f"time vs {groups[0].name}"],
                        loc="upper center", cellLoc="center", gid="summary")
    cells.auto_set_font_size(False)
    cells.set_fontsize(10)
    cells.auto_set_column_width(range(len(rows[0])))
    cells.scale(1, 2.2)
    for k, color in enumerate(colors):
        cells[k + 1, 0].set_facecolor(color)
        cells[k + 1, 0].set_alpha(0.35)
    table.set_title(f"finished runs; p(mean<{target}): one-sided t-test;\nvs {groups[0].name}: difference of means, "
                    "Welch's two-sided p", fontsize="medium")

    for ax in (by_time, zoom, by_step):
        ax.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize="x-large")
    fig.tight_layout()
    return fig


def train_loss_mean(runs):
    """(steps, mean training loss) at the steps every run logged."""
    if not runs:
        return [], []
    at = [dict(r.train_losses) for r in runs]
    steps = sorted(set.intersection(*(set(a) for a in at)))
    return steps, [statistics.fmean(a[s] for a in at) for s in steps]


def main(argv=None):
    p = argparse.ArgumentParser(prog="plot_logs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="*", metavar="LOG_OR_DIR", help="logs of one group, named runs")
    p.add_argument("--group", action="append", type=parse_group, default=[], metavar="NAME=LOG_OR_DIR",
                   help="logs of the group NAME (repeatable)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png", help="image to write (format from its extension)")
    p.add_argument("--target", type=float, default=stats.TARGET_LOSS, help="val loss drawn as a dashed line")
    p.add_argument("--title", default="", help="title above the panels")
    args = p.parse_args(argv)
    if args.logs and args.group:
        p.error("give either --group NAME=LOG_OR_DIR options or plain logs (one group), not both")
    if not args.logs and not args.group:
        p.error("no logs given: --group NAME=LOG_OR_DIR (repeatable) or LOG_OR_DIR...")
    named = args.group or [("runs", path) for path in args.logs]
    try:
        groups = load_groups(named)
    except stats.LogError as e:
        return fail(e)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        return fail(f"{args.output}: directory {out_dir} does not exist")
    try:
        import matplotlib
    except ImportError:
        return fail("matplotlib is not installed: run this with the project's .venv/bin/python (make creates it), "
                    "or python3 -m pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = build_figure(groups, args.target, args.title)
    try:
        fig.savefig(args.output, dpi=110)
    except (OSError, ValueError) as e:
        return fail(f"{args.output}: cannot write the image: {e}")
    finally:
        plt.close(fig)
    counts = ", ".join(f"{g.name}: {len(g.finished)} finished" + left_out(g) for g in groups)
    print(f"wrote {args.output} ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
