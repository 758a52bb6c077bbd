#!/usr/bin/env bash
# Checks what the build needs and installs what is missing from Debian's packages (as root),
# or says exactly what to install. The CUDA toolkit (nvcc, cuBLASLt, NCCL) is NVIDIA's and
# must already be there: both builds use its headers.
set -euo pipefail
missing=()
have_header() { echo "#include <$1>" | g++ -x c++ -fsyntax-only - 2>/dev/null; }
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
have_header boost/context/detail/fcontext.hpp || missing+=(libboost-context-dev)
command -v python3 >/dev/null || missing+=(python3)
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  else
    echo "missing packages; install them with:" >&2
    echo "  sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "the CUDA toolkit (nvcc, headers, cuBLASLt, NCCL) is needed for both builds: install CUDA 12.4+ and NCCL" >&2
  exit 1
fi
