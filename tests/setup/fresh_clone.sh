#!/usr/bin/env bash
# The README's setup on a fresh clone, as a new user gets it: the repository's last commit cloned into
# a temporary folder (with ../shared beside it when this checkout has one, as CI has), and a bare
# Python: python3 is a fresh venv with nothing installed and no user site-packages, so nothing the
# tests import can come from this machine's Python.
#
#   fresh_clone.sh quick       scripts/install_deps.sh, configure, build and run one small test, check
#                              that CMake's Python is the clone's .venv and that it imports what
#                              requirements.txt names (the CTest setup_fresh_clone)
#   fresh_clone.sh full        the README's two commands, make test then make run; prints the
#                              transcript's length and the time
#   fresh_clone.sh no-toolkit  the CPU build with the CUDA toolkit hidden (a mount namespace over
#                              /usr/local/cuda*, /usr/local/bin and /usr/local/include; needs
#                              unshare): install_deps.sh installs NVIDIA's header wheels, configure
#                              says so, two kernel tests build and pass, and link no NVIDIA library
#
# KEEP=1 keeps the temporary folder; JOBS=N as for make.
set -euo pipefail
mode=${1:-}
case $mode in
  quick|full|no-toolkit) ;;
  *) echo "usage: tests/setup/fresh_clone.sh quick|full|no-toolkit" >&2; exit 2 ;;
esac
repo=$(cd "$(dirname "$0")/../.." && pwd)
rev=$(git -C "$repo" rev-parse HEAD)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/fresh_clone.XXXXXX")
if [[ ${KEEP:-0} == 1 ]]; then
  echo "keeping $tmp"
else
  trap 'rm -rf "$tmp"' EXIT
fi
fail() { echo "FAIL: $*" >&2; echo "0 passed, 1 failed"; exit 1; }

echo "fresh clone of $rev (uncommitted changes are not in it) in $tmp/repo"
git clone -q --no-checkout "$repo" "$tmp/repo"
git -C "$tmp/repo" checkout -q "$rev"
if [[ -d $repo/../shared ]]; then
  ln -s "$(cd "$repo/../shared" && pwd)" "$tmp/shared"
fi

# The bare Python: first on PATH, no pip, no packages; user site-packages off.
python3 -m venv --without-pip "$tmp/bare-python"
export PATH=$tmp/bare-python/bin:$PATH PYTHONNOUSERSITE=1
unset PYTHONPATH VIRTUAL_ENV
if python3 -c 'import numpy' 2>/dev/null; then
  fail "the bare python3 ($(command -v python3)) imports numpy: the check would prove nothing"
fi
cd "$tmp/repo"

# The modules requirements.txt's packages provide, imported by the clone's .venv python.
check_imports() {
  .venv/bin/python -c 'import numpy, tiktoken, matplotlib, safetensors, scipy' || fail "the .venv lacks a package of requirements.txt"
  .venv/bin/cuobjdump --version >/dev/null || fail ".venv/bin/cuobjdump does not run"
  local python
  python=$(sed -n 's/^_Python3_EXECUTABLE:INTERNAL=//p' build/CMakeCache.txt)
  [[ $python == "$PWD/.venv/bin/python" ]] || fail "CMake's Python is '$python', not the clone's .venv"
}

case $mode in
  quick)
    scripts/install_deps.sh
    cmake -S . -B build -DBUILD_GPU=OFF >build.log 2>&1 || { cat build.log; fail "configure"; }
    cmake --build build --target test_data_shard -j "${JOBS:-2}" >>build.log 2>&1 || { cat build.log; fail "build"; }
    check_imports
    (cd build && ctest -R '^test_data_shard$' --output-on-failure) || fail "test_data_shard"
    echo "1 passed, 0 failed"
    ;;
  full)
    start=$(date +%s)
    { make test && make run; } 2>&1 | tee "$tmp/transcript.txt"
    status=${PIPESTATUS[0]}
    seconds=$(($(date +%s) - start))
    echo "transcript: $(wc -l <"$tmp/transcript.txt") lines, $((seconds / 60)) min $((seconds % 60)) s, exit $status"
    ((status == 0)) || fail "make test && make run"
    check_imports
    ;;
  no-toolkit)
    # Inside a private mount namespace the toolkit's folders are empty: nvcc, headers and libraries
    # are really gone, for install_deps.sh and CMake alike. As non-root, a user namespace maps us to root.
    unshare_args=(-m --propagation private)
    [[ $(id -u) == 0 ]] || unshare_args+=(-r)
    unshare "${unshare_args[@]}" bash -euo pipefail -c '
      for d in /usr/local/cuda* /usr/local/bin /usr/local/include; do
        if [[ -d $d ]]; then mount -t tmpfs none "$(readlink -f "$d")"; fi
      done
      if command -v nvcc || [[ -e /usr/local/cuda/include/cuda_runtime.h ]]; then
        echo "FAIL: the CUDA toolkit is still visible"; exit 1
      fi
      scripts/install_deps.sh
      cmake -S . -B build | tee configure.log | grep "No CUDA toolkit"
      grep -q "^BUILD_GPU:BOOL=OFF" build/CMakeCache.txt
      cmake --build build --target test_common test_norm -j "${JOBS:-2}" >build.log 2>&1 || { tail -30 build.log; exit 1; }
      (cd build && ctest -R "^(test_common|test_norm)$" --output-on-failure)
      if ldd build/test_norm | grep -E "cudart|cublas|nccl"; then echo "FAIL: links an NVIDIA library"; exit 1; fi
      if out=$(cmake --build build --target train_gpt 2>&1) || ! grep "GPU build is off" <<<"$out"; then
        echo "FAIL: building train_gpt without nvcc should fail saying the GPU build is off: $out"; exit 1
      fi
    ' || fail "the CPU build without a CUDA toolkit"
    echo "1 passed, 0 failed"
    ;;
esac
