// Host time of the loaders on a synthetic shard with FineWeb-like documents (log-normal
// lengths, median ~400 tokens): reading and indexing a shard, and one micro-batch (walk for all
// ranks + copy + cu_seqlens + bigram hash) for rank 0 of 8 at the record's batch sizes.
//   bench_data_loader [--tokens N] [--max-ms X]
// --tokens: synthetic shard size (default 20M; real shards hold 100M). --max-ms: exit 1 if a
// training micro-batch takes longer on average (a step of the record takes ~34 ms on the GPU,
// and the batch is prepared on the host while the GPU works).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "data/loader.h"
#include "tests/data/data_test_util.h"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::vector<uint16_t> synthetic_tokens(int64_t n) {
    std::mt19937_64 rng(20240520);
    std::lognormal_distribution<double> doc_len(std::log(400.0), 1.0);
    std::uniform_int_distribution<int> tok(0, dataload::kBosId - 1);
    std::vector<uint16_t> out;
    out.reserve(static_cast<size_t>(n));
    while (static_cast<int64_t>(out.size()) < n) {
        const int64_t len = std::max<int64_t>(1, std::llround(doc_len(rng)));
        out.push_back(dataload::kBosId);
        for (int64_t i = 1; i < len && static_cast<int64_t>(out.size()) < n; ++i) out.push_back(static_cast<uint16_t>(tok(rng)));
    }
    return out;
}

struct Timing {
    double mean_ms = 0, max_ms = 0;
    int count = 0;
};

// Average over micro-batches of one loader until `count` are taken.
template <class Loader>
Timing time_batches(Loader& loader, int count) {
    const dataload::MicroBatchShape s = loader.shape();
    std::vector<int32_t> inputs(static_cast<size_t>(s.tokens_local)), targets(inputs.size()), bigram(inputs.size()),
        cu(static_cast<size_t>(s.max_num_docs));
    const dataload::BatchBuffers buf{inputs.data(), targets.data(), cu.data(), bigram.data(), s.tokens_local, s.max_num_docs};
    loader.next(buf);  // first touch of the buffers and the shard's pages
    Timing t;
    for (int k = 0; k < count; ++k) {
        const auto t0 = Clock::now();
        loader.next(buf);
        const double ms = ms_since(t0);
        t.mean_ms += ms;
        t.max_ms = std::max(t.max_ms, ms);
        ++t.count;
    }
    t.mean_ms /= t.count;
    return t;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t tokens = 20'000'000;
    double max_ms = 0;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {
            tokens = std::atoll(argv[++i]);
        } else if (!std::strcmp(argv[i], "--max-ms") && i + 1 < argc) {
            max_ms = std::atof(argv[++i]);
        } else {
            std::fprintf(stderr, "usage: bench_data_loader [--tokens N] [--max-ms X]\n");
            return 2;
        }
    }
    if (tokens < 2'000'000) {
        std::fprintf(stderr, "bench_data_loader: --tokens must be at least 2000000\n");
        return 2;
    }
    datatest::ScratchDir dir;
    const std::string shard = dir.file("synthetic_000000.bin");
    try {
        dataload::write_shard(shard, synthetic_tokens(tokens));

        auto t0 = Clock::now();
        const auto read = dataload::read_shard(shard);
        const double read_ms = ms_since(t0);
        t0 = Clock::now();
        int64_t docs = 0;
        for (uint16_t t : read) docs += t == dataload::kBosId;
        const double scan_ms = ms_since(t0);
        std::printf("synthetic shard: %lld tokens, %lld documents; read %.1f ms, BOS scan %.1f ms (both off the training "
                    "thread after the first shard)\n",
                    (long long)tokens, (long long)docs, read_ms, scan_ms);

        bool ok = true;
        struct Stage {
            const char* name;
            int64_t batch;
        };
        for (const Stage st : {Stage{"stage 1 (8x2048x8)", 8 * 2048 * 8}, Stage{"stage 3 (24x2048x8)", 24 * 2048 * 8}}) {
            dataload::TrainLoader loader(shard, 0, 8, st.batch, 2048, 1);
            // Stay inside the one shard: each step takes ~batch tokens plus what max_seq_len cuts off.
            const int count = static_cast<int>(std::min<int64_t>(200, tokens / (st.batch * 2) - 2));
            const Timing t = time_batches(loader, count);
            std::printf("train %s: %lld tokens per rank, one micro-batch for rank 0 of 8 incl. bigram ids: mean %.3f ms, "
                        "max %.3f ms over %d\n",
                        st.name, (long long)loader.shape().tokens_local, t.mean_ms, t.max_ms, t.count);
            if (max_ms > 0 && t.mean_ms > max_ms) {
                std::printf("FAIL: %s takes %.3f ms, over the %.3f ms limit\n", st.name, t.mean_ms, max_ms);
                ok = false;
            }
        }
        dataload::ValLoader val(shard, 0, 8, 4 * 64 * 1024 * 8, 1);
        const Timing tv = time_batches(val, static_cast<int>(std::min<int64_t>(20, tokens / (4 * 64 * 1024 * 8) - 2)));
        std::printf("val (4x64x1024x8): %lld tokens per rank, one micro-batch incl. bigram ids: mean %.3f ms, max %.3f ms "
                    "over %d (clock stopped during validation)\n",
                    (long long)val.shape().tokens_local, tv.mean_ms, tv.max_ms, tv.count);
        std::printf("%d passed, %d failed\n", ok ? 1 : 0, ok ? 0 : 1);
        return ok ? 0 : 1;
    } catch (const dataload::DataError& e) {
        std::fprintf(stderr, "bench_data_loader: error: %s\n", e.what());
        return 1;
    }
}
