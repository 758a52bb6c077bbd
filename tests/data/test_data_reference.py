#!/usr/bin/env python3
"""Checks that the stored loader fixtures are what the independent Python reference prints.

The C++ test (test_data_loader) compares the C++ loaders with tests/data/fixtures/expected/;
this test closes the loop by re-running tests/data/ref_loader.py on every scenario and
comparing with the same files, and by checking that the hand-made shards are the layouts
make_fixtures.py describes. Standard library only.
"""
import os
import struct
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import make_fixtures  # noqa: E402
import ref_loader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402


def first_difference(got, want):
    g, w = got.split("\n"), want.split("\n")
    for i in range(max(len(g), len(w))):
        a = g[i] if i < len(g) else "<end>"
        b = w[i] if i < len(w) else "<end>"
        if a != b:
            return f"line {i + 1}: got {a!r} want {b!r}"
    return "(identical)"


def main():
    for i, tokens in enumerate(make_fixtures.layouts()):
        path = os.path.join(make_fixtures.FIXTURES, f"handmade_{i:03d}.bin")
        check(list(ref_loader.load_shard(path)) == tokens, f"{path} is not the layout make_fixtures.py describes")

    # The reference's own building blocks against values worked out by hand.
    check(ref_loader.bigram_hash([15496, 995, 262, 50256, 0, 65535, 50256], 251520) ==
          [251519, 91875, 88345, 120810, 8169, 122344, 248039], "reference bigram hash, hand values")
    check([ref_loader.next_multiple_of_n(v, 128) for v in (0, 54, 128, 129)] == [128, 128, 128, 256],
          "reference next_multiple_of_n")
    check(ref_loader.crc([1, 2, -3]) == zlib.crc32(struct.pack("<3i", 1, 2, -3)), "reference crc of little-endian int32s")
    check(zlib.crc32(b"123456789") == 0xCBF43926, "zlib's CRC-32 is the standard one")

    check_max_num_docs_rule()

    scenarios = make_fixtures.read_scenarios()
    check(len(scenarios) >= 10, f"only {len(scenarios)} scenarios")
    for name, expect, argv in scenarios:
        text, rc = make_fixtures.run_reference(argv, REPO)
        with open(os.path.join(make_fixtures.FIXTURES, "expected", name + ".txt")) as f:
            want = f.read()
        check(text == want, f"scenario {name}: reference output differs from the fixture at {first_difference(text, want)}")
        check((rc == 0) == (expect == "ok"), f"scenario {name}: reference exit status {rc}, expected {expect}")
    return finish()


def check_max_num_docs_rule():
    """Record 80's loader rules through ref_loader.generator, values worked out by hand: cu_seqlens has
    the rule's number of entries (padding = tokens per rank), more documents than entries - 1 is an
    error, and documents are cut at the max_seq_len sent with the batch size."""
    import tempfile

    def shard(tmp, name, tokens):
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(struct.pack("<3i", ref_loader.MAGIC, ref_loader.VERSION, len(tokens)) + bytes(1012))
            f.write(struct.pack(f"<{len(tokens)}H", *tokens))
        return [path]

    with tempfile.TemporaryDirectory() as tmp:
        # two-token documents: a 16-token micro-batch (+1 for the targets) takes 9 of them, the 9th
        # contributing its BOS only, so cu_seqlens holds 0, 2, ..., 16, 16 (10 entries), then padding
        short = shard(tmp, "short.bin", [ref_loader.BOS, 7] * 40)
        b = next(ref_loader.generator(short, 0, 1, 8 * 16, 2048, 8, True, 64, max_num_docs=lambda n: 12))
        check(b["cu"] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 16, 16, 16] and b["cu_len"] == 10,
              f"12 cu_seqlens entries by the rule: got {b['cu']}")
        try:
            next(ref_loader.generator(short, 0, 1, 8 * 16, 2048, 8, True, 64, max_num_docs=lambda n: 9))
            check(False, "10 entries in a rule of 9: the loader must stop")
        except ref_loader.LoaderError as e:
            check("9 documents in 16 tokens, 9 entries" in str(e), f"overflow message: {e}")
        # ten-token documents cut at 5 tokens (r80's first-stage rule), then at 2048 after a .send()
        long = shard(tmp, "long.bin", ([ref_loader.BOS] + list(range(100, 109))) * 8)
        gen = ref_loader.generator(long, 0, 1, 8 * 16, 5, 8, True, 64, max_num_docs=lambda n: 12)
        b = next(gen)
        check(b["starts"] == [0, 10, 20, 30] and b["ends"] == [5, 15, 25, 32] and b["cu"][:5] == [0, 5, 10, 15, 16],
              f"documents cut at 5 tokens: starts {b['starts']} ends {b['ends']} cu {b['cu'][:5]}")
        b = gen.send((8 * 16, 2048, 8))
        check(b["starts"] == [40, 50] and b["ends"] == [50, 57] and b["cu"][:3] == [0, 10, 16],
              f"no cut at 2048: starts {b['starts']} ends {b['ends']} cu {b['cu'][:3]}")


if __name__ == "__main__":
    sys.exit(main())
