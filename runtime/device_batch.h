// A micro-batch on the device, and its host image: the tensors and what the host builds for them,
// the id segments the embedding backward needs (positions grouped by token id and by bigram id).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../data/loader.h"
#include "../kernels/embed.cuh"
#include "arena.h"

// The ranges of a batch's ids: tokens below vocab_size, the embedding's rows (padded_vocab) and the
// bigram table's rows (bigram_vocab) that the id segments index.
struct TokenSpace {
    int vocab_size, padded_vocab, bigram_vocab;
};

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
// Room for micro-batches of up to T tokens, their cu_seqlens entries by the preset's rule.
void layout_batch(Arena& a, int T, const dataload::MaxDocsRule& max_docs, DeviceBatch& b) {
    const int64_t cu = max_docs.capacity(T);
    b.capacity = T;
    b.cu_capacity = static_cast<int>(cu);
    const size_t seg = id_segments_capacity_ints(T);
    b.packed_ints = 3 * batch_pack_ints(size_t(T)) + batch_pack_ints(size_t(cu)) + 2 * batch_pack_ints(seg);
    b.packed = a.take<int32_t>("batch.packed", {static_cast<int64_t>(b.packed_ints)});
    b.inputs = b.targets = b.cu_seqlens = b.bigram = b.token_segments_dev = b.bigram_segments_dev = b.packed;
}

// A micro-batch's host image: the contents of a DeviceBatch's packed region (the six tensors back to
// back, 16-byte aligned), in pinned memory so that its upload is an asynchronous copy (a pageable
// source makes the driver stage it), plus what the host keeps of the batch. `uploaded` is recorded
// after the copy: the image may be rewritten once it has completed.
struct BatchImage {
    int32_t* pinned = nullptr;  // cudaMallocHost, `capacity` ints
    size_t capacity = 0, used = 0;
    int T = 0, num_cu = 0;
    size_t targets_at = 0, bigram_at = 0, cu_at = 0, token_segments_at = 0, bigram_segments_at = 0;
    IdSegments token_segments, bigram_segments;
    std::vector<int32_t> cu_seqlens_host;
    cudaEvent_t uploaded = nullptr;
    bool in_flight = false;  // its upload was issued (the event recorded) since it was last packed
    explicit BatchImage(size_t ints) : capacity(ints) {
        CUDA_CHECK(cudaMallocHost(&pinned, std::max<size_t>(ints, 4) * sizeof(int32_t)));
        CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
    }
    ~BatchImage() {  // cudaFreeHost waits for the device: no copy still reads the image
        cudaFreeHost(pinned);
        cudaEventDestroy(uploaded);
    }
    BatchImage(const BatchImage&) = delete;
    BatchImage& operator=(const BatchImage&) = delete;
};

// What is wrong with a micro-batch for arena region `b` ("" when nothing is).
inline std::string batch_error(const DeviceBatch& b, const TokenSpace& c, const int32_t* inputs, const int32_t* targets,
                               const int32_t* cu_seqlens, int num_cu, int T) {
    if (T <= 0 || T % 16 != 0) return std::to_string(T) + " tokens is not a positive multiple of 16";
    if (T > b.capacity) return std::to_string(T) + " tokens exceed the " + std::to_string(b.capacity) + " the arena holds";
    if (num_cu < 2 || num_cu > b.cu_capacity || cu_seqlens[0] != 0 || cu_seqlens[num_cu - 1] != T)
        return "cu_seqlens must have 2.." + std::to_string(b.cu_capacity) + " entries from 0 to T";
    for (int k = 1; k < num_cu; ++k)  // attention reads documents [cu[k-1], cu[k]) of the T tokens
        if (cu_seqlens[k] < cu_seqlens[k - 1])
            return "cu_seqlens entry " + std::to_string(k) + " (" + std::to_string(cu_seqlens[k]) + ") is below entry " +
                   std::to_string(k - 1) + " (" + std::to_string(cu_seqlens[k - 1]) + "): document starts must ascend to T";
    for (int t = 0; t < T; ++t)
        if (inputs[t] < 0 || inputs[t] >= c.vocab_size || targets[t] < 0 || targets[t] >= c.vocab_size)
            return "token id " + std::to_string(inputs[t] < 0 || inputs[t] >= c.vocab_size ? inputs[t] : targets[t]) +
                   " at position " + std::to_string(t) + " is outside the vocabulary [0, " +
                   std::to_string(c.vocab_size) + ")";
    return "";
}

// Where the p-th token of a micro-batch's concatenated shard ranges sits in its shard.
inline int64_t shard_position(const dataload::Batch& b, int64_t p) {
    for (size_t k = 0; k < b.starts.size(); p -= b.ends[k] - b.starts[k], ++k)
        if (p < b.ends[k] - b.starts[k]) return b.starts[k] + p;
    return -1;
}

// A token id outside the vocabulary of a loaded micro-batch, named by its shard, its position in it
// and the rank that read it (input p is concatenated token p, target p is token p + 1), or "".
inline std::string vocabulary_error(const dataload::Batch& b, const int32_t* inputs, const int32_t* targets, int vocab_size,
                                    const std::vector<std::string>& files, int rank) {
    for (int64_t p = 0; p < b.num_tokens; ++p)
        for (const auto& [id, at] : {std::pair{inputs[p], p}, std::pair{targets[p], p + 1}})
            if (id < 0 || id >= vocab_size)
                return "token id " + std::to_string(id) + " at token " + std::to_string(shard_position(b, at)) + " of shard " +
                       files[b.shard] + " (read by rank " + std::to_string(rank) + ") is outside the vocabulary [0, " +
                       std::to_string(vocab_size) + ")";
    return "";
}

// Packs one rank's micro-batch into `img` and builds, on the host, the id segments the embedding
// backward needs (positions grouped by token id and by bigram id). The batch must be valid
// (batch_error) and the image's previous upload complete.
inline void pack_batch(BatchImage& img, IdSegmentBuilder& builder, const TokenSpace& c, const int32_t* inputs,
                       const int32_t* targets, const int32_t* cu_seqlens, int num_cu, const int32_t* bigram, int T) {
    img.T = T;
    img.num_cu = num_cu;
    img.cu_seqlens_host.assign(cu_seqlens, cu_seqlens + num_cu);
    size_t used = 0;  // ints of the region filled so far
    auto place = [&](const int32_t* from, size_t n) {
        std::copy(from, from + n, img.pinned + used);
        const size_t at = used;
        used += batch_pack_ints(n);
        return at;
    };
    place(inputs, size_t(T));
    img.targets_at = place(targets, size_t(T));
    img.bigram_at = place(bigram, size_t(T));
    img.cu_at = place(cu_seqlens, size_t(num_cu));
    img.token_segments_at = used;
    img.token_segments = builder.build(inputs, T, c.padded_vocab, img.pinned + used);
    used += batch_pack_ints(img.token_segments.ints());
    img.bigram_segments_at = used;
    img.bigram_segments = builder.build(bigram, T, c.bigram_vocab, img.pinned + used);
    img.used = used + img.bigram_segments.ints();
}

// The image onto the device: one copy per micro-batch, not six, moving only the bytes used, on
// stream s; the DeviceBatch's pointers are set to where the tensors land, and the image's event
// is recorded after the copy.
inline void upload_batch(DeviceBatch& b, BatchImage& img, cudaStream_t s) {
    b.T = img.T;
    b.num_cu = img.num_cu;
    b.cu_seqlens_host = img.cu_seqlens_host;
    b.inputs = b.packed;
    b.targets = b.packed + img.targets_at;
    b.bigram = b.packed + img.bigram_at;
    b.cu_seqlens = b.packed + img.cu_at;
    b.token_segments = img.token_segments;
    b.token_segments_dev = b.packed + img.token_segments_at;
    b.bigram_segments = img.bigram_segments;
    b.bigram_segments_dev = b.packed + img.bigram_segments_at;
    CUDA_CHECK(copy_async(b.packed, img.pinned, img.used * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(record_event(img.uploaded, s));
    img.in_flight = true;
}

// One micro-batch at a time through one image (validation, tests): checked, packed once the
// previous upload has completed (a wait that returns at once where the caller waits on the stream
// between batches, as validation does), uploaded.
struct BatchUploader {
    IdSegmentBuilder builder;
    std::unique_ptr<BatchImage> image;
    void upload(DeviceBatch& b, const TokenSpace& c, const int32_t* inputs, const int32_t* targets, const int32_t* cu_seqlens,
                int num_cu, const int32_t* bigram, int T, cudaStream_t s) {
        if (const std::string why = batch_error(b, c, inputs, targets, cu_seqlens, num_cu, T); !why.empty()) {
            std::fprintf(stderr, "train_gpt: bad batch: %s\n", why.c_str());
            std::exit(EXIT_FAILURE);
        }
        if (!image) image = std::make_unique<BatchImage>(b.packed_ints);
        if (image->in_flight) CUDA_CHECK(sync_event(image->uploaded, "batch_image_reuse"));
        pack_batch(*image, builder, c, inputs, targets, cu_seqlens, num_cu, bigram, T);
        upload_batch(b, *image, s);
    }
};
