#!/usr/bin/env python3
"""The GPU bundle's fallback build finds nlohmann-json where the machine has no package.

A GPU machine may lack Debian's nlohmann-json3-dev and the internet; scripts/build_gpu_bundle.sh puts
the headers its build compiled against into the bundle (include/nlohmann/), and scripts/gpu_check.sh's
rebuild hands that folder back (--json-include BUNDLE/include). Here, with the package hidden from
CMake (CMAKE_DISABLE_FIND_PACKAGE_nlohmann_json):
  - a configure given a copy of the headers as the bundle holds them takes that folder, and the
    checkpoint format compiles against it alone (no other nlohmann on the include path first);
  - build_gpu_bundle.sh refuses a --json-include folder without nlohmann/json.hpp, before building;
  - gpu_check.sh's rebuild passes the bundle's include/ on.
Only CMake's configure step runs (no program is built): a few seconds.

usage: test_bundle_json.py BUILD_DIR   (a configured build folder: its CMakeCache names the headers)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.environ.get("REPO", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def cache_value(build, name):
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.rstrip("\n").split("=", 1)[1]
    return ""


def main():
    build = sys.argv[1]
    used = cache_value(build, "NLOHMANN_JSON_USED")
    check(os.path.isfile(os.path.join(used, "nlohmann", "json.hpp")),
          f"the build records the nlohmann-json headers it compiles against ({used!r})")
    with tempfile.TemporaryDirectory() as tmp:
        carried = os.path.join(tmp, "bundle", "include")
        shutil.copytree(os.path.join(used, "nlohmann"), os.path.join(carried, "nlohmann"))
        # The configure of build_gpu_bundle.sh (no CPU programs, no MPI), less the GPU programs: their
        # compilers are not what is tested, and CMake then skips the CUDA compiler checks.
        p = subprocess.run(["cmake", "-S", REPO, "-B", os.path.join(tmp, "build"), "-DTRAIN_GPT_MPI=OFF",
                            "-DBUILD_CPU=OFF", "-DBUILD_GPU=OFF", "-DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON",
                            "-DNLOHMANN_JSON_INCLUDE_DIR=" + carried],
                           capture_output=True, text=True)
        check(p.returncode == 0, "configure with the package hidden and the carried headers: " +
              (p.stderr[-1500:] if p.returncode else "ok"))
        if p.returncode == 0:
            check(cache_value(os.path.join(tmp, "build"), "NLOHMANN_JSON_USED") == carried,
                  "that build compiles against the carried folder")
        # The format compiles against the carried copy alone: -nostdinc++ is not needed, but the
        # system's own nlohmann must not be what is found, so the copy's folder comes first.
        source = os.path.join(tmp, "format.cpp")
        with open(source, "w") as f:
            f.write('#include "runtime/checkpoint_format.h"\nint main() { return ckpt::CheckpointWriter().header().size() == 0; }\n')
        p = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-H", "-isystem", carried, "-I", REPO, source],
                           capture_output=True, text=True)
        headers = [line.split(" ", 1)[1] for line in p.stderr.splitlines() if re.match(r"^\.+ ", line)]
        json_headers = [h for h in headers if "/nlohmann/" in h]
        check(p.returncode == 0 and json_headers and all(h.startswith(carried) for h in json_headers),
              f"the checkpoint format compiles against the carried headers ({len(json_headers)} of them, "
              f"none from elsewhere){'' if p.returncode == 0 else ': ' + p.stderr[-800:]}")

        empty = os.path.join(tmp, "empty")
        os.mkdir(empty)
        p = subprocess.run([os.path.join(REPO, "scripts", "build_gpu_bundle.sh"), "--json-include", empty,
                            "--build", os.path.join(tmp, "never"), "--out", os.path.join(tmp, "never-out")],
                           capture_output=True, text=True)
        check(p.returncode == 2 and "holds no nlohmann/json.hpp" in p.stderr and not os.path.exists(os.path.join(tmp, "never")),
              f"build_gpu_bundle.sh refuses a --json-include without the headers, before building: {p.returncode} {p.stderr.strip()!r}")

    with open(os.path.join(REPO, "scripts", "gpu_check.sh")) as f:
        gpu_check = f.read()
    rebuild = gpu_check[gpu_check.index("rebuild_bundle() {"):]
    rebuild = rebuild[:rebuild.index("\n}\n")]
    check('--json-include "$GC_BIN/include"' in rebuild and '"${json[@]}"' in rebuild,
          "gpu_check.sh's rebuild passes the bundle's include/ to build_gpu_bundle.sh")

    print(f"{len(FAILURES)} failed" if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
