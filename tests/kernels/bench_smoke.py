#!/usr/bin/env python3
"""The kernel tests' --bench mode (tests/bench_util.h), in a few seconds: three CPU test binaries run
`--bench --iters 1` at the tiny preset's shapes, and each must print a line for every launcher of its
family with a positive mean time and the launch's recorded Work (FLOPs and bytes), say that emu's times
are wall time, and count its lines; bad flags must fail naming the flag. The output checker is first
run on planted outputs (a line missing, a zero time, no Work, a wrong count) and must catch each.

usage: bench_smoke.py TEST_NORM TEST_RESIDUAL TEST_MLP   (the binaries' paths)
"""
import os
import re
import subprocess
import sys

# The launchers each binary's bench must time: the families' launchers, named here independently of the
# tests' sources so that a launcher dropped from a bench is noticed.
EXPECTED = {
    "test_norm": ["rmsnorm_forward", "rmsnorm_backward"],
    "test_residual": ["residual_mix_forward", "residual_mix_backward", "gated_skip_add_forward",
                      "gated_skip_add_backward", "residual_add_forward", "residual_add_backward",
                      "backout_forward", "backout_backward"],
    "test_mlp": ["mlp_forward", "mlp_backward", "linear_relu_square_forward", "linear_relu_square_backward",
                 "relu_square_forward", "relu_square_backward", "lambda_scaled_weight_forward",
                 "lambda_scaled_weight_backward", "mlp_fp8_quantize_weights", "mlp_fp8_quantize_input",
                 "linear_relu_square_forward_fp8", "mlp_forward_fp8"],
}

# launcher, shape, mean ms, then the Work: GFLOP, MB, TFLOP/s ... TB/s (fractions of the H100's peaks)
LINE = re.compile(r"^(?P<name>[a-z0-9_]+)\s+(?P<shape>\S.*?)\s+(?P<ms>[-+0-9.eE]+) ms\s+(?P<work>.*)$")
WORK = re.compile(r"^\s*(?P<gflop>[-+0-9.eE]+) GFLOP\s+(?P<mb>[-+0-9.eE]+) MB\s+[-+0-9.eE]+ TFLOP/s.*"
                  r"\s[-+0-9.eE]+ TB/s \([-+0-9.eE]+% of HBM\)$")
CLOSING = re.compile(r"^bench (?P<program>\S+): timed (?P<count>\d+) launcher calls, one line each$")


def check_output(program, text, expected):
    """What is wrong with one binary's bench output (an empty list when nothing is)."""
    problems, seen, lines = [], set(), 0
    closing = None
    if "tiny shapes" not in text:
        problems.append(f"{program}: the header does not say it runs the tiny preset's shapes")
    if "the CPU emulation's wall time" not in text:
        problems.append(f"{program}: nothing says the times are emu's wall time")
    for line in text.splitlines():
        if line.startswith("TEST_SEED=") or line.startswith("bench: ") or line.startswith("launcher "):
            continue
        if m := CLOSING.match(line):
            closing = m
            continue
        if line.startswith(f"bench {program}: "):  # the header
            continue
        m = LINE.match(line)
        if not m:
            problems.append(f"{program}: a line that is no launcher's: {line!r}")
            continue
        lines += 1
        seen.add(m["name"])
        if not float(m["ms"]) > 0:
            problems.append(f"{program}: {m['name']} ({m['shape']}): mean time {m['ms']} ms is not positive")
        w = WORK.match(m["work"])
        if not w:
            problems.append(f"{program}: {m['name']} ({m['shape']}): no Work recorded: {m['work']!r}")
        elif not float(w["mb"]) > 0:
            problems.append(f"{program}: {m['name']} ({m['shape']}): the recorded Work moves no bytes")
    for name in expected:
        if name not in seen:
            problems.append(f"{program}: no line for {name}")
    if closing is None:
        problems.append(f"{program}: no closing line")
    elif int(closing["count"]) != lines:
        problems.append(f"{program}: the closing line counts {closing['count']} calls, {lines} lines were printed")
    return problems


GOOD = """TEST_SEED=1
bench test_norm: tiny shapes (model_dim 128, ...); per launcher 1 warm-up and 1 timed calls, CUDA events on one stream
bench: emu (the CPU build): the times are the CPU emulation's wall time, not a GPU's
launcher                       shape         mean  work (FLOPs, bytes) and H100 fractions
rmsnorm_forward         T=256 C=128    1.5340 ms  0.0002621 GFLOP  0.1321 MB  0.000171 TFLOP/s  8.61e-05 TB/s (0.00257% of HBM)
rmsnorm_backward        T=256 C=128    1.0124 ms  0.0005243 GFLOP  0.1976 MB  0.000518 TFLOP/s  0.000195 TB/s (0.00583% of HBM)
bench test_norm: timed 2 launcher calls, one line each
"""


def self_test():
    """The checker passes a good output and catches each planted fault."""
    names = EXPECTED["test_norm"]
    assert check_output("test_norm", GOOD, names) == [], check_output("test_norm", GOOD, names)
    planted = {
        "a launcher's line missing": (GOOD.replace(GOOD.splitlines()[5] + "\n", "").replace("timed 2", "timed 1"),
                                      "no line for rmsnorm_backward"),
        "a zero time": (GOOD.replace("1.0124 ms", "0.0000 ms"), "is not positive"),
        "no Work": (GOOD.replace("0.0005243 GFLOP  0.1976 MB  0.000518 TFLOP/s  0.000195 TB/s (0.00583% of HBM)",
                                 "(no Work recorded)"), "no Work recorded"),
        "a wrong count": (GOOD.replace("timed 2", "timed 3"), "counts 3 calls, 2 lines"),
        "no emu note": (GOOD.replace("the CPU emulation's wall time", "a GPU's time"), "emu's wall time"),
        "garbage": (GOOD + "Segmentation fault\n", "no launcher's"),
    }
    for what, (text, phrase) in planted.items():
        problems = check_output("test_norm", text, names)
        if not any(phrase in p for p in problems):
            sys.exit(f"bench_smoke self-test: the checker missed {what} (expected '{phrase}', got {problems})")
    print(f"self-test: the checker passes a good output and catches {len(planted)} planted faults")


def run(binary, *args):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=600)


def main():
    if len(sys.argv) != 1 + len(EXPECTED):
        sys.exit(__doc__)
    self_test()
    problems = []
    for binary in sys.argv[1:]:
        program = os.path.basename(binary)
        r = run(binary, "--bench", "--iters", "1")
        print(r.stdout, end="")
        if r.returncode != 0:
            problems.append(f"{program} --bench --iters 1: exit {r.returncode}, stderr: {r.stderr}")
        problems += check_output(program, r.stdout, EXPECTED[program])
    # bad command lines: a non-zero exit and a message naming what is wrong
    norm = sys.argv[1]
    for args, phrase in [(["--bench", "--bogus"], "--bogus"), (["--bench", "--iters", "0"], "--iters 0"),
                         (["--bench", "--iters", "2x"], "--iters 2x"), (["--bench", "--shape", "huge"], "huge"),
                         (["--bench", "--iters"], "--iters needs a value"), (["--iters", "3"], "--bench")]:
        r = run(norm, *args)
        ok = r.returncode != 0 and phrase in r.stderr
        first = r.stderr.splitlines()[0] if r.stderr else ""
        print(f"{os.path.basename(norm)} {' '.join(args)}: exit {r.returncode}, {first}")
        if not ok:
            problems.append(f"{' '.join(args)}: want a non-zero exit naming '{phrase}', got exit {r.returncode}, "
                            f"stderr {r.stderr!r}")
    for p in problems:
        print("FAIL:", p)
    print("kernel_bench_smoke:", "FAILED" if problems else "passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
