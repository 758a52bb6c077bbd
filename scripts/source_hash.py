#!/usr/bin/env python3
"""The source_hash that a trainer built in BUILD_DIR writes in its logs, read without running it.

  scripts/source_hash.py BUILD_DIR

The trainer embeds its sources at build time (cmake/embed_sources.cmake writes them, in order, to
BUILD_DIR/gen/source_bundle.cpp as byte arrays with a table of their paths) and its log's
"source_hash:" line is FNV-1a 64 over them, each as its path, a NUL, its text, a NUL (runtime/log.h,
source_hash()). scripts/run_ab.sh records each arm's hash in its manifest before any run, so
that stats.py can check every log against it. Standard library only.
Exit status: 0 printed; 1 no bundle, or one this script cannot read.
"""
import os
import re
import sys

ARRAY = re.compile(r"static const unsigned char source_(\d+)\[\] = \{([^}]*)\};")
ENTRY = re.compile(r'\{"([^"]+)", reinterpret_cast<const char\*>\(source_(\d+)\)\}')


def fnv1a_64(chunks):
    h = 0xcbf29ce484222325
    for chunk in chunks:
        for byte in chunk:
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def bundle_hash(bundle_path):
    with open(bundle_path, encoding="ascii") as f:
        text = f.read()
    arrays = {int(i): bytes(int(b, 16) for b in body.rstrip(",").split(",")) for i, body in ARRAY.findall(text)}
    entries = ENTRY.findall(text)
    if not entries or any(int(i) not in arrays for _, i in entries):
        raise ValueError("no table of embedded sources, or one naming an array it lacks")
    chunks = []
    for path, i in entries:
        data = arrays[int(i)]
        if not data.endswith(b"\0"):
            raise ValueError(f"the array of {path} does not end with its NUL")
        # The trainer hashes the text up to its first NUL (strlen), then the NUL.
        chunks += [path.encode() + b"\0", data[:data.index(b"\0") + 1]]
    return fnv1a_64(chunks)


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    bundle = os.path.join(argv[0], "gen", "source_bundle.cpp")
    try:
        print(bundle_hash(bundle))
    except OSError as e:
        print(f"source_hash.py: {bundle}: cannot read the embedded sources ({e.strerror}): is {argv[0]} a built "
              "trainer's build folder?", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"source_hash.py: {bundle}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
