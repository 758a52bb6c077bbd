// The step model's reports: a modeled plan (profiler/replay.h) as text tables (format_plan), as JSON
// (--json) and as a Chrome/Perfetto trace (--trace), and ours against upstream's schedule
// (format_schedule_comparison, with the rules of profiler/upstream_schedule.h). Host C++17 only.
#pragma once
#include "replay.h"
#include "upstream_schedule.h"
#include "work.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

// ---- text ----

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline void appendf(std::string& out, const char* fmt, ...) {
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    const int n = std::max(std::vsnprintf(nullptr, 0, fmt, ap), 0);
    va_end(ap);
    std::string s(size_t(n) + 1, '\0');
    std::vsnprintf(s.data(), s.size(), fmt, again);
    va_end(again);
    s.pop_back();
    out += s;
}

inline std::string format_critical_path(const std::vector<PathShare>& path, size_t most) {
    std::string out;
    for (size_t i = 0; i < std::min(path.size(), most); ++i)
        appendf(out, "%s%s %.3f", i ? ", " : "", path[i].name.c_str(), path[i].us / 1e3);
    return out;
}

// The stage table, then per stage its kernel families, collectives and critical paths.
inline std::string format_plan(const PlanReport& p) {
    std::string o;
    appendf(o, "Modeled step times, preset %s, schedule %s: H100 cost model, %d GPUs on %d node%s (a model, not a "
               "measurement)\n",
            p.preset.c_str(), p.schedule.c_str(), p.world_size, p.nodes, p.nodes == 1 ? "" : "s");
    appendf(o, "%-10s %16s %9s %9s %9s %22s %14s %14s\n", "stage", "steps e/a/u", "even ms", "adam ms", "untie ms",
            "exposed comm e/a ms", "launches e/a", "host syncs e/a");
    int steps = 0;
    for (const StageReport& s : p.stages) {
        char untie[16] = "-", steps_text[48], exposed[48], launches[32], syncs[32];
        if (!s.untie.ranks.empty()) std::snprintf(untie, sizeof untie, "%.3f", s.untie.ms);
        std::snprintf(steps_text, sizeof steps_text, "%d/%d/%d", s.steps_even, s.steps_adam, s.steps_untie);
        std::snprintf(exposed, sizeof exposed, "%.3f/%.3f", s.even.exposed_comm_ms, s.adam.exposed_comm_ms);
        std::snprintf(launches, sizeof launches, "%d/%d", s.even.launches, s.adam.launches);
        std::snprintf(syncs, sizeof syncs, "%d/%d", s.even.host_syncs, s.adam.host_syncs);
        appendf(o, "%-10s %16s %9.3f %9.3f %9s %22s %14s %14s\n", s.stage.c_str(), steps_text, s.even.ms, s.adam.ms,
                untie, exposed, launches, syncs);
        steps += s.steps_even + s.steps_adam + s.steps_untie;
    }
    appendf(o, "whole run: %d steps, %.3f s modeled (the sum over the schedule)\n", steps, p.total_ms / 1e3);
    for (const StageReport& s : p.stages) {
        appendf(o, "\n%s: kernel families (the slowest rank's; per Adam step, or even step if Adam's has none)\n",
                s.stage.c_str());
        appendf(o, "%-36s %12s %10s %9s %9s %9s\n", "family", "count e/a", "GFLOP", "GB", "even ms", "adam ms");
        std::vector<std::string> names;
        for (const ModeledStep* m : {&s.adam, &s.even})
            for (const FamilyRow& f : m->kernels)
                if (std::find(names.begin(), names.end(), f.name) == names.end()) names.push_back(f.name);
        for (const std::string& n : names) {
            FamilyRow e, a;
            for (const FamilyRow& f : s.even.kernels)
                if (f.name == n) e = f;
            for (const FamilyRow& f : s.adam.kernels)
                if (f.name == n) a = f;
            char counts[32];
            std::snprintf(counts, sizeof counts, "%d/%d", e.count, a.count);
            const FamilyRow& work = a.count ? a : e;
            appendf(o, "%-36s %12s %10.2f %9.3f %9.3f %9.3f\n", n.c_str(), counts, work.flops / 1e9, work.bytes / 1e9,
                    e.ms, a.ms);
        }
        for (const ModeledStep* m : {&s.even, &s.adam}) {
            if (m->collectives.empty()) continue;
            appendf(o, "%s: collectives of the %s\n", s.stage.c_str(), m == &s.even ? "even step" : "Adam step");
            appendf(o, "%-36s %6s %10s %9s %14s\n", "name", "count", "MB", "ms", "overlapped ms");
            for (const CollectiveRow& c : m->collectives)
                appendf(o, "%-36s %6d %10.3f %9.3f %14.3f\n", c.name.c_str(), c.count, c.bytes / 1e6, c.ms,
                        c.overlapped_ms);
        }
        for (const ModeledStep* m : {&s.even, &s.adam, &s.untie})
            if (!m->ranks.empty())
                appendf(o, "%s: critical path (ms): %s\n", m->label.c_str(),
                        format_critical_path(m->critical_path, 8).c_str());
    }
    return o;
}

// ---- JSON: the plan (--json) and a Chrome/Perfetto trace (--trace) ----

// A JSON string: quotes, backslashes and control characters escaped.
inline std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) appendf(out, "\\u%04x", static_cast<unsigned>(c));
        else out += c;
    }
    return out + "\"";
}
// Finite by construction (recording_error() refuses non-finite inputs); JSON has no NaN anyway.
inline std::string json_number(double x) {
    std::string out;
    appendf(out, "%.9g", std::isfinite(x) ? x : 0.0);
    return out;
}
// A JSON object's members in the order added; `raw` takes a value already in JSON.
struct JsonObject {
    std::string members;
    JsonObject& raw(const char* key, const std::string& value) {
        members += (members.empty() ? "" : ", ") + json_string(key) + ": " + value;
        return *this;
    }
    JsonObject& num(const char* key, double v) { return raw(key, json_number(v)); }
    JsonObject& integer(const char* key, int64_t v) { return raw(key, std::to_string(v)); }
    JsonObject& str(const char* key, const std::string& v) { return raw(key, json_string(v)); }
    std::string text() const { return "{" + members + "}"; }
};
// A JSON array of f(item) for each item, one per line at the given indent.
template <class T, class F>
std::string json_array(const std::vector<T>& items, const char* indent, F f) {
    std::string out = "[";
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ",\n" : "\n") + std::string(indent) + f(items[i]);
    return out + "]";
}

inline std::string kernels_json(const std::vector<FamilyRow>& rows) {
    return json_array(rows, "      ", [](const FamilyRow& f) {
        return JsonObject().str("name", f.name).integer("count", f.count).num("flops", f.flops)
            .num("tc_flops", f.tc_flops).num("bytes", f.bytes).num("modeled_ms", f.ms).text();
    });
}
inline std::string collectives_json(const std::vector<CollectiveRow>& rows) {
    return json_array(rows, "      ", [](const CollectiveRow& c) {
        return JsonObject().str("name", c.name).integer("count", c.count).num("bytes", c.bytes)
            .num("modeled_ms", c.ms).num("overlapped_ms", c.overlapped_ms).text();
    });
}
inline std::string critical_path_json(const std::vector<PathShare>& path) {
    return json_array(path, "      ",
                      [](const PathShare& p) { return JsonObject().str("name", p.name).num("ms", p.us / 1e3).text(); });
}

// The keys, plus: schedule, nodes, per stage the step counts, untie_ms (null without an
// untie step), the even step's kernels and collectives (kernels/collectives are the Adam step's,
// which has every family of the even step and Adam's own, or the even step's in a stage without
// Adam steps), host syncs per step kind (host_syncs_in_step is the larger), the critical paths.
inline std::string stage_json(const StageReport& s) {
    const ModeledStep& main = s.adam.ranks.empty() ? s.even : s.adam;
    return JsonObject()
        .str("stage", s.stage)
        .integer("steps_even", s.steps_even).integer("steps_adam", s.steps_adam).integer("steps_untie", s.steps_untie)
        .num("even_ms", s.even.ms).num("adam_ms", s.adam.ms)
        .raw("untie_ms", s.untie.ranks.empty() ? "null" : json_number(s.untie.ms))
        .num("total_ms", s.total_ms)
        .num("exposed_comm_even_ms", s.even.exposed_comm_ms).num("exposed_comm_adam_ms", s.adam.exposed_comm_ms)
        .integer("launches_even", s.even.launches).integer("launches_adam", s.adam.launches)
        .integer("host_syncs_in_step", std::max(s.even.host_syncs, s.adam.host_syncs))
        .integer("host_syncs_even", s.even.host_syncs).integer("host_syncs_adam", s.adam.host_syncs)
        .raw("kernels", kernels_json(main.kernels)).raw("collectives", collectives_json(main.collectives))
        .raw("kernels_even", kernels_json(s.even.kernels)).raw("collectives_even", collectives_json(s.even.collectives))
        .raw("critical_path_even", critical_path_json(s.even.critical_path))
        .raw("critical_path_adam", critical_path_json(s.adam.critical_path))
        .text();
}
inline std::string plan_json(const PlanReport& p) {
    return JsonObject()
               .str("preset", p.preset).str("schedule", p.schedule)
               .integer("world_size", p.world_size).integer("nodes", p.nodes)
               .num("total_ms", p.total_ms)
               .raw("stages", json_array(p.stages, "  ", stage_json))
               .text() + "\n";
}

// Chrome Trace Event format (chrome://tracing, ui.perfetto.dev): a process per rank, a thread for
// the host (0) and one per stream (stream + 1); the steps one after another, 100 us apart, each a
// span on the host thread named by its label; every op an "X" event on the host (its launch or
// wait) and, for device ops, one on its stream, with its work in args.
inline JsonObject trace_event(const char* ph, const std::string& name, size_t pid, int tid) {
    return JsonObject().str("ph", ph).str("name", name).integer("pid", int64_t(pid)).integer("tid", tid);
}
inline std::string trace_x(const std::string& name, const char* cat, size_t pid, int tid, double ts, double dur,
                           const JsonObject& args) {
    JsonObject e = trace_event("X", name, pid, tid).str("cat", cat).num("ts", ts).num("dur", dur);
    if (!args.members.empty()) e.raw("args", args.text());
    return e.text();
}
inline std::string op_label(const StepOp& op) {
    const char* name = family_name(op.work);
    if (*name) return name;
    if (op.kind == OpKind::event_record) return "event_record";
    return op.kind == OpKind::event_wait ? "event_wait" : "host_sync";
}
inline std::string chrome_trace_json(const std::vector<const ModeledStep*>& steps) {
    std::vector<std::string> events;
    size_t most_ranks = 0;
    int most_streams = 0;
    for (const ModeledStep* m : steps) {
        most_ranks = std::max(most_ranks, m->ranks.size());
        for (const std::vector<StepOp>& ops : m->ranks)
            for (const StepOp& op : ops) most_streams = std::max(most_streams, op.stream + 1);
    }
    for (size_t r = 0; r < most_ranks; ++r) {
        const auto name = [](const std::string& n) { return JsonObject().str("name", n).text(); };
        events.push_back(trace_event("M", "process_name", r, 0).raw("args", name("rank " + std::to_string(r))).text());
        for (int t = 0; t <= most_streams; ++t)
            events.push_back(trace_event("M", "thread_name", r, t)
                                 .raw("args", name(t ? "stream " + std::to_string(t - 1) : "host"))
                                 .text());
    }
    double offset = 0;
    for (const ModeledStep* m : steps) {
        double longest = 0;
        for (size_t r = 0; r < m->ranks.size(); ++r) {
            const Timeline& tl = m->timelines[r];
            longest = std::max(longest, tl.makespan_us);
            events.push_back(trace_x(m->label, "step", r, 0, offset, tl.makespan_us, JsonObject()));
            for (size_t i = 0; i < m->ranks[r].size(); ++i) {
                const StepOp& op = m->ranks[r][i];
                const OpTiming& t = tl.ops[i];
                events.push_back(trace_x(op_label(op), "host", r, 0, offset + t.host_begin_us,
                                         t.host_end_us - t.host_begin_us, JsonObject()));
                if (!is_device_op(op.kind)) continue;
                JsonObject args;
                args.num("tc_flops", op.work.tc_flops).num("flops", op.work.flops).num("bytes", work_bytes(op.work));
                args.str("range", op.range);
                if (op.kind == OpKind::collective)
                    args.num("comm_bytes", op.work.comm_bytes).num("overlapped_us", t.overlapped_us);
                events.push_back(trace_x(op_label(op), "device", r, op.stream + 1, offset + t.start_us,
                                         t.end_us - t.start_us, args));
            }
        }
        offset += longest + 100;
    }
    const auto as_is = [](const std::string& e) { return e; };
    return JsonObject().str("displayTimeUnit", "ms").raw("traceEvents", json_array(events, "", as_is)).text() + "\n";
}
inline std::vector<const ModeledStep*> modeled_steps(const PlanReport& p) {
    std::vector<const ModeledStep*> out;
    for (const StageReport& s : p.stages)
        for (const ModeledStep* m : {&s.even, &s.adam, &s.untie})
            if (!m->ranks.empty()) out.push_back(m);
    return out;
}

// Writes text to path; the error, or "".
inline std::string write_text_file(const std::string& path, const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return "cannot write " + path + ": " + std::strerror(errno);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    const int err = errno;
    if (std::fclose(f) != 0 || !ok) return "cannot write " + path + ": " + std::strerror(ok ? errno : err);
    return "";
}
inline std::string write_plan_json(const std::string& path, const PlanReport& p) {
    return write_text_file(path, plan_json(p));
}
inline std::string write_chrome_trace(const std::string& path, const PlanReport& p) {
    return write_text_file(path, chrome_trace_json(modeled_steps(p)));
}

// Ours against upstream's schedule, stage by stage, then the rules that make the difference.
inline std::string format_schedule_comparison(const PlanReport& ours, const PlanReport& upstream, UpstreamCode code = {}) {
    std::string o;
    appendf(o, "Ours vs upstream's schedule, modeled (preset %s, %d GPUs on %d node%s)\n", ours.preset.c_str(),
            ours.world_size, ours.nodes, ours.nodes == 1 ? "" : "s");
    appendf(o, "%-10s %14s %14s %14s %14s %14s %14s\n", "stage", "even ms ours", "upstream", "adam ms ours",
            "upstream", "stage s ours", "upstream");
    for (size_t i = 0; i < ours.stages.size() && i < upstream.stages.size(); ++i) {
        const StageReport &a = ours.stages[i], &b = upstream.stages[i];
        appendf(o, "%-10s %14.3f %14.3f %14.3f %14.3f %14.3f %14.3f\n", a.stage.c_str(), a.even.ms, b.even.ms,
                a.adam.ms, b.adam.ms, a.total_ms / 1e3, b.total_ms / 1e3);
    }
    appendf(o, "whole run: ours %.3f s, upstream's schedule %.3f s\nupstream's schedule, rule by rule:\n",
            ours.total_ms / 1e3, upstream.total_ms / 1e3);
    for (const ScheduleRule& r : upstream_rules(code)) appendf(o, "  %s: %s\n", r.name, r.what);
    return o;
}

