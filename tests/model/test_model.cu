// The assembled model (train_gpt.cu): memory plan, initialization, and a forward/backward on the
// tiny preset checked for the loss an untrained model must give.
#define TRAIN_GPT_NO_MAIN
#include "../../train_gpt.cu"
#include "../test_util.h"

#include "../../data/bigram.h"

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

int main() {
    test::seed();
    {
        Model plan_only;
        plan_only.cfg = record_preset();
        const MemoryPlan plan = plan_memory(plan_only, 8);
        test::check(plan.total() / 1048576.0 <= kUpstreamPeakMiB, "record plan %.0f MiB exceeds upstream's %.0f MiB",
                    plan.total() / 1048576.0, kUpstreamPeakMiB);
    }
    const Config c = tiny_preset();
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    Model m;
    build_model(m, c, test::seed(), s);

    const int T = c.max_train_tokens();
    std::vector<int32_t> inputs(T), targets(T), bigram(T), cu = {0, 100, 217, T};
    for (int t = 0; t < T; ++t) inputs[t] = test::randint(0, c.vocab_size - 1);
    for (int t = 0; t < T; ++t) targets[t] = t + 1 < T ? inputs[t + 1] : test::randint(0, c.vocab_size - 1);
    for (int d : {0, 100, 217}) inputs[d] = 50256;
    dataload::bigram_hash(inputs.data(), bigram.data(), T, c.bigram_vocab);
    cu.resize(128, T);
    BatchUploader up;
    up.upload(m.batch, c, inputs.data(), targets.data(), cu.data(), int(cu.size()), bigram.data(), T, s);
    const float w[3] = {1.0f, 0.5f, 0.25f};
    CUDA_CHECK(cudaMemcpy(m.mtp_weights, w, sizeof w, cudaMemcpyHostToDevice));
    StepSchedule sch{c.stages[0].ws_short * c.block_size, c.stages[0].ws_long * c.block_size, m.mtp_weights, 3};
    gpt_forward(m, m.batch, sch, m.train, s);
    const float loss = download_f(m.loss, 1)[0];
    // An untrained lm_head gives ~0 logits: every softcapped logit is 23*sigmoid(5/7.5), the
    // softmax is uniform, and each row costs ln(V) per unit of MTP weight (rows near the end fewer).
    double weight = 0;
    for (int t = 0; t < T; ++t)
        for (int k = 0; k < 3; ++k) weight += t + k < T ? w[k] : 0.0;
    const double uniform = weight * std::log(double(c.padded_vocab));
    test::check(std::fabs(loss - uniform) < 1e-2 * uniform, "untrained loss %.4f, uniform %.4f", loss, uniform);
    gpt_backward(m, m.batch, sch, false, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    auto gl = download_bf16(m.grads.lm_head, size_t(c.model_dim) * c.padded_vocab);
    double n2 = 0;
    for (float v : gl) n2 += double(v) * v;
    test::check(std::isfinite(n2) && n2 > 0, "lm_head gradient norm^2 %g", n2);

    // Bad input stops before any kernel runs, with a message naming the problem.
    test::check_fails_with("odd head count", "even number of heads", [&] {
        Config odd = c;
        odd.num_heads = 1;
        odd.head_dim = 128;
        Model bad;
        build_model(bad, odd, 1, s);
    });
    test::check_fails_with("token outside the vocabulary", "outside the vocabulary", [&] {
        std::vector<int32_t> ids = inputs;
        ids[7] = c.vocab_size;
        up.upload(m.batch, c, ids.data(), targets.data(), cu.data(), int(cu.size()), bigram.data(), T, s);
    });
    test::check_fails_with("T not a multiple of 16", "multiple of 16", [&] {
        std::vector<int32_t> short_cu = {0, T - 8};
        up.upload(m.batch, c, inputs.data(), targets.data(), short_cu.data(), 2, bigram.data(), T - 8, s);
    });
    test::check_fails_with("batch larger than the arena", "exceed", [&] {
        const int big = m.batch.capacity + 16;
        std::vector<int32_t> ids(big, 1), cu2 = {0, big};
        up.upload(m.batch, c, ids.data(), ids.data(), cu2.data(), 2, ids.data(), big, s);
    });
    return test::finish();
}
