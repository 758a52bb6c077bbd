// kernels/comms.cuh: the sparse exchange of the bigram-embedding gradient, on every rank of the
// run (CTest: 2 and 8 ranks). Each case marks two steps' micro-batches of row ids per rank (rows
// every rank touches, rows one rank touches, rows nobody touches, ids repeated within a batch,
// ranks that touch only their own rows or nothing), builds each rank's gradient, nonzero exactly
// on its touched rows as the embedding backward leaves it, marks every rank's ids in one set per
// rank and plans this rank's exchange from them (plan_sparse_exchange: no communication), runs
// begin / exchange_values / merge as the training loop does, and checks on every rank:
//   - the send and receive counts and the sent and received row indexes, exactly, against a host
//     computation from every rank's ids;
//   - the merged own slice bit for bit against the merge's specified arithmetic done on the host
//     (own value, then each source's row added in fp32 and rounded to bf16, in rank order: the
//     sum over the ranks, which Adam reads as bf16(x * (1/world)));
//   - that slice, scaled as Adam reads it, against the exact average sum_r G_r / world (double):
//     each of the k adds and the scale round once to bf16 (relative error <= 2^-8 of a value bounded by
//     sum_r |G_r|), so the tolerance is (k + 1) * 2^-8 * sum_r |G_r| / world;
//   - the merged slice against the dense path, ncclReduceScatter with ncclAvg of the full
//     gradients: the tolerance adds world * 2^-8 * sum_r |G_r| / world for the dense side's own
//     roundings (NCCL may round partial sums to bf16 at every hop);
//   - rows outside the own slice are left as they were.
// Every rank can compute every rank's ids and gradient: they derive from rank 0's seed
// (TEST_SEED replays a run) and the case, the cycle, the step and the rank.
#include "../../kernels/comms.cuh"
#include "../bench_util.h"
#include "../device_util.h"
#include "sparse_exchange_rig.h"

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using test::DeviceBuffer;

constexpr double kBf16Eps = 1.0 / 256;  // bf16 unit roundoff: 8 significant bits, round to nearest

int g_rank = 0, g_world = 1;
uint64_t g_seed = 0;
ncclComm_t g_nccl = nullptr;
// Own-slice rows seen over the whole run, by how many ranks touched them (0 .. world): the data
// must cover rows nobody, one rank and every rank touched.
std::vector<long> g_rows_by_touchers;

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
uint64_t key(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0) { return mix(mix(mix(mix(a) ^ b) ^ c) ^ d); }

// How a case's ranks choose their rows.
enum class Pattern {
    kMixed,  // rows shared by all ranks, random rows with a band per slice nobody draws, repeats
    kRoles,  // per cycle, rank roles rotate: only own rows / nothing at all / a handful of rows
};

struct Case {
    const char* name;
    int rows, cols, ids_per_step, cycles;
    Pattern pattern;
};

// Rank r's micro-batch ids of one step, from a generator every rank seeds alike.
std::vector<int32_t> batch_ids(const Case& c, uint64_t case_key, int cycle, int step, int r) {
    const int per_rank = c.rows / g_world;
    std::mt19937_64 g(
        key(case_key, static_cast<uint64_t>(cycle), static_cast<uint64_t>(step), static_cast<uint64_t>(r)));
    const auto below = [&g](int n) { return static_cast<int>(g() % static_cast<uint64_t>(n)); };
    std::vector<int32_t> ids;
    if (c.pattern == Pattern::kRoles) {
        const int role = (r + cycle) % 3;  // 1: no rows at all
        if (role == 0)                     // only its own rows: it sends nothing
            for (int k = 0; k < c.ids_per_step; ++k) ids.push_back(r * per_rank + below(per_rank));
        if (role == 2)  // a handful anywhere
            for (int k = 0; k < 5; ++k) ids.push_back(below(c.rows));
        return ids;
    }
    if (step == 0) {  // rows every rank touches: a shared random set and the slice boundaries
        std::mt19937_64 shared(key(case_key, static_cast<uint64_t>(cycle), 0xfeed));
        for (int k = 0; k < std::max(1, c.ids_per_step / 16); ++k)
            ids.push_back(static_cast<int32_t>(shared() % static_cast<uint64_t>(c.rows)));
        ids.push_back(0);
        ids.push_back(c.rows - 1);
        for (int s = 1; s < g_world; ++s) {
            ids.push_back(s * per_rank - 1);
            ids.push_back(s * per_rank);
        }
    }
    while (static_cast<int>(ids.size()) < c.ids_per_step) {
        if (!ids.empty() && below(5) == 0) {  // a repeat within the batch
            ids.push_back(ids[below(static_cast<int>(ids.size()))]);
            continue;
        }
        const int id = below(c.rows);
        const int in_slice = id % per_rank;
        if (per_rank >= 8 && in_slice >= per_rank / 2 && in_slice < per_rank / 2 + per_rank / 4) continue;  // cold band
        ids.push_back(id);
    }
    std::shuffle(ids.begin(), ids.end(), g);
    return ids;
}

// Rank r's gradient element (row, col) on a row it touched: bf16 values of varied magnitude and sign.
float grad_value(uint64_t cycle_key, int r, int row, int col) {
    const uint64_t h = key(cycle_key, static_cast<uint64_t>(r), static_cast<uint64_t>(row));
    const double scale = std::ldexp(1.0, static_cast<int>(h % 7) - 3);
    const double u = static_cast<double>(key(h, static_cast<uint64_t>(col)) >> 40) / double(1 << 24) * 2.0 - 1.0;
    return __bfloat162float(test::to_bf16(u * scale));
}

float round_bf16f(float x) { return __bfloat162float(__float2bfloat16(x)); }

void run_case(const Case& c, int case_no) {
    const int R = c.rows, C = c.cols, W = g_world, me = g_rank, per_rank = R / W;
    const int own_lo = me * per_rank, own_hi = own_lo + per_rank;
    const int max_touched = std::min(R, 2 * c.ids_per_step);
    const uint64_t case_key = key(g_seed, static_cast<uint64_t>(case_no));
    const std::string tag = std::string(c.name) + " (rank " + std::to_string(me) + " of " + std::to_string(W) + ")";

    SparseExchangeRig rig(R, C, W, max_touched);
    cudaStream_t compute = rig.compute, comms = rig.comms;
    cudaEvent_t grad_ready = rig.grad_ready;
    const size_t n = static_cast<size_t>(R) * C;
    DeviceBuffer<bf16> d_grad(n), d_dense_in(n), d_dense(static_cast<size_t>(per_rank) * C);
    {
        std::vector<TouchedRows> touched(W, TouchedRows(R));  // every rank's rows, on every rank
        std::vector<int32_t> scratch;
        SparseRowExchange ex = rig.exchange(R, C, max_touched, g_nccl);
        for (int cycle = 0; cycle < c.cycles; ++cycle) {
            const uint64_t cycle_key = key(case_key, static_cast<uint64_t>(cycle), 0xca7);
            // Every rank's touched rows over the two steps (host reference), and the marks.
            std::vector<std::vector<char>> hit(W, std::vector<char>(R, 0));
            for (int r = 0; r < W; ++r)
                for (int step = 0; step < 2; ++step) {
                    const auto ids = batch_ids(c, case_key, cycle, step, r);
                    for (int32_t id : ids) hit[r][id] = 1;
                    touched[r].mark(ids);
                }
            int distinct = 0;
            for (int i = 0; i < R; ++i) distinct += hit[me][i];
            test::check(touched[me].count() == distinct, "%s cycle %d: %d rows marked, want %d", tag.c_str(), cycle,
                        touched[me].count(), distinct);

            // Adam step: the plan on the host, its upload before the backward, values after it.
            // The pinned rows are rewritten only after the previous cycle's streams are synchronized.
            const SparseExchangePlan plan = plan_sparse_exchange(touched, me, max_touched, rig.pinned, scratch);
            for (int r = 0; r < W; ++r)
                test::check(touched[r].count() == 0, "%s cycle %d: rank %d's set is not cleared", tag.c_str(), cycle, r);
            ex.begin(plan, compute);
            std::vector<bf16> grad(n, test::to_bf16(0.0));
            for (int i = 0; i < R; ++i)
                if (hit[me][i])
                    for (int j = 0; j < C; ++j)
                        grad[static_cast<size_t>(i) * C + j] = __float2bfloat16(grad_value(cycle_key, me, i, j));
            CUDA_CHECK(cudaMemcpyAsync(d_grad.ptr, grad.data(), n * sizeof(bf16), cudaMemcpyHostToDevice, compute));
            CUDA_CHECK(cudaEventRecord(grad_ready, compute));
            ex.exchange_values(d_grad.ptr, grad_ready);
            bf16* own = ex.merge(compute);
            test::check(own == d_grad.ptr + static_cast<size_t>(own_lo) * C,
                        "%s cycle %d: merge returned %p, not the own slice", tag.c_str(), cycle,
                        static_cast<void*>(own));
            CUDA_CHECK(cudaStreamSynchronize(comms));
            CUDA_CHECK(cudaStreamSynchronize(compute));

            // The plan: counts and indexes, exactly.
            std::vector<int> want_send(W, 0), want_recv(W, 0);
            std::vector<int32_t> want_sent, want_received;
            for (int i = 0; i < R; ++i)
                if (hit[me][i] && (i < own_lo || i >= own_hi)) {
                    ++want_send[i / per_rank];
                    want_sent.push_back(i);
                }
            for (int s = 0; s < W; ++s)
                for (int i = own_lo; i < own_hi && s != me; ++i)
                    if (hit[s][i]) {
                        ++want_recv[s];
                        want_received.push_back(i);
                    }
            test::check(ex.send_counts() == want_send, "%s cycle %d: send counts differ", tag.c_str(), cycle);
            test::check(ex.recv_counts() == want_recv, "%s cycle %d: receive counts differ", tag.c_str(), cycle);
            std::vector<int32_t> sent(static_cast<size_t>(ex.send_total())),
                received(static_cast<size_t>(ex.recv_total()));
            CUDA_CHECK(cudaMemcpy(sent.data(), ex.sent_rows(), sent.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(received.data(), ex.received_rows(), received.size() * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost));
            test::check(sent == want_sent, "%s cycle %d: sent row indexes differ (%zu, want %zu)", tag.c_str(), cycle,
                        sent.size(), want_sent.size());
            test::check(received == want_received, "%s cycle %d: received row indexes differ (%zu, want %zu)",
                        tag.c_str(), cycle, received.size(), want_received.size());

            // The merged slice (summed over the ranks): bit for bit against the merge's arithmetic, and,
            // scaled by 1/world as Adam reads it, within the rounding bound of the exact average.
            const std::vector<bf16> got = d_grad.download();
            std::vector<uint16_t> got_bits, want_bits;
            std::vector<double> got_v, exact, tol, dense_tol;
            const float inv_world = 1.0f / static_cast<float>(W);
            for (int i = own_lo; i < own_hi; ++i) {
                int adds = 0;
                for (int s = 0; s < W; ++s) adds += s != me && hit[s][i];
                ++g_rows_by_touchers[adds + hit[me][i]];
                for (int j = 0; j < C; ++j) {
                    float acc = hit[me][i] ? grad_value(cycle_key, me, i, j) : 0.0f;
                    double sum = acc, mag = std::fabs(acc);
                    for (int s = 0; s < W; ++s) {
                        if (s == me || !hit[s][i]) continue;
                        const float v = grad_value(cycle_key, s, i, j);
                        acc = round_bf16f(acc + v);
                        sum += v;
                        mag += std::fabs(v);
                    }
                    const bf16 g = got[static_cast<size_t>(i) * C + j];
                    got_bits.push_back(test::bits(g));
                    want_bits.push_back(test::bits(__float2bfloat16(acc)));
                    // the average as the update reads it: the sum scaled by 1/world, rounded to bf16
                    got_v.push_back(test::value(__float2bfloat16(test::value(g) * inv_world)));
                    exact.push_back(sum / W);
                    tol.push_back((adds + 1) * kBf16Eps * mag / W);
                    dense_tol.push_back((adds + 1 + W) * kBf16Eps * mag / W);
                }
            }
            test::check(test::same_bits(got_bits, want_bits),
                        "%s cycle %d: merged slice differs from the rank-order bf16 index-add", tag.c_str(), cycle);
            test::check_within(tag + " cycle " + std::to_string(cycle) + ": merged slice vs exact average", got_v,
                               exact, tol);
            bool others_kept = true;
            for (size_t e = 0; e < n && others_kept; ++e) {
                const size_t row = e / C;
                if (row < static_cast<size_t>(own_lo) || row >= static_cast<size_t>(own_hi))
                    others_kept = test::bits(got[e]) == test::bits(grad[e]);
            }
            test::check(others_kept, "%s cycle %d: rows outside the own slice changed", tag.c_str(), cycle);

            // The dense path: reduce-scatter average of the full gradients.
            d_dense_in.upload(grad);
            NCCL_CHECK(ncclReduceScatter(d_dense_in.ptr, d_dense.ptr, static_cast<size_t>(per_rank) * C, ncclBfloat16,
                                         ncclAvg, g_nccl, compute));
            CUDA_CHECK(cudaStreamSynchronize(compute));
            const std::vector<double> dense = test::values(d_dense.download());
            test::check_within(tag + " cycle " + std::to_string(cycle) + ": merged slice vs dense reduce-scatter",
                               got_v, dense, dense_tol);
        }
    }
}

// Shape rules and misuse stop with a message (in a child process; rank 0 only).
void test_errors() {
    test::check(!sparse_exchange_shape_error(100, 64, 8, 10).empty(), "rows not a multiple of world accepted");
    test::check(!sparse_exchange_shape_error(64, 12, 2, 10).empty(), "cols not a multiple of 8 accepted");
    test::check(!sparse_exchange_shape_error(64, 64, 0, 10).empty(), "world 0 accepted");
    test::check(!sparse_exchange_shape_error(64, 64, 2, -1).empty(), "negative max_touched accepted");
    test::check(sparse_exchange_shape_error(64, 64, 2, 1000).empty(), "a valid shape rejected");
    if (g_rank != 0) return;
    test::check_fails_with("mark out of range", "outside [0, 100)", [] {
        TouchedRows t(100);
        t.mark(std::vector<int32_t>{5, 100});
    });
    test::check_fails_with("rows not a multiple of world", "multiple of the world size",
                           [] { sparse_exchange_device_bytes(100, 64, 8, 10); });
    test::check_fails_with("cols not a multiple of 8", "multiple of 8",
                           [] { sparse_exchange_device_bytes(64, 12, 2, 10); });
    const int R = 64 * g_world;
    const size_t dev_bytes = sparse_exchange_device_bytes(R, 64, g_world, 4);
    test::check_fails_with("more touched rows than max_touched", "room for only 4", [&] {
        std::vector<TouchedRows> t(g_world, TouchedRows(R));
        t[0].mark(std::vector<int32_t>{1, 2, 3, 4, 5});
        std::vector<int32_t> rows(sparse_exchange_host_bytes(R, g_world, 4) / sizeof(int32_t) + 1), scratch;
        plan_sparse_exchange(t, 0, 4, rows.data(), scratch);
    });
    test::check_fails_with("a plan receiving more than a source can send", "at most", [&] {
        DeviceBuffer<unsigned char> ws(dev_bytes);
        SparseRowExchange ex(R, 64, 4, g_nccl, nullptr, ws.ptr, dev_bytes);
        SparseExchangePlan plan;
        plan.send_counts.assign(g_world, 0);
        plan.recv_counts.assign(g_world, 0);
        plan.recv_counts[(ex.rank() + 1) % g_world] = 5;
        plan.recv_total = 5;
        ex.begin(plan, nullptr);
    });
    test::check_fails_with("calls out of order", "called out of order", [&] {
        DeviceBuffer<unsigned char> ws(dev_bytes);
        SparseRowExchange ex(R, 64, 4, g_nccl, nullptr, ws.ptr, dev_bytes);
        ex.merge(nullptr);
    });
    if (dev_bytes > 0)  // a single rank exchanges nothing and needs no device buffer
        test::check_fails_with("device buffer too small", "sparse_exchange_device_bytes", [&] {
            DeviceBuffer<unsigned char> ws(dev_bytes);
            SparseRowExchange ex(R, 64, 4, g_nccl, nullptr, ws.ptr, dev_bytes - 1);
        });
}

}  // namespace

// ---- benchmark: the merge's kernels on one rank (the exchange itself is NCCL's and MPI's) ----
int bench_comms(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int C = p.C, own_rows = p.bigram_vocab / p.ranks;
    // one source's rows in the own slice: its two steps' tokens spread over the ranks' slices
    const int n = std::min(own_rows, 2 * p.T() / p.ranks);
    std::vector<int32_t> rows(own_rows);
    for (int i = 0; i < own_rows; ++i) rows[i] = i;
    std::shuffle(rows.begin(), rows.end(), test::rng());
    rows.resize(n);
    DeviceBuffer<int32_t> d_rows(rows);
    DeviceBuffer<bf16> slice(test::normal_bf16(size_t(own_rows) * C)), vals(test::normal_bf16(size_t(n) * C));
    b.run("add_rows", bench::fmt("%d rows of C=%d into a slice of %d", n, C, own_rows),
          [&](cudaStream_t s) { add_rows(slice.ptr, d_rows.ptr, vals.ptr, n, C, s); });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_comms(*o);
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    g_nccl = nccl_world(g_rank, g_world);
    if (g_rank == 0) g_seed = test::seed();
    MPI_Bcast(&g_seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);

    const auto t0 = std::chrono::steady_clock::now();
    test_errors();
    const Case cases[] = {
        {"tiny width", 4096, 128, 700, 2, Pattern::kMixed},
        {"record width", 2048, 768, 300, 2, Pattern::kMixed},
        {"crowded", 64, 64, 200, 2, Pattern::kMixed},
        {"own rows only, no rows, a handful", 1024, 64, 100, 3, Pattern::kRoles},
        {"bigram vocab 251520", 251520, 64, 16384, 1, Pattern::kMixed},
    };
    g_rows_by_touchers.assign(g_world + 1, 0);
    int case_no = 0;
    for (const Case& c : cases) run_case(c, case_no++);
    test::check(g_rows_by_touchers[0] > 0 && g_rows_by_touchers[1] > 0 && g_rows_by_touchers[g_world] > 0,
                "rank %d: own rows touched by no rank (%ld), one rank (%ld) and every rank (%ld) must all occur",
                g_rank, g_rows_by_touchers[0], g_rows_by_touchers[1], g_rows_by_touchers[g_world]);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    int mine[2] = {test::passed(), test::failed()}, total[2] = {0, 0};
    MPI_Allreduce(mine, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) std::printf("%d ranks, %.1f s; %d passed, %d failed\n", g_world, secs, total[0], total[1]);
    NCCL_CHECK(ncclCommDestroy(g_nccl));
    MPI_Finalize();
    return total[1] ? 1 : 0;
}
