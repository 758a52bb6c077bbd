// The loaders (data/loader.h) and the dump (data/dump.h):
//  - a train walk worked out by hand on three tiny shards (a cut document, a zero-length last
//    piece, a shard skipped because it cannot fill every rank, running out of data);
//  - every scenario in tests/data/fixtures/scenarios.txt against the Python reference's output
//    stored in tests/data/fixtures/expected/ (hand-made layouts and Tiny Shakespeare; world sizes
//    1, 2, 8; grad_accum 1, 4, 8; batch-size changes; validation batches);
//  - background prefetch against no prefetch over many small shards;
//  - per-rank loaders against one loader filling every rank, set_batch, rewind;
//  - each error a caller can hit, with its message.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "data/dump.h"
#include "data/loader.h"
#include "tests/data/data_test_util.h"

using datatest::expect_data_error;
using namespace dataload;

namespace {

constexpr int32_t B = kBosId;

// Host buffers for one micro-batch, as the trainer's pinned ones.
struct Buffers {
    std::vector<int32_t> inputs, targets, cu, bigram;
    Buffers(int64_t tokens, int64_t cu_entries)
        : inputs(static_cast<size_t>(tokens), -1), targets(inputs), cu(static_cast<size_t>(cu_entries), -1), bigram(inputs) {}
    BatchBuffers view() {
        return {inputs.data(), targets.data(), cu.data(), bigram.data(), static_cast<int64_t>(inputs.size()),
                static_cast<int64_t>(cu.size())};
    }
};

// Everything a micro-batch consists of, for comparing runs.
struct Got {
    Batch batch;
    std::vector<int32_t> inputs, targets, cu, bigram;
    bool operator==(const Got& o) const {
        return batch.num_tokens == o.batch.num_tokens && batch.cu_entries == o.batch.cu_entries &&
               batch.cu_len == o.batch.cu_len && batch.shard == o.batch.shard && batch.starts == o.batch.starts &&
               batch.ends == o.batch.ends && inputs == o.inputs && targets == o.targets && cu == o.cu && bigram == o.bigram;
    }
};

template <class Loader>
Got take(Loader& loader) {
    const MicroBatchShape s = loader.shape();
    Buffers buf(s.tokens_local, s.max_num_docs);
    Got g;
    g.batch = loader.next(buf.view());
    g.inputs = buf.inputs;
    g.targets = buf.targets;
    g.cu = buf.cu;
    g.bigram = buf.bigram;
    return g;
}

std::vector<int32_t> padded_cu(std::vector<int32_t> head, int32_t n, size_t entries) {
    head.resize(entries, n);
    return head;
}

std::vector<int32_t> hash_of(const std::vector<int32_t>& inputs) {
    std::vector<int32_t> out(inputs.size());
    bigram_hash(inputs.data(), out.data(), static_cast<int64_t>(inputs.size()), kRecordBigramVocab);
    return out;
}

void check_batch(const std::string& what, const Got& g, size_t shard, std::vector<int64_t> starts, std::vector<int64_t> ends,
                 std::vector<int32_t> inputs, std::vector<int32_t> targets, std::vector<int32_t> cu_head) {
    const int32_t n = static_cast<int32_t>(inputs.size());
    test::check(g.batch.shard == shard, "%s: shard %zu, want %zu", what.c_str(), g.batch.shard, shard);
    test::check(g.batch.starts == starts && g.batch.ends == ends, "%s: document ranges differ", what.c_str());
    test::check(g.inputs == inputs, "%s: inputs differ", what.c_str());
    test::check(g.targets == targets, "%s: targets differ", what.c_str());
    test::check(g.batch.cu_len == static_cast<int64_t>(cu_head.size()) && g.batch.cu_entries == 128 &&
                    g.cu == padded_cu(cu_head, n, 128),
                "%s: cu_seqlens differ", what.c_str());
    test::check(g.bigram == hash_of(inputs), "%s: bigram ids differ", what.c_str());
}

// Three shards, worked by hand (positions in brackets, B = BOS):
//  A: 7 | B 10 11 12 | B 20 | B 30..38 | B | B 50 51        (21 tokens; the 7 continues a document)
//     documents start at 1, 5, 7, 17, 18
//  B: B 60..65 | B 70                                        (documents at 0, 7; 9 tokens)
//  C: B 80..84 | B 90 91 | B 100..105 | B | B 120 121        (documents at 0, 6, 9, 16, 17; 20 tokens)
// Two ranks, 10 tokens per step (5 per rank, so 6 taken), max_seq_len 4:
//  step 0, A: rank 0 takes [1,5) (the whole document, also exactly max_seq_len) and [5,7)
//    (ends at the next BOS, filling 4 + 2 = 6); rank 1 takes [7,11) (cut by max_seq_len; the
//    rest of that document is dropped), [17,18) and [18,19) (one token to fill, which becomes
//    a zero-length last document once the final token is moved to the targets).
//  step 1: A has no BOS left; B fills rank 0 ([0,4) and [7,9)) but not rank 1, so B is dropped
//    and C is used from its start: rank 0 [0,4) [6,8); rank 1 [9,13) [16,17) [17,18).
//  step 2: C has no BOS left and there is no other shard: out of data.
// With one rank and grad_accum 2 the same 5-token micro-batches come from one rank's walk, so
// B is not dropped: A rank 0, A rank 1, B rank 0, C rank 0, C rank 1, then out of data.
void test_hand_walk(const datatest::ScratchDir& dir) {
    std::vector<uint16_t> a = {7, B, 10, 11, 12, B, 20, B};
    for (uint16_t t = 30; t <= 38; ++t) a.push_back(t);
    a.insert(a.end(), {B, B, 50, 51});
    std::vector<uint16_t> b = {B, 60, 61, 62, 63, 64, 65, B, 70};
    std::vector<uint16_t> c = {B, 80, 81, 82, 83, 84, B, 90, 91, B, 100, 101, 102, 103, 104, 105, B, B, 120, 121};
    write_shard(dir.file("hand_000.bin"), a);
    write_shard(dir.file("hand_001.bin"), b);
    write_shard(dir.file("hand_002.bin"), c);
    const std::string pattern = dir.file("hand_*.bin");

    for (bool prefetch : {true, false}) {
        const std::string tag = prefetch ? " (prefetch)" : " (no prefetch)";
        TrainLoader::Options opt;
        opt.prefetch = prefetch;
        TrainLoader r0(pattern, 0, 2, 10, 4, 1, opt), r1(pattern, 1, 2, 10, 4, 1, opt);
        test::check(r0.shape().tokens_local == 5 && r0.shape().max_num_docs == 128, "hand walk: shape");
        check_batch("step 0 rank 0" + tag, take(r0), 0, {1, 5}, {5, 7}, {B, 10, 11, 12, B}, {10, 11, 12, B, 20}, {0, 4, 5});
        check_batch("step 0 rank 1" + tag, take(r1), 0, {7, 17, 18}, {11, 18, 19}, {B, 30, 31, 32, B}, {30, 31, 32, B, B},
                    {0, 4, 5, 5});
        check_batch("step 1 rank 0" + tag, take(r0), 2, {0, 6}, {4, 8}, {B, 80, 81, 82, B}, {80, 81, 82, B, 90}, {0, 4, 5});
        check_batch("step 1 rank 1" + tag, take(r1), 2, {9, 16, 17}, {13, 17, 18}, {B, 100, 101, 102, B},
                    {100, 101, 102, B, B}, {0, 4, 5, 5});
        expect_data_error("hand walk: out of data" + tag, [&] { take(r0); },
                          {"training data exhausted", "3 shard(s) matching", pattern, "micro-step 3",
                           "5 tokens per rank x 2 rank(s)"});

        TrainLoader one(pattern, 0, 1, 10, 4, 2, opt);
        check_batch("w1 g2 micro 0" + tag, take(one), 0, {1, 5}, {5, 7}, {B, 10, 11, 12, B}, {10, 11, 12, B, 20}, {0, 4, 5});
        check_batch("w1 g2 micro 1" + tag, take(one), 0, {7, 17, 18}, {11, 18, 19}, {B, 30, 31, 32, B}, {30, 31, 32, B, B},
                    {0, 4, 5, 5});
        check_batch("w1 g2 micro 2" + tag, take(one), 1, {0, 7}, {4, 9}, {B, 60, 61, 62, B}, {60, 61, 62, B, 70}, {0, 4, 5});
        check_batch("w1 g2 micro 3" + tag, take(one), 2, {0, 6}, {4, 8}, {B, 80, 81, 82, B}, {80, 81, 82, B, 90}, {0, 4, 5});
        check_batch("w1 g2 micro 4" + tag, take(one), 2, {9, 16, 17}, {13, 17, 18}, {B, 100, 101, 102, B},
                    {100, 101, 102, B, B}, {0, 4, 5, 5});
        expect_data_error("w1 g2: out of data" + tag, [&] { take(one); }, {"training data exhausted", "micro-step 6"});
    }

    // Validation, two ranks, 10 tokens per micro-step: the first micro-step reads positions
    // 0..10 of A (rank 0 inputs 0..4, rank 1 inputs 5..9); for the second, 10 + 10 + 1 >= 21,
    // so the loader moves on to B, which is too small for a micro-step.
    ValLoader v0(pattern, 0, 2, 10, 1), v1(pattern, 1, 2, 10, 1);
    const Got g0 = take(v0), g1 = take(v1);
    test::check(g0.inputs == std::vector<int32_t>{7, B, 10, 11, 12} && g0.targets == std::vector<int32_t>{B, 10, 11, 12, B},
                "val rank 0 tokens");
    test::check(g0.batch.cu_len == 2 && g0.cu == padded_cu({0, 1}, 5, 128), "val rank 0 cu_seqlens");
    test::check(g0.batch.starts == std::vector<int64_t>{0} && g0.batch.ends == std::vector<int64_t>{6}, "val rank 0 range");
    test::check(g1.inputs == std::vector<int32_t>{B, 20, B, 30, 31} && g1.targets == std::vector<int32_t>{20, B, 30, 31, 32},
                "val rank 1 tokens");
    // A BOS at position 0 gives a zero-length first sequence, as upstream's cu_seqlens do.
    test::check(g1.batch.cu_len == 3 && g1.cu == padded_cu({0, 0, 2}, 5, 128), "val rank 1 cu_seqlens");
    test::check(g1.bigram == hash_of(g1.inputs), "val rank 1 bigram ids");
    expect_data_error("val: next shard too small", [&] { take(v0); },
                      {"validation shard", dir.file("hand_001.bin"), "has 9 tokens, fewer than one micro-step needs (11)"});
}

std::vector<std::string> split_words(const std::string& line) {
    std::istringstream in(line);
    std::vector<std::string> out;
    for (std::string w; in >> w;) out.push_back(w);
    return out;
}

// Runs dump_batches for argv (as the tool would) and returns what it printed and whether it
// stopped on a DataError.
std::string run_dump(const std::vector<std::string>& args, bool& failed, std::string* error = nullptr) {
    std::vector<const char*> argv = {"dump_batches"};
    for (const auto& a : args) argv.push_back(a.c_str());
    const DumpConfig config = parse_dump_args(static_cast<int>(argv.size()), argv.data());
    char* text = nullptr;
    size_t size = 0;
    std::FILE* out = open_memstream(&text, &size);
    failed = false;
    try {
        dump_batches(out, config);
    } catch (const DataError& e) {
        failed = true;
        if (error) *error = e.what();
    }
    std::fclose(out);
    std::string s(text, size);
    std::free(text);
    return s;
}

// First differing line, for a readable failure.
std::string first_difference(const std::string& got, const std::string& want) {
    std::istringstream g(got), w(want);
    std::string gl, wl;
    for (int line = 1;; ++line) {
        const bool hg = static_cast<bool>(std::getline(g, gl)), hw = static_cast<bool>(std::getline(w, wl));
        if (!hg && !hw) return "(identical)";
        if (gl != wl || hg != hw)
            return "line " + std::to_string(line) + ": got \"" + (hg ? gl : "<end>") + "\" want \"" + (hw ? wl : "<end>") + "\"";
    }
}

void test_fixtures() {
    const std::string repo = datatest::repo_root();
    const std::string fixtures = repo + "/tests/data/fixtures/";
    std::istringstream lines(datatest::read_text_file(fixtures + "scenarios.txt"));
    int count = 0;
    for (std::string line; std::getline(lines, line);) {
        auto words = split_words(line);
        if (words.empty() || words[0][0] == '#') continue;
        const std::string name = words[0], expect = words[1];
        std::vector<std::string> args(words.begin() + 2, words.end());
        for (size_t i = 0; i + 1 < args.size(); ++i)
            if (args[i] == "--files") args[i + 1] = repo + "/" + args[i + 1];
        const std::string want = datatest::read_text_file(fixtures + "expected/" + name + ".txt");
        for (bool prefetch : {true, false}) {
            auto run_args = args;
            if (!prefetch) run_args.push_back("--no-prefetch");
            bool failed = false;
            std::string error;
            const std::string got = run_dump(run_args, failed, &error);
            const char* mode = prefetch ? "prefetch" : "no prefetch";
            test::check(got == want, "scenario %s (%s): output differs from the reference at %s", name.c_str(), mode,
                        first_difference(got, want).c_str());
            test::check(failed == (expect == "error"), "scenario %s (%s): %s", name.c_str(), mode,
                        failed ? ("stopped with: " + error).c_str() : "expected to run out of data");
        }
        ++count;
    }
    test::check(count >= 10, "only %d scenarios found in %sscenarios.txt", count, fixtures.c_str());
}

// Many small shards of varied layouts, including ones too small for a micro-step: the batch
// sequence with the next shard read in the background must equal the one read on demand.
void test_prefetch(const datatest::ScratchDir& dir) {
    for (int s = 0; s < 12; ++s) {
        std::vector<int> lengths;
        const int docs = s % 5 == 3 ? 2 : 20 + test::randint(0, 60);
        for (int d = 0; d < docs; ++d) lengths.push_back(test::randint(0, 9) < 8 ? test::randint(1, 40) : test::randint(41, 300));
        std::vector<uint16_t> tokens = datatest::make_docs(lengths, static_cast<uint32_t>(s));
        // Some shards begin mid-document, as real shards do.
        if (s % 3 == 1) tokens.insert(tokens.begin(), {1, 2, 3});
        write_shard(dir.file("p_" + std::to_string(100 + s) + ".bin"), tokens);
    }
    const std::string pattern = dir.file("p_*.bin");
    for (int world : {1, 3}) {
        TrainLoader::Options on, off;
        off.prefetch = false;
        TrainLoader a(pattern, world - 1, world, 48 * world, 24, 1, on), b(pattern, world - 1, world, 48 * world, 24, 1, off);
        int same = 0, total = 0;
        size_t last_shard = 0;
        std::string ea, eb;
        for (;;) {
            Got ga, gb;
            try {
                ga = take(a);
            } catch (const DataError& e) {
                ea = e.what();
            }
            try {
                gb = take(b);
            } catch (const DataError& e) {
                eb = e.what();
            }
            if (!ea.empty() || !eb.empty()) break;
            same += ga == gb;
            ++total;
            last_shard = ga.batch.shard;
        }
        test::check(same == total, "prefetch, world %d: %d of %d micro-batches differ", world, total - same, total);
        test::check(total > 30 && last_shard == 11, "prefetch, world %d: only %d micro-batches, last shard %zu", world,
                    total, last_shard);
        test::check(!ea.empty() && ea == eb, "prefetch, world %d: different endings: '%s' vs '%s'", world, ea.c_str(),
                    eb.c_str());
    }
}

// One loader per rank gives the same as one loader filling every rank; a loader whose batch
// doubles together with grad_accum continues exactly like one that never changed; one rank
// with grad_accum 8 sees, micro-step by micro-step, what 8 ranks see rank by rank.
void test_equivalences() {
    const std::string ts = datatest::repo_root() + "/data/tinyshakespeare/tinyshakespeare_train_*.bin";
    const int world = 4;
    std::vector<std::unique_ptr<TrainLoader>> per_rank;
    for (int r = 0; r < world; ++r) per_rank.push_back(std::make_unique<TrainLoader>(ts, r, world, 4 * 1024, 300, 1));
    TrainLoader shared(ts, 0, world, 4 * 1024, 300, 1);
    int same = 0;
    for (int step = 0; step < 6; ++step) {
        shared.advance();
        for (int r = 0; r < world; ++r) {
            Got mine = take(*per_rank[r]);
            Buffers buf(1024, 128);
            Got theirs;
            theirs.batch = shared.fill(r, buf.view());
            theirs.inputs = buf.inputs;
            theirs.targets = buf.targets;
            theirs.cu = buf.cu;
            theirs.bigram = buf.bigram;
            same += mine == theirs;
        }
    }
    test::check(same == 6 * world, "per-rank loaders vs fill(rank): %d of %d micro-batches differ", 6 * world - same, 6 * world);

    TrainLoader plain(ts, 1, 2, 2048, 128, 1), changed(ts, 1, 2, 2048, 128, 1);
    bool ok = take(plain) == take(changed);
    changed.set_batch(4096, 128, 2);
    test::check(changed.shape().tokens_local == 1024, "set_batch: tokens per rank");
    for (int k = 0; k < 5; ++k) ok = ok && take(plain) == take(changed);
    test::check(ok, "set_batch with doubled batch and grad_accum continues the same micro-batches");

    TrainLoader wide(ts, 0, 8, 8 * 512, 200, 1), deep(ts, 0, 1, 8 * 512, 200, 8);
    int equal = 0;
    for (int step = 0; step < 3; ++step) {
        wide.advance();
        for (int r = 0; r < 8; ++r) {
            Buffers bw(512, 128), bd(512, 128);
            wide.fill(r, bw.view());
            deep.next(bd.view());
            equal += bw.inputs == bd.inputs && bw.targets == bd.targets && bw.cu == bd.cu && bw.bigram == bd.bigram;
        }
    }
    test::check(equal == 24, "8 ranks x grad_accum 1 vs 1 rank x grad_accum 8: %d of 24 differ", 24 - equal);

    // A fresh validation loader and a rewound one agree.
    const std::string tsv = datatest::repo_root() + "/data/tinyshakespeare/tinyshakespeare_val_*.bin";
    ValLoader v(tsv, 1, 2, 4096, 1);
    const Got first = take(v), second = take(v);
    v.rewind();
    ValLoader fresh(tsv, 1, 2, 4096, 1);
    const Got again = take(v);
    test::check(again == first && take(fresh) == first && !(second == first), "val rewind replays from the start");
}

void test_errors(const datatest::ScratchDir& dir) {
    const std::string none = dir.file("absent_*.bin");
    expect_data_error("train: glob matches nothing", [&] { TrainLoader(none, 0, 1, 64, 16, 1); }, {"no files match", none});
    expect_data_error("val: glob matches nothing", [&] { ValLoader(none, 0, 1, 64, 1); }, {"no files match", none});

    // A broken file among good ones is reported when the loader is made, not when reached.
    for (int i = 0; i < 3; ++i) write_shard(dir.file("e_00" + std::to_string(i) + ".bin"), datatest::make_docs({20, 30, 40}, i));
    datatest::write_raw_shard(dir.file("e_003.bin"), 20240520, 1, 50, std::vector<uint16_t>(49, 1));
    const std::string eglob = dir.file("e_*.bin");
    expect_data_error("train: a truncated shard among good ones", [&] { TrainLoader(eglob, 0, 1, 64, 16, 1); },
                      {dir.file("e_003.bin"), "claims 50 tokens"});
    expect_data_error("val: a truncated shard among good ones", [&] { ValLoader(eglob, 0, 1, 64, 1); },
                      {dir.file("e_003.bin"), "claims 50 tokens"});

    const std::string good = dir.file("e_00[012].bin");
    expect_data_error("batch not divisible", [&] { TrainLoader(good, 0, 3, 100, 16, 1); },
                      {"batch of 100 tokens does not split evenly over 3 rank(s) x 1 micro-step(s)"});
    expect_data_error("rank outside world", [&] { TrainLoader(good, 2, 2, 64, 16, 1); }, {"rank 2 is outside world size 2"});
    expect_data_error("max_seq_len zero", [&] { TrainLoader(good, 0, 1, 64, 0, 1); }, {"max_seq_len must be at least 1"});
    expect_data_error("grad_accum zero", [&] { TrainLoader(good, 0, 1, 64, 16, 0); }, {"grad_accum must be at least 1"});
    expect_data_error("val batch not divisible", [&] { ValLoader(good, 0, 2, 64, 3); }, {"does not split evenly over 2 rank(s) x 3"});
    {
        TrainLoader l(good, 0, 1, 64, 64, 1);
        expect_data_error("set_batch not divisible", [&] { l.set_batch(65, 16, 2); }, {"65 tokens does not split evenly"});
        Buffers small(63, 128), few_cu(64, 127);
        expect_data_error("fill before advance", [&] { l.fill(0, small.view()); }, {"without a successful advance"});
        expect_data_error("token buffer too small", [&] { l.next(small.view()); },
                          {"batch buffers hold 63 tokens, the micro-batch needs 64"});
        expect_data_error("cu_seqlens buffer too small", [&] { l.fill(0, few_cu.view()); },
                          {"127 cu_seqlens entries, the micro-batch needs 128"});
        BatchBuffers missing = Buffers(64, 128).view();
        missing.targets = nullptr;
        expect_data_error("missing buffer", [&] { l.fill(0, missing); }, {"inputs, targets and cu_seqlens must all be given"});
        Buffers ok(64, 128);
        BatchBuffers no_bigram = ok.view();
        no_bigram.bigram = nullptr;
        ok.bigram.assign(64, -7);
        l.fill(0, no_bigram);
        test::check(ok.bigram == std::vector<int32_t>(64, -7) && ok.inputs[0] == B, "a null bigram buffer skips the hash");
    }

    // Documents of one token each: 129 of them fill a 128-token micro-batch, one more boundary
    // than the 128 cu_seqlens entries hold. Upstream fails here too (a shape mismatch).
    write_shard(dir.file("bos_only.bin"), std::vector<uint16_t>(1000, B));
    expect_data_error("too many documents for cu_seqlens", [&] {
        TrainLoader l(dir.file("bos_only.bin"), 0, 1, 128, 16, 1);
        Buffers buf(128, 128);
        l.next(buf.view());
    }, {dir.file("bos_only.bin"), "needs 130 cu_seqlens entries but max_num_docs is 128"});
    expect_data_error("val: too many documents for cu_seqlens", [&] {
        ValLoader v(dir.file("bos_only.bin"), 0, 1, 128, 1);
        Buffers buf(128, 128);
        v.next(buf.view());
    }, {"needs 129 cu_seqlens entries but max_num_docs is 128"});

    // A preset's max-documents table (record 80's TRAIN_MAX_NUM_DOCS rule): fewer entries than the
    // formula's, so fewer documents fit; the error names the rank whose part overflows, from fill()
    // and from check_documents() (the startup walk's check, which fills nothing).
    TrainLoader::Options table64;
    table64.max_docs.table = {{128, 64}};
    expect_data_error("table: too many documents", [&] {
        TrainLoader l(dir.file("bos_only.bin"), 0, 1, 128, 16, 1, table64);
        Buffers buf(128, 128);
        l.next(buf.view());
    }, {"rank 0's micro-batch of 128 tokens", "needs 130 cu_seqlens entries but max_num_docs is 64", "allows 63"});
    {
        std::vector<uint16_t> two = {B};  // rank 0: one 80-token document; rank 1: one-token documents
        for (int i = 0; i < 79; ++i) two.push_back(static_cast<uint16_t>(1 + i));
        for (int i = 0; i < 200; ++i) two.push_back(B);
        write_shard(dir.file("two_ranks.bin"), two);
        TrainLoader::Options t;
        t.max_docs.table = {{64, 32}};
        TrainLoader l(dir.file("two_ranks.bin"), 0, 2, 128, 2048, 1, t);
        expect_data_error("check_documents before advance", [&] { l.check_documents(); }, {"without a successful advance"});
        l.advance();
        Buffers buf(64, 32);
        const Batch mine = l.fill(0, buf.view());
        test::check(mine.cu_len == 2 && mine.cu_entries == 32, "rank 0's part fits the table's 32 entries (%lld of %lld)",
                    (long long)mine.cu_len, (long long)mine.cu_entries);
        expect_data_error("table: rank 1 overflows, check_documents", [&] { l.check_documents(); },
                          {"rank 1's micro-batch of 64 tokens", "needs 66 cu_seqlens entries but max_num_docs is 32"});
        expect_data_error("table: rank 1 overflows, fill", [&] { l.fill(1, buf.view()); },
                          {"rank 1's micro-batch", "needs 66 cu_seqlens entries"});
        TrainLoader roomy(dir.file("two_ranks.bin"), 0, 2, 128, 2048, 1);  // the formula: 128 entries
        roomy.advance();
        roomy.check_documents();
        // val slices: rank 1 reads tokens 64..127, the first document's last 16 then 48 one-token ones
        ValLoader v(dir.file("two_ranks.bin"), 0, 2, 128, 1, kRecordBigramVocab, t.max_docs);
        expect_data_error("val check_documents before advance", [&] { v.check_documents(); }, {"without a successful advance"});
        v.advance();
        expect_data_error("val table: rank 1 overflows", [&] { v.check_documents(); },
                          {"rank 1's micro-batch of 64 tokens", "needs 49 cu_seqlens entries but max_num_docs is 32"});
        Buffers vbuf(64, 32);
        expect_data_error("val table: rank 1 overflows, fill", [&] { v.fill(1, vbuf.view()); }, {"needs 49 cu_seqlens entries"});
        test::check(v.fill(0, vbuf.view()).cu_len == 2, "val: rank 0's slice holds one document start");
    }
    TrainLoader::Options bad_table;
    bad_table.max_docs.table = {{64, 1}};
    expect_data_error("table entry without room for a document", [&] { TrainLoader(good, 0, 1, 64, 16, 1, bad_table); },
                      {"max-documents table entry 64 -> 1", "2 cu_seqlens entries"});
    expect_data_error("val: table entry without room", [&] { ValLoader(good, 0, 1, 64, 1, kRecordBigramVocab, bad_table.max_docs); },
                      {"max-documents table entry 64 -> 1"});

    // A shard that breaks after the loader checked it fails when reached, with or without
    // prefetch (prefetch must surface the background thread's error, not hang or lose it).
    for (bool prefetch : {true, false}) {
        for (int i = 0; i < 3; ++i)
            write_shard(dir.file("late_" + std::to_string(i) + ".bin"), datatest::make_docs(std::vector<int>(10, 10), i));
        TrainLoader::Options opt;
        opt.prefetch = prefetch;
        TrainLoader l(dir.file("late_*.bin"), 0, 1, 40, 16, 1, opt);
        datatest::write_raw_shard(dir.file("late_2.bin"), 99, 1, 0, {});
        expect_data_error(std::string("shard broken after the start, prefetch ") + (prefetch ? "on" : "off"), [&] {
            for (int k = 0; k < 100; ++k) take(l);
        }, {dir.file("late_2.bin"), "has magic number 99"});
    }

    // The dump's own checks, for callers that fill a DumpConfig themselves (the trainer).
    DumpConfig dc;
    dc.files = good;
    dc.world_size = 1;
    dc.batch_tokens = 64;
    dc.max_seq_len = 64;
    expect_data_error("dump: no batches", [&] { dump_batches(stdout, dc); }, {"batches must be at least 1"});
    dc.batches = 1;
    dc.changes = {{2, 64, 64}, {2, 128, 64}};
    expect_data_error("dump: changes out of order", [&] { dump_batches(stdout, dc); }, {"ascending steps >= 1"});
    dc.changes = {{0, 64, 64}};
    expect_data_error("dump: change at step 0", [&] { dump_batches(stdout, dc); }, {"ascending steps >= 1"});
    dc.changes = {{1, 64, 64}};
    dc.val = true;
    expect_data_error("dump: changes for val", [&] { dump_batches(stdout, dc); }, {"training loader only"});

    // Validation runs out: every shard used, as the trainer would see with too few val tokens.
    expect_data_error("val: out of data", [&] {
        ValLoader v(good, 0, 1, 40, 1);
        for (int k = 0; k < 100; ++k) take(v);
    }, {"validation data exhausted", "3 shard(s) matching", good});
}

void test_shapes() {
    // The standard CRC-32 check value, so the dump's checksums match zlib's.
    test::check(crc32("123456789", 9) == 0xCBF43926u, "crc32 check value");
    test::check(next_multiple_of(0, 128) == 128 && next_multiple_of(54, 128) == 128 && next_multiple_of(128, 128) == 128 &&
                    next_multiple_of(129, 128) == 256,
                "next_multiple_of");
    // Record stages: 8 ranks, grad_accum 1; batch 8, 16 and 24 x 2048 x 8; val 4 x 64 x 1024 x 8.
    const MicroBatchShape s1 = micro_batch_shape(8 * 2048 * 8, 8, 1), s3 = micro_batch_shape(24 * 2048 * 8, 8, 1),
                          v = micro_batch_shape(4 * 64 * 1024 * 8, 8, 1), one = micro_batch_shape(8 * 2048 * 8, 1, 8);
    test::check(s1.tokens_local == 16384 && s1.max_num_docs == 128, "stage 1 shape %lld %lld", (long long)s1.tokens_local,
                (long long)s1.max_num_docs);
    test::check(s3.tokens_local == 49152 && s3.max_num_docs == 256, "stage 3 shape %lld %lld", (long long)s3.tokens_local,
                (long long)s3.max_num_docs);
    test::check(v.tokens_local == 262144 && v.max_num_docs == 896, "val shape");
    test::check(one.tokens_local == 16384, "one rank, grad_accum 8");
    // Record 80's table (upstream's TRAIN_MAX_NUM_DOCS at 2c702746): its three training sizes, on 8 ranks
    // and on 1; validation's 262,144 tokens per rank are not in it and keep the formula's 896.
    MaxDocsRule r80;
    r80.table = {{16384, 64}, {32768, 96}, {49152, 128}};
    test::check(micro_batch_shape(8 * 2048 * 8, 8, 1, r80).max_num_docs == 64 &&
                    micro_batch_shape(16 * 2048 * 8, 8, 1, r80).max_num_docs == 96 &&
                    micro_batch_shape(24 * 2048 * 8, 8, 1, r80).max_num_docs == 128 &&
                    micro_batch_shape(24 * 2048 * 8, 1, 8, r80).max_num_docs == 128 &&
                    micro_batch_shape(4 * 64 * 1024 * 8, 8, 1, r80).max_num_docs == 896,
                "record 80's max-documents table");
    // Capacity: enough for every size up to the bound, the formula's or a larger table entry's.
    test::check(r80.capacity(49152) == 256 && r80.capacity(16384) == 128 && r80.capacity(262144) == 896,
                "capacity of record 80's rule");
    MaxDocsRule wide;
    wide.table = {{100, 500}};
    test::check(wide.capacity(200) == 500 && wide.capacity(99) == 128 && wide.entries(100) == 500 && wide.entries(200) == 128,
                "a table entry above the formula sets the capacity of larger bounds only");
    test::check(r80.error().empty() && MaxDocsRule{{{0, 8}}}.error().find("at least 1 token") != std::string::npos,
                "table validation");
}

}  // namespace

int main() {
    test_shapes();
    {
        datatest::ScratchDir dir;
        test_hand_walk(dir);
    }
    test_fixtures();
    {
        datatest::ScratchDir dir;
        test_prefetch(dir);
    }
    test_equivalences();
    {
        datatest::ScratchDir dir;
        test_errors(dir);
    }
    return test::finish();
}
