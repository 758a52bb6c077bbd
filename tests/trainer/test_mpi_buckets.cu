// The NorMuon banks' bucket plan (runtime/sharded_comms.h, made from the param_table's bucket rows) and
// where the trainer launches the reductions the backward starts.
// The plan, for 1, 2, 4 and 8 ranks, against a reference written here from the layer structure:
// every matrix in exactly one bucket, each bucket one owner's whole matrices (today's contiguous
// shards), reduced at the backward point that finishes its last matrix; world sizes that cannot own
// whole matrices refused by name; planted wrong plans (a matrix in two buckets or none, a bucket
// launched late or early, one across two owners, out of order) refused. Then a dry-run training
// step of the tiny preset on this run's ranks, recorded: the k-th nccl_reduce of the last
// micro-step is bucket k (its bytes), issued after the event the comms stream waits on was recorded
// behind the kernel that finishes the bucket's gradients and before any op of the backward of the
// layers below; planted recordings (a reduce moved below the next layer, one moved above its
// gradient's kernel) refused. Then Adam steps, tied and untied: each value table's reduces are
// owned_pieces() of its rows (checked against a reference on random shapes), one per owner's
// piece, issued after the embedding backward that finishes the table in its layer (an event
// between) and before the backward of the layer below; lm_head's reduce-scatter right after the
// head's backward once untied, and after the whole backward (embed's gradient joins it) while
// tied. Planted: a table's reduces moved below the next layer refused.
#include "../trainer_under_test.h"
#include "trainer_test_util.h"

// ---- the plan against a reference ----

// The tiny preset's layer structure (record 71's), and its layer count as the reference below spells
// that structure out (layer 6 without attention).
const Structure kStructure = tiny_preset().structure;
constexpr int kLayers = 11;

// Matrices per layer of each bank as upstream lays them out, written here apart from the registry:
// attn [Wq, Wk, Wv, Wo] per attention layer, record 80's qk_bank a matrix per head pair of Wq and of
// Wk (H per attention layer), vo_bank [Wv, Wo], mlp [c_fc, c_proj] per layer.
int reference_per_layer(const std::string& label, int heads) {
    return label == "attn" ? 4 : label == "qk_bank" ? heads : 2;
}
// The backward point (backward_point's numbering: per layer from the last, the MLP's, then the
// attention's) that finishes matrix i of a bank, from the layer structure (layer 6 has no attention);
// the matrices after the layers' are padding no kernel writes, final at point 0.
int reference_ready(At b, int per_layer, int i) {
    const int a = i / per_layer;
    if (b == At::attn) {
        const int layer = a < 6 ? a : a + 1;
        return a < kLayers - 1 ? 2 * (kLayers - 1 - layer) + 1 : 0;
    }
    return a < kLayers ? 2 * (kLayers - 1 - a) : 0;
}

// The program's banks under a config (its table's bucket rows, the registry's shapes): their matrices'
// ready points from the layer structure, and their places.
struct ProgramBank {
    BankReady ready;
    At place;
    int heads;
};
std::vector<ProgramBank> program_banks(const Config& c) {
    Params p;
    std::vector<ProgramBank> out;
    for (const ParamRule& r : c.param_table)
        if (r.reduce == Reduce::buckets)
            visit_params(c, p, [&](const ParamSpec& spec, auto*&) {
                if (spec.name == std::string(r.label))
                    out.push_back({{r.label, bank_ready_points(c.structure, r.place, spec.per_layer, int(spec.shape[0]))},
                                   r.place, c.num_heads});
            });
    return out;
}
std::vector<BankReady> bank_readies(const std::vector<ProgramBank>& banks) {
    std::vector<BankReady> out;
    for (const ProgramBank& b : banks) out.push_back(b.ready);
    return out;
}
std::vector<BankReady> program_banks() { return bank_readies(program_banks(tiny_preset())); }

void check_plan(int world, const Config& c) {
    const std::vector<ProgramBank> program = program_banks(c);
    const std::vector<BankReady> banks = bank_readies(program);
    const std::vector<Bucket> plan = bucket_plan(banks, world);
    test::check(bucket_plan_error(plan, banks, world).empty(), "%d ranks: the plan is refused: %s", world,
                bucket_plan_error(plan, banks, world).c_str());
    for (size_t b = 0; b < banks.size(); ++b) {
        const int n = static_cast<int>(banks[b].ready.size());
        const char* label = banks[b].label;
        const int per_layer = reference_per_layer(label, program[b].heads);
        std::vector<int> seen(size_t(n), 0);
        for (const Bucket& k : plan) {
            if (k.bank != int(b)) continue;
            for (int i = k.first; i < k.first + k.count; ++i) {
                ++seen[size_t(i)];
                test::check(i * world / n == k.owner, "%d ranks: %s matrix %d in rank %d's bucket", world, label, i,
                            k.owner);
                test::check(reference_ready(program[b].place, per_layer, i) == k.ready,
                            "%d ranks: %s matrix %d reduced at point %d, final at %d", world, label, i, k.ready,
                            reference_ready(program[b].place, per_layer, i));
            }
        }
        for (int i = 0; i < n; ++i)
            test::check(seen[size_t(i)] == 1, "%d ranks: %s matrix %d in %d buckets", world, label, i, seen[size_t(i)]);
    }
    // a bucket is as large as it can be: its neighbour in the bank differs in owner or point
    for (size_t i = 0; i < plan.size(); ++i)
        for (size_t j = 0; j < plan.size(); ++j)
            if (plan[i].bank == plan[j].bank && plan[i].first + plan[i].count == plan[j].first)
                test::check(plan[i].owner != plan[j].owner || plan[i].ready != plan[j].ready,
                            "%d ranks: buckets %zu and %zu could be one", world, i, j);
    for (size_t i = 1; i < plan.size(); ++i)
        test::check(plan[i - 1].ready <= plan[i].ready, "%d ranks: bucket %zu launches before bucket %zu's point", world,
                    i, i - 1);
    if (world == 1) return;

    // planted wrong plans
    auto refused = [&](const char* what, std::vector<Bucket> bad, const char* phrase) {
        const std::string e = bucket_plan_error(bad, banks, world);
        test::check(e.find(phrase) != std::string::npos, "%d ranks, %s: '%s' does not say '%s'", world, what, e.c_str(),
                    phrase);
    };
    std::vector<Bucket> twice = plan, missing = plan, late = plan, early = plan, across = plan, swapped = plan;
    twice.push_back(plan[3]);
    missing.erase(missing.begin() + 3);
    late[3].ready += 2;
    early[5].ready -= 1;
    size_t m = 0;  // two neighbouring buckets of one bank with different owners, joined
    while (m + 1 < plan.size() && !(plan[m].bank == plan[m + 1].bank && plan[m].owner != plan[m + 1].owner &&
                                    plan[m + 1].first + plan[m + 1].count == plan[m].first))
        ++m;
    if (m + 1 < plan.size()) {
        across[m + 1].count += across[m].count;
        across.erase(across.begin() + long(m));
        refused("a bucket across two owners", across, "is not owned by rank");
    }
    size_t x = 1;
    while (x < plan.size() && plan[x].ready == plan[x - 1].ready) ++x;
    std::swap(swapped[x], swapped[x - 1]);
    refused("a matrix in two buckets", twice, "buckets");
    refused("a matrix in no bucket", missing, "in 0 buckets");
    refused("a bucket launched late", late, "later than matrix");
    refused("a bucket launched early", early, "before matrix");
    refused("buckets out of order", swapped, "out of the backward's order");
}

// ---- the recorded launch order ----

// Where the backward finishes a bucket's gradients, by family: the MLP's weight gradients
// (gemm_mlp_*_dw), the attention's lambda-scaled weights.
bool finishes(const StepOp& op, At b) {
    const std::string name = op.work.name;
    return b == At::attn ? name == "lambda_scaled_weight_backward"
                           : name.rfind("gemm_mlp_", 0) == 0 && name.size() > 3 && name.substr(name.size() - 3) == "_dw";
}
int range_layer(const std::string& range) {  // "backward/layer L" -> L, else -1
    const std::string prefix = "backward/layer ";
    return range.rfind(prefix, 0) == 0 ? std::atoi(range.c_str() + prefix.size()) : -1;
}
int point_layer(int point) { return kLayers - 1 - point / 2; }

// What is wrong with where a recorded step (this rank's ops) launches the plan's reductions, or "".
// Where the last micro-step's backward starts: after its forward's last op.
size_t backward_start(const std::vector<StepOp>& ops) {
    size_t from = 0;
    for (size_t i = 0; i < ops.size(); ++i)
        if (ops[i].range.rfind("forward", 0) == 0) from = i + 1;
    return from;
}

std::string launch_order_error(const std::vector<StepOp>& ops, const std::vector<Bucket>& plan, const int64_t elems[2]) {
    const size_t from = backward_start(ops);
    size_t k = 0;
    for (size_t i = from; i < ops.size(); ++i) {
        if (std::strcmp(ops[i].work.name, "nccl_reduce") != 0) continue;
        if (k >= plan.size()) return "more reduces than buckets";
        const Bucket& b = plan[k];
        const int layer = point_layer(b.ready);
        const std::string at = "bucket " + std::to_string(k) + " (" + program_banks()[size_t(b.bank)].label +
                               " layer " + std::to_string(layer) + ")";
        if (ops[i].work.comm_bytes != double(b.count * elems[b.bank] * 2))
            return at + ": the reduce's bytes are not the bucket's";
        for (size_t j = from; j < i; ++j)
            if (int l = range_layer(ops[j].range); l >= 0 && l < layer)
                return at + ": reduced after the backward of layer " + std::to_string(l) + " began";
        // the comms stream's last wait before it: on an event recorded after the finishing kernel
        int wait = -1;
        for (size_t j = from; j < i; ++j)
            if (ops[j].kind == OpKind::event_wait && ops[j].stream == ops[i].stream) wait = int(j);
        int recorded = -1, finishing = -1;
        for (int j = int(from); j < wait; ++j) {
            if (ops[size_t(j)].kind == OpKind::event_record && ops[size_t(j)].event == ops[size_t(wait)].event)
                recorded = j;
            if (finishes(ops[size_t(j)], program_banks(tiny_preset())[size_t(b.bank)].place) && range_layer(ops[size_t(j)].range) == layer) finishing = j;
        }
        if (wait < 0 || recorded < 0 || finishing < 0 || recorded < finishing)
            return at + ": its reduce does not wait for the kernel that finishes its gradients";
        ++k;
    }
    return k == plan.size() ? "" : std::to_string(plan.size() - k) + " buckets not reduced";
}

// ---- Adam steps: the value tables and lm_head ----

// owned_pieces against a reference: row by row, each row's owner is row / shard_rows; the pieces
// are the maximal runs of one owner, in order.
void check_owned_pieces() {
    std::mt19937 rng(7);
    for (int trial = 0; trial < 200; ++trial) {
        const int64_t shard = 1 + rng() % 50, world = 1 + rng() % 8, total = shard * world;
        const int64_t first = rng() % total, count = 1 + rng() % (total - first);
        std::vector<RowPiece> want;
        for (int64_t row = first; row < first + count; ++row) {
            const int owner = int(row / shard);
            if (want.empty() || want.back().owner != owner) want.push_back({owner, row, 0});
            ++want.back().count;
        }
        const std::vector<RowPiece> got = owned_pieces(first, count, shard);
        bool same = got.size() == want.size();
        for (size_t i = 0; same && i < got.size(); ++i)
            same = got[i].owner == want[i].owner && got[i].first == want[i].first && got[i].count == want[i].count;
        test::check(same, "owned_pieces(%lld, %lld, %lld): %zu pieces, the reference %zu", (long long)first,
                    (long long)count, (long long)shard, got.size(), want.size());
    }
}

bool named(const StepOp& op, const char* name) { return std::strcmp(op.work.name, name) == 0; }
size_t first_in_layer(const std::vector<StepOp>& ops, size_t from, int layer) {
    while (from < ops.size() && range_layer(ops[from].range) != layer) ++from;
    return from;
}

// What is wrong with where a recorded Adam step launches the value tables' reductions, or "": the
// reduces that follow each table's embedding backward, on the comms stream, until the backward of
// the layer below begins.
std::string table_order_error(const std::vector<StepOp>& ops, const GroupComms& t) {
    const size_t from = backward_start(ops);
    for (int layer = kLayers - 1; layer >= 0; --layer) {
        const int table = kStructure.value_table(layer);
        if (table < 0) continue;
        const std::string at = "value table " + std::to_string(table) + " (layer " + std::to_string(layer) + ")";
        size_t written = ops.size();  // the table's embedding backward: the last in its layer
        for (size_t i = first_in_layer(ops, from, layer); i < ops.size() && range_layer(ops[i].range) == layer; ++i)
            if (named(ops[i], "embedding_backward")) written = i;
        if (written == ops.size()) return at + ": no embedding backward in its layer";
        const std::vector<RowPiece> pieces = owned_pieces(table * t.piece_rows, t.piece_rows, t.shard_rows);
        size_t k = 0, first_piece = ops.size();
        for (size_t i = written + 1; i < ops.size() && range_layer(ops[i].range) == layer && k < pieces.size(); ++i) {
            if (!named(ops[i], "nccl_reduce")) continue;
            if (ops[i].work.comm_bytes != double(pieces[k].count * t.row_elems * 2))
                return at + ": reduce " + std::to_string(k) + " is not the bytes of its owner's piece";
            if (k++ == 0) first_piece = i;
        }
        if (k < pieces.size())
            return at + ": " + std::to_string(pieces.size() - k) + " of its pieces not reduced before the backward of layer " +
                   std::to_string(layer - 1) + " began";
        bool ordered = false;  // the comms stream waits, between the two, on an event recorded after the kernel
        for (size_t j = written + 1; j < first_piece; ++j)
            if (ops[j].kind == OpKind::event_wait && ops[j].stream == ops[first_piece].stream)
                for (size_t i = written + 1; i < j; ++i)
                    ordered |= ops[i].kind == OpKind::event_record && ops[i].event == ops[j].event;
        if (!ordered) return at + ": its reduces do not wait for the kernel that finishes it";
    }
    return "";
}

// Where lm_head's reduce-scatter is: its index among the recording's ops, and whether any op of
// the layers' backward comes before it.
std::pair<size_t, bool> head_reduce(const std::vector<StepOp>& ops, const GroupComms& h, int world) {
    bool after_layers = false;
    for (size_t i = backward_start(ops); i < ops.size(); ++i) {
        if (range_layer(ops[i].range) >= 0) after_layers = true;
        if (named(ops[i], "nccl_reduce_scatter") && ops[i].work.comm_bytes == double(h.shard_rows * h.row_elems * world * 2))
            return {i, after_layers};
    }
    return {ops.size(), after_layers};
}

std::vector<StepOp> record_adam_step(Run& r, int step) {
    advance_schedule(r, step);
    return record_step(plan_trainer(r), step);  // the dry run's recording, tied or untied as the step is
}

void check_adam_steps(Run& r) {
    const GroupComms& tables = r.m.buckets.group.at(size_t(param_group(r.m.cfg, "value_embed")));
    const GroupComms& head = r.m.buckets.group.at(size_t(param_group(r.m.cfg, "lm_head")));
    const int untied = r.sch.split_step + 2;
    work_recorder().start(true);  // a dry run again: nothing runs on the device
    reset_schedule(r);
    start_batches(r, {{1, untied}, 0});
    const std::vector<StepOp> tied_ops = record_adam_step(r, 1), untied_ops = record_adam_step(r, untied);
    work_recorder().stop();
    const bool split = r.o.split;
    r.o.split = false;
    test::check(split, "the untied step recorded tied");
    for (const std::vector<StepOp>* ops : {&tied_ops, &untied_ops}) {
        const std::string e = table_order_error(*ops, tables);
        test::check(e.empty(), "rank %d, %s Adam step: %s", r.d.rank, ops == &tied_ops ? "tied" : "untied", e.c_str());
    }
    const auto [tied_at, tied_after] = head_reduce(tied_ops, head, r.d.world);
    const auto [untied_at, untied_after] = head_reduce(untied_ops, head, r.d.world);
    bool transposed = false;  // tied: after embed's gradient joined lm_head's (the optimizer's transpose)
    for (size_t i = 0; i < tied_at && i < tied_ops.size(); ++i) transposed |= named(tied_ops[i], "transpose");
    test::check(tied_at < tied_ops.size() && tied_after && transposed, "tied: lm_head's reduce-scatter is not after the backward");
    test::check(untied_at < untied_ops.size() && !untied_after, "untied: lm_head's reduce-scatter is not before the layers' backward");
    bool head_before = false;  // untied: the head's weight gradient is enqueued before it
    for (size_t i = 0; i < untied_at && i < untied_ops.size(); ++i) head_before |= named(untied_ops[i], "gemm_lm_head_dw");
    test::check(head_before, "untied: lm_head's reduce-scatter comes before its gradient's GEMM");

    // planted: layer 9's table's last reduce (its reduces are the layer's after its embedding
    // backward) moved below the first op of layer 8
    std::vector<StepOp> late = tied_ops;
    const size_t layer9 = first_in_layer(late, backward_start(late), 9), layer8 = first_in_layer(late, layer9, 8);
    size_t written = layer9, reduce = layer8;
    for (size_t i = layer9; i < layer8; ++i)
        if (named(late[i], "embedding_backward")) written = i;
    for (size_t i = written; i < layer8; ++i)
        if (named(late[i], "nccl_reduce")) reduce = i;
    if (test::check(reduce < layer8, "no reduce in layer 9's backward")) {
        StepOp moved = late[reduce];
        moved.range = late[layer8].range;
        late.erase(late.begin() + long(reduce));
        late.insert(late.begin() + long(layer8), moved);
        test::check(table_order_error(late, tables).find("not reduced before") != std::string::npos,
                    "a table's reduce moved below the next layer passes: '%s'", table_order_error(late, tables).c_str());
    }
}

void check_recorded_order(Run& r) {
    WorkRecorder& rec = work_recorder();
    rec.start(true);
    reset_schedule(r);
    start_batches(r, {step_range(0, 1), 0});
    advance_schedule(r, 0);
    rec.start(true);
    train_step(r, 0);
    const std::vector<StepOp> ops = std::move(rec.ops);
    rec.stop();
    const GradBuckets& g = r.m.buckets;
    const int64_t elems[2] = {g.group.at(size_t(g.bank_group.at(0))).row_elems, g.group.at(size_t(g.bank_group.at(1))).row_elems};
    if (r.d.world == 1) {
        const bool none = std::none_of(ops.begin(), ops.end(), [](const StepOp& op) { return op.kind == OpKind::collective; });
        test::check(none, "one rank: a collective recorded");
        return;
    }
    const std::string e = launch_order_error(ops, g.plan, elems);
    test::check(e.empty(), "rank %d: %s", r.d.rank, e.c_str());

    // planted: the first reduces moved below the next layer's first op; a reduce moved above its kernel
    std::vector<StepOp> late = ops, early = ops;
    size_t first = 0;
    while (first < ops.size() && std::strcmp(ops[first].work.name, "nccl_reduce") != 0) ++first;
    size_t below = first;
    while (below < ops.size() && range_layer(ops[below].range) >= range_layer(ops[first].range)) ++below;
    if (test::check(below < ops.size(), "no op below the first bucket's layer")) {
        late.clear();  // the reduces before `below` moved, in order, right after it
        std::vector<StepOp> moved;
        for (size_t i = 0; i < ops.size(); ++i) {
            const bool reduce = std::strcmp(ops[i].work.name, "nccl_reduce") == 0;
            if (reduce && i >= first && i < below) moved.push_back(ops[i]);
            else late.push_back(ops[i]);
            if (i == below) late.insert(late.end(), moved.begin(), moved.end());
        }
        test::check(launch_order_error(late, g.plan, elems).find("after the backward of layer") != std::string::npos,
                    "a reduce launched late passes: %s", launch_order_error(late, g.plan, elems).c_str());
    }
    size_t last = ops.size() - 1;  // the last reduce (layer 0's attention) moved above its wait
    while (last > 0 && std::strcmp(ops[last].work.name, "nccl_reduce") != 0) --last;
    size_t wait = last;
    while (wait > 0 && ops[wait].kind != OpKind::event_wait) --wait;
    early.insert(early.begin() + long(wait), ops[last]);
    early.erase(early.begin() + long(last) + 1);
    test::check(launch_order_error(early, g.plan, elems).find("does not wait") != std::string::npos,
                "a reduce launched before its gradient's kernel passes: %s", launch_order_error(early, g.plan, elems).c_str());
}

int main(int argc, char** argv) {
    Distributed d = start_distributed(&argc, &argv);
    const char* repo = std::getenv("REPO");
    if (!repo) {
        std::fprintf(stderr, "test_mpi_buckets: set REPO to the repository\n");
        return 2;
    }
    // record 71's banks (tiny and the record), and record 80's head-pair banks: qk_bank 20 + 4 padding at tiny's
    // 2 heads, 60 + 4 at the record's 6; vo_bank 20 + 4
    Config tiny80 = tiny_preset(), record80 = r71_preset();
    use_record80_banks(tiny80);
    use_record80_banks(record80);
    for (const Config& c : {tiny_preset(), r71_preset(), tiny80, record80})
        for (int world : {1, 2, 4, 8}) check_plan(world, c);
    test::check(program_banks(record80).size() == 3 && program_banks(record80)[0].ready.ready.size() == 64 &&
                    program_banks(record80)[1].ready.ready.size() == 24,
                "record 80's banks: qk_bank of 64 matrices, vo_bank of 24, mlp");
    for (auto [world, bank] : {std::pair{3, 0}, std::pair{16, 1}}) {  // 40 attn, 24 mlp matrices
        const std::string e = ownership_error(program_banks()[size_t(bank)], world);
        test::check(e.find("cannot own whole") != std::string::npos, "%d ranks: '%s'", world, e.c_str());
        test::check(bucket_plan(program_banks(), world).empty(), "%d ranks: a plan made", world);
    }

    Config c = tiny_preset();
    c.world_size = d.world;
    TrainerRun t(d, c, repo, true);  // a dry run: nothing runs on the device
    Run& r = t.r;
    check_recorded_order(r);
    check_owned_pieces();
    if (d.world > 1) check_adam_steps(r);

    return finish_trainer_test(r, t.o);
}
