#!/usr/bin/env python3
"""The step profiler's command line on train_gpt_cpu (issue 17): --plan-step and --profile-steps.

plan (CTest plan_step_cli):
  - the tiny preset on 1 and 2 ranks: the JSON has the issue's keys, every stage's values are positive,
    an Adam step launches at least what an even step does, the stage steps add up to the schedule and
    total_ms is their sum of modeled step times (recomputed here); the trace parses with one process
    per rank; no log is written; no kernel or matmul runs (emu's EMU_PROFILE lists none);
  - --schedule upstream prices upstream's schedule (the JSON says so) and prints the comparison;
  - the record preset on 8 ranks finishes in under 2 minutes and prints every stage (with the Tiny
    Shakespeare stand-in when FineWeb is absent, saying so);
  - flags that only --plan-step takes are refused without it.
profile (CTest profile_steps_cli):
  - --profile-steps 2:3 on the tiny preset prints a table per step whose family counts equal the
    dry-run recording's of the same kind of step (--plan-step's JSON for stage 0: its even step for
    step 2, its Adam step for step 3), and says its times are the CPU emulation's;
  - bad ranges are refused at startup, naming the flag.
Usage: test_plan_step.py plan|profile TRAIN_GPT_CPU MPIRUN...
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.environ["REPO"]
WHAT = sys.argv[1]
BINARY = sys.argv[2]
MPIRUN = sys.argv[3:]
STAGE_KEYS = ["stage", "even_ms", "adam_ms", "exposed_comm_even_ms", "exposed_comm_adam_ms", "launches_even",
              "launches_adam", "host_syncs_in_step", "kernels", "collectives"]

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(args, ranks=1, cwd=None, env=None):
    cmd = ([BINARY] if ranks == 1 else MPIRUN + ["-np", str(ranks), "-x", "EMU_WORKERS=1", BINARY]) + args
    env = dict(os.environ, EMU_WORKERS="2" if ranks == 1 else "1", **(env or {}))
    return subprocess.run(cmd, cwd=cwd or REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def must(p, what):
    if p.returncode != 0:
        sys.exit(f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def counts(rows):
    return {r["name"]: r["count"] for r in rows}


def check_plan_json(plan, ranks, preset, steps, schedule="ours"):
    where = f"{preset} on {ranks} rank(s)"
    check(all(k in plan for k in ["preset", "world_size", "total_ms", "stages"]), f"{where}: the JSON's top-level keys")
    check(plan["preset"] == preset and plan["world_size"] == ranks and plan.get("schedule") == schedule,
          f"{where}: preset, world_size and schedule are the run's")
    stages = plan["stages"]
    check(len(stages) == 4, f"{where}: four stages (got {len(stages)})")
    total, n = 0.0, 0
    for s in stages:
        name = s.get("stage")
        check(all(k in s for k in STAGE_KEYS), f"{where}, {name}: every key of the issue")
        check(s["even_ms"] > 0 and s["adam_ms"] > 0 and s["launches_even"] > 0,
              f"{where}, {name}: modeled times and launches are positive")
        check(s["host_syncs_in_step"] == 0, f"{where}, {name}: no host sync inside a step (got {s['host_syncs_in_step']})")
        check(s["launches_adam"] >= s["launches_even"], f"{where}, {name}: an Adam step launches at least an even one's "
              f"({s['launches_adam']} vs {s['launches_even']})")
        check(s["exposed_comm_even_ms"] >= 0 and s["exposed_comm_adam_ms"] >= 0, f"{where}, {name}: exposed comm >= 0")
        check(len(s["kernels"]) > 10 and all({"name", "count", "flops", "bytes", "modeled_ms"} <= set(k)
                                             for k in s["kernels"]), f"{where}, {name}: kernel families with their keys")
        check(all({"name", "bytes", "modeled_ms", "overlapped_ms"} <= set(c) for c in s["collectives"]) and
              (ranks == 1) == (not s["collectives"]), f"{where}, {name}: collectives (with their keys) iff several ranks")
        total += s["steps_even"] * s["even_ms"] + s["steps_adam"] * s["adam_ms"] + \
            s["steps_untie"] * (s["untie_ms"] or 0)
        n += s["steps_even"] + s["steps_adam"] + s["steps_untie"]
    check(n == steps, f"{where}: the stages' steps add up to the schedule's {steps} (got {n})")
    check(abs(total - plan["total_ms"]) <= 1e-6 * total, f"{where}: total_ms {plan['total_ms']:.3f} is the sum over "
          f"the schedule ({total:.3f})")
    check(sum(s["steps_untie"] for s in stages) == 1, f"{where}: one untie step")


def test_plan(tmp):
    for ranks in (1, 2):
        out = os.path.join(tmp, f"tiny{ranks}")
        os.makedirs(out)
        js, trace = os.path.join(out, "plan.json"), os.path.join(out, "trace.json")
        # run in `out`: a log would land in out/logs, the default --log-dir (which --plan-step refuses)
        p = must(run(["--preset", "tiny", "--plan-step", "--json", js, "--trace", trace], ranks, cwd=out),
                 f"tiny --plan-step on {ranks} rank(s)")
        check_plan_json(json.load(open(js)), ranks, "tiny", 34)
        events = json.load(open(trace))["traceEvents"]
        pids = {e["pid"] for e in events}
        check(pids == set(range(ranks)), f"tiny on {ranks} rank(s): the trace has one process per rank ({sorted(pids)})")
        check(sum(e.get("ph") == "X" for e in events) > 1000, f"tiny on {ranks} rank(s): the trace has the ops")
        check(not os.path.exists(os.path.join(out, "logs")), f"tiny on {ranks} rank(s): no log written")
        check("whole run: 34 steps" in p.stdout, f"tiny on {ranks} rank(s): the whole run's modeled time is printed")

    # emu's per-kernel profile (EMU_PROFILE=1) lists every kernel and matmul run: a plan runs none
    p = must(run(["--preset", "tiny", "--plan-step"], env={"EMU_PROFILE": "1"}), "tiny --plan-step under EMU_PROFILE")
    check("emu profile" not in p.stderr, "tiny --plan-step: no kernel or matmul ran (emu's profile is empty)")
    p = must(run(["--preset", "tiny", "--check-platform"], env={"EMU_PROFILE": "1"}), "--check-platform")
    check("emu profile" in p.stderr, "(the same profile lists --check-platform's kernel)")

    js = os.path.join(tmp, "upstream.json")
    p = must(run(["--preset", "tiny", "--plan-step", "--schedule", "upstream", "--json", js]), "--schedule upstream")
    check_plan_json(json.load(open(js)), 1, "tiny", 34, "upstream")
    check("Ours vs upstream's schedule" in p.stdout and "fa3_attention" in p.stdout,
          "--schedule upstream: the comparison and its rules are printed")

    # the same plan on 2 ranks as 2 nodes of one GPU: every collective crosses the network
    one, two = os.path.join(tmp, "nodes1.json"), os.path.join(tmp, "nodes2.json")
    must(run(["--preset", "tiny", "--plan-step", "--json", one], 2), "tiny --plan-step on 2 ranks")
    must(run(["--preset", "tiny", "--plan-step", "--nodes", "2", "--json", two], 2), "--nodes 2 on 2 ranks")
    a, b = json.load(open(one)), json.load(open(two))
    check(a["nodes"] == 1 and b["nodes"] == 2, f"--nodes: the JSON says {a['nodes']} and {b['nodes']}")
    comm = lambda plan: sum(c["modeled_ms"] for st in plan["stages"] for c in st["collectives"])
    check(comm(b) > comm(a), f"--nodes 2: collectives cost more over the network ({comm(b):.4f} > {comm(a):.4f} ms)")
    p = run(["--preset", "tiny", "--plan-step", "--nodes", "3"], 2)
    check(p.returncode != 0 and "do not split evenly" in p.stderr, "--nodes 3 on 2 ranks: refused")

    js = os.path.join(tmp, "record8.json")
    t0 = time.time()
    p = must(run(["--preset", "r71", "--plan-step", "--json", js], 8), "r71 --plan-step on 8 ranks")
    seconds = time.time() - t0
    check(seconds < 120, f"record --plan-step on 8 ranks: {seconds:.1f} s (under 2 minutes)")
    check(all(re.search(rf"^stage {i} ", p.stdout, re.M) for i in range(4)), "record on 8 ranks: every stage's row")
    plan = json.load(open(js))
    check_plan_json(plan, 8, "r71", 1555)
    stage0 = plan["stages"][0]
    check(any(c["name"].startswith("nccl_send_recv") for c in stage0["collectives"]),
          "record on 8 ranks: the Adam step's sparse bigram exchange is there")
    if not os.path.exists(os.path.join(REPO, "data/fineweb10B")):
        check("not found; batches from" in p.stdout and "tinyshakespeare_train" in p.stdout,
              "record without FineWeb: the stand-in data is named")
    print(f"record --plan-step on 8 ranks: {seconds:.1f} s; stage 0 even {stage0['even_ms']:.3f} ms, "
          f"adam {stage0['adam_ms']:.3f} ms", flush=True)

    for args, phrase in [(["--json", "x.json"], "--json goes with --plan-step"),
                         (["--schedule", "upstream"], "--schedule goes with --plan-step"),
                         (["--nodes", "2"], "--nodes goes with --plan-step"),
                         (["--plan-step", "--nodes", "0"], "--nodes"),
                         (["--plan-step", "--schedule", "theirs"], "--schedule needs ours or upstream"),
                         (["--plan-step", "--print-memory"], "are separate modes")]:
        p = run(["--preset", "tiny"] + args)
        check(p.returncode == 2 and phrase in p.stderr, f"{' '.join(args)}: refused ({phrase})")


# A --profile-steps table: family -> count, up to the step's summary line (which gives the ops).
def profile_tables(stdout):
    tables, current = {}, None
    for line in stdout.splitlines():
        m = re.match(r"^profile of step (\d+) ", line)
        if m:
            current = tables.setdefault(int(m.group(1)), {"families": {}})
            continue
        m = re.match(r"^step (\d+): (\d+) ops, device ([\d.]+) ms", line)
        if m and current is not None:
            current["ops"] = int(m.group(2))
            current = None
            continue
        m = re.match(r"^(\S+) +(\d+) +[\d.]+ +[\d.]+% ", line)
        if m and current is not None:
            current["families"][m.group(1)] = int(m.group(2))
    return tables


def test_profile(tmp):
    js = os.path.join(tmp, "plan.json")
    must(run(["--preset", "tiny", "--plan-step", "--json", js]), "tiny --plan-step")
    stage0 = json.load(open(js))["stages"][0]
    want = {2: counts(stage0["kernels_even"]), 3: counts(stage0["kernels"])}
    p = must(run(["--preset", "tiny", "--max-steps", "4", "--val-every", "0", "--profile-steps", "2:3", "--log-dir",
                  os.path.join(tmp, "logs")]), "tiny --profile-steps 2:3")
    tables = profile_tables(p.stdout)
    check(sorted(tables) == [2, 3], f"--profile-steps 2:3: a table for steps 2 and 3 (got {sorted(tables)})")
    for step, table in tables.items():
        got = table["families"]
        check(got == want[step], f"step {step}: the table's counts are the recording's ({len(got)} families, "
              f"{sum(got.values())} ops; the recording: {len(want[step])}, {sum(want[step].values())})")
        check(table.get("ops") == sum(got.values()), f"step {step}: the summary's op count is the table's")
    check("times are the CPU emulation's" in p.stdout, "the table says its times are the CPU emulation's")
    check(len(re.findall(r"^profile of step", p.stdout, re.M)) == 2, "only steps 2 and 3 are profiled")

    for args, phrase in [(["--profile-steps", "3:2"], "--profile-steps 3:2: the first step is after the last"),
                         (["--profile-steps", "2"], "--profile-steps needs A:B"),
                         (["--profile-steps", "a:3"], "--profile-steps needs an integer"),
                         (["--profile-steps", "30:34"], "--profile-steps 30:34 reaches beyond the steps this run trains (0..33)"),
                         (["--max-steps", "4", "--profile-steps", "2:4"], "reaches beyond the steps this run trains (0..3)"),
                         (["--plan-step", "--profile-steps", "2:3"], "--profile-steps times a training run: it does not go with --plan-step")]:
        p = run(["--preset", "tiny", "--log-dir", os.path.join(tmp, "bad")] + args)
        check(p.returncode == 2 and phrase in p.stderr, f"{' '.join(args)}: refused at startup ({phrase})")
    check(not os.path.exists(os.path.join(tmp, "bad")), "refused runs write no log")


with tempfile.TemporaryDirectory() as tmp:
    {"plan": test_plan, "profile": test_profile}[WHAT](tmp)
print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
