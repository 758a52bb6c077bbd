#!/usr/bin/env python3
"""Statistics of speedrun record attempts, read from their logs.

  scripts/stats.py [--strict] [--mix] [--target LOSS] [--json] LOG_OR_DIR...
  scripts/stats.py [--strict] [--mix] [--json] --compare OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...

Summary mode prints each run's seed, steps, final validation loss and training time, then over
the runs, in seconds as record READMEs give them: n; the val loss's mean, median, min-max and
sample standard deviation (n-1) with the one-sided one-sample t-test of H1 "mean val loss < LOSS"
(default 3.28, the speedrun's target; a record claim wants p < 0.01); the training time's mean,
median, min-max and standard deviation; and both lists, ready to paste into a README.

Compare mode (--compare) reads two sets of runs, OLD before the lone "--" and NEW after it, and
compares their training times and final val losses with Welch's t-test (unequal variances,
two-sided p-value), saying which set is faster and by how much.

A directory stands for every *.txt file in it (not recursive). A log is the trainer's (or
upstream's): lines such as
  step:1555/1555 val_loss:3.2789 train_time:95168ms step_avg:61.20ms
anywhere in the file (the source code printed at its top, format strings included, never matches:
only whole lines of numbers in exactly this form count), and, in this trainer's logs, the header
lines "seed: N" and "source_hash: H" at the start of a line. A run is finished when it has a
val_loss line at the total step N of step:k/N, or when it ended normally (its "peak memory" line)
right after a validation at its last step (a run stopped by --max-steps); its final val loss and
training time are that line's.

A log that ends with a "fail: ..." line is a failed run (the trainer writes every fatal error and
a stopping signal there); one ending with neither "fail:" nor "finished:" was killed outright.

A resumed run (header line "resumes: RUN_ID step N") is one run made of segments: its training
time is its own log's plus, for each earlier segment (found among the logs given by its "run_id:"
header line), the training time at the checkpoint the next segment resumed from (its "saved
checkpoint DIR step:N train_time:Tms" line). A run whose earlier segments are not all among the
logs given is skipped, naming the missing run ids (its last segment's time alone would understate
it); the earlier segments are not runs of their own.

What is counted:
  - a file that is not a log, or whose run stopped before its first validation, is listed and
    skipped; so is an unfinished run (no validation at its last step), a failed one, a diverged one
    (val loss nan or inf), or a resumed run with a segment missing. With --strict each of these is
    an error instead.
  - identical runs are counted once, with a warning: logs with the same step and validation lines
    (a copied log), or with the same source_hash, seed and val losses (the trainer is
    deterministic: a rerun of a seed adds no evidence). Upstream's logs have no seed or hash.
  - the runs of a set must share their schedule (steps) and source_hash (logs without one count as
    one more source): mixed runs are refused unless --mix is given.
  - a missing file, a directory without *.txt files, or no logs at all: an error.
Exit status: 0 done (at least two runs counted in each set); 1 an error above, or fewer than two
runs left to count; 2 bad arguments.

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
TRAIN_LOSS_LINE = re.compile(r"step:(\d+)/(\d+) train_loss:(-?(?:\d+\.\d+|nan|inf))")
# The trainer's closing lines (upstream's has the first): the run ended normally.
END_LINES = ("peak memory allocated:", "finished: ")
# A fatal error or a stopping signal, the last line of a failed run's log.
FAIL_LINE = re.compile(r"fail: (.*)")
# A checkpoint and the training time up to it: where a resumed run's next segment starts.
SAVED_LINE = re.compile(r"saved checkpoint (.*) step:(\d+) train_time:(\d+)ms")
# This trainer's header lines, at the start of a line (the source dump holds the words only
# indented or quoted). Upstream's logs have none.
HEADER_LINES = {"seed": re.compile(r"seed: (\d+)"), "source_hash": re.compile(r"source_hash: ([0-9a-f]{16})"),
                "header_run_id": re.compile(r"run_id: (\S+)"), "resumes": re.compile(r"resumes: (\S+) step (\d+)")}


class LogError(Exception):
    """A problem that stops the script, with the message for the user."""


class NotALog(LogError):
    """A file that holds no run: skipped with its reason (an error under --strict)."""


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
    """What one log says: its header, every validation point, the total step count, the result."""

    def __init__(self, path):
        self.path = path
        self.run_id = os.path.splitext(os.path.basename(path))[0]
        self.seed = None          # the "seed:" header line (this trainer's logs only)
        self.source_hash = None   # the "source_hash:" header line
        self.total = None         # N of step:k/N
        self.val_points = []      # (step, val_loss, train_time_ms), in file order
        self.train_losses = []    # (step, train_loss) of "step:k/N train_loss:X" lines
        self.last_train_step = None
        self.ended = False        # the trainer's closing line came after the last step line
        self.step_lines = []      # every step line's text, in order: a copied log has the same
        self.header_run_id = None  # the "run_id:" header line (the file name's stem stands in without one)
        self.resumes = None       # "RUN_ID step N" of a resumed run's header
        self.failed = None        # the "fail:" line's message
        self.saves = {}           # step -> training time (ms) at its checkpoint
        self.earlier_ms = 0       # a resumed run: the training time of its earlier segments
        self.segments = []        # a resumed run: the run ids of its earlier segments, first first

    @property
    def final(self):
        """(val_loss, train_time_ms) of the run's end, or None when it did not finish: the last
        validation at the total step, or, when the run ended normally (stopped by --max-steps),
        a validation at its last trained step."""
        for step, loss, time_ms in reversed(self.val_points):
            if step == self.total:
                return loss, time_ms + self.earlier_ms
        step, loss, time_ms = self.val_points[-1]
        if self.ended and step == (self.last_train_step or 0):
            return loss, time_ms + self.earlier_ms
        return None

    @property
    def steps(self):
        """The step of the final validation, over the total: "1555/1555", or "6/34" for a run
        stopped by --max-steps; runs with different values have different schedules."""
        return f"{self.val_points[-1][0] if self.final else '?'}/{self.total}"

    def problem(self):
        """None for a finished run with a finite final loss, else why it cannot be counted."""
        if self.failed is not None:
            return f"failed: {self.failed}"
        final = self.final
        if final is None:
            last = self.val_points[-1][0]
            trained = f", training reached step {self.last_train_step}" if self.last_train_step is not None else ""
            return f"incomplete: last validation at step {last} of {self.total}{trained}"
        if not math.isfinite(final[0]):
            return f"diverged: final val loss {final[0]}"
        return None


NO_VAL_LINE = "no val_loss line (not a training log, or the run stopped before its first validation)"


def parse_log(path, lenient=False):
    """Reads one log. Raises NotALog if it holds no validation line (unless lenient: a resumed run's
    earlier segment may have none) or its step lines disagree, LogError if it cannot be read."""
    run = Run(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror}")
    for number, line in enumerate(lines, 1):
        key = next((k for k, pattern in HEADER_LINES.items() if pattern.fullmatch(line)), None)
        if key:
            value = line.split(": ", 1)[1]
            setattr(run, key, int(value) if key == "seed" else value)
            continue
        if m := FAIL_LINE.fullmatch(line):
            run.failed = m.group(1)
            continue
        if m := SAVED_LINE.fullmatch(line):
            run.saves[int(m.group(2))] = int(m.group(3))
            continue
        line = line.strip()
        if line.startswith(END_LINES):
            run.ended = bool(run.step_lines)
            continue
        m = VAL_LINE.fullmatch(line)
        if m:
            step, total = int(m.group(1)), int(m.group(2))
            run.val_points.append((step, float(m.group(3)), int(m.group(4))))
        elif m := TRAIN_LINE.fullmatch(line):
            step, total = int(m.group(1)), int(m.group(2))
            run.last_train_step = step
        elif m := TRAIN_LOSS_LINE.fullmatch(line):
            step, total = int(m.group(1)), int(m.group(2))
            run.train_losses.append((step, float(m.group(3))))
        else:
            continue
        run.step_lines.append(line)
        run.ended = False
        if run.total is None:
            run.total = total
        elif total != run.total:
            raise NotALog(f"{path}:{number}: total step count {total} differs from the {run.total} of earlier lines")
    if run.header_run_id:
        run.run_id = run.header_run_id
    if not run.val_points and run.failed is None and not lenient:
        raise NotALog(f"{path}: {NO_VAL_LINE}")
    return run


def join_segments(run, by_id):
    """Adds a resumed run's earlier segments' training time (run.earlier_ms, run.segments); returns
    None, or why the run cannot be counted (a segment's log missing or without its checkpoint's time)."""
    resumes, seen = run.resumes, {run.run_id}
    while resumes:
        rid, step = resumes.rsplit(" step ", 1)
        step = int(step)
        earlier = by_id.get(rid)
        if rid in seen:
            return f"resumed run: its chain of segments returns to run {rid}"
        if earlier is None:
            return (f"resumed run: the log of its earlier segment, run {rid} (its steps up to {step}), is not among the "
                    f"logs given: its training time cannot be counted (give that log too)")
        if step not in earlier.saves:
            return (f"resumed run: the log of its earlier segment {earlier.path} has no 'saved checkpoint ... step:{step} "
                    f"train_time:' line: its training time up to step {step} is unknown")
        seen.add(rid)
        run.earlier_ms += earlier.saves[step]
        run.segments.insert(0, rid)
        resumes = earlier.resumes
    return None


def expand(paths):
    """The log files named: files as given, directories as their *.txt files, each once."""
    files, seen = [], set()
    for path in paths:
        if os.path.isdir(path):
            found = sorted(f for f in glob.glob(os.path.join(glob.escape(path), "*.txt")) if os.path.isfile(f))
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


def read_runs(paths, strict):
    """Parses the logs. Returns (finished runs, [(path, why skipped)]); under strict a skipped file
    raises LogError instead."""
    runs, skipped, parsed = [], [], []
    for path in expand(paths):
        try:
            run = parse_log(path, lenient=True)
            parsed.append((path, run, None) if run.val_points or run.failed is not None else (path, run, NO_VAL_LINE))
        except NotALog as e:
            parsed.append((path, None, str(e).removeprefix(f"{path}: ")))
    by_id = {run.run_id: run for _, run, _ in parsed if run is not None}
    for _, run, _ in parsed:  # join each resumed run's segments first: they are not runs of their own
        if run is not None and run.resumes:
            run.segment_problem = join_segments(run, by_id)
        elif run is not None:
            run.segment_problem = None
    later = {}
    for _, run, _ in parsed:
        if run is not None and run.resumes and run.segment_problem is None:
            for rid in run.segments:
                later[rid] = run.run_id
    for path, run, why in parsed:
        if run is not None and run.run_id in later:
            why = f"an earlier segment of the resumed run {later[run.run_id]} (counted with it)"
        elif run is not None and why is None:
            why = run.segment_problem or run.problem()
        if why is None:
            runs.append(run)
        elif strict:
            raise LogError(f"{path}: {why} (--strict)")
        else:
            skipped.append((path, why))
    return runs, skipped


def duplicate_reason(run, earlier):
    """Why `run` repeats `earlier` (its evidence is already counted), or None."""
    if run.step_lines == earlier.step_lines:
        return "the same step and validation lines (a copied log)"
    if (run.source_hash is not None and run.seed is not None and run.source_hash == earlier.source_hash
            and run.seed == earlier.seed and [p[1] for p in run.val_points] == [p[1] for p in earlier.val_points]):
        return f"the same source_hash, seed {run.seed} and val losses (the trainer is deterministic: a rerun)"
    return None


def drop_duplicates(runs):
    """Returns (the runs each counted once, [(run, the earlier run it repeats, why)])."""
    kept, repeats = [], []
    for run in runs:
        for earlier in kept:
            why = duplicate_reason(run, earlier)
            if why:
                repeats.append((run, earlier, why))
                break
        else:
            kept.append(run)
    return kept, repeats


def mixture(runs):
    """A message naming how the runs differ in schedule or source_hash, or None when they agree."""
    problems = []
    for what, key in (("schedules (final step/total steps)", lambda r: r.steps),
                      ("sources (source_hash)", lambda r: r.source_hash or "none (not this trainer's log)")):
        groups = {}
        for r in runs:
            groups.setdefault(key(r), []).append(r.run_id)
        if len(groups) > 1:
            parts = "; ".join(f"{value}: {', '.join(ids)}" for value, ids in groups.items())
            problems.append(f"different {what}: {parts}")
    return "; ".join(problems) or None


def counted_runs(paths, strict, mix, label=""):
    """The runs a set's statistics count: finished, each once, of one schedule and source. What is
    left out is reported on stderr; a mixture is an error unless mix."""
    runs, skipped = read_runs(paths, strict)
    for path, why in skipped:
        warn(f"{path}: skipped: {why}")
    runs, repeats = drop_duplicates(runs)
    for run, earlier, why in repeats:
        warn(f"{run.path}: duplicate of {earlier.path}: {why}; counted once")
    if not runs:
        raise LogError(f"no finished runs{label} among the logs given")
    mixed = mixture(runs)
    if mixed and not mix:
        raise LogError(f"runs{label} are not comparable: {mixed}. Give --mix to pool them anyway")
    if mixed:
        warn(f"pooling runs{label} (--mix): {mixed}")
    return runs, skipped, repeats


def warn(message):
    print(f"stats.py: warning: {message}", file=sys.stderr)


# ---- reports ----

def seconds(ms):
    return ms / 1000.0


def describe(values):
    """mean, median, min, max and sample std (None for one value) of a list."""
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def summarize(runs, target=None, skipped=(), repeats=()):
    """The numbers of summary mode, as a dict (what --json prints)."""
    losses = [r.final[0] for r in runs]
    times = [seconds(r.final[1]) for r in runs]
    out = {
        "runs": [{"run_id": r.run_id, "path": r.path, "seed": r.seed, "source_hash": r.source_hash,
                  "steps": r.steps, "val_loss": r.final[0], "train_time_s": seconds(r.final[1])} for r in runs],
        "n": len(runs),
        "val_loss": describe(losses),
        "train_time_s": describe(times),
        "skipped": [{"path": path, "why": why} for path, why in skipped],
        "duplicates": [{"path": r.path, "duplicate_of": e.path, "why": why} for r, e, why in repeats],
    }
    if target is not None:
        test = one_sample_t_test_less(losses, target)
        out["target"] = target
        out["t"], out["df"], out["p"] = test if test else (None, None, None)
    return out


def format_p(p):
    """As record READMEs print it (p=%.4f), with two significant digits below 0.0001."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def print_runs(runs):
    width = max(len("run"), *(len(r.run_id) for r in runs))
    steps_width = max(len("steps"), *(len(r.steps) for r in runs))
    print(f"{'run':<{width}}  {'seed':>6}  {'steps':>{steps_width}}  {'val_loss':>8}  {'time_s':>8}")
    for r in runs:
        loss, time_ms = r.final
        seed = "-" if r.seed is None else str(r.seed)
        print(f"{r.run_id:<{width}}  {seed:>6}  {r.steps:>{steps_width}}  {loss:8.4f}  {seconds(time_ms):8.3f}")


def spread_text(d, fmt, unit="", mean_fmt=None):
    """mean_fmt: one more digit for the mean and std than the values have."""
    mean_fmt = mean_fmt or fmt
    std = "n/a (one run)" if d["std"] is None else f"{d['std']:{mean_fmt}}{unit}"
    return (f"mean {d['mean']:{mean_fmt}}{unit}, median {d['median']:{fmt}}{unit}, "
            f"min-max {d['min']:{fmt}}-{d['max']:{fmt}}{unit}, std {std}")


def print_summary(s):
    runs = s["runs"]
    print(f"n = {s['n']} ({runs[0]['steps']} steps each)")
    print(f"val_loss: {spread_text(s['val_loss'], '.4f', mean_fmt='.5f')}")
    if "target" in s:
        if s["t"] is None:
            why = "one run" if s["n"] < 2 else "no spread"
            print(f"  one-sided t-test, H1: mean < {s['target']}: p n/a ({why})")
        else:
            print(f"  one-sided t-test, H1: mean < {s['target']}: p={format_p(s['p'])} "
                  f"(t = {s['t']:.3f}, df = {s['df']})")
    print(f"time: {spread_text(s['train_time_s'], '.3f', ' s')}")
    print("val_losses = [" + ", ".join(f"{r['val_loss']:.4f}" for r in runs) + "]")
    print("times = [" + ", ".join(f"{r['train_time_s']:.3f}" for r in runs) + "]")


def compare(old, new):
    """The numbers of compare mode, as a dict (what --json prints). old, new: (runs, skipped, repeats)."""
    out = {"old": summarize(*old[:1], None, *old[1:]), "new": summarize(*new[:1], None, *new[1:])}
    for key, value in (("train_time_s", lambda r: seconds(r.final[1])), ("val_loss", lambda r: r.final[0])):
        a = [value(r) for r in old[0]]
        b = [value(r) for r in new[0]]
        diff = statistics.fmean(b) - statistics.fmean(a)
        test = welch_t_test(a, b)
        out[key] = {"difference": diff, "relative": diff / statistics.fmean(a),
                    "t": test[0] if test else None, "df": test[1] if test else None,
                    "p": test[2] if test else None}
    return out


def print_compare(c):
    for name in ("old", "new"):
        s = c[name]
        loss, time = s["val_loss"], s["train_time_s"]
        print(f"{name}: n = {s['n']}, val_loss mean {loss['mean']:.5f} std {loss['std']:.5f}, "
              f"time mean {time['mean']:.3f} s std {time['std']:.3f} s")
    for key, name, fmt, unit in (("train_time_s", "time", "+.3f", " s"), ("val_loss", "val_loss", "+.4f", "")):
        d = c[key]
        test = "n/a (no spread)" if d["t"] is None else \
            f"t = {d['t']:.3f}, df = {d['df']:.2f}, two-sided p={format_p(d['p'])}"
        print(f"{name}: new - old = {d['difference']:{fmt}}{unit} ({100 * d['relative']:+.2f}%); Welch {test}")
    d = c["train_time_s"]
    if d["difference"] == 0:
        print("new and old take the same mean time")
    else:
        faster, slower = ("new", "old") if d["difference"] < 0 else ("old", "new")
        amount = abs(d["difference"])
        base = c[slower]["train_time_s"]["mean"]
        print(f"{faster} is faster by {amount:.3f} s ({100 * amount / base:.2f}% less time than {slower})")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="stats.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, usage=argparse.SUPPRESS)
    p.add_argument("logs", nargs="*", metavar="LOG_OR_DIR")
    p.add_argument("--compare", action="store_true", help="compare OLD... -- NEW... with Welch's t-test")
    p.add_argument("--strict", action="store_true",
                   help="a file that is not a finished run (not a log, incomplete, diverged) is an error, not a warning")
    p.add_argument("--mix", action="store_true",
                   help="pool runs of different schedules or source hashes (a warning, not an error)")
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
            old = counted_runs(args.logs, args.strict, args.mix, " in the old set")
            new = counted_runs(args.new, args.strict, args.mix, " in the new set")
            for name, (runs, _, _) in (("old", old), ("new", new)):
                if len(runs) < 2:
                    raise LogError(f"Welch's t-test needs at least 2 finished runs in each set; {name} has {len(runs)}")
            result = compare(old, new)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                for name, (runs, _, _) in (("old", old), ("new", new)):
                    print(f"{name}:")
                    print_runs(runs)
                print()
                print_compare(result)
        else:
            runs, skipped, repeats = counted_runs(args.logs, args.strict, args.mix)
            result = summarize(runs, args.target, skipped, repeats)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                print_runs(runs)
                print()
                print_summary(result)
            if len(runs) < 2:
                raise LogError(f"the t-test needs at least 2 finished runs; {len(runs)} counted")
    except LogError as e:
        print(f"stats.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
