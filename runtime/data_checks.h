// The data checks at startup: the shards a run reads are there, have valid headers, hold every token
// the run's steps and its validation take, and every token id is inside the vocabulary, so that a run
// that cannot finish says why before anything is written; and the training data's identity, which
// every checkpoint records.
#pragma once
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "../data/loader.h"

// The repository the binary was built in: the parent of the executable's directory (build/..).
std::string repo_dir() {
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const std::string path = n > 0 ? std::string(exe, size_t(n)) : "./build/train_gpt";
    const std::string build = path.substr(0, path.rfind('/'));
    return build.substr(0, build.rfind('/'));
}

std::string current_dir() {
    char cwd[4096];
    return getcwd(cwd, sizeof cwd) ? cwd : "(unknown)";
}

// The shards a run reads: a preset's default path is relative to the repository, wherever the run
// starts; a path given on the command line is taken as it is.
struct DataFiles {
    std::string train, val;
    bool train_default = false, val_default = false;
    std::string remedy;  // how to get the preset's default data
};

// What a run reads of its data: the training batches of each step [0, last) (tokens over all ranks and
// micro-steps), the validation tokens, and the shapes and id ranges the loaders follow.
struct DataNeeds {
    int vocab_size = 0, bigram_vocab = 0, grad_accum = 1;
    dataload::MaxDocsRule max_docs;          // cu_seqlens entries per micro-batch size
    int64_t first_batch_tokens = 0;          // the training loader's batch before the first step
    int first_max_seq_len = 0;               // and its document cut length
    std::vector<int64_t> step_batch_tokens;  // one per step the run trains
    std::vector<int> step_max_seq_len;       // likewise
    int64_t val_batch_tokens = 0, val_tokens = 0;
};

// Why the shards `glob` names cannot be opened (no match, a bad header), or "".
std::string shard_error(const std::string& what, const std::string& glob, bool is_default, const std::string& remedy) {
    try {
        for (const std::string& f : dataload::expand_glob(glob)) dataload::read_shard_header(f);
    } catch (const dataload::DataError& e) {
        if (!is_default) return what + ": " + e.what();
        return what + ": " + e.what() + " (the preset's default, relative to the repository; the current directory is " +
               current_dir() + "): " + remedy + ", or give " +
               (what == "training data" ? "--train-files" : "--val-files");
    }
    return "";
}

// The message for a token id outside the vocabulary (as the batch producer words it at run time).
template <class Loader>
std::string vocabulary_error(const Loader& loader, int vocab) {
    const auto [rank, at, id] = loader.token_at_least(vocab);
    if (rank < 0) return "";
    return "token id " + std::to_string(id) + " at token " + std::to_string(at) + " of shard " + loader.current_file() +
           " (read by rank " + std::to_string(rank) + ") is outside the vocabulary [0, " + std::to_string(vocab) + ")";
}

// Whether the training shards hold the tokens of the run's steps on every rank, walked as the
// loader walks them (documents cut at the stage's max_seq_len, shard tails skipped, the batch
// growing with the stages), every token id inside the vocabulary and every rank's documents inside
// its cu_seqlens entries, or why not.
std::string train_tokens_error(const DataNeeds& n, const std::string& glob, int world) {
    const int last = static_cast<int>(n.step_batch_tokens.size());
    int step = 0;
    try {
        dataload::TrainLoader::Options lo;
        lo.bigram_vocab = n.bigram_vocab;
        lo.max_docs = n.max_docs;
        dataload::TrainLoader loader(glob, 0, world, n.first_batch_tokens, n.first_max_seq_len, n.grad_accum, lo);
        for (; step < last; ++step) {
            loader.set_batch(n.step_batch_tokens[size_t(step)], n.step_max_seq_len[size_t(step)], n.grad_accum);
            for (int i = 0; i < n.grad_accum; ++i) {
                loader.advance();
                if (std::string e = vocabulary_error(loader, n.vocab_size); !e.empty())
                    return "the training data of step " + std::to_string(step) + ": " + e;
                try {
                    loader.check_documents();
                } catch (const dataload::DataError& e) {
                    return "the training data of step " + std::to_string(step) + ": " + e.what();
                }
            }
        }
    } catch (const dataload::DataError& e) {
        return "the training data cannot feed this run's " + std::to_string(last) + " steps on " + std::to_string(world) +
               " rank(s): it runs out in step " + std::to_string(step) + ": " + e.what();
    }
    return "";
}

// Whether the validation shards hold val_tokens as the validation loader takes them, or why not.
std::string val_tokens_error(const DataNeeds& n, const std::string& glob, int world) {
    try {
        dataload::ValLoader loader(glob, 0, world, n.val_batch_tokens, n.grad_accum, n.bigram_vocab, n.max_docs);
        for (int64_t i = 0; i < n.grad_accum * n.val_tokens / n.val_batch_tokens; ++i) {
            loader.advance();
            if (std::string e = vocabulary_error(loader, n.vocab_size); !e.empty()) return "the validation data: " + e;
            loader.check_documents();
        }
    } catch (const dataload::DataError& e) {
        return "the validation data cannot supply --val-tokens " + std::to_string(n.val_tokens) + ": " + e.what();
    }
    return "";
}

// The data checks, in the order their messages are most useful (rank 0 reads for every rank).
std::string data_error(const DataNeeds& n, const DataFiles& f, int world) {
    for (const std::string& e : {shard_error("training data", f.train, f.train_default, f.remedy),
                                 shard_error("validation data", f.val, f.val_default, f.remedy)})
        if (!e.empty()) return e;
    if (std::string e = val_tokens_error(n, f.val, world); !e.empty()) return e;
    return train_tokens_error(n, f.train, world);
}

// The training shards' identity, cheap at any size: each shard's name and size (`name:bytes,...`),
// and an FNV-1a 64 over each one's header and two 64 KiB samples of its tokens, the first and the
// last (reading all of the record's shards a second time would cost seconds at every start; a
// shard rewritten with the same size and the same ends is not told apart). Empty when a shard
// cannot be read (the data check says why).
std::pair<std::string, std::string> data_identity(const std::string& glob) {
    std::string shards;
    uint64_t h = 0xcbf29ce484222325ull;
    const auto add = [&](const void* p, size_t n) {
        for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 0x100000001b3ull;
    };
    try {
        for (const std::string& f : dataload::expand_glob(glob)) {
            struct stat st {};
            FILE* in = std::fopen(f.c_str(), "rb");
            if (!in || fstat(fileno(in), &st) != 0) {
                if (in) std::fclose(in);
                return {};
            }
            const std::string name = f.substr(f.rfind('/') + 1);
            shards += (shards.empty() ? "" : ",") + name + ":" + std::to_string(st.st_size);
            add(name.data(), name.size() + 1);
            constexpr long kHeader = 1024, kSample = 65536;
            std::vector<unsigned char> buf(kHeader + kSample);
            for (long at : {0L, std::max(0L, long(st.st_size) - kSample)}) {
                const size_t n = std::fseek(in, at, SEEK_SET) == 0 ? std::fread(buf.data(), 1, at ? kSample : buf.size(), in) : 0;
                add(buf.data(), n);
            }
            std::fclose(in);
        }
    } catch (const dataload::DataError&) {
        return {};
    }
    char text[20];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
    return {shards, text};
}

