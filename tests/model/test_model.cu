// The assembled model (train_gpt.cu) at the tiny preset: the LR and momentum schedules, the memory
// plan, the loss an untrained model must give, bad input, and the loss and every parameter's gradient
// against the independent double-precision reference (tests/reference/gpt_reference.h) on a Tiny Shakespeare batch.
#include "../trainer_under_test.h"
#include "../reference/gpt_reference.h"
#include "../test_util.h"

#include "../../data/bigram.h"

#include <chrono>

constexpr int kDataVocab = 50257;  // GPT-2's tokens, those of the Tiny Shakespeare shards

std::vector<float> download_f(const float* p, size_t n) {
    std::vector<float> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}
std::vector<float> download_bf16(const bf16* p, size_t n) {
    std::vector<bf16> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
    return f;
}

// The device parameters in the reference's shapes (bf16 and fp32 values exactly), and back. A tensor is
// its pieces in the reference's order (elements; 0: the whole reference tensor): the reference's
// attn_bank, [Wq; Wk; Wv; Wo] per attention layer, is each layer's [Wq; Wk] and [Wv; Wo], which record
// 80's head-pair banks keep in two banks.
struct DeviceTensor {
    std::vector<std::pair<void*, size_t>> pieces;
    bool bf16;
};
std::vector<DeviceTensor> device_tensors(const Config& c, const Params& p) {  // in ref::Params order
    const size_t CC = size_t(c.model_dim) * c.model_dim;
    DeviceTensor attn{{}, true};
    for (int l = 0; l < c.structure.layers; ++l)
        if (c.structure.has_attention(l)) attn.pieces.insert(attn.pieces.end(), {{p.wqk(c, l), 2 * CC}, {p.wv(c, l), 2 * CC}});
    auto whole = [](void* d, bool bf16) { return DeviceTensor{{{d, 0}}, bf16}; };
    return {whole(p.embed, true),          whole(p.lm_head, true),       whole(p.bigram_embed, true),
            whole(p.value_embeds, true),   attn,                         whole(p.mlp_bank, true),
            whole(p.attn_gate_bank, true), whole(p.ve_gate_bank, true),  whole(p.smear_gate, true),
            whole(p.skip_gate, true),      whole(p.x0_lambdas, false),   whole(p.scalars, false),
            // record 80's residual stream (null and empty without it)
            whole(p.resid_lambdas, false), whole(p.post_lambdas, false), whole(p.bigram_lambdas, false),
            // record 82's XSA strengths (null and empty without it)
            whole(p.xsa_alphas, false),
            // record 81's MUDD (null and empty without it)
            whole(p.mudd_w1, true), whole(p.mudd_w2, true), whole(p.mudd_b2, true),
            // record 85's MUDD gate (null and empty without it; its records have no attn_gate_bank, skip_gate,
            // x0_lambdas, bigram_lambdas or xsa_alphas, null here and empty in the reference)
            whole(p.mudd_gate_w1, true), whole(p.mudd_gate_w2, true), whole(p.mudd_gate_b2, true),
            whole(p.mudd_gate_scale, false)};
}
// Calls f(device pointer, host offset, elements) for each piece of device tensor d over host tensor h.
template <class F>
void for_pieces(const DeviceTensor& d, const std::vector<double>& h, F f) {
    size_t at = 0;
    for (auto [ptr, n] : d.pieces) {
        const size_t count = n ? n : h.size();
        f(ptr, at, count);
        at += count;
    }
    test::check(at == h.size(), "device pieces cover %zu of the reference tensor's %zu elements", at, h.size());
}
ref::Params download_params(const Config& c, const Params& p, const ref::Config& rc) {
    ref::Params out = ref::Params::zeros(rc);
    auto dev = device_tensors(c, p);
    auto host = out.tensors();
    for (size_t i = 0; i < dev.size(); ++i) {
        std::vector<double>& h = *host[i].second;
        if (h.empty()) continue;
        for_pieces(dev[i], h, [&](void* d, size_t at, size_t n) {
            const std::vector<float> f = dev[i].bf16 ? download_bf16(static_cast<const bf16*>(d), n)
                                                     : download_f(static_cast<const float*>(d), n);
            std::copy(f.begin(), f.end(), h.begin() + at);
        });
    }
    return out;
}
// Uploads q (rounding to each tensor's dtype) and rounds q in place to what the device holds.
void upload_params(const Config& c, const Params& p, ref::Params& q) {
    auto dev = device_tensors(c, p);
    auto host = q.tensors();
    for (size_t i = 0; i < dev.size(); ++i) {
        std::vector<double>& h = *host[i].second;
        if (h.empty()) continue;
        for_pieces(dev[i], h, [&](void* d, size_t at, size_t n) {
            if (dev[i].bf16) {
                std::vector<bf16> b(n);
                for (size_t e = 0; e < n; ++e) {
                    b[e] = __float2bfloat16(static_cast<float>(h[at + e]));
                    h[at + e] = __bfloat162float(b[e]);
                }
                CUDA_CHECK(cudaMemcpy(d, b.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
            } else {
                std::vector<float> f(h.begin() + at, h.begin() + at + n);
                for (size_t e = 0; e < n; ++e) h[at + e] = f[e];
                CUDA_CHECK(cudaMemcpy(d, f.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            }
        });
    }
}

double norm2(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s);
}

// The CUDA model and the reference, from the same (perturbed, non-trivial) parameters, on a Tiny
// Shakespeare micro-batch: the training loss and every parameter's gradient.
void compare_with_reference(Model& m, const Config& c, cudaStream_t s) {
    const char* repo = std::getenv("REPO");
    const std::string pattern = std::string(repo ? repo : ".") + "/data/tinyshakespeare/tinyshakespeare_train_*.bin";
    const int64_t batch_tokens = c.stages[0].batch_tokens;
    const dataload::MicroBatchShape shape = dataload::micro_batch_shape(batch_tokens, 1, c.grad_accum());
    std::vector<int32_t> inputs(shape.tokens_local), targets(shape.tokens_local), bigram(shape.tokens_local),
        cu(shape.max_num_docs);
    dataload::TrainLoader::Options opt;
    opt.bigram_vocab = c.bigram_vocab;
    dataload::TrainLoader loader(pattern, 0, 1, batch_tokens, c.stages[0].max_seq_len, c.grad_accum(), opt);
    const dataload::BatchBuffers buf{inputs.data(), targets.data(), cu.data(), bigram.data(), shape.tokens_local,
                                     shape.max_num_docs};
    for (int skip = 0; skip < 3; ++skip) loader.next(buf);
    const dataload::Batch got = loader.next(buf);
    const int T = static_cast<int>(got.num_tokens);
    // Three documents, each starting at a BOS: a micro-batch this short is one document of Tiny Shakespeare, and the
    // attention's, DC's and the bigram hash's document bounds are what the comparison must also cross
    const std::vector<int> starts = {0, T * 3 / 8, T * 3 / 4};
    test::check(int(cu.size()) > int(starts.size()) && starts[1] > 0, "room for %zu documents in %d tokens", starts.size(), T);
    std::fill(cu.begin(), cu.end(), T);
    for (size_t d = 0; d < starts.size(); ++d) {
        cu[d] = starts[d];
        inputs[size_t(starts[d])] = dataload::kBosId;
        if (starts[d] > 0) targets[size_t(starts[d] - 1)] = dataload::kBosId;
    }
    const int cu_entries = int(starts.size()) + 1;
    // A vocabulary narrower than the data's (record 86's comparison, sized for its time: its tables are 3x tiny's
    // width): the ids folded into it; the bigram hash remade from the ids as they now are
    if (c.vocab_size < kDataVocab)
        for (int t = 0; t < T; ++t) inputs[size_t(t)] %= c.vocab_size, targets[size_t(t)] %= c.vocab_size;
    dataload::bigram_hash(inputs.data(), bigram.data(), T, c.bigram_vocab);
    std::printf("  a Tiny Shakespeare micro-batch of %d tokens as %zu documents\n", T, starts.size());
    BatchUploader up;
    up.upload(m.batch, c.tokens(), inputs.data(), targets.data(), cu.data(), cu_entries, bigram.data(), T, s);

    // Both sides: stage 2's windows after YaRN's update for the long window (as a schedule does).
    const TrainingStage& st = c.stages[1];
    const int ws_short = st.ws_short * c.block_size, ws_long = st.ws_long * c.block_size;
    const int old_long = c.stages[0].ws_long * c.block_size;
    yarn_rope_reset(m.rope, s);
    yarn_rope_apply(m.rope, old_long, ws_long, s);
    // the MTP weights, then (record 88's prefix-token loss) the prefix weight pw, stage 1's 0.25
    const float w[4] = {1.0f, 0.5f, 0.25f, 0.25f};
    CUDA_CHECK(cudaMemcpy(m.mtp_weights, w, sizeof w, cudaMemcpyHostToDevice));
    StepSchedule step_sch{ws_short, ws_long, m.mtp_weights, 3, {}};
    if (c.prefix_loss) step_sch.prefix = {m.prefix_table, m.mtp_weights + 3, dataload::kPrefixTableRows};

    ref::Config rc = ref::Config::make(T, c.padded_vocab, c.model_dim, c.num_heads, c.head_dim, c.bigram_vocab,
                                       ws_short, ws_long);
    rc.mtp_weights = {1.0, 0.5, 0.25};
    rc.grad_scale = c.grad_scale();
    test::check(c.structure.value_tables() == ref::kValueTables, "the reference holds %d value tables", ref::kValueTables);
    std::copy(c.structure.value_layers.begin(), c.structure.value_layers.end(), rc.value_layers.begin());
    rc.ve_gate_reads_ve = c.structure.ve_gate_reads_ve;
    rc.paired_ve_gate_reads_ve = c.structure.paired_ve_gate_reads_ve;
    rc.sw_over_all_weights = c.loss == SoftcapLoss::tanh_bf16;
    rc.sublayer_lambdas = c.structure.sublayer_lambdas;
    rc.late_attn_source = c.structure.late_attn_source;
    for (const int l : c.structure.xsa_layers) rc.xsa[size_t(l)] = true;
    rc.bigram_dim = c.bigram_dim;  // record 84's narrow bigram, record 83's signs (the model's own table)
    rc.bigram_sign_rows = c.bigram_sign_rows;
    rc.x0_includes_bigram = c.structure.x0_is_stream;
    rc.mudd = c.structure.mudd;
    rc.mlp_up_fp8 = c.mlp_up_fp8;
    // records 85-86: the reference implements upstream's fixed gate layout (6 heads; post gate at layer 4; output gates
    // on 3 and 10; XSA on 1, 3, 4, 7, which rc.xsa carries and the reference checks) and DC-MHA on layer 10 only
    rc.mudd_gate = c.structure.mudd_gate;
    rc.dc_mha = c.structure.dc_layer >= 0;
    if (c.structure.mudd_gate)
        test::check(c.structure.mudd_gate_post_layer == ref::kGatePostLayer &&
                        c.structure.gate_layers == std::vector<int>{3, 10} &&
                        (c.structure.dc_layer == ref::kDcLayer || c.structure.dc_layer < 0),
                    "the reference implements upstream's MUDD gate layout (post gate at 4, output gates 3 and 10, DC on 10)");
    if (m.bigram_signs) {
        const std::vector<float> t = download_bf16(m.bigram_signs, size_t(c.bigram_sign_rows) * c.bigram_width());
        rc.bigram_sign_table.assign(t.begin(), t.end());
    }
    rc.yarn_apply(old_long, ws_long);
    ref::Batch rb;
    rb.inputs.assign(inputs.begin(), inputs.begin() + T);
    rb.targets.assign(targets.begin(), targets.begin() + T);
    rb.bigram.assign(bigram.begin(), bigram.begin() + T);
    rb.cu_seqlens.assign(cu.begin(), cu.begin() + cu_entries);
    if (c.prefix_loss) {  // each row's prefix target, the model's own table at its next token (valid: below V)
        std::vector<int32_t> table(size_t(dataload::kPrefixTableRows));
        CUDA_CHECK(cudaMemcpy(table.data(), m.prefix_table, table.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
        rc.prefix_weight = w[3];
        int valid = 0;
        for (int t = 0; t < T; ++t) {
            rb.prefix_targets.push_back(table[size_t(targets[size_t(t)])]);
            valid += rb.prefix_valid(rc, size_t(t));
        }
        std::printf("  prefix-token loss: weight %.2f, %d of %d rows with a prefix target\n", w[3], valid, T);
    }

    // Upstream's init plus noise, so that every path (c_proj, gates, embeddings) carries gradient.
    ref::Params rp = download_params(c, m.params, rc);
    ref::perturb(rp, test::seed() + 7, 0.02);
    // Record 80: the late layers' attention outputs scaled up, so that their inputs' gradients (which
    // reach layer 7's output through norm(h7)) are a visible share of the gradients below them.
    for (int l = c.structure.late_attn_source + 1; c.structure.late_attn_source >= 0 && l < c.structure.layers; ++l)
        rp.post_lambdas[size_t(2 * l)] = 4.0;
    // The narrow signed bigram: rows and lambdas big enough (rows ~0.5, lambdas 0.3-0.6) that the bigram's share of
    // the stream is visible beside x0's, or a wrong bigram path would hide under the tolerances
    if (c.bigram_dim > 0 || c.bigram_sign_rows > 0) {
        for (double& e : rp.bigram_embed) e *= 25.0;
        for (double& l : rp.bigram_lambdas) l = (test::randint(0, 1) ? 1 : -1) * test::uniform(0.3, 0.6);
    }
    // x0 aliased: the injections' lambdas big enough that x0's readers' gradient, which then reaches the bigram rows
    // and bigram_lambdas[0], is a visible share of theirs
    if (c.structure.x0_is_stream)
        for (double& l : rp.x0_lambdas) l = (test::randint(0, 1) ? 1 : -1) * test::uniform(0.3, 0.6);
    // MUDD: the coefficients' second layer away from its zero start (every coefficient then depends on its stream,
    // and every path of the blocks' backward carries gradient), the biases moved off their init
    for (double& w : rp.mudd_w2) w = test::uniform(-0.08, 0.08);
    for (double& b : rp.mudd_b2) b += test::uniform(-0.5, 0.5);
    // the exit's value-row coefficient (0 at init) at 0.3-0.6, so that value table 0's gradient shows its share
    if (!rp.mudd_b2.empty()) rp.mudd_b2[ref::kMuddCoefs + 3] = (test::randint(0, 1) ? 1 : -1) * test::uniform(3.0, 6.0);
    // XSA: strengths of either sign well away from 0 (tanh(a) of 0.4 to 1.2), so that it changes y visibly
    for (double& a : rp.xsa_alphas) a = (test::randint(0, 1) ? 1 : -1) * test::uniform(0.4, 1.2);
    // The MUDD gate: its second layer away from zero (every column then varies per token and w1 carries gradient), and
    // the columns its init leaves at 0 or small moved off it at either sign, as the lambdas and XSA strengths above:
    // XSA's (G 0.4-1.2), the x0 and bigram injections' and DC's w2 (0.3-0.6); b2 holds G / 0.1
    if (rc.mudd_gate) {
        for (double& w : rp.mudd_gate_w2) w = test::uniform(-0.15, 0.15);
        auto away = [&](int gate, int col, double lo, double hi) {
            rp.mudd_gate_b2[size_t(gate * ref::kGateMaxCoefs + col)] = (test::randint(0, 1) ? 1 : -1) * test::uniform(lo, hi);
        };
        for (int l = 0; l < ref::kLayers; ++l) {
            const ref::GateCols k = ref::gate_cols(l);
            for (int h = 0; k.xsa >= 0 && h < c.num_heads; ++h) away(k.gate, k.xsa + h, 4.0, 12.0);
            if (k.x0 >= 0) away(k.gate, k.x0, 3.0, 6.0), away(k.gate, k.bigram, 3.0, 6.0);
        }
        for (int h = 0; rc.dc_mha && h < c.num_heads; ++h) away(1, ref::kGateDcW2Col + h, 3.0, 6.0);
    }
    upload_params(c, m.params, rp);
    m.lm_head_fp8_stale = true;  // lm_head changed outside the optimizer: its FP8 copies are remade
    m.mlp_fp8_stale = true;      // c_fc's too

    gpt_forward(m, m.batch, step_sch, m.train, s);
    gpt_backward(m, m.batch, step_sch, {false, false}, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    const double loss = download_f(m.loss, 1)[0];
    ref::Params rg;
    ref::Tape tape;
    const double ref_loss = ref::forward_backward(rc, rp, rb, rc.grad_scale, rg, &tape);
    if (c.mlp_up_fp8) {  // record 84's FP8 up-projection: layer 0's pre from the model's own MLP input and c_fc, quantized
        // as upstream quantizes (the reference's detail::mlp_up_fp8_forward). The loss hides a wrong quantization in
        // its tolerance, and e4m3 turns the stream's bf16 noise into percents of pre (1.6% against the reference's own
        // stream); on the same input the only differences are fp32 sums and pre's bf16 rounding.
        const size_t M = size_t(c.mlp_dim), C = size_t(c.model_dim);
        const std::vector<float> pre = download_bf16(m.train.layer[0].pre, size_t(T) * M),
                                 xin = download_bf16(m.train.layer[0].h_mlp, size_t(T) * C),
                                 fc = download_bf16(m.params.c_fc(c, 0), M * C);
        const std::vector<double> xd(xin.begin(), xin.end()), fcd(fc.begin(), fc.end());
        std::vector<double> want(size_t(T) * M), diff(want.size());
        double a = 0, dequant = 0;
        ref::detail::mlp_up_fp8_forward(xd.data(), fcd.data(), size_t(T), M, C, want.data(), &a, &dequant);
        for (size_t e = 0; e < want.size(); ++e) diff[e] = pre[e] - ref::round_bf16(want[e]);  // pre is stored in bf16
        const double rel = norm2(diff) / std::max(norm2(want), 1e-30);
        std::printf("  layer 0's FP8 MLP pre-activation from its own input: relative error %.3e\n", rel);
        test::check(rel < 1e-3, "layer 0's FP8 MLP pre-activation from its own input: relative error %.3e", rel);
    }
    std::printf("loss: model %.6f reference %.6f (relative %.2e)\n", loss, ref_loss, std::fabs(loss - ref_loss) / ref_loss);
    // bf16 activations through 11 layers and an FP8 head: the sum over rows agrees to ~1e-3.
    test::check(std::fabs(loss - ref_loss) <= 5e-3 * ref_loss, "training loss %.6f vs reference %.6f", loss, ref_loss);

    // Tolerances, from the spread seen over many seeds: bf16 activations through 11 layers and the
    // FP8 head's e5m2 gradient put 1-2.5% of error in the big tensors' gradients, with a tail to
    // ~5.5% on about one seed in 30 (TEST_SEED=11474964349816178238: embed 5.3%, lm_head 5.5%, the
    // same before and after the fusions); a wrong gradient is off by O(1). Gradients that are sums
    // over every token of products (12-wide gates) cancel, which raises their error to several percent.
    const ref::Params mg = download_params(c, m.grads, rc);
    auto got_t = mg.tensors();
    auto want_t = rg.tensors();
    for (size_t i = 0; i < got_t.size(); ++i) {
        const std::vector<double>& a = *got_t[i].second;
        const std::vector<double>& b = *want_t[i].second;
        if (b.empty()) continue;  // a tensor of the other residual stream
        std::vector<double> diff(a.size());
        for (size_t e = 0; e < a.size(); ++e) diff[e] = a[e] - b[e];
        const double rel = norm2(diff) / std::max(norm2(b), 1e-30);
        const bool reduced = a.size() <= size_t(c.structure.attn_layers()) * c.num_heads * kGateWidth;
        const bool by_scale = &b == &rg.scalars || &b == &rg.x0_lambdas || &b == &rg.skip_gate || &b == &rg.resid_lambdas ||
                              &b == &rg.post_lambdas || &b == &rg.bigram_lambdas;
        std::printf("  grad %-15s |ref| %.4e  relative error %.3e\n", got_t[i].first, norm2(b), rel);
        // xsa_alphas: each a sum over tokens of -p q that cancels as the gates' sums do, more so with the scaled-up
        // bigram (TEST_SEED=14962909035690948383 under EMU_RANDOM_ORDER=11: 16.8%); a wrong one is off by O(1)
        // (a planted wrong row: 125%)
        // MUDD's blocks: their gradients are sums over tokens of products with each token's coefficient gradients,
        // themselves sums over channels that cancel (6.9% on a passing seed; planted wrong paths: 12-43% here and
        // several tensors above 8%)
        const bool mudd = &b == &rg.mudd_w1 || &b == &rg.mudd_w2 || &b == &rg.mudd_gate_w1 || &b == &rg.mudd_gate_w2;
        // (MUDD's: 14.3% at TEST_SEED=8728976318279275397 under EMU_RANDOM_ORDER=23; a planted missing aux_v 16.7%
        // here and 18-33% in attn_bank and attn_gate_bank.) The FP8 up-projection turns the stream's bf16 noise into
        // e4m3 rounding flips (layer 0's pre 1.6% off the reference's own stream), so every bound doubles there (that
        // seed: value_embeds 8.2%, attn_bank 9.0%); its path is checked bit for bit by the pre-activation check above.
        const double base = &b == &rg.xsa_alphas ? 0.3 : mudd ? 0.25 : reduced ? 0.15 : 0.08;
        const double bound = c.mlp_up_fp8 ? 2 * base : base;
        // mudd_b2: 0.1 times sums over tokens of the coefficients' gradients, which cancel as the lambdas' do (17% at
        // TEST_SEED=9169812687577948472 under EMU_RANDOM_ORDER=23): checked against its scale below
        if (!by_scale && &b != &rg.mudd_b2 && &b != &rg.mudd_gate_b2 && &b != &rg.mudd_gate_scale)
            test::check(rel < bound, "gradient of %s: relative error %.3e", got_t[i].first, rel);
    }
    // Each lambda's gradient is a sum of products d_i x_i of a stream gradient with a stream over
    // T x C, and the sum can cancel almost completely, so a relative check on it is meaningless. The
    // scale of its error is the root-sum-square of the products (the reference's scale): over 30
    // seeds the error stayed below 0.14 of it, while the gradients themselves are 0.1-4 of it.
    // Layer 6's sa lambdas have no products at all and must be exactly zero.
    const double worst = test::check_within_scale("lambda gradients (scalars, x0, resid, post, bigram lambdas)", ref::lambda_gradients(mg),
                                                  ref::lambda_gradients(rg), ref::lambda_error_scales(tape), 0.3);
    std::printf("  lambdas: largest error %.3f of its scale\n", worst);
    if (c.structure.mudd) {
        const double worst_b2 = test::check_within_scale("MUDD's b2 gradient", mg.mudd_b2, rg.mudd_b2, tape.mudd_b2_scales, 0.3);
        std::printf("  mudd_b2: largest error %.3f of its scale\n", worst_b2);
    }
    if (c.structure.mudd_gate) {  // the gate's b2 and scale: sums over tokens of the columns' gradients, as MUDD's b2
        const double worst_gb2 = test::check_within_scale("the MUDD gate's b2 gradient", mg.mudd_gate_b2, rg.mudd_gate_b2,
                                                          tape.mudd_gate_b2_scales, 0.3);
        const double worst_gs = test::check_within_scale("the MUDD gate's scale gradient", mg.mudd_gate_scale,
                                                         rg.mudd_gate_scale, tape.mudd_gate_scale_scales, 0.3);
        double largest = 0;
        for (size_t j = 0; j < rg.mudd_gate_b2.size(); ++j)
            if (tape.mudd_gate_b2_scales[j] > 0) largest = std::max(largest, std::fabs(rg.mudd_gate_b2[j]) / tape.mudd_gate_b2_scales[j]);
        std::printf("  mudd_gate_b2: largest error %.3f of its scale (largest gradient %.2f of it); mudd_gate_scale: "
                    "error %.3f of its scale (gradient %.2f of it)\n", worst_gb2, largest, worst_gs,
                    std::fabs(rg.mudd_gate_scale[0]) / tape.mudd_gate_scale_scales[0]);
        return;  // no skip gate: its column is among b2's
    }
    // The skip gate's 12 gradients are sums over tokens of a gate factor times a dot product over C
    // that cancels in the same way; TEST_SEED=1273328711279058700 put 17.7% of relative error in
    // them. Against its scale (Tape::skip_gate_scales) the error stayed below 0.045 over 80 seeds,
    // while the largest gradient was 0.19-0.63 of it: a bound of 0.1 sees a wrong gradient.
    // With MUDD's coefficients scaled up (compare_with_reference) the largest was 0.112 of it
    // (TEST_SEED=9169812687577948472 under EMU_RANDOM_ORDER=23), its largest gradient still 1.03 of it.
    // With MUDD, TEST_SEED=6419059436655933998 gave a largest gradient of only 0.13 of its scale (error
    // 0.034): under the bound, so a zero gradient would have passed. The bound is therefore also at most
    // half the largest gradient, which a zero (or any gradient off by the largest) always exceeds.
    const double kSkipBound = c.structure.mudd ? 0.15 : 0.1;
    double largest = 0;  // how far off a zero gradient would be
    for (size_t j = 0; j < rg.skip_gate.size(); ++j)
        largest = std::max(largest, std::fabs(rg.skip_gate[j]) / tape.skip_gate_scales[j]);
    test::check(largest > 0, "the skip gate's reference gradient is not zero");
    const double worst_skip = test::check_within_scale("skip gate gradient", mg.skip_gate, rg.skip_gate,
                                                       tape.skip_gate_scales, std::min(kSkipBound, largest / 2));
    std::printf("  skip gate: largest error %.3f of its scale, largest gradient %.2f of it\n", worst_skip, largest);
}

double mean_of(const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += x;
    return s / v.size();
}
double std_of(const std::vector<float>& v) {
    const double mu = mean_of(v);
    double s = 0;
    for (float x : v) s += (x - mu) * (x - mu);
    return std::sqrt(s / v.size());
}

// A draw of U(-b, b): inside [-b, b] (to bf16's rounding) and close to both ends; [lo, hi] its range.
bool spans_uniform(const std::vector<float>& v, double bound, float& lo, float& hi) {
    lo = 1e9f, hi = -1e9f;
    for (float x : v) lo = std::min(lo, x), hi = std::max(hi, x);
    return lo >= -bound * 1.004 && hi <= bound * 1.004 && lo < -0.99 * bound && hi > 0.99 * bound;
}
// Its standard deviation within 2% of b / sqrt(3).
bool uniform_std(const std::vector<float>& v, double bound) {
    return std::fabs(std_of(v) / (bound / std::sqrt(3.0)) - 1) < 0.02;
}

// Upstream's init: uniform(+-sqrt(3)*0.5/sqrt(C)) for attention and c_fc, zeros for c_proj and the
// embeddings and gates, normal(0, 0.005) for lm_head, embed = lm_head^T, and the scalars' values.
void check_init(const Model& m, const Config& c) {
    const Params& p = m.params;
    const int64_t C = c.model_dim, V = c.padded_vocab;
    const int64_t layers = c.structure.layers, attn_layers = c.structure.attn_layers();
    const double bound = std::sqrt(3.0) * 0.5 / std::sqrt(double(C));
    for (auto [name, v] : {std::pair<const char*, std::vector<float>>{"attn_bank", download_bf16(p.attn_bank, attn_layers * 4 * C * C)},
                           {"c_fc", download_bf16(p.c_fc(c, 4), c.mlp_dim * C)}}) {
        float lo, hi;  // uniform on [-b, b]: mean 0, std b/sqrt(3), and it reaches close to both ends
        const bool spans = spans_uniform(v, bound, lo, hi);
        test::check(spans, "%s: range [%g, %g], bound %g", name, lo, hi, bound);
        test::check(std::fabs(mean_of(v)) < 0.02 * bound && uniform_std(v, bound), "%s: mean %g std %g", name, mean_of(v),
                    std_of(v));
    }
    const std::vector<float> lm = download_bf16(p.lm_head, C * V), em = download_bf16(p.embed, V * C);
    test::check(std::fabs(std_of(lm) / 0.005 - 1) < 0.01 && std::fabs(mean_of(lm)) < 1e-4, "lm_head: mean %g std %g",
                mean_of(lm), std_of(lm));
    int64_t mismatched = 0;
    for (int64_t v = 0; v < V; ++v)
        for (int64_t k = 0; k < C; ++k) mismatched += em[v * C + k] != lm[k * V + v];
    test::check(mismatched == 0, "embed must equal lm_head^T at init (%lld differ)", static_cast<long long>(mismatched));
    double zeros = 0;
    for (float x : download_bf16(p.c_proj(c, 3), c.mlp_dim * C)) zeros += std::fabs(x);
    for (float x : download_bf16(p.value_embeds, c.structure.value_tables() * V * C)) zeros += std::fabs(x);
    for (float x : download_bf16(p.bigram_embed, int64_t(c.bigram_vocab) * C)) zeros += std::fabs(x);
    for (float x : download_bf16(p.attn_gate_bank, attn_layers * c.num_heads * kGateWidth)) zeros += std::fabs(x);
    for (float x : download_f(p.x0_lambdas, layers)) zeros += std::fabs(x);
    test::check(zeros == 0, "c_proj, value_embeds, bigram_embed, gates and x0_lambdas start at zero");
    const ScalarSlots& k = c.scalar_slots;
    const std::vector<float> sc = download_f(p.scalars, k.count);
    bool ok = sc[size_t(k.smear)] == 0.0f && sc[size_t(k.backout)] == 0.5f && sc[size_t(k.skip)] == -1.5f &&
              sc[size_t(k.count - 1)] == 1.0f;
    for (int l = 0; l < layers; ++l)
        ok = ok && sc[size_t(k.resid + l)] == 1.1f && sc[size_t(k.sa + 2 * l)] == 0.5f &&
             sc[size_t(k.sa + 2 * l + 1)] == 1.0f && sc[size_t(k.bigram + l)] == 0.1f;
    test::check(ok, "scalars: resid 1.1, sa (0.5, 1.0), bigram 0.1, smear 0, backout 0.5, skip -1.5, padding 1");
}

// The LR and momentum schedules (upstream's get_lr and get_muon_momentum) at the record's steps.
void check_schedules() {
    auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-12; };
    // record 71's floor, 0.1
    auto lr_schedule = [](int step, double lr_mul, int scheduled, double cooldown_frac) {
        return ::lr_schedule(step, lr_mul, scheduled, cooldown_frac, 0.1);
    };
    // the record: 1515 scheduled steps, cooldown over the last 55%: starts at int(1515 * 0.45) = 681
    test::check(near(lr_schedule(0, 1.0, 1515, 0.55), 1.0), "lr at step 0");
    test::check(near(lr_schedule(680, 1.52, 1515, 0.55), 1.52), "lr at step 680 (before cooldown)");
    test::check(near(lr_schedule(681, 1.52, 1515, 0.55), 1.52), "lr at cooldown start 681 (t = 0)");
    test::check(near(lr_schedule(682, 1.52, 1515, 0.55), 1.5182973621103117), "lr at step 682: %.17g",
                lr_schedule(682, 1.52, 1515, 0.55));
    test::check(near(lr_schedule(1098, 1.73, 1515, 0.55), 0.5 * 1.73 + 0.5 * 0.1), "lr halfway through cooldown");
    test::check(near(lr_schedule(1514, 1.73, 1515, 0.55), 0.10195443645083932), "lr at the last scheduled step: %.17g",
                lr_schedule(1514, 1.73, 1515, 0.55));
    test::check(near(lr_schedule(1515, 1.0, 1515, 0.55), 0.1) && near(lr_schedule(1554, 1.0, 1515, 0.55), 0.1),
                "lr in the extension stays 0.1");
    test::check(near(lr_schedule(49, 1.0, 100, 0.5), 1.0) && near(lr_schedule(75, 1.0, 100, 0.5), 0.55) &&
                    near(lr_schedule(100, 1.0, 100, 0.5), 0.1),
                "lr of a short schedule");
    // a floor of 0.15 and cooldown over the last 60% of 1440 steps: starts at int(1440 * 0.4) = 576
    test::check(near(::lr_schedule(576, 1.52, 1440, 0.6, 0.15), 1.52) &&
                    near(::lr_schedule(1008, 1.73, 1440, 0.6, 0.15), 0.5 * 1.73 + 0.5 * 0.15) &&
                    near(::lr_schedule(1479, 1.0, 1440, 0.6, 0.15), 0.15),
                "lr with a floor of 0.15");

    // momentum: 0.85 -> 0.95 over 300 steps, back toward 0.85 over the last 50 of 1555
    test::check(near(muon_momentum(0, 1555), 0.85), "momentum at step 0");
    test::check(near(muon_momentum(150, 1555), 0.90), "momentum at step 150");
    test::check(near(muon_momentum(299, 1555), 0.9496666666666667), "momentum at step 299: %.17g",
                muon_momentum(299, 1555));
    test::check(near(muon_momentum(300, 1555), 0.95) && near(muon_momentum(1000, 1555), 0.95),
                "momentum after warm-up");
    test::check(near(muon_momentum(1505, 1555), 0.95), "momentum at cool-down start 1505 (strict >)");
    test::check(near(muon_momentum(1506, 1555), 0.948), "momentum at step 1506: %.17g", muon_momentum(1506, 1555));
    test::check(near(muon_momentum(1530, 1555), 0.90), "momentum halfway through cool-down");
    test::check(near(muon_momentum(1554, 1555), 0.852), "momentum at the last step: %.17g", muon_momentum(1554, 1555));
}

// The presets' layer structure: record 71's, written out independently of the Structure's lists (as
// upstream's forward spells it), and the structure rules each refusing a planted mistake.
void check_structure() {
    for (const char* name : {"r71", "tiny"}) {
        const std::optional<Config> c = preset_config(name);
        test::check(c && c->name == name && config_error(*c).empty(), "preset %s exists and is valid", name);
        if (!c) continue;
        const Structure& st = c->structure;
        bool same = st.layers == 11 && st.attn_layers() == 10 && st.value_tables() == 5 && st.skip_from == 3 &&
                    st.skip_to == 6 && st.backout_layer == 7;
        for (int l = 0; l < 11; ++l)
            same = same && st.has_attention(l) == (l != 6) && (l == 6 || st.attn_index(l) == (l < 6 ? l : l - 1)) &&
                   st.is_paired(l) == (l == 0 || l == 2 || l == 5 || l == 9) && st.is_long_window(l) == (l == 3 || l == 10) &&
                   st.value_table(l) == (l < 2 ? l : (l >= 8 ? l - 6 : -1));
        const ScalarSlots& k = c->scalar_slots;
        same = same && k.resid == 0 && k.sa == 11 && k.bigram == 33 && k.smear == 44 && k.backout == 45 && k.skip == 46 &&
               k.count == 51;
        test::check(same, "preset %s: record 71's layer structure and scalars layout", name);
        test::check(c->grad_scale_sum == 2 && c->lr_floor == 0.1, "preset %s: record 71's grad scale and lr floor", name);
    }
    test::check(!preset_config("r81") && !preset_config("Record"), "no preset by another name");
    // `record` is the newest record this program reproduces: upstream's record 89 (75d6867a), named record
    {
        const std::optional<Config> rec = preset_config("record"), r89 = preset_config("r89");
        test::check(rec && r89 && rec->name == "record" && rec->scheduled_iterations == 1270 &&
                        rec->extension_iterations == 15 && rec->structure.mudd_gate && rec->prefix_loss &&
                        rec->mlp_down_fp8 && rec->mlp_saves == ReluSquareSaves::post_only &&
                        rec->param_table.size() == r89->param_table.size() && config_error(*rec).empty(),
                    "--preset record is record 89: 1270 + 15 steps, the MUDD gate, the prefix loss, FP8 down, post-only");
    }
    // Record 80's presets, written out from upstream's 2c702746 (Hyperparameters, TRAINING_STAGES,
    // TRAIN_MAX_NUM_DOCS, the optimizer table, GPT.__init__) and tests/reference/README.md's tiny-r80 contract.
    for (const char* name : {"r80", "tiny-r80"}) {
        const std::optional<Config> c = preset_config(name);
        test::check(c && config_error(*c).empty(), "preset %s exists and is valid", name);
        if (!c) continue;
        const bool tiny = std::string(name) == "tiny-r80";
        const Structure& st = c->structure;
        bool same = st.layers == 11 && st.without_attention == std::vector<int>{6} && st.skip_from == 3 && st.skip_to == 6 &&
                    st.backout_layer == 7 && st.value_layers == std::vector<int>{1, 2, 8, 9, 10} && st.ve_gate_reads_ve &&
                    st.sublayer_lambdas && st.late_attn_source == 7 && st.attn_banks == AttnBanks::head_pairs &&
                    c->scalar_slots.count == 32 && c->loss == SoftcapLoss::tanh_bf16 && c->value_embed_std == 0.01f;
        same = same && c->grad_scale_sum == 1 && c->lr_floor == 0.15 && c->cooldown_frac == 0.60 && c->normuon_beta2 == 0.9 &&
               c->normuon_numerics.input == PolarExpressInput::round_first &&
               c->normuon_numerics.scale == VarianceScale::bf16 && c->normuon_numerics.momentum == MomentumComplement::fp32;
        same = same && c->scheduled_iterations == (tiny ? 30 : 1440) && c->extension_iterations == (tiny ? 4 : 40) &&
               c->stages.size() == 4 && c->stages[0].max_seq_len == (tiny ? 112 : 896);
        for (size_t i = 1; i < c->stages.size(); ++i) same = same && c->stages[i].max_seq_len == (tiny ? 256 : 2048);
        const int64_t t0 = tiny ? 32 : 16384, t1 = tiny ? 48 : 32768, t2 = tiny ? 64 : 49152;
        same = same && c->max_docs.entries(t0) == 64 && c->max_docs.entries(t1) == 96 && c->max_docs.entries(t2) == 128;
        const int qk = param_group(*c, "qk_bank"), vo = param_group(*c, "vo_bank");
        same = same && param_group(*c, "resid_lambdas") >= 0 && c->param_table[size_t(qk)].optim == Optim::normuon && c->param_table[size_t(vo)].reduce == Reduce::buckets;
        test::check(same, "preset %s: record 80's structure, schedule, data rules and optimizer", name);
    }
    // Records 88's and 89's feature presets on record 84, and the rules their switches bring, each refusal naming its cause
    for (const char* name : {"r84-prefix", "tiny-r84-prefix", "r84-fp8down", "tiny-r84-fp8down"}) {
        const std::optional<Config> c = preset_config(name);
        test::check(c && config_error(*c).empty(), "preset %s exists and is valid", name);
        if (!c) continue;
        const bool prefix = std::string(name).find("prefix") != std::string::npos;
        const bool tiny = std::string(name).rfind("tiny", 0) == 0;
        bool same = c->prefix_loss == prefix && c->mlp_down_fp8 == !prefix && c->mlp_up_fp8 &&
                    c->mlp_down_bootstrap_steps == 16 && c->stages.size() == 4 &&
                    c->scheduled_iterations == (tiny ? 30 : prefix ? 1365 : 1380);
        const float pw[4][2] = {{0.25f, 0.25f}, {0.25f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
        for (size_t i = 0; i < c->stages.size(); ++i)
            same = same && c->stages[i].prefix_start == (prefix ? pw[i][0] : 0.0f) &&
                   c->stages[i].prefix_end == (prefix ? pw[i][1] : 0.0f);
        test::check(same, "preset %s: record 84 with record %s's switch, steps and prefix weights", name,
                    prefix ? "88" : "89");
    }
    // Records 85-86's presets (upstream 003ff3e2: GPT.__init__'s xsa_layers, dc_layers, attn_gate_layers,
    // init_mudd_gate, unpack_pre_mudd_gate / unpack_post_mudd_gate, Hyperparameters, the TrainingManager's table),
    // the gate's columns written out from upstream's literals
    // and record 89's on it (75d6867a: the post-only MLP, the prefix loss, FP8 down; 1270 + 15 steps)
    for (const char* name : {"r86", "tiny-r86", "r89", "tiny-r89"}) {
        const std::optional<Config> c = preset_config(name);
        test::check(c && config_error(*c).empty(), "preset %s exists and is valid: '%s'", name,
                    c ? config_error(*c).c_str() : "none");
        if (!c) continue;
        const bool tiny = std::string(name).rfind("tiny", 0) == 0, r89 = std::string(name).find("r89") != std::string::npos;
        const Structure& st = c->structure;
        bool same = st.mudd && st.mudd_gate && st.mudd_gate_post_layer == 4 && !st.x0_is_stream &&
                    st.xsa_layers == std::vector<int>{1, 3, 4, 7} && st.gate_layers == std::vector<int>{3, 10} &&
                    st.dc_layer == 10 && c->bigram_dim == 0 && c->bigram_sign_rows == 8192 && c->mlp_up_fp8 &&
                    c->mlp_down_fp8 == r89 && c->prefix_loss == r89 &&
                    (c->mlp_saves == ReluSquareSaves::post_only) == r89 && c->num_heads == 6 &&
                    c->head_dim == (tiny ? 64 : 128) && c->bigram_vocab == (tiny ? 4096 * 15 / 2 : 50304 * 15 / 2) &&
                    c->scheduled_iterations == (tiny ? 30 : r89 ? 1270 : 1285) && c->extension_iterations == (tiny ? 4 : 15);
        const MuddGateLayout g = mudd_gate_layout(st, c->num_heads);
        const int pre_xsa[] = {-1, 0, -1, 6}, post_xsa[] = {0, -1, -1, 6, -1, -1, -1};  // layers 0-3, 4-10
        for (int l = 0; l < 11; ++l) {
            const GateColumns& k = g.layer[l];
            const int xsa = l < 4 ? pre_xsa[l] : post_xsa[l - 4];
            const int gate = l == 3 || l == 10 ? 12 : -1;
            const int pair = l < 4 ? 18 + 2 * l : l == 4 ? 18 : l == 5 ? 20 : l >= 7 && l <= 9 ? 22 + 2 * (l - 7) : -1;
            same = same && k.id == (l < 4 ? 0 : 1) && k.xsa == xsa && k.gate == gate && k.x0 == pair &&
                   k.bigram == (pair < 0 ? -1 : pair + 1);
        }
        same = same && g.n[0] == 26 && g.n[1] == 41 && g.skip == 28 && g.dc == 29;
        const std::vector<bf16> bias = initial_mudd_gate_bias(*c);
        for (int id = 0; id < 2; ++id)
            for (int j = 0; j < 41; ++j) {
                const bool gate_col = j >= 12 && j < 18, bigram_col = j >= 19 && j < (id ? 28 : 26) && j % 2 == 1;
                const float want = gate_col ? 2.5f : bigram_col ? 0.5f : id == 1 && j == 28 ? 5.0f
                                   : id == 1 && j >= 29 && j < 35 ? 10.0f : 0.0f;
                same = same && __bfloat162float(bias[size_t(id * 41 + j)]) == want;
            }
        for (const char* gone : {"skip_gate", "attn_gate_bank", "xsa_alphas", "x0_lambdas", "bigram_lambdas"})
            same = same && std::none_of(c->param_table.begin(), c->param_table.end(),
                                        [&](const ParamRule& r) { return std::string(r.label) == gone; });
        for (const char* label : {"mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale"}) {
            const int i = param_group(*c, label);
            const bool decays = std::string(label) == "mudd_gate_w1" || std::string(label) == "mudd_gate_w2";
            same = same && i >= 0 && c->param_table[size_t(i)].optim == Optim::adam &&
                   c->param_table[size_t(i)].reduce == Reduce::replicated && c->param_table[size_t(i)].beta1 == 0.9 &&
                   c->param_table[size_t(i)].beta2 == 0.99 && c->param_table[size_t(i)].lr_mul == 0.1 &&
                   c->param_table[size_t(i)].wd_mul == (decays ? 1.0 : 0.0);
        }
        same = same && c->param_table.size() == 19 && c->work_order.size() == 19;
        test::check(same, "preset %s: record 86's switches (record 89's too), gate columns and biases, bigram, steps and "
                    "optimizer table", name);
    }
    struct SwitchRule {
        const char *what, *preset, *message;
        void (*plant)(Config&);
    };
    const SwitchRule switch_rules[] = {
        {"prefix weights without prefix_loss", "tiny-r84-prefix", "prefix-loss weights but the config has no prefix_loss",
         [](Config& c) { c.prefix_loss = false; }},
        {"prefix_loss on record 71's loss", "tiny-r84-prefix", "a term of record 80's cross-entropy",
         [](Config& c) { c.loss = SoftcapLoss::sigmoid; }},
        {"prefix_loss with 8 MTP weights", "tiny-r84-prefix", "at most 7 MTP weights",
         [](Config& c) { c.stages[0].mtp_start = c.stages[0].mtp_end = std::vector<float>(8, 1.0f); }},
        {"mlp_down_fp8 without mlp_up_fp8", "tiny-r84-fp8down", "it needs mlp_up_fp8",
         [](Config& c) { c.mlp_up_fp8 = false; }},
        {"a negative bootstrap", "tiny-r84-fp8down", "mlp_down_bootstrap_steps must be at least 0",
         [](Config& c) { c.mlp_down_bootstrap_steps = -1; }},
        {"the MUDD gate without MUDD", "tiny-r86", "builds on MUDD", [](Config& c) { c.structure.mudd = false; }},
        {"the MUDD gate on record 84's aliased x0", "tiny-r86", "reads the clean x0",
         [](Config& c) { c.structure.x0_is_stream = true; }},
        {"the post gate at layer 0", "tiny-r86", "post gate must be made",
         [](Config& c) { c.structure.mudd_gate_post_layer = 0; }},
        {"the post gate after the skip's target", "tiny-r86", "post gate must be made",
         [](Config& c) { c.structure.mudd_gate_post_layer = 7; }},
        {"an output gate on the layer without attention", "tiny-r86", "must be a layer with attention",
         [](Config& c) { c.structure.gate_layers.push_back(6); }},
        {"DC-MHA on a paired layer", "tiny-r86", "DC-MHA's layer must be an unpaired",
         [](Config& c) { c.structure.dc_layer = 9; }},
        {"per-token gates without the MUDD gate", "tiny-r84", "read the MUDD gate",
         [](Config& c) { c.structure.gate_layers = {3}; }},
        {"a third XSA layer in the post gate", "tiny-r86", "come to 26 (pre) and 47 (post)",
         [](Config& c) { c.structure.xsa_layers = {1, 3, 4, 7, 8}; }},
        {"the MUDD gate with 2 heads", "tiny-r86", "come to 14 (pre) and 21 (post)",
         [](Config& c) { c.num_heads = 2, c.model_dim = 128, c.mlp_dim = 512; }},
    };
    for (const SwitchRule& r : switch_rules) {
        Config c = *preset_config(r.preset);
        r.plant(c);
        const std::string e = config_error(c);
        test::check(e.find(r.message) != std::string::npos, "the config rules refuse %s naming it: '%s'", r.what,
                    e.c_str());
    }
    const Config base = tiny_preset();
    const std::pair<const char*, void (*)(Structure&)> planted[] = {
        {"too many layers", [](Structure& st) { st.layers = kMaxLayers + 1; }},
        {"a list naming layer 11 of 11", [](Structure& st) { st.paired.push_back(11); }},
        {"a paired layer without attention", [](Structure& st) { st.paired.push_back(6); }},
        {"a value table on a layer without attention", [](Structure& st) { st.value_layers.push_back(6); }},
        {"two value tables on one layer", [](Structure& st) { st.value_layers.push_back(0); }},
        {"a skip to the next layer", [](Structure& st) { st.skip_to = st.skip_from + 1; }},
        {"a backout at the last layer", [](Structure& st) { st.backout_layer = st.layers - 1; }},
        {"the backout at the skip's layer", [](Structure& st) { st.backout_layer = st.skip_from; }},
    };
    for (const auto& [what, plant] : planted) {
        Config c = base;
        plant(c.structure);
        test::check(!config_error(c).empty(), "the structure rules refuse %s: '%s'", what, config_error(c).c_str());
    }
}

int main() {
    test::seed();
    check_schedules();
    check_structure();
    {
        Model plan_only;
        plan_only.cfg = r71_preset();
        Optimizer optimizer_plan;
        const MemoryPlan plan = plan_memory(plan_only, optimizer_plan, 8);
        test::check(plan.total() / 1048576.0 <= kUpstreamPeakMiB, "record plan %.0f MiB exceeds upstream's %.0f MiB",
                    plan.total() / 1048576.0, kUpstreamPeakMiB);
    }
    const Config c = tiny_preset();
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    Model m;
    build_model(m, c, test::seed(), s);

    check_init(m, c);
    {  // record 80's residual stream starts at upstream's values: resid sqrt(1.1), post 1, x0 0, bigram
       // 0.05 (each every element), scalars sa (0.5, 1.0) per layer, smear 0, backout 0.5, skip -1.5, ones
        Config r80 = c;
        use_record80_residual_stream(r80);
        Model mr;
        build_model(mr, r80, test::seed(), s);
        const int L = r80.structure.layers;
        auto all = [](const std::vector<float>& v, float want) {
            return std::all_of(v.begin(), v.end(), [&](float x) { return x == want; });
        };
        test::check(all(download_f(mr.params.resid_lambdas, 2 * L), static_cast<float>(std::sqrt(1.1))) &&
                        all(download_f(mr.params.post_lambdas, 2 * L), 1.0f) &&
                        all(download_f(mr.params.x0_lambdas, L), 0.0f) &&
                        all(download_f(mr.params.bigram_lambdas, L), 0.05f),
                    "record 80's lambdas start at resid sqrt(1.1), post 1, x0 0, bigram 0.05");
        const ScalarSlots& k = r80.scalar_slots;
        const std::vector<float> sc = download_f(mr.params.scalars, k.count);
        bool ok = k.count == 32 && sc[size_t(k.smear)] == 0.0f && sc[size_t(k.backout)] == 0.5f &&
                  sc[size_t(k.skip)] == -1.5f;
        for (int l = 0; l < L; ++l) ok = ok && sc[size_t(k.sa + 2 * l)] == 0.5f && sc[size_t(k.sa + 2 * l + 1)] == 1.0f;
        for (int i = k.skip + 1; i < k.count; ++i) ok = ok && sc[size_t(i)] == 1.0f;
        test::check(ok, "record 80's 32 scalars: sa (0.5, 1.0), smear 0, backout 0.5, skip -1.5, padding 1");
    }
    {  // record 80's head-pair banks: qk_bank (24, 128, 128) and vo_bank (24, 128, 128) at tiny's sizes (20
       // real matrices each: 10 attention layers x 2 heads, x [Wv, Wo]), the real ones drawn as attn was, the
       // padding zero; every layer's [Wq; Wk; Wv; Wo] its own draw (no two layers' matrices equal)
        Config r80 = c;
        use_record80_banks(r80);
        Model mb;
        build_model(mb, r80, test::seed(), s);
        test::check(!mb.params.attn_bank && mb.params.qk_bank && mb.params.vo_bank, "the head-pair banks replace attn");
        const int64_t C = r80.model_dim, CC = C * C, A = r80.structure.attn_layers();
        const std::vector<float> qk = download_bf16(mb.params.qk_bank, 24 * CC), vo = download_bf16(mb.params.vo_bank, 24 * CC);
        const double bound = std::sqrt(3.0) * 0.5 / std::sqrt(double(C));
        for (auto [name, v] : {std::pair<const char*, const std::vector<float>*>{"qk_bank", &qk}, {"vo_bank", &vo}}) {
            const std::vector<float> real(v->begin(), v->begin() + 2 * A * CC);
            float lo, hi;
            const bool spans = spans_uniform(real, bound, lo, hi);
            test::check(spans && uniform_std(real, bound), "%s: range [%g, %g] std %g, bound %g", name, lo, hi, std_of(real),
                        bound);
            test::check(std::all_of(v->begin() + 2 * A * CC, v->end(), [](float x) { return x == 0.0f; }),
                        "%s: its %lld padding matrices start zero", name, static_cast<long long>(24 - 2 * A));
        }
        test::check(!std::equal(qk.begin(), qk.begin() + CC, vo.begin()), "qk_bank and vo_bank are different draws");
        test::check(mb.params.wqk(r80, 7) == mb.params.qk_bank + 6 * 2 * CC && mb.params.wv(r80, 7) == mb.params.vo_bank + 6 * 2 * CC &&
                        mb.params.wo(r80, 7) == mb.params.vo_bank + 6 * 2 * CC + CC,
                    "layer 7 (attention layer 6) reads qk_bank[12, 14) and vo_bank 12, 13");
    }
    {  // record 80's value tables start at N(0, 0.01^2), drawn from their own stream
        Config ve = c;
        ve.value_embed_std = 0.01f;
        Model mv;
        build_model(mv, ve, test::seed(), s);
        const int64_t n = int64_t(ve.structure.value_tables()) * ve.padded_vocab * ve.model_dim;
        const std::vector<float> v = download_bf16(mv.params.value_embeds, n);
        const std::vector<float> lm = download_bf16(mv.params.lm_head, int64_t(ve.model_dim) * ve.padded_vocab);
        double dot = 0, vv = 0, ll = 0;  // correlation with lm_head's draws (the same generator, another stream)
        for (size_t i = 0; i < lm.size(); ++i) dot += double(v[i]) * lm[i], vv += double(v[i]) * v[i], ll += double(lm[i]) * lm[i];
        test::check(std::fabs(std_of(v) / 0.01 - 1) < 0.01 && std::fabs(mean_of(v)) < 1e-4 &&
                        std::fabs(dot / std::sqrt(vv * ll)) < 0.01,
                    "value tables: mean %g std %g, correlation with lm_head %g", mean_of(v), std_of(v), dot / std::sqrt(vv * ll));
    }
    const int T = c.max_train_tokens();
    // three documents, each starting at a BOS (offsets from T: written for 256 tokens, this test once
    // wrote BOS past the end of its 64-token buffers and gave cu_seqlens beyond T)
    const std::vector<int> starts = {0, T * 3 / 8, T * 3 / 4};
    std::vector<int32_t> inputs(T), targets(T), bigram(T), cu = {starts[0], starts[1], starts[2], T};
    for (int t = 0; t < T; ++t) inputs[t] = test::randint(0, c.vocab_size - 1);
    for (int t = 0; t < T; ++t) targets[t] = t + 1 < T ? inputs[t + 1] : test::randint(0, c.vocab_size - 1);
    for (int d : starts) inputs.at(size_t(d)) = 50256;
    dataload::bigram_hash(inputs.data(), bigram.data(), T, c.bigram_vocab);
    cu.resize(128, T);
    BatchUploader up;
    up.upload(m.batch, c.tokens(), inputs.data(), targets.data(), cu.data(), int(cu.size()), bigram.data(), T, s);
    const float w[3] = {1.0f, 0.5f, 0.25f};
    CUDA_CHECK(cudaMemcpy(m.mtp_weights, w, sizeof w, cudaMemcpyHostToDevice));
    StepSchedule step_sch{c.stages[0].ws_short * c.block_size, c.stages[0].ws_long * c.block_size, m.mtp_weights, 3, {}};
    const auto t0 = std::chrono::steady_clock::now();
    gpt_forward(m, m.batch, step_sch, m.train, s);
    const float loss = download_f(m.loss, 1)[0];
    // An untrained lm_head gives ~0 logits: every softcapped logit is 23*sigmoid(5/7.5), the
    // softmax is uniform, and each row costs ln(V) per unit of MTP weight (rows near the end fewer).
    double weight = 0;
    for (int t = 0; t < T; ++t)
        for (int k = 0; k < 3; ++k) weight += t + k < T ? w[k] : 0.0;
    const double uniform = weight * std::log(double(c.padded_vocab));
    test::check(std::fabs(loss - uniform) < 1e-2 * uniform, "untrained loss %.4f, uniform %.4f", loss, uniform);
    gpt_backward(m, m.batch, step_sch, {false, false}, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::printf("tiny preset, %d tokens: forward + backward %.2f s\n", T,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    auto gl = download_bf16(m.grads.lm_head, size_t(c.model_dim) * c.padded_vocab);
    double n2 = 0;
    for (float v : gl) n2 += double(v) * v;
    test::check(std::isfinite(n2) && n2 > 0, "lm_head gradient norm^2 %g", n2);

    compare_with_reference(m, c, s);
    {  // record 80's switches so far: value tables on layers 1, 2, 8, 9, 10 (2 and 9 paired), the gate
       // reading ve on the unpaired ones, the tanh-form loss kernel, grad_scale 1/accum, the residual
       // stream of per-sublayer lambdas with layers 8-10 attending to norm(h7), the head-pair banks
        Config r80 = c;
        use_record80_residual_stream(r80);
        use_record80_banks(r80);
        r80.structure.value_layers = {1, 2, 8, 9, 10};
        r80.structure.ve_gate_reads_ve = true;
        r80.loss = SoftcapLoss::tanh_bf16;
        r80.grad_scale_sum = 1;
        r80.value_embed_std = 0.01f;
        Model m80;
        build_model(m80, r80, test::seed(), s);
        std::printf("record 80's switches:\n");
        compare_with_reference(m80, r80, s);
        const int64_t real = 2 * r80.structure.attn_layers() * int64_t(r80.model_dim) * r80.model_dim;
        const std::vector<float> gqk = download_bf16(m80.grads.qk_bank + real, 4 * r80.model_dim * r80.model_dim),
                                 gvo = download_bf16(m80.grads.vo_bank + real, 4 * r80.model_dim * r80.model_dim);
        test::check(std::all_of(gqk.begin(), gqk.end(), [](float x) { return x == 0.0f; }) &&
                        std::all_of(gvo.begin(), gvo.end(), [](float x) { return x == 0.0f; }),
                    "the banks' padding matrices have zero gradients");

        // record 82's XSA on its layers 1, 3, 4, 7, 8, 10 (every unpaired attention layer; 1 and 8 with value
        // embeddings, whose v XSA reads), strengths starting at zero
        Config r82 = r80;
        use_record82_xsa(r82, {1, 3, 4, 7, 8, 10});
        Model m82;
        build_model(m82, r82, test::seed(), s);
        const std::vector<float> a0 = download_f(m82.params.xsa_alphas, size_t(r82.structure.layers) * r82.num_heads);
        test::check(std::all_of(a0.begin(), a0.end(), [](float x) { return x == 0.0f; }), "xsa_alphas start at zero");
        std::printf("record 80's switches with record 82's XSA:\n");
        compare_with_reference(m82, r82, s);
        const std::vector<float> ga = download_f(m82.grads.xsa_alphas, size_t(r82.structure.layers) * r82.num_heads);
        bool rows = true;  // zero exactly on the layers without XSA, non-zero on its layers
        for (int l = 0; l < r82.structure.layers; ++l)
            for (int h = 0; h < r82.num_heads; ++h)
                rows = rows && (ga[size_t(l * r82.num_heads + h)] != 0.0f) == r82.structure.has_xsa(l);
        test::check(rows, "xsa_alphas' gradient: zero on the layers without XSA, non-zero on its layers");

        // record 83's sign trick and record 84's narrow bigram (a quarter of the width, as 192 of 768), few sign
        // rows so that they repeat within the batch; record 84's x0 aliasing (the narrow bigram without it is
        // record 86's, whose kernels test_residual checks)
        Config r84 = r82;
        r84.bigram_dim = r84.model_dim / 4;
        r84.bigram_sign_rows = 61;
        r84.structure.x0_is_stream = true;
        r84.structure.paired_ve_gate_reads_ve = true;  // layers 2 and 9's gates read the value embedding too
        Model m84;
        build_model(m84, r84, test::seed(), s);
        const std::vector<float> signs = download_bf16(m84.bigram_signs, size_t(61) * r84.bigram_width());
        const int64_t plus = std::count(signs.begin(), signs.end(), 1.0f), minus = std::count(signs.begin(), signs.end(), -1.0f);
        test::check(plus + minus == int64_t(signs.size()) && plus > 0 && minus > 0, "the sign table is +-1 (%lld + %lld of %zu)",
                    static_cast<long long>(plus), static_cast<long long>(minus), signs.size());
        std::printf("record 80's switches with XSA, the narrow signed bigram, x0 aliased:\n");
        compare_with_reference(m84, r84, s);

        // record 81's MUDD on top: the last layer's entry and the exit in place of the backout
        Config r81 = r84;
        use_record81_mudd(r81);
        Model m81;
        build_model(m81, r81, test::seed(), s);
        std::printf("record 84's switches with MUDD:\n");
        compare_with_reference(m81, r81, s);

        // and record 84's FP8 MLP up-projection: every switch of the record
        Config fp8 = r81;
        fp8.mlp_up_fp8 = true;
        Model m84f;
        build_model(m84f, fp8, test::seed(), s);
        std::printf("record 84's switches with MUDD and the FP8 up-projection:\n");
        compare_with_reference(m84f, fp8, s);
    }
    // Records 85-86 in the default mode only: under emu's strict modes this comparison took 25 s of CI's 30 minutes,
    // and test_trainer_r89's strict ranks run the same forward and backward under them
    if (std::getenv("EMU_POISON") != nullptr)
        std::printf("records 86-88's comparison: in the default mode only (EMU_POISON is set)\n");
    else {  // records 85-86 (tiny-r86's structure: 6 heads of 64): the MUDD gate, per-token XSA and output gates, the gated
       // skip, DC-MHA on layer 10, the full-width signed bigram; as tiny-r89 (records 87-89 on it) with record 87's
       // post-only MLP (the same function) and record 88's prefix-token loss, without the FP8 up- and down-projections
       // (the up-projection checked above; the down-projection's delayed scale not in the reference), so that the
       // bounds stay the unquantized ones
        Config r86 = *preset_config("tiny-r89");
        r86.mlp_up_fp8 = r86.mlp_down_fp8 = false;
        // 4096 tokens (the batch's ids folded into them: compare_with_reference) and 6144 bigram rows, so that the
        // tables (value_embeds 5 x V x 384) stay small enough for the time a CI run has (50304 tokens: 18 s here)
        r86.vocab_size = r86.padded_vocab = 4096;
        r86.bigram_vocab = 4096 * 3 / 2;
        const auto t86 = std::chrono::steady_clock::now();
        Model m86;
        build_model(m86, r86, test::seed(), s);
        std::printf("records 86-88's switches (tiny-r89 without FP8 MLP projections):\n");
        compare_with_reference(m86, r86, s);
        std::printf("  record 86's model and comparison: %.2f s\n",
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t86).count());
    }

    // Bad input stops before any kernel runs, with a message naming the problem.
    test::check_fails_with("odd head count", "even number of heads", [&] {
        Config odd = c;
        odd.num_heads = 1;
        odd.head_dim = 128;
        Model bad;
        build_model(bad, odd, 1, s);
    });
    test::check_fails_with("XSA on a paired layer", "XSA layer 2 must have attention and not be paired", [&] {
        Config paired = c;
        use_record82_xsa(paired, {1, 2});
        Model bad;
        build_model(bad, paired, 1, s);
    });
    test::check_fails_with("a bigram width that is no multiple of 8", "bigram_dim must be 0 (model_dim) or a multiple of 8", [&] {
        Config odd = c;
        odd.bigram_dim = 12;
        Model bad;
        build_model(bad, odd, 1, s);
    });
    test::check_fails_with("a negative sign table", "bigram_sign_rows must be 0 (no sign trick) or positive", [&] {
        Config neg = c;
        neg.bigram_sign_rows = -1;
        Model bad;
        build_model(bad, neg, 1, s);
    });
    test::check_fails_with("x0 aliasing on record 71's layer mix", "x0_is_stream (record 84's x0 aliasing) needs per-sublayer", [&] {
        Config aliased = c;
        aliased.structure.x0_is_stream = true;
        Model bad;
        build_model(bad, aliased, 1, s);
    });
    test::check_fails_with("a narrow bigram on record 71's layer mix", "a narrow bigram (bigram_dim) needs per-sublayer", [&] {
        Config narrow = c;
        narrow.bigram_dim = 64;
        Model bad;
        build_model(bad, narrow, 1, s);
    });
    test::check_fails_with("a late attention source without per-sublayer lambdas", "needs per-sublayer lambdas", [&] {
        Config late = c;
        late.structure.late_attn_source = 7;
        Model bad;
        build_model(bad, late, 1, s);
    });
    test::check_fails_with("record 71's scalars under per-sublayer lambdas", "record80_scalar_slots goes with", [&] {
        Config mixed = c;
        mixed.structure.sublayer_lambdas = true;
        Model bad;
        build_model(bad, mixed, 1, s);
    });
    test::check_fails_with("a stage cutting documents at 0 tokens", "each stage's max_seq_len must be at least 1", [&] {
        Config cut = c;
        cut.stages[1].max_seq_len = 0;
        Model bad;
        build_model(bad, cut, 1, s);
    });
    test::check_fails_with("a max-documents table without room for a document", "max-documents table entry 32 -> 1", [&] {
        Config few = c;
        few.max_docs.table = {{32, 1}};
        Model bad;
        build_model(bad, few, 1, s);
    });
    test::check_fails_with("token outside the vocabulary", "outside the vocabulary", [&] {
        std::vector<int32_t> ids = inputs;
        ids[7] = c.vocab_size;
        up.upload(m.batch, c.tokens(), ids.data(), targets.data(), cu.data(), int(cu.size()), bigram.data(), T, s);
    });
    const std::string descending = "cu_seqlens entry 3 (" + std::to_string(T) + ") is below entry 2 (" + std::to_string(T + 6) + ")";
    test::check_fails_with("cu_seqlens past T", descending.c_str(), [&] {
        std::vector<int32_t> bad = cu;  // {0, T*3/8, T + 6, T, ...}: a document start past T
        bad[2] = T + 6;
        up.upload(m.batch, c.tokens(), inputs.data(), targets.data(), bad.data(), int(bad.size()), bigram.data(), T, s);
    });
    test::check_fails_with("T not a multiple of 16", "multiple of 16", [&] {
        std::vector<int32_t> short_cu = {0, T - 8};
        up.upload(m.batch, c.tokens(), inputs.data(), targets.data(), short_cu.data(), 2, bigram.data(), T - 8, s);
    });
    test::check_fails_with("batch larger than the arena", "exceed", [&] {
        const int big = m.batch.capacity + 16;
        std::vector<int32_t> ids(big, 1), cu2 = {0, big};
        up.upload(m.batch, c.tokens(), ids.data(), ids.data(), cu2.data(), 2, ids.data(), big, s);
    });
    return test::finish();
}
