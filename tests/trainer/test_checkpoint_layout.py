#!/usr/bin/env python3
"""Checkpoints keep their on-disk layout: a 2-step tiny run saving at steps 1 and 2 (an odd step,
which also holds Adam's pending gradients, and an even one) writes rank files whose tensor list
(name, dtype, shape, bytes, in data order) and metadata keys are byte-identical to the fixture
listed from the same save by main at d302bc7, before the optimizer-state registry. So checkpoints
from before the registry load (the loader looks tensors up by these names, dtypes and shapes).
CTest makes this comparison in test_trainer (check_layout), on its 1-rank run's saves at steps 1 and 2,
which list the same, rather than training this script's run for it; run alone, this script still does.

    test_checkpoint_layout.py TRAIN_GPT_CPU              compare with the fixture
    test_checkpoint_layout.py --make FILE TRAIN_GPT_CPU  write the listing of TRAIN_GPT_CPU's save to FILE
                                                         (scripts/repin.py, after a change of the layout)
    test_checkpoint_layout.py --list DIR                 print the listing of a save directory DIR
"""
import os
import subprocess
import sys
import tempfile

REPO = os.environ.get("REPO", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import read_checkpoint  # noqa: E402

FIXTURE = os.path.join(REPO, "tests", "trainer", "fixtures", "checkpoint_layout_d302bc7.txt")
STEPS = (1, 2)


def listing(save_dir):
    lines = []
    for step in STEPS:
        path = os.path.join(save_dir, f"step{step:06d}", "rank0.safetensors")
        meta, infos = read_checkpoint.read_header(path)
        lines.append(f"step{step:06d}/rank0.safetensors")
        for name, info in infos.items():
            lines.append(f"  {name} {info['dtype']} {list(info['shape'])} {info['bytes']}")
        lines.append("  meta: " + " ".join(sorted(meta)))
    return "\n".join(lines) + "\n"


def save_listing(binary):
    """The listing of a 2-step tiny run's saves at STEPS; exits naming the failure if the run fails."""
    with tempfile.TemporaryDirectory() as tmp:
        save = os.path.join(tmp, "ckpt")
        args = ["--preset", "tiny", "--max-steps", "2", "--val-every", "0", "--warmup", "0", "--val-tokens", "2048",
                "--checkpoint-steps", ",".join(map(str, STEPS)), "--save-checkpoint", save, "--log-dir", tmp]
        r = subprocess.run([binary] + args, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            print(f"FAIL the run exited {r.returncode}: {r.stderr[-2000:]}")
            sys.exit(1)
        return listing(save)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--list":
        sys.stdout.write(listing(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--make":
        text = save_listing(os.path.abspath(sys.argv[3]))
        open(sys.argv[2], "w").write(text)
        print(f"wrote {sys.argv[2]}")
        return 0
    if len(sys.argv) != 2 or sys.argv[1].startswith("--"):
        sys.exit(__doc__)
    got, want = save_listing(os.path.abspath(sys.argv[1])), open(FIXTURE).read()
    if got != want:
        print(f"FAIL the checkpoint layout differs from {os.path.relpath(FIXTURE, REPO)}:")
        for g, w in zip(got.splitlines() + [""] * 999, want.splitlines()):
            if g != w:
                print(f"  got  {g!r}\n  want {w!r}")
        return 1
    print(f"ok   the rank files of steps {STEPS} list {got.count(chr(10)) - 2 * len(STEPS)} tensors exactly as {os.path.relpath(FIXTURE, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
