// The step profiler's record format: what each operation of a step does, as the launchers describe it
// (kernels/platform.cuh's launch() and recording helpers take one). Every launcher, GEMM, copy and
// collective describes its work in a `Work`: FLOPs, global-memory bytes and collective bytes, computed
// on the host from the launcher's arguments. While a recording is on, the descriptions and the
// stream/event graph between them (event records and waits, host waits) are kept in issue order, one
// `StepOp` each. In a dry run the operations are recorded and not executed: the host code, the
// data-dependent sizes and the stream graph run for real, the device does nothing. Nothing here runs
// in a kernel, and nothing is kept while no recording is on. Host C++ and the standard library only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

enum class OpKind : uint8_t { kernel, gemm, copy, memset, collective, event_record, event_wait, host_sync };
enum class Comm : uint8_t { none, all_reduce, reduce_scatter, all_gather, broadcast, send_recv, reduce };
enum class GemmType : uint8_t { none, bf16, fp8 };

struct Work {
    const char* name = "";        // the family: the launcher's name, e.g. "rmsnorm_forward"
    double tc_flops = 0;          // tensor-core FLOPs, 2 per multiply-add
    double flops = 0;             // other arithmetic (CUDA cores, SFU)
    double bytes_read = 0;        // global memory each launch must read (every byte once)
    double bytes_written = 0;     // and write
    GemmType gemm = GemmType::none;  // GEMMs: cuBLASLt's problem shape, for a shape-dependent throughput
    int m = 0, n = 0, k = 0, batch = 1;
    Comm comm = Comm::none;       // collectives: the kind and the bytes of the per-rank buffer as NCCL
    double comm_bytes = 0;        // counts them (all-gather: the gathered output; reduce-scatter: the input;
                                  // reduce: the buffer reduced onto its root)
};

struct StepOp {
    OpKind kind;
    int stream;    // the stream's index in this recording, in order of first appearance; -1: host
    int event;     // event_record / event_wait: the event's index in this recording, else -1
    Work work;
    std::string range;  // the innermost open range ("forward/layer 3"), for traces and NVTX
};

// One process records at most one thing at a time; launches come from the main thread only.
struct WorkRecorder {
    bool on = false;       // keep StepOps
    bool dry_run = false;  // and do not execute them
    std::vector<StepOp> ops;
    std::vector<const void*> streams, events;  // index -> handle, in order of first appearance
    std::vector<std::string> ranges;           // the open ranges, outermost first

    static int index_of(std::vector<const void*>& seen, const void* h) {
        for (size_t i = 0; i < seen.size(); ++i)
            if (seen[i] == h) return static_cast<int>(i);
        seen.push_back(h);
        return static_cast<int>(seen.size()) - 1;
    }
    int stream_index(const void* stream) { return index_of(streams, stream); }  // the null stream too
    int event_index(const void* event) { return index_of(events, event); }

    void start(bool dry) {
        *this = WorkRecorder();
        on = true;
        dry_run = dry;
    }
    // A new recording that keeps the handles' indexes: steps recorded one after another name each
    // stream and event alike (the step model's steady state resolves events across them).
    void restart(bool dry) {
        ops.clear();
        ranges.clear();
        on = true;
        dry_run = dry;
    }
    void stop() { on = dry_run = false; }
    // stream: stream_index(handle), or -1 for a wait on the whole device; event: event_index(handle) or -1.
    void add(OpKind kind, int stream, int event, const Work& w) {
        if (!on) return;
        StepOp op{kind, stream, event, w, {}};
        for (size_t i = 0; i < ranges.size(); ++i) op.range += (i ? "/" : "") + ranges[i];
        ops.push_back(std::move(op));
    }
};

inline WorkRecorder& work_recorder() {
    static WorkRecorder r;
    return r;
}
// True when operations are to be recorded and not executed.
inline bool dry_running() { return work_recorder().dry_run; }
