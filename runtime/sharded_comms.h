// The reductions the backward launches for sharded parameter groups, and the gathers the next
// forward waits for: how each kind of group (a Reduce) moves on the comms stream. Which group is
// reduced how, where its gradient is final and where the forward first reads it is the trainer's
// optimizer table; this header knows groups only as that data (GroupComms), and a model's places
// only as numbers.
//
// Buckets (a NorMuon bank): a bucket is a run of whole matrices of one bank that one rank owns
// (updates) and whose gradients are all final after the same point of the backward. On a step's last
// micro-step each bucket is reduced onto its owner (ncclReduce, average) on the comms stream as soon
// as the backward has enqueued the kernel that finishes it (an event on the compute stream that the
// comms stream waits on); each rank's update of a bank waits only for its own buckets of that bank.
//
// Ownership stays contiguous shards (rank r updates matrices [r, r + 1) * matrices / world): every
// matrix keeps its NorMuon math (lr multipliers by global index, the variance normalization, Polar
// Express, cautious weight decay, each per matrix) and every rank keeps the optimizer state it always
// had (its checkpoint file's bits). A reduce-scatter per bucket would hand every rank a slice of each
// bucket, so the early buckets (the last layers) would spread over all ranks and each rank's state
// would hold other matrices; reduces onto the owner move the same bytes per link (a ring reduce: the
// buffer once; a reduce-scatter: (n-1)/n of it).
#pragma once
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "streams.h"

// How a parameter group's gradient is reduced across ranks, and so whether it is gathered.
enum class Reduce {
    replicated,      // all-reduced (average) after the backward, a run of them in one NCCL group; never gathered
    after_backward,  // sharded by rows: reduce-scattered (average) after the backward
    at_place,        // sharded by rows: reduce-scattered (average) where the backward finishes its gradient
    buckets,         // sharded by whole matrices: reduced onto their owners in buckets during the backward
    tables,          // sharded by rows, stacked tables: each table reduced (one reduce per owner's piece) where
                     // the backward finishes it, and gathered apart (one broadcast per piece)
    sparse,          // sharded by rows: the touched rows exchanged after the backward (else after_backward)
};
inline bool is_sharded(Reduce r) { return r != Reduce::replicated; }

// ---- the bucket plan ----
// A bank as the plan sees it: its label and, per matrix, the backward point (a number in the
// backward's order) after which its gradient is final.
struct BankReady {
    const char* label;
    std::vector<int> ready;
};

struct Bucket {
    int bank = 0;              // index into the plan's banks
    int first = 0, count = 0;  // matrices [first, first + count) of the bank
    int owner = 0;             // the rank whose shard holds them
    int ready = 0;             // the backward point after which their gradients are final
};

// Whole-matrix ownership: every rank owns the same number of whole matrices of each bank.
inline std::string ownership_error(const BankReady& b, int world) {
    const int matrices = static_cast<int>(b.ready.size());
    if (world >= 1 && matrices % world == 0) return "";
    return std::string("NorMuon bank ") + b.label + " has " + std::to_string(matrices) + " matrices, which " +
           std::to_string(world) + " ranks cannot own whole (the world size must divide it)";
}

// One bank's buckets: maximal runs of consecutive matrices with one owner and one ready point.
inline std::vector<Bucket> bank_buckets(int bank, const std::vector<int>& ready, int world) {
    const int n = static_cast<int>(ready.size()), per_rank = n / world;
    std::vector<Bucket> out;
    for (int i = 0; i < n; ++i) {
        const int owner = i / per_rank;
        if (out.empty() || out.back().owner != owner || out.back().ready != ready[size_t(i)])
            out.push_back({bank, i, 0, owner, ready[size_t(i)]});
        ++out.back().count;
    }
    return out;
}

// Every bank's buckets in launch order: by ready point, a point's buckets from the highest matrix
// down (the order the backward finishes them in is the same on every rank, as NCCL requires). None
// where ownership_error() has an error.
inline std::vector<Bucket> bucket_plan(const std::vector<BankReady>& banks, int world) {
    std::vector<Bucket> plan;
    for (size_t b = 0; b < banks.size(); ++b) {
        if (!ownership_error(banks[b], world).empty()) return {};
        const std::vector<Bucket> bank = bank_buckets(static_cast<int>(b), banks[b].ready, world);
        plan.insert(plan.end(), bank.begin(), bank.end());
    }
    std::stable_sort(plan.begin(), plan.end(), [](const Bucket& a, const Bucket& b) {
        return a.ready != b.ready ? a.ready < b.ready : a.first > b.first;
    });
    return plan;
}

// What is wrong with a plan for these banks on `world` ranks, or "": every matrix in exactly one
// bucket, each bucket within one owner's whole matrices, launched no earlier than its gradients are
// final and no later than the point that finishes them (launch order by ready point).
inline std::string bucket_plan_error(const std::vector<Bucket>& plan, const std::vector<BankReady>& banks, int world) {
    for (size_t b = 0; b < banks.size(); ++b) {
        if (std::string e = ownership_error(banks[b], world); !e.empty()) return e;
        const std::vector<int>& ready = banks[b].ready;
        const int n = static_cast<int>(ready.size());
        std::vector<int> times(size_t(n), 0);
        for (const Bucket& k : plan) {
            if (k.bank != static_cast<int>(b)) continue;
            const std::string where = std::string("bucket ") + banks[b].label + "[" + std::to_string(k.first) + ", +" +
                                      std::to_string(k.count) + ")";
            if (k.count < 1 || k.first < 0 || k.first + k.count > n) return where + ": outside the bank";
            for (int i = k.first; i < k.first + k.count; ++i) {
                ++times[size_t(i)];
                if (i / (n / world) != k.owner)
                    return where + ": matrix " + std::to_string(i) + " is not owned by rank " + std::to_string(k.owner);
                if (ready[size_t(i)] > k.ready)
                    return where + ": launched at backward point " + std::to_string(k.ready) + ", before matrix " +
                           std::to_string(i) + " is final (point " + std::to_string(ready[size_t(i)]) + ")";
                if (ready[size_t(i)] < k.ready)
                    return where + ": launched at backward point " + std::to_string(k.ready) + ", later than matrix " +
                           std::to_string(i) + " is final (point " + std::to_string(ready[size_t(i)]) + ")";
            }
        }
        for (int i = 0; i < n; ++i)
            if (times[size_t(i)] != 1)
                return std::string("matrix ") + std::to_string(i) + " of bank " + banks[b].label + " is in " +
                       std::to_string(times[size_t(i)]) + " buckets";
    }
    for (size_t i = 1; i < plan.size(); ++i)
        if (plan[i].ready < plan[i - 1].ready) return "buckets out of the backward's order at bucket " + std::to_string(i);
    return "";
}

// Rows [first, first + count) of a group sharded by rows, cut where the owner changes.
struct RowPiece {
    int owner;
    int64_t first, count;
};
inline std::vector<RowPiece> owned_pieces(int64_t first, int64_t count, int64_t shard_rows) {
    std::vector<RowPiece> out;
    for (int64_t row = first; row < first + count;) {
        const int owner = static_cast<int>(row / shard_rows);
        const int64_t end = std::min(first + count, (owner + 1) * shard_rows);
        out.push_back({owner, row, end - row});
        row = end;
    }
    return out;
}

// ---- a run's groups on this rank ----
// One sharded bf16 group the backward reduces (buckets, tables, at_place), or the forward waits for:
// its place in the model (the trainer's numbering: where the backward finishes its gradient and the
// next forward first reads it), its buffers and its events.
struct GroupComms {
    const char* label = "";
    Reduce reduce = Reduce::after_backward;
    int place = -1;
    const bf16* grad = nullptr;     // the whole group's gradient
    bf16* grad_shard = nullptr;     // this rank's rows (a bank: matrices), reduced
    bf16* param = nullptr;          // the whole group
    int64_t rows = 0, shard_rows = 0, row_elems = 0;  // along dim 0 (a bank: matrices)
    int64_t piece_rows = 0;         // rows of one table (tables), of the whole group otherwise
    int bank = -1;                  // buckets: its index in the plan's banks
    bool every_step = false;        // updated every step (final on each step's last micro-step), else every other
    cudaEvent_t reduced = nullptr;  // buckets: after this rank's last bucket; tables: after each table; at_place: after it
};

// Where this rank's reductions go: its rank and world, NCCL's communicator, the comms stream, and an
// event of the optimizer's for the compute stream's gradients so far (recorded at each backward point).
struct BucketComms {
    int rank = 0, world = 1;
    ncclComm_t comm = nullptr;
    cudaStream_t comms = nullptr;
    cudaEvent_t grads_ready = nullptr;
};

// The groups the backward reduces and the bucket plan of its banks (made from the optimizer's table
// by build_optimizer). One rank, or groups never built (a model without an optimizer), reduce nothing.
struct GradBuckets {
    std::vector<Bucket> plan;
    std::vector<BankReady> banks;
    std::vector<GroupComms> group;  // in the table's order
    std::vector<int> bank_group;    // per bank: its index in `group`
    BucketComms c;
};

// This rank's last bucket of bank b in the plan (every rank owns at least one).
inline size_t last_owned_bucket(const GradBuckets& g, int b) {
    size_t last = 0;
    for (size_t i = 0; i < g.plan.size(); ++i)
        if (g.plan[i].bank == b && g.plan[i].owner == g.c.rank) last = i;
    return last;
}

// Everything finishing the gradients of backward point `point` is enqueued on s: that point's
// buckets start their reductions on the comms stream.
inline void reduce_final_buckets(GradBuckets& g, int point, cudaStream_t s) {
    const BucketComms& c = g.c;
    if (c.world == 1) return;
    bool joined = false;
    for (size_t i = 0; i < g.plan.size(); ++i) {
        const Bucket& k = g.plan[i];
        if (k.ready != point) continue;
        if (!joined) CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
        joined = true;
        const GroupComms& q = g.group[size_t(g.bank_group[size_t(k.bank)])];
        const int64_t offset = int64_t(k.first) * q.row_elems;
        const int64_t shard_begin = int64_t(c.rank) * q.shard_rows * q.row_elems;
        bf16* recv = q.grad_shard + (k.owner == c.rank ? offset - shard_begin : 0);  // read on the owner only
        NCCL_CHECK(reduce(q.grad + offset, recv, size_t(k.count * q.row_elems), ncclBfloat16, ncclAvg, k.owner, c.comm,
                          c.comms));
        if (k.owner == c.rank && i == last_owned_bucket(g, k.bank)) CUDA_CHECK(record_event(q.reduced, c.comms));
    }
}

// Table `table` of a tables group is final: reduced right away, each piece onto the rank that owns
// it (ncclReduce, average, one NCCL group), so that only the last table finished is left for the
// end of the backward.
inline void reduce_final_table(const GradBuckets& g, const GroupComms& t, int table, cudaStream_t s) {
    const BucketComms& c = g.c;
    if (c.world == 1) return;
    CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
    NCCL_CHECK(group_start());
    for (const RowPiece& p : owned_pieces(table * t.piece_rows, t.piece_rows, t.shard_rows)) {
        bf16* recv = t.grad_shard + (p.owner == c.rank ? (p.first - c.rank * t.shard_rows) * t.row_elems : 0);
        NCCL_CHECK(reduce(t.grad + p.first * t.row_elems, recv, size_t(p.count * t.row_elems), ncclBfloat16, ncclAvg,
                          p.owner, c.comm, c.comms));
    }
    NCCL_CHECK(group_end());
    CUDA_CHECK(record_event(t.reduced, c.comms));
}

// An at_place group's gradient is final: its reduce-scatter (average), launched right away, so it
// crosses the wire during the rest of the backward.
inline void reduce_final_shards(const GradBuckets& g, const GroupComms& h, cudaStream_t s) {
    const BucketComms& c = g.c;
    if (c.world == 1) return;
    CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
    NCCL_CHECK(reduce_scatter(h.grad, h.grad_shard, size_t(h.shard_rows * h.row_elems), ncclBfloat16, ncclAvg, c.comm,
                              c.comms));
    CUDA_CHECK(record_event(h.reduced, c.comms));
}

// Every rank's copy of table `table` from its owners' updated rows (ncclBroadcast per piece, one
// group), on the comms stream.
inline void broadcast_table(const GradBuckets& g, const GroupComms& t, int table) {
    const BucketComms& c = g.c;
    NCCL_CHECK(group_start());
    for (const RowPiece& p : owned_pieces(table * t.piece_rows, t.piece_rows, t.shard_rows)) {
        bf16* rows = t.param + p.first * t.row_elems;
        NCCL_CHECK(broadcast(rows, rows, size_t(p.count * t.row_elems), ncclBfloat16, p.owner, c.comm, c.comms));
    }
    NCCL_CHECK(group_end());
}

// ---- the gathers the next forward waits for ----
// After the optimizer step the updated shards come back to every rank on the comms stream (all-
// gathers; tables by broadcasts), each followed by its event. The next forward waits for each where
// it first reads it (its place), so the gathers overlap the forward; anything else that reads the
// parameters waits for all of them. The events are recorded once when made: a forward before any
// gather waits for nothing.
struct GatherEvents {
    std::vector<int> place;                       // per group of the table: where the forward first reads it (-1: none)
    std::vector<std::vector<cudaEvent_t>> event;  // per group: one per gathered piece (a table each), none if replicated
};
// Waits on s for the gathers of every group first read at `place` (its table `piece` where it has tables).
inline void await_gathered(const GatherEvents& e, int place, cudaStream_t s, int piece = 0) {
    for (size_t q = 0; q < e.place.size(); ++q)
        if (e.place[q] == place && size_t(piece) < e.event[q].size()) CUDA_CHECK(wait_event(s, e.event[q][size_t(piece)]));
}
inline void await_all_gathered(const GatherEvents& e, cudaStream_t s) {
    for (const std::vector<cudaEvent_t>& group : e.event)
        for (cudaEvent_t ev : group) CUDA_CHECK(wait_event(s, ev));
}

// The named ranges of emu's race detector, which takes a kernel's pointer argument to reach to the end
// of the named range that holds it (nothing on a GPU): each bank's matrices by `per_layer` (the
// backward of a layer writes only its own matrices while the buckets of the layers above are in
// flight), and each table of a tables group in the gradient and the parameter (the backward and the
// forward touch one table at a time while the others' reduces or broadcasts are in flight; the price:
// a kernel given a pointer into the stack is taken to reach its table's end only, so the Adam update
// of a shard that crosses into the next table is checked on its first table's rows).
inline void name_bank_layers(const GroupComms& q, int per_layer) {
    for (int64_t i = 0; i < q.rows; i += per_layer) {
        const std::string name =
            std::string("grad.") + q.label + "[" + std::to_string(i) + ", +" + std::to_string(per_layer) + ")";
        name_device_range(q.grad + i * q.row_elems, size_t(per_layer * q.row_elems) * sizeof(bf16), name.c_str());
    }
}
inline void name_tables(const GroupComms& t) {
    for (int64_t k = 0; k < t.rows / t.piece_rows; ++k)
        for (auto [base, what] : {std::pair<const bf16*, const char*>{t.grad, "grad"}, {t.param, "param"}}) {
            const std::string name = std::string(what) + "." + t.label + "[" + std::to_string(k) + "]";
            name_device_range(base + k * t.piece_rows * t.row_elems, size_t(t.piece_rows * t.row_elems) * sizeof(bf16),
                              name.c_str());
        }
}

// Makes the plan of the banks and checks it; stops naming what is wrong (a world size that cannot own
// whole matrices).
inline void build_bucket_plan(GradBuckets& g) {
    g.plan = bucket_plan(g.banks, g.c.world);
    if (const std::string e = bucket_plan_error(g.plan, g.banks, g.c.world); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
}
