#!/usr/bin/env python3
"""Statistics of speedrun record attempts, read from their logs.

  scripts/stats.py [--strict] [--mix] [--target LOSS] [--json] LOG_OR_DIR...
  scripts/stats.py [--strict] [--mix] [--json] --compare OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...
  scripts/stats.py [--strict] [--mix] [--json] --paired OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...
  scripts/stats.py --ab DIR [--partial] [--markdown] [--target LOSS] [--z-sigma SIGMA] [--json]

Summary mode prints each run's seed, steps, final validation loss and training time, then over
the runs, in seconds as record READMEs give them: n; the val loss's mean, median, min-max and
sample standard deviation (n-1) with the one-sided one-sample t-test of H1 "mean val loss < LOSS"
(default 3.28, the speedrun's target; a record claim wants p < 0.01); the training time's mean,
median, min-max and standard deviation; and both lists, ready to paste into a README.

Compare mode (--compare) reads two sets of runs, OLD before the lone "--" and NEW after it, and
compares their training times and final val losses with Welch's t-test (unequal variances,
two-sided p-value), saying which set is faster and by how much. Paired mode (--paired) matches the
runs of the two sets by their seed lines (every seed in both sets, once) and tests the differences
NEW - OLD of time and of val loss with the paired t-test and its 95% confidence interval, beside
Welch's test of the same values taken as unpaired.

A/B mode (--ab DIR) reads the folder of scripts/run_ab.sh: its manifest (the two arms' revisions,
commits and source hashes, the seeds, the runs in the order they ran: pairs of one A and one B run
of one seed, in blocks ABBA BAAB ...) and the logs in DIR/A and DIR/B. It checks the plan is
balanced (each arm first in half of the pairs) and complete (every planned log finished, of its
seed and its arm's source_hash, none a copy of another); anything else is an error naming what is
wrong or missing (--partial: count the complete pairs of an interrupted series). It prints each
arm's summary, then B - A: the time difference paired within each pair, with its paired t-test
and 95% confidence interval, and Welch's test as if unpaired; the val loss difference paired by
seed; the order effect (how much longer the second run of a pair takes than the first, which
the balanced order cancels from the difference); and the noise floor, A against A (the later
minus the earlier A run of each block of four) and B against B. --markdown also writes
DIR/statistics.md (the command, revisions, machine, per-arm tables, the lists to paste, the
paired results and the plot DIR/ab.png from plot_logs.py, which needs matplotlib).

--z-sigma SIGMA adds track 3's one-sided z-test to each summary: z = (target - mean) sqrt(n) / SIGMA,
passed when (target - mean) sqrt(n) >= 0.004 (track 3 takes SIGMA = 0.0013).

A directory stands for every *.txt file in it (not recursive). A log is the trainer's (or
upstream's): lines such as
  step:1555/1555 val_loss:3.2789 train_time:95168ms step_avg:61.20ms
anywhere in the file (the source code printed at its top, format strings included, never matches:
only whole lines of numbers in exactly this form count), and, in this trainer's logs, the header
lines "seed: N", "source_hash: H" and "preset: NAME" at the start of a line (older logs: the
preset is the "command:" line's --preset, or "default"; upstream's logs name none). A run is
finished when it has a val_loss line at the total step N of step:k/N, or when it ended normally
(its "peak memory" line) right after a validation at its last step (a run stopped by
--max-steps); its final val loss and training time are that line's.

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
  - the runs of a set must share their preset, schedule (steps) and source_hash (logs without one
    count as one more source): mixed runs are refused unless --mix is given.
  - a missing file, a directory without *.txt files, or no logs at all: an error.
Exit status: 0 done (at least two runs counted in each set, or two complete pairs); 1 an error
above, or fewer than two runs (pairs) left to count; 2 bad arguments.

The Student t distribution is computed here (regularized incomplete beta function by its
continued fraction; its quantiles by bisection), so only the standard library is needed.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
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
                "header_run_id": re.compile(r"run_id: (\S+)"), "resumes": re.compile(r"resumes: (\S+) step (\d+)"),
                "preset_line": re.compile(r"preset: (\S+)"), "command": re.compile(r"command: (.*)")}
# The trainer's --preset NAME in a command line (logs written before the "preset:" header line).
PRESET_FLAG = re.compile(r"(?:^|\s)--preset(?:\s+|=)(\S+)")


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
        self.preset_line = None   # the "preset:" header line (the preset's own name, e.g. r89 for --preset record)
        self.command = None       # the "command:" header line
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
    def preset(self):
        """The preset the run trained: its "preset:" header line; in older logs the command line's --preset,
        or "default" (the trainer's default preset when it ran); None for a log that is not this trainer's
        (upstream's: no header lines)."""
        if self.preset_line is not None:
            return self.preset_line
        if self.command is not None:
            flags = PRESET_FLAG.findall(self.command)
            return flags[-1] if flags else "default"
        return "default" if self.source_hash is not None else None

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
    for what, key in (("presets", lambda r: r.preset or "none (not this trainer's log)"),
                      ("schedules (final step/total steps)", lambda r: r.steps),
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


def summarize(runs, target=None, skipped=(), repeats=(), z_sigma=None):
    """The numbers of summary mode, as a dict (what --json prints). z_sigma: also track 3's z-test."""
    losses = [r.final[0] for r in runs]
    times = [seconds(r.final[1]) for r in runs]
    out = {
        "runs": [{"run_id": r.run_id, "path": r.path, "seed": r.seed, "source_hash": r.source_hash,
                  "preset": r.preset, "steps": r.steps, "val_loss": r.final[0],
                  "train_time_s": seconds(r.final[1])} for r in runs],
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
        if z_sigma is not None:
            out["z_test"] = one_sample_z_test_less(losses, target, z_sigma)
    return out


def format_p(p):
    """As record READMEs print it (p=%.4f), with two significant digits below 0.0001."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def print_runs(runs):
    """One line per run; a preset column when any run is this trainer's (upstream's logs name none)."""
    width = max(len("run"), *(len(r.run_id) for r in runs))
    steps_width = max(len("steps"), *(len(r.steps) for r in runs))
    presets = any(r.preset for r in runs)
    preset_width = max([len("preset")] + [len(r.preset or "-") for r in runs])
    preset_head = f"  {'preset':<{preset_width}}" if presets else ""
    print(f"{'run':<{width}}  {'seed':>6}{preset_head}  {'steps':>{steps_width}}  {'val_loss':>8}  {'time_s':>8}")
    for r in runs:
        loss, time_ms = r.final
        seed = "-" if r.seed is None else str(r.seed)
        preset = f"  {r.preset or '-':<{preset_width}}" if presets else ""
        print(f"{r.run_id:<{width}}  {seed:>6}{preset}  {r.steps:>{steps_width}}  {loss:8.4f}  {seconds(time_ms):8.3f}")


def spread_text(d, fmt, unit="", mean_fmt=None):
    """mean_fmt: one more digit for the mean and std than the values have."""
    mean_fmt = mean_fmt or fmt
    std = "n/a (one run)" if d["std"] is None else f"{d['std']:{mean_fmt}}{unit}"
    return (f"mean {d['mean']:{mean_fmt}}{unit}, median {d['median']:{fmt}}{unit}, "
            f"min-max {d['min']:{fmt}}-{d['max']:{fmt}}{unit}, std {std}")


def print_summary(s):
    runs = s["runs"]
    preset = f"preset {runs[0]['preset']}, " if runs[0]["preset"] else ""
    print(f"n = {s['n']} ({preset}{runs[0]['steps']} steps each)")
    print(f"val_loss: {spread_text(s['val_loss'], '.4f', mean_fmt='.5f')}")
    if "target" in s:
        if s["t"] is None:
            why = "one run" if s["n"] < 2 else "no spread"
            print(f"  one-sided t-test, H1: mean < {s['target']}: p n/a ({why})")
        else:
            print(f"  one-sided t-test, H1: mean < {s['target']}: p={format_p(s['p'])} "
                  f"(t = {s['t']:.3f}, df = {s['df']})")
    if "z_test" in s:
        z = s["z_test"]
        print(f"  track 3 z-test (sigma {z['sigma']}): (target - mean) x sqrt(n) = {z['margin']:.4f}, "
              f"{'passes' if z['passes'] else 'fails'} >= {Z_MARGIN}; z = {z['z']:.3f}, one-sided p={format_p(z['p'])}")
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


# ---- A/B comparisons: two revisions run interleaved on one node (scripts/run_ab.sh) ----

CONFIDENCE = 0.95  # the level of the confidence intervals
ARMS = ("A", "B")
AB_MANIFEST = "manifest"
MANIFEST_KEYS = ("command", "A", "A_commit", "A_source_hash", "B", "B_commit", "B_source_hash", "seeds", "order")
# Track 3 (fewest steps) takes the val loss's run-to-run sigma as known and accepts a set of runs
# when (target - mean) * sqrt(n) >= 0.004: a one-sided z-test whose bar is z >= 0.004 / sigma.
Z_MARGIN = 0.004
# This trainer's environment lines (runtime/log.h): the device line, one gpu line per GPU as
# nvidia-smi reports it at the start (none on the CPU build), and the library versions.
ENV_LINE = re.compile(r"(command|date_utc|hosts|world_size|device|gpu|cuda_driver|cuda_runtime|cublaslt|nccl): (.+)")


def student_t_quantile(q, df):
    """The t with P(T <= t) = q for 0 < q < 1: bisection on student_t_cdf, which is increasing."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile needs 0 < q < 1, got {q}")
    lo, hi = -1.0, 1.0
    while student_t_cdf(lo, df) > q:
        lo *= 2.0
    while student_t_cdf(hi, df) < q:
        hi *= 2.0
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # no double left between them
            return mid
        if student_t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid


def mean_difference_test(differences, level=CONFIDENCE):
    """Student's one-sample t-test of H0 "mean difference 0" (two-sided p) and the confidence
    interval of the mean: the paired t-test when each difference is one pair's. t, p and the
    interval need two differences; t and p also need some spread."""
    n = len(differences)
    out = {"n": n, "differences": list(differences), "mean": statistics.fmean(differences) if n else None,
           "std": None, "t": None, "df": n - 1 if n > 1 else None, "p": None, "ci": None, "level": level}
    if n < 2:
        return out
    sd = statistics.stdev(differences)
    se = sd / math.sqrt(n)
    half = student_t_quantile(0.5 + level / 2, n - 1) * se
    out.update(std=sd, ci=[out["mean"] - half, out["mean"] + half])
    if se > 0:
        out["t"] = out["mean"] / se
        out["p"] = 2.0 * student_t_upper_tail(abs(out["t"]), n - 1)
    return out


def welch_result(old, new):
    """welch_t_test as a dict, with the difference of the means (new - old)."""
    test = welch_t_test(old, new)
    return {"difference": statistics.fmean(new) - statistics.fmean(old),
            "t": test[0] if test else None, "df": test[1] if test else None, "p": test[2] if test else None}


def one_sample_z_test_less(values, mu0, sigma):
    """Track 3's test of H1 "mean < mu0" with a known sigma: z = (mu0 - mean) sqrt(n) / sigma, one-sided
    p; it passes when (mu0 - mean) sqrt(n) >= Z_MARGIN."""
    margin = (mu0 - statistics.fmean(values)) * math.sqrt(len(values))
    z = margin / sigma
    return {"sigma": sigma, "margin": margin, "z": z, "p": 0.5 * math.erfc(z / math.sqrt(2.0)),
            "passes": margin >= Z_MARGIN}


class PlannedRun:
    """One run of the manifest: its place in the series, arm, seed and log (relative to the folder)."""

    def __init__(self, position, arm, seed, log):
        self.position, self.arm, self.seed, self.log = position, arm, seed, log
        self.run = None   # the parsed log, when it finished
        self.why = None   # else why it cannot be counted

    @property
    def pair(self):
        return (self.position - 1) // 2

    @property
    def block(self):
        return (self.position - 1) // 4

    def describe(self):
        return f"run {self.position} ({self.arm}, seed {self.seed}, {self.log})"


class AbPlan:
    """run_ab.sh's manifest: "key: value" lines (the command, each arm's revision, commit and
    source_hash, the seeds, the block order) and "run: POSITION ARM SEED LOG" lines in the order
    the runs were made."""

    def __init__(self, directory):
        self.dir = directory
        self.path = os.path.join(directory, AB_MANIFEST)
        self.fields = {}
        self.runs = []

    def arm_label(self, arm):
        return f"{arm} ({self.fields[arm]})"


def read_ab_plan(directory):
    plan = AbPlan(directory)
    if not os.path.isdir(directory):
        raise LogError(f"{directory}: no such directory")
    try:
        with open(plan.path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LogError(f"{plan.path}: cannot read the manifest ({e.strerror}): "
                       f"{directory} is not an A/B folder written by scripts/run_ab.sh")
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition(": ")
        if not sep:
            raise LogError(f"{plan.path}:{number}: not a 'key: value' line: {line!r}")
        if key != "run":
            plan.fields[key] = value
            continue
        parts = value.split(" ")
        if len(parts) != 4 or not parts[0].isdigit() or parts[1] not in ARMS or not parts[2].isdigit():
            raise LogError(f"{plan.path}:{number}: a run line is 'run: POSITION A|B SEED LOG', got {line!r}")
        plan.runs.append(PlannedRun(int(parts[0]), parts[1], int(parts[2]), parts[3]))
    missing = [k for k in MANIFEST_KEYS if k not in plan.fields]
    if missing:
        raise LogError(f"{plan.path}: the manifest has no {', '.join(missing)} line")
    if not plan.runs:
        raise LogError(f"{plan.path}: the manifest plans no run")
    return plan


def block_order(runs):
    """"ABBA BAAB ...": the arms in run order, four runs a block."""
    arms = "".join(r.arm for r in runs)
    return " ".join(arms[i:i + 4] for i in range(0, len(arms), 4))


def balance_problems(plan):
    """What makes the manifest's plan other than balanced pairs: runs 2i-1 and 2i are one A and one
    B run of one seed, each pair its own seed, the seed list the manifest's, and each arm first in
    half of the pairs."""
    problems = []
    positions = [r.position for r in plan.runs]
    if positions != list(range(1, len(plan.runs) + 1)):
        problems.append(f"the runs are numbered {positions}, not 1 to {len(plan.runs)} in order")
    if len(plan.runs) % 2:
        problems.append(f"{len(plan.runs)} runs: an odd count cannot be pairs")
    seeds = []
    for first, second in zip(plan.runs[0::2], plan.runs[1::2]):
        if {first.arm, second.arm} != set(ARMS) or first.seed != second.seed:
            problems.append(f"runs {first.position} and {second.position} are not a pair (one A and one B run of "
                            f"one seed): {first.arm} seed {first.seed}, {second.arm} seed {second.seed}")
        seeds.append(first.seed)
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        problems.append(f"seed(s) {', '.join(map(str, repeated))} planned for more than one pair: each pair needs "
                        "its own seed")
    if plan.fields["seeds"].split() != [str(s) for s in seeds]:
        problems.append(f"the seeds line ({plan.fields['seeds']}) differs from the runs' seeds ({' '.join(map(str, seeds))})")
    if plan.fields["order"] != block_order(plan.runs):
        problems.append(f"the order line ({plan.fields['order']}) differs from the runs' ({block_order(plan.runs)})")
    a_first = [r.seed for r in plan.runs[0::2] if r.arm == "A"]
    b_first = [r.seed for r in plan.runs[0::2] if r.arm == "B"]
    if len(a_first) != len(b_first):
        problems.append(f"unbalanced: A runs first in {len(a_first)} pair(s) (seeds {' '.join(map(str, a_first)) or '-'}), "
                        f"B in {len(b_first)}; each arm must go first in half of the pairs")
    return problems


def read_ab_runs(plan):
    """Parses every planned log into its PlannedRun (run or why); returns the problems that make the
    folder unusable whatever --partial says: a log of another seed or another build than the
    manifest's, or a copy of another log."""
    problems = []
    for p in plan.runs:
        path = os.path.join(plan.dir, p.log)
        if not os.path.isfile(path):
            p.why = "no such file"
            continue
        try:
            run = parse_log(path)
            p.why = run.problem()
        except NotALog as e:
            p.why = str(e).removeprefix(f"{path}: ")
            continue
        if run.seed is not None and run.seed != p.seed:
            problems.append(f"{path}: its seed line says {run.seed}, the manifest plans seed {p.seed}")
        expected = plan.fields[f"{p.arm}_source_hash"]
        if run.source_hash != expected:
            problems.append(f"{path}: source_hash {run.source_hash} is not arm {p.arm}'s {expected} "
                            "(a log of another build)")
        if p.why is None:
            p.run = run
    finished = [p for p in plan.runs if p.run]
    for i, p in enumerate(finished):
        for earlier in finished[:i]:
            why = duplicate_reason(p.run, earlier.run) if p.arm == earlier.arm else \
                ("the same step and validation lines (a copied log)" if p.run.step_lines == earlier.run.step_lines else None)
            if why:
                problems.append(f"{p.run.path} repeats {earlier.run.path}: {why}")
                break
    planned = {os.path.normpath(os.path.join(plan.dir, p.log)) for p in plan.runs}
    for arm in ARMS:
        for stray in sorted(glob.glob(os.path.join(glob.escape(os.path.join(plan.dir, arm)), "*.txt"))):
            if os.path.normpath(stray) not in planned:
                warn(f"{stray}: not a run of {plan.path}: left out")
    return problems


def ab_pairs(plan, partial):
    """The pairs whose two runs finished, as (A's PlannedRun, B's, the arm that ran first). An
    incomplete folder is an error naming what is missing, unless partial (an interrupted series):
    then the complete pairs, with a warning."""
    missing = [p for p in plan.runs if not p.run]
    if missing:
        listing = "; ".join(f"{p.describe()}: {p.why}" for p in missing)
        message = f"{plan.dir} is incomplete: {len(missing)} of {len(plan.runs)} planned runs have no finished log: {listing}"
        if not partial:
            raise LogError(message + ". Give --partial to count the complete pairs of an interrupted series")
        warn(message + "; counting the complete pairs (--partial)")
    pairs = []
    for first, second in zip(plan.runs[0::2], plan.runs[1::2]):
        if first.run and second.run:
            a, b = (first, second) if first.arm == "A" else (second, first)
            pairs.append((a, b, first.arm))
    a_first = sum(1 for _, _, arm in pairs if arm == "A")
    if partial and a_first != len(pairs) - a_first:
        warn(f"the complete pairs are unbalanced: A first in {a_first}, B first in {len(pairs) - a_first}")
    return pairs


def order_effect(pairs):
    """How much longer the second run of a pair takes than the first: with d = B - A per pair, half
    the difference between the mean d of the pairs where A ran first and where B ran first (the arm
    difference cancels), tested by Welch's t-test between those two groups."""
    times = [(seconds(b.run.final[1]) - seconds(a.run.final[1]), first) for a, b, first in pairs]
    a_first = [d for d, first in times if first == "A"]
    b_first = [d for d, first in times if first == "B"]
    out = {"a_first": len(a_first), "b_first": len(b_first), "second_minus_first": None, "t": None, "df": None, "p": None}
    if a_first and b_first:
        out["second_minus_first"] = (statistics.fmean(a_first) - statistics.fmean(b_first)) / 2
        test = welch_t_test(b_first, a_first)
        if test:
            out["t"], out["df"], out["p"] = test
    return out


def noise_floor(plan):
    """A against A (and B against B): in every block of four runs (ABBA or BAAB) whose two runs of
    the arm finished, the later one's time minus the earlier one's. Their spread is what this
    machine's timing varies by between runs of one binary."""
    out = {}
    for arm in ARMS:
        blocks = {}
        for p in plan.runs:
            if p.arm == arm:
                blocks.setdefault(p.block, []).append(p)
        differences = [seconds(later.run.final[1]) - seconds(earlier.run.final[1])
                       for earlier, later in blocks.values() if earlier.run and later.run]
        out[arm] = mean_difference_test(differences)
    return out


def read_environment(path):
    """The environment lines of a log (first of each, every gpu line); {} for upstream's logs."""
    env = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = ENV_LINE.fullmatch(line.rstrip("\n"))
            if not m:
                continue
            if m.group(1) == "gpu":
                env.setdefault("gpu", []).append(m.group(2))
            else:
                env.setdefault(m.group(1), m.group(2))
    return env


def arm_environment(runs):
    """Each environment line's distinct values over an arm's runs, in the order first seen."""
    values = {}
    for r in runs:
        for key, value in read_environment(r.path).items():
            value = "; ".join(value) if key == "gpu" else value
            if value not in values.setdefault(key, []):
                values[key].append(value)
    return values


def paired_results(a_runs, b_runs, level=CONFIDENCE):
    """B - A of runs paired in order (by seed): time and val loss, each with the paired t-test and
    its confidence interval, and Welch's test of the same values taken as unpaired."""
    out = {}
    for key, value in (("train_time_s", lambda r: seconds(r.final[1])), ("val_loss", lambda r: r.final[0])):
        a = [value(r) for r in a_runs]
        b = [value(r) for r in b_runs]
        out[key] = {"paired": mean_difference_test([y - x for x, y in zip(a, b)], level), "welch": welch_result(a, b)}
    return out


def analyze_ab(directory, partial=False, target=TARGET_LOSS, z_sigma=None):
    """The numbers of --ab, as a dict (what --json prints)."""
    plan = read_ab_plan(directory)
    problems = balance_problems(plan)
    if problems:
        raise LogError(f"{plan.path}: not a balanced A/B plan: " + "; ".join(problems))
    problems = read_ab_runs(plan)
    if problems:
        raise LogError("; ".join(problems))
    pairs = ab_pairs(plan, partial)
    if len(pairs) < 2:
        raise LogError(f"{directory}: {len(pairs)} complete pair(s): the paired tests need at least 2")
    out = {"dir": directory, "manifest": dict(plan.fields), "block_order": plan.fields["order"],
           "pairs": [{"seed": a.seed, "first": first, "block": a.block + 1,
                      "A": {"log": a.run.path, "val_loss": a.run.final[0], "train_time_s": seconds(a.run.final[1])},
                      "B": {"log": b.run.path, "val_loss": b.run.final[0], "train_time_s": seconds(b.run.final[1])}}
                     for a, b, first in pairs],
           "runs": [{"position": p.position, "block": p.block + 1, "arm": p.arm, "seed": p.seed, "log": p.log,
                     "val_loss": p.run.final[0] if p.run else None,
                     "train_time_s": seconds(p.run.final[1]) if p.run else None, "why": p.why} for p in plan.runs]}
    for i, arm in enumerate(ARMS):
        runs = [pair[i].run for pair in pairs]
        out[arm] = summarize(runs, target, z_sigma=z_sigma)
        out[arm]["environment"] = arm_environment(runs)
    out.update(paired_results([a.run for a, _, _ in pairs], [b.run for _, b, _ in pairs]))
    out["order_effect"] = order_effect(pairs)
    out["noise_floor"] = noise_floor(plan)
    return out


def pair_by_seed(old, new):
    """--paired: the runs of two sets matched by their seed lines, in seed order."""
    by_seed = []
    for name, runs in (("old", old), ("new", new)):
        seeds = {}
        for r in runs:
            if r.seed is None:
                raise LogError(f"{r.path}: no seed line (upstream's logs have none): --paired matches runs by seed")
            if r.seed in seeds:
                raise LogError(f"seed {r.seed} twice in the {name} set ({seeds[r.seed].path}, {r.path}): "
                               "runs are paired by seed")
            seeds[r.seed] = r
        by_seed.append(seeds)
    only = [f"seed {s} only in the {name} set" for name, mine, other in (("old", *by_seed), ("new", *by_seed[::-1]))
            for s in sorted(set(mine) - set(other))]
    if only:
        raise LogError("unpaired runs: " + ", ".join(only) + " (--paired needs the same seeds in both sets)")
    seeds = sorted(by_seed[0])
    return [by_seed[0][s] for s in seeds], [by_seed[1][s] for s in seeds]


def compare_paired(old, new):
    """The numbers of --paired, as a dict. old, new: (runs, skipped, repeats)."""
    a, b = pair_by_seed(old[0], new[0])
    out = {"old": summarize(a, None, *old[1:]), "new": summarize(b, None, *new[1:]), "seeds": [r.seed for r in a]}
    out.update(paired_results(a, b))
    return out


def significance(p, alpha=0.01):
    return "n/a" if p is None else ("significant" if p < alpha else "not significant") + f" at {alpha}"


def ci_text(test, fmt, unit=""):
    if test["ci"] is None:
        return "CI n/a (one pair)"
    lo, hi = test["ci"]
    return f"{100 * test['level']:.0f}% CI [{lo:{fmt}}, {hi:{fmt}}]{unit}"


def paired_text(test, fmt, unit=""):
    """"mean +0.300 s, 95% CI [...], paired t = ..., df = ..., p=..." of mean_difference_test."""
    if test["t"] is None:
        why = "one pair" if test["n"] < 2 else "no spread"
        tail = f"paired t-test n/a ({why})"
    else:
        tail = f"paired t = {test['t']:.3f}, df = {test['df']}, two-sided p={format_p(test['p'])}"
    return f"mean {test['mean']:{fmt}}{unit}, {ci_text(test, fmt, unit)}, {tail}"


def welch_text(w):
    return "Welch n/a (no spread)" if w["t"] is None else \
        f"unpaired (Welch) t = {w['t']:.3f}, df = {w['df']:.2f}, p={format_p(w['p'])}"


def verdict(result, names=("A", "B")):
    """One line: which arm is faster, by how much, and whether the paired test says so at 0.01."""
    t = result["train_time_s"]["paired"]
    a, b = names
    if t["mean"] == 0:
        return f"{a} and {b} take the same mean time"
    faster, slower = (b, a) if t["mean"] < 0 else (a, b)
    return (f"{faster} is faster than {slower} by {abs(t['mean']):.3f} s per run: "
            f"{significance(t['p'])} (paired p={format_p(t['p']) if t['p'] is not None else 'n/a'})")


def print_paired(result, names=("A", "B")):
    a, b = names
    print(f"{b} - {a}, paired ({result['train_time_s']['paired']['n']} pairs):")
    print(f"  time: {paired_text(result['train_time_s']['paired'], '+.3f', ' s')}; "
          f"{welch_text(result['train_time_s']['welch'])}")
    print(f"  val_loss (paired by seed): {paired_text(result['val_loss']['paired'], '+.4f')}; "
          f"{welch_text(result['val_loss']['welch'])}")
    if "order_effect" in result:
        o = result["order_effect"]
        if o["second_minus_first"] is None:
            print(f"  order effect: n/a (A first in {o['a_first']} pair(s), B first in {o['b_first']})")
        else:
            test = "Welch n/a" if o["p"] is None else f"Welch p={format_p(o['p'])}"
            print(f"  order effect: the second run of a pair takes {o['second_minus_first']:+.3f} s more than the "
                  f"first (A first in {o['a_first']} pair(s), B first in {o['b_first']}; {test})")
        for arm in ARMS:
            n = result["noise_floor"][arm]
            diffs = ", ".join(f"{d:+.3f}" for d in n["differences"])
            spread = "std n/a" if n["std"] is None else f"std {n['std']:.3f} s"
            print(f"  noise floor, {arm} against {arm} (later - earlier run of each block): [{diffs}] s, {spread}")
    print(verdict(result, names))


def print_ab(result):
    m = result["manifest"]
    for arm in ARMS:
        print(f"{arm}: {m[arm]} (commit {m[arm + '_commit']}, source_hash {m[arm + '_source_hash']})")
    print(f"block order: {result['block_order']}")
    print(f"{'run':>3}  {'block':>5}  arm  {'seed':>6}  {'val_loss':>8}  {'time_s':>8}")
    for r in result["runs"]:
        numbers = f"{r['val_loss']:8.4f}  {r['train_time_s']:8.3f}" if r["val_loss"] is not None else f"  ({r['why']})"
        print(f"{r['position']:>3}  {r['block']:>5}  {r['arm']:>3}  {r['seed']:>6}  {numbers}")
    for arm in ARMS:
        print()
        print(f"{arm}:")
        print_summary(result[arm])
    print()
    print_paired(result)


def table(rows):
    """A markdown table from a header row and the rows under it."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def machine_rows(result):
    """The environment table's rows: one a line kind, a column per arm."""
    def value(arm, key, fallback="-"):
        values = result[arm]["environment"].get(key)
        return "; ".join(values) if values else fallback

    def gpus(arm):
        lines = result[arm]["environment"].get("gpu")
        if not lines:
            return f"none reported by nvidia-smi; device: {value(arm, 'device')}"
        counts = sorted({len(line.split("; ")) for line in lines})
        return f"{'/'.join(map(str, counts))} x {', '.join(gpu_fields(arm, 1, 2))} (rank 0's node)"

    def gpu_fields(arm, first, last):
        """The distinct values of fields first..last-1 of every gpu line of the arm's runs."""
        lines = result[arm]["environment"].get("gpu") or []
        found = []
        for g in (g.split(", ") for line in lines for g in line.split("; ")):
            if len(g) >= 6 and ", ".join(g[first:last]) not in found:
                found.append(", ".join(g[first:last]))
        return found

    def clocks(arm):
        found = gpu_fields(arm, 3, 6)
        return "; ".join("SM {} (max {}), memory {}".format(*c.split(", ")) for c in found) or "-"

    def drivers(arm):
        return ", ".join(gpu_fields(arm, 2, 3)) or "-"

    rows = [["", "A", "B"]]
    for name, of in (("GPU (model and count)", gpus), ("driver (nvidia-smi)", drivers),
                     ("clocks at the start (nvidia-smi)", clocks),
                     ("CUDA driver / runtime", lambda arm: f"{value(arm, 'cuda_driver')} / {value(arm, 'cuda_runtime')}"),
                     ("cuBLASLt", lambda arm: value(arm, "cublaslt")), ("NCCL", lambda arm: value(arm, "nccl")),
                     ("hosts", lambda arm: value(arm, "hosts")), ("world size", lambda arm: value(arm, "world_size"))):
        rows.append([name, of("A"), of("B")])
    return rows


def ab_markdown(result, plot, plot_note):
    """statistics.md: what upstream's record folders carry, for an A/B comparison."""
    m = result["manifest"]
    out = [f"# {m['B']} against {m['A']}: A/B statistics", "",
           f"Written by `scripts/stats.py --ab {result['dir']} --markdown` from the logs of the interleaved "
           f"series below, {len(result['pairs'])} pairs of runs, in blocks {result['block_order']}.", "",
           "## Command", "", "```", m["command"], "```", ""]
    commands = [result[arm]["environment"].get("command", ["-"])[0] for arm in ARMS]
    out += ["First run of each arm, as its log gives it:", "", "```"] + commands + ["```", ""]
    out += ["## Revisions", "", table([["arm", "revision", "commit", "source_hash", "finished runs"]] +
                                      [[arm, f"`{m[arm]}`", f"`{m[arm + '_commit']}`", f"`{m[arm + '_source_hash']}`",
                                        result[arm]["n"]] for arm in ARMS]), ""]
    out += ["## Machine", "", table(machine_rows(result)), ""]
    out += ["## Runs, in the order they ran", "",
            table([["#", "block", "arm", "seed", "val_loss", "time (s)"]] +
                  [[r["position"], r["block"], r["arm"], r["seed"],
                    f"{r['val_loss']:.4f}" if r["val_loss"] is not None else f"({r['why']})",
                    f"{r['train_time_s']:.3f}" if r["train_time_s"] is not None else "-"] for r in result["runs"]]), ""]
    rows = [["", "A", "B"], ["n"] + [result[arm]["n"] for arm in ARMS]]
    for key, name, fmt, mean_fmt in (("val_loss", "val_loss", ".4f", ".5f"), ("train_time_s", "time (s)", ".3f", ".4f")):
        d = [result[arm][key] for arm in ARMS]
        rows += [[f"{name} mean"] + [f"{x['mean']:{mean_fmt}}" for x in d],
                 [f"{name} median"] + [f"{x['median']:{fmt}}" for x in d],
                 [f"{name} min-max"] + [f"{x['min']:{fmt}}-{x['max']:{fmt}}" for x in d],
                 [f"{name} std"] + ["n/a" if x["std"] is None else f"{x['std']:{mean_fmt}}" for x in d]]
    target = result["A"]["target"]
    rows.append([f"p, one-sided t-test of mean val_loss < {target}"] +
                ["n/a" if result[arm]["p"] is None else format_p(result[arm]["p"]) for arm in ARMS])
    if "z_test" in result["A"]:
        rows.append([f"track 3 z-test (sigma {result['A']['z_test']['sigma']}): (target - mean) x sqrt(n), z, p"] +
                    [f"{z['margin']:.4f} ({'passes' if z['passes'] else 'fails'} >= {Z_MARGIN}), z = {z['z']:.2f}, "
                     f"p={format_p(z['p'])}" for z in (result[arm]["z_test"] for arm in ARMS)])
    out += ["## Per arm", "", table(rows), ""]
    for arm in ARMS:
        s = result[arm]
        out += [f"{arm} ({m[arm]}):", "", "```",
                "val_losses = [" + ", ".join(f"{r['val_loss']:.4f}" for r in s["runs"]) + "]",
                "times = [" + ", ".join(f"{r['train_time_s']:.3f}" for r in s["runs"]) + "]", "```", ""]
    o = result["order_effect"]
    order = "n/a" if o["second_minus_first"] is None else \
        (f"the second run of a pair takes {o['second_minus_first']:+.3f} s more than the first "
         f"(A first in {o['a_first']} pair(s), B first in {o['b_first']}; "
         f"{'Welch n/a' if o['p'] is None else 'Welch p=' + format_p(o['p'])})")
    out += ["## Paired results (B - A)", "",
            f"- **time**: {paired_text(result['train_time_s']['paired'], '+.3f', ' s')}; "
            f"{welch_text(result['train_time_s']['welch'])}",
            f"- **val_loss, paired by seed**: {paired_text(result['val_loss']['paired'], '+.4f')}; "
            f"{welch_text(result['val_loss']['welch'])}",
            f"- **order effect**: {order}"]
    for arm in ARMS:
        n = result["noise_floor"][arm]
        diffs = ", ".join(f"{d:+.3f}" for d in n["differences"]) or "none"
        spread = "std n/a" if n["std"] is None else f"std {n['std']:.3f} s"
        out.append(f"- **noise floor, {arm} against {arm}** (the later minus the earlier {arm} run of each block): "
                   f"[{diffs}] s, {spread}")
    out += ["", f"**{verdict(result)}.**", "", "## Plot", ""]
    out += [f"![val loss and time of both arms]({plot})" if plot else plot_note, ""]
    return "\n".join(out)


def write_ab_report(result, directory):
    """statistics.md and the plot beside it (plot_logs.py on the two arms). Without matplotlib the
    report says how to draw the plot instead. Returns the report's path."""
    plot = "ab.png"
    m = result["manifest"]
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plot_logs.py"),
               "--group", f"A {m['A']}=" + os.path.join(directory, "A"),
               "--group", f"B {m['B']}=" + os.path.join(directory, "B"),
               "-o", os.path.join(directory, plot), "--title", f"{m['B']} (B) against {m['A']} (A)"]
    drawn = subprocess.run(command, capture_output=True, text=True)
    note = None
    if drawn.returncode != 0:
        warn(f"no plot: {drawn.stderr.strip()}")
        plot = None
        note = (f"No plot: plot_logs.py failed ({drawn.stderr.strip()}). Draw it with "
                f"`.venv/bin/python scripts/plot_logs.py --group A={directory}/A --group B={directory}/B -o {directory}/ab.png`.")
    path = os.path.join(directory, "statistics.md")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(ab_markdown(result, plot, note))
    except OSError as e:
        raise LogError(f"{path}: cannot write the report: {e.strerror}")
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="stats.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, usage=argparse.SUPPRESS)
    p.add_argument("logs", nargs="*", metavar="LOG_OR_DIR")
    p.add_argument("--compare", action="store_true", help="compare OLD... -- NEW... with Welch's t-test")
    p.add_argument("--paired", action="store_true",
                   help="compare OLD... -- NEW... as runs paired by seed (paired t-test), beside Welch's")
    p.add_argument("--ab", metavar="DIR", help="the A/B folder of scripts/run_ab.sh: per arm and paired statistics")
    p.add_argument("--partial", action="store_true",
                   help="with --ab: count the complete pairs of an interrupted series instead of refusing it")
    p.add_argument("--markdown", action="store_true",
                   help="with --ab: also write DIR/statistics.md and its plot DIR/ab.png")
    p.add_argument("--strict", action="store_true",
                   help="a file that is not a finished run (not a log, incomplete, diverged) is an error, not a warning")
    p.add_argument("--mix", action="store_true",
                   help="pool runs of different schedules or source hashes (a warning, not an error)")
    p.add_argument("--target", type=float, default=TARGET_LOSS,
                   help=f"val loss of the one-sided test's null hypothesis (default {TARGET_LOSS})")
    p.add_argument("--z-sigma", type=float, metavar="SIGMA",
                   help=f"also track 3's z-test with this known sigma of the val loss (track 3: 0.0013): "
                        f"passes when (target - mean) x sqrt(n) >= {Z_MARGIN}")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    # "--" separates the two sets of compare mode; split it off before argparse sees it.
    new = None
    if "--" in argv:
        cut = argv.index("--")
        argv, new = argv[:cut], argv[cut + 1:]
    args = p.parse_args(argv)
    if args.z_sigma is not None and not (math.isfinite(args.z_sigma) and args.z_sigma > 0):
        p.error(f"--z-sigma must be a positive number, got {args.z_sigma}")
    if args.compare and args.paired:
        p.error("--compare (Welch) and --paired are two modes: --paired prints Welch's test too")
    two_sets = "--compare" if args.compare else "--paired" if args.paired else None
    if args.ab is not None:
        if two_sets or args.logs or new is not None:
            p.error("--ab DIR reads the A/B folder alone: give no other logs, --compare or --paired")
    elif args.partial or args.markdown:
        p.error("--partial and --markdown go with --ab DIR")
    elif two_sets:
        if new is None or not args.logs or not new:
            p.error(f"{two_sets} needs both sets: {two_sets} OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...")
    elif new is not None:
        p.error('"--" separates the two sets of --compare or --paired; without them give the logs alone')
    elif not args.logs:
        p.error("no logs given: stats.py LOG_OR_DIR...")
    args.new = new
    return args


def run_ab_mode(args):
    result = analyze_ab(args.ab, args.partial, args.target, args.z_sigma)
    if args.markdown:
        result["report"] = write_ab_report(result, args.ab)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print_ab(result)
    if args.markdown:
        print(f"wrote {result['report']}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.ab is not None:
            run_ab_mode(args)
        elif args.compare or args.paired:
            old = counted_runs(args.logs, args.strict, args.mix, " in the old set")
            new = counted_runs(args.new, args.strict, args.mix, " in the new set")
            for name, (runs, _, _) in (("old", old), ("new", new)):
                if len(runs) < 2:
                    test = "The paired t-test" if args.paired else "Welch's t-test"
                    raise LogError(f"{test} needs at least 2 finished runs in each set; {name} has {len(runs)}")
            result = compare_paired(old, new) if args.paired else compare(old, new)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                for name, (runs, _, _) in (("old", old), ("new", new)):
                    print(f"{name}:")
                    print_runs(runs)
                print()
                if args.paired:
                    for name in ("old", "new"):
                        d = result[name]
                        print(f"{name}: n = {d['n']}, val_loss mean {d['val_loss']['mean']:.5f}, "
                              f"time mean {d['train_time_s']['mean']:.3f} s")
                    print_paired(result, ("old", "new"))
                else:
                    print_compare(result)
        else:
            runs, skipped, repeats = counted_runs(args.logs, args.strict, args.mix)
            result = summarize(runs, args.target, skipped, repeats, args.z_sigma)
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
