#!/usr/bin/env python3
"""The step profiler sees a step only through its recording helpers (profiler/work.h, kernels/platform.cuh):
every kernel launch passes a Work first (`launch(work, kernel, grid, ...)`), and the CUDA, cuBLASLt and NCCL
calls that enqueue work or wait for it go through a helper that records them (record_event, wait_event,
copy_async, memset_async, sync_stream, sync_event, sync_device, CublasLt::run, record_op for collectives).
This checks the sources for launches without a Work and for raw calls, file by file as RULES says, and
stops at the first file it cannot read.

Usage: check_recorded_calls.py [REPO]   (default: the repository holding this script). Prints each
violation as FILE:LINE: what, and each exception in ALLOWED that no longer matches anything (remove it),
then exits 1; exits 0 when there are none.
"""
import glob
import os
import re
import sys

# The raw calls a file's rule forbids, and the helper to use instead.
RAW_CALLS = {
    "cudaEventRecord": "record_event",
    "cudaStreamWaitEvent": "wait_event",
    "cudaMemcpyAsync": "copy_async",
    "cudaMemsetAsync": "memset_async",
    "cudaStreamSynchronize": "sync_stream",
    "cudaEventSynchronize": "sync_event",
    "cudaDeviceSynchronize": "sync_device",
    "cudaMemcpy": "copy_async and sync_stream",
    "cudaMemset": "memset_async and sync_stream",
    "cublasLtMatmul": "CublasLt::run",
    "ncclAllReduce": "runtime/streams.h's wrappers or record_op(OpKind::collective, ...)",
    "ncclReduceScatter": "runtime/streams.h's wrappers or record_op(OpKind::collective, ...)",
    "ncclAllGather": "runtime/streams.h's wrappers or record_op(OpKind::collective, ...)",
    "ncclBroadcast": "runtime/streams.h's wrappers or record_op(OpKind::collective, ...)",
    "ncclReduce": "runtime/streams.h's wrappers or record_op(OpKind::collective, ...)",
    "ncclSend": "record_op(OpKind::collective, ...)",
    "ncclRecv": "record_op(OpKind::collective, ...)",
}

# Which files are checked for what: (glob relative to the repository, launches must pass a Work,
# raw calls forbidden).
RULES = [
    ("kernels/*.cuh", True, tuple(RAW_CALLS)),
    ("train_gpt.cu", True, tuple(RAW_CALLS)),
    ("runtime/*.h", True, tuple(RAW_CALLS)),
    ("profiler/*.h", True, tuple(RAW_CALLS)),
]

# What may stay where it is: (file, enclosing function or "*", the call: an API name, launch:KERNEL,
# or "*") -> why. An entry that matches nothing is reported, so the list cannot go stale.
ALLOWED = {
    ("kernels/platform.cuh", "*", "*"): "the recording helpers and launch() themselves",
    ("profiler/op_timer.h", "*", "*"): "the op timer's events time the recorded ops; they are no ops of the step",
    ("kernels/matmul.cuh", "run", "cublasLtMatmul"): "CublasLt::run records the gemm before it calls cuBLASLt",
    ("kernels/comms.cuh", "exchange", "ncclSend"): "one grouped round, recorded as one collective before the group",
    ("kernels/comms.cuh", "exchange", "ncclRecv"): "one grouped round, recorded as one collective before the group",
    ("runtime/streams.h", "*", "*"): "the trainer's collective wrappers: they record before they call NCCL",
    ("runtime/platform_check.h", "*", "*"): "--check-platform, a mode of its own, never inside a step",
    ("train_gpt.cu", "warm_up", "cudaMemcpy"): "the warm-up saves and restores the parameters around its steps",
    ("train_gpt.cu", "warm_up", "cudaMemset"): "the warm-up zeroes the gradients after its steps",
    ("runtime/arena.h", "allocate", "cudaMemset"): "an arena is zeroed once when placed (a dry run reserves it instead)",
    ("runtime/checkpoint_io.h", "*", "*"): "checkpoints are saved and loaded between steps",
    ("train_gpt.cu", "save_checkpoint", "cudaStreamSynchronize"): "checkpoints are saved between steps",
    ("runtime/finite.h", "has_nonfinite", "cudaMemcpy"): "the CPU build's scan for NaN/inf, between steps",
    ("runtime/batch_producer.h", "wait_for_slot", "cudaEventSynchronize"):
        "the batch producer's thread waits for a slot's upload; the thread issuing the step never waits",
}

KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "static_assert"}


LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def strip_comments_and_strings(text):
    """The text with comments, string and character literals blanked (newlines kept, so lines stay)."""
    return LITERAL.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def kernel_names(texts):
    """Every __global__ function declared in the given (stripped) sources."""
    names = set()
    pattern = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
    for text in texts:
        names.update(pattern.findall(text))
    return names


def function_spans(text):
    """(start, end, name) of every function body: a '{' whose header (the text since the previous
    '{', '}' or ';' outside parentheses) names a function before its first '(', not a control statement
    or a lambda."""
    spans, stack = [], []
    last_stop, parens = 0, 0
    for m in re.finditer(r"[{};()]", text):
        i, ch = m.start(), m.group(0)
        if ch in "()":
            parens += 1 if ch == "(" else -1  # a for statement's ';' do not end its header
        elif ch == "{":
            header = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", text[last_stop:i])
            m = re.search(r"(\w+)\s*\(", header)
            name = m.group(1) if m and m.group(1) not in KEYWORDS and "(" in header else None
            if m and header[:m.start()].rstrip().endswith("]"):
                name = None  # a lambda belongs to the function around it
            stack.append((i, name))
            last_stop = i + 1
        elif ch == "}":
            if stack:
                start, name = stack.pop()
                if name:
                    spans.append((start, i, name))
            last_stop = i + 1
        elif ch == ";" and parens <= 0:
            last_stop = i + 1
    return spans


def enclosing(spans, pos):
    inner = [s for s in spans if s[0] < pos < s[1]]
    return min(inner, key=lambda s: s[1] - s[0])[2] if inner else ""


def call_args(text, open_paren):
    """The top-level arguments of the call whose '(' is at open_paren (split on commas outside (), [], {})."""
    depth, args, start = 0, [], open_paren + 1
    for i in range(open_paren, len(text)):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i])
                return args
        elif ch == "," and depth == 1:
            args.append(text[start:i])
            start = i + 1
    return args


def leading_name(arg):
    m = re.match(r"\s*(?:::)?(\w+)", arg)
    return m.group(1) if m else ""


def check(repo):
    files = []
    for pattern, launches, calls in RULES:
        for path in sorted(glob.glob(os.path.join(repo, pattern))):
            files.append((os.path.relpath(path, repo), launches, calls))
    if not files:
        sys.exit(f"check_recorded_calls: no sources under {repo}")
    texts = {}
    for rel, _, _ in files:
        with open(os.path.join(repo, rel), encoding="utf-8") as f:
            texts[rel] = strip_comments_and_strings(f.read())
    kernels = kernel_names(texts.values())

    violations, used = [], set()

    def allowed(rel, function, call):
        for key in ((rel, function, call), (rel, "*", call), (rel, function, "*"), (rel, "*", "*")):
            if key in ALLOWED:
                used.add(key)
                return True
        return False

    for rel, launches, calls in files:
        text = texts[rel]
        spans = function_spans(text)
        line_of = lambda pos: text.count("\n", 0, pos) + 1
        if launches:
            for m in re.finditer(r"\blaunch\s*\(", text):
                if re.search(r"\bvoid\s*$", text[max(0, m.start() - 64):m.start()]):
                    continue  # a definition
                args = call_args(text, m.end() - 1)
                first, second = leading_name(args[0]) if args else "", leading_name(args[1]) if len(args) > 1 else ""
                if first in kernels:
                    call, why = f"launch:{first}", f"launch of {first} without a Work first"
                elif second not in kernels:
                    call, why = f"launch:{second or '?'}", "launch( whose second argument is not a kernel"
                else:
                    continue
                if not allowed(rel, enclosing(spans, m.start()), call):
                    violations.append(f"{rel}:{line_of(m.start())}: {why}")
        for name in calls:
            for m in re.finditer(r"\b" + name + r"\s*\(", text):
                if not allowed(rel, enclosing(spans, m.start()), name):
                    violations.append(f"{rel}:{line_of(m.start())}: {name} outside a recording helper "
                                      f"(use {RAW_CALLS[name]})")
    checked = {rel for rel, _, _ in files}
    stale = [key for key in ALLOWED if key not in used and key[0] in checked]
    return violations, stale


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    violations, stale = check(repo)
    for v in violations:
        print(v)
    for rel, function, call in stale:
        print(f"{rel}: the exception for {call} in {function} matches nothing: remove it from ALLOWED")
    if violations or stale:
        sys.exit(1)
    print(f"check_recorded_calls: every launch passes a Work and every recorded call goes through a helper")


if __name__ == "__main__":
    main()
