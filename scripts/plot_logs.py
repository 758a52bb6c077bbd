#!/usr/bin/env python3
"""Plots validation loss of training runs from their logs.

  scripts/plot_logs.py LOG_OR_DIR... -o OUT.png [--target LOSS] [--title TEXT]

Two panels: val loss against training time (seconds, the clock that stops during validation)
and against step; one line per log, labelled with its run id (the file name without .txt); a
dashed line at the target loss (default 3.28). A directory stands for every *.txt file in it.
Incomplete runs are drawn as far as they got. Logs are read as scripts/stats.py reads them (only
whole `step:k/N val_loss:...` lines count); a missing file, a log with no val_loss line, or one
whose lines disagree on the step count is an error. Needs matplotlib (python3 -m pip install
matplotlib); it draws without a display (Agg backend).
Exit status: 0 written, 1 an error above, no matplotlib, or the image could not be written,
2 bad arguments.
"""
import argparse
import os
import sys

sys.dont_write_bytecode = True  # importing stats.py must leave no __pycache__ beside the scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats  # noqa: E402


def fail(message):
    print(f"plot_logs.py: error: {message}", file=sys.stderr)
    return 1


def plot(runs, out, target, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(13, 5))
    for run in runs:
        steps = [p[0] for p in run.val_points]
        losses = [p[1] for p in run.val_points]
        seconds = [p[2] / 1000.0 for p in run.val_points]
        by_time.plot(seconds, losses, marker=".", label=run.run_id)
        by_step.plot(steps, losses, marker=".", label=run.run_id)
    for ax, xlabel in ((by_time, "training time (s)"), (by_step, "step")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        # Losses fall from ~10.8 to ~3.3: a log scale keeps the end of the runs readable.
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 1.2, 1.5, 2, 2.5, 3, 3.3, 3.6, 4, 5, 6, 8)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    by_step.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="plot_logs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", metavar="LOG_OR_DIR")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png", help="image to write (format from its extension)")
    p.add_argument("--target", type=float, default=stats.TARGET_LOSS, help="val loss drawn as a dashed line")
    p.add_argument("--title", default="", help="title above the panels")
    args = p.parse_args(argv)
    try:
        runs = [stats.parse_log(path) for path in stats.expand(args.logs)]
    except stats.LogError as e:
        return fail(e)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        return fail(f"{args.output}: directory {out_dir} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("matplotlib is not installed; install it with: python3 -m pip install matplotlib")
    try:
        plot(runs, args.output, args.target, args.title)
    except (OSError, ValueError) as e:
        return fail(f"{args.output}: cannot write the image: {e}")
    print(f"wrote {args.output} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
