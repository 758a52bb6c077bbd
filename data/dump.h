// Batch inspection: prints, for every rank, the first batches the loaders produce (document
// ranges, cu_seqlens, CRC-32 checksums of inputs, targets, bigram ids and cu_seqlens), so a data
// problem can be seen without a GPU and compared with the Python reference
// (tests/data/ref_loader.py prints the same text). Used by the dump_batches tool and by
// `train_gpt --dump-batches N`. One process simulates all ranks, so call it on one rank only.
#pragma once
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "loader.h"

namespace dataload {

// zlib's CRC-32 (reflected polynomial 0xEDB88320), so Python's zlib.crc32 reproduces it.
inline uint32_t crc32(const void* data, size_t bytes, uint32_t crc = 0) {
    static const auto table = [] {
        std::vector<uint32_t> t(256);
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    const auto* p = static_cast<const unsigned char*>(data);
    crc = ~crc;
    for (size_t i = 0; i < bytes; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
    return ~crc;
}

// A stage change, applied before the step's first micro-batch as the trainer applies it.
struct ScheduleChange {
    int64_t step = 0;
    int64_t batch_tokens = 0;
    int max_seq_len = 0;
};

struct DumpConfig {
    std::string files;                     // glob of the shards
    bool val = false;                      // validation loader instead of the training one
    int world_size = 8;
    int grad_accum = 1;
    int64_t batch_tokens = 8 * 2048 * 8;   // tokens per step across ranks and micro-steps
    int max_seq_len = 2048;                // train only
    int32_t bigram_vocab = kRecordBigramVocab;
    MaxDocsRule max_docs;                  // cu_seqlens entries per micro-batch size (a preset's)
    int64_t batches = 0;                   // steps to print, each grad_accum micro-batches per rank
    bool prefetch = true;
    std::vector<ScheduleChange> changes;   // train only, ascending steps >= 1
};

// A bad command line; what() is the problem, the caller adds the usage text.
struct UsageError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline const char* dump_usage() {
    return "usage: dump_batches --files GLOB --batches N [options]\n"
           "Prints, for every rank, the first N batches (steps) the loader produces from the shards\n"
           "matching GLOB: document ranges, cu_seqlens and CRC-32s of inputs, targets, bigram ids.\n"
           "  --files GLOB          token shards (quote the glob)\n"
           "  --batches N           steps to print, each grad_accum micro-batches per rank (N >= 1)\n"
           "  --world-size W        ranks (default 8)\n"
           "  --grad-accum G        micro-steps per step (default 8 / W, the trainer's rule)\n"
           "  --batch-tokens T      tokens per step across all ranks and micro-steps (default 131072)\n"
           "  --max-seq-len L       longest document piece in a train batch (default 2048)\n"
           "  --bigram-vocab V      bigram table size (default 251520)\n"
           "  --change S:T[:L]      from step S (>= 1) on, T tokens per step and max_seq_len L\n"
           "                        (default: --max-seq-len); repeatable, steps ascending; train only\n"
           "  --val                 the validation loader (contiguous slices, not BOS-aligned)\n"
           "  --no-prefetch         read each next shard when needed instead of in the background\n"
           "  -h, --help            this text\n";
}

namespace detail {

inline int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
    if (text.empty()) throw UsageError(flag + " needs a number, got an empty string");
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') throw UsageError(flag + " needs an integer, got '" + text + "'");
    if (v < lo || v > hi)
        throw UsageError(flag + " must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + text);
    return v;
}

inline ScheduleChange parse_change(const std::string& text) {
    std::vector<std::string> parts;
    size_t from = 0;
    for (;;) {
        const size_t colon = text.find(':', from);
        parts.push_back(text.substr(from, colon == std::string::npos ? std::string::npos : colon - from));
        if (colon == std::string::npos) break;
        from = colon + 1;
    }
    if (parts.size() < 2 || parts.size() > 3) throw UsageError("--change needs STEP:TOKENS[:MAX_SEQ_LEN], got '" + text + "'");
    ScheduleChange c;
    c.step = parse_int("--change step", parts[0], 1, INT32_MAX);
    c.batch_tokens = parse_int("--change tokens", parts[1], 1, INT64_MAX / 2);
    c.max_seq_len = parts.size() == 3 ? static_cast<int>(parse_int("--change max_seq_len", parts[2], 1, INT32_MAX)) : 0;
    return c;
}

}  // namespace detail

// The flags above into a config; throws UsageError for anything wrong or missing.
inline DumpConfig parse_dump_args(int argc, const char* const* argv) {
    DumpConfig c;
    bool have_batches = false, have_grad_accum = false;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw UsageError(flag + " needs a value");
            return argv[++i];
        };
        if (flag == "--files") {
            c.files = value();
        } else if (flag == "--batches") {
            c.batches = detail::parse_int(flag, value(), 1, INT32_MAX);
            have_batches = true;
        } else if (flag == "--grad-accum") {
            c.grad_accum = static_cast<int>(detail::parse_int(flag, value(), 1, 4096));
            have_grad_accum = true;
        } else if (flag == "--world-size") {
            c.world_size = static_cast<int>(detail::parse_int(flag, value(), 1, 4096));
        } else if (flag == "--batch-tokens") {
            c.batch_tokens = detail::parse_int(flag, value(), 1, INT64_MAX / 2);
        } else if (flag == "--max-seq-len") {
            c.max_seq_len = static_cast<int>(detail::parse_int(flag, value(), 1, INT32_MAX));
        } else if (flag == "--bigram-vocab") {
            c.bigram_vocab = static_cast<int32_t>(detail::parse_int(flag, value(), 2, INT32_MAX));
        } else if (flag == "--change") {
            c.changes.push_back(detail::parse_change(value()));
        } else if (flag == "--val") {
            c.val = true;
        } else if (flag == "--no-prefetch") {
            c.prefetch = false;
        } else {
            throw UsageError("unknown argument '" + flag + "'");
        }
    }
    if (c.files.empty()) throw UsageError("--files is required");
    if (!have_batches) throw UsageError("--batches is required");
    if (!have_grad_accum) {
        if (8 % c.world_size != 0)
            throw UsageError("world size " + std::to_string(c.world_size) + " does not divide 8; give --grad-accum");
        c.grad_accum = 8 / c.world_size;
    }
    if (c.val && !c.changes.empty()) throw UsageError("--change applies to the training loader, not --val");
    for (size_t k = 1; k < c.changes.size(); ++k)
        if (c.changes[k].step <= c.changes[k - 1].step) throw UsageError("--change steps must be ascending");
    for (auto& ch : c.changes)
        if (ch.max_seq_len == 0) ch.max_seq_len = c.max_seq_len;
    return c;
}

namespace detail {

inline std::string base_name(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? path : path.substr(slash + 1);
}

inline void print_ranges(std::FILE* out, const char* label, const std::vector<int64_t>& v) {
    std::fprintf(out, "  %s", label);
    for (int64_t x : v) std::fprintf(out, " %" PRId64, x);
    std::fprintf(out, "\n");
}

// Checksums are over the little-endian int32 arrays exactly as the device receives them.
inline void print_batch(std::FILE* out, int64_t step, int micro, int rank, const Batch& b, const std::vector<int32_t>& inputs,
                        const std::vector<int32_t>& targets, const std::vector<int32_t>& bigram,
                        const std::vector<int32_t>& cu) {
    std::fprintf(out, "step %" PRId64 " micro %d rank %d: shard %zu tokens %" PRId64 "\n", step, micro, rank, b.shard,
                 b.num_tokens);
    print_ranges(out, "starts", b.starts);
    print_ranges(out, "ends", b.ends);
    std::fprintf(out, "  cu_seqlens");
    for (int64_t k = 0; k < b.cu_len; ++k) std::fprintf(out, " %d", cu[k]);
    std::fprintf(out, " +%" PRId64 "x%" PRId64 "\n", b.cu_entries - b.cu_len, b.num_tokens);
    const size_t n = static_cast<size_t>(b.num_tokens) * 4;
    std::fprintf(out, "  crc32 inputs %08x targets %08x bigram %08x cu_seqlens %08x\n", crc32(inputs.data(), n),
                 crc32(targets.data(), n), crc32(bigram.data(), n),
                 crc32(cu.data(), static_cast<size_t>(b.cu_entries) * 4));
}

template <class Loader>
void dump_with(std::FILE* out, const DumpConfig& c, Loader& loader) {
    for (size_t i = 0; i < loader.files().size(); ++i)
        std::fprintf(out, "# shard %zu: %s %" PRId64 " tokens\n", i, base_name(loader.files()[i]).c_str(),
                     read_shard_header(loader.files()[i]).num_tokens);
    std::vector<int32_t> inputs, targets, bigram, cu;
    size_t next_change = 0;
    for (int64_t step = 0; step < c.batches; ++step) {
        // Stage changes exist only for the training loader (dump_batches refuses them for val).
        if constexpr (std::is_same_v<Loader, TrainLoader>) {
            if (next_change < c.changes.size() && c.changes[next_change].step == step) {
                const ScheduleChange& ch = c.changes[next_change++];
                loader.set_batch(ch.batch_tokens, ch.max_seq_len, c.grad_accum);
                std::fprintf(out, "# step %" PRId64 ": batch_tokens=%" PRId64 " max_seq_len=%d\n", step, ch.batch_tokens,
                             ch.max_seq_len);
            }
        }
        const MicroBatchShape s = loader.shape();
        inputs.assign(static_cast<size_t>(s.tokens_local), 0);
        targets.assign(inputs.size(), 0);
        bigram.assign(inputs.size(), 0);
        cu.assign(static_cast<size_t>(s.max_num_docs), 0);
        const BatchBuffers buf{inputs.data(), targets.data(), cu.data(), bigram.data(), s.tokens_local, s.max_num_docs};
        for (int micro = 0; micro < c.grad_accum; ++micro) {
            loader.advance();
            for (int r = 0; r < c.world_size; ++r) {
                const Batch b = loader.fill(r, buf);
                print_batch(out, step, micro, r, b, inputs, targets, bigram, cu);
            }
        }
    }
}

}  // namespace detail

// Prints the batches c describes to out. Throws DataError for bad data or an impossible
// configuration (whatever was printed before stays printed, to show where it stopped).
inline void dump_batches(std::FILE* out, const DumpConfig& c) {
    if (c.batches < 1) throw DataError("dump_batches: batches must be at least 1");
    if (c.val && !c.changes.empty()) throw DataError("dump_batches: schedule changes apply to the training loader only");
    for (size_t k = 0; k < c.changes.size(); ++k)
        if (c.changes[k].step < 1 || (k > 0 && c.changes[k].step <= c.changes[k - 1].step))
            throw DataError("dump_batches: schedule changes need ascending steps >= 1");
    if (c.val) {
        std::fprintf(out, "# val batches: world_size=%d grad_accum=%d batch_tokens=%" PRId64 " bigram_vocab=%d batches=%" PRId64 "\n",
                     c.world_size, c.grad_accum, c.batch_tokens, c.bigram_vocab, c.batches);
        ValLoader loader(c.files, 0, c.world_size, c.batch_tokens, c.grad_accum, c.bigram_vocab, c.max_docs);
        detail::dump_with(out, c, loader);
    } else {
        std::fprintf(out, "# train batches: world_size=%d grad_accum=%d batch_tokens=%" PRId64
                          " max_seq_len=%d bigram_vocab=%d batches=%" PRId64 "\n",
                     c.world_size, c.grad_accum, c.batch_tokens, c.max_seq_len, c.bigram_vocab, c.batches);
        TrainLoader::Options opt;
        opt.prefetch = c.prefetch;
        opt.bigram_vocab = c.bigram_vocab;
        opt.max_docs = c.max_docs;
        TrainLoader loader(c.files, 0, c.world_size, c.batch_tokens, c.max_seq_len, c.grad_accum, opt);
        detail::dump_with(out, c, loader);
    }
    std::fflush(out);
}

}  // namespace dataload
