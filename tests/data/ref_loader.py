#!/usr/bin/env python3
"""Independent reference for the C++ loaders (data/loader.h) and dump_batches (data/dump.h).

It follows the reference record's Python data path step by step -- a generator that is driven
with .send() like the training loop drives it, a Shard whose next_batch raises StopIteration
when the BOS index runs out, torch's int32 wrap-around and floor remainder for the bigram hash --
using only the standard library (no torch, no numpy), and prints the same text as dump_batches
so the two can be compared byte for byte. Deliberately structured like upstream, not like the
C++ code, so that a shared misreading is less likely.

  ref_loader.py --files GLOB --batches N [--world-size W] [--grad-accum G] [--batch-tokens T]
                [--max-seq-len L] [--bigram-vocab V] [--change S:T[:L]]... [--val]
"""
import argparse
import glob
import os
import struct
import sys
import zlib
from array import array

BOS = 50256
MAGIC, VERSION = 20240520, 1


class LoaderError(Exception):
    pass


def load_shard(path):
    with open(path, "rb") as f:
        header = f.read(256 * 4)
        magic, version, count = struct.unpack("<3i", header[:12])
        assert magic == MAGIC and version == VERSION, path
        tokens = array("H")
        tokens.frombytes(f.read())
    assert len(tokens) == count, path
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def shard_token_count(path):
    with open(path, "rb") as f:
        return struct.unpack("<3i", f.read(12))[2]


def next_multiple_of_n(v, n):
    # upstream: next(x for x in range(n, int(v) + 1 + n, n) if x >= v)
    x = n
    while x < v:
        x += n
    return x


def to_int32(v):
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def bigram_hash(inputs, bigram_vocab):
    """out = x.clone(); out[0] = mod; out[1:] = (36313*out[1:] ^ 27191*out[:-1]) % mod, in int32."""
    mod = bigram_vocab - 1
    out = list(inputs)
    out[0] = mod
    shifted = out[:-1]  # the right-hand side reads out[:-1] after out[0] was replaced
    rest = []
    for cur, prev in zip(out[1:], shifted):
        x = to_int32(to_int32(36313 * cur) ^ to_int32(27191 * prev))
        rest.append(x % mod)  # Python's % is a floor remainder, like torch.remainder
    out[1:] = rest
    return out


class Shard:
    def __init__(self, tokens, world_size):
        self.tokens = tokens
        self.size = len(tokens)
        self.world_size = world_size
        self.i = 0
        self.bos_idx = [k for k, t in enumerate(tokens) if t == BOS]

    def next_batch(self, num_tokens_local, max_seq_len):
        n = len(self.bos_idx)
        starts = [[] for _ in range(self.world_size)]
        ends = [[] for _ in range(self.world_size)]
        idx = self.i
        for r in range(self.world_size):
            cur_len = 0
            while cur_len <= num_tokens_local:
                if idx >= n:
                    raise StopIteration("hit tail of shard")
                cur = self.bos_idx[idx]
                starts[r].append(cur)
                end = min(self.bos_idx[idx + 1] if idx + 1 < n else self.size,
                          cur + max_seq_len,
                          cur + num_tokens_local - cur_len + 1)
                ends[r].append(end)
                cur_len += end - cur
                idx += 1
            assert cur_len == num_tokens_local + 1
        self.i = idx
        return starts, ends


def generator(files, rank, world_size, num_tokens, max_seq_len, grad_accum, align_to_bos, bigram_vocab,
              max_num_docs=None):
    """Yields (batch dict) like upstream's distributed_data_generator; accepts .send((T, L, G)).
    max_num_docs: tokens per rank -> cu_seqlens entries (record 80's TRAIN_MAX_NUM_DOCS rule);
    None: the reference record's next_multiple_of_n(tokens // 300, 128)."""
    assert num_tokens % (world_size * grad_accum) == 0
    num_tokens //= grad_accum
    file_iter = iter(range(len(files)))
    file_no = next(file_iter)
    tokens = load_shard(files[file_no])
    if align_to_bos:
        shard = Shard(tokens, world_size)
        next_no = next(file_iter, None)  # upstream requires a second file here; we allow one
    else:
        pos = 0
    while True:
        num_tokens_local = num_tokens // world_size
        entries = (next_multiple_of_n(num_tokens_local // 300, 128) if max_num_docs is None
                   else max_num_docs(num_tokens_local))
        if align_to_bos:
            try:
                seq_starts, seq_ends = shard.next_batch(num_tokens_local, max_seq_len)
            except StopIteration:
                if next_no is None:
                    raise LoaderError("training data exhausted")
                file_no = next_no
                shard = Shard(load_shard(files[file_no]), world_size)
                tokens = shard.tokens
                next_no = next(file_iter, None)
                continue
            start_idxs, end_idxs = list(seq_starts[rank]), list(seq_ends[rank])
            buf = []
            for i, j in zip(start_idxs, end_idxs):
                buf.extend(tokens[i:j])
            inputs, targets = buf[:-1], buf[1:]
            shown_ends = list(end_idxs)
            end_idxs[-1] -= 1
            cum, acc = [], 0
            for i, j in zip(start_idxs, end_idxs):
                acc += j - i
                cum.append(acc)
            shown_starts = start_idxs
        else:
            if pos + num_tokens + 1 >= len(tokens):
                file_no = next(file_iter, None)
                if file_no is None:
                    raise LoaderError("validation data exhausted")
                tokens, pos = load_shard(files[file_no]), 0
            pos_local = pos + rank * num_tokens_local
            buf = tokens[pos_local:pos_local + num_tokens_local + 1]
            if len(buf) != num_tokens_local + 1:  # upstream fails in .view() here
                raise LoaderError("validation shard too small for a micro-step")
            inputs, targets = list(buf[:-1]), list(buf[1:])
            cum = [k for k, t in enumerate(inputs) if t == BOS]
            shown_starts, shown_ends = [pos_local], [pos_local + num_tokens_local + 1]
            pos += num_tokens
        if len(cum) + 1 > entries:
            raise LoaderError(f"too many documents for cu_seqlens: {len(cum)} documents in {num_tokens_local} "
                              f"tokens, {entries} entries")
        cu = [num_tokens_local] * entries
        cu[0] = 0
        cu[1:len(cum) + 1] = cum
        new_params = yield dict(
            shard=file_no, tokens=num_tokens_local, starts=shown_starts, ends=shown_ends,
            cu=cu, cu_len=len(cum) + 1, inputs=inputs, targets=targets,
            bigram=bigram_hash(inputs, bigram_vocab))
        if new_params is not None:
            new_num_tokens, new_max_seq_len, new_grad_accum = new_params
            assert new_num_tokens % (world_size * new_grad_accum) == 0
            num_tokens = new_num_tokens // new_grad_accum
            max_seq_len = new_max_seq_len


def crc(values):
    a = array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return zlib.crc32(a.tobytes()) & 0xFFFFFFFF


def dump(args, out):
    files = sorted(glob.glob(args.files))
    if not files:
        raise LoaderError("no files match " + args.files)
    ga = args.grad_accum if args.grad_accum is not None else 8 // args.world_size
    changes = {}
    for text in args.change:
        parts = [int(p) for p in text.split(":")]
        changes[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else args.max_seq_len)
    if args.val:
        out.write(f"# val batches: world_size={args.world_size} grad_accum={ga} batch_tokens={args.batch_tokens} "
                  f"bigram_vocab={args.bigram_vocab} batches={args.batches}\n")
    else:
        out.write(f"# train batches: world_size={args.world_size} grad_accum={ga} batch_tokens={args.batch_tokens} "
                  f"max_seq_len={args.max_seq_len} bigram_vocab={args.bigram_vocab} batches={args.batches}\n")
    for i, f in enumerate(files):
        out.write(f"# shard {i}: {os.path.basename(f)} {shard_token_count(f)} tokens\n")
    # One generator per rank, each driven exactly like upstream's training loop drives its own.
    gens = [generator(files, r, args.world_size, args.batch_tokens, args.max_seq_len, ga, not args.val,
                      args.bigram_vocab) for r in range(args.world_size)]
    started = False
    for step in range(args.batches):
        send = None
        if step in changes:
            tokens, seq = changes[step]
            send = (tokens, seq, ga)
            out.write(f"# step {step}: batch_tokens={tokens} max_seq_len={seq}\n")
        for micro in range(ga):
            batches = []
            for g in gens:
                batches.append(g.send(send) if started else next(g))
            started = True
            for r, b in enumerate(batches):
                out.write(f"step {step} micro {micro} rank {r}: shard {b['shard']} tokens {b['tokens']}\n")
                out.write("  starts" + "".join(f" {x}" for x in b["starts"]) + "\n")
                out.write("  ends" + "".join(f" {x}" for x in b["ends"]) + "\n")
                cu = b["cu"]
                out.write("  cu_seqlens" + "".join(f" {x}" for x in cu[:b["cu_len"]]) +
                          f" +{len(cu) - b['cu_len']}x{b['tokens']}\n")
                out.write(f"  crc32 inputs {crc(b['inputs']):08x} targets {crc(b['targets']):08x} "
                          f"bigram {crc(b['bigram']):08x} cu_seqlens {crc(cu):08x}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--batch-tokens", type=int, default=8 * 2048 * 8)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--bigram-vocab", type=int, default=50304 * 5)
    p.add_argument("--change", action="append", default=[])
    p.add_argument("--val", action="store_true")
    args = p.parse_args(argv)
    try:
        dump(args, sys.stdout)
    except LoaderError as e:
        sys.stdout.flush()
        print(f"ref_loader: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
