#!/usr/bin/env python3
"""scripts/gpu_check.sh's Python side (standard library; numpy for synth-shards):

  gpu_check_tool.py synth-shards DIR [--train-tokens N] [--val-tokens N] [--seed S] [--prefix P]
      synthetic token shards in the speedrun's format (data/shard.h): random tokens in documents of
      FineWeb-like lengths, each starting with BOS; for timing only (no FineWeb on the GPU machine)
  gpu_check_tool.py losses LOG FIXTURE [--steps N] [--json OUT]
      a run's training losses (step:N/M train_loss:X) against FIXTURE's: the CPU build's pinned ones
      (tests/trainer/fixtures/schedule_bits.json), or a tiny twin's golden trajectory
      (tests/reference/fixtures/*_golden.json), whose validation losses are compared too
  gpu_check_tool.py report WORK OUTDIR --mode gpu|dry-run --repo REPO [--total-s S] [--bundle DIR]
      report.md and report.json from the parts' logs; prints the short table last
  gpu_check_tool.py calibrate REPORT_DIR --out FILE --repo REPO
      profiler/cost_model.h's calibration file from a report: the measured rates, each naming the report
"""
import argparse
import datetime
import json
import math
import os
import re
import sys

BOS = 50256
SHARD_MAGIC, SHARD_VERSION = 20240520, 1

# The tiny run on a GPU against emu's losses. Emu runs the same kernels' arithmetic in the same order
# where the code fixes it (bf16 roundings, fp32 accumulation inside a tile), so the first step's loss
# differs only by what the hardware does its own way: cuBLASLt's choice of algorithm and split-K
# (fp32 sums in another order: ~1e-7 relative each), the MUFU exp/rsqrt approximations (a few ulp of
# fp32), and tensor-core accumulation order. Each such difference flips a bf16 rounding (2^-9 = 0.2%
# relative) of a few activations, which averages out over the 8 x 32 tokens of a step's loss: well
# under 0.1% at step 1. Training amplifies differences (each step's update follows the gradients of
# the last), and this schedule is short (8 steps) at a high learning rate, so the bound grows with the
# step: 0.5% at step 1 plus 0.5% per step after it (4% at step 8), still far below what a broken
# kernel does (a wrong attention mask or GEMM moves the loss by whole units within a step or two).
LOSS_REL_TOL_FIRST, LOSS_REL_TOL_PER_STEP = 0.005, 0.005


def loss_tolerance(step):
    return LOSS_REL_TOL_FIRST + LOSS_REL_TOL_PER_STEP * (step - 1)


# ---------------------------------------------------------------------------------------- shards
def synth_shards(args):
    import numpy as np
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.dir, exist_ok=True)

    def tokens(n):
        # FineWeb documents in GPT-2 tokens: median ~500, a long tail (log-normal, sigma 1), cut at 16..32768
        out = np.empty(n, dtype=np.uint16)
        at = 0
        while at < n:
            lengths = np.clip(rng.lognormal(math.log(500), 1.0, 4096).astype(np.int64), 16, 32768)
            for length in lengths:
                if at >= n:
                    break
                k = int(min(length, n - at))
                out[at] = BOS
                out[at + 1:at + k] = rng.integers(0, BOS, k - 1, dtype=np.uint16)
                at += k
        return out

    for kind, n in (("train", args.train_tokens), ("val", args.val_tokens)):
        header = np.zeros(256, dtype=np.int32)
        header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, n
        path = os.path.join(args.dir, f"{args.prefix}_{kind}_000001.bin")
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens(n).tobytes())
        print(f"synth-shards: {path}: {n} random tokens in documents of FineWeb-like lengths")
    return 0


# ---------------------------------------------------------------------------------------- losses
def pinned_losses(fixture):
    """(training losses from step 1, {step: validation loss}, the fixture's name for them): the CPU build's
    pinned bits, or a tiny twin's golden trajectory (the PyTorch reference's, tests/reference/README.md)."""
    f = json.load(open(fixture))
    if "train_losses" in f:
        return [float(x) for x in f["train_losses"]], {int(k): float(v) for k, v in f["val_losses"].items()}, \
            f"golden ({f['preset']})"
    return [float(x) for x in f["1"]["losses"]], {}, "pinned (CPU)"


def losses(args):
    text = open(args.log, errors="replace").read()
    got = [float(x) for x in re.findall(r"^step:\d+/\d+ train_loss:(\S+)$", text, re.M)]
    got_val = {int(s): float(x) for s, x in re.findall(r"^step:(\d+)/\d+ val_loss:(\S+)", text, re.M)}
    train, val, name = pinned_losses(args.fixture)
    want = train[:args.steps]
    rows, ok = [], len(got) == len(want)

    def row(kind, step, w, g):
        rel = abs(g - w) / abs(w) if g is not None else None
        tol = loss_tolerance(max(step, 1))
        rows.append({"kind": kind, "step": step, "cpu": w, "gpu": g, "rel_diff": rel, "tolerance": tol,
                     "ok": rel is not None and rel <= tol})
        return rows[-1]["ok"]

    for i, w in enumerate(want):
        ok = row("train", i + 1, w, got[i] if i < len(got) else None) and ok
    # the validations both made (a run stopped early by --max-steps validates where the fixture did not)
    for step in sorted(set(val) & set(got_val)):
        ok = row("val", step, val[step], got_val[step]) and ok
    print(f"{'':5} {'step':>4} {name:>13} {'this run':>10} {'rel diff':>10} {'tolerance':>10}")
    for r in rows:
        g = "missing" if r["gpu"] is None else f"{r['gpu']:.4f}"
        d = "-" if r["rel_diff"] is None else f"{r['rel_diff']:.2e}"
        print(f"{r['kind']:5} {r['step']:>4} {r['cpu']:>13.4f} {g:>10} {d:>10} {r['tolerance']:>10.3f}"
              f"{'' if r['ok'] else '  FAIL'}")
    if len(got) != len(want):
        print(f"losses: {len(got)} training losses printed, {len(want)} pinned")
    print(f"losses: {'within' if ok else 'OUTSIDE'} the bf16 tolerance (0.5% at step 1 + 0.5% per step)")
    if args.json:
        json.dump({"rows": rows, "count": len(got), "ok": ok, "against": name}, open(args.json, "w"), indent=1)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------- parsing
PROFILE_HEAD = re.compile(r"^profile of step (\d+) \((?:warm-up: stage (\d+) (even|adam|untie) step, batch (\d+) tokens, "
                          r"windows (\d+)/(\d+) blocks, embed (tied|untied); )?rank 0 of (\d+)")
NUMBER = r"[\d.]+(?:e[-+]?\d+)?"  # printf's %g
FAMILY_ROW = re.compile(rf"^(\S+) +(\d+) +([\d.]+) +[\d.]+% +({NUMBER}) +(\S+) +({NUMBER}) +\S+$")
STEP_LINE = re.compile(r"^step (\d+): (\d+) ops, device ([\d.]+) ms")
MODEL_LINE = re.compile(r"^model of step (\d+) .*: device ([\d.]+) ms, measured ([\d.]+) ms, measured/model ([\d.]+)")
VS_MODEL = re.compile(r"^vs model (\S+) +([\d.]+) ms measured +([\d.]+) ms model")


def parse_profiles(text):
    """Every profiled step: its label, families (measured), device ms, the model's ms, per family."""
    steps, cur = [], None
    for line in text.splitlines():
        if m := PROFILE_HEAD.match(line):
            cur = {"step": int(m[1]), "stage": int(m[2]) if m[2] else None, "kind": m[3], "batch": int(m[4] or 0),
                   "windows": [int(m[5] or 0), int(m[6] or 0)], "embed": m[7], "world": int(m[8]), "families": {}}
            steps.append(cur)
        elif cur is None:
            continue
        elif m := FAMILY_ROW.match(line):
            cur["families"][m[1]] = {"count": int(m[2]), "ms": float(m[3]), "tflops": float(m[4]), "tbs": float(m[6]),
                                     "tensor_core": m[5] != "-", "model_ms": None}
        elif m := STEP_LINE.match(line):
            cur["ops"], cur["ms"] = int(m[2]), float(m[3])
            wall = re.search(r"; wall ([\d.]+) ms", line)
            cur["wall_ms"] = float(wall[1]) if wall else None
        elif m := MODEL_LINE.match(line):
            cur["model_ms"] = float(m[2])
        elif m := VS_MODEL.match(line):
            if m[1] in cur["families"]:
                cur["families"][m[1]]["model_ms"] = float(m[3])
    return steps


BENCH_LINE = re.compile(r"^(?P<name>[a-z0-9_]+(?: \([a-zA-Z.]+\))?)\s+(?P<shape>\S.*?)\s+(?P<ms>[\d.eE+-]+) ms\s+"
                        r"(?P<gflop>[\d.eE+-]+) GFLOP\s+(?P<mb>[\d.eE+-]+) MB\s+(?P<tflops>[\d.eE+-]+) TFLOP/s.*?"
                        r"(?P<tbs>[\d.eE+-]+) TB/s")


def model_constants(repo):
    """profiler/cost_model.h's defaults, read from its source (the one table the model uses)."""
    src = open(os.path.join(repo, "profiler", "cost_model.h")).read()
    c = {}
    for name in ("bf16_tflops", "fp8_tflops", "hbm_tbs", "gemm_bf16_efficiency", "gemm_fp8_efficiency",
                 "hbm_efficiency", "tc_default_tflops"):
        m = re.search(r"\b" + name + r" = ([\d.]+);", src)
        if not m:
            raise SystemExit(f"gpu_check_tool: profiler/cost_model.h has no '{name} = ...;' to read")
        c[name] = float(m[1])
    table = re.search(r"tc_tflops = \{(.*?)\n    \};", src, re.S)
    c["tc_tflops"] = {k: float(v) for k, v in re.findall(r'\{"([a-z0-9_]+)", ([\d.]+)\}', table[1])} if table else {}
    return c


def model_rate(name, shape, c):
    """What the model assumes for a bench line: ('TFLOP/s' or 'TB/s', rate)."""
    base = name.split(" ")[0]
    for fam, v in c["tc_tflops"].items():
        if base == fam:
            return "TFLOP/s", v
    if base.startswith("matmul_fp8"):
        return "TFLOP/s", c["fp8_tflops"] * c["gemm_fp8_efficiency"]
    if base.startswith("matmul"):
        return "TFLOP/s", c["bf16_tflops"] * c["gemm_bf16_efficiency"]
    return "TB/s", c["hbm_tbs"] * c["hbm_efficiency"]


def parse_bench(text, c):
    rows = []
    for line in text.splitlines():
        m = BENCH_LINE.match(line)
        if not m:
            continue
        unit, rate = model_rate(m["name"], m["shape"], c)
        achieved = float(m["tflops"]) if unit == "TFLOP/s" else float(m["tbs"])
        rows.append({"launcher": m["name"], "shape": m["shape"], "ms": float(m["ms"]), "gflop": float(m["gflop"]),
                     "mb": float(m["mb"]), "tflops": float(m["tflops"]), "tbs": float(m["tbs"]), "unit": unit,
                     "model_rate": rate, "achieved_over_model": achieved / rate if rate else None})
    return rows


def read(path):
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def key_values(text):
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z][a-z ]*): (.*)$", line)
        if m and m[1] not in out:
            out[m[1]] = m[2]
    return out


# ---------------------------------------------------------------------------------------- report
def stage_summary(profiles):
    """Per stage and kind: the measured and modeled ms (mean over the warm-up's steps of that kind)."""
    groups = {}
    for p in profiles:
        if "ms" not in p:
            continue
        key = (p["stage"], p["kind"] or "step")
        g = groups.setdefault(key, {"stage": p["stage"], "kind": key[1], "steps": [], "ms": [], "model_ms": [],
                                    "batch": p["batch"], "windows": p["windows"], "embed": p["embed"], "families": {}})
        g["steps"].append(p["step"])
        g["ms"].append(p["ms"])
        g["model_ms"].append(p.get("model_ms") or 0)
        for name, f in p["families"].items():
            a = g["families"].setdefault(name, {"ms": 0.0, "model_ms": 0.0, "n": 0, "tflops": 0.0, "tbs": 0.0,
                                                "tensor_core": f["tensor_core"]})
            a["ms"] += f["ms"]
            a["model_ms"] += f["model_ms"] or 0
            a["tflops"] += f["tflops"]
            a["tbs"] += f["tbs"]
            a["n"] += 1
    out = []
    for key in sorted(groups, key=lambda k: (k[0] if k[0] is not None else -1, k[1])):
        g = groups[key]
        n = len(g["ms"])
        g["ms"], g["model_ms"] = sum(g["ms"]) / n, sum(g["model_ms"]) / n
        g["ratio"] = g["ms"] / g["model_ms"] if g["model_ms"] else None
        fams = []
        for name, a in g["families"].items():
            ms, mm = a["ms"] / a["n"], a["model_ms"] / a["n"]
            fams.append({"family": name, "ms": ms, "model_ms": mm, "ratio": ms / mm if mm else None,
                         "tflops": a["tflops"] / a["n"], "tbs": a["tbs"] / a["n"], "tensor_core": a["tensor_core"]})
        g["families"] = sorted(fams, key=lambda f: -f["ms"])
        out.append(g)
    return out


def stages_md(stages, title, intro):
    """report.md's section for one preset's profiled warm-up: per stage and kind, then per family."""
    if not stages:
        return []
    md = ["", f"## {title}", "", intro, "",
          "| stage | kind | steps | batch | windows | embed | measured ms | model ms | measured/model |",
          "| ---: | --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
    md += [f"| {g['stage']} | {g['kind']} | {','.join(map(str, g['steps']))} | {g['batch']} | "
           f"{g['windows'][0]}/{g['windows'][1]} | {g['embed']} | {g['ms']:.3f} | {g['model_ms']:.3f} | "
           f"{fmt(g['ratio'])} |" for g in stages]
    for g in stages:
        md += ["", f"### stage {g['stage']}, {g['kind']} step: per kernel family", "",
               "| family | measured ms | model ms | measured/model | TFLOP/s | TB/s |",
               "| --- | ---: | ---: | ---: | ---: | ---: |"]
        md += [f"| {f['family']} | {f['ms']:.3f} | {f['model_ms']:.3f} | {fmt(f['ratio'])} | {f['tflops']:.3f} | "
               f"{f['tbs']:.4f} |" for f in g["families"]]
    return md


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def report(args):
    work, out = args.work, args.out
    dry = args.mode == "dry-run"
    status = []
    for line in read(os.path.join(work, "status.tsv")).splitlines():
        name, st, secs, timeout, rc = line.split("\t")
        status.append({"part": name, "status": st, "seconds": int(secs), "timeout_s": int(timeout), "exit": rc})
    machine_log = read(os.path.join(work, "machine.log"))
    machine = key_values(machine_log)
    # the bundle's story (libraries found, a rebuild and how long it took) and the refusal, every line
    notes = [line for line in machine_log.splitlines() if line.startswith(("bundle: ", "REFUSED: "))]
    failures = [f"{s['part']}: {s['status']}" + (f" after {s['seconds']} s (timeout {s['timeout_s']} s)"
                                                 if s["status"] == "timeout" else "")
                for s in status if s["status"] != "pass"]
    kernel_tests = []
    for line in read(os.path.join(work, "kernel_tests.tsv")).splitlines():
        name, st, secs, rc = line.split("\t")
        kernel_tests.append({"program": name, "status": st, "seconds": int(secs), "exit": rc})
        if st not in ("pass", "not in bundle"):  # the bundle leaves some out on purpose (bundle.json)
            failures.append(f"kernel_tests: {name}: {st} (exit {rc})")
    tiny = json.load(open(os.path.join(work, "tiny.json"))) if os.path.exists(os.path.join(work, "tiny.json")) else None
    if tiny:
        failures += [f"tiny: step {r['step']} loss {r['gpu']} vs pinned {r['cpu']} (tolerance {r['tolerance']:.3f})"
                     for r in tiny["rows"] if not r["ok"]]
    # the tiny part's twins against their golden trajectories (twin_<preset>.json; the list is gpu_check.sh's)
    twins = {}
    for name in sorted(os.listdir(work)):
        if name.startswith("twin_") and name.endswith(".json"):
            twin = name[len("twin_"):-len(".json")]
            twins[twin] = json.load(open(os.path.join(work, name)))
            failures += [f"tiny: {twin} step {r['step']} {r['kind']} loss {r['gpu']} vs golden {r['cpu']} "
                         f"(tolerance {r['tolerance']:.3f})" for r in twins[twin]["rows"] if not r["ok"]]
            if twins[twin]["count"] != sum(r["kind"] == "train" for r in twins[twin]["rows"]):
                failures.append(f"tiny: {twin} printed {twins[twin]['count']} training losses")
    stages_out = read(os.path.join(work, "stages.out"))
    profiles = parse_profiles(stages_out)
    plan = re.search(r"^total +([\d.]+) MiB", read(os.path.join(work, "memory.out")), re.M)
    peak = re.search(r"^peak memory allocated: (\d+) MiB", stages_out, re.M)
    memory = {"plan_one_gpu_mib": float(plan[1]) if plan else None, "run_peak_mib": int(peak[1]) if peak else None}
    stages = stage_summary(profiles)
    stages_r80 = stage_summary(parse_profiles(read(os.path.join(work, "stages_r80.out"))))
    constants = model_constants(args.repo)
    bench = parse_bench(read(os.path.join(work, "bench.out")), constants)
    label = ("DRY RUN on the CPU build (emu): every time is the CPU emulation's wall time, not a GPU's; the "
             "smallest shapes that walk each part's code (the tiny preset's first 2 steps against the pinned "
             "losses, its 4-step schedule for the stages, --shape tiny for the benches, one kernel test)") if dry else "GPU run"
    doc = {"mode": args.mode, "label": label, "date": machine.get("date"), "commit": machine.get("commit"),
           "card": machine.get("gpu"), "machine": machine, "machine_notes": notes, "total_s": args.total_s, "bundle": args.bundle,
           "parts": status, "failures": failures, "kernel_tests": kernel_tests, "tiny": tiny, "twins": twins,
           "stages": stages, "stages_r80": stages_r80, "profiles": profiles, "memory": memory, "bench": bench, "model_constants": constants,
           "synthetic_tokens": not dry}
    os.makedirs(out, exist_ok=True)
    json.dump(doc, open(os.path.join(out, "report.json"), "w"), indent=1)

    md = [f"# gpu_check report: {machine.get('gpu', '?')}, {machine.get('date', '?')}, commit {machine.get('commit', '?')}",
          "", f"**{label}**", ""]
    md += [f"- {k}: {v}" for k, v in machine.items() if k not in ("mode", "bundle")]
    md += [f"- {n}" for n in notes]
    md += ["", "## Parts", "", "| part | status | seconds | timeout s |", "| --- | --- | ---: | ---: |"]
    md += [f"| {s['part']} | {s['status']} | {s['seconds']} | {s['timeout_s']} |" for s in status]
    md += ["", "## Failures", ""] + ([f"- {f}" for f in failures] or ["none"])
    if kernel_tests:
        md += ["", "## Kernel tests", "", "| program | status | seconds |", "| --- | --- | ---: |"]
        md += [f"| {k['program']} | {k['status']} | {k['seconds']} |" for k in kernel_tests]
    if tiny:
        md += ["", "## Tiny preset against the CPU build's pinned losses", "",
               "Tolerance (scripts/gpu_check_tool.py): 0.5% relative at step 1, +0.5% per step.", "",
               "| step | pinned (CPU) | this run | rel diff | tolerance |", "| ---: | ---: | ---: | ---: | ---: |"]
        md += [f"| {r['step']} | {r['cpu']:.4f} | {fmt(r['gpu'], '.4f')} | {fmt(r['rel_diff'], '.2e')} | "
               f"{r['tolerance']:.3f} |" for r in tiny["rows"]]
    if twins:
        md += ["", "## The tiny twins of records 80-89 against their golden trajectories", "",
               "The PyTorch reference's losses (tests/reference/fixtures/*_golden.json), the same tolerance; "
               "one rank, the schedule of their CI tests.", "",
               "| twin | loss | step | golden | this run | rel diff | tolerance |",
               "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        md += [f"| {twin} | {r['kind']} | {r['step']} | {r['cpu']:.4f} | {fmt(r['gpu'], '.4f')} | "
               f"{fmt(r['rel_diff'], '.2e')} | {r['tolerance']:.3f}{'' if r['ok'] else ' FAIL'} |"
               for twin, t in twins.items() for r in t["rows"]]
    if memory["plan_one_gpu_mib"]:
        md += ["", "## Memory", "", f"- the record preset's plan on one GPU (--print-memory --ranks 1): "
               f"{memory['plan_one_gpu_mib']:.0f} MiB (the part fails above 80 GiB less 2 GiB)",
               f"- the profiled run's peak allocation: {memory['run_peak_mib'] if memory['run_peak_mib'] is not None else '-'} MiB"
               + (" (the dry run's preset: tiny)" if dry else " (record preset, one GPU)")]
    md += stages_md(stages, "Stages: measured against the step model (the same recording)",
                    "The tiny preset (dry run)." if dry else
                    "The record preset on one GPU (8 micro-steps per step) on **synthetic tokens** (random tokens in "
                    "documents of FineWeb-like lengths: no FineWeb on the machine); each warm-up step timed from the "
                    "initial parameters (--profile-warmup).")
    md += stages_md(stages_r80, "Record 80's stages: measured against the step model",
                    "Record 80's tiny twin (dry run)." if dry else
                    "The r80 preset the same way (one GPU, synthetic tokens, --profile-warmup).")
    if bench:
        md += ["", "## Kernel benches against profiler/cost_model.h's rates", "",
               "| launcher | shape | ms | TFLOP/s | TB/s | model rate | achieved/model |",
               "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        md += [f"| {b['launcher']} | {b['shape']} | {b['ms']:.4f} | {b['tflops']:.3g} | {b['tbs']:.3g} | "
               f"{b['model_rate']:.4g} {b['unit']} | {fmt(b['achieved_over_model'])} |" for b in bench]
    md += ["", "Every part's output: logs.txt beside this file.", ""]
    open(os.path.join(out, "report.md"), "w").write("\n".join(md))

    # the short table, printed last
    print(f"\ngpu_check ({'DRY RUN, emu times' if dry else machine.get('gpu', '?')}): report in {out}")
    print(f"{'part':<14} {'status':<10} {'s':>5}  figure")
    for s in status:
        fig = ""
        if s["part"] == "kernel_tests" and kernel_tests:
            run = [k for k in kernel_tests if k["status"] != "not in bundle"]
            fig = f"{sum(k['status'] == 'pass' for k in run)}/{len(run)} programs passed"
        elif s["part"] == "tiny" and tiny:
            worst = max((r["rel_diff"] or 0) / r["tolerance"] for r in tiny["rows"])
            fig = f"losses: worst {worst:.2f} of the tolerance"
            if twins:
                worst = max((r["rel_diff"] or 0) / r["tolerance"] for t in twins.values() for r in t["rows"])
                fig += f"; {len(twins)} twins vs golden: worst {worst:.2f}"
        elif s["part"] == "stages" and stages:
            fig = "measured/model " + " ".join(f"s{g['stage']}{g['kind'][0]}:{fmt(g['ratio'], '.2f')}" for g in stages)
        elif s["part"] == "bench" and bench:
            fig = f"{len(bench)} launchers timed"
        elif s["part"] == "machine":
            fig = machine.get("gpu", "")[:60]
        print(f"{s['part']:<14} {s['status']:<10} {s['seconds']:>5}  {fig}")
    print(f"failures: {len(failures)}" + "".join(f"\n  {f}" for f in failures[:12]))
    return 0


# ---------------------------------------------------------------------------------------- calibrate
def calibrate(args):
    path = os.path.join(args.report, "report.json")
    if not os.path.exists(path):
        sys.exit(f"gpu_check_tool calibrate: no {path}")
    doc = json.load(open(path))
    if doc.get("mode") != "gpu":
        sys.exit(f"gpu_check_tool calibrate: {path} is a {doc.get('mode')} report; only a GPU run's rates calibrate")
    where = os.path.relpath(os.path.join(args.report, "report.md"), args.repo)
    c = doc["model_constants"]
    rates = {}
    # the record's largest stage, its even step: the tensor-core kernels the model prices at a rate of
    # their own (attention, the fused c_fc) by their TFLOP/s; the memory-bound families by their share
    # of HBM bandwidth; cuBLASLt's GEMMs (priced by shape) from the benches below; transfers and
    # collectives (PCIe, NCCL: other constants) not at all
    stages = [g for g in doc["stages"] if g["kind"] == "even"]
    if stages:
        last = max(stages, key=lambda g: g["stage"])
        for f in last["families"]:
            name = f["family"]
            if f["tensor_core"]:
                if name in c["tc_tflops"] and f["tflops"] > 0:
                    rates[f"tc_tflops.{name}"] = f["tflops"]
            elif f["tbs"] > 0 and not name.startswith(("nccl", "copy_h2d", "copy_d2h")):
                rates[f"hbm_efficiency_by_family.{name}"] = min(1.0, f["tbs"] / c["hbm_tbs"])
    # tensor-core families the stages did not time: from the kernel benches, the kernel a GPU run selects
    # (attention: mma.sync; the MLP's c_fc: wgmma) at the largest shapes benched, total FLOPs over total time
    for name, variant in [("attention_forward", ""), ("attention_backward", ""),
                          ("linear_relu_square_forward", " wgmma"), ("linear_relu_square_backward", " wgmma")]:
        rows = [b for b in doc["bench"] if b["launcher"] == name and b["shape"].endswith(variant) and b["ms"] > 0]
        if variant == "":
            rows = [b for b in rows if b["shape"].startswith("stage ")]
            top = max((b["shape"].split()[1] for b in rows), default=None)
            rows = [b for b in rows if b["shape"].split()[1] == top]
        if rows and f"tc_tflops.{name}" not in rates and name in c["tc_tflops"]:
            rates[f"tc_tflops.{name}"] = sum(b["gflop"] for b in rows) / sum(b["ms"] for b in rows)
    # cuBLASLt bf16 GEMMs: the median of the benches' achieved fraction of peak
    gemms = sorted(b["tflops"] / c["bf16_tflops"] for b in doc["bench"]
                   if b["launcher"].startswith("matmul") and "fp8" not in b["launcher"] and b["tflops"] > 0)
    if gemms:
        rates["gemm_bf16_efficiency"] = min(1.0, gemms[len(gemms) // 2])
    if not rates:
        sys.exit(f"gpu_check_tool calibrate: {path} holds no measured rate")
    out = {"made_by": f"scripts/gpu_check.sh --calibrate {args.report}", "card": doc.get("card"),
           "date": doc.get("date"), "commit": doc.get("commit"),
           "rates": {k: {"value": float(f"{v:.6g}"), "report": where} for k, v in sorted(rates.items())}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(out, open(args.out, "w"), indent=1)
    print(f"calibrate: {len(rates)} measured rates from {where} into {args.out}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth-shards")
    s.add_argument("dir")
    s.add_argument("--train-tokens", type=int, default=12_000_000)
    s.add_argument("--val-tokens", type=int, default=2_200_000)
    s.add_argument("--seed", type=int, default=26)
    s.add_argument("--prefix", default="synth")
    s = sub.add_parser("losses")
    s.add_argument("log")
    s.add_argument("fixture")
    s.add_argument("--json")
    s.add_argument("--steps", type=int, default=8, help="compare the first N pinned losses (the run trains N steps)")
    s = sub.add_parser("report")
    s.add_argument("work")
    s.add_argument("out")
    s.add_argument("--mode", choices=["gpu", "dry-run"], required=True)
    s.add_argument("--repo", required=True)
    s.add_argument("--total-s", type=int, default=0)
    s.add_argument("--bundle", default="")
    s = sub.add_parser("calibrate")
    s.add_argument("report")
    s.add_argument("--out", required=True)
    s.add_argument("--repo", required=True)
    a = ap.parse_args()
    return {"synth-shards": synth_shards, "losses": losses, "report": report, "calibrate": calibrate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
