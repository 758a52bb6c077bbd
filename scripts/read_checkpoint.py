#!/usr/bin/env python3
"""Lists and loads the trainer's checkpoint files (the safetensors layout runtime/checkpoint_format.h writes).

    python3 scripts/read_checkpoint.py FILE [--values K]

prints each tensor's name, dtype, shape and size in bytes (in data order), then the metadata;
--values K adds each tensor's first K elements. As a module (standard library only; numpy is used
by to_numpy() alone):

    meta, tensors = read_checkpoint.load(path)   # meta: {key: value}; tensors: {name: (dtype, shape, raw bytes)}
    meta, infos = read_checkpoint.read_header(path)  # without reading tensor data
    read_checkpoint.values(dtype, raw)           # the elements as a flat list of Python numbers
    read_checkpoint.to_numpy(dtype, shape, raw)  # a numpy array (BF16 widened to float32)

The file is validated as strictly as the C++ reader does: header length, JSON (objects, arrays,
strings, non-negative integers; no duplicate keys), known dtypes, sizes matching shapes, tensors
tiling the data section. Any problem raises CheckpointError naming the file.
"""
import json
import os
import struct
import sys

# dtype name -> (bytes per element, struct format of one element)
DTYPES = {"BF16": (2, "H"), "F32": (4, "f"), "U16": (2, "H"), "I32": (4, "i"), "I64": (8, "q"), "U8": (1, "B")}
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A file that is not a valid checkpoint; the message names the file and the problem."""


def _strict_json(text, path):
    def no_duplicates(pairs):
        obj = {}
        for key, value in pairs:
            if key in obj:
                raise CheckpointError(f"checkpoint {path}: bad header JSON: duplicate member {json.dumps(key)}")
            obj[key] = value
        return obj

    def refuse(kind):
        def hook(token):
            raise CheckpointError(f"checkpoint {path}: bad header JSON: {kind} {token} (only non-negative integers)")
        return hook

    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_float=refuse("number"),
                          parse_constant=refuse("constant"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: bad header JSON at byte {e.pos} of the header: {e.msg}") from None


def _is_count(v):
    return type(v) is int and v >= 0  # bool is an int subclass: excluded by the exact type test


def read_header(path):
    """(meta, infos): metadata {key: value} and {name: {"dtype", "shape", "offset", "bytes"}} in data
    order, with offset the tensor's position in the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"checkpoint {path} is {size} bytes, too short for its 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"checkpoint {path} declares a {n}-byte header, beyond the end of the {size}-byte file")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"checkpoint {path} declares a {n}-byte header, more than the {MAX_HEADER_BYTES}-byte limit")
        if n % 8:
            raise CheckpointError(f"checkpoint {path} declares a {n}-byte header, not a multiple of 8")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: bad header JSON: invalid UTF-8 at byte {e.start} of the header") from None
    header = _strict_json(text, path)
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {path}: bad header JSON: the header is not a JSON object")

    def bad(what):
        raise CheckpointError(f"checkpoint {path}: {what}")

    meta, found = {}, []
    for name, v in header.items():
        q = json.dumps(name, ensure_ascii=False)
        if name == "__metadata__":
            if not isinstance(v, dict):
                bad('"__metadata__" is not an object')
            for key, value in v.items():
                if not isinstance(value, str):
                    bad(f"metadata value of {json.dumps(key)} is not a string")
            meta = dict(v)
            continue
        if not isinstance(v, dict):
            bad(f"tensor {q} is not an object")
        if set(v) != {"dtype", "shape", "data_offsets"}:
            bad(f"tensor {q} has fields {sorted(v)}, want dtype, shape, data_offsets")
        dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            bad(f"tensor {q} has unknown dtype {json.dumps(dtype)} (known: {' '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(d) and d < 2**63 for d in shape):
            bad(f"tensor {q}: shape {shape!r} is not a list of dimensions")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            bad(f"tensor {q}: data_offsets {offsets!r} is not a pair of integers [begin, end]")
        begin, end = offsets
        if end < begin:
            bad(f"tensor {q}: data_offsets [{begin}, {end}] end before they begin")
        want = DTYPES[dtype][0]
        for d in shape:
            want *= d
        if want != end - begin:
            bad(f"tensor {q} is {dtype} {shape} ({want} bytes) but its data_offsets [{begin}, {end}] span {end - begin} bytes")
        found.append((begin, end, name, dtype, tuple(shape)))
    found.sort(key=lambda t: (t[0], t[1]))
    at, prev, infos = 0, None, {}
    for begin, end, name, dtype, shape in found:
        if begin != at:
            if prev is None:
                bad(f"the first tensor's data, {json.dumps(name)} at [{begin}, {end}], does not begin at 0")
            bad(f"tensor {json.dumps(name)} at data_offsets [{begin}, {end}] "
                f"{'overlaps' if begin < at else 'leaves a gap after'} tensor {json.dumps(prev)}, which ends at {at}")
        infos[name] = {"dtype": dtype, "shape": shape, "offset": 8 + n + begin, "bytes": end - begin}
        at, prev = end, name
    have = size - 8 - n
    if have < at:
        bad(f"the file is truncated: its header describes {at} bytes of tensor data, but only {have} follow the header")
    if have > at:
        bad(f"the file has {have} bytes after the header, more than the {at} bytes of tensor data its header describes")
    return meta, infos


def load(path):
    """(meta, tensors): metadata {key: value} and {name: (dtype, shape tuple, raw little-endian bytes)}."""
    meta, infos = read_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for name, info in infos.items():
            f.seek(info["offset"])
            raw = f.read(info["bytes"])
            if len(raw) != info["bytes"]:
                raise CheckpointError(f"checkpoint {path} shrank while tensor {json.dumps(name)} was read")
            tensors[name] = (info["dtype"], info["shape"], raw)
    return meta, tensors


def values(dtype, raw):
    """The elements of raw bytes of dtype as a flat list of Python numbers (BF16 as exact floats)."""
    size, fmt = DTYPES[dtype]
    count = len(raw) // size
    items = struct.unpack(f"<{count}{fmt}", raw)
    if dtype == "BF16":  # a bf16 is the top half of a float32
        return list(struct.unpack(f"<{count}f", struct.pack(f"<{count}I", *(b << 16 for b in items))))
    return list(items)


def to_numpy(dtype, shape, raw):
    """A numpy array of the tensor; BF16 (which numpy lacks) is widened exactly to float32."""
    import numpy as np
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    kinds = {"F32": "<f4", "U16": "<u2", "I32": "<i4", "I64": "<i8", "U8": "u1"}
    return np.frombuffer(raw, dtype=kinds[dtype]).reshape(shape).copy()


def listing(path, show=0):
    """The text the command prints."""
    meta, infos = read_header(path)
    total = sum(i["bytes"] for i in infos.values())
    lines = [f"{path}: {len(infos)} tensors, {total} bytes of tensor data, {len(meta)} metadata keys"]
    width = max([len(n) for n in infos] + [4])
    lines.append(f"  {'name':<{width}}  dtype  {'shape':<16} bytes")
    with open(path, "rb") as f:
        for name, info in infos.items():
            shape = "[" + ", ".join(str(d) for d in info["shape"]) + "]"
            line = f"  {name:<{width}}  {info['dtype']:<5}  {shape:<16} {info['bytes']}"
            if show > 0:
                size = DTYPES[info["dtype"]][0]
                f.seek(info["offset"])
                head = values(info["dtype"], f.read(min(info["bytes"], show * size)))
                more = " ..." if info["bytes"] > show * size else ""
                line += "  [" + ", ".join(repr(x) for x in head) + more + "]"
            lines.append(line)
    lines.append("metadata:")
    for key, value in meta.items():
        lines.append(f"  {key} = {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines)


def main(argv):
    args, show = list(argv), 0
    if "--values" in args:
        i = args.index("--values")
        try:
            show = int(args[i + 1])
        except (IndexError, ValueError):
            print("read_checkpoint.py: --values needs a count", file=sys.stderr)
            return 2
        del args[i:i + 2]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: read_checkpoint.py FILE [--values K]", file=sys.stderr)
        return 2
    try:
        print(listing(args[0], show))
    except (CheckpointError, OSError) as e:
        print(f"read_checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
