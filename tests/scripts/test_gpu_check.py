#!/usr/bin/env python3
"""scripts/gpu_check.sh and scripts/side_by_side.sh without a GPU (issue 26).

  plan      --plan's budget (at most 7 minutes with start-up, a rerun of the longest part inside the
            15-minute window), --help's standing rule, bad command lines refused by name
  dry-run   --dry-run walks every part on the CPU build (into OUTDIR, which the side test reads):
            each part passes; the report (report.md, report.json, logs.txt: at most 8 files) holds
            every part; the tiny run's losses (its first 2 steps) equal the pinned ones; every
            --profile-warmup step has the stage's batch, windows and tying as the
            schedule (recomputed here from the tiny preset's table, upstream's rounding) says, and a
            model price beside each family; the benches time every launcher asked for. Then the
            calibration: a GPU-mode copy of that report calibrates a file that --plan-step applies
            (its plan changes and says measured); a malformed file is refused before any work; a dry
            run's report refuses to calibrate
  planted   a machine part that hangs past its timeout, a kernel test that fails and one that hangs:
            each reported by name, the parts and programs after them still run; a memory plan over
            the card's limit fails the stages part before its run; losses off by more than
            the tolerance caught at the step (the losses check on made-up logs); a GPU that is not
            Hopper refused (exit 3), nothing run after it
  side      side_by_side.sh --dry-run on a stand-in upstream folder (the anchors the patch needs, in
            code written here), ours from the dry-run test's logs.txt (--ours-log: the run is not made
            twice): ours per stage, upstream skipped and labelled; --from-log
            extraction from a made-up log, a log without code refused, a missing anchor refused,
            bad arguments refused

usage: test_gpu_check.py plan|dry-run|planted|side BUILD_DIR [DRY_RUN_OUTDIR]
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.environ.get("REPO", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GPU_CHECK = os.path.join(REPO, "scripts", "gpu_check.sh")
SIDE = os.path.join(REPO, "scripts", "side_by_side.sh")
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def run(cmd, env=None, timeout=600):
    e = dict(os.environ, **(env or {}))
    for k in list(e):
        if k.startswith("GPU_CHECK_") and k not in (env or {}):
            del e[k]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=REPO)


# ---- the tiny preset's short schedule, independently: train_gpt.cu's tiny_preset() table, upstream's
# TrainingSchedule rounding (Python's round), the split at stage 2's first odd step ----
TINY_STAGES = [(1 / 3, 8 * 32, (1, 3)), (1 / 3, 8 * 48, (3, 7)), (1 / 3, 8 * 64, (5, 11)), (0, 8 * 64, (6, 13))]


def tiny_schedule(scheduled):
    starts, cum = [0], 0.0
    for duration, _, _ in TINY_STAGES[:-1]:
        cum += duration
        starts.append(round(cum * scheduled))
    return starts, starts[2] | 1


def expected_step(step, scheduled=3):
    starts, split = tiny_schedule(scheduled)
    stage = max(i for i, s in enumerate(starts) if step >= s)
    kind = "untie" if step == split else "adam" if step % 2 else "even"
    return {"stage": stage, "kind": kind, "batch": TINY_STAGES[stage][1], "windows": list(TINY_STAGES[stage][2]),
            "embed": "untied" if step > split else "tied"}


def warmup_steps(scheduled=3):
    starts, _ = tiny_schedule(scheduled)
    return sorted({0, 1} | {t + k for t in starts[1:] for k in (-2, -1, 0, 1) if 0 <= t + k})


# ---------------------------------------------------------------------------------------- plan
def test_plan(build):
    p = run([GPU_CHECK, "--plan"])
    check(p.returncode == 0, f"--plan exits 0 (got {p.returncode}: {p.stderr.strip()})")
    m = re.search(r"with the machine's start-up \((\d+) s\): (\d+) s of the (\d+) s budget", p.stdout)
    check(bool(m) and int(m[2]) <= 7 * 60 and int(m[3]) == 420 and int(m[1]) >= 60,
          f"--plan: parts + start-up within 7 minutes ({m[0] if m else p.stdout!r})")
    parts = dict(re.findall(r"^(machine|kernel_tests|tiny|stages|bench) +(\d+) +\d+$", p.stdout, re.M))
    check(sorted(parts) == sorted(["machine", "kernel_tests", "tiny", "stages", "bench"]),
          f"--plan lists each part's expected seconds ({parts})")
    if m:
        check(sum(map(int, parts.values())) + int(m[1]) == int(m[2]), "--plan's total is the parts' sum plus start-up")
        longest = max(map(int, parts.values()))
        r = re.search(r"a rerun of the longest part \((\d+) s\) after it: (\d+) s of the window's 900 s", p.stdout)
        check(bool(r) and int(r[1]) == longest and int(r[2]) == int(m[2]) + longest <= 900,
              "--plan: a rerun of the longest part fits the 15-minute window")
    check(re.search(r"^bundle: .*gpu-bundle", p.stdout, re.M) is not None, "--plan states the bundle (its size or that it is not built)")
    h = run([GPU_CHECK, "--help"])
    check(h.returncode == 0 and "THE STANDING RULE" in h.stdout and "docs/gpu-runs/" in h.stdout
          and "runs this script first" in h.stdout and "named in the issue's note" in h.stdout,
          "--help states the standing rule")
    # the trainer's flags this check relies on: refused where they make no sense, by name
    trainer = os.path.join(build, "train_gpt_cpu")
    for args, phrase in [(["--profile-warmup", "--warmup", "0"], "--profile-warmup times the warm-up: it does not go with --warmup 0"),
                         (["--profile-warmup", "--plan-step"], "--profile-warmup times a training run's warm-up: it does not go with --plan-step"),
                         (["--ranks", "2"], "--ranks goes with --print-memory"),
                         (["--print-memory", "--ranks", "3"], "--ranks needs 1, 2, 4 or 8"),
                         (["--calibration"], "--calibration needs a value")]:
        r = run([trainer, "--preset", "tiny"] + args)
        check(r.returncode == 2 and phrase in r.stderr, f"train_gpt {' '.join(args)}: refused naming '{phrase}'")
    one = run([trainer, "--preset", "record", "--print-memory", "--ranks", "1"])
    eight = run([trainer, "--preset", "record", "--print-memory"])
    total = lambda t: float(re.search(r"^total +([\d.]+) MiB", t, re.M)[1])
    state = lambda t: float(re.search(r"^    all state .* ([\d.]+) MiB$", t, re.M)[1])
    check(one.returncode == 0 and "(1 rank;" in one.stdout and total(one.stdout) <= 80 * 1024 - 2048,
          f"the record preset's plan on one GPU fits 80 GB ({total(one.stdout) if one.returncode == 0 else one.stderr} MiB)")
    check(eight.returncode == 0 and abs(state(one.stdout) - 8 * state(eight.stdout)) < 0.02 * state(one.stdout),
          "on one rank the optimizer state is unsharded: 8 times a rank's of 8")
    for args, phrase in [(["--bogus"], "unknown option '--bogus'"), (["--dry-run"], "OUTDIR missing"),
                         (["a", "b"], "one OUTDIR only"), (["--bundle", "/nonexistent", "x"], "/nonexistent: no such folder"),
                         (["--out", "f", "x"], "--out goes with --calibrate"), (["--bundle"], "--bundle needs a folder")]:
        r = run([GPU_CHECK] + args)
        check(r.returncode == 2 and phrase in r.stderr, f"gpu_check.sh {' '.join(args)}: exit 2 naming '{phrase}' "
                                                        f"(got {r.returncode}: {r.stderr.strip()[:200]})")


# ---------------------------------------------------------------------------------------- dry run
def report_of(out):
    files = sorted(os.listdir(out))
    check(files == ["logs.txt", "report.json", "report.md"], f"the output folder holds report.md, report.json, logs.txt ({files})")
    return json.load(open(os.path.join(out, "report.json"))), open(os.path.join(out, "report.md")).read()


def test_dry_run(build, out):
    tmp = tempfile.mkdtemp(prefix="gpu_check_test.")
    try:
        shutil.rmtree(out, ignore_errors=True)
        p = run([GPU_CHECK, "--dry-run", "--build", build, out])
        print(p.stdout[-3000:], p.stderr[-2000:])
        check(p.returncode == 0, f"--dry-run passes (exit {p.returncode})")
        rep, md = report_of(out)
        check(rep["mode"] == "dry-run" and "DRY RUN" in md and "emu" in rep["label"], "the report is labelled a dry run on emu")
        check([s["part"] for s in rep["parts"]] == ["machine", "kernel_tests", "tiny", "stages", "bench"]
              and all(s["status"] == "pass" for s in rep["parts"]), f"every part ran and passed ({rep['parts']})")
        check(rep["failures"] == [], f"no failures ({rep['failures']})")
        check([k["program"] for k in rep["kernel_tests"]] == ["test_norm_gpu", "train_gpt --check-platform"],
              f"the dry run's kernel tests, then --check-platform ({[k['program'] for k in rep['kernel_tests']]})")
        logs = open(os.path.join(out, "logs.txt")).read()
        for name in ("test_attention_gpu", "test_model_gpu", "test_matmul_gpu"):
            check(name in logs, f"the dry run lists {name} among the programs a GPU run runs")
        # the tiny run: the CPU build reproduces its own pinned losses exactly
        pinned = json.load(open(os.path.join(REPO, "tests/trainer/fixtures/schedule_bits.json")))["1"]["losses"]
        rows = rep["tiny"]["rows"]
        check(len(rows) == 2 and all(r["gpu"] == float(w) and r["ok"] for r, w in zip(rows, pinned)),
              "the tiny run's first 2 losses equal the pinned ones")
        check(rows[0]["tolerance"] == 0.005 and abs(rows[1]["tolerance"] - 0.01) < 1e-12, "the stated tolerance: 0.5% + 0.5%/step")
        # the twins: the dry run's tiny-r80, its first step and step 0's validation against the golden trajectory
        twins = rep.get("twins", {})
        kinds = [(r["kind"], r["step"], r["ok"]) for r in twins.get("tiny-r80", {}).get("rows", [])]
        check(list(twins) == ["tiny-r80"] and kinds == [("train", 1, True), ("val", 0, True)],
              f"the dry run's twin: tiny-r80's step 1 and validation 0 within the tolerance of its golden run ({kinds})")
        check("## The tiny twins of records 80-89 against their golden trajectories" in md, "the report has the twins' table")
        # the profiled warm-up: every step, each with its stage's shapes and tying
        profiles = rep["profiles"]
        check([p["step"] for p in profiles] == warmup_steps(), f"every warm-up step profiled ({[p['step'] for p in profiles]})")
        for pr in profiles:
            want = expected_step(pr["step"])
            got = {k: pr[k] for k in want}
            check(got == want, f"warm-up step {pr['step']}: {got} is the schedule's {want}")
            check(pr.get("model_ms", 0) > 0 and pr.get("ms", 0) > 0 and pr.get("wall_ms", 0) >= pr["ms"] * 0,
                  f"warm-up step {pr['step']}: measured and modeled device ms")
            priced = [f for f in pr["families"].values() if f["model_ms"] is not None and f["model_ms"] > 0]
            check(len(priced) >= 10 and "attention_forward" in pr["families"] and
                  pr["families"]["attention_forward"]["model_ms"] > 0,
                  f"warm-up step {pr['step']}: the model's ms per family ({len(priced)} families priced)")
        kinds = {(g["stage"], g["kind"]) for g in rep["stages"]}
        check(kinds == {(0, "even"), (1, "adam"), (2, "even"), (3, "untie"), (3, "even")},
              f"the stage table has every stage's shapes, the untie step among them ({sorted(kinds)})")
        check(all(g["ratio"] and g["ratio"] > 0 for g in rep["stages"]), "each stage's measured/model ratio")
        kinds80 = {(g["stage"], g["kind"]) for g in rep["stages_r80"]}
        check(kinds80 == kinds and all(g["ratio"] and g["ratio"] > 0 for g in rep["stages_r80"]) and
              "## Record 80's stages" in md,
              f"record 80's preset profiled the same way, in report.json and report.md ({sorted(kinds80)})")
        # the benches: every launcher asked for, with the model's rate beside
        launchers = {b["launcher"] for b in rep["bench"]}
        for want in ("attention_forward", "attention_forward (wgmma)", "attention_backward", "attention_backward (wgmma)",
                     "linear_relu_square_forward", "linear_relu_square_backward", "matmul_forward", "matmul_bf16"):
            check(want in launchers, f"bench: {want} timed")
        fc = [b for b in rep["bench"] if b["launcher"] == "linear_relu_square_forward"]
        check(len(fc) == 2 and {b["shape"].split()[-1] for b in fc} == {"mma", "wgmma"}, "bench: c_fc on mma.sync and wgmma")
        att = [b for b in rep["bench"] if b["launcher"] == "attention_forward"]
        check(all(b["unit"] == "TFLOP/s" and b["model_rate"] == 330 for b in att),
              "bench: attention against profiler/cost_model.h's 330 TFLOP/s")
        check(re.search(r"^bench +pass +\d+ +\d+ launchers timed$", p.stdout, re.M) is not None and
              p.stdout.rstrip().splitlines()[-1].startswith("failures: 0"), "the short table is printed last")

        # calibration from a GPU-mode copy of this report (fresh figures: the dry run's own)
        r = run([GPU_CHECK, "--calibrate", out, "--out", os.path.join(tmp, "never.json")])
        check(r.returncode != 0 and "only a GPU run's rates calibrate" in r.stderr, "a dry run's report does not calibrate")
        gpu_dir = os.path.join(tmp, "gpu-report")
        os.makedirs(gpu_dir)
        rep["mode"] = "gpu"
        json.dump(rep, open(os.path.join(gpu_dir, "report.json"), "w"))
        cal = os.path.join(tmp, "calibration.json")
        r = run([GPU_CHECK, "--calibrate", gpu_dir, "--out", cal])
        check(r.returncode == 0 and os.path.exists(cal), f"--calibrate writes the file ({r.stdout}{r.stderr})")
        if os.path.exists(cal):
            c = json.load(open(cal))
            check(all(v["report"].endswith("gpu-report/report.md") and v["value"] > 0 for v in c["rates"].values()),
                  "each rate names its report")
            # the rates, recomputed from the report's last stage's even step: a tensor-core family of the
            # model's table at its TFLOP/s, every other family (no transfer, no collective) at its HBM share
            last = max((g for g in rep["stages"] if g["kind"] == "even"), key=lambda g: g["stage"])
            want = {}
            for fam in last["families"]:
                if fam["tensor_core"]:
                    if fam["family"] in ("attention_forward", "attention_backward", "linear_relu_square_forward",
                                         "linear_relu_square_backward"):
                        want["tc_tflops." + fam["family"]] = fam["tflops"]
                elif not fam["family"].startswith(("nccl", "copy_h2d", "copy_d2h")):
                    want["hbm_efficiency_by_family." + fam["family"]] = min(1.0, fam["tbs"] / 3.35)
            got = {k: v["value"] for k, v in c["rates"].items() if k != "gemm_bf16_efficiency"}
            check(sorted(got) == sorted(want) and all(abs(got[k] - want[k]) <= 1e-5 * want[k] for k in want) and
                  "tc_tflops.attention_forward" in got and "hbm_efficiency_by_family.rmsnorm_forward" in got and
                  not any(k.split(".")[1].startswith("gemm") for k in got),
                  f"the rates are the report's: tensor-core and memory-bound families, no GEMM ({len(got)} of {len(want)})")
            trainer = os.path.join(build, "train_gpt_cpu")
            base = run([trainer, "--preset", "tiny", "--plan-step", "--calibration", "none"])
            calibrated = run([trainer, "--preset", "tiny", "--plan-step", "--calibration", cal])
            check(base.returncode == 0 and "none measured" in base.stdout, "--plan-step --calibration none: none measured")
            committed = os.path.join(REPO, "docs/gpu-runs/calibration.json")
            if os.path.exists(committed):  # without the flag, the committed file's rates
                default = run([trainer, "--preset", "tiny", "--plan-step"])
                check(default.returncode == 0 and f"constants measured ({committed})" in default.stdout,
                      "--plan-step without --calibration uses docs/gpu-runs/calibration.json")
            check(calibrated.returncode == 0 and "constants measured (" + cal + ")" in calibrated.stdout and
                  re.search(r"measured tc_tflops\.attention_forward +[\d.e+-]+ \(default 330\) from .*report\.md",
                            calibrated.stdout), "--plan-step with the file names the measured constants")
            total = lambda t: re.search(r"whole run: \d+ steps, ([\d.]+) s modeled", t)
            tb, tc = total(base.stdout), total(calibrated.stdout)
            check(tb and tc and float(tb[1]) != float(tc[1]), f"the measured rates change the plan ({tb and tb[1]} s -> "
                                                              f"{tc and tc[1]} s)")
            bad = os.path.join(tmp, "bad.json")
            open(bad, "w").write('{"rates": {"hbm_efficiency": {"value": 2.0, "report": "x"}}}')
            r = run([trainer, "--preset", "tiny", "--plan-step", "--calibration", bad])
            check(r.returncode != 0 and "calibration " + bad + ": \"hbm_efficiency\": an efficiency of 2" in r.stderr
                  and "plan-step: preset" not in r.stdout, f"a malformed calibration is refused before the plan ({r.stderr.strip()[:200]})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------- planted
def test_planted(build):
    tmp = tempfile.mkdtemp(prefix="gpu_check_test.")
    try:
        out = os.path.join(tmp, "out")
        env = {"GPU_CHECK_PARTS": "machine kernel_tests", "GPU_CHECK_HOOK_HANG": "machine",
               "GPU_CHECK_HOOK_TIMEOUT_machine": "3", "GPU_CHECK_TESTS": "test_norm test_residual",
               "GPU_CHECK_HOOK_FAIL_TEST": "test_norm", "GPU_CHECK_HOOK_HANG_TEST": "test_residual",
               "GPU_CHECK_HOOK_TEST_TIMEOUT": "2"}
        p = run([GPU_CHECK, "--dry-run", "--build", build, out], env=env)
        print(p.stdout[-2500:], p.stderr[-1500:])
        check(p.returncode == 1, f"planted failures: exit 1 (got {p.returncode})")
        rep, md = report_of(out)
        status = {s["part"]: s["status"] for s in rep["parts"]}
        check(status == {"machine": "timeout", "kernel_tests": "fail"},
              f"the hung part timed out and the part after it still ran ({status})")
        f = "\n".join(rep["failures"])
        for phrase in ("machine: timeout after", "kernel_tests: test_norm_gpu: fail", "kernel_tests: test_residual_gpu: timeout"):
            check(phrase in f and phrase.split(": ")[-2] in md, f"the report names '{phrase}'")
        check("train_gpt --check-platform" in [k["program"] for k in rep["kernel_tests"] if k["status"] == "pass"],
              "--check-platform still ran and passed after the planted test failures")
        # the memory check: a card too small for the record preset's plan fails the stages part, named
        out4 = os.path.join(tmp, "out4")
        p = run([GPU_CHECK, "--dry-run", "--build", build, out4],
                env={"GPU_CHECK_PARTS": "stages", "GPU_CHECK_HOOK_MEMORY_LIMIT_MIB": "30000"})
        rep, _ = report_of(out4)
        logs = open(os.path.join(out4, "logs.txt")).read()
        check(p.returncode == 1 and rep["parts"][0]["status"] == "fail" and
              re.search(r"plan on one GPU \(\d+ MiB\) does not fit 80 GB \(at most 30000 MiB\)", logs) is not None and
              "profile of step" not in logs, "a memory plan over the limit fails the stages part before the run")
        # the losses check: made-up logs, the pinned losses off by a little (inside) and by a lot (outside)
        pinned = [float(x) for x in json.load(open(os.path.join(REPO, "tests/trainer/fixtures/schedule_bits.json")))["1"]["losses"]]
        tool = os.path.join(REPO, "scripts", "gpu_check_tool.py")
        for label, losses, want_rc, phrase in [
                ("within", [w * (1 + 0.004 * (i + 1)) for i, w in enumerate(pinned)], 0, "within the bf16 tolerance"),
                ("step 3 off", [w * (1.03 if i == 2 else 1) for i, w in enumerate(pinned)], 1, "OUTSIDE"),
                ("one missing", pinned[:7], 1, "7 training losses printed, 8 pinned")]:
            log = os.path.join(tmp, "tiny.log")
            open(log, "w").write("".join(f"step:{i + 1}/8 train_loss:{x:.4f}\n" for i, x in enumerate(losses)))
            r = subprocess.run([sys.executable, tool, "losses", log, os.path.join(REPO, "tests/trainer/fixtures/schedule_bits.json")],
                               capture_output=True, text=True)
            check(r.returncode == want_rc and phrase in r.stdout, f"losses {label}: exit {want_rc} saying '{phrase}'")
            if label == "step 3 off":
                check(re.search(r"^train +3 .*FAIL$", r.stdout, re.M) is not None and
                      re.search(r"^train +2 .*FAIL$", r.stdout, re.M) is None, "losses: the step off is the one marked")
        # ... and against a twin's golden trajectory, whose validation losses count too
        golden = os.path.join(REPO, "tests/reference/fixtures/tiny_r89_golden.json")
        g = json.load(open(golden))
        for label, bump_train, bump_val, want_rc, phrase in [
                ("twin within", 1.002, 1.001, 0, "within the bf16 tolerance"),
                ("twin step 2 off", 1.03, 1.0, 1, "OUTSIDE"),
                ("twin validation at 4 off", 1.0, 1.05, 1, "OUTSIDE")]:
            log = os.path.join(tmp, "twin.log")
            lines = [f"step:{i + 1}/8 train_loss:{x * (bump_train if i == 1 else 1):.4f}\n"
                     for i, x in enumerate(g["train_losses"])]
            lines += [f"step:{k}/8 val_loss:{v * (bump_val if k == '4' else 1):.4f} train_time:0ms step_avg:0.00ms\n"
                      for k, v in g["val_losses"].items()]
            open(log, "w").write("".join(lines))
            r = subprocess.run([sys.executable, tool, "losses", log, golden], capture_output=True, text=True)
            check(r.returncode == want_rc and phrase in r.stdout and "golden (tiny-r89)" in r.stdout,
                  f"losses {label}: exit {want_rc} saying '{phrase}' against the golden trajectory")
            check(len(re.findall(r"^val +\d+ ", r.stdout, re.M)) == len(g["val_losses"]),
                  f"losses {label}: every validation of the fixture compared")
            if label == "twin validation at 4 off":
                check(re.search(r"^val +4 .*FAIL$", r.stdout, re.M) is not None and
                      re.search(r"^train .*FAIL$", r.stdout, re.M) is None, "losses: the validation off is the one marked")
        # a GPU that is not Hopper: refused, nothing after it
        out2 = os.path.join(tmp, "out2")
        p = run([GPU_CHECK, "--dry-run", "--build", build, out2],
                env={"GPU_CHECK_HOOK_GPU": "NVIDIA A100-SXM4-80GB|8.0|580.159"})
        check(p.returncode == 3, f"an A100 is refused with exit 3 (got {p.returncode})")
        rep, md = report_of(out2)
        logs = open(os.path.join(out2, "logs.txt")).read()
        check("REFUSED: NVIDIA A100-SXM4-80GB (compute capability 8.0) is not a Hopper GPU" in logs and
              "- REFUSED: NVIDIA A100-SXM4-80GB" in md, "the refusal names the GPU and why, in the log and the report")
        check([s["status"] for s in rep["parts"]] == ["refused", "not run", "not run", "not run", "not run"],
              f"no part runs after the refusal ({[s['status'] for s in rep['parts']]})")
        out3 = os.path.join(tmp, "out3")
        p = run([GPU_CHECK, "--dry-run", "--build", build, out3],
                env={"GPU_CHECK_HOOK_GPU": "NVIDIA H100 80GB HBM3|9.0|580.159", "GPU_CHECK_PARTS": "machine"})
        rep, _ = report_of(out3)
        check(p.returncode == 0 and rep["machine"].get("gpu") == "NVIDIA H100 80GB HBM3" and
              rep["machine"].get("compute capability") == "9.0", "an H100 is accepted and named")
        # GPU mode on a made-up bundle: a program the bundle leaves out on purpose (bundle.json's left_out)
        # is listed as such and fails nothing; the same program absent without that entry is a failure
        fake = os.path.join(tmp, "fake-bundle")
        os.makedirs(fake)
        for name, body in [("train_gpt", "echo platform check passed"), ("test_norm_gpu", "echo '1 passed, 0 failed'")]:
            with open(os.path.join(fake, name), "w") as f:
                f.write(f"#!/bin/sh\n{body}\n")
            os.chmod(os.path.join(fake, name), 0o755)
        for left_out, want_rc, want_status in [(["test_batch_producer_gpu"], 0, "not in bundle"), ([], 1, "missing")]:
            json.dump({"left_out": left_out}, open(os.path.join(fake, "bundle.json"), "w"))
            out4 = os.path.join(tmp, f"out4-{len(left_out)}")
            p = run([GPU_CHECK, "--bundle", fake, out4],
                    env={"GPU_CHECK_HOOK_GPU": "NVIDIA H100 80GB HBM3|9.0|580.159", "GPU_CHECK_PARTS": "machine kernel_tests",
                         "GPU_CHECK_TESTS": "test_norm test_batch_producer"})
            rep, _ = report_of(out4)
            got = {k["program"]: k["status"] for k in rep["kernel_tests"]}
            failing = [f for f in rep["failures"] if "test_batch_producer_gpu" in f]
            check(p.returncode == want_rc and got.get("test_batch_producer_gpu") == want_status and
                  got.get("test_norm_gpu") == "pass" and bool(failing) == (want_rc != 0),
                  f"bundle left_out {left_out}: exit {p.returncode} (want {want_rc}), statuses {got}, failures {failing}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------- side by side
# A stand-in for upstream's train_gpt.py: the lines the run-time patch anchors on, in code written here.
FAKE_TRAIN = """import os
from kernels import get_kernel
flash_attn_interface = get_kernel('varunneal/flash-attention-3').flash_attn_interface
class Hyperparameters:
    val_loss_every = 250
args = Hyperparameters()
print0("Compiling model and warming up kernels (~7 minutes on first execution)", console=True)
transition_steps = [2, 4, 6]
warmup_steps = sorted({0, 1} | set(transition_steps))
print0("Resetting Model", console=True)
train_steps = 8
for step in range(train_steps + 1):
    pass
"""


def test_side(build, dry_out):
    tmp = tempfile.mkdtemp(prefix="side_by_side_test.")
    try:
        up = os.path.join(tmp, "upstream")
        os.makedirs(up)
        open(os.path.join(up, "train_gpt.py"), "w").write(FAKE_TRAIN)
        open(os.path.join(up, "triton_kernels.py"), "w").write("KERNELS = 1\n")
        out = os.path.join(tmp, "out")
        ours_log = os.path.join(dry_out, "logs.txt")
        check(os.path.exists(ours_log), f"the dry-run test's {ours_log} is there (CTest runs gpu_check_dry-run first)")
        p = run([SIDE, "--dry-run", "--upstream", up, "--stages", "0,3", "--steps", "4", "--build", build,
                 "--ours-log", ours_log, out])
        print(p.stdout[-2500:], p.stderr[-1500:])
        check(p.returncode == 0, f"side_by_side --dry-run passes (exit {p.returncode})")
        rep = json.load(open(os.path.join(out, "side_by_side.json")))
        check([r["stage"] for r in rep["stages"]] == [0, 3], "the requested stages")
        check(all(r["ours_ms"] and r["ours_ms"] > 0 and r["ours_steps"] >= 1 for r in rep["stages"]),
              f"ours timed at each requested stage ({rep['stages']})")
        # the dry run's 4-step schedule: stage 0's warm-up step 0; stage 3's steps 3 (the untie) and 4
        check(rep["stages"][0]["ours_steps"] == 1 and rep["stages"][1]["ours_steps"] == 1,
              "ours: the stage's warm-up steps, the untie step apart")
        walls = [float(x) for x in re.findall(r"^step [04]: .*; wall ([\d.]+) ms", open(ours_log).read(), re.M)]
        check(len(walls) == 2 and abs(rep["stages"][0]["ours_ms"] - walls[0]) < 1e-6 and
              abs(rep["stages"][1]["ours_ms"] - walls[1]) < 1e-6, "ours: the wall times of those steps")
        check(rep["upstream_status"].startswith("skipped (dry run") and rep["stages"][0]["upstream_ms"] is None,
              "upstream skipped and labelled")
        check(any("flex_attention" in x and "flatters" in x for x in rep["left_out"]), "the report says FA3's stand-in flatters us")
        check(re.search(r"^ +0 +[\d.]+ +- +-$", p.stdout, re.M) is not None, "the table is printed")
        check(not os.path.exists(os.path.join(out, "train_gpt.py")), "no upstream code in the output folder")
        # --from-log: a made-up log in upstream's layout
        log = os.path.join(tmp, "run.txt")
        open(log, "w").write(FAKE_TRAIN + "\n\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\nKERNELS = 1\n\n" +
                             "=" * 100 + "\nRunning Python 3.12\nstep:0/1555 val_loss:10.8\n")
        ext = os.path.join(tmp, "extracted")
        r = run([SIDE, "--extract", log, ext])
        check(r.returncode == 0 and open(os.path.join(ext, "train_gpt.py")).read() == FAKE_TRAIN and
              open(os.path.join(ext, "triton_kernels.py")).read() == "KERNELS = 1\n", "--extract gives back both files exactly")
        stripped = os.path.join(tmp, "stripped.txt")
        open(stripped, "w").write("step:0/1555 val_loss:10.8309 train_time:0ms step_avg:0.04ms\n")
        r = run([SIDE, "--extract", stripped, ext])
        check(r.returncode != 0 and "no '# triton_kernels.py' separator" in r.stderr, "a log without code is refused")
        open(os.path.join(up, "train_gpt.py"), "w").write(FAKE_TRAIN.replace("for step in range(train_steps + 1):", "for s in x:"))
        r = run([SIDE, "--dry-run", "--upstream", up, "--stages", "0", "--build", build, "--ours-log", ours_log,
                 os.path.join(tmp, "o2")])
        check(r.returncode != 0 and "the training loop" in r.stderr and "found 0 times" in r.stderr,
              f"a missing anchor is refused by name ({r.stderr.strip()[:200]})")
        for args, phrase in [(["--stages", "0", "o"], "give --upstream DIR or --from-log LOG"),
                             (["--upstream", up, "--stages", "5", "o"], "--stages 5: want stage numbers 0..3"),
                             (["--upstream", up, "--stages", "0", "--steps", "1", "o"], "--steps 1: want 2..50"),
                             (["--upstream", up, "--from-log", log, "--stages", "0", "o"], "give one"),
                             (["--upstream", up, "--stages", "0"], "OUTDIR missing"),
                             (["--from-log", "/nonexistent", "--stages", "0", "o"], "/nonexistent: no such file"),
                             (["--upstream", up, "o"], "--stages LIST missing"),
                             (["--upstream", up, "--stages", "0", "--ours-log", log, "o"], "no --profile-warmup steps in it")]:
            r = run([SIDE, "--dry-run"] + args)
            check(r.returncode == 2 and phrase in r.stderr, f"side_by_side {' '.join(args)}: exit 2 naming '{phrase}' "
                                                            f"({r.stderr.strip()[:160]})")
        h = run([SIDE, "--help"])
        check(h.returncode == 0 and "never be committed" in h.stdout and "flex_attention" in h.stdout, "--help says what it does")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("plan", "dry-run", "planted", "side") or \
            (sys.argv[1] in ("dry-run", "side")) != (len(sys.argv) == 4):
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[2])
    what = sys.argv[1]
    if what in ("dry-run", "side"):
        {"dry-run": test_dry_run, "side": test_side}[what](build, os.path.abspath(sys.argv[3]))
    else:
        {"plan": test_plan, "planted": test_planted}[what](build)
    print(f"test_gpu_check {sys.argv[1]}: {'FAILED: ' + str(len(FAILURES)) if FAILURES else 'passed'}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
