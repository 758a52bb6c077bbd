// A micro-batch on the device, and what the host builds for it: the id segments the embedding
// backward needs (positions grouped by token id and by bigram id). Part of train_gpt.cu's memory
// layout: included after its Config.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../data/loader.h"
#include "../kernels/embed.cuh"
#include "arena.h"

struct DeviceBatch {
    int T = 0, num_cu = 0;
    int capacity = 0, cu_capacity = 0;  // what the arena holds
    int32_t *inputs, *targets, *cu_seqlens, *bigram;
    IdSegments token_segments, bigram_segments;  // host descriptions of the packed buffers
    int32_t *token_segments_dev, *bigram_segments_dev;
    std::vector<int32_t> cu_seqlens_host;  // the step profiler counts attention's tiles over it
};
void layout_batch(Arena& a, int T, DeviceBatch& b) {
    const int64_t cu = dataload::max_num_docs_for(T);
    b.capacity = T;
    b.cu_capacity = static_cast<int>(cu);
    b.inputs = a.take<int32_t>("batch.inputs", {T});
    b.targets = a.take<int32_t>("batch.targets", {T});
    b.cu_seqlens = a.take<int32_t>("batch.cu_seqlens", {cu});
    b.bigram = a.take<int32_t>("batch.bigram", {T});
    b.token_segments_dev = a.take<int32_t>("batch.token_segments", {static_cast<int64_t>(id_segments_capacity_ints(T))});
    b.bigram_segments_dev = a.take<int32_t>("batch.bigram_segments", {static_cast<int64_t>(id_segments_capacity_ints(T))});
}

// Copies one rank's micro-batch to the device and builds, on the host, the id segments the
// embedding backward needs (positions grouped by token id and by bigram id).
struct BatchUploader {
    IdSegmentBuilder builder;
    std::vector<int32_t> token_packed, bigram_packed;
    void upload(DeviceBatch& b, const Config& c, const int32_t* inputs, const int32_t* targets, const int32_t* cu_seqlens,
                int num_cu, const int32_t* bigram, int T, cudaStream_t s) {
        auto fail = [](const std::string& why) {
            std::fprintf(stderr, "train_gpt: bad batch: %s\n", why.c_str());
            std::exit(EXIT_FAILURE);
        };
        if (T <= 0 || T % 16 != 0) fail(std::to_string(T) + " tokens is not a positive multiple of 16");
        if (T > b.capacity) fail(std::to_string(T) + " tokens exceed the " + std::to_string(b.capacity) + " the arena holds");
        if (num_cu < 2 || num_cu > b.cu_capacity || cu_seqlens[0] != 0 || cu_seqlens[num_cu - 1] != T)
            fail("cu_seqlens must have 2.." + std::to_string(b.cu_capacity) + " entries from 0 to T");
        for (int t = 0; t < T; ++t)
            if (inputs[t] < 0 || inputs[t] >= c.vocab_size || targets[t] < 0 || targets[t] >= c.vocab_size)
                fail("token id " + std::to_string(inputs[t] < 0 || inputs[t] >= c.vocab_size ? inputs[t] : targets[t]) +
                     " at position " + std::to_string(t) + " is outside the vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
        b.T = T;
        b.num_cu = num_cu;
        b.cu_seqlens_host.assign(cu_seqlens, cu_seqlens + num_cu);
        token_packed.resize(id_segments_capacity_ints(T));
        bigram_packed.resize(id_segments_capacity_ints(T));
        b.token_segments = builder.build(inputs, T, c.padded_vocab, token_packed.data());
        b.bigram_segments = builder.build(bigram, T, c.bigram_vocab, bigram_packed.data());
        const size_t n = size_t(T) * sizeof(int32_t);
        CUDA_CHECK(copy_async(b.inputs, inputs, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(copy_async(b.targets, targets, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(copy_async(b.bigram, bigram, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(copy_async(b.cu_seqlens, cu_seqlens, num_cu * sizeof(int32_t), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(copy_async(b.token_segments_dev, token_packed.data(), b.token_segments.ints() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, s));
        CUDA_CHECK(copy_async(b.bigram_segments_dev, bigram_packed.data(), b.bigram_segments.ints() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, s));
        // the packed buffers are reused by the next upload: they must have reached the device
        CUDA_CHECK(sync_stream(s, "batch_upload"));
    }
};
