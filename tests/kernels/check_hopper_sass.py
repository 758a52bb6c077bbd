"""The GPU build's Hopper GEMM really runs on wgmma and TMA, without spilling (issue 20, item 4).

Usage: check_hopper_sass.py BINARY KERNEL_SYMBOL_PREFIX...
For each kernel whose mangled symbol starts with a prefix: `cuobjdump -sass` must show HGMMA (bf16 wgmma) or
QGMMA (FP8 wgmma) and UTMALDG instructions in it, and `cuobjdump -res-usage` must give it no local memory and no stack (spills).
cuobjdump is found as check_res_usage.py finds it; -sass also needs nvdisasm (find_nvdisasm).
Exits 77 (CTest's skip) when either tool is missing."""
import glob
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu_build"))
from check_res_usage import find_cuobjdump  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def functions(text, header):
    """{symbol: body} of cuobjdump's listing, split at lines matching `header` (group 1: the symbol)."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(header, line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name:
            out[name] += line + "\n"
    return out


def find_nvdisasm(cuobjdump):
    """nvdisasm on PATH, beside cuobjdump, or from the project's .venv (the nvidia-cuda-nvdisasm wheel:
    nvidia/cu<N>/bin or nvidia/cuda_nvdisasm/bin in site-packages); None when there is none."""
    candidates = [shutil.which("nvdisasm") or "", os.path.join(os.path.dirname(cuobjdump), "nvdisasm")]
    for pattern in ("nvidia/cu*/bin/nvdisasm", "nvidia/cuda_nvdisasm/bin/nvdisasm"):
        candidates += sorted(glob.glob(os.path.join(REPO, ".venv", "lib", "python3*", "site-packages", pattern)))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def main():
    binary, prefixes = sys.argv[1], sys.argv[2:]
    cuobjdump = find_cuobjdump(REPO)
    nvdisasm = cuobjdump and find_nvdisasm(cuobjdump)
    if not cuobjdump or not nvdisasm:
        print("check_hopper_sass: skipped, no cuobjdump with nvdisasm here")
        return 77
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    sass = functions(subprocess.run([cuobjdump, "-sass", binary], check=True, capture_output=True, text=True, env=env).stdout,
                     r"Function : (\S+)")
    res = functions(subprocess.run([cuobjdump, "-res-usage", binary], check=True, capture_output=True, text=True).stdout,
                    r"Function (\S+):")
    failures, checked = [], 0
    for symbol, body in sass.items():
        if not any(symbol.startswith(p) for p in prefixes):
            continue
        checked += 1
        # HGMMA: bf16 wgmma; QGMMA: FP8 (e4m3/e5m2) wgmma
        if "HGMMA" not in body and "QGMMA" not in body:
            failures.append(f"{symbol}: no HGMMA or QGMMA in its SASS")
        if "UTMALDG" not in body:
            failures.append(f"{symbol}: no UTMALDG in its SASS")
        usage = res.get(symbol, "")
        for field in ("LOCAL", "STACK"):
            m = re.search(field + r":(\d+)", usage)
            if not m or int(m.group(1)) != 0:
                failures.append(f"{symbol}: {field} is {m.group(1) if m else 'missing'} (spills)")
    if checked == 0:
        failures.append(f"no kernel in {binary} starts with {' or '.join(prefixes)}")
    for f in failures:
        print("check_hopper_sass:", f)
    if not failures:
        print(f"check_hopper_sass: {checked} kernels with HGMMA or QGMMA and UTMALDG, no local memory")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
