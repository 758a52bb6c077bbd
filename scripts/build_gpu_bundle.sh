#!/usr/bin/env bash
# The single-GPU bundle (README: "One GPU, no MPI"): train_gpt and every non-MPI *_gpu test program
# built for one rank (TRAIN_GPT_MPI=OFF: no MPI, the NCCL stand-in, static CUDA runtime, libstdc++
# and libgcc), stripped, in one folder with bundle.json (git revision, nvcc version, build date, each
# file's name, size and sha256). Built here, it travels to a GPU machine with the tree, so no GPU time
# goes to compiling; on a GPU machine it is also the fallback build (ninja where there is one). It
# compiles no CPU code (BUILD_CPU=OFF) and needs neither scripts/install_deps.sh nor .venv: the CUDA
# toolkit, nccl.h (beside it, or from a Python's NVIDIA wheels), CMake, python3, and nlohmann-json's
# headers: Debian's package, or --json-include DIR. The bundle carries the headers it was built with
# in include/nlohmann/, so that a GPU machine without the package (and without internet) can rebuild
# it from a bundle's include/ (scripts/gpu_check.sh does).
# Refuses to finish when a program loads MPI, NCCL or a shared libstdc++, or the bundle reaches
# 50 MiB (the tree it travels with may weigh 64 MiB in all).
# Usage: scripts/build_gpu_bundle.sh [--out DIR] [--jobs N] [--build DIR] [--json-include DIR]
#   --out DIR           the bundle's folder (default gpu-bundle/ at the repository root; git ignores it)
#   --jobs N            parallel compile jobs (default: the number of cores)
#   --build DIR         the CMake build folder (default build-gpu-bundle/ at the repository root)
#   --json-include DIR  a folder holding nlohmann/json.hpp, used where no nlohmann-json package is found
set -euo pipefail
trap 'echo "build_gpu_bundle: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
repo=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: scripts/build_gpu_bundle.sh [--out DIR] [--jobs N] [--build DIR] [--json-include DIR]"
out=$repo/gpu-bundle
build=$repo/build-gpu-bundle
jobs=$(nproc)
limit_mib=50
json_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --out|--jobs|--build|--json-include)
      if [ $# -lt 2 ] || [ -z "$2" ]; then echo "build_gpu_bundle: $1 needs a value; $usage" >&2; exit 2; fi
      case $1 in
        --out) out=$2 ;;
        --build) build=$2 ;;
        --json-include)
          if [ ! -f "$2/nlohmann/json.hpp" ]; then echo "build_gpu_bundle: --json-include $2 holds no nlohmann/json.hpp" >&2; exit 2; fi
          json_args=(-DNLOHMANN_JSON_INCLUDE_DIR="$(cd "$2" && pwd)") ;;
        --jobs)
          if ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then echo "build_gpu_bundle: --jobs $2 is not a positive number" >&2; exit 2; fi
          jobs=$2 ;;
      esac
      shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "build_gpu_bundle: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
done
for tool in cmake python3 strip ldd; do
  command -v $tool >/dev/null || { echo "build_gpu_bundle: $tool not found" >&2; exit 1; }
done
# The bundle's folder holds only what this script put there: anything else is not ours to delete.
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ] && [ ! -f "$out/bundle.json" ]; then
  echo "build_gpu_bundle: $out exists and is not a bundle (no bundle.json): choose another --out" >&2
  exit 1
fi

start=$(date +%s)
generator=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
mkdir -p "$build"
# --compress-mode=size: the programs' device code compressed (a sixth of its size; the driver unpacks it
# once at load), so that the bundle stays under its limit with every kernel test in it.
cmake -S "$repo" -B "$build" "${generator[@]}" -DTRAIN_GPT_MPI=OFF -DBUILD_CPU=OFF -DBUILD_GPU=ON "${json_args[@]}" \
  -DCMAKE_CUDA_FLAGS=--compress-mode=size \
  >"$build/bundle-configure.log" 2>&1 || {
  cat "$build/bundle-configure.log" >&2
  echo "build_gpu_bundle: configuring $build failed (log above)" >&2
  exit 1
}
cmake --build "$build" --target gpu_all -j "$jobs"
built=$(date +%s)

# gpu_all is train_gpt and the non-MPI *_gpu programs: every executable the build made at its top, less
# what the GPU check does not run (the bundle must stay well under 50 MiB; each program that includes
# the trainer weighs about 5 MiB):
#   test_batch_producer_gpu: the host-side batch producer (loader threads, no kernel), which the CPU
#   build tests the same way.
left_out=(test_batch_producer_gpu)
mapfile -t programs < <(find "$build" -maxdepth 1 \( -type f -o -type l \) -executable \( -name train_gpt -o -name 'test_*_gpu' \) |
                        grep -v -x -F "${left_out[@]/#/$build/}" | sort)
if [ ${#programs[@]} -eq 0 ] || [ ! -f "$build/train_gpt" ]; then
  echo "build_gpu_bundle: the build made no train_gpt in $build" >&2
  exit 1
fi
"$repo/scripts/check_single_rank_libs.sh" "${programs[@]}" >"$build/bundle-libs.txt" || {
  cat "$build/bundle-libs.txt" >&2
  echo "build_gpu_bundle: refusing to bundle: a program loads MPI, NCCL or a shared libstdc++ (above)" >&2
  exit 1
}

# Made whole in the build folder first: a failure leaves the previous bundle (or none), never half of one.
staging=$build/bundle-staging
rm -rf "$staging"
mkdir -p "$staging"
# A program that is a link (several test names of one binary, cmake/trainer_tests.cmake) stays a link to
# its one stripped copy: following it would put the whole binary in the bundle once per name.
for p in "${programs[@]}"; do
  if [ -L "$p" ]; then
    target=$(readlink "$p")
    case $target in */*) echo "build_gpu_bundle: $p links outside its folder ($target)" >&2; exit 1 ;; esac
    [ -f "$staging/$target" ] || strip -o "$staging/$target" "$build/$target"
    ln -s "$target" "$staging/$(basename "$p")"
  else
    strip -o "$staging/$(basename "$p")" "$p"
  fi
done
# The nlohmann-json headers this build compiled against (CMake recorded where they are).
json_dir=$(sed -n 's/^NLOHMANN_JSON_USED:INTERNAL=//p' "$build/CMakeCache.txt")
mkdir -p "$staging/include"
cp -R "$json_dir/nlohmann" "$staging/include/"

revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  revision="$revision+uncommitted changes"
fi
# The nvcc CMake compiled with (CMakeLists.txt may pick the toolkit's own, not PATH's).
nvcc_path=$(sed -n 's/^set(CMAKE_CUDA_COMPILER "\(.*\)")$/\1/p' "$build"/CMakeFiles/*/CMakeCUDACompiler.cmake | head -1)
nvcc_version=$("${nvcc_path:-nvcc}" --version 2>/dev/null | grep -m1 'release' || echo unknown)
python3 - "$staging" "$revision" "$nvcc_version" "$limit_mib" "$build/bundle-libs.txt" "${left_out[@]}" <<'EOF'
import datetime, hashlib, json, os, re, sys
out, revision, nvcc, limit_mib, libs_path = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
left_out = sys.argv[6:]
files, glibc = [], (2, 0)
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name)
    if name == "bundle.json" or not os.path.isfile(path):  # include/: the headers for a rebuild
        continue
    if os.path.islink(path):  # another name of a program listed under its own name
        files.append({"name": name, "link": os.readlink(path)})
        continue
    with open(path, "rb") as f:
        data = f.read()
    files.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    # The newest glibc symbol version a program asks for: the oldest glibc that runs the bundle.
    for v in re.findall(rb"GLIBC_2\.(\d+)", data):
        glibc = max(glibc, (2, int(v)))
total = sum(f.get("bytes", 0) for f in files)
# What ldd listed for train_gpt here: the libraries the GPU machine must provide (cuBLASLt, glibc, the driver at run time).
needs = next((l.split(": ", 1)[1].split() for l in open(libs_path) if l.startswith("train_gpt: ")), [])
bundle = {"git_revision": revision, "nvcc": nvcc, "built_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "build": "TRAIN_GPT_MPI=OFF BUILD_CPU=OFF, stripped", "train_gpt_loads": needs,
          "needs_glibc": "%d.%d" % glibc,
          "left_out": left_out, "total_bytes": total, "files": files,
          "json_headers": "include/nlohmann (for a rebuild: build_gpu_bundle.sh --json-include BUNDLE/include)"}
with open(os.path.join(out, "bundle.json"), "w") as f:
    json.dump(bundle, f, indent=1)
    f.write("\n")
mib = total / 2**20
print(f"gpu bundle: {len(files)} programs, {mib:.1f} MiB (limit {limit_mib:.0f} MiB), left out: {' '.join(left_out) or 'none'}")
print(f"gpu bundle: needs glibc {glibc[0]}.{glibc[1]} or newer; train_gpt loads {' '.join(needs)}")
if mib >= limit_mib:
    sys.exit(f"build_gpu_bundle: the bundle is {mib:.1f} MiB, not under {limit_mib:.0f} MiB")
EOF

# The previous bundle's files out (only those its bundle.json lists), the new one in.
mkdir -p "$out"
if [ -f "$out/bundle.json" ]; then
  python3 -c 'import json, os, sys
b = json.load(open(sys.argv[1]))
for f in b["files"]:
    p = os.path.join(os.path.dirname(sys.argv[1]), os.path.basename(f["name"]))
    if os.path.islink(p) or os.path.isfile(p): os.remove(p)' "$out/bundle.json"
  rm -rf "$out/include"
  rm -f "$out/bundle.json"
fi
mv "$staging"/* "$out"/
rmdir "$staging"
echo "gpu bundle: in $out"
end=$(date +%s)
echo "gpu bundle: built in $((built - start)) s with $jobs job(s), $((end - start)) s in all"
