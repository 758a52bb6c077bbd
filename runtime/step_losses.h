// The training loss of each step, read by the host only where it needs it. Each micro-step's loss
// is copied asynchronously (4 bytes) into a pinned slot of a ring of per-step rows, and an event
// is recorded after a step's last copy. The host sums a step's row (in double, as it always has,
// so the printed losses keep their bits) when the step prints it (--log-train-loss: at the next
// step, after a wait for that step's last forward only) and checks every row for a NaN or an
// infinity: every step polls the rows whose events have completed (cudaEventQuery, no wait), and
// the steps that validate, save or end wait for all of them. A row is checked before its slot
// is reused; kSteps rows are far more than the device can lag behind the host (the batch ring holds
// it to a few micro-steps), so that check finds its event complete.
#pragma once
#include <cstddef>

#include "../kernels/common.cuh"

struct StepLosses {
    static constexpr int kSteps = 8;
    float* pinned = nullptr;  // kSteps rows of grad_accum losses
    int grad_accum = 1;
    cudaEvent_t ready[kSteps] = {};
    int checked = 0;  // the steps before it have been checked (their slots are free)
    int first = 0;    // the first step this run makes: a resumed run has no loss of the steps before it

    void allocate(int accum) {
        grad_accum = accum;
        CUDA_CHECK(cudaMallocHost(&pinned, size_t(kSteps) * accum * sizeof(float)));
        for (cudaEvent_t& e : ready) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    void release() {
        CUDA_CHECK(cudaFreeHost(pinned));
        for (cudaEvent_t e : ready) CUDA_CHECK(cudaEventDestroy(e));
    }
    float* row(int step) { return pinned + size_t(step % kSteps) * grad_accum; }

    // Micro-step `micro`'s loss (device) into the step's row, on s; the step's event after its last.
    void copy(int step, int micro, const float* loss, cudaStream_t s) {
        CUDA_CHECK(copy_async(row(step) + micro, loss, sizeof(float), cudaMemcpyDeviceToHost, s));
        if (micro == grad_accum - 1) CUDA_CHECK(record_event(ready[step % kSteps], s));
    }
    // Whether step `step`'s losses have landed on the host: waits for them when `wait`, else only
    // polls (no wait; a pending event is not an error a later check may see).
    bool landed(int step, bool wait) {
        cudaEvent_t e = ready[step % kSteps];
        if (!wait && cudaEventQuery(e) == cudaErrorNotReady) {
            (void)cudaGetLastError();
            return false;
        }
        CUDA_CHECK(sync_event(e, "step_losses"));  // returns at once where the query found it complete
        return true;
    }
    // The sum of a step's micro-step losses on this rank (its event complete).
    double sum(int step) {
        double total = 0;
        for (int i = 0; i < grad_accum; ++i) total += row(step)[i];
        return total;
    }
};
