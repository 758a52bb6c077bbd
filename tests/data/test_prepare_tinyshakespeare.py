#!/usr/bin/env python3
"""Tests of data/prepare_tinyshakespeare.py and the committed Tiny Shakespeare shards.

Always: the document splitting rules on a small text and on the real one (nothing lost, the
documented counts), the committed shards' format and document counts, argument errors.
With tiktoken installed: the offline GPT-2 encoding gives the known ids, and regenerating the
shards from the local text and tokenizer files reproduces the committed ones byte for byte.
The local copies come from $SHARED_DATA (tinyshakespeare/input.txt, gpt2/vocab.bpe,
gpt2/encoder.json); parts that need them are reported as skipped when they are absent.
"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
SHARED = os.environ.get("SHARED_DATA") or os.path.join(REPO, "..", "shared", "data")
SCRIPT = os.path.join(REPO, "data", "prepare_tinyshakespeare.py")
SHARDS = os.path.join(REPO, "data", "tinyshakespeare")
INPUT = os.path.join(SHARED, "tinyshakespeare", "input.txt")
VOCAB = os.path.join(SHARED, "gpt2", "vocab.bpe")
ENCODER = os.path.join(SHARED, "gpt2", "encoder.json")
BOS = 50256

sys.path.insert(0, os.path.dirname(SCRIPT))
import prepare_tinyshakespeare as prep  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack("<3i", data[:12])
    check(magic == 20240520 and version == 1 and len(data) == 1024 + 2 * count and not any(data[12:1024]),
          f"{path}: bad header or size")
    return list(struct.unpack(f"<{count}H", data[1024:]))


def run(args):
    p = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_rules():
    # Play one: A and B talk; then C and D enter (neither spoke in the last 6 speeches): a new
    # document. A double blank line starts a new play even though A speaks on.
    text = ("A:\nhello\n\nB:\nhi\n\nA:\nbye\n\nC:\nyo\n\nD:\nho\n\nC:\nso\n\n\n"
            "A:\nagain\n\nB:\nand\n")
    sections = prep.split_sections(text)
    check(sections == ["A:\nhello\n\nB:\nhi\n\nA:\nbye\n", "C:\nyo\n\nD:\nho\n\nC:\nso\n", "A:\nagain\n\nB:\nand\n"],
          f"split rules: {sections}")
    # A single new speaker is not a scene change (the next speaker is a known one).
    check(len(prep.split_sections("A:\na\n\nB:\nb\n\nA:\nc\n\nE:\ne\n\nA:\nd\n")) == 1,
          "one new speaker keeps the document")
    train, val = prep.split_train_val(["x" * 10] * 10, 0.1)
    check(len(train) == 9 and len(val) == 1, f"90/10 split: {len(train)}/{len(val)}")
    try:
        prep.split_train_val(["x"], 0.5)
        check(False, "a split with an empty side is refused")
    except prep.PrepareError as e:
        check("leaves one split empty" in str(e), "empty split message")


def test_real_text():
    if not os.path.exists(INPUT):
        print(f"skipped: {INPUT} not found")
        return None
    text = open(INPUT, encoding="utf-8").read()
    sections = prep.split_sections(text)
    check(len(sections) == 446, f"{len(sections)} documents, the docstring says 446")
    check(sections[0].startswith("First Citizen:\nBefore we proceed"), "first document")
    check(all(s.endswith("\n") and not s.endswith("\n\n") for s in sections), "documents end with one newline")
    # Nothing is lost: the documents are the text with its blank-line runs made single.
    normalized = re.sub(r"\n(?:[ \t]*\n)+", "\n\n", text.strip("\n")) + "\n"
    check("\n".join(sections) == normalized, "documents rejoined give back the text")
    train, val = prep.split_train_val(sections, 0.1)
    return len(train), len(val)


def test_committed(split_counts):
    train = read_shard(os.path.join(SHARDS, "tinyshakespeare_train_000000.bin"))
    val = read_shard(os.path.join(SHARDS, "tinyshakespeare_val_000000.bin"))
    check(train[0] == BOS and val[0] == BOS, "shards start with a document's BOS")
    check(max(train) < 50257 and max(val) < 50257, "tokens are GPT-2 ids")
    check(250_000 < len(train) < 350_000 and 20_000 < len(val) < 50_000, f"sizes {len(train)}, {len(val)}")
    if split_counts is not None:
        check((train.count(BOS), val.count(BOS)) == split_counts,
              f"documents per shard {(train.count(BOS), val.count(BOS))}, splitting gives {split_counts}")
    # Documents longer than small presets' max_seq_len exist, as the loader tests need.
    starts = [i for i, t in enumerate(train) if t == BOS] + [len(train)]
    lengths = sorted(b - a for a, b in zip(starts, starts[1:]))
    check(lengths[-1] > 2048 and 300 < lengths[len(lengths) // 2] < 600, f"document lengths: median "
          f"{lengths[len(lengths) // 2]}, max {lengths[-1]}")


def test_arguments(have_tiktoken, local):
    rc, _, err = run(["--val-fraction", "1.5"])
    check(rc == 1 and "--val-fraction must be between 0 and 1" in err, f"bad val fraction: {rc} {err!r}")
    if not have_tiktoken:
        rc, _, err = run(["--input", INPUT])
        check(rc == 1 and "tiktoken is not installed (pip install tiktoken)" in err, f"no tiktoken: {rc} {err!r}")
        return
    if not local:
        return
    rc, _, err = run(["--vocab-bpe", VOCAB])
    check(rc == 1 and "--vocab-bpe and --encoder-json go together" in err, f"half the tokenizer: {err!r}")
    rc, _, err = run(["--vocab-bpe", "/nonexistent/vocab.bpe", "--encoder-json", ENCODER])
    check(rc == 1 and "tokenizer file not found: /nonexistent/vocab.bpe" in err, f"missing tokenizer file: {err!r}")
    out = tempfile.mkdtemp(prefix="ts_test_")
    try:
        rc, _, err = run(["--input", "/nonexistent/input.txt", "--vocab-bpe", VOCAB, "--encoder-json", ENCODER,
                          "--out-dir", out])
        check(rc == 1 and "/nonexistent/input.txt" in err and os.listdir(out) == [], f"missing input: {err!r}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_regenerate():
    enc = prep.get_encoding(VOCAB, ENCODER)
    check(enc.encode_ordinary("Hello") == [15496] and enc.encode_ordinary(" world") == [995] and
          enc.encode_ordinary(" the") == [262], "known GPT-2 ids")
    check(enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [BOS], "<|endoftext|> is 50256")
    prep.check_encoding(enc)
    out = tempfile.mkdtemp(prefix="ts_test_")
    try:
        rc, stdout, err = run(["--input", INPUT, "--vocab-bpe", VOCAB, "--encoder-json", ENCODER, "--out-dir", out])
        check(rc == 0, f"regeneration failed: {err!r}")
        names = sorted(os.listdir(out))
        check(names == ["tinyshakespeare_train_000000.bin", "tinyshakespeare_val_000000.bin"], f"outputs: {names}")
        for name in names:
            same = open(os.path.join(out, name), "rb").read() == open(os.path.join(SHARDS, name), "rb").read()
            check(same, f"regenerated {name} differs from the committed one")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    test_rules()
    counts = test_real_text()
    test_committed(counts)
    try:
        import tiktoken  # noqa: F401
        have_tiktoken = True
    except ImportError:
        have_tiktoken = False
    local = all(os.path.exists(p) for p in (INPUT, VOCAB, ENCODER))
    test_arguments(have_tiktoken, local)
    if have_tiktoken and local:
        test_regenerate()
    else:
        print("skipped: regenerating the shards needs tiktoken (pip install tiktoken) and the local GPT-2 files")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
