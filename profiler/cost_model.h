// The step cost model's table: what one operation of a recorded step (profiler/work.h) would take on
// an H100, priced from its Work alone (rooflines with an efficiency per kernel family, cuBLASLt GEMMs
// by shape, NCCL's alpha-beta model for collectives), and the calibration that replaces assumed rates
// with measured ones. profiler/replay.h replays a step's stream/event graph on these prices.
//
// It is a model, not a measurement: the constants sit in one table (CostModel) with the source of
// each; where no published number fits, the value is an assumption and says so. Compare schedules
// with it and trust differences more than absolute numbers; `--profile-steps` measures on a GPU.
// Deliberately left out: CUDA graphs (every launch pays its overhead), SMs that a running NCCL
// kernel takes from overlapped compute, L2 reuse between kernels, clocks below boost under load.
//
// Host C++17 only: no CUDA, nothing but profiler/work.h, the standard library and POSIX. Errors in
// what a caller passes come back as a message from the *_error functions; the functions that compute
// stop the process with that message when given what those functions refuse.
#pragma once
#include "work.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <unistd.h>
#include <utility>
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
// A family name with a stable address (Work.name and the model's tables hold const char*): the
// families a calibration names, a rule renames, or another rank's recording brings.
inline const char* intern_family(const std::string& name) {
    static std::set<std::string> names;
    return names.insert(name).first->c_str();
}

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
            else t.table->push_back({intern_family(t.family), v});
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

// The model for `world` GPUs on `nodes` nodes, with the measured rates of the calibration file the
// run names (--calibration), or else of the committed one (`committed`, docs/gpu-runs/calibration.json
// in the repository) where there is one; "none" names no file (every rate the default). "" or what is
// wrong with the file.
inline std::string calibrated_model(CostModel& m, const std::string& named, const std::string& committed, int world,
                                    int nodes) {
    m = h100_model(world, nodes);
    if (named == "none") return "";
    std::string path = named;
    if (path.empty() && access(committed.c_str(), F_OK) == 0) path = committed;
    return path.empty() ? "" : load_calibration(m, path);
}

// Which constants are measured (each with its report) and that the rest are assumed: for --plan-step
// and the profiles' model columns.
inline std::string calibration_summary(const CostModel& m) {
    if (m.measured.empty())
        return "constants: none measured (no calibration file); every rate is profiler/cost_model.h's default "
               "(datasheet or assumption)\n";
    std::string o = "constants measured (" + m.calibration_file + "), the rest profiler/cost_model.h's defaults "
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

