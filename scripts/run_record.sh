#!/usr/bin/env bash
# One record attempt: checks for the GPUs and the FineWeb shards, builds the GPU trainer (make),
# runs its platform check (--check-platform: a kernel, a cuBLASLt matmul and an NCCL all-reduce on
# every rank), then trains with one MPI rank per GPU, on this node or on the nodes of a hostfile.
#
#   scripts/run_record.sh [--cpu] [train_gpt flags...]
#
# The flags go to the trainer unchanged, e.g. --run-id ID (the log is <log-dir>/<ID>.txt),
# --log-dir DIR (default logs), --seed N, --train-files GLOB, --val-files GLOB (defaults: upstream's
# data/fineweb10B/fineweb_{train,val}_*.bin). It runs from the repository root, so relative paths
# in the flags are taken from there. `build/train_gpt --help` lists every flag. The preset is
# --preset record (the default): upstream's newest record this program reproduces, record 89; the
# older ones by name (--preset r71, r80, r84, r86; README "Presets").
#
# --cpu runs the CPU build (build/train_gpt_cpu, built with cmake's train_gpt_cpu target) instead:
# no GPU needed, ranks oversubscribed on this machine's cores; with --preset tiny it trains on the
# committed Tiny Shakespeare shards.
#
# Environment:
#   NP=8           ranks, one GPU each (default 8; 1 with --cpu; with HOSTFILE, the hostfile's
#                  slots summed). The trainer accumulates 8/NP micro-batches per step.
#   HOSTFILE=FILE  run across the nodes it names, Open MPI's format, one node a line with its
#                  GPU count as slots ("node1 slots=4"); every node's GPUs are checked first
#                  (mpirun -npernode 1 nvidia-smi -L), and the NCCL_* variables set here, and
#                  LD_LIBRARY_PATH, are passed to every rank (mpirun -x). The repository, its
#                  build and the data must be at the same path on every node.
#   MPIRUN=mpirun  the launcher command, split at spaces (e.g. "mpirun --mca btl ^openib")
#   MPI_BIND=...   mpirun's placement flags; default on one node: NP/K consecutive ranks on each of
#                  the K NUMA nodes, each rank bound to its node (--map-by ppr:NP/K:numa --bind-to
#                  numa), so ranks 0-3 sit next to GPUs 0-3 on a two-socket 8-GPU server; --bind-to
#                  numa alone when NP is not a multiple of K. With HOSTFILE: --map-by slot
#                  --bind-to none (each node's slots filled in rank order). With --cpu:
#                  --oversubscribe --bind-to none.
#   BINARY=PATH    the trainer to run (default <BUILD>/train_gpt, with --cpu <BUILD>/train_gpt_cpu)
#   SKIP_BUILD=1   use the trainer as built, without building it
#   SKIP_PLATFORM_CHECK=1  leave out the --check-platform run (run_many.sh runs it once a series)
#   BUILD=build    the build directory, as the Makefile's
# Exit status: 1 when a check fails (no GPU, too few GPUs on a node, no data, no binary, a bad
# hostfile, the platform check), 2 bad usage, otherwise the trainer's.
set -euo pipefail

die() {
  echo "run_record.sh: $*" >&2
  exit 1
}
usage() {
  echo "run_record.sh: $*" >&2
  exit 2
}

if [[ ${1-} == -h || ${1-} == --help ]]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

# --cpu is this script's; every other flag is the trainer's.
platform=gpu
args=()
for arg in "$@"; do
  if [[ $arg == --cpu ]]; then platform=cpu; else args+=("$arg"); fi
done

# Hostfile lines: "name slots=N [other keys]"; '#' starts a comment. Sets hosts[] and slots[].
hosts=()
slots=()
read_hostfile() {
  local file=$1 number=0 line name rest count
  [[ -r $file ]] || die "HOSTFILE $file cannot be read"
  while IFS= read -r line || [[ -n $line ]]; do
    number=$((number + 1))
    line=${line%%#*}
    read -r name rest <<<"$line" || true
    [[ -n ${name-} ]] || continue
    count=$(grep -oE '(^|[[:space:]])slots=[0-9]+' <<<" $rest" | head -1 | cut -d= -f2 || true)
    [[ -n $count ]] && ((10#$count > 0)) \
      || die "HOSTFILE $file line $number: '$name' has no slots=N (N: the node's GPUs, one rank each)"
    for seen in "${hosts[@]}"; do
      [[ $seen != "$name" ]] || die "HOSTFILE $file line $number: '$name' is listed twice"
    done
    hosts+=("$name")
    slots+=($((10#$count)))
  done <"$file"
  ((${#hosts[@]})) || die "HOSTFILE $file names no node"
}

hostfile=${HOSTFILE-}
if [[ -n $hostfile ]]; then
  [[ $platform == gpu ]] || usage "HOSTFILE runs the GPU build; --cpu runs on this machine only"
  read_hostfile "$hostfile"
  total_slots=0
  for s in "${slots[@]}"; do total_slots=$((total_slots + s)); done
  if [[ -n ${NP-} && ${NP-} != "$total_slots" ]]; then
    usage "NP=$NP differs from the $total_slots slots of HOSTFILE $hostfile (leave NP unset: the ranks are the slots)"
  fi
  np=$total_slots
elif [[ $platform == cpu ]]; then
  np=${NP:-1}
else
  np=${NP:-8}
fi
[[ $np =~ ^[1-9][0-9]*$ ]] || usage "NP must be a positive whole number of ranks, got '$np'"

read -r -a mpirun <<<"${MPIRUN:-mpirun}"
((${#mpirun[@]})) || die "MPIRUN is empty"
# Open MPI refuses to start as root (the usual case on rented GPU nodes) unless told it is meant.
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# The GPUs first: without them nothing else matters.
check_local_gpus() {
  local gpus count
  if ! gpus=$(nvidia-smi -L 2>/dev/null) || [[ -z $gpus ]]; then
    die "no NVIDIA GPU found (nvidia-smi is missing or fails): a record run needs $np GPUs.
  To run the trainer on this machine's CPU instead, use --cpu (or the tiny demo: make run)"
  fi
  count=$(grep -c '^GPU [0-9]' <<<"$gpus" || true)
  ((count >= np)) || die "nvidia-smi lists $count GPU(s), but $np ranks need one GPU each (set NP to use fewer ranks)"
}

# One process a node reports "node <rank> <host name> <GPUs nvidia-smi lists>"; rank i runs on the
# hostfile's i-th node, which needs a GPU for each of its slots.
check_node_gpus() {
  local report line i rank name count found
  command -v "${mpirun[0]}" >/dev/null || die "${mpirun[0]} not found: install Open MPI (scripts/install_deps.sh)"
  echo "+ checking the GPUs of ${#hosts[@]} node(s): ${mpirun[*]} --hostfile $hostfile -npernode 1 nvidia-smi -L" >&2
  report=$("${mpirun[@]}" --hostfile "$hostfile" -npernode 1 sh -c \
    'echo "node ${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-?}} $(hostname) $(nvidia-smi -L 2>/dev/null | grep -c "^GPU [0-9]")"' 2>&1) \
    || die "the node check failed (can mpirun reach every node of $hostfile without a password?):
$report"
  for i in "${!hosts[@]}"; do
    found=
    while read -r line rank name count; do
      [[ $line == node && $rank == "$i" ]] && found="$name $count"
    done <<<"$report"
    [[ -n $found ]] || die "node ${hosts[i]} (rank $i of the node check) did not report its GPUs:
$report"
    count=${found##* }
    ((count >= slots[i])) || die "node ${hosts[i]} (${found% *}) lists $count GPU(s), but its slots=${slots[i]} ranks need one GPU each"
  done
}

case $platform/${hostfile:+hostfile} in
  gpu/) check_local_gpus ;;
  gpu/hostfile) check_node_gpus ;;
esac

# The data the flags (or the record preset's defaults) name. Both "--flag value" and "--flag=value".
# The tiny preset's shards are committed; the trainer names any it cannot find.
train_glob='data/fineweb10B/fineweb_train_*.bin'
val_glob='data/fineweb10B/fineweb_val_*.bin'
preset=record
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --train-files | --val-files | --preset)
      ((i + 1 < ${#args[@]})) || usage "${args[i]} needs a value"
      case ${args[i]} in
        --train-files) train_glob=${args[i + 1]} ;;
        --val-files) val_glob=${args[i + 1]} ;;
        --preset) preset=${args[i + 1]} ;;
      esac
      i=$((i + 1))
      ;;
    --train-files=*) train_glob=${args[i]#*=} ;;
    --val-files=*) val_glob=${args[i]#*=} ;;
    --preset=*) preset=${args[i]#*=} ;;
  esac
done
if [[ $preset != tiny* ]]; then  # every full-size preset reads FineWeb (the tiny twins: Tiny Shakespeare)
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
fi

build=${BUILD:-build}
[[ $build == /* ]] || build=$repo/$build
if [[ $platform == cpu ]]; then
  trainer=${BINARY:-$build/train_gpt_cpu}
else
  trainer=${BINARY:-$build/train_gpt}
fi
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  if [[ $platform == cpu ]]; then
    make -C "$repo" ${BUILD:+"BUILD=$BUILD"} configure
    cmake --build "$build" --target train_gpt_cpu -j "$(nproc)"
  else
    make -C "$repo" ${BUILD:+"BUILD=$BUILD"}
  fi
fi
[[ -x $trainer ]] || die "$trainer is missing: build it (SKIP_BUILD=1 skips the build)"
command -v "${mpirun[0]}" >/dev/null || die "${mpirun[0]} not found: install Open MPI (scripts/install_deps.sh)"

launch=(-np "$np")
if [[ -n $hostfile ]]; then
  launch+=(--hostfile "$hostfile")
  # Open MPI gives remote ranks only the environment it is told to.
  for var in $(compgen -e); do
    [[ $var == NCCL_* || $var == LD_LIBRARY_PATH ]] && launch+=(-x "$var")
  done
fi
if [[ -n ${MPI_BIND+set} ]]; then
  read -r -a placement <<<"$MPI_BIND"
elif [[ $platform == cpu ]]; then
  placement=(--oversubscribe --bind-to none)
elif [[ -n $hostfile ]]; then
  placement=(--map-by slot --bind-to none)
else
  numa_nodes=$(compgen -G '/sys/devices/system/node/node[0-9]*' | wc -l || true)
  if ((numa_nodes > 0 && np % numa_nodes == 0)); then
    placement=(--map-by "ppr:$((np / numa_nodes)):numa" --bind-to numa)
  else
    placement=(--bind-to numa)
  fi
fi

# The platform check on every rank, with the run's preset and kernel choices (the flags it reads:
# it refuses the others, which it would ignore), so that a wrong world size or a failing kernel is
# found before any training.
check_args=()
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --preset | --attention | --mlp-kernel) check_args+=("${args[i]}" "${args[i + 1]-}"); i=$((i + 1)) ;;
    --preset=* | --attention=* | --mlp-kernel=*) check_args+=("${args[i]}") ;;
  esac
done
if [[ ${SKIP_PLATFORM_CHECK:-0} != 1 ]]; then
  check=("${mpirun[@]}" "${launch[@]}" "${placement[@]}" "$trainer" "${check_args[@]}" --check-platform)
  echo "+ ${check[*]}" >&2
  "${check[@]}" || die "the platform check failed on $np rank(s) (above): no training started"
fi

cmd=("${mpirun[@]}" "${launch[@]}" "${placement[@]}" "$trainer" "${args[@]}")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
