#!/usr/bin/env python3
"""Offline tests of the record scripts: stats.py (its Student t distribution against closed forms,
a table of critical values and a quadrature of the density; its numbers against the statistics
module and hand-worked examples; compare mode; errors), plot_logs.py, and run_record.sh /
run_many.sh with stub nvidia-smi, make and mpirun on PATH that record how they were called.
Logs are synthetic, written to a temporary directory, each headed by a fake source file full of
the log lines' format strings. Standard library only (the plot test needs matplotlib and is
skipped without it).
"""
import contextlib
import io
import json
import math
import os
import re
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)
import plot_logs  # noqa: E402
import stats  # noqa: E402

BASH = shutil.which("bash") or "/bin/bash"

# The top of a log: the program's source, whose format strings and comments hold log-like text
# that must never be taken for results, then the environment.
FAKE_HEADER = """\
// train_gpt.cu (a stand-in for the source the trainer prints at the top of its log)
static void log_validation(FILE* f, int step, int total, float loss, double ms) {
    fprintf(f, "step:%d/%d val_loss:%.4f train_time:%.0fms step_avg:%.2fms\\n", step, total, loss, ms, ms / step);
}
static void log_step(FILE* f, int step, int total, double ms) {
    fprintf(f, "step:%d/%d train_time:%.0fms step_avg:%.2fms\\n", step, total, ms, ms / step);
}
// A finished run ends like this:
// step:1555/1555 val_loss:2.0000 train_time:1ms step_avg:0.00ms
    print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms")
 * step:1555/1555 val_loss:2.5000 train_time:2ms step_avg:0.01ms (quoted in a block comment)
    print0(r, "seed: %llu\n", seed);  // the header lines' format strings, indented or quoted
  seed: 4242
"source_hash: 0123456789abcdef"
====================================================================================================
Running train_gpt (CUDA 12.8, NCCL 2.27)
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:05:00.0 Off |                    0 |
====================================================================================================
"""


def log_text(final_loss, final_ms, total=1555, stop_at=None, every=250, header="", train_loss=None,
             max_steps=None):
    """A log whose validations fall every `every` steps and at the end, the last one with the
    given loss and time. stop_at: the run breaks off after that training step (incomplete);
    max_steps: it stops normally there (--max-steps), validated and closed. header: lines after the
    source (e.g. "seed: 3\n"); train_loss: an offset, to log "step:k/N train_loss:X" lines too."""
    out = [FAKE_HEADER, header]
    last = stop_at or max_steps or total
    ms_per_step = final_ms / last
    for step in range(0, last + 1):
        t = step * ms_per_step
        if step > 0:
            if train_loss is not None:
                loss = 10.9 - 7.0 * step / total + 0.1 * (step % 3) + train_loss
                out.append(f"step:{step}/{total} train_loss:{loss:.4f}\n")
            out.append(f"step:{step}/{total} train_time:{t:.0f}ms step_avg:{t / step:.2f}ms\n")
        if step == total or step == max_steps:
            loss_text = final_loss if isinstance(final_loss, str) else f"{final_loss:.4f}"
            out.append(f"step:{step}/{total} val_loss:{loss_text} train_time:{final_ms}ms "
                       f"step_avg:{final_ms / step:.2f}ms\n")
        elif step % every == 0:
            loss = 10.8258 - (10.8258 - 3.4) * step / total
            out.append(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{t:.0f}ms "
                       f"step_avg:{t / max(step, 1):.2f}ms\n")
    if stop_at is None:
        out.append("peak memory allocated: 31253 MiB reserved: 46520 MiB\n")
    return "".join(out)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def write_logs(directory, runs, **kw):
    """runs: {run_id: (final_loss, final_ms)}. Returns the paths in the order given."""
    return [write(os.path.join(directory, f"{rid}.txt"), log_text(loss, ms, **kw)) for rid, (loss, ms) in runs.items()]


def run_script(args, env=None, cwd=None, executable=None):
    full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    full_env.update(env or {})
    cmd = ([executable] if executable else []) + args
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=60)


def run_py(script, args, env=None):
    return run_script([os.path.join(SCRIPTS, script)] + args, env=env, executable=sys.executable)


# ---- an independent Student t: the density integrated by Simpson's rule ----

def t_density_unnormalized(x, df):
    return math.exp(-(df + 1) / 2 * math.log1p(x * x / df))


def simpson(f, a, b, intervals):
    h = (b - a) / intervals
    total = f(a) + f(b)
    for i in range(1, intervals):
        total += (4 if i % 2 else 2) * f(a + i * h)
    return total * h / 3


def t_cdf_quadrature(t, df, intervals=4000):
    """P(T <= t) = 1/2 + integral of the density from 0 to t (the density is even). The density's
    constant is Gamma((df+1)/2) / (Gamma(df/2) sqrt(df pi)); for large df, where those lgamma
    values are huge and their difference inexact, it is found by integrating the density instead
    (whose tails there are Gaussian: nothing past 60)."""
    if df < 1000:
        log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        c = math.exp(log_c)
    else:
        c = 0.5 / simpson(lambda x: t_density_unnormalized(x, df), 0.0, 60.0, 24000)
    return 0.5 + c * simpson(lambda x: t_density_unnormalized(x, df), 0.0, t, intervals)


class StudentT(unittest.TestCase):
    def test_closed_forms(self):
        # df = 1 (Cauchy), 2 and 3 have elementary CDFs.
        for t in (-30.0, -4.1, -1.0, -0.2, 0.0, 0.05, 0.7, 2.5, 12.0):
            self.assertAlmostEqual(stats.student_t_cdf(t, 1), 0.5 + math.atan(t) / math.pi, places=13)
            self.assertAlmostEqual(stats.student_t_cdf(t, 2), 0.5 + t / (2 * math.sqrt(2 + t * t)), places=13)
            u = t / math.sqrt(3)
            f3 = 0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi
            self.assertAlmostEqual(stats.student_t_cdf(t, 3), f3, places=13)

    def test_far_tails_keep_relative_accuracy(self):
        # P(T < -x) for df 1 is atan(1/x)/pi; for df 2 it is 1/((sqrt(2+x^2)+x) sqrt(2+x^2)).
        for x in (10.0, 1e3, 1e6):
            self.assertLess(abs(stats.student_t_cdf(-x, 1) / (math.atan(1 / x) / math.pi) - 1), 1e-11)
            r = math.sqrt(2 + x * x)
            self.assertLess(abs(stats.student_t_cdf(-x, 2) * (r + x) * r - 1), 1e-11)
            self.assertLess(abs(stats.student_t_upper_tail(x, 2) * (r + x) * r - 1), 1e-11)

    def test_critical_value_table(self):
        # Two-sided 95%/90%/99% critical values as printed in statistics tables (t such that
        # P(T <= t) = q); each entry is itself confirmed here by the quadrature.
        table = [(1, 0.975, 12.7062047362), (2, 0.975, 4.3026527297), (5, 0.975, 2.5705818366),
                 (10, 0.975, 2.2281388520), (30, 0.975, 2.0422724563), (4, 0.95, 2.1318467863),
                 (9, 0.95, 1.8331129327), (20, 0.95, 1.7247182429), (3, 0.995, 5.8409093097),
                 (100, 0.99, 2.3642173662)]
        for df, q, t in table:
            self.assertAlmostEqual(t_cdf_quadrature(t, df, intervals=20000), q, places=9, msg=f"table df={df}")
            self.assertAlmostEqual(stats.student_t_cdf(t, df), q, places=9, msg=f"df={df}")
            self.assertAlmostEqual(stats.student_t_cdf(-t, df), 1 - q, places=9, msg=f"df={df}")

    def test_against_quadrature_including_fractional_df(self):
        # Welch's test uses non-integer degrees of freedom.
        for df in (0.7, 1.5, 3.2347, 7.3, 25.0, 400.0):
            for t in (-6.0, -2.2, -0.4, 0.3, 1.7, 4.5):
                self.assertAlmostEqual(stats.student_t_cdf(t, df), t_cdf_quadrature(t, df), places=10,
                                       msg=f"t={t} df={df}")

    def test_large_df(self):
        # Large df against the quadrature (lgamma(df/2) is large there), on both sides of the
        # switch to the normal expansion at 1e6; the t distribution tends to the normal.
        for df in (1e3, 1e5, 9.9e5, 1.1e6, 1e8):
            for t in (-3.0, -0.7, 2.1):
                self.assertAlmostEqual(stats.student_t_cdf(t, df), t_cdf_quadrature(t, df), places=11,
                                       msg=f"t={t} df={df}")
        for t in (-3.0, -1.0, 0.5, 2.0):
            self.assertAlmostEqual(stats.student_t_cdf(t, 1e12), 0.5 * math.erfc(-t / math.sqrt(2)), places=11)

    def test_edges(self):
        self.assertEqual(stats.student_t_cdf(0.0, 4), 0.5)
        self.assertEqual(stats.student_t_cdf(math.inf, 4), 1.0)
        self.assertEqual(stats.student_t_cdf(-math.inf, 4), 0.0)
        self.assertTrue(math.isnan(stats.student_t_cdf(math.nan, 4)))
        self.assertTrue(math.isnan(stats.student_t_cdf(1.0, 0)))
        for t in (-2.5, 0.8, 3.3):
            self.assertAlmostEqual(stats.student_t_cdf(t, 6.5) + stats.student_t_cdf(-t, 6.5), 1.0, places=14)

    def test_regularized_beta(self):
        # I_x(1, b) = 1 - (1-x)^b and I_x(a, 1) = x^a.
        for x in (0.01, 0.3, 0.5, 0.9, 0.999):
            self.assertAlmostEqual(stats.regularized_beta(x, 1.0, 3.5), 1 - (1 - x) ** 3.5, places=13)
            self.assertAlmostEqual(stats.regularized_beta(x, 2.5, 1.0), x ** 2.5, places=13)
        self.assertEqual(stats.regularized_beta(0.0, 2, 3), 0.0)
        self.assertEqual(stats.regularized_beta(1.0, 2, 3), 1.0)


class Parsing(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_scripts_")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_only_whole_numeric_lines_count(self):
        path = write(os.path.join(self.tmp, "a.txt"), log_text(3.2789, 95168))
        run = stats.parse_log(path)
        self.assertEqual(run.run_id, "a")
        self.assertEqual(run.total, 1555)
        self.assertEqual([p[0] for p in run.val_points], [0, 250, 500, 750, 1000, 1250, 1500, 1555])
        self.assertEqual(run.val_points[0][1], 10.8258)
        self.assertEqual(run.final, (3.2789, 95168))
        self.assertEqual(run.last_train_step, 1555)
        self.assertIsNone(run.problem())

    def test_header_alone_is_not_a_log(self):
        path = write(os.path.join(self.tmp, "h.txt"), FAKE_HEADER)
        with self.assertRaisesRegex(stats.LogError, "no val_loss line"):
            stats.parse_log(path)

    def test_incomplete_and_diverged(self):
        run = stats.parse_log(write(os.path.join(self.tmp, "i.txt"), log_text(3.28, 90000, stop_at=1300)))
        self.assertIsNone(run.final)
        self.assertEqual(run.problem(), "incomplete: last validation at step 1250 of 1555, training reached step 1300")
        run = stats.parse_log(write(os.path.join(self.tmp, "d.txt"), log_text("nan", 90000)))
        self.assertTrue(math.isnan(run.final[0]))
        self.assertTrue(run.problem().startswith("diverged"))

    def test_inconsistent_totals(self):
        text = log_text(3.28, 90000) + "step:1600/1600 val_loss:3.2000 train_time:99000ms step_avg:61.88ms\n"
        with self.assertRaisesRegex(stats.NotALog, r"total step count 1600 differs from the 1555"):
            stats.parse_log(write(os.path.join(self.tmp, "x.txt"), text))

    def test_header_lines(self):
        # Only "key: value" at the start of a line counts; the source dump's indented and quoted
        # copies (FAKE_HEADER) do not.
        run = stats.parse_log(write(os.path.join(self.tmp, "a.txt"), log_text(3.28, 90000)))
        self.assertEqual((run.seed, run.source_hash), (None, None))
        header = "world_size: 8\nseed: 17\nsource_hash: 00ff00ff00ff00ff\n"
        run = stats.parse_log(write(os.path.join(self.tmp, "b.txt"), log_text(3.28, 90000, header=header)))
        self.assertEqual((run.seed, run.source_hash), (17, "00ff00ff00ff00ff"))

    def test_preset(self):
        """The "preset:" header line; in older logs the command's --preset (the last one), else "default";
        upstream's logs (no header lines) name none. The source dump's quoted copies do not count."""
        def preset_of(name, header):
            return stats.parse_log(write(os.path.join(self.tmp, name), log_text(3.28, 90000, header=header))).preset
        self.assertIsNone(preset_of("u.txt", ""))
        self.assertEqual(preset_of("p.txt", "command: ./build/train_gpt --preset tiny\npreset: tiny-r84\n"), "tiny-r84")
        self.assertEqual(preset_of("c.txt", "command: ./build/train_gpt --preset r80 --seed 3 --preset=r84\n"), "r84")
        self.assertEqual(preset_of("d.txt", "command: ./build/train_gpt --seed 3 --run-id x-preset\n"), "default")
        self.assertEqual(preset_of("h.txt", "source_hash: 00ff00ff00ff00ff\n"), "default")
        self.assertIsNone(preset_of("q.txt", '  preset: r84\n"command: --preset r80"\n'))

    def test_stopped_by_max_steps(self):
        # A run stopped by --max-steps ends normally after a validation at its last step: finished.
        run = stats.parse_log(write(os.path.join(self.tmp, "m.txt"), log_text(8.95, 13000, total=34, max_steps=6)))
        self.assertEqual(run.final, (8.95, 13000))
        self.assertEqual(run.steps, "6/34")
        self.assertIsNone(run.problem())
        # Without the closing line it broke off there: incomplete.
        text = log_text(8.95, 13000, total=34, max_steps=6).replace("peak memory allocated", "peak memory?")
        run = stats.parse_log(write(os.path.join(self.tmp, "n.txt"), text))
        self.assertIsNone(run.final)
        self.assertEqual(run.problem(), "incomplete: last validation at step 6 of 34, training reached step 6")

    def test_train_loss_lines(self):
        run = stats.parse_log(write(os.path.join(self.tmp, "t.txt"), log_text(3.28, 9000, total=20, every=5,
                                                                           train_loss=0.0)))
        self.assertEqual([p[0] for p in run.train_losses], list(range(1, 21)))
        self.assertEqual(run.train_losses[2], (3, round(10.9 - 7.0 * 3 / 20 + 0.0, 4)))
        self.assertEqual(run.final, (3.28, 9000))


class Summary(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_scripts_")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def json_of(self, args, code=0):
        """stats.py --json run in this process (the command-line tests below run it as a program)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            got = stats.main(["--json"] + args)
        self.assertEqual(got, code, err.getvalue())
        return json.loads(out.getvalue()), err.getvalue()

    def test_numbers_match_independent_computation(self):
        runs = {"r1": (3.2791, 95168), "r2": (3.2774, 94870), "r3": (3.2802, 95512),
                "r4": (3.2768, 95021), "r5": (3.2785, 94777), "r6": (3.2779, 95304)}
        paths = write_logs(self.tmp, runs)
        s, _ = self.json_of(paths)
        losses = [v[0] for v in runs.values()]
        times = [v[1] / 1000 for v in runs.values()]
        self.assertEqual(s["n"], 6)
        self.assertEqual([r["run_id"] for r in s["runs"]], list(runs))
        self.assertEqual([r["val_loss"] for r in s["runs"]], losses)
        self.assertEqual([r["train_time_s"] for r in s["runs"]], times)
        for key, values in (("val_loss", losses), ("train_time_s", times)):
            d = s[key]
            self.assertAlmostEqual(d["mean"], statistics.mean(values), places=10)
            self.assertAlmostEqual(d["std"], statistics.stdev(values), places=10)
            self.assertEqual(d["median"], sorted(values)[2] / 2 + sorted(values)[3] / 2)
            self.assertEqual((d["min"], d["max"]), (min(values), max(values)))
        t = (statistics.mean(losses) - 3.28) / (statistics.stdev(losses) / math.sqrt(6))
        self.assertAlmostEqual(s["t"], t, places=10)
        self.assertEqual(s["df"], 5)
        self.assertAlmostEqual(s["p"], t_cdf_quadrature(t, 5), places=10)
        self.assertEqual(s["target"], 3.28)
        self.assertEqual((s["skipped"], s["duplicates"]), ([], []))

    def test_hand_worked_example_and_text_output(self):
        # Losses 3.2740, 3.2770, 3.2800: mean 3.2770, s = 0.003, t = -0.003 / (0.003/sqrt 3) = -sqrt 3,
        # df 2, p = P(T_2 <= -sqrt 3) = 1/2 - sqrt(3)/(2 sqrt 5) = 0.1127017.
        # Times 94, 95, 99 s: mean 96 s, median 95 s, std sqrt(7) = 2.64575 s.
        paths = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000), "c": (3.2800, 99000)})
        s, _ = self.json_of(paths)
        self.assertAlmostEqual(s["t"], -math.sqrt(3), places=9)
        self.assertAlmostEqual(s["p"], 0.5 - math.sqrt(3) / (2 * math.sqrt(5)), places=9)
        self.assertAlmostEqual(s["p"], 0.1127017, places=7)
        r = run_py("stats.py", paths)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = r.stdout
        self.assertRegex(out, r"(?m)^a\s+-\s+1555/1555\s+3\.2740\s+94\.000$")
        self.assertRegex(out, r"(?m)^c\s+-\s+1555/1555\s+3\.2800\s+99\.000$")
        self.assertIn("n = 3 (1555/1555 steps each)\n", out)
        self.assertIn("val_loss: mean 3.27700, median 3.2770, min-max 3.2740-3.2800, std 0.00300\n", out)
        self.assertIn("one-sided t-test, H1: mean < 3.28: p=0.1127 (t = -1.732, df = 2)", out)
        self.assertIn("time: mean 96.000 s, median 95.000 s, min-max 94.000-99.000 s, std 2.646 s\n", out)
        self.assertIn("val_losses = [3.2740, 3.2770, 3.2800]\ntimes = [94.000, 95.000, 99.000]\n", out)
        self.assertEqual(r.stderr, "")

    def test_target_option(self):
        paths = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000), "c": (3.2800, 99000)})
        s, _ = self.json_of(["--target", "3.277"] + paths)
        self.assertAlmostEqual(s["t"], 0.0, places=9)
        self.assertAlmostEqual(s["p"], 0.5, places=9)

    def test_directories_and_repeated_paths(self):
        write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000)})
        write(os.path.join(self.tmp, "notes.md"), "not a log\n")
        write(os.path.join(self.tmp, "sub", "c.txt"), log_text(3.30, 90000))  # not recursive
        s, _ = self.json_of([self.tmp, os.path.join(self.tmp, "a.txt")])
        self.assertEqual([r["run_id"] for r in s["runs"]], ["a", "b"])

    def test_record_71_copies_counted_once(self):
        # Upstream's five runs of record 71 (their final losses and times), then the same logs
        # copied under other names: n stays 5 and p 0.0423, with a warning for each copy. Counted
        # twice, n would be 10 and p 0.0038.
        final = {"02fee7bd": (3.2789, 95168), "2a84e38a": (3.2772, 95219), "37f71dac": (3.2804, 95069),
                 "5b64cd5c": (3.2770, 95277), "82f163f6": (3.2792, 95303)}
        originals = write_logs(self.tmp, final)
        for path in originals:
            shutil.copy(path, os.path.join(self.tmp, "copy-of-" + os.path.basename(path)))
        s, err = self.json_of([self.tmp])
        self.assertEqual(s["n"], 5)
        self.assertEqual(sorted(r["run_id"] for r in s["runs"]), sorted(final))
        self.assertAlmostEqual(s["p"], 0.0423, places=4)
        losses = [v[0] for v in final.values()]
        t = (statistics.mean(losses) - 3.28) / (statistics.stdev(losses) / math.sqrt(5))
        self.assertAlmostEqual(s["p"], t_cdf_quadrature(t, 4), places=10)
        self.assertEqual(len(s["duplicates"]), 5)
        for path in originals:
            copy = os.path.join(self.tmp, "copy-of-" + os.path.basename(path))
            self.assertIn(f"warning: {copy}: duplicate of {path}: the same step and validation lines", err)
        # A stray text file besides: listed, skipped, and the report still comes.
        write(os.path.join(self.tmp, "README.txt"), "notes on these runs\n")
        r = run_py("stats.py", [self.tmp])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("n = 5 (1555/1555 steps each)", r.stdout)
        self.assertIn("p=0.0423", r.stdout)
        self.assertIn("README.txt: skipped: no val_loss line", r.stderr)
        # The planted bug it guards against: without the duplicate check, n = 10.
        runs, _ = stats.read_runs([self.tmp], strict=False)
        self.assertEqual(len(runs), 10)
        self.assertAlmostEqual(stats.one_sample_t_test_less([r.final[0] for r in runs], 3.28)[2], 0.0038, places=4)

    def test_same_seed_and_source_is_a_duplicate(self):
        # The trainer is deterministic: a rerun of a seed gives the same losses (its times differ).
        head = "seed: {}\nsource_hash: 1234567890abcdef\n"
        a = write(os.path.join(self.tmp, "a.txt"), log_text(3.2790, 95000, header=head.format(1)))
        b = write(os.path.join(self.tmp, "b.txt"), log_text(3.2790, 95400, header=head.format(1)))
        c = write(os.path.join(self.tmp, "c.txt"), log_text(3.2790, 95200, header=head.format(2)))
        d = write(os.path.join(self.tmp, "d.txt"), log_text(3.2770, 95300, header=head.format(3)))
        s, err = self.json_of([a, b, c, d])
        self.assertEqual([r["run_id"] for r in s["runs"]], ["a", "c", "d"])  # c: another seed, same loss
        self.assertEqual([r["seed"] for r in s["runs"]], [1, 2, 3])
        self.assertEqual(s["duplicates"], [{"path": b, "duplicate_of": a, "why": s["duplicates"][0]["why"]}])
        self.assertIn(f"{b}: duplicate of {a}: the same source_hash, seed 1 and val losses", err)
        r = run_py("stats.py", [a, c, d])
        self.assertRegex(r.stdout, r"(?m)^c\s+2\s+default\s+1555/1555\s+3\.2790\s+95\.200$")
        # Upstream's logs have no seed: equal losses alone are not a duplicate.
        e = write(os.path.join(self.tmp, "e.txt"), log_text(3.2790, 95000))
        f = write(os.path.join(self.tmp, "f.txt"), log_text(3.2790, 95100))
        s, err = self.json_of([e, f])
        self.assertEqual(s["n"], 2)
        self.assertEqual(err, "")

    def test_mixed_schedules_and_sources_refused_unless_mix(self):
        a, b = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000)})
        long = write(os.path.join(self.tmp, "long.txt"), log_text(3.2750, 140000, total=2285))
        r = run_py("stats.py", [a, b, long])
        self.assertEqual(r.returncode, 1)
        self.assertIn("runs are not comparable: different schedules (final step/total steps): "
                      "1555/1555: a, b; 2285/2285: long. Give --mix to pool them anyway", r.stderr)
        s, err = self.json_of(["--mix", a, b, long])
        self.assertEqual(s["n"], 3)
        self.assertIn("warning: pooling runs (--mix): different schedules", err)
        hashed = write(os.path.join(self.tmp, "h.txt"), log_text(3.2760, 94500, header="source_hash: 00000000000000aa\n"))
        other = write(os.path.join(self.tmp, "o.txt"), log_text(3.2765, 94600, header="source_hash: 00000000000000bb\n"))
        r = run_py("stats.py", [hashed, other])
        self.assertEqual(r.returncode, 1)
        self.assertIn("different sources (source_hash): 00000000000000aa: h; 00000000000000bb: o", r.stderr)
        r = run_py("stats.py", [a, hashed])
        self.assertEqual(r.returncode, 1)
        self.assertIn("none (not this trainer's log): a", r.stderr)
        # A run stopped by --max-steps is a schedule of its own.
        short = write(os.path.join(self.tmp, "s.txt"), log_text(3.5, 60000, max_steps=1000))
        r = run_py("stats.py", [a, b, short])
        self.assertIn("1000/1555: s", r.stderr)

    def test_mixed_presets_refused_and_shown(self):
        """Two presets under one source and schedule (the same binary) are not comparable either; the text
        output names each run's preset and the set's."""
        head = "seed: {}\nsource_hash: 1234567890abcdef\npreset: {}\n"
        a = write(os.path.join(self.tmp, "a.txt"), log_text(3.2740, 94000, header=head.format(1, "r84")))
        b = write(os.path.join(self.tmp, "b.txt"), log_text(3.2770, 95000, header=head.format(2, "r84")))
        c = write(os.path.join(self.tmp, "c.txt"), log_text(3.2750, 93000, header=head.format(3, "r84-prefix")))
        r = run_py("stats.py", [a, b, c])
        self.assertEqual(r.returncode, 1)
        self.assertIn("runs are not comparable: different presets: r84: a, b; r84-prefix: c.", r.stderr)
        s, _ = self.json_of(["--mix", a, b, c])
        self.assertEqual([x["preset"] for x in s["runs"]], ["r84", "r84", "r84-prefix"])
        r = run_py("stats.py", [a, b])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"(?m)^run\s+seed\s+preset\s+steps\s+val_loss\s+time_s$")
        self.assertRegex(r.stdout, r"(?m)^a\s+1\s+r84\s+1555/1555\s+3\.2740\s+94\.000$")
        self.assertIn("n = 2 (preset r84, 1555/1555 steps each)\n", r.stdout)

    def test_one_run(self):
        paths = write_logs(self.tmp, {"solo": (3.2761, 95000)})
        s, err = self.json_of(paths, code=1)
        self.assertEqual((s["n"], s["val_loss"]["std"], s["p"]), (1, None, None))
        self.assertIn("the t-test needs at least 2 finished runs; 1 counted", err)
        r = run_py("stats.py", paths)
        self.assertEqual(r.returncode, 1)
        self.assertIn("std n/a (one run)", r.stdout)
        self.assertIn("H1: mean < 3.28: p n/a (one run)", r.stdout)

    def test_resumed_run_counts_every_segment(self):
        # s1 trained to step 800, saved there at 50.000 s of training and was stopped; s2 resumed
        # from that checkpoint and finished after 45.000 s more: one run of 95.000 s (not 45.000).
        s1 = write(os.path.join(self.tmp, "s1.txt"),
                   log_text(3.28, 52000, stop_at=810, header="run_id: s1\n") +
                   "saved checkpoint /ck/step000800 step:800 train_time:50000ms\nfail: stopped by SIGTERM\n")
        s2 = write(os.path.join(self.tmp, "s2.txt"),
                   log_text(3.2770, 45000, header="run_id: s2\nresumes: s1 step 800\n") +
                   "finished: steps 800..1555 of 1555, train_time:45000ms\n")
        other = write_logs(self.tmp, {"n": (3.2790, 96000)})
        s, err = self.json_of([s1, s2] + other)
        self.assertEqual({r["run_id"]: r["train_time_s"] for r in s["runs"]}, {"s2": 95.0, "n": 96.0})
        self.assertIn(f"{s1}: skipped: an earlier segment of the resumed run s2 (counted with it)", err)
        # without s1's log the time is unknown: s2 is skipped, naming the missing run
        s, err = self.json_of([s2] + other + write_logs(self.tmp, {"m": (3.2780, 95500)}))
        self.assertEqual(sorted(r["run_id"] for r in s["runs"]), ["m", "n"])
        self.assertIn(f"{s2}: skipped: resumed run: the log of its earlier segment, run s1 (its steps up to 800), "
                      "is not among the logs given", err)
        # a segment without the checkpoint's time
        s1b = write(os.path.join(self.tmp, "b", "s1.txt"), log_text(3.28, 52000, stop_at=810, header="run_id: s1\n"))
        r = run_py("stats.py", [s2, s1b])
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"{s2}: skipped: resumed run: the log of its earlier segment {s1b} has no 'saved checkpoint ... "
                      "step:800 train_time:' line", r.stderr)

    def test_failed_run_skipped(self):
        paths = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000)})
        # a fatal error after the final validation (the log's last line says so)
        failed = write(os.path.join(self.tmp, "f.txt"), log_text(3.2700, 93000) + "fail: cannot write checkpoint x\n")
        s, err = self.json_of(paths + [failed])
        self.assertEqual(s["n"], 2)
        self.assertIn(f"warning: {failed}: skipped: failed: cannot write checkpoint x", err)

    def test_unfinished_and_stray_files_skipped_or_fail_with_strict(self):
        paths = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2770, 95000)})
        partial = write(os.path.join(self.tmp, "partial.txt"), log_text(3.28, 90000, stop_at=1300))
        bad = write(os.path.join(self.tmp, "bad.txt"), log_text("nan", 90000))
        early = write(os.path.join(self.tmp, "early.txt"), FAKE_HEADER + "step:1/1555 train_time:60ms step_avg:60.00ms\n")
        s, err = self.json_of(paths + [partial, bad, early])
        self.assertEqual(s["n"], 2)
        self.assertIn(f"warning: {partial}: skipped: incomplete: last validation at step 1250 of 1555", err)
        self.assertIn(f"warning: {bad}: skipped: diverged: final val loss nan", err)
        self.assertIn(f"warning: {early}: skipped: no val_loss line", err)
        self.assertEqual([d["path"] for d in s["skipped"]], [partial, bad, early])
        for extra in (partial, early):
            r = run_py("stats.py", ["--strict"] + paths + [extra])
            self.assertEqual(r.returncode, 1)
            self.assertIn(f"error: {extra}: ", r.stderr)
            self.assertIn("(--strict)", r.stderr)
        r = run_py("stats.py", [partial])
        self.assertEqual(r.returncode, 1)
        self.assertIn("no finished runs among the logs given", r.stderr)
        r = run_py("stats.py", paths[:1] + [early])  # one run left after skipping: no test
        self.assertEqual(r.returncode, 1)
        self.assertIn("needs at least 2 finished runs; 1 counted", r.stderr)

    def test_errors(self):
        good = write_logs(self.tmp, {"a": (3.2740, 94000), "b": (3.2750, 94500)})
        empty_dir = os.path.join(self.tmp, "empty")
        os.makedirs(empty_dir)
        cases = [
            (good + [os.path.join(self.tmp, "missing.txt")], 1, "missing.txt: no such file or directory"),
            ([empty_dir], 1, "directory has no *.txt logs"),
            ([], 2, "no logs given"),
            (good + ["--", good[0]], 2, '"--" separates the two sets of --compare'),
            (["--target", "x"] + good, 2, "invalid float value"),
        ]
        for args, code, message in cases:
            r = run_py("stats.py", args)
            self.assertEqual(r.returncode, code, f"{args}: {r.stderr}")
            self.assertIn(message, r.stderr, args)
        r = run_py("stats.py", ["--help"])
        self.assertEqual(r.returncode, 0)
        self.assertIn("--compare OLD_LOG_OR_DIR... -- NEW_LOG_OR_DIR...", r.stdout)


class Compare(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_scripts_")
        # Old 100, 102, 104 s (variance 4 s^2), new 95..98 s (variance 5/3 s^2):
        # difference -5.5 s, se^2 = 4/3 + 5/12 = 1.75, t = -5.5/sqrt(1.75) = -4.15761,
        # Welch df = 1.75^2 / ((4/3)^2/2 + (5/12)^2/3) = 3.23472.
        self.old = write_logs(os.path.join(self.tmp, "old"),
                              {"o1": (3.2790, 100000), "o2": (3.2770, 102000), "o3": (3.2780, 104000)})
        self.new = write_logs(os.path.join(self.tmp, "new"),
                              {"n1": (3.2800, 95000), "n2": (3.2760, 96000), "n3": (3.2785, 97000), "n4": (3.2775, 98000)})

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_welch_numbers(self):
        r = run_py("stats.py", ["--json", "--compare"] + self.old + ["--"] + self.new)
        self.assertEqual(r.returncode, 0, r.stderr)
        c = json.loads(r.stdout)
        d = c["train_time_s"]
        self.assertAlmostEqual(d["difference"], -5.5, places=9)
        self.assertAlmostEqual(d["relative"], -5.5 / 102, places=12)
        self.assertAlmostEqual(d["t"], -5.5 / math.sqrt(1.75), places=9)
        self.assertAlmostEqual(d["df"], 1.75 ** 2 / ((4 / 3) ** 2 / 2 + (5 / 12) ** 2 / 3), places=9)
        self.assertAlmostEqual(d["t"], -4.15761, places=5)
        self.assertAlmostEqual(d["df"], 3.23472, places=5)
        self.assertAlmostEqual(d["p"], 2 * t_cdf_quadrature(d["t"], d["df"]), places=10)
        # The val losses, computed here from the statistics module.
        old_l, new_l = [3.2790, 3.2770, 3.2780], [3.2800, 3.2760, 3.2785, 3.2775]
        v_old, v_new = statistics.variance(old_l) / 3, statistics.variance(new_l) / 4
        t = (statistics.mean(new_l) - statistics.mean(old_l)) / math.sqrt(v_old + v_new)
        df = (v_old + v_new) ** 2 / (v_old ** 2 / 2 + v_new ** 2 / 3)
        self.assertAlmostEqual(c["val_loss"]["t"], t, places=9)
        self.assertAlmostEqual(c["val_loss"]["df"], df, places=9)
        self.assertAlmostEqual(c["val_loss"]["p"], 2 * (1 - t_cdf_quadrature(abs(t), df)), places=10)
        self.assertEqual((c["old"]["n"], c["new"]["n"]), (3, 4))

    def test_text_and_directories(self):
        r = run_py("stats.py", ["--compare", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("time: new - old = -5.500 s (-5.39%); Welch t = -4.158, df = 3.23, two-sided p=0.0218", r.stdout)
        self.assertIn("new is faster by 5.500 s (5.39% less time than old)", r.stdout)
        self.assertRegex(r.stdout, r"(?m)^n4\s+-\s+1555/1555\s+3\.2775\s+98\.000$")
        # Swapped: "old" is now the faster set; the saving is still 5.39% of the slower's 102 s,
        # while new - old is +5.70% of old's 96.5 s.
        r = run_py("stats.py", ["--compare", os.path.join(self.tmp, "new"), "--", os.path.join(self.tmp, "old")])
        self.assertIn("time: new - old = +5.500 s (+5.70%)", r.stdout)
        self.assertIn("old is faster by 5.500 s (5.39% less time than new)", r.stdout)
        self.assertIn("Welch t = 4.158", r.stdout)

    def test_errors(self):
        cases = [
            (["--compare"] + self.old, 2, "--compare needs both sets"),
            (["--compare", "--"] + self.new, 2, "--compare needs both sets"),
            (["--compare"] + self.old + ["--"], 2, "--compare needs both sets"),
            (["--compare"] + self.old + ["--", self.new[0]], 1, "needs at least 2 finished runs in each set; new has 1"),
            (["--compare"] + self.old + ["--", os.path.join(self.tmp, "nope")], 1, "nope: no such file or directory"),
        ]
        for args, code, message in cases:
            r = run_py("stats.py", args)
            self.assertEqual(r.returncode, code, f"{args}: {r.stderr}")
            self.assertIn(message, r.stderr, args)
        partial = write(os.path.join(self.tmp, "p.txt"), log_text(3.28, 90000, stop_at=10))
        r = run_py("stats.py", ["--strict", "--compare"] + self.old + ["--", partial] + self.new)
        self.assertEqual(r.returncode, 1)
        self.assertIn("p.txt: incomplete", r.stderr)
        r = run_py("stats.py", ["--compare"] + self.old + ["--", partial] + self.new)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("new: n = 4", r.stdout)

    def test_sets_checked_each_on_its_own(self):
        # A copy in one set is counted once; the sets may differ in schedule (a record that
        # shortens the run), but the runs of one set may not, unless --mix.
        shutil.copy(self.new[0], os.path.join(self.tmp, "new", "zz-copy.txt"))
        r = run_py("stats.py", ["--json", "--compare", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["new"]["n"], 4)
        self.assertIn("zz-copy.txt: duplicate of", r.stderr)
        shorter = write_logs(os.path.join(self.tmp, "short"), {"s1": (3.2790, 90000), "s2": (3.2795, 90500)}, total=1500)
        r = run_py("stats.py", ["--compare"] + self.old + ["--"] + shorter)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run_py("stats.py", ["--compare"] + self.old + ["--"] + shorter + self.new)
        self.assertEqual(r.returncode, 1)
        self.assertIn("runs in the new set are not comparable: different schedules", r.stderr)
        r = run_py("stats.py", ["--mix", "--compare"] + self.old + ["--"] + shorter + self.new)
        self.assertEqual(r.returncode, 0, r.stderr)


def have_matplotlib():
    r = subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True)
    return r.returncode == 0


class Plot(unittest.TestCase):
    """plot_logs.py: its options, and the figure's contents read back from the artists it draws
    (each tagged with a gid naming what and whose it is), against numbers computed here."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_scripts_")
        self.old_dir, self.new_dir = os.path.join(self.tmp, "old"), os.path.join(self.tmp, "new")
        self.old = {"o1": (3.2789, 95168), "o2": (3.2771, 96100), "o3": (3.2795, 95500)}
        self.new = {"n1": (3.2760, 93000), "n2": (3.2772, 93400), "n3": (3.2768, 92800)}
        write_logs(self.old_dir, self.old)
        for k, (rid, (loss, ms)) in enumerate(self.new.items()):
            write(os.path.join(self.new_dir, rid + ".txt"), log_text(loss, ms, train_loss=0.01 * k))
        self.partial = write(os.path.join(self.old_dir, "partial.txt"), log_text(3.28, 90000, stop_at=700))
        self.bad = write(os.path.join(self.new_dir, "bad.txt"), log_text("nan", 91000))
        write(os.path.join(self.new_dir, "notes.txt"), "what changed: ...\n")
        self.logs = [os.path.join(self.old_dir, f"{rid}.txt") for rid in self.old] + [self.partial]

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def groups(self):
        return plot_logs.load_groups([("old", self.old_dir), ("new", self.new_dir)])

    def test_groups_parsed(self):
        self.assertEqual(plot_logs.parse_group("old=logs/a=b"), ("old", "logs/a=b"))
        for bad in ("old", "=logs", "old="):
            with self.assertRaisesRegex(Exception, "is not NAME=LOG_OR_DIR"):
                plot_logs.parse_group(bad)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            groups = plot_logs.load_groups([("new", self.new_dir), ("old", self.logs[0]), ("old", self.logs[1]),
                                            ("new", self.old_dir)])
        self.assertEqual([g.name for g in groups], ["new", "old"])
        new, old = groups
        self.assertEqual(sorted(r.run_id for r in new.finished), sorted(list(self.new) + list(self.old)))
        self.assertEqual([r.run_id for r in new.truncated], ["partial"])
        self.assertEqual([r.run_id for r in new.diverged], ["bad"])
        self.assertEqual([r.run_id for r in old.finished], ["o1", "o2"])
        self.assertIn("notes.txt: skipped: no val_loss line", err.getvalue())

    @unittest.skipUnless(have_matplotlib(), "matplotlib is not installed (python3 -m pip install matplotlib)")
    def test_figure_panels(self):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        with contextlib.redirect_stderr(io.StringIO()):
            fig = plot_logs.build_figure(self.groups(), 3.28, "old vs new")
        self.addCleanup(plt.close, fig)
        by_time, zoom, by_step, finals, times, table = fig.axes[:6]
        self.assertEqual(by_time.get_title(), "val loss by training time")
        self.assertEqual(zoom.get_title(), "zoom: the end of the runs near the target 3.28")
        self.assertEqual(by_step.get_title(), "training loss by step")
        self.assertIn("final val loss of each run", finals.get_title())
        self.assertIn("training time of each run", times.get_title())

        def tagged(ax, gid):
            found = [a for a in ax.get_children() if a.get_gid() == gid]
            self.assertEqual(len(found), 1, gid)
            return found[0]

        # The old group's mean curve and band, from its three finished runs (not the truncated one).
        runs = [stats.parse_log(os.path.join(self.old_dir, f"{rid}.txt")) for rid in self.old]
        steps = [p[0] for p in runs[0].val_points]
        mean_loss = [statistics.mean(r.val_points[i][1] for r in runs) for i in range(len(steps))]
        mean_s = [statistics.mean(r.val_points[i][2] for r in runs) / 1000 for i in range(len(steps))]
        for ax in (by_time, zoom):
            line = tagged(ax, "mean:old")
            self.assertEqual(len(line.get_xdata()), len(steps))
            for got, want in zip(line.get_xdata(), mean_s):
                self.assertAlmostEqual(got, want, places=9)
            for got, want in zip(line.get_ydata(), mean_loss):
                self.assertAlmostEqual(got, want, places=9)
        band_y = tagged(by_time, "band:old").get_paths()[0].vertices[:, 1]
        self.assertAlmostEqual(min(band_y), 3.2771, places=9)
        self.assertAlmostEqual(max(band_y), 10.8258, places=9)
        # The truncated run: an X at its last validation (step 500 of its 700), on both curve panels.
        last = stats.parse_log(self.partial).val_points[-1]
        for ax in (by_time, zoom):
            mark = tagged(ax, "truncated:old:partial")
            self.assertEqual(mark.get_marker(), "X")
            self.assertEqual((mark.get_xdata()[0], mark.get_ydata()[0]), (last[2] / 1000, last[1]))
        # The diverged run: a star at its last finite point (step 1500).
        bad = stats.parse_log(self.bad).val_points[-2]
        mark = tagged(by_time, "diverged:new:bad")
        self.assertEqual(mark.get_marker(), "*")
        self.assertEqual((mark.get_xdata()[0], mark.get_ydata()[0]), (bad[2] / 1000, bad[1]))
        # The strip panels: one point per finished run at its final loss or time, the mean as a bar.
        for ax, gid, values in ((finals, "final:old", [v[0] for v in self.old.values()]),
                                (finals, "final:new", [v[0] for v in self.new.values()]),
                                (times, "time:new", [v[1] / 1000 for v in self.new.values()])):
            points = tagged(ax, gid).get_offsets()
            self.assertEqual(sorted(points[:, 1].tolist()), sorted(values), gid)
            self.assertAlmostEqual(tagged(ax, gid.replace(":", "-mean:")).get_ydata()[0], statistics.mean(values))
        labels = [t.get_text() for t in finals.get_xticklabels()]
        self.assertEqual(labels, ["old\n(3 finished; 1 truncated)", "new\n(3 finished; 1 diverged)"])
        # The training loss: the new group's mean over the runs that log it.
        new_runs = [stats.parse_log(os.path.join(self.new_dir, f"{rid}.txt")) for rid in self.new]
        line = tagged(by_step, "train-mean:new")
        want = [statistics.mean(r.train_losses[i][1] for r in new_runs) for i in range(1555)]
        self.assertEqual(len(line.get_ydata()), 1555)
        for got, w in zip(line.get_ydata()[::97], want[::97]):
            self.assertAlmostEqual(got, w, places=9)
        # The table: the one-sided p of each group and new's time difference with Welch's p.
        cells = tagged(table, "summary").get_celld()
        rows = {cells[r, 0].get_text().get_text(): [cells[r, c].get_text().get_text() for c in range(7)]
                for r in (1, 2)}
        for name, group in (("old", self.old), ("new", self.new)):
            losses = [v[0] for v in group.values()]
            t = (statistics.mean(losses) - 3.28) / (statistics.stdev(losses) / math.sqrt(3))
            self.assertEqual(rows[name][3], f"{t_cdf_quadrature(t, 2):.4f}")
        old_s = [v[1] / 1000 for v in self.old.values()]
        new_s = [v[1] / 1000 for v in self.new.values()]
        self.assertTrue(rows["new"][6].startswith(f"{statistics.mean(new_s) - statistics.mean(old_s):+.2f} s, p="))
        self.assertEqual(rows["old"][5:], ["(baseline)", "(baseline)"])

    @unittest.skipUnless(have_matplotlib(), "matplotlib is not installed (python3 -m pip install matplotlib)")
    def test_zoom_window_and_val_by_step(self):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        groups = plot_logs.load_groups([("old", self.old_dir)])
        fig = plot_logs.build_figure(groups, 3.28, "")
        self.addCleanup(plt.close, fig)
        self.assertEqual(fig.axes[1].get_ylim(), (3.28 - 0.015, 3.28 + 0.025))
        self.assertTrue(fig.axes[2].get_title().startswith("val loss by step (no train_loss lines"))
        # Runs that end far from the target (a short CPU run): the window covers their finals.
        tiny = write_logs(os.path.join(self.tmp, "tiny"), {"t1": (8.95, 13000), "t2": (8.92, 14000)}, total=34,
                          max_steps=6)
        fig = plot_logs.build_figure(plot_logs.load_groups([("tiny", tiny[0]), ("tiny", tiny[1])]), 3.28, "")
        self.addCleanup(plt.close, fig)
        lo, hi = fig.axes[1].get_ylim()
        self.assertTrue(lo < 8.92 and 8.95 < hi < 9.0, (lo, hi))
        self.assertIn("no run ends near the target", fig.axes[1].get_title())

    @unittest.skipUnless(have_matplotlib(), "matplotlib is not installed (python3 -m pip install matplotlib)")
    def test_draws_png(self):
        out = os.path.join(self.tmp, "val.png")
        r = run_py("plot_logs.py", ["--group", f"old={self.old_dir}", "--group", f"new={self.new_dir}", "-o", out,
                                    "--title", "two groups"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("(old: 3 finished; 1 truncated, new: 3 finished; 1 diverged)", r.stdout)
        self.assertIn("notes.txt: skipped", r.stderr)
        with open(out, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], b"\x89PNG\r\n\x1a\n")
        self.assertGreater(len(data), 50000)
        r = run_py("plot_logs.py", self.logs + ["-o", out])  # plain logs: one group
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("(runs: 3 finished; 1 truncated)", r.stdout)

    def test_without_matplotlib(self):
        # A matplotlib that cannot be imported, first on the path.
        fake = os.path.join(self.tmp, "fake_site", "matplotlib")
        write(os.path.join(fake, "__init__.py"), "raise ImportError('hidden by the test')\n")
        out = os.path.join(self.tmp, "val.png")
        r = run_py("plot_logs.py", self.logs + ["-o", out], env={"PYTHONPATH": os.path.dirname(fake)})
        self.assertEqual(r.returncode, 1)
        self.assertIn("matplotlib is not installed: run this with the project's .venv/bin/python", r.stderr)
        self.assertFalse(os.path.exists(out))

    def test_errors(self):
        out = os.path.join(self.tmp, "val.png")
        header = write(os.path.join(self.tmp, "h", "header.txt"), FAKE_HEADER)
        cases = [
            (self.logs + [os.path.join(self.tmp, "gone.txt"), "-o", out], 1, "gone.txt: no such file or directory"),
            ([header, "-o", out], 1, "group runs: no log with a validation among"),
            (self.logs + ["-o", os.path.join(self.tmp, "no_dir", "x.png")], 1, "does not exist"),
            (self.logs, 2, "the following arguments are required: -o/--output"),
            (["--group", "old", "-o", out], 2, "'old' is not NAME=LOG_OR_DIR"),
            (["--group", f"old={self.old_dir}", self.logs[0], "-o", out], 2, "not both"),
            (["-o", out], 2, "no logs given"),
        ]
        for args, code, message in cases:
            r = run_py("plot_logs.py", args)
            self.assertEqual(r.returncode, code, f"{args}: {r.stderr}")
            self.assertIn(message, r.stderr, args)


# ---- the launch scripts, with stubs ----

# Stubs are sh scripts (cheap to start): each appends "CALL <cwd>" and one "ARG <argument>" line
# per argument to $STUB_RECORD_DIR/<name>, then does what its body says.
RECORDER = """#!/bin/sh
{{ echo "CALL $PWD"; for a in "$@"; do echo "ARG $a"; done; }} >> "$STUB_RECORD_DIR/{name}"
{body}
"""

# Lists $STUB_GPUS GPUs (default 8), or fails as when the driver is not loaded (-1).
NVIDIA_SMI_BODY = """
n=${STUB_GPUS:-8}
[ "$n" -ge 0 ] || exit 9
i=0
while [ "$i" -lt "$n" ]; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i)"; i=$((i + 1)); done
"""

# With -npernode, runs its command once per hostfile node (stub_nodes below); with --check-platform
# exits with $STUB_CHECK_EXIT; with $STUB_LOSSES, plays the trainer (stub_trainer below); else
# exits with $STUB_MPIRUN_EXIT.
MPIRUN_BODY = """
case " $* " in *" -npernode "*) exec "$STUB_PYTHON" "$STUB_TEST_DIR/test_scripts.py" --stub-nodes "$@" ;; esac
case " $* " in *" --check-platform "*) exit "${STUB_CHECK_EXIT:-0}" ;; esac
[ -z "$STUB_LOSSES" ] || exec "$STUB_PYTHON" "$STUB_TEST_DIR/test_scripts.py" --stub-trainer "$@"
exit "${STUB_MPIRUN_EXIT:-0}"
"""


def stub_nodes(args):
    """The stub mpirun's "-npernode 1 COMMAND": COMMAND once per node of --hostfile, as rank i of
    the nodes, with $STUB_NODE_GPUS's i-th count as its nvidia-smi's GPUs; output in reverse rank
    order (a real mpirun's order is arbitrary)."""
    with open(args[args.index("--hostfile") + 1]) as f:
        hosts = [line.split()[0] for line in f if line.split() and not line.startswith("#")]
    command = args[args.index("-npernode") + 2:]
    gpus = os.environ["STUB_NODE_GPUS"].split(",")
    outputs = []
    for i in range(len(hosts)):
        env = dict(os.environ, OMPI_COMM_WORLD_RANK=str(i), STUB_GPUS=gpus[i])
        r = subprocess.run(command, capture_output=True, text=True, env=env)
        outputs.append(r.stdout)
        if r.returncode:
            return r.returncode
    sys.stdout.write("".join(reversed(outputs)))
    return 0


def stub_trainer(args):
    """The stub mpirun's trainer: writes the log a run would, to <--log-dir>/<--run-id>.txt.
    $STUB_LOSSES holds one final loss per call, comma-separated; "fail-partial" writes an
    incomplete log and exits 1, "fail-early" exits 1 without a log."""
    with open(os.path.join(os.environ["STUB_RECORD_DIR"], "mpirun")) as f:
        text = f.read()
    calls = text.count("CALL ") - text.count("ARG --check-platform\n")
    what = os.environ["STUB_LOSSES"].split(",")[calls - 1]
    run_id = args[args.index("--run-id") + 1]
    log_dir = args[args.index("--log-dir") + 1] if "--log-dir" in args else "logs"
    if what == "fail-early":
        return 1
    with open(os.path.join(log_dir, run_id + ".txt"), "w") as f:
        if what == "fail-partial":
            f.write(log_text(3.3, 50000, stop_at=600))
            return 1
        f.write(log_text(float(what), 95000 + 100 * calls))
    return 0


class Launch(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_scripts_")
        self.stubs = os.path.join(self.tmp, "stubs")
        self.record = os.path.join(self.tmp, "record")
        os.makedirs(self.record)
        for name, body in (("nvidia-smi", NVIDIA_SMI_BODY), ("make", ""), ("cmake", ""), ("mpirun", MPIRUN_BODY),
                           ("other-mpirun", "")):
            path = write(os.path.join(self.stubs, name), RECORDER.format(name=name, body=body))
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        # A built trainer, and shards for the data check to find (named by self.data_flags).
        self.build = os.path.join(self.tmp, "build")
        self.trainer = write(os.path.join(self.build, "train_gpt"), "#!/bin/sh\nexit 0\n")
        os.chmod(self.trainer, 0o755)
        data = os.path.join(self.tmp, "data")
        write(os.path.join(data, "fineweb_train_000001.bin"), "")
        write(os.path.join(data, "fineweb_val_000000.bin"), "")
        self.data_flags = ["--train-files", os.path.join(data, "fineweb_train_*.bin"),
                           "--val-files", os.path.join(data, "fineweb_val_*.bin")]
        self.env = {"PATH": self.stubs + os.pathsep + os.environ.get("PATH", ""),
                    "STUB_RECORD_DIR": self.record, "STUB_TEST_DIR": HERE, "STUB_PYTHON": sys.executable,
                    "BUILD": self.build}
        # The scripts' settings, should the caller's environment hold any.
        for var in ("NP", "MPIRUN", "MPI_BIND", "SKIP_BUILD", "LOG_DIR", "RUN_PREFIX", "STUB_LOSSES", "STUB_GPUS",
                    "STUB_MPIRUN_EXIT", "STUB_CHECK_EXIT", "HOSTFILE", "SEED", "BINARY", "SKIP_PLATFORM_CHECK"):
            os.environ.pop(var, None)
        for var in [v for v in os.environ if v.startswith("NCCL_")]:
            os.environ.pop(var, None)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def calls(self, name):
        """The stub's calls, each {"cwd": ..., "argv": [...]}."""
        path = os.path.join(self.record, name)
        if not os.path.exists(path):
            return []
        calls = []
        with open(path) as f:
            for line in f.read().splitlines():
                kind, _, value = line.partition(" ")
                if kind == "CALL":
                    calls.append({"cwd": value, "argv": []})
                else:
                    calls[-1]["argv"].append(value)
        return calls

    def sh(self, script, args, **env):
        return run_script([os.path.join(SCRIPTS, script)] + args, env=dict(self.env, **env), executable=BASH)

    def numa_placement(self, np):
        nodes = len([d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)]) \
            if os.path.isdir("/sys/devices/system/node") else 0
        if nodes and np % nodes == 0:
            return ["--map-by", f"ppr:{np // nodes}:numa", "--bind-to", "numa"]
        return ["--bind-to", "numa"]

    # run_record.sh

    def test_command_line(self):
        flags = self.data_flags + ["--run-id", "abc", "--log-dir", "/tmp/somewhere", "--extra=1"]
        r = self.sh("run_record.sh", flags)
        self.assertEqual(r.returncode, 0, r.stderr)
        make = self.calls("make")
        self.assertEqual(len(make), 1)
        self.assertEqual(len(make[0]["argv"]), 3)
        self.assertEqual(make[0]["argv"][0], "-C")
        self.assertEqual(os.path.realpath(make[0]["argv"][1]), os.path.realpath(REPO))
        self.assertEqual(make[0]["argv"][2], "BUILD=" + self.build)
        mpirun = self.calls("mpirun")
        self.assertEqual(len(mpirun), 2)  # the platform check on every rank, then the run
        launch = ["-np", "8"] + self.numa_placement(8) + [self.trainer]
        # the platform check takes only the flags it reads (the preset, the kernels): it refuses the rest
        self.assertEqual(mpirun[0]["argv"], launch + ["--check-platform"])
        self.assertEqual(mpirun[1]["argv"], launch + flags)
        self.assertIn("--bind-to", mpirun[1]["argv"])
        self.assertEqual(os.path.realpath(mpirun[1]["cwd"]), os.path.realpath(REPO))
        self.assertIn("+ mpirun -np 8", r.stderr)

    def test_overrides(self):
        r = self.sh("run_record.sh", self.data_flags, NP="2", MPIRUN="other-mpirun --mca btl self",
                    SKIP_BUILD="1", MPI_BIND="--bind-to none")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.calls("make"), [])
        self.assertEqual(self.calls("mpirun"), [])
        other = self.calls("other-mpirun")
        self.assertEqual(other[1]["argv"], ["--mca", "btl", "self", "-np", "2", "--bind-to", "none", self.trainer]
                         + self.data_flags)
        # "--flag=value" forms of the data flags are checked too.
        eq_flags = ["--train-files=" + self.data_flags[1], "--val-files=" + self.data_flags[3]]
        r = self.sh("run_record.sh", eq_flags, SKIP_BUILD="1", NP="4", STUB_GPUS="4", SKIP_PLATFORM_CHECK="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(self.calls("mpirun")), 1)
        self.assertEqual(self.calls("mpirun")[0]["argv"][:2], ["-np", "4"])
        # BINARY: another trainer.
        other_trainer = write(os.path.join(self.tmp, "mine", "train_gpt"), "#!/bin/sh\n")
        os.chmod(other_trainer, 0o755)
        r = self.sh("run_record.sh", self.data_flags, SKIP_BUILD="1", BINARY=other_trainer, SKIP_PLATFORM_CHECK="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(other_trainer, self.calls("mpirun")[-1]["argv"])

    def test_trainer_exit_status_is_returned(self):
        r = self.sh("run_record.sh", self.data_flags, SKIP_BUILD="1", STUB_MPIRUN_EXIT="3")
        self.assertEqual(r.returncode, 3)

    def test_missing_data(self):
        missing = os.path.join(self.tmp, "nowhere", "fineweb_train_*.bin")
        r = self.sh("run_record.sh", ["--train-files", missing, "--val-files", self.data_flags[3]])
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"missing training shards: no file matches {missing}", r.stderr)
        self.assertIn("python3 data/cached_fineweb10B.py 9", r.stderr)
        self.assertNotIn("validation shards", r.stderr)
        self.assertEqual(self.calls("mpirun") + self.calls("make"), [])
        # The default paths, unless this checkout has downloaded the data.
        default_dir = os.path.join(REPO, "data", "fineweb10B")
        if not (os.path.isdir(default_dir) and any(f.startswith("fineweb_val_") for f in os.listdir(default_dir))):
            r = self.sh("run_record.sh", ["--run-id", "x"])
            self.assertEqual(r.returncode, 1)
            self.assertIn("missing validation shards: no file matches data/fineweb10B/fineweb_val_*.bin", r.stderr)
            self.assertIn("python3 data/cached_fineweb10B.py 9", r.stderr)
        r = self.sh("run_record.sh", ["--train-files"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("--train-files needs a value", r.stderr)

    def test_no_gpu(self):
        # nvidia-smi fails (driver missing) ...
        r = self.sh("run_record.sh", self.data_flags, STUB_GPUS="-1")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no NVIDIA GPU found", r.stderr)
        self.assertIn("make run", r.stderr)
        # ... or is not installed: a PATH with dirname alone.
        bare = os.path.join(self.tmp, "bare")
        os.makedirs(bare)
        os.symlink(shutil.which("dirname"), os.path.join(bare, "dirname"))
        r = run_script([os.path.join(SCRIPTS, "run_record.sh")] + self.data_flags,
                       env={"PATH": bare}, executable=BASH)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("no NVIDIA GPU found (nvidia-smi is missing or fails)", r.stderr)
        # ... or lists too few.
        r = self.sh("run_record.sh", self.data_flags, STUB_GPUS="4")
        self.assertEqual(r.returncode, 1)
        self.assertIn("nvidia-smi lists 4 GPU(s), but 8 ranks need one GPU each", r.stderr)
        self.assertEqual(self.calls("mpirun") + self.calls("make"), [])

    def test_bad_settings(self):
        r = self.sh("run_record.sh", self.data_flags, NP="eight")
        self.assertEqual(r.returncode, 2)
        self.assertIn("NP must be a positive whole number", r.stderr)
        r = self.sh("run_record.sh", self.data_flags, SKIP_BUILD="1", BUILD=os.path.join(self.tmp, "nobuild"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("nobuild/train_gpt is missing", r.stderr)
        r = self.sh("run_record.sh", self.data_flags, SKIP_BUILD="1", MPIRUN="no-such-mpirun")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no-such-mpirun not found", r.stderr)
        r = self.sh("run_record.sh", self.data_flags, SKIP_BUILD="1", STUB_CHECK_EXIT="1")
        self.assertEqual(r.returncode, 1)
        self.assertIn("the platform check failed on 8 rank(s) (above): no training started", r.stderr)
        self.assertEqual(len(self.calls("mpirun")), 1)
        r = self.sh("run_record.sh", ["--help"])
        self.assertEqual(r.returncode, 0)
        self.assertIn("NP=8", r.stdout)

    # run_many.sh

    def test_series(self):
        logs = os.path.join(self.tmp, "series")
        r = self.sh("run_many.sh", ["3"] + self.data_flags + ["--log-dir", logs], STUB_LOSSES="3.2770,3.2790,3.2780")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(self.calls("make")), 1)  # built once for the series
        calls = self.calls("mpirun")
        self.assertEqual(len(calls), 4)  # checked once for the series
        self.assertEqual(calls[0]["argv"][-1], "--check-platform")
        calls = calls[1:]
        ids = [c["argv"][c["argv"].index("--run-id") + 1] for c in calls]
        self.assertRegex(ids[0], r"^record-\d{8}-\d{6}-1-seed0$")
        self.assertEqual(ids, [ids[0][:-len("1-seed0")] + f"{i + 1}-seed{i}" for i in range(3)])
        # Each run its own seed, base 0: deterministic runs with one seed would repeat one loss.
        self.assertEqual([c["argv"][c["argv"].index("--seed") + 1] for c in calls], ["0", "1", "2"])
        self.assertEqual(sorted(os.listdir(logs)), sorted(i + ".txt" for i in ids))
        for c in calls:  # the user's flags reach every run
            self.assertEqual(c["argv"][-len(self.data_flags) - 2:], self.data_flags + ["--log-dir", logs])
        self.assertIn("n = 3 (1555/1555 steps each)\n", r.stdout)
        self.assertIn("val_loss: mean 3.27800, median 3.2780, min-max 3.2770-3.2790, std 0.00100", r.stdout)
        self.assertIn("time: mean 95.200 s", r.stdout)
        self.assertIn("3 runs: 3 finished, 0 failed", r.stderr)

    def test_series_directory_from_env_and_default(self):
        logs = os.path.join(self.tmp, "from_env")
        r = self.sh("run_many.sh", ["2"] + self.data_flags, STUB_LOSSES="3.2770,3.2790", LOG_DIR=logs,
                    RUN_PREFIX="try", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.calls("make"), [])
        names = sorted(os.listdir(logs))
        self.assertEqual(len(names), 2)
        self.assertRegex(names[0], r"^try-\d{8}-\d{6}-1-seed0\.txt$")
        argv = [c["argv"] for c in self.calls("mpirun") if "--check-platform" not in c["argv"]][0]
        self.assertEqual(argv[argv.index("--log-dir") + 1], logs)
        self.assertIn("n = 2 (1555/1555 steps each)\n", r.stdout)

    def test_series_with_a_failed_run(self):
        logs = os.path.join(self.tmp, "series")
        r = self.sh("run_many.sh", ["3"] + self.data_flags + ["--log-dir", logs],
                    STUB_LOSSES="3.2770,fail-partial,3.2790")
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(self.calls("mpirun")), 4)  # the series went on
        self.assertIn("run 2 of 3 failed (exit status 1)", r.stderr)
        self.assertIn("3 runs: 2 finished, 1 failed", r.stderr)
        self.assertIn("n = 2 (1555/1555 steps each)\n", r.stdout)
        self.assertIn("val_loss: mean 3.27800", r.stdout)

    def test_series_stops_when_nothing_is_logged(self):
        logs = os.path.join(self.tmp, "series")
        r = self.sh("run_many.sh", ["3"] + self.data_flags + ["--log-dir", logs], STUB_LOSSES="fail-early,3.2,3.2")
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(self.calls("mpirun")), 2)
        self.assertIn("run 1 of 3 failed (exit status 1) before writing", r.stderr)
        # Missing data: run_record.sh's message, and no launch.
        r = self.sh("run_many.sh", ["2", "--train-files", os.path.join(self.tmp, "none_*.bin"), "--log-dir", logs])
        self.assertEqual(r.returncode, 1)
        self.assertIn("python3 data/cached_fineweb10B.py 9", r.stderr)
        self.assertEqual(len(self.calls("mpirun")), 2)

    def test_series_checkpoints_one_directory_per_run(self):
        # one --save-checkpoint for the series: each run saves under its own DIR/<id> (the trainer
        # refuses a directory that holds another run's checkpoints)
        logs, ck = os.path.join(self.tmp, "series"), os.path.join(self.tmp, "ck")
        r = self.sh("run_many.sh", ["2"] + self.data_flags + ["--save-checkpoint", ck, "--log-dir", logs],
                    STUB_LOSSES="3.2770,3.2790", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        calls = [c["argv"] for c in self.calls("mpirun") if "--check-platform" not in c["argv"]]
        self.assertEqual(len(calls), 2)
        for argv in calls:
            self.assertEqual(argv.count("--save-checkpoint"), 1)
            self.assertEqual(argv[argv.index("--save-checkpoint") + 1], os.path.join(ck, argv[argv.index("--run-id") + 1]))
        self.assertTrue(os.path.isdir(ck))
        for flags in (["--resume", "/x/step000010"], ["--resume=/x/step000010"]):
            r = self.sh("run_many.sh", ["2"] + flags)
            self.assertEqual(r.returncode, 2)
            self.assertIn("--resume continues one run", r.stderr)

    def test_series_usage_errors(self):
        for n in ("0", "-1", "abc", "2.5", "", "00"):
            r = self.sh("run_many.sh", [n] + self.data_flags)
            self.assertEqual(r.returncode, 2, n)
            self.assertIn(f"N must be a positive whole number of runs, got '{n}'", r.stderr)
        r = self.sh("run_many.sh", [])
        self.assertEqual(r.returncode, 2)
        self.assertIn("missing N", r.stderr)
        r = self.sh("run_many.sh", ["2", "--run-id", "mine"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("--run-id is chosen by run_many.sh", r.stderr)
        r = self.sh("run_many.sh", ["2"], RUN_PREFIX="a b")
        self.assertEqual(r.returncode, 2)
        self.assertEqual(self.calls("mpirun"), [])

    def test_series_seeds(self):
        logs = os.path.join(self.tmp, "series")
        r = self.sh("run_many.sh", ["3", "--seed", "40"] + self.data_flags + ["--log-dir", logs],
                    STUB_LOSSES="3.2770,3.2790,3.2780", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        runs = [c["argv"] for c in self.calls("mpirun") if "--check-platform" not in c["argv"]]
        self.assertEqual([a.count("--seed") for a in runs], [1, 1, 1])  # the base seed is not passed on
        self.assertEqual([a[a.index("--seed") + 1] for a in runs], ["40", "41", "42"])
        self.assertTrue(all(a[a.index("--run-id") + 1].endswith(f"-seed{40 + i}") for i, a in enumerate(runs)))
        os.remove(os.path.join(self.record, "mpirun"))
        r = self.sh("run_many.sh", ["2", "--seed=7"] + self.data_flags + ["--log-dir", logs], SEED="100",
                    STUB_LOSSES="3.2770,3.2790", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        runs = [c["argv"] for c in self.calls("mpirun") if "--check-platform" not in c["argv"]]
        self.assertEqual([a[a.index("--seed") + 1] for a in runs], ["7", "8"])  # the flag over $SEED
        os.remove(os.path.join(self.record, "mpirun"))
        r = self.sh("run_many.sh", ["2"] + self.data_flags + ["--log-dir", logs], SEED="100",
                    STUB_LOSSES="3.2770,3.2790", SKIP_BUILD="1")
        runs = [c["argv"] for c in self.calls("mpirun") if "--check-platform" not in c["argv"]]
        self.assertEqual([a[a.index("--seed") + 1] for a in runs], ["100", "101"])
        for args, env in ((["2", "--seed", "x"], {}), (["2", "--seed"], {}), (["2"], {"SEED": "-3"})):
            r = self.sh("run_many.sh", args + self.data_flags, **env)
            self.assertEqual(r.returncode, 2, args)
            self.assertIn("the base seed (--seed or SEED) must be a whole number", r.stderr)

    # the CPU build

    def test_cpu(self):
        # No GPU, no FineWeb: --cpu runs the CPU build, one rank by default, oversubscribed.
        r = self.sh("run_record.sh", ["--cpu", "--preset", "tiny", "--max-steps", "6"], STUB_GPUS="-1")
        cpu_trainer = os.path.join(self.build, "train_gpt_cpu")
        self.assertEqual(r.returncode, 1)  # the stub cmake builds nothing
        self.assertIn(f"{cpu_trainer} is missing", r.stderr)
        self.assertEqual(self.calls("nvidia-smi"), [])
        self.assertEqual(self.calls("make")[0]["argv"][2:], ["BUILD=" + self.build, "configure"])
        self.assertEqual(self.calls("cmake")[0]["argv"][:4], ["--build", self.build, "--target", "train_gpt_cpu"])
        self.assertEqual(self.calls("mpirun"), [])
        write(cpu_trainer, "#!/bin/sh\n")
        os.chmod(cpu_trainer, 0o755)
        r = self.sh("run_record.sh", ["--cpu", "--preset", "tiny", "--max-steps", "6"], STUB_GPUS="-1", NP="2")
        self.assertEqual(r.returncode, 0, r.stderr)
        run = ["-np", "2", "--oversubscribe", "--bind-to", "none", cpu_trainer, "--preset", "tiny"]
        self.assertEqual([c["argv"] for c in self.calls("mpirun")], [run + ["--check-platform"], run + ["--max-steps", "6"]])
        # A series on the CPU build.
        os.remove(os.path.join(self.record, "mpirun"))
        logs = os.path.join(self.tmp, "cpu_series")
        r = self.sh("run_many.sh", ["2", "--cpu", "--preset", "tiny", "--log-dir", logs], STUB_GPUS="-1",
                    STUB_LOSSES="8.95,8.93", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("n = 2 (1555/1555 steps each)", r.stdout)
        self.assertTrue(all(cpu_trainer in c["argv"] for c in self.calls("mpirun")))
        r = self.sh("run_record.sh", ["--cpu"], HOSTFILE=os.path.join(self.tmp, "h"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("--cpu runs on this machine only", r.stderr)

    # several machines

    def hostfile(self, text):
        return write(os.path.join(self.tmp, "hosts"), text)

    def test_hostfile_two_nodes(self):
        hosts = self.hostfile("# two 4-GPU nodes\nnodeA slots=4\n\nnodeB slots=4 max_slots=4  # the second\n")
        r = self.sh("run_record.sh", self.data_flags + ["--run-id", "x"], HOSTFILE=hosts, STUB_NODE_GPUS="4,4",
                    STUB_GPUS="0", NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="eth0", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 0, r.stderr)
        calls = [c["argv"] for c in self.calls("mpirun")]
        self.assertEqual(len(calls), 3)
        self.assertEqual(calls[0][:4], ["--hostfile", hosts, "-npernode", "1"])  # every node's GPUs
        self.assertEqual(self.calls("nvidia-smi")[0]["argv"], ["-L"])
        self.assertEqual(len(self.calls("nvidia-smi")), 2)  # one per node, none on this machine
        run = calls[2]
        self.assertEqual(run[:4], ["-np", "8", "--hostfile", hosts])  # 8 ranks: the slots summed
        forwarded = sorted(run[i + 1] for i, a in enumerate(run) if a == "-x")
        self.assertIn("NCCL_DEBUG", forwarded)
        self.assertIn("NCCL_SOCKET_IFNAME", forwarded)
        self.assertEqual(run[run.index("--map-by"):run.index("--map-by") + 4], ["--map-by", "slot", "--bind-to", "none"])
        self.assertEqual(run[-len(self.data_flags) - 3:], [self.trainer] + self.data_flags + ["--run-id", "x"])
        self.assertEqual(calls[1], run[:-len(self.data_flags) - 2] + ["--check-platform"])

    def test_hostfile_problems(self):
        hosts = self.hostfile("nodeA slots=4\nnodeB slots=4\n")
        r = self.sh("run_record.sh", self.data_flags, HOSTFILE=hosts, STUB_NODE_GPUS="4,2", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 1)
        self.assertRegex(r.stderr, r"node nodeB \(\S+\) lists 2 GPU\(s\), but its slots=4 ranks need one GPU each")
        self.assertEqual(len(self.calls("mpirun")), 1)  # no launch after the node check
        r = self.sh("run_record.sh", self.data_flags, HOSTFILE=hosts, STUB_NODE_GPUS="4,4", NP="4", SKIP_BUILD="1")
        self.assertEqual(r.returncode, 2)
        self.assertIn("NP=4 differs from the 8 slots of HOSTFILE", r.stderr)
        cases = [("nodeA slots=4\nnodeB\n", "line 2: 'nodeB' has no slots=N"),
                 ("nodeA slots=0\n", "line 1: 'nodeA' has no slots=N"),
                 ("nodeA slots=4\nnodeA slots=4\n", "line 2: 'nodeA' is listed twice"),
                 ("# nothing\n\n", "names no node")]
        for text, message in cases:
            r = self.sh("run_record.sh", self.data_flags, HOSTFILE=self.hostfile(text), STUB_NODE_GPUS="4,4")
            self.assertEqual(r.returncode, 1, text)
            self.assertIn(message, r.stderr, text)
        r = self.sh("run_record.sh", self.data_flags, HOSTFILE=os.path.join(self.tmp, "none"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot be read", r.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stub-trainer"]:
        sys.exit(stub_trainer(sys.argv[2:]))
    if sys.argv[1:2] == ["--stub-nodes"]:
        sys.exit(stub_nodes(sys.argv[2:]))
    unittest.main(verbosity=2)
