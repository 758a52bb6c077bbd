#!/usr/bin/env python3
"""Builds data/gpt2_prefix_table.bin: upstream record 88's prefix-token table.

p[v] is the id of the token whose bytes are the longest proper prefix of token v's bytes that is
itself a token, or -1 where none is (the 256 single bytes, <|endoftext|> = 50256 and the padding
ids 50257..50303 of the 50304-row embedding). Upstream: build_prefix_table in train_gpt.py
(modded-nanogpt 75d6867a), from tiktoken's gpt2 mergeable ranks; we read the same vocabulary from
GPT-2's encoder.json (its keys are bytes_to_unicode strings) so no tiktoken is needed. Upstream walks
the sorted byte strings with a stack; here each token probes its prefixes directly, longest first,
a second formulation of the same definition.

Output: 50304 int32 little-endian. The sha256 and spot values below are checked before writing;
FNV-1a 64 of the file is printed for data/prefix_table.h, which checks it (no sha256 in C++).
Standard-library Python only.
"""
import argparse
import hashlib
import json
import os
import struct
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB_ROWS = 50304  # the model's padded vocabulary (next multiple of 128 above 50257)
SPECIAL = "<|endoftext|>"  # a special token, not a mergeable rank: it has no byte string
EXPECTED_SHA256 = "36281293860d09f2307c3d2cd503f2e595e24c165fbd49b11f89cfaed71b617c"
EXPECTED_VALID = 50000
# " the" -> " th", " and" -> " an", "the" -> "th", " gazed" -> " gaze", "," has none
SPOT = {262: 294, 290: 281, 1169: 400, 50255: 17841, 11: -1}


def bytes_to_unicode():
    """GPT-2's byte -> printable character map (encoder.py), inverted by token_bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    bs += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def token_bytes(vocab_dir):
    """id -> bytes for every mergeable token of encoder.json."""
    with open(os.path.join(vocab_dir, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    return {tid: bytes(to_byte[c] for c in s) for s, tid in encoder.items() if s != SPECIAL}


def build_table(id_to_bytes):
    by_bytes = {b: tid for tid, b in id_to_bytes.items()}
    table = [-1] * VOCAB_ROWS
    for tid, b in id_to_bytes.items():
        for n in range(len(b) - 1, 0, -1):
            p = by_bytes.get(b[:n])
            if p is not None:
                table[tid] = p
                break
    return table


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def check(table, blob):
    """The problems with the table, as messages; empty when it matches upstream's."""
    problems = []
    sha = hashlib.sha256(blob).hexdigest()
    if sha != EXPECTED_SHA256:
        problems.append(f"sha256 {sha} differs from the expected {EXPECTED_SHA256}")
    valid = sum(1 for p in table if p >= 0)
    if valid != EXPECTED_VALID:
        problems.append(f"{valid} valid entries, expected {EXPECTED_VALID}")
    for v, want in SPOT.items():
        if table[v] != want:
            problems.append(f"p[{v}] = {table[v]}, expected {want}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default=os.path.join(REPO, "..", "shared", "data", "gpt2"),
                    help="folder with GPT-2's encoder.json (default ../shared/data/gpt2 from the repo root)")
    ap.add_argument("--out", default=os.path.join(REPO, "data", "gpt2_prefix_table.bin"))
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.vocab, "encoder.json")):
        print(f"make_prefix_table: no encoder.json in {args.vocab} (give the GPT-2 vocabulary folder with --vocab)",
              file=sys.stderr)
        return 2
    table = build_table(token_bytes(args.vocab))
    blob = struct.pack(f"<{VOCAB_ROWS}i", *table)
    problems = check(table, blob)
    if problems:
        print(f"make_prefix_table: the table from {args.vocab} is not upstream's:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(blob)} bytes, {EXPECTED_VALID} valid entries, "
          f"sha256 {EXPECTED_SHA256}, fnv1a64 0x{fnv1a64(blob):016x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
