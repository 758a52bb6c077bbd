// The buffers emu knows (allocations and the ranges a program names inside them: emu's one registry
// of them, which the runtime, the PTX twins' address checks and the NCCL shim all ask) and the race
// detector of deferred streams.
//
// The detector keeps, per byte range of device and pinned memory, the last write and the last
// read of each stream as epochs (stream, that stream's clock at the work, the work). Work whose
// clock does not cover an earlier conflicting epoch of another stream (write after read or
// write, read after write) is a race: nothing the program did orders the two on a GPU. This is
// the vector-clock race detection of FastTrack (Flanagan and Freund, 2009), at the granularity
// of the accesses the stream engine declares: exact ranges for copies, memsets, matmuls and NCCL
// calls, and for kernels from each pointer argument to the end of the named range (else the
// allocation) it points into.
#include "streams.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace emu {
namespace {

struct Buffer {
    size_t bytes;
    Memory kind;
};
struct Named {
    uintptr_t lo, hi;
    std::string name;
};
struct Work {  // the work behind an epoch, for messages
    std::function<std::string()> what;
    size_t stream;
};
struct Epoch {
    size_t stream;
    uint64_t clock;  // 0: none
    std::shared_ptr<const Work> work;
};
struct Segment {
    uintptr_t hi;
    Epoch write;
    std::vector<Epoch> reads;  // the last read of each stream
};

struct Registry {
    std::mutex m;
    std::map<uintptr_t, Buffer> allocations;  // ordered: an address finds its allocation
    std::atomic<uint64_t> allocations_changed{0};  // bumped by every allocation and free
    std::vector<Named> names;
    // Elementary intervals between the names' ends: each starts an interval whose innermost
    // (smallest) covering name is given by index, -1 for none. Rebuilt when names change.
    std::map<uintptr_t, int> innermost;
    bool stale = false;
    std::map<uintptr_t, Segment> shadow;  // disjoint segments by start
};
Registry& registry() {
    static Registry* r = new Registry;  // outlives every static that frees memory at exit
    return *r;
}

bool lookup(Registry& r, uintptr_t p, uintptr_t* base, Buffer* b) {
    auto it = r.allocations.upper_bound(p);
    if (it == r.allocations.begin()) return false;
    --it;
    if (p >= it->first + std::max<size_t>(it->second.bytes, 1)) return false;
    *base = it->first;
    *b = it->second;
    return true;
}

void rebuild_innermost(Registry& r) {
    r.innermost.clear();
    std::vector<uintptr_t> cuts;
    for (const Named& n : r.names) {
        cuts.push_back(n.lo);
        cuts.push_back(n.hi);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        int best = -1;
        for (size_t k = 0; k < r.names.size(); ++k) {
            const Named& n = r.names[k];
            if (n.lo <= cuts[i] && n.hi >= cuts[i + 1] && (best < 0 || n.hi - n.lo < r.names[best].hi - r.names[best].lo))
                best = static_cast<int>(k);
        }
        r.innermost[cuts[i]] = best;
    }
    if (!cuts.empty()) r.innermost[cuts.back()] = -1;
    r.stale = false;
}
const Named* named_at(Registry& r, uintptr_t p) {
    if (r.stale) rebuild_innermost(r);
    auto it = r.innermost.upper_bound(p);
    if (it == r.innermost.begin()) return nullptr;
    --it;
    return it->second < 0 ? nullptr : &r.names[it->second];
}

std::string hex(uintptr_t p) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
    return buf;
}
std::string stream_name(size_t id) { return id == 0 ? "the legacy default stream" : "stream " + std::to_string(id); }

std::string describe_bytes(Registry& r, uintptr_t lo, uintptr_t hi) {
    uintptr_t base = 0;
    Buffer b{};
    lookup(r, lo, &base, &b);
    const char* kind = b.kind == Memory::device ? "cudaMalloc" : "cudaMallocHost";
    std::string where = "bytes [" + std::to_string(lo - base) + ", " + std::to_string(hi - base) + ") of the " +
                        std::to_string(b.bytes) + "-byte " + kind + " buffer at " + hex(base);
    if (const Named* n = named_at(r, lo))
        return "'" + n->name + "' (its bytes [" + std::to_string(lo - n->lo) + ", " + std::to_string(hi - n->lo) +
               "); " + where + ")";
    return where;
}

[[noreturn]] void race(Registry& r, const Work& now, bool now_writes, const Epoch& before, bool before_wrote,
                       uintptr_t lo, uintptr_t hi) {
    fatal("race on " + describe_bytes(r, lo, hi) + ": " + now.what() + " on " + stream_name(now.stream) +
          (now_writes ? " writes" : " reads") + " it while " + before.work->what() + " on " +
          stream_name(before.stream) + (before_wrote ? " writes" : " reads") +
          " it, and nothing orders the two (a missing cudaStreamWaitEvent, event record or synchronize?)");
}

bool unordered(const Epoch& e, const Clock& clock) { return e.clock != 0 && e.clock > clock.at(e.stream); }

// Makes segment boundaries at x (splitting the segment that spans it).
void cut(std::map<uintptr_t, Segment>& shadow, uintptr_t x) {
    auto it = shadow.upper_bound(x);
    if (it == shadow.begin()) return;
    --it;
    if (it->first < x && it->second.hi > x) {
        Segment right = it->second;
        it->second.hi = x;
        shadow.emplace(x, std::move(right));
    }
}

void access(Registry& r, const std::shared_ptr<const Work>& work, const Clock& clock, uintptr_t lo, uintptr_t hi,
            bool write) {
    auto& shadow = r.shadow;
    cut(shadow, lo);
    cut(shadow, hi);
    const Epoch mine{work->stream, clock.at(work->stream), work};
    for (auto it = shadow.lower_bound(lo); it != shadow.end() && it->first < hi; ++it) {
        Segment& s = it->second;
        if (unordered(s.write, clock)) race(r, *work, write, s.write, true, it->first, s.hi);
        if (write)
            for (const Epoch& e : s.reads)
                if (unordered(e, clock)) race(r, *work, true, e, false, it->first, s.hi);
    }
    if (write) {  // one segment for the whole range: the write supersedes what was there
        shadow.erase(shadow.lower_bound(lo), shadow.lower_bound(hi));
        shadow.emplace(lo, Segment{hi, mine, {}});
        return;
    }
    uintptr_t at = lo;
    for (auto it = shadow.lower_bound(lo); at < hi;) {
        if (it == shadow.end() || it->first > at) {  // a gap nothing touched yet
            const uintptr_t end = it == shadow.end() ? hi : std::min(hi, it->first);
            it = shadow.emplace_hint(it, at, Segment{end, {}, {mine}});
            at = end;
            ++it;
            continue;
        }
        Segment& s = it->second;
        bool replaced = false;
        for (Epoch& e : s.reads)
            if (e.stream == mine.stream) e = mine, replaced = true;
        if (!replaced) s.reads.push_back(mine);
        at = s.hi;
        ++it;
    }
}

}  // namespace

void note_allocation(const void* p, size_t bytes, Memory kind) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    r.allocations[reinterpret_cast<uintptr_t>(p)] = {bytes, kind};
    ++r.allocations_changed;
}

bool forget_allocation(const void* p, size_t* bytes, Memory* kind) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
    auto it = r.allocations.find(lo);
    if (it == r.allocations.end()) return false;
    *bytes = it->second.bytes;
    *kind = it->second.kind;
    const uintptr_t hi = lo + std::max<size_t>(it->second.bytes, 1);
    r.allocations.erase(it);
    ++r.allocations_changed;
    const size_t before = r.names.size();
    r.names.erase(std::remove_if(r.names.begin(), r.names.end(), [&](const Named& n) { return n.lo >= lo && n.lo < hi; }),
                  r.names.end());
    r.stale |= r.names.size() != before;
    cut(r.shadow, lo);
    cut(r.shadow, hi);
    r.shadow.erase(r.shadow.lower_bound(lo), r.shadow.lower_bound(hi));
    return true;
}

bool find_allocation(const void* p, const void** base, size_t* bytes, Memory* kind) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    uintptr_t b = 0;
    Buffer buf{};
    if (!lookup(r, reinterpret_cast<uintptr_t>(p), &b, &buf)) return false;
    *base = reinterpret_cast<const void*>(b);
    *bytes = buf.bytes;
    *kind = buf.kind;
    return true;
}

bool in_device_allocation(const void* p, size_t bytes) {
    // The PTX twins ask for every 16-byte copy: the last device allocation found is remembered per
    // thread until the next allocation or free.
    struct Found {
        uintptr_t begin = 0, end = 0;
        uint64_t version = ~0ull;
    };
    static thread_local Found last;
    Registry& r = registry();
    const uintptr_t q = reinterpret_cast<uintptr_t>(p);
    const uint64_t version = r.allocations_changed.load(std::memory_order_acquire);
    if (last.version != version) last = Found{0, 0, version};
    if (!(q >= last.begin && q + bytes <= last.end)) {
        std::lock_guard<std::mutex> lock(r.m);
        auto it = r.allocations.upper_bound(q);
        if (it == r.allocations.begin()) return false;
        --it;
        if (it->second.kind != Memory::device) return false;
        last.begin = it->first;
        last.end = it->first + it->second.bytes;
    }
    return q >= last.begin && q + bytes <= last.end;
}

Memory memory_of(const void* p) {
    const void* base;
    size_t bytes;
    Memory kind;
    return find_allocation(p, &base, &bytes, &kind) ? kind : Memory::pageable;
}

void name_range(const void* p, size_t bytes, const char* name) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
    r.names.push_back({lo, lo + bytes, name});
    r.stale = true;
}

void check_accesses(size_t stream_id, const Clock& clock, const std::function<std::string()>& what,
                    const std::vector<Access>& accesses) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    const auto work = std::make_shared<const Work>(Work{what, stream_id});
    for (const Access& a : accesses) {
        const uintptr_t p = reinterpret_cast<uintptr_t>(a.p);
        uintptr_t base = 0;
        Buffer b{};
        if (!a.p || a.bytes == 0 || !lookup(r, p, &base, &b)) continue;  // pageable host memory is not tracked
        uintptr_t hi = base + b.bytes;
        if (a.bytes == kToEnd) {
            if (const Named* n = named_at(r, p)) hi = std::min(hi, n->hi);
        } else {
            hi = std::min(hi, p + a.bytes);
        }
        if (hi > p) access(r, work, clock, p, hi, a.write);
    }
}

void fatal(const std::string& message) {
    std::fflush(stdout);
    std::fprintf(stderr, "emu: %s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(1);
}

}  // namespace emu
