// Non-finite scans (and the gradient norms log, which reads gradients the same way): whether parameters, gradients or optimizer state hold a NaN or an infinity,
// read on the bits (an all-ones exponent). The CPU build scans on the host after every step to name
// where the first one appeared; every build runs the device-side check at each validation, before
// each save and every --check-finite N steps; the training losses as they land. Part of train_gpt.cu's
// run section: included after its Run.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "host_comm.h"

// A group's whole parameter or gradient, as floats on the host (failure reports and logs only), read
// on stream s (the stream that wrote it).
std::vector<float> host_values(const OptimGroup& q, const void* device, cudaStream_t s) {
    const size_t n = size_t(q.t.rows * q.t.row_elems);
    std::vector<float> v(n);
    if (q.t.fp32) {
        CUDA_CHECK(copy_async(v.data(), device, n * 4, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(sync_stream(s, "host_values"));
    } else {
        std::vector<bf16> h(n);
        CUDA_CHECK(copy_async(h.data(), device, n * 2, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(sync_stream(s, "host_values"));
        for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(h[i]);
    }
    return v;
}

// Whether a group's parameter or gradient holds a NaN or an infinity: all-ones exponents, read in
// chunks without conversion (the CPU build checks every group after every step).
bool has_nonfinite(const OptimGroup& q, const void* device) {
    const size_t bytes = size_t(q.t.rows * q.t.row_elems) * (q.t.fp32 ? 4 : 2);
    std::vector<uint32_t> chunk((std::min(bytes, size_t(1) << 22) + 3) / 4);
    for (size_t done = 0; done < bytes; done += chunk.size() * 4) {
        const size_t n = std::min(chunk.size() * 4, bytes - done);
        chunk[(n - 1) / 4] = 0;  // an odd bf16 count leaves half a word: zeros are finite
        CUDA_CHECK(cudaMemcpy(chunk.data(), static_cast<const char*>(device) + done, n, cudaMemcpyDeviceToHost));
        const uint32_t exponents = q.t.fp32 ? 0x7f800000u : 0x7f807f80u;
        for (size_t i = 0; i < (n + 3) / 4; ++i) {
            const uint32_t e = chunk[i] & exponents;
            if (q.t.fp32 ? e == exponents : (e & 0x7f80u) == 0x7f80u || (e >> 16) == 0x7f80u) return true;
        }
    }
    return false;
}

// The first parameter group (table order) holding a non-finite parameter or gradient, or "".
std::string nonfinite_group(Run& r) {
    for (const OptimGroup& q : r.o.group)
        for (const auto& [what, ptr] : {std::pair{"parameter", q.t.param}, std::pair{"gradient", q.t.grad}})
            if (has_nonfinite(q, ptr)) return std::string(what) + " " + q.rule->label;
    return "";
}

// The CPU build scans every step, so a failure names where the first non-finite value appeared
// (a GPU run cannot afford the copies; it only stops).
void watch_nonfinite(Run& r, int step) {
    if (!kEmulated || !r.first_nonfinite.empty()) return;
    await_all_gathered(r.m.gathered, r.s);  // the scan reads every rank's rows
    if (const std::string g = nonfinite_group(r); !g.empty())
        r.first_nonfinite = g + " (non-finite before step " + std::to_string(step) + ")";
}

// A float buffer the finite check covers, named as in the checkpoint.
struct StateBuffer {
    std::string name;
    const void* data;
    int64_t n;
    bool fp32;
};

// This rank's parameters and optimizer state by group, in table order: what a checkpoint holds
// (the Adam gradients only while they are state: after an even step). NorMuon's mantissa is
// integer bits, not a float.
std::vector<StateBuffer> state_buffers(const Run& r, int step) {
    std::vector<StateBuffer> out;
    for (const OptimGroup& q : r.o.group) {
        const std::string label = q.rule->label;
        const int64_t full = q.t.rows * q.t.row_elems;
        out.push_back({"param." + label, q.t.param, full, q.t.fp32});
        for (const StateTensor& t : q.state)
            if (t.dtype == DType::f32) out.push_back({t.name + ("." + label), t.data, t.elems(), true});
        if (q.rule->optim == Optim::adam && step % 2 == 1) out.push_back({"grad." + label, q.t.grad, full, q.t.fp32});
    }
    return out;
}
constexpr int kMaxStateBuffers = 4 * kParamGroups;

// The device-side finite check of every rank's parameters and optimizer state (kernels/finite.cuh,
// one launch per buffer, one copy of the flags back): where the first non-finite value is, as "exp_avg.scalars on
// rank 1" (table order, then rank), or "" when all are finite. Collective.
std::string nonfinite_state(Run& r, int step) {
    await_all_gathered(r.m.gathered, r.s);
    const std::vector<StateBuffer> bufs = state_buffers(r, step);
    if (bufs.size() > size_t(kMaxStateBuffers))  // a group registered more float state than the flags hold
        fail("the finite check covers " + std::to_string(bufs.size()) + " buffers; raise kMaxStateBuffers (" +
             std::to_string(kMaxStateBuffers) + ")");
    CUDA_CHECK(memset_async(r.finite_flags, 0, kMaxStateBuffers * sizeof(int), r.s));
    for (size_t i = 0; i < bufs.size(); ++i)
        flag_nonfinite(bufs[i].data, bufs[i].n, bufs[i].fp32, r.finite_flags + i, r.s);
    CUDA_CHECK_LAUNCH();
    int flags[kMaxStateBuffers];
    CUDA_CHECK(copy_async(flags, r.finite_flags, sizeof flags, cudaMemcpyDeviceToHost, r.s));
    CUDA_CHECK(sync_stream(r.s, "finite_flags"));
    int mine = INT32_MAX;  // buffer index * world + rank of the first bad buffer
    for (size_t i = 0; i < bufs.size() && mine == INT32_MAX; ++i)
        if (flags[i]) mine = int(i) * r.d.world + r.d.rank;
    const int first = host_min(mine);
    if (first == INT32_MAX) return "";
    return bufs[size_t(first / r.d.world)].name + " on rank " + std::to_string(first % r.d.world);
}

// Stops the run when a parameter or optimizer state holds a NaN or an infinity (at `step`, `when`).
void check_finite(Run& r, int step, const char* when) {
    if (const std::string where = nonfinite_state(r, step); !where.empty())
        fail("non-finite values in " + where + " at step " + std::to_string(step) + " (" + when + ")");
}

// Rank 0's gradient norms (its own micro-steps, before any reduction or tying), one line.
void log_grad_norms(Run& r, int step) {
    std::string line;
    for (const OptimGroup& q : r.o.group) {
        double sum = 0;
        for (float x : host_values(q, q.t.grad, r.s)) sum += double(x) * x;
        char item[96];
        std::snprintf(item, sizeof item, " %s:%.6e", q.rule->label, std::sqrt(sum));
        line += item;
    }
    print0(r, "step:%d/%d grad_norms%s\n", step + 1, r.sch.total_steps, line.c_str());
}

// The training losses of the steps before `step` (train/step_losses.h): each checked for a NaN or
// an infinity once it has landed (polled, no wait; `wait`: all of them now, at a validation, a save
// or the end), then the loss of step - 1 printed where --log-train-loss asks (the mean per token
// over every rank: the run's only MPI call between steps, there only). A failure names the step
// whose loss went bad, numbered as the log numbers it.
void check_step_losses(Run& r, int step, bool wait) {
    StepLosses& l = r.losses;
    for (int s = l.checked; s < step; ++s) {
        cudaEvent_t e = l.ready[s % StepLosses::kSteps];
        const bool due = wait || s + StepLosses::kSteps <= step || (r.opt.log_train_loss && s + 1 == step);
        if (!due && cudaEventQuery(e) == cudaErrorNotReady) {
            (void)cudaGetLastError();  // not an error: a later check must not see it
            break;
        }
        CUDA_CHECK(sync_event(e, "step_losses"));  // returns at once where the query found it complete
        if (const double loss = l.sum(s); !std::isfinite(loss)) {
            const std::string where = kEmulated ? r.first_nonfinite : "(the CPU build names the parameter group)";
            fail("the training loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at step " +
                 std::to_string(s + 1) + "; first non-finite: " + (where.empty() ? "the loss itself" : where));
        }
        l.checked = s + 1;
    }
    if (!r.opt.log_train_loss || step == 0 || l.checked < step) return;
    const double sum = l.sum(step - 1);
    const double all = host_sum(sum);
    print0(r, "step:%d/%d train_loss:%.4f\n", step, r.sch.total_steps,
           all / double(r.sch.lookup(step - 1).first->batch_tokens));
}
