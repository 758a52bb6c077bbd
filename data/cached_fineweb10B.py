#!/usr/bin/env python3
"""Downloads the GPT-2-tokenized FineWeb10B shards the speedrun trains on.

  python3 data/cached_fineweb10B.py [N]

fetches fineweb_val_000000.bin and the first N training shards, fineweb_train_000001.bin ..
fineweb_train_%06d.bin (training shards are numbered from 1; N defaults to all 103, each 100M
tokens, about 200 MB; upstream's README fetches 9 for a record run), from the Hugging Face dataset
kjj0/fineweb10B-gpt2 into data/fineweb10B/ -- the same files and names as upstream's script.

Safe to run again at any time: a file already present and complete (its shard header agrees
with its size) is skipped; a download goes to NAME.part and is renamed only once complete and
checked, and an interrupted one resumes from the .part file (HTTP Range) on the next attempt
or the next run. Standard library only.

Options:
  --base-url URL   where the files are (default: $FINEWEB_BASE_URL, else Hugging Face);
                   http(s):// or file:// (a mirror or a local copy)
  --out-dir DIR    destination (default: fineweb10B/ next to this script)
  --retries K      attempts per file before giving up (default 5)
  --retry-wait S   pause before the second attempt, doubling after each failure (default 2)
Exit status: 0 all present, 1 a download failed, 2 bad arguments.
"""
import argparse
import http.client
import os
import re
import struct
import sys
import time
import urllib.error
import urllib.request

DEFAULT_BASE_URL = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main"
NUM_TRAIN_SHARDS = 103
HEADER_BYTES = 256 * 4
MAGIC, VERSION = 20240520, 1
CHUNK = 1 << 20


class DownloadError(Exception):
    pass


def shard_names(num_train):
    return ["fineweb_val_%06d.bin" % 0] + ["fineweb_train_%06d.bin" % i for i in range(1, num_train + 1)]


def shard_problem(path):
    """None if path is a whole token shard, else what is wrong with it."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        return f"{size} bytes, shorter than the {HEADER_BYTES}-byte header"
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    if magic != MAGIC or version != VERSION:
        return f"not a token shard (magic {magic}, version {version})"
    if size != HEADER_BYTES + 2 * count:
        return f"header claims {count} tokens ({HEADER_BYTES + 2 * count} bytes) but the file has {size} bytes"
    return None


def total_size(response, offset):
    """The whole file's size as the server reports it, or None if it does not say."""
    content_range = response.headers.get("Content-Range")
    if content_range:
        m = re.match(r"bytes (\d+)-(\d+)/(\d+)", content_range)
        if m:
            return int(m.group(3))
    length = response.headers.get("Content-Length")
    return offset + int(length) if length is not None else None


class Incomplete(Exception):
    """The transfer stopped early; the .part file is kept for the next attempt to resume."""


def claimed_size(path):
    """The file size a shard's header implies, or None if the header is not there yet."""
    if os.path.getsize(path) < HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        return HEADER_BYTES + 2 * struct.unpack("<3i", f.read(12))[2]


def fetch_once(url, part):
    """One attempt: appends to part from its current size, or starts it over when there is none
    or the server sends the whole file. Returns (total size the server announced or None,
    the offset this attempt started from)."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"User-Agent": "cached_fineweb10B.py"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            return have, have  # nothing after what we hold: the .part is already the whole file
        raise
    with response:
        status = response.status or 200  # file:// responses carry no status
        resumed = have > 0 and status == 206
        if have and not resumed:
            print(f"  the server sent the whole file; starting {os.path.basename(part)} over", flush=True)
        offset = have if resumed else 0
        if resumed:
            start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            if not start or int(start.group(1)) != have:
                raise DownloadError(f"{url}: asked for bytes from {have}, the server answered "
                                    f"{response.headers.get('Content-Range')!r}")
        total = total_size(response, offset)
        done, next_report = offset, 0.25
        with open(part, "ab" if resumed else "wb") as f:
            while True:
                chunk = response.read(CHUNK)
                if not chunk:
                    break
                f.write(chunk)
                done += len(chunk)
                if total and total >= 64 * CHUNK and done / total >= next_report:
                    print(f"  {done / total:4.0%} of {total:,} bytes", flush=True)
                    next_report += 0.25
    return total, offset


def download(url, final, retries, retry_wait):
    part = final + ".part"
    last_error = None
    for attempt in range(1, retries + 1):
        try:
            total, started_at = fetch_once(url, part)
            size = os.path.getsize(part)
            # http.client returns a short body without an error when the connection drops, so
            # completeness is judged by size: the server's, else the shard header's.
            expected = total if total is not None else claimed_size(part)
            if expected is None or size < expected:
                raise Incomplete(f"the connection ended after {size:,} of {expected or '?'} bytes")
            problem = shard_problem(part)
            if problem is None:
                os.replace(part, final)
                return
            os.remove(part)
            if started_at == 0:
                raise DownloadError(f"{url} is not a token shard ({problem}); removed the download")
            last_error = f"the resumed download is not a token shard ({problem}); starting over"
        except Incomplete as e:
            last_error = str(e)
        except urllib.error.HTTPError as e:
            if e.code in (401, 403, 404, 410):
                raise DownloadError(f"{url}: HTTP error {e.code} {e.reason}")
            last_error = f"HTTP error {e.code} {e.reason}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            last_error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        print(f"  attempt {attempt} of {retries} failed: {last_error}", flush=True)
        if attempt < retries:
            time.sleep(min(retry_wait * 2 ** (attempt - 1), 60.0))
    kept = f"; {part} is kept and the next run resumes from it" if os.path.exists(part) else ""
    raise DownloadError(f"{url}: giving up after {retries} attempts ({last_error}){kept}")


def parse_args(argv):
    def count(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"N must be a whole number, got {text!r}")
        if not 0 <= n <= NUM_TRAIN_SHARDS:
            raise argparse.ArgumentTypeError(f"N must be between 0 and {NUM_TRAIN_SHARDS} "
                                             f"(FineWeb10B has {NUM_TRAIN_SHARDS} training shards), got {n}")
        return n

    def positive(text):
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
        return n

    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("num_train", nargs="?", type=count, default=NUM_TRAIN_SHARDS, metavar="N",
                   help=f"training shards to fetch (default {NUM_TRAIN_SHARDS}: all)")
    p.add_argument("--base-url", default=os.environ.get("FINEWEB_BASE_URL") or DEFAULT_BASE_URL)
    p.add_argument("--out-dir", default=os.path.join(here, "fineweb10B"))
    p.add_argument("--retries", type=positive, default=5)
    p.add_argument("--retry-wait", type=float, default=2.0, metavar="SECONDS",
                   help="pause before the second attempt, doubling after each failure (default 2)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    base = args.base_url.rstrip("/")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        for name in shard_names(args.num_train):
            final = os.path.join(args.out_dir, name)
            if os.path.exists(final):
                problem = shard_problem(final)
                if problem is None:
                    print(f"{name}: present, skipped", flush=True)
                    continue
                print(f"{name}: present but incomplete ({problem}); downloading again", flush=True)
                os.remove(final)
            url = f"{base}/{name}"
            print(f"{name}: downloading {url}", flush=True)
            download(url, final, args.retries, args.retry_wait)
            print(f"{name}: done ({os.path.getsize(final):,} bytes)", flush=True)
    except (DownloadError, OSError) as e:
        print(f"cached_fineweb10B: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
