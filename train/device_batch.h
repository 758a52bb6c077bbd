// A micro-batch on the device, and what the host builds for it: the id segments the embedding
// backward needs (positions grouped by token id and by bigram id). Part of train_gpt.cu's memory
// layout: included after its Config.
#pragma once
#include <algorithm>
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
    int32_t* packed;        // the arena region the six tensors above are packed into, each upload anew
    size_t packed_ints = 0;
    std::vector<int32_t> cu_seqlens_host;  // the step profiler counts attention's tiles over it
};
// Whole 16-byte packs: every tensor of the packed region starts on a 16-byte boundary.
inline size_t batch_pack_ints(size_t n) { return (n + 3) / 4 * 4; }
void layout_batch(Arena& a, int T, DeviceBatch& b) {
    const int64_t cu = dataload::max_num_docs_for(T);
    b.capacity = T;
    b.cu_capacity = static_cast<int>(cu);
    const size_t seg = id_segments_capacity_ints(T);
    b.packed_ints = 3 * batch_pack_ints(size_t(T)) + batch_pack_ints(size_t(cu)) + 2 * batch_pack_ints(seg);
    b.packed = a.take<int32_t>("batch.packed", {static_cast<int64_t>(b.packed_ints)});
    b.inputs = b.targets = b.cu_seqlens = b.bigram = b.token_segments_dev = b.bigram_segments_dev = b.packed;
}

// Copies one rank's micro-batch to the device and builds, on the host, the id segments the
// embedding backward needs (positions grouped by token id and by bigram id). The six tensors are
// packed back to back (16-byte aligned) into one host buffer laid out as the batch's arena region,
// and the DeviceBatch's pointers are set to where they landed: one copy per micro-batch, not six,
// moving only the bytes used.
struct BatchUploader {
    IdSegmentBuilder builder;
    std::vector<int32_t> staging;  // host image of b.packed
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
        staging.resize(b.packed_ints);
        size_t used = 0;  // ints of the region filled so far
        auto place = [&](int32_t*& dev, const int32_t* from, size_t n) {
            std::copy(from, from + n, staging.begin() + used);
            dev = b.packed + used;
            used += batch_pack_ints(n);
        };
        place(b.inputs, inputs, size_t(T));
        place(b.targets, targets, size_t(T));
        place(b.bigram, bigram, size_t(T));
        place(b.cu_seqlens, cu_seqlens, size_t(num_cu));
        b.token_segments = builder.build(inputs, T, c.padded_vocab, staging.data() + used);
        b.token_segments_dev = b.packed + used;
        used += batch_pack_ints(b.token_segments.ints());
        b.bigram_segments = builder.build(bigram, T, c.bigram_vocab, staging.data() + used);
        b.bigram_segments_dev = b.packed + used;
        used += b.bigram_segments.ints();
        CUDA_CHECK(copy_async(b.packed, staging.data(), used * sizeof(int32_t), cudaMemcpyHostToDevice, s));
        // the staging buffer is reused by the next upload: it must have reached the device
        CUDA_CHECK(sync_stream(s, "batch_upload"));
    }
};
