// Kernel execution on the CPU. Each CUDA thread is a fiber (Boost.Context's fcontext: a
// switch is a few nanoseconds, unlike ucontext's signal-mask syscalls). A block's fibers run
// on one worker thread, in turns: a fiber runs until it reaches a barrier or a warp
// collective it must wait at, then the next runnable fiber runs. Blocks are spread over a
// pool of workers. When a whole turn makes no progress, the block has deadlocked.
#include "cuda_emu.h"
#include "runtime_state.h"

#include <boost/context/detail/fcontext.hpp>
#include <cxxabi.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <pthread.h>
#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace emu {

__thread ThreadState* t_thread = nullptr;
__thread BlockState* t_block = nullptr;

namespace {
namespace bc = boost::context::detail;

constexpr unsigned kMaxThreadsPerBlock = 1024;

size_t env_size(const char* name, size_t fallback) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    unsigned long long x = std::strtoull(v, &end, 10);
    if (*end != '\0') {
        std::fprintf(stderr, "emu: %s=%s is not a number\n", name, v);
        std::exit(2);
    }
    return static_cast<size_t>(x);
}

struct Fiber : ThreadState {
    bc::fcontext_t ctx;
    const uint64_t* wait_gen;  // blocked while *wait_gen == wait_val
    uint64_t wait_val;
    const char* waiting_at;
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

    // Called on fibers.
    void yield(Fiber* f, const uint64_t* gen, uint64_t val, const char* what) {
        f->wait_gen = gen;
        f->wait_val = val;
        f->waiting_at = what;
        bc::transfer_t t = bc::jump_fcontext(sched_, nullptr);
        sched_ = t.fctx;
    }
    [[noreturn]] void fail_on_fiber(Fiber* f, const std::string& why) {
        record_failure("thread (" + std::to_string(f->thread_idx.x) + "," + std::to_string(f->thread_idx.y) +
                       "," + std::to_string(f->thread_idx.z) + "): " + why);
        f->done = true;
        bc::jump_fcontext(sched_, nullptr);
        std::abort();  // an abandoned fiber is never resumed
    }
    Warp& warp(unsigned w) { return warps_[w]; }

    uint64_t bar_gen = 0;
    unsigned bar_arrived = 0;
    int bar_count = 0, bar_result = 0;
    const char* bar_what = nullptr;

private:
    size_t stride() const { return stack_bytes_ + page(); }
    static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
    void ensure_stacks(unsigned n);
    void run_block(Job& job, uint64_t linear_block);
    void record_failure(const std::string& why);
    static void fiber_main(bc::transfer_t t);

    size_t stack_bytes_;
    unsigned char* stacks_ = nullptr;
    unsigned stack_capacity_ = 0;
    std::vector<Fiber> fibers_;
    std::vector<Warp> warps_;
    std::vector<unsigned char> smem_;
    std::vector<unsigned> order_;
    BlockState block_{};
    bc::fcontext_t sched_ = nullptr;
    Job* job_ = nullptr;
    std::mt19937_64 rng_;
};

__thread Worker* t_worker = nullptr;

struct Settings {
    unsigned workers;
    uint64_t random_seed;  // 0: threads run in index order
    size_t stack_bytes;
};

const Settings& settings() {
    static const Settings s = [] {
        Settings r;
        // Ranks of one node share its cores: by default each takes its part of them.
        size_t local_ranks = env_size("OMPI_COMM_WORLD_LOCAL_SIZE", env_size("MPI_LOCALNRANKS", 1));
        size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
        r.workers = static_cast<unsigned>(env_size("EMU_WORKERS", std::max<size_t>(1, cores / std::max<size_t>(1, local_ranks))));
        if (r.workers == 0) r.workers = 1;
        r.random_seed = env_size("EMU_RANDOM_ORDER", 0);
        r.stack_bytes = env_size("EMU_STACK_KB", 256) * 1024;
        return r;
    }();
    return s;
}

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
    for (unsigned i = 0; i < n; ++i) mprotect(stacks_ + i * stride(), page(), PROT_NONE);  // overflow faults
    stack_capacity_ = n;
}

void Worker::fiber_main(bc::transfer_t t) {
    Worker* w = static_cast<Worker*>(t.data);
    w->sched_ = t.fctx;
    w->job_->thunk(w->job_->closure);
    static_cast<Fiber*>(t_thread)->done = true;
    bc::jump_fcontext(w->sched_, nullptr);
    std::abort();
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
    t_block = &block_;
    const unsigned n = job.threads;
    if (settings().random_seed) std::memset(smem_.data(), 0xff, job.smem_bytes);  // stale data shows as NaN

    for (unsigned w = 0; w * 32 < n; ++w) {
        Warp& wp = warps_[w];
        const unsigned count = std::min(32u, n - w * 32);
        wp.lanes = count == 32 ? 0xffffffffu : (1u << count) - 1;
        for (WarpGroup& grp : wp.groups) grp.arrived = 0;
    }
    bar_arrived = 0;
    bar_count = 0;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers_[i];
        f.thread_idx = make_uint3(i % bd.x, i / bd.x % bd.y, i / (bd.x * bd.y));
        f.lane = i % 32;
        f.warp = i / 32;
        f.wait_gen = nullptr;
        f.waiting_at = nullptr;
        f.done = false;
        unsigned char* top = stacks_ + (i + 1) * stride();
        f.ctx = bc::make_fcontext(top, stack_bytes_, &Worker::fiber_main);
    }

    const bool shuffled = settings().random_seed != 0;
    unsigned remaining = n;
    // Resumes fiber i if it can run; false if it is blocked or done. Sets `stop` on a failure.
    bool stop = false;
    auto step = [&](unsigned i) {
        Fiber& f = fibers_[i];
        if (f.done || (f.wait_gen && *f.wait_gen == f.wait_val)) return false;
        f.wait_gen = nullptr;
        t_thread = &f;
        bc::transfer_t t = bc::jump_fcontext(f.ctx, this);
        f.ctx = t.fctx;
        if (job.failed.load(std::memory_order_relaxed)) stop = true;
        if (f.done) --remaining;
        return true;
    };
    const unsigned warps = (n + 31) / 32;
    while (remaining) {
        bool progressed = false;
        if (shuffled) {
            // One warp, chosen at random, first runs as far as it can on its own (to its next block
            // barrier): a warp racing ahead of the others exposes a missing __syncthreads.
            const unsigned lead = static_cast<unsigned>(rng_() % warps), first = lead * 32;
            const unsigned last = std::min(n, first + 32);
            for (bool again = true; again && !stop;) {
                again = false;
                for (unsigned i = first; i < last && !stop; ++i) again |= step(i);
                progressed |= again;
            }
            std::shuffle(order_.begin(), order_.begin() + n, rng_);
        }
        for (unsigned k = 0; k < n && !stop; ++k) progressed |= step(shuffled ? order_[k] : k);
        if (stop) return;
        if (!progressed) {
            unsigned exited = n - remaining;
            std::unordered_map<std::string, unsigned> waiting;
            for (unsigned i = 0; i < n; ++i)
                if (!fibers_[i].done) ++waiting[fibers_[i].waiting_at];
            std::string why = "deadlock:";
            for (auto& [what, count] : waiting) why += " " + std::to_string(count) + " threads wait at " + what + ";";
            why += " " + std::to_string(exited) + " of " + std::to_string(n) + " threads have exited";
            record_failure(why);
            return;
        }
    }
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

std::string kernel_name(const void* kernel) {
    static std::mutex m;
    static std::unordered_map<const void*, std::string> names;
    std::lock_guard<std::mutex> lock(m);
    auto it = names.find(kernel);
    if (it != names.end()) return it->second;
    std::string name;
    Dl_info info{};
    if (dladdr(kernel, &info) && info.dli_sname) {
        int status = 0;
        char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        name = status == 0 && d ? d : info.dli_sname;
        std::free(d);
    } else {
        char buf[64];
        std::snprintf(buf, sizeof buf, "at %p (build with -rdynamic for names)", kernel);
        name = buf;
    }
    return names[kernel] = "'" + name + "'";
}

std::string dims(dim3 d) {
    return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

Worker& current_worker_on_fiber() { return *t_worker; }

}  // namespace

int worker_count() { return static_cast<int>(settings().workers); }

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

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, Thunk thunk,
            const void* closure) {
    (void)stream;  // every stream runs in issue order at issue time: a legal schedule of any program
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
    const size_t smem_limit = max_dynamic_smem(kernel);
    if (smem_bytes > smem_limit) {
        set_launch_error(cudaErrorInvalidValue,
                         "emu: launch of kernel " + kernel_name(kernel) + " asks for " + std::to_string(smem_bytes) +
                             " bytes of dynamic shared memory; its limit is " + std::to_string(smem_limit) +
                             " (raise it with cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))");
        return;
    }
    if (sticky_error() != cudaSuccess) return;

    Job job;
    job.kernel = kernel;
    job.thunk = thunk;
    job.closure = closure;
    job.grid = grid;
    job.block = block;
    job.smem_bytes = smem_bytes;
    job.threads = static_cast<unsigned>(threads);
    job.block_order.resize(blocks);
    std::iota(job.block_order.begin(), job.block_order.end(), uint64_t{0});
    job.seed = settings().random_seed;
    if (job.seed) {
        static std::atomic<uint64_t> launches{0};
        job.seed += launches.fetch_add(1) * 0x9E3779B97F4A7C15ull;
        std::mt19937_64 rng(job.seed);
        std::shuffle(job.block_order.begin(), job.block_order.end(), rng);
    }
    if (t_thread) {
        set_sticky_error(cudaErrorLaunchFailure, "emu: kernel launched from inside a kernel (dynamic parallelism is not emulated)");
        return;
    }
    pool().run([&job] { this_worker().run_blocks(job); });
    if (job.failed) set_sticky_error(cudaErrorLaunchFailure, job.error);
}

unsigned char* collective_slot() {
    return current_worker_on_fiber().warp(t_thread->warp).in + t_thread->lane * kSlotBytes;
}

const unsigned char* collective_arrive(const char* what, unsigned mask, Combine combine) {
    Fiber* f = static_cast<Fiber*>(t_thread);
    Worker& w = current_worker_on_fiber();
    Warp& wp = w.warp(f->warp);
    const unsigned m = mask & wp.lanes;
    if (!((m >> f->lane) & 1u))
        w.fail_on_fiber(f, std::string(what) + " with a mask that does not include the calling lane");
    WarpGroup& g = wp.groups[__builtin_ctz(m)];
    if (g.arrived == 0) {
        g.mask = m;
        g.what = what;
    } else if (g.mask != m || (g.what != what && std::strcmp(g.what, what) != 0)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "divergent warp: lane %u reached %s (mask %08x) while others wait at %s (mask %08x)",
                      f->lane, what, m, g.what, g.mask);
        w.fail_on_fiber(f, buf);
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
        w.fail_on_fiber(f, std::string("divergent block: reached ") + what + " while others wait at " + w.bar_what);
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

unsigned warp_lanes() { return current_worker_on_fiber().warp(t_thread->warp).lanes; }

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
