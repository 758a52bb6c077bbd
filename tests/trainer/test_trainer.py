#!/usr/bin/env python3
"""End-to-end tests of train_gpt_cpu on the tiny preset (Tiny Shakespeare), under emu.

A short schedule (--scheduled-steps 6 --extension-steps 2: stage changes at steps 2, 4 and 6, the
YaRN update at 2, Adam steps 1, 3, 5, 7, the untie at step 5) is trained on 1 rank (grad_accum 8),
2 ranks (the MLP on its Hopper kernel, --mlp-kernel wgmma) and 8 ranks (sparse bigram comms, with
upstream's warm-up, under emu's deferred streams in a random order), with checkpoints at steps 0 (1 rank
only), 1, 2, 4, 5, 6 and 8. Checked:
  - the pinned bits: every checkpoint tensor at steps 2, 4, 5, 6 and 8 and every training loss equal
    to tests/trainer/fixtures/schedule_bits.json (test_schedule_bits.py's runs; the 8-rank one under
    its DEFERRED streams, where a missing event between streams changes bits or is reported as a race,
    so schedule_bits has no CTest test of its own);
  - the log: starts with the program's source, then lines in upstream's exact format; the
    validation loss falls;
  - tying: before the split embed == lm_head^T after every Adam step, and right after the split
    embed's Adam moments are lm_head's transposed (gathered from all ranks' shards); after the
    next Adam step they differ;
  - world sizes: 1, 2 and 8 ranks train the same model up to reduction order (tolerances below);
  - the golden values of the independent PyTorch reference (tests/reference/fixtures/
    tiny_golden.json, made by tests/reference/make_golden.py with this schedule): step 0's loss and
    gradient norms, every step's training loss, the validation losses and the final parameters'
    norms, on 1 rank and (the trajectory; 8 ranks validate at steps 0 and 8 only) on 8 ranks;
  - the checkpoint layout: the 1-rank run's rank files at steps 1 and 2 list their tensors and metadata
    keys as tests/trainer/fixtures/checkpoint_layout_d302bc7.txt (test_checkpoint_layout.py's check,
    which CTest makes here);
  - resume: 1 rank resumed from step 4 to 8 equals the uninterrupted run bit for bit;
  - failures: a NaN planted in a checkpoint stops the resumed run naming the step and the
    parameter group; bad flags and missing data give a clear message and a non-zero exit (the
    other bad inputs and faults: test_failures.py).
Usage: test_trainer.py TRAIN_GPT_CPU MPIRUN... (the mpirun command line as CTest runs it)
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.environ["REPO"]
sys.path.insert(0, os.path.join(REPO, "scripts"))
import read_checkpoint  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_schedule_bits  # noqa: E402
import test_checkpoint_layout  # noqa: E402

BINARY = sys.argv[1]
MPIRUN = sys.argv[2:]
SCHEDULE = ["--preset", "tiny", "--scheduled-steps", "6", "--extension-steps", "2", "--val-every", "4",
            "--val-tokens", "4096", "--checkpoint-steps", "0,1,2,4,5,6,8", "--log-train-loss", "--log-grad-norms"]
# Each world size's own flags: those of test_schedule_bits.py's default-mode run of that size, whose
# fixture these runs are checked against (the MLP's Hopper kernel and the warm-up give the same bits
# under emu as the default kernel and no warm-up: the fixture holds one entry per rank count).
WORLD_FLAGS = {1: ["--warmup", "0"], 2: ["--warmup", "0", "--mlp-kernel", "wgmma"], 8: ["--warmup", "1"]}
TOTAL = 8
# The steps each world size validates at: 2 and 8 ranks at the first and last only (--val-every 8; a validation costs
# 19 s on 8), compared with 1 rank's and the golden run's there
VAL_STEPS = {1: (0, 4, TOTAL), 2: (0, TOTAL), 8: (0, TOTAL)}
SPLIT = 5  # start of stage 2 (step 4) | 1
TIED = ("param.embed", "param.lm_head")
MUON = ("param.attn", "param.mlp")  # the NorMuon groups

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


# A 1-rank run's emu workers: EMU_WORKERS where the caller sets it, else 2. CTest sets 1: under ctest -j 2 another
# test keeps the second core busy, and a second worker costs a run a fifth more CPU (two tiny-r89 runs side by side:
# 65 s with 2 workers each, 58 s with 1). Ranks of a multi-rank run have one each.
ONE_RANK_WORKERS = os.environ.get("EMU_WORKERS", "2")


def validating_once(args):
    """A copy of args that validates once, at the run's end, on 2048 tokens: for runs whose validation losses no
    check reads (validation changes no bit of the training)."""
    args = list(args)
    args[args.index("--val-every") + 1] = "0"
    args[args.index("--val-tokens") + 1] = "2048"
    return args


def run(args, ranks=1, expect_ok=True, env=None):
    cmd = ([BINARY] if ranks == 1 else MPIRUN + ["-np", str(ranks), "-x", "EMU_WORKERS=1"] +
           [x for k in (env or {}) for x in ("-x", k)] + [BINARY]) + args
    e = dict(os.environ, EMU_WORKERS=ONE_RANK_WORKERS if ranks == 1 else "1", **(env or {}))
    started = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    print(f"time: {time.time() - started:.1f} s, {ranks} rank(s) {' '.join(args)[:120]}", flush=True)
    if expect_ok and p.returncode != 0:
        sys.exit(f"train_gpt failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def tensors(path, names=None, prefix=None):
    """(meta, {name: float64 array}) of a checkpoint's tensors: every one, or only those in NAMES or whose
    name starts with PREFIX, read alone (a tiny rank file is 0.5 to 1.2 GB: reading and widening all of it
    for the one or two tensors a check looks at was a minute of this test's own time)."""
    meta, infos = read_checkpoint.read_header(path)
    wanted = [n for n in infos if (names is None or n in names) and (prefix is None or n.startswith(prefix))]
    out = {}
    with open(path, "rb") as f:
        for n in wanted:
            info = infos[n]
            f.seek(info["offset"])
            raw = f.read(info["bytes"])
            if len(raw) != info["bytes"]:
                sys.exit(f"checkpoint {path} shrank while tensor {n} was read")
            out[n] = read_checkpoint.to_numpy(info["dtype"], info["shape"], raw).astype(np.float64)
    return meta, out


def ckpt(root, step, rank=0):
    return os.path.join(root, f"step{step:06d}", f"rank{rank}.safetensors")


def gathered(root, step, ranks, name):
    """A sharded state tensor reassembled from every rank's file (shards split dim 0)."""
    return np.concatenate([tensors(ckpt(root, step, r), (name,))[1][name] for r in range(ranks)], axis=0)


STEP_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\d+\.\d\d)ms$")
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\d+\.\d{4}) train_time:(\d+)ms step_avg:(\d+\.\d\d)ms$")
PEAK_LINE = re.compile(r"^peak memory allocated: \d+ MiB reserved: \d+ MiB$")


def check_log(path, label, val_steps=(0, 4, 8)):
    text = open(path).read()
    check(text.startswith("-" * 100 + "\n// train_gpt.cu\n"), f"{label}: the log starts with train_gpt.cu's source")
    check("// kernels/attention.cuh" in text and "// data/loader.h" in text, f"{label}: the log holds the headers")
    lines = text.splitlines()
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    vals = [(int(m.group(1)), float(m.group(3))) for m in map(VAL_LINE.match, lines) if m]
    check(steps == list(range(1, TOTAL + 1)), f"{label}: one step line per step in upstream's format")
    check([s for s, _ in vals] == list(val_steps), f"{label}: validation at steps {list(val_steps)}")
    check(all(b < a for (_, a), (_, b) in zip(vals, vals[1:])), f"{label}: validation loss falls {vals}")
    check(any(PEAK_LINE.match(l) for l in lines), f"{label}: the peak memory line")
    return vals


def check_layout(root):
    """test_checkpoint_layout.py's check on the 1-rank run's saves at steps 1 and 2 (an odd step, which
    holds Adam's pending gradients, and an even one): their rank files' tensor list (name, dtype, shape,
    bytes, in data order) and metadata keys byte-identical to the fixture listed by main at d302bc7, so
    checkpoints from before the optimizer-state registry load. (This schedule's saves list the same as
    that script's 2-step run of the default schedule; CTest makes the check here, on saves this test
    makes anyway, instead of training a run of its own for it.)"""
    got, want = test_checkpoint_layout.listing(root), open(test_checkpoint_layout.FIXTURE).read()
    diff = [f"\n     got  {g!r}\n     want {w!r}" for g, w in zip(got.splitlines() + [""] * len(want.splitlines()),
                                                               want.splitlines() + [""] * len(got.splitlines())) if g != w]
    check(not diff, f"1 rank: the rank files of steps {test_checkpoint_layout.STEPS} list their tensors and metadata keys "
                    f"exactly as {os.path.relpath(test_checkpoint_layout.FIXTURE, REPO)}" + "".join(diff[:10]))


# Checkpoint group labels -> the reference's parameter names.
GOLDEN_NAMES = {"attn": "attn_bank", "mlp": "mlp_bank", "value_embed": "value_embeds"}


def check_golden(runs, logs):
    """The trainer against the PyTorch reference's golden run of this schedule. Tolerances: bf16
    activations and reduction order put ~1e-4 of relative noise in the per-token losses (observed
    2.2e-4 at most): the losses must agree to 1e-3 relative; step 0's gradient norms of the big
    tensors to 3% (observed below 0.1%), those of the lambdas and 12-wide gates (each a dot product
    over every token of a bf16 stream gradient, which cancels) to 15% (observed 2% on this preset,
    10% on earlier ones, the spread the model test sees against its double-precision reference),
    plus 1e-6 for the exactly zero ones; the final parameters' norms to 2% (observed below 0.4%),
    those of the lambdas and gates to 15%: Adam normalizes their noisy gradients, so an element whose
    gradient flips sign between steps moves by a full step either way (observed up to 4.6%,
    smear_gate's 12 elements)."""
    golden = json.load(open(os.path.join(REPO, "tests", "reference", "fixtures", "tiny_golden.json")))
    check(golden["steps"] == TOTAL and golden["hyperparameters"]["config"]["scheduled_iterations"] == 6,
          "the golden fixture was made for this schedule")
    want_train = np.array(golden["train_losses"])
    want_val = {int(k): v for k, v in golden["val_losses"].items()}
    for ranks in (1, 8):
        text = logs[ranks]
        got_train = np.array([float(v) for v in re.findall(r"^step:\d+/\d+ train_loss:(\S+)$", text, re.M)])
        got_val = {int(a): float(b) for a, b in re.findall(r"^step:(\d+)/\d+ val_loss:(\S+) ", text, re.M)}
        rel = np.abs(got_train - want_train) / want_train if got_train.shape == want_train.shape else [np.inf]
        check(np.max(rel) <= 1e-3, f"{ranks} rank(s): training losses match the reference (max relative {np.max(rel):.1e})")
        check(sorted(got_val) == list(VAL_STEPS[ranks]) and
              all(abs(got_val[k] - want_val[k]) <= 1e-3 * want_val[k] for k in got_val),
              f"{ranks} rank(s): validation losses {got_val} match the reference {want_val}")
    lines = re.findall(r"^step:1/\d+ grad_norms (.*)$", logs[1], re.M)
    norms = dict(kv.split(":") for kv in lines[0].split()) if lines else {}
    check(len(norms) == 12, "step 0's gradient norms are logged for the 12 parameter groups")
    small = {"scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank", "x0_lambdas"}
    for label, value in norms.items():
        want = golden["step0_grad_norms"][GOLDEN_NAMES.get(label, label)]
        tol = 0.15 if label in small else 0.03
        check(abs(float(value) - want) <= tol * want + 1e-6,
              f"step 0 gradient norm of {label}: {value} vs {want:.6e} (tolerance {tol:.0%})")
    check_final_norms(tensors(ckpt(runs[1], TOTAL), prefix="param.")[1], golden, GOLDEN_NAMES, small)


def check_final_norms(final, golden, names, small):
    """Each parameter's norm in a checkpoint's tensors against the golden run's: 2%, the small groups 15%."""
    for name, t in final.items():
        if name.startswith("param."):
            label = name[len("param."):]
            want = golden["final_param_norms"][names.get(label, label)]
            got = float(np.linalg.norm(t))
            tol = 0.15 if label in small else 0.02
            check(abs(got - want) <= tol * want + 1e-6, f"final norm of {label}: {got:.6e} vs {want:.6e} (tolerance {tol:.0%})")


def main():
    tmp = tempfile.mkdtemp(prefix="trainer_test_")
    try:
        runs, stdouts = {}, {}
        for ranks in (1, 2, 8):
            root = os.path.join(tmp, f"np{ranks}")
            # 8 ranks under deferred random-order streams (schedule_bits' DEFERRED), with the warm-up: one run
            # pins both the 8-rank bits and the schedule's events (a missing one changes bits or is reported)
            # (step 0's save is read on 1 rank only: the others' parameters are compared from step 1)
            args = list(SCHEDULE)
            if ranks != 1:
                args[args.index("--checkpoint-steps") + 1] = "1,2,4,5,6,8"
            if VAL_STEPS[ranks] == (0, TOTAL):
                args[args.index("--val-every") + 1] = str(TOTAL)
            p = run(args + WORLD_FLAGS[ranks] + ["--run-id", f"np{ranks}", "--log-dir", tmp, "--save-checkpoint", root],
                    ranks, env=test_schedule_bits.DEFERRED if ranks == 8 else None)
            runs[ranks], stdouts[ranks] = root, p.stdout
            check_log(os.path.join(tmp, f"np{ranks}.txt"), f"{ranks} rank(s)", VAL_STEPS[ranks])
        for ok, what in test_schedule_bits.check_default_runs({n: (runs[n], stdouts[n]) for n in runs}):
            check(ok, what)
        check_layout(runs[1])

        # tying, on every world size: embed == lm_head^T through the split step, then they part
        for ranks, root in runs.items():
            for step in (2, 4, 6):
                _, t = tensors(ckpt(root, step), TIED)
                check(np.array_equal(t["param.embed"], t["param.lm_head"].T),
                      f"{ranks} rank(s): embed == lm_head^T at step {step}")
            for key in ("exp_avg", "exp_avg_sq"):
                lm = gathered(root, SPLIT + 1, ranks, f"{key}.lm_head")
                em = gathered(root, SPLIT + 1, ranks, f"{key}.embed")
                check(np.array_equal(em, lm.T), f"{ranks} rank(s): embed's {key} is lm_head's transposed after the split")
            meta, _ = tensors(ckpt(root, SPLIT + 1), ())
            check(meta["adam_steps.embed"] == meta["adam_steps.lm_head"] == "3", f"{ranks} rank(s): embed takes lm_head's Adam step count")
            _, t = tensors(ckpt(root, TOTAL), TIED)
            check(not np.array_equal(t["param.embed"], t["param.lm_head"].T), f"{ranks} rank(s): untied after step {SPLIT + 2}")

        # world sizes: the same training up to reduction order. Gradients are summed in a different
        # order on each rank count (one rank's bf16 accumulation of 8 micro-steps; bf16 all-reduce,
        # reduce-scatter and the sparse merge), so they differ by bf16 rounding, and:
        #  - the losses follow the same trajectory: every step's training loss and the validation
        #    losses at the steps both validated at agree to 0.1% (observed: 1e-5);
        #  - NorMuon's first update (step 0, before any feedback) agrees to 20% of its size (observed
        #    about 7%): Polar Express pushes every singular value toward 1 with a slope far above 1
        #    near 0, so rounding-level differences in the gradient's small singular directions
        #    become large there; a wrong shard, scale or lr multiplier differs by 100% or more;
        #  - Adam's first update (step 1) is lr * sign(g) per element, so only elements whose
        #    gradient is within rounding of zero may step the other way: at most 1% of the moved
        #    elements may differ by more than 1% of their step (observed: at most 0.13%).
        logs = {n: open(os.path.join(tmp, f"np{n}.txt")).read() for n in runs}
        def losses(text):
            train = np.array([float(v) for v in re.findall(r"^step:\d+/\d+ train_loss:(\S+)$", text, re.M)])
            return train, {int(a): float(b) for a, b in re.findall(r"^step:(\d+)/\d+ val_loss:(\S+) ", text, re.M)}
        _, p0 = tensors(ckpt(runs[1], 0), MUON)
        _, p1 = tensors(ckpt(runs[1], 1), prefix="param.")
        _, p2 = tensors(ckpt(runs[1], 2), prefix="param.")
        one_train, one_val = losses(logs[1])
        for ranks in (2, 8):
            train, val = losses(logs[ranks])
            rel = np.abs(one_train - train) / one_train if one_train.shape == train.shape == (TOTAL,) else [np.inf]
            val_rel = [abs(val[k] - one_val[k]) / one_val[k] for k in VAL_STEPS[ranks] if k in val and k in one_val]
            check(np.max(rel) <= 1e-3 and len(val_rel) == len(VAL_STEPS[ranks]) and max(val_rel) <= 1e-3,
                  f"{ranks} ranks vs 1: training and validation losses agree to 0.1% (max {np.max(rel):.1e}, "
                  f"validation at {list(VAL_STEPS[ranks])} {max(val_rel, default=np.inf):.1e})")
            _, q1 = tensors(ckpt(runs[ranks], 1), MUON)
            for name in MUON:
                rel = np.linalg.norm(q1[name] - p1[name]) / np.linalg.norm(p1[name] - p0[name])
                check(rel <= 0.2, f"{ranks} ranks vs 1: NorMuon's first update of {name} differs by {rel:.1%} of its size")
            _, q2 = tensors(ckpt(runs[ranks], 2), prefix="param.")
            for name in sorted(n for n in p2 if n.startswith("param.") and n not in MUON):
                step = np.abs(p2[name] - p1[name])
                moved = step > 0
                if not moved.any():
                    continue
                frac = float(np.mean(np.abs(q2[name] - p2[name])[moved] > 0.01 * step[moved]))
                check(frac <= 0.01, f"{ranks} ranks vs 1: Adam's first update of {name}: {frac:.3%} of elements differ")

        check_golden(runs, logs)

        # resume: steps 4..8 from the step-4 checkpoint equal the straight run bit for bit. It validates
        # once, at its end, on 2048 tokens (its validation losses are not read; validation changes no bit
        # of the training, and a resume does not check the validation flags)
        resumed = os.path.join(tmp, "resumed")
        run(validating_once(SCHEDULE) + ["--run-id", "resumed", "--log-dir", tmp, "--save-checkpoint", resumed, "--checkpoint-steps", "8",
                         "--resume", os.path.dirname(ckpt(runs[1], 4))])
        # (each tensor's dtype, shape and bytes compared as stored: bitwise, without widening 1 GB to float64)
        _, a = read_checkpoint.load(ckpt(runs[1], TOTAL))
        _, b = read_checkpoint.load(ckpt(resumed, TOTAL))
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        check(a.keys() == b.keys() and not differ,
              f"resume from step 4 equals the uninterrupted run at step 8 (every tensor, bitwise){' differ: ' if differ else ''}"
              + " ".join(differ[:8]))

        # a NaN planted in lm_head stops the run at the next step, naming it
        bad = os.path.join(tmp, "bad", "step000002")
        os.makedirs(bad)
        src = ckpt(runs[1], 2)
        raw = bytearray(open(src, "rb").read())
        _, infos = read_checkpoint.read_header(src)
        info = infos["param.lm_head"]
        start = info["offset"]
        raw[start:start + 2] = b"\xc0\x7f"  # bf16 NaN
        open(os.path.join(bad, "rank0.safetensors"), "wb").write(raw)
        # (the edited file no longer matches the manifest, so the copy has none: --resume-unverified)
        # (and no --checkpoint-steps: they need --save-checkpoint and must lie within the run)
        at = SCHEDULE.index("--checkpoint-steps")
        no_saves = SCHEDULE[:at] + SCHEDULE[at + 2:]
        p = run(no_saves + ["--run-id", "nan", "--log-dir", tmp, "--resume", bad, "--resume-unverified", "--max-steps", "3"],
                expect_ok=False)
        check(p.returncode != 0 and "NaN at step 3" in p.stderr and "lm_head" in p.stderr,
              f"a NaN stops the run naming the step and the group: {p.stderr.strip()[-200:]}")

        # bad input: a clear message and a non-zero exit, nothing written
        for args, phrase in [(["--no-such-flag"], "unknown argument"), (["--val-every", "x"], "--val-every needs an integer"),
                             (["--preset", "huge"], "unknown preset"), (["--preset", "tiny", "--val-tokens", "100"], "multiple of the validation batch"),
                             (["--preset", "tiny", "--train-files", "/nonexistent/*.bin"], "/nonexistent/*.bin"),
                             (["--preset", "tiny", "--resume", os.path.join(tmp, "nowhere")], "cannot resume")]:
            p = run(args + ["--log-dir", os.path.join(tmp, "badlogs")], expect_ok=False)
            check(p.returncode != 0 and phrase in p.stderr, f"{' '.join(args)}: fails with '{phrase}'")
            if args == ["--preset", "huge"]:  # --help names every preset the program has, and what record runs
                names = re.search(r"unknown preset 'huge' \(([^)]*)\)", p.stderr)
                usage = re.sub(r"\s+", " ", p.stderr.partition("usage:")[2])
                missing = [n for n in (names.group(1).split(", ") if names else []) if not re.search(rf"[ ,]{re.escape(n)}[,) ]", usage)]
                check(names is not None and not missing and "newest reproduced: r89" in usage,
                      f"the usage names every preset (missing: {missing}) and record as r89")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
