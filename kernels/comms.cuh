// Sparse exchange of the bigram-embedding gradient (upstream's "sharded_sparse" comms).
//
// The gradient G is N x C bf16 (N = bigram vocab rows); rank r owns rows [r*N/world, (r+1)*N/world)
// and updates only those. A dense reduce-scatter would move every row, but a rank's micro-batches
// touch only a few of the N rows (the rest of its G is exactly zero, as the embedding backward
// leaves it), so each rank sends just the rows it touched to their owners.
// The gradient accumulates over an even and an odd step, and Adam steps on the odd one, so the
// touched set covers both steps.
//
// Which rows travel is known on the host before any gradient exists: the loader is deterministic,
// so every rank can read every rank's bigram ids of a micro-step (TrainLoader::advance, then fill(r)
// for each r). Every rank marks every rank's ids in its own TouchedRows (one per rank) and plans
// its exchange from them with no communication: what it sends (its touched rows outside its slice,
// owner by owner) and what it receives (each source's touched rows inside its slice). Only the
// rows' values travel, as NCCL sends and receives. Per Adam step:
//
//   every micro-step, on the host   touched[r].mark(rank r's bigram ids) for every rank r
//   Adam step, on the host          plan_sparse_exchange(touched, rank, rows, ...): counts and
//                                   row indexes (clears the sets), into pinned memory
//   before the forward              ex.begin(plan, stream)   stream: upload of the row indexes
//   after the backward              ex.exchange_values(grad, grad_ready)   comms stream: gathers
//                                                           the sent rows, send/recv of the rows
//   optimizer work phase            own = ex.merge(stream) stream: own slice += each source's rows,
//                                                           source by source in rank order, then
//                                                           own slice *= 1/world
//
// The merge is deterministic: one source's rows are distinct, so a pass over them has no races,
// and the passes run in rank order. Each add is done in fp32 and rounded to bf16 (what torch's
// bf16 index_add_ does per add, there in a racy order); the own slice is then rounded once more
// as bf16(x * (1/world)), exact for a power-of-two world. The result is the dense reduce-scatter
// average of the ranks' gradients up to those per-add roundings.
//
// Buffers are the caller's: sparse_exchange_device_bytes (device) and sparse_exchange_host_bytes
// (pinned host memory the plan's row indexes are written to, for their asynchronous upload), sized
// by max_touched, a bound on the distinct rows a rank touches between two exchanges (at most N;
// two steps' tokens per rank bound it). Nothing is allocated per step.
//
// For the step profiler (work.cuh) every call records what it enqueues: the upload (copy_h2d), the
// grouped round of sends and receives as one collective (nccl_send_recv_values: the bytes this rank
// sends and receives), the gather and merge kernels, the event records and waits. No call waits on
// the host.
//
// Streams and lifetimes (all ordering is by events):
//   - begin()'s stream carries the upload of the row indexes; it first waits for the previous merge
//     (whose rows it overwrites); the pinned rows must stay unchanged until the stream has run the
//     upload (the caller records an event after begin() and waits for it before rewriting them);
//   - the comms stream (given at construction) carries the value exchange and the gather of the
//     sent rows, after the upload;
//   - grad must be complete when `grad_ready` (an event the caller recorded after the last kernel
//     writing it) completes; the comms stream waits for it. Until merge()'s work is done, rows of
//     grad outside the own slice are still read by the comms stream: work issued on merge()'s
//     stream after merge() is ordered after that, other streams must wait for merge()'s stream;
//   - the device buffer's received rows and values are read by merge().
#pragma once
#include "common.cuh"
#include "embed.cuh"  // embedding_gather: rows of a table by index, the gather of the rows to send

#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// ---- error check for NCCL: a failed call names itself and exits ----
inline void nccl_check(ncclResult_t r, const char* what, const char* file, int line) {
    if (r != ncclSuccess) {
        std::fprintf(stderr, "NCCL error at %s:%d: %s: %s\n", file, line, what, ncclGetErrorString(r));
        std::exit(EXIT_FAILURE);
    }
}
#define NCCL_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)

// ---- host: the rows touched since the last exchange ----
// One bit per row. Marking is O(ids); taking the sorted list scans N/64 words and costs O(1) per
// touched row (count-trailing-zeros), which also clears the set.
class TouchedRows {
public:
    explicit TouchedRows(int rows) : rows_(rows) {
        kernel_require(rows > 0, "TouchedRows: rows must be positive (rows=%d)", rows);
        words_.assign(static_cast<size_t>(ceil_div(rows, 64)), 0);
    }
    int rows() const { return rows_; }
    int count() const { return count_; }  // distinct rows marked since the last take_sorted

    void mark(const int32_t* ids, size_t n) {
        for (size_t k = 0; k < n; ++k) {
            const int32_t id = ids[k];
            kernel_require(id >= 0 && id < rows_, "TouchedRows::mark: id %d at position %zu is outside [0, %d)", id, k,
                           rows_);
            uint64_t& w = words_[static_cast<size_t>(id) >> 6];
            const uint64_t bit = uint64_t(1) << (id & 63);
            count_ += (w & bit) == 0;
            w |= bit;
        }
    }
    void mark(const std::vector<int32_t>& ids) { mark(ids.data(), ids.size()); }

    // Writes the marked rows in increasing order to out (room for `capacity`), clears the set,
    // and returns how many there were.
    int take_sorted(int32_t* out, int capacity) {
        kernel_require(count_ <= capacity, "TouchedRows::take_sorted: %d rows touched, room for only %d", count_,
                       capacity);
        int n = 0;
        for (size_t i = 0; i < words_.size(); ++i) {
            for (uint64_t w = words_[i]; w != 0; w &= w - 1)
                out[n++] = static_cast<int32_t>(i * 64 + static_cast<size_t>(__builtin_ctzll(w)));
            words_[i] = 0;
        }
        count_ = 0;
        return n;
    }

private:
    int rows_;
    int count_ = 0;
    std::vector<uint64_t> words_;
};

// ---- kernels: the merge of received rows and the scale of the own slice ----
constexpr int kCommsThreads = 256;

// grad[rows[i]] = bf16(grad[rows[i]] + vals[i]) for the n rows one source sent; its rows are
// distinct, so no two threads touch one element.
__global__ void add_rows_kernel(bf16* grad, const int32_t* rows, const bf16* vals, int n, int C) {
    const int packs = C / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(n) * packs) return;
    const int i = static_cast<int>(idx / packs), c = static_cast<int>(idx % packs) * 8;
    bf16* g = grad + static_cast<size_t>(rows[i]) * C + c;
    const Pack128<bf16> v = load128(vals + static_cast<size_t>(i) * C + c);
    Pack128<bf16> out = load128(g);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = __float2bfloat16(__bfloat162float(out[k]) + __bfloat162float(v[k]));
    store128(g, out);
}
// Reads the n row indexes, the n sent rows and the grad rows they land on; writes those grad rows; an
// add per element.
inline Work add_rows_work(int n, int C) {
    return Work{.name = "add_rows", .flops = 1.0 * n * C, .bytes_read = 4.0 * n + 4.0 * n * C,
                .bytes_written = 2.0 * n * C};
}
inline void add_rows(bf16* grad, const int32_t* rows, const bf16* vals, int n, int C, cudaStream_t stream) {
    kernel_require(n >= 0 && C > 0 && C % 8 == 0, "add_rows: need n >= 0 and C a positive multiple of 8 (n=%d C=%d)", n,
                   C);
    kernel_require(all_aligned16({grad, vals}), "add_rows: grad and vals must be 16-byte aligned");
    if (n == 0) return;
    const int64_t threads = static_cast<int64_t>(n) * (C / 8);
    launch(add_rows_work(n, C), add_rows_kernel, dim3(static_cast<unsigned>(ceil_div<int64_t>(threads, kCommsThreads))),
           dim3(kCommsThreads), 0, stream, grad, rows, vals, n, C);
    CUDA_CHECK_LAUNCH();
}

// ---- buffer sizes ----
// What is wrong with an exchange of an N x C gradient over `world` ranks ("" when nothing is).
inline std::string sparse_exchange_shape_error(int rows, int cols, int world, int max_touched) {
    if (world < 1) return "world must be at least 1 (world=" + std::to_string(world) + ")";
    if (rows <= 0 || rows % world != 0)
        return "rows must be a positive multiple of the world size, every rank owning as many (rows=" +
               std::to_string(rows) + " world=" + std::to_string(world) + ")";
    if (cols <= 0 || cols % 8 != 0)
        return "cols must be a positive multiple of 8: rows move in 16-byte packs (cols=" + std::to_string(cols) + ")";
    if (max_touched < 0) return "max_touched must be non-negative (max_touched=" + std::to_string(max_touched) + ")";
    return "";
}

// Where each piece lives in the device buffer (byte offsets, each 256-byte aligned), and the
// capacities behind them: a rank sends at most the rows it touched outside its own slice, and
// receives from each source at most the rows that source touched inside the own slice.
struct SparseExchangeLayout {
    int max_send_rows = 0, max_recv_rows_per_source = 0, max_recv_rows = 0;
    size_t send_rows = 0, recv_rows = 0, send_vals = 0, recv_vals = 0, bytes = 0;

    static SparseExchangeLayout make(int rows, int cols, int world, int max_touched) {
        require_shape(sparse_exchange_shape_error(rows, cols, world, max_touched), "sparse exchange");
        const int per_rank = rows / world, touched = std::min(max_touched, rows);
        SparseExchangeLayout l;
        l.max_send_rows = std::min(touched, rows - per_rank);
        l.max_recv_rows_per_source = std::min(touched, per_rank);
        l.max_recv_rows = (world - 1) * l.max_recv_rows_per_source;
        const auto piece = [&l](size_t bytes) {
            const size_t at = l.bytes;
            l.bytes += (bytes + 255) / 256 * 256;
            return at;
        };
        const size_t row_bytes = static_cast<size_t>(cols) * sizeof(bf16);
        l.send_rows = piece(static_cast<size_t>(l.max_send_rows) * sizeof(int32_t));
        l.recv_rows = piece(static_cast<size_t>(l.max_recv_rows) * sizeof(int32_t));
        l.send_vals = piece(static_cast<size_t>(l.max_send_rows) * row_bytes);
        l.recv_vals = piece(static_cast<size_t>(l.max_recv_rows) * row_bytes);
        return l;
    }
};
inline size_t sparse_exchange_device_bytes(int rows, int cols, int world, int max_touched) {
    return SparseExchangeLayout::make(rows, cols, world, max_touched).bytes;
}
// Pinned host memory for a plan's row indexes: what this rank sends, then what it receives.
inline size_t sparse_exchange_host_bytes(int rows, int world, int max_touched) {
    const SparseExchangeLayout l = SparseExchangeLayout::make(rows, 8, world, max_touched);
    return static_cast<size_t>(l.max_send_rows + l.max_recv_rows) * sizeof(int32_t);
}

// ---- the plan: who sends which rows to whom, from every rank's touched rows ----
// Counts per peer (own entries 0) and where the row indexes are: `rows` holds the send_total rows
// this rank sends (owner by owner, ascending), then the recv_total rows it receives (source by
// source, ascending), in pinned host memory for begin()'s upload.
struct SparseExchangePlan {
    std::vector<int> send_counts, recv_counts;
    const int32_t* rows = nullptr;
    int send_total = 0, recv_total = 0;
};

// Rank `rank`'s plan from touched[r], the rows rank r touched since the last exchange, for every r
// (each rank computes the same sets from the deterministic loader); takes (clears) every set.
// `rows` has room for sparse_exchange_host_bytes; `scratch` holds a sorted set in between.
inline SparseExchangePlan plan_sparse_exchange(std::vector<TouchedRows>& touched, int rank, int max_touched,
                                               int32_t* rows, std::vector<int32_t>& scratch) {
    const int world = static_cast<int>(touched.size());
    kernel_require(world >= 1 && rank >= 0 && rank < world, "plan_sparse_exchange: rank %d outside a world of %d",
                   rank, world);
    const int N = touched[0].rows(), per_rank = N / world;
    const SparseExchangeLayout l = SparseExchangeLayout::make(N, 8, world, max_touched);
    const int own_lo = rank * per_rank, own_hi = own_lo + per_rank;
    SparseExchangePlan plan;
    plan.send_counts.assign(world, 0);
    plan.recv_counts.assign(world, 0);
    plan.rows = rows;
    scratch.resize(static_cast<size_t>(std::min(max_touched, N)));
    for (int r = 0; r < world; ++r) {
        kernel_require(touched[r].rows() == N, "plan_sparse_exchange: rank %d's set has %d rows, rank 0's %d", r,
                       touched[r].rows(), N);
        const int n = touched[r].take_sorted(scratch.data(), static_cast<int>(scratch.size()));
        const int32_t *lo = std::lower_bound(scratch.data(), scratch.data() + n, own_lo),
                      *hi = std::lower_bound(scratch.data(), scratch.data() + n, own_hi);
        if (r == rank) {  // everything outside the own slice goes to its owner: the sorted list minus the own run
            int32_t* out = rows;
            for (const int32_t* p = scratch.data(); p < scratch.data() + n; ++p)
                if (p < lo || p >= hi) {
                    *out++ = *p;
                    ++plan.send_counts[*p / per_rank];
                }
            plan.send_total = static_cast<int>(out - rows);
        } else {  // source r's rows inside the own slice land here; placed after the sends below
            plan.recv_counts[r] = static_cast<int>(hi - lo);
            kernel_require(plan.recv_counts[r] <= l.max_recv_rows_per_source,
                           "plan_sparse_exchange: rank %d touched %d rows of rank %d's slice, room for %d", r,
                           plan.recv_counts[r], rank, l.max_recv_rows_per_source);
            std::copy(lo, hi, rows + l.max_send_rows + plan.recv_total);
            plan.recv_total += plan.recv_counts[r];
        }
    }
    // the received rows right after the sent ones: one upload of send_total + recv_total indexes
    std::copy(rows + l.max_send_rows, rows + l.max_send_rows + plan.recv_total, rows + plan.send_total);
    return plan;
}

// ---- the exchange ----
// One per sparsely reduced gradient; reused every Adam step.
class SparseRowExchange {
public:
    SparseRowExchange(int rows, int cols, int max_touched, ncclComm_t nccl, cudaStream_t comms, void* device_buffer,
                      size_t device_bytes)
        : rows_(rows), cols_(cols), nccl_(nccl), comms_(comms) {
        NCCL_CHECK(ncclCommUserRank(nccl, &rank_));
        NCCL_CHECK(ncclCommCount(nccl, &world_));
        layout_ = SparseExchangeLayout::make(rows, cols, world_, max_touched);
        kernel_require(
            (layout_.bytes == 0 || (device_buffer && is_aligned16(device_buffer))) && device_bytes >= layout_.bytes,
            "SparseRowExchange: the device buffer must be 16-byte aligned and hold %zu bytes "
            "(sparse_exchange_device_bytes), got %zu",
            layout_.bytes, device_bytes);
        auto* base = static_cast<unsigned char*>(device_buffer);
        send_rows_ = reinterpret_cast<int32_t*>(base + layout_.send_rows);
        recv_rows_ = reinterpret_cast<int32_t*>(base + layout_.recv_rows);
        send_vals_ = reinterpret_cast<bf16*>(base + layout_.send_vals);
        recv_vals_ = reinterpret_cast<bf16*>(base + layout_.recv_vals);
        per_rank_ = rows / world_;
        send_counts_.assign(world_, 0);
        recv_counts_.assign(world_, 0);
        send_offsets_.assign(world_ + 1, 0);
        recv_offsets_.assign(world_ + 1, 0);
        CUDA_CHECK(cudaEventCreateWithFlags(&upload_done_, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&values_done_, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&merged_, cudaEventDisableTiming));
    }
    ~SparseRowExchange() {
        cudaEventDestroy(upload_done_);
        cudaEventDestroy(values_done_);
        cudaEventDestroy(merged_);
    }
    SparseRowExchange(const SparseRowExchange&) = delete;
    SparseRowExchange& operator=(const SparseRowExchange&) = delete;

    // Before the backward: takes this step's plan (checked against the buffers' capacities) and
    // queues the upload of its row indexes on `stream`, after the previous merge.
    void begin(const SparseExchangePlan& plan, cudaStream_t stream) {
        expect(Phase::kIdle, "begin");
        kernel_require(static_cast<int>(plan.send_counts.size()) == world_ &&
                           static_cast<int>(plan.recv_counts.size()) == world_,
                       "SparseRowExchange::begin: the plan has %zu/%zu peers, the world %d", plan.send_counts.size(),
                       plan.recv_counts.size(), world_);
        send_offsets_[0] = recv_offsets_[0] = 0;
        for (int p = 0; p < world_; ++p) {
            const int s = plan.send_counts[p], r = plan.recv_counts[p];
            kernel_require(s >= 0 && r >= 0 && (p != rank_ || (s == 0 && r == 0)) && r <= layout_.max_recv_rows_per_source,
                           "SparseRowExchange::begin: the plan sends %d and receives %d rows with rank %d (rank %d, "
                           "at most %d from each source)",
                           s, r, p, rank_, layout_.max_recv_rows_per_source);
            send_counts_[p] = s;
            recv_counts_[p] = r;
            send_offsets_[p + 1] = send_offsets_[p] + s;
            recv_offsets_[p + 1] = recv_offsets_[p] + r;
        }
        send_total_ = send_offsets_[world_];
        recv_total_ = recv_offsets_[world_];
        kernel_require(send_total_ == plan.send_total && recv_total_ == plan.recv_total &&
                           send_total_ <= layout_.max_send_rows && (send_total_ + recv_total_ == 0 || plan.rows),
                       "SparseRowExchange::begin: the plan's totals (%d sent, %d received) do not match its counts "
                       "(%d, %d) or exceed the %d rows the buffers hold",
                       plan.send_total, plan.recv_total, send_total_, recv_total_, layout_.max_send_rows);
        // The previous merge (and the gather before it) must be done with the rows before new ones land.
        if (merge_queued_) CUDA_CHECK(wait_event(stream, merged_));
        if (send_total_ > 0)
            CUDA_CHECK(copy_async(send_rows_, plan.rows, static_cast<size_t>(send_total_) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream));
        if (recv_total_ > 0)
            CUDA_CHECK(copy_async(recv_rows_, plan.rows + send_total_, static_cast<size_t>(recv_total_) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream));
        CUDA_CHECK(record_event(upload_done_, stream));
        phase_ = Phase::kPlanned;
    }

    // After the backward: the comms stream waits for the upload and grad_ready, gathers the rows to
    // send and exchanges them. grad (N x C) is read outside the own slice until merge()'s work is done.
    void exchange_values(bf16* grad, cudaEvent_t grad_ready) {
        expect(Phase::kPlanned, "exchange_values");
        kernel_require(grad && is_aligned16(grad), "SparseRowExchange::exchange_values: grad must be 16-byte aligned");
        kernel_require(grad_ready != nullptr, "SparseRowExchange::exchange_values: grad_ready is null");
        CUDA_CHECK(wait_event(comms_, upload_done_));
        CUDA_CHECK(wait_event(comms_, grad_ready));
        if (send_total_ > 0) embedding_gather(send_vals_, grad, send_rows_, send_total_, cols_, comms_);
        exchange<bf16>(send_vals_, recv_vals_, static_cast<size_t>(cols_), ncclBfloat16, "nccl_send_recv_values");
        CUDA_CHECK(record_event(values_done_, comms_));
        grad_ = grad;
        phase_ = Phase::kValuesExchanged;
    }

    // On `stream`: adds the received rows into the own slice, source by source in rank order.
    // Returns the own slice (rows_per_rank() x C, in grad), summed over the ranks: the average's
    // 1/world is left to the update's read of it (AdamHyper::grad_scale), which saves a pass.
    bf16* merge(cudaStream_t stream) {
        expect(Phase::kValuesExchanged, "merge");
        CUDA_CHECK(wait_event(stream, values_done_));
        for (int s = 0; s < world_; ++s)
            add_rows(grad_, recv_rows_ + recv_offsets_[s], recv_vals_ + static_cast<size_t>(recv_offsets_[s]) * cols_,
                     recv_counts_[s], cols_, stream);
        bf16* own = grad_ + static_cast<size_t>(rank_) * per_rank_ * cols_;
        CUDA_CHECK(record_event(merged_, stream));
        merge_queued_ = true;
        phase_ = Phase::kIdle;
        return own;
    }

    int rank() const { return rank_; }
    int world() const { return world_; }
    int rows_per_rank() const { return per_rank_; }
    // The plan, for inspection: counts per peer (own entries 0), valid after begin(); the sent and
    // received row indexes on the device, peer by peer in rank order, once begin()'s stream has run
    // the upload.
    const std::vector<int>& send_counts() const { return send_counts_; }
    const std::vector<int>& recv_counts() const { return recv_counts_; }
    int send_total() const { return send_total_; }
    int recv_total() const { return recv_total_; }
    const int32_t* sent_rows() const { return send_rows_; }
    const int32_t* received_rows() const { return recv_rows_; }

private:
    enum class Phase { kIdle, kPlanned, kValuesExchanged };
    static const char* phase_call(Phase p) {  // the call each phase waits for
        static const char* const kCall[] = {"begin", "exchange_values", "merge"};
        return kCall[static_cast<int>(p)];
    }
    void expect(Phase want, const char* call) const {
        kernel_require(phase_ == want,
                       "SparseRowExchange::%s called out of order: the next call must be %s (begin, exchange_values, "
                       "merge)",
                       call, phase_call(phase_));
    }
    // One grouped round of sends and receives on the comms stream, `width` elements per row, the
    // peers' pieces at the planned offsets; empty pieces are skipped on both sides alike. Recorded as
    // one collective on every rank, an empty one too, so that the k-th collective of every rank is the same.
    template <class T>
    void exchange(const T* send, T* recv, size_t width, ncclDataType_t type, const char* name) {
        const double bytes = static_cast<double>(send_total_ + recv_total_) * width * sizeof(T);
        if (!record_op(OpKind::collective, Work{.name = name, .comm = Comm::send_recv, .comm_bytes = bytes}, comms_))
            return;
        NCCL_CHECK(ncclGroupStart());
        for (int peer = 0; peer < world_; ++peer) {
            if (peer == rank_) continue;
            if (send_counts_[peer] > 0)
                NCCL_CHECK(ncclSend(send + static_cast<size_t>(send_offsets_[peer]) * width,
                                    static_cast<size_t>(send_counts_[peer]) * width, type, peer, nccl_, comms_));
            if (recv_counts_[peer] > 0)
                NCCL_CHECK(ncclRecv(recv + static_cast<size_t>(recv_offsets_[peer]) * width,
                                    static_cast<size_t>(recv_counts_[peer]) * width, type, peer, nccl_, comms_));
        }
        NCCL_CHECK(ncclGroupEnd());
    }

    int rows_, cols_;
    ncclComm_t nccl_;
    cudaStream_t comms_;
    int rank_ = 0, world_ = 1, per_rank_ = 0;
    SparseExchangeLayout layout_;
    int32_t *send_rows_ = nullptr, *recv_rows_ = nullptr;
    bf16 *send_vals_ = nullptr, *recv_vals_ = nullptr, *grad_ = nullptr;
    std::vector<int> send_counts_, recv_counts_, send_offsets_, recv_offsets_;
    int send_total_ = 0, recv_total_ = 0;
    cudaEvent_t upload_done_ = nullptr, values_done_ = nullptr, merged_ = nullptr;
    bool merge_queued_ = false;
    Phase phase_ = Phase::kIdle;
};
