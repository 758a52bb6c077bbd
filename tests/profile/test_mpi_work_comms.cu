// kernels/comms.cuh's records for the step profiler (profiler/work.h), on every rank of the run
// (CTest: 2 and 8 ranks). Each rank touches rows drawn from rank 0's seed (every rank can compute
// every rank's rows), and one Adam step's exchange (the plan from every rank's rows, then begin,
// exchange_values, merge) runs three times over the same rows and gradient, each recorded:
//   1. for real: the ops are checked one by one against a list built from the rows: the uploads of
//      the sent and received row indexes (copy_h2d, 4 bytes a row), the send/recv round of the
//      values as one collective (nccl_send_recv_values, with the bytes this rank sends and
//      receives), the gather and merge kernels with their bytes, and the event records and waits
//      between the compute stream and the comms stream; no host wait;
//   2. as a dry run: the same list (plus the wait for the previous merge), the plan's counts taken
//      (the receive counts are right), and nothing on the device touched: the gradient and the
//      exchange's buffers keep their bytes;
//   3. for real again: the same ops as the dry run, field for field, and the merged gradient bit for
//      bit the first run's (the dry run left the exchange's state as a real one would).
// Every rank records its collective under the same name, so the k-th collective of every rank
// is the same one.
#include "../../kernels/comms.cuh"
#include "../device_util.h"
#include "../kernels/sparse_exchange_rig.h"

#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using test::DeviceBuffer;

int g_rank = 0, g_world = 1;

// An op the test expects; events by name, numbered here in order of first appearance as the
// recorder numbers them.
struct Want {
    OpKind kind;
    int stream;  // 0: the comms stream (the first the exchange uses), 1: compute, -1: the host
    std::string event;
    std::string name;
    double read = 0, written = 0, comm_bytes = 0;
};

bool matches(const std::vector<StepOp>& got, const std::vector<Want>& want, std::string& why) {
    if (got.size() != want.size()) {
        why = std::to_string(got.size()) + " ops, want " + std::to_string(want.size());
        return false;
    }
    std::vector<std::string> events;
    for (size_t i = 0; i < want.size(); ++i) {
        const Want& w = want[i];
        int event = -1;
        if (!w.event.empty()) {
            size_t e = 0;
            while (e < events.size() && events[e] != w.event) ++e;
            if (e == events.size()) events.push_back(w.event);
            event = static_cast<int>(e);
        }
        const StepOp& g = got[i];
        const Comm comm = w.kind == OpKind::collective ? Comm::send_recv : Comm::none;
        if (g.kind != w.kind || g.stream != w.stream || g.event != event || w.name != g.work.name ||
            g.work.bytes_read != w.read || g.work.bytes_written != w.written || g.work.comm != comm ||
            g.work.comm_bytes != w.comm_bytes) {
            why = "op " + std::to_string(i) + " is " + g.work.name + " (kind " + std::to_string(int(g.kind)) +
                  ", stream " + std::to_string(g.stream) + ", event " + std::to_string(g.event) + ", read " +
                  std::to_string(g.work.bytes_read) + ", written " + std::to_string(g.work.bytes_written) +
                  ", comm bytes " + std::to_string(g.work.comm_bytes) + "), want " + w.name;
            return false;
        }
    }
    return true;
}

bool same_ops(const std::vector<StepOp>& a, const std::vector<StepOp>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
        const Work &x = a[i].work, &y = b[i].work;
        if (a[i].kind != b[i].kind || a[i].stream != b[i].stream || a[i].event != b[i].event ||
            std::strcmp(x.name, y.name) != 0 || x.bytes_read != y.bytes_read || x.bytes_written != y.bytes_written ||
            x.flops != y.flops || x.comm != y.comm || x.comm_bytes != y.comm_bytes)
            return false;
    }
    return true;
}

void run(uint64_t seed, ncclComm_t nccl) {
    const int W = g_world, me = g_rank, C = 64, R = 32 * W, per_rank = R / W, max_touched = R;
    const std::string tag = "rank " + std::to_string(me) + " of " + std::to_string(W);
    // Rank r touches 12 rows anywhere and, when r is odd, none of its own.
    std::vector<std::vector<char>> hit(W, std::vector<char>(R, 0));
    for (int r = 0; r < W; ++r) {
        std::mt19937_64 g(seed ^ (0x9e3779b97f4a7c15ull * (r + 1)));
        for (int k = 0; k < 12; ++k) {
            const int row = static_cast<int>(g() % R);
            if (r % 2 == 1 && row / per_rank == r) continue;
            hit[r][row] = 1;
        }
    }
    int sends = 0;
    std::vector<int> recv(W, 0);
    for (int i = 0; i < R; ++i) sends += hit[me][i] && i / per_rank != me;
    for (int s = 0; s < W; ++s)
        for (int i = me * per_rank; i < (me + 1) * per_rank; ++i) recv[s] += s != me && hit[s][i];
    int recvs = 0;
    for (int n : recv) recvs += n;

    // The op list of one exchange, from the rows (stream 0: compute, where begin uploads the plan; 1:
    // comms); `after_merge`: a later exchange, which waits for the previous merge before the rows land.
    const auto expected = [&](bool after_merge) {
        std::vector<Want> w;
        if (after_merge) w.push_back({OpKind::event_wait, 0, "merged", "event_wait"});
        if (sends > 0) w.push_back({OpKind::copy, 0, "", "copy_h2d", 0, 4.0 * sends});
        if (recvs > 0) w.push_back({OpKind::copy, 0, "", "copy_h2d", 0, 4.0 * recvs});
        w.push_back({OpKind::event_record, 0, "upload_done", "event_record"});
        w.push_back({OpKind::event_record, 0, "grad_ready", "event_record"});  // the test's, on compute
        w.push_back({OpKind::event_wait, 1, "upload_done", "event_wait"});
        w.push_back({OpKind::event_wait, 1, "grad_ready", "event_wait"});
        if (sends > 0)
            w.push_back({OpKind::kernel, 1, "", "embedding_gather", 4.0 * sends + 2.0 * sends * C, 2.0 * sends * C});
        w.push_back({OpKind::collective, 1, "", "nccl_send_recv_values", 0, 0, 2.0 * C * (sends + recvs)});
        w.push_back({OpKind::event_record, 1, "values_done", "event_record"});
        w.push_back({OpKind::event_wait, 0, "values_done", "event_wait"});
        for (int s = 0; s < W; ++s)
            if (recv[s] > 0)
                w.push_back({OpKind::kernel, 0, "", "add_rows", 4.0 * recv[s] + 4.0 * recv[s] * C, 2.0 * recv[s] * C});
        w.push_back({OpKind::event_record, 0, "merged", "event_record"});
        return w;
    };

    SparseExchangeRig rig(R, C, W, max_touched);
    std::vector<bf16> grad(static_cast<size_t>(R) * C, test::to_bf16(0.0));
    std::mt19937_64 values(seed + static_cast<uint64_t>(me));
    for (int i = 0; i < R; ++i)
        if (hit[me][i])
            for (int j = 0; j < C; ++j)
                grad[static_cast<size_t>(i) * C + j] = test::to_bf16(std::uniform_real_distribution<double>(-1, 1)(values));
    DeviceBuffer<bf16> d_grad(grad.size());
    {
        std::vector<TouchedRows> touched(W, TouchedRows(R));
        std::vector<int32_t> scratch;
        SparseRowExchange ex = rig.exchange(R, C, max_touched, nccl);
        // One exchange of every rank's rows with the gradient uploaded fresh (outside the recording), recorded.
        const auto exchange = [&](bool dry) {
            d_grad.upload(grad);
            for (int r = 0; r < W; ++r)
                for (int i = 0; i < R; ++i)
                    if (hit[r][i]) touched[r].mark(&i, 1);
            const SparseExchangePlan plan = plan_sparse_exchange(touched, me, max_touched, rig.pinned, scratch);
            work_recorder().start(dry);
            ex.begin(plan, rig.compute);
            CUDA_CHECK(record_event(rig.grad_ready, rig.compute));
            ex.exchange_values(d_grad.ptr, rig.grad_ready);
            ex.merge(rig.compute);
            std::vector<StepOp> ops = work_recorder().ops;
            work_recorder().stop();
            CUDA_CHECK(cudaDeviceSynchronize());
            return ops;
        };

        std::string why;
        const std::vector<StepOp> first = exchange(false);
        test::check(matches(first, expected(false), why), "%s, first exchange: %s", tag.c_str(), why.c_str());
        const std::vector<bf16> merged = d_grad.download();

        CUDA_CHECK(cudaMemset(rig.workspace.ptr, 0xFF, rig.device_bytes));
        const std::vector<unsigned char> ws_before = rig.workspace.download();
        const std::vector<StepOp> dry = exchange(true);
        test::check(matches(dry, expected(true), why), "%s, dry exchange: %s", tag.c_str(), why.c_str());
        test::check(ex.recv_counts() == recv, "%s, dry exchange: the receive counts are not the plan's", tag.c_str());
        test::check(test::same_bits(d_grad.download(), grad), "%s, dry exchange: the gradient changed", tag.c_str());
        test::check(rig.workspace.download() == ws_before,
                    "%s, dry exchange: the exchange's device buffer changed", tag.c_str());

        const std::vector<StepOp> again = exchange(false);
        test::check(same_ops(again, dry), "%s: the real exchange after the dry one recorded other ops (%zu, %zu)",
                    tag.c_str(), again.size(), dry.size());
        test::check(test::same_bits(d_grad.download(), merged), "%s: the merge after a dry exchange differs",
                    tag.c_str());

        // The collectives' names, in order, agree on every rank.
        std::string names;
        for (const StepOp& op : first)
            if (op.kind == OpKind::collective) names += std::string(op.work.name) + ";";
        char mine_names[128] = {}, all[8][128] = {};
        std::snprintf(mine_names, sizeof mine_names, "%s", names.c_str());
        MPI_Allgather(mine_names, 128, MPI_CHAR, all, 128, MPI_CHAR, MPI_COMM_WORLD);
        bool agree = true;
        for (int r = 0; r < W; ++r) agree = agree && std::strcmp(all[r], mine_names) == 0;
        test::check(agree && names == "nccl_send_recv_values;",
                    "%s: collectives %s differ from another rank's", tag.c_str(), names.c_str());
        int counts[2] = {sends, recvs}, totals[2] = {0, 0};
        MPI_Allreduce(counts, totals, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        test::check(totals[0] == totals[1] && totals[0] > 0, "%s: %d rows sent and %d received in all", tag.c_str(),
                    totals[0], totals[1]);
    }
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    if (g_world > 8) {
        if (g_rank == 0) std::fprintf(stderr, "test_mpi_work_comms: at most 8 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const ncclComm_t nccl = nccl_world(g_rank, g_world);
    uint64_t seed = 0;
    if (g_rank == 0) seed = test::seed();
    MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);

    run(seed, nccl);

    int mine[2] = {test::passed(), test::failed()}, total[2] = {0, 0};
    MPI_Allreduce(mine, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) std::printf("%d ranks; %d passed, %d failed\n", g_world, total[0], total[1]);
    NCCL_CHECK(ncclCommDestroy(nccl));
    MPI_Finalize();
    return total[1] ? 1 : 0;
}
