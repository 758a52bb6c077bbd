// Sparse exchange of the bigram-embedding gradient (upstream's "sharded_sparse" comms).
//
// The gradient G is N x C bf16 (N = bigram vocab rows); rank r owns rows [r*N/world, (r+1)*N/world)
// and updates only those. A dense reduce-scatter would move every row, but a rank's micro-batches
// touch only a few of the N rows (the rest of its G is exactly zero, as the embedding backward
// leaves it), so ranks tell one another which rows they touched and send just those.
// The gradient accumulates over an even and an odd step, and Adam steps on the odd one, so the
// touched set covers both steps. Per Adam step, in the order the training loop makes the calls:
//
//   every step, before its forward   touched.mark(host bigram ids of the micro-batch)
//   Adam step, before the forward    ex.begin(touched)      host: sorted touched rows -> the send
//                                                           list (own rows dropped) and per-rank
//                                                           counts; comms stream: upload the list;
//                                                           MPI: the count all-to-all starts
//   Adam step, after the forward     ex.exchange_indexes()  waits for the counts (the one host wait:
//                                                           the receive sizes are host data); comms
//                                                           stream: the row indexes, send/recv
//   after the backward               ex.exchange_values(grad, grad_ready)   comms stream: gathers
//                                                           the sent rows, send/recv of the rows
//   optimizer work phase             own = ex.merge(stream) stream: own slice += each source's rows,
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
// (pinned host memory, for the asynchronous upload of the send list), sized by max_touched, a
// bound on the distinct rows a rank touches between two exchanges (at most N; two steps' tokens
// per rank bound it). Nothing is allocated per step.
//
// For the step profiler (work.cuh) every call records what it enqueues: the upload (copy_h2d), each
// grouped round of sends and receives as one collective (nccl_send_recv_indexes, _values: the bytes
// this rank sends and receives), the gather and merge kernels, the event records and waits, and the
// count exchange's wait as host_sync mpi_wait. In a dry run the device work is skipped and the host
// part runs for real: the counts are exchanged over MPI, so the sizes are the step's own.
//
// Streams and lifetimes (all ordering is by events; the only host waits are the count exchange
// and the safety wait on the pinned buffer described below):
//   - the comms stream (given at construction) carries the upload, the index and value exchanges
//     and the gather of the sent rows;
//   - grad must be complete when `grad_ready` (an event the caller recorded after the last kernel
//     writing it) completes; the comms stream waits for it. Until merge()'s work is done, rows of
//     grad outside the own slice are still read by the comms stream: work issued on merge()'s
//     stream after merge() is ordered after that, other streams must wait for merge()'s stream;
//   - the pinned host buffer is written by begin() only and read by the upload begin() queues.
//     begin() waits for the previous upload before rewriting it (a wait that returns at once in
//     training: that upload ran during the previous Adam step's forward). The caller must not
//     write the buffer, and must keep it and the device buffer alive, with the comms stream and
//     merge()'s stream idle, until the exchange is destroyed;
//   - the device buffer's received rows and indexes are read by merge(); the next exchange's
//     index exchange waits (on the comms stream) for the previous merge to finish.
#pragma once
#include "common.cuh"
#include "embed.cuh"  // embedding_gather: rows of a table by index, the gather of the rows to send

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// ---- error checks for the communication libraries: a failed call names itself and exits ----
inline void nccl_check(ncclResult_t r, const char* what, const char* file, int line) {
    if (r != ncclSuccess) {
        std::fprintf(stderr, "NCCL error at %s:%d: %s: %s\n", file, line, what, ncclGetErrorString(r));
        std::exit(EXIT_FAILURE);
    }
}
#define NCCL_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)
inline void mpi_check(int rc, const char* what, const char* file, int line) {
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        std::fprintf(stderr, "MPI error at %s:%d: %s: %.*s\n", file, line, what, len, msg);
        std::exit(EXIT_FAILURE);
    }
}
#define MPI_CHECK(call) mpi_check((call), #call, __FILE__, __LINE__)

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
// Pinned host memory for the sorted touched rows (and, compacted in place, the send list).
inline size_t sparse_exchange_host_bytes(int rows, int max_touched) {
    kernel_require(rows > 0 && max_touched >= 0, "sparse_exchange_host_bytes: need rows > 0 and max_touched >= 0");
    return static_cast<size_t>(std::min(rows, max_touched)) * sizeof(int32_t);
}

// ---- the exchange ----
// One per sparsely reduced gradient; reused every Adam step. `mpi` and `nccl` must hold the same
// ranks in the same order.
class SparseRowExchange {
public:
    SparseRowExchange(int rows, int cols, int max_touched, MPI_Comm mpi, ncclComm_t nccl, cudaStream_t comms,
                      void* device_buffer, size_t device_bytes, int32_t* pinned_rows, size_t pinned_bytes)
        : rows_(rows), cols_(cols), max_touched_(std::min(max_touched, rows)), mpi_(mpi), nccl_(nccl), comms_(comms) {
        int mpi_rank = 0, mpi_world = 0;
        MPI_CHECK(MPI_Comm_rank(mpi, &mpi_rank));
        MPI_CHECK(MPI_Comm_size(mpi, &mpi_world));
        NCCL_CHECK(ncclCommUserRank(nccl, &rank_));
        NCCL_CHECK(ncclCommCount(nccl, &world_));
        kernel_require(
            mpi_rank == rank_ && mpi_world == world_,
            "SparseRowExchange: the MPI communicator (rank %d of %d) and the NCCL one (rank %d of %d) differ", mpi_rank,
            mpi_world, rank_, world_);
        layout_ = SparseExchangeLayout::make(rows, cols, world_, max_touched);
        const size_t host_bytes = sparse_exchange_host_bytes(rows, max_touched);
        kernel_require(
            (layout_.bytes == 0 || (device_buffer && is_aligned16(device_buffer))) && device_bytes >= layout_.bytes,
            "SparseRowExchange: the device buffer must be 16-byte aligned and hold %zu bytes "
            "(sparse_exchange_device_bytes), got %zu",
            layout_.bytes, device_bytes);
        kernel_require((host_bytes == 0 || pinned_rows) && pinned_bytes >= host_bytes,
                       "SparseRowExchange: the pinned host buffer must hold %zu bytes (sparse_exchange_host_bytes), "
                       "got %zu",
                       host_bytes, pinned_bytes);
        auto* base = static_cast<unsigned char*>(device_buffer);
        send_rows_ = reinterpret_cast<int32_t*>(base + layout_.send_rows);
        recv_rows_ = reinterpret_cast<int32_t*>(base + layout_.recv_rows);
        send_vals_ = reinterpret_cast<bf16*>(base + layout_.send_vals);
        recv_vals_ = reinterpret_cast<bf16*>(base + layout_.recv_vals);
        host_rows_ = pinned_rows;
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
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (phase_ == Phase::kCountsInFlight && !finalized) MPI_Wait(&counts_request_, MPI_STATUS_IGNORE);
        cudaEventDestroy(upload_done_);
        cudaEventDestroy(values_done_);
        cudaEventDestroy(merged_);
    }
    SparseRowExchange(const SparseRowExchange&) = delete;
    SparseRowExchange& operator=(const SparseRowExchange&) = delete;

    // Before the forward: takes (and clears) the touched rows, plans the sends, queues the upload of
    // the send list on the comms stream and starts the count all-to-all.
    void begin(TouchedRows& touched) {
        expect(Phase::kIdle, "begin");
        kernel_require(touched.rows() == rows_,
                       "SparseRowExchange::begin: the touched set has %d rows, the gradient %d", touched.rows(), rows_);
        kernel_require(touched.count() <= max_touched_,
                       "SparseRowExchange::begin: %d rows touched, more than max_touched %d the buffers were sized for",
                       touched.count(), max_touched_);
        if (upload_queued_) CUDA_CHECK(sync_event(upload_done_, "sparse_upload_wait"));  // the pinned buffer's lifetime
        const int n = touched.take_sorted(host_rows_, max_touched_);
        // The list is sorted, so each owner's rows are one run; the own run is cut out.
        std::vector<int>& first = send_offsets_;
        for (int r = 0; r <= world_; ++r)
            first[r] = static_cast<int>(
                std::lower_bound(host_rows_, host_rows_ + n, static_cast<int64_t>(r) * per_rank_) - host_rows_);
        const int own_begin = first[rank_], own_end = first[rank_ + 1];
        std::memmove(host_rows_ + own_begin, host_rows_ + own_end, static_cast<size_t>(n - own_end) * sizeof(int32_t));
        for (int r = 0; r < world_; ++r) send_counts_[r] = r == rank_ ? 0 : first[r + 1] - first[r];
        for (int r = rank_ + 1; r <= world_; ++r) first[r] -= own_end - own_begin;
        send_total_ = n - (own_end - own_begin);
        if (send_total_ > 0) {
            CUDA_CHECK(copy_async(send_rows_, host_rows_, static_cast<size_t>(send_total_) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, comms_));
            CUDA_CHECK(record_event(upload_done_, comms_));
            upload_queued_ = true;
        }
        MPI_CHECK(
            MPI_Ialltoall(send_counts_.data(), 1, MPI_INT, recv_counts_.data(), 1, MPI_INT, mpi_, &counts_request_));
        phase_ = Phase::kCountsInFlight;
    }

    // After the forward is queued: waits for the counts, then exchanges the row indexes on the
    // comms stream.
    void exchange_indexes() {
        expect(Phase::kCountsInFlight, "exchange_indexes");
        record_host_wait("mpi_wait");
        MPI_CHECK(MPI_Wait(&counts_request_, MPI_STATUS_IGNORE));
        recv_offsets_[0] = 0;
        for (int s = 0; s < world_; ++s) {
            const int c = recv_counts_[s];
            kernel_require(
                c >= 0 && c <= layout_.max_recv_rows_per_source && (s != rank_ || c == 0),
                "SparseRowExchange::exchange_indexes: rank %d announced %d rows for rank %d, outside [0, %d] "
                "(do all ranks use the same rows and max_touched?)",
                s, c, rank_, s == rank_ ? 0 : layout_.max_recv_rows_per_source);
            recv_offsets_[s + 1] = recv_offsets_[s] + c;
        }
        recv_total_ = recv_offsets_[world_];
        // The previous merge must be done reading the received rows before new ones land.
        if (merge_queued_) CUDA_CHECK(wait_event(comms_, merged_));
        exchange<int32_t>(send_rows_, recv_rows_, 1, ncclInt32, "nccl_send_recv_indexes");
        phase_ = Phase::kIndexesExchanged;
    }

    // After the backward: the comms stream waits for grad_ready, gathers the rows to send and
    // exchanges them. grad (N x C) is read outside the own slice until merge()'s work is done.
    void exchange_values(bf16* grad, cudaEvent_t grad_ready) {
        expect(Phase::kIndexesExchanged, "exchange_values");
        kernel_require(grad && is_aligned16(grad), "SparseRowExchange::exchange_values: grad must be 16-byte aligned");
        kernel_require(grad_ready != nullptr, "SparseRowExchange::exchange_values: grad_ready is null");
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
    // The plan, for inspection: counts per peer (own entries 0), valid after begin() (send) and
    // exchange_indexes() (receive); the sent and received row indexes on the device, peer by peer
    // in rank order, valid once the comms stream has run the upload / the index exchange.
    const std::vector<int>& send_counts() const { return send_counts_; }
    const std::vector<int>& recv_counts() const { return recv_counts_; }
    int send_total() const { return send_total_; }
    int recv_total() const { return recv_total_; }
    const int32_t* sent_rows() const { return send_rows_; }
    const int32_t* received_rows() const { return recv_rows_; }

private:
    enum class Phase { kIdle, kCountsInFlight, kIndexesExchanged, kValuesExchanged };
    static const char* phase_call(Phase p) {  // the call each phase waits for
        static const char* const kCall[] = {"begin", "exchange_indexes", "exchange_values", "merge"};
        return kCall[static_cast<int>(p)];
    }
    void expect(Phase want, const char* call) const {
        kernel_require(phase_ == want,
                       "SparseRowExchange::%s called out of order: the next call must be %s (begin, exchange_indexes, "
                       "exchange_values, merge)",
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

    int rows_, cols_, max_touched_;
    MPI_Comm mpi_;
    ncclComm_t nccl_;
    cudaStream_t comms_;
    int rank_ = 0, world_ = 1, per_rank_ = 0;
    SparseExchangeLayout layout_;
    int32_t *send_rows_ = nullptr, *recv_rows_ = nullptr, *host_rows_ = nullptr;
    bf16 *send_vals_ = nullptr, *recv_vals_ = nullptr, *grad_ = nullptr;
    std::vector<int> send_counts_, recv_counts_, send_offsets_, recv_offsets_;
    int send_total_ = 0, recv_total_ = 0;
    MPI_Request counts_request_ = MPI_REQUEST_NULL;
    cudaEvent_t upload_done_ = nullptr, values_done_ = nullptr, merged_ = nullptr;
    bool upload_queued_ = false, merge_queued_ = false;
    Phase phase_ = Phase::kIdle;
};
