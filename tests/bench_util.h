// What a kernel test's benchmark mode shares: `test_X --bench [--iters N] [--shape record|tiny]` runs
// each launcher of the family at a preset's shapes on random inputs instead of the checks, and prints
// one line per launcher: its name, the shape, the mean time of N calls timed with CUDA events on one
// stream after warm-up calls, and, from the Work the launcher records for the step profiler
// (profiler/work.h), its FLOPs and bytes, the achieved TFLOP/s and TB/s and their fractions of an
// H100's peaks. Under emu the same code runs and the times are the CPU emulation's wall time.
//
// A test adds one function that builds its inputs (with its own builders) and calls Bench::run once
// per launcher, and main() starts with
//     if (const auto o = bench::parse(argc, argv)) return bench_X(*o);
#pragma once
#include "device_util.h"
#include "../profiler/cost_model.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace bench {

// ---- the presets' shapes ----
// One training stage as one of 8 ranks sees it: tokens per micro-batch, attention windows in tokens.
struct Stage {
    int T, ws_short, ws_long;
};
// The shapes the trainer gives the launchers: train_gpt.cu's r71_preset() and tiny_preset() on 8
// ranks (the numbers are copied from there; the trainer owns them).
struct Preset {
    const char* name;
    int C, H, D, M, V, bigram_vocab;
    int max_seq_len;  // documents are cut at this many tokens
    int ranks;        // sharded optimizer state: each rank updates 1/ranks of a bank's matrices
    int n_predict;    // stage 1's multi-token-prediction weights
    Stage stage[3];   // the three training stages (the extension runs stage 3's shapes)
    int T() const { return stage[0].T; }
};
// The record: stage batches of 8, 16 and 24 x 2048 x 8 tokens, windows (1, 3), (3, 7), (5, 11) blocks
// of 128 tokens.
constexpr Preset kRecord{"record", 768, 6, 128, 3072, 50304, 50304 * 5, 2048, 8, 3,
                         {{16384, 128, 384}, {32768, 384, 896}, {49152, 640, 1408}}};
// The tiny preset's widths and windows (blocks of 8 tokens); T 256, its validation micro-batch, in stage
// 1 (its training micro-batches of 32 to 64 tokens are too short to time), twice and three times that
// in stages 2 and 3 as in the record.
constexpr Preset kTiny{"tiny", 128, 2, 64, 512, 50304, 4096 * 5, 256, 8, 3,
                       {{256, 8, 24}, {512, 24, 56}, {768, 40, 88}}};

// H100 SXM peaks, the step profiler's (profiler/cost_model.h's CostModel holds them with their source).
const CostModel kH100 = h100_model(8);
const double kPeakBf16Flops = kH100.bf16_tflops * 1e12, kPeakFp8Flops = kH100.fp8_tflops * 1e12,
             kPeakHbmBytes = kH100.hbm_tbs * 1e12;

// ---- the command line ----
enum class ShapeSet { record, tiny };
struct Options {
    std::string program;
    int iters;
    ShapeSet shapes;
    const Preset& preset() const { return shapes == ShapeSet::record ? kRecord : kTiny; }
};
// Timed calls per launcher when --iters is not given, and the untimed calls before them (the first
// one also records the launch's Work): emu takes seconds where a GPU takes microseconds.
constexpr int kDefaultIters = kEmulated ? 2 : 20;
constexpr int kWarmupCalls = kEmulated ? 1 : 3;
constexpr int kMaxIters = 1000000;

[[noreturn]] inline void usage_error(const std::string& program, const std::string& what) {
    std::fprintf(stderr, "%s: %s\nusage: %s [--bench [--iters N] [--shape record|tiny]]\n", program.c_str(),
                 what.c_str(), program.c_str());
    std::exit(EXIT_FAILURE);
}

// The benchmark options when the command line asks for them; nothing (run the checks) when it is empty.
// Anything else stops with a message naming the argument.
inline std::optional<Options> parse(int argc, char** argv) {
    std::string program = argc > 0 ? argv[0] : "test";
    if (const size_t slash = program.rfind('/'); slash != std::string::npos) program = program.substr(slash + 1);
    if (argc <= 1) return std::nullopt;
    Options o{program, kDefaultIters, kEmulated ? ShapeSet::tiny : ShapeSet::record};
    bool bench = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage_error(program, a + " needs a value");
            return argv[++i];
        };
        if (a == "--bench") {
            bench = true;
        } else if (a == "--iters") {
            const std::string v = value();
            char* end = nullptr;
            const long n = std::strtol(v.c_str(), &end, 10);
            if (v.empty() || *end != '\0' || n < 1 || n > kMaxIters)
                usage_error(program, "--iters " + v + ": want an integer in 1.." + std::to_string(kMaxIters));
            o.iters = static_cast<int>(n);
        } else if (a == "--shape") {
            const std::string v = value();
            if (v == "record") o.shapes = ShapeSet::record;
            else if (v == "tiny") o.shapes = ShapeSet::tiny;
            else usage_error(program, "--shape " + v + ": want record or tiny");
        } else {
            usage_error(program, "unknown argument '" + a + "'");
        }
    }
    if (!bench) usage_error(program, "--iters and --shape go with --bench");
    return o;
}

// For the tests of building blocks that no launcher uses directly: says so, and succeeds.
inline int nothing_to_bench(const Options& o, const char* why) {
    std::printf("bench %s: no launcher to bench (%s)\n", o.program.c_str(), why);
    return 0;
}

// printf into a std::string, for the shape column.
__attribute__((format(printf, 1, 2))) inline std::string fmt(const char* f, ...) {
    std::va_list ap, again;
    va_start(ap, f);
    va_copy(again, ap);
    std::string s(static_cast<size_t>(std::vsnprintf(nullptr, 0, f, ap)), '\0');
    std::vsnprintf(s.data(), s.size() + 1, f, again);
    va_end(again);
    va_end(ap);
    return s;
}

// ---- the Work of one call ----
struct Totals {
    int ops = 0;                // kernels, GEMMs, copies and memsets the call enqueued
    double flops = 0;           // tensor-core and other
    double tc_flops = 0;
    double tc_seconds = 0;      // the tensor-core work's time at the peaks above (FP8 GEMMs at FP8's)
    double bytes = 0;           // read and written
};
inline Totals total_work(const std::vector<StepOp>& ops) {
    Totals t;
    for (const StepOp& op : ops) {
        const bool device_work = op.kind == OpKind::kernel || op.kind == OpKind::gemm || op.kind == OpKind::copy ||
                                 op.kind == OpKind::memset;
        if (!device_work) continue;
        const Work& w = op.work;
        ++t.ops;
        t.flops += w.tc_flops + w.flops;
        t.tc_flops += w.tc_flops;
        t.tc_seconds += w.tc_flops / (w.gemm == GemmType::fp8 ? kPeakFp8Flops : kPeakBf16Flops);
        t.bytes += w.bytes_read + w.bytes_written;
    }
    return t;
}

// ---- timing ----
class Bench {
public:
    // note: what the shape column leaves out, printed above the table.
    explicit Bench(const Options& o, const std::string& note = "") : opt_(o), preset_(o.preset()) {
        test::seed();
        const Preset& p = preset_;
        std::printf("bench %s: %s shapes (model_dim %d, %d heads of %d, mlp %d, vocab %d, T %d tokens per "
                    "micro-batch in stage 1, %d ranks); per launcher %d warm-up and %d timed calls, CUDA events on "
                    "one stream\n",
                    o.program.c_str(), p.name, p.C, p.H, p.D, p.M, p.V, p.T(), p.ranks, kWarmupCalls, o.iters);
        if (kEmulated)
            std::printf("bench: emu (the CPU build): the times are the CPU emulation's wall time, not a GPU's%s\n",
                        o.shapes == ShapeSet::record ? "; record shapes under emu may take long" : "");
        if (!note.empty()) std::printf("bench: %s\n", note.c_str());
        std::printf("%-30s %-46s %13s  %s\n", "launcher", "shape", "mean", "work (FLOPs, bytes) and H100 fractions");
        CUDA_CHECK(cudaStreamCreate(&stream_));  // blocking: it waits for the uploads on the default stream
        CUDA_CHECK(cudaEventCreate(&start_));
        CUDA_CHECK(cudaEventCreate(&stop_));
    }
    ~Bench() {
        cudaEventDestroy(start_);
        cudaEventDestroy(stop_);
        cudaStreamDestroy(stream_);
    }
    Bench(const Bench&) = delete;
    Bench& operator=(const Bench&) = delete;

    const Preset& preset() const { return preset_; }
    cudaStream_t stream() const { return stream_; }

    // Times call(stream): the first call records its Work, the warm-up calls and the timed ones follow
    // on the same stream; prints the launcher's line.
    template <class F>
    void run(const std::string& launcher, const std::string& shape, F&& call) {
        WorkRecorder& rec = work_recorder();
        rec.start(false);
        call(stream_);
        rec.stop();
        const Totals work = total_work(rec.ops);
        for (int i = 1; i < kWarmupCalls; ++i) call(stream_);
        CUDA_CHECK(cudaEventRecord(start_, stream_));
        for (int i = 0; i < opt_.iters; ++i) call(stream_);
        CUDA_CHECK(cudaEventRecord(stop_, stream_));
        CUDA_CHECK(cudaEventSynchronize(stop_));
        CUDA_CHECK(cudaGetLastError());
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
        print_line(launcher, shape, double(ms) / opt_.iters, work);
        ++launchers_;
    }

    // The closing line; the exit code (a benchmark that timed nothing failed).
    int finish() const {
        std::printf("bench %s: timed %d launcher calls, one line each\n", opt_.program.c_str(), launchers_);
        return launchers_ > 0 ? 0 : 1;
    }

private:
    static void print_line(const std::string& launcher, const std::string& shape, double ms, const Totals& w) {
        std::string work = "(no Work recorded)";
        if (w.ops > 0) {
            const double s = ms * 1e-3;
            work = fmt("%9.4g GFLOP %9.4g MB %9.3g TFLOP/s", w.flops * 1e-9, w.bytes * 1e-6, w.flops / s * 1e-12);
            if (w.tc_flops > 0) work += fmt(" (%.3g%% of tensor peak)", 100 * w.tc_seconds / s);
            work += fmt(" %9.3g TB/s (%.3g%% of HBM)", w.bytes / s * 1e-12, 100 * w.bytes / kPeakHbmBytes / s);
        }
        std::printf("%-30s %-46s %10.4f ms  %s\n", launcher.c_str(), shape.c_str(), ms, work.c_str());
        std::fflush(stdout);
    }

    Options opt_;
    const Preset& preset_;
    cudaStream_t stream_ = nullptr;
    cudaEvent_t start_ = nullptr, stop_ = nullptr;
    int launchers_ = 0;
};

// Fills a device buffer with copies of `block` (random data of a manageable size) one after another:
// inputs of billions of elements (the record's logits) without drawing each on the host.
template <class T>
void fill_tiled(test::DeviceBuffer<T>& buf, const std::vector<T>& block) {
    for (size_t at = 0; at < buf.n; at += block.size()) {
        const size_t n = std::min(block.size(), buf.n - at);
        CUDA_CHECK(cudaMemcpy(buf.ptr + at, block.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
}

}  // namespace bench
