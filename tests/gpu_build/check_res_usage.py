#!/usr/bin/env python3
"""Checks the GPU build's per-kernel resources against every launch configuration the CPU tests used.

Usage: check_res_usage.py --launch-log FILE BINARY... (or --res-usage FILE, cuobjdump's saved output)

The launch log is what emu writes under EMU_LAUNCH_LOG=FILE: one line per distinct launch, "<mangled
kernel symbol> <threads per block> <dynamic shared bytes>" (g++ and nvcc mangle a kernel alike). The
resources come from `cuobjdump -res-usage` on the GPU binaries. On an H100 (sm_90) a configuration fits
when its registers, allocated per warp in units of 256, take at most the 65,536 of an SM, and its static
shared memory (cuobjdump's SHARED less the 1 KiB the system reserves per block) plus the dynamic bytes
take at most 227 KiB; and no kernel may use local memory or a stack frame (where ptxas puts register
spills), except the frames listed in STACK_FRAMES with their exact size. Exit status 1 and a line per
violation when anything does not fit.
"""
import argparse
import glob
import math
import os
import re
import shutil
import subprocess
import sys

REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated per warp, in units of 256
RESERVED_SHARED = 1024  # per block, counted in cuobjdump's SHARED on sm_90
MAX_SHARED = 227 * 1024  # per block: static + dynamic (cudaDevAttrMaxSharedMemoryPerBlockOptin)

# Stack frames that hold no spills, by kernel symbol: bytes and why (ptxas -v reports "0 bytes spill
# stores" for each). A different size fails, so a spill that joins one later still shows.
STACK_FRAMES = {
    "_Z22yarn_fill_table_kernelP13__nv_bfloat16PKfii":
        (32, "sinf/cosf keep the table of their slow argument reduction (|x| >= 105615) on the stack"),
}


def find_cuobjdump(repo):
    """$CUOBJDUMP, PATH, the CUDA toolkit's bin/, then the project's .venv (its bin/, then the NVIDIA
    wheel inside site-packages: nvidia/cuda_cuobjdump/bin, or nvidia/cu<N>/bin for CUDA 13's wheels)."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "cuobjdump"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump"))
    venv = os.path.join(repo, ".venv")
    candidates.append(os.path.join(venv, "bin", "cuobjdump"))
    for pattern in ("nvidia/cuda_cuobjdump/bin/cuobjdump", "nvidia/cu*/bin/cuobjdump"):
        candidates += sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", pattern)))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def parse_res_usage(text):
    """{symbol: {"REG": n, "SHARED": n, "LOCAL": n, "STACK": n}}; a kernel listed by several binaries
    keeps the largest of each."""
    kernels = {}
    symbol = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            symbol = m.group(1)
            continue
        if symbol and "REG:" in line:
            fields = {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}
            old = kernels.get(symbol, {})
            kernels[symbol] = {k: max(fields.get(k, 0), old.get(k, 0)) for k in ("REG", "SHARED", "LOCAL", "STACK")}
            symbol = None
    return kernels


def parse_launch_log(text):
    launches = set()
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"launch log line {n} is not '<symbol> <threads> <dynamic shared bytes>': {line!r}")
        launches.add((parts[0], int(parts[1]), int(parts[2])))
    return launches


def registers_per_block(regs, threads):
    per_warp = math.ceil(regs * 32 / REGISTER_UNIT) * REGISTER_UNIT
    return per_warp * math.ceil(threads / 32)


def violations(kernels, launches):
    """The problems, one line each, and the number of launch configurations checked."""
    problems = []
    for sym, r in sorted(kernels.items()):
        allowed_stack = STACK_FRAMES.get(sym, (0, ""))[0]
        if r["LOCAL"] or r["STACK"] != allowed_stack:
            problems.append(f"{sym}: spills or uses local memory (LOCAL {r['LOCAL']} bytes, STACK {r['STACK']} bytes"
                            f"{f'; its known frame is {allowed_stack}' if allowed_stack else ''})")
    checked = 0
    for sym, threads, smem in sorted(launches):
        r = kernels.get(sym)
        if r is None:
            problems.append(f"{sym}: launched by the CPU tests but in none of the GPU binaries examined")
            continue
        checked += 1
        regs = registers_per_block(r["REG"], threads)
        if regs > REGISTERS_PER_SM:
            problems.append(f"{sym} with {threads} threads: {r['REG']} registers a thread take {regs} per block, "
                            f"more than the {REGISTERS_PER_SM} of an SM")
        shared = max(0, r["SHARED"] - RESERVED_SHARED) + smem
        if shared > MAX_SHARED:
            problems.append(f"{sym} with {smem} bytes of dynamic shared memory: {shared} bytes in all "
                            f"(static {r['SHARED'] - RESERVED_SHARED}), more than the {MAX_SHARED} a block may have")
    return problems, checked


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch-log", required=True)
    ap.add_argument("--res-usage", help="cuobjdump -res-usage output, instead of running cuobjdump on BINARY...")
    ap.add_argument("binaries", nargs="*")
    args = ap.parse_args()
    if args.res_usage:
        with open(args.res_usage) as f:
            text = f.read()
    else:
        if not args.binaries:
            sys.exit("check_res_usage: no GPU binaries given")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        tool = find_cuobjdump(repo)
        if not tool:
            sys.exit("check_res_usage: cuobjdump not found ($CUOBJDUMP, PATH, the CUDA toolkit, <repo>/.venv); "
                     "install it with scripts/install_deps.sh (the nvidia-cuda-cuobjdump wheel)")
        text = ""
        for b in args.binaries:
            run = subprocess.run([tool, "-res-usage", b], capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"check_res_usage: {tool} -res-usage {b} failed: {run.stderr.strip()}")
            text += run.stdout
    kernels = parse_res_usage(text)
    if not kernels:
        sys.exit("check_res_usage: no kernels in the cuobjdump output")
    try:
        with open(args.launch_log) as f:
            launches = parse_launch_log(f.read())
    except (OSError, ValueError) as e:
        sys.exit(f"check_res_usage: {e}")
    if not launches:
        sys.exit(f"check_res_usage: {args.launch_log} lists no launches (did the CPU tests run with EMU_LAUNCH_LOG?)")
    problems, checked = violations(kernels, launches)
    worst = max((registers_per_block(kernels[s]["REG"], t) / REGISTERS_PER_SM, s, t)
                for s, t, _ in launches if s in kernels)
    print(f"{len(kernels)} kernels in the GPU binaries, {checked} launch configurations checked; most registers: "
          f"{worst[1]} with {worst[2]} threads, {100 * worst[0]:.0f}% of an SM")
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
