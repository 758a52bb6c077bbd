// --profile-steps' op timer: a recording that is timed. While the timer is on (with a recording that
// is not a dry run), every op kernels/platform.cuh's record_op records lies between two CUDA events on
// its stream, a start event recorded just before the op is enqueued and an end event just after. The
// recording helpers there end their op at once; an op its caller enqueues after record_op returns (a
// cuBLASLt call, a send/recv round) is ended by the next helper call or by OpTimer::stop: nothing is
// enqueued on its stream in between, so the end event still marks its completion (unless the host
// dawdles while that stream is idle, which a step does not do between a GEMM and the next launch). The
// events come from a pool that grows to a step's op count once and is reused; nothing waits for them
// until the step is read (profiler/profile_steps.h). Host code on the CUDA runtime API (emu provides
// it in the CPU build).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

struct OpTimer {
    struct Span {
        size_t op;  // index in work_recorder().ops
        cudaEvent_t start, end;
        cudaStream_t stream;
        double share = 1;  // of (end - start): 1 / n for each of n collectives issued as one NCCL group
    };
    bool on = false;
    std::vector<Span> spans;
    double host_wait_ms = 0;  // host time spent in the CUDA host waits (sync_*) while on

    void start() {
        on = true;
        spans.clear();
        used_ = 0;
        host_wait_ms = 0;
    }
    void stop() {
        end_open();
        on = false;
    }
    // The op just recorded starts on `stream`.
    void begin(size_t op, cudaStream_t stream) {
        end_open();
        spans.push_back({op, next_event(), next_event(), stream});
        check(cudaEventRecord(spans.back().start, stream));
        open_ = !grouping_;
    }
    // The last op begun has been enqueued.
    void end_open() {
        if (!open_) return;
        check(cudaEventRecord(spans.back().end, spans.back().stream));
        open_ = false;
    }
    // Collectives issued between ncclGroupStart and ncclGroupEnd run as one when the group ends: each
    // ends there and is charged its share of the group's time.
    void begin_group() {
        end_open();
        grouping_ = true;
        group_from_ = spans.size();
    }
    void end_group() {
        grouping_ = false;
        const size_t n = spans.size() - group_from_;
        for (size_t i = group_from_; i < spans.size(); ++i) {
            check(cudaEventRecord(spans[i].end, spans[i].stream));
            spans[i].share = 1.0 / static_cast<double>(n);
        }
    }

private:
    std::vector<cudaEvent_t> pool_;
    size_t used_ = 0, group_from_ = 0;
    bool open_ = false, grouping_ = false;
    cudaEvent_t next_event() {
        if (used_ == pool_.size()) {
            pool_.emplace_back();
            check(cudaEventCreate(&pool_.back()));
        }
        return pool_[used_++];
    }
    static void check(cudaError_t e) {
        if (e == cudaSuccess) return;
        std::fprintf(stderr, "step profiler: %s\n", cudaGetErrorString(e));
        std::exit(EXIT_FAILURE);
    }
};
inline OpTimer& op_timer() {
    static OpTimer t;
    return t;
}
