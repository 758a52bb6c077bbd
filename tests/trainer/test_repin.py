#!/usr/bin/env python3
"""scripts/repin.py on a planted change of what the trainer computes, in a scratch copy of the fixtures.

The planted trainer is train_gpt_cpu behind a two-line wrapper that adds --seed 7 (every parameter's
initial value moves, so every bit and loss does, as after a change of the math; no rebuild). With the
cheap round of schedule_bits, one rank up to step 2 (--ranks 1 --steps 2: its first save; that the
unplanted trainer matches the committed fixture is schedule_bits' and test_trainer's own check):
  - before the re-pin, the pinned test fails on the planted trainer, naming schedule_bits.json;
  - a planted trainer whose bits depend on emu's mode (--seed 8 under deferred streams) is refused:
    repin.py exits non-zero and writes nothing;
  - repin.py on the planted trainer rewrites schedule_bits.json, prints which tensors and losses
    moved, says that the checkpoint layout did not change and what to do about the golden trajectory;
  - after it, the pinned test passes on the planted trainer.
Usage: test_repin.py TRAIN_GPT_CPU MPIRUN...
"""
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.environ["REPO"]
BINARY = os.path.abspath(sys.argv[1])
MPIRUN = sys.argv[2:]
FIXTURES = [os.path.join("tests", "trainer", "fixtures", "schedule_bits.json"),
            os.path.join("tests", "trainer", "fixtures", "checkpoint_layout_d302bc7.txt"),
            os.path.join("tests", "reference", "fixtures", "tiny_golden.json")]

CHEAP = ["--ranks", "1", "--steps", "2"]
failures = []


def check(ok, what, output=""):
    print(("ok   " if ok else "FAIL ") + what + ("" if ok else f"\n{output[-3000:]}"), flush=True)
    if not ok:
        failures.append(what)


def python(*args):
    p = subprocess.run([sys.executable] + list(args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return p.returncode, p.stdout


def wrapper(path, body):
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n{body}\n")
    os.chmod(path, 0o755)
    return path


def main():
    bits_test = os.path.join(REPO, "tests", "trainer", "test_schedule_bits.py")
    repin = os.path.join(REPO, "scripts", "repin.py")
    with tempfile.TemporaryDirectory(prefix="repin_test_") as root:
        for rel in FIXTURES:
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            shutil.copy(os.path.join(REPO, rel), os.path.join(root, rel))
        bits = os.path.join(root, FIXTURES[0])
        planted = wrapper(os.path.join(root, "planted_train_gpt"), f'exec {BINARY} "$@" --seed 7')
        moody = wrapper(os.path.join(root, "moody_train_gpt"),
                        f'if [ -n "$EMU_STREAMS" ]; then exec {BINARY} "$@" --seed 8; fi\nexec {BINARY} "$@" --seed 7')

        rc, out = python(bits_test, "--fixture", bits, *CHEAP, planted, *MPIRUN)
        check(rc != 0 and "FAIL" in out and "schedule_bits.json" in out,
              "before the re-pin the pinned test fails on the planted trainer, naming schedule_bits.json", out)

        before = open(bits).read()
        rc, out = python(repin, "--root", root, *CHEAP, moody, *MPIRUN)
        check(rc != 0 and "not deterministic" in out and "refused, nothing written" in out and open(bits).read() == before,
              "a trainer whose bits depend on emu's mode is refused and nothing is written", out)

        rc, out = python(repin, "--root", root, *CHEAP, planted, *MPIRUN)
        print(out)
        check(rc == 0 and "schedule_bits.json: changed" in out and "tensor digests moved" in out
              and "training losses step 1" in out, "repin rewrites schedule_bits.json and says which tensors and losses moved", out)
        check("checkpoint_layout_d302bc7.txt: unchanged" in out, "repin says the checkpoint layout did not change", out)
        check("tiny_golden.json" in out and ("torch_reference.py" in out or "tiny_golden.json: " in out),
              "repin says what it did about the golden trajectory", out)
        check("kept as pinned (not made: --ranks 1 --steps 2): 2, 8 rank(s)" in out, "the rank counts not made are kept", out)

        rc, out = python(bits_test, "--fixture", bits, *CHEAP, planted, *MPIRUN)
        check(rc == 0 and "all runs match" in out, "after the re-pin the pinned test passes on the planted trainer", out)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
