#!/usr/bin/env python3
"""Adding a parameter as README.md's editing guide says, through the real program.

tests/model/tests.cmake builds two trainers from copies of train_gpt.cu edited by param_toy_edit.py
with the guide's worked example (its lines read from README.md): train_gpt_toy_cpu with all of it
(a struct Params field, a registry line, a kParamTable row, a kWorkOrder entry), and
train_gpt_toy_no_row_cpu without the table row (nor the work-order entry, whose array is the
table's length). This test builds them, then checks:
  - --print-memory of the toy lists the parameter with its registered dtype and shape, and its Adam
    state (optim.<name>.exp_avg and .exp_avg_sq) in the optimizer arena and in the state summary,
    which grows by exactly those bytes over the unedited program's;
  - the toy trains 2 steps of the tiny preset (so its startup table check passed), validating at
    every step. The toy parameter is not used by the forward, so its gradient is zero (its logged
    gradient norm is 0) and nothing else changes: every training and validation loss and every
    other gradient norm in the log (as printed) equals the unedited program's, and every tensor of
    the checkpoints at steps 1 and 2 equals the unedited program's bit for bit (the parameters each
    loss is computed from, by deterministic kernels: the same bits in, the same loss). The toy's checkpoints
    add param.<name> with its init values (Init::zeros: zeros), its Adam moments (zeros: the
    gradient is zero), grad.<name> at the odd step, and adam_steps.<name>; its log embeds the
    edited source;
  - the planted trainer stops at startup, non-zero and before writing a log, naming the parameter.

    test_param_toy_edit.py CMAKE BUILD_DIR TRAIN_GPT_CPU TOY NO_ROW
"""
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.environ["REPO"]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, HERE)
import param_toy_edit  # noqa: E402
import read_checkpoint  # noqa: E402
from test_memory_plan_state import check, finish, parse as parse_memory_plan  # noqa: E402

CMAKE, BUILD, PLAIN, TOY, NO_ROW = sys.argv[1:6]
STEPS = 2
ARGS = ["--preset", "tiny", "--max-steps", str(STEPS), "--val-every", "1", "--val-tokens", "2048", "--warmup", "0",
        "--log-train-loss", "--log-grad-norms", "--checkpoint-steps", "1,2"]
DTYPES = {"float": ("fp32", "F32", 4), "bf16": ("bf16", "BF16", 2)}


def example():
    """The parameter's name, element type and shape (in model_dim units) from README.md's example."""
    lines = dict(param_toy_edit.example_lines(open(os.path.join(REPO, "README.md")).read()))
    field = re.match(r"(float|bf16)\* (\w+);", lines["struct Params"])
    spec = re.search(r'ParamSpec\{"(\w+)", \{([^}]*)\}, Init::(\w+)', lines["visit_params"])
    if not field or not spec or lines["kParamTable"].split('"')[1] != spec.group(1):
        sys.exit(f"README.md's example is not a field, a registry line and a table row of one parameter: {lines}")
    return spec.group(1), field.group(1), [d.strip() for d in spec.group(2).split(",")], spec.group(3)


def build():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    targets = [os.path.basename(b) for b in (PLAIN, TOY, NO_ROW)]
    p = subprocess.run([CMAKE, "--build", BUILD, "-j", "2", "--target"] + targets, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL building {' '.join(targets)}:\n{p.stdout[-6000:]}")
    print(f"ok   built {' '.join(targets)}")


def run(binary, args, expect_ok=True):
    env = dict(os.environ, EMU_WORKERS="2")
    p = subprocess.run([binary] + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAIL {binary} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def check_print_memory(name, dtype, dims):
    plain_arenas, plain_state, _ = parse_memory_plan(run(PLAIN, ["--preset", "tiny", "--print-memory"]).stdout)
    toy_arenas, toy_state, _ = parse_memory_plan(run(TOY, ["--preset", "tiny", "--print-memory"]).stdout)
    short, _, size = DTYPES[dtype]
    nbytes = size * math.prod(dims)
    params = {n: (t, shape, b) for n, t, shape, b in toy_arenas["parameters"]}
    check(params.get(name) == (short, dims, nbytes),
          f"--print-memory lists {name} among the parameters ({short}, {dims}, {nbytes} bytes): {params.get(name)}")
    optim = {n: (t, shape) for n, t, shape, _ in toy_arenas["optimizer"]}
    adam = {s: optim.get(f"optim.{name}.{s}") for s in ("exp_avg", "exp_avg_sq")}
    check(all(v == ("fp32", dims) for v in adam.values()),
          f"--print-memory lists its Adam state in the optimizer arena: {adam}")
    grown = {s: (toy_state[s][0] - plain_state[s][0], toy_state[s][1] - plain_state[s][1]) for s in plain_state}
    want = {s: (1, 4 * math.prod(dims)) if s in adam else (0, 0) for s in plain_state}
    check(set(toy_state) == set(plain_state) and grown == want,
          f"the state summary grows by one group and its bytes for exp_avg and exp_avg_sq only: {grown}")


def model_dim():
    """The tiny preset's model_dim: the width of the unedited program's embed."""
    arenas, _, _ = parse_memory_plan(run(PLAIN, ["--preset", "tiny", "--print-memory"]).stdout)
    return next(shape[1] for n, _, shape, _ in arenas["parameters"] if n == "embed")


def log_lines(log_dir):
    logs = [f for f in os.listdir(log_dir) if f.endswith(".txt")]
    if len(logs) != 1:
        sys.exit(f"FAIL expected one log in {log_dir}, found {logs}")
    text = open(os.path.join(log_dir, logs[0])).read()
    # the losses and gradient norms, without the timings of the validation lines
    return text, re.findall(r"^step:\d+/\d+ (?:(?:train_loss|val_loss):\S+|grad_norms.*)", text, re.M)


def without_norm(line, name):
    return re.sub(rf" {name}:\S+", "", line)


def check_training(name, dtype, dims, init, tmp):
    runs = {}
    for label, binary in (("plain", PLAIN), ("toy", TOY)):
        d = os.path.join(tmp, label)
        run(binary, ARGS + ["--save-checkpoint", os.path.join(d, "ckpt"), "--log-dir", d, "--run-id", label])
        runs[label] = (d, *log_lines(d))
    _, plain_text, plain = runs["plain"]
    toy_dir, toy_text, toy = runs["toy"]
    losses = [l for l in plain if "grad_norms" not in l]
    check(len(losses) == 2 * STEPS + 1 and losses == [l for l in toy if "grad_norms" not in l],
          f"the toy trainer ran (its table check passed) with the unedited program's {STEPS} training and "
          f"{STEPS + 1} validation losses: {' | '.join(losses)}")
    norms = [l for l in toy if "grad_norms" in l]
    check(len(norms) == STEPS and all(re.search(rf" {name}:0\.000000e\+00( |$)", l) for l in norms),
          f"{name}'s gradient norm is 0 at every step (the forward does not use it)")
    check([without_norm(l, name) for l in norms] == [l for l in plain if "grad_norms" in l],
          "every other gradient norm equals the unedited program's")
    example_line = dict(param_toy_edit.example_lines(open(os.path.join(REPO, "README.md")).read()))["visit_params"]
    check(example_line in toy_text and example_line not in plain_text, "the toy's log embeds its edited source")

    st_dtype = DTYPES[dtype][1]
    for step in (1, 2):
        path = f"step{step:06d}/rank0.safetensors"
        plain_meta, plain_t = read_checkpoint.load(os.path.join(tmp, "plain", "ckpt", path))
        toy_meta, toy_t = read_checkpoint.load(os.path.join(toy_dir, "ckpt", path))
        added = {f"param.{name}", f"exp_avg.{name}", f"exp_avg_sq.{name}"} | ({f"grad.{name}"} if step % 2 else set())
        same = [n for n in plain_t if toy_t.get(n) == plain_t[n]]
        check(set(toy_t) == set(plain_t) | added and len(same) == len(plain_t),
              f"step {step}: all {len(plain_t)} tensors of the unedited checkpoint are bit for bit the toy's, "
              f"which adds {sorted(added)}")
        want_dtype = {f"param.{name}": st_dtype, f"grad.{name}": st_dtype}
        for n in sorted(added & set(toy_t)):
            dt, shp, raw = toy_t[n]
            why = f"its Init::{init} values" if n.startswith("param.") else "a zero gradient"
            check(dt == want_dtype.get(n, "F32") and list(shp) == dims and not read_checkpoint.to_numpy(dt, shp, raw).any(),
                  f"step {step}: {n} ({dt} {list(shp)}) is all zeros ({why})")
        differing = {k for k in set(plain_meta) | set(toy_meta) if plain_meta.get(k) != toy_meta.get(k)}
        check(differing == {"run_id", "save_id", f"adam_steps.{name}"} and
              toy_meta.get(f"adam_steps.{name}") == plain_meta["adam_steps.scalars"],
              f"step {step}: the metadata adds adam_steps.{name} = {toy_meta.get(f'adam_steps.{name}')} "
              f"(as every Adam group's), the rest is the unedited save's but the run and save ids")


def check_planted(name, tmp):
    d = os.path.join(tmp, "no_row")
    p = run(NO_ROW, ARGS + ["--save-checkpoint", os.path.join(d, "ckpt"), "--log-dir", d], expect_ok=False)
    message = next((l for l in p.stderr.splitlines() if "disagree" in l), p.stderr.strip()[-500:])
    check(p.returncode != 0 and f"kParamTable lacks the registered parameter '{name}'" in p.stderr,
          f"without its table row the trainer exits {p.returncode} at startup: {message}")
    check(not os.path.exists(d), "... before writing a log or a checkpoint")


def main():
    name, dtype, shape, init = example()
    if init != "zeros":
        sys.exit(f"README.md's example initializes {name} with Init::{init}; this test checks Init::zeros")
    build()
    C = model_dim()
    if any(d != "C" and not d.isdigit() for d in shape):
        sys.exit(f"README.md's example has the shape {{{', '.join(shape)}}}; this test knows numbers and C")
    dims = [C if d == "C" else int(d) for d in shape]
    with tempfile.TemporaryDirectory() as tmp:
        check_print_memory(name, dtype, dims)
        check_training(name, dtype, dims, init, tmp)
        check_planted(name, tmp)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
