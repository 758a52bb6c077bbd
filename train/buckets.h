// The step's communication schedule (issue 18): NorMuon's banks reduced in buckets during the
// backward, Adam's value tables reduced as the backward finishes each and an untied lm_head after
// the head's backward, and the gathers the next forward waits for. Part of train_gpt.cu, included after the layer structure (kLayers,
// has_attention, attn_index, kValueTables).
//
// A bucket is a run of whole matrices of one bank that one rank owns (updates) and whose gradients
// are all final after the same point of the backward. On a step's last micro-step each bucket is
// reduced onto its owner (ncclReduce, average) on the comms stream as soon as the backward has
// enqueued the kernel that finishes it (an event on the compute stream that the comms stream waits
// on); each rank's NorMuon update of a bank waits only for its own buckets of that bank.
//
// Ownership stays today's contiguous shards (rank r updates matrices [r, r + 1) * matrices / world):
// every matrix keeps its NorMuon math (lr multipliers by global index, c_proj's 2x, the variance
// normalization, Polar Express, cautious weight decay, each per matrix) and every rank keeps the
// optimizer state it always had (its checkpoint file's bits). A reduce-scatter per bucket would hand
// every rank a slice of each bucket, so the early buckets (the last layers) would spread over all
// ranks and each rank's state would hold other matrices; reduces onto the owner move the same bytes
// per link (a ring reduce: the buffer once; a reduce-scatter: (n-1)/n of it).
#pragma once
#include <nccl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../runtime/streams.h"

enum class Bank { attn, mlp };
constexpr Bank kBanks[] = {Bank::attn, Bank::mlp};
inline const char* bank_label(Bank b) { return b == Bank::attn ? "attn" : "mlp"; }

// The backward's points where bank gradients become final, in its order: per layer from the last,
// the MLP's (after mlp_backward), then the attention's (after the lambda-scaled weights' backward).
constexpr int kBackwardPoints = 2 * kLayers;
constexpr int backward_point(Bank b, int layer) { return 2 * (kLayers - 1 - layer) + (b == Bank::attn ? 1 : 0); }

// Per matrix of a bank (`matrices` of them), the backward point that finishes its gradient: attn
// holds [Wq; Wk; Wv; Wo] per attention layer, mlp [c_fc, c_proj] per layer and then padding that no
// kernel writes (final from the start, reduced with the first bucket).
inline std::vector<int> matrix_ready_points(Bank b, int matrices) {
    std::vector<int> ready(size_t(matrices), 0);
    for (int l = 0; l < kLayers; ++l) {
        if (b == Bank::attn && has_attention(l))
            for (int k = 0; k < 4; ++k) ready.at(size_t(4 * attn_index(l) + k)) = backward_point(b, l);
        if (b == Bank::mlp)
            for (int k = 0; k < 2; ++k) ready.at(size_t(2 * l + k)) = backward_point(b, l);
    }
    return ready;
}

struct Bucket {
    Bank bank;
    int first = 0, count = 0;  // matrices [first, first + count) of the bank
    int owner = 0;             // the rank whose shard holds them
    int ready = 0;             // the backward point after which their gradients are final
};

// Whole-matrix ownership: every rank owns the same number of whole matrices of each bank.
inline std::string ownership_error(Bank b, int matrices, int world) {
    if (world >= 1 && matrices % world == 0) return "";
    return std::string("NorMuon bank ") + bank_label(b) + " has " + std::to_string(matrices) + " matrices, which " +
           std::to_string(world) + " ranks cannot own whole (the world size must divide it)";
}

// One bank's buckets: maximal runs of consecutive matrices with one owner and one ready point.
inline std::vector<Bucket> bank_buckets(Bank b, const std::vector<int>& ready, int world) {
    const int n = static_cast<int>(ready.size()), per_rank = n / world;
    std::vector<Bucket> out;
    for (int i = 0; i < n; ++i) {
        const int owner = i / per_rank;
        if (out.empty() || out.back().owner != owner || out.back().ready != ready[size_t(i)])
            out.push_back({b, i, 0, owner, ready[size_t(i)]});
        ++out.back().count;
    }
    return out;
}

// Both banks' buckets in launch order: by ready point, a point's buckets from the highest matrix
// down (the order the backward finishes them in is the same on every rank, as NCCL requires). None
// where ownership_error() has an error.
inline std::vector<Bucket> bucket_plan(int attn_matrices, int mlp_matrices, int world) {
    std::vector<Bucket> plan;
    for (Bank b : kBanks) {
        const int n = b == Bank::attn ? attn_matrices : mlp_matrices;
        if (!ownership_error(b, n, world).empty()) return {};
        const std::vector<Bucket> bank = bank_buckets(b, matrix_ready_points(b, n), world);
        plan.insert(plan.end(), bank.begin(), bank.end());
    }
    std::stable_sort(plan.begin(), plan.end(), [](const Bucket& a, const Bucket& b) {
        return a.ready != b.ready ? a.ready < b.ready : a.first > b.first;
    });
    return plan;
}

// What is wrong with a plan for banks of these matrix counts on `world` ranks, or "": every matrix in
// exactly one bucket, each bucket within one owner's whole matrices, launched no earlier than its
// gradients are final and no later than the point that finishes them (launch order by ready point).
inline std::string bucket_plan_error(const std::vector<Bucket>& plan, int attn_matrices, int mlp_matrices, int world) {
    for (Bank b : kBanks) {
        const int n = b == Bank::attn ? attn_matrices : mlp_matrices;
        if (std::string e = ownership_error(b, n, world); !e.empty()) return e;
        const std::vector<int> ready = matrix_ready_points(b, n);
        std::vector<int> times(size_t(n), 0);
        for (const Bucket& k : plan) {
            if (k.bank != b) continue;
            const std::string where = std::string("bucket ") + bank_label(b) + "[" + std::to_string(k.first) + ", +" +
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
                return std::string("matrix ") + std::to_string(i) + " of bank " + bank_label(b) + " is in " +
                       std::to_string(times[size_t(i)]) + " buckets";
    }
    for (size_t i = 1; i < plan.size(); ++i)
        if (plan[i].ready < plan[i - 1].ready) return "buckets out of the backward's order at bucket " + std::to_string(i);
    return "";
}

// One bank's buffers on this rank, for its buckets' reductions.
struct BankBuffers {
    const bf16* grad = nullptr;  // the whole bank's gradient
    bf16* grad_shard = nullptr;  // this rank's matrices, reduced
    int64_t matrix_elems = 0;
    int matrices = 0;            // in the bank; each rank owns matrices / world of them
    cudaEvent_t own_reduced = nullptr;  // recorded on the comms stream after this rank's last bucket
};

// Adam's value tables on this rank: value_embed stacks kValueTables tables of V rows, and ranks own
// contiguous shards of its rows (Adam's state as it always was), which cut across tables.
struct TableBuffers {
    const bf16* grad = nullptr;  // the stacked tables' gradient
    bf16* grad_shard = nullptr;  // this rank's rows of the stack, reduced
    bf16* param = nullptr;       // the stacked tables
    int64_t table_rows = 0, shard_rows = 0, row_elems = 0;
    cudaEvent_t reduced = nullptr;  // recorded on the comms stream after each table's reduction
};

// Adam's lm_head on this rank. Once untied from embed its gradient is final after the head's
// backward, at the start of the backward (while tied, embed's joins it after the backward).
struct HeadBuffers {
    const bf16* grad = nullptr;
    bf16* grad_shard = nullptr;  // this rank's shard, reduced
    int64_t shard_elems = 0;
    cudaEvent_t reduced = nullptr;
};

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

// Where this rank's reductions go: its rank and world, NCCL's communicator, the comms stream, and an
// event of the optimizer's for the compute stream's gradients so far (recorded at each backward point).
struct BucketComms {
    int rank = 0, world = 1;
    ncclComm_t comm = nullptr;
    cudaStream_t comms = nullptr;
    cudaEvent_t grads_ready = nullptr;
};
// The buckets, the value tables and lm_head of a run and what launching their reductions needs (made
// by build_optimizer; the backward's hooks: reduce_final_buckets, reduce_final_table,
// reduce_final_head). One rank, or buckets never built (a model without an optimizer), reduce nothing.
struct GradBuckets {
    std::vector<Bucket> plan;
    BucketComms c;
    BankBuffers bank[2];
    TableBuffers tables;
    HeadBuffers head;
    BankBuffers& of(Bank b) { return bank[b == Bank::attn ? 0 : 1]; }
};

// This rank's last bucket of bank b in the plan (every rank owns at least one).
inline size_t last_owned_bucket(const GradBuckets& g, Bank b) {
    size_t last = 0;
    for (size_t i = 0; i < g.plan.size(); ++i)
        if (g.plan[i].bank == b && g.plan[i].owner == g.c.rank) last = i;
    return last;
}

// The backward hook: everything finishing bank b's gradients of `layer` is enqueued on s. On the
// step's last micro-step, that point's buckets start their reductions on the comms stream.
inline void reduce_final_buckets(GradBuckets& g, bool last_micro_step, Bank b, int layer, cudaStream_t s) {
    const BucketComms& c = g.c;
    if (!last_micro_step || c.world == 1) return;
    const int point = backward_point(b, layer);
    bool joined = false;
    for (size_t i = 0; i < g.plan.size(); ++i) {
        const Bucket& k = g.plan[i];
        if (k.ready != point) continue;
        if (!joined) CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
        joined = true;
        BankBuffers& buf = g.of(k.bank);
        const int64_t offset = int64_t(k.first) * buf.matrix_elems;
        const int64_t shard_begin = int64_t(c.rank) * (buf.matrices / c.world) * buf.matrix_elems;
        bf16* recv = buf.grad_shard + (k.owner == c.rank ? offset - shard_begin : 0);  // read on the owner only
        NCCL_CHECK(reduce(buf.grad + offset, recv, size_t(k.count * buf.matrix_elems), ncclBfloat16, ncclAvg, k.owner,
                          c.comm, c.comms));
        if (k.owner == c.rank && i == last_owned_bucket(g, k.bank)) CUDA_CHECK(record_event(buf.own_reduced, c.comms));
    }
}

// The backward hook of Adam's value tables: `table`'s gradient is final (its layer's backward has
// written its rows). On an Adam step's last micro-step it is reduced right away, each piece onto the
// rank that owns it (ncclReduce, average, one NCCL group), so that only layer 0's table is left for
// the end of the backward.
inline void reduce_final_table(GradBuckets& g, bool adam_final, int table, cudaStream_t s) {
    const BucketComms& c = g.c;
    const TableBuffers& t = g.tables;
    if (!adam_final || c.world == 1) return;
    CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
    NCCL_CHECK(group_start());
    for (const RowPiece& p : owned_pieces(table * t.table_rows, t.table_rows, t.shard_rows)) {
        bf16* recv = t.grad_shard + (p.owner == c.rank ? (p.first - c.rank * t.shard_rows) * t.row_elems : 0);
        NCCL_CHECK(reduce(t.grad + p.first * t.row_elems, recv, size_t(p.count * t.row_elems), ncclBfloat16, ncclAvg,
                          p.owner, c.comm, c.comms));
    }
    NCCL_CHECK(group_end());
    CUDA_CHECK(record_event(t.reduced, c.comms));
}

// The backward hook of an untied lm_head on an Adam step's last micro-step: its reduce-scatter
// (average), launched right after the head's backward, so it crosses the wire during the layers'.
inline void reduce_final_head(GradBuckets& g, bool head_final, cudaStream_t s) {
    const BucketComms& c = g.c;
    const HeadBuffers& h = g.head;
    if (!head_final || c.world == 1) return;
    CUDA_CHECK(join_stream(c.comms, c.grads_ready, s));
    NCCL_CHECK(reduce_scatter(h.grad, h.grad_shard, size_t(h.shard_elems), ncclBfloat16, ncclAvg, c.comm, c.comms));
    CUDA_CHECK(record_event(h.reduced, c.comms));
}

// Every rank's copy of `table` from its owners' updated rows (ncclBroadcast per piece, one group),
// on the comms stream.
inline void broadcast_table(const GradBuckets& g, int table) {
    const BucketComms& c = g.c;
    const TableBuffers& t = g.tables;
    NCCL_CHECK(group_start());
    for (const RowPiece& p : owned_pieces(table * t.table_rows, t.table_rows, t.shard_rows)) {
        bf16* rows = t.param + p.first * t.row_elems;
        NCCL_CHECK(broadcast(rows, rows, size_t(p.count * t.row_elems), ncclBfloat16, p.owner, c.comm, c.comms));
    }
    NCCL_CHECK(group_end());
}

// ---- the gathers the next forward waits for ----
// After the optimizer step the updated shards come back to every rank on the comms stream (all-
// gathers; the value tables by broadcasts), each followed by its event. The next forward waits for
// each where it first reads it, so the gathers overlap the forward; anything else that reads the
// parameters waits for all of them. The events are recorded once when made: a forward before any
// gather waits for nothing.
enum class Gathered { embed, bigram, lm_head, attn, mlp, value };  // value table k: value + k
constexpr int kGatherEvents = static_cast<int>(Gathered::value) + kValueTables;
struct GatherEvents {
    cudaEvent_t event[kGatherEvents] = {};
    cudaEvent_t& at(Gathered g, int table = 0) { return event[static_cast<int>(g) + table]; }
};
inline void await_gathered(GatherEvents& e, Gathered g, cudaStream_t s, int table = 0) {
    if (e.at(g, table)) CUDA_CHECK(wait_event(s, e.at(g, table)));
}
inline void await_all_gathered(GatherEvents& e, cudaStream_t s) {
    for (cudaEvent_t ev : e.event)
        if (ev) CUDA_CHECK(wait_event(s, ev));
}

// Each layer's matrices of a bank named for emu's race detector, which takes a kernel's pointer
// argument to reach to the end of the named range that holds it: the backward of a layer writes only
// its own matrices while the buckets of the layers above are in flight. (Nothing on a GPU.)
inline void name_bank_layers(const bf16* bank, int64_t matrix_elems, Bank b, int matrices, const char* what) {
    const int per_layer = b == Bank::attn ? 4 : 2;
    for (int i = 0; i < matrices; i += per_layer) {
        const std::string name = std::string(what) + "." + bank_label(b) + "[" + std::to_string(i) + ", +" +
                                 std::to_string(per_layer) + ")";
        name_device_range(bank + i * matrix_elems, size_t(per_layer * matrix_elems) * sizeof(bf16), name.c_str());
    }
}

// The run's reductions for this rank, from the optimizer's groups: the NorMuon banks (each bank's
// gradient, this rank's reduced shard, and its `reduced` event, which the bucket of its last own
// matrices records), the value tables (`table_rows` rows each) and lm_head; stops naming the bank
// when the world size cannot own whole matrices.
template <class Group>
void build_grad_buckets(GradBuckets& g, const BucketComms& c, const Group& attn, const Group& mlp, const Group& value,
                        int64_t table_rows, const Group& head) {
    g.head = {static_cast<const bf16*>(head.t.grad), static_cast<bf16*>(head.grad_shard), head.shard_elems(), head.reduced};
    g.tables = {static_cast<const bf16*>(value.t.grad), static_cast<bf16*>(value.grad_shard), static_cast<bf16*>(value.t.param),
                table_rows, value.shard_rows, value.t.row_elems, value.reduced};
    for (auto [b, q] : {std::pair<Bank, const Group*>{Bank::attn, &attn}, {Bank::mlp, &mlp}})
        g.of(b) = {static_cast<const bf16*>(q->t.grad), static_cast<bf16*>(q->grad_shard), q->t.row_elems,
                   static_cast<int>(q->t.rows), q->reduced};
    const int attn_matrices = g.of(Bank::attn).matrices, mlp_matrices = g.of(Bank::mlp).matrices;
    g.plan = bucket_plan(attn_matrices, mlp_matrices, c.world);
    if (const std::string e = bucket_plan_error(g.plan, attn_matrices, mlp_matrices, c.world); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    g.c = c;
    for (Bank b : kBanks) name_bank_layers(g.of(b).grad, g.of(b).matrix_elems, b, g.of(b).matrices, "grad");
    // each table's rows named apart for emu's race detector: the backward and forward touch one table at a
    // time while the others' reduces or broadcasts are in flight (the price: a kernel given a pointer into
    // the stack is taken to reach its table's end only, so the Adam update of a shard that crosses into the
    // next table is checked on its first table's rows)
    const TableBuffers& t = g.tables;
    for (int64_t k = 0; k < value.t.rows / table_rows; ++k)
        for (auto [base, what] : {std::pair<const bf16*, const char*>{t.grad, "grad"}, {t.param, "param"}}) {
            const std::string name = std::string(what) + ".value_embed[" + std::to_string(k) + "]";
            name_device_range(base + k * table_rows * t.row_elems, size_t(table_rows * t.row_elems) * sizeof(bf16),
                              name.c_str());
        }
}
