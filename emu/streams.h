// emu's streams: when each stream's work runs (EMU_STREAMS), and the race detector that checks
// the program orders every pair of conflicting accesses on different streams.
//
// EMU_STREAMS=immediate (the default): work runs when it is issued, in issue order, except
// copies from or to pageable host memory, which wait for the next work on their stream or its
// next synchronization. EMU_STREAMS=deferred[:SEED]: every stream's work is queued and runs only
// when something needs it (a synchronize, a blocking copy, an event query, an NCCL call that
// depends on it); among the streams that may run, a generator seeded with SEED (default 1) picks
// which goes next. In deferred mode every access to device memory is checked at issue against
// the accesses of the other streams by vector clocks: one not ordered before it stops the program.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace emu {

enum class StreamMode { immediate, deferred };
StreamMode stream_mode();

// A byte range some work reads or writes. kToEnd: from p to the end of the buffer p points into
// (a kernel's pointer argument: its extent is unknown, so it reaches to the end of the named
// range, or else the allocation, that contains p).
constexpr size_t kToEnd = SIZE_MAX;
struct Access {
    const void* p;
    size_t bytes;
    bool write;
};

// When submitted work runs.
enum class RunAt {
    by_mode,  // at issue when immediate, when needed when deferred
    at_sync,  // when needed, in both modes (copies with pageable host memory)
    now,      // before submit returns, after all it depends on (NCCL calls, blocking copies)
};
struct StreamWork {
    std::function<std::string()> what;  // names it in messages (made only when needed)
    std::vector<Access> accesses;       // for the race detector
    std::function<void()> run;
};
void submit(cudaStream_t s, StreamWork work, RunAt at);

// Runs everything issued so far on s (and what that depends on); the host then knows it done.
void synchronize_stream(cudaStream_t s);
void synchronize_device();

// Buffers: every cudaMalloc and cudaMallocHost, and the names a program gives to ranges inside
// them (emu_name_range), which the race detector's messages use and kernel extents stop at.
enum class Memory { device, pinned, pageable };
void note_allocation(const void* p, size_t bytes, Memory kind);
// Forgets the allocation that starts at p (and the names and race records inside it), giving its
// size and kind; false when no allocation starts at p.
bool forget_allocation(const void* p, size_t* bytes, Memory* kind);
Memory memory_of(const void* p);  // pageable: neither cudaMalloc'ed nor cudaMallocHost'ed
// The allocation [*base, *base + *bytes) that holds p; false when none does.
bool find_allocation(const void* p, const void** base, size_t* bytes, Memory* kind);

// The race detector (deferred mode): checks work issued on stream `stream` whose clocks are
// `clock`, then records its accesses. Called by the stream engine.
struct Clock {
    std::vector<uint64_t> c;  // per stream id: the last work of that stream ordered before
    uint64_t at(size_t id) const { return id < c.size() ? c[id] : 0; }
    void join(const Clock& o);
};
void check_accesses(size_t stream_id, const Clock& clock, const std::function<std::string()>& what,
                    const std::vector<Access>& accesses);

// Prints "emu: <message>" and ends the process with a failure (races, misuse emu must stop on).
[[noreturn]] void fatal(const std::string& message);

// nccl.cpp: how many ncclGroupStart calls are open on this thread (blocking calls are refused there).
int nccl_group_depth();

}  // namespace emu
