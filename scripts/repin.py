#!/usr/bin/env python3
"""Re-pins the fixtures that a change of the math moves, from the trainer as built now.

For a change that is meant to change what the trainer computes (a hyperparameter, a kernel's
rounding, a new parameter), after which the pinned tests fail naming these fixtures:
  tests/trainer/fixtures/schedule_bits.json       every checkpoint tensor's digest and training loss
      of the short tiny schedule on 1, 2 and 8 ranks (test_schedule_bits.py --make). Each rank count
      is trained twice, in emu's default mode and under deferred random-order streams; unless the two
      agree bit for bit nothing is written (a program whose bits depend on the schedule is a bug, not
      a new pin).
  tests/trainer/fixtures/checkpoint_layout_*.txt  the rank files' tensor list (test_checkpoint_layout.py
      --make): it moves only when the checkpoint's contents change, and then older checkpoints no
      longer load.
  tests/reference/fixtures/tiny_golden.json       the golden trajectory. It comes from the independent
      PyTorch reference (tests/reference/torch_reference.py), not from this trainer: a change of the
      math must be made there by hand too, then tests/reference/make_golden.py rewrites it. Run here
      where torch is installed; without torch this script says so and leaves it.
Prints what changed (which fixtures, which tensors and values) and writes only the changed fixtures,
after every one of them has been made.

Usage: repin.py [--root DIR] [--ranks N,...] [--steps N] TRAIN_GPT_CPU MPIRUN...
  --root DIR    the fixtures under DIR (the same paths as in the repository) instead of the repository's
  --ranks N,... schedule_bits' rank counts to make (others kept as they are), and --steps N: its
                schedule up to step N only (test_schedule_bits.py --steps); the repin test's cheap round.
                A real re-pin makes all.
`make repin` runs it with the build's trainer and mpirun command line.
"""
import difflib
import glob
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BITS = os.path.join("tests", "trainer", "fixtures", "schedule_bits.json")
LAYOUT_GLOB = os.path.join("tests", "trainer", "fixtures", "checkpoint_layout_*.txt")
GOLDEN = os.path.join("tests", "reference", "fixtures", "tiny_golden.json")
# The schedule test_trainer.py runs and the golden fixture is made for (tests/reference/README.md).
GOLDEN_FLAGS = ["--scheduled-steps", "6", "--extension-steps", "2", "--val-every", "4", "--val-tokens", "4096"]


def parse_args(argv):
    root, subset = REPO, []
    while argv and argv[0].startswith("--"):
        if argv[0] == "--root" and len(argv) > 1:
            root, argv = os.path.abspath(argv[1]), argv[2:]
        elif argv[0] in ("--ranks", "--steps") and len(argv) > 1:
            subset, argv = subset + argv[:2], argv[2:]
        else:
            sys.exit(f"repin.py: unknown option {argv[0]}\n{__doc__}")
    if len(argv) < 2:
        sys.exit(__doc__)
    binary = os.path.abspath(argv[0])
    if not os.access(binary, os.X_OK):
        sys.exit(f"repin.py: {binary} is not an executable trainer (make cpu builds build/train_gpt_cpu)")
    return root, subset, binary, argv[1:]


def make(what, cmd):
    """Runs a fixture maker, its output shown; stops the re-pin with nothing written if it fails."""
    print(f"== {what}: {' '.join(cmd)}", flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, REPO=REPO, PYTHONDONTWRITEBYTECODE="1"))
    if p.returncode != 0:
        sys.exit(f"repin.py: refused, nothing written: {what} failed (exit {p.returncode})")


def bits_changes(old, new):
    """Lines saying how the schedule_bits fixture changed, per rank count: the tensors whose digest
    moved (counted per step, the first few named) and the training losses, old -> new."""
    lines = []
    for ranks in sorted(new, key=int):
        if ranks not in old:
            lines.append(f"{ranks} rank(s): new")
            continue
        moved, total, names = {}, 0, []
        for step, per_rank in new[ranks]["digests"].items():
            for rank, digests in per_rank.items():
                was = old[ranks]["digests"].get(step, {}).get(rank, {})
                for name, digest in digests.items():
                    total += 1
                    if was.get(name) != digest:
                        moved[step] = moved.get(step, 0) + 1
                        if name not in names:
                            names.append(name)
        if moved:
            per_step = ", ".join(f"step {s}: {n}" for s, n in sorted(moved.items(), key=lambda x: int(x[0])))
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            lines.append(f"{ranks} rank(s): {sum(moved.values())} of {total} tensor digests moved ({per_step}): {shown}")
        if old[ranks]["losses"] != new[ranks]["losses"]:
            pairs = [f"step {i + 1} {a} -> {b}" for i, (a, b) in enumerate(zip(old[ranks]["losses"], new[ranks]["losses"]))
                     if a != b]
            lines.append(f"{ranks} rank(s): training losses " + ", ".join(pairs))
    return lines


def golden_changes(old, new):
    """Lines naming each golden value that moved, old -> new (the run's own bookkeeping, its
    'source' entry, left out)."""
    lines = []

    def walk(a, b, path):
        if isinstance(b, dict):
            for k in b:
                walk(a.get(k) if isinstance(a, dict) else None, b[k], f"{path}.{k}" if path else k)
        elif isinstance(b, list) and isinstance(a, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            lines.append(f"{path}: {a} -> {b}")

    walk({k: v for k, v in old.items() if k != "source"}, {k: v for k, v in new.items() if k != "source"}, "")
    return lines


def torch_available():
    return subprocess.run([sys.executable, "-c", "import torch"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def main():
    root, subset, binary, mpirun = parse_args(sys.argv[1:])
    tests = os.path.join(REPO, "tests")
    layouts = sorted(glob.glob(os.path.join(root, LAYOUT_GLOB)))
    if len(layouts) != 1:
        sys.exit(f"repin.py: want one {LAYOUT_GLOB} under {root}, found {len(layouts)}")
    layout = os.path.relpath(layouts[0], root)
    made = {}
    with tempfile.TemporaryDirectory(prefix="repin_") as tmp:
        bits_cmd = [sys.executable, os.path.join(tests, "trainer", "test_schedule_bits.py"),
                    "--make", os.path.join(tmp, "bits.json")] + subset + [binary] + mpirun
        make("schedule_bits (default and deferred random-order streams must agree)", bits_cmd)
        made[BITS] = os.path.join(tmp, "bits.json")
        make("checkpoint layout", [sys.executable, os.path.join(tests, "trainer", "test_checkpoint_layout.py"),
                                   "--make", os.path.join(tmp, "layout.txt"), binary])
        made[layout] = os.path.join(tmp, "layout.txt")
        golden_note = None
        if torch_available():
            dump_tool = os.path.join(os.path.dirname(binary), "dump_batches")
            make("golden trajectory from the PyTorch reference",
                 [sys.executable, os.path.join(tests, "reference", "make_golden.py"), "--trainer", binary,
                  "--dump-tool", dump_tool, "--out", os.path.join(tmp, "golden.json")] + GOLDEN_FLAGS)
            made[GOLDEN] = os.path.join(tmp, "golden.json")
        else:
            golden_note = (f"{GOLDEN}: not remade, torch is not installed here. The golden trajectory comes from the "
                           "independent PyTorch reference, tests/reference/torch_reference.py: make the same change of "
                           "the math there by hand, then, where torch is installed, run\n"
                           f"    python3 tests/reference/make_golden.py {' '.join(GOLDEN_FLAGS)}\n"
                           "(or this script again). test_trainer's golden checks fail until then if the trajectory moved.")

        print("\n== what changed")
        changed = []
        for rel, path in made.items():
            old_path = os.path.join(root, rel)
            old_text, new_text = open(old_path).read(), open(path).read()
            if rel == BITS:
                old, new = json.loads(old_text), json.loads(new_text)
                kept = sorted(set(old) - set(new), key=int)
                new = {**{k: old[k] for k in kept}, **new}
                new_text = json.dumps(new, indent=0, sort_keys=True) + "\n"
                lines = bits_changes(old, new)
                if kept:
                    lines.append(f"kept as pinned (not made: {' '.join(subset)}): {', '.join(kept)} rank(s)")
            elif rel == GOLDEN:
                lines = golden_changes(json.loads(old_text), json.loads(new_text))
            else:
                lines = [line.rstrip("\n") for line in difflib.unified_diff(
                    old_text.splitlines(True), new_text.splitlines(True), rel, rel + " (new)", n=0)]
            if old_text == new_text or not [l for l in lines if not l.startswith("kept as pinned")]:
                print(f"{rel}: unchanged")
                continue
            changed.append((old_path, new_text))
            print(f"{rel}: changed")
            for line in lines:
                print(f"    {line}")
            if rel == layout:
                print("    (the checkpoint's tensor list moved: checkpoints saved before this change no longer load)")
        if golden_note:
            print(golden_note)
        for old_path, new_text in changed:
            with open(old_path + ".tmp", "w") as f:
                f.write(new_text)
            os.replace(old_path + ".tmp", old_path)
    print(f"\nrepin: {len(changed)} fixture(s) rewritten" + (f" under {root}" if root != REPO else "") +
          ("" if not changed else ": " + ", ".join(os.path.relpath(p, root) for p, _ in changed)))


if __name__ == "__main__":
    main()
