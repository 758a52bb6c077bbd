// Record 84's FP8 up-projection in real training steps (tiny-r84): the e4m3 copies of c_fc that each step's
// training forward multiplies by are upstream's quantize_mlp_fp8 of the c_fc that forward reads (every layer's
// W1q = e4m3(bf16(W1 / w_s)) and w_s = bf16(max|W1| / 448), padding layer included), although NorMuon moved c_fc
// after the step before. Planted (`fp8_refresh plant`): the optimizer's mark that c_fc changed is lost after each
// step, so the copies stay step 0's; the test must then fail, naming the step.
#include "../trainer_under_test.h"
#include "../device_util.h"
#include "../reference/gpt_reference.h"
#include "trainer_test_util.h"

#include <cstring>

std::vector<double> download_doubles_bf16(const bf16* p, size_t n) {
    std::vector<bf16> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = test::value(h[i]);
    return out;
}

int main(int argc, char** argv) {
    Distributed d = start_distributed(&argc, &argv);
    const bool plant = argc >= 2 && std::strcmp(argv[1], "plant") == 0;
    const char* repo = std::getenv("REPO");
    if (!repo || (argc >= 2 && !plant)) {
        std::fprintf(stderr, "usage: REPO=DIR fp8_refresh [plant]\n");
        return 2;
    }
    Config c = tiny_r84_preset();
    c.world_size = d.world;
    TrainerRun t(d, c, repo, false);
    Run& r = t.r;
    Model& m = t.m;
    cudaStream_t s = t.s;
    const int layers = c.structure.layers + 1;  // the bank's padding layer is quantized too, as upstream does
    const size_t M = size_t(c.mlp_dim), C = size_t(c.model_dim), per_layer = M * C;

    const std::vector<int> steps = {0, 1, 2, 3};  // NorMuon after each; Adam after the odd ones
    reset_schedule(r);
    start_batches(r, {steps, 0});
    std::vector<double> before;
    for (int step : steps) {
        CUDA_CHECK(sync_stream(s, "fp8_refresh"));
        std::vector<std::vector<double>> fc(static_cast<size_t>(layers));  // the c_fc this step's forward reads
        for (int l = 0; l < layers; ++l) fc[size_t(l)] = download_doubles_bf16(m.params.c_fc(c, l), per_layer);
        test::check(before.empty() || fc[0] != before, "step %d: c_fc moved since the step before", step);
        before = fc[0];
        advance_schedule(r, step);
        train_step(r, step);
        if (plant) m.mlp_fp8_stale = false;
        CUDA_CHECK(sync_stream(s, "fp8_refresh"));
        std::vector<__nv_fp8_e4m3> wq(size_t(layers) * per_layer);
        std::vector<float> scale(static_cast<size_t>(layers));
        CUDA_CHECK(cudaMemcpy(wq.data(), m.mlp_fp8.w, wq.size(), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(scale.data(), m.mlp_fp8.scale, scale.size() * sizeof(float), cudaMemcpyDeviceToHost));
        size_t wrong = 0, wrong_scales = 0;
        for (int l = 0; l < layers; ++l) {
            const std::vector<double>& w = fc[size_t(l)];
            const double w_s = ref::detail::mlp_fp8_weight_scale(w.data(), per_layer);
            wrong_scales += scale[size_t(l)] != w_s;
            for (size_t e = 0; e < per_layer; ++e)
                wrong += test::value(wq[size_t(l) * per_layer + e]) !=
                         ref::round_e4m3(ref::round_bf16(ref::round_fp32(w[e] / w_s)));
        }
        test::check(wrong == 0 && wrong_scales == 0,
                    "step %d: the FP8 copies of c_fc are its quantization as the forward read it (%zu of %zu codes and "
                    "%zu of %d scales differ)",
                    step, wrong, wq.size(), wrong_scales, layers);
    }
    return finish_trainer_test(r, t.o);
}
