#!/usr/bin/env python3
"""Nothing lost silently: each bad input or fault train_gpt_cpu must refuse, with a clear message and
a non-zero exit, as early as it can be known, and without losing what was already saved.

Runs are tiny-preset runs of 0-2 steps (--val-every 0 --warmup 0, 2048 validation tokens).
  - flags: integers out of range (the range in the message), an unknown --mlp-kernel, conflicting
    modes, --checkpoint-steps beyond the run or without --save-checkpoint, --resume-unverified without
    --resume;
  - startup, before anything is written: default data resolved relative to the repository (a run
    started elsewhere finds it; a binary away from its repository names the glob and the current
    directory), training shards too short for the schedule, validation shards too short for
    --val-tokens, a checkpoint directory that cannot be created, a reused run id;
  - the wgmma guard: a fault planted in the wgmma attention or MLP kernels' input
    (TRAIN_GPT_PLANT_WGMMA_FAULT) stops a run before anything is written, naming the kernels, the
    worst error and the fallback flag, on 1 and 2 ranks and in --check-platform; the fallback runs;
  - the log: a full disk from the start and mid-run (a small tmpfs where mounting is allowed, else
    the CPU build's TRAIN_GPT_LOG_LIMIT) stops the run naming the log, keeping what was written;
  - checkpoints: the manifest lists every rank file with its size and CRC-32C; a rank file copied
    over another, a flipped bit, a directory left mixed by a killed re-save, a transposed shape, a
    directory without a manifest: each refused naming the file; --resume-unverified loads a
    manifest-less directory with a warning; a re-save that dies leaves no manifest; a dead process's
    temp file is removed at the next save; SIGTERM during a save removes the process's temp file;
  - non-finite state (NaN planted in checkpoints): found by the device-side check with
    --check-finite, at validation, and before a save (nothing is saved), naming the group;
  - the out-of-vocabulary error names the shard, the position and the rank; step_avg after a resume
    divides by the steps this run timed; the log's header lines (contract 1);
  - issue 28, nothing lost silently: flags a mode ignores, outputs never made or overwriting each
    other, and out-of-range EMU_* variables refused before anything is written; an out-of-vocabulary
    validation token found at startup (1 and 2 ranks); a checkpoint directory holding another run's
    checkpoints refused naming both ids (1 and 2 ranks), and one in use by a live process; resume
    errors before the log (a checkpoint root, a step past the run, another world size, a changed
    schedule, kernel or training data, a checkpoint step or profile range already passed, a save at
    the resumed last step); --resume-changed's warnings, the resumes: header, the finished: line,
    stats.py's sum over the segments; a final validation that fails after training keeps the last
    checkpoint and ends the log with fail:; SIGTERM, SIGUSR1 and SIGHUP end the log with
    "fail: stopped by <SIGNAL>".
Usage: test_failures.py TRAIN_GPT_CPU MPIRUN...
"""
import mmap
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.environ["REPO"]
sys.path.insert(0, os.path.join(REPO, "scripts"))
import read_checkpoint  # noqa: E402

BINARY = os.path.abspath(sys.argv[1])
MPIRUN = sys.argv[2:]
BASE = ["--preset", "tiny", "--val-every", "0", "--warmup", "0", "--val-tokens", "2048"]
TRAIN_SHARD = os.path.join(REPO, "data", "tinyshakespeare", "tinyshakespeare_train_000000.bin")
VAL_SHARD = os.path.join(REPO, "data", "tinyshakespeare", "tinyshakespeare_val_000000.bin")

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


RUN_SECONDS = []  # (seconds, ranks, args) of every trainer run, for the summary of where the time went


def run(args, cwd, ranks=1, env=None, binary=BINARY):
    cmd = ([binary] if ranks == 1 else MPIRUN + ["-np", str(ranks), "-x", "EMU_WORKERS=1", binary]) + args
    e = dict(os.environ, EMU_WORKERS="2" if ranks == 1 else "1")
    e.update(env or {})
    started = time.time()
    p = subprocess.run(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    RUN_SECONDS.append((time.time() - started, ranks, args))
    return p


def timed(section, *args):
    """Runs SECTION(*ARGS) and prints its wall time and trainer runs (the test's time, by section)."""
    started, runs = time.time(), len(RUN_SECONDS)
    result = section(*args)
    print(f"time: {section.__name__}: {time.time() - started:.1f} s, {len(RUN_SECONDS) - runs} trainer run(s)", flush=True)
    return result


def expect_fail(p, phrases, what):
    ok = p.returncode != 0 and all(ph in p.stderr for ph in phrases)
    check(ok, f"{what}: rc {p.returncode}, message names {phrases}" + ("" if ok else f"\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"))


def expect_ok(p, what):
    if not check(p.returncode == 0, f"{what} runs" + ("" if p.returncode == 0 else f"\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")):
        sys.exit(f"{len(failures)} failure(s): a run the rest depends on failed")


def ckpt_dir(root, step):
    return os.path.join(root, f"step{step:06d}")


def host_tag():
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "unknown-host"


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def plant(src_dir, dst_dir, rank, edits, keep_manifest=False):
    """A copy of a checkpoint directory with rank `rank`'s file changed by edits(raw, infos), raw the
    copy's bytes mapped in place (the edits change a few bytes of a 0.5-1.2 GB file: not read into this
    process and written back)."""
    skip = set() if keep_manifest else {"manifest.json"}
    shutil.copytree(src_dir, dst_dir, ignore=lambda d, names: [n for n in names if n in skip])
    path = os.path.join(dst_dir, f"rank{rank}.safetensors")
    _, infos = read_checkpoint.read_header(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as raw:
        edits(raw, infos)
        raw.flush()


def nan_at(name):
    def edit(raw, infos):
        info = infos[name]
        raw[info["offset"]:info["offset"] + (4 if info["dtype"] == "F32" else 2)] = \
            struct.pack("<f", float("nan")) if info["dtype"] == "F32" else b"\xc0\x7f"
    return edit


def replace_in_header(old, new):
    def edit(raw, infos):
        n = struct.unpack("<Q", raw[:8])[0]
        header = raw[8:8 + n].decode()
        assert old in header and len(old) == len(new), (old, new)
        raw[8:8 + n] = header.replace(old, new, 1).encode()
    return edit


def test_flags(tmp):
    for args, phrase in [
            (["--max-steps", "4294967297"], "--max-steps needs an integer in [0, 10000000], got '4294967297'"),
            (["--scheduled-steps", "2147483647"], "--scheduled-steps needs an integer in [1, 10000000]"),
            (["--extension-steps", "-1"], "--extension-steps needs an integer in [0, 10000000]"),
            (["--val-every", "99999999999"], "--val-every needs an integer in [0, 10000000]"),
            (["--seed", "-5"], "--seed needs an integer in [0, 9223372036854775807]"),
            (["--warmup", "2"], "--warmup needs an integer in [0, 1]"),
            (["--check-finite", "x"], "--check-finite needs an integer in [0, 10000000]"),
            (["--checkpoint-steps", "1,x"], "--checkpoint-steps needs an integer in [0, 10000000], got 'x'"),
            (["--mlp-kernel", "tensor"], "--mlp-kernel needs mma or wgmma, got 'tensor'"),
            (["--attention", "fa3"], "--attention needs mma or wgmma, got 'fa3'"),
            (["--print-memory", "--dump-batches", "2", "--check-platform"], "--print-memory and --dump-batches are separate modes"),
            (["--check-platform", "--print-memory"], "--check-platform and --print-memory are separate modes"),
            (["--checkpoint-steps", "1"], "--checkpoint-steps needs --save-checkpoint"),
            (BASE + ["--save-checkpoint", os.path.join(tmp, "c"), "--checkpoint-steps", "0,5", "--max-steps", "2"],
             "--checkpoint-steps 5 is beyond this run's last step 2"),
            (["--resume-unverified"], "--resume-unverified goes with --resume")]:
        p = run(args + ["--log-dir", os.path.join(tmp, "flaglogs")], tmp)
        expect_fail(p, [phrase], " ".join(args))
    check(not os.path.exists(os.path.join(tmp, "flaglogs")), "bad flags write nothing")


def test_startup(tmp):
    logs = os.path.join(tmp, "startlogs")
    # a binary away from its repository: its default data is missing; one line, no log, no abort banner
    away = os.path.join(tmp, "away", "build")
    os.makedirs(away)
    shutil.copy(BINARY, away)
    p = run(BASE + ["--log-dir", logs], tmp, binary=os.path.join(away, os.path.basename(BINARY)))
    glob = os.path.join(tmp, "away", "data", "tinyshakespeare", "tinyshakespeare_train_*.bin")
    expect_fail(p, [f"no files match {glob}", f"the current directory is {tmp}", "--train-files"],
                "default data missing next to the binary")
    check(len(p.stderr.strip().splitlines()) == 1 and "MPI_ABORT" not in p.stderr, "it is one line, without MPI_ABORT")

    # training shards too short for the schedule: found before step 1 (the loader walks all 34 steps)
    short = os.path.join(tmp, "short")
    os.makedirs(short)
    raw = open(TRAIN_SHARD, "rb").read()
    keep = 40000
    hdr = bytearray(raw[:1024])
    hdr[8:12] = struct.pack("<i", keep)
    open(os.path.join(short, "short_000000.bin"), "wb").write(bytes(hdr) + raw[1024:1024 + 2 * keep])
    p = run(BASE + ["--train-files", os.path.join(short, "*.bin"), "--log-dir", logs], tmp)
    expect_fail(p, ["the training data cannot feed this run's 34 steps on 1 rank(s): it runs out in step",
                    "training data exhausted", os.path.join(short, "*.bin")], "short training data")
    m = re.search(r"runs out in step (\d+)", p.stderr)
    check(m is not None and 0 < int(m.group(1)) < 34, "the step it runs out in is named")
    check(not os.path.exists(logs), "short training data: nothing written (no log)")
    # the same shard holds a 2-step run
    p = run(BASE + ["--train-files", os.path.join(short, "*.bin"), "--max-steps", "0", "--log-dir", logs,
                    "--run-id", "short0"], tmp)
    check(p.returncode == 0, f"the short shard holds a 0-step run ({p.stderr[-300:]})")

    # validation shards too short for --val-tokens: refused before training (with --val-every 0 and
    # a checkpoint to save, the old behaviour trained to the end, failed, and saved nothing)
    p = run(BASE[:-1] + ["65536", "--save-checkpoint", os.path.join(tmp, "valck"), "--log-dir", logs, "--run-id", "v"], tmp)
    expect_fail(p, ["the validation data cannot supply --val-tokens 65536", "validation data exhausted", "tinyshakespeare_val_*.bin"],
                "short validation data")
    check(not os.path.exists(os.path.join(logs, "v.txt")), "short validation data: no log, no training")

    # a checkpoint directory whose parent is missing, and one that is a file
    p = run(BASE + ["--save-checkpoint", "/missing/a/b", "--log-dir", logs, "--run-id", "m"], tmp)
    expect_fail(p, ["cannot create the checkpoint directory /missing/a/b", "No such file or directory"], "--save-checkpoint /missing/a/b")
    check(not os.path.exists(os.path.join(logs, "m.txt")), "uncreatable checkpoint directory: no log")
    afile = os.path.join(tmp, "afile")
    open(afile, "w").write("x")
    p = run(BASE + ["--save-checkpoint", afile, "--log-dir", logs, "--run-id", "m"], tmp)
    expect_fail(p, [f"the checkpoint directory {afile} is not a directory"], "--save-checkpoint FILE")

    # a reused run id is refused and the old log is untouched
    before = open(os.path.join(logs, "short0.txt")).read()
    p = run(BASE + ["--max-steps", "0", "--log-dir", logs, "--run-id", "short0"], tmp)
    expect_fail(p, [f"the log {os.path.join(logs, 'short0.txt')} already exists", "run id short0 was used before"], "reused run id")
    check(open(os.path.join(logs, "short0.txt")).read() == before, "the old log is unchanged")


def test_wgmma_guard(tmp):
    logs = os.path.join(tmp, "guardlogs")
    ckpt = os.path.join(tmp, "guardck")
    guard = ["the wgmma", "disagree with the mma.sync kernels on a random problem", "worst error",
             "nothing was trained"]
    attention = {"TRAIN_GPT_PLANT_WGMMA_FAULT": "attention"}
    mlp = {"TRAIN_GPT_PLANT_WGMMA_FAULT": "mlp"}
    args = BASE + ["--max-steps", "1", "--log-dir", logs, "--save-checkpoint", ckpt, "--checkpoint-steps", "0"]
    p = run(args + ["--run-id", "a"], tmp, env=attention)
    expect_fail(p, guard + ["attention kernels", "run with --attention mma"], "a planted wgmma attention fault")
    written = lambda: os.path.exists(logs) or (os.path.exists(ckpt) and os.listdir(ckpt))
    check(not written(), "the attention fault: no log, no checkpoint")
    p = run(args + ["--run-id", "m", "--mlp-kernel", "wgmma"], tmp, ranks=2, env=mlp)
    expect_fail(p, guard + ["MLP kernels", "run with --mlp-kernel mma"], "a planted wgmma MLP fault on 2 ranks")
    check(p.stderr.count("disagree with") == 1 and "MPI_ABORT" not in p.stderr, "2 ranks: one message, no MPI_ABORT")
    check(not written(), "the MLP fault: no log, no checkpoint")
    # the fallback flags skip the faulty kernels (the planted fault touches only the wgmma run)
    p = run(BASE + ["--max-steps", "0", "--log-dir", logs, "--run-id", "fa", "--attention", "mma"], tmp, env=attention)
    check(p.returncode == 0, f"the attention fault with --attention mma trains ({p.stderr[-300:]})")
    p = run(BASE + ["--max-steps", "0", "--log-dir", logs, "--run-id", "fm", "--mlp-kernel", "mma"], tmp, env=mlp)
    check(p.returncode == 0, f"the MLP fault with --mlp-kernel mma trains ({p.stderr[-300:]})")
    # --check-platform: both kernels checked and passed, then each planted fault found
    platform = ["--preset", "tiny", "--check-platform", "--mlp-kernel", "wgmma"]
    p = run(platform, tmp, ranks=2)
    check(p.returncode == 0 and "wgmma guard passed: the kernels selected as wgmma (attention: wgmma, MLP: wgmma)"
          in p.stdout, f"--check-platform passes the wgmma guard on 2 ranks ({p.stdout[-300:]}{p.stderr[-300:]})")
    for env, flag in ((attention, "--attention mma"), (mlp, "--mlp-kernel mma")):
        p = run(platform, tmp, env=env)
        check(p.returncode != 0 and "wgmma guard FAILED" in p.stdout and f"run with {flag}" in p.stderr,
              f"--check-platform finds the planted {env['TRAIN_GPT_PLANT_WGMMA_FAULT']} fault")


def log_prefix_bytes(path):
    """Bytes of the log before its first step line."""
    text = open(path, "rb").read()
    return text.index(b"\nstep:") + 1


def test_log_full(tmp, base_log):
    """A full disk: from the start, and after the first step line. On a small tmpfs when mounting is
    allowed (root), else through TRAIN_GPT_LOG_LIMIT."""
    mnt = os.path.join(tmp, "mnt")
    os.makedirs(mnt)
    can_mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", mnt],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    if can_mount:
        subprocess.run(["umount", mnt])
    how = "a 4 KiB tmpfs" if can_mount else "TRAIN_GPT_LOG_LIMIT"
    print(f"log-full tests use {how}", flush=True)

    def full_run(room, run_id, args):
        """Runs with `room` bytes of log space (a tmpfs of whole pages when mounting: the run id's
        length pads the log so that the room ends where wanted)."""
        env = {}
        if can_mount:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(4096, (room + 4095) // 4096 * 4096)}", "tmpfs", mnt],
                           check=True)
        else:
            env = {"TRAIN_GPT_LOG_LIMIT": str(room)}
        try:
            p = run(args + ["--log-dir", mnt if can_mount else os.path.join(tmp, "limited"), "--run-id", run_id], tmp, env=env)
            log = os.path.join(mnt if can_mount else os.path.join(tmp, "limited"), run_id + ".txt")
            text = open(log, "rb").read() if os.path.exists(log) else b""
        finally:
            if can_mount:
                subprocess.run(["umount", mnt])
        return p, log, text

    # from the start: the log fills inside the source dump
    p, log, text = full_run(4096, "full0", BASE + ["--max-steps", "1"])
    expect_fail(p, [f"cannot write the log {log}", "No space left on device"], f"log disk full from the start ({how})")
    check(b"step:" not in text and text.startswith(b"-" * 100), "the log keeps what fit, and the run stopped before training")

    # mid-run: room for the preamble and the first step line only. The preamble's length is the
    # base run's (same flags), adjusted for the command line's different run id and log dir.
    args = BASE + ["--max-steps", "2"]
    prefix = log_prefix_bytes(base_log)
    base_cmd = re.search(rb"^command: (.*)$", open(base_log, "rb").read(), re.M).group(1)
    first_step = re.search(rb"^step:1/34 train_time:\d+ms step_avg:\S+\n", open(base_log, "rb").read(), re.M).group(0)
    run_id = "mid"
    def cmd_len(seed):
        d = mnt if can_mount else os.path.join(tmp, "limited")
        return len(" ".join([BINARY] + args + ["--seed", seed, "--log-dir", d, "--run-id", run_id]))
    seed = "1337"
    if can_mount:  # pad the seed with leading zeros until the page boundary falls inside the second step line
        while True:
            pre = prefix - len(base_cmd) + cmd_len(seed)
            end = (pre + 4095) // 4096 * 4096
            if pre + len(first_step) + 5 <= end <= pre + len(first_step) + 30:
                break
            seed = "0" + seed
        room = end
    else:
        pre = prefix - len(base_cmd) + cmd_len(seed)
        room = pre + len(first_step) + 10
    os.makedirs(os.path.join(tmp, "limited"), exist_ok=True)
    p, log, text = full_run(room, run_id, args + ["--seed", seed])
    expect_fail(p, [f"cannot write the log {log}", "No space left on device"], f"log disk full mid-run ({how})")
    print(f"mid-run: preamble {pre} bytes predicted, room {room}, the log kept {len(text)}: ...{text[-120:]!r}", flush=True)
    check(re.search(rb"^step:1/34 train_time:", text, re.M) is not None and
          re.search(rb"^step:\d+/34 val_loss:", text, re.M) is None,
          "mid-run: the log keeps the preamble and step 1; the run stopped instead of ending without its val_loss")


def test_header(log_path, argv):
    text = open(log_path).read()
    lines = text.splitlines()
    def value(key):
        found = [l[len(key) + 2:] for l in lines if l.startswith(key + ": ")]
        return found[0] if len(found) == 1 else None
    check(value("command") == " ".join(argv), f"command: {value('command')}")
    # the config's own name, which scripts/stats.py groups runs by (the base run's --preset tiny)
    check(value("preset") == "tiny", f"preset: {value('preset')}")
    check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value("date_utc") or "") is not None, f"date_utc: {value('date_utc')}")
    check(value("hosts") == socket.gethostname(), f"hosts: {value('hosts')}")
    check(value("world_size") == "1" and value("seed") == "1337", "world_size and seed")
    # source_hash: FNV-1a 64 over the source dump at the top of the log (path, NUL, text, NUL each)
    dump = text[:text.index("=" * 100 + "\n")]
    parts = re.split(r"(?:^|\n)-{100}\n// (\S+)\n-{100}\n", dump)
    parts[-1] = parts[-1][:-1]  # the newline after the last file's text
    h = 0xcbf29ce484222325
    for path, body in zip(parts[1::2], parts[2::2]):
        for byte in path.encode() + b"\0" + body.encode() + b"\0":
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    check(len(parts) > 20 and value("source_hash") == f"{h:016x}", f"source_hash {value('source_hash')} == {h:016x}")
    env = text.index("CPU build")
    check(env < text.index("\ncommand: ") < text.index("\nconfig tiny:"), "header lines sit between the environment and the config")


def test_checkpoints(tmp, base):
    logs = os.path.join(tmp, "cklogs")
    step1 = ckpt_dir(base, 1)
    man = open(os.path.join(step1, "manifest.json")).read()
    size = os.path.getsize(os.path.join(step1, "rank0.safetensors"))
    check(f'"name":"rank0.safetensors","bytes":{size},"crc32c":"' in man and '"step":"1"' in man and '"run_id":"base"' in man,
          "the manifest lists rank 0's file with its size, and the step and run id")

    # a flipped bit in tensor data fails the checksum, naming the file
    flipped = os.path.join(tmp, "flipped", "step000001")
    def flip(raw, infos):
        raw[infos["param.mlp"]["offset"] + 1000] ^= 0x10
    plant(step1, flipped, 0, flip, keep_manifest=True)
    p = run(BASE + ["--resume", flipped, "--max-steps", "2", "--log-dir", logs], tmp)
    expect_fail(p, [f"{flipped}/rank0.safetensors has CRC-32C", "its bytes changed"], "a flipped bit")

    # no manifest: refused, naming it; with --resume-unverified loaded with a warning
    bare = os.path.join(tmp, "bare", "step000001")
    plant(step1, bare, 0, lambda raw, infos: None)
    p = run(BASE + ["--resume", bare, "--max-steps", "2", "--log-dir", logs], tmp)
    expect_fail(p, [f"{bare}/manifest.json is missing", "--resume-unverified"], "a directory without a manifest")
    p = run(BASE + ["--resume", bare, "--resume-unverified", "--max-steps", "2", "--log-dir", logs, "--run-id", "unv"], tmp)
    check(p.returncode == 0 and "WARNING: " + bare + " has no manifest: nothing in it can be verified" in p.stdout,
          f"--resume-unverified resumes with a warning ({p.stderr[-300:]})")
    # step_avg after a resume: over the one step this run timed
    m = re.search(r"^step:2/34 train_time:(\d+)ms step_avg:(\S+)ms$", p.stdout, re.M)
    check(m is not None and abs(float(m.group(2)) - int(m.group(1))) <= 1,
          f"step_avg after resuming at step 1 divides by 1 step: {m.group(0) if m else None}")

    # a transposed shape of the same size (only loadable unverified: the checksum would catch it first)
    transposed = os.path.join(tmp, "transposed", "step000001")
    plant(step1, transposed, 0, replace_in_header('"param.lm_head":{"dtype":"BF16","shape":[128,50304]',
                                                  '"param.lm_head":{"dtype":"BF16","shape":[50304,128]'))
    p = run(BASE + ["--resume", transposed, "--resume-unverified", "--max-steps", "2", "--log-dir", logs], tmp)
    expect_fail(p, [f"{transposed}/rank0.safetensors: tensor param.lm_head is BF16 [50304, 128], this run's is BF16 [128, 50304]"],
                "a transposed shape")

    # another seed
    p = run(BASE + ["--resume", step1, "--seed", "7", "--max-steps", "2", "--log-dir", logs], tmp)
    expect_fail(p, ["saved by a run with --seed 1337; this run has --seed 7"], "resume with another seed")

    # a re-save into an existing directory removes its manifest first: one that dies leaves none
    resave = os.path.join(tmp, "resave")
    shutil.copytree(step1, ckpt_dir(resave, 0), ignore=lambda d, names: [n for n in names if n == "rank0.safetensors"])
    os.makedirs(os.path.join(ckpt_dir(resave, 0), "rank0.safetensors", "blocker"))  # the rename cannot land
    # (as run base: the directory holds base's checkpoint, and another run may not save into it)
    p = run(BASE + ["--max-steps", "0", "--save-checkpoint", resave, "--checkpoint-steps", "0", "--log-dir", logs,
                    "--run-id", "base"], tmp)
    expect_fail(p, ["cannot write checkpoint", "rank0.safetensors"], "a re-save that fails")
    check(not os.path.exists(os.path.join(ckpt_dir(resave, 0), "manifest.json")), "the failed re-save left no manifest")
    check(not [f for f in os.listdir(ckpt_dir(resave, 0)) if ".tmp." in f], "nor a temp file")


def test_two_ranks(tmp):
    """Rank files that do not belong together, on a 2-rank checkpoint; a dead process's temp file."""
    root = os.path.join(tmp, "np2")
    os.makedirs(ckpt_dir(root, 1))
    stale = os.path.join(ckpt_dir(root, 1), f"rank1.safetensors.tmp.{host_tag()}.{dead_pid()}")
    open(stale, "w").write("partial")
    p = run(BASE + ["--max-steps", "1", "--save-checkpoint", root, "--checkpoint-steps", "1", "--log-dir", tmp,
                    "--run-id", "np2"], tmp, ranks=2)
    expect_ok(p, "2-rank save")
    check(not os.path.exists(stale) and "the temp file of a dead process" in p.stderr, "a dead process's temp file is removed")
    step1 = ckpt_dir(root, 1)
    man = open(os.path.join(step1, "manifest.json")).read()
    check(man.count('"name":"rank') == 2, "the manifest lists both rank files")
    logs = os.path.join(tmp, "np2logs")

    # rank 0's file copied over rank 1's
    copied = os.path.join(tmp, "copied", "step000001")
    shutil.copytree(step1, copied, ignore=lambda d, names: [n for n in names if n == "rank1.safetensors"])
    shutil.copy(os.path.join(copied, "rank0.safetensors"), os.path.join(copied, "rank1.safetensors"))
    p = run(BASE + ["--resume", copied, "--max-steps", "2", "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"{copied}/rank1.safetensors is", "a file of another save, or damaged"], "rank 0's file over rank 1's")
    # rank 1 finds it after the log exists: its message is in rank 0's log too (the ranks share one run
    # id, drawn on rank 0), before the line of the signal that then stopped rank 0
    made = [os.path.join(logs, n) for n in os.listdir(logs)] if os.path.isdir(logs) else []
    tail = open(made[0]).read().splitlines()[-3:] if len(made) == 1 else []
    check(any(line.startswith(f"fail: rank 1: cannot resume from {copied}: {copied}/rank1.safetensors is")
              for line in tail), f"rank 1's fatal error is in the log's last lines ({made}: {tail})")

    # what a killed re-save leaves: no manifest, rank 0 from the new save, rank 1 from the old one
    mixed = os.path.join(tmp, "mixed", "step000001")
    old_id = re.search(r'"save_id":"([0-9a-f]{16})"', man).group(1)
    new_id = "%016x" % (int(old_id, 16) ^ 1)
    plant(step1, mixed, 0, replace_in_header(f'"save_id":"{old_id}"', f'"save_id":"{new_id}"'))
    p = run(BASE + ["--resume", mixed, "--max-steps", "2", "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"{mixed}/manifest.json is missing"], "a directory a killed re-save left mixed")
    p = run(BASE + ["--resume", mixed, "--resume-unverified", "--max-steps", "2", "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"{mixed}/rank1.safetensors has save_id {old_id}, but the directory's is {new_id}"],
                "the mixed directory, even unverified, names the file of the other save")

    # a rank's file from the right save but the wrong rank (metadata only; unverified)
    swapped = os.path.join(tmp, "swapped", "step000001")
    plant(step1, swapped, 1, replace_in_header('"rank":"1"', '"rank":"0"'))
    p = run(BASE + ["--resume", swapped, "--resume-unverified", "--max-steps", "2", "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"{swapped}/rank1.safetensors has rank 0, but the directory's is 1"], "a file of another rank")


def test_nonfinite(tmp, base):
    step1 = ckpt_dir(base, 1)
    logs = os.path.join(tmp, "nanlogs")
    # NaN in Adam's state of scalars: --check-finite 1 finds it right after the resume
    d = os.path.join(tmp, "nan_scalars", "step000001")
    plant(step1, d, 0, nan_at("exp_avg.scalars"))
    out = os.path.join(tmp, "nan_out")
    p = run(BASE + ["--resume", d, "--resume-unverified", "--max-steps", "2", "--check-finite", "1", "--save-checkpoint", out,
                    "--log-dir", logs, "--run-id", "cf"], tmp)
    expect_fail(p, ["non-finite values in exp_avg.scalars on rank 0 at step 1 (--check-finite)"], "--check-finite 1")
    check(last_line(os.path.join(logs, "cf.txt")) == "fail: non-finite values in exp_avg.scalars on rank 0 at step 1 "
          "(--check-finite)", "the log ends with the error (fail: ...)")
    check(not os.path.exists(ckpt_dir(out, 2)), "nothing saved")
    # ... and at validation (the last step is validated)
    p = run(BASE + ["--resume", d, "--resume-unverified", "--max-steps", "1", "--log-dir", logs], tmp)
    expect_fail(p, ["non-finite values in exp_avg.scalars on rank 0 at step 1 (at validation)"], "the finite check at validation")
    # a NaN parameter makes the validation loss NaN: the step and the group are named
    d = os.path.join(tmp, "nan_param", "step000001")
    plant(step1, d, 0, nan_at("param.scalars"))
    p = run(BASE + ["--resume", d, "--resume-unverified", "--max-steps", "1", "--log-dir", logs], tmp)
    expect_fail(p, ["the validation loss became NaN at step 1", "param.scalars on rank 0"], "a NaN validation loss")
    # NaN in state that does not reach the loss (embed's Adam moments while embed is tied): the save
    # at step 2 is refused and nothing is written
    d = os.path.join(tmp, "nan_embed", "step000001")
    plant(step1, d, 0, nan_at("exp_avg.embed"))
    p = run(BASE + ["--resume", d, "--resume-unverified", "--max-steps", "3", "--checkpoint-steps", "2", "--save-checkpoint", out,
                    "--log-train-loss", "--log-dir", logs], tmp)
    expect_fail(p, ["non-finite values in exp_avg.embed on rank 0 at step 2 (before saving a checkpoint)"], "the check before a save")
    check("step:2/34 train_loss:" in p.stdout and not os.path.exists(ckpt_dir(out, 2)),
          "the training loss stayed finite, and no checkpoint was written")


def test_signal(tmp):
    """SIGTERM while a checkpoint is being written removes the temp file (a FIFO stands in for it, so
    the save blocks opening it until the signal comes)."""
    root = os.path.join(tmp, "sig")
    os.makedirs(ckpt_dir(root, 1))
    logs = os.path.join(tmp, "siglogs")
    e = dict(os.environ, EMU_WORKERS="2")
    p = subprocess.Popen([BINARY] + BASE + ["--max-steps", "2", "--save-checkpoint", root, "--checkpoint-steps", "1",
                                            "--log-dir", logs, "--run-id", "sig"],
                         cwd=tmp, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fifo = os.path.join(ckpt_dir(root, 1), f"rank0.safetensors.tmp.{host_tag()}.{p.pid}")
    os.mkfifo(fifo)
    log = os.path.join(logs, "sig.txt")
    for _ in range(1200):
        if os.path.exists(log) and "step:1/34 train_time" in open(log).read():
            break
        time.sleep(0.1)
    def blocked_on_fifo():  # a thread waits in open() for the FIFO's reader
        try:
            tasks = os.listdir(f"/proc/{p.pid}/task")
            return any(open(f"/proc/{p.pid}/task/{t}/wchan").read() == "wait_for_partner" for t in tasks)
        except OSError:
            return False
    for _ in range(1200):
        if blocked_on_fifo() or p.poll() is not None:
            break
        time.sleep(0.1)
    alive = p.poll() is None and blocked_on_fifo()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    check(alive and p.returncode == -signal.SIGTERM, f"the run was saving when SIGTERM came and died of it (rc {p.returncode})")
    check(not os.path.exists(fifo), "SIGTERM removed the temp file being written")
    check(last_line(log) == "fail: stopped by SIGTERM", f"the log says so: {last_line(log)}")


def test_vocabulary(tmp):
    d = os.path.join(tmp, "oov")
    os.makedirs(d)
    raw = bytearray(open(TRAIN_SHARD, "rb").read())
    bos = [i for i in range(0, 2000) if struct.unpack_from("<H", raw, 1024 + 2 * i)[0] == 50256][0]
    pos = bos + 5
    struct.pack_into("<H", raw, 1024 + 2 * pos, 60000)
    shard = os.path.join(d, "oov_000000.bin")
    open(shard, "wb").write(raw)
    p = run(BASE + ["--train-files", os.path.join(d, "*.bin"), "--max-steps", "1", "--log-dir", os.path.join(tmp, "oovlogs")], tmp)
    expect_fail(p, [f"the training data of step 0: token id 60000 at token {pos} of shard {shard} (read by rank 0) is outside "
                    "the vocabulary [0, 50257)"], "an out-of-vocabulary token")
    check(not os.listdir(os.path.join(tmp, "oovlogs")) if os.path.exists(os.path.join(tmp, "oovlogs")) else True,
          "found by the startup walk: no log")


# ---- issue 28: a run's outputs cannot be lost, overwritten, skipped or invalidated silently ----

def last_line(path):
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return lines[-1] if lines else ""


def nothing_in(d):
    return not os.path.exists(d) or not os.listdir(d)


def test_mode_flags(tmp):
    """Every flag a mode ignores is refused there; outputs that would never be made or would
    overwrite each other are refused; the CPU build's EMU_* variables are range-checked. All at
    parse time or at program start: nothing written."""
    logs = os.path.join(tmp, "modelogs")
    for args, phrase in [
            (["--print-memory", "--max-steps", "3"], "--max-steps does nothing with --print-memory (it takes only --preset, --ranks)"),
            (["--dump-batches", "2", "--log-dir", logs], "--log-dir does nothing with --dump-batches"),
            (["--dump-batches", "2", "--seed", "3"], "--seed does nothing with --dump-batches"),
            (["--check-platform", "--resume", logs], "--resume does nothing with --check-platform"),
            (["--check-platform", "--val-files", "x"], "--val-files does nothing with --check-platform"),
            (["--plan-step", "--save-checkpoint", logs], "--save-checkpoint does nothing with --plan-step"),
            (["--plan-step", "--run-id", "x"], "--run-id does nothing with --plan-step"),
            (["--plan-step", "--checkpoint-steps", "1"], "--checkpoint-steps does nothing with --plan-step"),
            (["--plan-step", "--max-steps", "1"], "--max-steps does nothing with --plan-step"),
            (["--plan-step", "--json", "a.json", "--trace", "a.json"], "--json and --trace name the same file a.json"),
            (["--save-checkpoint", os.path.join(logs, "ck"), "--max-steps", "0"],
             "--save-checkpoint with a run of 0 steps saves nothing"),
            (["--resume-changed"], "--resume-changed goes with --resume DIR")]:
        p = run(["--preset", "tiny"] + args, tmp)
        check(p.returncode == 2 and phrase in p.stderr, f"{' '.join(args)}: refused ({phrase})" +
              ("" if p.returncode == 2 and phrase in p.stderr else f" rc {p.returncode}: {p.stderr[-300:]}"))
    # the last --checkpoint-steps counts (as for every flag): 5 is beyond a 2-step run, 2 is not
    p = run(BASE + ["--max-steps", "2", "--save-checkpoint", os.path.join(tmp, "cs"), "--checkpoint-steps", "5",
                    "--checkpoint-steps", "3", "--log-dir", logs], tmp)
    expect_fail(p, ["--checkpoint-steps 3 is beyond this run's last step 2"], "the last --checkpoint-steps counts")
    for var, value, phrase in [("EMU_WORKERS", "-1", "EMU_WORKERS=-1 is not a whole number in [1, 1024]"),
                               ("EMU_WORKERS", "99999999999999999999", "EMU_WORKERS=99999999999999999999 is not a whole number"),
                               ("EMU_WORKERS", "0", "EMU_WORKERS=0 is not a whole number in [1, 1024]"),
                               ("EMU_STACK_KB", "1", "EMU_STACK_KB=1 is not a whole number in [64, 65536]"),
                               ("EMU_STACK_KB", "99999999999", "EMU_STACK_KB=99999999999 is not a whole number"),
                               ("EMU_RANDOM_ORDER", "-3", "EMU_RANDOM_ORDER=-3 is not a whole number"),
                               ("EMU_PROFILE", "yes", "EMU_PROFILE=yes is not a whole number in [0, 1]"),
                               ("EMU_GEMM", "avx9", "EMU_GEMM=avx9 is not one of avx512, avx2, generic"),
                               ("EMU_STREAMS", "lazy", "EMU_STREAMS=lazy is not 'immediate', 'deferred'"),
                               ("EMU_POISON", "2", "EMU_POISON=2: expected 0 or 1")]:
        p = run(BASE + ["--max-steps", "1", "--log-dir", logs], tmp, env={var: value})
        check(p.returncode == 2 and phrase in p.stderr and "Aborted" not in p.stderr,
              f"{var}={value}: refused at start, exit 2 ({p.returncode}: {p.stderr.strip()[-200:]})")
    check(nothing_in(logs), "refused flags and variables write nothing")


def plant_token(src, dst, position, token):
    raw = bytearray(open(src, "rb").read())
    struct.pack_into("<H", raw, 1024 + 2 * position, token)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    open(dst, "wb").write(raw)


def test_data_at_startup(tmp):
    """An out-of-vocabulary token in the validation tokens is found before anything is written
    (it used to be found at the final validation, after training, losing the checkpoint)."""
    logs, ck = os.path.join(tmp, "oovvlogs"), os.path.join(tmp, "oovvck")
    shard = os.path.join(tmp, "oovv", "val_000000.bin")
    plant_token(VAL_SHARD, shard, 1500, 50300)
    p = run(BASE + ["--val-files", os.path.join(tmp, "oovv", "*.bin"), "--save-checkpoint", ck, "--log-dir", logs], tmp)
    expect_fail(p, [f"the validation data: token id 50300 at token 1500 of shard {shard} (read by rank 0) is outside "
                    "the vocabulary [0, 50257)"], "an out-of-vocabulary validation token, at startup")
    check(nothing_in(logs) and nothing_in(ck), "nothing written: no log, no checkpoint")
    # on 2 ranks the token belongs to rank 1's half of the micro-step (1024 tokens each)
    p = run(BASE + ["--val-files", os.path.join(tmp, "oovv", "*.bin"), "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"token id 50300 at token 1500 of shard {shard} (read by rank 1)"], "the same on 2 ranks names rank 1")


def test_final_validation_keeps_checkpoint(tmp):
    """A validation that fails after training (an out-of-vocabulary token written into its second
    shard after the startup check read it, while the run trained) costs no checkpoint: the last
    step is saved before it is validated; the log ends with fail:."""
    d = os.path.join(tmp, "val2")
    os.makedirs(d)
    tokens = open(VAL_SHARD, "rb").read()
    first = bytearray(tokens[:1024 + 2 * 1500])  # room for no 2048-token micro-step: the second shard is read
    first[8:12] = struct.pack("<i", 1500)
    open(os.path.join(d, "v_000000.bin"), "wb").write(first)
    second = os.path.join(d, "v_000001.bin")
    shutil.copy(VAL_SHARD, second)
    logs, ck = os.path.join(tmp, "val2logs"), os.path.join(tmp, "val2ck")
    log = os.path.join(logs, "v2.txt")
    os.makedirs(ck)  # claimed by a run that died before saving anything: taken over
    open(os.path.join(ck, "run_id"), "w").write("ghost\n")
    e = dict(os.environ, EMU_WORKERS="2")
    p = subprocess.Popen([BINARY] + BASE + ["--val-files", os.path.join(d, "*.bin"), "--max-steps", "1",
                                            "--save-checkpoint", ck, "--log-dir", logs, "--run-id", "v2"],
                         cwd=tmp, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2400):  # the log exists: the startup checks have read the shards
        if os.path.exists(log) or p.poll() is not None:
            break
        time.sleep(0.02)
    with open(second, "r+b") as f:  # the first token the validation reads from it
        f.seek(1024)
        f.write(struct.pack("<H", 50300))
    out, err = p.communicate(timeout=300)
    phrase = f"token id 50300 at token 0 of shard {second} (read by rank 0) is outside the vocabulary"
    check(p.returncode != 0 and phrase in err, f"the final validation fails on the changed shard ({err.strip()[-300:]})")
    check(os.path.exists(os.path.join(ckpt_dir(ck, 1), "manifest.json")), "the step-1 checkpoint was saved before it")
    check(open(os.path.join(ck, "run_id")).read() == "v2\n", "the dead run's empty claim was taken over")
    check(last_line(log) == "fail: " + phrase + " [0, 50257)", f"the log ends with fail: ({last_line(log)})")


def test_outputs_belong_to_one_run(tmp, base, base_log):
    """A checkpoint directory belongs to the chain of runs that first saved in it; a resume is
    checked at startup (before its log) against what the checkpoint records."""
    logs = os.path.join(tmp, "ownlogs")
    step1 = ckpt_dir(base, 1)
    manifest = open(os.path.join(step1, "manifest.json")).read()
    # another run saving into base's directory, after it or while it runs: refused, both ids named
    for ranks in (1, 2):
        p = run(BASE + ["--max-steps", "1", "--save-checkpoint", base, "--log-dir", logs, "--run-id", f"other{ranks}"], tmp,
                ranks=ranks)
        expect_fail(p, [f"the checkpoint directory {base} holds the checkpoints of run base ({step1}/manifest.json); "
                        f"this run is other{ranks}"], f"another run's checkpoint directory on {ranks} rank(s)")
        check(p.stderr.count("holds the checkpoints") == 1 and "MPI_ABORT" not in p.stderr, "one message, no MPI_ABORT")
    check(nothing_in(logs) and open(os.path.join(step1, "manifest.json")).read() == manifest,
          "no log; base's checkpoint untouched")
    import fcntl
    with open(os.path.join(base, "run_id")) as held:  # as a live process of run base holds it
        check(held.read() == "base\n", "the directory names its run (run_id)")
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = run(BASE + ["--resume", step1, "--max-steps", "2", "--save-checkpoint", base, "--log-dir", logs], tmp)
        expect_fail(p, [f"the checkpoint directory {base} is in use by a running process of run base"],
                    "a second process saving into a directory in use")
    # resume errors, each before the log
    for args, phrases, what in [
            (["--resume", base], [f"cannot resume from {base}: it is a checkpoint root, not a step directory: resume from "
                                  f"one of {step1} (the last one saved: {step1})"], "a checkpoint root"),
            (["--resume", step1, "--max-steps", "0"], [f"its step 1 is beyond this run's last step 0: give --max-steps 1 or more"],
             "a step past the run"),
            (["--resume", step1, "--scheduled-steps", "20", "--mlp-kernel", "wgmma"],
             ["this run would not continue the run that saved it: scheduled_steps 30 in the checkpoint, 20 in this run; "
              "mlp_kernel mma in the checkpoint, wgmma in this run", "--resume-changed"], "a changed schedule and kernel"),
            (["--resume", step1, "--train-files", os.path.join(tmp, "changed", "*.bin")],
             ["train_shards tinyshakespeare_train_000000.bin:612680 in the checkpoint, c_000000.bin:612680 in this run",
              "train_data "], "changed training data"),
            (["--resume", step1, "--save-checkpoint", os.path.join(tmp, "later"), "--checkpoint-steps", "1,3"],
             ["--checkpoint-steps 1 would never be saved: this run resumes at step 1"], "a checkpoint step already passed"),
            (["--resume", step1, "--max-steps", "1", "--save-checkpoint", os.path.join(tmp, "later")],
             ["would save nothing: this run resumes at its last step 1"], "a save at the resumed last step"),
            (["--resume", step1, "--max-steps", "3", "--profile-steps", "0:1"],
             ["--profile-steps 0:1 starts before step 1, where this run resumes"], "a profile range before the resume")]:
        if "changed" in what:
            plant_token(TRAIN_SHARD, os.path.join(tmp, "changed", "c_000000.bin"), 7, 11)
        p = run(BASE + args + ["--log-dir", logs], tmp)
        expect_fail(p, phrases, what)
    p = run(BASE + ["--resume", step1, "--max-steps", "2", "--log-dir", logs], tmp, ranks=2)
    expect_fail(p, [f"cannot resume from {step1}: it was saved by preset tiny on 1 ranks; this run is preset tiny on 2"],
                "a resume on another world size")
    check(nothing_in(logs) and nothing_in(os.path.join(tmp, "later")), "resume errors: no log, nothing saved")

    # an accepted change: a WARNING in the log, the resumed run named in the header; on the CPU build
    # wgmma and mma give the same bits, so the val loss equals the uninterrupted run's
    resumed = os.path.join(tmp, "resumed")
    p = run(BASE + ["--resume", step1, "--max-steps", "2", "--mlp-kernel", "wgmma", "--resume-changed",
                    "--save-checkpoint", base, "--log-dir", tmp, "--run-id", "seg2"], tmp)
    expect_ok(p, "a resume with --resume-changed")
    log2 = os.path.join(tmp, "seg2.txt")
    text2 = open(log2).read()
    check("WARNING: resume: --resume-changed: mlp_kernel mma in the checkpoint, wgmma in this run" in text2,
          "the accepted change is a WARNING in the log")
    check(re.search(r"^run_id: seg2\nresumes: base step 1$", text2, re.M) is not None, "the header names the run it resumes")
    val = lambda t: re.search(r"^step:2/34 val_loss:(\S+) train_time:(\d+)ms", t, re.M)
    base_text = open(base_log).read()
    check(val(text2).group(1) == val(base_text).group(1), "the resumed run's val loss equals the uninterrupted run's")
    check(re.fullmatch(r"finished: steps 1\.\.2 of 34, train_time:\d+ms", last_line(log2)) is not None,
          f"a finished run's last line: {last_line(log2)}")
    check(re.search(r'"lineage":"base"', open(os.path.join(ckpt_dir(base, 2), "manifest.json")).read()) is not None,
          "the resume saved into its chain's directory, as run base's")
    # stats.py counts the resumed run once, over both segments: base's time at its step-1 save plus seg2's
    saved = int(re.search(r"^saved checkpoint \S+ step:1 train_time:(\d+)ms$", base_text, re.M).group(1))
    stats = [sys.executable, os.path.join(REPO, "scripts", "stats.py"), "--json"]
    p = subprocess.run(stats + [base_log, log2], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = {r["run_id"]: r["train_time_s"] for r in __import__("json").loads(p.stdout)["runs"]} if p.stdout else {}
    want = round((saved + int(val(text2).group(2))) / 1000, 3)
    check(got == {"seg2": want} and "an earlier segment of the resumed run seg2" in p.stderr,
          f"stats.py: seg2 counts {want} s over both segments ({got}; {p.stderr.strip()[-200:]})")
    p = subprocess.run(stats + [log2], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    check(p.returncode == 1 and "the log of its earlier segment, run base (its steps up to 1), is not among the logs" in p.stderr,
          f"stats.py without the first segment refuses to count it ({p.stderr.strip()[-200:]})")


def test_stop_signals(tmp):
    """SIGUSR1 (a scheduler's pre-emption notice) and SIGHUP (a closed terminal) end the log with
    the signal's name and kill the run as the signal would."""
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        logs = os.path.join(tmp, "stoplogs")
        log = os.path.join(logs, f"{sig.name}.txt")
        p = subprocess.Popen([BINARY] + BASE + ["--max-steps", "3", "--log-dir", logs, "--run-id", sig.name], cwd=tmp,
                             env=dict(os.environ, EMU_WORKERS="2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(1200):
            if (os.path.exists(log) and "\n" + "=" * 100 + "\n" in open(log).read()[-2000:]) or p.poll() is not None:
                break
            time.sleep(0.05)
        p.send_signal(sig)
        p.communicate(timeout=120)
        check(p.returncode == -sig and last_line(log) == f"fail: stopped by {sig.name}",
              f"{sig.name}: rc {p.returncode}, the log ends '{last_line(log)}'")


def main():
    tmp = tempfile.mkdtemp(prefix="failures_test_")
    try:
        timed(test_flags, tmp)
        timed(test_startup, tmp)
        timed(test_wgmma_guard, tmp)
        # the base run, started outside the repository: the default data is found relative to it
        base = os.path.join(tmp, "base")
        argv = [BINARY] + BASE + ["--max-steps", "2", "--save-checkpoint", base, "--checkpoint-steps", "1",
                                  "--log-dir", tmp, "--run-id", "base"]
        p = run(argv[1:], tmp)
        expect_ok(p, "a 2-step run started outside the repository")
        base_log = os.path.join(tmp, "base.txt")
        m = re.search(r"^step:2/34 train_time:(\d+)ms step_avg:(\S+)ms$", open(base_log).read(), re.M)
        check(m is not None and abs(float(m.group(2)) - int(m.group(1)) / 2) <= 1, "step_avg of a fresh run divides by 2 steps")
        test_header(base_log, argv)
        timed(test_log_full, tmp, base_log)
        timed(test_checkpoints, tmp, base)
        timed(test_nonfinite, tmp, base)
        timed(test_vocabulary, tmp)
        timed(test_signal, tmp)
        timed(test_two_ranks, tmp)
        timed(test_mode_flags, tmp)
        timed(test_data_at_startup, tmp)
        timed(test_outputs_belong_to_one_run, tmp, base, base_log)
        timed(test_final_validation_keeps_checkpoint, tmp)
        timed(test_stop_signals, tmp)
        slowest = sorted(RUN_SECONDS, key=lambda r: -r[0])[:8]
        print(f"time: {len(RUN_SECONDS)} trainer runs, {sum(r[0] for r in RUN_SECONDS):.1f} s; the slowest:", flush=True)
        for seconds, ranks, args in slowest:
            print(f"time:   {seconds:6.1f} s  {ranks} rank(s) {' '.join(args)[:160]}", flush=True)
    finally:
        for mnt in [os.path.join(tmp, "mnt")]:
            if os.path.ismount(mnt):
                subprocess.run(["umount", mnt])
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
