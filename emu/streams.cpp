// Streams and events (see streams.h for the two modes). Each stream is a queue of work; work may
// also depend on other streams' progress (an event it waits on, the legacy default stream's
// implicit ordering). Running "stream S up to work N" runs, one at a time, the front work of any
// stream among those S transitively needs whose own dependencies are met: in deferred mode the
// next is picked at random, in immediate mode the first.
//
// Vector clocks give the happens-before order the race detector checks: each stream ticks its
// own entry per work; a work's clock joins its stream's earlier work, the events it waits on,
// the legacy stream's ordering, and what the host has synchronized with (work issued after a
// synchronize is ordered after what it waited for).
#include "streams.h"
#include "runtime_state.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>

namespace emu {
namespace {
struct Dep {  // stream `stream` must have run its first `upto` works
    size_t stream;
    uint64_t upto;
};
struct Op {
    std::vector<Dep> deps;
    std::function<void()> run;
};
}  // namespace
}  // namespace emu

struct CUstream_st {
    unsigned flags;
    int priority;
    size_t id;
    bool legacy;
    std::deque<emu::Op> queue;  // issued, not yet run
    uint64_t issued = 0, done = 0;
    emu::Clock clock;
};
struct CUevent_st {
    unsigned flags;
    bool recorded = false;
    size_t stream = 0;  // the last record: its stream, and that stream's work count at it
    uint64_t upto = 0;
    emu::Clock clock;
    std::shared_ptr<std::chrono::steady_clock::time_point> when;  // set when the record runs
};

namespace emu {

void Clock::join(const Clock& o) {
    if (c.size() < o.c.size()) c.resize(o.c.size(), 0);
    for (size_t i = 0; i < o.c.size(); ++i) c[i] = std::max(c[i], o.c[i]);
}

namespace {

struct Settings {
    StreamMode mode = StreamMode::immediate;
    uint64_t seed = 1;
};
Settings read_settings() {
    Settings r;
    const char* v = std::getenv("EMU_STREAMS");
    const std::string text = v ? v : "";
    if (text.empty() || text == "immediate") return r;
    if (text.rfind("deferred", 0) != 0 || (text.size() > 8 && text[8] != ':')) {
        std::fprintf(stderr, "emu: EMU_STREAMS=%s is not 'immediate', 'deferred' or 'deferred:SEED'\n", v);
        std::exit(2);
    }
    r.mode = StreamMode::deferred;
    if (text.size() > 9) {
        char* end = nullptr;
        r.seed = std::strtoull(text.c_str() + 9, &end, 10);
        if (*end != '\0') {
            std::fprintf(stderr, "emu: EMU_STREAMS=%s: the seed is not a number\n", v);
            std::exit(2);
        }
    }
    return r;
}
const Settings& settings() {
    static const Settings s = read_settings();
    return s;
}
// Checked when the program starts, before it writes anything (a log): a bad value stops it at once.
// Only checked: the settings are still read at their first use, so a test may set them in main().
[[maybe_unused]] const bool kSettingsCheckedAtStart = (read_settings(), true);

struct Engine {
    std::recursive_mutex m;
    std::vector<CUstream_st*> streams;  // by id; null once destroyed; 0 is the legacy default stream
    CUstream_st legacy{0, 0, 0, true, {}, 0, 0, {}};
    Clock host;  // what the host has synchronized with
    std::mt19937_64 rng{settings().seed};
    Engine() { streams.push_back(&legacy); }
};
Engine& engine() {
    static Engine* e = new Engine;  // never destroyed: work left queued at exit is dropped
    return *e;
}

CUstream_st* resolve(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &engine().legacy;
    return s;
}
bool blocking(const CUstream_st* s) { return !s->legacy && !(s->flags & cudaStreamNonBlocking); }
bool met(const Dep& d) {
    const CUstream_st* s = engine().streams[d.stream];
    return !s || s->done >= d.upto;  // a destroyed stream ran all its work first
}

void run_front(CUstream_st* s) {
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    if (op.run) op.run();
    ++s->done;
}

// Runs work until stream `target` has run its first `upto` works.
void run_until(CUstream_st* target, uint64_t upto) {
    Engine& e = engine();
    std::vector<std::pair<CUstream_st*, uint64_t>> need{{target, upto}};
    std::vector<CUstream_st*> ready;
    const auto require = [&need](CUstream_st* s, uint64_t n) {
        for (auto& [t, k] : need)
            if (t == s) {
                k = std::max(k, n);
                return;
            }
        need.push_back({s, n});
    };
    for (;;) {
        ready.clear();
        bool pending = false;
        for (size_t i = 0; i < need.size(); ++i) {  // grows as the fronts' dependencies are added
            CUstream_st* s = need[i].first;
            if (s->done >= need[i].second) continue;
            pending = true;
            bool runnable = true;
            for (const Dep& d : s->queue.front().deps)
                if (!met(d)) {
                    runnable = false;
                    require(e.streams[d.stream], d.upto);
                }
            if (runnable) ready.push_back(s);
        }
        if (!pending) return;
        if (ready.empty()) fatal("streams wait on each other in a cycle (an internal error of emu)");
        const bool shuffle = settings().mode == StreamMode::deferred;
        run_front(ready[shuffle ? e.rng() % ready.size() : 0]);
    }
}

void check_not_in_group(const char* fn) {
    if (nccl_group_depth() > 0)
        fatal(std::string(fn) + " inside ncclGroupStart/ncclGroupEnd: the group's NCCL operations are not issued until "
                                "ncclGroupEnd, so a blocking call there can wait forever on a GPU");
}

// Queues work on s with an optional extra dependency (an event waited on) and its clock.
void enqueue(CUstream_st* s, StreamWork work, RunAt at, const Dep* wait, const Clock* wait_clock) {
    Engine& e = engine();
    Op op;
    op.run = std::move(work.run);
    s->clock.join(e.host);
    if (wait) {
        s->clock.join(*wait_clock);
        if (!met(*wait)) op.deps.push_back(*wait);
    }
    // The legacy default stream waits for all work on blocking streams, and they wait for it.
    if (s->legacy) {
        for (CUstream_st* t : e.streams)
            if (t && blocking(t)) {
                s->clock.join(t->clock);
                if (t->done < t->issued) op.deps.push_back({t->id, t->issued});
            }
    } else if (blocking(s)) {
        s->clock.join(e.legacy.clock);
        if (e.legacy.done < e.legacy.issued) op.deps.push_back({0, e.legacy.issued});
    }
    if (s->clock.c.size() <= s->id) s->clock.c.resize(s->id + 1, 0);
    ++s->clock.c[s->id];
    if (settings().mode == StreamMode::deferred && !work.accesses.empty())
        check_accesses(s->id, s->clock, work.what, work.accesses);
    s->queue.push_back(std::move(op));
    ++s->issued;
    if (at == RunAt::now || (at == RunAt::by_mode && settings().mode == StreamMode::immediate)) run_until(s, s->issued);
}

CUstream_st* make_stream(unsigned flags, int priority) {
    Engine& e = engine();
    std::lock_guard<std::recursive_mutex> lock(e.m);
    auto* s = new CUstream_st{flags, priority, e.streams.size(), false, {}, 0, 0, {}};
    e.streams.push_back(s);
    return s;
}

}  // namespace

StreamMode stream_mode() { return settings().mode; }

void submit(cudaStream_t s, StreamWork work, RunAt at) {
    std::lock_guard<std::recursive_mutex> lock(engine().m);
    enqueue(resolve(s), std::move(work), at, nullptr, nullptr);
}

void synchronize_stream(cudaStream_t stream) {
    Engine& e = engine();
    std::lock_guard<std::recursive_mutex> lock(e.m);
    CUstream_st* s = resolve(stream);
    run_until(s, s->issued);
    e.host.join(s->clock);
}

void synchronize_device() {
    Engine& e = engine();
    std::lock_guard<std::recursive_mutex> lock(e.m);
    // One pass over a shuffled order of the streams; each run_until picks at random inside.
    std::vector<CUstream_st*> order;
    for (CUstream_st* s : e.streams)
        if (s) order.push_back(s);
    if (settings().mode == StreamMode::deferred) std::shuffle(order.begin(), order.end(), e.rng);
    for (CUstream_st* s : order) {
        run_until(s, s->issued);
        e.host.join(s->clock);
    }
}

}  // namespace emu

using emu::engine;

extern "C" {

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned flags, int priority) {
    if (const cudaError_t e = emu::device_use("cudaStreamCreate")) return e;
    *s = emu::make_stream(flags, priority);
    return emu::sticky_error();
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) { return cudaStreamCreateWithPriority(s, flags, 0); }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithPriority(s, 0, 0); }
// The stream's work still runs (now), as a GPU finishes it after the stream is destroyed.
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) return cudaErrorInvalidResourceHandle;
    std::lock_guard<std::recursive_mutex> lock(engine().m);
    emu::run_until(s, s->issued);
    engine().streams[s->id] = nullptr;
    delete s;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    emu::check_not_in_group("cudaStreamSynchronize");
    emu::synchronize_stream(s);
    return emu::sticky_error();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {  // runs the stream's work: the answer is then "done"
    emu::synchronize_stream(s);
    return emu::sticky_error();
}
cudaError_t cudaDeviceSynchronize(void) {
    emu::check_not_in_group("cudaDeviceSynchronize");
    emu::synchronize_device();
    return emu::sticky_error();
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    if (!e) {
        emu::set_launch_error(cudaErrorInvalidResourceHandle, "emu: cudaStreamWaitEvent on a null event");
        return cudaErrorInvalidResourceHandle;
    }
    std::lock_guard<std::recursive_mutex> lock(engine().m);
    if (!e->recorded) return emu::sticky_error();  // waiting for an event never recorded waits for nothing
    const emu::Dep wait{e->stream, e->upto};
    emu::enqueue(emu::resolve(s), {}, emu::RunAt::by_mode, &wait, &e->clock);
    return emu::sticky_error();
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
    if (const cudaError_t err = emu::device_use("cudaEventCreate")) return err;
    *e = new CUevent_st;
    (*e)->flags = flags;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;  // a record still queued writes its own time slot, not the event
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
    if (!e) {
        emu::set_launch_error(cudaErrorInvalidResourceHandle, "emu: cudaEventRecord on a null event");
        return cudaErrorInvalidResourceHandle;
    }
    std::lock_guard<std::recursive_mutex> lock(engine().m);
    CUstream_st* s = emu::resolve(stream);
    auto when = std::make_shared<std::chrono::steady_clock::time_point>();
    emu::StreamWork w;
    w.run = [when] { *when = std::chrono::steady_clock::now(); };
    emu::enqueue(s, std::move(w), emu::RunAt::by_mode, nullptr, nullptr);
    e->recorded = true;
    e->stream = s->id;
    e->upto = s->issued;
    e->clock = s->clock;
    e->when = when;
    return emu::sticky_error();
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned) { return cudaEventRecord(e, s); }

namespace {
// Runs the event's stream up to its last record; the host then knows what the event covers.
void complete(cudaEvent_t e) {
    emu::Engine& en = engine();
    std::lock_guard<std::recursive_mutex> lock(en.m);
    if (!e->recorded) return;
    if (CUstream_st* s = en.streams[e->stream]) emu::run_until(s, e->upto);
    en.host.join(e->clock);
}
}  // namespace

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    emu::check_not_in_group("cudaEventSynchronize");
    if (!e) return cudaErrorInvalidResourceHandle;
    complete(e);
    return emu::sticky_error();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {  // runs what the event waits for: the answer is then "done"
    if (!e) return cudaErrorInvalidResourceHandle;
    complete(e);
    return emu::sticky_error();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start || !end || !start->recorded || !end->recorded) {
        emu::set_launch_error(cudaErrorInvalidResourceHandle, "emu: cudaEventElapsedTime on an event never recorded");
        return cudaErrorInvalidResourceHandle;
    }
    if ((start->flags | end->flags) & cudaEventDisableTiming) {
        emu::set_launch_error(cudaErrorInvalidResourceHandle,
                              "emu: cudaEventElapsedTime on an event created with cudaEventDisableTiming");
        return cudaErrorInvalidResourceHandle;
    }
    complete(start);
    complete(end);
    *ms = std::chrono::duration<float, std::milli>(*end->when - *start->when).count();
    return cudaSuccess;
}

}  // extern "C"
