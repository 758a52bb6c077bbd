// The run's batches on the host: their buffers, each micro-batch read, checked against the vocabulary
// and uploaded, the loader replayed to a resumed run's position, and --dump-batches. Part of
// train_gpt.cu's run section: included after its Run and its schedule's advance.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>

#include "../data/dump.h"
#include "../data/loader.h"

// Where the p-th token of a micro-batch's concatenated shard ranges sits in its shard.
int64_t shard_position(const dataload::Batch& b, int64_t p) {
    for (size_t k = 0; k < b.starts.size(); p -= b.ends[k] - b.starts[k], ++k)
        if (p < b.ends[k] - b.starts[k]) return b.starts[k] + p;
    return -1;
}

// The host buffers a micro-batch is read into (sized for the larger of a training and a validation
// micro-batch) and the pinned slots of a step's micro-step losses.
void allocate_host_buffers(Run& r) {
    const Config& c = r.m.cfg;
    const int T = std::max(c.max_train_tokens(), c.val_micro_tokens());
    r.inputs.resize(T);
    r.targets.resize(T);
    r.bigram.resize(T);
    r.cu.resize(dataload::max_num_docs_for(T));
    CUDA_CHECK(cudaMallocHost(&r.losses, c.grad_accum() * sizeof(float)));
}

// A token id outside the vocabulary stops the run naming the shard, the token's position in it and
// the rank (input p is concatenated token p, target p is token p + 1).
template <class Loader>
void check_vocabulary(const Run& r, const Loader& loader, const dataload::Batch& b) {
    const int vocab = r.m.cfg.vocab_size;
    for (int64_t p = 0; p < b.num_tokens; ++p)
        for (const auto& [id, at] : {std::pair{r.inputs[p], p}, std::pair{r.targets[p], p + 1}})
            if (id < 0 || id >= vocab)
                fail("token id " + std::to_string(id) + " at token " + std::to_string(shard_position(b, at)) + " of shard " +
                     loader.files()[b.shard] + " (read by rank " + std::to_string(r.d.rank) +
                     ") is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// The next micro-batch of `loader` onto the device.
template <class Loader>
void load_batch(Run& r, Loader& loader, DeviceBatch& b) {
    dataload::BatchBuffers buf{r.inputs.data(), r.targets.data(), r.cu.data(), r.bigram.data(),
                               static_cast<int64_t>(r.inputs.size()), static_cast<int64_t>(r.cu.size())};
    const dataload::Batch batch = loader.next(buf);
    check_vocabulary(r, loader, batch);
    r.uploader.upload(b, r.m.cfg, r.inputs.data(), r.targets.data(), r.cu.data(), static_cast<int>(batch.cu_entries),
                      r.bigram.data(), static_cast<int>(batch.num_tokens), r.s);
}

// A resumed run reaches the checkpoint's data position, YaRN state and touched bigram rows by
// replaying the schedule and the loader (host work only) up to `step`.
void replay_to(Run& r, int step) {
    for (int st = 0; st < step; ++st) {
        advance_schedule(r, st);
        if (r.o.sparse && st % 2 == 1) r.o.touched = std::make_unique<TouchedRows>(r.m.cfg.bigram_vocab);
        for (int i = 0; i < r.m.cfg.grad_accum(); ++i) {
            dataload::BatchBuffers buf{r.inputs.data(), r.targets.data(), r.cu.data(), r.bigram.data(),
                                       static_cast<int64_t>(r.inputs.size()), static_cast<int64_t>(r.cu.size())};
            const dataload::Batch b = r.train->next(buf);
            if (r.o.sparse && st % 2 == 0) r.o.touched->mark(r.bigram.data(), size_t(b.num_tokens));
        }
    }
}

// --dump-batches N: rank 0 prints the first N steps' batches of every rank as the loader makes them
// (what tests/data compares with upstream's loader), through the schedule's batch-size changes.
void dump_batches_mode(const Config& cfg, int64_t batches, const DataFiles& files, Distributed& d) {
    agree_or_exit(d, d.rank == 0 ? shard_error("training data", files.train, files.train_default, files.remedy) : "");
    if (d.rank != 0) return;
    dataload::DumpConfig dc;
    dc.files = files.train;
    dc.world_size = d.world;
    dc.grad_accum = cfg.grad_accum();
    dc.batch_tokens = cfg.stages.front().batch_tokens;
    dc.max_seq_len = cfg.max_seq_len;
    dc.bigram_vocab = cfg.bigram_vocab;
    dc.batches = batches;
    const Schedule sch(cfg);
    for (size_t k = 1; k < cfg.stages.size(); ++k)
        if (cfg.stages[k].batch_tokens != cfg.stages[k - 1].batch_tokens && sch.starts[k] < batches)
            dc.changes.push_back({sch.starts[k], cfg.stages[k].batch_tokens, cfg.max_seq_len});
    try {
        dataload::dump_batches(stdout, dc);
    } catch (const std::exception& e) {
        fail(e.what());
    }
}
