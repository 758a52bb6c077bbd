#!/usr/bin/env python3
"""--print-memory's optimizer-state summary against the optimizer arena it summarizes, for both presets.

The summary is a loop over the groups' registered state tensors (runtime/memory_plan.h); the arena lists
every tensor the optimizer takes, state or not (gradient shards, NorMuon's scratch, ...). Checked: the
summary names exactly the state tensors a checkpoint saves (README.md's checkpoint table), and each
name's bytes and group count equal those of the arena's `optim.<group>.<name>` entries, computed here
from their printed dtype and shape; the total is the sum. The comparison is also run on the output with
each state entry removed in turn (a planted miscount), which it must report.

    test_memory_plan_state.py TRAIN_GPT_CPU
"""
import math
import re
import subprocess
import sys

# The optimizer state a checkpoint saves per group: Adam's moments and NorMuon's state.
STATE_NAMES = {"exp_avg", "exp_avg_sq", "momentum", "mantissa", "second_moment"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "uint16": 2, "int32": 4, "fp8": 1, "bytes": 1}
ARENA = re.compile(r"^(\S+)\s+[0-9.]+ MiB")
SUMMARY = re.compile(r"^optimizer state by name")
SUMMARY_ROW = re.compile(r"^    (\S+)\s+(\d+) groups\s+(\d+) bytes\s+[0-9.]+ MiB$")
SUMMARY_TOTAL = re.compile(r"^    all state\s+(\d+) bytes\s+[0-9.]+ MiB$")

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def finish():
    """The exit status: 1 when a check failed."""
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


def parse(text):
    """({arena: [(name, dtype, shape, bytes)]}, {state name: (groups, bytes)}, total bytes or None)."""
    arenas, summary, total, current = {}, {}, None, None
    for line in text.splitlines():
        if SUMMARY.match(line):
            current = None
            continue
        if m := ARENA.match(line):
            current = arenas.setdefault(m.group(1), [])
        elif m := SUMMARY_ROW.match(line):
            summary[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        elif m := SUMMARY_TOTAL.match(line):
            total = int(m.group(1))
        elif current is not None and line.startswith("    "):
            tokens = line.split()  # name dtype d0 x d1 ... MiB-value MiB
            shape = [int(d) for d in tokens[2:-2] if d != "x"]
            current.append((tokens[0], tokens[1], shape, math.prod(shape) * DTYPE_BYTES[tokens[1]]))
    return arenas, summary, total


def mismatches(text):
    """What in the summary disagrees with the optimizer arena's state entries ([] when all agree)."""
    arenas, summary, total = parse(text)
    want = {}
    for name, _, _, nbytes in arenas.get("optimizer", []):
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "optim" and parts[2] in STATE_NAMES:
            groups, b = want.get(parts[2], (0, 0))
            want[parts[2]] = (groups + 1, b + nbytes)
    out = []
    if set(summary) != STATE_NAMES:
        out.append(f"the summary names {sorted(summary)}, not the checkpoint's state {sorted(STATE_NAMES)}")
    for name in sorted(set(summary) | set(want)):
        if summary.get(name) != want.get(name):
            out.append(f"{name}: the summary says (groups, bytes) {summary.get(name)}, the arena {want.get(name)}")
    if total != sum(b for _, b in summary.values()):
        out.append(f"the total {total} is not the sum of the rows")
    return out


def print_memory(binary, preset):
    p = subprocess.run([binary, "--preset", preset, "--print-memory"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if p.returncode != 0:
        sys.exit(f"{binary} --preset {preset} --print-memory failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout


def main():
    binary = sys.argv[1]
    for preset in ("tiny", "record"):
        text = print_memory(binary, preset)
        _, summary, total = parse(text)
        bad = mismatches(text)
        check(not bad, f"{preset}: the state summary ({len(summary)} names, {total} bytes) equals the optimizer "
                       f"arena's state entries" + "".join("\n     " + b for b in bad))
        lines = text.splitlines()
        state_lines = [i for i, l in enumerate(lines)
                       if re.match(r"^    optim\.[^. ]+\.\S+ ", l) and l.split()[0].split(".")[2] in STATE_NAMES]
        caught = [i for i in state_lines
                  if any(b.startswith(lines[i].split()[0].split(".")[2] + ":")
                         for b in mismatches("\n".join(lines[:i] + lines[i + 1:])))]
        check(state_lines and caught == state_lines,
              f"{preset}: the comparison reports each planted miscount (the arena without one of its "
              f"{len(state_lines)} state entries; caught {len(caught)})")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
