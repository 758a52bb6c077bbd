#!/usr/bin/env bash
# One record attempt on this node's GPUs: checks for the GPUs and the FineWeb shards, builds the
# GPU trainer (make), then runs it with one MPI rank per GPU.
#
#   scripts/run_record.sh [train_gpt flags...]
#
# The flags go to build/train_gpt unchanged, e.g. --run-id ID (the log is <log-dir>/<ID>.txt),
# --log-dir DIR (default logs), --train-files GLOB, --val-files GLOB (defaults: upstream's
# data/fineweb10B/fineweb_{train,val}_*.bin). It runs from the repository root, so relative paths
# in the flags are taken from there. `build/train_gpt --help` lists every flag.
#
# Environment:
#   NP=8           ranks, one GPU each (the trainer accumulates 8/NP micro-batches per step)
#   MPIRUN=mpirun  the launcher command, split at spaces (e.g. "mpirun --mca btl ^openib")
#   MPI_BIND=...   mpirun's placement flags; default: NP/K consecutive ranks on each of the K NUMA
#                  nodes, each rank bound to its node (--map-by ppr:NP/K:numa --bind-to numa), so
#                  ranks 0-3 sit next to GPUs 0-3 on a two-socket 8-GPU server; --bind-to numa
#                  alone when NP is not a multiple of K
#   SKIP_BUILD=1   use the trainer as built, without running make
#   BUILD=build    the build directory, as the Makefile's
# Exit status: 1 when a check fails (no GPU, too few GPUs, no data, no binary), 2 bad usage,
# otherwise the trainer's.
set -euo pipefail

die() {
  echo "run_record.sh: $*" >&2
  exit 1
}

if [[ ${1-} == -h || ${1-} == --help ]]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

np=${NP:-8}
if [[ ! $np =~ ^[1-9][0-9]*$ ]]; then
  echo "run_record.sh: NP must be a positive whole number of ranks, got '$np'" >&2
  exit 2
fi

# The GPUs first: without them nothing else matters.
if ! gpus=$(nvidia-smi -L 2>/dev/null) || [[ -z $gpus ]]; then
  die "no NVIDIA GPU found (nvidia-smi is missing or fails): a record run needs $np GPUs.
  To run the trainer on this machine's CPU instead (the tiny demo), use: make run"
fi
gpu_count=$(grep -c '^GPU [0-9]' <<<"$gpus" || true)
if ((gpu_count < np)); then
  die "nvidia-smi lists $gpu_count GPU(s), but $np ranks need one GPU each (set NP to use fewer ranks)"
fi

# The data the flags (or the trainer's defaults) name. Both "--flag value" and "--flag=value".
train_glob='data/fineweb10B/fineweb_train_*.bin'
val_glob='data/fineweb10B/fineweb_val_*.bin'
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --train-files | --val-files)
      ((i + 1 < ${#args[@]})) || { echo "run_record.sh: ${args[i]} needs a value (a glob)" >&2; exit 2; }
      if [[ ${args[i]} == --train-files ]]; then train_glob=${args[i + 1]}; else val_glob=${args[i + 1]}; fi
      i=$((i + 1))
      ;;
    --train-files=*) train_glob=${args[i]#*=} ;;
    --val-files=*) val_glob=${args[i]#*=} ;;
  esac
done
missing=()
compgen -G "$train_glob" >/dev/null || missing+=("training shards: no file matches $train_glob")
compgen -G "$val_glob" >/dev/null || missing+=("validation shards: no file matches $val_glob")
if ((${#missing[@]})); then
  {
    printf 'run_record.sh: missing %s\n' "${missing[@]}"
    echo "  Download the FineWeb validation shard and the first 9 training shards (about 2 GB, as"
    echo "  upstream's record used) into data/fineweb10B/ with:"
    echo "    python3 data/cached_fineweb10B.py 9"
  } >&2
  exit 1
fi

build=${BUILD:-build}
[[ $build == /* ]] || build=$repo/$build
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  make -C "$repo" ${BUILD:+"BUILD=$BUILD"}
fi
trainer=$build/train_gpt
[[ -x $trainer ]] || die "$trainer is missing: build it with make (SKIP_BUILD=1 skips the build)"

read -r -a mpirun <<<"${MPIRUN:-mpirun}"
((${#mpirun[@]})) || die "MPIRUN is empty"
command -v "${mpirun[0]}" >/dev/null || die "${mpirun[0]} not found: install Open MPI (scripts/install_deps.sh)"

if [[ -n ${MPI_BIND+set} ]]; then
  read -r -a placement <<<"$MPI_BIND"
else
  numa_nodes=$(compgen -G '/sys/devices/system/node/node[0-9]*' | wc -l || true)
  if ((numa_nodes > 0 && np % numa_nodes == 0)); then
    placement=(--map-by "ppr:$((np / numa_nodes)):numa" --bind-to numa)
  else
    placement=(--bind-to numa)
  fi
fi
# Open MPI refuses to start as root (the usual case on rented GPU nodes) unless told it is meant.
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

cmd=("${mpirun[@]}" -np "$np" "${placement[@]}" "$trainer" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
