// What --profile-steps makes of a timed recording (profiler/profile_steps.h reads the times from CUDA events):
// per family, the measured time and work, and the communication the compute stream waited for.
// Host C++17 only (profiler/work.h and the standard library), so it is tested on hand-made times.
#pragma once
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "work.h"

// One timed recording: ops[i] ran on the device from start_ms[i] to end_ms[i] (-1: not timed: event
// ops, host waits), of which share[i] is its own (a collective of an NCCL group of n: 1/n).
struct TimedStep {
    std::vector<StepOp> ops;
    std::vector<double> start_ms, end_ms, share;
};

// One family's timed ops.
struct MeasuredFamily {
    std::string name;
    int count = 0;
    double ms = 0, tc_flops = 0, flops = 0, bytes = 0;  // flops: tensor-core and other; collectives: comm bytes
    bool fp8 = false, collective = false;
};

// Per family (Work.name), the slowest first.
inline std::vector<MeasuredFamily> measured_families(const TimedStep& t) {
    std::vector<MeasuredFamily> families;
    for (size_t i = 0; i < t.ops.size(); ++i) {
        if (t.start_ms[i] < 0) continue;
        const StepOp& op = t.ops[i];
        auto f = std::find_if(families.begin(), families.end(),
                              [&](const MeasuredFamily& m) { return m.name == op.work.name; });
        if (f == families.end()) f = families.insert(families.end(), MeasuredFamily{op.work.name});
        ++f->count;
        f->ms += (t.end_ms[i] - t.start_ms[i]) * t.share[i];
        f->tc_flops += op.work.tc_flops;
        f->flops += op.work.tc_flops + op.work.flops;
        f->bytes += op.kind == OpKind::collective ? op.work.comm_bytes : op.work.bytes_read + op.work.bytes_written;
        f->fp8 = f->fp8 || op.work.gemm == GemmType::fp8;
        f->collective = op.kind == OpKind::collective;
    }
    std::stable_sort(families.begin(), families.end(),
                     [](const MeasuredFamily& a, const MeasuredFamily& b) { return a.ms > b.ms; });
    return families;
}

// From the first timed op's start to the last one's end.
inline double device_ms(const TimedStep& t) {
    double first = -1, last = 0;
    for (size_t i = 0; i < t.ops.size(); ++i)
        if (t.start_ms[i] >= 0) {
            first = first < 0 ? t.start_ms[i] : std::min(first, t.start_ms[i]);
            last = std::max(last, t.end_ms[i]);
        }
    return first < 0 ? 0 : last - first;
}

// The time stream 0 sat idle waiting for another stream's work: in each gap between consecutive timed
// ops of stream 0, the part before the latest event it waited on there (recorded on another stream)
// completed; an event completes when the last timed op before its record on that stream ends. Plus
// every collective on stream 0, whole.
inline double exposed_comm_ms(const TimedStep& t) {
    std::map<int, double> last_end;     // stream -> end of its last timed op so far
    std::map<int, double> event_ready;  // event -> when its latest record completed (records off stream 0)
    double exposed = 0, gap_from = -1, waited = -1;
    for (size_t i = 0; i < t.ops.size(); ++i) {
        const StepOp& op = t.ops[i];
        if (op.kind == OpKind::event_record) {
            const auto it = last_end.find(op.stream);
            if (op.stream != 0 && it != last_end.end()) event_ready[op.event] = it->second;
            else event_ready.erase(op.event);
        } else if (op.kind == OpKind::event_wait) {
            if (op.stream != 0) continue;
            if (const auto it = event_ready.find(op.event); it != event_ready.end()) waited = std::max(waited, it->second);
        } else if (t.start_ms[i] >= 0) {
            if (op.stream == 0) {
                if (op.kind == OpKind::collective) exposed += t.end_ms[i] - t.start_ms[i];
                if (gap_from >= 0 && waited > gap_from) exposed += std::min(waited, t.start_ms[i]) - gap_from;
                gap_from = t.end_ms[i];
                waited = -1;
            }
            last_end[op.stream] = std::max(last_end[op.stream], t.end_ms[i]);
        }
    }
    return exposed;
}

// The device time after stream 0's last timed op: other streams' work still running, the gathers a
// step leaves for the next forward to wait on (a profiled step runs alone, so they end it here).
inline double tail_after_stream0_ms(const TimedStep& t) {
    double stream0 = -1, last = -1;
    for (size_t i = 0; i < t.ops.size(); ++i)
        if (t.start_ms[i] >= 0) {
            last = std::max(last, t.end_ms[i]);
            if (t.ops[i].stream == 0) stream0 = std::max(stream0, t.end_ms[i]);
        }
    return stream0 < 0 ? 0 : last - stream0;
}
