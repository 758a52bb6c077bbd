// kernels/embed.cuh: lookups, the smear and its backward, the host-built id segments and the
// segment-sum embedding backward, each against plain double-precision loops on fresh random data.
//
// Tolerances: a bf16 output rounded once from fp32 is within half a bf16 ulp (2^-9 relative) of
// the fp32 value, so it must match a double reference within rtol 2^-8; sums over many rows also
// get an absolute slack of 1e-5 * (sum of |terms|) for fp32 accumulation. Gate inputs
// (x[:, :12] and the gate weights) are drawn from short binary fractions so that the 12-term dot
// product is exact in fp32 and double alike: the bf16 rounding of the logit is then the same
// in the kernel and the reference, and a gate never flips between two bf16 neighbours.
#include "../../kernels/embed.cuh"
#include "../../runtime/init_random.h"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace {

constexpr double kRtol = 1.0 / 256;  // bf16 outputs, see above

using test::DeviceBuffer;
using test::round_bf16;  // gate logits here are exact in fp32
using test::sigmoid;
using test::to_bf16;
using test::uniform_bf16;
using test::value;
using test::values;

std::vector<int32_t> random_ids(int T, int vocab) {
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = test::randint(0, vocab - 1);
    return ids;
}

// got within rtol*|want| + slack[i] of want, element by element (one check).
bool check_within(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                  const std::vector<double>& slack, double rtol) {
    std::vector<double> tol(want.size());
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = rtol * std::fabs(want[i]) + slack[i];
    return test::check_within(what, got, want, tol);
}

// ---- lookups ----
void test_gather(int T, int C, int V) {
    const auto table = uniform_bf16(static_cast<size_t>(V) * C, -2, 2);
    const auto ids = random_ids(T, V);
    DeviceBuffer<bf16> d_table(table), d_out(static_cast<size_t>(T) * C);
    DeviceBuffer<int32_t> d_ids(ids);
    embedding_gather(d_out.ptr, d_table.ptr, d_ids.ptr, T, C, nullptr);
    const auto out = d_out.download();
    bool same = true;
    for (int t = 0; t < T && same; ++t)
        same = std::memcmp(&out[static_cast<size_t>(t) * C], &table[static_cast<size_t>(ids[t]) * C], C * sizeof(bf16)) == 0;
    test::check(same, "embedding_gather T=%d C=%d V=%d: rows differ from the table", T, C, V);
}

// ---- record 83's bigram signs ----
// A sign table from init_signs and random token ids (GPT-2's ids) for a micro-batch of T tokens.
struct Signs {
    int rows;
    std::vector<bf16> table;
    std::vector<int32_t> tokens;
    std::unique_ptr<DeviceBuffer<bf16>> d_table;
    std::unique_ptr<DeviceBuffer<int32_t>> d_tokens;
    Signs(int T, int C, int r) : rows(r), tokens(random_ids(T, 50257)) {
        d_table = std::make_unique<DeviceBuffer<bf16>>(static_cast<size_t>(rows) * C);
        init_signs(d_table->ptr, static_cast<int64_t>(rows) * C, test::seed() + 3, nullptr);
        table = d_table->download();
        d_tokens = std::make_unique<DeviceBuffer<int32_t>>(tokens);
    }
    BigramSigns view() const { return {d_table->ptr, d_tokens->ptr, rows}; }
    // upstream: sign_idx[0] = 0, sign_idx[t] = (tok[t-1] ^ tok[t]) % rows
    double at(int t, int c, int C) const {
        const int index = t == 0 ? 0 : (tokens[t - 1] ^ tokens[t]) % rows;
        return value(table[static_cast<size_t>(index) * C + c]);
    }
};

// init_signs: +-1 only, about half each, the same bits for a seed, another seed another table
void test_init_signs() {
    const int64_t n = 8192 * 192;
    DeviceBuffer<bf16> a(n), b(n), other(n);
    init_signs(a.ptr, n, 11, nullptr);
    init_signs(b.ptr, n, 11, nullptr);
    init_signs(other.ptr, n, 12, nullptr);
    const auto va = a.download(), vb = b.download(), vo = other.download();
    int64_t plus = 0, bad = 0, differ = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double x = value(va[i]);
        plus += x == 1.0;
        bad += x != 1.0 && x != -1.0;
        differ += value(vo[i]) != x;
    }
    const double sd = std::sqrt(n / 4.0);  // of the count of +1 over n fair draws
    test::check(bad == 0 && std::fabs(plus - n / 2.0) < 6 * sd, "init_signs: %lld of %lld not +-1, %lld are +1", 
                static_cast<long long>(bad), static_cast<long long>(n), static_cast<long long>(plus));
    test::check(test::same_bits(va, vb), "init_signs: one seed, two tables");
    test::check(std::fabs(differ - n / 2.0) < 6 * sd, "init_signs: another seed changes %lld of %lld entries",
                static_cast<long long>(differ), static_cast<long long>(n));
}

// The signed lookup equals the table row times its sign row, bit for bit (both are exact)
void test_signed_gather(int T, int C, int V, int rows) {
    const auto table = uniform_bf16(static_cast<size_t>(V) * C, -2, 2);
    const auto ids = random_ids(T, V);
    const Signs sg(T, C, rows);
    DeviceBuffer<bf16> d_table(table), d_out(static_cast<size_t>(T) * C);
    DeviceBuffer<int32_t> d_ids(ids);
    embedding_gather(d_out.ptr, d_table.ptr, d_ids.ptr, T, C, nullptr, sg.view());
    const auto out = d_out.download();
    size_t bad = 0, flipped = 0;
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) {
            const double want = value(table[static_cast<size_t>(ids[t]) * C + c]) * sg.at(t, c, C);
            bad += value(out[static_cast<size_t>(t) * C + c]) != want;
            flipped += sg.at(t, c, C) < 0;
        }
    test::check(bad == 0 && flipped > 0, "embedding_gather with signs T=%d C=%d rows=%d: %zu values differ (%zu flipped)",
                T, C, rows, bad, flipped);
}

// ---- smear: reference ----
struct SmearRef {
    std::vector<double> out, dx, dw;
    double dlambda = 0;
    std::vector<double> dx_slack, dw_slack;
    double dlambda_slack = 0;
};
// x: gathered rows (T, C); w: 12; round_z: round the gate logit to bf16 as upstream does.
SmearRef smear_reference(const std::vector<double>& x, const std::vector<double>& w, double lambda,
                         const std::vector<double>& dout, int T, int C, bool round_z) {
    SmearRef r;
    r.out.assign(static_cast<size_t>(T) * C, 0);
    r.dx.assign(r.out.size(), 0);
    r.dx_slack.assign(r.out.size(), 0);
    r.dw.assign(kGateWidth, 0);
    r.dw_slack.assign(kGateWidth, 0);
    std::vector<double> sg(T, 0), dz(T, 0);
    for (int t = 1; t < T; ++t) {
        double z = 0;
        for (int j = 0; j < kGateWidth; ++j) z += x[static_cast<size_t>(t) * C + j] * w[j];
        sg[t] = sigmoid(round_z ? round_bf16(z) : z);
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) {
            const size_t i = static_cast<size_t>(t) * C + c;
            r.out[i] = x[i] + (t > 0 ? lambda * sg[t] * x[i - C] : 0.0);
        }
    if (dout.empty()) return r;
    for (int t = 1; t < T; ++t) {
        double s = 0, s_abs = 0;
        for (int c = 0; c < C; ++c) {
            s += dout[static_cast<size_t>(t) * C + c] * x[static_cast<size_t>(t - 1) * C + c];
            s_abs += std::fabs(dout[static_cast<size_t>(t) * C + c] * x[static_cast<size_t>(t - 1) * C + c]);
        }
        dz[t] = lambda * sg[t] * (1 - sg[t]) * s;
        r.dlambda += sg[t] * s;
        r.dlambda_slack += 1e-5 * sg[t] * s_abs;
        for (int j = 0; j < kGateWidth; ++j) {
            r.dw[j] += dz[t] * x[static_cast<size_t>(t) * C + j];
            r.dw_slack[j] += 1e-5 * std::fabs(lambda) * s_abs * std::fabs(x[static_cast<size_t>(t) * C + j]);
        }
    }
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) {
            const size_t i = static_cast<size_t>(t) * C + c;
            double v = dout[i], a = std::fabs(dout[i]);
            if (t + 1 < T) {
                v += lambda * sg[t + 1] * dout[i + C];
                a += std::fabs(lambda * sg[t + 1] * dout[i + C]);
            }
            if (c < kGateWidth) {
                v += dz[t] * w[c];
                a += std::fabs(dz[t] * w[c]);
            }
            r.dx[i] = v;
            r.dx_slack[i] = 1e-6 * a;
        }
    return r;
}

void test_smear(int T, int C, int V, bool accumulate) {
    const std::string shape = "T=" + std::to_string(T) + " C=" + std::to_string(C) + (accumulate ? " accumulate" : "");
    const auto table = test::gate_exact_rows(V, C, kGateWidth);
    const auto w = test::gate_exact_weights(kGateWidth);
    const auto ids = random_ids(T, V);
    const auto dout = uniform_bf16(static_cast<size_t>(T) * C, -1, 1);
    const float lambda = static_cast<float>(test::uniform(-1.5, 1.5));
    const auto dw_init = uniform_bf16(kGateWidth, -1, 1);
    const float dlambda_init = static_cast<float>(test::uniform(-1, 1));

    DeviceBuffer<bf16> d_table(table), d_w(w), d_out(static_cast<size_t>(T) * C), d_dout(dout),
        d_dx(static_cast<size_t>(T) * C), d_dw(dw_init);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_lambda(std::vector<float>{lambda}), d_dlambda(std::vector<float>{dlambda_init});
    test::DevicePartials d_scratch(embed_smear_backward_scratch_bytes(T));

    embed_smear_forward(d_out.ptr, d_table.ptr, d_ids.ptr, d_w.ptr, d_lambda.ptr, T, C, nullptr);
    embed_smear_backward(d_dx.ptr, d_dw.ptr, d_dlambda.ptr, d_dout.ptr, d_table.ptr, d_ids.ptr, d_w.ptr, d_lambda.ptr,
                         d_scratch.view(), T, C, accumulate, nullptr);
    const int blocks = embed_smear_backward_blocks(T);
    test::same_as_second_launch("smear backward d(smear_lambda) " + shape, d_scratch, 0, blocks, kSmearPartials,
                                std::vector<float>{dlambda_init}, d_dlambda.download(), accumulate);
    test::same_as_second_launch("smear backward d(smear_gate) " + shape, d_scratch, 1, blocks, kSmearPartials, dw_init,
                                d_dw.download(), accumulate);

    std::vector<double> x(static_cast<size_t>(T) * C);
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c)
            x[static_cast<size_t>(t) * C + c] = value(table[static_cast<size_t>(ids[t]) * C + c]);
    const auto ref = smear_reference(x, values(w), lambda, values(dout), T, C, true);

    std::vector<double> out_slack(ref.out.size(), 1e-6);
    check_within("smear forward " + shape, values(d_out.download()), ref.out, out_slack, kRtol);
    check_within("smear backward dx " + shape, values(d_dx.download()), ref.dx, ref.dx_slack, kRtol);
    std::vector<double> dw_want = ref.dw;
    if (accumulate)
        for (int j = 0; j < kGateWidth; ++j) dw_want[j] += value(dw_init[j]);
    check_within("smear backward d(smear_gate) " + shape, values(d_dw.download()), dw_want, ref.dw_slack, kRtol);
    const double dl_want = ref.dlambda + (accumulate ? dlambda_init : 0.0);
    // fp32 output: rtol for the fp32 accumulation only
    check_within("smear backward d(smear_lambda) " + shape, {static_cast<double>(d_dlambda.download()[0])}, {dl_want},
                 {ref.dlambda_slack + 1e-6}, 1e-5);
}

// Finite differences of L = sum(R * smear(x)) in double (the smooth function: no bf16 logit
// rounding) against the kernel's gradients, on a small case.
void test_smear_finite_differences() {
    const int T = 6, C = 16;
    std::vector<bf16> xb = uniform_bf16(static_cast<size_t>(T) * C, -1, 1), wb = uniform_bf16(kGateWidth, -1, 1),
                      rb = uniform_bf16(static_cast<size_t>(T) * C, -1, 1);
    const float lambda = 0.9f;
    std::vector<int32_t> ids(T);
    std::iota(ids.begin(), ids.end(), 0);  // table = the gathered rows themselves
    DeviceBuffer<bf16> d_x(xb), d_w(wb), d_r(rb), d_dx(static_cast<size_t>(T) * C), d_dw(kGateWidth);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_lambda(std::vector<float>{lambda}), d_dlambda(1);
    test::DevicePartials d_scratch(embed_smear_backward_scratch_bytes(T));
    embed_smear_backward(d_dx.ptr, d_dw.ptr, d_dlambda.ptr, d_r.ptr, d_x.ptr, d_ids.ptr, d_w.ptr, d_lambda.ptr,
                         d_scratch.view(), T, C, false, nullptr);
    const auto dx = values(d_dx.download()), dw = values(d_dw.download());
    const double dlambda = d_dlambda.download()[0];

    auto x = values(xb), w = values(wb);
    const auto r = values(rb);
    double lam = lambda;
    const auto loss = [&] {
        const auto o = smear_reference(x, w, lam, {}, T, C, false).out;
        double s = 0;
        for (size_t i = 0; i < o.size(); ++i) s += r[i] * o[i];
        return s;
    };
    const double h = 1e-5;
    std::vector<double> fd_x(x.size()), fd_w(kGateWidth);
    for (size_t i = 0; i < x.size(); ++i) fd_x[i] = test::central_difference(x[i], h, loss);
    for (int j = 0; j < kGateWidth; ++j) fd_w[j] = test::central_difference(w[j], h, loss);
    const double fd_l = test::central_difference(lam, h, loss);
    // the kernel evaluates the gate at the bf16-rounded logit: relative differences ~2^-8
    test::check_close("smear finite differences d(x)", dx, fd_x, 2e-3, 2e-2);
    test::check_close("smear finite differences d(smear_gate)", dw, fd_w, 2e-3, 2e-2);
    test::check_close("smear finite differences d(smear_lambda)", &dlambda, &fd_l, 1, 2e-3, 2e-2);
}

// ---- id segments ----
// The packed buffer as the builder must lay it out, from std::stable_sort.
std::vector<int32_t> segments_reference(const std::vector<int32_t>& ids, IdSegments& s) {
    const int T = static_cast<int>(ids.size());
    std::vector<int32_t> order(T);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::vector<int32_t> unique, seg, items, merges;
    int slot = 0;
    for (int k = 0; k < T;) {
        int e = k;
        while (e < T && ids[order[e]] == ids[order[k]]) ++e;
        unique.push_back(ids[order[k]]);
        seg.push_back(k);
        const int chunks = (e - k + kEmbedGradChunk - 1) / kEmbedGradChunk;
        if (chunks > 1) merges.insert(merges.end(), {ids[order[k]], slot, chunks});
        for (int b = k; b < e; b += kEmbedGradChunk)
            items.insert(items.end(), {ids[order[k]], b, std::min(b + kEmbedGradChunk, e), chunks > 1 ? slot++ : -1});
        k = e;
    }
    seg.push_back(T);
    s = IdSegments{};
    s.T = T;
    s.num_unique = static_cast<int>(unique.size());
    s.num_items = static_cast<int>(items.size() / 4);
    s.num_merges = static_cast<int>(merges.size() / 3);
    s.num_slots = slot;
    std::vector<int32_t> packed = order;
    for (const auto* v : {&unique, &seg, &items, &merges}) packed.insert(packed.end(), v->begin(), v->end());
    return packed;
}

void test_segments(const char* what, const std::vector<int32_t>& ids, int vocab) {
    const int T = static_cast<int>(ids.size());
    IdSegmentBuilder builder;
    std::vector<int32_t> packed(id_segments_capacity_ints(T), -7);
    const IdSegments s = builder.build(ids.data(), T, vocab, packed.data());
    IdSegments want_s;
    const auto want = segments_reference(ids, want_s);
    const bool sizes = s.T == want_s.T && s.num_unique == want_s.num_unique && s.num_items == want_s.num_items &&
                       s.num_merges == want_s.num_merges && s.num_slots == want_s.num_slots && s.ints() == want.size();
    test::check(sizes, "id segments %s: sizes (unique %d items %d merges %d slots %d), want (%d %d %d %d)", what,
                s.num_unique, s.num_items, s.num_merges, s.num_slots, want_s.num_unique, want_s.num_items,
                want_s.num_merges, want_s.num_slots);
    if (sizes)
        test::check(std::equal(want.begin(), want.end(), packed.begin()), "id segments %s: packed arrays differ", what);
    test::check(s.ints() <= id_segments_capacity_ints(T) && s.num_slots <= embedding_grad_max_slots(T),
                "id segments %s: capacity bounds", what);
}

// Ids with heavy repetition: a few ids take large shares (several chunks each), the rest spread.
std::vector<int32_t> skewed_ids(int T, int vocab) {
    std::vector<int32_t> ids(T);
    for (auto& i : ids) {
        const double u = test::uniform(0, 1);
        i = u < 0.3 ? 7 % vocab : u < 0.4 ? (vocab - 1) : u < 0.45 ? 3 % vocab : test::randint(0, vocab - 1);
    }
    return ids;
}
// Roughly Zipf-distributed token ids, like text.
std::vector<int32_t> zipf_ids(int T, int vocab) {
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = std::min(vocab - 1, static_cast<int>(std::exp(test::uniform(0, std::log(double(vocab))))) - 1);
    return ids;
}

void time_segments(int T, int vocab, const std::vector<int32_t>& ids, const char* what) {
    IdSegmentBuilder builder;
    std::vector<int32_t> packed(id_segments_capacity_ints(T));
    IdSegments s = builder.build(ids.data(), T, vocab, packed.data());  // warm
    const int reps = 50;
    double best = 1e30, total = 0;
    for (int r = 0; r < reps; ++r) {
        const auto a = std::chrono::steady_clock::now();
        s = builder.build(ids.data(), T, vocab, packed.data());
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
        best = std::min(best, us);
        total += us;
    }
    std::printf("id segments build, T=%d vocab=%d (%s): mean %.1f us, best %.1f us (%d unique, %d items, %d merged)\n", T,
                vocab, what, total / reps, best, s.num_unique, s.num_items, s.num_merges);
}

// ---- embedding backward ----
// sign_rows > 0: record 83's signs (one table)
void test_embedding_backward(const char* what, const std::vector<int32_t>& ids, int V, int C, int tables,
                             bool accumulate, int sign_rows = 0) {
    const int T = static_cast<int>(ids.size());
    const std::unique_ptr<Signs> sg = sign_rows > 0 ? std::make_unique<Signs>(T, C, sign_rows) : nullptr;
    const BigramSigns signs = sg ? sg->view() : BigramSigns{};
    IdSegmentBuilder builder;
    std::vector<int32_t> packed(id_segments_capacity_ints(T));
    const IdSegments s = builder.build(ids.data(), T, V, packed.data());
    DeviceBuffer<int32_t> d_packed(packed);
    DeviceBuffer<float> d_scratch(embedding_backward_scratch_bytes(T, C, tables) / sizeof(float));

    std::vector<std::vector<bf16>> init(tables), dout(tables);
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> d_grad, d_dout;
    EmbeddingGradBatch batch;
    batch.count = tables;
    for (int k = 0; k < tables; ++k) {
        init[k] = uniform_bf16(static_cast<size_t>(V) * C, -1, 1);
        dout[k] = uniform_bf16(static_cast<size_t>(T) * C, -1, 1);
        d_grad.push_back(std::make_unique<DeviceBuffer<bf16>>(init[k]));
        d_dout.push_back(std::make_unique<DeviceBuffer<bf16>>(dout[k]));
        batch.grad[k] = d_grad[k]->ptr;
        batch.dout[k] = d_dout[k]->ptr;
    }
    if (tables == 1)
        embedding_backward(batch.grad[0], batch.dout[0], s, d_packed.ptr, d_scratch.ptr, C, accumulate, nullptr, signs);
    else
        embedding_backward(batch, s, d_packed.ptr, d_scratch.ptr, C, accumulate, nullptr, signs);

    std::vector<char> in_batch(V, 0);
    for (int t : ids) in_batch[t] = 1;
    for (int k = 0; k < tables; ++k) {
        const auto got = d_grad[k]->download();
        std::vector<double> want(static_cast<size_t>(V) * C, 0), slack(want.size(), 0);
        for (int t = 0; t < T; ++t)
            for (int c = 0; c < C; ++c) {
                want[static_cast<size_t>(ids[t]) * C + c] +=
                    value(dout[k][static_cast<size_t>(t) * C + c]) * (sg ? sg->at(t, c, C) : 1.0);
                slack[static_cast<size_t>(ids[t]) * C + c] +=
                    1e-5 * std::fabs(value(dout[k][static_cast<size_t>(t) * C + c]));
            }
        std::vector<double> got_rows, want_rows, slack_rows;
        bool untouched = true;
        for (int v = 0; v < V; ++v)
            for (int c = 0; c < C; ++c) {
                const size_t i = static_cast<size_t>(v) * C + c;
                if (!in_batch[v]) {
                    untouched = untouched && std::memcmp(&got[i], &init[k][i], sizeof(bf16)) == 0;
                    continue;
                }
                got_rows.push_back(value(got[i]));
                want_rows.push_back(want[i] + (accumulate ? value(init[k][i]) : 0.0));
                slack_rows.push_back(slack[i] + 1e-7);
            }
        const std::string name = std::string("embedding backward ") + what + " C=" + std::to_string(C) + " table " +
                                 std::to_string(k) + (accumulate ? " accumulate" : "") + (sg ? " signs" : "");
        check_within(name, got_rows, want_rows, slack_rows, kRtol);
        test::check(untouched, "%s: rows outside the batch were written", name.c_str());
    }
    // determinism: the same inputs give the same bits
    const auto first = d_grad[0]->download();
    for (int k = 0; k < tables; ++k) d_grad[k]->upload(init[k]);
    embedding_backward(batch, s, d_packed.ptr, d_scratch.ptr, C, accumulate, nullptr, signs);
    const auto second = d_grad[0]->download();
    test::check(test::same_bits(first, second), "embedding backward %s: two runs differ in bits", what);
}

// ---- benchmark: the trainer's embedding launchers (token ids Zipf-like, bigram ids uniform) ----
// The ids' segments as the trainer's batch uploader makes them: built on the host, packed on the device.
struct DeviceSegments {
    IdSegments s;
    std::unique_ptr<DeviceBuffer<int32_t>> packed;
    DeviceSegments(const std::vector<int32_t>& ids, int vocab) {
        const int T = static_cast<int>(ids.size());
        std::vector<int32_t> host(id_segments_capacity_ints(T));
        s = IdSegmentBuilder().build(ids.data(), T, vocab, host.data());
        packed = std::make_unique<DeviceBuffer<int32_t>>(host);
    }
};

int bench_embed(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int T = p.T(), C = p.C, V = p.V, tables = 1 + 5;  // embed and the five value embeddings
    const std::string rows = bench::fmt("T=%d C=%d", T, C);
    const std::vector<int32_t> ids = zipf_ids(T, V), bigram_ids = random_ids(T, p.bigram_vocab);
    DeviceBuffer<int32_t> d_ids(ids), d_bigram_ids(bigram_ids);
    DeviceBuffer<bf16> embed(size_t(V) * C), bigram(size_t(p.bigram_vocab) * C), out(size_t(T) * C);
    bench::fill_tiled(embed, uniform_bf16(size_t(1) << 20, -1, 1));
    bench::fill_tiled(bigram, uniform_bf16(size_t(1) << 20, -1, 1));
    b.run("embedding_gather", rows + bench::fmt(" bigram vocab %d", p.bigram_vocab),
          [&](cudaStream_t s) { embedding_gather(out.ptr, bigram.ptr, d_bigram_ids.ptr, T, C, s); });

    DeviceBuffer<bf16> gate(uniform_bf16(kGateWidth, -1, 1)), dout(uniform_bf16(size_t(T) * C, -1, 1)),
        dx(size_t(T) * C), dgate(kGateWidth);
    DeviceBuffer<float> lambda(std::vector<float>{0.5f}), dlambda(1);
    test::DevicePartials smear_scratch(embed_smear_backward_scratch_bytes(T));
    b.run("embed_smear_forward", rows + bench::fmt(" vocab %d", V), [&](cudaStream_t s) {
        embed_smear_forward(out.ptr, embed.ptr, d_ids.ptr, gate.ptr, lambda.ptr, T, C, s);
    });
    b.run("embed_smear_backward", rows, [&](cudaStream_t s) {
        embed_smear_backward(dx.ptr, dgate.ptr, dlambda.ptr, dout.ptr, embed.ptr, d_ids.ptr, gate.ptr, lambda.ptr,
                             smear_scratch.view(), T, C, true, s);
    });

    // the token ids' tables share one call; each reads its own per-position gradient
    const DeviceSegments by_token(ids, V), by_bigram(bigram_ids, p.bigram_vocab);
    DeviceBuffer<bf16> grads(size_t(tables) * V * C), douts(size_t(tables) * T * C), bigram_grad(bigram.n);
    bench::fill_tiled(douts, uniform_bf16(size_t(1) << 20, -1, 1));
    DeviceBuffer<float> scratch(embedding_backward_scratch_bytes(T, C, tables) / sizeof(float));
    EmbeddingGradBatch batch;
    batch.count = tables;
    for (int k = 0; k < tables; ++k) {
        batch.grad[k] = grads.ptr + size_t(k) * V * C;
        batch.dout[k] = douts.ptr + size_t(k) * T * C;
    }
    b.run("embedding_backward", rows + bench::fmt(" %d tables of %d rows, %d ids", tables, V, by_token.s.num_unique),
          [&](cudaStream_t s) {
              embedding_backward(batch, by_token.s, by_token.packed->ptr, scratch.ptr, C, true, s);
          });
    b.run("embedding_backward", rows + bench::fmt(" bigram, %d rows, %d ids", p.bigram_vocab, by_bigram.s.num_unique),
          [&](cudaStream_t s) {
              embedding_backward(bigram_grad.ptr, dout.ptr, by_bigram.s, by_bigram.packed->ptr, scratch.ptr, C, true,
                                 s);
          });
    // record 83's narrow signed bigram table: 3x the rows, 192 channels, 8192 sign rows
    const int bigram_dim = 192, signed_rows = 3 * p.bigram_vocab;
    const std::vector<int32_t> signed_ids = random_ids(T, signed_rows);
    const DeviceSegments by_signed(signed_ids, signed_rows);
    const Signs sg(T, bigram_dim, 8192);
    DeviceBuffer<int32_t> d_signed_ids(signed_ids);
    DeviceBuffer<bf16> narrow(size_t(signed_rows) * bigram_dim), narrow_grad(narrow.n),
        narrow_out(size_t(T) * bigram_dim), narrow_dout(uniform_bf16(size_t(T) * bigram_dim, -1, 1));
    bench::fill_tiled(narrow, uniform_bf16(size_t(1) << 20, -1, 1));
    const std::string narrow_at = bench::fmt("T=%d C=%d bigram, %d rows, signs", T, bigram_dim, signed_rows);
    b.run("embedding_gather", narrow_at, [&](cudaStream_t s) {
        embedding_gather(narrow_out.ptr, narrow.ptr, d_signed_ids.ptr, T, bigram_dim, s, sg.view());
    });
    b.run("embedding_backward", narrow_at, [&](cudaStream_t s) {
        embedding_backward(narrow_grad.ptr, narrow_dout.ptr, by_signed.s, by_signed.packed->ptr, scratch.ptr, bigram_dim,
                           true, s, sg.view());
    });
    return b.finish();
}

}  // namespace

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_embed(*o);
    test::seed();
    // bad input: a child process must exit non-zero (forked before emu starts its threads)
    test::check_fails_with("id out of range", "is outside [0, 50304)", [] {
        std::vector<int32_t> ids = {1, 2, 50304};
        std::vector<int32_t> packed(id_segments_capacity_ints(3));
        IdSegmentBuilder().build(ids.data(), 3, 50304, packed.data());
    });
    test::check_fails_with("negative id", "id -1 at position 1", [] {
        std::vector<int32_t> ids = {1, -1};
        std::vector<int32_t> packed(id_segments_capacity_ints(2));
        IdSegmentBuilder().build(ids.data(), 2, 10, packed.data());
    });
    test::check_fails_with("C not a multiple of 8", "C a positive multiple of 8",
                           [] { embedding_gather(nullptr, nullptr, nullptr, 4, 100, nullptr); });
    test::check_fails_with("a sign table without the token ids", "a sign table needs the token ids", [] {
        embedding_gather(reinterpret_cast<bf16*>(16), reinterpret_cast<const bf16*>(16),
                         reinterpret_cast<const int32_t*>(16), 4, 192, nullptr,
                         BigramSigns{reinterpret_cast<const bf16*>(16), nullptr, 8192});
    });
    test::check_fails_with("smear with C < 12", "at least 12",
                           [] { embed_smear_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 4, 8, nullptr); });

    // lookups: tiny and record widths, ragged T
    test_gather(1000, 128, 5000);
    test_gather(37, 768, 4000);

    // smear forward and backward against the reference
    for (bool acc : {false, true}) {
        test_smear(1024, 128, 300, acc);
        test_smear(64, 768, 100, acc);
    }
    test_smear(257, 128, 50, false);  // T not a multiple of the rows per block
    test_smear(1, 128, 10, false);    // one token: nothing to smear
    test_smear_finite_differences();

    // id segments
    test_segments("random, vocab 50304", random_ids(4096, 50304), 50304);
    test_segments("skewed, vocab 300", skewed_ids(3000, 300), 300);
    test_segments("one id", std::vector<int32_t>(1000, 42), 50);
    test_segments("all distinct", [] {
        std::vector<int32_t> v(2000);
        std::iota(v.begin(), v.end(), 0);
        std::shuffle(v.begin(), v.end(), test::rng());
        return v;
    }(), 2000);
    test_segments("single position", {5}, 6);
    test_segments("bigram vocab", random_ids(3000, 251520), 251520);
    test_segments("vocab 1", std::vector<int32_t>(70, 0), 1);
    test_segments("vocab 2^23 + 3 (three radix passes)", random_ids(2000, (1 << 23) + 3), (1 << 23) + 3);

    // embedding backward: repeated ids (30% one id: ~28 chunks merged), several tables at once
    for (bool acc : {false, true}) {
        test_embedding_backward("skewed", skewed_ids(3000, 300), 300, 128, 1, acc);
        test_embedding_backward("skewed, 3 tables", skewed_ids(1500, 200), 200, 128, 3, acc);
    }
    test_embedding_backward("record width", skewed_ids(300, 500), 500, 768, 2, false);
    test_embedding_backward("one id", std::vector<int32_t>(700, 3), 10, 64, 1, true);

    // record 83's bigram signs: the table, the signed lookup and its backward (192 channels, 8192 sign rows;
    // a sign row count that is no power of two), repeated ids merged over several chunks
    test_init_signs();
    test_signed_gather(1000, 192, 3000, 8192);
    test_signed_gather(37, 64, 500, 1000);
    for (bool acc : {false, true}) test_embedding_backward("skewed", skewed_ids(3000, 300), 300, 192, 1, acc, 8192);
    test_embedding_backward("random", random_ids(500, 2000), 2000, 64, 1, false, 1000);

    // the builder's speed at the record's batch (49152 tokens per rank and micro-step)
    time_segments(49152, 50304, zipf_ids(49152, 50304), "Zipf-like token ids");
    time_segments(49152, 251520, random_ids(49152, 251520), "uniform bigram ids");
    return test::finish();
}
