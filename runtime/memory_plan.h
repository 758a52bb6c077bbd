// The memory plan's report: every arena of a rank, the optimizer state by name and the total
// (--print-memory, and the model test's bound against upstream's peak). The trainer measures the
// arenas of a config without a device and hands them here.
#pragma once
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "arena.h"

struct MemoryPlan {
    size_t params, grads, state, activations, optimizer, workspace;
    size_t total() const { return params + grads + state + activations + optimizer + workspace; }
};

// The optimizer's state by name (exp_avg, momentum, ...): bytes and groups summed over every group's
// registered state tensors, so a new optimizer rule's state shows here without an edit.
struct StateTotal {
    std::string name;
    int groups = 0;
    size_t bytes = 0;
};
// Adds one group's registered state tensors to the totals.
void add_state_totals(std::vector<StateTotal>& out, const std::vector<StateTensor>& group_state) {
    for (const StateTensor& t : group_state) {
        auto it = std::find_if(out.begin(), out.end(), [&](const StateTotal& s) { return s.name == t.name; });
        if (it == out.end()) it = out.insert(out.end(), StateTotal{t.name});
        ++it->groups;
        it->bytes += t.bytes();
    }
}

void print_optimizer_state(const std::vector<StateTotal>& totals, FILE* f) {
    std::fprintf(f, "optimizer state by name (the groups' registered state tensors, inside the optimizer arena):\n");
    size_t total = 0;
    for (const StateTotal& s : totals) {
        std::fprintf(f, "    %-28s %2d groups %12zu bytes %10.2f MiB\n", s.name.c_str(), s.groups, s.bytes, s.bytes / 1048576.0);
        total += s.bytes;
    }
    std::fprintf(f, "    %-28s %9s %12zu bytes %10.2f MiB\n", "all state", "", total, total / 1048576.0);
}

// Upstream's record 71 run peaks at 31253 MiB allocated per GPU; ours must not need more.
constexpr double kUpstreamPeakMiB = 31253;

// The plan's arenas (parameters, gradients, state, activations, optimizer: each with its tensors but
// the gradients', which mirror the parameters), the optimizer state by name, the workspace and the total.
void print_memory_breakdown(const MemoryPlan& plan, const Arena& params, const Arena& grads, const Arena& state,
                            const Arena& activations, const Arena& optimizer,
                            const std::vector<StateTotal>& state_totals, double upstream_peak_mib, FILE* f) {
    params.print(f, true);
    grads.print(f, false);
    state.print(f, true);
    activations.print(f, true);
    optimizer.print(f, true);
    print_optimizer_state(state_totals, f);
    std::fprintf(f, "%-12s %10.1f MiB\n", "workspace", plan.workspace / 1048576.0);
    std::fprintf(f, "%-12s %10.1f MiB (upstream's run of this record peaks at %.0f MiB allocated)\n", "total",
                 plan.total() / 1048576.0, upstream_peak_mib);
}
