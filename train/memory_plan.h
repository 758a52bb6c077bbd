// The memory plan: every arena of a rank for a config, measured without a device, and the optimizer
// state by name (--print-memory, and the model test's bound against upstream's peak). Part of
// train_gpt.cu: included after its optimizer.
#pragma once
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

struct MemoryPlan {
    size_t params, grads, state, activations, optimizer, workspace;
    size_t total() const { return params + grads + state + activations + optimizer + workspace; }
};
MemoryPlan plan_memory(Model& m, Optimizer& o, int world) {
    layout_params(m.param_arena, m.cfg, m.params);
    layout_params(m.grad_arena, m.cfg, m.grads);
    layout_state(m.state_arena, m);
    layout_activations(m.act_arena, m);
    o.world = world;
    layout_optimizer(o.arena, o, m.cfg, m.params, m.grads, world == 8 && m.cfg.grad_accum() == 1);
    return {m.param_arena.bytes(), m.grad_arena.bytes(), m.state_arena.bytes(), m.act_arena.bytes(),
            o.arena.bytes(), CublasLt::kWorkspaceBytes};
}

// The optimizer's state by name (exp_avg, momentum, ...): bytes and groups summed over every group's
// registered state tensors (q.state), so a new optimizer rule's state shows here without an edit.
struct StateTotal {
    std::string name;
    int groups = 0;
    size_t bytes = 0;
};
std::vector<StateTotal> optimizer_state_totals(const Optimizer& o) {
    std::vector<StateTotal> out;
    for (const OptimGroup& q : o.group)
        for (const StateTensor& t : q.state) {
            auto it = std::find_if(out.begin(), out.end(), [&](const StateTotal& s) { return s.name == t.name; });
            if (it == out.end()) it = out.insert(out.end(), StateTotal{t.name});
            ++it->groups;
            it->bytes += t.bytes();
        }
    return out;
}

void print_optimizer_state(const Optimizer& o, FILE* f) {
    std::fprintf(f, "optimizer state by name (the groups' registered state tensors, inside the optimizer arena):\n");
    size_t total = 0;
    for (const StateTotal& s : optimizer_state_totals(o)) {
        std::fprintf(f, "    %-28s %2d groups %12zu bytes %10.2f MiB\n", s.name.c_str(), s.groups, s.bytes, s.bytes / 1048576.0);
        total += s.bytes;
    }
    std::fprintf(f, "    %-28s %9s %12zu bytes %10.2f MiB\n", "all state", "", total, total / 1048576.0);
}

// Upstream's record run peaks at 31253 MiB allocated per GPU; ours must not need more.
constexpr double kUpstreamPeakMiB = 31253;

// ranks: the world size planned for (8, or 1 for one GPU: its optimizer state unsharded, 8 micro-steps).
void print_memory_plan(const Config& c, FILE* f, int ranks) {
    if (const std::string e = config_error(c); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    Model m;
    m.cfg = c;
    m.cfg.world_size = ranks;
    Optimizer o;
    const MemoryPlan plan = plan_memory(m, o, ranks);
    std::fprintf(f, "memory plan per rank, preset %s (%d rank%s; %d train and %d eval tokens per micro-step):\n",
                 c.name.c_str(), ranks, ranks == 1 ? "" : "s", m.cfg.max_train_tokens(), m.cfg.val_micro_tokens());
    m.param_arena.print(f, true);
    m.grad_arena.print(f, false);
    m.state_arena.print(f, true);
    m.act_arena.print(f, true);
    o.arena.print(f, true);
    print_optimizer_state(o, f);
    std::fprintf(f, "%-12s %10.1f MiB\n", "workspace", plan.workspace / 1048576.0);
    std::fprintf(f, "%-12s %10.1f MiB (upstream's record peaks at %.0f MiB)\n", "total", plan.total() / 1048576.0,
                 kUpstreamPeakMiB);
}

// What the run allocates on the device: every arena and cuBLASLt's workspace (the log's peak line).
size_t allocated_bytes(const Model& m, const Optimizer& o) {
    return m.param_arena.bytes() + m.grad_arena.bytes() + m.state_arena.bytes() + m.act_arena.bytes() + o.arena.bytes() +
           CublasLt::kWorkspaceBytes;
}
