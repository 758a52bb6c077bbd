#!/usr/bin/env python3
"""The training schedule's bits, pinned: a change to how a step is scheduled (streams, events,
buckets, batch buffers, host waits) must not change a single bit of what the step computes.

Trains test_trainer's short tiny schedule (--scheduled-steps 6 --extension-steps 2: stage changes at
steps 2, 4 and 6, Adam steps 1, 3, 5, 7, the untie at step 5) and saves checkpoints at steps
2, 4, 5, 6 and 8. Every tensor of every rank's checkpoint (parameters, optimizer state, mantissas)
is hashed and compared with tests/trainer/fixtures/schedule_bits.json, which was made by this
script's --make from the program as it was before the step was rescheduled. The training losses
are compared too, as printed.

Runs (CTest): 1, 2 and 8 ranks in emu's default mode (8 ranks with upstream's warm-up, which must
restore the initial state exactly; 2 ranks with the MLP on its Hopper kernel, --mlp-kernel wgmma,
which gives the same bits under emu), and 8 ranks with deferred streams in a random order
(EMU_STREAMS=deferred EMU_RANDOM_ORDER=<seed>), where a missing event between streams changes the
bits or is reported as a race. --full runs every rank count in both modes, each with the warm-up.

Usage: test_schedule_bits.py [--make FIXTURE] [--full] TRAIN_GPT_CPU MPIRUN...
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
    make, full = None, False
    while argv and argv[0].startswith("--"):
        if argv[0] == "--make" and len(argv) > 1:
            make, argv = argv[1], argv[2:]
        elif argv[0] == "--full":
            full, argv = True, argv[1:]
        else:
            sys.exit(f"test_schedule_bits.py: unknown option {argv[0]}\n{__doc__}")
    if not argv:
        sys.exit(__doc__)
    return make, full, argv[0], argv[1:]


def train(binary, mpirun, ranks, env, warmup, extra, root):
    """Trains the schedule; returns {step: {rank: {tensor: digest}}} and the printed training losses."""
    args = SCHEDULE + extra + ["--warmup", "1" if warmup else "0", "--run-id", "bits", "--log-dir", root,
                               "--save-checkpoint", os.path.join(root, "ckpt")]
    cmd = ([binary] if ranks == 1 else mpirun + ["-np", str(ranks), "-x", "EMU_WORKERS=1"] +
           [x for k in env for x in ("-x", k)] + [binary]) + args
    e = dict(os.environ, EMU_WORKERS="2" if ranks == 1 else "1", **env)
    p = subprocess.run(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"train_gpt failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    losses = re.findall(r"^step:\d+/\d+ train_loss:(\S+)$", p.stdout, re.M)
    digests = {}
    for step in STEPS:
        digests[str(step)] = {}
        for rank in range(ranks):
            path = os.path.join(root, "ckpt", f"step{step:06d}", f"rank{rank}.safetensors")
            _, tensors = read_checkpoint.load(path)
            digests[str(step)][str(rank)] = {name: hashlib.sha256(raw).hexdigest()[:16]
                                             for name, (_, _, raw) in sorted(tensors.items())}
    return digests, losses


def main():
    make, full, binary, mpirun = parse_args(sys.argv[1:])
    if full or make:
        runs = [(ranks, env, True, []) for ranks in (1, 2, 8) for env in ({}, DEFERRED)]
    else:
        runs = [(1, {}, False, []), (2, {}, False, ["--mlp-kernel", "wgmma"]), (8, {}, True, []),
                (8, DEFERRED, False, [])]
    want = None if make else json.load(open(FIXTURE))
    got = {}
    failures = []
    for ranks, env, warmup, extra in runs:
        label = f"{ranks} rank(s), {'deferred random-order streams' if env else 'default streams'}" + \
                (", warm-up" if warmup else "") + "".join(" " + a for a in extra)
        with tempfile.TemporaryDirectory() as root:
            digests, losses = train(binary, mpirun, ranks, env, warmup, extra, root)
        if make:
            previous = got.get(str(ranks))
            if previous and previous != {"digests": digests, "losses": losses}:
                sys.exit(f"--make: {label} differs from the same rank count's other run; the program is not "
                         "deterministic, no fixture written")
            got[str(ranks)] = {"digests": digests, "losses": losses}
            print(f"made {label}", flush=True)
            continue
        ref = want[str(ranks)]
        bad = [f"step {s} rank {r} {name}" for s in ref["digests"] for r in ref["digests"][s]
               for name, d in ref["digests"][s][r].items() if digests.get(s, {}).get(r, {}).get(name) != d]
        extra = [f"step {s} rank {r} {name}" for s in digests for r in digests[s] for name in digests[s][r]
                 if name not in ref["digests"].get(s, {}).get(r, {})]
        ok = not bad and not extra and losses == ref["losses"]
        print(("ok   " if ok else "FAIL ") + f"{label}: every checkpoint tensor and training loss as pinned", flush=True)
        if not ok:
            failures.append(label)
            for what in bad[:10]:
                print(f"     differs: {what}")
            for what in extra[:10]:
                print(f"     not in the fixture: {what}")
            if losses != ref["losses"]:
                print(f"     losses {losses} != {ref['losses']}")
    if make:
        with open(make, "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
            f.write("\n")
        print(f"wrote {make}")
        return
    if failures:
        sys.exit(f"{len(failures)} run(s) differ from the pinned bits: {failures}")
    print("all runs match the pinned bits")


if __name__ == "__main__":
    main()
