#!/usr/bin/env python3
"""The training schedule's bits, pinned: a change to how a step is scheduled (streams, events,
buckets, batch buffers, host waits) must not change a single bit of what the step computes.

Trains test_trainer's short tiny schedule (--scheduled-steps 6 --extension-steps 2: stage changes at
steps 2, 4 and 6, Adam steps 1, 3, 5, 7, the untie at step 5) and saves checkpoints at steps
2, 4, 5, 6 and 8. Every tensor of every rank's checkpoint (parameters, optimizer state, mantissas)
is hashed and compared with tests/trainer/fixtures/schedule_bits.json, which was made by this
script's --make from the program as it was before the step was rescheduled. The training losses
are compared too, as printed.

Runs: 1, 2 and 8 ranks in emu's default mode (8 ranks with upstream's warm-up, which must restore
the initial state exactly; 2 ranks with the MLP on its Hopper kernel, --mlp-kernel wgmma, which gives
the same bits under emu), and 8 ranks with deferred streams in a random order (EMU_STREAMS=deferred
EMU_RANDOM_ORDER=<seed>), where a missing event between streams changes the bits or is reported as a
race. --full runs every rank count in both modes, each with the warm-up. --deferred-only runs the
last alone. CTest runs none of these: test_trainer trains 1 and 2 ranks in the default mode and 8
ranks deferred with these flags and checks them against the fixture (check_default_runs).

--make FILE trains every rank count in both modes and writes FILE only if the two modes agree bit for
bit (scripts/repin.py). --fixture FILE compares with FILE instead of the committed fixture; --ranks
N[,N...] keeps the runs of those rank counts; --steps N (one of the saved steps) stops the schedule
after step N (--max-steps N), without the warm-up and with one small validation (--val-every 0
--val-tokens 2048: no validation loss is checked, and validation changes no bit), and checks or makes
only the saves and losses up to it. The last two make the repin test's cheap round (tests/trainer/test_repin.py: one rank, two steps;
the warm-up's exact restore is pinned by the full runs).

Usage: test_schedule_bits.py [--make FILE | --full | --deferred-only] [--fixture FILE] [--ranks N,...]
                             [--steps N] TRAIN_GPT_CPU MPIRUN...
"""
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.environ.get("REPO", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import read_checkpoint  # noqa: E402

FIXTURE = os.path.join(REPO, "tests", "trainer", "fixtures", "schedule_bits.json")
SCHEDULE = ["--preset", "tiny", "--scheduled-steps", "6", "--extension-steps", "2", "--val-every", "4",
            "--val-tokens", "4096", "--checkpoint-steps", "2,4,5,6,8", "--log-train-loss"]
STEPS = [2, 4, 5, 6, 8]
DEFERRED = {"EMU_STREAMS": "deferred", "EMU_RANDOM_ORDER": "20261124"}


def parse_args(argv):
    opts = {"make": None, "full": False, "deferred_only": False, "fixture": FIXTURE, "ranks": None, "steps": None}
    while argv and argv[0].startswith("--"):
        if argv[0] in ("--make", "--fixture", "--ranks", "--steps") and len(argv) > 1:
            opts[argv[0][2:]], argv = argv[1], argv[2:]
        elif argv[0] in ("--full", "--deferred-only"):
            opts[argv[0][2:].replace("-", "_")], argv = True, argv[1:]
        else:
            sys.exit(f"test_schedule_bits.py: unknown option {argv[0]}\n{__doc__}")
    if not argv:
        sys.exit(__doc__)
    if opts["ranks"] is not None:
        if not re.fullmatch(r"[128](,[128])*", opts["ranks"]):
            sys.exit(f"test_schedule_bits.py: --ranks takes rank counts among 1, 2 and 8, got '{opts['ranks']}'")
        opts["ranks"] = [int(r) for r in opts["ranks"].split(",")]
    if opts["steps"] is not None:
        if opts["steps"] not in [str(s) for s in STEPS]:
            sys.exit(f"test_schedule_bits.py: --steps takes one of the saved steps {STEPS}, got '{opts['steps']}'")
        opts["steps"] = int(opts["steps"])
    return opts, argv[0], argv[1:]


def schedule(last):
    """SCHEDULE's flags for a run that stops after step LAST (saving the STEPS up to it). A run cut
    short (the cheap round) validates once, at its end, on the smallest --val-tokens: nothing here
    reads a validation loss, and validation changes no bit of the training (the cheap round against
    the committed fixture passes so; the full runs validate as the fixture's runs did)."""
    args = list(SCHEDULE)
    args[args.index("--checkpoint-steps") + 1] = ",".join(str(s) for s in STEPS if s <= last)
    if last < STEPS[-1]:
        args[args.index("--val-every") + 1] = "0"
        args[args.index("--val-tokens") + 1] = "2048"
    return args + (["--max-steps", str(last)] if last < STEPS[-1] else [])


def truncated(entry, last):
    """A fixture entry's saves and losses up to step LAST."""
    return {"digests": {s: v for s, v in entry["digests"].items() if int(s) <= last}, "losses": entry["losses"][:last]}


def train(binary, mpirun, ranks, env, warmup, extra, root, last=STEPS[-1]):
    """Trains the schedule up to step LAST; returns {step: {rank: {tensor: digest}}} and the printed
    training losses."""
    args = schedule(last) + extra + ["--warmup", "1" if warmup else "0", "--run-id", "bits", "--log-dir", root,
                                     "--save-checkpoint", os.path.join(root, "ckpt")]
    cmd = ([binary] if ranks == 1 else mpirun + ["-np", str(ranks), "-x", "EMU_WORKERS=1"] +
           [x for k in env for x in ("-x", k)] + [binary]) + args
    e = dict(os.environ, EMU_WORKERS="2" if ranks == 1 else "1", **env)
    p = subprocess.run(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"train_gpt failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return checkpoint_digests(os.path.join(root, "ckpt"), ranks, last), train_losses(p.stdout)


def shown(path):
    """PATH as the repository names it, where it lies inside it."""
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel


def train_losses(stdout):
    return re.findall(r"^step:\d+/\d+ train_loss:(\S+)$", stdout, re.M)


def checkpoint_digests(save_dir, ranks, last=STEPS[-1]):
    """{step: {rank: {tensor: digest}}} of the saves at STEPS (up to step LAST) in SAVE_DIR."""
    digests = {}
    for step in [s for s in STEPS if s <= last]:
        digests[str(step)] = {}
        for rank in range(ranks):
            path = os.path.join(save_dir, f"step{step:06d}", f"rank{rank}.safetensors")
            _, tensors = read_checkpoint.load(path)
            digests[str(step)][str(rank)] = {name: hashlib.sha256(raw).hexdigest()[:16]
                                             for name, (_, _, raw) in sorted(tensors.items())}
    return digests


def differences(ref, digests, losses):
    """What differs from a fixture entry {"digests", "losses"}: a list of lines, empty when none."""
    bad = [f"differs: step {s} rank {r} {name}" for s in ref["digests"] for r in ref["digests"][s]
           for name, d in ref["digests"][s][r].items() if digests.get(s, {}).get(r, {}).get(name) != d]
    extra = [f"not in the fixture: step {s} rank {r} {name}" for s in digests for r in digests[s]
             for name in digests[s][r] if name not in ref["digests"].get(s, {}).get(r, {})]
    lines = bad[:10] + extra[:10]
    if len(bad) + len(extra) > len(lines):
        lines.append(f"... {len(bad) + len(extra) - len(lines)} more tensor(s)")
    if losses != ref["losses"]:
        lines.append(f"losses {losses} != {ref['losses']}")
    return lines


def check_default_runs(runs, fixture=FIXTURE):
    """test_trainer.py's runs against the fixture: RUNS is {ranks: (save_dir, stdout)}, each trained
    with SCHEDULE's flags in the default mode (what schedule_bits --deferred-only leaves to it).
    Returns a list of (ok, message)."""
    want = json.load(open(fixture))
    results = []
    for ranks, (save_dir, stdout) in sorted(runs.items()):
        lines = differences(want[str(ranks)], checkpoint_digests(save_dir, ranks), train_losses(stdout))
        results.append((not lines, f"{ranks} rank(s): every checkpoint tensor and training loss as pinned in "
                                   f"{shown(fixture)}" + "".join("\n     " + l for l in lines)))
    return results


def main():
    opts, binary, mpirun = parse_args(sys.argv[1:])
    make = opts["make"]
    if opts["full"] or make:
        runs = [(ranks, env, True, []) for ranks in (1, 2, 8) for env in ({}, DEFERRED)]
    elif opts["deferred_only"]:
        runs = [(8, DEFERRED, False, [])]
    else:
        runs = [(1, {}, False, []), (2, {}, False, ["--mlp-kernel", "wgmma"]), (8, {}, True, []),
                (8, DEFERRED, False, [])]
    if opts["ranks"]:
        runs = [r for r in runs if r[0] in opts["ranks"]]
    if opts["steps"]:  # the cheap round: the warm-up (upstream's ~10 steps around the stage changes) is the most of a run
        runs = [(ranks, env, False, extra) for ranks, env, _, extra in runs]
    fixture, last = opts["fixture"], opts["steps"] or STEPS[-1]
    want = None if make else json.load(open(fixture))
    got = {}
    failures = []
    for ranks, env, warmup, extra in runs:
        label = f"{ranks} rank(s), {'deferred random-order streams' if env else 'default streams'}" + \
                (", warm-up" if warmup else "") + "".join(" " + a for a in extra) + \
                (f", up to step {last}" if last < STEPS[-1] else "")
        with tempfile.TemporaryDirectory() as root:
            digests, losses = train(binary, mpirun, ranks, env, warmup, extra, root, last)
        if make:
            previous = got.get(str(ranks))
            if previous and previous != {"digests": digests, "losses": losses}:
                sys.exit(f"--make: {label} differs from the same rank count's other run; the program is not "
                         "deterministic, no fixture written")
            got[str(ranks)] = {"digests": digests, "losses": losses}
            print(f"made {label}", flush=True)
            continue
        if str(ranks) not in want:
            sys.exit(f"{fixture} has no entry for {ranks} rank(s)")
        lines = differences(truncated(want[str(ranks)], last), digests, losses)
        print(("ok   " if not lines else "FAIL ") + f"{label}: every checkpoint tensor and training loss as pinned in "
              f"{shown(fixture)}", flush=True)
        if lines:
            failures.append(label)
            for line in lines:
                print(f"     {line}")
    if make:
        with open(make, "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
            f.write("\n")
        print(f"wrote {make}")
        return
    if failures:
        sys.exit(f"{len(failures)} run(s) differ from the pinned bits of {fixture}: {failures}")
    print("all runs match the pinned bits")


if __name__ == "__main__":
    main()
