#!/usr/bin/env python3
"""Tests of scripts/read_checkpoint.py, and of the C++ checkpoint format against it.

    test_read_checkpoint.py [PATH_TO_test_data_checkpoint]

Always: files built here byte by byte load with the values they were given, the command's listing,
broken files refused with the right message. With the C++ test program (its --write-sample and
--list modes): the C++ writer's sample file has the layout and the values written out below, and
the C++ reader reads files built here (members in other orders, every escape) and refuses the same
broken files. With the `safetensors` package installed, it loads the C++ sample too; with numpy,
to_numpy() is checked.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "scripts", "read_checkpoint.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import read_checkpoint as rc  # noqa: E402

sys.path.insert(0, HERE)
from checks import check, finish  # noqa: E402


def build(path, header_text, data=b"", pad=True, length=None):
    """A checkpoint made by hand: length field, header (space-padded to a multiple of 8), data."""
    h = header_text.encode("utf-8")
    if pad:
        h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)


def run(args):
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def bf16(x):
    """The bf16 bits of a float that bf16 holds exactly."""
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


# The C++ sample (test_data_checkpoint --write-sample), in the order it adds the tensors.
SAMPLE_META = {"step": "1234", "note": "quote \" backslash \\ newline \n tab \t bell \x07 e-acute \u00e9 emoji \U0001F600",
               "empty": ""}
SAMPLE = [
    ("wte.weight", "BF16", (3, 4), [(i - 5) * 0.25 for i in range(12)]),
    ("scalars", "F32", (5,), [0.5, -1.0, 3.25, 1024.0, -0.125]),
    ("step", "I64", (), [1234]),
    ("tokens", "U16", (6,), [0, 1, 50256, 65535, 7, 300]),
    ("counts", "I32", (2, 2), [-1, 2, -2**31, 2**31 - 1]),
    ("empty", "F32", (0, 3), []),
    ("bytes", "U8", (5,), [0, 1, 127, 128, 255]),
    ("rng state/\u00fc", "U8", (), [42]),
]


def test_handmade(tmp):
    # Members in an unusual order and spacing, a tensor listed before the one that precedes it in
    # the data, metadata last.
    path = os.path.join(tmp, "hand.safetensors")
    data = struct.pack("<3f", 1.0, -2.5, 0.125) + struct.pack("<2H", bf16(-3.0), bf16(0.5)) + bytes([9, 8])
    header = ('{ "b" : {"shape": [2], "data_offsets": [12, 16], "dtype": "BF16"},\n'
              ' "a": {"dtype": "F32", "data_offsets": [0, 12], "shape": [3]},'
              ' "e": {"dtype": "I64", "shape": [4, 0], "data_offsets": [16, 16]},'
              ' "c\\u00e9\\/": {"dtype": "U8", "shape": [1, 2], "data_offsets": [16, 18]},'
              ' "__metadata__": {"origin": "hand \\"made\\"\\n", "step": "7"}}')
    build(path, header, data)
    meta, tensors = rc.load(path)
    check(meta == {"origin": 'hand "made"\n', "step": "7"}, f"handmade meta: {meta}")
    check(list(tensors) == ["a", "b", "e", "c\u00e9/"], f"handmade: data order {list(tensors)}")
    check(tensors["a"] == ("F32", (3,), data[:12]) and rc.values("F32", tensors["a"][2]) == [1.0, -2.5, 0.125],
          f"handmade a: {tensors['a']}")
    check(tensors["b"][:2] == ("BF16", (2,)) and rc.values("BF16", tensors["b"][2]) == [-3.0, 0.5], "handmade b")
    check(tensors["e"] == ("I64", (4, 0), b""), "handmade empty tensor")
    check(tensors["c\u00e9/"] == ("U8", (1, 2), bytes([9, 8])), "handmade escaped name")
    _, infos = rc.read_header(path)
    n = struct.unpack("<Q", open(path, "rb").read(8))[0]
    check(infos["b"]["offset"] == 8 + n + 12 and infos["b"]["bytes"] == 4, f"handmade offsets: {infos['b']}")

    code, out, err = run([sys.executable, SCRIPT, path, "--values", "2"])
    lines = out.splitlines()
    check(code == 0 and not err and lines[0] == f"{path}: 4 tensors, 18 bytes of tensor data, 2 metadata keys",
          f"listing head: {code} {err} {lines[:1]}")
    check(len(lines) == 9 and lines[2].split() == ["a", "F32", "[3]", "12", "[1.0,", "-2.5", "...]"] and
          lines[3].split() == ["b", "BF16", "[2]", "4", "[-3.0,", "0.5]"] and
          lines[4].split() == ["e", "I64", "[4,", "0]", "0", "[]"] and lines[6] == "metadata:" and
          lines[7] == '  origin = "hand \\"made\\"\\n"' and lines[8] == '  step = "7"', "listing:\n" + out)
    code, out2, _ = run([sys.executable, SCRIPT, path])
    check(code == 0 and out2.splitlines()[2].split() == ["a", "F32", "[3]", "12"], "listing without values:\n" + out2)
    return path


def test_broken(tmp, tool):
    # Each broken file: load() raises naming the file and the problem; the command exits 1 with
    # it; the C++ reader (when given) refuses it too.
    path = os.path.join(tmp, "broken.safetensors")
    good = '{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'
    # (how to make it, the message's words, where the C++ reader words it otherwise: its words)
    cases = [
        (lambda: open(path, "wb").write(b"abc"), "too short for its 8-byte header length", None),
        (lambda: build(path, good, b"1234", length=4096), "declares a 4096-byte header, beyond the end", None),
        (lambda: build(path, good, b"1234", pad=False, length=len(good)), "not a multiple of 8", None),
        (lambda: build(path, good, b"123"), "truncated: its header describes 4 bytes of tensor data, but only 3", None),
        (lambda: build(path, good, b"12345"), "5 bytes after the header, more than the 4", None),
        (lambda: build(path, '{"t":1,}', b""), "bad header JSON at byte 7 of the header", None),
        (lambda: build(path, '{"a":1,"a":2}', b""), 'duplicate member "a"', None),
        (lambda: build(path, '{"t":{"dtype":"U8","shape":[1.5],"data_offsets":[0,4]}}', b"1234"),
         "bad header JSON: number 1.5", "only integers are allowed"),
        (lambda: build(path, '{"t":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}}', b"1234"),
         'tensor "t": shape [-4] is not a list of dimensions', "negative numbers are not allowed"),
        (lambda: build(path, '{"t":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}', b"1234"), 'unknown dtype "F16"', None),
        (lambda: build(path, '{"t":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}}', b"1234"),
         'is BF16 [3] (6 bytes) but its data_offsets [0, 4] span 4 bytes', None),
        (lambda: build(path, '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                             '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"1234"),
         'tensor "b" at data_offsets [1, 3] overlaps tensor "a", which ends at 2', None),
        (lambda: build(path, '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                             '"b":{"dtype":"U8","shape":[1],"data_offsets":[3,4]}}', b"1234"),
         'tensor "b" at data_offsets [3, 4] leaves a gap after tensor "a", which ends at 2', None),
        (lambda: build(path, '{"__metadata__":{"step":3}}', b""), 'metadata value of "step" is not a string', None),
    ]
    for make, message, cpp_message in cases:
        make()
        try:
            rc.load(path)
            check(False, f"load() accepted a broken file ({message})")
        except rc.CheckpointError as e:
            check(path in str(e) and message in str(e), f"load(): message {e} lacks {message!r}")
        code, out, err = run([sys.executable, SCRIPT, path])
        check(code == 1 and not out and err.startswith("read_checkpoint.py: error: checkpoint ") and message in err,
              f"command on a broken file ({message}): {code} {out!r} {err!r}")
        if tool:
            code, out, err = run([tool, "--list", path])
            want = cpp_message or message
            check(code == 1 and want in err and path in err, f"C++ reader on a broken file: {code} {err!r}, want {want!r}")

    code, _, err = run([sys.executable, SCRIPT, os.path.join(tmp, "missing")])
    check(code == 1 and "No such file" in err, f"command on a missing file: {code} {err!r}")
    code, _, err = run([sys.executable, SCRIPT])
    check(code == 2 and err.startswith("usage:"), f"command without a file: {code} {err!r}")
    code, _, err = run([sys.executable, SCRIPT, path, "--values"])
    check(code == 2 and "--values needs a count" in err, f"--values without a count: {code} {err!r}")


def test_cpp_sample(tmp, tool):
    path = os.path.join(tmp, "sample.safetensors")
    code, out, err = run([tool, "--write-sample", path])
    check(code == 0, f"--write-sample failed: {code} {err}")
    if code != 0:
        return
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].decode("utf-8")
    body = header.rstrip(" ")
    check(n % 8 == 0 and len(header) - len(body) < 8 and body.startswith('{"__metadata__":{"step":"1234",'),
          f"sample header layout: {n} bytes, {header!r}")
    parsed = json.loads(body)
    check(list(parsed) == ["__metadata__"] + [t[0] for t in SAMPLE], f"sample header member order: {list(parsed)}")
    at = 0
    for name, dtype, shape, vals in SAMPLE:
        size = rc.DTYPES[dtype][0] * len(vals)
        check(parsed[name] == {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]},
              f"sample header entry {name}: {parsed[name]}")
        at += size
    check(len(raw) == 8 + n + at, f"sample size {len(raw)}, want {8 + n + at}")

    meta, tensors = rc.load(path)
    check(meta == SAMPLE_META, f"sample meta: {meta}")
    check(list(tensors) == [t[0] for t in SAMPLE], f"sample names: {list(tensors)}")
    for name, dtype, shape, vals in SAMPLE:
        got = tensors.get(name)
        check(got is not None and got[:2] == (dtype, shape) and rc.values(dtype, got[2]) == vals,
              f"sample tensor {name}: {got and (got[0], got[1], rc.values(got[0], got[2]))}")

    code, out, err = run([sys.executable, SCRIPT, path, "--values", "3"])
    lines = out.splitlines()
    check(code == 0 and lines[0].endswith(": 8 tensors, 86 bytes of tensor data, 3 metadata keys") and
          lines[2].split() == ["wte.weight", "BF16", "[3,", "4]", "24", "[-1.25,", "-1.0,", "-0.75", "...]"] and
          lines[5].split() == ["tokens", "U16", "[6]", "12", "[0,", "1,", "50256", "...]"] and
          lines[-2] == '  note = "quote \\" backslash \\\\ newline \\n tab \\t bell \\u0007 e-acute \u00e9 emoji \U0001F600"',
          "sample listing:\n" + out)

    # The C++ reader's view of the same file.
    code, out, err = run([tool, "--list", path])
    rows = [json.loads(line) for line in out.splitlines()] if code == 0 else []
    want = []
    for name, dtype, shape, vals in SAMPLE:
        d, t = tensors[name][2], rc.read_header(path)[1][name]
        want.append(["tensor", name, dtype, list(shape), t["offset"], len(d), d.hex()])
    want += [["meta", k, v] for k, v in SAMPLE_META.items()]
    check(code == 0 and rows == want, f"C++ --list of the sample: {code} {err}\n{rows}\nwant {want}")

    try:
        import safetensors
    except ImportError:
        print("skipped: the safetensors package is not installed (the sample's reading by it)")
    else:
        loaded = {name: (info["dtype"], tuple(info["shape"]), bytes(info["data"]))
                  for name, info in safetensors.deserialize(raw)}
        check(loaded == tensors, f"safetensors.deserialize differs: {loaded}")
    try:
        import numpy as np
    except ImportError:
        print("skipped: numpy is not installed (to_numpy)")
    else:
        for name, dtype, shape, vals in SAMPLE:
            a = rc.to_numpy(*tensors[name])
            check(a.shape == shape and a.reshape(-1).tolist() == vals, f"to_numpy {name}: {a}")
        check(rc.to_numpy(*tensors["wte.weight"]).dtype == np.float32, "to_numpy widens BF16 to float32")


def test_cpp_reads_handmade(path, tool):
    code, out, err = run([tool, "--list", path])
    rows = [json.loads(line) for line in out.splitlines()] if code == 0 else []
    meta, tensors = rc.load(path)
    _, infos = rc.read_header(path)
    want = [["tensor", name, t[0], list(t[1]), infos[name]["offset"], len(t[2]), t[2].hex()] for name, t in tensors.items()]
    want += [["meta", "step", "7"], ["meta", "origin", meta["origin"]]]
    check(code == 0 and rows == want, f"C++ --list of the handmade file: {code} {err}\n{rows}\nwant {want}")


def main():
    tool = sys.argv[1] if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        hand = test_handmade(tmp)
        test_broken(tmp, tool)
        if tool:
            test_cpp_sample(tmp, tool)
            test_cpp_reads_handmade(hand, tool)
        else:
            print("skipped: no test_data_checkpoint program given (the C++ cross-checks)")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
