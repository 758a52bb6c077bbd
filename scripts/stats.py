#!/usr/bin/env python3
"""Statistics of speedrun record attempts, read from their logs.

  scripts/stats.py [--strict] [--target LOSS] [--json] LOG_OR_DIR...
  scripts/stats.py [--strict] [--json] --compare OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...

Summary mode prints each run's final validation loss and training time, then over the runs:
n, the mean and sample standard deviation (n-1) of the final val loss, the one-sided one-sample
t-test of H1 "mean val loss < LOSS" (default 3.28, the speedrun's target; a record claim wants
p < 0.01), and the mean and standard deviation of the training time in ms and minutes.

Compare mode (--compare) reads two sets of runs, OLD before the lone "--" and NEW after it, and
compares their training times and final val losses with Welch's t-test (unequal variances,
two-sided p-value), saying which set is faster and by how much.

A directory stands for every *.txt file in it (not recursive). A log is the trainer's: lines
such as
  step:1555/1555 val_loss:3.2789 train_time:95168ms step_avg:61.20ms
anywhere in the file (the source code printed at its top, format strings included, never matches:
only whole lines of numbers in exactly this form count). A run is complete when it has a val_loss
line whose step is the total N of step:N/N; its final val loss and training time are that line's.

Problems:
  a missing file, a log with no val_loss line, lines that disagree on the total step count,
  or no logs at all: an error (exit status 1).
  an incomplete run (no val_loss line at the last step) or a diverged one (val loss nan or inf):
  a warning on stderr and the run is left out; with --strict, an error instead.
Exit status: 0 done, 1 an error above or too few runs for the requested test, 2 bad arguments.

The Student t distribution is computed here (regularized incomplete beta function by its
continued fraction), so only the standard library is needed.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

TARGET_LOSS = 3.28

# Whole lines only: the source printed at the top of a log holds the same text as format strings.
VAL_LINE = re.compile(r"step:(\d+)/(\d+) val_loss:(-?(?:\d+\.\d+|nan|inf)) train_time:(\d+)ms step_avg:(\d+\.\d+)ms")
TRAIN_LINE = re.compile(r"step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\d+\.\d+)ms")


class LogError(Exception):
    """A problem that stops the script, with the message for the user."""


# ---- the Student t distribution ----

def _beta_continued_fraction(x, a, b):
    """The continued fraction of I_x(a, b) (modified Lentz); converges fast for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 100000):
        # Even term, then odd term, of the fraction's coefficients.
        for coef in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                     -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + coef * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + coef / c
            c = c if abs(c) > tiny else tiny
            step = c * d
            result *= step
        if abs(step - 1.0) < 1e-15:
            return result
    raise ArithmeticError(f"incomplete beta: no convergence for x={x}, a={a}, b={b}")


def _log_gamma_ratio(a, b):
    """log(Gamma(a+b) / Gamma(a)). For large a the two lgamma values are huge and nearly equal,
    so their difference comes from Stirling's series, where the large terms cancel by algebra."""
    if a < 100.0:
        return math.lgamma(a + b) - math.lgamma(a)

    def stirling_tail(z):  # lgamma(z) - ((z - 1/2) log z - z + log(2 pi)/2), to O(z^-7)
        z2 = z * z
        return (1.0 / 12.0 - (1.0 / 360.0 - 1.0 / (1260.0 * z2)) / z2) / z

    return (a - 0.5) * math.log1p(b / a) + b * math.log(a + b) - b + stirling_tail(a + b) - stirling_tail(a)


def regularized_beta(x, a, b, one_minus_x=None):
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0.
    one_minus_x, when given, is 1 - x computed without cancellation by the caller."""
    y = 1.0 - x if one_minus_x is None else one_minus_x
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_x = math.log(x) if x < 0.5 else math.log1p(-y)
    log_y = math.log(y) if y < 0.5 else math.log1p(-x)
    big, small = (a, b) if a >= b else (b, a)
    log_front = _log_gamma_ratio(big, small) - math.lgamma(small) + a * log_x + b * log_y
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    # I_x(a, b) = 1 - I_{1-x}(b, a): the fraction converges quickly on this side.
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(y, b, a) / b


def student_t_upper_tail(t, df):
    """P(T > t) for Student's t with df > 0 degrees of freedom (df need not be an integer)."""
    if math.isnan(t) or math.isnan(df) or df <= 0:
        return math.nan
    if t == 0:
        return 0.5
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if df > 1e6:
        # Past here the fraction loses digits; the normal tail with its first 1/df correction
        # (Fisher's expansion) is within about 1e-12.
        density = math.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
        return 0.5 * math.erfc(t / math.sqrt(2.0)) + density * (t ** 3 + t) / (4.0 * df)
    # P(|T| > |t|) = I_{df/(df+t^2)}(df/2, 1/2).
    denom = df + t * t
    two_sided = regularized_beta(df / denom, 0.5 * df, 0.5, one_minus_x=t * t / denom)
    return 0.5 * two_sided if t > 0 else 1.0 - 0.5 * two_sided


def student_t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    return student_t_upper_tail(-t, df)


# ---- tests on samples ----

def one_sample_t_test_less(values, mu0):
    """One-sided one-sample t-test of H1: mean < mu0. Returns (t, df, p); None when n < 2 or the
    values have no spread (the statistic is undefined)."""
    n = len(values)
    if n < 2:
        return None
    sd = statistics.stdev(values)
    if sd == 0:
        return None
    t = (statistics.fmean(values) - mu0) / (sd / math.sqrt(n))
    return t, n - 1, student_t_cdf(t, n - 1)


def welch_t_test(old, new):
    """Welch's t-test of mean(new) - mean(old) (unequal variances). Returns (t, df, two-sided p);
    None when either set has fewer than 2 values or both have no spread."""
    if len(old) < 2 or len(new) < 2:
        return None
    se2_old = statistics.variance(old) / len(old)
    se2_new = statistics.variance(new) / len(new)
    se2 = se2_old + se2_new
    if se2 == 0:
        return None
    t = (statistics.fmean(new) - statistics.fmean(old)) / math.sqrt(se2)
    # Welch-Satterthwaite degrees of freedom.
    df = se2 * se2 / (se2_old ** 2 / (len(old) - 1) + se2_new ** 2 / (len(new) - 1))
    return t, df, 2.0 * student_t_upper_tail(abs(t), df)


# ---- logs ----

class Run:
    """What one log says: every validation point, the total step count, and the final result."""

    def __init__(self, path):
        self.path = path
        self.run_id = os.path.splitext(os.path.basename(path))[0]
        self.total = None       # N of step:k/N
        self.val_points = []    # (step, val_loss, train_time_ms), in file order
        self.last_train_step = None

    @property
    def final(self):
        """The last val_loss line at the total step as (val_loss, train_time_ms), or None."""
        for step, loss, time_ms in reversed(self.val_points):
            if step == self.total:
                return loss, time_ms
        return None

    def problem(self):
        """None for a complete run with a finite final loss, else why it cannot be counted."""
        final = self.final
        if final is None:
            last = self.val_points[-1][0]
            trained = f", training reached step {self.last_train_step}" if self.last_train_step is not None else ""
            return f"incomplete: last validation at step {last} of {self.total}{trained}"
        if not math.isfinite(final[0]):
            return f"diverged: final val loss {final[0]}"
        return None


def parse_log(path):
    """Reads one log. Raises LogError if it cannot be read or holds no validation line."""
    run = Run(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror}")
    for number, line in enumerate(lines, 1):
        line = line.strip()
        m = VAL_LINE.fullmatch(line)
        if m:
            step, total = int(m.group(1)), int(m.group(2))
            run.val_points.append((step, float(m.group(3)), int(m.group(4))))
        else:
            m = TRAIN_LINE.fullmatch(line)
            if not m:
                continue
            step, total = int(m.group(1)), int(m.group(2))
            run.last_train_step = step
        if run.total is None:
            run.total = total
        elif total != run.total:
            raise LogError(f"{path}:{number}: total step count {total} differs from the {run.total} of earlier lines")
    if not run.val_points:
        raise LogError(f"{path}: no val_loss line (not a training log, or the run stopped before its first validation)")
    return run


def expand(paths):
    """The log files named: files as given, directories as their *.txt files, each once."""
    files, seen = [], set()
    for path in paths:
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(glob.escape(path), "*.txt")))
            if not found:
                raise LogError(f"{path}: directory has no *.txt logs")
        elif os.path.exists(path):
            found = [path]
        else:
            raise LogError(f"{path}: no such file or directory")
        for f in found:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                files.append(f)
    if not files:
        raise LogError("no logs given")
    return files


def complete_runs(paths, strict, label=""):
    """Parses the logs; returns the runs that count. Incomplete or diverged runs are skipped with
    a warning, or raise LogError under strict."""
    runs = []
    for path in expand(paths):
        run = parse_log(path)
        problem = run.problem()
        if problem is None:
            runs.append(run)
        elif strict:
            raise LogError(f"{path}: {problem} (--strict)")
        else:
            print(f"stats.py: warning: {path}: {problem}; left out", file=sys.stderr)
    if not runs:
        raise LogError(f"no complete runs{label} among the logs given")
    return runs


# ---- reports ----

def summarize(runs, target=None):
    """The numbers of summary mode, as a dict (what --json prints)."""
    losses = [r.final[0] for r in runs]
    times = [r.final[1] for r in runs]
    n = len(runs)
    out = {
        "runs": [{"run_id": r.run_id, "path": r.path, "steps": r.total,
                  "val_loss": r.final[0], "train_time_ms": r.final[1]} for r in runs],
        "n": n,
        "val_loss_mean": statistics.fmean(losses),
        "val_loss_std": statistics.stdev(losses) if n > 1 else None,
        "train_time_ms_mean": statistics.fmean(times),
        "train_time_ms_std": statistics.stdev(times) if n > 1 else None,
    }
    if target is not None:
        test = one_sample_t_test_less(losses, target)
        out["target"] = target
        out["t"], out["df"], out["p"] = test if test else (None, None, None)
    return out


def minutes(ms):
    return ms / 60000.0


def print_runs(runs):
    width = max(len("run"), *(len(r.run_id) for r in runs))
    print(f"{'run':<{width}}  {'steps':>5}  {'val_loss':>8}  {'train_time':>10}")
    for r in runs:
        loss, time_ms = r.final
        print(f"{r.run_id:<{width}}  {r.total:>5}  {loss:8.4f}  {time_ms:>8d}ms  ({minutes(time_ms):.3f} min)")


def print_summary(s):
    std = s["val_loss_std"]
    print(f"n = {s['n']}")
    std_text = "n/a (one run)" if std is None else f"{std:.5f}"
    print(f"val_loss: mean {s['val_loss_mean']:.5f}, std {std_text}")
    if "target" in s:
        if s["t"] is None:
            why = "one run" if s["n"] < 2 else "no spread"
            print(f"  one-sided t-test, H1: mean < {s['target']}: n/a ({why})")
        else:
            print(f"  one-sided t-test, H1: mean < {s['target']}: t = {s['t']:.3f}, df = {s['df']}, p = {s['p']:.4g}")
    mean, std = s["train_time_ms_mean"], s["train_time_ms_std"]
    std_text = "n/a (one run)" if std is None else f"{std:.0f} ms ({minutes(std):.4f} min)"
    print(f"train_time: mean {mean:.0f} ms ({minutes(mean):.4f} min), std {std_text}")


def compare(old_runs, new_runs):
    """The numbers of compare mode, as a dict (what --json prints)."""
    out = {"old": summarize(old_runs), "new": summarize(new_runs)}
    for key, value in (("train_time_ms", lambda r: r.final[1]), ("val_loss", lambda r: r.final[0])):
        old = [value(r) for r in old_runs]
        new = [value(r) for r in new_runs]
        diff = statistics.fmean(new) - statistics.fmean(old)
        test = welch_t_test(old, new)
        out[key] = {"difference": diff, "relative": diff / statistics.fmean(old),
                    "t": test[0] if test else None, "df": test[1] if test else None,
                    "p": test[2] if test else None}
    return out


def print_compare(c):
    for name in ("old", "new"):
        s = c[name]
        print(f"{name}: n = {s['n']}, val_loss mean {s['val_loss_mean']:.5f} std {s['val_loss_std']:.5f}, "
              f"train_time mean {s['train_time_ms_mean']:.0f} ms ({minutes(s['train_time_ms_mean']):.4f} min) "
              f"std {s['train_time_ms_std']:.0f} ms")
    for key, unit, fmt in (("train_time_ms", " ms", "+.0f"), ("val_loss", "", "+.4f")):
        d = c[key]
        test = "n/a (no spread)" if d["t"] is None else f"t = {d['t']:.3f}, df = {d['df']:.2f}, two-sided p = {d['p']:.4g}"
        print(f"{key.replace('_ms', '')}: new - old = {d['difference']:{fmt}}{unit} ({100 * d['relative']:+.2f}%); "
              f"Welch {test}")
    d = c["train_time_ms"]
    if d["difference"] == 0:
        print("new and old take the same mean time")
    else:
        faster, slower = ("new", "old") if d["difference"] < 0 else ("old", "new")
        amount = abs(d["difference"])
        base = c[slower]["train_time_ms_mean"]
        print(f"{faster} is faster by {amount:.0f} ms ({100 * amount / base:.2f}% less time than {slower})")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="stats.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, usage=argparse.SUPPRESS)
    p.add_argument("logs", nargs="*", metavar="LOG_OR_DIR")
    p.add_argument("--compare", action="store_true", help="compare OLD... -- NEW... with Welch's t-test")
    p.add_argument("--strict", action="store_true", help="an incomplete or diverged run is an error, not a warning")
    p.add_argument("--target", type=float, default=TARGET_LOSS,
                   help=f"val loss of the one-sided test's null hypothesis (default {TARGET_LOSS})")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    # "--" separates the two sets of compare mode; split it off before argparse sees it.
    new = None
    if "--" in argv:
        cut = argv.index("--")
        argv, new = argv[:cut], argv[cut + 1:]
    args = p.parse_args(argv)
    if args.compare:
        if new is None or not args.logs or not new:
            p.error("--compare needs both sets: --compare OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...")
    elif new is not None:
        p.error('"--" separates the two sets of --compare; without --compare give the logs alone')
    elif not args.logs:
        p.error("no logs given: stats.py LOG_OR_DIR...")
    args.new = new
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.compare:
            old_runs = complete_runs(args.logs, args.strict, " in the old set")
            new_runs = complete_runs(args.new, args.strict, " in the new set")
            for name, runs in (("old", old_runs), ("new", new_runs)):
                if len(runs) < 2:
                    raise LogError(f"Welch's t-test needs at least 2 complete runs in each set; {name} has {len(runs)}")
            result = compare(old_runs, new_runs)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                for name, runs in (("old", old_runs), ("new", new_runs)):
                    print(f"{name}:")
                    print_runs(runs)
                print()
                print_compare(result)
        else:
            runs = complete_runs(args.logs, args.strict)
            result = summarize(runs, args.target)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                print_runs(runs)
                print_summary(result)
    except LogError as e:
        print(f"stats.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
