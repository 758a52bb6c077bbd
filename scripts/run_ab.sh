#!/usr/bin/env bash
# A/B comparison on this node: is revision B faster than revision A? Builds both, runs them
# interleaved in balanced blocks, then their paired statistics and statistics.md
# (scripts/stats.py --ab DIR --markdown).
#
#   scripts/run_ab.sh A B [N] [--cpu] [train_gpt flags...]
#
# A and B are git revisions of this repository (HEAD~1, a branch, a commit) or build folders
# (CMake build directories, e.g. build). A revision is checked out into its own git worktree,
# build-ab/<commit>/ (the working copy is untouched), and built there once, into
# build-ab/<commit>/build, which later comparisons reuse (configured with the project's defaults
# plus $AB_CMAKE_FLAGS, split at spaces, by the comparison that made it). A build folder that was
# built from the revision's exact tree (its source checkout clean and at that tree) is reused
# instead: by default build/, or those listed in AB_BUILDS (colon-separated). A build folder given
# as an arm is brought up to date with cmake --build (SKIP_BUILD=1: used as it is). Each binary
# embeds its sources, so their source_hash differs when the sources do; a warning says when the
# two arms' are equal.
#
# Then 2N runs (N per arm, default 8; N even): pair i is one run of each arm with seed S+i-1 (S: the
# --seed flag's value, else $SEED, else 0), the two back to back; pairs alternate so that the runs
# go in blocks A B B A, B A A B, A B B A, ...: each arm runs first in half of the pairs, and a
# machine that drifts (warms, throttles) weighs on both arms alike. Logs: <dir>/A/ and <dir>/B/,
# run ids ab-<time>-<k>-<arm>-seed<S> (k: the run's place in the series); <dir> is $LOG_DIR, else
# logs/ab-<time>. <dir>/manifest records the plan before the first run: the command, each arm's
# revision, commit, build and source_hash, the seeds, the block order and every run with its log;
# stats.py --ab checks the logs against it. After each run a progress line gives the arm, the seed,
# the run's wall time, its final val loss and train time, and the ETA of the series.
#
# Flags go to every run (--cpu: the CPU build, as in run_record.sh; --log-dir and --run-id are this
# script's). Each run is scripts/run_record.sh with the arm's binary (its environment applies: NP,
# MPIRUN, MPI_BIND, HOSTFILE...); the platform check runs before each arm's first run.
#
# Ctrl-C stops the series after the run in progress ends (interrupted; its log is kept and counted
# as unfinished): the finished runs are kept and the statistics of the complete pairs are printed
# (stats.py --ab DIR --partial). A run that fails after writing its log is reported and left out,
# and the series goes on (at its end, the statistics of the complete pairs, and no statistics.md);
# one that fails before writing it stops the series.
# Exit status: 0 every run finished and statistics.md was written; 1 a build or a run failed, or the
# statistics could not be computed; 2 bad usage; 130 interrupted.
set -euo pipefail

usage() {
  echo "run_ab.sh: $*" >&2
  echo "usage: scripts/run_ab.sh A B [N] [--cpu] [train_gpt flags...]   (A, B: git revisions or build folders; N: runs per arm, even)" >&2
  exit 2
}
die() {
  echo "run_ab.sh: $*" >&2
  exit 1
}

if [[ ${1-} == -h || ${1-} == --help ]]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
command_line=$(printf '%q ' "$0" "$@")
command_line=${command_line% }

(($# >= 2)) || usage "needs two revisions (or build folders), A and B"
specs=("$1" "$2")
shift 2
n=8
if [[ ${1-} =~ ^[0-9]+$ ]]; then
  n=$((10#$1))
  shift
fi
((n > 0 && n % 2 == 0)) || usage "N (runs per arm) must be a positive even number, so that each arm goes first in half of the pairs; got $n"

platform=gpu
seed=${SEED:-0}
args=()
set -- "$@" ""  # a sentinel, so that a flag's value is read as "$2" even for the last flag
while (($# > 1)); do
  case $1 in
    --cpu) platform=cpu ;;
    --seed) seed=$2; shift ;;
    --seed=*) seed=${1#*=} ;;
    --log-dir | --log-dir=* | --run-id | --run-id=*)
      usage "${1%%=*} is chosen by run_ab.sh (<dir>/A and <dir>/B; set LOG_DIR for <dir>)" ;;
    *) args+=("$1") ;;
  esac
  shift
done
[[ $seed =~ ^[0-9]+$ ]] || usage "the base seed (--seed or SEED) must be a whole number, got '$seed'"
seed=$((10#$seed))

stamp=$(date +%Y%m%d-%H%M%S)
dir=${LOG_DIR:-logs/ab-$stamp}
if [[ -e $dir ]] && [[ -n $(ls -A "$dir") ]]; then
  usage "$dir exists and is not empty: an A/B folder holds one series (set LOG_DIR to another)"
fi

if [[ $platform == cpu ]]; then
  target=train_gpt_cpu
  configure_flags=(-DBUILD_GPU=OFF)  # the CPU trainer needs no nvcc
else
  target=train_gpt
  configure_flags=()
fi
python=$repo/.venv/bin/python  # matplotlib for the plot; stats.py itself needs only the standard library
[[ -x $python ]] || python=python3

# ---- the two builds ----

# "dirty" when a checkout has changes git would show (ignored files, such as build folders, aside).
tree_of_checkout() {
  local src=$1
  [[ -z $(git -C "$src" status --porcelain 2>/dev/null) ]] || { echo dirty; return; }
  git -C "$src" rev-parse 'HEAD^{tree}' 2>/dev/null || echo none
}

cmake_source_of() {
  sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$1/CMakeCache.txt"
}

# Brings a build folder's trainer up to date, its output in <folder>/run_ab-build.log.
build_target() {
  local folder=$1 what=$2 start=$SECONDS
  [[ ${SKIP_BUILD:-0} == 1 ]] && return
  echo "== building $what: cmake --build $folder --target $target (log: $folder/run_ab-build.log)" >&2
  if ! cmake --build "$folder" --target "$target" -j "$(nproc)" >"$folder/run_ab-build.log" 2>&1; then
    tail -n 30 "$folder/run_ab-build.log" >&2
    die "the build of $what failed (above; whole log: $folder/run_ab-build.log)"
  fi
  echo "== built $what in $((SECONDS - start)) s" >&2
}

# A build folder built from exactly this commit's tree, or nothing.
reusable_build() {
  local tree=$1 candidate src
  IFS=: read -r -a candidates <<<"${AB_BUILDS:-${BUILD:-build}}"
  for candidate in "${candidates[@]}"; do
    [[ -f $candidate/CMakeCache.txt ]] || continue
    src=$(cmake_source_of "$candidate")
    if [[ -n $src && $(tree_of_checkout "$src") == "$tree" ]]; then
      (cd "$candidate" && pwd)
      return
    fi
  done
}

# Checks the commit out into build-ab/<commit> (once) and configures its build folder there.
worktree_build() {
  local commit=$1 wt=$repo/build-ab/${1:0:12}
  if [[ ! -e $wt/.git ]]; then
    git worktree add --detach --quiet "$wt" "$commit" || die "cannot check $commit out into $wt (git worktree add)"
  fi
  [[ $(git -C "$wt" rev-parse HEAD) == "$commit" ]] || die "$wt is not at $commit: remove it (git worktree remove --force $wt)"
  # Untracked files aside: the links below, which git may not take for the ignored folders they stand for.
  [[ -z $(git -C "$wt" status --porcelain --untracked-files=no) ]] \
    || die "$wt has local changes: remove it (git worktree remove --force $wt)"
  # The worktree's trainer finds a preset's data relative to its own checkout; the Python
  # environment holds NVIDIA's headers where there is no CUDA toolkit.
  [[ -e $wt/.venv || ! -d $repo/.venv ]] || ln -s "$repo/.venv" "$wt/.venv"
  [[ -e $wt/data/fineweb10B || ! -d $repo/data/fineweb10B ]] || ln -s "$repo/data/fineweb10B" "$wt/data/fineweb10B"
  if [[ ! -f $wt/build/CMakeCache.txt ]]; then
    mkdir -p "$wt/build"
    read -r -a extra <<<"${AB_CMAKE_FLAGS-}"
    cmake -S "$wt" -B "$wt/build" "${configure_flags[@]}" "${extra[@]}" >"$wt/build/run_ab-configure.log" 2>&1 \
      || { tail -n 30 "$wt/build/run_ab-configure.log" >&2; die "cannot configure $wt/build (above)"; }
  fi
  echo "$wt/build"
}

declare -A spec_of=([A]=${specs[0]} [B]=${specs[1]}) commit binary source_hash build_dir
# First what each arm is (bad names are usage errors before any build), then the builds.
for arm in A B; do
  spec=${spec_of[$arm]}
  if [[ -d $spec ]]; then
    [[ -f $spec/CMakeCache.txt ]] || usage "$arm: '$spec' is a directory but not a CMake build folder (no CMakeCache.txt)"
    build_dir[$arm]=$(cd "$spec" && pwd)
    src=$(cmake_source_of "${build_dir[$arm]}")
    commit[$arm]=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)")
    [[ $(tree_of_checkout "$src") != dirty ]] || commit[$arm]+=" with uncommitted changes"
  else
    commit[$arm]=$(git rev-parse --verify --quiet "$spec^{commit}") \
      || usage "$arm: '$spec' is neither a git revision of $repo nor a build folder"
  fi
done
for arm in A B; do
  spec=${spec_of[$arm]}
  folder=${build_dir[$arm]-}
  if [[ -n $folder ]]; then
    build_target "$folder" "$arm ($spec)"
  else
    folder=$(reusable_build "$(git rev-parse "${commit[$arm]}^{tree}")")
    if [[ -n $folder ]]; then
      echo "== $arm ($spec = ${commit[$arm]:0:12}): reusing $folder, built from the same tree" >&2
    else
      folder=$(worktree_build "${commit[$arm]}")
    fi
    build_target "$folder" "$arm ($spec = ${commit[$arm]:0:12})"
  fi
  build_dir[$arm]=$folder
  binary[$arm]=$folder/$target
  [[ -x ${binary[$arm]} ]] || die "$arm: ${binary[$arm]} is missing (build it, or leave SKIP_BUILD unset)"
  source_hash[$arm]=$("$python" scripts/source_hash.py "$folder") || die "$arm: no source_hash for $folder (above)"
done
if [[ ${source_hash[A]} == "${source_hash[B]}" ]]; then
  echo "run_ab.sh: warning: A and B embed the same sources (source_hash ${source_hash[A]}): this measures the noise, not a change" >&2
fi

# ---- the plan: pairs in blocks ABBA BAAB ..., written before the first run ----
order=()  # the arms in run order
for ((i = 0; i < n; i++)); do
  # Pair i of block i/2: the block's first pair AB and second BA in even blocks, the reverse in odd ones.
  if (((i / 2 + i % 2) % 2 == 0)); then order+=(A B); else order+=(B A); fi
done
blocks=$(printf '%s' "${order[@]}" | sed -E 's/(.{4})/\1 /g; s/ $//')
mkdir -p "$dir/A" "$dir/B"
manifest=$dir/manifest
{
  echo "# scripts/run_ab.sh's plan of an A/B comparison, written before its first run; scripts/stats.py --ab reads it."
  echo "command: $command_line"
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  echo "platform: $platform"
  echo "trainer_flags: ${args[*]}"
  for arm in A B; do
    echo "$arm: ${spec_of[$arm]}"
    echo "${arm}_commit: ${commit[$arm]}"
    echo "${arm}_build: ${build_dir[$arm]}"
    echo "${arm}_source_hash: ${source_hash[$arm]}"
  done
  echo "seeds: $(seq -s ' ' "$seed" $((seed + n - 1)))"
  echo "order: $blocks"
  for ((k = 1; k <= 2 * n; k++)); do
    arm=${order[k - 1]}
    echo "run: $k $arm $((seed + (k - 1) / 2)) $arm/ab-$stamp-$k-$arm-seed$((seed + (k - 1) / 2)).txt"
  done
} >"$manifest"
echo "== A/B: $n runs of each arm in blocks $blocks; logs and manifest in $dir" >&2

# ---- the runs ----
interrupted=0
trap 'interrupted=1' INT  # Ctrl-C: bash runs this when the run in progress has ended
platform_flag=()
[[ $platform == gpu ]] || platform_flag=(--cpu)
declare -A checked
finished=0
finished_runs=()
failed=()
started=$SECONDS
for ((k = 1; k <= 2 * n; k++)); do
  arm=${order[k - 1]}
  run_seed=$((seed + (k - 1) / 2))
  id=ab-$stamp-$k-$arm-seed$run_seed
  log=$dir/$arm/$id.txt
  echo "== run $k of $((2 * n)): $arm (${spec_of[$arm]}), seed $run_seed" >&2
  skip_check=${SKIP_PLATFORM_CHECK:-0}
  [[ -z ${checked[$arm]-} ]] || skip_check=1
  run_start=$SECONDS
  status=0
  BINARY=${binary[$arm]} SKIP_BUILD=1 SKIP_PLATFORM_CHECK=$skip_check \
    scripts/run_record.sh "${platform_flag[@]}" --run-id "$id" --log-dir "$dir/$arm" --seed "$run_seed" "${args[@]}" \
    || status=$?
  checked[$arm]=1
  wall=$((SECONDS - run_start))
  if ((interrupted)); then
    echo "== run $k interrupted (Ctrl-C) after $wall s${status:+; exit status $status}" >&2
    break
  fi
  if ((status == 0)) && [[ -f $log ]]; then
    finished=$((finished + 1))
    finished_runs+=("run $k: $arm seed $run_seed, $log")
    # The run's last validation line: "step:6/34 val_loss:8.9577 train_time:33954ms ..."
    result=$(grep -E '^step:[0-9]+/[0-9]+ val_loss:' "$log" | tail -n 1 \
      | sed -E 's/^step:([0-9/]+) val_loss:([^ ]+) train_time:([0-9]+)ms.*/step \1, val_loss \2, train_time \3 ms/')
    left=$((2 * n - k))
    eta=$(((SECONDS - started) * left / k))
    echo "== [$k/$((2 * n))] $arm seed $run_seed: $wall s ($result); $left to go," \
      "ETA ${eta} s ($(date -d "+$eta seconds" +%H:%M:%S))" >&2
  elif [[ -f $log ]]; then
    echo "== run $k ($arm, seed $run_seed) failed (exit status $status); its log $log is left out" >&2
    failed+=("$log")
  else
    die "run $k ($arm, seed $run_seed) failed (exit status $status) before writing $log: stopping the series"
  fi
done
trap - INT

echo "== A/B: $finished of $((2 * n)) runs finished, ${#failed[@]} failed$( ((interrupted)) && echo ", interrupted"); logs in $dir" >&2
for log in "${failed[@]}"; do
  echo "   failed: $log" >&2
done
if ((interrupted)); then
  for run in "${finished_runs[@]}"; do
    echo "   finished: $run" >&2
  done
  "$python" scripts/stats.py --ab "$dir" --partial || echo "== no statistics of the runs so far (above)" >&2
  exit 130
fi
if ((${#failed[@]})); then
  # An incomplete series is no claim: the statistics of its complete pairs, and no statistics.md.
  "$python" scripts/stats.py --ab "$dir" --partial || true
  exit 1
fi
"$python" scripts/stats.py --ab "$dir" --markdown || exit 1
