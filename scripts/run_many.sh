#!/usr/bin/env bash
# N record attempts in a row (scripts/run_record.sh each), each with its own seed, their logs in
# one directory, then their statistics (scripts/stats.py: mean val loss and its t-test against
# 3.28, mean time).
#
#   scripts/run_many.sh N [--cpu] [train_gpt flags...]
#
# Run i (1 to N) trains with seed S+i-1, where S is the --seed flag's value, else $SEED, else 0;
# its id is <prefix>-<timestamp>-<i>-seed<S+i-1> (the timestamp is the series' start), its log
# <dir>/<id>.txt. Distinct seeds are what make the t-test meaningful: the trainer is deterministic,
# so runs with one seed give one val loss, and their "spread" would be zero. The directory is the
# --log-dir flag's if one is given, else $LOG_DIR, else logs/<prefix>-<timestamp>; relative paths
# are taken from the repository root, as in run_record.sh. --save-checkpoint DIR gives each run its
# own directory, DIR/<id> (a checkpoint directory belongs to one run: the trainer refuses one that
# holds another run's checkpoints). Other flags go to every run unchanged (--run-id is this script's
# to choose; --resume continues one run, so it is refused here); --cpu runs the CPU build (see
# run_record.sh).
#
# Environment: RUN_PREFIX (default record), SEED, LOG_DIR (above), and run_record.sh's: NP,
# HOSTFILE, MPIRUN, MPI_BIND, BINARY, SKIP_BUILD, SKIP_PLATFORM_CHECK, BUILD. The first run
# builds the trainer and runs the platform check; the others reuse both.
#
# A run that fails before writing its log (no GPU, no data, a build error) stops the series: the
# next would fail the same way. A run that fails after writing its log is reported, left out of
# the statistics, and the series goes on.
# Exit status: 0 every run finished and the statistics were printed; 1 a run failed, or the
# statistics could not be computed (they need two finished runs); 2 bad usage.
set -euo pipefail

usage() {
  echo "run_many.sh: $*" >&2
  echo "usage: scripts/run_many.sh N [--cpu] [train_gpt flags...]   (N: how many runs, a positive whole number)" >&2
  exit 2
}

if [[ ${1-} == -h || ${1-} == --help ]]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi
(($#)) || usage "missing N"
n=$1
shift
if [[ ! $n =~ ^[0-9]+$ ]] || ((10#$n == 0)); then
  usage "N must be a positive whole number of runs, got '$n'"
fi
n=$((10#$n))

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

prefix=${RUN_PREFIX:-record}
[[ $prefix =~ ^[A-Za-z0-9._-]+$ ]] || usage "RUN_PREFIX may hold only letters, digits, '.', '_' and '-', got '$prefix'"
stamp=$(date +%Y%m%d-%H%M%S)

dir=
ckpt_root=
seed=${SEED:-0}
args=()  # the flags for every run: all but --seed, which is this script's base seed
set -- "$@" ""  # a sentinel, so that a flag's value is read as "$2" even for the last flag
while (($# > 1)); do
  case $1 in
    --log-dir)
      [[ -n $2 ]] || usage "--log-dir needs a value (a directory)"
      dir=$2
      args+=("$1" "$2")
      shift
      ;;
    --log-dir=*) dir=${1#*=}; args+=("$1") ;;
    --seed) seed=$2; shift ;;
    --seed=*) seed=${1#*=} ;;
    --run-id | --run-id=*) usage "--run-id is chosen by run_many.sh (<prefix>-<timestamp>-<i>-seed<S>); set RUN_PREFIX instead" ;;
    --save-checkpoint)
      [[ -n $2 ]] || usage "--save-checkpoint needs a value (a directory)"
      ckpt_root=$2
      shift
      ;;
    --save-checkpoint=*) ckpt_root=${1#*=} ;;
    --resume | --resume=*) usage "--resume continues one run: resume it with scripts/run_record.sh, not a series" ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [[ ! $seed =~ ^[0-9]+$ ]]; then
  usage "the base seed (--seed or SEED) must be a whole number, got '$seed'"
fi
seed=$((10#$seed))
log_dir_flag=()
if [[ -z $dir ]]; then
  dir=${LOG_DIR:-logs/$prefix-$stamp}
  log_dir_flag=(--log-dir "$dir")
fi
mkdir -p "$dir"
[[ -z $ckpt_root ]] || mkdir -p "$ckpt_root"

finished=()
failed=()
for ((i = 1; i <= n; i++)); do
  run_seed=$((seed + i - 1))
  id=$prefix-$stamp-$i-seed$run_seed
  log=$dir/$id.txt
  echo "== run $i of $n: $id (log $log)" >&2
  status=0
  ckpt_flag=()
  [[ -z $ckpt_root ]] || ckpt_flag=(--save-checkpoint "$ckpt_root/$id")
  scripts/run_record.sh --run-id "$id" --seed "$run_seed" "${log_dir_flag[@]}" "${ckpt_flag[@]}" "${args[@]}" || status=$?
  if ((status == 0)) && [[ -f $log ]]; then
    finished+=("$log")
  elif ((status == 0)); then
    echo "run_many.sh: run $i of $n ended without error but left no log at $log: stopping the series" >&2
    exit 1
  elif [[ -f $log ]]; then
    echo "== run $i of $n failed (exit status $status); its log $log is left out of the statistics" >&2
    failed+=("$log")
  else
    echo "run_many.sh: run $i of $n failed (exit status $status) before writing $log: stopping the series" >&2
    exit 1
  fi
  export SKIP_BUILD=1 SKIP_PLATFORM_CHECK=1  # built and checked (or skipped) once for the whole series
done

echo "== $n runs: ${#finished[@]} finished, ${#failed[@]} failed; logs in $dir" >&2
for log in "${failed[@]}"; do
  echo "   failed: $log" >&2
done
if ((${#finished[@]} == 0)); then
  echo "run_many.sh: no run finished: no statistics" >&2
  exit 1
fi
if ((${#finished[@]} == 1)); then
  # One run is a series of one: its numbers, and no statistics to fail on.
  python3 scripts/stats.py "${finished[@]}" || echo "== one finished run: no spread, no t-test" >&2
else
  python3 scripts/stats.py "${finished[@]}" || exit 1
fi
((${#failed[@]} == 0)) || exit 1
