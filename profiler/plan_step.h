// --plan-step: every rank records one step of each kind of each training stage in a dry run (host code,
// data, sparse-exchange sizes and the stream graph for real, no device work: profiler/work.h), rank 0
// gathers the recordings, prices them with the step model (profiler/replay.h) and prints the tables
// (profiler/reports.h), and writes --json and --trace. The profiler knows the trainer only through
// what it is handed: the schedule as data (ScheduleFacts), the run's processes (ProfilerRanks) and the
// few things a recording asks of the trainer (PlanTrainer).
#pragma once
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../data/loader.h"
#include "cost_model.h"
#include "replay.h"
#include "reports.h"
#include "schedule_facts.h"
#include "upstream_schedule.h"
#include "work.h"

// The run's processes: this rank, the gathers to rank 0 (the trainer's host_comm), and how a fatal
// error ends every rank (the trainer's fail(): the message, the log's fail line, MPI's abort).
struct ProfilerRanks {
    int rank = 0, world = 1;
    void (*gather)(const void* mine, size_t bytes, void* all) = nullptr;  // fixed-size, every rank's
    void (*gatherv)(const void* mine, int bytes, void* all, const int* counts, const int* offsets) = nullptr;
    void (*fail)(const std::string& why) = nullptr;
};
[[noreturn]] inline void profiler_fail(const ProfilerRanks& ranks, const std::string& why) {
    ranks.fail(why);
    std::exit(EXIT_FAILURE);  // fail() does not return; this line only tells the compiler so
}

// What a plan asks of the trainer, each a function of the trainer's own: the schedule as at a run's
// start, and at `step`; a fresh batch producer for steps [first, end) from the data's start, the data
// read `repeat` times over; the tied/stale state a run's `step` starts in; the training step; the
// producer's CPU ms per micro-batch, and the sparse exchange's plan's share of it.
struct PlanTrainer {
    std::function<void()> reset_schedule;
    std::function<void(int step)> advance_schedule;
    std::function<void(int first, int end, int repeat)> start_batches;
    std::function<void(int step)> as_in_a_run;
    std::function<void(int step)> train_step;
    std::function<std::pair<double, double>()> producer_ms;
};

// What a stage records: its first even step (the first after the untie in the stage that has it, so
// that the even and Adam steps both price the untied schedule most of its steps run), the first odd
// step after it (an Adam step), and the schedule's untie step when the stage has it (an Adam step of
// its own kind). -1: none.
struct StagePlan {
    int first = 0, end = 0;  // the stage's steps [first, end)
    int even = -1, adam = -1, untie = -1;
    int steps_even = 0, steps_adam = 0, steps_untie = 0;  // how many of each the schedule runs
    int last_recorded() const { return std::max({even, adam, untie}); }
    int first_recorded() const {
        int f = end;
        for (int s : {even, adam, untie})
            if (s >= 0) f = std::min(f, s);
        return f;
    }
};

inline std::vector<StagePlan> stage_plans(const ScheduleFacts& sch) {
    std::vector<StagePlan> plans;
    for (const ScheduleFacts::Stage& stage : sch.stages) {
        StagePlan p;
        p.first = stage.first;
        p.end = stage.end;
        for (int st = p.first; st < p.end; ++st) {
            if (st == sch.split_step) {
                ++p.steps_untie;
                p.untie = st;
            } else if (st % 2 == 0) {
                ++p.steps_even;
                // the first even step; in the stage that unties, the first after an untied Adam step
                if (p.even < 0 || (p.even < sch.split_step && st > sch.split_step + 2)) p.even = st;
            } else {
                ++p.steps_adam;
            }
        }
        // the Adam step after the even one (else, in a stage that has none after it, the first)
        for (int from : {std::max(p.first, p.even + 1), p.first})
            for (int st = from; st < p.end && p.adam < 0; ++st)
                if (st % 2 == 1 && st != sch.split_step) p.adam = st;
        plans.push_back(p);
    }
    return plans;
}

// ---- the data a plan reads ----

// The batches a plan reads. The run's training data, or, when it is the preset's and absent (no
// FineWeb on a laptop), the committed Tiny Shakespeare shard. Each stage's steps read from the data's
// start (a fresh loader per stage: the plan prices steps, not the run's position in its data), so a
// short shard serves every stage; a shard too short for a stage's steps (the record preset's 393,216
// tokens per micro-step on 8 ranks against Tiny Shakespeare's ~305,000) is read several times over as
// one (TrainLoader::Options::repeat): the smallest count that holds every stage's steps.
struct PlanData {
    std::string files;
    int repeat = 1;
};
// Where a plan may read its batches: the run's files, or the stand-in when they are the preset's
// default and absent. *_missing: why those files cannot be read, "" when they can (the run's: also ""
// when the user named them, so that a plan fails on them as the run would).
struct PlanDataFiles {
    std::string train, train_missing;
    std::string fallback, fallback_missing;
};

// Whether a fresh loader of `repeat` feeds the steps a stage runs (first recorded..last recorded).
inline bool feeds_stage(const ScheduleFacts& sch, size_t stage, const StagePlan& p, const std::string& files, int world,
                        int repeat) {
    try {
        dataload::TrainLoader::Options lo;
        lo.bigram_vocab = sch.bigram_vocab;
        lo.prefetch = false;
        lo.repeat = repeat;
        dataload::TrainLoader loader(files, 0, world, sch.stages[stage].batch_tokens, sch.stages[stage].max_seq_len,
                                     sch.grad_accum, lo);
        for (int st = p.first_recorded(); st <= p.last_recorded(); ++st)
            for (int i = 0; i < sch.grad_accum; ++i) loader.advance();
    } catch (const dataload::DataError&) {
        return false;
    }
    return true;
}

inline PlanData plan_data(const ScheduleFacts& sch, const PlanDataFiles& f, const ProfilerRanks& ranks) {
    PlanData data{f.train};
    if (f.train_missing.empty()) return data;
    data.files = f.fallback;
    if (!f.fallback_missing.empty())
        profiler_fail(ranks, "--plan-step: neither the preset's data nor the fallback is there: " + f.fallback_missing);
    const std::vector<StagePlan> plans = stage_plans(sch);
    for (size_t i = 0; i < plans.size(); ++i)
        while (plans[i].last_recorded() >= 0 && !feeds_stage(sch, i, plans[i], data.files, ranks.world, data.repeat))
            if (++data.repeat > 64) profiler_fail(ranks, "--plan-step: " + data.files + " cannot feed a step of this preset");
    return data;
}

// Before the model is built: the data, and the dry run starts (building does no device work, so the
// record preset plans on a CPU). The caller turns off what a plan does not do (logs, checkpoints).
inline PlanData start_plan_step(const ScheduleFacts& sch, const PlanDataFiles& f, const ProfilerRanks& ranks) {
    const PlanData data = plan_data(sch, f, ranks);
    if (ranks.rank == 0 && data.files != f.train)
        std::printf("plan-step: %s not found; batches from %s%s (sizes of the sparse exchange depend on the data)\n",
                    f.train.c_str(), data.files.c_str(),
                    data.repeat > 1 ? (", read " + std::to_string(data.repeat) + " times over as one shard").c_str() : "");
    work_recorder().start(/*dry=*/true);
    return data;
}

// ---- recording ----

// One recorded training step: the trainer's step in the dry run, its ops taken. The dry run stays on
// between recordings, so the schedule's changes (YaRN, MTP weights) do no device work either; every
// recording of the plan names a stream or event by the same index (the steady state needs it).
inline std::vector<StepOp> record_step(const PlanTrainer& t, int step) {
    WorkRecorder& rec = work_recorder();
    rec.restart(/*dry=*/true);
    t.as_in_a_run(step);
    t.train_step(step);
    std::vector<StepOp> ops = std::move(rec.ops);
    rec.restart(/*dry=*/true);
    return ops;
}

// ---- recordings between ranks: rank 0 gathers every rank's, as bytes ----
struct OpWriter {
    std::string bytes;
    template <class T>
    void put(const T& v) {
        bytes.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    void put_text(const std::string& s) {
        put(static_cast<uint32_t>(s.size()));
        bytes += s;
    }
    void put_ops(const std::vector<StepOp>& ops) {
        put(static_cast<uint32_t>(ops.size()));
        for (const StepOp& op : ops) {
            const Work& w = op.work;
            put(op.kind), put(op.stream), put(op.event), put_text(w.name ? w.name : "");
            put(w.tc_flops), put(w.flops), put(w.bytes_read), put(w.bytes_written);
            put(w.gemm), put(w.m), put(w.n), put(w.k), put(w.batch), put(w.comm), put(w.comm_bytes);
            put_text(op.range);
        }
    }
};
struct OpReader {
    const char* at;
    template <class T>
    void get(T& v) {
        std::memcpy(&v, at, sizeof v);
        at += sizeof v;
    }
    std::string get_text() {
        uint32_t n = 0;
        get(n);
        std::string s(at, n);
        at += n;
        return s;
    }
    std::vector<StepOp> get_ops() {
        uint32_t n = 0;
        get(n);
        std::vector<StepOp> ops(n);
        for (StepOp& op : ops) {
            Work& w = op.work;
            get(op.kind), get(op.stream), get(op.event);
            w.name = intern_family(get_text());  // a stable pointer for the gathered names
            get(w.tc_flops), get(w.flops), get(w.bytes_read), get(w.bytes_written);
            get(w.gemm), get(w.m), get(w.n), get(w.k), get(w.batch), get(w.comm), get(w.comm_bytes);
            op.range = get_text();
        }
        return ops;
    }
};

// Every rank's recordings on rank 0: out[k][r] is rank r's recording k (empty elsewhere). Collective.
inline std::vector<std::vector<std::vector<StepOp>>> gather_recordings(const std::vector<std::vector<StepOp>>& mine,
                                                                       const ProfilerRanks& ranks) {
    OpWriter w;
    for (const std::vector<StepOp>& ops : mine) w.put_ops(ops);
    const long long size = static_cast<long long>(w.bytes.size());
    std::vector<long long> sizes(ranks.world);
    ranks.gather(&size, sizeof size, sizes.data());
    std::vector<int> counts(ranks.world), offsets(ranks.world);
    long long total = 0;
    for (int r = 0; r < ranks.world; ++r) {
        if (sizes[r] > INT32_MAX - total) profiler_fail(ranks, "--plan-step: the recordings exceed 2 GB");
        counts[r] = static_cast<int>(sizes[r]), offsets[r] = static_cast<int>(total), total += sizes[r];
    }
    std::string all(ranks.rank == 0 ? size_t(total) : 0, '\0');
    ranks.gatherv(w.bytes.data(), static_cast<int>(size), all.data(), counts.data(), offsets.data());
    std::vector<std::vector<std::vector<StepOp>>> out(mine.size());
    if (ranks.rank != 0) return out;
    for (int r = 0; r < ranks.world; ++r) {
        OpReader in{all.data() + offsets[r]};
        for (auto& step : out) step.push_back(in.get_ops());
    }
    return out;
}

// ---- the plan ----

// What a plan prints and writes beyond its tables (the flags of --plan-step).
struct PlanOutputs {
    std::string json_path, trace_path;  // empty: none
    bool upstream = false;              // price upstream's schedule of the same work (--schedule upstream)
    int nodes = 1;                      // the ranks split evenly over this many nodes (--nodes)
    UpstreamCode upstream_code;         // where the preset's upstream code differs from record 71's
};

// Every stage's recorded steps on this rank: per stage, its even, Adam and untie step (empty where
// none), and rank 0's batch producer's CPU ms per micro-batch and the sparse plan's share (-1: none).
struct PlanRecordings {
    std::vector<std::vector<StepOp>> steps;
    std::vector<std::pair<double, double>> producer_ms;
};

inline PlanRecordings record_plan(const PlanTrainer& t, const std::vector<StagePlan>& plans, const PlanData& data) {
    PlanRecordings out;
    out.producer_ms.assign(plans.size(), {-1.0, -1.0});
    t.reset_schedule();
    for (size_t i = 0; i < plans.size(); ++i) {
        const StagePlan& p = plans[i];
        for (int kind = 0; kind < 3; ++kind) out.steps.emplace_back();
        if (p.last_recorded() < 0) continue;
        // every step from the first recorded to the last runs (the others too, unrecorded), so an
        // Adam step exchanges the rows of the even step before it, as in a run; the batches from a
        // fresh producer (each stage from the data's start), its host time kept
        t.start_batches(p.first_recorded(), p.last_recorded() + 1, data.repeat);
        for (int st = p.first_recorded(); st <= p.last_recorded(); ++st) {
            t.advance_schedule(st);
            std::vector<StepOp> ops = record_step(t, st);
            const int kind = st == p.even ? 0 : st == p.adam ? 1 : st == p.untie ? 2 : -1;
            if (kind >= 0) out.steps[3 * i + size_t(kind)] = std::move(ops);
        }
        out.producer_ms[i] = t.producer_ms();
    }
    return out;
}

// --plan-step: records every stage's steps on every rank, then rank 0 prices them with `cm` (the
// calibrated model of the ranks, placed here on out.nodes nodes) and prints the tables (and writes
// --json, --trace). Writes no log and no checkpoint.
inline void plan_step_mode(const PlanTrainer& t, const ScheduleFacts& sch, const std::string& preset,
                           const PlanData& data, const PlanOutputs& out, CostModel cm, const ProfilerRanks& ranks) {
    if (out.nodes < 1 || ranks.world % out.nodes != 0)
        profiler_fail(ranks, "--nodes " + std::to_string(out.nodes) + ": the " + std::to_string(ranks.world) +
                                 " ranks do not split evenly over that many nodes");
    cm.nodes = out.nodes;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<StagePlan> plans = stage_plans(sch);
    PlanRecordings mine;
    try {
        mine = record_plan(t, plans, data);
    } catch (const std::exception& e) {  // data errors
        profiler_fail(ranks, e.what());
    }
    work_recorder().stop();
    const double record_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<std::vector<std::vector<StepOp>>> all = gather_recordings(mine.steps, ranks);
    if (ranks.rank != 0) return;
    std::vector<PlanStage> stages;
    for (size_t i = 0; i < plans.size(); ++i) {
        const StagePlan& p = plans[i];
        if (p.end == p.first) continue;  // a stage the schedule leaves out (no extension steps)
        auto taken = [&](int step, size_t k) {  // every rank's recording k, or none for a step not recorded
            return step < 0 ? std::vector<std::vector<StepOp>>{} : std::move(all[3 * i + k]);
        };
        stages.push_back({"stage " + std::to_string(i), p.steps_even, p.steps_adam, p.steps_untie, taken(p.even, 0),
                          taken(p.adam, 1), taken(p.untie, 2)});
    }
    if (out.upstream)
        if (const std::string e = upstream_schedule_error(stages, out.upstream_code); !e.empty()) profiler_fail(ranks, e);
    const PlanReport ours = plan_report(preset, "ours", stages, cm);
    std::printf("plan-step: preset %s on %d rank(s): one step of each kind per stage recorded in a dry run in %.1f s\n",
                preset.c_str(), ranks.world, record_s);
    std::printf("plan-step: %s", calibration_summary(cm).c_str());
    const PlanReport report = out.upstream ? plan_report(preset, "upstream", upstream_schedule(stages, out.upstream_code), cm) : ours;
    std::printf("%s", format_plan(report).c_str());
    for (size_t i = 0; i < mine.producer_ms.size(); ++i)  // rank 0's, off the issuing thread
        if (mine.producer_ms[i].first >= 0)
            std::printf("stage %zu: batch producer %.3f ms of CPU time per micro-batch (%.3f ms of it the sparse "
                        "exchange's plan)\n",
                        i, mine.producer_ms[i].first, mine.producer_ms[i].second);
    if (out.upstream) std::printf("\n%s", format_schedule_comparison(ours, report, out.upstream_code).c_str());
    if (!out.json_path.empty())
        if (const std::string e = write_plan_json(out.json_path, report); !e.empty()) profiler_fail(ranks, e);
    if (!out.trace_path.empty())
        if (const std::string e = write_chrome_trace(out.trace_path, report); !e.empty()) profiler_fail(ranks, e);
    std::fflush(stdout);
}
