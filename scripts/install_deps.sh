#!/usr/bin/env bash
# Everything the build and the tests need, in two parts:
#  1. Debian packages (CMake, g++, Open MPI, python3 with venv, nlohmann-json; Boost.Context only off x86-64): the
#     missing ones are installed when run as root, else the apt-get line to run is printed.
#  2. The project's Python environment <repo>/.venv with requirements.txt, and, where there is no
#     CUDA toolkit (or with --cuda-headers), requirements-cuda-headers.txt: NVIDIA's headers for the
#     CPU build. A stamp of the requirements' hash skips pip when nothing changed.
# Idempotent, and fast when everything is there. `make` runs it before configuring.
set -euo pipefail
usage="usage: scripts/install_deps.sh [--cuda-headers]   (--cuda-headers: NVIDIA's header wheels even with a CUDA toolkit)"
want_headers=0
for arg in "$@"; do
  case $arg in
    --cuda-headers) want_headers=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "install_deps.sh: unknown argument '$arg'" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$repo/.venv

# ---- 1. Debian packages ----
missing=()
have_header() { echo "#include <$1>" | g++ -x c++ -fsyntax-only - 2>/dev/null; }
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
command -v python3 >/dev/null || missing+=(python3)
# Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
# emu switches fiber stacks itself on x86-64; elsewhere it uses Boost.Context (emu/exec.cpp).
if [[ $(uname -m) != x86_64 ]]; then
  have_header boost/context/detail/fcontext.hpp || missing+=(libboost-context-dev)
fi
# The checkpoint format reads and writes its JSON with nlohmann-json (header-only).
have_header nlohmann/json.hpp || missing+=(nlohmann-json3-dev)
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

# ---- 2. The Python environment ----
# The toolkit as CMake's FindCUDAToolkit looks for it: nvcc on PATH, $CUDA_PATH, /usr/local/cuda.
have_toolkit() {
  command -v nvcc >/dev/null || [[ -x ${CUDA_PATH:-/nonexistent}/bin/nvcc ]] || [[ -x /usr/local/cuda/bin/nvcc ]]
}
requirements=("$repo/requirements.txt")
if ((want_headers)) || ! have_toolkit; then
  requirements+=("$repo/requirements-cuda-headers.txt")
fi
stamp=$venv/.requirements-stamp
# The stamp names the requirements' hash and the interpreter the venv was made from.
hash=$( (python3 -c 'import sys; print(sys.version)'; cat "${requirements[@]}") | sha256sum | cut -c1-64)
if [[ -f $stamp && $(cat "$stamp") == "$hash" && -x $venv/bin/python ]]; then
  exit 0
fi
if [[ ! -x $venv/bin/python ]]; then
  echo "creating the Python environment $venv"
  python3 -m venv "$venv"
fi
pip_args=(-q --disable-pip-version-check --no-input)
for r in "${requirements[@]}"; do pip_args+=(-r "$r"); done
echo "installing into $venv: $(sed -e 's/#.*//' -e '/^ *$/d' -e 's/ *$//' "${requirements[@]}" | paste -sd ' ')"
"$venv/bin/python" -m pip install "${pip_args[@]}"
# cuobjdump where tools look for it first in the venv (its wheel puts it under nvidia/cu<N>/bin).
cuobjdump=$("$venv/bin/python" -c 'import glob, sysconfig
print(next(iter(glob.glob(sysconfig.get_paths()["purelib"] + "/nvidia/*/bin/cuobjdump")), ""))')
if [[ -n $cuobjdump ]]; then
  ln -sf "$cuobjdump" "$venv/bin/cuobjdump"
fi
echo "$hash" > "$stamp"
