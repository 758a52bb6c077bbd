#!/usr/bin/env python3
"""Adding a sharded parameter as README.md's editing guide says, through the real program.

tests/model/tests.cmake builds train_gpt_toy_cpu from a copy of train_gpt.cu edited by
param_toy_edit.py with the guide's worked example (its lines read from README.md: a struct Params
field, a registry line, a param_table row, a work_order entry, its use in gpt_forward and
gpt_backward: a second bigram table, sharded by rows with Adam, added to the first's rows). This test
builds it, then checks:
  - --print-memory of the toy lists the parameter with the first bigram table's dtype and shape, and
    its Adam state (optim.<name>.exp_avg and .exp_avg_sq: a rank's shard, as the first table's) in the
    optimizer arena and in the state summary, which grows by exactly those bytes over the unedited
    program's;
  - the toy trains 2 steps of the tiny preset on 2 ranks (so its startup table check passed) under
    deferred streams in a random order with emu's race detector: the training and validation losses before the first Adam update
    (step 1's) are the unedited program's, the validation loss after it is not (the forward reads the
    new table); every tensor of each rank's checkpoint after that update (at step 2) is the unedited
    program's, bit for bit, and the toy's adds the parameter's tensors, each equal bit
    for bit to the first bigram table's (the same gradient, reduce-scatter, update and gather: a
    gather that missed a shard leaves rank 0's copy of it at zero), with its adam_steps in the
    metadata; its log embeds the edited source.

    test_param_toy_edit.py CMAKE BUILD_DIR TRAIN_GPT_CPU TOY MPIRUN...
"""
import math
import os
import re
import subprocess
import sys
import tempfile

REPO = os.environ["REPO"]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, HERE)
import param_toy_edit  # noqa: E402
import read_checkpoint  # noqa: E402
from test_memory_plan_state import check, finish, parse as parse_memory_plan  # noqa: E402

CMAKE, BUILD, PLAIN, TOY = sys.argv[1:5]
MPIRUN = sys.argv[5:]
FIRST = "bigram_embed"  # the table the example's is a second one of
ARGS = ["--preset", "tiny", "--max-steps", "2", "--val-every", "1", "--val-tokens", "2048", "--warmup", "0",
        "--log-train-loss"]
DEFERRED = {"EMU_STREAMS": "deferred:5", "EMU_RANDOM_ORDER": "5"}  # the race detector's mode, as gathers_race's
DTYPES = {"float": "fp32", "bf16": "bf16"}


def example():
    """The parameter's name and element type from README.md's example, which must be a sharded row."""
    lines = param_toy_edit.lines_of(open(os.path.join(REPO, "README.md")).read())
    field = re.match(r"(float|bf16)\* (\w+) = nullptr;", lines["struct Params"][0])
    spec = re.search(r'ParamSpec\{"(\w+)", \{[^}]*\}, Init::zeros\}', lines["visit_params"][0])
    row = re.match(r'\{"(\w+)", Optim::adam, Reduce::(\w+), At::(\w+),', lines["param_table"][0])
    if not field or not spec or not row or row.group(1) != spec.group(1) or row.group(2) in ("replicated", "sparse"):
        sys.exit(f"README.md's example is not a field, a zero-initialized registry line and a sharded Adam row "
                 f"of one parameter: {lines}")
    return spec.group(1), field.group(1)


def build():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    targets = [os.path.basename(PLAIN), os.path.basename(TOY)]
    p = subprocess.run([CMAKE, "--build", BUILD, "-j", "2", "--target"] + targets, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL building {' '.join(targets)}:\n{p.stdout[-6000:]}")
    print(f"ok   built {' '.join(targets)}")


def run(binary, args, ranks=1, env=None, expect_ok=True):
    env = env or {}
    cmd = [binary] if ranks == 1 else MPIRUN + ["-np", str(ranks), "-x", "EMU_WORKERS=1"] + \
        [x for k in env for x in ("-x", k)] + [binary]
    p = subprocess.run(cmd + args, env=dict(os.environ, EMU_WORKERS="2" if ranks == 1 else "1", **env),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAIL {binary} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def check_print_memory(name, dtype):
    plain_arenas, plain_state, _ = parse_memory_plan(run(PLAIN, ["--preset", "tiny", "--print-memory"]).stdout)
    toy_arenas, toy_state, _ = parse_memory_plan(run(TOY, ["--preset", "tiny", "--print-memory"]).stdout)
    params = {n: (t, shape) for n, t, shape, _ in toy_arenas["parameters"]}
    dims = params.get(FIRST, (None, []))[1]
    check(params.get(name) == (DTYPES[dtype], dims) and params.get(name) == params.get(FIRST),
          f"--print-memory lists {name} among the parameters as {FIRST}: {params.get(name)}")
    optim = {n: (t, shape) for n, t, shape, _ in toy_arenas["optimizer"]}
    adam = {s: optim.get(f"optim.{name}.{s}") for s in ("exp_avg", "exp_avg_sq")}
    first = {s: optim.get(f"optim.{FIRST}.{s}") for s in adam}
    check(all(adam.values()) and adam == first,
          f"--print-memory lists its Adam state (a rank's shard) in the optimizer arena, as {FIRST}'s: {adam}")
    grown = {s: (toy_state[s][0] - plain_state[s][0], toy_state[s][1] - plain_state[s][1]) for s in plain_state}
    want = {s: (1, 4 * math.prod(adam[s][1])) if s in adam and adam[s] else (0, 0) for s in plain_state}
    check(set(toy_state) == set(plain_state) and grown == want,
          f"the state summary grows by one group and its bytes for exp_avg and exp_avg_sq only: {grown}")


def losses(log_dir):
    logs = [f for f in os.listdir(log_dir) if f.endswith(".txt")]
    if len(logs) != 1:
        sys.exit(f"FAIL expected one log in {log_dir}, found {logs}")
    text = open(os.path.join(log_dir, logs[0])).read()
    # the losses, without the timings of the validation lines
    return text, re.findall(r"^step:(\d+)/\d+ ((?:train_loss|val_loss):\S+)", text, re.M)


def check_training(name, tmp):
    runs = {}
    for label, binary in (("plain", PLAIN), ("toy", TOY)):
        d = os.path.join(tmp, label)
        run(binary, ARGS + ["--checkpoint-steps", "2", "--save-checkpoint", os.path.join(d, "ckpt"), "--log-dir", d,
                            "--run-id", label], ranks=2, env=DEFERRED)
        runs[label] = (d, *losses(d))
    _, plain_text, plain = runs["plain"]
    toy_dir, toy_text, toy = runs["toy"]
    # logged step k's training loss is step k - 1's forward: all but the last validation come before the
    # first Adam update (step 1's), which the last validation follows
    last_val = lambda s, l: int(s) == 2 and l.startswith("val_loss")  # noqa: E731
    before = [(s, l) for s, l in plain if not last_val(s, l)]
    after = [(s, l) for s, l in plain if last_val(s, l)]
    check(len(before) == 4 and len(after) == 1 and before == [(s, l) for s, l in toy if not last_val(s, l)],
          f"the toy trained on 2 ranks without a race, with the unedited program's losses before its first "
          f"Adam update: {' | '.join(f'step:{s} {l}' for s, l in before)}")
    toy_after = [(s, l) for s, l in toy if last_val(s, l)]
    check(len(toy_after) == 1 and toy_after != after,
          f"the validation loss after the update moves (the forward reads {name}): {after} -> {toy_after}")
    example_line = param_toy_edit.lines_of(open(os.path.join(REPO, "README.md")).read())["gpt_forward"][0]
    check(example_line in toy_text and example_line not in plain_text, "the toy's log embeds its edited source")

    for rank in (0, 1):
        path = f"step000002/rank{rank}.safetensors"
        plain_meta, plain_t = read_checkpoint.load(os.path.join(tmp, "plain", "ckpt", path))
        toy_meta, toy_t = read_checkpoint.load(os.path.join(toy_dir, "ckpt", path))
        twins = {n[:-len(FIRST)] + name: n for n in plain_t if n.endswith("." + FIRST)}
        same = [n for n in plain_t if toy_t.get(n) == plain_t[n]]
        check(set(toy_t) == set(plain_t) | set(twins) and len(same) == len(plain_t) and twins,
              f"rank {rank}, step 2: all {len(plain_t)} tensors of the unedited checkpoint are bit for bit the "
              f"toy's, which adds {sorted(twins)}")
        equal = [n for n, first in twins.items() if toy_t.get(n) == toy_t[first]]
        dt, shp, raw = toy_t[f"param.{name}" if f"param.{name}" in toy_t else f"exp_avg.{name}"]
        check(len(equal) == len(twins) and read_checkpoint.to_numpy(dt, shp, raw).any(),
              f"rank {rank}, step 2: {sorted(twins)} equal {FIRST}'s bit for bit (the same reduction, update and "
              f"gather), and are not all zeros")
        differing = {k for k in set(plain_meta) | set(toy_meta) if plain_meta.get(k) != toy_meta.get(k)}
        check(differing == {"run_id", "save_id", f"adam_steps.{name}"} and
              toy_meta.get(f"adam_steps.{name}") == plain_meta[f"adam_steps.{FIRST}"],
              f"rank {rank}, step 2: the metadata adds adam_steps.{name} = {toy_meta.get(f'adam_steps.{name}')} "
              f"(as every Adam group's), the rest is the unedited save's but the run and save ids")


def main():
    name, dtype = example()
    build()
    with tempfile.TemporaryDirectory() as tmp:
        check_print_memory(name, dtype)
        check_training(name, tmp)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
