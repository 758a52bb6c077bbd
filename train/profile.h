// The step profiler's two modes (issue 17), on the recordings of kernels/work.cuh:
//   --plan-step          every rank records one step of each kind of each training stage in a dry run
//                        (host code, data, sparse-exchange sizes and the stream graph for real, no
//                        device work), rank 0 gathers them and prices them with train/step_model.h;
//   --profile-steps A:B  steps A..B of a real run are recorded and every op timed with CUDA events
//                        (platform.cuh's OpTimer); after each, a table per family of what it took.
// Part of train_gpt.cu's run section: included after train_step.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "../data/loader.h"
#include "../runtime/host_comm.h"
#include "step_measure.h"
#include "step_model.h"

// The step model for `world` GPUs on `nodes` nodes, with the measured rates of --calibration FILE, or
// else of the committed docs/gpu-runs/calibration.json where there is one. A bad file stops the run.
CostModel calibrated_model(const RunOptions& opt, int world, int nodes) {
    CostModel cm = h100_model(world, nodes);
    std::string path = opt.calibration;
    if (path.empty())
        if (const std::string committed = repo_dir() + "/docs/gpu-runs/calibration.json"; access(committed.c_str(), F_OK) == 0)
            path = committed;
    if (!path.empty())
        if (const std::string e = load_calibration(cm, path); !e.empty()) fail(e);
    return cm;
}

// ============================================================================================
// --plan-step
// ============================================================================================

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

std::vector<StagePlan> stage_plans(const Schedule& sch) {
    std::vector<StagePlan> plans;
    for (size_t i = 0; i < sch.starts.size(); ++i) {
        StagePlan p;
        p.first = sch.starts[i];
        p.end = sch.stage_end(i);
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

// The batches a plan reads. The preset's training data, or, when it is absent (no FineWeb on a
// laptop), the committed Tiny Shakespeare shard. Each stage's steps read from the data's start (a
// fresh loader per stage: the plan prices steps, not the run's position in its data), so a short
// shard serves every stage; a shard too short for a stage's steps (the record preset's 393,216
// tokens per micro-step on 8 ranks against Tiny Shakespeare's ~305,000) is read several times over
// as one (TrainLoader::Options::repeat): the smallest count that holds every stage's steps.
struct PlanData {
    std::string files;
    int repeat = 1;
};

// Whether a fresh loader of `repeat` feeds the steps a stage runs (first recorded..last recorded).
bool feeds_stage(const Config& c, const Schedule& sch, const StagePlan& p, const std::string& files, int world,
                 int repeat) {
    try {
        dataload::TrainLoader::Options lo;
        lo.bigram_vocab = c.bigram_vocab;
        lo.prefetch = false;
        lo.repeat = repeat;
        const int64_t batch = sch.lookup(p.first).first->batch_tokens;
        dataload::TrainLoader loader(files, 0, world, batch, c.max_seq_len, c.grad_accum(), lo);
        for (int st = p.first_recorded(); st <= p.last_recorded(); ++st)
            for (int i = 0; i < c.grad_accum(); ++i) loader.advance();
    } catch (const dataload::DataError&) {
        return false;
    }
    return true;
}

PlanData plan_data(const Config& c, const DataFiles& f, int world) {
    PlanData data{f.train};
    if (!f.train_default || shard_error("training data", f.train, true, "").empty()) return data;
    data.files = repo_dir() + "/" + tiny_preset().train_files;
    if (const std::string e = shard_error("training data", data.files, true, "python3 data/prepare_tinyshakespeare.py");
        !e.empty())
        fail("--plan-step: neither the preset's data nor the fallback is there: " + e);
    const Schedule sch(c);
    for (const StagePlan& p : stage_plans(sch))
        while (p.last_recorded() >= 0 && !feeds_stage(c, sch, p, data.files, world, data.repeat))
            if (++data.repeat > 64) fail("--plan-step: " + data.files + " cannot feed a step of this preset");
    return data;
}

// Before the model is built: the dry run starts (building does no device work, so the record preset
// plans on a CPU), and what a plan does not do is turned off (logs and checkpoints).
PlanData start_plan_step(RunOptions& opt, const Config& c, const DataFiles& f, const Distributed& d) {
    const PlanData data = plan_data(c, f, d.world);
    if (d.rank == 0 && data.files != f.train)
        std::printf("plan-step: %s not found; batches from %s%s (sizes of the sparse exchange depend on the data)\n",
                    f.train.c_str(), data.files.c_str(),
                    data.repeat > 1 ? (", read " + std::to_string(data.repeat) + " times over as one shard").c_str() : "");
    opt.train_files = data.files;
    opt.save_dir.clear();
    opt.checkpoint_steps.clear();
    opt.log_grad_norms = false;
    work_recorder().start(/*dry=*/true);
    return data;
}

// One recorded training step: train_step in the dry run, its ops taken. The dry run stays on between
// recordings, so the schedule's changes (YaRN, MTP weights) do no device work either; every recording
// of the plan names a stream or event by the same index (the steady state needs it).
std::vector<StepOp> record_step(Run& r, int step) {
    WorkRecorder& rec = work_recorder();
    rec.restart(/*dry=*/true);
    r.o.split = step > r.sch.split_step;  // embed is tied until the untie step
    // an even step's forward remakes lm_head's copies (embed too while tied) after the Adam step before it
    r.m.lm_head_fp8_stale = step % 2 == 0;
    r.m.embed_stale = step % 2 == 0 && step > 0 && step - 1 <= r.sch.split_step;
    train_step(r, step);
    std::vector<StepOp> ops = std::move(rec.ops);
    rec.restart(/*dry=*/true);
    return ops;
}

// ---- recordings between ranks: rank 0 gathers every rank's (MPI), as bytes ----
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
std::vector<std::vector<std::vector<StepOp>>> gather_recordings(const std::vector<std::vector<StepOp>>& mine,
                                                                const Distributed& d) {
    OpWriter w;
    for (const std::vector<StepOp>& ops : mine) w.put_ops(ops);
    const long long size = static_cast<long long>(w.bytes.size());
    std::vector<long long> sizes(d.world);
    host_gather(&size, sizeof size, sizes.data());
    std::vector<int> counts(d.world), offsets(d.world);
    long long total = 0;
    for (int r = 0; r < d.world; ++r) {
        if (sizes[r] > INT32_MAX - total) fail("--plan-step: the recordings exceed 2 GB");
        counts[r] = static_cast<int>(sizes[r]), offsets[r] = static_cast<int>(total), total += sizes[r];
    }
    std::string all(d.rank == 0 ? size_t(total) : 0, '\0');
    host_gatherv(w.bytes.data(), static_cast<int>(size), all.data(), counts.data(), offsets.data());
    std::vector<std::vector<std::vector<StepOp>>> out(mine.size());
    if (d.rank != 0) return out;
    for (int r = 0; r < d.world; ++r) {
        OpReader in{all.data() + offsets[r]};
        for (auto& step : out) step.push_back(in.get_ops());
    }
    return out;
}

// --plan-step: records every stage's steps on every rank, then rank 0 prices them and prints the
// tables (and writes --json, --trace). Returns the exit code; writes no log and no checkpoint.
int plan_step_mode(Run& r, const PlanData& data, const PlanOptions& plan) {
    if (r.d.world % plan.nodes != 0)
        fail("--nodes " + std::to_string(plan.nodes) + ": the " + std::to_string(r.d.world) +
             " ranks do not split evenly over that many nodes");
    const auto t0 = std::chrono::steady_clock::now();
    const Config& c = r.m.cfg;
    const std::vector<StagePlan> plans = stage_plans(r.sch);
    std::vector<std::vector<StepOp>> mine;  // per stage: even, adam, untie (empty where none)
    // per stage: the batch producer's CPU ms per micro-batch, and the sparse plan's share of it
    std::vector<std::pair<double, double>> producer_ms(plans.size(), {-1.0, -1.0});
    reset_schedule(r);
    try {
        for (const StagePlan& p : plans) {
            for (int kind = 0; kind < 3; ++kind) mine.emplace_back();
            if (p.last_recorded() < 0) continue;
            // every step from the first recorded to the last runs (the others too, unrecorded), so
            // an Adam step exchanges the rows of the even step before it, as in a run; the batches
            // from a fresh producer (each stage from the data's start), its host time kept
            start_batches(r, {step_range(p.first_recorded(), p.last_recorded() + 1), p.first_recorded()}, data.repeat);
            for (int st = p.first_recorded(); st <= p.last_recorded(); ++st) {
                advance_schedule(r, st);
                std::vector<StepOp> ops = record_step(r, st);
                const int kind = st == p.even ? 0 : st == p.adam ? 1 : st == p.untie ? 2 : -1;
                if (kind >= 0) mine[mine.size() - 3 + kind] = std::move(ops);
            }
            producer_ms[mine.size() / 3 - 1] = {r.batches->ms_per_batch(), r.batches->sparse_ms_per_batch()};
        }
    } catch (const std::exception& e) {  // data errors
        fail(e.what());
    }
    work_recorder().stop();
    const double record_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<std::vector<std::vector<StepOp>>> all = gather_recordings(mine, r.d);
    if (r.d.rank == 0) {
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
        const CostModel cm = calibrated_model(r.opt, r.d.world, plan.nodes);
        const PlanReport ours = plan_report(c.name, "ours", stages, cm);
        std::printf("plan-step: preset %s on %d rank(s): one step of each kind per stage recorded in a dry run in %.1f s\n",
                    c.name.c_str(), r.d.world, record_s);
        std::printf("plan-step: %s", calibration_summary(cm).c_str());
        const PlanReport report = plan.upstream ? plan_report(c.name, "upstream", upstream_schedule(stages), cm) : ours;
        std::printf("%s", format_plan(report).c_str());
        for (size_t i = 0; i < producer_ms.size(); ++i)  // rank 0's, off the issuing thread (train/batch_producer.h)
            if (producer_ms[i].first >= 0)
                std::printf("stage %zu: batch producer %.3f ms of CPU time per micro-batch (%.3f ms of it the sparse "
                        "exchange's plan)\n",
                        i, producer_ms[i].first, producer_ms[i].second);
        if (plan.upstream) std::printf("\n%s", format_schedule_comparison(ours, report).c_str());
        if (!plan.json_path.empty())
            if (const std::string e = write_plan_json(plan.json_path, report); !e.empty()) fail(e);
        if (!plan.trace_path.empty())
            if (const std::string e = write_chrome_trace(plan.trace_path, report); !e.empty()) fail(e);
        std::fflush(stdout);
    }
    stop_distributed(r.d);
    return 0;
}

// ============================================================================================
// --profile-steps
// ============================================================================================

// Milliseconds from `origin` to e (both recorded and complete).
double event_ms(cudaEvent_t origin, cudaEvent_t e) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, origin, e));
    return ms;
}

// The step just recorded and timed, its times read from the events (after a sync).
TimedStep timed_step() {
    TimedStep t{work_recorder().ops, {}, {}, {}};
    t.start_ms.assign(t.ops.size(), -1);
    t.end_ms.assign(t.ops.size(), -1);
    t.share.assign(t.ops.size(), 1);
    const std::vector<OpTimer::Span>& spans = op_timer().spans;
    for (const OpTimer::Span& s : spans) {
        t.start_ms[s.op] = event_ms(spans.front().start, s.start);
        t.end_ms[s.op] = event_ms(spans.front().start, s.end);
        t.share[s.op] = s.share;
    }
    return t;
}

// What a warm-up step is, for its profile's header: its stage, kind, batch, windows and tying, as
// the step runs them (so that a profile is known to stand for that stage's steps).
std::string warmup_step_label(const Run& r, int step) {
    size_t stage = 0;
    while (stage + 1 < r.sch.starts.size() && step >= r.sch.starts[stage + 1]) ++stage;
    const char* kind = step == r.sch.split_step ? "untie" : step % 2 == 1 ? "adam" : "even";
    char text[256];
    std::snprintf(text, sizeof text, "warm-up: stage %zu %s step, batch %lld tokens, windows %d/%d blocks, embed %s; ",
                  stage, kind, static_cast<long long>(r.state.batch_tokens), r.state.ws_short, r.state.ws_long,
                  r.o.split ? "untied" : "tied");
    return text;
}

// The step model's price of the recording just timed (the same ops, alone: a profiled step starts on
// an idle device and ends when its last op does), per family beside the measured time, and the ratio.
void report_model_of_step(Run& r, int step, const TimedStep& t, double step_ms, const std::vector<MeasuredFamily>& measured) {
    const CostModel cm = calibrated_model(r.opt, r.d.world, 1);
    const ModeledStep m = model_step("step " + std::to_string(step), {{t.ops}}, 0, cm);
    print0(r, "model of step %d (train/step_model.h on this recording, alone, %d H100%s; %s): device %.3f ms, measured "
              "%.3f ms, measured/model %.3f\n",
           step, r.d.world, r.d.world == 1 ? "" : "s",
           cm.measured.empty() ? "no rate measured" : ("rates from " + cm.calibration_file).c_str(), m.ms, step_ms,
           step_ms / std::max(m.ms, 1e-9));
    for (const MeasuredFamily& f : measured) {
        double model_ms = 0;
        for (const FamilyRow& k : m.kernels)
            if (k.name == f.name) model_ms = k.ms;
        for (const CollectiveRow& c : m.collectives)
            if (c.name == f.name) model_ms = c.ms;
        print0(r, "vs model %-34s %10.3f ms measured %10.3f ms model %8.3f\n", f.name.c_str(), f.ms, model_ms,
               f.ms / std::max(model_ms, 1e-9));
    }
}

// The table of a profiled step (rank 0's), then one line: device time, host time, exposed comms, wall
// time; then the model's price of the same recording.
void report_profiled_step(Run& r, int step, double host_ms, double wall_ms, const std::string& label) {
    const TimedStep t = timed_step();
    const double step_ms = device_ms(t);
    const CostModel peak = h100_model(r.d.world);
    print0(r, "profile of step %d (%srank 0 of %d%s; its train_time includes this profile's events, sync and report)\n",
           step, label.c_str(), r.d.world, kEmulated ? "; times are the CPU emulation's, not a GPU's" : "");
    print0(r, "%-34s %6s %10s %7s %9s %8s %8s %8s\n", "family", "count", "total ms", "share", "TFLOP/s", "of peak", "TB/s",
           "of HBM");
    const std::vector<MeasuredFamily> families = measured_families(t);
    for (const MeasuredFamily& f : families) {
        const double s = std::max(f.ms, 1e-9) / 1e3;
        const double tflops = f.flops / s / 1e12, tbs = f.bytes / s / 1e12;
        const double tc_peak = f.fp8 ? peak.fp8_tflops : peak.bf16_tflops;
        char compute[32] = "-", memory[32] = "-";
        if (f.tc_flops > 0) std::snprintf(compute, sizeof compute, "%.1f%%", 100 * f.tc_flops / s / 1e12 / tc_peak);
        if (!f.collective) std::snprintf(memory, sizeof memory, "%.1f%%", 100 * tbs / peak.hbm_tbs);
        print0(r, "%-34s %6d %10.3f %6.1f%% %9.4g %8s %8.4g %8s\n", f.name.c_str(), f.count, f.ms,
               100 * f.ms / std::max(step_ms, 1e-9), tflops, compute, tbs, memory);
    }
    print0(r, "step %d: %zu ops, device %.3f ms (first op's start to last op's end), host %.3f ms enqueueing (%.3f ms of it "
              "in host waits), exposed communication %.3f ms, then %.3f ms of other streams' work (the gathers a run "
              "overlaps with the next forward, which a profiled step has not); wall %.3f ms (from its first enqueue to "
              "the device's end, the profile's events included)\n",
           step, op_timer().spans.size(), step_ms, host_ms, op_timer().host_wait_ms, exposed_comm_ms(t),
           tail_after_stream0_ms(t), wall_ms);
    report_model_of_step(r, step, t, step_ms, families);
}

// Steps train_step as it is, but recorded (not dry) and every op timed; the device is synchronized
// after it (outside the timed window) to read the times. label: what the header says the step is.
void profiled_train_step(Run& r, int step, const std::string& label) {
    work_recorder().start(/*dry=*/false);
    op_timer().start();
    const auto t0 = std::chrono::steady_clock::now();
    train_step(r, step);
    const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    op_timer().stop();
    work_recorder().stop();
    CUDA_CHECK(sync_device("profile_read"));
    const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    report_profiled_step(r, step, host_ms, wall_ms, label);
}

// A training step of the run: as it is, or, within --profile-steps, profiled.
void run_train_step(Run& r, int step) {
    if (!r.opt.profile_steps.contains(step)) return train_step(r, step);
    profiled_train_step(r, step, "");
}

// A step of the warm-up: as it is, or, with --profile-warmup, profiled and labelled with its stage.
void warm_up_step(Run& r, int step) {
    if (!r.opt.profile_warmup) return train_step(r, step);
    profiled_train_step(r, step, warmup_step_label(r, step));
}
