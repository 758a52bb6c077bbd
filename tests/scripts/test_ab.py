#!/usr/bin/env python3
"""Offline tests of the A/B comparison: stats.py's paired statistics (--ab, --paired, --z-sigma)
against scipy on fresh random data, its checks of an A/B folder (balance, completeness, seeds,
source hashes, copies), statistics.md, source_hash.py against an independent FNV-1a over a bundle
written by cmake/embed_sources.cmake, and scripts/run_ab.sh's orchestration (block order, seeds,
manifest, flags, progress, Ctrl-C) with two stand-in build folders whose "trainer" writes
synthetic logs, and a stub mpirun that runs it. scipy is required: without it this test fails.
The real builds and runs: test_run_ab_cpu.py.
"""
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest

import scipy.stats  # noqa: F401 (the independent reference; a missing scipy fails the test)
from scipy import stats as sps

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)
sys.path.insert(0, HERE)
import source_hash  # noqa: E402
import stats  # noqa: E402
from test_scripts import log_text  # noqa: E402

SEED = int(os.environ.get("TEST_SEED", random.SystemRandom().randrange(1 << 30)))
print(f"TEST_SEED={SEED}", flush=True)
BASH = shutil.which("bash") or "/bin/bash"
HASHES = {"A": "00000000000000aa", "B": "00000000000000bb"}
# Environment lines as this trainer logs them on an 8-GPU node (runtime/log.h).
ENV = ("device: NVIDIA H100 80GB HBM3 x 8 visible, 132 SMs; 8 rank(s)\n"
       + "".join(f"gpu: {i}, NVIDIA H100 80GB HBM3, 570.86.15, 1980 MHz, 1980 MHz, 2619 MHz\n" for i in range(8))
       + "cuda_driver: 12.8\ncuda_runtime: 12.8\ncublaslt: 12.8.4\nnccl: 2.27.3\n"
       "command: ./build/train_gpt --seed {seed}\ndate_utc: 2026-11-27T08:00:00Z\nhosts: node7\nworld_size: 8\n")


def plan_order(pairs):
    """The arms in run order of run_ab.sh's plan, written here from its definition: pairs AB BA in
    even blocks of two pairs, BA AB in odd ones."""
    order = []
    for i in range(pairs):
        order += ["A", "B"] if (i // 2 + i % 2) % 2 == 0 else ["B", "A"]
    return order


def write_ab_folder(directory, times, losses, order=None, seeds=None, hashes=HASHES, skip=()):
    """An A/B folder as run_ab.sh leaves it: a manifest and one log a run. times, losses:
    {arm: [per pair]} (ms, loss); order: the arms in run order (default: the balanced plan)."""
    n = len(times["A"])
    order = order or plan_order(n)
    seeds = seeds or list(range(n))
    runs = []
    for k, arm in enumerate(order, 1):
        pair = (k - 1) // 2
        log = f"{arm}/ab-x-{k}-{arm}-seed{seeds[pair]}.txt"
        runs.append(f"run: {k} {arm} {seeds[pair]} {log}")
        if k in skip:
            continue
        header = ENV.format(seed=seeds[pair]) + f"seed: {seeds[pair]}\nsource_hash: {hashes[arm]}\n"
        path = os.path.join(directory, log)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(log_text(losses[arm][pair], times[arm][pair], header=header))
    arms = "".join(order)
    manifest = ["# test", "command: scripts/run_ab.sh HEAD~1 HEAD %d" % n, "A: HEAD~1", "A_commit: 1111",
                f"A_source_hash: {HASHES['A']}", "B: HEAD", "B_commit: 2222", f"B_source_hash: {HASHES['B']}",
                "seeds: " + " ".join(map(str, seeds)), "order: " + " ".join(arms[i:i + 4] for i in range(0, len(arms), 4))]
    with open(os.path.join(directory, "manifest"), "w") as f:
        f.write("\n".join(manifest + runs) + "\n")


def drift_case(rng, pairs=8, gain_ms=300, drift_ms=1000, second_ms=100):
    """Times (ms) where the machine drifts by +-1 s between blocks of four runs, B is 0.3 s faster
    than A, and the second run of a pair 0.1 s slower; losses paired by seed."""
    order = plan_order(pairs)
    offset, block_offsets = 0, []
    for _ in range((2 * pairs + 3) // 4):
        block_offsets.append(offset)
        offset += rng.choice((-drift_ms, drift_ms))
    times = {"A": [0] * pairs, "B": [0] * pairs}
    for k, arm in enumerate(order):
        pair = k // 2
        t = 95000 + block_offsets[k // 4] + (second_ms if k % 2 else 0) + rng.gauss(0, 40)
        times[arm][pair] = int(round(t - (gain_ms if arm == "B" else 0)))
    seed_effect = [rng.gauss(0, 0.0013) for _ in range(pairs)]
    losses = {"A": [round(3.2785 + e, 4) for e in seed_effect],
              "B": [round(3.2790 + e + rng.gauss(0, 0.0003), 4) for e in seed_effect]}
    return times, losses, order


def read(path):
    with open(path) as f:
        return f.read()


def rewrite(path, text):
    with open(path, "w") as f:
        f.write(text)


def run_stats(args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "stats.py")] + args, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))


class Distributions(unittest.TestCase):
    def test_quantile_against_scipy(self):
        for df in (1, 2, 3.5, 7, 30, 250.5, 5e4):
            for q in (0.0005, 0.025, 0.3, 0.5, 0.9, 0.975, 0.995, 0.9999):
                self.assertAlmostEqual(stats.student_t_quantile(q, df), sps.t.ppf(q, df), delta=1e-9 * max(1, abs(sps.t.ppf(q, df))),
                                       msg=f"q={q} df={df}")
        with self.assertRaises(ValueError):
            stats.student_t_quantile(1.0, 3)

    def test_paired_welch_and_z_against_scipy(self):
        rng = random.Random(SEED)
        for n in (2, 3, 8, 25):
            a = [rng.gauss(95, 1.5) for _ in range(n)]
            b = [x + rng.gauss(-0.2, 0.3) for x in a]
            got = stats.mean_difference_test([y - x for x, y in zip(a, b)])
            ref = sps.ttest_rel(b, a)
            self.assertAlmostEqual(got["t"], ref.statistic, places=9)
            self.assertAlmostEqual(got["p"], ref.pvalue, places=10)
            lo, hi = ref.confidence_interval(0.95)
            self.assertAlmostEqual(got["ci"][0], lo, places=9)
            self.assertAlmostEqual(got["ci"][1], hi, places=9)
            w = stats.welch_result(a, b)
            ref = sps.ttest_ind(b, a, equal_var=False)
            self.assertAlmostEqual(w["t"], ref.statistic, places=9)
            self.assertAlmostEqual(w["p"], ref.pvalue, places=10)
            losses = [rng.gauss(3.2775, 0.0013) for _ in range(n)]
            z = stats.one_sample_z_test_less(losses, 3.28, 0.0013)
            mean = sum(losses) / n
            self.assertAlmostEqual(z["p"], sps.norm.sf((3.28 - mean) * math.sqrt(n) / 0.0013), places=12)
            self.assertEqual(z["passes"], (3.28 - mean) * math.sqrt(n) >= 0.004)
        one = stats.mean_difference_test([0.5])
        self.assertIsNone(one["t"])
        self.assertIsNone(one["ci"])
        flat = stats.mean_difference_test([0.5, 0.5, 0.5])
        self.assertIsNone(flat["t"])
        self.assertEqual(flat["ci"], [0.5, 0.5])


class AbFolder(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_ab_")
        self.rng = random.Random(SEED)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def folder(self, name="ab", **kw):
        directory = os.path.join(self.tmp, name)
        os.makedirs(directory)
        write_ab_folder(directory, **kw)
        return directory

    def ab_json(self, directory, *extra, code=0):
        r = run_stats(["--ab", directory, "--json", *extra])
        self.assertEqual(r.returncode, code, r.stderr)
        return (json.loads(r.stdout) if code == 0 else None), r

    def test_drift_case_paired_significant_welch_not(self):
        times, losses, order = drift_case(self.rng)
        result, _ = self.ab_json(self.folder(times=times, losses=losses))
        a_s = [t / 1000 for t in times["A"]]
        b_s = [t / 1000 for t in times["B"]]
        paired = result["train_time_s"]["paired"]
        ref = sps.ttest_rel(b_s, a_s)
        self.assertAlmostEqual(paired["mean"], sum(b_s) / 8 - sum(a_s) / 8, places=9)
        self.assertAlmostEqual(paired["t"], ref.statistic, places=7)
        self.assertAlmostEqual(paired["p"], ref.pvalue, places=9)
        self.assertLess(paired["p"], 0.01, "the paired test sees the 0.3 s gain through the drift")
        lo, hi = ref.confidence_interval(0.95)
        self.assertAlmostEqual(paired["ci"][0], lo, places=7)
        self.assertAlmostEqual(paired["ci"][1], hi, places=7)
        welch = result["train_time_s"]["welch"]
        ref = sps.ttest_ind(b_s, a_s, equal_var=False)
        self.assertAlmostEqual(welch["p"], ref.pvalue, places=9)
        self.assertGreater(welch["p"], 0.05, "unpaired, the drift hides the gain")
        loss = result["val_loss"]["paired"]
        ref = sps.ttest_rel(losses["B"], losses["A"])
        self.assertAlmostEqual(loss["t"], ref.statistic, places=6)
        self.assertAlmostEqual(loss["p"], ref.pvalue, places=8)
        # Order effect: half the difference of the mean B - A between A-first and B-first pairs.
        d = {arm: [b - a for a, b, first in zip(a_s, b_s, order[0::2]) if first == arm] for arm in "AB"}
        o = result["order_effect"]
        self.assertAlmostEqual(o["second_minus_first"], (sum(d["A"]) / 4 - sum(d["B"]) / 4) / 2, places=9)
        self.assertAlmostEqual(o["p"], sps.ttest_ind(d["A"], d["B"], equal_var=False).pvalue, places=9)
        self.assertEqual((o["a_first"], o["b_first"]), (4, 4))
        # Noise floor: the later minus the earlier A run of each block of four.
        run_time = {}
        for k, arm in enumerate(order):
            run_time[k] = (arm, times[arm][k // 2] / 1000)
        for arm in "AB":
            expected = []
            for block in range(4):
                mine = [t for k, (a, t) in run_time.items() if a == arm and k // 4 == block]
                expected.append(mine[1] - mine[0])
            self.assertEqual(len(result["noise_floor"][arm]["differences"]), 4)
            for got, want in zip(result["noise_floor"][arm]["differences"], expected):
                self.assertAlmostEqual(got, want, places=9)
        for arm in "AB":
            self.assertEqual(result[arm]["n"], 8)
            self.assertEqual([r["seed"] for r in result[arm]["runs"]], list(range(8)))

    def test_text_markdown_and_z(self):
        times, losses, _ = drift_case(self.rng)
        directory = self.folder(times=times, losses=losses)
        r = run_stats(["--ab", directory, "--markdown", "--z-sigma", "0.0013"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("block order: ABBA BAAB ABBA BAAB", r.stdout)
        self.assertIn("B is faster than A by", r.stdout)
        self.assertIn("track 3 z-test (sigma 0.0013)", r.stdout)
        md = read(os.path.join(directory, "statistics.md"))
        for section in ("## Command", "## Revisions", "## Machine", "## Runs, in the order they ran", "## Per arm",
                        "## Paired results (B - A)", "## Plot", "scripts/run_ab.sh HEAD~1 HEAD 8",
                        "./build/train_gpt --seed 0", HASHES["A"], HASHES["B"], "8 x NVIDIA H100 80GB HBM3",
                        "570.86.15", "SM 1980 MHz (max 1980 MHz), memory 2619 MHz", "12.8 / 12.8", "12.8.4",
                        "2.27.3", "node7", "order effect", "noise floor, A against A", "track 3 z-test",
                        "![val loss and time of both arms](ab.png)"):
            self.assertIn(section, md)
        for arm in "AB":
            self.assertIn("val_losses = [" + ", ".join(f"{x:.4f}" for x in losses[arm]) + "]", md)
            self.assertIn("times = [" + ", ".join(f"{t / 1000:.3f}" for t in times[arm]) + "]", md)
        self.assertTrue(os.path.getsize(os.path.join(directory, "ab.png")) > 10000)

    def test_unbalanced_or_malformed_plans_refused(self):
        times, losses, order = drift_case(self.rng, pairs=4)
        cases = [(["A", "B"] * 4, "unbalanced: A runs first in 4 pair(s) (seeds 0 1 2 3), B in 0"),
                 (["A", "B", "A", "B", "B", "A", "B", "A"], None)]  # balanced pairs in another block order: accepted
        for i, (arms, message) in enumerate(cases):
            directory = self.folder(f"o{i}", times=times, losses=losses, order=arms)
            result, r = self.ab_json(directory, code=1 if message else 0)
            if message:
                self.assertIn(message, r.stderr)
                self.assertIn("not a balanced A/B plan", r.stderr)
        directory = self.folder("seeds", times=times, losses=losses, seeds=[0, 1, 1, 3])
        _, r = self.ab_json(directory, code=1)
        self.assertIn("seed(s) 1 planned for more than one pair", r.stderr)
        # A pair that is two A runs.
        directory = self.folder("pair", times=times, losses=losses)
        text = read(os.path.join(directory, "manifest")).replace("run: 2 B 0 B/", "run: 2 A 0 B/")
        rewrite(os.path.join(directory, "manifest"), text)
        _, r = self.ab_json(directory, code=1)
        self.assertIn("runs 1 and 2 are not a pair (one A and one B run of one seed): A seed 0, A seed 0", r.stderr)
        # A manifest line that is not key: value, one with a key missing, and no manifest at all.
        for edit, message in ((lambda t: t + "garbage\n", "not a 'key: value' line: 'garbage'"),
                              (lambda t: re.sub(r"B_source_hash: .*\n", "", t), "the manifest has no B_source_hash line"),
                              (lambda t: t.replace("run: 3 B 1", "run: 3 C 1"), "a run line is 'run: POSITION A|B SEED LOG'")):
            directory = self.folder(f"m{len(os.listdir(self.tmp))}", times=times, losses=losses)
            path = os.path.join(directory, "manifest")
            rewrite(path, edit(read(path)))
            _, r = self.ab_json(directory, code=1)
            self.assertIn(message, r.stderr)
        os.remove(os.path.join(directory, "manifest"))
        _, r = self.ab_json(directory, code=1)
        self.assertIn("not an A/B folder written by scripts/run_ab.sh", r.stderr)
        _, r = self.ab_json(os.path.join(self.tmp, "none"), code=1)
        self.assertIn("no such directory", r.stderr)

    def test_incomplete_folder_names_what_is_missing(self):
        times, losses, order = drift_case(self.rng, pairs=4)
        directory = self.folder(times=times, losses=losses, skip=(7,))
        # Run 5's log ends before its last validation (a run stopped by Ctrl-C).
        run5 = [line.split()[4] for line in read(os.path.join(directory, "manifest")).splitlines() if line.startswith("run: 5 ")][0]
        path = os.path.join(directory, run5)
        text = read(path)
        rewrite(path, text[:text.index("step:1000/1555")])
        _, r = self.ab_json(directory, code=1)
        self.assertIn("is incomplete: 2 of 8 planned runs have no finished log", r.stderr)
        self.assertRegex(r.stderr, rf"run 5 \({order[4]}, seed 2, {re.escape(run5)}\): incomplete: last validation at step 750 of 1555")
        self.assertRegex(r.stderr, rf"run 7 \({order[6]}, seed 3, {order[6]}/ab-x-7-{order[6]}-seed3.txt\): no such file")
        self.assertIn("Give --partial", r.stderr)
        result, r = self.ab_json(directory, "--partial")
        self.assertEqual([p["seed"] for p in result["pairs"]], [0, 1])
        self.assertIn("counting the complete pairs (--partial)", r.stderr)
        self.assertIsNone(result["runs"][4]["val_loss"])
        # One complete pair is too few.
        directory = self.folder("one", times=times, losses=losses, skip=(3, 5, 7))
        _, r = self.ab_json(directory, "--partial", code=1)
        self.assertIn("1 complete pair(s): the paired tests need at least 2", r.stderr)

    def test_foreign_and_copied_logs_refused(self):
        times, losses, order = drift_case(self.rng, pairs=4)
        directory = self.folder(times=times, losses=losses)
        logs = [line.split()[4] for line in read(os.path.join(directory, "manifest")).splitlines() if line.startswith("run: ")]
        # A log whose seed line is not the planned seed, and one of another build.
        path = os.path.join(directory, logs[2])
        text = read(path)
        rewrite(path, text.replace("\nseed: 1\n", "\nseed: 9\n"))
        _, r = self.ab_json(directory, code=1)
        self.assertIn(f"{path}: its seed line says 9, the manifest plans seed 1", r.stderr)
        arm = order[2]
        rewrite(path, text.replace(HASHES[arm], "0123456789abcdef"))
        _, r = self.ab_json(directory, code=1)
        self.assertIn(f"source_hash 0123456789abcdef is not arm {arm}'s {HASHES[arm]} (a log of another build)", r.stderr)
        rewrite(path, text)
        # A planted copy: the same run's lines under another seed of the same arm, and across arms.
        first_a = next(i for i, arm in enumerate(order) if arm == "A")
        later_a = next(i for i, arm in enumerate(order) if arm == "A" and i // 2 == 3)
        source = read(os.path.join(directory, logs[first_a]))
        target = os.path.join(directory, logs[later_a])
        rewrite(target, source.replace("\nseed: 0\n", "\nseed: 3\n"))
        _, r = self.ab_json(directory, code=1)
        self.assertIn(f"{target} repeats {os.path.join(directory, logs[first_a])}: the same step and validation lines "
                      "(a copied log)", r.stderr)
        directory = self.folder("across", times=times, losses=losses)
        partner = first_a ^ 1  # the B run of seed 0: a copy of A's with B's hash
        source = read(os.path.join(directory, logs[first_a]))
        rewrite(os.path.join(directory, logs[partner]), source.replace(HASHES["A"], HASHES["B"]))
        _, r = self.ab_json(directory, code=1)
        self.assertIn("the same step and validation lines (a copied log)", r.stderr)
        # A stray log in an arm's folder is named and left out.
        directory = self.folder("stray", times=times, losses=losses)
        shutil.copy(os.path.join(directory, logs[0]), os.path.join(directory, "A", "extra.txt"))
        _, r = self.ab_json(directory)
        self.assertIn("extra.txt: not a run of", r.stderr)

    def test_arms_of_one_source_are_a_noise_measurement(self):
        # A against A: both arms one build, the same seeds give the same losses; nothing is a copy.
        times, losses, _ = drift_case(self.rng, pairs=4)
        losses["B"] = list(losses["A"])
        directory = self.folder(times=times, losses=losses, hashes={"A": HASHES["A"], "B": HASHES["A"]})
        text = read(os.path.join(directory, "manifest")).replace(f"B_source_hash: {HASHES['B']}",
                                                                          f"B_source_hash: {HASHES['A']}")
        rewrite(os.path.join(directory, "manifest"), text)
        result, _ = self.ab_json(directory)
        self.assertEqual(result["val_loss"]["paired"]["mean"], 0.0)


class PairedSets(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_ab_")
        self.rng = random.Random(SEED + 1)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def write(self, name, seed, loss, ms, source="00000000000000aa"):
        path = os.path.join(self.tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(log_text(loss, ms, header=f"seed: {seed}\nsource_hash: {source}\n"))
        return path

    def test_paired_by_seed_against_scipy(self):
        seeds = [3, 0, 2, 1, 4]
        a = {s: (round(3.279 + self.rng.gauss(0, 0.001), 4), 95000 + self.rng.randrange(-900, 900)) for s in seeds}
        b = {s: (round(a[s][0] + 0.0004 + self.rng.gauss(0, 0.0002), 4), a[s][1] - 250 + self.rng.randrange(-40, 40))
             for s in seeds}
        for s in seeds:
            self.write(f"old/s{s}.txt", s, *a[s])
            self.write(f"new/s{s}.txt", s, *b[s], source="00000000000000bb")
        r = run_stats(["--paired", "--json", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 0, r.stderr)
        result = json.loads(r.stdout)
        order = sorted(seeds)
        self.assertEqual(result["seeds"], order)
        ref = sps.ttest_rel([b[s][1] / 1000 for s in order], [a[s][1] / 1000 for s in order])
        self.assertAlmostEqual(result["train_time_s"]["paired"]["p"], ref.pvalue, places=9)
        ref = sps.ttest_rel([b[s][0] for s in order], [a[s][0] for s in order])
        self.assertAlmostEqual(result["val_loss"]["paired"]["p"], ref.pvalue, places=9)
        ref = sps.ttest_ind([b[s][1] / 1000 for s in order], [a[s][1] / 1000 for s in order], equal_var=False)
        self.assertAlmostEqual(result["train_time_s"]["welch"]["p"], ref.pvalue, places=9)
        r = run_stats(["--paired", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("new - old, paired (5 pairs):", r.stdout)
        self.assertIn("new is faster than old by", r.stdout)

    def test_duplicates_and_unpaired_seeds(self):
        for s in (0, 1, 2):
            self.write(f"old/s{s}.txt", s, 3.279 + s / 1000, 95000 + 10 * s)
            self.write(f"new/s{s}.txt", s, 3.2795 + s / 1000, 94700 + 30 * s, source="00000000000000bb")
        # A rerun of seed 1 (same source, seed and losses) is counted once, as before.
        shutil.copy(os.path.join(self.tmp, "old/s1.txt"), os.path.join(self.tmp, "old/s1-again.txt"))
        r = run_stats(["--paired", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("duplicate of", r.stderr)
        self.assertIn("3 pairs", r.stdout)
        # A second run of seed 1 with another loss cannot be paired.
        self.write("old/s1-other.txt", 1, 3.2811, 95500)
        r = run_stats(["--paired", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 1)
        self.assertIn("seed 1 twice in the old set", r.stderr)
        os.remove(os.path.join(self.tmp, "old/s1-other.txt"))
        self.write("new/s7.txt", 7, 3.2791, 94000, source="00000000000000bb")
        r = run_stats(["--paired", os.path.join(self.tmp, "old"), "--", os.path.join(self.tmp, "new")])
        self.assertEqual(r.returncode, 1)
        self.assertIn("unpaired runs: seed 7 only in the new set", r.stderr)

    def test_argument_errors(self):
        for args, message in ((["--paired", "x"], "--paired needs both sets"),
                              (["--compare", "--paired", "x", "--", "y"], "two modes"),
                              (["--ab", "d", "x"], "--ab DIR reads the A/B folder alone"),
                              (["--markdown", "x"], "--partial and --markdown go with --ab DIR"),
                              (["--z-sigma", "0", "x"], "--z-sigma must be a positive number")):
            r = run_stats(args)
            self.assertEqual(r.returncode, 2, args)
            self.assertIn(message, r.stderr)

    def test_z_sigma_in_summary(self):
        paths = [self.write(f"z/s{s}.txt", s, loss, 95000) for s, loss in enumerate((3.2770, 3.2765, 3.2781, 3.2772))]
        r = run_stats(["--z-sigma", "0.0013", "--json"] + paths)
        self.assertEqual(r.returncode, 0, r.stderr)
        z = json.loads(r.stdout)["z_test"]
        mean = (3.2770 + 3.2765 + 3.2781 + 3.2772) / 4
        self.assertAlmostEqual(z["margin"], (3.28 - mean) * 2, places=12)
        self.assertTrue(z["passes"])
        self.assertAlmostEqual(z["p"], sps.norm.sf((3.28 - mean) * 2 / 0.0013), places=12)


def independent_fnv(files):
    h = 0xcbf29ce484222325
    for path, data in files:
        for byte in path.encode() + b"\0" + data + b"\0":
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def embed(src_dir, files, out):
    """A source bundle as the build writes it (cmake/embed_sources.cmake)."""
    for rel, data in files:
        os.makedirs(os.path.dirname(os.path.join(src_dir, rel)), exist_ok=True)
        with open(os.path.join(src_dir, rel), "wb") as f:
            f.write(data)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    subprocess.run(["cmake", f"-DREPO={src_dir}", f"-DOUTPUT={out}", "-DFILES=" + ",".join(r for r, _ in files), "-P",
                    os.path.join(REPO, "cmake", "embed_sources.cmake")], check=True, capture_output=True)


# The stand-in trainer of a stand-in build folder: records its call, passes --check-platform, and
# copies the log its arm and seed have in $STUB_AB_LOGS (written by the test: seed and source_hash
# lines, a time with a jitter). $STUB_AB_HANG names a run position whose trainer writes a log cut
# after its first steps, then waits to be interrupted; $STUB_AB_FAIL one that writes it and fails,
# $STUB_AB_FAIL_EARLY one that fails before writing any.
FAKE_TRAINER = """#!/bin/sh
echo "{arm} $*" >>"$STUB_AB_RECORD"
case " $* " in *" --check-platform "*) exit 0 ;; esac
while [ $# -gt 0 ]; do
  case $1 in
    --run-id) id=$2; shift ;;
    --log-dir) dir=$2; shift ;;
    --seed) seed=$2; shift ;;
  esac
  shift
done
position=$(echo "$id" | cut -d- -f4)
if [ "$position" = "${{STUB_AB_FAIL_EARLY-}}" ]; then
  exit 1
fi
if [ "$position" = "${{STUB_AB_FAIL-}}" ]; then
  cp "$STUB_AB_LOGS/{arm}-seed$seed-cut.txt" "$dir/$id.txt"
  exit 1
fi
if [ "$position" = "${{STUB_AB_HANG-}}" ]; then
  cp "$STUB_AB_LOGS/{arm}-seed$seed-cut.txt" "$dir/$id.txt"
  sleep 60
  exit 3
fi
cp "$STUB_AB_LOGS/{arm}-seed$seed.txt" "$dir/$id.txt"
"""

STUB_MPIRUN = """#!/bin/sh
# mpirun's launch flags dropped, the command run in place.
while [ $# -gt 0 ]; do
  case $1 in
    -np|--bind-to|--map-by|--hostfile|-x) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
exec "$@"
"""


class RunAb(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_ab_")
        self.record = os.path.join(self.tmp, "calls")
        stubs = os.path.join(self.tmp, "stubs")
        os.makedirs(stubs)
        with open(os.path.join(stubs, "mpirun"), "w") as f:
            f.write(STUB_MPIRUN)
        os.chmod(os.path.join(stubs, "mpirun"), 0o755)
        self.builds, self.hashes = {}, {}
        for arm in "AB":
            build = os.path.join(self.tmp, f"build{arm}")
            files = [("train_gpt.cu", f"// arm {arm}\nint main() {{}}\n".encode()), ("runtime/log.h", b"#pragma once\n")]
            embed(os.path.join(self.tmp, f"src{arm}"), files, os.path.join(build, "gen", "source_bundle.cpp"))
            self.hashes[arm] = independent_fnv(files)
            with open(os.path.join(build, "CMakeCache.txt"), "w") as f:
                f.write(f"CMAKE_HOME_DIRECTORY:INTERNAL={self.tmp}/src{arm}\n")
            trainer = os.path.join(build, "train_gpt_cpu")
            with open(trainer, "w") as f:
                f.write(FAKE_TRAINER.format(arm=arm))
            os.chmod(trainer, os.stat(trainer).st_mode | stat.S_IXUSR)
            self.builds[arm] = build
        # Each arm's log for each seed it may run: 6 of 34 steps, B 0.3 s faster, a jitter per run.
        logs = os.path.join(self.tmp, "logs")
        os.makedirs(logs)
        rng = random.Random(SEED + 3)
        for arm in "AB":
            for seed in range(10):
                header = f"seed: {seed}\nsource_hash: {self.hashes[arm]}\n"
                ms = 60000 + rng.randrange(400) - (300 if arm == "B" else 0)
                loss = 8.9 + seed / 100 + (0.001 if arm == "B" else 0)
                rewrite(os.path.join(logs, f"{arm}-seed{seed}.txt"), log_text(loss, ms, total=34, max_steps=6, header=header))
                rewrite(os.path.join(logs, f"{arm}-seed{seed}-cut.txt"), log_text(loss, ms, total=34, stop_at=3, header=header))
        self.env = dict(os.environ, PATH=stubs + os.pathsep + os.environ["PATH"], STUB_AB_RECORD=self.record, STUB_AB_LOGS=logs,
                        SKIP_BUILD="1", PYTHONDONTWRITEBYTECODE="1", LOG_DIR=os.path.join(self.tmp, "ab"))
        for var in ("NP", "MPIRUN", "MPI_BIND", "SEED", "HOSTFILE", "SKIP_PLATFORM_CHECK", "BINARY", "AB_BUILDS"):
            self.env.pop(var, None)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def run_ab(self, args, **env):
        return subprocess.run([BASH, os.path.join(SCRIPTS, "run_ab.sh")] + args, capture_output=True, text=True,
                              env=dict(self.env, **env), timeout=300)

    def calls(self):
        with open(self.record) as f:
            return [line.split() for line in f.read().splitlines()]

    def test_series(self):
        flags = ["--cpu", "--preset", "tiny", "--max-steps", "6", "--seed", "5"]
        r = self.run_ab([self.builds["A"], self.builds["B"], "4"] + flags)
        self.assertEqual(r.returncode, 0, r.stderr)
        directory = os.path.join(self.tmp, "ab")
        manifest = read(os.path.join(directory, "manifest"))
        self.assertIn("order: ABBA BAAB\n", manifest)
        self.assertIn("seeds: 5 6 7 8\n", manifest)
        for arm in "AB":
            self.assertIn(f"{arm}_source_hash: {self.hashes[arm]}\n", manifest)
            self.assertIn(f"{arm}: {self.builds[arm]}\n", manifest)
        self.assertIn("trainer_flags: --preset tiny --max-steps 6\n", manifest)
        runs = [line.split()[1:] for line in manifest.splitlines() if line.startswith("run: ")]
        self.assertEqual([r[1] for r in runs], plan_order(4))
        # Balanced: each arm first in half of the pairs and of the blocks of four.
        firsts = [r[1] for r in runs[0::2]]
        self.assertEqual(firsts.count("A"), firsts.count("B"))
        block_firsts = [r[1] for r in runs[0::4]]
        self.assertEqual(block_firsts.count("A"), block_firsts.count("B"))
        # Each arm ran its binary with every seed once, the flags passed on; the platform check
        # once per arm, before its first run.
        calls = self.calls()
        # (run_record.sh gives the platform check only the flags it reads: the others are refused there)
        self.assertEqual([c for c in calls if "--check-platform" in c],
                         [[arm, "--preset", "tiny", "--check-platform"] for arm in "AB"])
        trained = [c for c in calls if "--check-platform" not in c]
        self.assertEqual([c[0] for c in trained], plan_order(4))
        for c in trained:
            self.assertEqual(c[-4:], ["--preset", "tiny", "--max-steps", "6"])
        for arm in "AB":
            seeds = [int(c[c.index("--seed") + 1]) for c in trained if c[0] == arm]
            self.assertEqual(sorted(seeds), [5, 6, 7, 8])
            logs = sorted(os.listdir(os.path.join(directory, arm)))
            self.assertEqual(len(logs), 4)
            self.assertTrue(all(re.fullmatch(rf"ab-\d{{8}}-\d{{6}}-\d-{arm}-seed[5-8]\.txt", n) for n in logs), logs)
        self.assertEqual(len(re.findall(r"^== \[\d/8\] [AB] seed \d: \d+ s \(step 6/34, val_loss 8\.9\d+, train_time \d+ ms\); "
                                        r"\d to go, ETA \d+ s", r.stderr, re.M)), 8, r.stderr)
        self.assertIn("B is faster than A by", r.stdout)
        self.assertTrue(os.path.exists(os.path.join(directory, "statistics.md")))
        self.assertIn(f"wrote {directory}/statistics.md", r.stdout)

    def test_failed_runs(self):
        r = self.run_ab([self.builds["A"], self.builds["B"], "4", "--cpu", "--preset", "tiny"], STUB_AB_FAIL="3")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, r"== run 3 \(B, seed 1\) failed \(exit status 1\); its log \S+-3-B-seed1.txt is left out")
        self.assertIn("7 of 8 runs finished, 1 failed", r.stderr)
        self.assertIn("B - A, paired (3 pairs):", r.stdout)  # the complete pairs
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "ab", "statistics.md")))
        shutil.rmtree(os.path.join(self.tmp, "ab"))
        r = self.run_ab([self.builds["A"], self.builds["B"], "4", "--cpu", "--preset", "tiny"], STUB_AB_FAIL_EARLY="2")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, r"run 2 \(B, seed 0\) failed \(exit status 1\) before writing \S+: stopping the series")
        self.assertNotIn("== run 3", r.stderr)

    def test_same_sources_warned(self):
        # One build as both arms: an A/A series, which measures the noise; said before the first run.
        # (The stand-in's runs of a seed are then copies of each other, which the statistics refuse.)
        r = self.run_ab([self.builds["A"], self.builds["A"], "2", "--cpu", "--preset", "tiny"])
        self.assertIn(f"A and B embed the same sources (source_hash {self.hashes['A']}): this measures the noise", r.stderr)
        self.assertLess(r.stderr.index("embed the same sources"), r.stderr.index("== run 1 of 4"))

    def test_interrupted(self):
        proc = subprocess.Popen([BASH, os.path.join(SCRIPTS, "run_ab.sh"), self.builds["A"], self.builds["B"], "4", "--cpu",
                                 "--preset", "tiny"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(self.env, STUB_AB_HANG="6"), start_new_session=True)
        directory = os.path.join(self.tmp, "ab")
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not any("-6-" in n for arm in "AB" if os.path.isdir(os.path.join(directory, arm))
                                                  for n in os.listdir(os.path.join(directory, arm))):
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=120)
        self.assertEqual(proc.returncode, 130, err)
        self.assertIn("== run 6 interrupted (Ctrl-C)", err)
        self.assertIn("5 of 8 runs finished, 0 failed, interrupted", err)
        self.assertEqual(len(re.findall(r"^   finished: run [1-5]: [AB] seed [0-2], \S+\.txt$", err, re.M)), 5, err)
        self.assertIn("counting the complete pairs (--partial)", err)
        self.assertRegex(err, r"run 6 \([AB], seed 2, [AB]/ab-\S+-6-[AB]-seed2.txt\): incomplete")
        self.assertIn("run 7 (", err)
        self.assertIn("B - A, paired (2 pairs):", out)
        self.assertFalse(os.path.exists(os.path.join(directory, "statistics.md")))
        self.assertEqual(sum(len(os.listdir(os.path.join(directory, arm))) for arm in "AB"), 6)  # 5 finished, 1 cut

    def test_usage_errors(self):
        for args, message in (([self.builds["A"]], "needs two revisions"),
                              ([self.builds["A"], "no-such-revision-xyz", "--cpu"], "B: 'no-such-revision-xyz' is neither a git revision"),
                              ([self.builds["A"], self.builds["B"], "3"], "must be a positive even number"),
                              ([self.builds["A"], self.builds["B"], "--log-dir", "x"], "--log-dir is chosen by run_ab.sh"),
                              ([self.tmp, self.builds["B"]], "is a directory but not a CMake build folder"),
                              ([self.builds["A"], self.builds["B"], "--seed", "x"], "must be a whole number")):
            r = self.run_ab(args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(message, r.stderr)
        os.makedirs(os.path.join(self.tmp, "ab"), exist_ok=True)
        rewrite(os.path.join(self.tmp, "ab", "x"), "")
        r = self.run_ab([self.builds["A"], self.builds["B"], "2", "--cpu"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("exists and is not empty", r.stderr)


class _Any:
    def __eq__(self, other):
        return True

    def __repr__(self):
        return "ANY"


ANY = _Any()


class SourceHash(unittest.TestCase):
    def test_bundle_hash_against_independent_fnv(self):
        rng = random.Random(SEED + 2)
        tmp = tempfile.mkdtemp(prefix="test_ab_")
        try:
            files = [("train_gpt.cu", bytes(rng.randrange(1, 256) for _ in range(rng.randrange(0, 3000)))),
                     ("kernels/x.cuh", b"// a kernel\n"), ("data/y.h", b"")]
            out = os.path.join(tmp, "build", "gen", "source_bundle.cpp")
            embed(os.path.join(tmp, "src"), files, out)
            r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "source_hash.py"), os.path.join(tmp, "build")],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), independent_fnv(files))
            r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "source_hash.py"), tmp], capture_output=True, text=True)
            self.assertEqual(r.returncode, 1)
            self.assertIn("cannot read the embedded sources", r.stderr)
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    unittest.main(verbosity=2)
