// The double-precision GPT reference (gpt_reference.h) checked against itself and against hand
// derivations: finite differences of every parameter's gradient (on the smooth path, FP8 off),
// the FP8 formats from their bit definitions, the paired-head layout, document isolation (and
// exactly the paths that cross documents by design: smear, bigram hash, key offset), windows,
// the MTP and evaluation losses, upstream's initialization and YaRN update, record 80's stream, record
// 82's XSA (its row function on both sides of the normalize clamp), records 83/84's bigram (narrow
// width, sign trick, x0 aliasing), record 81's MUDD (against its formulas, against record 80 at constant
// coefficients, finite differences), record 84's FP8 MLP up-projection, bad input. Host only.
#include "gpt_reference.h"
#include "../test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <string>

namespace {

using namespace ref;

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The finite-difference configuration: several documents (11 to 19 tokens in the tests), windows
// that bite (short 8 tokens, paired layers 8 rows = 4 tokens; long 11), three MTP weights, YaRN
// state after one window growth.
Config small_config() {
    Config c = Config::make(48, 256, 64, 2, 32, 97, 8, 11);
    c.mtp_weights = {1.0, 0.5, 0.25};
    c.fp8 = false;
    c.yarn_apply(7, 11);
    return c;
}

// Random tokens, targets = next tokens, the given document starts (plus padding entries), hash.
Batch make_batch(const Config& c, const std::vector<int>& starts, int pad_entries) {
    Batch b;
    std::vector<int> tok(c.T + 1);
    for (int& t : tok) t = test::randint(0, c.V - 1);
    b.inputs.assign(tok.begin(), tok.end() - 1);
    b.targets.assign(tok.begin() + 1, tok.end());
    b.cu_seqlens = starts;
    for (int i = 0; i <= pad_entries; ++i) b.cu_seqlens.push_back(c.T);
    b.bigram = bigram_hash(b.inputs, c.bigram_vocab);
    return b;
}

Params random_params(const Config& c) {
    Params p = Params::init(c, test::rng()());
    perturb(p, test::rng()(), 0.05);
    return p;
}

// ---- finite differences ----
using Samples = std::vector<std::pair<std::string, std::vector<size_t>>>;
struct FdStats {
    int evaluated = 0, shrunk = 0;  // forwards run, step reductions at relu kinks
};

// Checks g (the analytic gradient of forward(c, p, b) with loss_scale 1) at the sampled entries of the
// named tensors against 4-point central differences; p is restored on return.
FdStats fd_check(const Config& c, Params& p, const Batch& b, const Params& g, const Samples& samples) {
    // The loss is smooth except where an MLP pre-activation crosses 0 (relu^2 has a jump in its
    // second derivative there): the step shrinks until no pre-activation changes sign across the
    // stencil, so the O(h^4) error bound holds on the whole interval.
    std::vector<char> signs0, signs1;
    auto loss_and_signs = [&](std::vector<char>& signs) {
        Tape tp;
        const double v = forward(c, p, b, &tp);
        signs.clear();
        for (const LayerTape& L : tp.layers)
            for (double x : L.pre) signs.push_back(x > 0.0);
        return v;
    };
    auto tensors = p.tensors();
    auto gtensors = g.tensors();
    FdStats st;
    for (auto& [name, idx] : samples) {
        const int shrunk_before = st.shrunk;
        size_t ti = 0;
        while (name != tensors[ti].first) ++ti;
        std::vector<double>& w = *tensors[ti].second;
        const std::vector<double>& gw = *gtensors[ti].second;
        double worst = 0.0;
        size_t worst_i = 0;
        double worst_fd = 0, worst_an = 0, worst_h = 0;
        for (size_t i : idx) {
            // 4-point central difference, O(h^4): truncation far below the tolerance at h <= 4e-4
            const double orig = w[i];
            double h = 4.0 * 4e-4, fd = 0.0;
            for (int attempt = 0; attempt < 4; ++attempt) {
                h /= 4.0;
                double f[4];
                bool smooth = true;
                const double steps[4] = {-2 * h, -h, h, 2 * h};
                for (int s = 0; s < 4; ++s) {
                    w[i] = orig + steps[s];
                    f[s] = loss_and_signs(s == 0 ? signs0 : signs1);
                    smooth &= s == 0 || signs1 == signs0;
                }
                w[i] = orig;
                st.evaluated += 4;
                fd = (8.0 * (f[2] - f[1]) - (f[3] - f[0])) / (12.0 * h);
                if (smooth) break;
                ++st.shrunk;
            }
            // relative 1e-6, plus the stencil's rounding noise: the loss (~5e2, one ulp 6e-14) is a
            // long double-precision sum whose rounding reaches tens of ulps, which the stencil turns
            // into ~1e-12/h (TEST_SEED=11465204421782253010: x0_lambdas at h 6.3e-6 was off by 4.4e-7,
            // 2.2e-7 past the relative part); 10x that is allowed
            const double err = std::fabs(fd - gw[i]) / (1e-6 * std::fabs(gw[i]) + 1e-11 / h);
            if (err > worst || err != err) {
                worst = err;
                worst_i = i;
                worst_fd = fd;
                worst_an = gw[i];
                worst_h = h;
            }
        }
        test::check(worst <= 1.0, "fd %s[%zu]: analytic %.10g, finite difference %.10g at step %.2g (%.2f x tolerance)",
                    name.c_str(), worst_i, worst_an, worst_fd, worst_h, worst);
        std::printf("  fd %-15s %3zu samples, worst %.3f x tolerance (|g| there %.3g, step %.2g), %d step reductions\n",
                    name.c_str(), idx.size(), worst, std::fabs(worst_an), worst_h, st.shrunk - shrunk_before);
    }
    return st;
}

// ---- finite differences of every parameter ----
void check_gradients_fd() {
    const auto t0 = std::chrono::steady_clock::now();
    const Config c = small_config();
    Params p = random_params(c);
    const Batch b = make_batch(c, {0, 13, 30}, 2);
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, F = c.hidden(), H = c.H;

    std::set<int> used_tokens(b.inputs.begin(), b.inputs.end()), used_bigrams(b.bigram.begin(), b.bigram.end());
    int unused_token = 0, unused_bigram = 0;
    while (used_tokens.count(unused_token)) ++unused_token;
    while (used_bigrams.count(unused_bigram)) ++unused_bigram;
    auto rnd = [](int n) { return test::randint(0, n - 1); };

    // sample indexes per tensor: rows the batch touches, a row it does not (gradient 0), every bank
    // entry and every weight part, every small vector in full
    Samples samples;
    auto add = [&](const char* name, std::vector<size_t> idx) { samples.push_back({name, std::move(idx)}); };
    {
        std::vector<size_t> e, l, bg, ve;
        for (int i = 0; i < 9; ++i) e.push_back(size_t(b.inputs[rnd(c.T)]) * C + rnd(C));
        e.push_back(size_t(unused_token) * C + rnd(C));
        for (int i = 0; i < 10; ++i) l.push_back(rnd(C * V));
        for (int i = 0; i < 9; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * C + rnd(C));
        bg.push_back(size_t(unused_bigram) * C + rnd(C));
        for (int k = 0; k < kValueTables; ++k) {
            for (int i = 0; i < 2; ++i) ve.push_back((size_t(k) * V + b.inputs[rnd(c.T)]) * C + rnd(C));
            ve.push_back((size_t(k) * V + unused_token) * C + rnd(C));
        }
        add("embed", e);
        add("lm_head", l);
        add("bigram_embed", bg);
        add("value_embeds", ve);
    }
    {
        std::vector<size_t> a, m, ag, vg;
        for (int bank = 0; bank < kAttnLayers; ++bank)
            for (int part = 0; part < 4; ++part)  // q, k, v, o
                a.push_back((size_t(bank) * 4 * C + part * C + rnd(C)) * C + rnd(C));
        for (int l = 0; l < kMlpBankLayers; ++l)
            for (int part = 0; part < 2; ++part)  // c_fc, c_proj (entry 11: padding, gradient 0)
                m.push_back(((size_t(l) * 2 + part) * F + rnd(F)) * C + rnd(C));
        for (int bank = 0; bank < kAttnLayers; ++bank)
            ag.push_back((size_t(bank) * H + rnd(H)) * kGateDim + rnd(kGateDim));
        for (int t = 0; t < kValueTables; ++t)
            for (int i = 0; i < 2; ++i) vg.push_back((size_t(t) * H + rnd(H)) * kGateDim + rnd(kGateDim));
        add("attn_bank", a);
        add("mlp_bank", m);
        add("attn_gate_bank", ag);
        add("ve_gate_bank", vg);
    }
    auto all = [](size_t n) {
        std::vector<size_t> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = i;
        return v;
    };
    add("smear_gate", all(kGateDim));
    add("skip_gate", all(kGateDim));
    add("x0_lambdas", all(kLayers));
    add("scalars", all(kScalarsUsed));  // the padding is checked to be exactly 0 below

    const FdStats fd = fd_check(c, p, b, g, samples);
    // the sampled zero-gradient entries are exactly zero
    test::check(g.embed[size_t(unused_token) * C] == 0.0 && g.bigram_embed[size_t(unused_bigram) * C] == 0.0,
                "rows the batch does not touch have non-zero gradients");
    bool pad_zero = true;
    for (size_t e = size_t(11) * 2 * F * C; e < g.mlp_bank.size(); ++e) pad_zero &= g.mlp_bank[e] == 0.0;
    for (int i = kScalarsUsed; i < c.num_scalars(); ++i) pad_zero &= g.scalars[i] == 0.0;
    test::check(pad_zero, "padding entries (mlp_bank[11], scalars past 47) have non-zero gradients");
    std::printf("finite differences: loss %.6f, %d forwards (%d step reductions at relu kinks), %.1f s\n", loss,
                fd.evaluated, fd.shrunk, seconds_since(t0));
}

// ---- record 80's residual stream ----
// The finite-difference configuration with record 80's switches: sublayer lambdas, attention of layers
// 8-10 reading norm(h7), value tables on layers 1, 2, 8, 9, 10 with the gate reading ve. Exact lambdas
// (their bf16 rounding is piecewise constant: check_r80_lambdas_bf16) and record 71's S_w (record 80's
// sums every weight, whose gradient is by design not the loss's derivative on the last rows).
Config r80_small_config() {
    Config c = small_config();
    c.T = 32;  // documents of 11 to 14 tokens in the tests: the windows still bite, forwards are cheaper
    c.sublayer_lambdas = true;
    c.late_attn_source = 7;
    c.lambdas_bf16 = false;
    c.value_layers = {1, 2, 8, 9, 10};
    c.ve_gate_reads_ve = true;
    return c;
}

// The record 80 stream's lambdas at every kind of layer, the scalars its layout moved, and a sample of
// the other tensors, weighted to the paths h7 carries (layers 0-7's weights reach the loss through
// layers 8-10's norms as well as through the stream).
void check_r80_gradients_fd() {
    const auto t0 = std::chrono::steady_clock::now();
    const Config c = r80_small_config();
    Params p = random_params(c);
    const Batch b = make_batch(c, {0, 11, 18}, 2);
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, F = c.hidden(), H = c.H;
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    auto tok = [&] { return size_t(b.inputs[rnd(c.T)]); };
    Samples samples;
    // the layers whose updates differ (0: no bigram injection; 3: the skip's source; 6: no attention,
    // whose attention-side entries are checked to be exactly 0 below; 7: h7; 8-10: read norm(h7)) and
    // one of the others, drawn per run; at each, the resid and post lambdas of a sublayer drawn per run
    // (they move every pre-activation, so their stencils often straddle a relu kink and shrink: cost)
    const int others[] = {1, 2, 4, 5};
    const int drawn = others[rnd(4)];
    std::vector<size_t> resid, post, bigram, x0;
    for (int i : {0, 3, 6, 7, 8, 9, 10, drawn}) {
        resid.push_back(2 * size_t(i) + (i == kSkipTo ? 1 : rnd(2)));  // [i][0] attention, [i][1] MLP
        post.push_back(2 * size_t(i) + (i == kSkipTo ? 1 : rnd(2)));
        if (i != kSkipTo) bigram.push_back(size_t(i));
    }
    for (int i : {0, 7, 9, drawn}) x0.push_back(size_t(i));
    samples.push_back({"resid_lambdas", resid});
    samples.push_back({"post_lambdas", post});
    samples.push_back({"bigram_lambdas", bigram});
    samples.push_back({"x0_lambdas", x0});
    const ScalarSlots& k = c.scalar_slots();
    samples.push_back({"scalars", {size_t(k.sa_of(0, 0)), size_t(k.sa_of(2, 1)), size_t(k.sa_of(7, 0)),
                                   size_t(k.sa_of(9, 1)), size_t(k.sa_of(10, 0)), size_t(k.smear), size_t(k.backout),
                                   size_t(k.skip)}});
    std::vector<size_t> a, m, e, bg, ve, ag, vg;
    for (int bank = 0; bank < kAttnLayers; ++bank) a.push_back((size_t(bank) * 4 * C + rnd(4) * C + rnd(C)) * C + rnd(C));
    for (int l : {1, 4, 7, 8, 10}) m.push_back(((size_t(l) * 2 + 1) * F + rnd(F)) * C + rnd(C));  // c_proj
    for (int l : {3, 7, 9}) m.push_back(((size_t(l) * 2) * F + rnd(F)) * C + rnd(C));              // c_fc
    for (int i = 0; i < 3; ++i) e.push_back(tok() * C + rnd(C));
    for (int i = 0; i < 3; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * C + rnd(C));
    for (int k = 0; k < kValueTables; ++k) ve.push_back((size_t(k) * V + tok()) * C + rnd(C));
    for (int i = 0; i < 3; ++i) ag.push_back((size_t(rnd(kAttnLayers)) * H + rnd(H)) * kGateDim + rnd(kGateDim));
    for (int k = 0; k < kValueTables; ++k) vg.push_back((size_t(k) * H + rnd(H)) * kGateDim + rnd(kGateDim));
    samples.push_back({"attn_bank", a});
    samples.push_back({"mlp_bank", m});
    samples.push_back({"embed", e});
    samples.push_back({"bigram_embed", bg});
    samples.push_back({"value_embeds", ve});
    samples.push_back({"attn_gate_bank", ag});
    samples.push_back({"ve_gate_bank", vg});
    samples.push_back({"skip_gate", {size_t(rnd(kGateDim)), size_t(rnd(kGateDim))}});
    samples.push_back({"smear_gate", {size_t(rnd(kGateDim))}});
    samples.push_back({"lm_head", {size_t(rnd(C * V)), size_t(rnd(C * V))}});
    const FdStats fd = fd_check(c, p, b, g, samples);

    // what layer 6 (no attention, no injection) and the layout leave unread has exactly zero gradient
    bool zero = g.resid_lambdas[2 * 6] == 0.0 && g.post_lambdas[2 * 6] == 0.0 && g.x0_lambdas[6] == 0.0 &&
                g.bigram_lambdas[6] == 0.0 && g.scalars[k.sa_of(6, 0)] == 0.0 && g.scalars[k.sa_of(6, 1)] == 0.0;
    for (int i = k.used; i < c.num_scalars(); ++i) zero &= g.scalars[i] == 0.0;
    test::check(zero, "record 80: layer 6's attention-side lambdas and the scalars' padding have non-zero gradients");
    std::printf("record 80 finite differences: loss %.6f, %d forwards (%d step reductions), %.1f s\n", loss, fd.evaluated,
                fd.shrunk, seconds_since(t0));
}

// The stream's structure, by forward runs: unit lambdas reduce it to record 71's; layers 8-10's
// attention reads norm(h7) and nothing after it; the bf16 lambdas are the parameters' roundings.
void check_r80_stream() {
    // (1) record 80 with resid = post = 1, x0 = bigram lambdas = 0 and no late source is record 71 with
    // resid 1 and x0/bigram lambdas 0: every update is the same sum (x + 0 and 1 * x are exact)
    const Config c71 = small_config();
    Params p71 = random_params(c71);
    for (int i = 0; i < kLayers; ++i) {
        p71.scalars[scalar_resid(i)] = 1.0;
        p71.scalars[scalar_bigram(i)] = 0.0;
        p71.x0_lambdas[i] = 0.0;
    }
    Config c80 = c71;
    c80.sublayer_lambdas = true;
    Params p80 = Params::zeros(c80);
    {
        auto from = p71.tensors();
        auto to = p80.tensors();
        for (size_t t = 0; t < from.size(); ++t)
            if (from[t].second != &p71.scalars && !from[t].second->empty()) *to[t].second = *from[t].second;
        const ScalarSlots &k71 = c71.scalar_slots(), &k80 = c80.scalar_slots();
        for (int i = 0; i < kLayers; ++i)
            for (int j = 0; j < 2; ++j) p80.scalars[k80.sa_of(i, j)] = p71.scalars[k71.sa_of(i, j)];
        p80.scalars[k80.smear] = p71.scalars[k71.smear];
        p80.scalars[k80.backout] = p71.scalars[k71.backout];
        p80.scalars[k80.skip] = p71.scalars[k71.skip];
        p80.resid_lambdas.assign(2 * kLayers, 1.0);
        p80.post_lambdas.assign(2 * kLayers, 1.0);
    }
    const Batch b = make_batch(c71, {0, 13, 30}, 1);
    Tape t71, t80;
    Params g71, g80;
    const double l71 = forward_backward(c71, p71, b, 1.0, g71, &t71), l80 = forward_backward(c80, p80, b, 1.0, g80, &t80);
    test::check(l71 == l80 && t71.row_loss == t80.row_loss, "record 80 at unit lambdas: loss %.17g, record 71's %.17g", l80,
                l71);
    for (const char* name : {"embed", "lm_head", "bigram_embed", "value_embeds", "attn_bank", "mlp_bank", "attn_gate_bank",
                             "ve_gate_bank", "smear_gate", "skip_gate"}) {
        size_t t = 0;
        while (std::string(g71.tensors()[t].first) != name) ++t;
        test::check_close(std::string("record 80 at unit lambdas: gradient of ") + name, *g80.tensors()[t].second,
                          *g71.tensors()[t].second, 1e-12, 1e-12);
    }
    // the stream lambdas' gradients there: resid[i][0] of record 80 is record 71's resid (both multiply
    // x_in; layer 0's x_in is x0 in both), except that record 71's attention normalizes r x_in, record
    // 80's x_in (the same value at r = 1, but r71's resid gradient also flows through the norm)
    std::vector<double> r80_attn_resid, r71_resid;
    for (int i = 0; i < kLayers; ++i)
        if (i != kSkipTo) {
            r80_attn_resid.push_back(g80.resid_lambdas[2 * i]);
            r71_resid.push_back(g71.scalars[scalar_resid(i)]);
        }
    // record 71's also carries <d norm input, x_in>, zero but for the norm's eps (1.2e-7 of mean(x^2))
    test::check_close("record 80 at unit lambdas: attention resid lambdas' gradients = record 71's resid", r80_attn_resid,
                      r71_resid, 1e-6, 1e-9);

    // (2) layers after the late source normalize its output, bit for bit, whatever comes after it
    const Config c = r80_small_config();
    Params p = random_params(c);
    const Batch b2 = make_batch(c, {0, 11, 18}, 1);
    Config none = c;
    none.late_attn_source = -1;
    Tape base, base_none;
    forward(c, p, b2, &base);
    forward(none, p, b2, &base_none);
    bool reads_h7 = true;
    for (int i = 8; i < kLayers; ++i) reads_h7 &= base.layers[i].x_mix == base.layers[7].x_out;
    test::check(reads_h7 && base.layers[7].x_mix == base.layers[7].x_in && base.layers[9].x_in != base.layers[7].x_out,
                "late source 7: layers 8-10 normalize h7, layer 7 its own input");
    test::check(base_none.layers[9].x_mix == base_none.layers[9].x_in && base.layers[9].xa != base_none.layers[9].xa,
                "without a late source layer 9 normalizes its input");
    // layer 8's weights (its attention's output projection, its MLP's c_proj) move the stream entering
    // layers 9 and 10 but not their attention inputs; record 80 without the late source sees them
    Params q = p;
    const size_t C = c.C, F = c.hidden();
    q.attn_bank[(size_t(attn_bank_index(8)) * 4 * C + 3 * C + 5) * C + 7] += 0.5;
    q.mlp_bank[(size_t(2 * 8 + 1) * F + 11) * C + 3] += 0.5;
    Tape moved, moved_none;
    forward(c, q, b2, &moved);
    forward(none, q, b2, &moved_none);
    test::check(moved.layers[9].x_in != base.layers[9].x_in && moved.layers[10].x_in != base.layers[10].x_in,
                "test setup: layer 8's weights should move the stream after it");
    test::check(moved.layers[9].xa == base.layers[9].xa && moved.layers[10].xa == base.layers[10].xa &&
                    moved.layers[8].xa == base.layers[8].xa,
                "late source 7: layer 8's weights changed layers 8-10's attention inputs");
    test::check(moved_none.layers[9].xa != base_none.layers[9].xa, "without a late source layer 8 reaches layer 9's norm");
    test::check(forward(c, p, b2) != forward(none, p, b2), "the late source changes nothing");

    // (3) with post lambdas 0 the blocks add nothing, and each layer's output is a_t x0 + b_t xb per
    // token t, the coefficients following upstream's updates: start (1, lb[0]); attention sublayer
    // (ra a + lx0, ra b + lb[i], no lb at layer 0); layer 6 adds the skip gate times layer 3's; MLP (rm a, rm b)
    Params z = p;
    z.post_lambdas.assign(2 * kLayers, 0.0);
    Tape tz;
    forward(c, z, b2, &tz);
    const size_t T = c.T;
    const ScalarSlots& k = c.scalar_slots();
    std::vector<double> a(T, 1.0), bb(T, z.bigram_lambdas[0]), a3, b3;
    double worst = 0.0;
    for (int i = 0; i < kLayers; ++i) {
        for (size_t t = 0; t < T; ++t) {
            if (i == kSkipTo) {
                const double gate = 2.0 * test::sigmoid(z.scalars[k.skip]) *
                                    test::sigmoid(detail::dot(tz.x0.data() + t * C, z.skip_gate.data(), kGateDim));
                a[t] += gate * a3[t];
                bb[t] += gate * b3[t];
            } else {
                const double ra = z.resid_lambdas[2 * i];
                a[t] = ra * a[t] + z.x0_lambdas[i];
                bb[t] = ra * bb[t] + (i > 0 ? z.bigram_lambdas[i] : 0.0);
            }
            a[t] *= z.resid_lambdas[2 * i + 1];
            bb[t] *= z.resid_lambdas[2 * i + 1];
            for (size_t j = 0; j < C; ++j) {
                const double want = a[t] * tz.x0[t * C + j] + bb[t] * tz.x_bigram[t * C + j];
                worst = std::max(worst, std::fabs(tz.layers[i].x_out[t * C + j] - want) / (std::fabs(want) + 1e-3));
            }
        }
        if (i == kSkipFrom) a3 = a, b3 = bb;
    }
    test::check(worst < 1e-12, "record 80 with post lambdas 0: layer outputs off the x0/bigram recurrence by %.3g", worst);
}

// bf16 lambdas: round to nearest even on bf16's grid; the model with lambdas_bf16 equals the exact model
// on pre-rounded lambdas, gradients included (straight through, as upstream's cast).
void check_r80_lambdas_bf16() {
    test::check(round_bf16(std::sqrt(1.1)) == 1.046875 && round_bf16(1.0 + std::ldexp(1.0, -8)) == 1.0 &&
                    round_bf16(1.0 + 3 * std::ldexp(1.0, -8)) == 1.0 + std::ldexp(1.0, -6) &&
                    round_bf16(-0.05) == -0.050048828125 && round_bf16(std::ldexp(1.0, -133)) == std::ldexp(1.0, -133) &&
                    round_bf16(std::ldexp(3.0, -134)) == std::ldexp(1.0, -132) && round_bf16(std::ldexp(1.0, -135)) == 0.0 &&
                    round_bf16(0x1.ffp127) == INFINITY,
                "round_bf16: nearest, ties to even, subnormals, overflow");
    Config on = r80_small_config();
    on.lambdas_bf16 = true;
    const Config off = r80_small_config();
    const Params p = random_params(on);
    Params pr = p;
    for (std::vector<double>* t : {&pr.resid_lambdas, &pr.post_lambdas, &pr.x0_lambdas, &pr.bigram_lambdas})
        for (double& v : *t) v = round_bf16(v);
    const Batch b = make_batch(on, {0, 20}, 0);
    Params g_on, g_off;
    const double l_on = forward_backward(on, p, b, 1.0, g_on), l_off = forward_backward(off, pr, b, 1.0, g_off);
    test::check(l_on == l_off, "bf16 lambdas: loss %.17g, exact model on rounded lambdas %.17g", l_on, l_off);
    bool same = true;
    for (size_t t = 0; t < g_on.tensors().size(); ++t) same &= *g_on.tensors()[t].second == *g_off.tensors()[t].second;
    test::check(same, "bf16 lambdas: gradients differ from the exact model's on rounded lambdas");
    test::check(forward(off, p, b) != l_on, "bf16 lambdas: the rounding changes nothing");
}

// Record 80's init, layout and lambda vectors.
void check_r80_layout() {
    Config c = Config::make(16, 512, 128, 2, 64, 50, 128, 384);
    c.sublayer_lambdas = true;
    c.late_attn_source = 7;
    const Params p = Params::init(c, 99);
    const ScalarSlots& k = c.scalar_slots();
    bool ok = p.scalars.size() == 32 && k.sa == 0 && k.smear == 22 && k.backout == 23 && k.skip == 24 && k.used == 25;
    for (int i = 0; i < kLayers; ++i) ok &= p.scalars[2 * i] == 0.5 && p.scalars[2 * i + 1] == 1.0;
    ok &= p.scalars[22] == 0.0 && p.scalars[23] == 0.5 && p.scalars[24] == -1.5;
    for (int i = 25; i < 32; ++i) ok &= p.scalars[i] == 1.0;
    test::check(ok, "record 80 scalars: sa (0.5, 1) x 11, smear 0, backout 0.5, skip -1.5, 7 ones (32)");
    bool lambdas = p.resid_lambdas.size() == 22 && p.post_lambdas.size() == 22 && p.bigram_lambdas.size() == 11 &&
                   p.x0_lambdas.size() == 11;
    for (double v : p.resid_lambdas) lambdas &= v == std::sqrt(1.1);
    for (double v : p.post_lambdas) lambdas &= v == 1.0;
    for (double v : p.bigram_lambdas) lambdas &= v == 0.05;
    for (double v : p.x0_lambdas) lambdas &= v == 0.0;
    test::check(lambdas, "record 80 init: resid sqrt(1.1), post 1, bigram 0.05, x0 0");
    const auto t = p.tensors();
    test::check(t.size() == 23 && std::string(t[11].first) == "scalars" && std::string(t[12].first) == "resid_lambdas" &&
                    std::string(t[13].first) == "post_lambdas" && std::string(t[14].first) == "bigram_lambdas",
                "tensors(): record 80's lambdas after scalars");
    const Params p71 = Params::init(Config::make(16, 512, 128, 2, 64, 50, 128, 384), 99);
    test::check(p71.resid_lambdas.empty() && p71.post_lambdas.empty() && p71.bigram_lambdas.empty() &&
                    p71.scalars.size() == 51 && lambda_gradients(p71).size() == 58,
                "record 71: no record 80 lambdas, 51 scalars, 47 + 11 lambdas");
    // lambda_gradients / lambda_error_scales: 25 scalars, x0 (11), resid (22), post (22), bigram (11)
    Params g = Params::zeros(c);
    for (auto& [name, v] : g.tensors())
        for (size_t i = 0; i < v->size(); ++i) (*v)[i] = 1000.0 * (name[0] + name[1]) + double(i);
    const std::vector<double> lg = lambda_gradients(g);
    ok = lg.size() == 91 && lg[24] == g.scalars[24] && lg[25] == g.x0_lambdas[0] && lg[36] == g.resid_lambdas[0] &&
         lg[57] == g.resid_lambdas[21] && lg[58] == g.post_lambdas[0] && lg[80] == g.bigram_lambdas[0] &&
         lg[90] == g.bigram_lambdas[10];
    Tape tp;
    tp.scalar_scales = g.scalars;
    tp.x0_lambda_scales = g.x0_lambdas;
    tp.resid_lambda_scales = g.resid_lambdas;
    tp.post_lambda_scales = g.post_lambdas;
    tp.bigram_lambda_scales = g.bigram_lambdas;
    test::check(ok && lambda_error_scales(tp) == lg,
                "record 80 lambda vectors: scalars (25), x0 (11), resid (22), post (22), bigram (11)");
}

// The error scales of the new lambdas' gradients: the FP8 head's e5m2 gradient moves each by a
// fraction of its scale (as the record 71 lambdas in check_fp8_tiny), while the gradients themselves
// are of the order of it.
void check_r80_error_scales() {
    Config exact = r80_small_config();
    exact.lambdas_bf16 = true;
    Config fp8 = exact;
    fp8.fp8 = true;
    const Params p = random_params(exact);
    const Batch b = make_batch(exact, {0, 11, 18}, 0);
    Params g8, gx;
    Tape tx;
    forward_backward(fp8, p, b, exact.grad_scale, g8);
    forward_backward(exact, p, b, exact.grad_scale, gx, &tx);
    const std::vector<double> scales = lambda_error_scales(tx), want = lambda_gradients(gx);
    test::check(scales.size() == want.size() && scales.size() == 91, "record 80 error scales: %zu entries", scales.size());
    const double worst = test::check_within_scale("record 80: FP8 vs exact lambda gradients", lambda_gradients(g8), want,
                                                  scales, 0.6);
    double largest = 0.0;
    for (size_t i = 25; i < want.size(); ++i)
        if (scales[i] > 0) largest = std::max(largest, std::fabs(want[i]) / scales[i]);
    test::check(largest > 0.6, "record 80 error scales: the largest gradient is %.2f of its scale", largest);
    std::printf("  record 80 lambdas: FP8 vs exact largest difference %.3f of the scale, largest gradient %.2f of it\n",
                worst, largest);
}

// ---- record 82's XSA ----
// XSA's row function by itself against central differences of L = w . y', on both sides of
// F.normalize's clamp: |v| ~ 1.6, and |v| ~ 5e-6 < 1e-4 where v^ = v / 1e-4 (the model-level check
// below never reaches the clamp). L is linear in y and alpha, so their differences are exact but for
// rounding; in v it is smooth (quadratic under the clamp).
void check_xsa_row() {
    const size_t D = 8;
    for (const double v_scale : {1.0, 3e-6}) {
        std::vector<double> y(D), v(D), w(D), out(D), dy(D), dv(D, 0.0);
        for (size_t d = 0; d < D; ++d) {
            y[d] = test::uniform(-1.0, 1.0);
            v[d] = v_scale * test::uniform(-1.0, 1.0);
            w[d] = test::uniform(-1.0, 1.0);
        }
        double alpha = test::uniform(-0.9, 0.9), n = 0.0;
        auto loss = [&] {
            double nn = 0.0;
            detail::xsa_forward_row(y.data(), v.data(), alpha, D, out.data(), &nn);
            return detail::dot(w.data(), out.data(), D);
        };
        const double p = detail::xsa_forward_row(y.data(), v.data(), alpha, D, out.data(), &n);
        const bool clamped = v_scale < 1.0;
        const double norm = std::sqrt(detail::dot(v.data(), v.data(), D));
        test::check(clamped ? n == kXsaEps && norm < kXsaEps : n == norm && norm > kXsaEps,
                    "XSA row: normalizer %.6g for |v| = %.6g (clamp at %g)", n, norm, kXsaEps);
        test::check(std::fabs(p - detail::dot(y.data(), v.data(), D) / n) <= 1e-15 * std::fabs(p) + 1e-300,
                    "XSA row: p = y . v / max(|v|, eps)");
        const double dalpha =
            detail::xsa_backward_row(y.data(), v.data(), alpha, p, n, w.data(), D, dy.data(), dv.data());
        // v's step: under the clamp L is quadratic in v, so a step of |v|'s own size is exact (and keeps
        // |v| below eps) while the loss's rounding noise (~1e-16 / step) stays far below the tolerance
        const double hv = clamped ? v_scale : 1e-5;
        std::vector<double> fd_y(D), fd_v(D);
        for (size_t d = 0; d < D; ++d) {
            fd_y[d] = test::central_difference(y[d], 1e-3, loss);
            fd_v[d] = test::central_difference(v[d], hv, loss);
        }
        const double fd_alpha = test::central_difference(alpha, 1e-3, loss);
        double vmax = 0.0;
        for (double e : dv) vmax = std::max(vmax, std::fabs(e));
        const char* side = clamped ? "clamped" : "unclamped";
        test::check_close(std::string("XSA row (") + side + "): dL/dy", dy, fd_y, 1e-9, 1e-8);
        // absolute: 1e-10 over the difference's rounding noise (~1e-16 |L| / step), for rows whose dv is small
        test::check_close(std::string("XSA row (") + side + "): dL/dv", dv, fd_v, 1e-8 * vmax + 1e-10, 1e-7);
        test::check(std::fabs(dalpha - fd_alpha) <= 1e-9 * (1.0 + std::fabs(dalpha)),
                    "XSA row (%s): dL/dalpha %.12g, central difference %.12g", side, dalpha, fd_alpha);
    }
    // alpha = 1 removes y's whole component along v (|v| above the clamp): y' . v = 0
    std::vector<double> y(32), v(32), out(32);
    for (size_t d = 0; d < 32; ++d) y[d] = test::uniform(-1.0, 1.0), v[d] = test::uniform(-1.0, 1.0);
    double n = 0.0;
    detail::xsa_forward_row(y.data(), v.data(), 1.0, 32, out.data(), &n);
    test::check(std::fabs(detail::dot(out.data(), v.data(), 32)) < 1e-14 * n * n, "XSA row at alpha 1: y' . v = %.3g",
                detail::dot(out.data(), v.data(), 32));
}

// The finite-difference configuration of record 80 with record 82's XSA on its layers (1, 3, 4, 7, 8,
// 10: 1 and 8 read value embeddings, 3 and 10 have the key offset, 8 and 10 read norm(h7)), exact
// alphas (their bf16 rounding is piecewise constant: check_xsa_forward).
Config xsa_small_config() {
    Config c = r80_small_config();
    for (int i : {1, 3, 4, 7, 8, 10}) c.xsa[size_t(i)] = true;
    c.xsa_alpha_bf16 = false;
    return c;
}
// Strengths of either sign well away from 0 (tanh(a) of 0.38 to 0.83), so that XSA changes y visibly;
// every row, so that the rows of layers without XSA would show if they were read.
Params xsa_random_params(const Config& c) {
    Params p = random_params(c);
    for (double& a : p.xsa_alphas) a = (test::randint(0, 1) ? 1 : -1) * test::uniform(0.4, 1.2);
    return p;
}

// Layout and init: xsa_alphas last in tensors(), (11, H) with XSA, empty without, zeros at init;
// an XSA layer must have attention and not be paired (check_bad_input).
void check_xsa_layout() {
    Config c = Config::make(16, 512, 128, 2, 64, 50, 128, 384);
    test::check(!c.any_xsa() && Params::init(c, 5).xsa_alphas.empty(), "without XSA: no xsa_alphas");
    c.xsa[4] = true;
    const Params p = Params::init(c, 5);
    const auto t = p.tensors();
    bool zeros = p.xsa_alphas.size() == size_t(kLayers) * c.H;
    for (double a : p.xsa_alphas) zeros &= a == 0.0;
    test::check(c.any_xsa() && zeros && t.size() == 23 && std::string(t[15].first) == "xsa_alphas" &&
                    Params::sizes(c).size() == 23 && Params::sizes(c)[15] == size_t(kLayers) * c.H,
                "XSA: xsa_alphas (11, H) of zeros, after the lambdas in tensors() and sizes()");
    test::check(c.xsa_alpha(0.3) == round_bf16(std::tanh(0.3)) && c.xsa_alpha(0.3) != std::tanh(0.3) &&
                    c.xsa_alpha(5.0) == 1.0,
                "XSA: alpha = bf16(tanh(a))");
}

// The forward's structure: zero strengths are the model without XSA (gradients too, bit for bit);
// alpha = 1 leaves each XSA head's output orthogonal to its own v (after the value-embedding mix), and
// the gate multiplies that; bf16 alphas equal the exact model at a' = atanh(bf16(tanh(a))), with
// the gradient passed straight through the rounding.
void check_xsa_forward() {
    const Config c = xsa_small_config();
    Config off = c;
    off.xsa = {};
    const Batch b = make_batch(c, {0, 11, 18}, 1);
    Params p = xsa_random_params(c);
    Params z = p, p_off = p;
    z.xsa_alphas.assign(z.xsa_alphas.size(), 0.0);
    p_off.xsa_alphas.clear();
    Params gz, g_off;
    const double lz = forward_backward(c, z, b, 1.0, gz), l_off = forward_backward(off, p_off, b, 1.0, g_off);
    bool same = lz == l_off;
    for (size_t i = 0; i < gz.tensors().size(); ++i)
        if (std::string(gz.tensors()[i].first) != "xsa_alphas") same &= *gz.tensors()[i].second == *g_off.tensors()[i].second;
    test::check(same, "XSA at zero strengths: loss %.17g, without XSA %.17g (or gradients differ)", lz, l_off);
    test::check(forward(c, p, b) != l_off, "XSA at non-zero strengths changes nothing");

    Config unit = c;
    unit.xsa_alpha_bf16 = true;
    Params pu = p;
    pu.xsa_alphas.assign(pu.xsa_alphas.size(), 5.0);  // tanh(5) = 0.99991 rounds to 1 in bf16
    Tape tu;
    forward(unit, pu, b, &tu);
    const size_t T = c.T, H = c.H, D = c.D;
    double worst = 0.0;
    bool gated = true, shapes = true;
    for (int i = 0; i < kLayers; ++i) {
        const LayerTape& L = tu.layers[size_t(i)];
        shapes &= c.xsa[size_t(i)] ? L.y_xsa.size() == T * c.C && L.xsa_p.size() == T * H : L.y_xsa.empty();
        if (!c.xsa[size_t(i)]) continue;
        for (size_t r = 0; r < T * H; ++r) {
            const double* v = L.v.data() + r * D;
            const double* y = L.y.data() + r * D;
            const double nv = std::sqrt(detail::dot(v, v, D)), ny = std::sqrt(detail::dot(y, y, D));
            worst = std::max(worst, std::fabs(detail::dot(L.y_xsa.data() + r * D, v, D)) / (nv * ny));
            for (size_t d = 0; d < D; ++d) gated &= L.yg[r * D + d] == L.attn_sig[r] * L.y_xsa[r * D + d];
        }
    }
    test::check(shapes && worst < 1e-14 && gated,
                "XSA at alpha 1: y' . v up to %.3g |y||v| (or the gate does not multiply y', or tapes misshaped)",
                worst);

    Config bf = c;
    bf.xsa_alpha_bf16 = true;
    Params pr = p;
    for (double& a : pr.xsa_alphas) a = std::atanh(round_bf16(std::tanh(a)));
    Params g_bf, g_ex;
    const double l_bf = forward_backward(bf, p, b, 1.0, g_bf), l_ex = forward_backward(c, pr, b, 1.0, g_ex);
    test::check(std::fabs(l_bf - l_ex) <= 1e-13 * l_ex && l_bf != forward(c, p, b),
                "bf16 alphas: loss %.17g, exact model at rounded alphas %.17g (or the rounding changes nothing)", l_bf,
                l_ex);
    // straight through: d a = d alpha (1 - tanh(a)^2) at the rounded alpha
    std::vector<double> want(g_ex.xsa_alphas);
    for (size_t e = 0; e < want.size(); ++e) {
        const double ta = std::tanh(p.xsa_alphas[e]), tr = std::tanh(pr.xsa_alphas[e]);
        want[e] *= (1.0 - ta * ta) / (1.0 - tr * tr);
    }
    test::check_close("bf16 alphas: gradient straight through the rounding", g_bf.xsa_alphas, want, 1e-12, 1e-8);
    test::check_close("bf16 alphas: the value bank's gradient as the exact model's at rounded alphas", g_bf.attn_bank,
                      g_ex.attn_bank, 1e-12, 1e-8);
}

// Every tensor's gradient with XSA on, weighted to what XSA touches: every strength of its layers,
// each XSA layer's q, k, v (twice: v carries XSA's own gradient) and o weights, output gate and sa
// lambdas, and the value embeddings and ve gates of layers 1 and 8 (v's sources); the rows of the
// layers without XSA are checked to be exactly 0 below.
void check_xsa_gradients_fd() {
    const auto t0 = std::chrono::steady_clock::now();
    const Config c = xsa_small_config();
    Params p = xsa_random_params(c);
    const Batch b = make_batch(c, {0, 11, 18}, 2);
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, F = c.hidden(), H = c.H;
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    auto tok = [&] { return size_t(b.inputs[rnd(c.T)]); };
    const ScalarSlots& k = c.scalar_slots();
    std::vector<size_t> alphas, a, ag, sc, ve, vg;
    for (int i = 0; i < kLayers; ++i) {
        const int bank = attn_bank_index(i);
        if (!c.xsa[size_t(i)]) {
            if (bank >= 0) a.push_back((size_t(bank) * 4 * C + rnd(4) * C + rnd(C)) * C + rnd(C));
            continue;
        }
        for (int h = 0; h < H; ++h) alphas.push_back(size_t(i) * H + h);
        for (int part : {0, 1, 2, 2, 3})  // q, k, v, v, o
            a.push_back((size_t(bank) * 4 * C + part * C + rnd(C)) * C + rnd(C));
        ag.push_back((size_t(bank) * H + rnd(H)) * kGateDim + rnd(kGateDim));
        sc.push_back(size_t(k.sa_of(i, 0)));
        sc.push_back(size_t(k.sa_of(i, 1)));
    }
    for (size_t s : {k.smear, k.backout, k.skip}) sc.push_back(s);
    for (int t = 0; t < kValueTables; ++t) {
        const bool read_by_xsa = c.xsa[size_t(c.value_layers[size_t(t)])];
        for (int i = 0; i < (read_by_xsa ? 2 : 1); ++i) {
            ve.push_back((size_t(t) * V + tok()) * C + rnd(C));
            vg.push_back((size_t(t) * H + rnd(H)) * kGateDim + rnd(kGateDim));
        }
    }
    Samples samples = {{"xsa_alphas", alphas}, {"attn_bank", a},   {"attn_gate_bank", ag},
                       {"scalars", sc},        {"value_embeds", ve}, {"ve_gate_bank", vg}};
    std::vector<size_t> m, e, bg;
    for (int l : {1, 4, 8}) m.push_back(((size_t(l) * 2 + 1) * F + rnd(F)) * C + rnd(C));  // c_proj
    for (int l : {3, 10}) m.push_back(((size_t(l) * 2) * F + rnd(F)) * C + rnd(C));        // c_fc
    for (int i = 0; i < 2; ++i) e.push_back(tok() * C + rnd(C));
    for (int i = 0; i < 2; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * C + rnd(C));
    samples.push_back({"mlp_bank", m});
    samples.push_back({"embed", e});
    samples.push_back({"bigram_embed", bg});
    samples.push_back({"lm_head", {size_t(rnd(C * V)), size_t(rnd(C * V))}});
    samples.push_back({"smear_gate", {size_t(rnd(kGateDim))}});
    samples.push_back({"skip_gate", {size_t(rnd(kGateDim))}});
    samples.push_back({"x0_lambdas", {size_t(rnd(kLayers))}});
    samples.push_back({"resid_lambdas", {size_t(2 * 4), size_t(2 * 8 + 1)}});
    samples.push_back({"post_lambdas", {size_t(2 * 3), size_t(2 * 10)}});
    samples.push_back({"bigram_lambdas", {size_t(7)}});
    const FdStats fd = fd_check(c, p, b, g, samples);

    // the strengths of the layers without XSA are never read: exactly zero; those of its layers are not
    bool rows = true;
    for (int i = 0; i < kLayers; ++i)
        for (int h = 0; h < H; ++h) rows &= (g.xsa_alphas[size_t(i) * H + h] != 0.0) == c.xsa[size_t(i)];
    test::check(rows, "xsa_alphas' gradient: zero exactly on the rows of layers without XSA");
    std::printf("XSA finite differences: loss %.6f, %d forwards (%d step reductions), %.1f s\n", loss, fd.evaluated,
                fd.shrunk, seconds_since(t0));
}

// ---- records 83/84's bigram: narrow width, sign trick, x0 aliasing ----
// Record 80's finite-difference configuration with a bigram 40 wide of the 64 channels (a multiple of
// 8 below C, past the 12 gate channels, so that the aliased x0's skip gate reads bigram channels),
// signs from a 5-row table (rows repeat within the 32 tokens) and x0 aliasing on or off.
Config bigram_small_config(bool x0_includes_bigram) {
    Config c = r80_small_config();
    c.bigram_dim = 40;
    c.bigram_sign_rows = 5;
    c.bigram_sign_table = c.random_sign_table(test::rng()());
    c.x0_includes_bigram = x0_includes_bigram;
    return c;
}
// Bigram rows, bigram and x0 lambdas of the size of what they are added to (perturb's 0.05 leaves the
// bigram a few thousandths of the stream, and its aliasing into x0 nearly invisible).
Params bigram_random_params(const Config& c) {
    Params p = random_params(c);
    for (double& e : p.bigram_embed) e = test::uniform(-1.0, 1.0);
    for (double& l : p.bigram_lambdas) l = test::uniform(0.1, 0.4);
    for (double& l : p.x0_lambdas) l = test::uniform(-0.5, 0.5);
    return p;
}

// The sign rows on a hand-made batch: row 0 at t = 0, (prev ^ cur) % rows after, across the document
// bound at 3; the forward's x_bigram is the bigram row times its sign row.
void check_bigram_signs() {
    const std::vector<int> inputs = {5, 3, 3, 12, 7, 200};
    // 5^3 = 6, 3^3 = 0, 3^12 = 15, 12^7 = 11, 7^200 = 207
    test::check(bigram_sign_index(inputs, 4) == std::vector<int>({0, 2, 0, 3, 3, 3}) &&
                    bigram_sign_index(inputs, 5) == std::vector<int>({0, 1, 0, 0, 1, 2}) &&
                    bigram_sign_index(inputs, 1) == std::vector<int>(6, 0),
                "bigram_sign_index: row 0 at t = 0, (prev ^ cur) mod rows");
    Config c = bigram_small_config(false);
    c.T = 6;
    Params p = bigram_random_params(c);
    Batch b;
    b.inputs = inputs;
    b.targets = {3, 3, 12, 7, 200, 1};
    b.cu_seqlens = {0, 3, 6};  // t = 3 starts a document: its sign row still reads token 2
    b.bigram = bigram_hash(b.inputs, c.bigram_vocab);
    Tape tp;
    forward(c, p, b, &tp);
    const size_t W = c.bigram_width();
    bool rows = tp.bigram_sign_idx == std::vector<int>({0, 1, 0, 0, 1, 2}) && tp.x_bigram.size() == 6 * W;
    for (size_t t = 0; t < 6; ++t)
        for (size_t j = 0; j < W; ++j)
            rows &= tp.x_bigram[t * W + j] == p.bigram_embed[size_t(b.bigram[t]) * W + j] *
                                                  c.bigram_sign_table[size_t(tp.bigram_sign_idx[t]) * W + j];
    test::check(rows, "signed bigram: x_bigram[t] = bigram row * sign row (prev ^ cur) mod 5, (T, 40)");
    // both signs present, the same table for the same seed
    int plus = 0;
    for (double e : c.bigram_sign_table) plus += e > 0;
    test::check(plus > 0 && plus < int(c.bigram_sign_table.size()) &&
                    c.random_sign_table(7) == c.random_sign_table(7) && c.random_sign_table(7) != c.random_sign_table(8),
                "random_sign_table: +-1 both present (%d of %zu +1), deterministic per seed", plus,
                c.bigram_sign_table.size());
}

// The switches' structure by forward runs: (1) full width with an all-(+1) table is record 80 bit for
// bit, gradients included; (2) the narrow bigram reaches channels [0, 40) only: with post lambdas 0 (the
// blocks add nothing) new bigram rows move every layer's output there and leave channels 40-63 exact;
// (3) the aliased x0 is layer 0's input, differs from the norm's output on channels [0, 40) only, and
// the skip gate reads it; at bigram_lambdas[0] = 0 aliasing changes nothing but d bigram_lambdas[0].
void check_bigram_forward() {
    const Config c80 = r80_small_config();
    Config ones = c80;
    ones.bigram_dim = c80.C;
    ones.bigram_sign_rows = 3;
    ones.bigram_sign_table.assign(size_t(3) * c80.C, 1.0);
    for (const bool bf16 : {false, true}) {
        Config a = c80, o = ones;
        a.lambdas_bf16 = o.lambdas_bf16 = bf16;
        const Params p = bigram_random_params(a);
        const Batch b = make_batch(a, {0, 11, 18}, 1);
        Params ga, go;
        Tape ta, to;
        const double la = forward_backward(a, p, b, 1.0, ga, &ta), lo = forward_backward(o, p, b, 1.0, go, &to);
        bool same = la == lo && ta.row_loss == to.row_loss;
        for (size_t t = 0; t < ga.tensors().size(); ++t) same &= *ga.tensors()[t].second == *go.tensors()[t].second;
        test::check(same && to.bigram_sign_idx.size() == size_t(a.T),
                    "bigram_dim = C with an all-(+1) sign table (bf16 lambdas %d): loss %.17g, record 80's %.17g (or "
                    "gradients differ)",
                    bf16, lo, la);
    }

    const Config c = bigram_small_config(false);
    const size_t T = c.T, C = c.C, W = c.bigram_width();
    Params p = bigram_random_params(c);
    p.post_lambdas.assign(2 * kLayers, 0.0);
    const Batch b = make_batch(c, {0, 11, 18}, 1);
    Params q = p;
    for (double& e : q.bigram_embed) e += 0.25;
    Tape tp, tq;
    forward(c, p, b, &tp);
    forward(c, q, b, &tq);
    bool narrow_moved = true, wide_exact = true;
    for (int i = 0; i < kLayers; ++i)
        for (size_t t = 0; t < T; ++t) {
            bool moved = false;
            for (size_t j = 0; j < C; ++j) {
                const size_t e = t * C + j;
                if (j < W) moved |= tp.layers[i].x_out[e] != tq.layers[i].x_out[e];
                else wide_exact &= tp.layers[i].x_out[e] == tq.layers[i].x_out[e];
            }
            narrow_moved &= moved;
        }
    test::check(narrow_moved && wide_exact,
                "narrow bigram (40 of 64): new rows must move channels [0, 40) of every layer's output (%d) and "
                "leave channels 40-63 exact (%d)",
                narrow_moved, wide_exact);

    const Config ca = bigram_small_config(true);
    Config cn = ca;
    cn.x0_includes_bigram = false;
    const Params pa = bigram_random_params(ca);
    Tape on, off;
    forward(ca, pa, b, &on);
    forward(cn, pa, b, &off);
    const bool alias = on.x0_with_bigram == on.layers[0].x_in && off.x0_with_bigram.empty() &&
                       on.layers[0].x_in == off.layers[0].x_in;
    bool narrow_only = true, differs = false;
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < C; ++j) {
            const size_t e = t * C + j;
            if (j < W) differs |= on.x0_with_bigram[e] != on.x0[e];
            else narrow_only &= on.x0_with_bigram[e] == on.x0[e];
        }
    bool skip = true;
    for (size_t t = 0; t < T; ++t)
        skip &= on.skip_sig[t] ==
                test::sigmoid(detail::dot(on.x0_with_bigram.data() + t * C, pa.skip_gate.data(), kGateDim));
    test::check(alias && narrow_only && differs && skip && on.skip_sig != off.skip_sig && on.loss != off.loss,
                "x0 aliasing: x0 = layer 0's input (%d), off the norm's output on channels [0, 40) only (%d, %d), the "
                "skip gate reads it (%d)",
                alias, narrow_only, differs, skip);
    Params pz = pa;
    pz.bigram_lambdas[0] = 0.0;
    Params gon, goff;
    const double lon = forward_backward(ca, pz, b, 1.0, gon), loff = forward_backward(cn, pz, b, 1.0, goff);
    bool same = lon == loff && gon.bigram_lambdas[0] != goff.bigram_lambdas[0];
    Params gon0 = gon, goff0 = goff;
    gon0.bigram_lambdas[0] = goff0.bigram_lambdas[0] = 0.0;
    for (size_t t = 0; t < gon.tensors().size(); ++t) same &= *gon0.tensors()[t].second == *goff0.tensors()[t].second;
    test::check(same,
                "x0 aliasing at bigram_lambdas[0] = 0: loss %.17g, without %.17g; gradients must agree but for d "
                "bigram_lambdas[0] (%.6g, %.6g), which the reads of x0 reach",
                lon, loff, gon.bigram_lambdas[0], goff.bigram_lambdas[0]);
}

// Every tensor's gradient with records 83/84's bigram, weighted to what it touches: a bigram row read
// at two positions under different sign rows, other rows at channels across [0, 40), every bigram
// lambda, the x0 lambdas and the skip gate (readers of the aliased x0), the embedding and smear (the
// norm's inputs), and a sample of the rest. With aliasing on, record 84's XSA layers as well.
void check_bigram_gradients_fd(bool x0_includes_bigram) {
    const auto t0 = std::chrono::steady_clock::now();
    Config c = bigram_small_config(x0_includes_bigram);
    if (x0_includes_bigram)
        for (int i : {1, 3, 4, 7, 8, 10}) c.xsa[size_t(i)] = true;
    c.xsa_alpha_bf16 = false;
    Params p = bigram_random_params(c);
    for (double& a : p.xsa_alphas) a = test::uniform(-1.0, 1.0);
    Batch b = make_batch(c, {0, 11, 18}, 2);
    // one bigram row read at two positions under different sign rows (any id is in range)
    const std::vector<int> sidx = bigram_sign_index(b.inputs, c.bigram_sign_rows);
    const int t1 = 5;
    int t2 = 6;
    while (sidx[size_t(t2)] == sidx[size_t(t1)] && t2 + 1 < c.T) ++t2;
    test::check(sidx[size_t(t2)] != sidx[size_t(t1)], "test setup: two positions with different sign rows");
    b.bigram[size_t(t2)] = b.bigram[size_t(t1)];
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, F = c.hidden(), H = c.H, W = c.bigram_width();
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    auto tok = [&] { return size_t(b.inputs[rnd(c.T)]); };
    const ScalarSlots& k = c.scalar_slots();
    std::vector<size_t> bg, bl, x0;
    const size_t shared = size_t(b.bigram[size_t(t1)]);
    for (int i = 0; i < 4; ++i) bg.push_back(shared * W + rnd(W));
    for (int i = 0; i < 6; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * W + rnd(W));
    bg.push_back(size_t(b.bigram[rnd(c.T)]) * W + W - 1);  // the last channel the bigram reaches
    for (int i = 0; i < kLayers; ++i)
        if (i != kSkipTo) bl.push_back(size_t(i));
    for (int i : {0, 3, 7, 9, 10}) x0.push_back(size_t(i));
    Samples samples = {{"bigram_embed", bg},
                       {"bigram_lambdas", bl},
                       {"x0_lambdas", x0},
                       {"skip_gate", {0, 5, 11, size_t(rnd(kGateDim))}},
                       {"smear_gate", {size_t(rnd(kGateDim))}},
                       {"embed", {tok() * C + rnd(C), tok() * C + rnd(C), tok() * C + rnd(C)}},
                       {"lm_head", {size_t(rnd(C * V))}}};
    std::vector<size_t> a, m, ve, ag, vg;
    for (int bank : {0, 1, 4, 6, 9}) a.push_back((size_t(bank) * 4 * C + rnd(4) * C + rnd(C)) * C + rnd(C));
    for (int l : {0, 5, 9}) m.push_back(((size_t(l) * 2 + 1) * F + rnd(F)) * C + rnd(C));  // c_proj
    for (int l : {2, 8}) m.push_back(((size_t(l) * 2) * F + rnd(F)) * C + rnd(C));         // c_fc
    for (int t : {0, 2, 4}) {
        ve.push_back((size_t(t) * V + tok()) * C + rnd(C));
        vg.push_back((size_t(t) * H + rnd(H)) * kGateDim + rnd(kGateDim));
    }
    for (int i = 0; i < 2; ++i) ag.push_back((size_t(rnd(kAttnLayers)) * H + rnd(H)) * kGateDim + rnd(kGateDim));
    samples.push_back({"attn_bank", a});
    samples.push_back({"mlp_bank", m});
    samples.push_back({"value_embeds", ve});
    samples.push_back({"ve_gate_bank", vg});
    samples.push_back({"attn_gate_bank", ag});
    samples.push_back({"scalars", {size_t(k.sa_of(1, 0)), size_t(k.smear), size_t(k.backout), size_t(k.skip)}});
    samples.push_back({"resid_lambdas", {size_t(0), size_t(2 * 6 + 1), size_t(2 * 9)}});
    samples.push_back({"post_lambdas", {size_t(1), size_t(2 * 4), size_t(2 * 10 + 1)}});
    if (x0_includes_bigram) samples.push_back({"xsa_alphas", {size_t(1 * H), size_t(8 * H + 1)}});
    const FdStats fd = fd_check(c, p, b, g, samples);

    // a row the batch does not read has exactly zero gradient; the shared row's is not
    std::set<int> used(b.bigram.begin(), b.bigram.end());
    int unused = 0;
    while (used.count(unused)) ++unused;
    bool zero = true, shared_nonzero = false;
    for (int j = 0; j < W; ++j) {
        zero &= g.bigram_embed[size_t(unused) * W + j] == 0.0;
        shared_nonzero |= g.bigram_embed[shared * W + j] != 0.0;
    }
    test::check(zero && shared_nonzero && g.bigram_embed.size() == size_t(c.bigram_vocab) * W,
                "bigram rows (97, 40): an unread row's gradient must be exactly zero (%d), a read one's not (%d)", zero,
                shared_nonzero);
    std::printf("records 83/84 bigram finite differences (x0 aliasing %s): loss %.6f, %d forwards (%d step "
                "reductions), %.1f s\n",
                x0_includes_bigram ? "on, XSA" : "off", loss, fd.evaluated, fd.shrunk, seconds_since(t0));
}

// ---- record 81's MUDD ----
// The bigram finite-difference configuration (record 80's stream with h7 the late source, the narrow signed
// bigram) with MUDD, x0 aliasing on or off.
Config mudd_small_config(bool x0_includes_bigram) {
    Config c = bigram_small_config(x0_includes_bigram);
    c.mudd = true;
    return c;
}
// MUDD's weights random, w2 and b2 included (at init w2 = 0 makes every coefficient a constant and leaves
// w1 without gradient): coefficients of order 0.5 that vary from token to token.
Params mudd_random_params(const Config& c) {
    Params p = bigram_random_params(c);
    const double w1 = 1.0 / std::sqrt(double(c.C));  // upstream's init bound
    for (double& w : p.mudd_w1) w = test::uniform(-w1, w1);
    for (double& w : p.mudd_w2) w = test::uniform(-1.0, 1.0);
    for (double& b : p.mudd_b2) b = test::uniform(-3.0, 3.0);
    return p;
}

// Layout, init and refusals' neighbours: scalars without the backout (24, no padding), the three tensors
// after xsa_alphas, upstream's init values, the lambda vectors.
void check_mudd_layout() {
    Config c = Config::make(16, 512, 128, 2, 64, 50, 128, 384);
    c.sublayer_lambdas = true;
    c.late_attn_source = 7;
    c.value_layers = {1, 2, 8, 9, 10};
    c.mudd = true;
    const Params p = Params::init(c, 99);
    const ScalarSlots& k = c.scalar_slots();
    bool ok = p.scalars.size() == 24 && c.num_scalars() == 24 && k.sa == 0 && k.smear == 22 && k.backout == -1 &&
              k.skip == 23 && k.used == 24;
    for (int i = 0; i < kLayers; ++i) ok &= p.scalars[2 * i] == 0.5 && p.scalars[2 * i + 1] == 1.0;
    ok &= p.scalars[22] == 0.0 && p.scalars[23] == -1.5;
    test::check(ok, "MUDD scalars: sa (0.5, 1) x 11, smear 0, skip -1.5, no backout, no padding (24)");
    const auto t = p.tensors();
    const std::vector<size_t> n = Params::sizes(c);
    test::check(t.size() == 23 && n.size() == 23 && std::string(t[16].first) == "mudd_w1" &&
                    std::string(t[17].first) == "mudd_w2" && std::string(t[18].first) == "mudd_b2" &&
                    n[16] == size_t(2 * 64 * 128) && n[17] == size_t(2 * 14 * 64) && n[18] == size_t(2 * 14),
                "MUDD tensors: mudd_w1 (2, 64, C), mudd_w2 (2, 14, 64), mudd_b2 (2, 14) after xsa_alphas");
    const double bound = 1.0 / std::sqrt(128.0);
    double largest = 0.0, sum = 0.0;
    for (double w : p.mudd_w1) largest = std::max(largest, std::fabs(w)), sum += w;
    bool w2 = true;
    for (double w : p.mudd_w2) w2 &= w == 0.0;
    test::check(largest <= bound && largest > 0.99 * bound && std::fabs(sum / double(p.mudd_w1.size())) < 0.01 * bound && w2,
                "MUDD init: w1 uniform(+-1/sqrt(C)) (largest %.5f of %.5f), w2 zeros", largest, bound);
    std::vector<double> want(28, 0.0);
    want[kMuGateLo] = want[kMuGateHi] = 20.0;
    want[kMuResidAttn] = want[kMuResidMlp] = 10.5;
    want[kMuPostAttn] = want[kMuPostMlp] = 10.0;
    want[kMuBigram] = 0.5;
    want[kMuddCoefs + kMuPost7] = -5.0;
    test::check(p.mudd_b2 == want, "MUDD init: b2 = upstream's (20, 20, 10.5, 10, 0, 0.5, 10.5, 10 at 6-13; -5 at [1, 1])");
    // without MUDD: no tensors; lambda_gradients: 24 scalars, x0 (11), resid (22), post (22), bigram (11)
    Config r80 = c;
    r80.mudd = false;
    const Params p80 = Params::init(r80, 99);
    test::check(p80.mudd_w1.empty() && p80.mudd_w2.empty() && p80.mudd_b2.empty() && p80.scalars.size() == 32,
                "record 80 (no MUDD): no MUDD tensors, 32 scalars");
    Params g = Params::zeros(c);
    for (auto& [name, v] : g.tensors())
        for (size_t i = 0; i < v->size(); ++i) (*v)[i] = 1000.0 * (name[0] + name[1]) + double(i);
    const std::vector<double> lg = lambda_gradients(g);
    Tape tp;
    tp.scalar_scales = g.scalars;
    tp.x0_lambda_scales = g.x0_lambdas;
    tp.resid_lambda_scales = g.resid_lambdas;
    tp.post_lambda_scales = g.post_lambdas;
    tp.bigram_lambda_scales = g.bigram_lambdas;
    tp.mudd[1].coef.assign(1, 0.0);  // what marks a MUDD tape
    test::check(lg.size() == 90 && lg[23] == g.scalars[23] && lg[24] == g.x0_lambdas[0] && lg[89] == g.bigram_lambdas[10] &&
                    lambda_error_scales(tp) == lg,
                "MUDD lambda vectors: scalars (24), x0 (11), resid (22), post (22), bigram (11)");
}

// Naive MUDD block for one token: (gelu(h W1^T) W2[:n]^T + b2[:n]) * 0.1, from the formula.
std::vector<double> naive_mudd(const Params& p, int block, int n, const double* h, int C) {
    std::vector<double> out(size_t(n), 0.0), gz(kMuddDim);
    for (int m = 0; m < kMuddDim; ++m) {
        double z = 0.0;
        for (int j = 0; j < C; ++j) z += h[j] * p.mudd_w1[(size_t(block) * kMuddDim + m) * C + j];
        gz[size_t(m)] = 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
    }
    for (int i = 0; i < n; ++i) {
        double s = p.mudd_b2[size_t(block) * kMuddCoefs + i];
        for (int m = 0; m < kMuddDim; ++m) s += gz[size_t(m)] * p.mudd_w2[(size_t(block) * kMuddCoefs + i) * kMuddDim + m];
        out[size_t(i)] = s * 0.1;
    }
    return out;
}

// The forward against the formulas, written out per element from the tape's snapshots (4 heads, so each
// ve gate lane covers two): the coefficients, layer 10's v, attention input, updates and output, and the
// post-loop mix. Then MUDD at constant coefficients (w2 = 0) equal to record 80's lambdas, ve gate 1 and
// backout is record 80 (up to the sums' order), and its b2 gradient is 0.1 times theirs.
void check_mudd_forward() {
    for (const bool alias : {false, true}) {
        Config c = mudd_small_config(alias);
        c.H = 4;
        c.D = 16;
        c.yarn.reset(16);
        c.yarn_paired.reset(16);
        c.yarn_apply(7, 11);
        const Params p = mudd_random_params(c);
        const Batch b = make_batch(c, {0, 11, 18}, 1);
        Tape tp;
        forward(c, p, b, &tp);
        const int T = c.T, C = c.C, H = c.H, D = c.D, W = c.bigram_width();
        const LayerTape& L = tp.layers[10];
        const std::vector<double>&h0 = tp.layers[0].x_in, &h3 = tp.layers[3].x_out, &h7 = tp.layers[7].x_out,
                                  &h9 = tp.layers[9].x_out;
        const double sa0 = p.scalars[c.scalar_slots().sa_of(10, 0)], sa1 = p.scalars[c.scalar_slots().sa_of(10, 1)];
        double worst = 0.0;
        auto near = [&](double got, double want) {
            worst = std::max(worst, std::fabs(got - want) / (1.0 + std::fabs(want)));
        };
        for (int t = 0; t < T; ++t) {
            const std::vector<double> k = naive_mudd(p, 0, 14, h9.data() + size_t(t) * C, C);
            for (int j = 0; j < 14; ++j) near(tp.mudd[0].coef[size_t(t) * 14 + j], k[size_t(j)]);
            const double* ve4 = p.value_embeds.data() + (size_t(4) * c.V + b.inputs[size_t(t)]) * C;
            const double* ve0 = p.value_embeds.data() + size_t(b.inputs[size_t(t)]) * C;
            for (int h = 0; h < H; ++h)
                for (int d = 0; d < D; ++d) {
                    const size_t e = size_t(t) * C + h * D + d;
                    const double gate = h < H / 2 ? k[6] : k[7];
                    const double v = sa0 * L.qkv_raw[size_t(t) * 3 * C + 2 * C + h * D + d] + gate * ve4[h * D + d] +
                                     (k[0] * h0[e] + k[1] * h7[e] + k[2] * h9[e]);
                    near(L.v[e], v);
                }
            std::vector<double> x(C);
            for (int j = 0; j < C; ++j) {
                const size_t e = size_t(t) * C + j;
                const double r = (1.0 + k[5]) * h9[e] + k[3] * h0[e] + k[4] * h7[e];
                double xa = k[8] * r + k[9] * sa1 * L.o_raw[e] + k[10] * h0[e];
                if (j < W) xa += k[11] * tp.x_bigram[size_t(t) * W + j];
                near(L.x_attn[e], xa);
                x[size_t(j)] = k[12] * L.x_attn[e] + k[13] * L.mlp_out[e];
                near(L.x_out[e], x[size_t(j)]);
            }
            const std::vector<double> q = naive_mudd(p, 1, 5, L.x_out.data() + size_t(t) * C, C);
            for (int j = 0; j < 5; ++j) near(tp.mudd[1].coef[size_t(t) * 5 + j], q[size_t(j)]);
            for (int j = 0; j < C; ++j) {
                const size_t e = size_t(t) * C + j;
                near(tp.x_final[e], L.x_out[e] + q[0] * h0[e] + q[1] * h7[e] + q[2] * h9[e] + q[3] * ve0[j] + q[4] * h3[e]);
            }
        }
        test::check(worst < 1e-12 && L.x_mix == h7 && L.x_in == h9 && L.ve_sig.empty() &&
                        (alias ? tp.x0_with_bigram == h0 : tp.x0 != h0),
                    "MUDD forward (x0 aliasing %d) against the formulas: worst %.3g; layer 10 attends to norm(h7), its "
                    "input is h9; h0 is layer 0's input",
                    alias, worst);

        // constant coefficients: record 80 with lambdas c8..c13, a ve gate of 1 (gate weights 0) and backout 0.5
        Config c80 = bigram_small_config(alias);
        Params p80 = bigram_random_params(c80);
        const int t4 = 4 * c80.H * kGateDim;
        for (int e = t4; e < t4 + c80.H * kGateDim; ++e) p80.ve_gate_bank[size_t(e)] = 0.0;  // 2 sigmoid(0) = 1
        Config cm = c80;
        cm.mudd = true;
        Params pm = Params::zeros(cm);
        {
            auto from = p80.tensors();
            auto to = pm.tensors();
            for (size_t i = 0; i < from.size(); ++i)
                if (std::string(from[i].first) != "scalars" && std::string(from[i].first).rfind("mudd", 0) != 0)
                    *to[i].second = *from[i].second;
        }
        const ScalarSlots &k80 = c80.scalar_slots(), &km = cm.scalar_slots();
        for (int i = 0; i < kLayers; ++i)
            for (int j = 0; j < 2; ++j) pm.scalars[size_t(km.sa_of(i, j))] = p80.scalars[size_t(k80.sa_of(i, j))];
        pm.scalars[size_t(km.smear)] = p80.scalars[size_t(k80.smear)];
        pm.scalars[size_t(km.skip)] = p80.scalars[size_t(k80.skip)];
        p80.scalars[size_t(k80.backout)] = 0.5;
        for (double& w : pm.mudd_w1) w = test::uniform(-0.3, 0.3);  // w2 = 0: the coefficients are b2 * 0.1
        double* b0 = pm.mudd_b2.data();
        b0[kMuGateLo] = b0[kMuGateHi] = 10.0;  // 10 * 0.1 = 1 exactly
        b0[kMuddCoefs + kMuPost7] = -5.0;      // -0.5 h7
        for (int j : {kMuResidAttn, kMuPostAttn, kMuX0, kMuBigram, kMuResidMlp, kMuPostMlp}) b0[j] = test::uniform(-12.0, 12.0);
        if (!alias) b0[kMuX0] = 0.0;  // record 80's layer-10 x0 injection reads x0, MUDD's c10 reads h0: equal only aliased
        p80.resid_lambdas[20] = b0[kMuResidAttn] * kMuddScale;
        p80.post_lambdas[20] = b0[kMuPostAttn] * kMuddScale;
        p80.x0_lambdas[10] = b0[kMuX0] * kMuddScale;
        p80.bigram_lambdas[10] = b0[kMuBigram] * kMuddScale;
        p80.resid_lambdas[21] = b0[kMuResidMlp] * kMuddScale;
        p80.post_lambdas[21] = b0[kMuPostMlp] * kMuddScale;
        const Batch b80 = make_batch(c80, {0, 11, 18}, 1);
        Params g80, gm;
        const double l80 = forward_backward(c80, p80, b80, 1.0, g80), lm = forward_backward(cm, pm, b80, 1.0, gm);
        double grad_worst = 0.0;
        {
            auto a = gm.tensors();
            auto w = g80.tensors();
            for (size_t i = 0; i < a.size(); ++i) {
                const std::string name = a[i].first;
                if (name == "scalars" || name.rfind("mudd", 0) == 0 || name == "ve_gate_bank" ||
                    name == "resid_lambdas" || name == "post_lambdas" || name == "x0_lambdas" || name == "bigram_lambdas")
                    continue;
                double big = 0.0, diff = 0.0;
                for (size_t e = 0; e < a[i].second->size(); ++e)
                    big = std::max(big, std::fabs((*w[i].second)[e])),
                    diff = std::max(diff, std::fabs((*a[i].second)[e] - (*w[i].second)[e]));
                grad_worst = std::max(grad_worst, diff / std::max(big, 1e-300));
            }
            std::vector<std::pair<int, int>> slots = {{km.smear, k80.smear}, {km.skip, k80.skip}};
            for (int i = 0; i < kLayers; ++i)
                for (int j = 0; j < 2; ++j) slots.push_back({km.sa_of(i, j), k80.sa_of(i, j)});
            for (auto [sm, s80] : slots)
                grad_worst = std::max(grad_worst, std::fabs(gm.scalars[size_t(sm)] - g80.scalars[size_t(s80)]) /
                                                      (1e-300 + std::fabs(g80.scalars[size_t(s80)])));
        }
        const double* gb = gm.mudd_b2.data();
        double lam_worst = 0.0;
        auto lam = [&](double got_b2, double want_lambda) {
            lam_worst = std::max(lam_worst, std::fabs(got_b2 - kMuddScale * want_lambda) / (1e-300 + std::fabs(kMuddScale * want_lambda)));
        };
        lam(gb[kMuResidAttn], g80.resid_lambdas[20]);
        lam(gb[kMuPostAttn], g80.post_lambdas[20]);
        lam(gb[kMuBigram], g80.bigram_lambdas[10]);
        lam(gb[kMuResidMlp], g80.resid_lambdas[21]);
        lam(gb[kMuPostMlp], g80.post_lambdas[21]);
        lam(gb[kMuddCoefs + kMuPost7], -g80.scalars[size_t(k80.backout)]);
        if (alias) lam(gb[kMuX0], g80.x0_lambdas[10]);
        test::check(std::fabs(lm - l80) <= 1e-12 * std::fabs(l80) && grad_worst < 1e-9 && lam_worst < 1e-9,
                    "MUDD at constant coefficients (x0 aliasing %d) = record 80: loss %.17g vs %.17g, other gradients "
                    "off by %.3g, d b2 / 0.1 off record 80's lambda gradients by %.3g",
                    alias, lm, l80, grad_worst, lam_worst);
    }
}

// Every new gradient by central differences, with w2 and b2 random so that every coefficient path is live:
// both blocks' w1, every row of w2 and b2 that is read, value tables 0 (layer 1's and c'3's) and 4 (the ve
// gated by c6/c7), layers 3 and 7 (h3, h7) and 10's weights, the bigram rows, the lambdas that stay live and
// layer 10's sa lambdas; with aliasing on, XSA on record 84's layers (10's v includes v_mudd). What MUDD
// leaves unread is exactly zero: layer 10's resid/post/x0/bigram lambdas, its table's ve gate, rows [5, 14)
// of block 1's w2 and b2.
void check_mudd_gradients_fd(bool x0_includes_bigram) {
    const auto t0 = std::chrono::steady_clock::now();
    Config c = mudd_small_config(x0_includes_bigram);
    if (x0_includes_bigram)
        for (int i : {1, 3, 4, 7, 8, 10}) c.xsa[size_t(i)] = true;
    c.xsa_alpha_bf16 = false;
    Params p = mudd_random_params(c);
    for (double& a : p.xsa_alphas) a = test::uniform(-1.0, 1.0);
    const Batch b = make_batch(c, {0, 11, 18}, 2);
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, F = c.hidden(), H = c.H, W = c.bigram_width(), M = kMuddDim;
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    auto tok = [&] { return size_t(b.inputs[rnd(c.T)]); };
    const ScalarSlots& k = c.scalar_slots();
    std::vector<size_t> w1, w2, b2;
    for (int blk = 0; blk < kMuddBlocks; ++blk)
        for (int i = 0; i < 3; ++i) w1.push_back((size_t(blk) * M + rnd(M)) * C + rnd(C));
    for (int j = 0; j < kMuddCoefs; ++j) w2.push_back(size_t(j) * M + rnd(M)), b2.push_back(size_t(j));
    for (int j = 0; j < kMuddPostCoefs; ++j)
        w2.push_back((size_t(kMuddCoefs) + j) * M + rnd(M)), b2.push_back(size_t(kMuddCoefs + j));
    std::vector<size_t> ve, a, m, bg;
    for (int t : {0, 4})
        for (int i = 0; i < 3; ++i) ve.push_back((size_t(t) * V + tok()) * C + rnd(C));
    for (int bank : {3, 6, 9})  // layers 3, 7, 10
        for (int part : {rnd(3), 3}) a.push_back((size_t(bank) * 4 * C + part * C + rnd(C)) * C + rnd(C));
    for (int l : {3, 7, 9}) m.push_back(((size_t(l) * 2 + 1) * F + rnd(F)) * C + rnd(C));  // c_proj
    for (int l : {3, 10}) m.push_back(((size_t(l) * 2) * F + rnd(F)) * C + rnd(C));         // c_fc
    for (int i = 0; i < 3; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * W + rnd(W));
    Samples samples = {{"mudd_w1", w1},
                       {"mudd_w2", w2},
                       {"mudd_b2", b2},
                       {"value_embeds", ve},
                       {"attn_bank", a},
                       {"mlp_bank", m},
                       {"bigram_embed", bg},
                       {"resid_lambdas", {size_t(2 * 3), size_t(2 * 7 + 1), size_t(2 * 9)}},
                       {"post_lambdas", {size_t(2 * 7), size_t(2 * 9 + 1)}},
                       {"x0_lambdas", {0, 3, 9}},
                       {"bigram_lambdas", {0, 9}},
                       {"scalars", {size_t(k.sa_of(10, 0)), size_t(k.sa_of(10, 1)), size_t(k.smear), size_t(k.skip)}},
                       {"skip_gate", {size_t(rnd(kGateDim))}},
                       {"embed", {tok() * C + rnd(C), tok() * C + rnd(C)}},
                       {"lm_head", {size_t(rnd(C * V))}}};
    if (x0_includes_bigram) samples.push_back({"xsa_alphas", {size_t(10 * H), size_t(10 * H + 1)}});
    const FdStats fd = fd_check(c, p, b, g, samples);

    bool dead = g.resid_lambdas[20] == 0.0 && g.resid_lambdas[21] == 0.0 && g.post_lambdas[20] == 0.0 &&
                g.post_lambdas[21] == 0.0 && g.x0_lambdas[10] == 0.0 && g.bigram_lambdas[10] == 0.0;
    const int table = c.table_of(10);
    for (int e = 0; e < H * kGateDim; ++e) dead &= g.ve_gate_bank[size_t(table * H * kGateDim + e)] == 0.0;
    for (int j = kMuddPostCoefs; j < kMuddCoefs; ++j) {
        dead &= g.mudd_b2[size_t(kMuddCoefs + j)] == 0.0;
        for (int i = 0; i < M; ++i) dead &= g.mudd_w2[(size_t(kMuddCoefs) + j) * M + i] == 0.0;
    }
    bool live = true;
    for (int j = 0; j < kMuddCoefs + kMuddPostCoefs; ++j) live &= g.mudd_b2[size_t(j)] != 0.0;
    test::check(dead && live,
                "MUDD: layer 10's lambdas and ve gate, block 1's w2/b2 rows [5, 14) must have exactly zero gradient "
                "(%d), every read b2 entry a non-zero one (%d)",
                dead, live);
    std::printf("record 81 MUDD finite differences (x0 aliasing %s): loss %.6f, %d forwards (%d step reductions), %.1f s\n",
                x0_includes_bigram ? "on, XSA" : "off", loss, fd.evaluated, fd.shrunk, seconds_since(t0));
}

// MUDD's b2 error scales (Tape::mudd_b2_scales), as check_r80_error_scales: the FP8 head's e5m2 gradient
// moves each b2 gradient by a fraction of its scale, while the gradients are of the order of it; the unread
// rows' scales are 0.
void check_mudd_error_scales() {
    Config exact = mudd_small_config(true);
    exact.lambdas_bf16 = true;
    Config fp8 = exact;
    fp8.fp8 = true;
    const Params p = mudd_random_params(exact);
    const Batch b = make_batch(exact, {0, 11, 18}, 0);
    Params g8, gx;
    Tape tx;
    forward_backward(fp8, p, b, exact.grad_scale, g8);
    forward_backward(exact, p, b, exact.grad_scale, gx, &tx);
    const std::vector<double>& scales = tx.mudd_b2_scales;
    test::check(scales.size() == 28, "MUDD error scales: %zu entries", scales.size());
    const double worst = test::check_within_scale("MUDD: FP8 vs exact b2 gradients", g8.mudd_b2, gx.mudd_b2, scales, 0.6);
    double largest = 0.0;
    bool zero = true, positive = true;
    for (size_t j = 0; j < scales.size(); ++j) {
        const bool read = j < size_t(kMuddCoefs + kMuddPostCoefs);  // block 0, then block 1's first 5
        if (read) positive &= scales[j] > 0.0, largest = std::max(largest, std::fabs(gx.mudd_b2[j]) / scales[j]);
        else zero &= scales[j] == 0.0;
    }
    test::check(largest > 0.6 && zero && positive,
                "MUDD error scales: the largest b2 gradient is %.2f of its scale; unread rows' scales 0 (%d), read "
                "rows' positive (%d)",
                largest, zero, positive);
    std::printf("  MUDD b2: FP8 vs exact largest difference %.3f of the scale, largest gradient %.2f of it\n", worst,
                largest);
}

// ---- record 88's prefix-token loss ----
// The loss is the MTP loss plus pw (lse - z[P_t]) over the rows whose prefix target lies in [0, V) (some rows -1, some
// past V: none), and its gradient central differences' (the term joins S_w and the target column).
void check_prefix_loss() {
    Config c = r80_small_config();  // S_w over the present weights: the gradient of the loss (record 80's quirk is not)
    c.prefix_weight = 0.3;
    const Params p = random_params(c);
    Batch b = make_batch(c, {0, 11, 18}, 1);
    b.prefix_targets.resize(size_t(c.T));
    int valid = 0;
    for (int t = 0; t < c.T; ++t) {
        const int kind = t % 4;  // -1, past V, then two valid ones
        b.prefix_targets[size_t(t)] = kind == 0 ? -1 : kind == 1 ? c.V + t : test::randint(0, c.V - 1);
        valid += kind >= 2;
    }
    Tape tp;
    const double loss = forward(c, p, b, &tp);
    Batch plain = b;
    plain.prefix_targets.clear();
    double want = forward(c, p, plain);
    for (int t = 0; t < c.T; ++t)
        if (t % 4 >= 2)
            want += c.prefix_weight *
                    (tp.lse[size_t(t)] - detail::softcap(tp.logits[size_t(t) * c.V + size_t(b.prefix_targets[size_t(t)])]));
    test::check(std::fabs(loss - want) <= 1e-12 * std::fabs(want) && loss > forward(c, p, plain),
                "prefix loss: %.12g, the MTP loss plus pw (lse - z[P]) over the %d valid rows %.12g", loss, valid, want);
    Params g;
    forward_backward(c, p, b, 1.0, g);
    Params q = p;
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    const int C = c.C, V = c.V;
    std::vector<size_t> head, emb, att;
    for (int i = 0; i < 4; ++i) head.push_back(size_t(rnd(C)) * V + size_t(b.prefix_targets[size_t(4 * rnd(c.T / 4) + 2)]));
    for (int i = 0; i < 2; ++i) emb.push_back(size_t(b.inputs[size_t(rnd(c.T))]) * C + size_t(rnd(C)));
    for (int i = 0; i < 3; ++i) att.push_back(size_t(rnd(10 * 4 * C * C)));
    fd_check(c, q, b, g, {{"lm_head", head}, {"embed", emb}, {"attn_bank", att}});
    std::printf("record 88 prefix loss: %.6f (MTP alone %.6f), %d valid rows of %d\n", loss, forward(c, p, plain), valid, c.T);
}

// ---- records 85-86's MUDD gate and DC-MHA ----
// Record 84's MUDD configuration (record 80's stream, h7 the late source, the signed bigram, here full width as record
// 86's) with the gate at 6 heads of 8 (C = 48), XSA on its layers 1, 3, 4, 7 and DC-MHA with a window of 6 keys (upstream
// 112; the documents of 11-14 tokens make it bite).
Config gate_small_config() {
    Config c = Config::make(32, 256, 48, 6, 8, 97, 8, 11);
    c.mtp_weights = {1.0, 0.5, 0.25};
    c.fp8 = false;
    c.yarn_apply(7, 11);
    c.sublayer_lambdas = true;
    c.late_attn_source = 7;
    c.lambdas_bf16 = false;
    c.value_layers = {1, 2, 8, 9, 10};
    c.ve_gate_reads_ve = c.paired_ve_gate_reads_ve = true;
    c.bigram_sign_rows = 5;
    c.bigram_sign_table = c.random_sign_table(test::rng()());
    c.mudd = c.mudd_gate = c.dc_mha = true;
    c.dc_window = 6;
    for (int i : {1, 3, 4, 7}) c.xsa[size_t(i)] = true;
    return c;
}
// Upstream's init, perturbed, with MUDD's and the gate's second layers and biases random (at init w2 = 0 makes every
// column a constant and leaves w1 without gradient): columns of order 0.3-1 that vary from token to token.
Params gate_random_params(const Config& c) {
    Params p = random_params(c);
    for (double& e : p.bigram_embed) e = test::uniform(-1.0, 1.0);
    const double w1 = 1.0 / std::sqrt(double(c.C));
    for (std::vector<double>* t : {&p.mudd_w1, &p.mudd_gate_w1})
        for (double& w : *t) w = test::uniform(-w1, w1);
    for (double& w : p.mudd_w2) w = test::uniform(-1.0, 1.0);
    for (double& b : p.mudd_b2) b = test::uniform(-3.0, 3.0);
    for (double& w : p.mudd_gate_w2) w = test::uniform(-1.0, 1.0);
    for (double& b : p.mudd_gate_b2) b = test::uniform(-6.0, 6.0);
    p.mudd_gate_scale[0] = test::uniform(0.08, 0.15);
    return p;
}

// Layout, init and refusals: the five tensors the gate replaces are gone, its four have upstream's shapes, b2 starts
// at upstream's columns; configurations the reference does not implement stop with a message.
void check_gate_layout() {
    const Config c = gate_small_config();
    const Params p = Params::init(c, 5);
    const std::vector<size_t> n = Params::sizes(c);
    const auto t = p.tensors();
    bool gone = p.attn_gate_bank.empty() && p.skip_gate.empty() && p.x0_lambdas.empty() && p.bigram_lambdas.empty() &&
                p.xsa_alphas.empty();
    test::check(gone && t.size() == 23 && std::string(t[19].first) == "mudd_gate_w1" && n[19] == 2 * 64 * 48 &&
                    n[20] == 2 * 41 * 64 && n[21] == 2 * 41 && n[22] == 1 && p.mudd_gate_scale[0] == 0.1,
                "MUDD gate tensors: the five it replaces empty (%d), w1 (2, 64, C), w2 (2, 41, 64), b2 (2, 41), scale 0.1",
                gone);
    std::vector<double> want(2 * kGateMaxCoefs, 0.0);
    for (int id = 0; id < 2; ++id) {
        for (int j = 12; j < 18; ++j) want[size_t(id * 41 + j)] = 2.5;
        for (int j = 19; j < (id ? 28 : 26); j += 2) want[size_t(id * 41 + j)] = 0.5;
    }
    want[41 + 28] = 5.0;
    for (int j = 29; j < 35; ++j) want[size_t(41 + j)] = 10.0;
    test::check(p.mudd_gate_b2 == want, "MUDD gate init: b2 = upstream's (out 2.5, bigram 0.5, skip 5, DC w1 10)");
    // the columns each layer reads, upstream's literals
    bool cols = gate_cols(0).x0 == 18 && gate_cols(0).bigram == 19 && gate_cols(1).xsa == 0 && gate_cols(3).xsa == 6 &&
                gate_cols(3).out == 12 && gate_cols(3).x0 == 24 && gate_cols(4).gate == 1 && gate_cols(4).xsa == 0 &&
                gate_cols(4).x0 == 18 && gate_cols(5).x0 == 20 && gate_cols(6).x0 == -1 && gate_cols(7).xsa == 6 &&
                gate_cols(7).x0 == 22 && gate_cols(9).bigram == 27 && gate_cols(10).out == 12 && gate_cols(10).x0 == -1;
    test::check(cols, "MUDD gate columns: upstream's unpack_pre_mudd_gate / unpack_post_mudd_gate");
}

// The gate's columns by the formula, token by token (naive sums), XSA and DC-MHA's outputs by theirs on one token each.
void check_gate_forward() {
    const Config c = gate_small_config();
    const Params p = gate_random_params(c);
    const Batch b = make_batch(c, {0, 11, 18}, 1);
    Tape tp;
    forward(c, p, b, &tp);
    const int C = c.C, H = c.H, D = c.D;
    double worst = 0.0;
    for (int id = 0; id < 2; ++id) {
        const std::vector<double>& h = id == 0 ? tp.x0 : tp.layers[kGatePostLayer].x_in;
        test::check(h == tp.layers[3].x_out || id == 0, "the post gate reads layer 4's input, h3");
        for (int t : {0, 13, 31}) {
            std::vector<double> gz(kMuddDim);
            for (int m = 0; m < kMuddDim; ++m) {
                double z = 0.0;
                for (int j = 0; j < C; ++j) z += h[size_t(t * C + j)] * p.mudd_gate_w1[size_t((id * kMuddDim + m) * C + j)];
                gz[size_t(m)] = 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
            }
            for (int j = 0; j < kGateCoefs[id]; ++j) {
                double s = p.mudd_gate_b2[size_t(id * kGateMaxCoefs + j)];
                for (int m = 0; m < kMuddDim; ++m) s += gz[size_t(m)] * p.mudd_gate_w2[size_t((id * kGateMaxCoefs + j) * kMuddDim + m)];
                worst = std::max(worst, std::fabs(s * p.mudd_gate_scale[0] - tp.gate[size_t(id)].coef[size_t(t * kGateCoefs[id] + j)]));
            }
        }
    }
    test::check(worst < 1e-12, "MUDD gate columns by the formula: largest difference %.3g", worst);
    // layer 6: x_in + sigmoid(skip) G1[t, 28] h3
    const double sl = 1.0 / (1.0 + std::exp(-p.scalars[size_t(c.scalar_slots().skip)]));
    double skip_worst = 0.0;
    for (int t = 0; t < c.T; ++t)
        for (int j = 0; j < C; ++j) {
            const size_t e = size_t(t * C + j);
            const double want = tp.layers[6].x_in[e] + sl * tp.gate[1].coef[size_t(t * 41 + 28)] * tp.layers[3].x_out[e];
            skip_worst = std::max(skip_worst, std::fabs(want - tp.layers[6].x_attn[e]));
        }
    test::check(skip_worst < 1e-12, "layer 6's skip by the post gate's column 28: largest difference %.3g", skip_worst);
    // DC on token 15 of the document [11, 18), window 6: keys 10 < s <= 15 -> 11..15 (the document bound bites)
    const LayerTape& L = tp.layers[10];
    const int t = 15;
    double ms = 0.0;
    for (int h = 0; h < H; ++h) ms += std::pow(tp.gate[1].coef[size_t(t * 41 + 29 + h)], 2);
    std::vector<double> A(size_t(c.T), 0.0);
    for (int h = 0; h < H; ++h) {
        const double w1 = tp.gate[1].coef[size_t(t * 41 + 29 + h)] / std::sqrt(ms / H + 1e-6);
        double den = 0.0;
        std::vector<double> e(size_t(c.T), 0.0);
        for (int s = 11; s <= 15; ++s) {
            double d = 0.0;
            for (int k = 0; k < D; ++k) d += L.q[size_t((t * H + h) * D + k)] * L.k[size_t((s * H + h) * D + k)];
            den += (e[size_t(s)] = std::exp(c.yarn.attn_scale * d));
        }
        for (int s = 11; s <= 15; ++s) A[size_t(s)] += w1 * e[size_t(s)] / den;
    }
    double dc_worst = 0.0;
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < D; ++k) {
            double want = L.y[size_t((t * H + h) * D + k)];
            for (int s = 11; s <= 15; ++s)
                want += tp.gate[1].coef[size_t(t * 41 + 35 + h)] * A[size_t(s)] * L.v[size_t((s * H + h) * D + k)];
            dc_worst = std::max(dc_worst, std::fabs(want - L.y_dc[size_t((t * H + h) * D + k)]));
        }
    test::check(dc_worst < 1e-12, "DC-MHA on token 15 by the formula: largest difference %.3g", dc_worst);
    // XSA on layer 4, token 20, head 2: y - tanh(G1[t, 2]) (y . v) / |v|^2 v; layer 10's projection reads y_dc gated
    const LayerTape& X = tp.layers[4];
    const size_t o = size_t((20 * H + 2) * D);
    double yv = 0.0, vv = 0.0, xsa_worst = 0.0;
    for (int k = 0; k < D; ++k) yv += X.y[o + k] * X.v[o + k], vv += X.v[o + k] * X.v[o + k];
    for (int k = 0; k < D; ++k)
        xsa_worst = std::max(xsa_worst, std::fabs(X.y[o + k] - std::tanh(tp.gate[1].coef[size_t(20 * 41 + 2)]) * yv / vv * X.v[o + k] -
                                                  X.yg[o + k]));
    double gate_worst = 0.0;
    for (int k = 0; k < D; ++k)
        gate_worst = std::max(gate_worst, std::fabs(tp.gate[1].coef[size_t(20 * 41 + 12 + 2)] * L.y_dc[size_t((20 * H + 2) * D + k)] -
                                                    L.yg[size_t((20 * H + 2) * D + k)]));
    test::check(xsa_worst < 1e-12 && gate_worst < 1e-12,
                "record 86's XSA (layer 4, ungated) and layer 10's raw output gate on DC's output: %.3g, %.3g", xsa_worst,
                gate_worst);
}

// Every gate path by central differences: both gates' w1, every read row of w2 and b2, the scale, and the tensors
// whose paths the gate changed (layers 1, 3, 4, 7 (XSA), 3 and 10 (output gates), 10 (DC's q, k, v), the bigram rows,
// the skip lambda, value tables 0 and 4); the gate 0's unread rows have exactly zero gradient.
void check_gate_gradients_fd() {
    const auto t0 = std::chrono::steady_clock::now();
    const Config c = gate_small_config();
    Params p = gate_random_params(c);
    const Batch b = make_batch(c, {0, 11, 18}, 2);
    Params g;
    const double loss = forward_backward(c, p, b, 1.0, g);
    const int C = c.C, V = c.V, M = kMuddDim;
    auto rnd = [](int n) { return test::randint(0, n - 1); };
    auto tok = [&] { return size_t(b.inputs[rnd(c.T)]); };
    std::vector<size_t> w1, w2, b2, a, ve, bg;
    for (int id = 0; id < 2; ++id) {
        for (int i = 0; i < 4; ++i) w1.push_back((size_t(id) * M + rnd(M)) * C + rnd(C));
        for (int j = 0; j < kGateCoefs[id]; ++j)
            w2.push_back((size_t(id) * kGateMaxCoefs + j) * M + rnd(M)), b2.push_back(size_t(id) * kGateMaxCoefs + j);
    }
    for (int bank : {1, 3, 4, 6, 9})  // layers 1, 3, 4, 7, 10: q or k or v, and the output projection
        for (int part : {rnd(3), 3}) a.push_back((size_t(bank) * 4 * C + part * C + rnd(C)) * C + rnd(C));
    for (int i = 0; i < 3; ++i) a.push_back((size_t(9) * 4 * C + rnd(2) * C + rnd(C)) * C + rnd(C));  // 10's q, k (DC)
    for (int tbl : {0, 4})
        for (int i = 0; i < 3; ++i) ve.push_back((size_t(tbl) * V + tok()) * C + rnd(C));
    for (int i = 0; i < 4; ++i) bg.push_back(size_t(b.bigram[rnd(c.T)]) * C + rnd(C));
    const ScalarSlots& k = c.scalar_slots();
    Samples samples = {{"mudd_gate_w1", w1},
                       {"mudd_gate_w2", w2},
                       {"mudd_gate_b2", b2},
                       {"attn_bank", a},
                       {"value_embeds", ve},
                       {"bigram_embed", bg},
                       {"resid_lambdas", {size_t(2 * 4), size_t(2 * 6 + 1)}},
                       {"post_lambdas", {size_t(2 * 3), size_t(2 * 7)}},
                       {"scalars", {size_t(k.sa_of(10, 0)), size_t(k.sa_of(10, 1)), size_t(k.smear), size_t(k.skip)}},
                       {"mudd_b2", {0, 8, 11, size_t(kMuddCoefs + 3)}},
                       {"embed", {tok() * C + rnd(C), tok() * C + rnd(C)}}};
    const FdStats fd = fd_check(c, p, b, g, samples);
    // The scale multiplies every column at once, so a step in it moves every MLP pre-activation and central
    // differences keep crossing relu's kink (a 2e-5 stencil error seen); the columns are s (gelu(z) W2^T + b2), linear
    // in (W2, b2) jointly, so Euler's identity gives its gradient exactly: s dL/ds = sum W2 dL/dW2 + sum b2 dL/db2.
    double euler = 0.0;
    for (size_t e = 0; e < p.mudd_gate_w2.size(); ++e) euler += p.mudd_gate_w2[e] * g.mudd_gate_w2[e];
    for (size_t e = 0; e < p.mudd_gate_b2.size(); ++e) euler += p.mudd_gate_b2[e] * g.mudd_gate_b2[e];
    euler /= p.mudd_gate_scale[0];
    test::check(std::fabs(euler - g.mudd_gate_scale[0]) <= 1e-9 * std::fabs(euler),
                "MUDD gate scale's gradient %.12g, by Euler's identity from w2's and b2's %.12g", g.mudd_gate_scale[0], euler);
    std::printf("  mudd_gate_scale: gradient %.10g, Euler's identity %.10g\n", g.mudd_gate_scale[0], euler);
    bool dead = true, live = true;
    for (int j = kGateCoefs[0]; j < kGateMaxCoefs; ++j) {
        dead &= g.mudd_gate_b2[size_t(j)] == 0.0;
        for (int i = 0; i < M; ++i) dead &= g.mudd_gate_w2[size_t(j) * M + i] == 0.0;
    }
    for (int id = 0; id < 2; ++id)
        for (int j = 0; j < kGateCoefs[id]; ++j) live &= g.mudd_gate_b2[size_t(id * kGateMaxCoefs + j)] != 0.0;
    test::check(dead && live, "MUDD gate: gate 0's rows [26, 41) have exactly zero gradient (%d), every read b2 entry a "
                "non-zero one (%d)", dead, live);
    std::printf("records 85-86 MUDD gate and DC-MHA finite differences: loss %.6f, %d forwards (%d step reductions), "
                "%.1f s\n", loss, fd.evaluated, fd.shrunk, seconds_since(t0));
}

// ---- record 84's FP8 MLP up-projection ----
// The loss moves by a small, non-zero relative amount; layer 4's pre is the formula's, recomputed here
// element by element in float where upstream rounds to fp32, and a few percent off the unquantized product
// of the same input; the backward reads the unquantized input and W1 with the FP8 pre; evaluation is
// unquantized.
void check_mlp_fp8() {
    const Config c = r80_small_config();
    Config q = c;
    q.mlp_up_fp8 = true;
    const Params p = random_params(c);
    const Batch b = make_batch(c, {0, 11, 18}, 0);
    Tape tx, tq;
    Params gx, gq;
    const double lx = forward_backward(c, p, b, 1.0, gx, &tx), lq = forward_backward(q, p, b, 1.0, gq, &tq);
    const double rel = std::fabs(lq - lx) / std::fabs(lx);
    test::check(rel > 1e-8 && rel < 1e-2, "FP8 MLP: loss %.10f vs exact %.10f, relative %.3g", lq, lx, rel);

    const int layer = 4;
    const size_t T = c.T, C = c.C, F = c.hidden();
    const LayerTape& L = tq.layers[layer];
    const double* w = p.mlp_bank.data() + size_t(2 * layer) * F * C;
    double wmax = 0.0, xmax = 0.0;
    for (size_t e = 0; e < F * C; ++e) wmax = std::max(wmax, std::fabs(w[e]));
    for (size_t e = 0; e < T * C; ++e) xmax = std::max(xmax, std::fabs(L.xm[e]));
    const double w_s = round_bf16(double(float(round_bf16(wmax)) / 448.0f));
    const double a = round_bf16(xmax);
    const float xs = 448.0f / float(a);
    const double dq = double(float(float(w_s) * float(a)) / 448.0f);
    double worst = 0.0, moved = 0.0, largest_xq = 0.0, pre_scale = 0.0;
    for (size_t t = 0; t < T; ++t)
        for (size_t f = 0; f < F; ++f) {
            double s = 0.0, exact = 0.0;
            for (size_t j = 0; j < C; ++j) {
                const double xq = round_e4m3_satfinite(double(float(L.xm[t * C + j] * double(xs))));
                const double wq = round_e4m3(round_bf16(double(float(w[f * C + j] / w_s))));
                largest_xq = std::max(largest_xq, std::fabs(xq));
                s += xq * wq;
                exact += L.xm[t * C + j] * w[f * C + j];
            }
            const double pre = s * dq;
            pre_scale = std::max(pre_scale, std::fabs(exact));
            worst = std::max(worst, std::fabs(L.pre[t * F + f] - pre) / (1e-300 + std::fabs(pre)));
            moved = std::max(moved, std::fabs(pre - exact));
        }
    test::check(worst < 1e-12 && L.mlp_fp8_a == a && L.mlp_fp8_dequant == dq && largest_xq == 448.0 &&
                    moved > 1e-4 * pre_scale && moved < 0.1 * pre_scale && tx.layers[layer].mlp_fp8_a == 0.0,
                "FP8 MLP layer %d: pre off the recomputation by %.3g (a %.6g, dequant %.6g, largest |xq| %g), off the "
                "exact pre by %.3g of its largest",
                layer, worst, a, dq, largest_xq, moved / pre_scale);

    // the backward: d c_fc = d pre^T xm and d xm = d pre c_fc with xm and c_fc unquantized, d pre from the
    // FP8 pre: layer 4's block backward from a random output gradient, against the formula
    std::vector<double> dout(T * C), dx(T * C, 0.0);
    for (double& e : dout) e = test::normal();
    Params g = Params::zeros(q);
    detail::mlp_block_backward(q, p, layer, L, dout, dx, g);
    const double* proj = w + F * C;
    std::vector<double> dpre(T * F);
    for (size_t t = 0; t < T; ++t)
        for (size_t f = 0; f < F; ++f) {
            double s = 0.0;
            for (size_t j = 0; j < C; ++j) s += dout[t * C + j] * proj[f * C + j];
            const double pre = L.pre[t * F + f];
            dpre[t * F + f] = pre > 0.0 ? 2.0 * pre * s : 0.0;
        }
    double bworst = 0.0, bscale = 0.0;
    for (size_t f = 0; f < F; f += 7)
        for (size_t j = 0; j < C; ++j) {
            double s = 0.0;
            for (size_t t = 0; t < T; ++t) s += dpre[t * F + f] * L.xm[t * C + j];
            bworst = std::max(bworst, std::fabs(g.mlp_bank[size_t(2 * layer) * F * C + f * C + j] - s));
            bscale = std::max(bscale, std::fabs(s));
        }
    test::check(bworst < 1e-12 * bscale, "FP8 MLP backward: d c_fc off d pre(FP8 pre)^T xm (unquantized) by %.3g of %.3g",
                bworst, bscale);
    Config eval = c, eval_q = q;
    eval.training = eval_q.training = false;
    test::check(forward(eval, p, b) == forward(eval_q, p, b), "FP8 MLP: evaluation must stay unquantized");
    std::printf("  FP8 MLP: loss relative change %.3g, layer %d pre moved by %.3g of its largest\n", rel, layer,
                moved / pre_scale);
}

// ---- loss scaling, evaluation loss, MTP decomposition ----
void check_losses() {
    Config c = small_config();
    const Params p = random_params(c);
    Batch b = make_batch(c, {0, 20}, 0);

    // gradients scale with loss_scale
    Params g1, g3;
    forward_backward(c, p, b, 1.0, g1);
    forward_backward(c, p, b, 3.0, g3);
    bool scaled = true;
    for (size_t k = 0; k < g1.tensors().size(); ++k) {
        const auto& a = *g1.tensors()[k].second;
        const auto& s = *g3.tensors()[k].second;
        double mx = 0.0;
        for (double e : s) mx = std::max(mx, std::fabs(e));
        for (size_t i = 0; i < a.size(); ++i) scaled &= std::fabs(3.0 * a[i] - s[i]) <= 1e-12 * mx;
    }
    test::check(scaled, "gradients do not scale with loss_scale");

    // MTP row t = sum_k w_k CE(row t, target t+k): single-target runs with targets shifted by k
    Tape mtp;
    forward(c, p, b, &mtp);
    Config one = c;
    one.mtp_weights = {1.0};
    std::vector<std::vector<double>> ce(3);
    for (int k = 0; k < 3; ++k) {
        Batch shifted = b;
        for (int t = 0; t < c.T; ++t) shifted.targets[t] = b.targets[std::min(t + k, c.T - 1)];
        Tape tk;
        forward(one, p, shifted, &tk);
        ce[k] = tk.row_loss;
    }
    std::vector<double> want(c.T);
    for (int t = 0; t < c.T; ++t) {
        want[t] = ce[0][t];
        if (t + 1 < c.T) want[t] += 0.5 * ce[1][t];
        if (t + 2 < c.T) want[t] += 0.25 * ce[2][t];
    }
    test::check_close("MTP rows = weighted single-target rows", mtp.row_loss, want, 1e-12, 1e-12);
    Config zero_w = one;
    zero_w.mtp_weights = {1.0, 0.0, 0.0};
    test::check(forward(zero_w, p, b) == forward(one, p, b), "zero MTP weights change the loss");

    // evaluation = mean of the single-target training rows (same softcap; exact lm_head)
    Config ev = one;
    ev.training = false;
    ev.fp8 = true;  // ignored outside training
    Params ge, gt;
    const double le = forward_backward(ev, p, b, 1.0, ge);
    const double lt = forward_backward(one, p, b, 1.0 / c.T, gt);
    test::check(std::fabs(le * c.T - lt) <= 1e-12 * std::fabs(lt), "eval loss %.15g * T != training loss %.15g", le, lt);
    for (size_t k = 0; k < ge.tensors().size(); ++k)
        test::check_close(std::string("eval vs training/T gradient ") + ge.tensors()[k].first, *ge.tensors()[k].second,
                          *gt.tensors()[k].second, 1e-14, 1e-9);
    // eval rows are plain cross-entropy of the softcapped logits
    Tape te;
    forward(ev, p, b, &te);
    double maxerr = 0.0;
    for (int t = 0; t < c.T; ++t) {
        double s = 0.0;
        for (int v = 0; v < c.V; ++v) s += std::exp(23.0 / (1.0 + std::exp(-(te.logits[size_t(t) * c.V + v] + 5.0) / 7.5)));
        const double zt = 23.0 / (1.0 + std::exp(-(te.logits[size_t(t) * c.V + b.targets[t]] + 5.0) / 7.5));
        maxerr = std::max(maxerr, std::fabs(std::log(s) - zt - te.row_loss[t]));
    }
    test::check(maxerr < 1e-12, "eval row loss is not log-sum-exp minus the softcapped target logit (err %.3g)", maxerr);
}

// ---- FP8 formats from their bit definitions ----
double decode_e4m3(int code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return std::nan("");
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    return code & 0x80 ? -v : v;
}
double decode_e5m2(int code) {
    const int e = (code >> 2) & 31, m = code & 3;
    if (e == 31) return m == 0 ? (code & 0x80 ? -INFINITY : INFINITY) : std::nan("");
    const double v = e == 0 ? std::ldexp(m, -16) : std::ldexp(1.0 + m / 4.0, e - 15);
    return code & 0x80 ? -v : v;
}

template <class Decode, class Round>
void check_format(const char* name, Decode decode, Round round, int max_code) {
    int bad = 0;
    for (int code = 0; code <= max_code; ++code) {  // codes 0..max_code: the positive finite values, increasing
        const double a = decode(code);
        for (double s : {1.0, -1.0}) bad += round(s * a) != s * a;
        if (code == max_code) break;
        const double b = decode(code + 1), mid = 0.5 * (a + b);
        const double even = (code & 1) ? b : a;  // the mantissa's last bit is the code's
        for (double s : {1.0, -1.0}) {
            bad += round(s * mid) != s * even;
            bad += round(s * std::nextafter(mid, 0.0)) != s * a;
            bad += round(s * std::nextafter(mid, INFINITY)) != s * b;
        }
    }
    test::check(bad == 0, "%s: %d values off the format's round-to-nearest-even", name, bad);
}

void check_fp8() {
    check_format("e4m3fn", decode_e4m3, round_e4m3, 0x7E);
    check_format("e5m2", decode_e5m2, round_e5m2, 0x7B);
    test::check(round_e4m3(464.0) == 448.0 && std::isnan(round_e4m3(464.5)) && std::isnan(round_e4m3(-1e4)),
                "e4m3fn: 464 rounds to 448, above it NaN");
    test::check(round_e5m2(61439.0) == 57344.0 && std::isinf(round_e5m2(61440.0)), "e5m2: 61440 and above overflow");
    test::check(round_e4m3(std::ldexp(1.0, -10)) == 0.0 && round_e4m3(std::ldexp(3.0, -10)) == std::ldexp(1.0, -8),
                "e4m3fn subnormal ties");
    test::check(round_e5m2(1.125) == 1.0 && round_e5m2(1.375) == 1.5 && round_e5m2(std::ldexp(1.5, -16)) == std::ldexp(1.0, -15),
                "e5m2 ties");
    // the saturating e4m3 of upstream's compiled casts (record 84's MLP input): the same nearest-even rounding
    // in range, +-448 beyond it
    check_format("e4m3fn satfinite", decode_e4m3, round_e4m3_satfinite, 0x7E);
    test::check(round_e4m3_satfinite(0.0) == 0.0 && std::signbit(round_e4m3_satfinite(-0.0)) &&
                    round_e4m3_satfinite(448.0) == 448.0 && round_e4m3_satfinite(464.0) == 448.0 &&
                    round_e4m3_satfinite(464.5) == 448.0 && round_e4m3_satfinite(-1e30) == -448.0 &&
                    round_e4m3_satfinite(INFINITY) == 448.0 && std::isnan(round_e4m3_satfinite(std::nan(""))),
                "e4m3fn satfinite: 0, 448, 464 and beyond saturate to +-448, NaN stays NaN");
    const double s9 = std::ldexp(1.0, -9);  // the smallest subnormal
    test::check(round_e4m3_satfinite(s9) == s9 && round_e4m3_satfinite(std::ldexp(1.0, -10)) == 0.0 &&
                    round_e4m3_satfinite(std::nextafter(std::ldexp(1.0, -10), 1.0)) == s9 &&
                    round_e4m3_satfinite(3 * std::ldexp(1.0, -10)) == 2 * s9 &&
                    round_e4m3_satfinite(5 * std::ldexp(1.0, -10)) == 2 * s9 && round_e4m3_satfinite(1.0625) == 1.0 &&
                    round_e4m3_satfinite(1.1875) == 1.25 && round_e4m3_satfinite(-1.0625) == -1.0 &&
                    round_e4m3_satfinite(std::ldexp(0.875, -6)) == std::ldexp(0.875, -6),
                "e4m3fn satfinite: subnormal 2^-9, ties to even (2^-10 -> 0, 3 2^-10 and 5 2^-10 -> 2^-8, 1.0625 -> 1, "
                "1.1875 -> 1.25), the largest subnormal");
    test::check(round_fp32(1.0 + std::ldexp(1.0, -24)) == 1.0 && round_fp32(1.0 + 3 * std::ldexp(1.0, -24)) ==
                                                                         1.0 + std::ldexp(1.0, -22),
                "round_fp32: nearest, ties to even");
}

// ---- the paired-head layout, straight on the attention core ----
// Which (token, head) values of v reach output (t, h): perturb each v entry and look.
std::set<std::pair<int, int>> v_dependence(const AttnShape& s, const std::vector<double>& q, const std::vector<double>& k,
                                           std::vector<double> v, int t, int h) {
    const size_t n = size_t(s.T) * s.H * s.D;
    std::vector<double> y0(n), y1(n), lse(size_t(s.rows()) * s.slots());
    attention_forward(s, q.data(), k.data(), v.data(), y0.data(), lse.data());
    std::set<std::pair<int, int>> dep;
    for (int t2 = 0; t2 < s.T; ++t2)
        for (int h2 = 0; h2 < s.H; ++h2) {
            const size_t o = (size_t(t2) * s.H + h2) * s.D;
            const double orig = v[o];
            v[o] = orig + 1.0;
            attention_forward(s, q.data(), k.data(), v.data(), y1.data(), lse.data());
            v[o] = orig;
            if (y1[(size_t(t) * s.H + h) * s.D] != y0[(size_t(t) * s.H + h) * s.D]) dep.insert({t2, h2});
        }
    return dep;
}

void check_attention_layout() {
    const std::vector<int> cu = {0, 3, 6, 6};
    AttnShape s;
    s.T = 6;
    s.H = 6;
    s.D = 4;
    s.scale = 0.3;
    s.cu_seqlens = &cu;
    const size_t n = size_t(s.T) * s.H * s.D;
    std::vector<double> q(n), k(n), v(n);
    for (size_t i = 0; i < n; ++i) {
        q[i] = test::normal();
        k[i] = test::normal();
        v[i] = test::normal();
    }
    using Dep = std::set<std::pair<int, int>>;
    // paired, H = 6, window 3 rows: token t head h is row 2t + h/3, slot h%3
    s.paired = true;
    s.window = 3;
    test::check(v_dependence(s, q, k, v, 1, 1) == Dep{{0, 1}, {0, 4}, {1, 1}}, "paired: (t1,h1) = row 2 sees rows 0..2 of slot 1");
    test::check(v_dependence(s, q, k, v, 1, 4) == Dep{{0, 1}, {0, 4}, {1, 1}, {1, 4}}, "paired: (t1,h4) = row 3 sees rows 0..3");
    test::check(v_dependence(s, q, k, v, 2, 0) == Dep{{0, 3}, {1, 0}, {1, 3}, {2, 0}}, "paired: (t2,h0) = row 4, window 3 rows");
    test::check(v_dependence(s, q, k, v, 3, 0) == Dep{{3, 0}}, "paired: (t3,h0) starts document 2 (row 6)");
    test::check(v_dependence(s, q, k, v, 4, 5) == Dep{{3, 2}, {3, 5}, {4, 2}, {4, 5}}, "paired: (t4,h5) = row 9 in doc 2");
    // not paired, window 1 token
    s.paired = false;
    s.window = 1;
    test::check(v_dependence(s, q, k, v, 2, 4) == Dep{{1, 4}, {2, 4}}, "plain: (t2,h4) sees tokens 1, 2 of head 4");
    test::check(v_dependence(s, q, k, v, 3, 4) == Dep{{3, 4}}, "plain: (t3,h4) starts a document");
    // window 0: every query sees only itself, so y = v
    for (bool paired : {false, true}) {
        s.paired = paired;
        s.window = 0;
        std::vector<double> y(n), lse(size_t(s.rows()) * s.slots());
        attention_forward(s, q.data(), k.data(), v.data(), y.data(), lse.data());
        test::check_close(paired ? "paired window 0 gives v" : "window 0 gives v", y, v, 1e-15, 1e-14);
    }

    // the attention backward against finite differences of sum(y * R), paired H = 6
    s.paired = true;
    s.window = 5;
    std::vector<double> R(n), y(n), lse(size_t(s.rows()) * s.slots()), dq(n), dk(n), dv(n);
    for (double& r : R) r = test::normal();
    attention_forward(s, q.data(), k.data(), v.data(), y.data(), lse.data());
    attention_backward(s, q.data(), k.data(), v.data(), y.data(), lse.data(), R.data(), dq.data(), dk.data(), dv.data());
    auto objective = [&] {
        std::vector<double> yy(n), ll(lse.size());
        attention_forward(s, q.data(), k.data(), v.data(), yy.data(), ll.data());
        return detail::dot(yy.data(), R.data(), n);
    };
    double worst = 0.0;
    for (int which = 0; which < 3; ++which) {
        std::vector<double>& x = which == 0 ? q : which == 1 ? k : v;
        const std::vector<double>& gx = which == 0 ? dq : which == 1 ? dk : dv;
        for (size_t i = 0; i < n; ++i) {
            const double orig = x[i], h = 1e-4;
            x[i] = orig + h;
            const double fp = objective();
            x[i] = orig - h;
            const double fm = objective();
            x[i] = orig;
            worst = std::max(worst, std::fabs((fp - fm) / (2 * h) - gx[i]) / (1e-6 * std::fabs(gx[i]) + 1e-7));
        }
    }
    test::check(worst <= 1.0, "paired attention backward vs finite differences: %.2f x tolerance", worst);
}

// ---- rotary positions and angles ----
void check_rotary() {
    test::check(rotary_position(true, 5, 1) == 11 && rotary_position(true, 5, 4) == 10 && rotary_position(true, 5, 0) == 10 &&
                    rotary_position(false, 5, 4) == 5,
                "rotary positions: paired head h of token t at 2t + (h & 1), plain at t");
    Yarn y;
    y.reset(16);  // 4 frequencies: 1, 1024^(-1/3), 1024^(-2/3), 1/1024
    test::check(y.freq.size() == 4 && y.freq[0] == 1.0 && std::fabs(y.freq[3] - 1.0 / 1024) < 1e-18 &&
                    std::fabs(y.freq[1] - std::pow(1024.0, -1.0 / 3)) < 1e-15,
                "YaRN base frequencies");
    // unit vector e_{2j}: turns into (cos, -sin) on dims 2j, 2j+1; the upper half stays
    for (int j = 0; j < 4; ++j) {
        std::vector<double> x(16, 0.0);
        x[2 * j] = 1.0;
        rotary_apply(y, 7.0, x.data(), 16);
        const double th = 7.0 * y.freq[j];
        test::check(std::fabs(x[2 * j] - std::cos(th)) < 1e-15 && std::fabs(x[2 * j + 1] + std::sin(th)) < 1e-15,
                    "rotary of e_%d", 2 * j);
        std::vector<double> u(16, 0.0);
        u[8 + 2 * j] = 1.0;
        rotary_apply(y, 7.0, u.data(), 16);
        test::check(u[8 + 2 * j] == 1.0, "rotary moves upper dim %d", 8 + 2 * j);
    }
    // scores depend on relative position only; inverse undoes
    std::vector<double> a(16), b(16);
    for (int i = 0; i < 16; ++i) {
        a[i] = test::normal();
        b[i] = test::normal();
    }
    auto score = [&](double pa, double pb) {
        std::vector<double> ra(a), rb(b);
        rotary_apply(y, pa, ra.data(), 16);
        rotary_apply(y, pb, rb.data(), 16);
        return detail::dot(ra.data(), rb.data(), 16);
    };
    test::check(std::fabs(score(9, 4) - score(105, 100)) < 1e-10, "rotary scores depend on relative position only");
    std::vector<double> r(a);
    rotary_apply(y, 33.0, r.data(), 16);
    rotary_apply(y, 33.0, r.data(), 16, true);
    test::check_close("rotary inverse", r, a, 1e-14, 0.0);

    // YaRN growth 384 -> 896 tokens: the fastest frequency (61 turns over 384 > beta) stays, the
    // slowest (0.06 turns < alpha) scales by 384/896, a middle one blends; scale *= 0.2 ln(896/384) + 1
    Yarn g;
    g.reset(128);
    const double f10 = g.freq[10];
    g.apply(384, 896);
    const double turns = 384 * f10 / (2 * kPi), blend = std::clamp((turns - 1) / 31, 0.0, 1.0);
    test::check(g.freq[0] == 1.0 && std::fabs(g.freq[31] - (1.0 / 1024) * 384 / 896) < 1e-18 &&
                    std::fabs(g.freq[10] - f10 * (384.0 / 896 + blend * (1 - 384.0 / 896))) < 1e-16 && blend > 0 && blend < 1,
                "YaRN frequency update");
    test::check(std::fabs(g.attn_scale - 0.1 * (0.2 * std::log(896.0 / 384) + 1)) < 1e-16, "YaRN softmax scale update");
}

// ---- document isolation, and what crosses documents by design ----
bool rows_equal(const std::vector<double>& a, const std::vector<double>& b, int lo, int hi) {
    for (int t = lo; t < hi; ++t)
        if (a[t] != b[t]) return false;
    return true;
}
bool rows_differ_somewhere(const std::vector<double>& a, const std::vector<double>& b, int lo, int hi) {
    return !rows_equal(a, b, lo, hi);
}

void check_documents() {
    Config c = small_config();
    Params p = random_params(c);
    const Batch b = make_batch(c, {0, 13, 30}, 1);  // documents [0,13) [13,30) [30,48)
    auto rows = [&](const Config& cc, const Params& pp, const Batch& bb) {
        Tape tp;
        forward(cc, pp, bb, &tp);
        return tp.row_loss;
    };
    auto changed = [&](const Batch& from, int pos, bool rehash) {
        Batch x = from;
        x.inputs[pos] = (x.inputs[pos] + 1 + test::randint(0, c.V - 2)) % c.V;
        if (rehash) x.bigram = bigram_hash(x.inputs, c.bigram_vocab);
        return x;
    };

    // a token inside document 2: earlier rows untouched, later rows of document 2 move, document 3
    // moves only through the key offset (layers 3 and 10 read the previous token's key across the bound)
    const Batch inner = changed(b, 20, true);
    for (bool ko : {false, true}) {
        Config cc = c;
        cc.key_offset = ko;
        const auto r0 = rows(cc, p, b), r1 = rows(cc, p, inner);
        test::check(rows_equal(r0, r1, 0, 20), "key_offset=%d: rows before the change moved", ko);
        test::check(rows_differ_somewhere(r0, r1, 20, 30), "key_offset=%d: document 2 did not move", ko);
        if (ko) test::check(rows_differ_somewhere(r0, r1, 30, 48), "key offset does not carry document 2 into document 3");
        else test::check(rows_equal(r0, r1, 30, 48), "without key offset document 3 still moved");
    }

    // the last token of document 2, key offset off: document 3's first token reads it through the
    // smear (embedding of the previous token) and the bigram hash (previous token id)
    Config nk = c;
    nk.key_offset = false;
    Params no_smear = p;
    no_smear.scalars[kScalarSmear] = 0.0;
    // a new token 29 whose bigram hash at 30 changes: a random one may keep it (the test's bigram table
    // is small), which would leave the hash nothing to carry across the bound
    Batch last_keep_hash, last_rehash;
    for (int draw = 0; draw < 64; ++draw) {
        last_keep_hash = changed(b, 29, false);
        last_rehash = last_keep_hash;
        last_rehash.bigram = bigram_hash(last_rehash.inputs, c.bigram_vocab);
        if (last_rehash.bigram[30] != b.bigram[30]) break;
    }
    test::check(last_rehash.bigram[30] != b.bigram[30], "test setup: the hash at 30 should change");
    {
        const auto r0 = rows(nk, p, b), r1 = rows(nk, p, last_keep_hash);
        test::check(rows_equal(r0, r1, 0, 29), "last token: earlier rows moved");
        test::check(rows_differ_somewhere(r0, r1, 30, 48), "smear does not carry across the document bound");
    }
    {
        const auto r0 = rows(nk, no_smear, b), r1 = rows(nk, no_smear, last_keep_hash);
        test::check(rows_equal(r0, r1, 30, 48), "without smear or key offset, document 3 moved");
        const auto r2 = rows(nk, no_smear, last_rehash);
        test::check(rows_differ_somewhere(r0, r2, 30, 48), "the bigram hash does not carry across the document bound");
        test::check(rows_equal(r0, r2, 0, 29), "bigram hash change moved earlier rows");
    }
    // a bigram id changed only at the start of document 3 leaves documents 1 and 2 exact
    {
        Batch x = b;
        x.bigram[30] = (x.bigram[30] + 1) % c.bigram_vocab;
        const auto r0 = rows(c, p, b), r1 = rows(c, p, x);
        test::check(rows_equal(r0, r1, 0, 30) && rows_differ_somewhere(r0, r1, 30, 48), "bigram at 30: documents 1-2 moved");
    }
    // cu_seqlens padding entries change nothing
    {
        Batch x = b;
        x.cu_seqlens.push_back(c.T);
        x.cu_seqlens.push_back(c.T);
        test::check(rows(c, p, b) == rows(c, p, x), "extra cu_seqlens padding changed the result");
    }
}

// ---- windows and pairing at the model level ----
void check_windows_and_pairing() {
    const Config c = small_config();
    const Params p = random_params(c);
    const Batch b = make_batch(c, {0, 11, 29}, 0);  // longest document 19 tokens = 38 paired rows
    auto rows = [&](const Config& cc) {
        Tape tp;
        forward(cc, p, b, &tp);
        return tp.row_loss;
    };
    Config wide = c, wider = c;
    wide.window_short = 40;
    wide.window_long = 41;
    wider.window_short = 1000;
    wider.window_long = 2000;
    test::check(rows(wide) == rows(wider), "windows wider than every document differ from plain causal attention");
    test::check(rows(c) != rows(wide), "a biting window changes nothing");

    Config flipped = c;
    flipped.paired[2] = false;
    test::check(rows(c) != rows(flipped), "pairing layer 2 changes nothing");

    // key-offset layers are those whose window equals the long one (upstream's b == ws_long)
    Config same = c;
    same.window_short = same.window_long = 11;
    test::check(c.has_key_offset(3) && c.has_key_offset(10) && !c.has_key_offset(1) && !c.has_key_offset(0),
                "key offset on layers 3 and 10 only");
    test::check(same.has_key_offset(1) && same.has_key_offset(4) && !same.has_key_offset(0) && !same.has_key_offset(6),
                "equal windows: key offset on every non-paired attention layer");
    test::check(attn_bank_index(5) == 5 && attn_bank_index(6) == -1 && attn_bank_index(7) == 6 && attn_bank_index(10) == 9,
                "attention bank indexes skip layer 6");
    test::check(value_table(0) == 0 && value_table(1) == 1 && value_table(2) == -1 && value_table(7) == -1 &&
                    value_table(8) == 2 && value_table(10) == 4,
                "value-embedding tables on layers 0, 1, 8, 9, 10");
}

// ---- upstream's initialization ----
void check_init() {
    const Config c = Config::make(16, 512, 128, 2, 64, 50, 128, 384);
    const Params p = Params::init(c, 1234);
    bool ok = p.scalars.size() == 51;
    for (int i = 0; i < kLayers; ++i)
        ok &= p.scalars[i] == 1.1 && p.scalars[11 + 2 * i] == 0.5 && p.scalars[12 + 2 * i] == 1.0 && p.scalars[33 + i] == 0.1;
    ok &= p.scalars[44] == 0.0 && p.scalars[45] == 0.5 && p.scalars[46] == -1.5;
    for (int i = 47; i < 51; ++i) ok &= p.scalars[i] == 1.0;
    test::check(ok, "scalars: resid 1.1, sa (0.5, 1), bigram 0.1, smear 0, backout 0.5, skip -1.5, padding 1");
    bool tied = true;
    for (int v = 0; v < c.V; ++v)
        for (int k = 0; k < c.C; ++k) tied &= p.embed[size_t(v) * c.C + k] == p.lm_head[size_t(k) * c.V + v];
    test::check(tied, "embed is lm_head transposed");
    double ss = 0;
    for (double w : p.lm_head) ss += w * w;
    const double std_lm = std::sqrt(ss / p.lm_head.size());
    test::check(std::fabs(std_lm / 0.005 - 1) < 0.02, "lm_head std %.5f, want 0.005", std_lm);
    const double bound = std::sqrt(3.0) * 0.5 / std::sqrt(128.0);
    double amax = 0, fmax = 0, pmax = 0;
    for (double w : p.attn_bank) amax = std::max(amax, std::fabs(w));
    const size_t mat = size_t(4) * 128 * 128;
    for (int l = 0; l < kMlpBankLayers; ++l)
        for (size_t e = 0; e < mat; ++e) {
            fmax = std::max(fmax, std::fabs(p.mlp_bank[2 * l * mat + e]));
            pmax = std::max(pmax, std::fabs(p.mlp_bank[(2 * l + 1) * mat + e]));
        }
    test::check(amax <= bound && amax > 0.99 * bound && fmax <= bound && fmax > 0.99 * bound && pmax == 0.0,
                "attn and c_fc uniform(+-%.5f) (max %.5f, %.5f), c_proj zero (%g)", bound, amax, fmax, pmax);
    bool zeros = true;
    for (auto* t : {&p.bigram_embed, &p.value_embeds, &p.attn_gate_bank, &p.ve_gate_bank, &p.smear_gate, &p.skip_gate,
                    &p.x0_lambdas})
        for (double w : *t) zeros &= w == 0.0;
    test::check(zeros, "bigram, value embeddings, gates and x0 lambdas start at zero");
    // at init (c_proj = 0, zero gates and embeddings) a forward runs and gives a finite loss near ln V-ish
    Config cc = c;
    const Batch b = make_batch(cc, {0, 7}, 0);
    const double loss = forward(cc, p, b);
    test::check(std::isfinite(loss) && loss > 0, "init loss %g", loss);
}

// ---- the FP8 path at the tiny preset's shape, against the exact lm_head ----
double cosine(const std::vector<double>& a, const std::vector<double>& b) {
    const double ab = detail::dot(a.data(), b.data(), a.size()), aa = detail::dot(a.data(), a.data(), a.size()),
                 bb = detail::dot(b.data(), b.data(), b.size());
    return ab / std::sqrt(aa * bb);
}

void check_fp8_tiny() {
    Config c = Config::make(128, 50304, 128, 2, 64, 3001, 128, 384);
    c.mtp_weights = {1.0, 0.5, 0.25};
    c.yarn_apply(128, 384);
    Params p = Params::init(c, test::rng()());
    perturb(p, test::rng()(), 0.02);
    const Batch b = make_batch(c, {0, 70, 71, 100}, 3);
    Params g8, gx;
    auto t0 = std::chrono::steady_clock::now();
    Tape tape;
    const double l8 = forward_backward(c, p, b, c.grad_scale, g8, &tape);
    const double t_fp8 = seconds_since(t0);
    Config exact = c;
    exact.fp8 = false;
    Tape exact_tape;
    const double lx = forward_backward(exact, p, b, c.grad_scale, gx, &exact_tape);
    std::printf("tiny preset (T=%d, C=%d, V=%d): forward+backward %.2f s; loss fp8 %.6f, exact %.6f\n", c.T, c.C, c.V, t_fp8,
                l8, lx);
    test::check(std::fabs(l8 - lx) < 1e-3 * std::fabs(lx), "FP8 loss %.8g far from exact %.8g", l8, lx);
    // the quantized operands are on their grids
    bool on_grid = true;
    for (size_t e = 0; e < tape.xq.size(); e += 97) on_grid &= round_e4m3(tape.xq[e] / c.x_s) * c.x_s == tape.xq[e];
    for (size_t e = 0; e < tape.wq.size(); e += 997) on_grid &= round_e4m3(tape.wq[e] / c.w_s) * c.w_s == tape.wq[e];
    test::check(on_grid && tape.xq.size() == size_t(c.T) * c.C && tape.wq.size() == size_t(c.C) * c.V,
                "FP8 operands off the e4m3 grid");
    // gradients agree in direction (e5m2 keeps 2 mantissa bits: ~10% per element, averaged over rows)
    for (size_t k = 0; k < g8.tensors().size(); ++k) {
        const char* name = g8.tensors()[k].first;
        const auto& a = *g8.tensors()[k].second;
        const auto& e = *gx.tensors()[k].second;
        if (e.empty() || &e == &gx.scalars || &e == &gx.x0_lambdas) continue;  // below (empty: record 80's lambdas)
        const double cs = cosine(a, e);
        test::check(cs > 0.99, "FP8 vs exact gradient of %s: cosine %.5f", name, cs);
    }
    // The lambdas' gradients are sums of products that cancel (Tape::scalar_scales): each within a
    // fraction of the root-sum-square of its products: over 9 seeds the largest was 0.23 of it, while
    // the gradients themselves are 0.01-4 of it.
    const double worst = test::check_within_scale("FP8 vs exact lambda gradients (scalars, then x0_lambdas)",
                                                  lambda_gradients(g8), lambda_gradients(gx),
                                                  lambda_error_scales(exact_tape), 0.6);
    std::printf("  FP8 vs exact lambda gradients: largest difference %.3f of the scale\n", worst);
    std::printf("  cosine fp8/exact: lm_head %.5f, attn_bank %.5f, scalars %.5f\n", cosine(g8.lm_head, gx.lm_head),
                cosine(g8.attn_bank, gx.attn_bank), cosine(g8.scalars, gx.scalars));
}

// ---- bad input: a clear message and a non-zero exit ----
// f() must exit non-zero; with `message`, its stderr must contain it (the child's stderr is passed on as well).
template <class F>
void expect_exit_failure(const char* what, F f, const char* message = nullptr) {
    std::fflush(stdout);
    std::fflush(stderr);
    int fd[2];
    test::check(pipe(fd) == 0, "%s: a pipe for the child's stderr", what);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], STDERR_FILENO);
        f();
        _exit(0);
    }
    close(fd[1]);
    std::string err;
    char buf[512];
    for (ssize_t n; (n = read(fd[0], buf, sizeof buf)) > 0;) err.append(buf, size_t(n));
    close(fd[0]);
    std::fputs(err.c_str(), stderr);
    int status = 0;
    waitpid(pid, &status, 0);
    test::check(WIFEXITED(status) && WEXITSTATUS(status) != 0, "%s: expected a clear error and a non-zero exit", what);
    if (message) test::check(err.find(message) != std::string::npos, "%s: the message says \"%s\"", what, message);
}

void check_bad_input() {
    std::printf("(the next error messages are expected)\n");
    const Config c = small_config();
    const Params p = Params::init(c, 1);
    const Batch b = make_batch(c, {0, 10}, 0);
    expect_exit_failure("C != H*D", [&] {
        Config x = c;
        x.C = 60;
        forward(x, p, b);
    });
    expect_exit_failure("odd head count with paired layers", [&] {
        Config x = Config::make(8, 64, 96, 3, 32, 10, 4, 8);
        x.validate();
    });
    expect_exit_failure("target out of range", [&] {
        Batch x = b;
        x.targets[3] = c.V;
        forward(c, p, x);
    });
    expect_exit_failure("cu_seqlens not ending at T", [&] {
        Batch x = b;
        x.cu_seqlens.back() = c.T - 1;
        forward(c, p, x);
    });
    expect_exit_failure("parameter of the wrong size", [&] {
        Params x = p;
        x.ve_gate_bank.pop_back();
        forward(c, x, b);
    });
    expect_exit_failure("YaRN state of another head_dim", [&] {
        Config x = c;
        x.yarn.reset(64);
        forward(x, p, b);
    });
    expect_exit_failure("paired attention with an odd head count", [&] {
        const std::vector<int> cu = {0, 4};
        AttnShape s;
        s.T = 4;
        s.H = 3;
        s.D = 4;
        s.paired = true;
        s.cu_seqlens = &cu;
        std::vector<double> x(48), y(48), lse(12);
        attention_forward(s, x.data(), x.data(), x.data(), y.data(), lse.data());
    });
    expect_exit_failure("a late attention source without record 80's stream", [&] {
        Config x = c;
        x.late_attn_source = 7;
        forward(x, p, b);
    });
    expect_exit_failure("a late attention source that no layer follows", [&] {
        Config x = c;
        x.sublayer_lambdas = true;
        x.late_attn_source = kLayers - 1;
        x.validate();
    });
    expect_exit_failure("record 71's parameters in record 80's stream", [&] {
        Config x = c;
        x.sublayer_lambdas = true;
        forward(x, p, b);
    });
    expect_exit_failure("XSA on a paired layer", [&] {
        Config x = c;
        x.xsa[2] = true;
        x.validate();
    });
    expect_exit_failure("XSA on the layer without attention", [&] {
        Config x = c;
        x.xsa[6] = true;
        x.validate();
    });
    expect_exit_failure("XSA without its strengths", [&] {
        Config x = c;
        x.xsa[1] = true;
        forward(x, p, b);
    });
    expect_exit_failure("a narrow bigram without record 80's stream", [&] {
        Config x = c;
        x.bigram_dim = 32;
        x.validate();
    });
    expect_exit_failure("a bigram wider than the model", [&] {
        Config x = c;
        x.sublayer_lambdas = true;
        x.bigram_dim = c.C + 8;
        x.validate();
    });
    expect_exit_failure("a negative bigram width", [&] {
        Config x = c;
        x.sublayer_lambdas = true;
        x.bigram_dim = -8;
        x.validate();
    });
    expect_exit_failure("sign rows without their table", [&] {
        Config x = c;
        x.bigram_sign_rows = 5;
        x.validate();
    });
    expect_exit_failure("a sign table of full width for a narrow bigram", [&] {
        Config x = c;
        x.sublayer_lambdas = true;
        x.bigram_sign_rows = 5;
        x.bigram_sign_table.assign(size_t(5) * c.C, 1.0);
        x.bigram_dim = 32;
        x.validate();
    });
    expect_exit_failure("a sign table entry that is not +-1", [&] {
        Config x = c;
        x.bigram_sign_rows = 5;
        x.bigram_sign_table = x.random_sign_table(3);
        x.bigram_sign_table[17] = 0.5;
        x.validate();
    });
    expect_exit_failure("negative sign rows", [&] {
        Config x = c;
        x.bigram_sign_rows = -1;
        x.validate();
    });
    expect_exit_failure("x0 aliasing without record 80's stream", [&] {
        Config x = c;
        x.x0_includes_bigram = true;
        x.validate();
    });
    expect_exit_failure("full-width bigram rows for a narrow bigram", [&] {
        Config x = r80_small_config();
        const Params q = Params::init(x, 1);
        x.bigram_dim = 32;
        forward(x, q, make_batch(x, {0, 10}, 0));
    });
    expect_exit_failure("sign rows of an empty table", [] { bigram_sign_index({1, 2, 3}, 0); });
    expect_exit_failure("MUDD without record 80's stream", [&] {
        Config x = c;
        x.mudd = true;
        x.validate();
    });
    expect_exit_failure("MUDD with an odd head count", [&] {
        Config x = Config::make(8, 64, 96, 3, 32, 10, 4, 8);
        x.paired = {};
        x.sublayer_lambdas = true;
        x.mudd = true;
        x.validate();
    });
    expect_exit_failure("MUDD without a value table on layer 10", [&] {
        Config x = r80_small_config();
        x.value_layers = {0, 1, 2, 8, 9};
        x.mudd = true;
        x.validate();
    });
    expect_exit_failure("record 80's parameters (no MUDD tensors, 32 scalars) under MUDD", [&] {
        Config x = r80_small_config();
        const Params q = Params::init(x, 1);
        x.mudd = true;
        forward(x, q, make_batch(x, {0, 10}, 0));
    });
    // records 85-86 and 88's switches, each refused with its message
    struct BadSwitch {
        const char* what;
        void (*edit)(Config&);
        const char* message;
    };
    const BadSwitch bad_switches[] = {
        {"the MUDD gate without MUDD", [](Config& x) { x.mudd = false; }, "mudd_gate needs mudd"},
        {"the MUDD gate on the aliased x0", [](Config& x) { x.x0_includes_bigram = true; }, "mudd_gate reads the clean x0"},
        {"the MUDD gate without XSA on layer 7", [](Config& x) { x.xsa[7] = false; },
         "XSA on exactly layers 1, 3, 4, 7 (layer 7 differs)"},
        {"DC-MHA without the MUDD gate", [](Config& x) { x.mudd_gate = false; }, "dc_mha needs mudd_gate"},
        {"DC-MHA over a window of 0 keys", [](Config& x) { x.dc_window = 0; }, "dc_window 0 must be at least 1"},
    };
    for (const BadSwitch& b : bad_switches)
        expect_exit_failure(b.what, [&b] {
            Config x = gate_small_config();
            b.edit(x);
            x.validate();
        }, b.message);
    expect_exit_failure("prefix targets not one per row", [&] {
        Batch x = b;
        x.prefix_targets = {1, 2, 3};
        x.validate(c);
    }, "prefix targets, want 0 or T");
    expect_exit_failure("YaRN apply with a zero window", [&] {
        Config x = c;
        x.yarn_apply(0, 10);
    });
}

}  // namespace

int main() {
    test::seed();
    const auto t0 = std::chrono::steady_clock::now();
    check_bad_input();
    check_fp8();
    check_rotary();
    check_attention_layout();
    check_init();
    check_losses();
    check_documents();
    check_windows_and_pairing();
    check_gradients_fd();
    const auto t80 = std::chrono::steady_clock::now();
    check_r80_layout();
    check_r80_stream();
    check_r80_lambdas_bf16();
    check_r80_error_scales();
    check_r80_gradients_fd();
    std::printf("record 80's checks: %.1f s\n", seconds_since(t80));
    const auto t82 = std::chrono::steady_clock::now();
    check_xsa_row();
    check_xsa_layout();
    check_xsa_forward();
    check_xsa_gradients_fd();
    std::printf("record 82's XSA checks: %.1f s\n", seconds_since(t82));
    const auto t84 = std::chrono::steady_clock::now();
    check_bigram_signs();
    check_bigram_forward();
    check_bigram_gradients_fd(false);
    check_bigram_gradients_fd(true);
    std::printf("records 83/84's bigram checks: %.1f s\n", seconds_since(t84));
    const auto t81 = std::chrono::steady_clock::now();
    check_mudd_layout();
    check_mudd_forward();
    check_mudd_gradients_fd(false);
    check_mudd_gradients_fd(true);
    check_mudd_error_scales();
    check_mlp_fp8();
    std::printf("record 81's MUDD and record 84's FP8 MLP checks: %.1f s\n", seconds_since(t81));
    const auto t86 = std::chrono::steady_clock::now();
    check_prefix_loss();
    check_gate_layout();
    check_gate_forward();
    check_gate_gradients_fd();
    std::printf("records 85-86's MUDD gate and DC-MHA, record 88's prefix loss checks: %.1f s\n", seconds_since(t86));
    check_fp8_tiny();
    std::printf("total %.1f s\n", seconds_since(t0));
    return test::finish();
}
