// Upstream's schedule of the same recorded work (--plan-step --schedule upstream): each difference
// between our step and upstream's record run is one rule that rewrites a recording
// (upstream_schedule()), priced by the same model (profiler/replay.h). Host C++17 only.
#pragma once
#include "replay.h"
#include "work.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

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

// Each difference between our step and upstream's is one rule, applied in this order. A rule names the
// kernel families it acts on that every training step records (not relu_square_backward, which only
// mlp_backward's fallback path launches), so a recording without one means a kernel was renamed, and the
// rule would silently change nothing; upstream_schedule_error() refuses such a recording, naming the
// rule and the family.
struct ScheduleRule {
    const char* name;
    std::vector<const char*> needs;       // families (Work.name prefixes)
    void (*apply)(std::vector<StepOp>&);  // nullptr: a difference the model keeps, stated for the reader
    const char* what;
};
// Where upstream's code of the preset's record differs from record 71's, which the rules describe.
enum class UpstreamLoss {
    compiled_then_quantized,  // record 71: a compiled loss backward, then the FP8 lm_head's quantization pass
    fused_e5m2,               // record 80: one kernel writes the e5m2 gradient, as ours (no rule)
};
struct UpstreamCode {
    UpstreamLoss loss = UpstreamLoss::compiled_then_quantized;
};
inline const std::vector<ScheduleRule>& all_upstream_rules() {
    static const std::vector<ScheduleRule> rules = {
        {"fa3_attention", {"attention_forward", "attention_backward"}, rule_fa3_attention,
         "attention kernels with tensor-core work (attention_*) become fa3_<family>, priced at FlashAttention-3's "
         "rates (the fa3_ rows of CostModel::tc_tflops): upstream calls FA3's flash_attn_varlen_func. The executed "
         "tiles stay ours; our deterministic backward computes 7 tile products where FA3's computes 5, so upstream's "
         "attention backward is overstated by up to 7/5"},
        {"triton_linear_relu_square", {"linear_relu_square_forward", "linear_relu_square_backward"}, rule_triton_linear_relu_square,
         "linear_relu_square_forward and _backward (our fused c_fc kernel and dpre kernel, shapes in the Work) are "
         "priced as bf16 GEMMs of their shape (upstream's persistent Triton kernel on TMA and wgmma, 128x256x64 "
         "tiles, the GEMM model's tile) and renamed triton_<family>"},
        {"fused_relu_square_backward", {}, rule_fused_relu_square_backward,
         "relu_square_backward disappears into the GEMM just before it on its stream that writes its input "
         "(upstream's linear_relu_square(grad, W2, aux=pre): the epilogue reads pre and writes dpre): that GEMM "
         "also reads pre (the op's bytes written); the elementwise pass's own traffic and launch are gone. Our step "
         "fuses it too (linear_relu_square_backward) except on mlp_backward's fallback path, so this rarely fires"},
        {"separate_loss_quantization", {"softcap_mtp_loss_backward_fp8"}, rule_separate_loss_quantization,
         "softcap_mtp_loss_backward_fp8 (our loss backward writing the e5m2 gradient in both layouts) becomes "
         "upstream's two passes: the compiled loss backward writes a bf16 gradient, then the FP8 lm_head's custom "
         "op quantizes it (grad / grad_s to e5m2, both layouts): the second pass reads and writes what the first "
         "writes (a bf16 matrix and two e5m2 layouts have the same bytes), one launch more"},
        {"comms_after_backward", {}, rule_comms_after_backward,
         "collectives issued inside the backward (range \"backward...\") on a stream other than 0, with the other "
         "ops of those streams there, move after the backward's last op, behind one event stream 0 records there: "
         "upstream launches its reductions from the optimizer step. Ours reduce the NorMuon banks in buckets (one "
         "ncclReduce per owner and layer) and, on Adam steps, value_embed's tables (an ncclReduce per owner's "
         "piece) and an untied lm_head during the backward; moved after it they stay that many collectives, "
         "where upstream issues one reduce-scatter per group"},
        {"gathers_joined", {}, rule_gathers_joined,
         "stream 0 waits at the step's end for every other stream's work (an event recorded behind each stream's "
         "last op): upstream's optimizer step waits for all its all-gathers before it returns, so its next forward "
         "starts after them; ours waits for each gathered group only where the next forward first reads it"},
        {"sum_block_partials_kept", {}, nullptr,
         "our deterministic reductions' second passes are kept although upstream's torch reductions have none: "
         "most are fused into their producers now (last-block-done); the few left (sum_fixed_order of the loss, "
         "sum_block_partials outside the backward) slightly overstate upstream"},
    };
    return rules;
}
// The rules that stand for upstream's code `code`.
inline std::vector<ScheduleRule> upstream_rules(UpstreamCode code = {}) {
    std::vector<ScheduleRule> rules;
    for (const ScheduleRule& r : all_upstream_rules())
        if (code.loss == UpstreamLoss::compiled_then_quantized || std::string(r.name) != "separate_loss_quantization")
            rules.push_back(r);
    return rules;
}

inline std::vector<StepOp> upstream_schedule(const std::vector<StepOp>& ops, UpstreamCode code = {}) {
    std::vector<StepOp> out = ops;
    for (const ScheduleRule& r : upstream_rules(code))
        if (r.apply) r.apply(out);
    return out;
}
inline std::vector<PlanStage> upstream_schedule(const std::vector<PlanStage>& stages, UpstreamCode code = {}) {
    std::vector<PlanStage> out = stages;
    for (PlanStage& s : out)
        for (std::vector<std::vector<StepOp>>* step : {&s.even, &s.adam, &s.untie})
            for (std::vector<StepOp>& ops : *step) ops = upstream_schedule(ops, code);
    return out;
}

// The first family a rule acts on that `ops` (one rank's recording of a training step) lacks, as
// "rule R acts on F", or "".
inline std::string missing_rule_family(const std::vector<StepOp>& ops, UpstreamCode code = {}) {
    for (const ScheduleRule& r : upstream_rules(code))
        for (const char* family : r.needs) {
            const bool recorded = std::any_of(ops.begin(), ops.end(),
                                              [&](const StepOp& op) { return name_starts(family_name(op.work), family); });
            if (!recorded) return std::string("rule ") + r.name + " acts on " + family;
        }
    return "";
}

// What keeps upstream_schedule() from standing for upstream's schedule of these stages, or "": a
// recording without a family one of the rules acts on (a renamed kernel: rename the rule's family too).
inline std::string upstream_schedule_error(const std::vector<PlanStage>& stages, UpstreamCode code = {}) {
    for (const PlanStage& st : stages) {
        const struct {
            const char* kind;
            const std::vector<std::vector<StepOp>>& ranks;
        } kinds[] = {{"even", st.even}, {"adam", st.adam}, {"untie", st.untie}};
        for (const auto& k : kinds)
            for (size_t r = 0; r < k.ranks.size(); ++r)
                if (const std::string e = missing_rule_family(k.ranks[r], code); !e.empty())
                    return "--schedule upstream: " + e + ", and " + st.name + "'s " + k.kind + " step (rank " +
                           std::to_string(r) + ") records none: a kernel renamed? Rename the rule's family too";
    }
    return "";
}
