#!/usr/bin/env python3
"""The single-rank build's CPU twin against the MPI build (CTest single_rank_losses).

train_gpt_cpu_nompi is train_gpt_cpu's compiled code linked with the world-1 host side
(runtime/host_comm_world1.cpp) and NCCL stand-in (runtime/nccl_world1.cpp) instead of MPI and emu's MPI
NCCL. Both run the same short tiny-preset training, each without mpirun, and must print the same
training losses, line for line (one rank computes the same bits either way). The twin's log must say
that it ran the stand-in on one rank, and the MPI build's that it did not, so the comparison is
between two different programs. The comparison itself is checked on a planted difference: one
loss's last digit changed must be reported, naming its step.
Usage: test_single_rank.py TRAIN_GPT_CPU_NOMPI TRAIN_GPT_CPU TRAINER_ARGS...
"""
import os
import re
import subprocess
import sys
import tempfile

REPO = os.environ["REPO"]
NOMPI, MPI, ARGS = sys.argv[1], sys.argv[2], sys.argv[3:]
LOSS = re.compile(r"^step:(\d+)/\d+ train_loss:\S+$", re.M)
STAND_IN = "NCCL none (runtime/nccl_world1.cpp, the one-rank stand-in)"

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def train(binary, log_dir):
    env = dict(os.environ, EMU_WORKERS="1")
    p = subprocess.run([binary] + ARGS + ["--log-dir", log_dir], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"{binary} {' '.join(ARGS)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def loss_lines(out):
    return [m.group(0) for m in LOSS.finditer(out)]


# The first line where two runs' losses differ, or "" when they agree.
def difference(a, b):
    if len(a) != len(b):
        return f"{len(a)} loss lines against {len(b)}"
    for x, y in zip(a, b):
        if x != y:
            return f"{x!r} against {y!r}"
    return ""


def main():
    with tempfile.TemporaryDirectory() as tmp:
        nompi_out = train(NOMPI, os.path.join(tmp, "nompi"))
        mpi_out = train(MPI, os.path.join(tmp, "mpi"))
    nompi, mpi = loss_lines(nompi_out), loss_lines(mpi_out)
    for line in nompi:
        print("  " + line)
    steps = re.search(r"--max-steps (\d+)", " ".join(ARGS))
    check(steps and len(nompi) == int(steps.group(1)), f"the twin printed a loss for each of the {steps.group(1)} steps")
    check(STAND_IN in nompi_out and "world_size: 1" in nompi_out, "the twin ran NCCL's one-rank stand-in, on one rank")
    check(STAND_IN not in mpi_out and re.search(r"NCCL \d+\n", mpi_out) is not None,
          "train_gpt_cpu ran NCCL over MPI (emu/nccl.cpp)")
    diff = difference(nompi, mpi)
    check(diff == "", "the same losses as train_gpt_cpu" + (f": {diff}" if diff else ""))
    # The planted difference: the last digit of the last loss.
    planted = nompi[:-1] + [nompi[-1][:-1] + str((int(nompi[-1][-1]) + 1) % 10)] if nompi else []
    step = LOSS.match(planted[-1]).group(1) if planted else "?"
    check(f"step:{step}/" in difference(nompi, planted), f"a planted last-digit change at step {step} is reported")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed: " + "; ".join(failures))


main()
