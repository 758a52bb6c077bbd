#!/usr/bin/env python3
"""A short 2-rank tiny training run under emu's strict switches equals the default mode's bit for bit.

The run (--scheduled-steps 6 --extension-steps 2 --max-steps 3: the warm-up, the stage change at
step 2 and the Adam steps 1 and 3) is made once in the default mode, then once per seed with
EMU_RANDOM_ORDER=SEED (threads and blocks in shuffled order), EMU_STREAMS=deferred:SEED (streams run
when needed, in a seeded order, under the race detector) and EMU_POISON=1 (allocations filled with
NaNs). A correct program computes the same bits in every mode: the logged losses and the final
checkpoint of every rank must be identical (every tensor's bytes, and the metadata but for the run and
save identities, which are new for every run and save).
Usage: strict_training.py TRAIN_GPT_CPU SEED[,SEED...] MPIRUN... (the mpirun command line as CTest runs it)
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import read_checkpoint  # noqa: E402

IDENTITIES = ("run_id", "save_id")  # differ between any two saves by design
BINARY, SEEDS, MPIRUN = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
RANKS, STEPS = 2, 3
ARGS = ["--preset", "tiny", "--scheduled-steps", "6", "--extension-steps", "2", "--max-steps", str(STEPS),
        "--val-every", "0", "--log-train-loss"]
LOSS = re.compile(r"^step:\d+/\d+ (?:train_loss|val_loss):\S+", re.M)


def run(label, tmp, env):
    save = os.path.join(tmp, label)
    cmd = MPIRUN + ["-np", str(RANKS), "-x", "EMU_WORKERS=1", BINARY] + ARGS + ["--log-dir", save, "--save-checkpoint", save]
    p = subprocess.run(cmd, cwd=os.environ["REPO"], env=dict(os.environ, **env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL {label}: train_gpt exited with {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    losses = [m.group(0) for m in LOSS.finditer(p.stdout)]
    ckpts = sorted(os.path.relpath(os.path.join(d, f), save) for d, _, fs in os.walk(save) for f in fs
                   if f.endswith(".safetensors"))
    return save, losses, ckpts


def same_checkpoint(a, b):
    """The two files hold the same tensors, bit for bit, and the same metadata but for IDENTITIES."""
    (meta_a, tensors_a), (meta_b, tensors_b) = read_checkpoint.load(a), read_checkpoint.load(b)
    strip = lambda meta: {k: v for k, v in meta.items() if k not in IDENTITIES}  # noqa: E731
    return strip(meta_a) == strip(meta_b) and tensors_a == tensors_b


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        base, base_losses, base_ckpts = run("default", tmp, {})
        if len(base_losses) != STEPS + 1 or len(base_ckpts) != RANKS:
            sys.exit(f"FAIL default: expected {STEPS + 1} loss lines and {RANKS} checkpoints, got {base_losses} {base_ckpts}")
        for seed in SEEDS:
            label = f"strict_{seed}"
            env = {"EMU_RANDOM_ORDER": seed, "EMU_STREAMS": f"deferred:{seed}", "EMU_POISON": "1"}
            save, losses, ckpts = run(label, tmp, env)
            ok = losses == base_losses
            print(("ok   " if ok else "FAIL ") + f"{label}: losses {losses}" + ("" if ok else f" != default {base_losses}"))
            if not ok:
                failures.append(label + " losses")
            for c in base_ckpts:
                same = c in ckpts and same_checkpoint(os.path.join(base, c), os.path.join(save, c))
                print(("ok   " if same else "FAIL ") + f"{label}: checkpoint {c} identical to the default mode's")
                if not same:
                    failures.append(f"{label} {c}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
