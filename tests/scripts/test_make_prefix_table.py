#!/usr/bin/env python3
"""scripts/make_prefix_table.py on the shared GPT-2 vocabulary reproduces the committed
data/gpt2_prefix_table.bin byte for byte; with one token removed from the vocabulary it exits
non-zero with a sha256 error and writes nothing."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(os.environ.get("SHARED_DATA") or os.path.join(REPO, "..", "shared", "data"), "gpt2")
SCRIPT = os.path.join(REPO, "scripts", "make_prefix_table.py")
COMMITTED = os.path.join(REPO, "data", "gpt2_prefix_table.bin")


def run(vocab, out):
    return subprocess.run([sys.executable, SCRIPT, "--vocab", vocab, "--out", out], capture_output=True, text=True)


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "table.bin")
        r = run(VOCAB, out)
        if r.returncode != 0:
            failures.append(f"shared vocabulary: exit {r.returncode}: {r.stderr.strip()}")
        else:
            with open(out, "rb") as a, open(COMMITTED, "rb") as b:
                if a.read() != b.read():
                    failures.append(f"{out} differs from the committed {COMMITTED}")

        # " gaze" (17841) removed: " gazed" loses its prefix, so the table changes.
        cut_dir = os.path.join(tmp, "cut")
        os.mkdir(cut_dir)
        with open(os.path.join(VOCAB, "encoder.json"), encoding="utf-8") as f:
            encoder = json.load(f)
        removed = [s for s, i in encoder.items() if i == 17841]
        del encoder[removed[0]]
        with open(os.path.join(cut_dir, "encoder.json"), "w", encoding="utf-8") as f:
            json.dump(encoder, f)
        shutil.copy(os.path.join(VOCAB, "vocab.bpe"), cut_dir)
        cut_out = os.path.join(tmp, "cut.bin")
        r = run(cut_dir, cut_out)
        if r.returncode == 0:
            failures.append("a vocabulary without token 17841 was accepted")
        for want in ("sha256", "p[50255]"):
            if want not in r.stderr:
                failures.append(f"the error for a missing token lacks {want!r}: {r.stderr.strip()}")
        if os.path.exists(cut_out):
            failures.append("a refused table was still written")
    for f in failures:
        print("FAIL: " + f)
    print("test_make_prefix_table: " + ("FAILED" if failures else "ok"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
