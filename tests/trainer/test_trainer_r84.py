#!/usr/bin/env python3
"""End to end on the tiny-r84 preset (record 84's switches at tiny's sizes: MUDD, XSA, the narrow signed bigram with
the aliased x0, the paired layers' gates reading the value embedding, the FP8 MLP up-projection), under emu.

  - 1 rank, 6 + 2 steps (stage changes at 2, 4 and 6, Adam steps 1, 3, 5, 7, the untie at 5) against the PyTorch
    reference's golden run (tests/reference/fixtures/tiny_r84_golden.json, from this trainer's step-0 checkpoint and
    checked batches): every training and validation loss to 2e-3 relative (seen: 3.4e-4 at most; the reference
    from parameters nudged by one bf16 step: 3.0e-4; upstream a333be08's own code against this trainer: 2.1e-4),
    step 0's gradient norms of the 20 groups and the final parameters' norms as record 80's test checks them;
    every training loss finite, validation at 0, 4 and 8 falling; the log in upstream's format; record 83's sign table saved with
    the parameters (`buffer.bigram_signs`, (8192, bigram_dim) of +-1, what the references and upstream's code
    read to start from the same state);
  - resume from step 5 (an odd step: the even step's Adam gradients pending, the FP8 copies of c_fc to remake, the
    sign table read back) equals the uninterrupted run at step 8, every tensor bitwise, and its log prints no
    training loss of a step it did not run;
  - 8 ranks under emu's strictest modes (deferred streams in random order, poisoned allocations: MUDD's and XSA's
    replicated reductions, the narrow bigram's sparse exchange, the banks' buckets and gathers, each ordered by
    its events or reported as a race), steps 0..3: the same training losses, and validation loss at step 4, as 1 rank up to
    reduction order (0.1%, as records 71's and 80's 1 = 2 = 8; 2 ranks: tiny-r84-prefix's with FULL=1, below);
  - --print-memory --preset r84: the record's plan fits one H100 (80 GB);
  - tiny-r84-fp8down (record 89's FP8 down-projection with delayed scales on tiny-r84; the weights' scale bootstrapped
    for every quantization of these 8 steps, as upstream's for steps below 16), steps 0-1: the scales in every rank's
    checkpoint (`buffer.mlp_down_scales`); a run with upstream's warm-up equal to the run without it at step 2 (the
    reset restores the scales), every tensor bitwise (a resume inside the bootstrap, and 2 and 8 strict ranks = 1:
    tiny-r89's, test_trainer_r86.py);
  - with FULL=1 in the environment (by hand: CI's 30 minutes on 2 cores leave no room), also tiny-r84-prefix (record
    88's prefix-token loss on tiny-r84; pw 0.25, then 0.25 -> 0 over stage 1, then 0): 1 rank against its own golden
    run (tests/reference/fixtures/tiny_r84_prefix_golden.json) as above; step 0's training loss above tiny-r84's (the
    same parameters and batch: the prefix term adds); 2 ranks against 1 over steps 0..3 (each rank uploads the step's
    weight after its MTP weights); and tiny-r84-fp8down over 8 steps against its own golden run
    (tests/reference/fixtures/tiny_r84_fp8down_golden.json), its 2 strict ranks against 1. In CI, record 89's golden
    run and its strict ranks (test_trainer_r89) run the same prefix-loss and FP8 down-projection code on tiny-r86.
Usage: test_trainer_r84.py TRAIN_GPT_CPU MPIRUN...
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_trainer as T  # noqa: E402  (its run, check and log helpers)
import test_trainer_r80 as R80  # noqa: E402  (its golden-run check)

SCHEDULE = ["--preset", "tiny-r84", "--scheduled-steps", "6", "--extension-steps", "2", "--val-every", "4",
            "--val-tokens", "4096", "--log-train-loss", "--warmup", "0"]
TOTAL = 8
# The resume's step: odd, so the checkpoint holds the even step's Adam gradients; after the stage change at 4, so the
# resumed run has 3 steps and one validation left, across the change at 6 (from step 3: 5 steps and two, 30 s more)
RESUME_AT = 5
# FULL=1: the feature presets' checks CI leaves out (the docstring's last item)
FULL = os.environ.get("FULL") == "1"
STRICT = {"EMU_RANDOM_ORDER": "29", "EMU_STREAMS": "deferred:29", "EMU_POISON": "1"}
# Record 84's 20 groups: record 80's 16 with xsa_alphas and MUDD's three, the new ones sums over tokens (small). Step
# 0's gradient norms against the reference (tests/reference/README.md, "Record 84"): skip_gate 6.1%, mudd_b2 3.5%,
# resid_lambdas 2.8%, x0_lambdas 40% (upstream's own code against this trainer: 45%; the reference from parameters
# nudged by one bf16 step moves it 21-29%: a sum over T x C that cancels), the banks and tables 0.05-0.15%.
SMALL = R80.SMALL | {"xsa_alphas", "mudd_w1", "mudd_w2", "mudd_b2"}
NOISY = {"x0_lambdas": 0.6, "skip_gate": 0.3, "resid_lambdas": 0.3}
# tiny-r84-prefix: x0_lambdas' step-0 norm cancels more with the prefix term. The PR's own code on the CPU
# (scripts/upstream_cpu/run.py, record 88) gives 1.705e-3, the reference 1.727e-3 (1.3% from it), this trainer 2.934e-3
# (72% from it: its fp32 sums of the stream's gradients, tests/reference/README.md "The step-0 gradient offset"), and
# upstream from parameters nudged by one bf16 step moves it 52%: 80% is 1.5 times that noise floor.
NOISY_PREFIX = NOISY | {"x0_lambdas": 0.8}


# 1 rank's losses from a log, and a multi-rank run against them: tiny-r80's (test_trainer_r80.py)
losses = R80.losses
check_ranks = R80.check_ranks


def check_resume(tmp, schedule, root, step, run_id, label):
    """Resume from root's step-`step` checkpoint to the end: the same bytes as the uninterrupted run (every tensor as
    stored). It validates once, at its end, on 2048 tokens: its validation losses are not read, validation changes no
    bit of the training, and a resume does not check the validation flags (a tiny-r89 validation of 4096 tokens
    costs 16 s here). Returns the resumed run's log."""
    resumed = os.path.join(tmp, run_id)
    T.run(T.validating_once(schedule) + ["--run-id", run_id, "--log-dir", tmp, "--save-checkpoint", resumed, "--checkpoint-steps",
                      str(TOTAL), "--resume", os.path.dirname(T.ckpt(root, step))])
    differ = checkpoint_differences(T.ckpt(root, TOTAL), T.ckpt(resumed, TOTAL))
    T.check(not differ, f"{label}: resume from step {step} equals the uninterrupted run at step {TOTAL} (every tensor, "
            "bitwise)" + (" differ: " + " ".join(differ[:8]) if differ else ""))
    return open(os.path.join(tmp, run_id + ".txt")).read()


def checkpoint_differences(path_a, path_b):
    """The tensors two checkpoint files do not both hold with the same bytes."""
    _, a = T.read_checkpoint.load(path_a)
    _, b = T.read_checkpoint.load(path_b)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check_prefix(tmp, r84_train):
    """tiny-r84-prefix: 1 rank against its golden run, step 0's loss above tiny-r84's by the prefix term, 2 ranks = 1."""
    schedule = [a if a != "tiny-r84" else "tiny-r84-prefix" for a in SCHEDULE]
    root = os.path.join(tmp, "prefix1")
    T.run(schedule + ["--log-grad-norms", "--run-id", "prefix1", "--log-dir", tmp, "--save-checkpoint", root,
                      "--checkpoint-steps", str(TOTAL)])
    text = open(os.path.join(tmp, "prefix1.txt")).read()
    T.check(re.search(r"^preset: tiny-r84-prefix$", text, re.M) is not None and
            re.search(r"^  stage 1: .* prefix \[0\.25->0\.00\]$", text, re.M) is not None,
            "the tiny-r84-prefix log names its preset and stage 1's prefix weights")
    R80.check_golden(text, T.tensors(T.ckpt(root, TOTAL), prefix="param.")[1], "tiny-r84-prefix", 20, SMALL,
                     NOISY_PREFIX)
    one_train, one_val = losses(text)
    # the same parameters and batch at step 0: the prefix term pw (lse - z[P]) > 0 adds to most rows
    T.check(one_train.shape == (TOTAL,) and one_train[0] > r84_train[0] * 1.01,
            f"step 0's loss with the prefix term ({one_train[:1]}) is above tiny-r84's ({r84_train[:1]})")
    check_ranks(tmp, schedule, one_train, one_val, 2, None, "prefix2", "tiny-r84-prefix, 2 ranks")


def check_fp8down(tmp):
    """tiny-r84-fp8down: the scales in the checkpoints and the warm-up's reset bitwise; with FULL=1, 1 rank against its
    golden run and 2 strict ranks = 1 (in CI, steps 0-1 only: tiny-r89's golden run covers the same code)."""
    schedule = [a if a != "tiny-r84" else "tiny-r84-fp8down" for a in SCHEDULE]
    if not FULL:  # steps 0-1 only: one validation, at the end, on 2048 tokens (validation changes no training state)
        schedule = T.validating_once(schedule)
    root, last = os.path.join(tmp, "fp8down1"), TOTAL if FULL else 2
    T.run(schedule + ["--log-grad-norms", "--run-id", "fp8down1", "--log-dir", tmp, "--save-checkpoint", root,
                      "--checkpoint-steps", f"0,2,{TOTAL}" if FULL else "0,2", "--max-steps", str(last)])
    text = open(os.path.join(tmp, "fp8down1.txt")).read()
    if FULL:
        R80.check_golden(text, T.tensors(T.ckpt(root, TOTAL), prefix="param.")[1], "tiny-r84-fp8down", 20, SMALL,
                         NOISY)
    one_train, one_val = losses(text)
    scales = T.tensors(T.ckpt(root, last), names=["buffer.mlp_down_scales"])[1].get("buffer.mlp_down_scales")
    # (12 layers, 12 floats): act, used, next at 0, 4, 8; after 2 steps every MLP layer's act and the weights' scales
    # are amaxes over 448 (not the initial ones), the padding layer's act untouched
    ok = scales is not None and scales.shape == (12, 12)
    if ok:
        act, used, nxt = scales[:, 0], scales[:, 4], scales[:, 8]
        ok = (np.all(np.isfinite(scales)) and np.all((act[:11] > 0) & (act[:11] != 1)) and act[11] == 1 and
              np.all((used[:11] > 0) & (used[:11] != 1)) and np.all(nxt[:11] > 0))
    T.check(ok, f"step {last}'s checkpoint holds record 89's scales, (12, 12), moved from their ones ({scales})")
    # a resume inside the bootstrap: tiny-r89's, record 89's merged form (test_trainer_r86.py, PART=r89)
    # upstream's warm-up, then its reset (the scales back to their ones, the next quantization a bootstrap): the states
    # at steps 0 and 2 equal the run's without it (step 0's holds the scales the reset restores; by step 2 they are
    # overwritten, and c_proj's zero init hides step 0's act from the loss)
    warm = os.path.join(tmp, "fp8down_warm")
    warm_schedule = schedule[:schedule.index("--warmup")] + ["--warmup", "1"] + schedule[schedule.index("--warmup") + 2:]
    T.run(warm_schedule + ["--max-steps", "2", "--run-id", "fp8down_warm", "--log-dir", tmp, "--save-checkpoint", warm,
                           "--checkpoint-steps", "0,2"])
    for step in (0, 2):
        differ = checkpoint_differences(T.ckpt(root, step), T.ckpt(warm, step))
        T.check(not differ, f"tiny-r84-fp8down: after the warm-up, step {step}'s state equals the run's without it "
                "(every tensor, bitwise)" + (" differ: " + " ".join(differ[:8]) if differ else ""))
    if FULL:
        check_ranks(tmp, schedule, one_train, one_val, 2, STRICT, "fp8down2", "tiny-r84-fp8down, 2 strict ranks")


def main():
    with tempfile.TemporaryDirectory(prefix="trainer_r84_") as tmp:
        root = os.path.join(tmp, "np1")
        T.run(SCHEDULE + ["--log-grad-norms", "--run-id", "np1", "--log-dir", tmp, "--save-checkpoint", root,
                          "--checkpoint-steps", f"0,{RESUME_AT},{TOTAL}"])
        T.check_log(os.path.join(tmp, "np1.txt"), "1 rank")
        text = open(os.path.join(tmp, "np1.txt")).read()
        R80.check_golden(text, T.tensors(T.ckpt(root, TOTAL), prefix="param.")[1], "tiny-r84", 20, SMALL, NOISY)
        one_train, one_val = losses(text)
        T.check(one_train.shape == (TOTAL,) and np.all(np.isfinite(one_train)),
                f"1 rank: {TOTAL} finite training losses ({one_train})")
        T.check(sorted(one_val) == [0, 4, TOTAL] and one_val[0] > one_val[4] > one_val[TOTAL],
                f"1 rank: validation losses {one_val} fall")
        signs = T.tensors(T.ckpt(root, 0), names=["buffer.bigram_signs"])[1].get("buffer.bigram_signs")
        T.check(signs is not None and signs.shape == (8192, 32) and set(np.unique(signs)) == {-1.0, 1.0}
                and abs(float(np.mean(signs))) < 0.02,
                f"the checkpoint holds the sign table, (8192, 32) of balanced +-1 "
                f"({None if signs is None else (signs.shape, np.unique(signs), float(np.mean(signs)))})")

        # resume from step 5 to the end: the same bytes as the uninterrupted run (every tensor as stored)
        text = check_resume(tmp, SCHEDULE, root, RESUME_AT, "resumed", "tiny-r84")
        logged = [int(k) for k in re.findall(r"^step:(\d+)/\d+ train_loss:", text, re.M)]
        r_train, _ = losses(text)
        T.check(logged == list(range(RESUME_AT + 1, TOTAL + 1)) and np.array_equal(r_train, one_train[RESUME_AT:]),
                f"the resumed log prints the training losses of steps {RESUME_AT + 1}..{TOTAL} only, the uninterrupted "
                f"run's ({logged}: {r_train})")

        # without upstream's warm-up (test_trainer.py runs it on record 71's tiny preset)
        # 8 ranks under the strict modes (2 in the default mode: tiny-r80's; tiny-r84-prefix's with FULL=1)
        check_ranks(tmp, SCHEDULE, one_train, one_val, 8, STRICT, "np8", "8 ranks, strict emu")
        if FULL:
            check_prefix(tmp, one_train)
        check_fp8down(tmp)
    plan = subprocess.run([T.BINARY, "--preset", "r84", "--print-memory"], capture_output=True, text=True)
    total = re.search(r"^total\s+(\S+) MiB", plan.stdout, re.M)
    T.check(plan.returncode == 0 and total is not None and float(total.group(1)) < 80 * 1024,
            f"r84's memory plan fits one H100: {total.group(1) if total else plan.stderr[-300:]} MiB")
    if T.failures:
        sys.exit(f"{len(T.failures)} check(s) failed")
    print("all tiny-r84 trainer checks passed")


if __name__ == "__main__":
    main()
