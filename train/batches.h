// The run's batches on the host: the validation batches read, checked against the vocabulary and
// uploaded; the training batches' producer started (from the start or a resumed run's position)
// and its micro-batches uploaded; --dump-batches. Part of
// train_gpt.cu's run section: included after its Run and its schedule's advance.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "../data/dump.h"
#include "../data/loader.h"

// The host buffers a validation micro-batch is read into and the pinned rows of the steps' losses
// (the training batches are the producer's: train/batch_producer.h).
void allocate_host_buffers(Run& r) {
    const Config& c = r.m.cfg;
    const int T = c.val_micro_tokens();
    r.inputs.resize(T);
    r.targets.resize(T);
    r.bigram.resize(T);
    r.cu.resize(dataload::max_num_docs_for(T));
    r.losses.allocate(c.grad_accum());
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

// The next validation micro-batch onto the device.
void load_val_batch(Run& r) {
    dataload::BatchBuffers buf{r.inputs.data(), r.targets.data(), r.cu.data(), r.bigram.data(),
                               static_cast<int64_t>(r.inputs.size()), static_cast<int64_t>(r.cu.size())};
    const dataload::Batch batch = r.val->next(buf);
    check_vocabulary(r, *r.val, batch);
    r.uploader.upload(r.m.eval_batch, r.m.cfg, r.inputs.data(), r.targets.data(), r.cu.data(),
                      static_cast<int>(batch.cu_entries), r.bigram.data(), static_cast<int>(batch.num_tokens), r.s);
}

// The training batches of `steps` from a fresh loader (from the data's start), made by the producer
// thread; those of steps before first_made are walked, not made (a resumed run's position). The
// sparse bigram exchange's plans come with them where it is active. Losses are checked from first_made.
void start_batches(Run& r, BatchSchedule plan, int repeat = 1) {
    const Config& c = r.m.cfg;
    r.batches.reset();  // its thread stops before the new loader opens
    dataload::TrainLoader::Options lo;
    lo.bigram_vocab = c.bigram_vocab;
    lo.repeat = repeat;
    const int64_t first = r.sch.lookup(plan.steps.empty() ? 0 : plan.steps.front()).first->batch_tokens;
    auto loader = std::make_unique<dataload::TrainLoader>(r.opt.train_files, r.d.rank, r.d.world, first, c.max_seq_len,
                                                          c.grad_accum(), lo);
    const SparsePlanning sparse = r.o.sparse ? SparsePlanning{r.d.world, r.o.sparse_max_touched, c.bigram_vocab}
                                             : SparsePlanning{};
    r.losses.checked = plan.first_made;
    r.batches = std::make_unique<BatchProducer>(c, r.sch, std::move(loader), r.d.rank, sparse, r.m.batch.packed_ints,
                                                std::move(plan));
}

// The next training micro-batch onto the device, with the step's MTP weights and the sparse
// exchange's plan: copies on the stream from the slot's pinned memory, the slot's event after them,
// the slot back to the producer. No host wait.
void upload_next_batch(Run& r, int step, int micro) {
    BatchSlot& s = r.batches->next(step, micro);
    if (s.n_mtp > 0)
        CUDA_CHECK(copy_async(r.m.mtp_weights, s.mtp, s.n_mtp * sizeof(float), cudaMemcpyHostToDevice, r.s));
    if (s.has_plan) r.o.exchange->begin(s.plan, r.s);
    upload_batch(r.m.batch, *s.image, r.s);
    r.batches->issued();
}

// A resumed run reaches the checkpoint's YaRN state by replaying the schedule (host work only) up
// to `step`, and the data position (and the sparse exchange's touched rows) by a producer that
// walks the loader through the steps before it.
void replay_to(Run& r, int step, int last) {
    for (int st = 0; st < step; ++st) advance_schedule(r, st);
    start_batches(r, {step_range(0, last), step});
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
