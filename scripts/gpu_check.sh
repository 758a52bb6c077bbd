#!/usr/bin/env bash
# GPU first light (issue 26): one prepared check of a GPU window, built here and run there.
#
#   scripts/gpu_check.sh [--bundle DIR] OUTDIR     on the GPU machine (the bundle: make gpu-bundle's gpu-bundle/)
#   scripts/gpu_check.sh --dry-run [--build DIR] OUTDIR   every part against the CPU build (emu), no GPU
#   scripts/gpu_check.sh --plan                    each part's expected device seconds, the budget, the bundle
#   scripts/gpu_check.sh --calibrate REPORT_DIR [--out FILE]   measured rates for profiler/cost_model.h
#   scripts/gpu_check.sh --help
#
# The parts, in order, each under its own timeout (a hang costs that part, not the window):
#   machine       the GPU, driver, clocks, nvcc, where cuBLASLt and NCCL resolve (ldd); refuses a GPU
#                 that is not Hopper (compute capability 9.x) and stops there; checks the bundle runs,
#                 else rebuilds it (scripts/build_gpu_bundle.sh) and says how long that took
#   kernel_tests  every *_gpu test program (each kernel family against its double reference on fresh
#                 random data), then train_gpt --check-platform (the wgmma guard); each failure by name
#   tiny          the tiny preset on test_trainer's short schedule, its training losses against the CPU
#                 build's pinned ones (tests/trainer/fixtures/schedule_bits.json) within a bf16 tolerance;
#                 then the tiny twins of records 80, 84, 86 and 89, each against its golden trajectory
#                 (tests/reference/fixtures/*_golden.json: training and validation losses), the same way
#   stages        the record preset on one GPU (8 micro-steps) on synthetic tokens: its memory plan
#                 (--print-memory --ranks 1, which must fit 80 GB), then
#                 --profile-warmup times every warm-up step (every stage's shapes: even, Adam and the
#                 untie step) with the step model's ms for the same recording beside each family; then
#                 the same for record 80's preset (r80)
#   bench         the kernel tests' --bench at the record's shapes: attention forward/backward on wgmma
#                 and mma.sync, c_fc/dpre on wgmma and mma.sync, cuBLASLt's GEMMs, against the model
# Everything goes to OUTDIR: report.md, report.json (every figure) and logs.txt (every part's output);
# a short table is printed last. Exit status: 0 when every part passed, 1 when one failed, 3 when the
# GPU was refused, 2 bad usage.
#
# THE STANDING RULE: whoever gets a GPU window runs this script first (scripts/gpu_check.sh --plan says
# what it costs). Its report is committed under docs/gpu-runs/<date>-<card>-<commit>/ (report.md and
# report.json; docs/gpu-runs/README.md). Every failure it shows is fixed, or, where it cannot be at
# once, named in the issue's note with the report's lines.
#
# Environment hooks for the tests alone (tests/scripts/test_gpu_check.py), never set otherwise:
#   GPU_CHECK_HOOK_GPU="NAME|CC|DRIVER"  the GPU the machine part sees;  GPU_CHECK_HOOK_HANG=PART  that part
#   sleeps;  GPU_CHECK_HOOK_TIMEOUT_<PART>=S  its timeout;  GPU_CHECK_HOOK_FAIL_TEST=PROGRAM  that kernel
#   test fails;  GPU_CHECK_HOOK_HANG_TEST=PROGRAM  it hangs;  GPU_CHECK_HOOK_TEST_TIMEOUT=S  per program;
#   GPU_CHECK_HOOK_MEMORY_LIMIT_MIB=N  the memory plan's limit (80 GiB less 2 GiB).
# And to run less (tests, or a rerun of one failed part in a window):  GPU_CHECK_PARTS="tiny stages"  only
#   these parts;  GPU_CHECK_TESTS="test_a test_b"  only these kernel tests (the dry run's: DRY_TESTS).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/scripts/gpu_check.sh"
TOOL="$REPO/scripts/gpu_check_tool.py"
PARTS_ALL="machine kernel_tests tiny stages bench"
# Expected device seconds on one Hopper GPU (the plan), and each part's timeout, from the H200 runs of
# 2026-11-29 (docs/gpu-runs/2026-11-29-h200-*): machine 0 s, kernel tests 191 s (test_gpt_reference_gpu
# 69 of them: its double-precision finite differences run on the host's cores and cover records 71 to
# 86), tiny 1 s and its twins of records 80-89 21 s of training (tiny-r86 and tiny-r89 8 s each),
# stages 26 s, bench 36 s.
declare -A EXPECTED=([machine]=5 [kernel_tests]=220 [tiny]=30 [stages]=30 [bench]=40)
declare -A TIMEOUT=([machine]=60 [kernel_tests]=360 [tiny]=150 [stages]=150 [bench]=120)
TEST_TIMEOUT_S=${GPU_CHECK_HOOK_TEST_TIMEOUT:-60}  # one kernel test program
# ... but the whole-model finite differences, which the H200 run cut off at 60 s
declare -A TEST_TIMEOUT_OF=([test_gpt_reference_gpu]=${GPU_CHECK_HOOK_TEST_TIMEOUT:-200})
STARTUP_S=60          # the machine's start, counted in the window
WINDOW_S=900          # a window's device time
BUDGET_S=420          # what the check may take with start-up: the rest leaves room to rerun a failed part
COMMAND_S=600         # one command's limit on the GPU machine
DEADLINE_S=555        # no part runs past this (the report is written inside one command)
DRY_TIMEOUT_FACTOR=6  # --dry-run: emu on a shared CPU runs the parts far slower than a GPU would
# The dry run's kernel tests: the CPU twins take up to minutes each under emu and CI runs every one of
# them as its own CTest test, so the dry run walks the part's code on the quickest and lists the rest.
DRY_TESTS="test_norm"

usage() { sed -n '2,/^set -u/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

# ---- the plan ----
bundle_size() {
    local dir="$REPO/gpu-bundle"
    if [ -d "$dir" ]; then
        echo "bundle: $dir, $(du -sb "$dir" | cut -f1) bytes ($(du -sh "$dir" | cut -f1)), $(ls "$dir" | wc -l) files"
    else
        echo "bundle: $dir is not built (make gpu-bundle builds it here; the tree sent over must carry it)"
    fi
}
plan() {
    local sum=0 p
    printf '%-14s %12s %10s\n' part "expected s" "timeout s"
    for p in $PARTS_ALL; do
        printf '%-14s %12d %10d\n' "$p" "${EXPECTED[$p]}" "${TIMEOUT[$p]}"
        sum=$((sum + ${EXPECTED[$p]}))
    done
    local total=$((sum + STARTUP_S)) worst_rerun=0
    for p in $PARTS_ALL; do [ "${EXPECTED[$p]}" -gt "$worst_rerun" ] && worst_rerun=${EXPECTED[$p]}; done
    echo "parts: $sum s expected; with the machine's start-up ($STARTUP_S s): $total s of the $BUDGET_S s budget"
    echo "a rerun of the longest part ($worst_rerun s) after it: $((total + worst_rerun)) s of the window's $WINDOW_S s"
    echo "worst case: no part runs past $DEADLINE_S s, so one command (limit $COMMAND_S s) always ends with its report"
    bundle_size
    if [ "$total" -gt "$BUDGET_S" ] || [ $((total + worst_rerun)) -gt "$WINDOW_S" ]; then
        echo "gpu_check.sh: the plan is over budget" >&2
        return 1
    fi
}

# ---- the parts (each runs as `gpu_check.sh --part NAME WORK` under its timeout) ----
# Settings shared with the parts through the environment: GC_MODE (gpu|dry-run), GC_BIN (the binaries'
# folder), GC_WORK (the part's scratch and logs).
bin() {  # the program NAME (a *_gpu name) as this mode has it
    local name=$1
    if [ "$GC_MODE" = dry-run ]; then
        name=${name%_gpu}
        [ "$name" = train_gpt ] && { [ -x "$GC_BIN/train_gpt_cpu_nompi" ] && name=train_gpt_cpu_nompi || name=train_gpt_cpu; }
    fi
    echo "$GC_BIN/$name"
}
kernel_test_names() {  # the *_gpu programs: tests/<area>/test_*.cu outside tests/emu, not test_mpi_*
    local f n
    for f in "$REPO"/tests/*/test_*.cu; do
        case "$f" in */tests/emu/*) continue ;; esac
        n=$(basename "$f" .cu)
        case "$n" in test_mpi_*) continue ;; esac
        echo "${n}_gpu"
    done | sort
}
env_file() { [ -f "$GC_WORK/env.sh" ] && . "$GC_WORK/env.sh"; true; }
trainer() {  # the bundle's train_gpt; the dry run's CPU twin (the no-MPI one where it is built)
    if [ "$GC_MODE" = gpu ]; then echo "$GC_BIN/train_gpt"; else bin train_gpt; fi
}

part_machine() {
    echo "mode: $GC_MODE"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    echo "commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    # The bundle's own record of its commit: the device tool's copy of the history can be older than the
    # tree it sends (both H200 runs of 2026-11-29 said cde869f), and the bundle is what runs.
    [ "$GC_MODE" = gpu ] && [ -f "$GC_BIN/bundle.json" ] &&
        echo "bundle built from: $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("git_revision", "unknown"))' "$GC_BIN/bundle.json")"
    local gpu=""
    if [ -n "${GPU_CHECK_HOOK_GPU:-}" ]; then
        gpu=$GPU_CHECK_HOOK_GPU
    elif command -v nvidia-smi >/dev/null 2>&1; then
        gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -1 | sed 's/, /|/g')
    fi
    if [ -z "$gpu" ]; then
        if [ "$GC_MODE" = dry-run ]; then
            echo "gpu: none (dry run: the CPU build, emu; every time below is the CPU emulation's)"
        else
            echo "gpu: none found (nvidia-smi gives no GPU)"
            echo "REFUSED: no GPU; this check is for a Hopper GPU (H100/H200)"
            return 3
        fi
    else
        local name cc driver
        IFS='|' read -r name cc driver <<<"$gpu"
        echo "gpu: $name"
        echo "compute capability: $cc"
        echo "driver: $driver"
        case "$cc" in
            9.*) ;;
            *) echo "REFUSED: $name (compute capability $cc) is not a Hopper GPU: the kernels are built for sm_90a" \
                    "(wgmma, TMA) and would not load; run this on an H100 or H200"
               return 3 ;;
        esac
        if [ -z "${GPU_CHECK_HOOK_GPU:-}" ]; then
            nvidia-smi --query-gpu=memory.total,clocks.max.sm,clocks.max.mem,clocks.sm,power.limit,persistence_mode \
                --format=csv 2>&1 | sed 's/^/clocks: /'
        fi
    fi
    echo "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | grep -o 'release [0-9.]*' || echo 'not found')"
    local trainer
    trainer=$(trainer)
    if [ "$GC_MODE" = gpu ]; then
        bundle_check "$trainer" || return 1
        env_file
        trainer=$(trainer)
    fi
    echo "ldd $trainer:"
    ldd "$trainer" 2>&1 | sed 's/^/  /'
    echo "libraries: cuBLASLt $(ldd "$trainer" 2>/dev/null | awk '/libcublasLt/ {print $3; exit}')," \
         "NCCL $(ldd "$trainer" 2>/dev/null | awk '/libnccl/ {print $3; exit}')," \
         "MPI $(ldd "$trainer" 2>/dev/null | awk '/libmpi/ {print $3; exit}')"
}

# The bundle's binaries run here, or are rebuilt: a library not found is looked for in the toolkit and
# in the nvidia wheels beside PyTorch (LD_LIBRARY_PATH, kept in env.sh for the later parts).
bundle_check() {
    local trainer=$1 dirs="" d
    [ -x "$trainer" ] || { echo "bundle: $trainer missing"; rebuild_bundle; return; }
    if ldd "$trainer" | grep -q 'not found'; then
        echo "bundle: libraries not found: $(ldd "$trainer" | awk '/not found/ {print $1}' | tr '\n' ' ')"
        for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
                 $(python3 -c 'import nvidia, os; [print(os.path.join(p, s, "lib")) for p in nvidia.__path__ for s in sorted(os.listdir(p))]' 2>/dev/null); do
            [ -d "$d" ] && dirs="$dirs${dirs:+:}$d"
        done
        echo "export LD_LIBRARY_PATH=\"$dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\"" >"$GC_WORK/env.sh"
        env_file
        echo "bundle: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    fi
    if ! "$trainer" --help >/dev/null 2>"$GC_WORK/bundle_help.err"; then
        echo "bundle: $trainer does not run: $(head -3 "$GC_WORK/bundle_help.err")"
        rebuild_bundle
        return
    fi
    echo "bundle: $GC_BIN runs here"
}
# The bundle's own nlohmann-json headers serve where the machine has no package (and no internet).
rebuild_bundle() {
    local start=$SECONDS json=()
    [ -f "$GC_BIN/include/nlohmann/json.hpp" ] && json=(--json-include "$GC_BIN/include")
    echo "bundle: rebuilding with scripts/build_gpu_bundle.sh into $GC_WORK/bundle"
    if ! "$REPO/scripts/build_gpu_bundle.sh" --out "$GC_WORK/bundle" --jobs "$(nproc)" "${json[@]}"; then
        echo "bundle: the rebuild failed after $((SECONDS - start)) s"
        return 1
    fi
    echo "bundle: rebuilt in $((SECONDS - start)) s (GPU time spent compiling)"
    echo "export GC_BIN=\"$GC_WORK/bundle\"" >>"$GC_WORK/env.sh"
}

part_kernel_tests() {
    env_file
    local names n prog start rc status
    if [ -n "${GPU_CHECK_TESTS:-}" ]; then
        names=$(for n in $GPU_CHECK_TESTS; do echo "${n%_gpu}_gpu"; done)
    elif [ "$GC_MODE" = dry-run ]; then
        names=$(for n in $DRY_TESTS; do echo "${n}_gpu"; done)
        echo "dry run: $(kernel_test_names | wc -l) kernel test programs; the dry run runs $DRY_TESTS (emu takes minutes" \
             "for each of the others; CI runs every one as its own test):"
        kernel_test_names | tr '\n' ' '
        echo
    else
        names=$(kernel_test_names)
    fi
    : >"$GC_WORK/kernel_tests.tsv"
    for n in $names; do
        prog=$(bin "$n")
        start=$SECONDS
        echo "==== $n"
        if [ "${GPU_CHECK_HOOK_FAIL_TEST:-}" = "${n%_gpu}" ]; then
            echo "planted failure (GPU_CHECK_HOOK_FAIL_TEST)"; rc=1
        elif [ "${GPU_CHECK_HOOK_HANG_TEST:-}" = "${n%_gpu}" ]; then
            timeout -k 2 "$TEST_TIMEOUT_S" sleep 100000; rc=$?
        elif [ ! -x "$prog" ] && bundle_leaves_out "$n"; then
            echo "not in the bundle: build_gpu_bundle.sh leaves it out on purpose (bundle.json's left_out)"
            printf '%s\t%s\t%d\t%s\n' "$n" "not in bundle" 0 - >>"$GC_WORK/kernel_tests.tsv"
            continue
        elif [ ! -x "$prog" ]; then
            echo "missing: $prog"; rc=127
        else
            (cd "$REPO" && SHARED_DATA="$REPO/../shared/data" REPO="$REPO" timeout -k 5 "${TEST_TIMEOUT_OF[$n]:-$TEST_TIMEOUT_S}" "$prog") 2>&1 | tail -40
            rc=${PIPESTATUS[0]}
        fi
        case $rc in 0) status=pass ;; 124|137) status=timeout ;; 127) status=missing ;; *) status=fail ;; esac
        printf '%s\t%s\t%d\t%s\n' "$n" "$status" "$((SECONDS - start))" "$rc" >>"$GC_WORK/kernel_tests.tsv"
    done
    echo "==== check-platform"
    start=$SECONDS
    prog=$(trainer)
    (cd "$REPO" && timeout -k 5 "$TEST_TIMEOUT_S" "$prog" --check-platform) 2>&1 | tail -20
    rc=${PIPESTATUS[0]}
    case $rc in 0) status=pass ;; 124|137) status=timeout ;; *) status=fail ;; esac
    printf '%s\t%s\t%d\t%s\n' "train_gpt --check-platform" "$status" "$((SECONDS - start))" "$rc" >>"$GC_WORK/kernel_tests.tsv"
    ! grep -v $'\tnot in bundle\t' "$GC_WORK/kernel_tests.tsv" | grep -qv $'\tpass\t'
}
bundle_leaves_out() {  # NAME: the bundle's bundle.json lists it in left_out (gpu mode only)
    [ "$GC_MODE" = gpu ] && [ -f "$GC_BIN/bundle.json" ] &&
        python3 -c 'import json, sys; sys.exit(sys.argv[2] not in json.load(open(sys.argv[1])).get("left_out", []))' \
            "$GC_BIN/bundle.json" "$1"
}

part_tiny() {
    env_file
    # test_trainer's short tiny schedule as tests/trainer/test_schedule_bits.py trains it on one rank
    # (its checkpoints aside: they do not change the losses), without the warm-up as its 1-rank run.
    local args=(--preset tiny --scheduled-steps 6 --extension-steps 2 --val-every 4 --val-tokens 4096
                --log-train-loss --warmup 0 --run-id tiny --log-dir "$GC_WORK/logs") steps=8
    # the dry run: the schedule's first 2 steps (the same losses as the whole run's first 2), to be quick
    [ "$GC_MODE" = dry-run ] && { args+=(--max-steps 2); steps=2; echo "dry run: the first 2 of the 8 steps"; }
    echo "$(trainer) ${args[*]}"
    (cd "$REPO" && "$(trainer)" "${args[@]}") >"$GC_WORK/tiny.out" 2>&1
    local rc=$?
    tail -25 "$GC_WORK/tiny.out"
    [ $rc -eq 0 ] || { echo "the tiny run failed (exit $rc)"; return 1; }
    python3 "$TOOL" losses "$GC_WORK/tiny.out" "$REPO/tests/trainer/fixtures/schedule_bits.json" \
        --steps "$steps" --json "$GC_WORK/tiny.json" || rc=1
    # The newer records' tiny twins against their golden trajectories (tests/reference/fixtures: the PyTorch
    # reference's, the same tolerance), as their CI tests train them on one rank: every kernel of records
    # 80-89 in a training step (the H200 window of 2026-11-29 ran them by hand first). The dry run: tiny-r80's
    # first step (13 s under emu).
    local twin twins="tiny-r80 tiny-r84 tiny-r86 tiny-r89" twin_steps=8 twin_args=()
    [ "$GC_MODE" = dry-run ] && { twins=tiny-r80; twin_steps=1; twin_args=(--max-steps 1); echo "dry run: tiny-r80's first step"; }
    for twin in $twins; do
        args=(--preset "$twin" --scheduled-steps 6 --extension-steps 2 --val-every 4 --val-tokens 4096 --log-train-loss
              --warmup 0 --run-id "$twin" --log-dir "$GC_WORK/logs" "${twin_args[@]}")
        echo "$(trainer) ${args[*]}"
        if ! (cd "$REPO" && "$(trainer)" "${args[@]}") >"$GC_WORK/$twin.out" 2>&1; then
            tail -15 "$GC_WORK/$twin.out"
            echo "the $twin run failed"
            rc=1
            continue
        fi
        python3 "$TOOL" losses "$GC_WORK/$twin.out" "$REPO/tests/reference/fixtures/${twin//-/_}_golden.json" \
            --steps "$twin_steps" --json "$GC_WORK/twin_$twin.json" || rc=1
    done
    return $rc
}

part_stages() {
    env_file
    local t args
    t=$(trainer)
    if [ "$GC_MODE" = dry-run ]; then
        # the smallest run that walks the same code: the tiny preset on a 4-step schedule (every stage one
        # step long, the untie step in the extension), whose warm-up visits every stage in 5 steps
        echo "dry run: the tiny preset's 4-step schedule stands for the record preset (emu runs record shapes for hours)"
        args=(--preset tiny --scheduled-steps 3 --extension-steps 1 --val-tokens 2048)
    else
        echo "synthetic tokens (no FineWeb here): random tokens, documents of FineWeb-like lengths"
        # the warm-up reads one validation micro-batch (262144 tokens on one GPU) per step: 14 steps
        python3 "$TOOL" synth-shards "$GC_WORK/data" --train-tokens 12000000 --val-tokens 4200000 || return 1
        args=(--preset record --train-files "$GC_WORK/data/synth_train_*.bin" --val-files "$GC_WORK/data/synth_val_*.bin"
              --val-tokens 2097152)
    fi
    # the record preset's memory plan on one GPU (no device needed): it must fit an 80 GB card with room
    # for the CUDA context, cuBLASLt's and NCCL's own allocations (2 GiB kept free)
    echo "$t --preset record --print-memory --ranks 1"
    (cd "$REPO" && "$t" --preset record --print-memory --ranks 1) >"$GC_WORK/memory.out" 2>&1
    grep -E '^(memory plan|parameters|gradients|activations|optimizer|total)' "$GC_WORK/memory.out"
    local plan_mib
    plan_mib=$(awk '/^total/ {print int($2); exit}' "$GC_WORK/memory.out")
    [ -n "$plan_mib" ] || { echo "no memory plan"; return 1; }
    local limit=${GPU_CHECK_HOOK_MEMORY_LIMIT_MIB:-$((80 * 1024 - 2048))}
    [ "$plan_mib" -le "$limit" ] || { echo "the record preset's plan on one GPU ($plan_mib MiB) does not fit 80 GB (at most $limit MiB)"; return 1; }
    args+=(--max-steps 0 --profile-warmup --run-id stages --log-dir "$GC_WORK/logs")
    echo "$t ${args[*]}"
    (cd "$REPO" && "$t" "${args[@]}") >"$GC_WORK/stages.out" 2>&1
    local rc=$?
    grep -E '^(warming up|profile of step|step [0-9]+: |model of step)' "$GC_WORK/stages.out"
    [ $rc -eq 0 ] || { tail -20 "$GC_WORK/stages.out"; echo "the profiled run failed (exit $rc)"; return 1; }
    grep -q '^model of step' "$GC_WORK/stages.out" || { echo "no profiled step"; return 1; }
    # record 80's preset the same way (the dry run: its tiny twin), into stages_r80.out: the trunk the
    # newer records build on, with its own kernels (banks, residual stream, the tanh-form loss)
    local i
    args[1]=r80
    [ "$GC_MODE" = dry-run ] && args[1]=tiny-r80
    for i in "${!args[@]}"; do [ "${args[i]}" = --run-id ] && args[i + 1]=stages_r80; done
    echo "$t ${args[*]}"
    (cd "$REPO" && "$t" "${args[@]}") >"$GC_WORK/stages_r80.out" 2>&1
    rc=$?
    # its lines stay out of this log (scripts/side_by_side.sh --ours-log reads the record preset's from it):
    # the report parses stages_r80.out
    echo "record 80: $(grep -c '^model of step' "$GC_WORK/stages_r80.out") warm-up steps profiled (report.json's stages_r80)"
    [ $rc -eq 0 ] || { tail -20 "$GC_WORK/stages_r80.out"; echo "record 80's profiled run failed (exit $rc)"; return 1; }
    grep -q '^model of step' "$GC_WORK/stages_r80.out" || { echo "no profiled step of record 80"; return 1; }
}

part_bench() {
    env_file
    local shape=record iters=20 n prog rc=0 r
    [ "$GC_MODE" = dry-run ] && { shape=tiny; iters=1; echo "dry run: the tiny preset's shapes, 1 timed call each (emu)"; }
    : >"$GC_WORK/bench.out"
    for n in test_attention_gpu test_mlp_gpu test_matmul_gpu; do
        prog=$(bin "$n")
        echo "==== $n --bench --shape $shape --iters $iters" | tee -a "$GC_WORK/bench.out"
        (cd "$REPO" && "$prog" --bench --shape "$shape" --iters "$iters") >>"$GC_WORK/bench.out" 2>&1
        r=$?
        [ $r -eq 0 ] || { echo "$n --bench failed (exit $r)" | tee -a "$GC_WORK/bench.out"; rc=1; }
    done
    grep -E 'TFLOP/s|failed|timed' "$GC_WORK/bench.out" | head -80
    return $rc
}

run_part_body() {  # --part NAME: the part itself, its hooks first
    local name=$1
    if [ "${GPU_CHECK_HOOK_HANG:-}" = "$name" ]; then
        echo "planted hang (GPU_CHECK_HOOK_HANG)"
        exec sleep 100000
    fi
    "part_$name"
}

# ---- the check: every part under its timeout, then the report ----
run_check() {
    local out=$1 start=$SECONDS p t left rc refused=0 failed=0
    mkdir -p "$out" || die "cannot create $out"
    GC_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
    export GC_WORK GC_MODE GC_BIN
    local parts=${GPU_CHECK_PARTS:-$PARTS_ALL}
    for p in $parts; do case " $PARTS_ALL " in *" $p "*) ;; *) die "GPU_CHECK_PARTS: no part '$p' ($PARTS_ALL)" ;; esac; done
    : >"$GC_WORK/status.tsv"
    for p in $PARTS_ALL; do
        case " $parts " in *" $p "*) ;; *) continue ;; esac
        local hook="GPU_CHECK_HOOK_TIMEOUT_$p" deadline=$DEADLINE_S
        t=${!hook:-${TIMEOUT[$p]}}
        # A dry run times emu on a CPU that CI shares with other tests, not the GPU the budget is for:
        # its parts get DRY_TIMEOUT_FACTOR times their timeouts (a planted hook's timeout stays as set).
        if [ "$GC_MODE" = dry-run ]; then
            [ -n "${!hook:-}" ] || t=$((t * DRY_TIMEOUT_FACTOR))
            deadline=$((DEADLINE_S * DRY_TIMEOUT_FACTOR))
        fi
        left=$((deadline - (SECONDS - start)))
        if [ "$refused" = 1 ]; then
            printf '%s\tnot run\t0\t%d\t-\n' "$p" "$t" >>"$GC_WORK/status.tsv"
            continue
        fi
        if [ "$left" -lt 10 ]; then
            printf '%s\tno time left\t0\t%d\t-\n' "$p" "$t" >>"$GC_WORK/status.tsv"
            failed=1
            continue
        fi
        [ "$t" -gt "$left" ] && t=$left
        echo "gpu_check: part $p (timeout $t s) ..." >&2
        local ps=$SECONDS
        GC_WORK=$GC_WORK timeout -k 5 "$t" bash "$SELF" --part "$p" >"$GC_WORK/$p.log" 2>&1
        rc=$?
        local status
        case $rc in 0) status=pass ;; 3) status=refused; refused=1 ;; 124|137) status=timeout ;; *) status=fail ;; esac
        [ "$status" = pass ] || failed=1
        [ -f "$GC_WORK/env.sh" ] && . "$GC_WORK/env.sh"
        printf '%s\t%s\t%d\t%d\t%d\n' "$p" "$status" "$((SECONDS - ps))" "$t" "$rc" >>"$GC_WORK/status.tsv"
        echo "gpu_check: part $p: $status in $((SECONDS - ps)) s" >&2
    done
    python3 "$TOOL" report "$GC_WORK" "$out" --mode "$GC_MODE" --repo "$REPO" --total-s $((SECONDS - start)) \
        --bundle "$GC_BIN" || { echo "gpu_check.sh: the report could not be written" >&2; failed=1; }
    for p in $PARTS_ALL; do
        [ -f "$GC_WORK/$p.log" ] && { echo "########## part $p"; cat "$GC_WORK/$p.log"; }
    done >"$out/logs.txt"
    rm -rf "$GC_WORK"
    [ "$refused" = 1 ] && return 3
    return $failed
}

# ---- the command line ----
MODE=gpu BIN="" OUT="" CAL_REPORT="" CAL_OUT=""
[ $# -gt 0 ] || { usage >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --help|-h) usage; exit 0 ;;
        --plan) plan; exit $? ;;
        --part) [ $# -eq 2 ] || die "--part NAME (internal)"; GC_MODE=${GC_MODE:?} GC_BIN=${GC_BIN:?}; run_part_body "$2"; exit $? ;;
        --dry-run) MODE=dry-run ;;
        --bundle|--build) [ $# -ge 2 ] || die "$1 needs a folder"; BIN=$2; shift ;;
        --calibrate) [ $# -ge 2 ] || die "--calibrate needs a report folder"; CAL_REPORT=$2; shift ;;
        --out) [ $# -ge 2 ] || die "--out needs a file"; CAL_OUT=$2; shift ;;
        -*) die "unknown option '$1' (--help lists them)" ;;
        *) [ -z "$OUT" ] || die "one OUTDIR only (got '$OUT' and '$1')"; OUT=$1 ;;
    esac
    shift
done
if [ -n "$CAL_REPORT" ]; then
    [ -z "$OUT" ] || die "--calibrate takes a report folder and --out FILE, no OUTDIR"
    exec python3 "$TOOL" calibrate "$CAL_REPORT" --out "${CAL_OUT:-$REPO/docs/gpu-runs/calibration.json}" --repo "$REPO"
fi
[ -z "$CAL_OUT" ] || die "--out goes with --calibrate"
[ -n "$OUT" ] || die "OUTDIR missing (where the report goes)"
GC_MODE=$MODE
if [ -z "$BIN" ]; then
    [ "$MODE" = dry-run ] && BIN="$REPO/build" || BIN="$REPO/gpu-bundle"
fi
[ -d "$BIN" ] || die "$BIN: no such folder ($([ "$MODE" = dry-run ] && echo 'build the CPU programs: make cpu' || echo 'build the bundle here: make gpu-bundle'))"
GC_BIN=$(cd "$BIN" && pwd)
run_check "$OUT"
