#!/usr/bin/env python3
"""Writes the loader test fixtures under tests/data/fixtures/:

  handmade_00{0,1,2,3}.bin  small shards with known document layouts (below)
  expected/<name>.txt       what ref_loader.py prints for each scenario in scenarios.txt

The C++ test (test_data_loader) runs dump_batches on each scenario and compares with
expected/; test_data_reference.py re-runs ref_loader.py and checks expected/ is still what it
prints. Run this again only when the scenarios or layouts change:
  python3 tests/data/make_fixtures.py

Layouts (every document is BOS followed by length-1 other tokens):
  shard 0: starts with a BOS; hand-picked lengths first (a lone BOS, two BOS in a row, documents
           far longer than the scenarios' max_seq_len), then generated ones; ends mid-document.
  shard 1: begins with 11 tokens continuing shard 0's last document (never used: batches start
           at a BOS), then documents; ends mid-document.
  shard 2: tiny (two documents): too small for any scenario's micro-step, so every loader must
           skip it on its way to shard 3 (the StopIteration path taken twice in a row).
  shard 3: like shard 1, with tokens 0, 50255 and 65535 mixed in (65535 makes 36313 * token
           overflow int32 in the bigram hash).
"""
import os
import struct
import sys
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
sys.path.insert(0, HERE)
import ref_loader  # noqa: E402

BOS = 50256


class Lcg:
    """A fixed generator, so the layouts do not depend on Python's random module."""

    def __init__(self, seed):
        self.state = seed

    def next(self, n):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return (self.state >> 33) % n


def doc(rng, length, specials=False):
    out = [BOS]
    for _ in range(length - 1):
        r = rng.next(40) if specials else 1
        if r == 0:
            out.append(65535)
        elif r == 1 and specials:
            out.append(0)
        elif r == 2:
            out.append(50255)
        else:
            out.append(rng.next(BOS))
    return out


def generated_lengths(rng, count):
    # Mostly short documents with a long tail, like web text at a much smaller scale.
    lengths = []
    for _ in range(count):
        r = rng.next(10)
        lengths.append(1 + rng.next(12) if r < 5 else 12 + rng.next(40) if r < 9 else 60 + rng.next(200))
    return lengths


def continuation(rng, n):
    return [rng.next(BOS) for _ in range(n)]


def layouts():
    rng = Lcg(20240520)
    shard0 = []
    for length in [5, 1, 1, 40, 3, 90, 12, 64, 65, 7, 200, 17] + generated_lengths(rng, 60):
        shard0 += doc(rng, length)
    shard0 += doc(rng, 30)  # cut below: continues in shard 1
    shard0 = shard0[:-9]
    shard1 = continuation(rng, 11)
    for length in [300, 8, 19, 44, 1, 77] + generated_lengths(rng, 70):
        shard1 += doc(rng, length)
    shard1 += doc(rng, 25)[:14]
    shard2 = doc(rng, 6) + doc(rng, 9)
    shard3 = continuation(rng, 3)
    for length in [2, 150, 33] + generated_lengths(rng, 80):
        shard3 += doc(rng, length, specials=True)
    return [shard0, shard1, shard2, shard3]


def write_shard(path, tokens):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        body = array("H", tokens)
        if sys.byteorder != "little":
            body.byteswap()
        f.write(body.tobytes())
    os.replace(tmp, path)


def read_scenarios():
    """(name, expectation, argv) per line of scenarios.txt; expectation is 'ok' or 'error'."""
    out = []
    with open(os.path.join(FIXTURES, "scenarios.txt")) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, expect, *argv = line.split()
            out.append((name, expect, argv))
    return out


def run_reference(argv, cwd):
    """ref_loader's stdout for argv (paths relative to cwd) and whether it ended in an error."""
    import io
    import contextlib
    buf, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = ref_loader.main(argv)
    finally:
        os.chdir(old)
    return buf.getvalue(), rc


def main():
    repo = os.path.dirname(os.path.dirname(HERE))
    os.makedirs(os.path.join(FIXTURES, "expected"), exist_ok=True)
    for i, tokens in enumerate(layouts()):
        write_shard(os.path.join(FIXTURES, f"handmade_{i:03d}.bin"), tokens)
        print(f"handmade_{i:03d}.bin: {len(tokens)} tokens, {tokens.count(BOS)} documents")
    for name, expect, argv in read_scenarios():
        text, rc = run_reference(argv, repo)
        if (rc == 0) != (expect == "ok"):
            sys.exit(f"scenario {name}: reference exit status {rc}, scenarios.txt expects {expect}")
        path = os.path.join(FIXTURES, "expected", name + ".txt")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        print(f"{name}: {text.count(chr(10))} lines")


if __name__ == "__main__":
    main()
