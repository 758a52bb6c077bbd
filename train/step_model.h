// The step cost model (issue 17, `--plan-step`): what a recorded training step would take on H100s.
// A recording is kernels/work.cuh's StepOps of one step, one list per rank, in host issue order.
// Each operation is priced from its Work alone (rooflines with an efficiency per kernel family,
// cuBLASLt GEMMs by shape, NCCL's alpha-beta model for collectives), then every rank's stream/event
// graph is replayed event by event (replay()): the host pays a launch cost per operation, an
// operation starts when the host has issued it, its stream is free and the events its stream waits
// on have completed, and the k-th collective of every rank starts on all ranks together.
//
// A step is priced in steady state (replay_steady(), plan_report()): the two steps before it in a
// run, it, and the step after it (even and Adam steps alternate, the untie step follows an even one:
// an even step is modeled as even, Adam, EVEN, Adam; an Adam step as Adam, even, ADAM, even; each
// the stage's recording of that kind) are replayed back to back on one timeline per rank, streams and events carried over (a recording names each stream and event by the same index
// in every step of a plan), so a wait on an event an earlier step recorded resolves against that
// record, and communication that spills into the next step's forward delays what waits for it
// there rather than vanishing (one step alone) or ending the step. A step's time runs from the end of
// the step before (its last op done, on any rank) to its own end; its exposed communication is stream
// 0's idle time for other streams within that window, whichever step's op waited.
//
// It is a model, not a measurement: the constants sit in one table (CostModel) with the source of
// each; where no published number fits, the value is an assumption and says so. Compare schedules
// with it and trust differences more than absolute numbers; `--profile-steps` measures on a GPU.
// Deliberately left out: CUDA graphs (every launch pays its overhead), SMs that a running NCCL
// kernel takes from overlapped compute, L2 reuse between kernels, clocks below boost under load.
//
// Use (--plan-step): record one even, one Adam and (at the split step) one untie step per stage on
// every rank, then
//   const CostModel cm = h100_model(world_size);               // or h100_model(world_size, nodes)
//   const PlanReport ours = plan_report(preset, "ours", stages, cm);
//   const PlanReport up = plan_report(preset, "upstream", upstream_schedule(stages), cm);
//   format_plan(ours), format_schedule_comparison(ours, up)    // the text
//   write_plan_json(path, ours), write_chrome_trace(path, ours)  // each gives its error, or ""
//
// Host C++17 only: no CUDA, nothing but work.cuh and the standard library. Errors in what a caller
// passes come back as a message from the *_error functions; the functions that compute stop the
// process with that message when given what those functions refuse.
#pragma once
#include "../kernels/work.cuh"

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

// ---- the constants: one table, every number with its source ----

struct FamilyValue {
    const char* family;  // a Work.name prefix; the longest matching prefix wins
    double value;
};

// One of NCCL's protocols in its own tuning model (src/graph/tuning.cc, ncclTopoTuneModel: defaults
// of baseLatencies, hwLatencies and llMaxBws): a ring collective of s steps, i of them between
// nodes, costs base + (s - i) * nvlink_step + i * net_step, plus its bytes at bw_fraction of the
// ring's bus bandwidth (capped at bw_cap_gbs when not 0). NCCL picks the fastest; so does the model.
struct NcclProtocol {
    const char* name;
    double base_us, nvlink_step_us, net_step_us;
    double bw_fraction, bw_cap_gbs;
};

struct CostModel {
    // -- the GPU: NVIDIA H100 SXM5 80GB datasheet (dense, i.e. without 2:4 sparsity) --
    int sms = 132;
    double bf16_tflops = 989;   // tensor cores, bf16 in, fp32 accumulate
    double fp8_tflops = 1979;   // tensor cores, e4m3/e5m2
    double fp32_tflops = 67;    // CUDA cores (non-tensor fp32)
    double hbm_tbs = 3.35;      // HBM3

    // -- cuBLASLt GEMMs: peak x base efficiency x wave quantization x small-K ramp --
    // bf16: the best large H100 SXM matmuls measure ~780 TFLOP/s (Horace He's "H100 peak matmul
    // FLOPS" gist: 780 with CUTLASS autotuning), 79% of peak.
    double gemm_bf16_efficiency = 0.80;
    // fp8: an assumption, ~1.38 PFLOP/s for large cuBLASLt fp8 GEMMs (fp8's epilogue and scaling
    // cost relatively more than bf16's at twice the math rate).
    double gemm_fp8_efficiency = 0.70;
    // The output tile whose waves over the 132 SMs quantize the duration: 128x256, a CUTLASS/cuBLAS
    // Hopper bf16 and fp8 tile and the one upstream's Triton ReLU^2 GEMM uses (BLOCK_SIZE_M 128,
    // BLOCK_SIZE_N 256). The model takes the better of the two orientations, as a heuristic would.
    int gemm_tile_m = 128, gemm_tile_n = 256;
    // A tile's fixed cost (pipeline fill, epilogue) expressed as K: efficiency x k / (k + ramp).
    // An assumption: at peak a 128x256 tile spends ~8.7 ns per unit of K, so 128 is ~1.1 us per tile.
    double gemm_k_ramp = 128;
    // Split-K: when the output's tiles leave SMs idle (a weight gradient, 3072x768 with K = 16384,
    // is 72 tiles on 132 SMs), cuBLASLt's heuristics split K; the model takes the best of 1..8
    // splits, each extra split costing its fp32 partials written and read back through HBM.
    int gemm_max_split_k = 8;

    // -- tensor-core kernels that are not GEMMs: TFLOP/s on the tiles they execute, by family --
    std::vector<FamilyValue> tc_tflops = {
        // Ours: FA2-class kernels on mma.sync (the Ampere instruction). The FlashAttention-3 paper
        // (Shah et al. 2024) reports FlashAttention-2 at ~35% of H100 peak forward (~350 TFLOP/s at
        // long sequences); our tiles are smaller (64 rows, 4 warps) and the windows short, so a
        // third of peak. Backward: FA2 runs at ~85% of its forward rate (FA2 paper, A100: up to 63%
        // of peak backward, 73% forward).
        {"attention_forward", 330},
        {"attention_backward", 280},
        // Ours: the fused c_fc + ReLU^2 GEMM on mma.sync, 128x128 tiles, 3-stage cp.async. mma.sync
        // reaches about 2/3 of Hopper's wgmma peak (FlashAttention-3 paper); assume ~70% of that.
        {"linear_relu_square_forward", 450},
        {"linear_relu_square_backward", 450},  // the same kernel with ReLU^2's derivative in its epilogue
        // Upstream's (upstream_schedule()): FlashAttention-3, head dim 128. Forward: 565 TFLOP/s at
        // seqlen 2048 (pytorch/benchmark PR 2391, FA3 vs Triton FA2 on H100); backward: the FA3
        // paper's 1.5-1.75x over FA2, i.e. ~1.6 x 280.
        {"fa3_attention_forward", 560},
        {"fa3_attention_backward", 450},
    };
    double tc_default_tflops = 450;  // any other tensor-core kernel: assumed like our mma.sync GEMM

    // -- memory-bound kernels: bytes at HBM x efficiency, or flops at the CUDA cores, the slower --
    // An assumption for the typical fused elementwise/row-reduction kernel (streaming copies reach
    // ~90% of 3.35 TB/s; row reductions over 768 columns, short grids and tails do worse).
    double hbm_efficiency = 0.70;
    // Families measured (--profile-steps) far from the default go here, e.g. {"embedding_backward", 0.4}.
    std::vector<FamilyValue> hbm_efficiency_by_family = {};
    // Of fp32_tflops: elementwise kernels issue loads, address math and SFU ops beside their FMAs.
    double cuda_core_efficiency = 0.5;

    // -- launches outside CUDA graphs, and the host --
    double host_launch_us = 2.5;      // cudaLaunchKernel / cudaMemcpyAsync / cudaMemsetAsync: 2-4 us
    double host_gemm_us = 4.0;        // cublasLtMatmul with a cached plan (assumption)
    double host_collective_us = 5.0;  // an NCCL call's enqueue (assumption)
    double host_event_us = 1.0;       // cudaEventRecord / cudaStreamWaitEvent (assumption)
    double host_sync_us = 5.0;        // a synchronize returns this long after the stream drains (assumption)
    double mpi_us = 5.0;              // a small blocking MPI call between ranks of a node (assumption)
    double device_launch_us = 1.0;    // fixed device time per kernel: the ~1 us gap between kernels

    // -- copies (H100 SXM5: PCIe Gen5 x16, 64 GB/s per direction) --
    double pcie_pinned_gbs = 50;    // cudaMemcpyAsync from/to pinned host memory
    double pcie_pageable_gbs = 25;  // through a staging buffer: a copy whose name contains "pageable"
    double copy_latency_us = 2.0;   // a DMA transfer's setup (assumption)

    // -- collectives: NCCL ring alpha-beta, within a node over NVLink/NVSwitch or across nodes --
    int world_size = 8, nodes = 1;
    // NVLink 4 carries 450 GB/s per direction per GPU; with protocol overhead NCCL gets ~370 GB/s of
    // bus bandwidth on 8 H100s for ring collectives (NCCL maintainer, nccl-tests issue 212; NVLS
    // all-reduces reach ~480, not modeled: our all-reduces are KB-sized, where LL wins).
    double nvlink_busbw_gbs = 370;
    // Across nodes (DGX H100: 8 ConnectX-7 400 Gb/s InfiniBand NICs per node, rail-optimized): each
    // NIC carries one ring channel's crossing, so a ring's bus bandwidth is at most the node's NICs'
    // total at nccl-tests' ~90% of line rate, and never above NVLink's.
    int nics_per_node = 8;
    double nic_gbs = 50;
    double nic_efficiency = 0.9;
    std::vector<NcclProtocol> nccl_protocols = {
        {"LL", 6.6, 0.6, 2.7, 0.5, 141},  // Hopper single-node llMaxBw: 141 GB/s
        {"LL128", 14.0, 1.9, 4.0, 0.92, 0},
        {"Simple", 8.4, 3.4, 14.0, 1.0, 0},
    };

    // -- which of the above were measured: set by apply_calibration() from a calibration file --
    std::string calibration_file;  // empty: every constant is the default above
    struct Measured {
        std::string constant, report;  // e.g. "tc_tflops.attention_forward", the gpu_check report it came from
        double value, assumed;         // the measured value, the default it replaced
    };
    std::vector<Measured> measured;
};

[[noreturn]] inline void step_model_fail(const std::string& why) {
    std::fprintf(stderr, "step_model: %s\n", why.c_str());
    std::fflush(stderr);
    std::exit(EXIT_FAILURE);
}

// The H100 table for world_size GPUs on `nodes` nodes (world_size a multiple of nodes).
inline CostModel h100_model(int world_size, int nodes = 1) {
    if (world_size < 1 || nodes < 1 || world_size % nodes != 0)
        step_model_fail("h100_model: " + std::to_string(world_size) + " GPUs do not split evenly over " +
                        std::to_string(nodes) + " nodes");
    CostModel m;
    m.world_size = world_size;
    m.nodes = nodes;
    return m;
}

// ---- pricing one operation (microseconds of device time) ----

inline const char* family_name(const Work& w) { return w.name ? w.name : ""; }
inline bool name_starts(const char* name, const char* prefix) {
    return std::strncmp(name, prefix, std::strlen(prefix)) == 0;
}
inline double family_value(const std::vector<FamilyValue>& table, const char* name, double fallback) {
    size_t best = 0;
    double v = fallback;
    for (const FamilyValue& f : table) {
        const size_t n = std::strlen(f.family);
        if (n > best && name_starts(name, f.family)) best = n, v = f.value;
    }
    return v;
}
inline double work_bytes(const Work& w) { return w.bytes_read + w.bytes_written; }

// ---- calibration: measured rates replace the defaults ----
// A calibration file (docs/gpu-runs/calibration.json, made by `scripts/gpu_check.sh --calibrate REPORT`
// from a GPU run's report) holds measured values of some of the constants above, each with the report
// it was measured in:
//   {"rates": {"hbm_efficiency": {"value": 0.62, "report": "docs/gpu-runs/<run>/report.md"},
//              "tc_tflops.attention_forward": {"value": 410, "report": "..."}}}
// Any other top-level key ("made_by", "card", ...) is kept for people and ignored here. Anything the
// model does not know, a value that is not a positive finite number (an efficiency above 1), or a
// missing report is refused with a message naming it: a silently ignored typo would leave a constant
// assumed while --plan-step calls it measured.
namespace step_model_detail {

// The few JSON shapes a calibration file holds: objects, strings, numbers (and, to refuse them
// clearly, anything else). A small reader, so the model stays free of libraries.
struct JsonValue {
    enum class Kind { object, string, number, other } kind = Kind::other;
    std::string text;                                        // a string's value; other: what it was
    double number = 0;
    std::vector<std::pair<std::string, JsonValue>> members;  // an object's, in file order
};
class JsonReader {
public:
    explicit JsonReader(const std::string& s) : s_(s) {}
    // The document's value, or an error (empty on success).
    std::string read(JsonValue& v) {
        std::string e = value(v, 0);
        skip_space();
        if (e.empty() && at_ != s_.size()) e = where() + ": text after the JSON value";
        return e;
    }

private:
    std::string where() const {
        int line = 1;
        for (size_t i = 0; i < at_ && i < s_.size(); ++i) line += s_[i] == '\n';
        return "line " + std::to_string(line);
    }
    void skip_space() {
        while (at_ < s_.size() && std::strchr(" \t\r\n", s_[at_])) ++at_;
    }
    std::string string(std::string& out) {
        if (at_ >= s_.size() || s_[at_] != '"') return where() + ": a string was expected";
        for (++at_; at_ < s_.size() && s_[at_] != '"'; ++at_) {
            if (s_[at_] == '\\') {
                if (++at_ >= s_.size()) break;
                const char c = s_[at_];
                if (!std::strchr("\"\\/", c)) return where() + ": an escape other than \\\" \\\\ \\/ in a string";
            }
            out += s_[at_];
        }
        if (at_ >= s_.size()) return where() + ": a string does not end";
        ++at_;
        return "";
    }
    std::string value(JsonValue& v, int depth) {
        if (depth > 8) return where() + ": nested too deep";
        skip_space();
        if (at_ >= s_.size()) return where() + ": the file ends where a value was expected";
        const char c = s_[at_];
        if (c == '"') {
            v.kind = JsonValue::Kind::string;
            return string(v.text);
        }
        if (c == '{') {
            v.kind = JsonValue::Kind::object;
            ++at_;
            skip_space();
            if (at_ < s_.size() && s_[at_] == '}') return ++at_, "";
            for (;;) {
                skip_space();
                std::string key;
                if (std::string e = string(key); !e.empty()) return e;
                skip_space();
                if (at_ >= s_.size() || s_[at_] != ':') return where() + ": ':' expected after \"" + key + "\"";
                ++at_;
                JsonValue member;
                if (std::string e = value(member, depth + 1); !e.empty()) return e;
                for (const auto& m : v.members)
                    if (m.first == key) return where() + ": \"" + key + "\" given twice";
                v.members.emplace_back(key, std::move(member));
                skip_space();
                if (at_ < s_.size() && s_[at_] == ',') {
                    ++at_;
                    continue;
                }
                if (at_ < s_.size() && s_[at_] == '}') return ++at_, "";
                return where() + ": ',' or '}' expected in an object";
            }
        }
        if (c == '-' || (c >= '0' && c <= '9')) {
            const char* begin = s_.c_str() + at_;
            char* end = nullptr;
            errno = 0;
            v.number = std::strtod(begin, &end);
            if (end == begin || errno != 0) return where() + ": a malformed number";
            v.kind = JsonValue::Kind::number;
            at_ += size_t(end - begin);
            return "";
        }
        if (c == '[') return where() + ": an array, where no calibration entry takes one";
        // true/false/null: no constant takes them; read the word to name it
        const size_t from = at_;
        while (at_ < s_.size() && !std::strchr(",}\n", s_[at_])) ++at_;
        v.kind = JsonValue::Kind::other;
        v.text = s_.substr(from, at_ - from);
        return "";
    }
    const std::string& s_;
    size_t at_ = 0;
};

inline const JsonValue* member(const JsonValue& v, const std::string& key) {
    for (const auto& m : v.members)
        if (m.first == key) return &m.second;
    return nullptr;
}

// The constant a calibration names: a scalar of CostModel, or a family's entry of one of its tables
// ("tc_tflops.<family>", "hbm_efficiency_by_family.<family>"); nullptr and the error when unknown.
// Efficiencies are fractions: at most 1.
struct Target {
    double* scalar = nullptr;
    std::vector<FamilyValue>* table = nullptr;
    double table_default = 0;
    std::string family;
    bool fraction = false;
};
inline std::string target_of(CostModel& m, const std::string& name, Target& t) {
    const struct {
        const char* name;
        double* field;
        bool fraction;
    } scalars[] = {{"bf16_tflops", &m.bf16_tflops, false},
                   {"fp8_tflops", &m.fp8_tflops, false},
                   {"fp32_tflops", &m.fp32_tflops, false},
                   {"hbm_tbs", &m.hbm_tbs, false},
                   {"gemm_bf16_efficiency", &m.gemm_bf16_efficiency, true},
                   {"gemm_fp8_efficiency", &m.gemm_fp8_efficiency, true},
                   {"tc_default_tflops", &m.tc_default_tflops, false},
                   {"hbm_efficiency", &m.hbm_efficiency, true},
                   {"cuda_core_efficiency", &m.cuda_core_efficiency, true},
                   {"host_launch_us", &m.host_launch_us, false},
                   {"host_gemm_us", &m.host_gemm_us, false},
                   {"device_launch_us", &m.device_launch_us, false}};
    for (const auto& sc : scalars)
        if (name == sc.name) {
            t.scalar = sc.field, t.fraction = sc.fraction;
            return "";
        }
    for (const auto& [prefix, table, fallback, fraction] :
         {std::tuple{"tc_tflops.", &m.tc_tflops, m.tc_default_tflops, false},
          std::tuple{"hbm_efficiency_by_family.", &m.hbm_efficiency_by_family, m.hbm_efficiency, true}})
        if (name.rfind(prefix, 0) == 0 && name.size() > std::strlen(prefix)) {
            t.table = table, t.table_default = fallback, t.fraction = fraction;
            t.family = name.substr(std::strlen(prefix));
            return "";
        }
    std::string known;
    for (const auto& sc : scalars) known += std::string(known.empty() ? "" : ", ") + sc.name;
    return "unknown constant \"" + name + "\" (known: " + known +
           ", tc_tflops.<family>, hbm_efficiency_by_family.<family>)";
}

// A family name with a stable address for the model's tables (they hold const char*).
inline const char* stable_family(const std::string& name) {
    static std::set<std::string> names;
    return names.insert(name).first->c_str();
}

}  // namespace step_model_detail

// Applies a calibration file's text to m; returns what is wrong with it ("" when nothing is; then m
// holds the measured values and lists them in m.measured). `file` names it in messages and in m.
inline std::string apply_calibration(CostModel& m, const std::string& text, const std::string& file) {
    using namespace step_model_detail;
    JsonValue doc;
    const std::string bad = "calibration " + file + ": ";
    if (const std::string e = JsonReader(text).read(doc); !e.empty()) return bad + e;
    if (doc.kind != JsonValue::Kind::object) return bad + "the file is not a JSON object";
    const JsonValue* rates = member(doc, "rates");
    if (!rates || rates->kind != JsonValue::Kind::object) return bad + "no \"rates\" object";
    if (rates->members.empty()) return bad + "\"rates\" names no constant";
    CostModel out = m;
    for (const auto& [name, entry] : rates->members) {
        const std::string at = bad + "\"" + name + "\": ";
        Target t;
        if (const std::string e = target_of(out, name, t); !e.empty()) return bad + e;
        if (entry.kind != JsonValue::Kind::object) return at + "want {\"value\": number, \"report\": \"...\"}";
        const JsonValue *value = member(entry, "value"), *report = member(entry, "report");
        if (!value || value->kind != JsonValue::Kind::number)
            return at + "no numeric \"value\"" + (value && value->kind != JsonValue::Kind::number ? " (got " +
                   (value->kind == JsonValue::Kind::string ? "\"" + value->text + "\"" : value->text) + ")" : "");
        if (!report || report->kind != JsonValue::Kind::string || report->text.empty())
            return at + "no \"report\" naming the run it was measured in";
        const double v = value->number;
        if (!std::isfinite(v) || v <= 0) return at + "the value " + std::to_string(v) + " is not positive";
        if (t.fraction && v > 1) return at + "an efficiency of " + std::to_string(v) + " is above 1";
        double assumed = 0;
        if (t.scalar) {
            assumed = *t.scalar;
            *t.scalar = v;
        } else {
            assumed = family_value(*t.table, t.family.c_str(), t.table_default);
            const auto same = std::find_if(t.table->begin(), t.table->end(),
                                           [&](const FamilyValue& f) { return t.family == f.family; });
            if (same != t.table->end()) same->value = v;
            else t.table->push_back({stable_family(t.family), v});
        }
        out.measured.push_back({name, report->text, v, assumed});
    }
    out.calibration_file = file;
    m = std::move(out);
    return "";
}

// Reads and applies a calibration file; "" or what is wrong (a file that cannot be read included).
inline std::string load_calibration(CostModel& m, const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) return "calibration " + path + ": cannot be read (" + std::strerror(errno) + ")";
    std::string text;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
    std::fclose(f);
    return apply_calibration(m, text, path);
}

// Which constants are measured (each with its report) and that the rest are assumed: for --plan-step
// and the profiles' model columns.
inline std::string calibration_summary(const CostModel& m) {
    if (m.measured.empty())
        return "constants: none measured (no calibration file); every rate is train/step_model.h's default "
               "(datasheet or assumption)\n";
    std::string o = "constants measured (" + m.calibration_file + "), the rest train/step_model.h's defaults "
                    "(datasheet or assumption):\n";
    for (const CostModel::Measured& c : m.measured) {
        char line[512];
        std::snprintf(line, sizeof line, "  measured %-40s %12.6g (default %.6g) from %s\n", c.constant.c_str(), c.value,
                      c.assumed, c.report.c_str());
        o += line;
    }
    return o;
}

// Bytes at the family's share of HBM bandwidth, or CUDA-core flops, whichever takes longer.
inline double memory_bound_us(const Work& w, const CostModel& cm) {
    const double eff = family_value(cm.hbm_efficiency_by_family, family_name(w), cm.hbm_efficiency);
    const double bytes_us = work_bytes(w) / (cm.hbm_tbs * 1e6 * eff);  // 1 TB/s = 1e6 bytes per us
    const double flops_us = w.flops / (cm.fp32_tflops * 1e6 * cm.cuda_core_efficiency);
    return std::max(bytes_us, flops_us);
}

// cuBLASLt by shape: whole waves of output tiles over the SMs, each tile's K loop at the per-SM
// share of peak x base efficiency x k / (k + ramp); the better tile orientation and split of K.
// Without a shape: the FLOPs at peak x efficiency.
inline double gemm_compute_us(const Work& w, const CostModel& cm) {
    const bool fp8 = w.gemm == GemmType::fp8;
    const double rate = (fp8 ? cm.fp8_tflops * cm.gemm_fp8_efficiency : cm.bf16_tflops * cm.gemm_bf16_efficiency) * 1e6;
    if (w.m <= 0 || w.n <= 0 || w.k <= 0) return w.tc_flops / rate;
    const int64_t batch = std::max(w.batch, 1);
    const auto tiles = [&](int64_t tm, int64_t tn) { return (w.m + tm - 1) / tm * ((w.n + tn - 1) / tn) * batch; };
    const int64_t out_tiles = std::min(tiles(cm.gemm_tile_m, cm.gemm_tile_n), tiles(cm.gemm_tile_n, cm.gemm_tile_m));
    double best = std::numeric_limits<double>::infinity();
    for (int split = 1; split <= std::max(cm.gemm_max_split_k, 1) && split <= w.k; ++split) {
        const double k = double((w.k + split - 1) / split), ramp = k / (k + cm.gemm_k_ramp);
        const double tile_us = 2.0 * cm.gemm_tile_m * cm.gemm_tile_n * k / (rate * ramp / cm.sms);
        const int64_t waves = (out_tiles * split + cm.sms - 1) / cm.sms;
        const double partial_bytes = split > 1 ? 8.0 * w.m * w.n * batch * split : 0;  // fp32, written and read
        const double partials = partial_bytes / (cm.hbm_tbs * 1e6 * cm.hbm_efficiency);
        best = std::min(best, double(waves) * tile_us + partials);
    }
    return best;
}

// Host <-> device over PCIe by the name's direction (copy_h2d, copy_d2h); anything else moves
// through HBM like a memory-bound kernel.
inline double copy_us(const Work& w, const CostModel& cm) {
    const char* name = family_name(w);
    if (!name_starts(name, "copy_h2d") && !name_starts(name, "copy_d2h"))
        return memory_bound_us(w, cm) + cm.device_launch_us;
    const double gbs = std::strstr(name, "pageable") ? cm.pcie_pageable_gbs : cm.pcie_pinned_gbs;
    return cm.copy_latency_us + std::max(w.bytes_read, w.bytes_written) / (gbs * 1e3);  // 1 GB/s = 1e3 bytes per us
}

// NCCL's ring: steps and the share of the buffer each GPU moves, per kind (nccl-tests' busbw
// conversion: reduce-scatter and all-gather (N-1)/N of the full buffer, all-reduce 2(N-1)/N,
// broadcast and reduce 1). send_recv (the sparse exchange's grouped sends): comm_bytes are what this rank
// sends, spread evenly over the other ranks, each at once; one step.
inline double collective_us(Comm kind, double bytes, const CostModel& cm) {
    const int n = cm.world_size, nodes = cm.nodes, per_node = n / nodes;
    if (n <= 1 || kind == Comm::none) return cm.device_launch_us;
    const double net_busbw = cm.nics_per_node * cm.nic_gbs * cm.nic_efficiency;
    const double busbw = nodes > 1 ? std::min(cm.nvlink_busbw_gbs, net_busbw) : cm.nvlink_busbw_gbs;
    int steps = 1, net_steps = nodes > 1 ? 1 : 0;
    double factor = 1.0;
    if (kind == Comm::all_reduce) {
        steps = 2 * (n - 1), net_steps = 2 * (nodes - 1), factor = 2.0 * (n - 1) / n;
    } else if (kind == Comm::reduce_scatter || kind == Comm::all_gather) {
        steps = n - 1, net_steps = nodes - 1, factor = double(n - 1) / n;
    } else if (kind == Comm::reduce) {  // a ring reduce: the whole buffer through every link (busbw = algbw)
        steps = n - 1, net_steps = nodes - 1;
    } else if (kind == Comm::broadcast) {
        steps = n, net_steps = nodes > 1 ? n : 0;  // NCCL prices every broadcast step at the slower link
    }
    double best = std::numeric_limits<double>::infinity();
    for (const NcclProtocol& p : cm.nccl_protocols) {
        const auto bw = [&](double gbs) {
            const double b = gbs * p.bw_fraction;
            return (p.bw_cap_gbs > 0 ? std::min(b, p.bw_cap_gbs) : b) * 1e3;  // bytes per us
        };
        const double latency = p.base_us + (steps - net_steps) * p.nvlink_step_us + net_steps * p.net_step_us;
        double transfer = bytes * factor / bw(busbw);
        if (kind == Comm::send_recv && nodes > 1) {  // the off-node share leaves through this GPU's NIC
            const double off = double(n - per_node) / (n - 1);
            const double nic = cm.nic_gbs * cm.nic_efficiency;
            transfer = std::max(bytes * (1 - off) / bw(cm.nvlink_busbw_gbs), bytes * off / bw(nic));
        }
        best = std::min(best, latency + transfer);
    }
    return best;
}

// Device time of one enqueued operation (not events or host waits).
inline double device_us(const StepOp& op, const CostModel& cm) {
    const Work& w = op.work;
    switch (op.kind) {
        case OpKind::collective: return collective_us(w.comm, w.comm_bytes, cm);
        case OpKind::copy: return copy_us(w, cm);
        case OpKind::memset: return memory_bound_us(w, cm) + cm.device_launch_us;
        case OpKind::gemm:
        case OpKind::kernel: {
            const double tc_rate = family_value(cm.tc_tflops, family_name(w), cm.tc_default_tflops) * 1e6;
            double compute = 0;
            if (op.kind == OpKind::gemm || w.gemm != GemmType::none) compute = gemm_compute_us(w, cm);
            else if (w.tc_flops > 0) compute = w.tc_flops / tc_rate;
            return std::max(compute, memory_bound_us(w, cm)) + cm.device_launch_us;
        }
        default: return 0;
    }
}

inline bool is_device_op(OpKind k) {
    return k == OpKind::kernel || k == OpKind::gemm || k == OpKind::copy || k == OpKind::memset ||
           k == OpKind::collective;
}
inline double host_cost_us(OpKind k, const CostModel& cm) {
    switch (k) {
        case OpKind::gemm: return cm.host_gemm_us;
        case OpKind::collective: return cm.host_collective_us;
        case OpKind::event_record:
        case OpKind::event_wait: return cm.host_event_us;
        case OpKind::host_sync: return 0;  // priced as a wait (host_sync_us, mpi_us)
        default: return cm.host_launch_us;
    }
}

// ---- checking recordings ----

inline bool is_mpi_call(const StepOp& op) {
    return op.kind == OpKind::host_sync && name_starts(family_name(op.work), "mpi_");
}
// Collectives and blocking MPI calls meet across ranks: the k-th of each rank is the same one.
inline bool is_rendezvous(const StepOp& op) { return op.kind == OpKind::collective || is_mpi_call(op); }
inline std::vector<const StepOp*> rendezvous_of(const std::vector<StepOp>& ops) {
    std::vector<const StepOp*> out;
    for (const StepOp& op : ops)
        if (is_rendezvous(op)) out.push_back(&op);
    return out;
}

inline std::string op_error(const StepOp& op) {
    const Work& w = op.work;
    const double numbers[] = {w.tc_flops, w.flops, w.bytes_read, w.bytes_written, w.comm_bytes};
    for (double x : numbers)
        if (!(x >= 0 && std::isfinite(x))) return "a FLOP or byte count is negative or not finite";
    if (w.m < 0 || w.n < 0 || w.k < 0 || w.batch < 0) return "a negative GEMM dimension";
    if (op.stream < -1 || (op.stream == -1 && op.kind != OpKind::host_sync))
        return "stream " + std::to_string(op.stream) + " (only a host_sync may name stream -1, the whole device)";
    const bool event_op = op.kind == OpKind::event_record || op.kind == OpKind::event_wait;
    if (event_op && op.event < 0) return "an event operation without an event";
    if (op.kind == OpKind::collective && w.comm == Comm::none) return "a collective without a kind (Comm::none)";
    return "";
}

// What is wrong with a step's recordings (one per rank), or "": every operation well formed, and
// every rank issuing the same collectives and MPI calls (by name and kind) in the same order.
inline std::string recording_error(const std::vector<std::vector<StepOp>>& ranks) {
    if (ranks.empty()) return "no ranks recorded";
    for (size_t r = 0; r < ranks.size(); ++r)
        for (size_t i = 0; i < ranks[r].size(); ++i)
            if (std::string e = op_error(ranks[r][i]); !e.empty())
                return "rank " + std::to_string(r) + ", operation " + std::to_string(i) + " (" +
                       family_name(ranks[r][i].work) + "): " + e;
    const std::vector<const StepOp*> first = rendezvous_of(ranks[0]);
    for (size_t r = 1; r < ranks.size(); ++r) {
        const std::vector<const StepOp*> mine = rendezvous_of(ranks[r]);
        for (size_t k = 0; k < std::min(first.size(), mine.size()); ++k) {
            const StepOp &a = *first[k], &b = *mine[k];
            if (a.kind != b.kind || a.work.comm != b.work.comm || std::strcmp(family_name(a.work), family_name(b.work)))
                return "collective/MPI call " + std::to_string(k) + " differs: rank 0 issues " + family_name(a.work) +
                       ", rank " + std::to_string(r) + " issues " + family_name(b.work);
        }
        if (first.size() != mine.size())
            return "rank 0 issues " + std::to_string(first.size()) + " collectives and MPI calls, rank " +
                   std::to_string(r) + " issues " + std::to_string(mine.size());
    }
    return "";
}

// ---- the replay ----

struct OpTiming {
    double host_begin_us = 0, host_end_us = 0;  // the host enqueuing the op (or waiting, for host_sync)
    double start_us = 0, end_us = 0;            // on its stream (device ops); others: the host's time
    double exposed_comm_us = 0;  // stream 0 idle waiting on another stream (events), or in a collective
    double overlapped_us = 0;    // collectives: how long stream 0 computed meanwhile
};
struct PathShare {
    std::string name;  // a family, "host_launch" (the host issuing), "host_sync", or an mpi_ call
    double us;
};
struct Timeline {  // one rank's step
    std::vector<OpTiming> ops;  // one per StepOp
    double makespan_us = 0;     // the host and every stream done
    double exposed_comm_us = 0;
    int launches = 0, host_syncs = 0;
    // What the step's end depends on: walking back from the last thing to finish through the
    // constraint that set each start (host, stream order, event, or the rank a collective waited
    // for), time per family, largest first; the shares add up to makespan_us.
    std::vector<PathShare> critical_path;
};

namespace step_model_detail {

struct Node {  // a stretch of time on the critical-path graph
    std::string label;
    double begin, end;
    int pred;  // the node whose end set `begin`, or -1 (time 0)
};
struct Stamp {  // a time and the node it comes from
    double t = 0;
    int node = -1;
};
inline Stamp later(Stamp a, Stamp b) { return b.t > a.t ? b : a; }  // ties keep a

struct RankState {
    size_t pos = 0;
    Stamp host;
    // Per stream: the last op's end, and the latest event waited for since. A time set on the
    // stream itself is never later than its tail, so a wait that delays an op is on another stream.
    std::vector<Stamp> tail, wait;
    struct Event {
        Stamp at;
        bool recorded = false;  // a wait on an event never recorded is a no-op, as in CUDA
    };
    std::vector<Event> events;
    bool arrived = false;  // at its next rendezvous: when it is ready, `own_ready` without other
    Stamp ready, own_ready;  // streams' events, and its own duration (collectives)
    double own_us = 0;
    Timeline tl;
    std::vector<Stamp> op_end;  // per op: when it was done (device ops on their stream; others on the host)
};

class Replay {
  public:
    Replay(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm)
        : ranks_(ranks), cm_(cm), st_(ranks.size()) {
        for (size_t r = 0; r < ranks.size(); ++r) st_[r].tl.ops.resize(ranks[r].size()), st_[r].op_end.resize(ranks[r].size());
    }

    // Replays every rank's ops to their end; then timelines() reports a stretch of them.
    void run() {
        for (;;) {
            bool all_done = true, all_arrived = true;
            for (size_t r = 0; r < st_.size(); ++r) {
                advance(r);
                all_done = all_done && st_[r].pos == ranks_[r].size();
                all_arrived = all_arrived && st_[r].arrived;
            }
            if (all_done) break;
            // replay_error() checked that every rank meets the same rendezvous in the same order
            if (!all_arrived) step_model_fail("replay: ranks stopped at different points (a bug in the replay)");
            resolve();
        }
    }

    // When rank r's ops [from, to) were all done (the last of them; for the last ops of the replay,
    // the host and every stream idle).
    Stamp done(size_t r, size_t from, size_t to) {
        RankState& s = st_[r];
        Stamp t;
        for (size_t i = from; i < to; ++i) t = later(t, s.op_end[i]);
        return to == ranks_[r].size() ? later(t, later(device_ready(s, -1), s.host)) : t;
    }
    // Per rank, its ops [first[r], last[r]) with times from t0 (the step's start): when each ran, the
    // makespan to the last of them, stream 0's idle time for other streams in between, the critical
    // path back to t0.
    std::vector<Timeline> timelines(const std::vector<size_t>& first, const std::vector<size_t>& last, double t0) {
        std::vector<Timeline> out;
        for (size_t r = 0; r < st_.size(); ++r) out.push_back(finish(r, first[r], last[r], t0));
        return out;
    }

  private:
    const std::vector<std::vector<StepOp>>& ranks_;
    const CostModel& cm_;
    std::vector<RankState> st_;
    std::vector<Node> nodes_;

    Stamp add_node(std::string label, double begin, double dur, int pred) {
        nodes_.push_back({std::move(label), begin, begin + dur, pred});
        return {begin + dur, int(nodes_.size()) - 1};
    }
    static void add_stream(RankState& s, int stream) {
        if (int(s.tail.size()) > stream) return;
        s.tail.resize(size_t(stream) + 1), s.wait.resize(size_t(stream) + 1);
    }
    static Stamp stream_ready(RankState& s, int stream) {
        add_stream(s, stream);
        return later(s.tail[stream], s.wait[stream]);
    }
    static Stamp device_ready(RankState& s, int stream) {  // every stream (-1) or one
        if (stream >= 0) return stream_ready(s, stream);
        Stamp t;
        for (int i = 0; i < int(s.tail.size()); ++i) t = later(t, stream_ready(s, i));
        return t;
    }
    void host_pay(RankState& s, OpTiming& t, double us) {
        t.host_begin_us = s.host.t;
        if (us > 0) s.host = add_node("host_launch", s.host.t, us, s.host.node);
        t.host_end_us = s.host.t;
    }
    // The op starts: its stream takes it. On stream 0, the compute stream, the time past `own` (its
    // stream's tail or its issue) went to waiting on other streams: exposed communication; a
    // collective there is exposed whole.
    void run_on_stream(RankState& s, const StepOp& op, OpTiming& t, Stamp start, double dur, Stamp own) {
        const Stamp end = add_node(family_name(op.work), start.t, dur, start.node);
        t.start_us = start.t, t.end_us = end.t;
        s.op_end[s.pos] = end;
        if (op.stream == 0)
            t.exposed_comm_us = op.kind == OpKind::collective ? end.t - own.t : std::max(0.0, start.t - own.t);
        s.tail[op.stream] = end;
        s.wait[op.stream] = Stamp{};
    }

    // Runs rank r's ops until its end or its next rendezvous (where it arrives and waits).
    void advance(size_t r) {
        RankState& s = st_[r];
        while (s.pos < ranks_[r].size() && !s.arrived) {
            const StepOp& op = ranks_[r][s.pos];
            OpTiming& t = s.tl.ops[s.pos];
            if (is_rendezvous(op)) {
                arrive(s, op, t);
                return;
            }
            host_pay(s, t, host_cost_us(op.kind, cm_));
            if (is_device_op(op.kind)) {
                const Stamp ready = stream_ready(s, op.stream);
                const Stamp own = later(s.tail[op.stream], s.host);
                run_on_stream(s, op, t, later(ready, s.host), device_us(op, cm_), own);
            } else if (op.kind == OpKind::event_record) {
                if (int(s.events.size()) <= op.event) s.events.resize(size_t(op.event) + 1);
                s.events[op.event] = {stream_ready(s, op.stream), true};
                t.start_us = t.end_us = s.events[op.event].at.t;
            } else if (op.kind == OpKind::event_wait) {
                add_stream(s, op.stream);
                if (op.event < int(s.events.size()) && s.events[op.event].recorded)
                    s.wait[op.stream] = later(s.wait[op.stream], s.events[op.event].at);
                t.start_us = t.end_us = s.host.t;
            } else {  // host_sync
                const Stamp w = later(s.host, device_ready(s, op.stream));
                const char* name = family_name(op.work);
                s.host = add_node(*name ? name : "host_sync", w.t, cm_.host_sync_us, w.node);
                t.start_us = w.t, t.end_us = t.host_end_us = s.host.t;
            }
            if (!is_device_op(op.kind)) s.op_end[s.pos] = s.host;
            ++s.pos;
        }
    }

    void arrive(RankState& s, const StepOp& op, OpTiming& t) {
        if (op.kind == OpKind::collective) {
            host_pay(s, t, cm_.host_collective_us);
            s.ready = later(stream_ready(s, op.stream), s.host);
            s.own_ready = later(s.tail[op.stream], s.host);
            s.own_us = device_us(op, cm_);
        } else {  // a blocking MPI call: the host first waits as any host_sync does
            t.host_begin_us = s.host.t;
            s.ready = later(s.host, device_ready(s, op.stream));
        }
        s.arrived = true;
    }

    // Every rank is at the same collective or MPI call: it starts when the last rank is ready.
    void resolve() {
        Stamp start;
        double dur = 0;
        for (const RankState& s : st_) start = later(start, s.ready), dur = std::max(dur, s.own_us);
        for (size_t r = 0; r < st_.size(); ++r) {
            RankState& s = st_[r];
            const StepOp& op = ranks_[r][s.pos];
            OpTiming& t = s.tl.ops[s.pos];
            if (op.kind == OpKind::collective) {
                run_on_stream(s, op, t, start, dur, s.own_ready);
            } else {
                s.host = add_node(family_name(op.work), start.t, cm_.mpi_us, start.node);
                t.start_us = start.t, t.end_us = t.host_end_us = s.host.t;
                s.op_end[s.pos] = s.host;
            }
            s.arrived = false;
            s.own_us = 0;
            ++s.pos;
        }
    }

    Timeline finish(size_t r, size_t first, size_t last, double t0) {
        RankState& s = st_[r];
        const std::vector<OpTiming>& all = s.tl.ops;
        const Stamp end = done(r, first, last);
        Timeline tl;
        tl.makespan_us = end.t - t0;
        tl.ops.assign(all.begin() + std::ptrdiff_t(first), all.begin() + std::ptrdiff_t(last));
        for (size_t i = first; i < last; ++i) {
            const StepOp& op = ranks_[r][i];
            if (is_device_op(op.kind)) ++tl.launches;
            if (op.kind == OpKind::host_sync) ++tl.host_syncs;
        }
        // stream 0's idle time in [t0, end]: an earlier step's op whose wait reaches into the step
        // counts here, a wait before t0 in the step before
        for (size_t i = 0; i < ranks_[r].size(); ++i) {
            const OpTiming& t = all[i];
            const double until = ranks_[r][i].kind == OpKind::collective ? t.end_us : t.start_us;
            tl.exposed_comm_us += std::max(0.0, std::min(until, end.t) - std::max(until - t.exposed_comm_us, t0));
        }
        // collectives' overlap with stream 0's compute (stream 0's ops run one after another), the
        // earlier steps' compute included
        std::vector<const OpTiming*> busy;
        for (size_t i = 0; i < ranks_[r].size(); ++i) {
            const StepOp& op = ranks_[r][i];
            if (op.stream == 0 && is_device_op(op.kind) && op.kind != OpKind::collective) busy.push_back(&all[i]);
        }
        for (size_t i = first; i < last; ++i) {
            if (ranks_[r][i].kind != OpKind::collective) continue;
            OpTiming& c = tl.ops[i - first];
            auto it = std::lower_bound(busy.begin(), busy.end(), c.start_us,
                                       [](const OpTiming* b, double t) { return b->end_us <= t; });
            for (; it != busy.end() && (*it)->start_us < c.end_us; ++it)
                c.overlapped_us += std::min(c.end_us, (*it)->end_us) - std::max(c.start_us, (*it)->start_us);
        }
        for (OpTiming& t : tl.ops)
            for (double* x : {&t.host_begin_us, &t.host_end_us, &t.start_us, &t.end_us}) *x -= t0;
        tl.critical_path = critical_path(end, t0);
        return tl;
    }

    // Every node begins where its predecessor ends (a Stamp carries both), and the first at 0; the
    // path is cut at t0 (a node across it counts from t0).
    std::vector<PathShare> critical_path(Stamp end, double t0) const {
        std::map<std::string, double> by_name;
        for (int n = end.node; n >= 0 && nodes_[n].end > t0; n = nodes_[n].pred)
            by_name[nodes_[n].label] += nodes_[n].end - std::max(nodes_[n].begin, t0);
        std::vector<PathShare> out;
        for (const auto& [name, us] : by_name) out.push_back({name, us});
        std::stable_sort(out.begin(), out.end(), [](const PathShare& a, const PathShare& b) { return a.us > b.us; });
        return out;
    }
};

}  // namespace step_model_detail

// What keeps a model from pricing these recordings, or "": a malformed recording, or ranks that
// are not the model's GPUs (one rank may stand for all of them).
inline std::string replay_error(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm) {
    if (ranks.size() > 1 && int(ranks.size()) != cm.world_size)
        return std::to_string(ranks.size()) + " ranks recorded, but the model is for " +
               std::to_string(cm.world_size) + " GPUs";
    return recording_error(ranks);
}

// Replays one step of every rank (ranks[r]: rank r's ops in host issue order) on the model: per
// rank, when each op ran, the step's makespan, exposed and overlapped communication, the critical
// path. Stops the process with replay_error()'s message when it has one.
inline std::vector<Timeline> replay(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm) {
    if (const std::string e = replay_error(ranks, cm); !e.empty()) step_model_fail(e);
    step_model_detail::Replay replay(ranks, cm);
    replay.run();
    std::vector<size_t> last;
    for (const std::vector<StepOp>& ops : ranks) last.push_back(ops.size());
    return replay.timelines(std::vector<size_t>(ranks.size(), 0), last, 0);
}

// A step in steady state: steps[k][r] is rank r's recording of the k-th of a run of steps, replayed
// back to back on one timeline per rank: the host issues each step right after the one before, and
// streams and events carry over (a recording names a handle by the same index in every step), so a
// wait on an event recorded in an earlier step resolves against that record, and communication that
// spills into the next step delays what waits for it there. Step `report` is reported: its time runs
// from the end of the step before (the last of that step's ops done, on any rank, host or stream)
// to its own end; its exposed communication is stream 0's idle time for other streams in that window
// (a later step's wait included: replay one step after it), its launches and host syncs its own ops'.
inline std::vector<Timeline> replay_steady(const std::vector<std::vector<std::vector<StepOp>>>& steps, size_t report,
                                           const CostModel& cm) {
    if (report >= steps.size()) step_model_fail("replay_steady: no step " + std::to_string(report) + " to report");
    const size_t n = steps[report].size();
    std::vector<std::vector<StepOp>> ranks(n);
    std::vector<std::vector<size_t>> begin(steps.size() + 1, std::vector<size_t>(n, 0));  // begin[k][r]
    for (size_t k = 0; k < steps.size(); ++k) {
        if (const std::string e = replay_error(steps[k], cm); !e.empty()) step_model_fail(e);
        if (steps[k].size() != n) step_model_fail("steps of a steady state recorded on different rank counts");
        for (size_t r = 0; r < n; ++r) {
            ranks[r].insert(ranks[r].end(), steps[k][r].begin(), steps[k][r].end());
            begin[k + 1][r] = ranks[r].size();
        }
    }
    step_model_detail::Replay replay(ranks, cm);
    replay.run();
    double t0 = 0;
    if (report > 0)
        for (size_t r = 0; r < n; ++r) t0 = std::max(t0, replay.done(r, begin[report - 1][r], begin[report][r]).t);
    return replay.timelines(begin[report], begin[report + 1], t0);
}

// ---- a modeled step, a plan of stages, and their reports ----

struct FamilyRow {  // the device ops of one family (not collectives) in one rank's step
    std::string name;
    int count = 0;
    double tc_flops = 0, flops = 0, bytes = 0, ms = 0;  // flops: tensor-core and other
};
struct CollectiveRow {
    std::string name;
    int count = 0;
    double bytes = 0, ms = 0, overlapped_ms = 0;
};

// One step of every rank, replayed. The step takes as long as its slowest rank (`rank`); the
// family tables, exposed communication and critical path are that rank's. Ranks that a collective
// at the step's end holds together finish at once: of those, the one that waited least is the one
// the others waited for (its work sets the step; their extra wait is the ranks' imbalance).
struct ModeledStep {
    std::string label;
    std::vector<std::vector<StepOp>> ranks;  // empty: a step the schedule does not have
    std::vector<Timeline> timelines;
    int rank = 0;
    double ms = 0, exposed_comm_ms = 0;
    int launches = 0, host_syncs = 0;
    std::vector<FamilyRow> kernels;  // largest modeled time first
    std::vector<CollectiveRow> collectives;
    std::vector<PathShare> critical_path;
};

template <class Row>
Row& row_named(std::vector<Row>& rows, const char* name) {
    for (Row& r : rows)
        if (r.name == name) return r;
    rows.push_back(Row{name});
    return rows.back();
}
inline void add_family(std::vector<FamilyRow>& rows, const StepOp& op, const OpTiming& t) {
    FamilyRow& f = row_named(rows, family_name(op.work));
    ++f.count;
    f.tc_flops += op.work.tc_flops;
    f.flops += op.work.tc_flops + op.work.flops;
    f.bytes += work_bytes(op.work);
    f.ms += (t.end_us - t.start_us) / 1e3;
}
inline void add_collective(std::vector<CollectiveRow>& rows, const StepOp& op, const OpTiming& t) {
    CollectiveRow& c = row_named(rows, family_name(op.work));
    ++c.count;
    c.bytes += op.work.comm_bytes;
    c.ms += (t.end_us - t.start_us) / 1e3;
    c.overlapped_ms += t.overlapped_us / 1e3;
}

// Step `report` of `steps` (each every rank's recording) in the steady state of the run of them
// (replay_steady).
inline ModeledStep model_step(std::string label, const std::vector<std::vector<std::vector<StepOp>>>& steps,
                              size_t report, const CostModel& cm) {
    ModeledStep m;
    m.label = std::move(label);
    m.ranks = steps.at(report);
    if (m.ranks.empty()) return m;
    m.timelines = replay_steady(steps, report, cm);
    for (size_t r = 1; r < m.timelines.size(); ++r) {
        const Timeline &t = m.timelines[r], &slowest = m.timelines[m.rank];
        const bool tie = std::fabs(t.makespan_us - slowest.makespan_us) <= 1e-6 * std::max(1.0, slowest.makespan_us);
        if (tie ? t.exposed_comm_us < slowest.exposed_comm_us : t.makespan_us > slowest.makespan_us) m.rank = int(r);
    }
    const Timeline& tl = m.timelines[m.rank];
    m.ms = tl.makespan_us / 1e3;
    m.exposed_comm_ms = tl.exposed_comm_us / 1e3;
    m.launches = tl.launches;
    m.host_syncs = tl.host_syncs;
    const std::vector<StepOp>& ops = m.ranks[m.rank];
    for (size_t i = 0; i < ops.size(); ++i) {
        if (ops[i].kind == OpKind::collective) add_collective(m.collectives, ops[i], tl.ops[i]);
        else if (is_device_op(ops[i].kind)) add_family(m.kernels, ops[i], tl.ops[i]);
    }
    std::stable_sort(m.kernels.begin(), m.kernels.end(),
                     [](const FamilyRow& a, const FamilyRow& b) { return a.ms > b.ms; });
    m.critical_path = tl.critical_path;
    return m;
}

// A training stage: how many steps of each kind the schedule runs, and one recorded step of each
// (every rank's ops). The counts are disjoint: the untie step is not also counted as an Adam step.
struct PlanStage {
    std::string name;
    int steps_even = 0, steps_adam = 0, steps_untie = 0;
    std::vector<std::vector<StepOp>> even, adam, untie;  // untie: empty unless the stage has the split step
};
struct StageReport {
    std::string stage;
    int steps_even = 0, steps_adam = 0, steps_untie = 0;
    ModeledStep even, adam, untie;
    double total_ms = 0;  // the stage's steps, each at its kind's modeled time
};
struct PlanReport {
    std::string preset, schedule;  // schedule: "ours", or "upstream" (upstream_schedule())
    int world_size = 1, nodes = 1;
    double total_ms = 0;  // the whole run: the sum over the schedule
    std::vector<StageReport> stages;
};

// What is wrong with a plan for the model, or "".
inline std::string plan_error(const std::vector<PlanStage>& stages, const CostModel& cm) {
    for (const PlanStage& st : stages) {
        const struct {
            const char* kind;
            int steps;
            const std::vector<std::vector<StepOp>>& ranks;
        } kinds[] = {
            {"even", st.steps_even, st.even}, {"adam", st.steps_adam, st.adam}, {"untie", st.steps_untie, st.untie}};
        for (const auto& k : kinds) {
            const std::string where = "stage " + st.name + ", " + k.kind + " step: ";
            if (k.steps < 0) return where + "a negative step count (" + std::to_string(k.steps) + ")";
            if (k.steps > 0 && k.ranks.empty()) return where + std::to_string(k.steps) + " steps but no recording";
            if (!k.ranks.empty())
                if (const std::string e = replay_error(k.ranks, cm); !e.empty()) return where + e;
        }
    }
    return "";
}

// The steady state a stage's step of each kind is modeled in: the two steps before it in a run, it,
// and the step after it (an even step follows an Adam step; an Adam step and the untie step follow an
// even step, which an Adam step follows). A kind the stage did not record stands in for itself.
constexpr int kSteadyStepsBefore = 2;
enum class StepKind { even, adam, untie };
inline const std::vector<std::vector<StepOp>>& recording(const PlanStage& st, StepKind k) {
    return k == StepKind::even ? st.even : k == StepKind::adam ? st.adam : st.untie;
}
inline StepKind step_before(const PlanStage& st, StepKind k) {
    const StepKind before = k == StepKind::even ? StepKind::adam : StepKind::even;
    return recording(st, before).empty() ? k : before;
}
inline StepKind step_after(const PlanStage& st, StepKind k) {
    const StepKind after = k == StepKind::even ? StepKind::adam : StepKind::even;
    return recording(st, after).empty() ? k : after;
}
inline std::vector<std::vector<std::vector<StepOp>>> steady_steps(const PlanStage& st, StepKind k) {
    std::vector<std::vector<std::vector<StepOp>>> steps(kSteadyStepsBefore + 2);
    steps.back() = recording(st, step_after(st, k));
    for (int i = kSteadyStepsBefore; i >= 0; --i, k = step_before(st, k)) steps[size_t(i)] = recording(st, k);
    return steps;
}

inline PlanReport plan_report(const std::string& preset, const std::string& schedule,
                              const std::vector<PlanStage>& stages, const CostModel& cm) {
    if (const std::string e = plan_error(stages, cm); !e.empty()) step_model_fail(e);
    PlanReport p{preset, schedule, cm.world_size, cm.nodes, 0, {}};
    for (const PlanStage& st : stages) {
        StageReport s;
        s.stage = st.name;
        s.steps_even = st.steps_even, s.steps_adam = st.steps_adam, s.steps_untie = st.steps_untie;
        s.even = model_step(st.name + " even", steady_steps(st, StepKind::even), kSteadyStepsBefore, cm);
        s.adam = model_step(st.name + " adam", steady_steps(st, StepKind::adam), kSteadyStepsBefore, cm);
        s.untie = model_step(st.name + " untie", steady_steps(st, StepKind::untie), kSteadyStepsBefore, cm);
        s.total_ms = s.steps_even * s.even.ms + s.steps_adam * s.adam.ms + s.steps_untie * s.untie.ms;
        p.total_ms += s.total_ms;
        p.stages.push_back(std::move(s));
    }
    return p;
}

// ---- text ----

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline void appendf(std::string& out, const char* fmt, ...) {
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = std::max(std::vsnprintf(nullptr, 0, fmt, ap), 0);
    va_end(ap);
    std::string s(size_t(n) + 1, '\0');
    std::vsnprintf(s.data(), s.size(), fmt, again);
    va_end(again);
    s.pop_back();
    out += s;
}

inline std::string format_critical_path(const std::vector<PathShare>& path, size_t most) {
    std::string out;
    for (size_t i = 0; i < std::min(path.size(), most); ++i)
        appendf(out, "%s%s %.3f", i ? ", " : "", path[i].name.c_str(), path[i].us / 1e3);
    return out;
}

// The stage table, then per stage its kernel families, collectives and critical paths.
inline std::string format_plan(const PlanReport& p) {
    std::string o;
    appendf(o, "Modeled step times, preset %s, schedule %s: H100 cost model, %d GPUs on %d node%s (a model, not a "
               "measurement)\n",
            p.preset.c_str(), p.schedule.c_str(), p.world_size, p.nodes, p.nodes == 1 ? "" : "s");
    appendf(o, "%-10s %16s %9s %9s %9s %22s %14s %14s\n", "stage", "steps e/a/u", "even ms", "adam ms", "untie ms",
            "exposed comm e/a ms", "launches e/a", "host syncs e/a");
    int steps = 0;
    for (const StageReport& s : p.stages) {
        char untie[16] = "-", steps_text[48], exposed[48], launches[32], syncs[32];
        if (!s.untie.ranks.empty()) std::snprintf(untie, sizeof untie, "%.3f", s.untie.ms);
        std::snprintf(steps_text, sizeof steps_text, "%d/%d/%d", s.steps_even, s.steps_adam, s.steps_untie);
        std::snprintf(exposed, sizeof exposed, "%.3f/%.3f", s.even.exposed_comm_ms, s.adam.exposed_comm_ms);
        std::snprintf(launches, sizeof launches, "%d/%d", s.even.launches, s.adam.launches);
        std::snprintf(syncs, sizeof syncs, "%d/%d", s.even.host_syncs, s.adam.host_syncs);
        appendf(o, "%-10s %16s %9.3f %9.3f %9s %22s %14s %14s\n", s.stage.c_str(), steps_text, s.even.ms, s.adam.ms,
                untie, exposed, launches, syncs);
        steps += s.steps_even + s.steps_adam + s.steps_untie;
    }
    appendf(o, "whole run: %d steps, %.3f s modeled (the sum over the schedule)\n", steps, p.total_ms / 1e3);
    for (const StageReport& s : p.stages) {
        appendf(o, "\n%s: kernel families (the slowest rank's; per Adam step, or even step if Adam's has none)\n",
                s.stage.c_str());
        appendf(o, "%-36s %12s %10s %9s %9s %9s\n", "family", "count e/a", "GFLOP", "GB", "even ms", "adam ms");
        std::vector<std::string> names;
        for (const ModeledStep* m : {&s.adam, &s.even})
            for (const FamilyRow& f : m->kernels)
                if (std::find(names.begin(), names.end(), f.name) == names.end()) names.push_back(f.name);
        for (const std::string& n : names) {
            FamilyRow e, a;
            for (const FamilyRow& f : s.even.kernels)
                if (f.name == n) e = f;
            for (const FamilyRow& f : s.adam.kernels)
                if (f.name == n) a = f;
            char counts[32];
            std::snprintf(counts, sizeof counts, "%d/%d", e.count, a.count);
            const FamilyRow& work = a.count ? a : e;
            appendf(o, "%-36s %12s %10.2f %9.3f %9.3f %9.3f\n", n.c_str(), counts, work.flops / 1e9, work.bytes / 1e9,
                    e.ms, a.ms);
        }
        for (const ModeledStep* m : {&s.even, &s.adam}) {
            if (m->collectives.empty()) continue;
            appendf(o, "%s: collectives of the %s\n", s.stage.c_str(), m == &s.even ? "even step" : "Adam step");
            appendf(o, "%-36s %6s %10s %9s %14s\n", "name", "count", "MB", "ms", "overlapped ms");
            for (const CollectiveRow& c : m->collectives)
                appendf(o, "%-36s %6d %10.3f %9.3f %14.3f\n", c.name.c_str(), c.count, c.bytes / 1e6, c.ms,
                        c.overlapped_ms);
        }
        for (const ModeledStep* m : {&s.even, &s.adam, &s.untie})
            if (!m->ranks.empty())
                appendf(o, "%s: critical path (ms): %s\n", m->label.c_str(),
                        format_critical_path(m->critical_path, 8).c_str());
    }
    return o;
}

// ---- JSON: the plan (--json) and a Chrome/Perfetto trace (--trace) ----

// A JSON string: quotes, backslashes and control characters escaped.
inline std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) appendf(out, "\\u%04x", static_cast<unsigned>(c));
        else out += c;
    }
    return out + "\"";
}
// Finite by construction (recording_error() refuses non-finite inputs); JSON has no NaN anyway.
inline std::string json_number(double x) {
    std::string out;
    appendf(out, "%.9g", std::isfinite(x) ? x : 0.0);
    return out;
}
// A JSON object's members in the order added; `raw` takes a value already in JSON.
struct JsonObject {
    std::string members;
    JsonObject& raw(const char* key, const std::string& value) {
        members += (members.empty() ? "" : ", ") + json_string(key) + ": " + value;
        return *this;
    }
    JsonObject& num(const char* key, double v) { return raw(key, json_number(v)); }
    JsonObject& integer(const char* key, int64_t v) { return raw(key, std::to_string(v)); }
    JsonObject& str(const char* key, const std::string& v) { return raw(key, json_string(v)); }
    std::string text() const { return "{" + members + "}"; }
};
// A JSON array of f(item) for each item, one per line at the given indent.
template <class T, class F>
std::string json_array(const std::vector<T>& items, const char* indent, F f) {
    std::string out = "[";
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ",\n" : "\n") + std::string(indent) + f(items[i]);
    return out + "]";
}

inline std::string kernels_json(const std::vector<FamilyRow>& rows) {
    return json_array(rows, "      ", [](const FamilyRow& f) {
        return JsonObject().str("name", f.name).integer("count", f.count).num("flops", f.flops)
            .num("tc_flops", f.tc_flops).num("bytes", f.bytes).num("modeled_ms", f.ms).text();
    });
}
inline std::string collectives_json(const std::vector<CollectiveRow>& rows) {
    return json_array(rows, "      ", [](const CollectiveRow& c) {
        return JsonObject().str("name", c.name).integer("count", c.count).num("bytes", c.bytes)
            .num("modeled_ms", c.ms).num("overlapped_ms", c.overlapped_ms).text();
    });
}
inline std::string critical_path_json(const std::vector<PathShare>& path) {
    return json_array(path, "      ",
                      [](const PathShare& p) { return JsonObject().str("name", p.name).num("ms", p.us / 1e3).text(); });
}

// The keys, plus: schedule, nodes, per stage the step counts, untie_ms (null without an
// untie step), the even step's kernels and collectives (kernels/collectives are the Adam step's,
// which has every family of the even step and Adam's own, or the even step's in a stage without
// Adam steps), host syncs per step kind (host_syncs_in_step is the larger), the critical paths.
inline std::string stage_json(const StageReport& s) {
    const ModeledStep& main = s.adam.ranks.empty() ? s.even : s.adam;
    return JsonObject()
        .str("stage", s.stage)
        .integer("steps_even", s.steps_even).integer("steps_adam", s.steps_adam).integer("steps_untie", s.steps_untie)
        .num("even_ms", s.even.ms).num("adam_ms", s.adam.ms)
        .raw("untie_ms", s.untie.ranks.empty() ? "null" : json_number(s.untie.ms))
        .num("total_ms", s.total_ms)
        .num("exposed_comm_even_ms", s.even.exposed_comm_ms).num("exposed_comm_adam_ms", s.adam.exposed_comm_ms)
        .integer("launches_even", s.even.launches).integer("launches_adam", s.adam.launches)
        .integer("host_syncs_in_step", std::max(s.even.host_syncs, s.adam.host_syncs))
        .integer("host_syncs_even", s.even.host_syncs).integer("host_syncs_adam", s.adam.host_syncs)
        .raw("kernels", kernels_json(main.kernels)).raw("collectives", collectives_json(main.collectives))
        .raw("kernels_even", kernels_json(s.even.kernels)).raw("collectives_even", collectives_json(s.even.collectives))
        .raw("critical_path_even", critical_path_json(s.even.critical_path))
        .raw("critical_path_adam", critical_path_json(s.adam.critical_path))
        .text();
}
inline std::string plan_json(const PlanReport& p) {
    return JsonObject()
               .str("preset", p.preset).str("schedule", p.schedule)
               .integer("world_size", p.world_size).integer("nodes", p.nodes)
               .num("total_ms", p.total_ms)
               .raw("stages", json_array(p.stages, "  ", stage_json))
               .text() + "\n";
}

// Chrome Trace Event format (chrome://tracing, ui.perfetto.dev): a process per rank, a thread for
// the host (0) and one per stream (stream + 1); the steps one after another, 100 us apart, each a
// span on the host thread named by its label; every op an "X" event on the host (its launch or
// wait) and, for device ops, one on its stream, with its work in args.
inline JsonObject trace_event(const char* ph, const std::string& name, size_t pid, int tid) {
    return JsonObject().str("ph", ph).str("name", name).integer("pid", int64_t(pid)).integer("tid", tid);
}
inline std::string trace_x(const std::string& name, const char* cat, size_t pid, int tid, double ts, double dur,
                           const JsonObject& args) {
    JsonObject e = trace_event("X", name, pid, tid).str("cat", cat).num("ts", ts).num("dur", dur);
    if (!args.members.empty()) e.raw("args", args.text());
    return e.text();
}
inline std::string op_label(const StepOp& op) {
    const char* name = family_name(op.work);
    if (*name) return name;
    if (op.kind == OpKind::event_record) return "event_record";
    return op.kind == OpKind::event_wait ? "event_wait" : "host_sync";
}
inline std::string chrome_trace_json(const std::vector<const ModeledStep*>& steps) {
    std::vector<std::string> events;
    size_t most_ranks = 0;
    int most_streams = 0;
    for (const ModeledStep* m : steps) {
        most_ranks = std::max(most_ranks, m->ranks.size());
        for (const std::vector<StepOp>& ops : m->ranks)
            for (const StepOp& op : ops) most_streams = std::max(most_streams, op.stream + 1);
    }
    for (size_t r = 0; r < most_ranks; ++r) {
        const auto name = [](const std::string& n) { return JsonObject().str("name", n).text(); };
        events.push_back(trace_event("M", "process_name", r, 0).raw("args", name("rank " + std::to_string(r))).text());
        for (int t = 0; t <= most_streams; ++t)
            events.push_back(trace_event("M", "thread_name", r, t)
                                 .raw("args", name(t ? "stream " + std::to_string(t - 1) : "host"))
                                 .text());
    }
    double offset = 0;
    for (const ModeledStep* m : steps) {
        double longest = 0;
        for (size_t r = 0; r < m->ranks.size(); ++r) {
            const Timeline& tl = m->timelines[r];
            longest = std::max(longest, tl.makespan_us);
            events.push_back(trace_x(m->label, "step", r, 0, offset, tl.makespan_us, JsonObject()));
            for (size_t i = 0; i < m->ranks[r].size(); ++i) {
                const StepOp& op = m->ranks[r][i];
                const OpTiming& t = tl.ops[i];
                events.push_back(trace_x(op_label(op), "host", r, 0, offset + t.host_begin_us,
                                         t.host_end_us - t.host_begin_us, JsonObject()));
                if (!is_device_op(op.kind)) continue;
                JsonObject args;
                args.num("tc_flops", op.work.tc_flops).num("flops", op.work.flops).num("bytes", work_bytes(op.work));
                args.str("range", op.range);
                if (op.kind == OpKind::collective)
                    args.num("comm_bytes", op.work.comm_bytes).num("overlapped_us", t.overlapped_us);
                events.push_back(trace_x(op_label(op), "device", r, op.stream + 1, offset + t.start_us,
                                         t.end_us - t.start_us, args));
            }
        }
        offset += longest + 100;
    }
    const auto as_is = [](const std::string& e) { return e; };
    return JsonObject().str("displayTimeUnit", "ms").raw("traceEvents", json_array(events, "", as_is)).text() + "\n";
}
inline std::vector<const ModeledStep*> modeled_steps(const PlanReport& p) {
    std::vector<const ModeledStep*> out;
    for (const StageReport& s : p.stages)
        for (const ModeledStep* m : {&s.even, &s.adam, &s.untie})
            if (!m->ranks.empty()) out.push_back(m);
    return out;
}

// Writes text to path; the error, or "".
inline std::string write_text_file(const std::string& path, const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return "cannot write " + path + ": " + std::strerror(errno);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    const int err = errno;
    if (std::fclose(f) != 0 || !ok) return "cannot write " + path + ": " + std::strerror(ok ? errno : err);
    return "";
}
inline std::string write_plan_json(const std::string& path, const PlanReport& p) {
    return write_text_file(path, plan_json(p));
}
inline std::string write_chrome_trace(const std::string& path, const PlanReport& p) {
    return write_text_file(path, chrome_trace_json(modeled_steps(p)));
}

// ---- upstream's schedule (item 4): the same recorded work, run as upstream's record runs it ----
// Each difference is one rule below; a rule whose families a recording lacks changes nothing.

struct ScheduleRule {
    const char* name;
    const char* what;
};
inline const std::vector<ScheduleRule>& upstream_rules() {
    static const std::vector<ScheduleRule> rules = {
        {"fa3_attention",
         "attention kernels with tensor-core work (attention_*) become fa3_<family>, priced at FlashAttention-3's "
         "rates (the fa3_ rows of CostModel::tc_tflops): upstream calls FA3's flash_attn_varlen_func. The executed "
         "tiles stay ours; our deterministic backward computes 7 tile products where FA3's computes 5, so upstream's "
         "attention backward is overstated by up to 7/5"},
        {"triton_linear_relu_square",
         "linear_relu_square_forward and _backward (our fused c_fc kernel and dpre kernel, shapes in the Work) are "
         "priced as bf16 GEMMs of their shape (upstream's persistent Triton kernel on TMA and wgmma, 128x256x64 "
         "tiles, the GEMM model's tile) and renamed triton_<family>"},
        {"fused_relu_square_backward",
         "relu_square_backward disappears into the GEMM just before it on its stream that writes its input "
         "(upstream's linear_relu_square(grad, W2, aux=pre): the epilogue reads pre and writes dpre): that GEMM "
         "also reads pre (the op's bytes written); the elementwise pass's own traffic and launch are gone. Our step "
         "fuses it too (linear_relu_square_backward) except on mlp_backward's fallback path, so this rarely fires"},
        {"separate_loss_quantization",
         "softcap_mtp_loss_backward_fp8 (our loss backward writing the e5m2 gradient in both layouts) becomes "
         "upstream's two passes: the compiled loss backward writes a bf16 gradient, then the FP8 lm_head's custom "
         "op quantizes it (grad / grad_s to e5m2, both layouts): the second pass reads and writes what the first "
         "writes (a bf16 matrix and two e5m2 layouts have the same bytes), one launch more"},
        {"comms_after_backward",
         "collectives issued inside the backward (range \"backward...\") on a stream other than 0, with the other "
         "ops of those streams there, move after the backward's last op, behind one event stream 0 records there: "
         "upstream launches its reductions from the optimizer step. Ours reduce the NorMuon banks in buckets (one "
         "ncclReduce per owner and layer) and, on Adam steps, value_embed's tables (an ncclReduce per owner's "
         "piece) and an untied lm_head during the backward; moved after it they stay that many collectives, "
         "where upstream issues one reduce-scatter per group"},
        {"gathers_joined",
         "stream 0 waits at the step's end for every other stream's work (an event recorded behind each stream's "
         "last op): upstream's optimizer step waits for all its all-gathers before it returns, so its next forward "
         "starts after them; ours waits for each gathered group only where the next forward first reads it"},
        {"sum_block_partials_kept",
         "our deterministic reductions' second passes are kept although upstream's torch reductions have none: "
         "most are fused into their producers now (last-block-done); the few left (sum_fixed_order of the loss, "
         "sum_block_partials outside the backward) slightly overstate upstream"},
    };
    return rules;
}

// A stable name for a renamed family (Work.name is a pointer; recordings outlive any local string).
inline const char* intern_family(const std::string& name) {
    static std::set<std::string> names;
    return names.insert(name).first->c_str();
}
inline bool in_backward(const StepOp& op) { return name_starts(op.range.c_str(), "backward"); }

inline void rule_fa3_attention(std::vector<StepOp>& ops) {
    for (StepOp& op : ops)
        if (name_starts(family_name(op.work), "attention_") && op.work.tc_flops > 0)
            op.work.name = intern_family(std::string("fa3_") + family_name(op.work));
}
inline void rule_triton_linear_relu_square(std::vector<StepOp>& ops) {
    for (StepOp& op : ops)
        if (name_starts(family_name(op.work), "linear_relu_square_")) {
            op.work.gemm = GemmType::bf16;
            op.work.name = intern_family(std::string("triton_") + family_name(op.work));
        }
}
inline void rule_fused_relu_square_backward(std::vector<StepOp>& ops) {
    std::vector<StepOp> out;
    for (const StepOp& op : ops) {
        if (name_starts(family_name(op.work), "relu_square_backward")) {
            auto prev = std::find_if(out.rbegin(), out.rend(),
                                     [&](const StepOp& p) { return p.stream == op.stream && is_device_op(p.kind); });
            const bool gemm = prev != out.rend() && prev->kind == OpKind::gemm;
            const Work& g = gemm ? prev->work : op.work;
            const bool writes_input = g.m <= 0 || double(g.m) * g.n * std::max(g.batch, 1) * 2 == op.work.bytes_written;
            if (gemm && writes_input) {
                prev->work.bytes_read += op.work.bytes_written;
                continue;
            }
        }
        out.push_back(op);
    }
    ops = std::move(out);
}
inline void rule_separate_loss_quantization(std::vector<StepOp>& ops) {
    std::vector<StepOp> out;
    for (const StepOp& op : ops) {
        if (!name_starts(family_name(op.work), "softcap_mtp_loss_backward_fp8")) {
            out.push_back(op);
            continue;
        }
        StepOp loss = op, quantize = op;
        loss.work.name = "softcap_mtp_loss_backward";
        quantize.work = Work{.name = "quantize_fp8_two_layouts", .bytes_read = op.work.bytes_written,
                             .bytes_written = op.work.bytes_written};
        out.push_back(loss);
        out.push_back(quantize);
    }
    ops = std::move(out);
}
inline void rule_comms_after_backward(std::vector<StepOp>& ops) {
    int last = -1;
    bool collective = false;
    for (int i = 0; i < int(ops.size()); ++i)
        if (in_backward(ops[i])) {
            last = i;
            collective = collective || (ops[i].kind == OpKind::collective && ops[i].stream > 0);
        }
    if (!collective) return;
    int event = 0;
    for (const StepOp& op : ops) event = std::max(event, op.event + 1);
    std::vector<StepOp> out, moved;
    std::vector<int> streams;
    for (int i = 0; i <= last; ++i) {
        const bool move = in_backward(ops[i]) && ops[i].stream > 0;
        (move ? moved : out).push_back(ops[i]);
        if (move && std::find(streams.begin(), streams.end(), ops[i].stream) == streams.end())
            streams.push_back(ops[i].stream);
    }
    const std::string range = ops[last].range;
    out.push_back({OpKind::event_record, 0, event, Work{}, range});
    for (int s : streams) out.push_back({OpKind::event_wait, s, event, Work{}, range});
    out.insert(out.end(), moved.begin(), moved.end());
    out.insert(out.end(), ops.begin() + last + 1, ops.end());
    ops = std::move(out);
}

// The join's events: stream s's is kJoinEvents + s in every recording (steady states replay steps of
// different kinds back to back), above any recording's own.
constexpr int kJoinEvents = 1 << 12;
inline void rule_gathers_joined(std::vector<StepOp>& ops) {
    int streams = 0;
    for (const StepOp& op : ops) streams = std::max(streams, op.stream + 1);
    const std::string range = ops.empty() ? "" : ops.back().range;
    std::vector<StepOp> joins;
    for (int s = 1; s < streams; ++s) {
        int last = -1;  // the stream's last device op, and whether stream 0 waits on an event recorded after it
        for (int i = 0; i < int(ops.size()); ++i)
            if (ops[i].stream == s && is_device_op(ops[i].kind)) last = i;
        bool joined = last < 0;
        for (int i = last + 1; i < int(ops.size()) && !joined; ++i)
            if (ops[i].kind == OpKind::event_record && ops[i].stream == s)
                for (int j = i + 1; j < int(ops.size()) && !joined; ++j)
                    joined = ops[j].kind == OpKind::event_wait && ops[j].stream == 0 && ops[j].event == ops[i].event;
        if (joined) continue;
        joins.push_back({OpKind::event_record, s, kJoinEvents + s, Work{}, range});
        joins.push_back({OpKind::event_wait, 0, kJoinEvents + s, Work{}, range});
    }
    ops.insert(ops.end(), joins.begin(), joins.end());
}

inline std::vector<StepOp> upstream_schedule(const std::vector<StepOp>& ops) {
    std::vector<StepOp> out = ops;
    rule_fa3_attention(out);
    rule_triton_linear_relu_square(out);
    rule_fused_relu_square_backward(out);
    rule_separate_loss_quantization(out);
    rule_comms_after_backward(out);
    rule_gathers_joined(out);
    return out;
}
inline std::vector<PlanStage> upstream_schedule(const std::vector<PlanStage>& stages) {
    std::vector<PlanStage> out = stages;
    for (PlanStage& s : out)
        for (std::vector<std::vector<StepOp>>* step : {&s.even, &s.adam, &s.untie})
            for (std::vector<StepOp>& ops : *step) ops = upstream_schedule(ops);
    return out;
}

// Ours against upstream's schedule, stage by stage, then the rules that make the difference.
inline std::string format_schedule_comparison(const PlanReport& ours, const PlanReport& upstream) {
    std::string o;
    appendf(o, "Ours vs upstream's schedule, modeled (preset %s, %d GPUs on %d node%s)\n", ours.preset.c_str(),
            ours.world_size, ours.nodes, ours.nodes == 1 ? "" : "s");
    appendf(o, "%-10s %14s %14s %14s %14s %14s %14s\n", "stage", "even ms ours", "upstream", "adam ms ours",
            "upstream", "stage s ours", "upstream");
    for (size_t i = 0; i < ours.stages.size() && i < upstream.stages.size(); ++i) {
        const StageReport &a = ours.stages[i], &b = upstream.stages[i];
        appendf(o, "%-10s %14.3f %14.3f %14.3f %14.3f %14.3f %14.3f\n", a.stage.c_str(), a.even.ms, b.even.ms,
                a.adam.ms, b.adam.ms, a.total_ms / 1e3, b.total_ms / 1e3);
    }
    appendf(o, "whole run: ours %.3f s, upstream's schedule %.3f s\nupstream's schedule, rule by rule:\n",
            ours.total_ms / 1e3, upstream.total_ms / 1e3);
    for (const ScheduleRule& r : upstream_rules()) appendf(o, "  %s: %s\n", r.name, r.what);
    return o;
}
