// --plan-step's dry run records what a real step does: the same operations (kind, stream, event,
// family, range, and every number of their Work) in the same order; the ranges name the layers of
// the forward and backward and the optimizer. The tiny preset on a short
// schedule (stage changes at steps 2, 4 and 6, the untie at step 5) trains steps 0..7 for real with
// steps 2..7 recorded, then the same steps again from the same start (a fresh loader: the same
// data) in a dry run; each recording must equal its real twin. Steps 0 and 1 run unrecorded first
// in both, so each recorded step follows a step (the sparse exchange, on 8 ranks, waits for the
// previous merge from its second exchange on). The comparison itself is checked on planted
// differences. Run on 1 rank and, for the collectives and the sparse exchange, 8.
#include "../trainer_under_test.h"
#include "trainer_test_util.h"

// The first difference between two recordings, or "".
std::string recording_difference(const std::vector<StepOp>& a, const std::vector<StepOp>& b) {
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        const StepOp &x = a[i], &y = b[i];
        const Work &u = x.work, &v = y.work;
        const bool same = x.kind == y.kind && x.stream == y.stream && x.event == y.event &&
                          std::strcmp(u.name, v.name) == 0 && x.range == y.range && u.tc_flops == v.tc_flops &&
                          u.flops == v.flops && u.bytes_read == v.bytes_read && u.bytes_written == v.bytes_written &&
                          u.gemm == v.gemm && u.m == v.m && u.n == v.n && u.k == v.k && u.batch == v.batch &&
                          u.comm == v.comm && u.comm_bytes == v.comm_bytes;
        if (!same)
            return "op " + std::to_string(i) + ": " + u.name + " (kind " + std::to_string(int(x.kind)) + ", stream " +
                   std::to_string(x.stream) + ", " + x.range + ") vs " + v.name + " (kind " + std::to_string(int(y.kind)) +
                   ", stream " + std::to_string(y.stream) + ", " + y.range + ")";
    }
    if (a.size() != b.size()) return std::to_string(a.size()) + " ops vs " + std::to_string(b.size());
    return "";
}

constexpr int kFirstRecorded = 2, kSteps = 8;

// Steps 0..kSteps-1 from the start of the schedule and the data; the recordings of steps
// kFirstRecorded.. (a dry run does no device work anywhere, a real one records without skipping).
std::vector<std::vector<StepOp>> run_steps(Run& r, bool dry) {
    WorkRecorder& rec = work_recorder();
    if (dry) rec.start(true);
    r.o.split = false;
    reset_schedule(r);
    start_batches(r, {step_range(0, kSteps), 0});
    std::vector<std::vector<StepOp>> out;
    for (int step = 0; step < kSteps; ++step) {
        advance_schedule(r, step);
        if (step >= kFirstRecorded) rec.start(dry);
        train_step(r, step);
        if (step >= kFirstRecorded) out.push_back(std::move(rec.ops));
        if (dry) rec.start(true);
        else rec.stop();
    }
    rec.stop();
    CUDA_CHECK(cudaStreamSynchronize(r.s));
    return out;
}

int main(int argc, char** argv) {
    Distributed d = start_distributed(&argc, &argv);
    const char* repo = std::getenv("REPO");
    if (!repo) {
        std::fprintf(stderr, "plan_step_dry_vs_real: set REPO to the repository\n");
        return 2;
    }
    Config c = tiny_preset();
    c.world_size = d.world;
    c.scheduled_iterations = 6;
    c.extension_iterations = 2;
    TrainerRun t(d, c, repo, false);
    Run& r = t.r;

    const std::vector<std::vector<StepOp>> real = run_steps(r, false), dry = run_steps(r, true);
    for (size_t k = 0; k < real.size(); ++k) {
        const int step = kFirstRecorded + int(k);
        int collectives = 0;
        for (const StepOp& op : real[k]) collectives += op.kind == OpKind::collective;
        test::check(real[k].size() > 100, "rank %d step %d: the real recording has only %zu ops", d.rank, step,
                    real[k].size());
        test::check(d.world == 1 || collectives > 0, "rank %d step %d: no collectives recorded on %d ranks", d.rank,
                    step, d.world);
        // the ranges (NVTX on the GPU) name the ops: a layer's forward and backward, the optimizer
        for (const char* range : {"forward/layer 0", "forward/layer 10", "backward/layer 3", "optimizer"}) {
            const bool named = std::any_of(real[k].begin(), real[k].end(), [&](const StepOp& op) {
                return op.range == range && (op.kind == OpKind::kernel || op.kind == OpKind::gemm);
            });
            test::check(named, "rank %d step %d: no op in range %s", d.rank, step, range);
        }
        const std::string diff = recording_difference(real[k], dry[k]);
        test::check(diff.empty(), "rank %d step %d: the dry run differs from the real step at %s", d.rank, step,
                    diff.c_str());
    }
    if (d.rank == 0)
        std::printf("%zu steps compared on %d rank(s), %zu to %zu ops each\n", real.size(), d.world, real.front().size(),
                    real.back().size());

    // the comparison finds planted differences: a renamed op, a byte count, two ops swapped, one dropped
    const std::vector<StepOp>& ops = real.front();
    std::vector<StepOp> renamed = ops, bytes = ops, swapped = ops, dropped = ops;
    renamed[ops.size() / 2].work.name = "planted";
    bytes[ops.size() / 3].work.bytes_read += 1;
    size_t i = 1;
    while (i < ops.size() && swapped[i].work.name == swapped[i - 1].work.name) ++i;
    std::swap(swapped[i], swapped[i - 1]);
    dropped.pop_back();
    for (const auto& [what, planted] : {std::pair{"a renamed op", &renamed}, std::pair{"a byte count", &bytes},
                                        std::pair{"two swapped ops", &swapped}, std::pair{"a dropped op", &dropped}})
        test::check(!recording_difference(ops, *planted).empty(), "the comparison misses %s", what);

    return finish_trainer_test(r, t.o);
}
