#!/usr/bin/env bash
# Ours against upstream's PyTorch record on the same GPU (issue 26): ms per step per stage, and the ratio.
#
#   scripts/side_by_side.sh (--upstream DIR | --from-log LOG) --stages LIST [--steps N] [--bundle DIR] OUTDIR
#   scripts/side_by_side.sh --dry-run (--upstream DIR | --from-log LOG) --stages LIST [--build DIR] OUTDIR
#   scripts/side_by_side.sh --extract LOG DIR     upstream's two files from a record log, into DIR
#   --ours-log FILE: ours from a run already made (gpu_check.sh's logs.txt, whose stages part ran the
#   same --profile-warmup on the same GPU) instead of running it again: saves the window's time
#
# Upstream's record-71 train_gpt.py and triton_kernels.py are upstream's code: they are not in this
# repository and must never be committed. Pass their folder (--upstream DIR), or a record-71 run log
# that begins with them (--from-log LOG: modded-nanogpt's records/track_1_short/
# 2026-02-06_SparseBigramGradient/*.txt; the copies under shared/data have the code stripped).
#
# On the GPU machine (one GPU, PyTorch and Triton, no FlashAttention-3, no network), in one command:
#   1. synthetic token shards (no FineWeb there): both programs read the same files
#   2. ours: the bundle's train_gpt, record 71's preset (r71: upstream's code here is record 71's), one GPU (8 micro-steps), --profile-warmup: each
#      warm-up step (the steps around every schedule change) timed; a stage's figure is the mean wall
#      time of its warm-up steps (the untie step apart)
#   3. upstream: a temporary copy of its code, patched at run time (scripts/side_by_side/upstream_code.py:
#      FA3's import replaced by fa3_standin.py, flex_attention with FA3's masks; the warm-up compiles the
#      requested stages' first two steps only; the loop runs --steps N steps from each requested stage's
#      first step, each timed between synchronizations; no validation), run as one rank (world 1, its
#      8 micro-steps of gradient accumulation). torch.compile's time is printed apart from the steps.
#   4. the table: per stage, ours and upstream's ms per step and upstream/ours; OUTDIR gets
#      side_by_side.md and side_by_side.json, with what was left out.
# --stages: stages 0..3 of the schedule (3: the extension), comma-separated. Upstream's compile (its
# README: minutes on a first run) has to fit the command's 10 minutes: one stage per call if need be.
# --dry-run: no torch here: checks the arguments, extracts/patches upstream's code into a temporary
# folder (the patch's anchors), runs ours on the CPU build (the tiny preset's short schedule) and
# writes the report with the upstream side skipped and labelled so.
# Exit status: 0 when both sides ran, 1 when one failed (the report says which), 2 bad usage.
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE="$REPO/scripts/side_by_side"
COMMAND_S=600       # one command on the GPU machine
MARGIN_S=30         # for the report after upstream's run
OURS_TIMEOUT_S=150

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "side_by_side.sh: $*" >&2; exit 2; }

DRY=0 UPSTREAM="" LOG="" STAGES="" STEPS=6 BIN="" OUT="" EXTRACT=() OURS_LOG=""
[ $# -gt 0 ] || { usage >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --help|-h) usage; exit 0 ;;
        --dry-run) DRY=1 ;;
        --upstream) [ $# -ge 2 ] || die "--upstream needs a folder"; UPSTREAM=$2; shift ;;
        --from-log) [ $# -ge 2 ] || die "--from-log needs a record log"; LOG=$2; shift ;;
        --stages) [ $# -ge 2 ] || die "--stages needs a list, e.g. 0 or 0,2"; STAGES=$2; shift ;;
        --steps) [ $# -ge 2 ] || die "--steps needs a number"; STEPS=$2; shift ;;
        --bundle|--build) [ $# -ge 2 ] || die "$1 needs a folder"; BIN=$2; shift ;;
        --ours-log) [ $# -ge 2 ] || die "--ours-log needs a file"; OURS_LOG=$2; shift ;;
        --extract) [ $# -ge 3 ] || die "--extract LOG DIR"; EXTRACT=("$2" "$3"); shift 2 ;;
        -*) die "unknown option '$1' (--help lists them)" ;;
        *) [ -z "$OUT" ] || die "one OUTDIR only (got '$OUT' and '$1')"; OUT=$1 ;;
    esac
    shift
done
if [ ${#EXTRACT[@]} -gt 0 ]; then
    exec python3 "$HERE/upstream_code.py" extract "${EXTRACT[0]}" "${EXTRACT[1]}"
fi
[ -n "$UPSTREAM" ] || [ -n "$LOG" ] || die "upstream's code: give --upstream DIR or --from-log LOG"
[ -z "$UPSTREAM" ] || [ -z "$LOG" ] || die "--upstream and --from-log: give one"
[ -z "$UPSTREAM" ] || [ -d "$UPSTREAM" ] || die "--upstream $UPSTREAM: no such folder"
[ -z "$LOG" ] || [ -f "$LOG" ] || die "--from-log $LOG: no such file"
[ -n "$STAGES" ] || die "--stages LIST missing (stages 0..3, e.g. --stages 0 or --stages 0,2)"
[[ "$STAGES" =~ ^[0-3](,[0-3])*$ ]] || die "--stages $STAGES: want stage numbers 0..3 separated by commas"
[[ "$STEPS" =~ ^[0-9]+$ ]] && [ "$STEPS" -ge 2 ] && [ "$STEPS" -le 50 ] || die "--steps $STEPS: want 2..50"
[ -n "$OUT" ] || die "OUTDIR missing (where the report goes)"
[ -z "$OURS_LOG" ] || grep -q '^profile of step [0-9]* (warm-up: ' "$OURS_LOG" 2>/dev/null ||
    die "--ours-log $OURS_LOG: no --profile-warmup steps in it (want gpu_check.sh's logs.txt or a --profile-warmup run's output)"
if [ -z "$BIN" ]; then [ $DRY = 1 ] && BIN="$REPO/build" || BIN="$REPO/gpu-bundle"; fi
[ -d "$BIN" ] || die "$BIN: no such folder ($([ $DRY = 1 ] && echo 'make cpu' || echo 'make gpu-bundle') builds it)"
if [ $DRY = 1 ]; then
    OURS="$BIN/train_gpt_cpu_nompi"; [ -x "$OURS" ] || OURS="$BIN/train_gpt_cpu"
else
    OURS="$BIN/train_gpt"
fi
[ -n "$OURS_LOG" ] || [ -x "$OURS" ] || die "$OURS: not built"
mkdir -p "$OUT" || die "cannot create $OUT"

START=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/side_by_side.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# upstream's code: a temporary copy, patched (never in the repository)
SRC=$UPSTREAM
if [ -n "$LOG" ]; then
    SRC="$WORK/upstream_src"
    python3 "$HERE/upstream_code.py" extract "$LOG" "$SRC" || exit 1
fi
python3 "$HERE/upstream_code.py" patch "$SRC" "$WORK/upstream" || exit 1

# ours
OURS_STATUS=pass
if [ $DRY = 0 ]; then
    python3 "$REPO/scripts/gpu_check_tool.py" synth-shards "$WORK/data/data/fineweb10B" --prefix fineweb \
        --train-tokens 24000000 --val-tokens 4200000 || exit 1
fi
if [ -n "$OURS_LOG" ]; then
    echo "ours: from $OURS_LOG"
    cp "$OURS_LOG" "$WORK/ours.out"
    OURS_STATUS="pass (from $OURS_LOG)"
else
    if [ $DRY = 1 ]; then
        ours_args=(--preset tiny --scheduled-steps 6 --extension-steps 2 --val-tokens 2048)
    else
        ours_args=(--preset r71 --train-files "$WORK/data/data/fineweb10B/fineweb_train_*.bin"
                   --val-files "$WORK/data/data/fineweb10B/fineweb_val_*.bin" --val-tokens 2097152)
    fi
    ours_args+=(--max-steps 0 --profile-warmup --run-id side_by_side --log-dir "$WORK/logs")
    echo "ours: $OURS ${ours_args[*]}"
    (cd "$REPO" && timeout -k 5 "$OURS_TIMEOUT_S" "$OURS" "${ours_args[@]}") >"$WORK/ours.out" 2>&1 || {
        OURS_STATUS="failed (exit $?)"; tail -20 "$WORK/ours.out"; }
fi
grep -E '^(warming up|step [0-9]+: )' "$WORK/ours.out" | sed 's/ (first op.*wall/, wall/' | head -40

# upstream
UP_STATUS=pass
if [ $DRY = 1 ]; then
    UP_STATUS="skipped (dry run: no torch on this machine)"
elif ! python3 -c 'import torch, triton' 2>/dev/null; then
    UP_STATUS="skipped (no torch and triton in $(command -v python3))"
else
    left=$((COMMAND_S - MARGIN_S - (SECONDS - START)))
    [ "$left" -gt 60 ] || left=60
    echo "upstream: world 1, stages $STAGES, $STEPS steps each, timeout $left s (compile included)"
    (cd "$WORK/upstream" && RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29526 \
        DATA_PATH="$WORK/data" SBS_STAGES="$STAGES" SBS_STEPS="$STEPS" SBS_OUT="$WORK/upstream.json" \
        timeout -k 10 "$left" python3 train_gpt.py) >"$WORK/upstream.out" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { UP_STATUS="failed (exit $rc$([ $rc -eq 124 ] && echo ': timed out'))"; tail -30 "$WORK/upstream.out"; }
    grep '^side_by_side:' "$WORK/upstream.out" | head -60
fi

python3 "$HERE/report.py" --ours "$WORK/ours.out" --upstream-json "$WORK/upstream.json" --stages "$STAGES" \
    --steps "$STEPS" --ours-status "$OURS_STATUS" --upstream-status "$UP_STATUS" --dry-run "$DRY" \
    --seconds $((SECONDS - START)) --out "$OUT" || exit 1
[ -n "$OURS_LOG" ] || cp "$WORK/ours.out" "$OUT/ours.log"
[ -f "$WORK/upstream.out" ] && cp "$WORK/upstream.out" "$OUT/upstream.log"
case $OURS_STATUS in pass*) ;; *) exit 1 ;; esac
[ "$UP_STATUS" = pass ] || [ $DRY = 1 ]
