#!/usr/bin/env python3
"""Golden values of the tiny preset's training run from the independent PyTorch reference.

Starts from the C++ trainer's initial checkpoint (so both runs start from the same parameters),
builds exactly the batches the trainer sees (tests/data/ref_loader.py, a transcription of upstream's
loader, driven as upstream's training loop drives it) and asserts that every micro-batch fed here has
the CRC-32s the C++ side prints (train_gpt --dump-batches for training, dump_batches --val for
validation). Then it trains the schedule (torch_reference.Trainer, world size 1) and writes the
fixture JSON: the step-0 loss and gradient norms, every step's training loss, the validation losses,
the final parameters' norms, and every hyperparameter used.

  python3 tests/reference/make_golden.py        (from the repository root; see README.md here)

Needs torch (CPU) and the built C++ tools (build/train_gpt_cpu, build/dump_batches: `make cpu`).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

# glibc returns every large block to the kernel on free and faults it in again on the next
# allocation; the reference allocates (T, V) tensors per micro-batch, which doubles its run time.
# Keep the heap instead (the variables are read at process start, hence the re-exec).
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
if __name__ == "__main__" and sys.platform.startswith("linux") and any(k not in os.environ for k in _MALLOC_ENV):
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **_MALLOC_ENV})

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))

import torch  # noqa: E402

import ref_loader  # noqa: E402
import torch_reference as R  # noqa: E402

FORMAT = "train_gpt golden 1"
TRAIN_GLOB = "data/tinyshakespeare/tinyshakespeare_train_*.bin"  # the tiny preset's shards, from the repo root
VAL_GLOB = "data/tinyshakespeare/tinyshakespeare_val_*.bin"
Checksums = Dict[Tuple[int, int], Tuple[int, int, int, int]]  # (step, micro) -> crc32 of inputs, targets, bigram, cu


class GoldenError(Exception):
    pass


def parse_dump(text: str, what: str, rank: int = 0) -> Checksums:
    """The CRC-32s of one rank's micro-batches in data/dump.h's text (one section, train or val)."""
    header = re.search(r"^# (train|val) batches: world_size=(\d+) grad_accum=(\d+)", text, re.M)
    if not header or header.group(1) != what:
        raise GoldenError(f"the {what} dump has no '# {what} batches' header:\n{text[:500]}")
    if int(header.group(2)) != 1 or int(header.group(3)) != 8:
        raise GoldenError(f"the {what} dump is for world_size={header.group(2)} grad_accum={header.group(3)}, "
                          "want 1 and 8 (the reference runs one process)")
    out: Checksums = {}
    key = None
    for line in text.splitlines():
        m = re.match(r"step (\d+) micro (\d+) rank (\d+):", line)
        if m:
            key = (int(m.group(1)), int(m.group(2))) if int(m.group(3)) == rank else None
            continue
        m = re.match(r"\s+crc32 inputs (\w{8}) targets (\w{8}) bigram (\w{8}) cu_seqlens (\w{8})", line)
        if m and key is not None:
            out[key] = tuple(int(g, 16) for g in m.groups())
    if not out:
        raise GoldenError(f"no micro-batch checksums in the {what} dump")
    return out


def run(cmd: List[str], what: str) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise GoldenError(f"{what} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


class CheckedBatches:
    """Micro-batches from ref_loader, each checked against the C++ side's checksums."""

    def __init__(self, expected, what: str):
        """expected None: nothing to check against (tiny-r80 without a C++ dump)."""
        self.expected, self.what, self.checked = expected, what, 0

    def take(self, raw: dict, step: int, micro: int) -> R.Batch:
        b = R.Batch.from_lists(raw["inputs"], raw["targets"], raw["cu"], raw["bigram"])
        if self.expected is None:
            return b
        got = tuple(ref_loader.crc(t.tolist()) for t in (b.inputs, b.targets, b.bigram, b.cu_seqlens))
        want = self.expected.get((step, micro))
        if want is None:
            raise GoldenError(f"the {self.what} dump has no step {step} micro {micro}")
        if got != want:
            raise GoldenError(f"{self.what} step {step} micro {micro}: checksums {['%08x' % x for x in got]} differ "
                              f"from the C++ loader's {['%08x' % x for x in want]}")
        self.checked += 1
        return b


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def initial_checkpoint(args, tmp: str) -> str:
    if args.checkpoint:
        return args.checkpoint
    run([args.trainer, "--preset", args.trainer_preset, "--seed", str(args.seed), "--max-steps", "0",
         "--val-every", "0",
         "--save-checkpoint", os.path.join(tmp, "ckpt"), "--checkpoint-steps", "0", "--log-dir", tmp,
         "--run-id", "golden-init"], "the trainer (initial checkpoint)")
    path = os.path.join(tmp, "ckpt", "step000000", "rank0.safetensors")
    if not os.path.exists(path):
        raise GoldenError(f"the trainer wrote no {path}")
    return path


def schedule_table(tr: R.Trainer, steps: int) -> List[dict]:
    s = tr.schedule
    rows = []
    for step in range(steps + 1):
        ws = s.windows(step)
        rows.append(dict(step=step, lr=s.lr(step), muon_momentum=s.muon_momentum(step),
                         mtp_weights=s.mtp_weights(step).tolist(), ws_short=ws[0], ws_long=ws[1],
                         batch_tokens=s.batch_tokens(step), adam=R.Schedule.is_adam_step(step)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", default="build/train_gpt_cpu", help="the C++ trainer (CPU build), run in the repo root")
    p.add_argument("--dump-tool", default="build/dump_batches", help="the C++ batch dump tool (validation batches)")
    p.add_argument("--checkpoint", help="initial checkpoint (rank0.safetensors); default: made by --trainer")
    p.add_argument("--train-dump", help="file with the trainer's --dump-batches text; default: run --trainer")
    p.add_argument("--val-dump", help="file with dump_batches --val text; default: run --dump-tool")
    p.add_argument("--seed", type=int, default=1337, help="the trainer's --seed for the initial checkpoint")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the whole schedule)")
    p.add_argument("--scheduled-steps", type=int, default=None, help="passed to the trainer too")
    p.add_argument("--extension-steps", type=int, default=None, help="passed to the trainer too")
    p.add_argument("--val-every", type=int, default=10, help="validate every N steps and at the last step")
    p.add_argument("--val-tokens", type=int, default=None, help="validation tokens (the trainer's flag)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: reproducible sums, and fastest on a "
                                                           "busy machine)")
    p.add_argument("--preset", choices=("tiny", "tiny-r80", "tiny-r84", "tiny-r84-prefix", "tiny-r84-fp8down",
                                        "tiny-r86", "tiny-r89"),
                   default="tiny",
                   help="tiny: record 71's twin; tiny-r80, tiny-r84: records 80's and 84's twins; tiny-r84-prefix: "
                        "tiny-r84 with record 88's prefix-token loss; tiny-r84-fp8down: with record 89's FP8 MLP "
                        "down-projection; tiny-r86: records 85-86's twin (the MUDD gate, DC-MHA); tiny-r89: "
                        "tiny-r86 with records 87-89 (the post-only MLP backward, the prefix-token loss, the FP8 "
                        "down-projection) "
                        "(tests/reference/README.md). Each starts from the C++ trainer's step-0 checkpoint (or "
                        "--checkpoint; tiny-r84 takes its bigram sign table from it too) and checks its batches")
    p.add_argument("--trainer-preset", default=None,
                   help="the trainer's preset for the step-0 checkpoint and --dump-batches (default: --preset), for a "
                        "preset the trainer does not have yet whose parameters and batches are another's (e.g. "
                        "tiny-r84-fp8down from tiny-r84's: the FP8 down-projection changes neither)")
    p.add_argument("--write-init", help="tiny-r80, tiny-r84: start from this reference's own seeded init (--seed) "
                                        "instead of the trainer's, and write it to this safetensors file; the batches "
                                        "are then ref_loader's, checked only against dumps given with "
                                        "--train-dump/--val-dump")
    p.add_argument("--out", default=None, help="default: tests/reference/fixtures/tiny_golden.json, or "
                                               "tiny_r80_golden.json / tiny_r84_golden.json for those presets")
    args = p.parse_args(argv)
    if args.write_init and (args.preset == "tiny" or args.checkpoint):
        print("make_golden: error: --write-init saves the reference's own init, used only for --preset tiny-r80 "
              "or tiny-r84 without --checkpoint", file=sys.stderr)
        return 1
    args.trainer_preset = args.trainer_preset or args.preset
    if args.out is None:
        name = {"tiny": "tiny_golden.json", "tiny-r80": "tiny_r80_golden.json",
                "tiny-r84": "tiny_r84_golden.json", "tiny-r84-prefix": "tiny_r84_prefix_golden.json",
                "tiny-r84-fp8down": "tiny_r84_fp8down_golden.json", "tiny-r86": "tiny_r86_golden.json",
                "tiny-r89": "tiny_r89_golden.json"}[args.preset]
        args.out = os.path.join("tests", "reference", "fixtures", name)
    try:
        return generate(args)
    except (GoldenError, ValueError, OSError, ref_loader.LoaderError) as e:
        print(f"make_golden: error: {e}", file=sys.stderr)
        return 1


def generate(args) -> int:
    torch.set_num_threads(args.threads)
    cfg = R.PRESETS[args.preset]()
    has_trainer = not args.write_init  # the C++ trainer's step-0 parameters and batches (else the reference's own)
    cfg.val_loss_every = args.val_every
    schedule_flags = []
    if args.scheduled_steps is not None:
        cfg.scheduled_iterations = args.scheduled_steps
        schedule_flags += ["--scheduled-steps", str(args.scheduled_steps)]
    if args.extension_steps is not None:
        cfg.extension_iterations = args.extension_steps
        schedule_flags += ["--extension-steps", str(args.extension_steps)]
    if args.val_tokens is not None:
        if args.val_tokens <= 0 or args.val_tokens % cfg.val_batch_tokens:
            raise GoldenError(f"--val-tokens must be a positive multiple of {cfg.val_batch_tokens}")
        cfg.val_tokens = args.val_tokens
    total = cfg.total_steps
    steps = total if args.steps is None else args.steps
    if not 0 <= steps <= total:
        raise GoldenError(f"--steps must be in 0..{total}")
    train_files = sorted(glob.glob(os.path.join(ROOT, TRAIN_GLOB)))
    val_files = sorted(glob.glob(os.path.join(ROOT, VAL_GLOB)))
    if not train_files or not val_files:
        raise GoldenError("the Tiny Shakespeare shards are missing from data/tinyshakespeare/")

    with tempfile.TemporaryDirectory() as tmp:
        if has_trainer or args.checkpoint:
            ckpt_path = initial_checkpoint(args, tmp)
        else:
            ckpt_path = args.write_init or os.path.join(tmp, "init.safetensors")
            init = {"param." + n: t for n, t in R.init_params(cfg, args.seed).items()}
            if cfg.bigram_sign_rows:
                init["buffer.bigram_signs"] = R.random_sign_table(cfg, args.seed)
            R.write_safetensors(ckpt_path, init,
                                dict(format="torch_reference init", preset=args.preset, step=0, seed=args.seed,
                                     made_by=f"torch_reference.init_params({args.preset} config, seed={args.seed})"))
        tensors, meta = R.read_safetensors(ckpt_path, prefix=("param.", "buffer."))
        ckpt_hash = sha256(ckpt_path)
    want_preset = args.trainer_preset if has_trainer or args.checkpoint else args.preset
    if meta.get("preset", want_preset) != want_preset or meta.get("step", "0") != "0":
        raise GoldenError(f"{ckpt_path} is preset {meta.get('preset')} step {meta.get('step')}, "
                          f"want {want_preset} step 0")
    params = R.params_from_checkpoint(cfg, tensors)
    signs = R.bigram_signs_from_checkpoint(cfg, tensors)  # None unless the config has a sign table
    if not torch.equal(params["embed"], params["lm_head"].t()):
        raise GoldenError("the checkpoint's embed is not lm_head^T (they start tied)")

    train_sums = CheckedBatches(None, "train")
    if steps > 0 and (has_trainer or args.train_dump):
        dump_cmd = [args.trainer, "--preset", args.trainer_preset, *schedule_flags, "--dump-batches", str(steps)]
        train_text = open(args.train_dump).read() if args.train_dump else run(dump_cmd, "the trainer's --dump-batches")
        train_sums = CheckedBatches(parse_dump(train_text, "train"), "train")
    val_micro = cfg.grad_accum * cfg.val_tokens // cfg.val_batch_tokens
    val_sums = CheckedBatches(None, "val")
    if has_trainer or args.val_dump:
        val_text = open(args.val_dump).read() if args.val_dump else run(
            [args.dump_tool, "--val", "--files", VAL_GLOB, "--world-size", "1", "--grad-accum", str(cfg.grad_accum),
             "--batch-tokens", str(cfg.val_batch_tokens), "--bigram-vocab", str(cfg.bigram_vocab),
             "--batches", str(val_micro // cfg.grad_accum)], "dump_batches --val")
        val_sums = CheckedBatches(parse_dump(val_text, "val"), "val")

    tr = R.Trainer(cfg, params, signs)
    docs_rule = None if cfg.max_num_docs_table is None else (lambda n: R.max_num_docs(cfg, n))
    seq_len = tr.schedule.train_max_seq_len(0)
    train_gen = ref_loader.generator(train_files, 0, 1, cfg.stages[0].batch_tokens, seq_len, cfg.grad_accum,
                                     True, cfg.bigram_vocab, max_num_docs=docs_rule)
    started, batch_tokens = False, cfg.stages[0].batch_tokens
    result = dict(format=FORMAT, preset=args.preset, steps=steps, step0_loss=None, step0_grad_norms=None,
                  train_losses=[],
                  val_losses={})
    t_start = time.time()
    for step in range(steps + 1):
        tr.advance(step)
        if step == steps or (args.val_every > 0 and step % args.val_every == 0):
            if step == total:
                tr.apply_final_window_extension()
            gen = ref_loader.generator(val_files, 0, 1, cfg.val_batch_tokens, -1, cfg.grad_accum, False,
                                       cfg.bigram_vocab, max_num_docs=docs_rule)
            batches = [val_sums.take(next(gen), i // cfg.grad_accum, i % cfg.grad_accum) for i in range(val_micro)]
            result["val_losses"][str(step)] = tr.evaluate(batches)
            print(f"step:{step}/{total} val_loss:{result['val_losses'][str(step)]:.4f} ({time.time() - t_start:.0f} s)",
                  file=sys.stderr, flush=True)
        if step == steps:
            break
        send = None  # upstream's advance_schedule: re-sent when the batch size or (r80) the cut length changes
        if tr.schedule.batch_tokens(step) != batch_tokens or tr.schedule.train_max_seq_len(step) != seq_len:
            batch_tokens, seq_len = tr.schedule.batch_tokens(step), tr.schedule.train_max_seq_len(step)
            send = (batch_tokens, seq_len, cfg.grad_accum)
        micro = []
        for i in range(cfg.grad_accum):
            raw = train_gen.send(send) if started else next(train_gen)
            started = True
            micro.append(train_sums.take(raw, step, i))
        loss_sum = tr.accumulate_gradients(micro)
        if step == 0:
            result["step0_loss"] = loss_sum / batch_tokens
            result["step0_grad_norms"] = tr.grad_norms()
        tr.optimizer_step(step)
        result["train_losses"].append(loss_sum / batch_tokens)
        print(f"step:{step + 1}/{total} train_loss:{result['train_losses'][-1]:.4f} ({time.time() - t_start:.0f} s)",
              file=sys.stderr, flush=True)
    result["final_param_norms"] = tr.param_norms()
    result["hyperparameters"] = dict(
        config=cfg.to_json(), split_step=tr.schedule.split_step, stage_boundaries=tr.schedule.boundaries,
        transition_steps=tr.schedule.transition_steps(), schedule=schedule_table(tr, steps),
        param_table={n: dict(label=R.LABELS.get(n, n), optim=o, adam_betas=b, lr_mul=lm, wd_mul=wm)
                     for n, (o, b, lm, wm) in R.optimizer_table(cfg).items()},
        normuon_lr_muls={n: tr.optimizer.lr_muls(n) for n, row in R.optimizer_table(cfg).items()
                         if row[0] == "normuon"})
    result["source"] = dict(
        checkpoint_metadata=meta, checkpoint_sha256=ckpt_hash, torch=torch.__version__, threads=args.threads,
        train_files=[os.path.relpath(f, ROOT) for f in train_files],
        val_files=[os.path.relpath(f, ROOT) for f in val_files],
        micro_batches_checked=dict(train=train_sums.checked if steps > 0 else 0, val=val_sums.checked),
        seconds=round(time.time() - t_start, 1))
    if args.preset != "tiny":  # (record 71's fixture keeps its keys)
        result["source"]["initial_parameters"] = (
            f"checkpoint {args.checkpoint}" if args.checkpoint else
            f"the trainer's step-0 checkpoint (--preset {args.trainer_preset} --seed {args.seed}), its batches checked"
            if has_trainer else
            f"torch_reference.init_params({args.preset} config, seed={args.seed}) (--write-init): the reference's own "
            "step-0 parameters, the batches ref_loader's with the preset's rules, unchecked")
    if signs is not None:  # (the sign table is the checkpoint's buffer.bigram_signs)
        result["source"]["bigram_signs"] = dict(
            key="buffer.bigram_signs", shape=list(signs.shape), plus_ones=int((signs.float() > 0).sum()),
            sha256=hashlib.sha256(signs.view(torch.int16).numpy().tobytes()).hexdigest())
    out = args.out if os.path.isabs(args.out) else os.path.join(ROOT, args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp_out = out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp_out, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
