#!/usr/bin/env python3
"""Offline tests of data/cached_fineweb10B.py against a local HTTP server (127.0.0.1) that
serves small fake shards, supports Range requests, records every request and can be told to
cut a response short, ignore Range, or answer 404; plus a file:// source. The script runs as a
user runs it, in a subprocess. Standard library only.
"""
import http.server
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "data", "cached_fineweb10B.py")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402


def shard_bytes(num_tokens, seed):
    tokens = [(seed * 7919 + i * 104729) % 50257 for i in range(num_tokens)]
    return struct.pack("<256i", 20240520, 1, num_tokens, *([0] * 253)) + struct.pack(f"<{num_tokens}H", *tokens)


class Server:
    """Serves files from a directory; per-file behaviour is set through the attributes below."""

    def __init__(self, root):
        self.root = root
        self.requests = []      # (file name, Range header or None)
        self.cut = {}           # name -> (bytes to send before dropping the connection, times left)
        self.ignore_range = False
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                path = os.path.join(server.root, name)
                if not os.path.isfile(path):
                    self.send_error(404, "Not Found")
                    return
                with open(path, "rb") as f:
                    data = f.read()
                start = 0
                if rng and not server.ignore_range:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                limit, times = server.cut.get(name, (None, 0))
                if times > 0:
                    server.cut[name] = (limit, times - 1)
                    self.wfile.write(body[:limit])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/kjj0/fineweb10B-gpt2/resolve/main"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def names_requested(self):
        return [n for n, _ in self.requests]

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def run(args, env=None):
    full_env = dict(os.environ)
    full_env.pop("FINEWEB_BASE_URL", None)
    full_env.update(env or {})
    p = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, env=full_env, timeout=60)
    return p.returncode, p.stdout, p.stderr


def listing(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def main():
    work = tempfile.mkdtemp(prefix="fineweb_test_")
    try:
        src = os.path.join(work, "source")
        os.makedirs(src)
        files = {"fineweb_val_000000.bin": shard_bytes(1500, 0)}
        for i in range(1, 4):
            files["fineweb_train_%06d.bin" % i] = shard_bytes(1000 + 300 * i, i)
        # A train shard 000000 exists upstream's naming would never ask for; it must not be fetched.
        files["fineweb_train_000000.bin"] = shard_bytes(10, 99)
        for name, data in files.items():
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
        server = Server(src)
        try:
            run_all(work, src, files, server)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return finish()


def run_all(work, src, files, server):
    out = os.path.join(work, "out")
    base = ["--base-url", server.url, "--out-dir", out, "--retry-wait", "0"]

    def same(name):
        path = os.path.join(out, name)
        return os.path.exists(path) and open(path, "rb").read() == files[name]

    # Argument handling.
    for bad, message in [("abc", "N must be a whole number, got 'abc'"), ("-1", "between 0 and 103"),
                         ("104", "FineWeb10B has 103 training shards")]:
        rc, _, err = run([bad] + base)
        check(rc == 2 and message in err, f"argument {bad!r}: rc {rc}, stderr {err!r}")
    rc, _, err = run(["1", "--retries", "0"] + base)
    check(rc == 2 and "--retries" in err, f"--retries 0: rc {rc}")
    check(not os.path.exists(out), "bad arguments created the output directory")

    # Fresh download of N = 2: the val shard and train shards 1 and 2, nothing else.
    rc, stdout, err = run(["2"] + base)
    check(rc == 0, f"N=2: rc {rc}, stderr {err!r}")
    check(listing(out) == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"],
          f"N=2 files: {listing(out)}")
    check(all(same(n) for n in listing(out)), "N=2: contents differ from the source")
    check(server.names_requested() == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"],
          f"N=2 requests: {server.requests}")

    # Run again: everything is present and complete, so nothing is requested.
    server.requests.clear()
    rc, stdout, _ = run(["2"] + base)
    check(rc == 0 and server.requests == [] and stdout.count("present, skipped") == 3, f"rerun: rc {rc}, {server.requests}")

    # N = 3 fetches only the new shard; N = 0 only checks the val shard.
    rc, _, _ = run(["3"] + base)
    check(rc == 0 and server.names_requested() == ["fineweb_train_000003.bin"] and same("fineweb_train_000003.bin"),
          f"N=3 after N=2: {server.requests}")
    server.requests.clear()
    rc, stdout, _ = run(["0"] + base)
    check(rc == 0 and server.requests == [] and "fineweb_val_000000.bin: present, skipped" in stdout, "N=0")

    # Resume from a .part left by an interrupted run: one Range request from where it stopped.
    name = "fineweb_train_000003.bin"
    os.remove(os.path.join(out, name))
    with open(os.path.join(out, name + ".part"), "wb") as f:
        f.write(files[name][:1500])
    server.requests.clear()
    rc, _, err = run(["3"] + base)
    check(rc == 0 and server.requests == [(name, "bytes=1500-")] and same(name), f"resume: rc {rc}, {server.requests}, {err!r}")
    check(not any(n.endswith(".part") for n in listing(out)), "resume left a .part file")

    # The connection drops mid-file: the next attempt resumes and the file comes out whole.
    name = "fineweb_train_000002.bin"
    os.remove(os.path.join(out, name))
    server.requests.clear()
    server.cut[name] = (700, 1)
    rc, stdout, err = run(["2"] + base)
    check(rc == 0 and server.requests == [(name, None), (name, "bytes=700-")] and same(name),
          f"dropped connection: rc {rc}, {server.requests}, {err!r}")
    check("attempt 1 of 5 failed: the connection ended after 700 of" in stdout, f"dropped connection message: {stdout!r}")

    # Every attempt drops: a clear error, no final file, the .part kept; the next run resumes it.
    os.remove(os.path.join(out, name))
    server.requests.clear()
    server.cut[name] = (300, 2)
    rc, _, err = run(["2", "--retries", "2"] + base)
    check(rc == 1 and "giving up after 2 attempts" in err and "is kept and the next run resumes from it" in err,
          f"all attempts fail: rc {rc}, stderr {err!r}")
    check(not os.path.exists(os.path.join(out, name)) and os.path.getsize(os.path.join(out, name + ".part")) == 600,
          "all attempts fail: final file absent, .part holds what arrived")
    server.requests.clear()
    rc, _, _ = run(["2"] + base)
    check(rc == 0 and server.requests == [(name, "bytes=600-")] and same(name), f"resume after failure: {server.requests}")

    # A server that ignores Range: the whole file arrives and the .part is rewritten, not appended.
    os.remove(os.path.join(out, name))
    with open(os.path.join(out, name + ".part"), "wb") as f:
        f.write(files[name][:900])
    server.ignore_range = True
    rc, stdout, _ = run(["2"] + base)
    server.ignore_range = False
    check(rc == 0 and same(name) and "starting fineweb_train_000002.bin.part over" in stdout, "server without Range support")

    # A .part that is already complete (the run died before renaming): 416, then checked and renamed.
    os.remove(os.path.join(out, name))
    with open(os.path.join(out, name + ".part"), "wb") as f:
        f.write(files[name])
    server.requests.clear()
    rc, _, _ = run(["2"] + base)
    check(rc == 0 and same(name) and len(server.requests) == 1, f"complete .part: {server.requests}")

    # A truncated final file (copied by hand, say) is detected and fetched again.
    with open(os.path.join(out, name), "r+b") as f:
        f.truncate(2000)
    server.requests.clear()
    rc, stdout, _ = run(["2"] + base)
    check(rc == 0 and same(name) and server.names_requested() == [name] and "present but incomplete" in stdout,
          f"truncated final file: {server.requests}")

    # A missing file on the server: a clear error naming the URL, nothing left behind.
    os.remove(os.path.join(out, "fineweb_train_000003.bin"))
    os.rename(os.path.join(src, "fineweb_train_000003.bin"), os.path.join(src, "moved.bin"))
    rc, _, err = run(["3"] + base)
    os.rename(os.path.join(src, "moved.bin"), os.path.join(src, "fineweb_train_000003.bin"))
    check(rc == 1 and "fineweb_train_000003.bin: HTTP error 404" in err, f"404: rc {rc}, stderr {err!r}")
    check(not any(n.startswith("fineweb_train_000003") for n in listing(out)), "404 left a file behind")

    # Something that is not a shard (an error page served as the file): refused and removed.
    with open(os.path.join(src, "fineweb_train_000003.bin"), "wb") as f:
        f.write(b"<html>rate limited</html>" * 50)
    rc, _, err = run(["3"] + base)
    check(rc == 1 and "is not a token shard" in err, f"not a shard: rc {rc}, stderr {err!r}")
    check(not any(n.startswith("fineweb_train_000003") for n in listing(out)), "a non-shard download was kept")
    with open(os.path.join(src, "fineweb_train_000003.bin"), "wb") as f:
        f.write(files["fineweb_train_000003.bin"])

    # file:// sources, and the FINEWEB_BASE_URL environment variable instead of the flag.
    out2 = os.path.join(work, "out_file_url")
    rc, _, err = run(["3", "--out-dir", out2, "--retry-wait", "0"], env={"FINEWEB_BASE_URL": "file://" + src})
    check(rc == 0 and listing(out2) == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin",
                                        "fineweb_val_000000.bin"], f"file:// via FINEWEB_BASE_URL: rc {rc}, {err!r}")
    check(all(open(os.path.join(out2, n), "rb").read() == files[n] for n in listing(out2)), "file:// contents")

    # The default source is Hugging Face's kjj0/fineweb10B-gpt2 (checked without a network).
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import cached_fineweb10B as cf
    check(cf.DEFAULT_BASE_URL == "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main", "default URL")
    check(cf.shard_names(2) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"],
          "file names")
    check(len(cf.shard_names(103)) == 104 and cf.shard_names(103)[-1] == "fineweb_train_000103.bin", "all 103 shards")


if __name__ == "__main__":
    sys.exit(main())
