#!/usr/bin/env python3
"""Upstream's record-71 code for scripts/side_by_side.sh, never committed here (it is upstream's):

  upstream_code.py extract LOG DIR
      writes DIR/train_gpt.py and DIR/triton_kernels.py from a record log, which begins with both:
      train_gpt.py's text, then "\\n\\n" + 40 dashes + "\\n# triton_kernels.py\\n" + 40 dashes + "\\n\\n",
      then triton_kernels.py's text, then a line of 100 '=' (upstream prints `code` and that line first)
  upstream_code.py patch SRC DIR
      copies SRC's two files into DIR (a temporary folder) and patches the copy of train_gpt.py to run
      on one GPU without FlashAttention-3 and to time selected steps: FA3's import becomes
      fa3_standin.py, the warm-up compiles only the requested stages' first steps, the training loop
      runs sbs_hooks.timed_steps() instead of the schedule, validation is off. Each patch finds its
      anchor exactly once, else stops naming it (upstream's code changed: the patch must follow).
"""
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SEPARATOR = "\n\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\n"
END = "\n" + "=" * 100 + "\n"


def extract(log, out):
    text = open(log, errors="strict", encoding="utf-8").read()
    at = text.find(SEPARATOR)
    if at < 0:
        sys.exit(f"upstream_code: {log}: no '# triton_kernels.py' separator: not a record log with its code "
                 "(the logs under shared/data have theirs stripped)")
    end = text.find(END, at)
    if end < 0:
        sys.exit(f"upstream_code: {log}: no line of 100 '=' after the code")
    train, kernels = text[:at], text[at + len(SEPARATOR):end]
    for name, code in (("train_gpt.py", train), ("triton_kernels.py", kernels)):
        try:
            compile(code, name, "exec")
        except SyntaxError as e:
            sys.exit(f"upstream_code: {log}: the extracted {name} is not Python ({e})")
    os.makedirs(out, exist_ok=True)
    # the files as upstream read them: train_gpt.py ended where the separator begins; triton_kernels.py
    # where print0 added its newline
    open(os.path.join(out, "train_gpt.py"), "w").write(train)
    open(os.path.join(out, "triton_kernels.py"), "w").write(kernels)
    print(f"extracted {out}/train_gpt.py ({train.count(chr(10)) + 1} lines) and {out}/triton_kernels.py "
          f"({kernels.count(chr(10)) + 1} lines) from {log}")


# (what, pattern of one whole line, its replacement lines); the pattern must match exactly one line
PATCHES = [
    ("the kernels package import", r"from kernels import get_kernel",
     ["# side_by_side: no kernels package (FlashAttention-3 from fa3_standin below)"]),
    ("FlashAttention-3's import", r"flash_attn_interface = get_kernel\('varunneal/flash-attention-3'\)\.flash_attn_interface",
     ["import fa3_standin as flash_attn_interface  # side_by_side: flex_attention with FA3's masks"]),
    ("the hyperparameters", r"args = Hyperparameters\(\)",
     ["args = Hyperparameters()", "args.val_loss_every = 0  # side_by_side: no validation in the timed steps",
      "import sbs_hooks  # side_by_side"]),
    ("the warm-up's message", r'print0\("Compiling model and warming up kernels.*\)',
     ["sbs_hooks.begin_compile()", "{line}"]),
    ("the warm-up's steps", r"warmup_steps = sorted\(.*\)",
     ["warmup_steps = sbs_hooks.warmup_steps(transition_steps)  # side_by_side: the requested stages only"]),
    ("the reset after the warm-up", r'print0\("Resetting Model".*\)', ["sbs_hooks.end_compile()", "{line}"]),
    ("the training loop", r"for step in range\(train_steps \+ 1\):",
     ["for step in sbs_hooks.timed_steps(transition_steps):  # side_by_side: the timed steps"]),
]


def patch(src, out):
    for name in ("train_gpt.py", "triton_kernels.py"):
        if not os.path.exists(os.path.join(src, name)):
            sys.exit(f"upstream_code: {src}/{name} missing (extract it from a record log: side_by_side.sh --from-log)")
    os.makedirs(out, exist_ok=True)
    lines = open(os.path.join(src, "train_gpt.py")).read().split("\n")
    for what, pattern, replacement in PATCHES:
        hits = [i for i, line in enumerate(lines) if re.fullmatch(pattern, line)]
        if len(hits) != 1:
            sys.exit(f"upstream_code: {src}/train_gpt.py: {what} ({pattern!r}) found {len(hits)} times, want once: "
                     "upstream's code is not record 71's as this patch knows it")
        i = hits[0]
        lines[i:i + 1] = [r.replace("{line}", lines[i]) for r in replacement]
    open(os.path.join(out, "train_gpt.py"), "w").write("\n".join(lines))
    shutil.copy(os.path.join(src, "triton_kernels.py"), out)
    for ours in ("fa3_standin.py", "sbs_hooks.py"):
        shutil.copy(os.path.join(HERE, ours), out)
    print(f"patched a copy of {src}/train_gpt.py into {out} ({len(PATCHES)} patches)")


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("extract", "patch"):
        sys.exit(__doc__)
    (extract if sys.argv[1] == "extract" else patch)(sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    main()
