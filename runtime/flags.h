// The command line: what a run is asked to do beyond its config, the usage text, and the flags'
// value rules (a bad value stops with the usage and exit code 2, before any process starts).
#pragma once
#include "../kernels/attention.cuh"
#include "../kernels/mlp.cuh"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

// Steps first..last (inclusive); none while first < 0.
struct StepRange {
    int first = -1, last = -1;
    bool contains(int step) const { return first >= 0 && step >= first && step <= last; }
};

// What a run is asked to do beyond the config (the command line).
struct RunOptions {
    std::string train_files, val_files;  // empty: the preset's
    std::string run_id, log_dir = "logs";
    int val_every = 250;                 // 0: only at the end
    int64_t val_tokens = -1;             // -1: the preset's
    uint64_t seed = 1337;
    int max_steps = -1;                  // stop after this many steps (tests, golden runs); -1: the schedule's
    // compiles nothing, but warms cuBLASLt heuristics and NCCL paths; the CPU build gains nothing from it
    bool warmup = !kEmulated;
    bool log_train_loss = false;
    bool log_grad_norms = false;
    int check_finite = 0;                // also check parameters and optimizer state every N steps; 0: never
    std::string save_dir, resume_dir;
    bool resume_unverified = false;      // accept a checkpoint directory without a manifest (saved before them)
    bool resume_changed = false;         // --resume-changed: accept a resume whose schedule, data, kernels or seed differ
    std::vector<int> checkpoint_steps;   // empty: the last step when save_dir is set
    StepRange profile_steps;             // --profile-steps A:B: time every operation of steps A..B
    bool profile_warmup = false;         // --profile-warmup: time every step of the warm-up (every stage's shapes)
    std::string calibration;             // --calibration FILE|none: the step model's measured rates; empty: the committed file
    std::optional<MlpKernel> mlp_kernel; // --mlp-kernel; none: default_mlp_kernel() (wgmma on Hopper GPUs)
    std::optional<AttentionKernel> attention;  // --attention; none: default_attention_kernel() (mma on a GPU, wgmma under emu)
    std::string command;                 // the command line, for the log
};

// --plan-step's outputs and the schedule it prices.
struct PlanOptions {
    std::string json_path, trace_path;  // empty: none
    bool upstream = false;              // price upstream's schedule of the same work (--schedule upstream)
    int nodes = 1;                      // --nodes: the ranks split evenly over this many nodes (8 GPUs each
                                        // on the record), collectives crossing the network between them
};

// The largest step count a flag takes: far beyond any real schedule, and small enough that step
// arithmetic (sums, products with the accumulation count) stays inside int.
constexpr int64_t kMaxSteps = 10'000'000;

const char* kUsage =
    "usage: train_gpt [options]        (GPU: mpirun -np 8 ./build/train_gpt; CPU: ./build/train_gpt_cpu --preset tiny)\n"
    "  --preset NAME            record (the newest reproduced: r89; the default), r71, r80, r84, r84-prefix,\n"
    "                           r84-fp8down, r86, r89, and each one's CPU-sized twin: tiny (r71's), tiny-r80, tiny-r84,\n"
    "                           tiny-r84-prefix, tiny-r84-fp8down, tiny-r86, tiny-r89 (README: Presets)\n"
    "  --train-files GLOB       training shards (default: the preset's, under the repository)\n"
    "  --val-files GLOB         validation shards (default: the preset's, under the repository)\n"
    "  --val-every N            validate every N steps and at the end; 0: only at the end (0..10000000, default 250)\n"
    "  --val-tokens N           validation tokens, a multiple of the validation batch (1..2^40, default: the preset's)\n"
    "  --run-id ID              log file name, new for each run (default: a random id)\n"
    "  --log-dir DIR            where logs go (default logs)\n"
    "  --seed N                 parameter initialization seed (0..2^63-1, default 1337)\n"
    "  --max-steps N            stop after N steps; the schedule stays the full run's (0..10000000)\n"
    "  --scheduled-steps N      length of the scheduled part (stages by fraction, lr cool-down; 1..10000000,\n"
    "                           default: the preset's)\n"
    "  --extension-steps N      steps after it at the final stage (0..10000000, default: the preset's)\n"
    "  --warmup 0|1             warm up on the steps around each schedule change, then restore the initial\n"
    "                           state (default: 1 on the GPU build, 0 on the CPU build)\n"
    "  --log-train-loss         also log each step's training loss (step:N/M train_loss:X; the host waits for\n"
    "                           each step's last forward, one step late, and all-reduces the loss)\n"
    "  --log-grad-norms         also log rank 0's gradient norms per parameter group before each optimizer step\n"
    "                           (a debugging flag: the host waits for every step's backward and copies every\n"
    "                           gradient to sum it, inside the step's time: on an H200, tiny-r89's steps took\n"
    "                           1.06 s with it, under 0.2 s without; never time steps with it)\n"
    "  --check-finite N         also check parameters and optimizer state for NaN/inf every N steps (0..10000000,\n"
    "                           default 0: only at each validation and before each save; the host waits there)\n"
    "  --save-checkpoint DIR    save checkpoints under DIR/stepNNNNNN/ (default: at the last step); DIR's parent\n"
    "                           must exist\n"
    "  --checkpoint-steps LIST  comma-separated steps to save at, each 0..the last step (0: the initial state);\n"
    "                           needs --save-checkpoint; given twice, the last list counts\n"
    "  --resume DIR             continue from a checkpoint directory DIR/stepNNNNNN (verified by its manifest)\n"
    "  --resume-unverified      also accept a checkpoint directory without a manifest (saved before manifests)\n"
    "  --resume-changed         accept a resume whose schedule, training data, kernels or seed differ from the\n"
    "                           checkpoint's (each difference is a WARNING in the log); refused without it\n"
    "  --print-memory           print the per-rank memory plan of the preset and exit (no GPU needed)\n"
    "  --ranks N                with --print-memory: the plan for N ranks (1, 2, 4, 8; default 8)\n"
    "  --dump-batches N         print the first N training batches of every rank and exit (1..10000000)\n"
    "  --check-platform         run the platform check (kernel, cuBLASLt, NCCL on every rank) and exit\n"
    "  --plan-step              model the step time on H100s without a GPU: record one step of each stage\n"
    "                           (even, Adam, the untie step) in a dry run, price it, print the tables and exit\n"
    "  --json FILE, --trace FILE  with --plan-step: also write the plan as JSON, and a Chrome/Perfetto trace\n"
    "  --schedule ours|upstream with --plan-step: price our schedule (default) or upstream's for the same work\n"
    "  --nodes N                with --plan-step: price collectives for the ranks split over N nodes (default 1)\n"
    "  --mlp-kernel mma|wgmma   the MLP's fused c_fc GEMMs (forward, and dpre in the backward) on mma.sync or on\n"
    "                           Hopper's TMA + wgmma (default: wgmma on sm_90 GPUs, else mma; the CPU build runs\n"
    "                           mma: its wgmma twins are 2x slower, and both give the same bits there)\n"
    "  --attention mma|wgmma    the attention kernels, forward and backward: mma (mma.sync; the GPU default: an H100\n"
    "                           ran it twice as fast) or wgmma (Hopper's wgmma + TMA; the CPU build's default, the\n"
    "                           same bits as mma there)\n"
    "  --profile-steps A:B      time every operation of training steps A..B (0 <= A <= B < the run's last step)\n"
    "                           and print a table per step; those steps' times include the report\n"
    "  --profile-warmup         time every operation of each warm-up step (the steps around each schedule change:\n"
    "                           every stage's shapes, an even and an Adam step each, the untie step), from the\n"
    "                           initial parameters, with the step model's price of each recording beside it;\n"
    "                           turns the warm-up on (not with --warmup 0)\n"
    "  --calibration FILE       the step model's measured rates (--plan-step, --profile-*): a JSON file made by\n"
    "                           scripts/gpu_check.sh --calibrate (default: docs/gpu-runs/calibration.json where present;\n"
    "                           none: every rate the model's default)\n"
    "  --help                   this text\n";

[[noreturn]] void usage_error(const std::string& why) {
    std::fprintf(stderr, "train_gpt: %s\n%s", why.c_str(), kUsage);
    std::exit(2);
}

int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
        usage_error(flag + " needs an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'");
    return x;
}
int parse_steps(const std::string& flag, const std::string& v, int64_t lo) {
    return static_cast<int>(parse_int(flag, v, lo, kMaxSteps));
}

// An argument as a POSIX shell reads it back: as it is when it holds only safe characters, else in
// single quotes (Python's shlex.quote).
std::string shell_quote(const std::string& a) {
    const bool safe = !a.empty() && std::all_of(a.begin(), a.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || std::strchr("_@%+=:,./-", c);
    });
    if (safe) return a;
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\"'\"'") : std::string(1, c);
    return q + "'";
}

std::string command_line(int argc, char** argv) {
    std::string cmd;
    for (int i = 0; i < argc; ++i) {  // appended, not " " + std::string&&: a false -Wrestrict of GCC 12 at -O3
        if (i) cmd += ' ';
        cmd += shell_quote(argv[i]);
    }
    return cmd;
}

// What a command line asks for: one run mode (checked to be one) and the run's options.
enum class Mode { train, print_memory, dump_batches, check_platform, plan_step, help };

std::string random_run_id() {
    std::random_device rd;
    char id[40];
    std::snprintf(id, sizeof id, "%08x-%04x-%04x", rd(), rd() & 0xffff, rd() & 0xffff);
    return id;
}

// The options that depend on each other and on the run's last step; gives the run an id.
void check_run_options(RunOptions& opt, int last) {
    if (!opt.checkpoint_steps.empty() && opt.save_dir.empty())
        usage_error("--checkpoint-steps needs --save-checkpoint DIR (where to save)");
    for (int st : opt.checkpoint_steps)
        if (st > last)
            usage_error("--checkpoint-steps " + std::to_string(st) + " is beyond this run's last step " + std::to_string(last) +
                        " (steps 0.." + std::to_string(last) + ")");
    if (opt.resume_unverified && opt.resume_dir.empty()) usage_error("--resume-unverified goes with --resume DIR");
    if (opt.resume_changed && opt.resume_dir.empty()) usage_error("--resume-changed goes with --resume DIR");
    // a save nothing would trigger: a fresh run saves at its last step, never at its start
    if (!opt.save_dir.empty() && opt.checkpoint_steps.empty() && last == 0 && opt.resume_dir.empty())
        usage_error("--save-checkpoint with a run of 0 steps saves nothing (a run saves at its last step, not its "
                    "first): add --checkpoint-steps 0 to save the initial state");
    const StepRange& p = opt.profile_steps;
    if (p.last >= last)
        usage_error("--profile-steps " + std::to_string(p.first) + ":" + std::to_string(p.last) +
                    " reaches beyond the steps this run trains (" +
                    (last > 0 ? "0.." + std::to_string(last - 1) : std::string("none")) + ")");
    if (opt.run_id.empty()) opt.run_id = random_run_id();
    if (opt.run_id.find('/') != std::string::npos) usage_error("--run-id '" + opt.run_id + "' must not contain '/'");
}

// The command line as given (presets and step counts are applied by main, flag order aside).
struct CommandLine {
    Mode mode = Mode::train;
    RunOptions opt;
    std::string preset = "record";
    int scheduled = -1, extension = -1;  // -1: the preset's
    int64_t dump_batches = 0;
    int memory_ranks = 8;  // --print-memory --ranks N
    PlanOptions plan;
};

// A:B with 0 <= A <= B <= kMaxSteps.
StepRange parse_step_range(const std::string& flag, const std::string& v) {
    const size_t colon = v.find(':');
    if (colon == std::string::npos) usage_error(flag + " needs A:B (first and last step), got '" + v + "'");
    StepRange r{parse_steps(flag, v.substr(0, colon), 0), parse_steps(flag, v.substr(colon + 1), 0)};
    if (r.first > r.last) usage_error(flag + " " + v + ": the first step is after the last");
    return r;
}

// The flags a mode other than training reads (besides its own mode flag); every other flag is refused
// there, so nothing asked for is silently skipped (a log, a checkpoint, a resume that a mode never makes).
const std::vector<std::string>& flags_read_by(Mode m) {
    static const std::vector<std::string> memory = {"--preset", "--ranks"},
        dump = {"--preset", "--train-files", "--scheduled-steps", "--extension-steps"},
        platform = {"--preset", "--attention", "--mlp-kernel"},
        plan = {"--preset", "--train-files", "--scheduled-steps", "--extension-steps", "--attention", "--mlp-kernel",
                "--json", "--trace", "--schedule", "--nodes", "--calibration"},
        none = {};
    switch (m) {
        case Mode::print_memory: return memory;
        case Mode::dump_batches: return dump;
        case Mode::check_platform: return platform;
        case Mode::plan_step: return plan;
        default: return none;
    }
}

void check_mode_flags(Mode m, const char* mode_flag, const std::vector<std::string>& given) {
    if (m == Mode::train) return;
    const std::vector<std::string>& read = flags_read_by(m);
    for (const std::string& f : given)
        if (f != mode_flag && std::find(read.begin(), read.end(), f) == read.end()) {
            std::string list;
            for (const std::string& r : read) list += (list.empty() ? "" : ", ") + r;
            usage_error(f + " does nothing with " + mode_flag + " (it takes only " + list + "): drop it, or run without " +
                        mode_flag);
        }
}

CommandLine parse_command_line(int argc, char** argv) {
    CommandLine cl;
    RunOptions& opt = cl.opt;
    opt.command = command_line(argc, argv);
    const char* mode_flag = nullptr;
    const char* plan_flag = nullptr;  // the last flag given that only --plan-step takes
    bool warmup_off = false;          // --warmup 0 given
    bool ranks_given = false;         // --ranks N given
    auto set_mode = [&](Mode m, const char* flag) {
        if (mode_flag && cl.mode != m) usage_error(std::string(mode_flag) + " and " + flag + " are separate modes: give one");
        cl.mode = m;
        mode_flag = flag;
    };
    std::vector<std::string> given;  // every flag on the line, for check_mode_flags
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        given.push_back(arg);
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage_error(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--help" || arg == "-h") {
            cl.mode = Mode::help;  // whatever else the line holds
            return cl;
        } else if (arg == "--preset") cl.preset = value();
        else if (arg == "--train-files") opt.train_files = value();
        else if (arg == "--val-files") opt.val_files = value();
        else if (arg == "--val-every") opt.val_every = parse_steps(arg, value(), 0);
        else if (arg == "--val-tokens") opt.val_tokens = parse_int(arg, value(), 1, int64_t(1) << 40);
        else if (arg == "--run-id") opt.run_id = value();
        else if (arg == "--log-dir") opt.log_dir = value();
        else if (arg == "--seed") opt.seed = static_cast<uint64_t>(parse_int(arg, value(), 0, INT64_MAX));
        else if (arg == "--max-steps") opt.max_steps = parse_steps(arg, value(), 0);
        else if (arg == "--scheduled-steps") cl.scheduled = parse_steps(arg, value(), 1);
        else if (arg == "--extension-steps") cl.extension = parse_steps(arg, value(), 0);
        else if (arg == "--warmup") {
            opt.warmup = parse_int(arg, value(), 0, 1) != 0;
            warmup_off = !opt.warmup;
        }
        else if (arg == "--log-train-loss") opt.log_train_loss = true;
        else if (arg == "--log-grad-norms") opt.log_grad_norms = true;
        else if (arg == "--check-finite") opt.check_finite = parse_steps(arg, value(), 0);
        else if (arg == "--save-checkpoint") opt.save_dir = value();
        else if (arg == "--checkpoint-steps") {
            opt.checkpoint_steps.clear();  // like every flag, the last one given counts
            std::string list = value(), item;
            for (size_t at = 0; at <= list.size(); ++at)
                if (at == list.size() || list[at] == ',') {
                    opt.checkpoint_steps.push_back(parse_steps(arg, item, 0));
                    item.clear();
                } else {
                    item += list[at];
                }
        } else if (arg == "--resume") opt.resume_dir = value();
        else if (arg == "--resume-unverified") opt.resume_unverified = true;
        else if (arg == "--resume-changed") opt.resume_changed = true;
        else if (arg == "--print-memory") set_mode(Mode::print_memory, "--print-memory");
        else if (arg == "--ranks") {
            const int64_t n = parse_int(arg, value(), 1, 8);
            if (8 % n != 0) usage_error("--ranks needs 1, 2, 4 or 8 (a divisor of 8), got " + std::to_string(n));
            cl.memory_ranks = static_cast<int>(n);
            ranks_given = true;
        }
        else if (arg == "--dump-batches") {
            set_mode(Mode::dump_batches, "--dump-batches");
            cl.dump_batches = parse_steps(arg, value(), 1);
        } else if (arg == "--check-platform") set_mode(Mode::check_platform, "--check-platform");
        else if (arg == "--plan-step") set_mode(Mode::plan_step, "--plan-step");
        else if (arg == "--json") cl.plan.json_path = value(), plan_flag = "--json";
        else if (arg == "--trace") cl.plan.trace_path = value(), plan_flag = "--trace";
        else if (arg == "--nodes") cl.plan.nodes = static_cast<int>(parse_int(arg, value(), 1, 4096)), plan_flag = "--nodes";
        else if (arg == "--schedule") {
            plan_flag = "--schedule";
            const std::string v = value();
            if (v != "ours" && v != "upstream") usage_error("--schedule needs ours or upstream, got '" + v + "'");
            cl.plan.upstream = v == "upstream";
        } else if (arg == "--mlp-kernel") {
            const std::string v = value();
            if (v != "mma" && v != "wgmma") usage_error("--mlp-kernel needs mma or wgmma, got '" + v + "'");
            opt.mlp_kernel = v == "wgmma" ? MlpKernel::wgmma : MlpKernel::mma;
        } else if (arg == "--attention") {
            const std::string v = value();
            if (v != "mma" && v != "wgmma") usage_error("--attention needs mma or wgmma, got '" + v + "'");
            opt.attention = v == "mma" ? AttentionKernel::mma : AttentionKernel::wgmma;
        } else if (arg == "--profile-steps") opt.profile_steps = parse_step_range(arg, value());
        else if (arg == "--profile-warmup") opt.profile_warmup = true;
        else if (arg == "--calibration") opt.calibration = value();
        else usage_error("unknown argument '" + arg + "'");
    }
    if (plan_flag && cl.mode != Mode::plan_step) usage_error(std::string(plan_flag) + " goes with --plan-step");
    if (ranks_given && cl.mode != Mode::print_memory) usage_error("--ranks goes with --print-memory");
    if (!cl.plan.json_path.empty() && cl.plan.json_path == cl.plan.trace_path)
        usage_error("--json and --trace name the same file " + cl.plan.json_path + ": one would overwrite the other");
    if (opt.profile_steps.first >= 0 && cl.mode != Mode::train)
        usage_error(std::string("--profile-steps times a training run: it does not go with ") + mode_flag);
    if (opt.profile_warmup && cl.mode != Mode::train)
        usage_error(std::string("--profile-warmup times a training run's warm-up: it does not go with ") + mode_flag);
    if (opt.profile_warmup && warmup_off) usage_error("--profile-warmup times the warm-up: it does not go with --warmup 0");
    if (opt.profile_warmup) opt.warmup = true;
    check_mode_flags(cl.mode, mode_flag, given);
    return cl;
}
