// The step model's replay: a recorded step (profiler/work.h's StepOps, one list per rank, in host
// issue order) on the prices of profiler/cost_model.h. Every rank's stream/event graph is replayed
// event by event (replay()): the host pays a launch cost per operation, an operation starts when the
// host has issued it, its stream is free and the events its stream waits on have completed, and the
// k-th collective of every rank starts on all ranks together.
//
// A step is priced in steady state (replay_steady(), plan_report()): the two steps before it in a
// run, it, and the step after it (even and Adam steps alternate, the untie step follows an even one:
// an even step is modeled as even, Adam, EVEN, Adam; an Adam step as Adam, even, ADAM, even; each
// the stage's recording of that kind) are replayed back to back on one timeline per rank, streams
// and events carried over (a recording names each stream and event by the same index in every step
// of a plan), so a wait on an event an earlier step recorded resolves against that record, and
// communication that spills into the next step's forward delays what waits for it there rather than
// vanishing (one step alone) or ending the step. A step's time runs from the end of the step before
// (its last op done, on any rank) to its own end; its exposed communication is stream 0's idle time
// for other streams within that window, whichever step's op waited.
//
// Use (--plan-step, profiler/plan_step.h): record one even, one Adam and (at the split step) one
// untie step per stage on every rank, then
//   const CostModel cm = h100_model(world_size);               // or h100_model(world_size, nodes)
//   const PlanReport ours = plan_report(preset, "ours", stages, cm);
//   const PlanReport up = plan_report(preset, "upstream", upstream_schedule(stages), cm);
//   format_plan(ours), format_schedule_comparison(ours, up)    // the text (profiler/reports.h)
//   write_plan_json(path, ours), write_chrome_trace(path, ours)  // each gives its error, or ""
//
// Host C++17 only, as profiler/cost_model.h.
#pragma once
#include "cost_model.h"
#include "work.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

// ---- checking recordings ----

inline bool is_mpi_call(const StepOp& op) {
    return op.kind == OpKind::host_sync && name_starts(family_name(op.work), "mpi_");
}
// Collectives and blocking MPI calls meet across ranks: the k-th of each rank is the same one.
inline bool is_rendezvous(const StepOp& op) { return op.kind == OpKind::collective || is_mpi_call(op); }
inline std::vector<const StepOp*> rendezvous_of(const std::vector<StepOp>& ops) {
    std::vector<const StepOp*> out;
    for (const StepOp& op : ops)
        if (is_rendezvous(op)) out.push_back(&op);
    return out;
}

inline std::string op_error(const StepOp& op) {
    const Work& w = op.work;
    const double numbers[] = {w.tc_flops, w.flops, w.bytes_read, w.bytes_written, w.comm_bytes};
    for (double x : numbers)
        if (!(x >= 0 && std::isfinite(x))) return "a FLOP or byte count is negative or not finite";
    if (w.m < 0 || w.n < 0 || w.k < 0 || w.batch < 0) return "a negative GEMM dimension";
    if (op.stream < -1 || (op.stream == -1 && op.kind != OpKind::host_sync))
        return "stream " + std::to_string(op.stream) + " (only a host_sync may name stream -1, the whole device)";
    const bool event_op = op.kind == OpKind::event_record || op.kind == OpKind::event_wait;
    if (event_op && op.event < 0) return "an event operation without an event";
    if (op.kind == OpKind::collective && w.comm == Comm::none) return "a collective without a kind (Comm::none)";
    return "";
}

// What is wrong with a step's recordings (one per rank), or "": every operation well formed, and
// every rank issuing the same collectives and MPI calls (by name and kind) in the same order.
inline std::string recording_error(const std::vector<std::vector<StepOp>>& ranks) {
    if (ranks.empty()) return "no ranks recorded";
    for (size_t r = 0; r < ranks.size(); ++r)
        for (size_t i = 0; i < ranks[r].size(); ++i)
            if (std::string e = op_error(ranks[r][i]); !e.empty())
                return "rank " + std::to_string(r) + ", operation " + std::to_string(i) + " (" +
                       family_name(ranks[r][i].work) + "): " + e;
    const std::vector<const StepOp*> first = rendezvous_of(ranks[0]);
    for (size_t r = 1; r < ranks.size(); ++r) {
        const std::vector<const StepOp*> mine = rendezvous_of(ranks[r]);
        for (size_t k = 0; k < std::min(first.size(), mine.size()); ++k) {
            const StepOp &a = *first[k], &b = *mine[k];
            if (a.kind != b.kind || a.work.comm != b.work.comm || std::strcmp(family_name(a.work), family_name(b.work)))
                return "collective/MPI call " + std::to_string(k) + " differs: rank 0 issues " + family_name(a.work) +
                       ", rank " + std::to_string(r) + " issues " + family_name(b.work);
        }
        if (first.size() != mine.size())
            return "rank 0 issues " + std::to_string(first.size()) + " collectives and MPI calls, rank " +
                   std::to_string(r) + " issues " + std::to_string(mine.size());
    }
    return "";
}

// ---- the replay ----

struct OpTiming {
    double host_begin_us = 0, host_end_us = 0;  // the host enqueuing the op (or waiting, for host_sync)
    double start_us = 0, end_us = 0;            // on its stream (device ops); others: the host's time
    double exposed_comm_us = 0;  // stream 0 idle waiting on another stream (events), or in a collective
    double overlapped_us = 0;    // collectives: how long stream 0 computed meanwhile
};
struct PathShare {
    std::string name;  // a family, "host_launch" (the host issuing), "host_sync", or an mpi_ call
    double us;
};
struct Timeline {  // one rank's step
    std::vector<OpTiming> ops;  // one per StepOp
    double makespan_us = 0;     // the host and every stream done
    double exposed_comm_us = 0;
    int launches = 0, host_syncs = 0;
    // What the step's end depends on: walking back from the last thing to finish through the
    // constraint that set each start (host, stream order, event, or the rank a collective waited
    // for), time per family, largest first; the shares add up to makespan_us.
    std::vector<PathShare> critical_path;
};

namespace step_model_detail {

struct Node {  // a stretch of time on the critical-path graph
    std::string label;
    double begin, end;
    int pred;  // the node whose end set `begin`, or -1 (time 0)
};
struct Stamp {  // a time and the node it comes from
    double t = 0;
    int node = -1;
};
inline Stamp later(Stamp a, Stamp b) { return b.t > a.t ? b : a; }  // ties keep a

struct RankState {
    size_t pos = 0;
    Stamp host;
    // Per stream: the last op's end, and the latest event waited for since. A time set on the
    // stream itself is never later than its tail, so a wait that delays an op is on another stream.
    std::vector<Stamp> tail, wait;
    struct Event {
        Stamp at;
        bool recorded = false;  // a wait on an event never recorded is a no-op, as in CUDA
    };
    std::vector<Event> events;
    bool arrived = false;  // at its next rendezvous: when it is ready, `own_ready` without other
    Stamp ready, own_ready;  // streams' events, and its own duration (collectives)
    double own_us = 0;
    Timeline tl;
    std::vector<Stamp> op_end;  // per op: when it was done (device ops on their stream; others on the host)
};

class Replay {
  public:
    Replay(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm)
        : ranks_(ranks), cm_(cm), st_(ranks.size()) {
        for (size_t r = 0; r < ranks.size(); ++r) st_[r].tl.ops.resize(ranks[r].size()), st_[r].op_end.resize(ranks[r].size());
    }

    // Replays every rank's ops to their end; then timelines() reports a stretch of them.
    void run() {
        for (;;) {
            bool all_done = true, all_arrived = true;
            for (size_t r = 0; r < st_.size(); ++r) {
                advance(r);
                all_done = all_done && st_[r].pos == ranks_[r].size();
                all_arrived = all_arrived && st_[r].arrived;
            }
            if (all_done) break;
            // replay_error() checked that every rank meets the same rendezvous in the same order
            if (!all_arrived) step_model_fail("replay: ranks stopped at different points (a bug in the replay)");
            resolve();
        }
    }

    // When rank r's ops [from, to) were all done (the last of them; for the last ops of the replay,
    // the host and every stream idle).
    Stamp done(size_t r, size_t from, size_t to) {
        RankState& s = st_[r];
        Stamp t;
        for (size_t i = from; i < to; ++i) t = later(t, s.op_end[i]);
        return to == ranks_[r].size() ? later(t, later(device_ready(s, -1), s.host)) : t;
    }
    // Per rank, its ops [first[r], last[r]) with times from t0 (the step's start): when each ran, the
    // makespan to the last of them, stream 0's idle time for other streams in between, the critical
    // path back to t0.
    std::vector<Timeline> timelines(const std::vector<size_t>& first, const std::vector<size_t>& last, double t0) {
        std::vector<Timeline> out;
        for (size_t r = 0; r < st_.size(); ++r) out.push_back(finish(r, first[r], last[r], t0));
        return out;
    }

  private:
    const std::vector<std::vector<StepOp>>& ranks_;
    const CostModel& cm_;
    std::vector<RankState> st_;
    std::vector<Node> nodes_;

    Stamp add_node(std::string label, double begin, double dur, int pred) {
        nodes_.push_back({std::move(label), begin, begin + dur, pred});
        return {begin + dur, int(nodes_.size()) - 1};
    }
    static void add_stream(RankState& s, int stream) {
        if (int(s.tail.size()) > stream) return;
        s.tail.resize(size_t(stream) + 1), s.wait.resize(size_t(stream) + 1);
    }
    static Stamp stream_ready(RankState& s, int stream) {
        add_stream(s, stream);
        return later(s.tail[stream], s.wait[stream]);
    }
    static Stamp device_ready(RankState& s, int stream) {  // every stream (-1) or one
        if (stream >= 0) return stream_ready(s, stream);
        Stamp t;
        for (int i = 0; i < int(s.tail.size()); ++i) t = later(t, stream_ready(s, i));
        return t;
    }
    void host_pay(RankState& s, OpTiming& t, double us) {
        t.host_begin_us = s.host.t;
        if (us > 0) s.host = add_node("host_launch", s.host.t, us, s.host.node);
        t.host_end_us = s.host.t;
    }
    // The op starts: its stream takes it. On stream 0, the compute stream, the time past `own` (its
    // stream's tail or its issue) went to waiting on other streams: exposed communication; a
    // collective there is exposed whole.
    void run_on_stream(RankState& s, const StepOp& op, OpTiming& t, Stamp start, double dur, Stamp own) {
        const Stamp end = add_node(family_name(op.work), start.t, dur, start.node);
        t.start_us = start.t, t.end_us = end.t;
        s.op_end[s.pos] = end;
        if (op.stream == 0)
            t.exposed_comm_us = op.kind == OpKind::collective ? end.t - own.t : std::max(0.0, start.t - own.t);
        s.tail[op.stream] = end;
        s.wait[op.stream] = Stamp{};
    }

    // Runs rank r's ops until its end or its next rendezvous (where it arrives and waits).
    void advance(size_t r) {
        RankState& s = st_[r];
        while (s.pos < ranks_[r].size() && !s.arrived) {
            const StepOp& op = ranks_[r][s.pos];
            OpTiming& t = s.tl.ops[s.pos];
            if (is_rendezvous(op)) {
                arrive(s, op, t);
                return;
            }
            host_pay(s, t, host_cost_us(op.kind, cm_));
            if (is_device_op(op.kind)) {
                const Stamp ready = stream_ready(s, op.stream);
                const Stamp own = later(s.tail[op.stream], s.host);
                run_on_stream(s, op, t, later(ready, s.host), device_us(op, cm_), own);
            } else if (op.kind == OpKind::event_record) {
                if (int(s.events.size()) <= op.event) s.events.resize(size_t(op.event) + 1);
                s.events[op.event] = {stream_ready(s, op.stream), true};
                t.start_us = t.end_us = s.events[op.event].at.t;
            } else if (op.kind == OpKind::event_wait) {
                add_stream(s, op.stream);
                if (op.event < int(s.events.size()) && s.events[op.event].recorded)
                    s.wait[op.stream] = later(s.wait[op.stream], s.events[op.event].at);
                t.start_us = t.end_us = s.host.t;
            } else {  // host_sync
                const Stamp w = later(s.host, device_ready(s, op.stream));
                const char* name = family_name(op.work);
                s.host = add_node(*name ? name : "host_sync", w.t, cm_.host_sync_us, w.node);
                t.start_us = w.t, t.end_us = t.host_end_us = s.host.t;
            }
            if (!is_device_op(op.kind)) s.op_end[s.pos] = s.host;
            ++s.pos;
        }
    }

    void arrive(RankState& s, const StepOp& op, OpTiming& t) {
        if (op.kind == OpKind::collective) {
            host_pay(s, t, cm_.host_collective_us);
            s.ready = later(stream_ready(s, op.stream), s.host);
            s.own_ready = later(s.tail[op.stream], s.host);
            s.own_us = device_us(op, cm_);
        } else {  // a blocking MPI call: the host first waits as any host_sync does
            t.host_begin_us = s.host.t;
            s.ready = later(s.host, device_ready(s, op.stream));
        }
        s.arrived = true;
    }

    // Every rank is at the same collective or MPI call: it starts when the last rank is ready.
    void resolve() {
        Stamp start;
        double dur = 0;
        for (const RankState& s : st_) start = later(start, s.ready), dur = std::max(dur, s.own_us);
        for (size_t r = 0; r < st_.size(); ++r) {
            RankState& s = st_[r];
            const StepOp& op = ranks_[r][s.pos];
            OpTiming& t = s.tl.ops[s.pos];
            if (op.kind == OpKind::collective) {
                run_on_stream(s, op, t, start, dur, s.own_ready);
            } else {
                s.host = add_node(family_name(op.work), start.t, cm_.mpi_us, start.node);
                t.start_us = start.t, t.end_us = t.host_end_us = s.host.t;
                s.op_end[s.pos] = s.host;
            }
            s.arrived = false;
            s.own_us = 0;
            ++s.pos;
        }
    }

    Timeline finish(size_t r, size_t first, size_t last, double t0) {
        RankState& s = st_[r];
        const std::vector<OpTiming>& all = s.tl.ops;
        const Stamp end = done(r, first, last);
        Timeline tl;
        tl.makespan_us = end.t - t0;
        tl.ops.assign(all.begin() + std::ptrdiff_t(first), all.begin() + std::ptrdiff_t(last));
        for (size_t i = first; i < last; ++i) {
            const StepOp& op = ranks_[r][i];
            if (is_device_op(op.kind)) ++tl.launches;
            if (op.kind == OpKind::host_sync) ++tl.host_syncs;
        }
        // stream 0's idle time in [t0, end]: an earlier step's op whose wait reaches into the step
        // counts here, a wait before t0 in the step before
        for (size_t i = 0; i < ranks_[r].size(); ++i) {
            const OpTiming& t = all[i];
            const double until = ranks_[r][i].kind == OpKind::collective ? t.end_us : t.start_us;
            tl.exposed_comm_us += std::max(0.0, std::min(until, end.t) - std::max(until - t.exposed_comm_us, t0));
        }
        // collectives' overlap with stream 0's compute (stream 0's ops run one after another), the
        // earlier steps' compute included
        std::vector<const OpTiming*> busy;
        for (size_t i = 0; i < ranks_[r].size(); ++i) {
            const StepOp& op = ranks_[r][i];
            if (op.stream == 0 && is_device_op(op.kind) && op.kind != OpKind::collective) busy.push_back(&all[i]);
        }
        for (size_t i = first; i < last; ++i) {
            if (ranks_[r][i].kind != OpKind::collective) continue;
            OpTiming& c = tl.ops[i - first];
            auto it = std::lower_bound(busy.begin(), busy.end(), c.start_us,
                                       [](const OpTiming* b, double t) { return b->end_us <= t; });
            for (; it != busy.end() && (*it)->start_us < c.end_us; ++it)
                c.overlapped_us += std::min(c.end_us, (*it)->end_us) - std::max(c.start_us, (*it)->start_us);
        }
        for (OpTiming& t : tl.ops)
            for (double* x : {&t.host_begin_us, &t.host_end_us, &t.start_us, &t.end_us}) *x -= t0;
        tl.critical_path = critical_path(end, t0);
        return tl;
    }

    // Every node begins where its predecessor ends (a Stamp carries both), and the first at 0; the
    // path is cut at t0 (a node across it counts from t0).
    std::vector<PathShare> critical_path(Stamp end, double t0) const {
        std::map<std::string, double> by_name;
        for (int n = end.node; n >= 0 && nodes_[n].end > t0; n = nodes_[n].pred)
            by_name[nodes_[n].label] += nodes_[n].end - std::max(nodes_[n].begin, t0);
        std::vector<PathShare> out;
        for (const auto& [name, us] : by_name) out.push_back({name, us});
        std::stable_sort(out.begin(), out.end(), [](const PathShare& a, const PathShare& b) { return a.us > b.us; });
        return out;
    }
};

}  // namespace step_model_detail

// What keeps a model from pricing these recordings, or "": a malformed recording, or ranks that
// are not the model's GPUs (one rank may stand for all of them).
inline std::string replay_error(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm) {
    if (ranks.size() > 1 && int(ranks.size()) != cm.world_size)
        return std::to_string(ranks.size()) + " ranks recorded, but the model is for " +
               std::to_string(cm.world_size) + " GPUs";
    return recording_error(ranks);
}

// Replays one step of every rank (ranks[r]: rank r's ops in host issue order) on the model: per
// rank, when each op ran, the step's makespan, exposed and overlapped communication, the critical
// path. Stops the process with replay_error()'s message when it has one.
inline std::vector<Timeline> replay(const std::vector<std::vector<StepOp>>& ranks, const CostModel& cm) {
    if (const std::string e = replay_error(ranks, cm); !e.empty()) step_model_fail(e);
    step_model_detail::Replay replay(ranks, cm);
    replay.run();
    std::vector<size_t> last;
    for (const std::vector<StepOp>& ops : ranks) last.push_back(ops.size());
    return replay.timelines(std::vector<size_t>(ranks.size(), 0), last, 0);
}

// A step in steady state: steps[k][r] is rank r's recording of the k-th of a run of steps, replayed
// back to back on one timeline per rank: the host issues each step right after the one before, and
// streams and events carry over (a recording names a handle by the same index in every step), so a
// wait on an event recorded in an earlier step resolves against that record, and communication that
// spills into the next step delays what waits for it there. Step `report` is reported: its time runs
// from the end of the step before (the last of that step's ops done, on any rank, host or stream)
// to its own end; its exposed communication is stream 0's idle time for other streams in that window
// (a later step's wait included: replay one step after it), its launches and host syncs its own ops'.
inline std::vector<Timeline> replay_steady(const std::vector<std::vector<std::vector<StepOp>>>& steps, size_t report,
                                           const CostModel& cm) {
    if (report >= steps.size()) step_model_fail("replay_steady: no step " + std::to_string(report) + " to report");
    const size_t n = steps[report].size();
    std::vector<std::vector<StepOp>> ranks(n);
    std::vector<std::vector<size_t>> begin(steps.size() + 1, std::vector<size_t>(n, 0));  // begin[k][r]
    for (size_t k = 0; k < steps.size(); ++k) {
        if (const std::string e = replay_error(steps[k], cm); !e.empty()) step_model_fail(e);
        if (steps[k].size() != n) step_model_fail("steps of a steady state recorded on different rank counts");
        for (size_t r = 0; r < n; ++r) {
            ranks[r].insert(ranks[r].end(), steps[k][r].begin(), steps[k][r].end());
            begin[k + 1][r] = ranks[r].size();
        }
    }
    step_model_detail::Replay replay(ranks, cm);
    replay.run();
    double t0 = 0;
    if (report > 0)
        for (size_t r = 0; r < n; ++r) t0 = std::max(t0, replay.done(r, begin[report - 1][r], begin[report][r]).t);
    return replay.timelines(begin[report], begin[report + 1], t0);
}

// ---- a modeled step and a plan of stages (their text, JSON and trace: profiler/reports.h) ----

struct FamilyRow {  // the device ops of one family (not collectives) in one rank's step
    std::string name;
    int count = 0;
    double tc_flops = 0, flops = 0, bytes = 0, ms = 0;  // flops: tensor-core and other
};
struct CollectiveRow {
    std::string name;
    int count = 0;
    double bytes = 0, ms = 0, overlapped_ms = 0;
};

// One step of every rank, replayed. The step takes as long as its slowest rank (`rank`); the
// family tables, exposed communication and critical path are that rank's. Ranks that a collective
// at the step's end holds together finish at once: of those, the one that waited least is the one
// the others waited for (its work sets the step; their extra wait is the ranks' imbalance).
struct ModeledStep {
    std::string label;
    std::vector<std::vector<StepOp>> ranks;  // empty: a step the schedule does not have
    std::vector<Timeline> timelines;
    int rank = 0;
    double ms = 0, exposed_comm_ms = 0;
    int launches = 0, host_syncs = 0;
    std::vector<FamilyRow> kernels;  // largest modeled time first
    std::vector<CollectiveRow> collectives;
    std::vector<PathShare> critical_path;
};

template <class Row>
Row& row_named(std::vector<Row>& rows, const char* name) {
    for (Row& r : rows)
        if (r.name == name) return r;
    rows.push_back(Row{name});
    return rows.back();
}
inline void add_family(std::vector<FamilyRow>& rows, const StepOp& op, const OpTiming& t) {
    FamilyRow& f = row_named(rows, family_name(op.work));
    ++f.count;
    f.tc_flops += op.work.tc_flops;
    f.flops += op.work.tc_flops + op.work.flops;
    f.bytes += work_bytes(op.work);
    f.ms += (t.end_us - t.start_us) / 1e3;
}
inline void add_collective(std::vector<CollectiveRow>& rows, const StepOp& op, const OpTiming& t) {
    CollectiveRow& c = row_named(rows, family_name(op.work));
    ++c.count;
    c.bytes += op.work.comm_bytes;
    c.ms += (t.end_us - t.start_us) / 1e3;
    c.overlapped_ms += t.overlapped_us / 1e3;
}

// Step `report` of `steps` (each every rank's recording) in the steady state of the run of them
// (replay_steady).
inline ModeledStep model_step(std::string label, const std::vector<std::vector<std::vector<StepOp>>>& steps,
                              size_t report, const CostModel& cm) {
    ModeledStep m;
    m.label = std::move(label);
    m.ranks = steps.at(report);
    if (m.ranks.empty()) return m;
    m.timelines = replay_steady(steps, report, cm);
    for (size_t r = 1; r < m.timelines.size(); ++r) {
        const Timeline &t = m.timelines[r], &slowest = m.timelines[m.rank];
        const bool tie = std::fabs(t.makespan_us - slowest.makespan_us) <= 1e-6 * std::max(1.0, slowest.makespan_us);
        if (tie ? t.exposed_comm_us < slowest.exposed_comm_us : t.makespan_us > slowest.makespan_us) m.rank = int(r);
    }
    const Timeline& tl = m.timelines[m.rank];
    m.ms = tl.makespan_us / 1e3;
    m.exposed_comm_ms = tl.exposed_comm_us / 1e3;
    m.launches = tl.launches;
    m.host_syncs = tl.host_syncs;
    const std::vector<StepOp>& ops = m.ranks[m.rank];
    for (size_t i = 0; i < ops.size(); ++i) {
        if (ops[i].kind == OpKind::collective) add_collective(m.collectives, ops[i], tl.ops[i]);
        else if (is_device_op(ops[i].kind)) add_family(m.kernels, ops[i], tl.ops[i]);
    }
    std::stable_sort(m.kernels.begin(), m.kernels.end(),
                     [](const FamilyRow& a, const FamilyRow& b) { return a.ms > b.ms; });
    m.critical_path = tl.critical_path;
    return m;
}

// A training stage: how many steps of each kind the schedule runs, and one recorded step of each
// (every rank's ops). The counts are disjoint: the untie step is not also counted as an Adam step.
struct PlanStage {
    std::string name;
    int steps_even = 0, steps_adam = 0, steps_untie = 0;
    std::vector<std::vector<StepOp>> even, adam, untie;  // untie: empty unless the stage has the split step
};
struct StageReport {
    std::string stage;
    int steps_even = 0, steps_adam = 0, steps_untie = 0;
    ModeledStep even, adam, untie;
    double total_ms = 0;  // the stage's steps, each at its kind's modeled time
};
struct PlanReport {
    std::string preset, schedule;  // schedule: "ours", or "upstream" (upstream_schedule())
    int world_size = 1, nodes = 1;
    double total_ms = 0;  // the whole run: the sum over the schedule
    std::vector<StageReport> stages;
};

// What is wrong with a plan for the model, or "".
inline std::string plan_error(const std::vector<PlanStage>& stages, const CostModel& cm) {
    for (const PlanStage& st : stages) {
        const struct {
            const char* kind;
            int steps;
            const std::vector<std::vector<StepOp>>& ranks;
        } kinds[] = {
            {"even", st.steps_even, st.even}, {"adam", st.steps_adam, st.adam}, {"untie", st.steps_untie, st.untie}};
        for (const auto& k : kinds) {
            const std::string where = "stage " + st.name + ", " + k.kind + " step: ";
            if (k.steps < 0) return where + "a negative step count (" + std::to_string(k.steps) + ")";
            if (k.steps > 0 && k.ranks.empty()) return where + std::to_string(k.steps) + " steps but no recording";
            if (!k.ranks.empty())
                if (const std::string e = replay_error(k.ranks, cm); !e.empty()) return where + e;
        }
    }
    return "";
}

// The steady state a stage's step of each kind is modeled in: the two steps before it in a run, it,
// and the step after it (an even step follows an Adam step; an Adam step and the untie step follow an
// even step, which an Adam step follows). A kind the stage did not record stands in for itself.
constexpr int kSteadyStepsBefore = 2;
enum class StepKind { even, adam, untie };
inline const std::vector<std::vector<StepOp>>& recording(const PlanStage& st, StepKind k) {
    return k == StepKind::even ? st.even : k == StepKind::adam ? st.adam : st.untie;
}
inline StepKind step_before(const PlanStage& st, StepKind k) {
    const StepKind before = k == StepKind::even ? StepKind::adam : StepKind::even;
    return recording(st, before).empty() ? k : before;
}
inline StepKind step_after(const PlanStage& st, StepKind k) {
    const StepKind after = k == StepKind::even ? StepKind::adam : StepKind::even;
    return recording(st, after).empty() ? k : after;
}
inline std::vector<std::vector<std::vector<StepOp>>> steady_steps(const PlanStage& st, StepKind k) {
    std::vector<std::vector<std::vector<StepOp>>> steps(kSteadyStepsBefore + 2);
    steps.back() = recording(st, step_after(st, k));
    for (int i = kSteadyStepsBefore; i >= 0; --i, k = step_before(st, k)) steps[size_t(i)] = recording(st, k);
    return steps;
}

inline PlanReport plan_report(const std::string& preset, const std::string& schedule,
                              const std::vector<PlanStage>& stages, const CostModel& cm) {
    if (const std::string e = plan_error(stages, cm); !e.empty()) step_model_fail(e);
    PlanReport p{preset, schedule, cm.world_size, cm.nodes, 0, {}};
    for (const PlanStage& st : stages) {
        StageReport s;
        s.stage = st.name;
        s.steps_even = st.steps_even, s.steps_adam = st.steps_adam, s.steps_untie = st.steps_untie;
        s.even = model_step(st.name + " even", steady_steps(st, StepKind::even), kSteadyStepsBefore, cm);
        s.adam = model_step(st.name + " adam", steady_steps(st, StepKind::adam), kSteadyStepsBefore, cm);
        s.untie = model_step(st.name + " untie", steady_steps(st, StepKind::untie), kSteadyStepsBefore, cm);
        s.total_ms = s.steps_even * s.even.ms + s.steps_adam * s.adam.ms + s.steps_untie * s.untie.ms;
        p.total_ms += s.total_ms;
        p.stages.push_back(std::move(s));
    }
    return p;
}
