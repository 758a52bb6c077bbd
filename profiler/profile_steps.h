// --profile-steps A:B and --profile-warmup: a profiled training step is recorded (not dry) and every
// op timed with CUDA events (profiler/op_timer.h); after the step the device is synchronized (outside
// the timed window) to read the times, and rank 0 prints a table per family of what it took
// (profiler/step_measure.h), then the step model's price of the same recording. The trainer runs the
// profiler through its step hooks: before and after each training step, whichever code runs it.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/common.cuh"
#include "../kernels/platform.cuh"
#include "cost_model.h"
#include "op_timer.h"
#include "replay.h"
#include "schedule_facts.h"
#include "step_measure.h"
#include "work.h"

// What runs around a training step (the trainer calls them first and last in its step): the
// profiler's, where a run profiles; empty in a plain run.
struct StepHooks {
    std::function<void(int step)> before, after;
};

// What a profiled step reports with: the rank count, the model it is priced by (calibrated, for `world`
// GPUs on one node) and rank 0's log (the console and the log file; the other ranks print nothing).
struct ProfiledRun {
    int world = 1;
    CostModel model;
    std::function<void(const std::string&)> print;
};

// The schedule's state a step runs with (as advance_schedule left it), and whether embed is tied.
struct StepState {
    long long batch_tokens = 0;
    int ws_short = 0, ws_long = 0;  // blocks
    bool tied = true;
};
// What a warm-up step is, for its profile's header: its stage, kind, batch, windows and tying, as the
// step runs them (so that a profile is known to stand for that stage's steps).
inline std::string warmup_step_label(const ScheduleFacts& sch, int step, const StepState& s) {
    size_t stage = 0;
    while (stage + 1 < sch.stages.size() && step >= sch.stages[stage + 1].first) ++stage;
    const char* kind = step == sch.split_step ? "untie" : step % 2 == 1 ? "adam" : "even";
    char text[256];
    std::snprintf(text, sizeof text, "warm-up: stage %zu %s step, batch %lld tokens, windows %d/%d blocks, embed %s; ",
                  stage, kind, s.batch_tokens, s.ws_short, s.ws_long, s.tied ? "tied" : "untied");
    return text;
}

// One of rank 0's lines (print0's shape: printf's format, any length).
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline void print_line(const ProfiledRun& run, const char* fmt, ...) {
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = std::max(std::vsnprintf(nullptr, 0, fmt, ap), 0);
    va_end(ap);
    std::string line(size_t(n) + 1, '\0');
    std::vsnprintf(line.data(), line.size(), fmt, again);
    va_end(again);
    line.pop_back();
    run.print(line);
}

// Milliseconds from `origin` to e (both recorded and complete).
inline double event_ms(cudaEvent_t origin, cudaEvent_t e) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, origin, e));
    return ms;
}

// The step just recorded and timed, its times read from the events (after a sync).
inline TimedStep timed_step() {
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

// The step model's price of the recording just timed (the same ops, alone: a profiled step starts on
// an idle device and ends when its last op does), per family beside the measured time, and the ratio.
inline void report_model_of_step(const ProfiledRun& run, int step, const TimedStep& t, double step_ms,
                                 const std::vector<MeasuredFamily>& measured) {
    const CostModel& cm = run.model;
    const ModeledStep m = model_step("step " + std::to_string(step), {{t.ops}}, 0, cm);
    print_line(run,
               "model of step %d (profiler/replay.h on this recording, alone, %d H100%s; %s): device %.3f ms, "
               "measured %.3f ms, measured/model %.3f\n",
               step, run.world, run.world == 1 ? "" : "s",
               cm.measured.empty() ? "no rate measured" : ("rates from " + cm.calibration_file).c_str(), m.ms, step_ms,
               step_ms / std::max(m.ms, 1e-9));
    for (const MeasuredFamily& f : measured) {
        double model_ms = 0;
        for (const FamilyRow& k : m.kernels)
            if (k.name == f.name) model_ms = k.ms;
        for (const CollectiveRow& c : m.collectives)
            if (c.name == f.name) model_ms = c.ms;
        print_line(run, "vs model %-34s %10.3f ms measured %10.3f ms model %8.3f\n", f.name.c_str(), f.ms, model_ms,
                   f.ms / std::max(model_ms, 1e-9));
    }
}

// The table of a profiled step (rank 0's), then one line: device time, host time, exposed comms, wall
// time; then the model's price of the same recording.
inline void report_profiled_step(const ProfiledRun& run, int step, double host_ms, double wall_ms,
                                 const std::string& label) {
    const TimedStep t = timed_step();
    const double step_ms = device_ms(t);
    const CostModel peak = h100_model(run.world);
    print_line(run, "profile of step %d (%srank 0 of %d%s; its train_time includes this profile's events, sync and "
                    "report)\n",
               step, label.c_str(), run.world, kEmulated ? "; times are the CPU emulation's, not a GPU's" : "");
    print_line(run, "%-34s %6s %10s %7s %9s %8s %8s %8s\n", "family", "count", "total ms", "share", "TFLOP/s",
               "of peak", "TB/s", "of HBM");
    const std::vector<MeasuredFamily> families = measured_families(t);
    for (const MeasuredFamily& f : families) {
        const double s = std::max(f.ms, 1e-9) / 1e3;
        const double tflops = f.flops / s / 1e12, tbs = f.bytes / s / 1e12;
        const double tc_peak = f.fp8 ? peak.fp8_tflops : peak.bf16_tflops;
        char compute[32] = "-", memory[32] = "-";
        if (f.tc_flops > 0) std::snprintf(compute, sizeof compute, "%.1f%%", 100 * f.tc_flops / s / 1e12 / tc_peak);
        if (!f.collective) std::snprintf(memory, sizeof memory, "%.1f%%", 100 * tbs / peak.hbm_tbs);
        print_line(run, "%-34s %6d %10.3f %6.1f%% %9.4g %8s %8.4g %8s\n", f.name.c_str(), f.count, f.ms,
                   100 * f.ms / std::max(step_ms, 1e-9), tflops, compute, tbs, memory);
    }
    print_line(run,
               "step %d: %zu ops, device %.3f ms (first op's start to last op's end), host %.3f ms enqueueing (%.3f ms "
               "of it in host waits), exposed communication %.3f ms, then %.3f ms of other streams' work (the gathers "
               "a run overlaps with the next forward, which a profiled step has not); wall %.3f ms (from its first "
               "enqueue to the device's end, the profile's events included)\n",
               step, op_timer().spans.size(), step_ms, host_ms, op_timer().host_wait_ms, exposed_comm_ms(t),
               tail_after_stream0_ms(t), wall_ms);
    report_model_of_step(run, step, t, step_ms, families);
}

// Hooks that profile the steps `profiled` says: each such step is recorded (not dry) and every op timed
// from before its first enqueue to after its last; the device is then synchronized (outside the timed
// window) to read the times, and the step's tables are printed, headed by label(step).
inline StepHooks step_profile_hooks(ProfiledRun run, std::function<bool(int step)> profiled,
                                    std::function<std::string(int step)> label) {
    using clock = std::chrono::steady_clock;
    struct Open {  // the step being profiled
        clock::time_point t0;
        std::string label;  // taken before the step: the step changes what it describes (the untie)
    };
    const auto open = std::make_shared<Open>();
    const auto shared = std::make_shared<ProfiledRun>(std::move(run));
    StepHooks hooks;
    hooks.before = [=](int step) {
        if (!profiled(step)) return;
        open->label = label ? label(step) : "";
        work_recorder().start(/*dry=*/false);
        op_timer().start();
        open->t0 = clock::now();
    };
    hooks.after = [=](int step) {
        if (!profiled(step)) return;
        const double host_ms = std::chrono::duration<double, std::milli>(clock::now() - open->t0).count();
        op_timer().stop();
        work_recorder().stop();
        CUDA_CHECK(sync_device("profile_read"));
        const double wall_ms = std::chrono::duration<double, std::milli>(clock::now() - open->t0).count();
        report_profiled_step(*shared, step, host_ms, wall_ms, open->label);
    };
    return hooks;
}
