// Kernel execution on the CPU. Each CUDA thread is a fiber (on x86-64 a six-register stack
// switch of our own; elsewhere Boost.Context's fcontext; both a few nanoseconds, unlike
// ucontext's signal-mask syscalls). A block's fibers run on one worker thread, in turns: a
// fiber runs until it reaches a barrier or a warp collective it must wait at, then hands over
// directly to the next runnable fiber. Blocks are spread over a pool of workers. When a whole
// turn makes no progress, the block has deadlocked.
#include "cuda_emu.h"
#include "launch_bounds.h"
#include "poison.h"
#include "runtime_state.h"
#include "streams.h"

#if !(defined(__x86_64__) && defined(__ELF__))
#include <boost/context/detail/fcontext.hpp>
#endif
#include <cxxabi.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace emu {

__thread ThreadState* t_thread = nullptr;
__thread BlockState* t_block = nullptr;

namespace {

// ---- execution contexts: a stack to run a fiber on, and the switch between two of them ----
// A context is the state a switch left behind; jump(to, self) saves the running context at
// *self and resumes `to`. A new context starts in fiber_entry (defined with the Worker).
[[noreturn]] void fiber_entry();
#if defined(__x86_64__) && defined(__ELF__)
// The System V callee-saved registers go on the stack, the stack pointer is the context. The
// FPU control words (which Boost also saves) are left alone: no fiber changes rounding modes.
// The switch ends in `ret` (Boost pops and jumps): fibers switch from the same few call sites,
// so the return-stack predictor stays right, where a jump leaves it one entry off and every
// return after the switch mispredicts (measured: 53 ns per lane of a shuffle, 19 with `ret`).
extern "C" __attribute__((visibility("hidden"))) void emu_context_switch(void** save, void* to);
extern "C" __attribute__((visibility("hidden"))) void emu_context_start();
asm(R"(
    .text
    .p2align 4
    .globl emu_context_switch
    .hidden emu_context_switch
    .type emu_context_switch, @function
emu_context_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_context_switch, .-emu_context_switch

    .p2align 4
    .globl emu_context_start
    .hidden emu_context_start
    .type emu_context_start, @function
emu_context_start:
    endbr64
    callq *%r12
    ud2
    .size emu_context_start, .-emu_context_start
)");
using Context = void*;
// The frame emu_context_switch pops: six registers (r12 = the entry), then emu_context_start as the
// return address, leaving the stack 16-byte aligned for its call, as the ABI wants.
Context make_context(unsigned char* top, size_t) {
    void** sp = reinterpret_cast<void**>(top - 16);
    *--sp = reinterpret_cast<void*>(&emu_context_start);
    *--sp = nullptr;                                        // rbp
    *--sp = nullptr;                                        // rbx
    *--sp = reinterpret_cast<void*>(&fiber_entry);          // r12
    for (int i = 0; i < 3; ++i) *--sp = nullptr;            // r13, r14, r15
    return sp;
}
inline void jump(Context to, Context* self) { emu_context_switch(self, to); }
#else
namespace bc = boost::context::detail;
using Context = bc::fcontext_t;
// fcontext hands the resumed side the context it left; the jumper passes where that belongs.
void boost_entry(bc::transfer_t t) {
    *static_cast<Context*>(t.data) = t.fctx;
    fiber_entry();
}
Context make_context(unsigned char* top, size_t bytes) { return bc::make_fcontext(top, bytes, &boost_entry); }
inline void jump(Context to, Context* self) {
    const bc::transfer_t t = bc::jump_fcontext(to, self);
    *static_cast<Context*>(t.data) = t.fctx;
}
#endif

constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kMinStackKb = 64;  // EMU_STACK_KB's floor (measured: the trainer's kernels run in 64)

// A whole number from the environment in [lo, hi], else `fallback` when unset; anything else stops
// the program naming the variable and the range (a negative or huge worker count would abort in
// thread creation, a stack too small for the kernels' frames would crash in the first launch).
size_t env_size(const char* name, size_t fallback, size_t lo, size_t hi) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    errno = 0;
    unsigned long long x = std::strtoull(v, &end, 10);
    if (*end != '\0' || errno != 0 || v[0] == '-' || v[0] == '+' || x < lo || x > hi) {
        std::fprintf(stderr, "emu: %s=%s is not a whole number in [%zu, %zu]\n", name, v, lo, hi);
        std::exit(2);
    }
    return static_cast<size_t>(x);
}

struct Fiber : ThreadState {
    Context ctx;               // valid once started
    const uint64_t* wait_gen;  // blocked while *wait_gen == wait_val
    uint64_t wait_val;
    const char* waiting_at;
    int stack;                 // index of the stack it runs on; -1 before it starts
    bool done;
};

struct WarpGroup {  // the lanes of one mask meeting at a collective
    uint64_t gen = 0;
    unsigned arrived = 0, mask = 0;
    const char* what = nullptr;
};

struct Warp {
    unsigned lanes;          // lanes that exist (the last warp of a block may be partial)
    WarpGroup groups[32];    // keyed by the lowest lane of the mask
    alignas(16) unsigned char in[32 * kSlotBytes];
    alignas(16) unsigned char out[32 * kSlotBytes];
};

struct Job {
    const void* kernel;
    Thunk thunk;
    const void* closure;
    dim3 grid, block;
    size_t smem_bytes;
    unsigned threads;
    std::vector<uint64_t> block_order;  // linear block ids, shuffled in random mode
    std::shared_ptr<const StaticPoison> static_poison;  // what each block start poisons (poison.h)
    std::atomic<uint64_t> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;
    uint64_t seed;
};

std::string kernel_name(const void* kernel);

class Worker {
public:
    explicit Worker(size_t stack_bytes) : stack_bytes_(stack_bytes) {}
    ~Worker() {
        if (stacks_) munmap(stacks_, stack_capacity_ * stride());
    }
    void run_blocks(Job& job);

    // Called on fibers. The fiber waits while *gen == val; the next runnable fiber of the pass runs.
    void yield(Fiber* f, const uint64_t* gen, uint64_t val, const char* what) {
        f->wait_gen = gen;
        f->wait_val = val;
        f->waiting_at = what;
        Fiber* next = next_in_pass();
        jump(next ? next->ctx : sched_, &f->ctx);
        release_retired_stack();
    }
    [[noreturn]] void fail_on_fiber(Fiber* f, const std::string& why) {
        record_failure("thread (" + std::to_string(f->thread_idx.x) + "," + std::to_string(f->thread_idx.y) +
                       "," + std::to_string(f->thread_idx.z) + "): " + why);
        f->done = true;
        stop_ = true;
        jump(sched_, &f->ctx);
        std::abort();  // an abandoned fiber is never resumed
    }
    Warp& warp(unsigned w) { return warps_[w]; }

    uint64_t bar_gen = 0;
    unsigned bar_arrived = 0;
    int bar_count = 0, bar_result = 0;
    const char* bar_what = nullptr;

private:
    // Each stack has a guard page below it and a page of room above for its skew.
    size_t stride() const { return stack_bytes_ + 2 * page_; }
    // Stack tops at a different offset within the page per fiber: with page-aligned tops, every
    // fiber's hot frames would share the same few L1 sets and evict each other at every switch.
    unsigned char* stack_top(unsigned i) const { return stacks_ + (i + 1) * stride() - (i % 64) * 64; }
    void ensure_stacks(unsigned n);
    void run_block(Job& job, uint64_t linear_block);
    bool run_pass(const unsigned* fibers, unsigned count);
    void record_failure(const std::string& why);
    friend void fiber_entry();
    // The next fiber of the current pass that can run (made the current thread), or none: the
    // pass is over and the scheduler takes over. Fibers hand over to each other directly, one
    // switch per resume, in the same order a scheduler loop over the pass would resume them.
    // A fiber takes a stack from the pool when it first runs and gives it back when it exits, so
    // the threads of a kernel without barriers take turns on two stacks that stay in cache (a
    // stack per thread, each on its own pages, missed the cache and the TLB at every start).
    Fiber* next_in_pass() {
        while (++pass_pos_ < pass_count_) {
            Fiber& f = fibers_[pass_[pass_pos_]];
            if (f.done || (f.wait_gen && *f.wait_gen == f.wait_val)) continue;
            if (f.stack < 0) {
                f.stack = free_stacks_.back();
                free_stacks_.pop_back();
                f.ctx = make_context(stack_top(static_cast<unsigned>(f.stack)), stack_bytes_);
            }
            f.wait_gen = nullptr;
            t_thread = &f;
            ++pass_resumed_;
            return &f;
        }
        return nullptr;
    }
    // An exited fiber's stack is still in use until the switch away from it: whoever runs next
    // returns it to the pool.
    void release_retired_stack() {
        if (retired_stack_ >= 0) {
            free_stacks_.push_back(retired_stack_);
            retired_stack_ = -1;
        }
    }

    size_t stack_bytes_;
    const size_t page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    unsigned char* stacks_ = nullptr;
    unsigned stack_capacity_ = 0;
    std::vector<Fiber> fibers_;
    std::vector<Warp> warps_;
    std::vector<unsigned char> smem_;
    std::vector<unsigned> order_, identity_, lead_;  // passes: shuffled, index order, the lead warp
    BlockState block_{};
    uint64_t blocks_run_ = 0;
    Context sched_ = nullptr;         // the scheduler's resume point (on the worker's own stack)
    const unsigned* pass_ = nullptr;  // the pass in progress: fiber indices in resume order
    unsigned pass_count_ = 0, pass_resumed_ = 0;
    int64_t pass_pos_ = 0;
    unsigned remaining_ = 0;        // fibers of the block not yet done
    std::vector<int> free_stacks_;  // stacks no fiber runs on; the next to hand out last
    int retired_stack_ = -1;        // the stack of the fiber that just exited
    bool stop_ = false;             // a fiber failed: abandon the block
    Job* job_ = nullptr;
    std::mt19937_64 rng_;
};

__thread Worker* t_worker = nullptr;

struct Settings {
    unsigned workers;
    uint64_t random_seed;  // 0: threads run in index order
    size_t stack_bytes;
    bool profile;
};

Settings read_settings() {
    Settings r;
    // Ranks of one node share its cores: by default each takes its part of them.
    constexpr size_t kMany = size_t(1) << 20;
    size_t local_ranks = env_size("OMPI_COMM_WORLD_LOCAL_SIZE", env_size("MPI_LOCALNRANKS", 1, 1, kMany), 1, kMany);
    size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
    r.workers = static_cast<unsigned>(env_size("EMU_WORKERS", std::max<size_t>(1, cores / local_ranks), 1, 1024));
    r.random_seed = read_random_order_seed();
    // the kernels' deepest frames fit in 64 KiB with room to spare; 64 MiB per fiber is plenty
    r.stack_bytes = env_size("EMU_STACK_KB", 256, kMinStackKb, 65536) * 1024;
    r.profile = env_size("EMU_PROFILE", 0, 0, 1) != 0;
    return r;
}
const Settings& settings() {
    static const Settings s = read_settings();
    return s;
}
// Checked when the program starts, before it writes anything (a log): a bad value stops it at once.
// Only checked: the settings are still read at their first use, so a test may set them in main().
[[maybe_unused]] const bool kSettingsCheckedAtStart = (read_settings(), true);

Worker& this_worker() {
    static thread_local std::unique_ptr<Worker> w;
    if (!w) {
        w = std::make_unique<Worker>(settings().stack_bytes);
        t_worker = w.get();
    }
    return *w;
}

void Worker::ensure_stacks(unsigned n) {
    if (n <= stack_capacity_) return;
    if (stacks_) munmap(stacks_, stack_capacity_ * stride());
    const size_t bytes = n * stride();
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        std::fprintf(stderr, "emu: cannot map %zu bytes of fiber stacks\n", bytes);
        std::exit(2);
    }
    stacks_ = static_cast<unsigned char*>(p);
    for (unsigned i = 0; i < n; ++i) mprotect(stacks_ + i * stride(), page_, PROT_NONE);  // overflow faults
    stack_capacity_ = n;
}

// Every fiber starts here: runs its CUDA thread, then hands over to the next fiber of the pass.
void fiber_entry() {
    Worker* w = t_worker;
    w->release_retired_stack();
    w->job_->thunk(w->job_->closure);
    Fiber* f = static_cast<Fiber*>(t_thread);
    f->done = true;
    --w->remaining_;
    w->retired_stack_ = f->stack;
    Fiber* next = w->next_in_pass();
    jump(next ? next->ctx : w->sched_, &f->ctx);
    std::abort();  // a finished fiber is never resumed
}

void Worker::record_failure(const std::string& why) {
    std::lock_guard<std::mutex> lock(job_->error_mutex);
    if (job_->failed.load()) return;
    const uint3 b = block_.block_idx;
    job_->error = "emu: kernel " + kernel_name(job_->kernel) + ", block (" + std::to_string(b.x) + "," +
                  std::to_string(b.y) + "," + std::to_string(b.z) + "), " + why;
    job_->failed = true;
}

void Worker::run_block(Job& job, uint64_t linear) {
    const dim3 g = job.grid, bd = job.block;
    block_.block_idx = make_uint3(static_cast<unsigned>(linear % g.x), static_cast<unsigned>(linear / g.x % g.y),
                                  static_cast<unsigned>(linear / (uint64_t(g.x) * g.y)));
    block_.block_dim = bd;
    block_.grid_dim = g;
    block_.dyn_smem = smem_.data();
    block_.dyn_smem_bytes = job.smem_bytes;
    block_.serial = ++blocks_run_;
    t_block = &block_;
    const unsigned n = job.threads;
    poison_fresh(smem_.data(), job.smem_bytes);  // what an earlier block left shows as NaN
    poison_static_shared(job.static_poison.get());

    for (unsigned w = 0; w * 32 < n; ++w) {
        Warp& wp = warps_[w];
        const unsigned count = std::min(32u, n - w * 32);
        wp.lanes = count == 32 ? 0xffffffffu : (1u << count) - 1;
        for (WarpGroup& grp : wp.groups) grp.arrived = 0;
    }
    bar_arrived = 0;
    bar_count = 0;
    uint3 idx = make_uint3(0, 0, 0);
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers_[i];
        f.thread_idx = idx;
        if (++idx.x == bd.x) {
            idx.x = 0;
            if (++idx.y == bd.y) idx.y = 0, ++idx.z;
        }
        f.lane = i % 32;
        f.warp = i / 32;
        f.slot = warps_[f.warp].in + f.lane * kSlotBytes;
        f.wait_gen = nullptr;
        f.waiting_at = nullptr;
        f.stack = -1;
        f.done = false;
    }
    // Every stack is free at a block's start (a failed block's fibers are abandoned); they are
    // handed out in index order.
    free_stacks_.resize(n);
    for (unsigned i = 0; i < n; ++i) free_stacks_[i] = static_cast<int>(n - 1 - i);
    retired_stack_ = -1;

    const bool shuffled = settings().random_seed != 0;
    remaining_ = n;
    stop_ = false;
    const unsigned warps = (n + 31) / 32;
    while (remaining_) {
        bool progressed = false;
        if (shuffled) {
            // One warp, chosen at random, first runs as far as it can on its own (to its next block
            // barrier): a warp racing ahead of the others exposes a missing __syncthreads.
            const unsigned lead = static_cast<unsigned>(rng_() % warps), first = lead * 32;
            const unsigned last = std::min(n, first + 32);
            lead_.resize(last - first);
            std::iota(lead_.begin(), lead_.end(), first);
            while (!stop_ && run_pass(lead_.data(), last - first)) progressed = true;
            std::shuffle(order_.begin(), order_.begin() + n, rng_);
        }
        if (!stop_) progressed |= run_pass(shuffled ? order_.data() : identity_.data(), n);
        if (stop_) return;
        if (!progressed) {
            unsigned exited = n - remaining_;
            std::unordered_map<std::string, unsigned> waiting;
            for (unsigned i = 0; i < n; ++i)
                if (!fibers_[i].done) ++waiting[fibers_[i].waiting_at];
            // Appended piece by piece: GCC 12 at -O3 reports "literal" + std::string&& as an
            // overlapping memcpy (a false -Wrestrict of GCC 12).
            std::string why = "deadlock:";
            for (auto& [what, count] : waiting) {
                why += ' ';
                why += std::to_string(count) + " threads wait at " + what + ";";
            }
            why += ' ';
            why += std::to_string(exited) + " of " + std::to_string(n) + " threads have exited";
            record_failure(why);
            return;
        }
    }
}

// Resumes, in the order given, each listed fiber that can run, once: each runs until it waits or
// exits, then hands over to the next. True if any ran.
bool Worker::run_pass(const unsigned* fibers, unsigned count) {
    pass_ = fibers;
    pass_count_ = count;
    pass_pos_ = -1;
    pass_resumed_ = 0;
    if (Fiber* first = next_in_pass()) {
        jump(first->ctx, &sched_);
        release_retired_stack();
    }
    return pass_resumed_ > 0;
}

void Worker::run_blocks(Job& job) {
    job_ = &job;
    const unsigned n = job.threads;
    ensure_stacks(n);
    if (fibers_.size() < n) fibers_.resize(n);
    if (warps_.size() < (n + 31) / 32) warps_.resize((n + 31) / 32);
    if (smem_.size() < job.smem_bytes) smem_.resize(job.smem_bytes);
    if (order_.size() < n) order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0u);
    if (identity_.size() < n) {
        identity_.resize(n);
        std::iota(identity_.begin(), identity_.end(), 0u);
    }
    rng_.seed(job.seed ^ reinterpret_cast<uintptr_t>(this));
    const uint64_t blocks = job.block_order.size();
    for (;;) {
        const uint64_t i = job.next_block.fetch_add(1);
        if (i >= blocks || job.failed.load()) break;
        run_block(job, job.block_order[i]);
    }
    t_thread = nullptr;
    t_block = nullptr;
    job_ = nullptr;
}

// Worker threads beyond the calling thread, woken for each parallel piece of work (a kernel's
// blocks, a GEMM's tiles): the caller and every worker run the same function, which pulls its
// share from a shared counter.
class Pool {
public:
    explicit Pool(unsigned extra) {
        for (unsigned i = 0; i < extra; ++i) threads_.emplace_back([this] { loop(); });
    }
    // A forked child has only the thread that forked: it runs everything on that thread.
    void forget_workers() { forked_ = true; }
    void run(const std::function<void()>& work) {
        std::lock_guard<std::mutex> serial(run_m_);
        const bool helpers = !threads_.empty() && !forked_;
        if (helpers) {
            std::lock_guard<std::mutex> lock(m_);
            work_ = &work;
            ++epoch_;
            busy_ = static_cast<unsigned>(threads_.size());
            cv_.notify_all();
        }
        work();
        if (helpers) {
            std::unique_lock<std::mutex> lock(m_);
            done_cv_.wait(lock, [&] { return busy_ == 0; });
            work_ = nullptr;
        }
    }

private:
    void loop() {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void()>* work;
            {
                std::unique_lock<std::mutex> lock(m_);
                cv_.wait(lock, [&] { return epoch_ != seen; });
                seen = epoch_;
                work = work_;
            }
            (*work)();
            std::lock_guard<std::mutex> lock(m_);
            if (--busy_ == 0) done_cv_.notify_one();
        }
    }
    std::vector<std::thread> threads_;
    std::mutex run_m_, m_;
    std::condition_variable cv_, done_cv_;
    const std::function<void()>* work_ = nullptr;
    uint64_t epoch_ = 0;
    unsigned busy_ = 0;
    bool forked_ = false;
};

// Never destroyed: its threads end with the process (joining them at exit would hang a forked
// child, which has none of them).
Pool& pool() {
    static Pool* p = [] {
        Pool* made = new Pool(settings().workers - 1);
        pthread_atfork(nullptr, nullptr, [] { pool().forget_workers(); });
        return made;
    }();
    return *p;
}

// The function's name without its return type, template arguments, parameters or namespaces:
// "void adam_step_kernel<float>(float*, ...)" is adam_step_kernel.
std::string plain_identifier(std::string demangled) {
    if (demangled.rfind("void ", 0) == 0) demangled.erase(0, 5);  // templates show their return type
    demangled = demangled.substr(0, demangled.find_first_of("<("));
    const size_t colons = demangled.rfind("::");
    return colons == std::string::npos ? demangled : demangled.substr(colons + 2);
}

struct KernelInfo {
    std::string name;      // demangled and quoted, for messages
    std::string symbol;    // mangled, as the GPU build's cuobjdump lists it; empty if unknown
    unsigned max_threads;  // its __launch_bounds__ (launch_bounds.h), else the device's limit
};
const KernelInfo& kernel_info(const void* kernel) {
    static std::mutex m;
    static std::unordered_map<const void*, KernelInfo> infos;
    std::lock_guard<std::mutex> lock(m);
    auto it = infos.find(kernel);
    if (it != infos.end()) return it->second;
    KernelInfo k{"", "", kMaxThreadsPerBlock};
    Dl_info info{};
    if (dladdr(kernel, &info) && info.dli_sname) {
        int status = 0;
        char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        const std::string demangled = status == 0 && d ? d : info.dli_sname;
        std::free(d);
        k.name = "'" + demangled + "'";
        k.symbol = info.dli_sname;
        const std::string id = plain_identifier(demangled);
        for (size_t i = 0; i < kLaunchBoundCount; ++i)
            if (id == kLaunchBounds[i].kernel) k.max_threads = kLaunchBounds[i].max_threads;
    } else {
        char buf[64];
        std::snprintf(buf, sizeof buf, "at %p (build with -rdynamic for names)", kernel);
        k.name = buf;
    }
    return infos.emplace(kernel, k).first->second;
}
std::string kernel_name(const void* kernel) { return kernel_info(kernel).name; }

// EMU_LAUNCH_LOG=FILE: each distinct (kernel symbol, threads per block, dynamic shared bytes) this
// process launches, appended to FILE as one line (processes may share the file), for the check of the
// GPU build's resource usage (tests/gpu_build/). Read at every launch: a test's child that plants a
// failure (test::check_fails_with) unsets it, as its kernels are emu-only and never built for the GPU.
void log_launch(const KernelInfo& k, uint64_t threads, size_t smem_bytes) {
    const char* path = std::getenv("EMU_LAUNCH_LOG");
    if (!path || !*path || k.symbol.empty()) return;
    static std::mutex m;
    static std::set<std::tuple<std::string, uint64_t, size_t>> seen;
    std::lock_guard<std::mutex> lock(m);
    if (!seen.emplace(k.symbol, threads, smem_bytes).second) return;
    const std::string line = k.symbol + " " + std::to_string(threads) + " " + std::to_string(smem_bytes) + "\n";
    const int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
        std::fprintf(stderr, "emu: EMU_LAUNCH_LOG=%s: cannot append to it\n", path);
        std::exit(2);
    }
    close(fd);
}

std::string dims(dim3 d) {
    std::string s = "(";  // appended, not "(" + std::string&&: a false -Wrestrict of GCC 12 at -O3
    s += std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
    return s;
}

Worker& current_worker_on_fiber() { return *t_worker; }

}  // namespace

int worker_count() { return static_cast<int>(settings().workers); }
uint64_t read_random_order_seed() { return env_size("EMU_RANDOM_ORDER", 0, 0, UINT64_MAX); }
uint64_t random_order_seed() { return settings().random_seed; }

void profile_since(std::chrono::steady_clock::time_point start, const std::function<std::string()>& name) {
    if (!settings().profile) return;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    struct Entry {
        double seconds = 0;
        uint64_t calls = 0;
    };
    static struct Table {  // printed when the program exits
        std::mutex m;
        std::unordered_map<std::string, Entry> rows;
        ~Table() {
            std::vector<std::pair<std::string, Entry>> sorted(rows.begin(), rows.end());
            std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
            double total = 0;
            for (const auto& r : sorted) total += r.second.seconds;
            std::fprintf(stderr, "emu profile (pid %d): %.3f s in kernels and matmuls\n%10s %6s %9s  %s\n", int(getpid()),
                         total, "seconds", "share", "calls", "kernel");
            for (const auto& r : sorted)
                std::fprintf(stderr, "%10.3f %5.1f%% %9llu  %s\n", r.second.seconds, total > 0 ? 100 * r.second.seconds / total : 0.0,
                             static_cast<unsigned long long>(r.second.calls), r.first.c_str());
        }
    } table;
    std::lock_guard<std::mutex> lock(table.m);
    Entry& e = table.rows[name()];
    e.seconds += seconds;
    e.calls += 1;
}

void parallel_for(int64_t tasks, const std::function<void(int64_t)>& task) {
    if (tasks < 2) {
        for (int64_t i = 0; i < tasks; ++i) task(i);
        return;
    }
    std::atomic<int64_t> next{0};
    pool().run([&] {
        for (int64_t i; (i = next.fetch_add(1)) < tasks;) task(i);
    });
}

namespace {
// Runs a launch's grid on the workers (when its stream gets to it).
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, Thunk thunk, const void* closure) {
    if (sticky_error() != cudaSuccess) return;
    const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
    Job job;
    job.kernel = kernel;
    job.thunk = thunk;
    job.closure = closure;
    job.grid = grid;
    job.block = block;
    job.smem_bytes = smem_bytes;
    job.threads = block.x * block.y * block.z;
    job.static_poison = static_poison_for(kernel_info(kernel).symbol);
    job.block_order.resize(blocks);
    std::iota(job.block_order.begin(), job.block_order.end(), uint64_t{0});
    job.seed = settings().random_seed;
    if (job.seed) {
        static std::atomic<uint64_t> launches{0};
        job.seed += launches.fetch_add(1) * 0x9E3779B97F4A7C15ull;
        std::mt19937_64 rng(job.seed);
        std::shuffle(job.block_order.begin(), job.block_order.end(), rng);
    }
    const auto start = std::chrono::steady_clock::now();
    pool().run([&job] { this_worker().run_blocks(job); });
    profile_since(start, [kernel] { return kernel_name(kernel); });
    if (job.failed) set_sticky_error(cudaErrorLaunchFailure, job.error);
}
}  // namespace

bool tracks_accesses() { return stream_mode() == StreamMode::deferred; }

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, Thunk thunk,
            std::shared_ptr<const void> closure, std::vector<PointerArg> pointers) {
    const uint64_t threads = uint64_t(block.x) * block.y * block.z;
    const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
    std::string bad;
    if (threads == 0 || threads > kMaxThreadsPerBlock || block.x > 1024 || block.y > 1024 || block.z > 64)
        bad = "block " + dims(block) + " is not a valid block shape (at most 1024 threads, z at most 64)";
    else if (blocks == 0 || grid.y > 65535 || grid.z > 65535)
        bad = "grid " + dims(grid) + " is not a valid grid shape";
    if (!bad.empty()) {
        set_launch_error(cudaErrorInvalidConfiguration, "emu: launch of kernel " + kernel_name(kernel) + ": " + bad);
        return;
    }
    if (device_use(("launch of kernel " + kernel_name(kernel)).c_str()) != cudaSuccess) return;
    const KernelInfo& info = kernel_info(kernel);
    if (threads > info.max_threads) {  // as the GPU refuses a launch beyond what the kernel was compiled for
        set_launch_error(cudaErrorLaunchOutOfResources,
                         "emu: launch of kernel " + info.name + " with " + std::to_string(threads) +
                             " threads per block: its __launch_bounds__ allow " + std::to_string(info.max_threads));
        return;
    }
    const size_t smem_limit = max_dynamic_smem(kernel);
    if (smem_bytes > smem_limit) {
        set_launch_error(cudaErrorInvalidValue,
                         "emu: launch of kernel " + kernel_name(kernel) + " asks for " + std::to_string(smem_bytes) +
                             " bytes of dynamic shared memory; its limit is " + std::to_string(smem_limit) +
                             " (raise it with cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))");
        return;
    }
    if (sticky_error() != cudaSuccess) return;
    log_launch(info, threads, smem_bytes);
    if (t_thread) {
        set_sticky_error(cudaErrorLaunchFailure, "emu: kernel launched from inside a kernel (dynamic parallelism is not emulated)");
        return;
    }
    StreamWork w;
    w.what = [kernel] { return "kernel " + kernel_name(kernel); };
    for (const PointerArg& a : pointers) w.accesses.push_back({a.p, kToEnd, a.written});
    w.run = [=, closure = std::move(closure)] { run_grid(kernel, grid, block, smem_bytes, thunk, closure.get()); };
    submit(stream, std::move(w), RunAt::by_mode);
}

namespace {
// The failures, out of the hot paths below so that those keep small frames.
[[noreturn, gnu::noinline, gnu::cold]] void fail_lane_not_in_mask(Worker& w, Fiber* f, const char* what) {
    w.fail_on_fiber(f, std::string(what) + " with a mask that does not include the calling lane");
}
[[noreturn, gnu::noinline, gnu::cold]] void fail_divergent_warp(Worker& w, Fiber* f, const char* what, unsigned m,
                                                              const WarpGroup& g) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "divergent warp: lane %u reached %s (mask %08x) while others wait at %s (mask %08x)",
                  f->lane, what, m, g.what, g.mask);
    w.fail_on_fiber(f, buf);
}
[[noreturn, gnu::noinline, gnu::cold]] void fail_divergent_block(Worker& w, Fiber* f, const char* what) {
    w.fail_on_fiber(f, std::string("divergent block: reached ") + what + " while others wait at " + w.bar_what);
}
}  // namespace

const unsigned char* collective_arrive(const char* what, unsigned mask, Combine combine) {
    Fiber* f = static_cast<Fiber*>(t_thread);
    Worker& w = current_worker_on_fiber();
    Warp& wp = w.warp(f->warp);
    const unsigned m = mask & wp.lanes;
    if (!((m >> f->lane) & 1u)) fail_lane_not_in_mask(w, f, what);
    WarpGroup& g = wp.groups[__builtin_ctz(m)];
    if (g.arrived == 0) {
        g.mask = m;
        g.what = what;
    } else if (g.mask != m || (g.what != what && std::strcmp(g.what, what) != 0)) {
        fail_divergent_warp(w, f, what, m, g);
    }
    if (++g.arrived == static_cast<unsigned>(__builtin_popcount(m))) {
        combine(wp.in, wp.out, m);
        g.arrived = 0;
        ++g.gen;
    } else {
        w.yield(f, &g.gen, g.gen, what);
    }
    return wp.out + f->lane * kSlotBytes;
}

int block_barrier(const char* what, int pred) {
    Fiber* f = static_cast<Fiber*>(t_thread);
    Worker& w = current_worker_on_fiber();
    const unsigned n = t_block->block_dim.x * t_block->block_dim.y * t_block->block_dim.z;
    if (w.bar_arrived == 0) {
        w.bar_what = what;
    } else if (w.bar_what != what && std::strcmp(w.bar_what, what) != 0) {
        fail_divergent_block(w, f, what);
    }
    w.bar_count += pred != 0;
    if (++w.bar_arrived == n) {
        w.bar_result = w.bar_count;
        w.bar_count = 0;
        w.bar_arrived = 0;
        ++w.bar_gen;
    } else {
        w.yield(f, &w.bar_gen, w.bar_gen, what);
    }
    return w.bar_result;
}

void wait_while_equal(const uint64_t* word, uint64_t seen, const char* what) {
    current_worker_on_fiber().yield(static_cast<Fiber*>(t_thread), word, seen, what);
}

unsigned warp_lanes() { return current_worker_on_fiber().warp(t_thread->warp).lanes; }

bool in_block_shared(const void* p, size_t bytes) {
    const auto* q = static_cast<const unsigned char*>(p);
    const BlockState& b = *t_block;
    if (q >= b.dyn_smem && q + bytes <= b.dyn_smem + b.dyn_smem_bytes) return true;
    return in_static_shared(p, bytes);
}

void fail_thread(const char* why) {
    current_worker_on_fiber().fail_on_fiber(static_cast<Fiber*>(t_thread), why);
}

void shfl_combine(const unsigned char* in, unsigned char* out, unsigned mask) {
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!((mask >> lane) & 1u)) continue;
        ShflIn mine;
        std::memcpy(&mine, in + lane * kSlotBytes, sizeof mine);
        // A source lane outside the mask gives an undefined value: make it loud (all ones).
        unsigned long long v = ~0ull;
        if (mine.src >= 0 && mine.src < 32 && ((mask >> mine.src) & 1u))
            std::memcpy(&v, in + mine.src * kSlotBytes, sizeof v);
        std::memcpy(out + lane * kSlotBytes, &v, sizeof v);
    }
}

void ballot_combine(const unsigned char* in, unsigned char* out, unsigned mask) {
    unsigned bits = 0;
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!((mask >> lane) & 1u)) continue;
        unsigned p;
        std::memcpy(&p, in + lane * kSlotBytes, sizeof p);
        bits |= (p != 0) << lane;
    }
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((mask >> lane) & 1u) std::memcpy(out + lane * kSlotBytes, &bits, sizeof bits);
}

}  // namespace emu
