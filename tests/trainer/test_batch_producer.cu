// runtime/batch_producer.h: the training batches made ahead on the producer thread, against an
// independent walk of the loader, in one process (no MPI: the producer and the references read the
// data as any rank of an 8-rank run). The tiny preset on a short schedule (stage changes at steps 2,
// 4 and 6, batch sizes 256, 384, 512 tokens) as rank 3 of 8 (one micro-step per step, the sparse
// bigram exchange active), checked for every micro-batch:
//   - the image's inputs, targets, bigram ids and cu_seqlens equal what a TrainLoader of rank 3 gives
//     when next() is called with the batch size set at each stage change (as the run did before the
//     producer existed);
//   - the MTP weights come with the first micro-step, equal to the schedule's;
//   - on Adam steps (odd), the sparse exchange's plan: the counts and row indexes this rank sends
//     and receives, against sets built from eight reference loaders' bigram ids of the step and the
//     even step before it (what rank 3 touched outside its slice; what every other rank touched
//     inside it), and no plan on even steps;
// then a resumed producer (steps before 5 walked, not made) makes the same batches and plans from
// step 5 on; a producer asked for a micro-batch of another step reports the mismatch; and a producer
// run past the end of the data delivers every micro-batch the data holds, equal to the reference's,
// then the loader's exhaustion error at the micro-batch where the reference loader throws it.
#include "../trainer_under_test.h"
#include "../test_util.h"

#include <optional>
#include <set>

namespace {

constexpr int kRank = 3, kWorld = 8;

Config short_tiny() {
    Config c = tiny_preset();
    c.world_size = kWorld;
    c.scheduled_iterations = 6;
    c.extension_iterations = 2;
    return c;
}

std::unique_ptr<dataload::TrainLoader> loader_of(const Config& c, const std::string& files, int rank) {
    dataload::TrainLoader::Options lo;
    lo.bigram_vocab = c.bigram_vocab;
    lo.max_docs = c.max_docs;
    return std::make_unique<dataload::TrainLoader>(files, rank, kWorld, c.stages[0].batch_tokens,
                                                   c.stages[0].max_seq_len, c.grad_accum(), lo);
}

// One rank's micro-batch as the loader gives it.
struct RefBatch {
    std::vector<int32_t> inputs, targets, bigram, cu;
};
RefBatch next_batch(dataload::TrainLoader& l, int T) {
    RefBatch b;
    b.inputs.resize(T), b.targets.resize(T), b.bigram.resize(T), b.cu.resize(size_t(l.shape().max_num_docs));
    const dataload::Batch got = l.next({b.inputs.data(), b.targets.data(), b.cu.data(), b.bigram.data(), T,
                                        static_cast<int64_t>(b.cu.size())});
    b.inputs.resize(got.num_tokens), b.targets.resize(got.num_tokens), b.bigram.resize(got.num_tokens);
    b.cu.resize(got.cu_entries);
    return b;
}

// Every rank's reference loader, walked step by step with the schedule's batch sizes.
struct Reference {
    const Config& c;
    const Schedule& sch;
    std::vector<std::unique_ptr<dataload::TrainLoader>> loaders;
    std::vector<std::set<int32_t>> touched = std::vector<std::set<int32_t>>(kWorld);
    int64_t batch = 0;
    int max_seq_len = 0;
    Reference(const Config& cfg, const Schedule& s, const std::string& files) : c(cfg), sch(s) {
        for (int r = 0; r < kWorld; ++r) loaders.push_back(loader_of(c, files, r));
    }
    // Step `step`'s batches of every rank; rank kRank's returned.
    RefBatch step_batches(int step) {
        const TrainingStage& st = *sch.lookup(step).first;
        const int64_t b = st.batch_tokens;
        const int T = c.micro_tokens(b);
        RefBatch mine;
        for (int k = 0; k < kWorld; ++k) {  // this rank's loader first: its error is the one compared
            const int r = (kRank + k) % kWorld;
            if (b != batch || st.max_seq_len != max_seq_len) loaders[r]->set_batch(b, st.max_seq_len, c.grad_accum());
            RefBatch got = next_batch(*loaders[r], T);
            touched[r].insert(got.bigram.begin(), got.bigram.end());
            if (r == kRank) mine = std::move(got);
        }
        batch = b, max_seq_len = st.max_seq_len;
        return mine;
    }
    // The plan of rank kRank from every rank's rows since the last Adam step (then cleared).
    void plan(std::vector<int>& send_counts, std::vector<int>& recv_counts, std::vector<int32_t>& rows) {
        const int per_rank = c.bigram_vocab / kWorld, lo = kRank * per_rank, hi = lo + per_rank;
        send_counts.assign(kWorld, 0), recv_counts.assign(kWorld, 0), rows.clear();
        for (int32_t row : touched[kRank])
            if (row < lo || row >= hi) ++send_counts[row / per_rank], rows.push_back(row);
        for (int s = 0; s < kWorld; ++s)
            for (int32_t row : touched[s])
                if (s != kRank && row >= lo && row < hi) ++recv_counts[s], rows.push_back(row);
        for (auto& t : touched) t.clear();
    }
};

std::vector<int32_t> image_part(const BatchImage& img, size_t at, size_t n) {
    return std::vector<int32_t>(img.pinned + at, img.pinned + at + n);
}

// Checks the producer's micro-batch of `step` against the reference's; returns whether the image agreed.
bool check_step(BatchProducer& p, Reference& ref, const Schedule& sch, int step, const char* who) {
    const RefBatch want = ref.step_batches(step);
    BatchSlot& s = p.next(step, 0);
    const BatchImage& img = *s.image;
    const size_t T = want.inputs.size();
    const bool same = img.T == int(T) && img.num_cu == int(want.cu.size()) && image_part(img, 0, T) == want.inputs &&
                      image_part(img, img.targets_at, T) == want.targets &&
                      image_part(img, img.bigram_at, T) == want.bigram &&
                      image_part(img, img.cu_at, want.cu.size()) == want.cu && img.cu_seqlens_host == want.cu;
    test::check(same, "%s step %d: the batch differs from the loader's (T %d, want %zu)", who, step, img.T, T);
    const std::vector<float> w = sch.mtp_weights(step);
    test::check(s.n_mtp == int(w.size()) && std::equal(w.begin(), w.end(), s.mtp), "%s step %d: MTP weights", who, step);
    test::check(s.has_plan == (step % 2 == 1), "%s step %d: a plan %s", who, step, s.has_plan ? "on an even step" : "missing");
    if (step % 2 == 1) {
        std::vector<int> send, recv;
        std::vector<int32_t> rows;
        ref.plan(send, recv, rows);
        const std::vector<int32_t> got(s.plan.rows, s.plan.rows + s.plan.send_total + s.plan.recv_total);
        test::check(s.plan.send_counts == send && s.plan.recv_counts == recv && got == rows,
                    "%s step %d: the sparse plan differs (%d sent, %d received; want %zu rows)", who, step,
                    s.plan.send_total, s.plan.recv_total, rows.size());
        test::check(!rows.empty(), "%s step %d: the reference plan is empty (the test sees nothing)", who, step);
    }
    p.issued();
    return same;
}

// A producer of `plan` following the schedule's batches, or `batches` where given (planted plans).
std::unique_ptr<BatchProducer> producer(const Config& c, const Schedule& sch, const std::string& files,
                                        const BatchSchedule& plan, std::optional<std::vector<StepBatch>> batches = {}) {
    DeviceBatch region;
    Arena a{"batch"};
    layout_batch(a, std::max(c.max_train_tokens(), c.val_micro_tokens()), c.max_docs, region);  // measures: no device memory
    const int max_touched = std::min(c.bigram_vocab, 2 * c.max_train_tokens());
    return std::make_unique<BatchProducer>(batch_shape(c), loader_of(c, files, kRank), kRank,
                                           SparsePlanning{kWorld, max_touched, c.bigram_vocab}, region.packed_ints, plan,
                                           batches ? *batches : step_batches(sch, plan.steps));
}

}  // namespace

int main() {
    const char* repo = std::getenv("REPO");
    if (!repo) {
        std::fprintf(stderr, "test_batch_producer: set REPO to the repository\n");
        return 2;
    }
    const Config c = short_tiny();
    const Schedule sch(c);
    const std::string files = std::string(repo) + "/" + c.train_files;
    const int steps = sch.total_steps;

    {  // the schedule from the start, then resumed at step 5
        auto p = producer(c, sch, files, {step_range(0, steps), 0});
        Reference ref(c, sch, files);
        for (int st = 0; st < steps; ++st) check_step(*p, ref, sch, st, "from the start");
        auto resumed = producer(c, sch, files, {step_range(0, steps), 5});
        Reference again(c, sch, files);  // to step 5: the Adam step 3 took the rows before step 4
        for (int st = 0; st < 5; ++st) {
            again.step_batches(st);
            if (st % 2 == 1)
                for (auto& t : again.touched) t.clear();
        }
        for (int st = 5; st < steps; ++st) check_step(*resumed, again, sch, st, "resumed at 5");
    }
    {  // per-stage cut lengths (record 80's 896 then 2048, here 5 then 256) and a max-documents table
        Config cut = c;
        cut.stages[0].max_seq_len = 5;  // binds: tiny's documents are longer
        const Schedule cut_sch(cut);
        auto p = producer(cut, cut_sch, files, {step_range(0, steps), 0});
        Reference ref(cut, cut_sch, files);
        int longest[2] = {0, 0};  // the longest document piece in stage 0 and after it
        for (int st = 0; st < steps; ++st) {
            const std::vector<int32_t> cu = ref.step_batches(st).cu;
            for (size_t k = 1; k < cu.size(); ++k)
                longest[st >= cut_sch.starts[1]] = std::max(longest[st >= cut_sch.starts[1]], cu[k] - cu[k - 1]);
        }
        Reference again(cut, cut_sch, files);
        for (int st = 0; st < steps; ++st) check_step(*p, again, cut_sch, st, "cut at 5 in stage 0");
        // the last piece of a micro-batch loses its final token to the targets: at most 5 either way
        test::check(longest[0] == 5 && longest[1] > 5, "documents cut at 5 in stage 0 only: longest %d, then %d", longest[0],
                    longest[1]);
        Config few = c;
        few.max_docs.table = {{c.micro_tokens(c.stages[0].batch_tokens), 2}};  // one document per micro-batch
        auto q = producer(few, sch, files, {step_range(0, steps), 0});
        std::string why;
        try {
            for (int st = 0; st < steps; ++st) {
                q->next(st, 0);
                q->issued();
            }
        } catch (const dataload::DataError& e) {
            why = e.what();
        }
        test::check(why.rfind("step ", 0) == 0 &&
                        why.find("'s micro-batch of 32 tokens") != std::string::npos &&  // the sparse plan reads every rank's
                        why.find("max_num_docs is 2") != std::string::npos,
                    "a max-documents table too small for the data: '%s'", why.c_str());
        // the startup walk finds it before the run starts, naming the step and the rank
        const std::string startup = train_tokens_error(data_needs(few, steps), files, kWorld);
        test::check(startup.rfind("the training data of step ", 0) == 0 &&
                        startup.find("'s micro-batch of 32 tokens") != std::string::npos &&
                        startup.find("max_num_docs is 2") != std::string::npos,
                    "the startup walk: '%s'", startup.c_str());
        test::check(train_tokens_error(data_needs(c, steps), files, kWorld).empty(), "the startup walk of the tiny preset");
    }
    {  // asked for another step than it made
        auto p = producer(c, sch, files, {step_range(2, 4), 0});
        std::string why;
        try {
            p->next(3, 0);
        } catch (const std::logic_error& e) {
            why = e.what();
        }
        test::check(why.find("micro-step 0 of step 3 asked for, 0 of step 2 made") != std::string::npos,
                    "a step the producer did not make: '%s'", why.c_str());
    }
    {  // a plan whose step batches do not match its steps, and a step with more MTP weights than a slot holds
        std::string why;
        try {
            producer(c, sch, files, {step_range(0, 3), 0}, step_batches(sch, step_range(0, 2)));
        } catch (const std::logic_error& e) {
            why = e.what();
        }
        test::check(why.find("2 step batches for 3 steps") != std::string::npos, "a short plan: '%s'", why.c_str());
        std::vector<StepBatch> many = step_batches(sch, step_range(0, 1));
        many[0].mtp_weights.assign(kMaxMtpWeights + 1, 1.0f);
        auto p = producer(c, sch, files, {step_range(0, 1), 0}, many);
        why.clear();
        try {
            p->next(0, 0);
        } catch (const std::logic_error& e) {
            why = e.what();
        }
        test::check(why.find(std::to_string(kMaxMtpWeights + 1) + " MTP weights for step 0") != std::string::npos,
                    "too many MTP weights: '%s'", why.c_str());
    }
    {  // past the end of the data: every batch it holds, then the loader's error where it runs out
        const int far = 1000000;
        auto p = producer(c, sch, files, {step_range(0, far), 0});
        Reference ref(c, sch, files);
        int st = 0;
        std::string want_error, got_error;
        for (; st < far; ++st) {
            RefBatch want;
            try {
                want = ref.step_batches(st);
            } catch (const dataload::DataError& e) {
                want_error = e.what();
            }
            try {
                BatchSlot& s = p->next(st, 0);
                const BatchImage& img = *s.image;
                if (!want_error.empty() || image_part(img, 0, want.inputs.size()) != want.inputs) break;
                p->issued();
            } catch (const dataload::DataError& e) {
                got_error = e.what();
                break;
            }
            if (!want_error.empty()) break;
        }
        // the producer's error is the loader's, said with the step it stops
        test::check(!want_error.empty() && got_error == "step " + std::to_string(st) + ": " + want_error && st > 10,
                    "past the data: at step %d the producer said '%s', the loader '%s'", st, got_error.c_str(),
                    want_error.c_str());
        test::check(want_error.find("exhausted") != std::string::npos, "the loader's error names exhaustion: %s",
                    want_error.c_str());
    }
    std::printf("%d passed, %d failed\n", test::passed(), test::failed());
    return test::failed() ? 1 : 0;
}
