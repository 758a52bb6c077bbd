#!/usr/bin/env python3
"""Tokenizes Tiny Shakespeare into the speedrun's shard format, for runs that need no download.

Writes data/tinyshakespeare/tinyshakespeare_train_000000.bin and ..._val_000000.bin: a header of
256 int32 (magic 20240520, version 1, token count) and then uint16 GPT-2 tokens, every document
preceded by <|endoftext|> (50256), as the FineWeb shards the speedrun trains on are laid out.

What a document ("play section") is. The text is a run of speeches ("NAME:" then its lines)
separated by blank lines, several plays concatenated, with no act or scene headings; in two
places a double blank line marks where one play ends and the next begins. A document is a run
of consecutive speeches, and a new one starts
  - at a play boundary (a double blank line), or
  - where the cast changes: neither the speaker of a speech nor the speaker of the speech after
    it has spoken in the previous 6 speeches (our stand-in for a scene change).
A document's text is its speeches joined by a blank line, ending with a newline. This gives
446 documents with a median near 400 tokens (FineWeb's median is about 400), from a few tokens
up to several thousand, so small presets see documents both shorter and longer than
max_seq_len. The first documents holding 90% of the characters are the train split, the rest
the val split (as nanoGPT splits this text 90/10).

The tokenizer is tiktoken's GPT-2 encoding: by default tiktoken.get_encoding("gpt2") (which
downloads its two files once), or offline from local copies with --vocab-bpe and --encoder-json.
Either way the known ids are checked before anything is written. The text comes from --input, or
is downloaded from --url. Outputs are written to a temporary name and renamed, so an
interrupted run leaves no partial shard.

  python3 data/prepare_tinyshakespeare.py                       # online
  python3 data/prepare_tinyshakespeare.py --input input.txt \\
      --vocab-bpe gpt2/vocab.bpe --encoder-json gpt2/encoder.json   # offline
"""
import argparse
import os
import re
import struct
import sys
import urllib.request
from array import array

DEFAULT_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
BOS = 50256
MAGIC, VERSION = 20240520, 1
CAST_WINDOW = 6
# sha256 of OpenAI's published GPT-2 files: local copies must be those same files.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenization regex (from its original encoder).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
KNOWN_IDS = [("Hello", [15496]), (" world", [995]), (" the", [262])]


class PrepareError(Exception):
    pass


def split_sections(text):
    """The documents of the text, as described in the module docstring."""
    text = text.replace("\r\n", "\n").strip("\n")
    # Separators keep their newlines so a play boundary (two or more blank lines) stays visible.
    pieces = re.split(r"(\n(?:[ \t]*\n)+)", text)
    speeches, play_start = [], []
    new_play = True
    for k, piece in enumerate(pieces):
        if k % 2 == 1:
            if piece.count("\n") >= 3:
                new_play = True
            continue
        if piece.strip():
            speeches.append(piece)
            play_start.append(new_play)
            new_play = False
    speakers = [s.split("\n", 1)[0] for s in speeches]
    sections, current = [], []
    for i, speech in enumerate(speeches):
        if current:
            recent = set(speakers[max(0, i - CAST_WINDOW):i])
            cast_change = i + 1 < len(speeches) and speakers[i] not in recent and speakers[i + 1] not in recent
            if play_start[i] or cast_change:
                sections.append(current)
                current = []
        current.append(speech)
    if current:
        sections.append(current)
    return ["\n\n".join(s) + "\n" for s in sections]


def split_train_val(sections, val_fraction):
    """The leading sections that hold (1 - val_fraction) of the characters, and the rest."""
    total = sum(len(s) for s in sections)
    seen, cut = 0, len(sections)
    for i, s in enumerate(sections):
        if seen >= (1.0 - val_fraction) * total:
            cut = i
            break
        seen += len(s)
    if cut == 0 or cut == len(sections):
        raise PrepareError(f"val fraction {val_fraction} leaves one split empty")
    return sections[:cut], sections[cut:]


def get_encoding(vocab_bpe, encoder_json):
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise PrepareError("tiktoken is not installed (pip install tiktoken)")
    if vocab_bpe is None and encoder_json is None:
        return tiktoken.get_encoding("gpt2")
    if vocab_bpe is None or encoder_json is None:
        raise PrepareError("--vocab-bpe and --encoder-json go together")
    for path in (vocab_bpe, encoder_json):
        if not os.path.isfile(path):
            raise PrepareError(f"tokenizer file not found: {path}")
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        os.path.abspath(vocab_bpe), os.path.abspath(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2-local", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": BOS}, explicit_n_vocab=50257)


def check_encoding(enc):
    for text, ids in KNOWN_IDS:
        got = enc.encode_ordinary(text)
        if got != ids:
            raise PrepareError(f"tokenizer maps {text!r} to {got}, GPT-2 gives {ids}")
    got = enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"})
    if got != [BOS]:
        raise PrepareError(f"tokenizer maps <|endoftext|> to {got}, GPT-2 gives [{BOS}]")


def tokenize(enc, sections):
    """The shard's tokens and each document's length in tokens (its BOS included)."""
    tokens, lengths = array("H"), []
    for doc in sections:
        ids = enc.encode_ordinary(doc)
        tokens.append(BOS)
        tokens.extend(ids)
        lengths.append(len(ids) + 1)
    return tokens, lengths


def write_shard(path, tokens):
    header = struct.pack("<256i", MAGIC, VERSION, len(tokens), *([0] * 253))
    body = array("H", tokens)
    if sys.byteorder != "little":
        body.byteswap()
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(body.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_text(input_path, url):
    if input_path is not None:
        with open(input_path, encoding="utf-8") as f:
            return f.read()
    print(f"downloading {url}")
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode("utf-8")


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="the Tiny Shakespeare text (default: download from --url)")
    p.add_argument("--url", default=DEFAULT_URL, help="where to download the text from")
    p.add_argument("--vocab-bpe", help="local GPT-2 vocab.bpe (offline; with --encoder-json)")
    p.add_argument("--encoder-json", help="local GPT-2 encoder.json (offline; with --vocab-bpe)")
    p.add_argument("--out-dir", default=os.path.join(here, "tinyshakespeare"), help="where the shards go")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the text for validation")
    args = p.parse_args(argv)
    try:
        if not 0.0 < args.val_fraction < 1.0:
            raise PrepareError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
        enc = get_encoding(args.vocab_bpe, args.encoder_json)
        check_encoding(enc)
        text = read_text(args.input, args.url)
        sections = split_sections(text)
        train, val = split_train_val(sections, args.val_fraction)
        os.makedirs(args.out_dir, exist_ok=True)
        for name, docs in (("train", train), ("val", val)):
            tokens, lengths = tokenize(enc, docs)
            lengths.sort()
            path = os.path.join(args.out_dir, f"tinyshakespeare_{name}_000000.bin")
            write_shard(path, tokens)
            print(f"{path}: {len(tokens)} tokens, {len(docs)} documents "
                  f"(tokens per document: min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]})")
    except (PrepareError, OSError, ValueError) as e:
        print(f"prepare_tinyshakespeare: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
