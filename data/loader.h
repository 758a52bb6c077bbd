// The training and validation data loaders: the same batches, token for token, as the
// reference's distributed_data_generator (train: BOS-aligned; val: contiguous slices), written
// into caller-provided host buffers (in the trainer, ordinary std::vectors: its BatchUploader copies
// each batch to the device and waits for the copies before the next batch overwrites them).
//
// Terms: a step consumes batch_tokens tokens across all ranks and grad_accum micro-steps; each
// call to next() is one micro-step for one rank and yields
//   tokens_local = batch_tokens / (grad_accum * world_size)
// inputs, the same number of targets (inputs shifted by one), the bigram hash ids of the inputs,
// and max_num_docs cu_seqlens entries (document boundaries, padded with tokens_local).
//
// Train batches. Each shard gets an index of its BOS positions. A micro-step walks that index
// for all ranks in turn: rank 0 takes documents from the shard's current BOS until it holds
// tokens_local + 1 tokens, then rank 1 continues with the next BOS, and so on. Each piece starts
// at a BOS and ends at the earliest of the next BOS, start + max_seq_len (the rest of a long
// document is dropped), and the point where the rank's buffer is full. When the index runs out
// before every rank is full, the whole micro-step is discarded and redone from the first BOS of
// the next shard (the reference's StopIteration path). The next shard is read and indexed on a
// background thread while the current one is in use, as upstream.
//
// Two deliberate differences from the reference, neither of which changes a batch:
//  - upstream indexes the first 6M tokens of a shard synchronously and swaps in the full index
//    when a background scan finishes; we index the whole shard up front, which is what upstream
//    sees whenever the scan wins that race (always in practice: 6M tokens last dozens of steps).
//  - upstream needs at least two training files (it starts prefetching the second at once) and
//    dies with an unrelated exception when the last one runs out; we accept one file and report
//    exhaustion, and a batch that has more documents than cu_seqlens can hold, as DataError.
#pragma once
#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bigram.h"
#include "shard.h"

namespace dataload {

// Upstream's next_multiple_of_n: the smallest positive multiple of n that is >= v (so 0 -> n).
inline int64_t next_multiple_of(int64_t v, int64_t n) { return v <= n ? n : (v + n - 1) / n * n; }

// cu_seqlens entries per micro-batch: room for documents of ~300 tokens on average (FineWeb's
// median is ~400), rounded up to a multiple of 128 so the shapes repeat.
inline int64_t max_num_docs_for(int64_t tokens_local) { return next_multiple_of(tokens_local / 300, 128); }

// A preset's rule for the cu_seqlens entries of a micro-batch: its table where the table names the
// micro-batch's size (record 80's TRAIN_MAX_NUM_DOCS: fewer entries, so smaller attention metadata),
// else max_num_docs_for. A micro-batch with more documents than entries - 1 is a DataError (upstream
// crashes there), never a truncation.
struct MaxDocsRule {
    std::vector<std::pair<int64_t, int64_t>> table;  // (tokens_local, entries)
    int64_t entries(int64_t tokens_local) const {
        for (const auto& [tokens, n] : table)
            if (tokens == tokens_local) return n;
        return max_num_docs_for(tokens_local);
    }
    // Entries enough for every micro-batch of at most max_tokens_local tokens: buffers sized once.
    int64_t capacity(int64_t max_tokens_local) const {
        int64_t n = max_num_docs_for(max_tokens_local);  // non-decreasing in the tokens
        for (const auto& [tokens, entries] : table)
            if (tokens <= max_tokens_local) n = std::max(n, entries);
        return n;
    }
    // Why the table cannot serve (empty when it can): every entry needs room for one document.
    std::string error() const {
        for (const auto& [tokens, n] : table)
            if (tokens < 1 || n < 2)
                return "max-documents table entry " + std::to_string(tokens) + " -> " + std::to_string(n) +
                       ": a micro-batch needs at least 1 token and 2 cu_seqlens entries";
        return "";
    }
};

struct MicroBatchShape {
    int64_t tokens_local;  // inputs, targets and bigram ids per rank per micro-step
    int64_t max_num_docs;  // cu_seqlens entries
};

// The per-rank micro-batch for a step of batch_tokens; throws DataError if it does not divide.
inline MicroBatchShape micro_batch_shape(int64_t batch_tokens, int world_size, int grad_accum,
                                         const MaxDocsRule& max_docs = {}) {
    if (world_size < 1) throw DataError("world size must be at least 1, got " + std::to_string(world_size));
    if (grad_accum < 1) throw DataError("grad_accum must be at least 1, got " + std::to_string(grad_accum));
    const int64_t parts = int64_t(world_size) * grad_accum;
    if (batch_tokens <= 0 || batch_tokens % parts != 0)
        throw DataError("batch of " + std::to_string(batch_tokens) + " tokens does not split evenly over " +
                        std::to_string(world_size) + " rank(s) x " + std::to_string(grad_accum) + " micro-step(s)");
    const int64_t local = batch_tokens / parts;
    // cu_seqlens are int32 on the device.
    if (local > INT32_MAX - 1)
        throw DataError("micro-batch of " + std::to_string(local) + " tokens per rank exceeds int32 offsets");
    return {local, max_docs.entries(local)};
}

// Where next() writes. All pointers except bigram must be set; bigram may be null to skip the
// hash. Capacities are in elements and are checked on every call.
struct BatchBuffers {
    int32_t* inputs = nullptr;
    int32_t* targets = nullptr;
    int32_t* cu_seqlens = nullptr;
    int32_t* bigram = nullptr;
    int64_t token_capacity = 0;  // for inputs, targets and bigram
    int64_t cu_capacity = 0;
};

// What a micro-batch for one rank holds, besides the buffers' contents.
struct Batch {
    int64_t num_tokens = 0;    // tokens_local: entries of inputs, targets, bigram
    int64_t cu_entries = 0;    // max_num_docs: entries of cu_seqlens
    int64_t cu_len = 0;        // leading cu_seqlens entries taken from the data; the rest are num_tokens
    size_t shard = 0;          // index of the shard it came from in files()
    // Token ranges [start, end) of the shard that were concatenated; the final token of the last
    // range is only a target. Train: one per document piece. Val: one contiguous range.
    std::vector<int64_t> starts, ends;
};

namespace detail {

struct IndexedShard {
    std::vector<uint16_t> tokens;
    std::vector<int64_t> bos;  // positions of every BOS, ascending
};

// The shard's tokens, `repeat` times in a row, and their BOS index.
inline std::shared_ptr<const IndexedShard> load_indexed_shard(const std::string& path, int repeat = 1) {
    auto s = std::make_shared<IndexedShard>();
    s->tokens = read_shard(path);
    const size_t once = s->tokens.size();
    for (int k = 1; k < repeat; ++k) s->tokens.insert(s->tokens.end(), s->tokens.begin(), s->tokens.begin() + once);
    const uint16_t* t = s->tokens.data();
    const int64_t n = static_cast<int64_t>(s->tokens.size());
    for (int64_t i = 0; i < n; ++i)
        if (t[i] == kBosId) s->bos.push_back(i);
    return s;
}

inline void check_buffers(const BatchBuffers& out, int64_t tokens, int64_t cu_entries) {
    if (!out.inputs || !out.targets || !out.cu_seqlens)
        throw DataError("batch buffers: inputs, targets and cu_seqlens must all be given");
    if (out.token_capacity < tokens)
        throw DataError("batch buffers hold " + std::to_string(out.token_capacity) + " tokens, the micro-batch needs " +
                        std::to_string(tokens));
    if (out.cu_capacity < cu_entries)
        throw DataError("batch buffers hold " + std::to_string(out.cu_capacity) + " cu_seqlens entries, the micro-batch needs " +
                        std::to_string(cu_entries));
}

// Ensures the boundaries fit: upstream's cu_seqlens assignment fails the same way, less clearly.
inline void check_doc_count(int64_t cu_len, int64_t cu_entries, int64_t tokens, const std::string& file, int rank) {
    if (cu_len > cu_entries)
        throw DataError("rank " + std::to_string(rank) + "'s micro-batch of " + std::to_string(tokens) + " tokens from " +
                        file + " needs " + std::to_string(cu_len) + " cu_seqlens entries but max_num_docs is " +
                        std::to_string(cu_entries) + " (" + std::to_string(cu_len - 1) + " documents; the preset's " +
                        "max-documents rule allows " + std::to_string(cu_entries - 1) + " at this size)");
}

inline void check_all_headers(const std::vector<std::string>& files) {
    for (const auto& f : files) read_shard_header(f);
}

}  // namespace detail

class TrainLoader {
  public:
    struct Options {
        bool prefetch = true;  // read and index the next shard on a background thread
        int32_t bigram_vocab = kRecordBigramVocab;
        // Each shard read this many times in a row, as one shard: a stand-in shard too short for a
        // micro-step of every rank (--plan-step's fallback data) serves as a longer one.
        int repeat = 1;
        MaxDocsRule max_docs;  // cu_seqlens entries per micro-batch size
    };

    // Opens the shards matching pattern (sorted as Python sorts), checks every header, loads the
    // first shard and starts reading the second. rank is the one next() fills.
    TrainLoader(const std::string& pattern, int rank, int world_size, int64_t batch_tokens, int max_seq_len,
                int grad_accum, Options options)
        : pattern_(pattern), files_(expand_glob(pattern)), rank_(rank), world_size_(world_size), options_(options) {
        if (rank < 0 || rank >= world_size)
            throw DataError("rank " + std::to_string(rank) + " is outside world size " + std::to_string(world_size));
        if (options_.bigram_vocab < 2)
            throw DataError("bigram table size must be at least 2, got " + std::to_string(options_.bigram_vocab));
        if (options_.repeat < 1) throw DataError("repeat must be at least 1, got " + std::to_string(options_.repeat));
        if (const std::string e = options_.max_docs.error(); !e.empty()) throw DataError(e);
        set_batch(batch_tokens, max_seq_len, grad_accum);
        detail::check_all_headers(files_);
        shard_ = detail::load_indexed_shard(files_[0], options_.repeat);
        next_file_ = 1;
        start_prefetch();
    }
    TrainLoader(const std::string& pattern, int rank, int world_size, int64_t batch_tokens, int max_seq_len,
                int grad_accum)
        : TrainLoader(pattern, rank, world_size, batch_tokens, max_seq_len, grad_accum, Options{}) {}

    // A new batch size, document cut length or accumulation count, taking effect from the next
    // micro-step (the reference's generator.send at a stage change); the walk goes on where it was.
    void set_batch(int64_t batch_tokens, int max_seq_len, int grad_accum) {
        const MicroBatchShape s = micro_batch_shape(batch_tokens, world_size_, grad_accum, options_.max_docs);
        if (max_seq_len < 1) throw DataError("max_seq_len must be at least 1, got " + std::to_string(max_seq_len));
        shape_ = s;
        max_seq_len_ = max_seq_len;
    }

    // The next micro-batch for this loader's rank.
    Batch next(const BatchBuffers& out) {
        advance();
        return fill(rank_, out);
    }

    // The two halves of next(), for a caller that wants every rank's micro-batch from one loader
    // (dump_batches does): advance() takes the next micro-step's documents for all ranks, then
    // fill(r, ...) writes rank r's part of it, for any r, any number of times.
    void advance() {
        have_batch_ = false;
        while (!walk()) next_shard();
        have_batch_ = true;
        ++micro_steps_;
    }
    Batch fill(int rank, const BatchBuffers& out) const {
        if (!have_batch_) throw DataError("TrainLoader::fill without a successful advance()");
        if (rank < 0 || rank >= world_size_)
            throw DataError("rank " + std::to_string(rank) + " is outside world size " + std::to_string(world_size_));
        const int64_t n = walked_shape_.tokens_local;
        detail::check_buffers(out, n, walked_shape_.max_num_docs);
        const auto& starts = starts_[rank];
        const auto& ends = ends_[rank];
        const int64_t pieces = static_cast<int64_t>(starts.size());
        detail::check_doc_count(pieces + 1, walked_shape_.max_num_docs, n, files_[shard_index_], rank);

        // The pieces concatenate to n + 1 tokens: inputs are the first n, targets the last n.
        const uint16_t* tok = shard_->tokens.data();
        int64_t p = 0;
        for (int64_t k = 0; k < pieces; ++k) {
            for (int64_t i = starts[k]; i < ends[k]; ++i, ++p) {
                const int32_t t = tok[i];
                if (p < n) out.inputs[p] = t;
                if (p > 0) out.targets[p - 1] = t;
            }
        }
        // Lengths as inputs see them: the last piece lost its final token to the targets.
        out.cu_seqlens[0] = 0;
        int64_t acc = 0;
        for (int64_t k = 0; k < pieces; ++k) {
            acc += ends[k] - starts[k] - (k == pieces - 1 ? 1 : 0);
            out.cu_seqlens[k + 1] = static_cast<int32_t>(acc);
        }
        std::fill(out.cu_seqlens + pieces + 1, out.cu_seqlens + walked_shape_.max_num_docs, static_cast<int32_t>(n));
        if (out.bigram) bigram_hash(out.inputs, out.bigram, n, options_.bigram_vocab);

        Batch b;
        b.num_tokens = n;
        b.cu_entries = walked_shape_.max_num_docs;
        b.cu_len = pieces + 1;
        b.shard = shard_index_;
        b.starts = starts;
        b.ends = ends;
        return b;
    }

    // The first token of the current micro-step, every rank's pieces in rank order (targets included),
    // whose id is `limit` or more, as {rank, position in the shard, id}; {-1, -1, 0} when none. The
    // startup walk checks the whole run's tokens against the vocabulary with it.
    std::tuple<int, int64_t, int32_t> token_at_least(int32_t limit) const {
        if (!have_batch_) throw DataError("TrainLoader::token_at_least without a successful advance()");
        const uint16_t* tok = shard_->tokens.data();
        for (int r = 0; r < world_size_; ++r)
            for (size_t k = 0; k < starts_[r].size(); ++k)
                for (int64_t i = starts_[r][k]; i < ends_[r][k]; ++i)
                    if (tok[i] >= limit) return {r, i, tok[i]};
        return {-1, -1, 0};
    }
    const std::string& current_file() const { return files_[shard_index_]; }
    // Throws fill()'s DataError if some rank's part of the current micro-step has more documents than
    // its cu_seqlens entries hold (the startup walk checks the whole run with it, filling nothing).
    void check_documents() const {
        if (!have_batch_) throw DataError("TrainLoader::check_documents without a successful advance()");
        for (int r = 0; r < world_size_; ++r)
            detail::check_doc_count(static_cast<int64_t>(starts_[r].size()) + 1, walked_shape_.max_num_docs,
                                    walked_shape_.tokens_local, files_[shard_index_], r);
    }

    const std::vector<std::string>& files() const { return files_; }
    MicroBatchShape shape() const { return shape_; }  // what the next micro-step will yield

  private:
    // One micro-step of upstream's Shard.next_batch: false when the shard's BOS index runs out
    // before every rank is full, in which case nothing is consumed.
    bool walk() {
        const std::vector<int64_t>& bos = shard_->bos;
        const int64_t nb = static_cast<int64_t>(bos.size());
        const int64_t size = static_cast<int64_t>(shard_->tokens.size());
        const int64_t n = shape_.tokens_local;
        // Built aside: a failed walk must leave the shard's state as it was.
        std::vector<std::vector<int64_t>> starts(world_size_), ends(world_size_);
        int64_t idx = bos_next_;
        for (int r = 0; r < world_size_; ++r) {
            int64_t len = 0;
            while (len <= n) {
                if (idx >= nb) return false;
                const int64_t cur = bos[idx];
                const int64_t doc_end = idx + 1 < nb ? bos[idx + 1] : size;
                const int64_t end = std::min({doc_end, cur + max_seq_len_, cur + n - len + 1});
                starts[r].push_back(cur);
                ends[r].push_back(end);
                len += end - cur;
                ++idx;
            }
        }
        bos_next_ = idx;
        walked_shape_ = shape_;
        starts_ = std::move(starts);
        ends_ = std::move(ends);
        return true;
    }

    void next_shard() {
        if (next_file_ >= files_.size())
            throw DataError("training data exhausted: the " + std::to_string(files_.size()) + " shard(s) matching " +
                            pattern_ + " have no room for micro-step " + std::to_string(micro_steps_ + 1) + " (" +
                            std::to_string(shape_.tokens_local) + " tokens per rank x " + std::to_string(world_size_) +
                            " rank(s)); add shards or shorten the run");
        // A read error of a prefetched shard surfaces here, when the shard is needed, exactly as it
        // would without prefetching.
        shard_ = pending_.valid() ? pending_.get() : detail::load_indexed_shard(files_[next_file_], options_.repeat);
        shard_index_ = next_file_++;
        bos_next_ = 0;
        start_prefetch();
    }

    void start_prefetch() {
        if (options_.prefetch && next_file_ < files_.size())
            pending_ = std::async(std::launch::async, detail::load_indexed_shard, files_[next_file_], options_.repeat);
    }

    std::string pattern_;
    std::vector<std::string> files_;
    int rank_, world_size_;
    Options options_;
    MicroBatchShape shape_{}, walked_shape_{};
    int max_seq_len_ = 0;

    std::shared_ptr<const detail::IndexedShard> shard_;
    size_t shard_index_ = 0, next_file_ = 0;
    std::future<std::shared_ptr<const detail::IndexedShard>> pending_;
    int64_t bos_next_ = 0;     // next unused entry of shard_->bos
    int64_t micro_steps_ = 0;  // micro-steps taken so far
    bool have_batch_ = false;  // starts_/ends_ describe a micro-step of shard_
    std::vector<std::vector<int64_t>> starts_, ends_;  // the current micro-step, per rank
};

// Validation batches: not BOS-aligned. Each micro-step takes the next batch_tokens / grad_accum
// tokens of the shard; rank r's inputs are the r-th tokens_local-sized slice of them and its
// targets the same slice shifted by one; cu_seqlens mark where each BOS in the inputs starts a
// sequence. Like the reference, a micro-step that would reach the shard's last token moves on to
// the next shard's start instead (the rest of the shard is skipped).
class ValLoader {
  public:
    ValLoader(const std::string& pattern, int rank, int world_size, int64_t batch_tokens, int grad_accum,
              int32_t bigram_vocab = kRecordBigramVocab, const MaxDocsRule& max_docs = {})
        : pattern_(pattern), files_(expand_glob(pattern)), rank_(rank), world_size_(world_size),
          shape_(micro_batch_shape(batch_tokens, world_size, grad_accum, max_docs)), bigram_vocab_(bigram_vocab) {
        if (const std::string e = max_docs.error(); !e.empty()) throw DataError(e);
        if (rank < 0 || rank >= world_size)
            throw DataError("rank " + std::to_string(rank) + " is outside world size " + std::to_string(world_size));
        if (bigram_vocab < 2) throw DataError("bigram table size must be at least 2, got " + std::to_string(bigram_vocab));
        detail::check_all_headers(files_);
        rewind();
    }

    // Back to the first token of the first shard, as a freshly made loader (upstream makes a new
    // loader for every validation); the first shard stays in memory when it is the current one.
    void rewind() {
        have_batch_ = false;
        if (tokens_.empty() || file_ != 0) tokens_ = read_shard(files_[0]);
        file_ = 0;
        next_pos_ = 0;
        micro_steps_ = 0;
    }

    Batch next(const BatchBuffers& out) {
        advance();
        return fill(rank_, out);
    }

    void advance() {
        have_batch_ = false;
        const int64_t step_tokens = shape_.tokens_local * world_size_;
        // Upstream's test, including the >=: a micro-step never ends on the shard's last token.
        if (next_pos_ + step_tokens + 1 >= static_cast<int64_t>(tokens_.size())) {
            if (file_ + 1 >= files_.size())
                throw DataError("validation data exhausted: the " + std::to_string(files_.size()) + " shard(s) matching " +
                                pattern_ + " have no room for micro-step " + std::to_string(micro_steps_ + 1) + " of " +
                                std::to_string(step_tokens) + " tokens");
            tokens_ = read_shard(files_[file_ + 1]);
            ++file_;
            next_pos_ = 0;
            if (step_tokens + 1 > static_cast<int64_t>(tokens_.size()))
                throw DataError("validation shard " + files_[file_] + " has " + std::to_string(tokens_.size()) +
                                " tokens, fewer than one micro-step needs (" + std::to_string(step_tokens + 1) + ")");
        }
        pos_ = next_pos_;
        next_pos_ += step_tokens;
        have_batch_ = true;
        ++micro_steps_;
    }

    Batch fill(int rank, const BatchBuffers& out) const {
        if (!have_batch_) throw DataError("ValLoader::fill without a successful advance()");
        if (rank < 0 || rank >= world_size_)
            throw DataError("rank " + std::to_string(rank) + " is outside world size " + std::to_string(world_size_));
        const int64_t n = shape_.tokens_local;
        detail::check_buffers(out, n, shape_.max_num_docs);
        const int64_t begin = pos_ + rank * n;
        const uint16_t* tok = tokens_.data() + begin;
        int64_t cu_len = 1;
        out.cu_seqlens[0] = 0;
        for (int64_t i = 0; i < n; ++i) {
            out.inputs[i] = tok[i];
            out.targets[i] = tok[i + 1];
            if (tok[i] == kBosId) {
                // Count past the end without writing, so the error can say how many were needed.
                if (cu_len < shape_.max_num_docs) out.cu_seqlens[cu_len] = static_cast<int32_t>(i);
                ++cu_len;
            }
        }
        detail::check_doc_count(cu_len, shape_.max_num_docs, n, files_[file_], rank);
        std::fill(out.cu_seqlens + cu_len, out.cu_seqlens + shape_.max_num_docs, static_cast<int32_t>(n));
        if (out.bigram) bigram_hash(out.inputs, out.bigram, n, bigram_vocab_);

        Batch b;
        b.num_tokens = n;
        b.cu_entries = shape_.max_num_docs;
        b.cu_len = cu_len;
        b.shard = file_;
        b.starts = {begin};
        b.ends = {begin + n + 1};
        return b;
    }

    // As TrainLoader's: the first token of the current micro-step (each rank's inputs and the target
    // after them) whose id is `limit` or more, as {rank, position in the shard, id}; {-1, -1, 0} if none.
    std::tuple<int, int64_t, int32_t> token_at_least(int32_t limit) const {
        if (!have_batch_) throw DataError("ValLoader::token_at_least without a successful advance()");
        const int64_t n = shape_.tokens_local;
        for (int r = 0; r < world_size_; ++r)
            for (int64_t i = pos_ + r * n; i <= pos_ + r * n + n; ++i)
                if (tokens_[i] >= limit) return {r, i, tokens_[i]};
        return {-1, -1, 0};
    }
    const std::string& current_file() const { return files_[file_]; }
    // As TrainLoader's: fill()'s DataError where some rank's slice has more documents than its entries.
    void check_documents() const {
        if (!have_batch_) throw DataError("ValLoader::check_documents without a successful advance()");
        const int64_t n = shape_.tokens_local;
        for (int r = 0; r < world_size_; ++r) {
            const uint16_t* tok = tokens_.data() + pos_ + r * n;
            const int64_t cu_len = 1 + std::count(tok, tok + n, kBosId);
            detail::check_doc_count(cu_len, shape_.max_num_docs, n, files_[file_], r);
        }
    }

    const std::vector<std::string>& files() const { return files_; }
    MicroBatchShape shape() const { return shape_; }

  private:
    std::string pattern_;
    std::vector<std::string> files_;
    int rank_, world_size_;
    MicroBatchShape shape_;
    int32_t bigram_vocab_;
    std::vector<uint16_t> tokens_;
    size_t file_ = 0;
    int64_t pos_ = 0;       // first token of the current micro-step
    int64_t next_pos_ = 0;  // first token of the next one
    int64_t micro_steps_ = 0;
    bool have_batch_ = false;
};

}  // namespace dataload
