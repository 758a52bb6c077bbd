// The step profiler's records (profiler/work.h) of every kernel family, against counts this test
// derives from the tensors it passes: each family runs once at a small shape, first as a dry run and
// then for real, with a recording on, and the test checks
//   - the ops recorded: their kind, name (the launcher's, or the GEMM's gemm_<what>) and stream, and
//     their bytes read and written against the sum of the sizes of the tensors the test passed them
//     (the parts a kernel touches where it reads part of a tensor: the gathered rows of a table, the
//     12 gate columns of an activation);
//   - the bytes written against a measurement: every pure output starts poisoned (all bytes 0xFF, a
//     NaN or an impossible code in every element type the kernels write), and the elements that no
//     longer hold the poison after the real run must add up to the bytes the ops say they wrote;
//   - GEMMs: cuBLASLt's m, n, k and batch, and tc_flops = 2 m n k batch from the matrices allocated;
//     the c_fc kernel: 2 T C H on tile-aligned shapes, the padded tiles on others; attention: the
//     (query tile, key tile) and (key tile, query sub-tile) pairs the kernels visit, counted here by
//     walking every row's document and window, times each kernel's tile products;
//   - the dry run: the same ops, field for field, as the real run, and every output (pure or updated
//     in place) left as it was.
// The sparse exchange's records (collectives, events, the MPI wait, the upload) are checked on
// several ranks by test_mpi_work_comms.
#include "../../kernels/attention.cuh"
#include "../../kernels/comms.cuh"
#include "../../kernels/dc_mha.cuh"
#include "../../kernels/finite.cuh"
#include "../../kernels/head.cuh"
#include "../../kernels/mlp.cuh"
#include "../../kernels/mudd.cuh"
#include "../../kernels/optim.cuh"
#include "../../kernels/residual.cuh"
#include "../../kernels/attention_aux.cuh"
#include "../../kernels/transpose.cuh"
#include "../../runtime/init_random.h"
#include "../device_util.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using test::DeviceBuffer;
using test::uniform_bf16;

// ---- the harness ----
template <class T>
double bytes(const DeviceBuffer<T>& b) {
    return static_cast<double>(b.n) * sizeof(T);
}

// A tensor a call writes. pure: the call writes it without reading it, so it can start poisoned and its
// written elements be counted; otherwise it is updated in place, and only the dry run's "unchanged" applies.
struct Output {
    void* ptr;
    size_t elems, elem_bytes;
    bool pure;
};
template <class T>
Output out(DeviceBuffer<T>& b) {
    return {b.ptr, b.n, sizeof(T), true};
}
template <class T>
Output inout(DeviceBuffer<T>& b) {
    return {b.ptr, b.n, sizeof(T), false};
}
std::vector<unsigned char> contents(const Output& o) {
    std::vector<unsigned char> h(o.elems * o.elem_bytes);
    CUDA_CHECK(cudaMemcpy(h.data(), o.ptr, h.size(), cudaMemcpyDeviceToHost));
    return h;
}
// Bytes of the pure outputs' elements that no longer hold the poison.
double written_bytes(const std::vector<Output>& outs) {
    double total = 0;
    for (const Output& o : outs) {
        if (!o.pure) continue;
        const std::vector<unsigned char> h = contents(o);
        for (size_t e = 0; e < o.elems; ++e)
            for (size_t b = 0; b < o.elem_bytes; ++b)
                if (h[e * o.elem_bytes + b] != 0xFF) {
                    total += static_cast<double>(o.elem_bytes);
                    break;
                }
    }
    return total;
}

// An op the test expects: its kind, name, and the bytes it must read and write.
struct Want {
    OpKind kind;
    std::string name;
    double read, written;
};
Want kernel(const std::string& name, double read, double written) { return {OpKind::kernel, name, read, written}; }
Want gemm(const std::string& name, double read, double written) { return {OpKind::gemm, name, read, written}; }

std::vector<StepOp> record(bool dry, const std::function<void()>& call) {
    work_recorder().start(dry);
    call();
    std::vector<StepOp> ops = work_recorder().ops;
    work_recorder().stop();
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaGetLastError());
    return ops;
}

bool same_op(const StepOp& a, const StepOp& b) {
    const Work &x = a.work, &y = b.work;
    return a.kind == b.kind && a.stream == b.stream && a.event == b.event && std::strcmp(x.name, y.name) == 0 &&
           x.tc_flops == y.tc_flops && x.flops == y.flops && x.bytes_read == y.bytes_read &&
           x.bytes_written == y.bytes_written && x.gemm == y.gemm && x.m == y.m && x.n == y.n && x.k == y.k &&
           x.batch == y.batch && x.comm == y.comm && x.comm_bytes == y.comm_bytes;
}

// Runs `call` dry and then for real, both recorded, and checks what the header says. `measured`: the
// bytes the poisoned outputs must show written, when some op writes bytes another op writes again
// (default: the sum of the ops' bytes written). Returns the real run's ops.
std::vector<StepOp> check_family(const std::string& what, const std::vector<Want>& want,
                                 const std::vector<Output>& outs, const std::function<void()>& call,
                                 double measured = -1) {
    for (const Output& o : outs)
        if (o.pure) CUDA_CHECK(cudaMemset(o.ptr, 0xFF, o.elems * o.elem_bytes));
    std::vector<std::vector<unsigned char>> before;
    for (const Output& o : outs) before.push_back(contents(o));
    const std::vector<StepOp> dry = record(true, call);
    bool untouched = true;
    for (size_t i = 0; i < outs.size(); ++i) untouched = untouched && contents(outs[i]) == before[i];
    test::check(untouched, "%s: the dry run changed an output", what.c_str());

    const std::vector<StepOp> real = record(false, call);
    bool same = dry.size() == real.size();
    for (size_t i = 0; same && i < real.size(); ++i) same = same_op(dry[i], real[i]);
    test::check(same, "%s: the dry run recorded %zu ops, not the real run's %zu (or they differ)", what.c_str(),
                dry.size(), real.size());

    if (!test::check(real.size() == want.size(), "%s: %zu ops recorded, want %zu", what.c_str(), real.size(),
                     want.size()))
        return real;
    double total_written = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const StepOp& op = real[i];
        const Want& w = want[i];
        test::check(op.kind == w.kind && w.name == op.work.name && op.stream == 0 && op.event == -1,
                    "%s op %zu: kind %d name %s stream %d, want kind %d name %s on stream 0", what.c_str(), i,
                    static_cast<int>(op.kind), op.work.name, op.stream, static_cast<int>(w.kind), w.name.c_str());
        test::check(op.work.bytes_read == w.read && op.work.bytes_written == w.written,
                    "%s op %zu (%s): bytes read %.0f written %.0f, want %.0f and %.0f", what.c_str(), i, op.work.name,
                    op.work.bytes_read, op.work.bytes_written, w.read, w.written);
        total_written += op.work.bytes_written;
    }
    bool any_pure = false;
    for (const Output& o : outs) any_pure = any_pure || o.pure;
    if (any_pure) {
        const double got = written_bytes(outs), expect = measured >= 0 ? measured : total_written;
        test::check(got == expect, "%s: the outputs show %.0f bytes written, the ops say %.0f", what.c_str(), got,
                    expect);
    }
    return real;
}

void check_gemm_shape(const std::string& what, const StepOp& op, GemmType type, int m, int n, int k, int batch) {
    const Work& w = op.work;
    test::check(w.gemm == type && w.m == m && w.n == n && w.k == k && w.batch == batch &&
                    w.tc_flops == 2.0 * m * n * k * batch,
                "%s: gemm type %d m %d n %d k %d batch %d tc_flops %.0f, want type %d, %d x %d x %d x %d and 2mnk",
                what.c_str(), static_cast<int>(w.gemm), w.m, w.n, w.k, w.batch, w.tc_flops, static_cast<int>(type), m,
                n, k, batch);
}

// ---- common, finite, transpose ----
void test_common() {
    const int blocks = 7;
    DeviceBuffer<float> partials(test::uniform_vector(blocks * 8, -1, 1)), f32(3), sum_in(test::uniform_vector(100, 0, 1));
    DeviceBuffer<bf16> b16(5);
    DeviceBuffer<float> total(1);
    const double targets = bytes(f32) + bytes(b16);
    check_family("sum_block_partials", {kernel("sum_block_partials", bytes(partials), targets)},
                 {out(f32), out(b16)}, [&] {
                     sum_block_partials(SumTargets().add(f32.ptr, 3).add(b16.ptr, 5), partials.ptr, blocks, 8, false,
                                        nullptr);
                 });
    check_family("sum_block_partials accumulating", {kernel("sum_block_partials", bytes(partials) + targets, targets)},
                 {inout(f32), inout(b16)}, [&] {
                     sum_block_partials(SumTargets().add(f32.ptr, 3).add(b16.ptr, 5), partials.ptr, blocks, 8, true,
                                        nullptr);
                 });
    check_family("sum_fixed_order", {kernel("sum_fixed_order", bytes(sum_in), bytes(total))}, {out(total)},
                 [&] { sum_fixed_order(total.ptr, sum_in.ptr, 100, 0.5f, false, nullptr); });

    // A NaN planted in each input makes the kernel write its flag.
    std::vector<bf16> x16 = uniform_bf16(1000, -1, 1);
    x16[517] = test::to_bf16(NAN);
    std::vector<float> x32 = test::uniform_vector(333, -1, 1);
    x32[200] = INFINITY;
    DeviceBuffer<bf16> d16(x16);
    DeviceBuffer<float> d32(x32);
    DeviceBuffer<int> flag(1);
    check_family("flag_nonfinite bf16", {kernel("flag_nonfinite", bytes(d16), bytes(flag))}, {out(flag)},
                 [&] { flag_nonfinite(d16.ptr, 1000, false, flag.ptr, nullptr); });
    check_family("flag_nonfinite fp32", {kernel("flag_nonfinite", bytes(d32), bytes(flag))}, {out(flag)},
                 [&] { flag_nonfinite(d32.ptr, 333, true, flag.ptr, nullptr); });

    const int rows = 70, cols = 50;  // element by element
    DeviceBuffer<bf16> in(uniform_bf16(rows * cols, -1, 1)), t(rows * cols);
    DeviceBuffer<float> in32(test::uniform_vector(rows * cols, -1, 1)), t32(rows * cols);
    check_family("transpose", {kernel("transpose", bytes(in), bytes(t))}, {out(t)},
                 [&] { transpose(t.ptr, in.ptr, rows, cols, cols, rows, false, nullptr); });
    check_family("transpose fp32 adding", {kernel("transpose", bytes(in32) + bytes(t32), bytes(t32))}, {inout(t32)},
                 [&] { transpose(t32.ptr, in32.ptr, rows, cols, cols, rows, true, nullptr); });
    const int vrows = 72, vcols = 48;  // 16-byte accesses, ragged tiles
    DeviceBuffer<bf16> vin(uniform_bf16(vrows * vcols, -1, 1)), vt(vrows * vcols);
    DeviceBuffer<float> vin32(test::uniform_vector(vrows * vcols, -1, 1)), vt32(vrows * vcols);
    check_family("transpose 16-byte", {kernel("transpose", bytes(vin), bytes(vt))}, {out(vt)},
                 [&] { transpose(vt.ptr, vin.ptr, vrows, vcols, vcols, vrows, false, nullptr); });
    check_family("transpose fp32 16-byte adding", {kernel("transpose", bytes(vin32) + bytes(vt32), bytes(vt32))},
                 {inout(vt32)}, [&] { transpose(vt32.ptr, vin32.ptr, vrows, vcols, vcols, vrows, true, nullptr); });
}

// ---- norm, residual ----
void test_rows() {
    const int T = 40, C = 128;
    const size_t n = size_t(T) * C;
    DeviceBuffer<bf16> x(uniform_bf16(n, -1, 1)), x0(uniform_bf16(n, -1, 1)), xb(uniform_bf16(n, -1, 1));
    DeviceBuffer<bf16> y(n), h(n), dy(uniform_bf16(n, -1, 1)), dx(n), dx0(n), dxb(n), g(uniform_bf16(n, -1, 1));
    DeviceBuffer<float> rstd(T), in_rstd(test::uniform_vector(T, 0.5, 2));
    DeviceBuffer<float> lambdas(test::uniform_vector(3, 0.5, 1.5)), lambda_grads(3);
    test::DevicePartials scratch(residual_backward_scratch_bytes(T));
    const double lam = bytes(lambdas) / 3;  // one fp32 scalar

    check_family("rmsnorm_forward", {kernel("rmsnorm_forward", bytes(x), bytes(y) + bytes(rstd))}, {out(y), out(rstd)},
                 [&] { rmsnorm_forward(y.ptr, rstd.ptr, x.ptr, T, C, nullptr); });
    check_family("rmsnorm_backward", {kernel("rmsnorm_backward", bytes(dy) + bytes(x) + bytes(in_rstd), bytes(dx))},
                 {out(dx)}, [&] { rmsnorm_backward(dx.ptr, dy.ptr, x.ptr, in_rstd.ptr, T, C, false, nullptr); });
    check_family("residual_add_backward",
                 {kernel("rmsnorm_backward", bytes(dy) + bytes(x) + bytes(in_rstd) + bytes(dx), bytes(dx))},
                 {inout(dx)}, [&] { residual_add_backward(dx.ptr, dy.ptr, x.ptr, in_rstd.ptr, T, C, nullptr); });

    const MixLambdas mix{lambdas.ptr, lambdas.ptr + 1, lambdas.ptr + 2};
    check_family("residual_mix_forward",
                 {kernel("residual_mix_forward", bytes(x) + bytes(x0) + bytes(xb) + 3 * lam,
                         bytes(y) + bytes(h) + bytes(rstd))},
                 {out(y), out(h), out(rstd)},
                 [&] { residual_mix_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, x0.ptr, xb.ptr, mix, false, T, C, nullptr); });
    check_family("residual_mix_forward first layer",  // x is x0: x0 is not read
                 {kernel("residual_mix_forward", bytes(x) + bytes(xb) + 3 * lam, bytes(y) + bytes(h) + bytes(rstd))},
                 {out(y), out(h), out(rstd)},
                 [&] { residual_mix_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, x.ptr, xb.ptr, mix, true, T, C, nullptr); });

    const int blocks = residual_backward_blocks(T);
    const double partials3 = 3.0 * blocks * sizeof(float), ticket = sizeof(unsigned int);
    // the reductions' second pass runs in the producer's last block: it reads the partials back and
    // writes the targets; the ticket counter is read and written (not poisoned: it must start at zero)
    const MixLambdaGrads mix_grads{lambda_grads.ptr, lambda_grads.ptr + 1, lambda_grads.ptr + 2};
    const double mix_in = bytes(g) + bytes(dy) + bytes(y) + bytes(in_rstd) + bytes(x) + bytes(x0) + bytes(xb) + 3 * lam;
    check_family("residual_mix_backward",
                 {kernel("residual_mix_backward", mix_in + partials3 + ticket,
                         bytes(dx) + bytes(dx0) + bytes(dxb) + partials3 + bytes(lambda_grads) + ticket)},
                 {out(dx), out(dx0), out(dxb), out(scratch.partials), out(lambda_grads), inout(scratch.done)}, [&] {
                     residual_mix_backward(dx.ptr, dx0.ptr, dxb.ptr, mix_grads, scratch.view(), g.ptr, dy.ptr, y.ptr,
                                           in_rstd.ptr, x.ptr, x0.ptr, xb.ptr, mix,
                                           {.first_layer = false, .accumulate_dx = false, .accumulate_x0_grads = false,
                                            .accumulate_lambda_grads = false},
                                           T, C, nullptr);
                 },
                 bytes(dx) + bytes(dx0) + bytes(dxb) + partials3 + bytes(lambda_grads));
    check_family("residual_mix_backward accumulating",
                 {kernel("residual_mix_backward",
                         mix_in + bytes(dx) + bytes(dx0) + bytes(dxb) + partials3 + bytes(lambda_grads) + ticket,
                         bytes(dx) + bytes(dx0) + bytes(dxb) + partials3 + bytes(lambda_grads) + ticket)},
                 {inout(dx), inout(dx0), inout(dxb), inout(lambda_grads), inout(scratch.done)}, [&] {
                     residual_mix_backward(dx.ptr, dx0.ptr, dxb.ptr, mix_grads, scratch.view(), g.ptr, dy.ptr, y.ptr,
                                           in_rstd.ptr, x.ptr, x0.ptr, xb.ptr, mix,
                                           {.first_layer = false, .accumulate_dx = true, .accumulate_x0_grads = true,
                                            .accumulate_lambda_grads = true},
                                           T, C, nullptr);
                 });

    {  // record 80's per-sublayer update and stream start, and record 84's narrow bigram (64 of 128 channels)
        DeviceBuffer<float> lam4(test::uniform_vector(4, 0.5, 1.5)), grads4(4), grad1(1);
        const SublayerLambdas sl{lam4.ptr, lam4.ptr + 1, lam4.ptr + 2, lam4.ptr + 3};
        const SublayerLambdaGrads sg{grads4.ptr, grads4.ptr + 1, grads4.ptr + 2, grads4.ptr + 3};
        const int bd = 64;
        DeviceBuffer<bf16> xbn(uniform_bf16(size_t(T) * bd, -1, 1)), dxbn(size_t(T) * bd);
        const double partials4 = 4.0 * blocks * sizeof(float), partials2 = 2.0 * blocks * sizeof(float),
                     partials1 = 1.0 * blocks * sizeof(float);
        // record 81's last layer: per-token lambdas (a row of 16 per token), their gradients written per token
        DeviceBuffer<float> lamt(test::uniform_vector(size_t(T) * 16, 0.5, 1.5)), gradt(size_t(T) * 16);
        const SublayerLambdas st{lamt.ptr + 8, lamt.ptr + 9, lamt.ptr + 10, lamt.ptr + 11, 16};
        const SublayerLambdaGrads sgt{gradt.ptr + 8, gradt.ptr + 9, gradt.ptr + 10, gradt.ptr + 11};
        // record 85: columns of the MUDD gate's 48 coefficients per token: x0's (5) and the bigram's (17), resid
        // and post shared; the stream start's bigram (3); layer 6's skip (28). The gradients' other columns keep
        // the poison, so only the used ones count as written.
        constexpr int kStride = 48;
        DeviceBuffer<float> cols(test::uniform_vector(size_t(T) * kStride, -1, 1)), dcols(size_t(T) * kStride);
        const double column = 4.0 * T;
        const SublayerLambdas si{lam4.ptr, lam4.ptr + 1, cols.ptr + 5, cols.ptr + 17, 0, kStride};
        const SublayerLambdaGrads sgi{grads4.ptr, grads4.ptr + 1, dcols.ptr + 5, dcols.ptr + 17};
        for (const int width : {0, bd}) {
            const bf16* xbp = width ? xbn.ptr : xb.ptr;
            DeviceBuffer<bf16>& dxbp = width ? dxbn : dxb;
            const double bb = width ? bytes(xbn) : bytes(xb);
            const std::string how = width ? " narrow bigram" : "";
            // the rows each direction reads and writes; the block output's gradient goes to h, its norm's gradient
            // is dy, the stream it read is y
            const double fwd_in = bytes(x) + bytes(g) + bytes(x0) + bb, fwd_out = bytes(y) + bytes(h) + bytes(rstd);
            const double bwd_in = bytes(g) + bytes(dy) + bytes(y) + bytes(rstd) + fwd_in,
                         bwd_out = bytes(dx) + bytes(h) + bytes(dx0) + bb;
            const auto forward = [&](const SublayerLambdas& l) {
                sublayer_residual_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, g.ptr, x0.ptr, xbp, l, Injection::x0_and_bigram,
                                          T, C, nullptr, width);
            };
            const auto backward = [&](const SublayerLambdas& l, const SublayerLambdaGrads& lg) {
                sublayer_residual_backward(dx.ptr, h.ptr, dx0.ptr, dxbp.ptr, lg, scratch.view(), g.ptr,
                                           NormGrads{{dy.ptr}}, y.ptr, rstd.ptr, x.ptr, g.ptr, x0.ptr, xbp, l,
                                           {.injection = Injection::x0_and_bigram, .accumulate_dx = false,
                                            .accumulate_x0_grads = false, .accumulate_lambda_grads = false,
                                            .bigram_dim = width},
                                           T, C, nullptr);
            };
            check_family("sublayer_residual_forward" + how,
                         {kernel("sublayer_residual_forward", fwd_in + 4 * lam, fwd_out)}, {out(y), out(h), out(rstd)},
                         [&] { forward(sl); });
            check_family("sublayer_residual_backward" + how,
                         {kernel("sublayer_residual_backward", bwd_in + 4 * lam + partials4 + ticket,
                                 bwd_out + partials4 + bytes(grads4) + ticket)},
                         {out(dx), out(h), out(dx0), out(dxbp), out(scratch.partials), out(grads4),
                          inout(scratch.done)},
                         [&] { backward(sl, sg); }, bwd_out + partials4 + bytes(grads4));
            check_family("sublayer_residual_forward per token" + how,
                         {kernel("sublayer_residual_forward", fwd_in + 4.0 * lam * T, fwd_out)},
                         {out(y), out(h), out(rstd)}, [&] { forward(st); });
            check_family("sublayer_residual_backward per token" + how,
                         {kernel("sublayer_residual_backward", bwd_in + 4.0 * lam * T, bwd_out + 4.0 * lam * T)},
                         {out(dx), out(h), out(dx0), out(dxbp), out(gradt)}, [&] { backward(st, sgt); });
            // record 85: resid's and post's sums through the partials; x0's and the bigram's per row, into their columns
            check_family("sublayer_residual_forward per-token injections" + how,
                         {kernel("sublayer_residual_forward", fwd_in + 2 * lam + 2 * column, fwd_out)},
                         {out(y), out(h), out(rstd)}, [&] { forward(si); });
            check_family("sublayer_residual_backward per-token injections" + how,
                         {kernel("sublayer_residual_backward", bwd_in + 2 * lam + 2 * column + partials2 + ticket,
                                 bwd_out + 2 * column + partials2 + 2 * lam + ticket)},
                         {out(dx), out(h), out(dx0), out(dxbp), out(dcols), out(scratch.partials), out(grads4),
                          inout(scratch.done)},
                         [&] { backward(si, sgi); }, bwd_out + 2 * column + partials2 + 2 * lam);

            // the stream start: one bigram lambda (partials), or record 85's per token (each row's gradient written)
            for (const bool per_token : {false, true}) {
                const float* lb = per_token ? cols.ptr + 3 : lam4.ptr;
                float* dlb = per_token ? dcols.ptr + 3 : grad1.ptr;
                const double lb_in = per_token ? column : lam, lb_out = per_token ? column : partials1 + bytes(grad1);
                const std::string at = (per_token ? " per token" : "") + how;
                check_family("stream_start_forward" + at,
                             {kernel("stream_start_forward", bytes(x0) + bb + lb_in, fwd_out)},
                             {out(y), out(h), out(rstd)}, [&] {
                                 stream_start_forward(y.ptr, h.ptr, rstd.ptr, x0.ptr, xbp, lb, T, C, nullptr, width,
                                                      per_token ? kStride : 0);
                             });
                std::vector<Output> outs = {out(dx0), out(dxbp), per_token ? out(dcols) : out(grad1)};
                if (!per_token) outs.insert(outs.end(), {out(scratch.partials), inout(scratch.done)});
                check_family("stream_start_backward" + at,
                             {kernel("stream_start_backward",
                                     bytes(g) + bytes(dy) + bytes(y) + bytes(rstd) + bb + lb_in +
                                         (per_token ? 0.0 : partials1 + ticket),
                                     bytes(dx0) + bb + lb_out + (per_token ? 0.0 : ticket))},
                             outs, [&] {
                                 stream_start_backward(dx0.ptr, dxbp.ptr, dlb, scratch.view(), g.ptr, dy.ptr, y.ptr,
                                                       rstd.ptr, xbp, lb,
                                                       {.accumulate_x0_grads = false, .accumulate_lambda_grads = false,
                                                        .bigram_dim = width, .token_stride = per_token ? kStride : 0},
                                                       T, C, nullptr);
                             },
                             bytes(dx0) + bb + lb_out);
            }
        }
        // record 85's layer-6 skip: G28[t] scales h3 (g here), skip_lambda an fp32 scalar
        check_family("token_skip_add_norm_forward",
                     {kernel("token_skip_add_norm_forward", bytes(x) + bytes(g) + column + lam,
                             bytes(y) + bytes(h) + bytes(rstd))},
                     {out(y), out(h), out(rstd)}, [&] {
                         token_skip_add_norm_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, g.ptr, cols.ptr + 28, kStride,
                                                     lambdas.ptr, T, C, nullptr);
                     });
        // one partial per block (lane 0 of each row's warp summed in the block), the last block's sum into d skip_lambda
        for (const bool acc : {false, true}) {
            const double added = acc ? bytes(dx) + lam : 0.0;
            std::vector<Output> outs = {out(dcols), out(scratch.partials), inout(scratch.done)};
            outs.push_back(acc ? inout(dx) : out(dx));
            outs.push_back(acc ? inout(lambda_grads) : out(lambda_grads));
            check_family(std::string("token_skip_add_backward") + (acc ? " accumulating" : ""),
                         {kernel("token_skip_add_backward",
                                 bytes(dy) + bytes(g) + column + lam + partials1 + added + ticket,
                                 bytes(dx) + column + partials1 + lam + ticket)},
                         outs, [&] {
                             token_skip_add_backward(dx.ptr, dcols.ptr + 28, lambda_grads.ptr, scratch.view(), dy.ptr,
                                                     g.ptr, cols.ptr + 28, kStride, lambdas.ptr,
                                                     {.accumulate_d_skip = acc, .accumulate_lambda_grad = acc}, T, C,
                                                     nullptr);
                         },
                         acc ? column + partials1 : bytes(dx) + column + partials1 + lam);
        }
    }

    DeviceBuffer<bf16> gate(test::gate_exact_weights(kGateWidth)), d_gate(kGateWidth);
    const double gate_cols = 2.0 * kGateWidth * T;  // the first 12 columns of a (T, C) bf16 tensor
    check_family("gated_skip_add_forward",
                 {kernel("gated_skip_add_forward", bytes(x) + bytes(g) + gate_cols + bytes(gate) + lam, bytes(y))},
                 {out(y)}, [&] { gated_skip_add_forward(y.ptr, x.ptr, g.ptr, x0.ptr, gate.ptr, lambdas.ptr, T, C, nullptr); });
    const double partials13 = 13.0 * blocks * sizeof(float);
    check_family("gated_skip_add_backward",
                 {kernel("gated_skip_add_backward",
                         bytes(g) + bytes(x) + 2 * gate_cols + bytes(gate) + lam + partials13 + ticket,
                         bytes(dx) + gate_cols + partials13 + bytes(d_gate) + lam + ticket)},
                 {out(dx), out(scratch.partials), out(d_gate), out(lambda_grads), inout(dx0), inout(scratch.done)}, [&] {
                     gated_skip_add_backward(dx.ptr, dx0.ptr, d_gate.ptr, lambda_grads.ptr, scratch.view(), g.ptr, x.ptr,
                                             x0.ptr, gate.ptr, lambdas.ptr,
                                             {.accumulate_d_skip = false, .accumulate_param_grads = false}, T, C,
                                             nullptr);
                 },
                 bytes(dx) + partials13 + bytes(d_gate) + lam);  // dx0's columns are updated in place

    check_family("residual_add_forward", {kernel("residual_add_forward", bytes(x) + bytes(g), bytes(y))}, {out(y)},
                 [&] { residual_add_forward(y.ptr, nullptr, nullptr, x.ptr, g.ptr, T, C, nullptr); });
    check_family("residual_add_forward with norm",
                 {kernel("residual_add_forward", bytes(x) + bytes(g), bytes(y) + bytes(h) + bytes(rstd))},
                 {out(y), out(h), out(rstd)},
                 [&] { residual_add_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, g.ptr, T, C, nullptr); });
    check_family("backout_forward",
                 {kernel("backout_forward", bytes(x) + bytes(g) + lam, bytes(y) + bytes(h) + bytes(rstd))},
                 {out(y), out(h), out(rstd)},
                 [&] { backout_forward(y.ptr, h.ptr, rstd.ptr, x.ptr, g.ptr, lambdas.ptr, T, C, nullptr); });
    const double partials1 = 1.0 * blocks * sizeof(float);
    check_family("backout_backward",
                 {kernel("backout_backward", bytes(dy) + bytes(x) + bytes(in_rstd) + bytes(g) + lam + partials1 + ticket,
                         bytes(dx) + bytes(dxb) + partials1 + lam + ticket)},
                 {out(dx), out(dxb), out(scratch.partials), out(lambda_grads), inout(scratch.done)}, [&] {
                     backout_backward(dx.ptr, dxb.ptr, lambda_grads.ptr, scratch.view(), dy.ptr, x.ptr, in_rstd.ptr, g.ptr,
                                      lambdas.ptr, false, T, C, nullptr);
                 },
                 bytes(dx) + bytes(dxb) + partials1 + lam);
}

// ---- matmul ----
void test_matmul(CublasLt& lt) {
    const int M = 32, N = 48, K = 64, B = 3;
    DeviceBuffer<bf16> a(uniform_bf16(M * K, -1, 1)), b(uniform_bf16(B * K * N, -1, 1)), c(uniform_bf16(B * M * N, -1, 1));
    DeviceBuffer<bf16> o(B * M * N);
    const MatmulBatch batch{B, 0, int64_t(K) * N, int64_t(M) * N};  // a shared by the batch: read once
    auto ops = check_family("matmul_bf16 batched, separate c",
                            {gemm("gemm_test", bytes(a) + bytes(b) + bytes(c), bytes(o))}, {out(o)}, [&] {
                                matmul_bf16(lt, o.ptr, a.ptr, false, b.ptr, false, M, N, K, nullptr, 1.0f, 0.5f, c.ptr,
                                            batch, "gemm_test");
                            });
    if (ops.size() == 1) check_gemm_shape("matmul_bf16 batched", ops[0], GemmType::bf16, N, M, K, B);

    DeviceBuffer<bf16> w(uniform_bf16(N * K, -1, 1));
    DeviceBuffer<float> o32(M * N);
    ops = check_family("matmul_forward", {gemm("gemm_bf16", bytes(a) + bytes(w), bytes(o32))}, {out(o32)},
                       [&] { matmul_forward(lt, o32.ptr, a.ptr, w.ptr, M, N, K, nullptr); });
    if (ops.size() == 1) check_gemm_shape("matmul_forward", ops[0], GemmType::bf16, N, M, K, 1);
    check_family("matmul_forward accumulating", {gemm("gemm_fc", bytes(a) + bytes(w) + bytes(o32), bytes(o32))},
                 {inout(o32)}, [&] { matmul_forward(lt, o32.ptr, a.ptr, w.ptr, M, N, K, nullptr, true, "gemm_fc"); });

    std::vector<__nv_fp8_e4m3> a8(M * K), b8(N * K);
    for (auto& v : a8) v = __nv_fp8_e4m3(static_cast<float>(test::uniform(-2, 2)));
    for (auto& v : b8) v = __nv_fp8_e4m3(static_cast<float>(test::uniform(-2, 2)));
    DeviceBuffer<__nv_fp8_e4m3> da8(a8), db8(b8);
    DeviceBuffer<float> scales(std::vector<float>{0.5f, 0, 0, 0, 0.25f});  // each scale 16-byte aligned
    DeviceBuffer<bf16> o8(M * N);
    ops = check_family("matmul_fp8", {gemm("gemm_fp8", bytes(da8) + bytes(db8) + 2 * sizeof(float), bytes(o8))}, {out(o8)},
                       [&] { matmul_fp8(lt, o8.ptr, da8.ptr, scales.ptr, db8.ptr, scales.ptr + 4, M, N, K, nullptr); });
    if (ops.size() == 1) check_gemm_shape("matmul_fp8", ops[0], GemmType::fp8, N, M, K, 1);
}

// ---- the FP8 up-projection: the weights' two launches, the input's two, the e4m3 GEMM on both
// kernels, and mlp_forward_fp8 (the scratch partials and the ticket counter are written too, so the
// poisoned outputs show only the tensors) ----
void test_mlp_fp8(CublasLt& lt) {
    const int T = 128, C = 128, H = 256, L = 3;
    const size_t ntc = size_t(T) * C, nth = size_t(T) * H, nhc = size_t(H) * C;
    const double tc = double(ntc), hc = double(nhc);
    DeviceBuffer<bf16> bank(uniform_bf16(L * 2 * nhc, -0.2, 0.2)), x(uniform_bf16(ntc, -1, 1));
    DeviceBuffer<bf16> c_proj(uniform_bf16(nhc, -0.2, 0.2)), pre(nth), post(nth), o(ntc);
    DeviceBuffer<__nv_fp8_e4m3> w(L * nhc), xq(ntc);
    DeviceBuffer<float> scale(L);
    DeviceBuffer<Fp8UpScales> scales(1);
    test::DevicePartials wp(mlp_fp8_weight_scratch_floats(L, H, C) * sizeof(float)),
        xp(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    const double wpb = 4.0 * mlp_fp8_weight_scratch_floats(L, H, C), xpb = 4.0 * mlp_fp8_input_scratch_floats(T, C);
    check_family("mlp_fp8_quantize_weights",
                 {kernel("mlp_fp8_weight_scale", 2 * L * hc + wpb + 4, wpb + 4.0 * L + 4),
                  kernel("mlp_fp8_quantize_weights", 2 * L * hc + 4.0 * L, L * hc)},
                 {out(w), out(scale)},
                 [&] { mlp_fp8_quantize_weights({w.ptr, scale.ptr}, {bank.ptr, 2 * int64_t(H) * C, L}, H, C, wp.view(), nullptr); },
                 bytes(w) + bytes(scale));
    const Fp8Up up{w.ptr + size_t(2) * H * C, scale.ptr + 2, xq.ptr, scales.ptr, xp.view()};
    check_family("mlp_fp8_quantize_input",
                 {kernel("mlp_fp8_input_amax", 2 * tc + xpb + 8, xpb + sizeof(Fp8UpScales) + 4),
                  kernel("mlp_fp8_quantize_input", 2 * tc + 4, tc)},
                 {out(xq), out(scales)}, [&] { mlp_fp8_quantize_input(up, x.ptr, T, C, nullptr); },
                 bytes(xq) + bytes(scales));
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string fc = std::string(" (") + mlp_kernel_name(k) + ")";
        const auto ops = check_family("linear_relu_square_forward_fp8" + fc,
                                      {kernel("linear_relu_square_forward_fp8", tc + hc + 4, bytes(pre) + bytes(post))},
                                      {out(pre), out(post)},
                                      [&] { linear_relu_square_forward_fp8(k, pre.ptr, post.ptr, up, T, C, H, nullptr); });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == 2.0 * T * C * H, "linear_relu_square_forward_fp8%s: tc_flops %.0f, want 2 T C H",
                        fc.c_str(), ops[0].work.tc_flops);
    }
    check_family("mlp_forward_fp8",
                 {kernel("mlp_fp8_input_amax", 2 * tc + xpb + 8, xpb + sizeof(Fp8UpScales) + 4),
                  kernel("mlp_fp8_quantize_input", 2 * tc + 4, tc),
                  kernel("linear_relu_square_forward_fp8", tc + hc + 4, bytes(pre) + bytes(post)),
                  gemm("gemm_mlp_proj", bytes(post) + bytes(c_proj), bytes(o))},
                 {out(xq), out(pre), out(post), out(o)},
                 [&] { mlp_forward_fp8(lt, MlpKernel::wgmma, o.ptr, pre.ptr, post.ptr, x.ptr, up, c_proj.ptr, T, C, H, nullptr); },
                 bytes(xq) + bytes(pre) + bytes(post) + bytes(o));
    // record 87 on the FP8 up-projection: post only (pre null)
    const ReluSquareSaves post_only = ReluSquareSaves::post_only;
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string fc = std::string(" post only (") + mlp_kernel_name(k) + ")";
        check_family("linear_relu_square_forward_fp8" + fc,
                     {kernel("linear_relu_square_forward_fp8", tc + hc + 4, bytes(post))}, {out(post)},
                     [&] { linear_relu_square_forward_fp8(k, nullptr, post.ptr, up, T, C, H, nullptr, post_only); });
    }
    check_family("mlp_forward_fp8 post only",
                 {kernel("mlp_fp8_input_amax", 2 * tc + xpb + 8, xpb + sizeof(Fp8UpScales) + 4),
                  kernel("mlp_fp8_quantize_input", 2 * tc + 4, tc),
                  kernel("linear_relu_square_forward_fp8", tc + hc + 4, bytes(post)),
                  gemm("gemm_mlp_proj", bytes(post) + bytes(c_proj), bytes(o))},
                 {out(xq), out(post), out(o)},
                 [&] { mlp_forward_fp8(lt, MlpKernel::wgmma, o.ptr, nullptr, post.ptr, x.ptr, up, c_proj.ptr, T, C, H, nullptr, post_only); },
                 bytes(xq) + bytes(post) + bytes(o));

    // record 89: the FP8 down-projection with delayed scales. W2 is the bank's second matrix of each layer; the
    // scales are checked as fp32 slots (act, used, next and their pads), so only the slots written count.
    DeviceBuffer<__nv_fp8_e4m3> w2q(L * nhc), postq(nth);
    const std::vector<MlpDownScales> ones(L);
    DeviceBuffer<MlpDownScales> down(ones);
    const Output slots{down.ptr, size_t(L) * kMlpDownScaleStride, sizeof(float), true};
    const Output slots_inout{down.ptr, size_t(L) * kMlpDownScaleStride, sizeof(float), false};
    const MlpProjBank proj{bank.ptr + nhc, 2 * int64_t(H) * C, L};
    const double tiles = 4.0 * L * mlp_fp8_down_weight_tiles(H, C);  // the tiles' amax partials
    test::DevicePartials dwp(mlp_fp8_down_weight_scratch_floats(L, H, C) * sizeof(float));
    // bootstrap: next from W2's amax (the up-projection's kernel, over the same scratch), then used and W2q, then
    // next again; the scratch's partials overlap (the larger set counts once), the slots written are used and next
    check_family("mlp_fp8_down_quantize_weights bootstrap",
                 {kernel("mlp_fp8_weight_scale", 2 * L * hc + wpb + 4, wpb + 4.0 * L + 4),
                  kernel("mlp_fp8_down_quantize", 2 * L * hc + 4.0 * L, L * hc + tiles + 4.0 * L),
                  kernel("mlp_fp8_down_weight_scales", tiles, 4.0 * L)},
                 {out(w2q), slots, out(dwp.partials), inout(dwp.done)},
                 [&] {
                     mlp_fp8_down_quantize_weights({w2q.ptr, down.ptr}, proj, H, C, MlpDownScaling::bootstrap,
                                                   dwp.view(), nullptr);
                 },
                 bytes(w2q) + 8.0 * L + std::max(wpb, tiles));
    down.upload(ones);
    check_family("mlp_fp8_down_quantize_weights delayed",  // next is read: the slots are updated in place
                 {kernel("mlp_fp8_down_quantize", 2 * L * hc + 4.0 * L, L * hc + tiles + 4.0 * L),
                  kernel("mlp_fp8_down_weight_scales", tiles, 4.0 * L)},
                 {out(w2q), out(dwp.partials), slots_inout},
                 [&] {
                     mlp_fp8_down_quantize_weights({w2q.ptr, down.ptr}, proj, H, C, MlpDownScaling::delayed,
                                                   dwp.view(), nullptr);
                 },
                 bytes(w2q) + tiles);
    // the post-only up-projection's e4m3 epilogue: post, postq and one amax partial per warp of each tile
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string fc = std::string(" (") + mlp_kernel_name(k) + ")";
        DeviceBuffer<float> act_partials(mlp_fp8_down_act_partials(k, T, H));
        const Fp8DownAct act{postq.ptr, act_partials.ptr, &down.ptr->act};
        const auto ops = check_family("linear_relu_square_forward_fp8_down" + fc,
                                      {kernel("linear_relu_square_forward_fp8_down", tc + hc + 8,
                                              bytes(post) + bytes(postq) + bytes(act_partials))},
                                      {out(post), out(postq), out(act_partials)},
                                      [&] { linear_relu_square_forward_fp8_down(k, post.ptr, act, up, T, C, H, nullptr); });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == 2.0 * T * C * H,
                        "linear_relu_square_forward_fp8_down%s: tc_flops %.0f, want 2 T C H", fc.c_str(),
                        ops[0].work.tc_flops);
        // record 89's PR on record 84: pre too (Fp8DownAct::pre)
        DeviceBuffer<bf16> pre(size_t(T) * H);
        const Fp8DownAct act_pre{postq.ptr, act_partials.ptr, &down.ptr->act, pre.ptr};
        check_family("linear_relu_square_forward_fp8_down with pre" + fc,
                     {kernel("linear_relu_square_forward_fp8_down", tc + hc + 8,
                             bytes(pre) + bytes(post) + bytes(postq) + bytes(act_partials))},
                     {out(pre), out(post), out(postq), out(act_partials)},
                     [&] { linear_relu_square_forward_fp8_down(k, post.ptr, act_pre, up, T, C, H, nullptr); });
    }
    {  // every layer's act from its partials: only the act slots are written
        const int64_t count = mlp_fp8_down_act_partials(MlpKernel::wgmma, T, H);
        DeviceBuffer<float> partials(test::uniform_vector(size_t(L * count), 0, 4));
        check_family("mlp_fp8_down_act_scales",
                     {kernel("mlp_fp8_down_act_scales", bytes(partials), 4.0 * L)}, {slots},
                     [&] { mlp_fp8_down_act_scales(down.ptr, partials.ptr, count, L, nullptr); });
        down.upload(ones);
    }
    // layer 1's down-projection (cuBLASLt FP8: postq, W2q and the act and used scales)
    const auto proj_ops = check_family(
        "mlp_fp8_down_proj", {gemm("gemm_mlp_proj_fp8", bytes(postq) + hc + 2 * sizeof(float), bytes(o))}, {out(o)},
        [&] { mlp_fp8_down_proj(lt, o.ptr, postq.ptr, w2q.ptr + nhc, down.ptr + 1, T, C, H, nullptr); });
    if (proj_ops.size() == 1) check_gemm_shape("mlp_fp8_down_proj", proj_ops[0], GemmType::fp8, C, T, H, 1);
    {
        DeviceBuffer<float> act_partials(mlp_fp8_down_act_partials(MlpKernel::wgmma, T, H));
        check_family("mlp_forward_fp8_down",
                     {kernel("mlp_fp8_input_amax", 2 * tc + xpb + 8, xpb + sizeof(Fp8UpScales) + 4),
                      kernel("mlp_fp8_quantize_input", 2 * tc + 4, tc),
                      kernel("linear_relu_square_forward_fp8_down", tc + hc + 8,
                             bytes(post) + bytes(postq) + bytes(act_partials)),
                      gemm("gemm_mlp_proj_fp8", bytes(postq) + hc + 2 * sizeof(float), bytes(o))},
                     {out(xq), out(post), out(postq), out(act_partials), out(o)},
                     [&] {
                         mlp_forward_fp8_down(lt, MlpKernel::wgmma, o.ptr, post.ptr, postq.ptr, act_partials.ptr, x.ptr,
                                              up, w2q.ptr + nhc, down.ptr + 1, T, C, H, nullptr);
                     },
                     bytes(xq) + bytes(post) + bytes(postq) + bytes(act_partials) + bytes(o));
    }
}

// ---- mlp ----
void test_mlp(CublasLt& lt) {
    const int T = 128, C = 64, H = 256;  // whole tiles of the c_fc kernel
    const size_t tc = size_t(T) * C, th = size_t(T) * H, hc = size_t(H) * C;
    DeviceBuffer<bf16> x(uniform_bf16(tc, -1, 1)), c_fc(uniform_bf16(hc, -0.2, 0.2)), c_proj(uniform_bf16(hc, -0.2, 0.2));
    DeviceBuffer<bf16> pre(uniform_bf16(th, -1, 1)), post(th), o(tc), dout(uniform_bf16(tc, -1, 1)), dx(tc), dc_fc(hc), dc_proj(hc), dpre(th);

    check_family("relu_square_forward", {kernel("relu_square_forward", bytes(pre), bytes(post))}, {out(post)},
                 [&] { relu_square_forward(post.ptr, pre.ptr, int64_t(th), nullptr); });
    check_family("relu_square_backward", {kernel("relu_square_backward", bytes(post) + bytes(pre), bytes(dpre))},
                 {out(dpre)}, [&] { relu_square_backward(dpre.ptr, post.ptr, pre.ptr, int64_t(th), nullptr); });

    std::vector<StepOp> ops;
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string fc = std::string(" (") + mlp_kernel_name(k) + ")";
        ops = check_family("linear_relu_square_forward" + fc,
                           {kernel("linear_relu_square_forward", bytes(x) + bytes(c_fc), bytes(pre) + bytes(post))},
                           {out(pre), out(post)},
                           [&] { linear_relu_square_forward(k, pre.ptr, post.ptr, x.ptr, c_fc.ptr, T, C, H, nullptr); });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == 2.0 * T * C * H, "linear_relu_square_forward%s: tc_flops %.0f, want 2 T C H",
                        fc.c_str(), ops[0].work.tc_flops);
        // Off the tiles: T 48, C 72, H 264 run as 128 rows over 128 of depth (64-wide k-steps) and 384
        // columns in 128-column tiles (mma) or 512 in 256-column tiles (wgmma), the padding computed too.
        {
            const int t = 48, c = 72, hh = 264, cols = k == MlpKernel::wgmma ? 512 : 384;
            DeviceBuffer<bf16> xs(uniform_bf16(size_t(t) * c, -1, 1)), ws(uniform_bf16(size_t(hh) * c, -1, 1));
            DeviceBuffer<bf16> ps(size_t(t) * hh), qs(size_t(t) * hh);
            ops = check_family("linear_relu_square_forward off the tiles" + fc,
                               {kernel("linear_relu_square_forward", bytes(xs) + bytes(ws), bytes(ps) + bytes(qs))},
                               {out(ps), out(qs)},
                               [&] { linear_relu_square_forward(k, ps.ptr, qs.ptr, xs.ptr, ws.ptr, t, c, hh, nullptr); });
            if (ops.size() == 1)
                test::check(ops[0].work.tc_flops == 2.0 * 128 * cols * 128,
                            "linear_relu_square_forward off the tiles%s: tc_flops %.0f, want 2 x 128 x %d x 128",
                            fc.c_str(), ops[0].work.tc_flops, cols);
        }

        ops = check_family("linear_relu_square_backward" + fc,
                           {kernel("linear_relu_square_backward", bytes(dout) + bytes(c_proj) + bytes(pre), bytes(dpre))},
                           {out(dpre)},
                           [&] { linear_relu_square_backward(k, dpre.ptr, dout.ptr, c_proj.ptr, pre.ptr, T, C, H, nullptr); });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == 2.0 * T * C * H, "linear_relu_square_backward%s: tc_flops %.0f, want 2 T C H",
                        fc.c_str(), ops[0].work.tc_flops);
    }

    // record 87: post only. The forward writes no pre; the backward reads post in pre's place (sqrt(post))
    const ReluSquareSaves post_only = ReluSquareSaves::post_only;
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string fc = std::string(" post only (") + mlp_kernel_name(k) + ")";
        ops = check_family("linear_relu_square_forward" + fc,
                           {kernel("linear_relu_square_forward", bytes(x) + bytes(c_fc), bytes(post))}, {out(post)},
                           [&] { linear_relu_square_forward(k, nullptr, post.ptr, x.ptr, c_fc.ptr, T, C, H, nullptr, post_only); });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == 2.0 * T * C * H, "linear_relu_square_forward%s: tc_flops %.0f, want 2 T C H",
                        fc.c_str(), ops[0].work.tc_flops);
        check_family("linear_relu_square_backward" + fc,
                     {kernel("linear_relu_square_backward", bytes(dout) + bytes(c_proj) + bytes(post), bytes(dpre))},
                     {out(dpre)},
                     [&] { linear_relu_square_backward(k, dpre.ptr, dout.ptr, c_proj.ptr, post.ptr, T, C, H, nullptr, post_only); });
    }
    check_family("relu_square_backward post only", {kernel("relu_square_backward", bytes(pre) + bytes(post), bytes(dpre))},
                 {out(dpre)}, [&] { relu_square_backward(dpre.ptr, pre.ptr, post.ptr, int64_t(th), nullptr, post_only); });
    ops = check_family("mlp_forward post only",
                       {kernel("linear_relu_square_forward", bytes(x) + bytes(c_fc), bytes(post)),
                        gemm("gemm_mlp_proj", bytes(post) + bytes(c_proj), bytes(o))},
                       {out(post), out(o)},
                       [&] { mlp_forward(lt, MlpKernel::wgmma, o.ptr, nullptr, post.ptr, x.ptr, c_fc.ptr, c_proj.ptr, T, C, H, nullptr, post_only); });
    if (ops.size() == 2) check_gemm_shape("gemm_mlp_proj", ops[1], GemmType::bf16, C, T, H, 1);
    {  // dpre apart, and in the post buffer (the trainer's layout: post is read, then overwritten by dpre)
        DeviceBuffer<bf16> post2(th);
        CUDA_CHECK(cudaMemcpy(post2.ptr, post.ptr, bytes(post), cudaMemcpyDeviceToDevice));
        const double t_h = bytes(post);  // post and dpre: (T, H) bf16
        for (const bool in_place : {false, true}) {
            bf16* dp = in_place ? post2.ptr : dpre.ptr;
            const bf16* saved = in_place ? post2.ptr : post.ptr;
            check_family(std::string("mlp_backward post only") + (in_place ? ", dpre in post" : ""),
                         {gemm("gemm_mlp_proj_dw", t_h + bytes(dout), bytes(dc_proj)),
                          kernel("linear_relu_square_backward", bytes(dout) + bytes(c_proj) + t_h, t_h),
                          gemm("gemm_mlp_fc_dw", t_h + bytes(x), bytes(dc_fc)),
                          gemm("gemm_mlp_fc_dx", t_h + bytes(c_fc), bytes(dx))},
                         {out(dx), out(dc_fc), out(dc_proj), in_place ? inout(post2) : out(dpre)}, [&] {
                             mlp_backward(lt, MlpKernel::wgmma, dx.ptr, dc_fc.ptr, dc_proj.ptr, false, dp, dout.ptr,
                                          x.ptr, c_fc.ptr, c_proj.ptr, nullptr, saved, T, C, H, nullptr, post_only);
                         },
                         bytes(dx) + bytes(dc_fc) + bytes(dc_proj) + (in_place ? 0.0 : t_h));
        }
    }

    ops = check_family("mlp_forward",
                       {kernel("linear_relu_square_forward", bytes(x) + bytes(c_fc), bytes(pre) + bytes(post)),
                        gemm("gemm_mlp_proj", bytes(post) + bytes(c_proj), bytes(o))},
                       {out(pre), out(post), out(o)},
                       [&] { mlp_forward(lt, MlpKernel::wgmma, o.ptr, pre.ptr, post.ptr, x.ptr, c_fc.ptr, c_proj.ptr, T, C, H, nullptr); });
    if (ops.size() == 2) check_gemm_shape("gemm_mlp_proj", ops[1], GemmType::bf16, C, T, H, 1);
    ops = check_family("mlp_backward",
                       {gemm("gemm_mlp_proj_dw", bytes(post) + bytes(dout), bytes(dc_proj)),
                        kernel("linear_relu_square_backward", bytes(dout) + bytes(c_proj) + bytes(pre), bytes(dpre)),
                        gemm("gemm_mlp_fc_dw", bytes(dpre) + bytes(x), bytes(dc_fc)),
                        gemm("gemm_mlp_fc_dx", bytes(dpre) + bytes(c_fc), bytes(dx))},
                       {out(dx), out(dc_fc), out(dc_proj), out(dpre)}, [&] {
                           mlp_backward(lt, MlpKernel::wgmma, dx.ptr, dc_fc.ptr, dc_proj.ptr, false, dpre.ptr, dout.ptr, x.ptr, c_fc.ptr,
                                        c_proj.ptr, pre.ptr, post.ptr, T, C, H, nullptr);
                       });
    if (ops.size() == 4) {
        check_gemm_shape("gemm_mlp_proj_dw", ops[0], GemmType::bf16, C, H, T, 1);
        check_gemm_shape("gemm_mlp_fc_dx", ops[3], GemmType::bf16, C, T, H, 1);
    }
    // Past the fused kernel's 65535 row tiles, dpre is cuBLASLt's product then relu_square_backward
    // (written twice). Dry run only: the pointers are never dereferenced.
    {
        const int t = 65535 * kFcTileRows + 8, c = 8, hh = 16;
        const double tc_b = 2.0 * t * c, th_b = 2.0 * t * hh, hc_b = 2.0 * hh * c;
        const auto fake = [](int i) { return reinterpret_cast<bf16*>(uintptr_t(256) * i); };  // distinct tensors
        const std::vector<Want> want = {gemm("gemm_mlp_proj_dw", th_b + tc_b, hc_b),
                                        gemm("gemm_mlp_proj_dx", tc_b + hc_b, th_b),
                                        kernel("relu_square_backward", 2 * th_b, th_b),
                                        gemm("gemm_mlp_fc_dw", th_b + tc_b, hc_b),
                                        gemm("gemm_mlp_fc_dx", th_b + hc_b, tc_b)};
        for (const ReluSquareSaves saves : {ReluSquareSaves::pre_and_post, ReluSquareSaves::post_only}) {
            // post only: pre null, relu_square_backward reads post in its place
            const bf16* pre_p = saves == ReluSquareSaves::post_only ? nullptr : fake(9);
            const std::vector<StepOp> big = record(true, [&] {
                mlp_backward(lt, MlpKernel::wgmma, fake(1), fake(2), fake(3), false, fake(4), fake(5), fake(6), fake(7),
                             fake(8), pre_p, fake(10), t, c, hh, nullptr, saves);
            });
            bool same = big.size() == want.size();
            for (size_t i = 0; same && i < want.size(); ++i)
                same = big[i].kind == want[i].kind && big[i].work.name == want[i].name &&
                       big[i].work.bytes_read == want[i].read && big[i].work.bytes_written == want[i].written;
            test::check(same, "mlp_backward (%s) past 65535 row tiles: cuBLASLt + relu_square_backward (%zu ops)",
                        relu_square_saves_name(saves), big.size());
        }
    }

    // a layer's two weights in one launch each way (here of 4096 and 1024 elements, one buffer each)
    const int64_t n1 = 4096, n2 = 1024, n = n1 + n2;
    DeviceBuffer<bf16> w(uniform_bf16(n, -1, 1)), w_eff(n), dw_eff(uniform_bf16(n, -1, 1)), dw(n);
    DeviceBuffer<float> lambda(std::vector<float>{0.7f, 0.4f}), dlambda(2);
    test::DevicePartials scratch(lambda_scaled_weight_backward_scratch_bytes({n1, n2}));
    check_family("lambda_scaled_weight_forward",
                 {kernel("lambda_scaled_weight_forward", bytes(w) + bytes(lambda), bytes(w_eff))}, {out(w_eff)}, [&] {
                     lambda_scaled_weight_forward(
                         {{w_eff.ptr, w.ptr, lambda.ptr, n1}, {w_eff.ptr + n1, w.ptr + n1, lambda.ptr + 1, n2}}, nullptr);
                 });
    // the partials (one per block) are read back by the last block, which also draws and resets the ticket
    const double partials = bytes(scratch.partials), ticket = sizeof(unsigned int);
    check_family("lambda_scaled_weight_backward",
                 {kernel("lambda_scaled_weight_backward", bytes(dw_eff) + bytes(w) + bytes(lambda) + partials + ticket,
                         bytes(dw) + partials + bytes(dlambda) + ticket)},
                 {out(dw), out(scratch.partials), out(dlambda), inout(scratch.done)}, [&] {
                     lambda_scaled_weight_backward(
                         {{dw.ptr, dlambda.ptr, dw_eff.ptr, w.ptr, lambda.ptr, n1},
                          {dw.ptr + n1, dlambda.ptr + 1, dw_eff.ptr + n1, w.ptr + n1, lambda.ptr + 1, n2}},
                         scratch.view(), {.dw = false, .dlambda = false}, nullptr);
                 },
                 bytes(dw) + partials + bytes(dlambda));
}

// ---- attention ----
struct AttnCase {
    const char* name;
    int T, H;
    std::vector<int> cu;
    int window;
    bool paired;
    bool skips;  // the documents and window leave some causal tiles unvisited
};
// The tile pairs the kernels visit, by walking every row: row i of the view (2T rows of H/2 heads for
// paired heads, the bounds doubled) sees key j iff both lie in one document and i - window <= j <= i.
struct TilePairs {
    long q_k = 0;    // (64-row query tile, 64-key tile) pairs with a visible (query, key) in them
    long k_q = 0;    // (64-key tile, 32-query sub-tile) pairs likewise
    long k_q64 = 0;  // (64-key tile, 64-query tile) pairs likewise (the wgmma dk/dv kernel's)
};
TilePairs visited_tiles(const AttnCase& c) {
    const int rows = c.paired ? 2 * c.T : c.T, mult = c.paired ? 2 : 1;
    const int window = c.window <= 0 || c.window > rows ? rows : c.window;
    std::vector<int> doc(rows);
    for (int i = 0, d = 0; i < rows; ++i) {
        while (d + 1 < int(c.cu.size()) && c.cu[d + 1] * mult <= i) ++d;
        doc[i] = d;
    }
    std::set<std::pair<int, int>> q_k, k_q, k_q64;
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j <= i; ++j)
            if (doc[i] == doc[j] && i - window <= j) {
                q_k.insert({i / 64, j / 64});
                k_q.insert({j / 64, i / 32});
                k_q64.insert({j / 64, i / 64});
            }
    return {long(q_k.size()), long(k_q.size()), long(k_q64.size())};
}

void test_attention_case(const AttnCase& c) {
    const int D = 64, rows = c.paired ? 2 * c.T : c.T, heads = c.paired ? c.H / 2 : c.H;
    const size_t n = size_t(c.T) * c.H * D;
    DeviceBuffer<bf16> q(uniform_bf16(n, -1, 1)), k(uniform_bf16(n, -1, 1)), v(uniform_bf16(n, -1, 1));
    DeviceBuffer<bf16> o(n), dout(uniform_bf16(n, -1, 1)), dq(n), dk(n), dv(n);
    DeviceBuffer<float> lse(size_t(c.T) * c.H);
    DeviceBuffer<int> cu(c.cu);
    const int num_cu = int(c.cu.size());
    const float scale = 0.12f;
    const TilePairs pairs = visited_tiles(c);
    const double tile_qk = 2.0 * 64 * 64 * D, tile_kq = 2.0 * 64 * 32 * D;  // one tile product
    const std::string tag = std::string("attention ") + c.name;

    // both forward kernels visit the same tiles (the wgmma one in pairs of 64-row tiles per block)
    for (AttentionKernel fk : {AttentionKernel::mma, AttentionKernel::wgmma}) {
        const std::string ftag = tag + (fk == AttentionKernel::mma ? " forward (mma)" : " forward (wgmma)");
        const auto ops = check_family(
            ftag, {kernel("attention_forward", bytes(q) + bytes(k) + bytes(v) + bytes(cu), bytes(o) + bytes(lse))},
            {out(o), out(lse)}, [&] {
                attention_forward(o.ptr, lse.ptr, q.ptr, k.ptr, v.ptr, cu.ptr, num_cu, c.T, c.H, D, c.window, c.paired,
                                  scale, nullptr, c.cu.data(), fk);
            });
        if (ops.size() == 1)
            test::check(ops[0].work.tc_flops == pairs.q_k * heads * 2 * tile_qk,
                        "%s: tc_flops %.0f, want %ld tile pairs x %d heads x 2 products", ftag.c_str(),
                        ops[0].work.tc_flops, pairs.q_k, heads);
    }
    const long tiles = (rows + 63) / 64, causal = tiles * (tiles + 1) / 2;
    test::check(c.skips ? pairs.q_k < causal : pairs.q_k == causal, "%s: %ld tile pairs of the %ld causal ones",
                tag.c_str(), pairs.q_k, causal);

    const size_t ws_det = attention_backward_workspace_bytes(c.T, c.H, D);
    DeviceBuffer<float> ws(attention_backward_workspace_bytes(c.T, c.H, D, AttentionBackwardMode::atomic_dq) / 4);
    const double delta = 4.0 * c.T * c.H, dq_sum = 4.0 * n;  // fp32 (H, T) and (T, H, D)
    const double inputs = bytes(q) + bytes(k) + bytes(v) + bytes(dout) + bytes(lse) + delta + bytes(cu);
    // the wgmma dk/dv kernel streams 64-query tiles where the mma.sync one streams 32
    for (AttentionKernel bk : {AttentionKernel::mma, AttentionKernel::wgmma}) {
        const std::string btag = tag + (bk == AttentionKernel::mma ? " backward (mma)" : " backward (wgmma)");
        const auto ops = check_family(btag,
                                      {kernel("attention_backward", bytes(dout) + bytes(o), delta),
                                       kernel("attention_backward", inputs, bytes(dk) + bytes(dv)),
                                       kernel("attention_backward", inputs, bytes(dq))},
                                      {out(dq), out(dk), out(dv), out(ws)}, [&] {
                                          attention_backward(dq.ptr, dk.ptr, dv.ptr, dout.ptr, o.ptr, lse.ptr, q.ptr,
                                                             k.ptr, v.ptr, cu.ptr, num_cu, c.T, c.H, D, c.window,
                                                             c.paired, scale, ws.ptr, ws_det, nullptr,
                                                             AttentionBackwardMode::deterministic, c.cu.data(), bk);
                                      });
        if (ops.size() == 3) {
            const long k_q = bk == AttentionKernel::mma ? pairs.k_q : pairs.k_q64;
            const double tile = bk == AttentionKernel::mma ? tile_kq : tile_qk;
            test::check(ops[1].work.tc_flops == k_q * heads * 4 * tile,
                        "%s dk/dv: tc_flops %.0f, want %ld tile pairs x %d heads x 4 products", btag.c_str(),
                        ops[1].work.tc_flops, k_q, heads);
            test::check(ops[2].work.tc_flops == pairs.q_k * heads * 3 * tile_qk,
                        "%s dq: tc_flops %.0f, want %ld tile pairs x %d heads x 3 products", btag.c_str(),
                        ops[2].work.tc_flops, pairs.q_k, heads);
        }
    }
    // atomic dq: the fp32 sum is zeroed, added into (read and written) and converted; its bytes are
    // written twice by the ops, once in memory
    auto ops = check_family(tag + " backward, atomic dq",
                            {kernel("attention_backward", bytes(dout) + bytes(o), delta),
                             {OpKind::memset, "memset", 0, dq_sum},
                             kernel("attention_backward", inputs + dq_sum, bytes(dk) + bytes(dv) + dq_sum),
                             kernel("attention_backward", dq_sum, bytes(dq))},
                            {out(dq), out(dk), out(dv), out(ws)}, [&] {
                                attention_backward(dq.ptr, dk.ptr, dv.ptr, dout.ptr, o.ptr, lse.ptr, q.ptr, k.ptr, v.ptr,
                                                   cu.ptr, num_cu, c.T, c.H, D, c.window, c.paired, scale, ws.ptr,
                                                   ws.n * sizeof(float), nullptr, AttentionBackwardMode::atomic_dq,
                                                   c.cu.data());
                            },
                            bytes(dq) + bytes(dk) + bytes(dv) + delta + dq_sum);
    if (ops.size() == 4)
        test::check(ops[2].work.tc_flops == pairs.k_q * heads * 5 * tile_kq,
                    "%s backward dk/dv with atomic dq: tc_flops %.0f, want %ld tile pairs x %d heads x 5 products",
                    tag.c_str(), ops[2].work.tc_flops, pairs.k_q, heads);
}

void test_attention() {
    test_attention_case({"three documents, window 96", 256, 2, {0, 70, 150, 256}, 96, false, true});
    test_attention_case({"paired, partial tile, window 200", 208, 4, {0, 40, 41, 130, 208, 208}, 200, true, true});
    test_attention_case({"one document, no window", 192, 2, {0, 192}, 0, false, false});
    // Recording needs the host copy of the bounds: without it, a clear stop, before any CUDA call (the
    // child of the fork can make none on a GPU: stand-in device pointers, never read).
    test::check_fails_with("attention_forward recorded without cu_seqlens_host", "host copy of cu_seqlens", [] {
        const int T = 64, H = 2, D = 64;
        auto* x = reinterpret_cast<bf16*>(256);
        work_recorder().start(true);
        attention_forward(x, reinterpret_cast<float*>(256), x, x, x, reinterpret_cast<const int*>(256), 2, T, H, D, 0,
                          false, 0.1f, nullptr);
    });
}

// ---- embed ----
void test_embed() {
    const int T = 300, C = 64, V = 50;
    std::vector<int32_t> ids(T);
    for (int t = 0; t < T; ++t) ids[t] = t % 3 == 0 ? 7 : test::randint(0, V - 1);  // id 7: 100+ positions
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<bf16> table(uniform_bf16(size_t(V) * C, -1, 1)), o(size_t(T) * C), dout(uniform_bf16(size_t(T) * C, -1, 1));
    DeviceBuffer<bf16> gate(test::gate_exact_weights(kGateWidth)), d_gate(kGateWidth), dx(size_t(T) * C);
    DeviceBuffer<float> lambda(std::vector<float>{0.6f}), d_lambda(1);
    const double rows = 2.0 * T * C;  // the T rows the ids pick out of the table

    check_family("embedding_gather", {kernel("embedding_gather", bytes(d_ids) + rows, bytes(o))}, {out(o)},
                 [&] { embedding_gather(o.ptr, table.ptr, d_ids.ptr, T, C, nullptr); });
    check_family("embed_smear_forward",
                 {kernel("embed_smear_forward", bytes(d_ids) + rows + bytes(gate) + bytes(lambda), bytes(o))}, {out(o)},
                 [&] { embed_smear_forward(o.ptr, table.ptr, d_ids.ptr, gate.ptr, lambda.ptr, T, C, nullptr); });
    test::DevicePartials smear_scratch(embed_smear_backward_scratch_bytes(T));
    const double smear_partials = bytes(smear_scratch.partials), ticket = sizeof(unsigned int);
    check_family("embed_smear_backward",  // the last block reads the partials back, and draws and resets the ticket
                 {kernel("embed_smear_backward",
                         bytes(dout) + bytes(d_ids) + rows + bytes(gate) + bytes(lambda) + smear_partials + ticket,
                         bytes(dx) + smear_partials + bytes(d_lambda) + bytes(d_gate) + ticket)},
                 {out(dx), out(smear_scratch.partials), out(d_lambda), out(d_gate), inout(smear_scratch.done)}, [&] {
                     embed_smear_backward(dx.ptr, d_gate.ptr, d_lambda.ptr, dout.ptr, table.ptr, d_ids.ptr, gate.ptr,
                                          lambda.ptr, smear_scratch.view(), T, C, false, nullptr);
                 },
                 bytes(dx) + smear_partials + bytes(d_lambda) + bytes(d_gate));

    // The backward into two tables from the same ids. From the ids' histogram: ids with at most 32
    // positions are summed straight into their row, the others in 32-position chunks (fp32 slots)
    // that a second kernel merges into the row.
    std::map<int, int> count;
    for (int id : ids) ++count[id];
    double single = 0, multi = 0, slots = 0;
    for (const auto& id_count : count) {
        const int k = id_count.second;
        if (k <= kEmbedGradChunk) {
            ++single;
        } else {
            ++multi;
            slots += (k + kEmbedGradChunk - 1) / kEmbedGradChunk;
        }
    }
    test::check(multi >= 1 && single >= 1, "embedding_backward: the ids need both kinds of rows");
    IdSegmentBuilder builder;
    std::vector<int32_t> packed(id_segments_capacity_ints(T));
    const IdSegments seg = builder.build(ids.data(), T, V, packed.data());
    DeviceBuffer<int32_t> d_packed(packed);
    DeviceBuffer<float> slots_buf(embedding_backward_scratch_bytes(T, C, 2) / sizeof(float));
    DeviceBuffer<bf16> g0(size_t(V) * C), g1(size_t(V) * C), dout1(uniform_bf16(size_t(T) * C, -1, 1));
    EmbeddingGradBatch batch;
    batch.count = 2;
    batch.grad[0] = g0.ptr, batch.grad[1] = g1.ptr;
    batch.dout[0] = dout.ptr, batch.dout[1] = dout1.ptr;
    const double items = single + slots, row = 2.0 * C, slot = 4.0 * C;
    check_family("embedding_backward",
                 {kernel("embedding_backward", 4.0 * T + 16 * items + bytes(dout) + bytes(dout1),
                         2 * (single * row + slots * slot)),
                  kernel("embedding_backward", 12 * multi + 2 * slots * slot, 2 * multi * row)},
                 {out(g0), out(g1), out(slots_buf)},
                 [&] { embedding_backward(batch, seg, d_packed.ptr, slots_buf.ptr, C, false, nullptr); });
    check_family("embedding_backward accumulating",
                 {kernel("embedding_backward", 4.0 * T + 16 * items + bytes(dout) + bytes(dout1) + 2 * single * row,
                         2 * (single * row + slots * slot)),
                  kernel("embedding_backward", 12 * multi + 2 * slots * slot + 2 * multi * row, 2 * multi * row)},
                 {inout(g0), inout(g1)},
                 [&] { embedding_backward(batch, seg, d_packed.ptr, slots_buf.ptr, C, true, nullptr); });

    // record 83's signs: the lookup and the backward also read the tokens and each position's sign row
    const int sign_rows = 40;
    DeviceBuffer<bf16> sign_table(size_t(sign_rows) * C);
    init_signs(sign_table.ptr, int64_t(sign_rows) * C, 5, nullptr);
    std::vector<int32_t> tokens(T);
    for (auto& t : tokens) t = test::randint(0, 50256);
    DeviceBuffer<int32_t> d_tokens(tokens);
    const BigramSigns signs{sign_table.ptr, d_tokens.ptr, sign_rows};
    const double sign_reads = bytes(d_tokens) + rows;  // T sign rows of C bf16
    check_family("embedding_gather with signs",
                 {kernel("embedding_gather", bytes(d_ids) + rows + sign_reads, bytes(o))}, {out(o)},
                 [&] { embedding_gather(o.ptr, table.ptr, d_ids.ptr, T, C, nullptr, signs); });
    check_family("embedding_backward with signs",
                 {kernel("embedding_backward", 4.0 * T + 16 * items + bytes(dout) + sign_reads,
                         single * row + slots * slot),
                  kernel("embedding_backward", 12 * multi + slots * slot, multi * row)},
                 {out(g0), out(slots_buf)},
                 [&] { embedding_backward(g0.ptr, dout.ptr, seg, d_packed.ptr, slots_buf.ptr, C, false, nullptr, signs); });
}

// ---- head ----
void test_head(CublasLt& lt) {
    const int T = 64, C = 128, V = 256, P = 3;
    using e4m3 = __nv_fp8_e4m3;
    using e5m2 = __nv_fp8_e5m2;
    DeviceBuffer<bf16> x(uniform_bf16(size_t(T) * C, -1, 1)), w(uniform_bf16(size_t(C) * V, -0.1, 0.1));
    DeviceBuffer<bf16> logits(size_t(T) * V), dlogits(uniform_bf16(size_t(T) * V, -0.01, 0.01)), dw(size_t(C) * V),
        dx(size_t(T) * C);
    DeviceBuffer<e4m3> x_f8(size_t(T) * C), x_f8_t(size_t(T) * C), w_f8(size_t(C) * V), w_f8_t(size_t(C) * V);
    DeviceBuffer<e5m2> g_f8(size_t(T) * V), g_f8_t(size_t(T) * V);
    const LmHeadFp8Scales host_scales = lm_head_fp8_scales(2.0);
    DeviceBuffer<LmHeadFp8Scales> scales(std::vector<LmHeadFp8Scales>{host_scales});
    const LmHeadFp8Scales* sc = scales.ptr;
    const LmHeadFp8Buffers buf{x_f8.ptr, x_f8_t.ptr, w_f8.ptr, w_f8_t.ptr, g_f8.ptr, g_f8_t.ptr};
    const double scale = sizeof(float);

    check_family("lm_head_fp8_quantize_weight",
                 {kernel("quantize_fp8_two_layouts", bytes(w) + scale, bytes(w_f8) + bytes(w_f8_t))},
                 {out(w_f8), out(w_f8_t)}, [&] { lm_head_fp8_quantize_weight(buf, w.ptr, sc, C, V, nullptr); });
    DeviceBuffer<bf16> embed(size_t(C) * V);
    check_family("lm_head_fp8_quantize_weight (tied embed)",
                 {kernel("quantize_fp8_two_layouts", bytes(w) + scale, bytes(w_f8) + bytes(w_f8_t) + bytes(embed))},
                 {out(w_f8), out(w_f8_t), out(embed)},
                 [&] { lm_head_fp8_quantize_weight(buf, w.ptr, sc, C, V, nullptr, embed.ptr); });
    auto ops = check_family("lm_head_fp8_forward",
                            {kernel("quantize_fp8_two_layouts", bytes(x) + scale, bytes(x_f8) + bytes(x_f8_t)),
                             gemm("gemm_lm_head", bytes(x_f8) + bytes(w_f8_t) + 2 * scale, bytes(logits))},
                            {out(x_f8), out(x_f8_t), out(logits)},
                            [&] { lm_head_fp8_forward(lt, logits.ptr, buf, x.ptr, sc, T, C, V, nullptr); });
    if (ops.size() == 2) check_gemm_shape("gemm_lm_head", ops[1], GemmType::fp8, V, T, C, 1);
    quantize_fp8_two_layouts(g_f8.ptr, g_f8_t.ptr, dlogits.ptr, &sc->grad, T, V, nullptr);  // the backward's input
    ops = check_family("lm_head_fp8_backward",
                       {gemm("gemm_lm_head_dw", bytes(x_f8_t) + bytes(g_f8_t) + 2 * scale, bytes(dw)),
                        gemm("gemm_lm_head_dx", bytes(g_f8) + bytes(w_f8) + 2 * scale, bytes(dx))},
                       {out(dw), out(dx)},
                       [&] { lm_head_fp8_backward(lt, dx.ptr, dw.ptr, false, buf, sc, T, C, V, nullptr); });
    if (ops.size() == 2) check_gemm_shape("gemm_lm_head_dw", ops[0], GemmType::fp8, V, C, T, 1);
    check_family("lm_head_fp8_backward accumulating dw",
                 {gemm("gemm_lm_head_dw", bytes(x_f8_t) + bytes(g_f8_t) + 2 * scale + bytes(dw), bytes(dw)),
                  gemm("gemm_lm_head_dx", bytes(g_f8) + bytes(w_f8) + 2 * scale, bytes(dx))},
                 {inout(dw), out(dx)},
                 [&] { lm_head_fp8_backward(lt, dx.ptr, dw.ptr, true, buf, sc, T, C, V, nullptr); },
                 bytes(dx));  // dw is updated in place
    check_family("lm_head_bf16_forward", {gemm("gemm_lm_head_eval", bytes(x) + bytes(w), bytes(logits))},
                 {out(logits)}, [&] { lm_head_bf16_forward(lt, logits.ptr, x.ptr, w.ptr, T, C, V, nullptr); });

    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    DeviceBuffer<int> d_targets(targets);
    DeviceBuffer<float> weights(std::vector<float>{1.0f, 0.5f, 0.25f}), rows(T), lse(T), loss(1), dloss(std::vector<float>{1.0f});
    check_family("softcap_mtp_loss_forward",
                 {kernel("softcap_mtp_loss_forward", bytes(logits) + bytes(d_targets) + bytes(weights),
                         bytes(rows) + bytes(lse)),
                  kernel("sum_fixed_order", bytes(rows), bytes(loss))},
                 {out(rows), out(lse), out(loss)}, [&] {
                     softcap_mtp_loss_forward(loss.ptr, false, rows.ptr, lse.ptr, logits.ptr, d_targets.ptr,
                                              weights.ptr, P, T, V, nullptr);
                 });
    check_family("softcap_mtp_loss_backward",
                 {kernel("softcap_mtp_loss_backward",
                         bytes(logits) + bytes(lse) + bytes(d_targets) + bytes(weights) + bytes(dloss), bytes(dlogits))},
                 {out(dlogits)}, [&] {
                     softcap_mtp_loss_backward(dlogits.ptr, logits.ptr, lse.ptr, d_targets.ptr, weights.ptr, P,
                                               dloss.ptr, T, V, nullptr);
                 });
    check_family("softcap_mtp_loss_backward_fp8",
                 {kernel("softcap_mtp_loss_backward_fp8",
                         bytes(logits) + bytes(lse) + bytes(d_targets) + bytes(weights) + bytes(dloss) + scale,
                         bytes(g_f8) + bytes(g_f8_t))},
                 {out(g_f8), out(g_f8_t)}, [&] {
                     softcap_mtp_loss_backward_fp8(g_f8.ptr, g_f8_t.ptr, &sc->grad, logits.ptr, lse.ptr,
                                                   d_targets.ptr, weights.ptr, P, dloss.ptr, T, V, nullptr);
                 });
    // record 80's loss (two passes over the logits forward; the backward fused with the e5m2 layouts), without and with
    // record 88's prefix term: a table entry per row (gathered) and the weight
    std::vector<int> table(static_cast<size_t>(V));
    for (auto& p : table) p = test::randint(-1, V - 1);
    DeviceBuffer<int> d_table(table);
    DeviceBuffer<float> prefix_weight(std::vector<float>{0.25f});
    for (const bool with_prefix : {false, true}) {
        const CePrefix prefix = with_prefix ? CePrefix{d_table.ptr, prefix_weight.ptr, V} : CePrefix{};
        const double prefix_bytes = with_prefix ? 4.0 * T + bytes(prefix_weight) : 0.0;
        const std::string tag = with_prefix ? " (prefix)" : "";
        check_family("ce_r80_loss_forward" + tag,
                     {kernel("ce_r80_loss_forward",
                             2 * bytes(logits) + bytes(d_targets) + bytes(weights) + prefix_bytes, bytes(rows) + bytes(lse)),
                      kernel("sum_fixed_order", bytes(rows), bytes(loss))},
                     {out(rows), out(lse), out(loss)}, [&] {
                         ce_r80_loss_forward(loss.ptr, false, rows.ptr, lse.ptr, logits.ptr, d_targets.ptr, weights.ptr,
                                             P, T, V, nullptr, prefix);
                     });
        check_family("ce_r80_loss_backward_fp8" + tag,
                     {kernel("ce_r80_loss_backward_fp8",
                             bytes(logits) + bytes(lse) + bytes(d_targets) + bytes(weights) + bytes(dloss) + scale +
                                 prefix_bytes,
                             bytes(g_f8) + bytes(g_f8_t))},
                     {out(g_f8), out(g_f8_t)}, [&] {
                         ce_r80_loss_backward_fp8(g_f8.ptr, g_f8_t.ptr, dloss.ptr, &sc->grad, logits.ptr, lse.ptr,
                                                  d_targets.ptr, weights.ptr, P, T, V, nullptr, prefix);
                     });
    }
    check_family("softcap_eval_loss",
                 {kernel("softcap_eval_loss", bytes(logits) + bytes(d_targets), bytes(rows)),
                  kernel("sum_fixed_order", bytes(rows), bytes(loss))},
                 {out(rows), out(loss)},
                 [&] { softcap_eval_loss(loss.ptr, false, 1.0f / T, rows.ptr, logits.ptr, d_targets.ptr, T, V, nullptr); });
}

// ---- optim ----
void test_optim(CublasLt& lt) {
    const int n = 1000;  // not a multiple of 8: the ragged tail too
    DeviceBuffer<bf16> p16(uniform_bf16(n, -1, 1)), g16(uniform_bf16(n, -1, 1));
    DeviceBuffer<float> p32(test::uniform_vector(n, -1, 1)), g32(test::uniform_vector(n, -1, 1));
    DeviceBuffer<float> m(test::uniform_vector(n, -0.1, 0.1)), v(test::uniform_vector(n, 0, 0.1));
    const AdamStepScalars host_scalars = adam_step_scalars(0.01, 1, 1, 0.9, 0.99, 0.01, 1, 3);
    DeviceBuffer<AdamStepScalars> scalars(std::vector<AdamStepScalars>{host_scalars});
    const AdamHyper h = adam_hyper(0.9, 0.99, 1e-8);
    check_family("adam_step bf16",
                 {kernel("adam_step", bytes(p16) + bytes(g16) + bytes(m) + bytes(v) + bytes(scalars),
                         bytes(p16) + bytes(m) + bytes(v))},
                 {inout(p16), inout(m), inout(v)},
                 [&] { adam_step(p16.ptr, m.ptr, v.ptr, g16.ptr, n, h, scalars.ptr, nullptr); });
    check_family("adam_step fp32",
                 {kernel("adam_step", bytes(p32) + bytes(g32) + bytes(m) + bytes(v) + bytes(scalars),
                         bytes(p32) + bytes(m) + bytes(v))},
                 {inout(p32), inout(m), inout(v)},
                 [&] { adam_step(p32.ptr, m.ptr, v.ptr, g32.ptr, n, h, scalars.ptr, nullptr); });

    // NorMuon on a tall bank (the Gram matrix X^T X) and a wide one (X X^T), with per-matrix multipliers
    // on the tall one.
    for (const bool tall : {true, false}) {
        const int count = 2, rows = tall ? 64 : 32, cols = tall ? 32 : 64, s = 32, len = tall ? rows : cols;
        const size_t e = size_t(count) * rows * cols;
        DeviceBuffer<bf16> param(uniform_bf16(e, -0.1, 0.1)), grad(uniform_bf16(e, -1, 1));
        DeviceBuffer<float> mom(test::uniform_vector(e, -0.1, 0.1)), second(test::uniform_vector(size_t(count) * len, 0.01, 0.1));
        DeviceBuffer<uint16_t> mant(e);
        DeviceBuffer<float> lr_mul(std::vector<float>{1.0f, 2.0f});
        const NorMuonStepScalars host_ns = normuon_step_scalars(0.02, 1, 1, 0.01, 1, 0.95);
        DeviceBuffer<NorMuonStepScalars> ns(std::vector<NorMuonStepScalars>{host_ns});
        const size_t scratch_bytes = normuon_scratch_bytes(count, rows, cols);
        DeviceBuffer<unsigned char> scratch(scratch_bytes);
        const NorMuonShard shard{param.ptr, grad.ptr, mom.ptr, second.ptr, mant.ptr, tall ? lr_mul.ptr : nullptr,
                                 count, rows, cols};
        const double x = 2.0 * e, gram = 2.0 * count * s * s, norm_partials = 4.0 * count * normuon_elementwise_blocks(rows, cols);
        const double moments = bytes(second), var_partials = 8.0 * count * normuon_variance_blocks(rows, cols);
        std::vector<Want> want = {
            kernel("normuon_momentum", bytes(grad) + bytes(mom) + bytes(ns), bytes(mom) + norm_partials),
            kernel("polar_express_normalize", bytes(grad) + bytes(mom) + norm_partials + bytes(ns), x)};
        for (int it = 0; it < kPolarExpressIters; ++it) {
            want.push_back(gemm("gemm_polar_gram", x, gram));  // X X^T: X once
            want.push_back(gemm("gemm_polar_poly", gram, gram));  // c A A + b A: A once
            want.push_back(gemm("gemm_polar_update", x + gram, x));  // a X + B X
        }
        want.push_back(kernel("normuon_variance_stats", x + moments, 2 * moments + var_partials));
        want.push_back(kernel("normuon_scale_and_update",
                              3 * x + moments + var_partials + (tall ? bytes(lr_mul) : 0) + bytes(ns), 2 * x));
        const std::string tag = std::string("normuon_step ") + (tall ? "tall" : "wide");
        const auto ops = check_family(tag, want, {inout(param), inout(mant), inout(mom), inout(second), inout(scratch)},
                                      [&] { normuon_step(lt, shard, ns.ptr, 0.05f, scratch.ptr, scratch_bytes, nullptr); });
        if (ops.size() == want.size()) {
            check_gemm_shape(tag + " gram", ops[2], GemmType::bf16, s, s, tall ? rows : cols, count);
            check_gemm_shape(tag + " update", ops[4], GemmType::bf16, tall ? s : cols, tall ? rows : s, s, count);
        }
        // Upstream's split form of a X + B X: the matmul without C, then the scaled add.
        const NorMuonScratch w = normuon_scratch_layout(scratch.ptr, count, rows, cols);
        check_family(tag + " polar_express_iteration, split",
                     {gemm("gemm_polar_gram", x, gram), gemm("gemm_polar_poly", gram, gram),
                      gemm("gemm_polar_update", x + gram, x), kernel("polar_express_add_scaled", 2 * x, x)},
                     {inout(scratch)}, [&] {
                         polar_express_iteration(lt, w.x_other, w.x, w.gram, w.poly, count, rows, cols, 3.0f, -2.0f,
                                                 0.5f, true, nullptr);
                     });
    }
}

// ---- rope ----
void test_rope() {
    const int D = 64, positions = 256;
    DeviceBuffer<unsigned char> mem(yarn_rope_bytes(D, positions));
    YarnRope r = yarn_rope_view(mem.ptr, D, positions);
    const double freq = 4.0 * (D / 4), table = double(positions) * D;  // D/4 floats; D/4 {cos, sin} bf16 pairs a row
    const Output freqs{r.freq, D / 4, sizeof(float), true}, entries{r.table, size_t(positions) * D / 2, 2, true};
    check_family("yarn_rope_reset", {kernel("yarn_rope_reset", 0, freq), kernel("yarn_fill_table", freq, table)},
                 {freqs, entries}, [&] { yarn_rope_reset(r, nullptr); });
    check_family("yarn_rope_apply", {kernel("yarn_rope_apply", freq, freq), kernel("yarn_fill_table", freq, table)},
                 {{r.freq, D / 4, sizeof(float), false}, {r.table, size_t(positions) * D / 2, 2, false}},
                 [&] { yarn_rope_apply(r, 128, 384, nullptr); });

    const int T = 48, H = 2, C = H * D, V = 40;
    const size_t tc = size_t(T) * C;
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = test::randint(0, V - 1);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<bf16> qkv(uniform_bf16(3 * tc, -1, 1)), xa(test::gate_exact_rows(T, C, kGateWidth));
    DeviceBuffer<bf16> ve_table(uniform_bf16(size_t(V) * C, -1, 1)), ve_gate(test::gate_exact_weights(H * kGateWidth));
    DeviceBuffer<bf16> attn_gate(test::gate_exact_weights(H * kGateWidth));
    DeviceBuffer<bf16> q(tc), k(tc), v(tc), dq(uniform_bf16(tc, -1, 1)), dk(uniform_bf16(tc, -1, 1)),
        dv(uniform_bf16(tc, -1, 1)), dqkv(3 * tc), dve(tc), y(uniform_bf16(tc, -1, 1)), yg(tc), dy(tc);
    DeviceBuffer<float> rstd_q(size_t(T) * H), rstd_k(size_t(T) * H), dz_ve(size_t(T) * H), dz_attn(size_t(T) * H);
    DeviceBuffer<bf16> d_attn_gate(H * kGateWidth), d_ve_gate(H * kGateWidth), dxa(uniform_bf16(tc, -1, 1));
    AttnAux a;
    a.T = T, a.H = H, a.D = D, a.key_offset = true, a.rope_table = r.table, a.rope_positions = positions;
    a.xa = xa.ptr, a.ids = d_ids.ptr, a.ve_table = ve_table.ptr, a.ve_gate = ve_gate.ptr, a.attn_gate = attn_gate.ptr;
    const double rope_rows = double(T) * D;     // positions 0..T-1, D bytes each
    const double xa_cols = 2.0 * kGateWidth * T;  // the gates read xa[:, :12]
    const double ve = bytes(d_ids) + 2.0 * tc + xa_cols + bytes(ve_gate);  // the ids, their rows, the ve gate
    const double stats = bytes(rstd_q);

    check_family("attn_qkv_forward with value embeddings",
                 {kernel("attn_qkv_forward", bytes(qkv) + rope_rows + ve, bytes(q) + bytes(k) + bytes(v) + 2 * stats)},
                 {out(q), out(k), out(v), out(rstd_q), out(rstd_k)},
                 [&] { attn_qkv_forward(a, q.ptr, k.ptr, v.ptr, rstd_q.ptr, rstd_k.ptr, qkv.ptr, nullptr); });
    check_family("attn_qkv_backward with value embeddings",
                 {kernel("attn_qkv_backward",
                         bytes(dq) + bytes(dk) + bytes(dv) + 2 * bytes(qkv) / 3 + 2 * stats + rope_rows + ve,
                         bytes(dqkv) + bytes(dve) + bytes(dz_ve))},
                 {out(dqkv), out(dve), out(dz_ve)}, [&] {
                     attn_qkv_backward(a, dqkv.ptr, dve.ptr, dz_ve.ptr, dq.ptr, dk.ptr, dv.ptr, qkv.ptr, rstd_q.ptr,
                                       rstd_k.ptr, nullptr);
                 });
    AttnAux p = a;  // paired heads read positions 2t and 2t + 1; no value embeddings, v read from qkv
    p.paired = true, p.key_offset = false, p.ids = nullptr, p.ve_table = nullptr, p.ve_gate = nullptr;
    check_family("attn_qkv_forward paired, no v",
                 {kernel("attn_qkv_forward", 2 * bytes(qkv) / 3 + 2 * rope_rows, bytes(q) + bytes(k) + 2 * stats)},
                 {out(q), out(k), out(rstd_q), out(rstd_k)},
                 [&] { attn_qkv_forward(p, q.ptr, k.ptr, nullptr, rstd_q.ptr, rstd_k.ptr, qkv.ptr, nullptr); });

    const double gate_in = xa_cols + bytes(attn_gate);
    check_family("attn_output_gate_forward", {kernel("attn_output_gate_forward", bytes(y) + gate_in, bytes(yg))},
                 {out(yg)}, [&] { attn_output_gate_forward(a, yg.ptr, y.ptr, nullptr); });
    check_family("attn_output_gate_backward",
                 {kernel("attn_output_gate_backward", bytes(yg) + bytes(y) + gate_in, bytes(dy) + bytes(dz_attn))},
                 {out(dy), out(dz_attn)}, [&] { attn_output_gate_backward(a, dy.ptr, dz_attn.ptr, yg.ptr, y.ptr, nullptr); });

    {  // record 82's XSA: the gate also reads v and the strengths; its backward writes XSA's dv and d alpha
        DeviceBuffer<float> alpha(test::uniform_vector(H, -1, 1)), d_alpha(H);
        DeviceBuffer<bf16> dv_xsa(tc);
        AttnAux x = a;
        x.ve_gate_input = VeGateInput::x_and_ve, x.xsa_v = v.ptr, x.xsa_alpha = alpha.ptr;
        test::DevicePartials xsa_scratch(attn_output_gate_backward_scratch_bytes(T, H, D));
        const double xsa_partials = bytes(xsa_scratch.partials), ticket = sizeof(unsigned int);
        check_family("attn_output_gate_forward with XSA",
                     {kernel("attn_output_gate_forward", bytes(y) + gate_in + bytes(v) + bytes(alpha), bytes(yg))},
                     {out(yg)}, [&] { attn_output_gate_forward(x, yg.ptr, y.ptr, nullptr); });
        check_family("attn_output_gate_backward with XSA",  // the last block reads the partials back
                     {kernel("attn_output_gate_backward",
                             bytes(yg) + bytes(y) + gate_in + bytes(v) + bytes(alpha) + xsa_partials + ticket,
                             bytes(dy) + bytes(dz_attn) + bytes(dv_xsa) + xsa_partials + ticket + bytes(d_alpha))},
                     {out(dy), out(dz_attn), out(dv_xsa), out(xsa_scratch.partials), out(d_alpha),
                      inout(xsa_scratch.done)},
                     [&] {
                         attn_output_gate_backward(x, dy.ptr, dz_attn.ptr, yg.ptr, y.ptr, nullptr,
                                                   XsaGrads{dv_xsa.ptr, d_alpha.ptr, xsa_scratch.view(), false});
                     },
                     bytes(dy) + bytes(dz_attn) + bytes(dv_xsa) + xsa_partials + bytes(d_alpha));
        const double ve80 = bytes(d_ids) + 2.0 * tc + 2.0 * kVeGateHalf * T + bytes(ve_gate);
        check_family("attn_qkv_backward with XSA's dv",
                     {kernel("attn_qkv_backward",
                             bytes(dq) + bytes(dk) + bytes(dv) + bytes(dv_xsa) + 2 * bytes(qkv) / 3 + 2 * stats +
                                 rope_rows + ve80,
                             bytes(dqkv) + bytes(dve) + bytes(dz_ve))},
                     {out(dqkv), out(dve), out(dz_ve)}, [&] {
                         attn_qkv_backward(x, dqkv.ptr, dve.ptr, dz_ve.ptr, dq.ptr, dk.ptr, dv.ptr, qkv.ptr, rstd_q.ptr,
                                           rstd_k.ptr, nullptr, dv_xsa.ptr);
                     });
    }

    {  // record 85's per-token strengths: columns of the MUDD gate's coefficients; the backward writes only the
       // used columns of the gradients (the rest keep the poison)
        constexpr int kStride = 48;
        DeviceBuffer<float> coefs(test::uniform_vector(size_t(T) * kStride, -1, 1)), grads(size_t(T) * kStride);
        DeviceBuffer<bf16> dv_xsa(tc);
        const double column = 4.0 * T * H;
        struct Kind {
            const char* name;
            int gate, xsa;
        };
        for (const Kind k : {Kind{"gate and XSA", 12, 29}, Kind{"XSA", -1, 0}, Kind{"gate", 12, -1}}) {
            AttnAux x = a;
            x.attn_gate = nullptr;
            x.token = TokenCoefs{coefs.ptr, grads.ptr, kStride, k.gate, k.xsa};
            const bool xsa = k.xsa >= 0;
            x.xsa_v = xsa ? v.ptr : nullptr;
            const double cols = column * ((k.gate >= 0) + xsa), vb = xsa ? bytes(v) : 0.0;
            const std::string at = std::string(" per token, ") + k.name;
            check_family("attn_output_gate_forward" + at,
                         {kernel("attn_output_gate_forward", bytes(y) + vb + cols, bytes(yg))}, {out(yg)},
                         [&] { attn_output_gate_forward(x, yg.ptr, y.ptr, nullptr); });
            std::vector<Output> outs = {out(dy), out(grads)};
            if (xsa) outs.push_back(out(dv_xsa));
            check_family("attn_output_gate_backward" + at,
                         {kernel("attn_output_gate_backward", bytes(yg) + bytes(y) + vb + cols,
                                 bytes(dy) + cols + (xsa ? bytes(dv_xsa) : 0.0))},
                         outs, [&] {
                             attn_output_gate_backward(x, dy.ptr, nullptr, yg.ptr, y.ptr, nullptr,
                                                       XsaGrads{xsa ? dv_xsa.ptr : nullptr, nullptr, {}, false});
                         });
        }
    }

    const int blocks = ceil_div(T, kGateRowsPerBlock), n_w = 2 * H * kGateWidth;
    test::DevicePartials scratch(attn_gates_backward_scratch_bytes(T, H));
    const double partials = 4.0 * blocks * n_w, ticket = sizeof(unsigned int);
    check_family("attn_gates_backward",  // the last block reads the partials back, and draws and resets the ticket
                 {kernel("attn_gates_backward",
                         bytes(dz_attn) + bytes(dz_ve) + xa_cols + xa_cols + bytes(attn_gate) + bytes(ve_gate) +
                             partials + ticket,
                         xa_cols + partials + bytes(d_attn_gate) + bytes(d_ve_gate) + ticket)},
                 {inout(dxa), out(scratch.partials), out(d_attn_gate), out(d_ve_gate), inout(scratch.done)}, [&] {
                     attn_gates_backward(a, dxa.ptr, nullptr, d_attn_gate.ptr, d_ve_gate.ptr, dz_attn.ptr, dz_ve.ptr,
                                         scratch.view(), false, nullptr);
                 },
                 partials + bytes(d_attn_gate) + bytes(d_ve_gate));  // dxa's columns are updated in place

    // record 80's non-paired VE gate reads cat(xa[:, :6], ve[:, :6]): 6 columns of xa, ve's 6 lie in the
    // gathered rows; its backward also reads the ids and updates dve's first 6 columns from ve's
    AttnAux r80 = a;
    r80.ve_gate_input = VeGateInput::x_and_ve;
    const double half_cols = 2.0 * kVeGateHalf * T;
    const double ve80 = bytes(d_ids) + 2.0 * tc + half_cols + bytes(ve_gate);
    check_family("attn_qkv_forward with the VE gate reading ve",
                 {kernel("attn_qkv_forward", bytes(qkv) + rope_rows + ve80, bytes(q) + bytes(k) + bytes(v) + 2 * stats)},
                 {out(q), out(k), out(v), out(rstd_q), out(rstd_k)},
                 [&] { attn_qkv_forward(r80, q.ptr, k.ptr, v.ptr, rstd_q.ptr, rstd_k.ptr, qkv.ptr, nullptr); });
    check_family("attn_qkv_backward with the VE gate reading ve",
                 {kernel("attn_qkv_backward",
                         bytes(dq) + bytes(dk) + bytes(dv) + 2 * bytes(qkv) / 3 + 2 * stats + rope_rows + ve80,
                         bytes(dqkv) + bytes(dve) + bytes(dz_ve))},
                 {out(dqkv), out(dve), out(dz_ve)}, [&] {
                     attn_qkv_backward(r80, dqkv.ptr, dve.ptr, dz_ve.ptr, dq.ptr, dk.ptr, dv.ptr, qkv.ptr, rstd_q.ptr,
                                       rstd_k.ptr, nullptr);
                 });
    check_family("attn_gates_backward with the VE gate reading ve",
                 {kernel("attn_gates_backward",
                         bytes(dz_attn) + bytes(dz_ve) + xa_cols + xa_cols + bytes(attn_gate) + bytes(ve_gate) +
                             bytes(d_ids) + half_cols + half_cols + partials + ticket,
                         xa_cols + half_cols + partials + bytes(d_attn_gate) + bytes(d_ve_gate) + ticket)},
                 {inout(dxa), inout(dve), out(scratch.partials), out(d_attn_gate), out(d_ve_gate), inout(scratch.done)},
                 [&] {
                     attn_gates_backward(r80, dxa.ptr, dve.ptr, d_attn_gate.ptr, d_ve_gate.ptr, dz_attn.ptr, dz_ve.ptr,
                                         scratch.view(), false, nullptr);
                 },
                 partials + bytes(d_attn_gate) + bytes(d_ve_gate));  // dxa's and dve's columns are updated in place

    // record 85's value-table layers have no attn_gate: the VE gate alone, its dz and weights and its partials
    // only; reading cat(xa[:, :6], ve[:, :6]) it touches 6 columns of xa and of dxa, reading xa[:, :12] all 12
    const double ve_partials = 4.0 * blocks * H * kGateWidth;
    AttnAux r85 = r80;
    r85.attn_gate = nullptr;
    check_family("attn_gates_backward, the VE gate alone reading ve",
                 {kernel("attn_gates_backward",
                         bytes(dz_ve) + half_cols + half_cols + bytes(ve_gate) + bytes(d_ids) + half_cols + half_cols +
                             ve_partials + ticket,
                         half_cols + half_cols + ve_partials + bytes(d_ve_gate) + ticket)},
                 {inout(dxa), inout(dve), out(scratch.partials), out(d_ve_gate), inout(scratch.done)},
                 [&] {
                     attn_gates_backward(r85, dxa.ptr, dve.ptr, nullptr, d_ve_gate.ptr, nullptr, dz_ve.ptr,
                                         scratch.view(), false, nullptr);
                 },
                 ve_partials + bytes(d_ve_gate));
    r85.ve_gate_input = VeGateInput::x;
    check_family("attn_gates_backward, the VE gate alone reading xa",
                 {kernel("attn_gates_backward", bytes(dz_ve) + xa_cols + xa_cols + bytes(ve_gate) + ve_partials + ticket,
                         xa_cols + ve_partials + bytes(d_ve_gate) + ticket)},
                 {inout(dxa), out(scratch.partials), out(d_ve_gate), inout(scratch.done)},
                 [&] {
                     attn_gates_backward(r85, dxa.ptr, nullptr, nullptr, d_ve_gate.ptr, nullptr, dz_ve.ptr,
                                         scratch.view(), false, nullptr);
                 },
                 ve_partials + bytes(d_ve_gate));
}

// ---- MUDD (record 81): the last layer's entry and the exit, forward and backward ----
void test_mudd() {
    const int T = 40, C = 128, H = 2, V = 30, blocks = mudd_backward_blocks(T);
    std::vector<int32_t> ids(T);
    for (int32_t& i : ids) i = test::randint(0, V - 1);
    DeviceBuffer<int32_t> d_ids(ids);
    auto rows = [&] { return DeviceBuffer<bf16>(uniform_bf16(size_t(T) * C, -1, 1)); };
    DeviceBuffer<bf16> z(uniform_bf16(size_t(T) * kMuddHidden, -1, 1)), table(uniform_bf16(size_t(V) * C, -1, 1));
    DeviceBuffer<bf16> w2(uniform_bf16(size_t(kMuddMaxCoef) * kMuddHidden, -1, 1)), b2(uniform_bf16(kMuddMaxCoef, -1, 1));
    DeviceBuffer<bf16> h0 = rows(), h7 = rows(), h9 = rows(), h3 = rows(), x = rows(), g1 = rows(), g2 = rows();
    DeviceBuffer<bf16> o1(size_t(T) * C), o2(size_t(T) * C), o3(size_t(T) * C), o4(size_t(T) * C);
    DeviceBuffer<bf16> d0 = rows(), d7 = rows(), d3 = rows(), dz(size_t(T) * kMuddHidden);
    DeviceBuffer<bf16> dw2(size_t(kMuddMaxCoef) * kMuddHidden), db2(kMuddMaxCoef);
    DeviceBuffer<float> coeffs(size_t(T) * kMuddCoefStride), dcoeffs(test::uniform_vector(size_t(T) * kMuddCoefStride, -1, 1));
    DeviceBuffer<float> rstd(T);
    test::DevicePartials scratch(mudd_backward_scratch_bytes(T));
    const double rows_bytes = 2.0 * T * C, gathered = rows_bytes + bytes(d_ids), zb = bytes(z), ticket = sizeof(unsigned int);
    const MuddSource ve{table.ptr, d_ids.ptr};
    for (const int n : {kMuddEntryCoef, kMuddExitCoef}) {
        const bool entry = n == kMuddEntryCoef;
        const MuddHead head{w2.ptr, b2.ptr, n};
        const double head_bytes = 2.0 * n * (kMuddHidden + 1), partials = 4.0 * blocks * n * (kMuddHidden + 1);
        MuddExitSources src{{{h0.ptr, nullptr}, {h7.ptr, nullptr}, {h9.ptr, nullptr}, ve, {h3.ptr, nullptr}}};
        if (entry) {
            check_family("mudd_entry_forward",
                         {kernel("mudd_entry_forward", zb + head_bytes + 3 * rows_bytes + gathered,
                                 bytes(coeffs) + 2 * rows_bytes)},
                         {out(coeffs), out(o1), out(o2)}, [&] {
                             mudd_entry_forward(coeffs.ptr, o1.ptr, o2.ptr, z.ptr, head, h0.ptr, h7.ptr, h9.ptr, ve, T, C,
                                                H, nullptr);
                         });
            // dh0 and dh7 add to their shares, dh9 is written; the head's gradients are added to
            const MuddEntryGrads eg{{d0.ptr, true}, {d7.ptr, true}, {o3.ptr, false}, o4.ptr};
            check_family("mudd_entry_backward",
                         {kernel("mudd_entry_backward",
                                 2 * rows_bytes + 3 * rows_bytes + 2 * rows_bytes + gathered + 4.0 * T * kMuddEntryCoef +
                                     zb + head_bytes + partials + head_bytes + ticket,
                                 4 * rows_bytes + bytes(dz) + 4.0 * T * 8 + partials + head_bytes + ticket)},
                         {out(o3), out(o4), out(dz), out(scratch.partials), inout(d0), inout(d7), inout(dcoeffs),
                          inout(dw2), inout(db2), inout(scratch.done)},
                         [&] {
                             mudd_entry_backward(dz.ptr, dcoeffs.ptr, eg, {dw2.ptr, db2.ptr, true}, scratch.view(),
                                                 g1.ptr, C, g2.ptr, coeffs.ptr, z.ptr, head, h0.ptr, h7.ptr, h9.ptr, ve,
                                                 T, C, H, nullptr);
                         },
                         2 * rows_bytes + bytes(dz) + partials);  // dh0, dh7, the coefficients and the head in place
        } else {
            const double sources = 4 * rows_bytes + gathered;
            check_family("mudd_exit_forward",
                         {kernel("mudd_exit_forward", zb + head_bytes + rows_bytes + sources,
                                 bytes(coeffs) + 2 * rows_bytes + bytes(rstd))},
                         {out(coeffs), out(o1), out(o2), out(rstd)}, [&] {
                             mudd_exit_forward(coeffs.ptr, o1.ptr, o2.ptr, rstd.ptr, z.ptr, head, x.ptr, src, T, C,
                                               nullptr);
                         });
            // h0's and h3's gradients add to their shares, the others are written; the head's gradients are written
            MuddExitGrads eg{o3.ptr, {{d0.ptr, true}, {o4.ptr, false}, {dz.ptr, false}, {g1.ptr, false}, {d3.ptr, true}}};
            DeviceBuffer<bf16> dz2(size_t(T) * kMuddHidden);
            eg.src[2] = {o2.ptr, false};
            check_family("mudd_exit_backward",
                         {kernel("mudd_exit_backward",
                                 2 * rows_bytes + bytes(rstd) + 4.0 * T * kMuddExitCoef + sources + 2 * rows_bytes + zb +
                                     head_bytes + partials + ticket,
                                 6 * rows_bytes + 4.0 * T * kMuddExitCoef + bytes(dz2) + partials + head_bytes + ticket)},
                         {out(o3), out(o4), out(o2), out(g1), out(dz2), out(scratch.partials), out(dw2), out(db2),
                          inout(d0), inout(d3), inout(dcoeffs), inout(scratch.done)},
                         [&] {
                             mudd_exit_backward(dz2.ptr, dcoeffs.ptr, eg, {dw2.ptr, db2.ptr, false}, scratch.view(),
                                                g2.ptr, o1.ptr, rstd.ptr, coeffs.ptr, z.ptr, head, src, T, C, nullptr);
                         },
                         4 * rows_bytes + bytes(dz2) + partials + 2.0 * kMuddExitCoef * kMuddHidden + 2.0 * kMuddExitCoef);
        }
    }
    // record 85's MUDD gate head: 26 (pre) or 41 (post) coefficients, 48 per token (zeros past n), a learnable scale
    DeviceBuffer<bf16> gw2(uniform_bf16(size_t(kMuddGateMaxCoef) * kMuddHidden, -1, 1)), gb2(uniform_bf16(kMuddGateMaxCoef, -1, 1));
    DeviceBuffer<bf16> gdw2(size_t(kMuddGateMaxCoef) * kMuddHidden), gdb2(kMuddGateMaxCoef), gdz(size_t(T) * kMuddHidden);
    DeviceBuffer<float> scale(std::vector<float>{0.1f}), dscale(1), gcoeffs(size_t(T) * kMuddGateCoefStride);
    DeviceBuffer<float> gdcoeffs(test::uniform_vector(size_t(T) * kMuddGateCoefStride, -1, 1));
    test::DevicePartials gscratch(mudd_gate_backward_scratch_bytes(T));
    const int gblocks = mudd_gate_backward_blocks(T);
    for (const int n : {kMuddGatePreCoef, kMuddGatePostCoef}) {
        const MuddHead head{gw2.ptr, gb2.ptr, n};
        const double head_bytes = 2.0 * n * (kMuddHidden + 1), partials = 4.0 * gblocks * (n * (kMuddHidden + 1) + 1);
        const std::string at = " n=" + std::to_string(n);
        check_family("mudd_gate_forward" + at,
                     {kernel("mudd_gate_forward", zb + head_bytes + bytes(scale), bytes(gcoeffs))}, {out(gcoeffs)},
                     [&] { mudd_gate_forward(gcoeffs.ptr, z.ptr, head, scale.ptr, T, nullptr); });
        check_family("mudd_gate_backward" + at,  // the last block reads the partials back, and draws and resets the ticket
                     {kernel("mudd_gate_backward",
                             4.0 * T * n + zb + head_bytes + bytes(scale) + partials + ticket,
                             bytes(gdz) + partials + head_bytes + ticket + bytes(dscale))},
                     {out(gdz), out(gscratch.partials), out(gdw2), out(gdb2), out(dscale), inout(gscratch.done)},
                     [&] {
                         mudd_gate_backward(gdz.ptr, {gdw2.ptr, gdb2.ptr, false}, {dscale.ptr, 0}, gscratch.view(),
                                            gdcoeffs.ptr, z.ptr, head, scale.ptr, T, nullptr);
                     },
                     bytes(gdz) + partials + head_bytes + bytes(dscale));
    }
}

// ---- comms' kernels (the exchange itself: test_mpi_work_comms) ----
void test_comms_kernels() {
    const int R = 64, C = 64, n = 10;
    std::vector<int32_t> rows(n);
    for (int i = 0; i < n; ++i) rows[i] = 5 * i + 1;  // distinct, as one source's rows are
    DeviceBuffer<bf16> grad(uniform_bf16(size_t(R) * C, -1, 1)), vals(uniform_bf16(size_t(n) * C, -1, 1));
    DeviceBuffer<int32_t> d_rows(rows);
    const double touched = 2.0 * n * C;  // the grad rows added into
    check_family("add_rows", {kernel("add_rows", bytes(d_rows) + bytes(vals) + touched, touched)}, {inout(grad)},
                 [&] { add_rows(grad.ptr, d_rows.ptr, vals.ptr, n, C, nullptr); });
}

// ---- the recording helpers of platform.cuh ----
void test_helpers() {
    DeviceBuffer<float> a(test::uniform_vector(256, -1, 1)), b(256);
    std::vector<float> host(256, 3.0f);
    cudaStream_t s1;
    CUDA_CHECK(cudaStreamCreate(&s1));
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    const auto run = [&] {
        CUDA_CHECK(copy_async(b.ptr, host.data(), 1024, cudaMemcpyHostToDevice, nullptr));
        CUDA_CHECK(record_event(e, nullptr));
        CUDA_CHECK(wait_event(s1, e));
        CUDA_CHECK(copy_async(b.ptr, a.ptr, 512, cudaMemcpyDeviceToDevice, s1));
        CUDA_CHECK(memset_async(b.ptr + 128, 0, 256, s1));
        CUDA_CHECK(copy_async(host.data(), b.ptr, 1024, cudaMemcpyDeviceToHost, s1));
        CUDA_CHECK(sync_event(e, "event_wait_test"));
        CUDA_CHECK(sync_stream(s1, "stream_wait_test"));
        record_host_wait("mpi_test");
        CUDA_CHECK(sync_device("device_wait_test"));
    };
    struct Step {
        OpKind kind;
        int stream, event;
        const char* name;
        double read, written;
    };
    const Step want[] = {
        {OpKind::copy, 0, -1, "copy_h2d", 0, 1024},       {OpKind::event_record, 0, 0, "event_record", 0, 0},
        {OpKind::event_wait, 1, 0, "event_wait", 0, 0},  {OpKind::copy, 1, -1, "copy_d2d", 512, 512},
        {OpKind::memset, 1, -1, "memset", 0, 256},       {OpKind::copy, 1, -1, "copy_d2h", 1024, 0},
        {OpKind::host_sync, 0, -1, "event_wait_test", 0, 0},  // the stream of e's record
        {OpKind::host_sync, 1, -1, "stream_wait_test", 0, 0}, {OpKind::host_sync, -1, -1, "mpi_test", 0, 0},
        {OpKind::host_sync, -1, -1, "device_wait_test", 0, 0}};
    for (const bool dry : {true, false}) {
        std::fill(host.begin(), host.end(), 3.0f);
        CUDA_CHECK(cudaMemset(b.ptr, 0xFF, 1024));
        const auto ops = record(dry, run);
        bool ok = ops.size() == std::size(want);
        for (size_t i = 0; ok && i < ops.size(); ++i)
            ok = ops[i].kind == want[i].kind && ops[i].stream == want[i].stream && ops[i].event == want[i].event &&
                 std::strcmp(ops[i].work.name, want[i].name) == 0 && ops[i].work.bytes_read == want[i].read &&
                 ops[i].work.bytes_written == want[i].written;
        test::check(ok, "recording helpers (%s): %zu ops, not the %zu expected (or they differ)", dry ? "dry" : "real",
                    ops.size(), std::size(want));
        // the real run downloads the device copy of a (and the zeroed range); the dry run moves nothing
        const std::vector<float> av = a.download(), bv = b.download();
        const bool moved = host[0] == av[0] && host[127] == av[127] && host[128] == 0.0f && host[200] == 3.0f;
        const bool still = std::all_of(host.begin(), host.end(), [](float f) { return f == 3.0f; }) &&
                           std::all_of(bv.begin(), bv.end(), [](float f) { return f != f; });
        test::check(dry ? still : moved, "recording helpers (%s): the copies %s", dry ? "dry" : "real",
                    dry ? "ran in a dry run" : "did not run");
    }
    test::check(copy_async(b.ptr, a.ptr, 4, cudaMemcpyDefault, nullptr) == cudaErrorInvalidMemcpyDirection,
                "copy_async accepted cudaMemcpyDefault (its direction, and so its name, is unknown)");
    // Nothing is recorded while no recording is on.
    const size_t kept = work_recorder().ops.size();
    CUDA_CHECK(record_event(e, nullptr));
    sum_fixed_order(b.ptr, a.ptr, 4, 1.0f, false, nullptr);
    test::check(work_recorder().ops.size() == kept, "ops were kept while no recording was on");
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaEventDestroy(e));
    CUDA_CHECK(cudaStreamDestroy(s1));
}

}  // namespace

// ---- DC-MHA (record 85, layer 10): forward (training and validation) and its two backward kernels ----
// One document of T tokens: every query sees min(t + 1, 112) keys, the pairs the Work records count and the scratch
// (A fp32, dS bf16 per head) holds. Each D (128: the record, 64: its CPU-sized twin): bytes from the tensors passed;
// tc_flops: one block per 16 rows (queries, or keys on the key side), each of its 6 warps running 16 x 128 x D tile
// products (2 flops per multiply-add, masked columns included): 2 in the forward (QK^T, PV), 4 on the query side
// (go V^T and QK^T, go V^T again, dS K), 2 on the key side (dS^T Q, (w2 A)^T go).
void test_dc_mha(int D) {
    const int T = 200, H = kDcHeads, stride = kMuddGateCoefStride;
    const std::string at = " (D=" + std::to_string(D) + ")";
    auto rows = [&] { return DeviceBuffer<bf16>(uniform_bf16(size_t(T) * H * D, -1, 1)); };
    DeviceBuffer<bf16> q = rows(), k = rows(), v = rows(), y = rows(), go = rows(), o(size_t(T) * H * D);
    DeviceBuffer<bf16> dq = rows(), dk = rows(), dv = rows();
    DeviceBuffer<float> coefs(test::uniform_vector(size_t(T) * stride, -1, 1)), lse(size_t(T) * H);
    DeviceBuffer<float> dcoefs(test::uniform_vector(size_t(T) * stride, -1, 1));
    DeviceBuffer<int> cu(std::vector<int>{0, T});
    const size_t ws_bytes = dc_mha_backward_workspace_bytes(T);
    DeviceBuffer<unsigned char> ws(ws_bytes);
    double pairs = 0;
    for (int t = 0; t < T; ++t) pairs += std::min(t + 1, kDcWindow);
    const double rb = bytes(q), used_coefs = 4.0 * T * 2 * H, w2_coefs = 4.0 * T * H, scratch = pairs * (4.0 + 2.0 * H);
    const double tile = (T + 15) / 16 * H * 2.0 * 16 * 128 * D;  // one tile product per block and warp
    auto check_tc = [&](const std::string& what, const std::vector<StepOp>& ops, size_t i, int products) {
        if (i < ops.size())
            test::check(ops[i].work.tc_flops == products * tile, "%s op %zu (%s): tc_flops %.0f, want %d tile products",
                        what.c_str(), i, ops[i].work.name, ops[i].work.tc_flops, products);
    };
    for (const bool training : {true, false}) {  // training saves lse; validation does not
        const std::string what = std::string(training ? "dc_mha_forward" : "dc_mha_forward (validation)") + at;
        float* l = training ? lse.ptr : nullptr;
        std::vector<Output> outs{out(o)};
        if (training) outs.push_back(out(lse));
        const double written = rb + (training ? bytes(lse) : 0.0);
        const std::vector<StepOp> ops =
            check_family(what, {kernel("dc_mha_forward", 4 * rb + used_coefs + bytes(cu), written)}, outs, [&] {
                dc_mha_forward(o.ptr, l, y.ptr, q.ptr, k.ptr, v.ptr, coefs.ptr, stride, cu.ptr, 2, T, H, D, 0.1f, nullptr);
            });
        check_tc(what, ops, 0, 2);
    }
    // dq, dk, dv are added to; the gradient columns 29..40 and the scratch's valid pairs are written (measured per
    // element: A fp32 (T, 112), then dS bf16 (T, 6, 112))
    const DcScratch sc = dc_scratch(ws.ptr, T);
    const Output scratch_a{sc.a, size_t(T) * kDcWindow, sizeof(float), true};
    const Output scratch_ds{sc.ds, size_t(T) * H * kDcWindow, sizeof(bf16), true};
    dc_mha_forward(o.ptr, lse.ptr, y.ptr, q.ptr, k.ptr, v.ptr, coefs.ptr, stride, cu.ptr, 2, T, H, D, 0.1f, nullptr);
    const std::string what = "dc_mha_backward" + at;
    const std::vector<StepOp> ops = check_family(
        what,
        {kernel("dc_mha_backward_query", 6 * rb + bytes(lse) + used_coefs + bytes(cu), rb + used_coefs + scratch),
         kernel("dc_mha_backward_key", 4 * rb + scratch + w2_coefs + bytes(cu), 2 * rb)},
        {inout(dq), inout(dk), inout(dv), out(dcoefs), scratch_a, scratch_ds},
        [&] {
            dc_mha_backward(dq.ptr, dk.ptr, dv.ptr, dcoefs.ptr, go.ptr, q.ptr, k.ptr, v.ptr, lse.ptr, coefs.ptr, stride,
                            cu.ptr, 2, T, H, D, 0.1f, ws.ptr, ws_bytes, nullptr);
        },
        used_coefs + scratch);
    check_tc(what, ops, 0, 4);
    check_tc(what, ops, 1, 2);
}

int main() {
    test::seed();
    CublasLt lt;
    test_helpers();
    test_common();
    test_rows();
    test_matmul(lt);
    test_mlp(lt);
    test_mlp_fp8(lt);
    test_attention();
    test_embed();
    test_head(lt);
    test_optim(lt);
    test_rope();
    test_mudd();
    test_dc_mha(128);
    test_dc_mha(64);
    test_comms_kernels();
    return test::finish();
}
