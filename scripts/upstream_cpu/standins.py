"""CPU stand-ins for what upstream's train_gpt.py and triton_kernels.py (record 80, commit 2c702746, record
84, a333be08, the PRs of records 88 and 89 on it, record 86, 003ff3e2, with dc_triton_kernels.py, and 75d6867a,
records 87-89 on it) need
from a GPU, so that their own Python code runs on the CPU (scripts/upstream_cpu/run.py). Written here
from the kernels' semantics (upstream's sources say what each computes); nothing is copied from them.

  install()                 fake `triton` and `kernels` packages and torch.cuda._compile_kernel, before
                            upstream's files are imported; torch.compile becomes the identity (eager)
  patch_kernels(module)     triton_kernels' launchers (XXT, XTX, ba_plus_cAA, linear_relu_square with
                            a333be08's FP8 e4m3 forward and record 89's e4m3 post, transpose_copy, transpose_add,
                            record 89's reduce_mlp_activation_scales and quantize_transpose_mlp_down_weights)
                            replaced by exact CPU equivalents; post_only=True: 75d6867a's linear_relu_square
                            (record 87: post only, the backward from sqrt(post))
  patch_dc_kernels(module)  003ff3e2's dc_triton_kernels launcher (DC-MHA's post-only correction added to FA3's
                            output) replaced by a CPU autograd Function with the Triton kernels' rounding points
  torch._scaled_mm          FP8 operands cast back to fp32, one fp32 matmul, times scale_a * scale_b

Each stand-in reproduces the kernel's rounding points: fp32 accumulation, one rounding to the output
dtype, the symmetric kernels' mirrored upper triangle, the CE kernel's bf16 sigmoid and e5m2 output.
"""
import sys
import types

import torch

# -----------------------------------------------------------------------------------------------------
# FlashAttention-3's varlen forward and backward: exact softmax attention in fp32 with its masks.
# -----------------------------------------------------------------------------------------------------


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True,
                           softmax_scale=None, window_size=(-1, -1), **unused):
    """q, k, v bf16 (T, H, D), possibly fp32 where run.py keeps the compiled graph's unrounded q and k: they
    are rounded to bf16 here, where upstream's compiled graph materializes them for FA3. Key j is seen
    by query i when both are in one document (cu_seqlens, padded with T), j <= i and i - j <= window_size[0].
    Softmax in fp32 without rounding P (FA3 rounds P to bf16 before P V: a known difference, as in the
    reference); output bf16. Autograd gives the backward (FA3's dq, dk, dv: fp32 math, bf16 results)."""
    if not causal or window_size[1] != 0:
        raise NotImplementedError("standins: upstream's attention is causal with window_size = (left, 0)")
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("standins: upstream passes the same documents for queries and keys")
    q, k, v = (t.bfloat16() for t in (q, k, v))
    T = q.shape[0]
    pos = torch.arange(T)
    doc = torch.searchsorted(cu_seqlens_q.long(), pos, right=True)
    i, j = pos[:, None], pos[None, :]
    seen = (doc[:, None] == doc[None, :]) & (j <= i)
    if window_size[0] >= 0:
        seen &= i - j <= window_size[0]
    if FA3_BF16_P:
        return _Fa3RoundedP.apply(q, k, v, seen, softmax_scale)
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * softmax_scale
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, v.float()).bfloat16().contiguous()  # FA3's out is (T, H, D) dense


# run.py --fa3-bf16-p: the stand-in rounds P (and the backward's dS) to bf16 where FA3's tensor-core
# GEMMs take them, as FA3 (and the C++ trainer's mma.sync attention) do; off: exact fp32 P (the default,
# as the reference does)
FA3_BF16_P = False


class _Fa3RoundedP(torch.autograd.Function):
    """FA3's rounding points in one pass (not its online blocks): S = scale q k^T in fp32; P = exp(S - max)
    in fp32, rounded to bf16 for P V; out = bf16(sum_j bf16(P_ij) v_j / sum_j P_ij) (the denominator from the
    unrounded P). Backward: P = exp(S - lse) in fp32, dv = bf16(bf16(P)^T dout), dP = dout v^T in fp32,
    delta = rowsum(dout * out), dS = P (dP - delta) rounded to bf16 for dq = bf16(scale dS k) and
    dk = bf16(scale dS^T q)."""

    @staticmethod
    def forward(ctx, q, k, v, seen, scale):
        s = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale
        s = s.masked_fill(~seen, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        out = (torch.einsum("hij,jhd->hid", p.bfloat16().float(), v.float()) / l).permute(1, 0, 2).bfloat16()
        out = out.contiguous()
        ctx.save_for_backward(q, k, v, seen, out, m + torch.log(l))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, seen, out, lse = ctx.saved_tensors
        scale = ctx.scale
        s = (torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale).masked_fill(~seen, float("-inf"))
        p = torch.exp(s - lse)
        do = dout.bfloat16().float()
        dv = torch.einsum("hij,ihd->jhd", p.bfloat16().float(), do).bfloat16()
        dp = torch.einsum("ihd,jhd->hij", do, v.float())
        delta = (do * out.float()).sum(dim=-1).permute(1, 0)[..., None]
        ds = (p * (dp - delta)).bfloat16().float()
        dq = (scale * torch.einsum("hij,jhd->ihd", ds, k.float())).bfloat16()
        dk = (scale * torch.einsum("hij,ihd->jhd", ds, q.float())).bfloat16()
        return dq, dk, dv, None, None


def get_kernel(name, version=None):
    """2c702746: varunneal/flash-attention-3; a333be08: kernels-community/flash-attn3, version 1 (another
    build of the same FA3)."""
    if (name, version) not in (("varunneal/flash-attention-3", None), ("kernels-community/flash-attn3", 1)):
        raise NotImplementedError(f"standins: no stand-in for the kernel package {name}")
    return types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func))


# -----------------------------------------------------------------------------------------------------
# dc_triton_kernels.py (003ff3e2, record 86): the post-only, no-DD DC-MHA correction added to FA3's output.
# -----------------------------------------------------------------------------------------------------

DC_BLOCK_M = 16  # the Triton backward's query block (small_block_m): one bf16 atomic add per block into dk, dv
LOG2E = 1.4426950408889634


def _dc_visible(cu_seqlens, T, window):
    """(T, T) mask of the keys s query t reads: s in t's document (cu_seqlens, padded with T) and 0 <= t - s <
    window (the kernels' `valid`)."""
    pos = torch.arange(T)
    doc = torch.searchsorted(cu_seqlens.long(), pos, right=True)
    i, j = pos[:, None], pos[None, :]
    return (doc[:, None] == doc[None, :]) & (j <= i) & (i - j < window)


def _dc_probs(q, k, seen, scaling, lse=None):
    """Each head's softmax P_h (H, T, T) in fp32 as the kernels take it: S = fp32(q . k) (bf16 products, fp32
    sums) times the fp32 constant fp32(scaling) * fp32(log2 e), exp2. Forward (lse None): P = exp2(S - max) /
    sum, and lse = max ln 2 + ln(sum); backward: P = exp2(S - lse * log2 e) from the forward's lse."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)
    s = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * (f(scaling) * f(LOG2E))
    if lse is not None:
        return torch.where(seen, torch.exp2(s - (lse * f(LOG2E))[..., None]), f(0.0))
    s = s.masked_fill(~seen, -3.4028234663852886e38)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.where(seen, torch.exp2(s - m), f(0.0))
    den = p.sum(dim=-1, keepdim=True)
    den = torch.where(den > 0, den, f(1.0))
    return p / den, (m * f(0.6931471805599453) + torch.log(den))[..., 0]


def _dc_mix(w, p):
    """A[t, s] = sum over heads of w[t, h] P_h[t, s] in fp32, heads in order (the kernels' unrolled sum)."""
    a = w[:, 0, None].float() * p[0]
    for h in range(1, p.shape[0]):
        a = a + w[:, h, None].float() * p[h]
    return a


def _bf16_atomic_blocks(blocks, shape):
    """Per-query-block fp32 partials (list of tensors of `shape`) added as the Triton kernels' tl.atomic_add into a
    bf16 tensor of zeros: each partial rounded to bf16, then each add rounded to bf16 (here in block order; the GPU's
    order is whatever the atomics meet in)."""
    out = torch.zeros(shape, dtype=torch.bfloat16)
    for b in blocks:
        out = (out.float() + b.bfloat16().float()).bfloat16()
    return out


class _DcCorrection(torch.autograd.Function):
    """out = bf16(fp32(y) + sum_s bf16(w2[t,h] A[t,s]) v_h[s]) with A = sum_h w1[t,h] P_h: the forward kernel's
    (_dc_postonly_corr_fwd_wsmall_cached_kernel) rounding points: corr_weight.to(bf16) before the tensor-core dot
    with v, fp32 accumulation, the base added in fp32, one rounding at the store. Backward as the two Triton
    kernels (pre and qk) compute it: dy = dout; dm_h = fp32(dout_h v_h^T); dv_h = the bf16 atomic sum over query
    blocks of bf16(sum_t bf16(w2 A)[t, s] dout_h[t]); dw2 = bf16(sum_s dm_h A); dA = sum_h w2 dm_h (fp32, heads in
    order); dw1 = bf16(sum_s dA P_h); dS_h = P_h (w1 dA - sum_s w1 dA P_h); dq = bf16(fp32(bf16(dS) k) * scaling);
    dk = the bf16 atomic sum over query blocks of bf16(dS)^T q * scaling. P is recomputed from the forward's lse."""

    @staticmethod
    def forward(ctx, y, q, k, v, w1, w2, seen, scaling):
        p, lse = _dc_probs(q, k, seen, scaling)
        a = _dc_mix(w1, p)
        corr = torch.einsum("thj,jhd->thd", (w2.float().t()[:, :, None] * a[None]).permute(1, 0, 2).bfloat16().float(),
                            v.float())
        ctx.save_for_backward(q, k, v, w1, w2, seen, lse)
        ctx.scaling = scaling
        return (y.float() + corr).to(y.dtype).contiguous()  # the kernel's out: empty_like(base)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, w1, w2, seen, lse = ctx.saved_tensors
        scaling = ctx.scaling
        T, H, _ = q.shape
        p = _dc_probs(q, k, seen, scaling, lse)
        a = _dc_mix(w1, p)
        do = dout.to(q.dtype).float()
        blocks = [slice(b, min(b + DC_BLOCK_M, T)) for b in range(0, T, DC_BLOCK_M)]
        da = torch.zeros(T, T)
        dv, dw2 = torch.empty_like(v), torch.empty_like(w2)
        for h in range(H):
            dm = do[:, h] @ v[:, h].float().t()
            cw = (w2[:, h, None].float() * a).bfloat16().float()
            dv[:, h] = _bf16_atomic_blocks([cw[b].t() @ do[b, h] for b in blocks], v[:, h].shape)
            dw2[:, h] = (dm * a).sum(dim=1).to(w2.dtype)
            da = da + w2[:, h, None].float() * dm
        dw1, dq, dk = torch.empty_like(w1), torch.empty_like(q), torch.empty_like(k)
        s32 = torch.tensor(scaling, dtype=torch.float32)
        for h in range(H):
            dp = w1[:, h, None].float() * da
            soft_dot = (dp * p[h]).sum(dim=1, keepdim=True)
            dw1[:, h] = (da * p[h]).sum(dim=1).to(w1.dtype)
            ds = (p[h] * (dp - soft_dot)).bfloat16().float()
            dq[:, h] = ((ds @ k[:, h].float()) * s32).to(q.dtype)
            dk[:, h] = _bf16_atomic_blocks([(ds[b].t() @ q[b, h].float()) * s32 for b in blocks], k[:, h].shape)
        return dout, dq, dk, dv, dw1, dw2, None, None


def dc_attention_postonly_nodd_correction_add_base_triton(base_out, q, k, v, dc_weights, softmax_lse, scaling,
                                                          window=None, seq_lens=None, block_m=16, block_n=32):
    """dc_triton_kernels' launcher on the CPU: base_out (T, H, D) (FA3's output), q, k, v (1, T, H, D) (q and k
    possibly fp32 where run.py keeps the compiled graph's unrounded values: rounded to bf16 here, as the
    kernel's inputs), dc_weights = (w1, w2) (1, T, H) bf16 (dc_gate's), seq_lens the cu_seqlens; window 112 by
    default, <= 128. Upstream's kernel asserts H == 6 and D == 128; this stand-in takes any D (the tiny twin's 64)."""
    w1, w2 = dc_weights
    B, T, H, D = q.shape
    if B != 1 or k.shape != q.shape or v.shape != q.shape or tuple(w1.shape) != (B, T, H) or \
            tuple(w2.shape) != (B, T, H) or base_out.shape not in ((T, H, D), (B, T, H, D)):
        raise NotImplementedError(f"standins: DC correction shapes q {tuple(q.shape)}, base {tuple(base_out.shape)}, "
                                  f"w {tuple(w1.shape)}")
    if H != 6:
        raise NotImplementedError("standins: upstream's DC kernels unroll 6 heads")
    window = 112 if window is None else int(window)
    if softmax_lse is not None or seq_lens is None or not 0 < window <= 128:
        raise NotImplementedError("standins: upstream passes softmax_lse None, its cu_seqlens and a window <= 128")
    seen = _dc_visible(seq_lens, T, window)
    y = base_out.reshape(T, H, D)
    out = _DcCorrection.apply(y, q[0].bfloat16(), k[0].bfloat16(), v[0].bfloat16(), w1[0], w2[0], seen,
                              float(scaling))
    return out.view(base_out.shape)


def dc_direct_float64(y, q, k, v, w1, w2, cu_seqlens, scaling, window=112):
    """The DC correction evaluated directly in float64 from the same values (for --self-check): out[t, h] =
    y[t, h] + w2[t, h] sum_s A[t, s] v_h[s], A[t, s] = sum_h w1[t, h] softmax_s(scaling q_h[t] . k_h[s]) over the
    keys s of t's document with 0 <= t - s < window. Tensors (T, H, D) and (T, H); differentiable."""
    T = q.shape[0]
    seen = _dc_visible(cu_seqlens, T, window)
    s = torch.einsum("ihd,jhd->hij", q, k) * scaling
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    a = torch.einsum("ih,hij->ij", w1, p)
    return y + w2[..., None] * torch.einsum("ij,jhd->ihd", a, v)


def patch_dc_kernels(module):
    """dc_triton_kernels' launcher replaced by the stand-in above (before train_gpt.py imports it by name)."""
    name = "dc_attention_postonly_nodd_correction_add_base_triton"
    if not hasattr(module, name):
        raise SystemExit(f"standins: dc_triton_kernels.py has no {name}: not the code this stand-in knows")
    setattr(module, name, globals()[name])


# -----------------------------------------------------------------------------------------------------
# triton_kernels.py's launchers
# -----------------------------------------------------------------------------------------------------


def _mirror_upper(m):
    """The symmetric kernels compute the blocks on and above the diagonal and store each one mirrored."""
    return torch.triu(m) + torch.triu(m, 1).mT


def XXT(A, out):
    """out = A @ A^T: fp32 accumulation, one rounding, symmetric."""
    a = A.float()
    out.copy_(_mirror_upper((a @ a.mT).to(out.dtype)))
    return out


def XTX(A, out):
    """out = A^T @ A (tall A): fp32 accumulation, one rounding, symmetric."""
    a = A.float()
    out.copy_(_mirror_upper((a.mT @ a).to(out.dtype)))
    return out


def ba_plus_cAA(A, alpha, beta, out):
    """out = alpha * (A @ A) + beta * A (A symmetric): the kernel scales its fp32 accumulator by alpha,
    then adds beta * A in fp32, and rounds once."""
    a = A.float()
    acc = (a @ a.mT) * torch.tensor(alpha, dtype=torch.float32)
    out.copy_(_mirror_upper((acc + a * torch.tensor(beta, dtype=torch.float32)).to(out.dtype)))
    return out


def linear_relu_square(a, b, aux=None, a_f8=None, b_f8=None, dequant_scale_ptr=None, activation_scale=None,
                       partial_amax=None):
    """Forward (aux None): pre = bf16(a @ b^T), post = bf16(relu(pre)^2) from the bf16 pre.
    Backward (aux = pre): bf16(2 * bf16(a @ b^T) * relu(pre)).
    a333be08's FP8 forward (b_f8 given: a_f8 = e4m3 x, b_f8 = e4m3 W1, dequant_scale_ptr = the fp32
    one-element w_s * amax / 448): the e4m3 products summed in fp32 (exact products; the kernel's
    tl.dot on sm_90 accumulates them with Hopper's fast FP8 accumulation, less precise: a known
    difference), the fp32 sums times the fp32 dequant scale (accumulator *= load(dequant_scale_ptr)),
    then rounded once to bf16 as pre; post as above. a and b (bf16) are not read there.
    Record 89's EMIT_FP8 epilogue (activation_scale given, the layer's one-element act): also
    post_f8 = e4m3(min(fp32(post) * (1 / act), 448)) (1 / act in fp32: IEEE here, Triton's div.full.f32 on the
    GPU) returned third, and partial_amax[0] = the max of fp32(post) over the whole (T, H) post, the other
    slots 0: the kernel's one partial per persistent CTA, of which only the max matters, with every tile
    counted (upstream's scratch at tiny sizes would keep stale slots: run.py gives it one slot per layer)."""
    if b_f8 is not None:
        if aux is not None or a_f8 is None or dequant_scale_ptr is None:
            raise NotImplementedError("standins: the FP8 path is forward only, with a_f8 and the dequant scale")
        if a_f8.dtype != torch.float8_e4m3fn or b_f8.dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"standins: FP8 operands {a_f8.dtype}, {b_f8.dtype}, want e4m3fn")
        if dequant_scale_ptr.dtype != torch.float32 or dequant_scale_ptr.numel() != 1:
            raise NotImplementedError("standins: the dequant scale is one fp32 element")
        acc = a_f8.float() @ b_f8.float().t()
        acc = acc * dequant_scale_ptr.reshape(())
        c = acc.to(a.dtype)
        post = torch.relu(c.float()).square().to(a.dtype)
        if activation_scale is None:
            return c, post
        if partial_amax is None or activation_scale.dtype != torch.float32 or activation_scale.numel() != 1:
            raise NotImplementedError("standins: the FP8 epilogue takes one fp32 act and a partial-amax row")
        inv = torch.tensor(1.0, dtype=torch.float32) / activation_scale.reshape(())
        post_f8 = torch.minimum(post.float() * inv, torch.tensor(448.0)).to(torch.float8_e4m3fn)
        partial_amax.zero_()
        partial_amax[0] = post.float().amax()
        return c, post, post_f8
    if activation_scale is not None:
        raise NotImplementedError("standins: the e4m3 post comes with the FP8 up-projection only")
    c = (a.float() @ b.float().t()).to(a.dtype)
    if aux is None:
        return c, torch.relu(c.float()).square().to(a.dtype)
    return (2 * c.float() * torch.relu(aux.float())).to(a.dtype)


def linear_relu_square_post_only(a, b, aux=None, a_f8=None, b_f8=None, dequant_scale_ptr=None, activation_scale=None,
                                 partial_amax=None):
    """75d6867a's kernel (record 87: the forward keeps post only). Forward: c = bf16(acc) (acc as in
    linear_relu_square: the bf16 GEMM or the e4m3 one times the fp32 dequant scale), post = bf16(relu(c)^2) (the
    product of two bf16 values is exact in fp32: one rounding), returned alone, or with EMIT_FP8 (activation_scale
    given) as (post, post_f8), post_f8 and partial_amax as linear_relu_square's. Backward (aux = post): relu(pre)
    taken as sqrt(fp32(post)): dpre = bf16(fp32(2 bf16(g W2^T)) * sqrt(fp32(post))), the product in fp32 then one
    bf16 rounding (an IEEE root here; Triton's tl.sqrt is the approximate sqrt.approx.f32 on the GPU)."""
    if aux is not None:
        if b_f8 is not None or activation_scale is not None:
            raise NotImplementedError("standins: the post-only backward is the bf16 GEMM with aux = post")
        c = (a.float() @ b.float().t()).to(a.dtype)
        return (2 * c.float() * torch.sqrt(aux.float())).to(a.dtype)
    out = linear_relu_square(a, b, None, a_f8, b_f8, dequant_scale_ptr, activation_scale, partial_amax)
    return out[1] if activation_scale is None else (out[1], out[2])  # (pre, post[, post_f8]) -> post[, post_f8]


def _delayed_scale(amax, headroom):
    """reduce_mlp_activation_scales_kernel's max(amax, 1e-12) * (HEADROOM / 448.0): the constexpr quotient folded
    in double, rounded once to fp32 where it multiplies."""
    return torch.maximum(amax.float(), torch.tensor(1e-12, dtype=torch.float32)) * \
        torch.tensor(headroom / 448.0, dtype=torch.float32)


def reduce_mlp_activation_scales(partial_amax, scales, headroom=1.25):
    """scales[l] = max(max_k partial_amax[l, k], 1e-12) * fp32(headroom / 448) for each row l of the partials."""
    num_layers = partial_amax.shape[0]
    if scales.numel() < num_layers:
        raise NotImplementedError("standins: fewer scales than partial-amax rows")
    scales[:num_layers] = _delayed_scale(partial_amax.amax(dim=1), headroom)


def quantize_transpose_mlp_down_weights(weights, output_storage, next_scales, used_scales, partial_amax,
                                        headroom=1.12):
    """Per layer l of weights (L, H, C) bf16: scale = next_scales[l]; output_storage[l] (C, H) =
    e4m3(clamp(fp32(W) / scale, +-448)) transposed (an IEEE fp32 division here, Triton's div.full.f32 on the GPU);
    used_scales[l] = scale; then next_scales[l] = max(max|W|, 1e-12) * fp32(headroom / 448) (the tiles' partials
    reduced as reduce_mlp_activation_scales does). partial_amax (upstream's (12, 576), sized for 3072 x 768: its
    launcher asserts that shape, which tiny sizes do not have) is written with each layer's amax in slot 0."""
    num_layers, hidden_dim, model_dim = weights.shape
    if tuple(output_storage.shape) != (num_layers, model_dim, hidden_dim):
        raise NotImplementedError(f"standins: W2q storage {tuple(output_storage.shape)} for weights "
                                  f"{tuple(weights.shape)}")
    if partial_amax.shape[0] != num_layers:
        raise NotImplementedError("standins: one partial-amax row per layer")
    w = weights.float()
    scale = next_scales[:num_layers].clone()
    q = torch.maximum(torch.minimum(w / scale[:, None, None], torch.tensor(448.0)), torch.tensor(-448.0))
    output_storage.copy_(q.transpose(1, 2).to(torch.float8_e4m3fn))
    used_scales[:num_layers] = scale
    partial_amax.zero_()
    partial_amax[:, 0] = w.abs().amax(dim=(1, 2))
    reduce_mlp_activation_scales(partial_amax, next_scales, headroom=headroom)


def transpose_copy(src, dst):
    dst.copy_(src.t())


def transpose_add(src, dst):
    """dst += src^T in fp32, rounded once to dst's dtype."""
    dst.copy_((dst.float() + src.t().float()).to(dst.dtype))


def patch_kernels(module, post_only=False):
    """post_only: 75d6867a's linear_relu_square (record 87's post-only kernel) in place of the earlier one."""
    for name in ("XXT", "XTX", "ba_plus_cAA", "linear_relu_square", "transpose_copy", "transpose_add"):
        if not hasattr(module, name):
            raise SystemExit(f"standins: triton_kernels.py has no {name}: not the code this stand-in knows")
        setattr(module, name, globals()[name])
    if post_only:
        module.linear_relu_square = linear_relu_square_post_only
    for name in ("reduce_mlp_activation_scales", "quantize_transpose_mlp_down_weights"):  # record 89
        if hasattr(module, name):
            setattr(module, name, globals()[name])


# -----------------------------------------------------------------------------------------------------
# The NVRTC cross-entropy kernel (ce_fwd_bwd_kernel), one row per CUDA block.
# -----------------------------------------------------------------------------------------------------


def _fma32(a, b, c):
    """fp32 fused multiply-add: the product is exact in float64, then one rounding (double rounding
    through float64 differs from a true FMA only in vanishingly rare ties)."""
    return (a.double() * b.double() + c.double()).float()


class CeKernel:
    """What ce_fwd_bwd_kernel writes: losses[t] and grad_input[t, :] (e5m2) from the bf16 logits.
    In the kernel's order of fp32 operations: u = fma(l, 1/C, B/C); s = 0.5 + tanh(0.5 u) 0.5 (the
    hardware tanh approximation there, the correctly rounded one here), rounded to bf16 and reused; the
    max over the unrounded A s; lse = max + log(sum exp(A s_bf16 - max)); loss = sum over k with
    t + k < T of fma(w_k, lse - A s[target], loss); S_w = the sum of all n_predict weights; every
    column written with term2 = 0, then each target column of rows t + k < T rewritten with term2 =
    the weights of the k < 3 whose target is that column.
    Record 88's kernel (75d6867a, and its PR on a333be08) takes prefix_targets and prefix_weight after the
    MTP weights: a row whose prefix P is in [0, V) adds fma(pw, lse - A s[P], loss) after the MTP terms,
    starts S_w at pw, and its column P's term2 adds pw after the MTP weights."""

    def set_shared_memory_config(self, nbytes):
        pass

    def __call__(self, grid, block, args, shared_mem=0):
        if len(args) == 14:
            (logits, targets, mtp_weights, prefix_targets, prefix_weight, losses, grad_input, n_rows, n_predict, A,
             B, C, grad_s, grad_scale) = args
        else:
            logits, targets, mtp_weights, losses, grad_input, n_rows, n_predict, A, B, C, grad_s, grad_scale = args
            prefix_targets = prefix_weight = None
        f = lambda v: torch.tensor(v, dtype=torch.float32)
        A, B, C, grad_s, grad_scale = f(A), f(B), f(C), f(grad_s), f(grad_scale)
        inv_C = 1 / C
        s_raw = 0.5 + torch.tanh(_fma32(logits.float(), inv_C, B * inv_C) * 0.5) * 0.5
        s = s_raw.bfloat16().float()
        row_max = (A * s_raw).amax(dim=1, keepdim=True)
        lse = row_max + torch.log(torch.exp(A * s - row_max).sum(dim=1, keepdim=True))
        w = mtp_weights.float()
        T = n_rows
        total = torch.zeros(T, dtype=torch.float32)
        for k in range(n_predict):
            m = max(T - k, 0)
            zt = A * s[:m].gather(1, targets[k:k + m].long().unsqueeze(1)).squeeze(1)
            total[:m] = _fma32(w[k].expand(m), lse[:m, 0] - zt, total[:m])
        S_w = torch.zeros((T, 1), dtype=torch.float32)
        if prefix_targets is not None:
            V = s.shape[1]
            pw = prefix_weight.float().reshape(())
            P = prefix_targets.long()
            valid = (P >= 0) & (P < V)
            Pc = P.clamp(0, V - 1)
            zp = A * s.gather(1, Pc.unsqueeze(1)).squeeze(1)
            total = torch.where(valid, _fma32(pw.expand(T), lse[:, 0] - zp, total), total)
            S_w = torch.where(valid, pw, torch.zeros((), dtype=torch.float32)).unsqueeze(1)
        losses.copy_(total)
        for k in range(n_predict):
            S_w = S_w + w[k]
        term2 = torch.zeros_like(s)
        for k in range(min(n_predict, 3)):
            m = max(T - k, 0)
            term2[:m].scatter_add_(1, targets[k:k + m].long().unsqueeze(1), w[k].expand(m, 1).contiguous())
        if prefix_targets is not None:
            rows = valid.nonzero().squeeze(1)
            term2[rows, Pc[rows]] += pw
        grad_z = S_w * torch.exp(A * s - lse) - term2
        g = grad_scale * (1 / C * A) * (1 / grad_s) * grad_z * s * (1 - s)
        big = torch.finfo(torch.float8_e5m2).max  # cvt.rn.satfinite
        grad_input.copy_(g.clamp(-big, big).to(torch.float8_e5m2))


def _compile_kernel(source, name, **unused):
    if name != "ce_fwd_bwd_kernel":
        raise NotImplementedError(f"standins: no CPU stand-in for the NVRTC kernel {name}")
    return CeKernel()


# -----------------------------------------------------------------------------------------------------
# torch._scaled_mm
# -----------------------------------------------------------------------------------------------------


def scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """(a @ b) * scale_a * scale_b from the FP8 operands' exact values in one fp32 matmul (cuBLASLt's
    fast accumulation on Hopper is less precise in the forward: a known difference), then out_dtype."""
    if bias is not None or scale_result is not None:
        raise NotImplementedError("standins: upstream calls _scaled_mm without bias or scale_result")
    out = (a.float() @ b.float()) * (scale_a.float() * scale_b.float())
    return out.to(out_dtype or a.dtype)


# -----------------------------------------------------------------------------------------------------
# The compiled NorMuon update on bf16 bits: CPU PyTorch has no uint32 shifts, so the same bit
# arithmetic in int64.
# -----------------------------------------------------------------------------------------------------


def cautious_wd_and_update_inplace(p, mantissa, grad, wd_tensor, lr_tensor):
    """p (uint16 view of the bf16 parameter) << 16 | mantissa is the fp32 parameter; it is updated with
    cautious weight decay and written back as its top and bottom 16 bits (upstream's compiled function)."""
    grad = grad.float()
    wd, lr = wd_tensor.to(torch.float32), lr_tensor.to(torch.float32)
    raw = (p.to(torch.int64) << 16) | mantissa.to(torch.int64)
    precise = (raw - (raw >> 31) * (1 << 32)).to(torch.int32).view(torch.float32)
    mask = (grad * precise) >= 0
    new = precise - (precise * mask * wd * lr) - (grad * lr)
    bits = new.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    p.copy_((bits >> 16).to(torch.uint16))
    mantissa.copy_((bits & 0xFFFF).to(torch.uint16))


# -----------------------------------------------------------------------------------------------------
# install()
# -----------------------------------------------------------------------------------------------------


class _Anything(types.ModuleType):
    """Triton's names for importing triton_kernels.py only: its decorators and annotations are evaluated
    at import, and every kernel it defines is replaced by a CPU stand-in above before anything calls it.
    A kernel that were launched anyway fails loudly: `@triton.jit` leaves the plain Python function, which
    cannot be indexed by a grid (`kernel[grid](...)` raises TypeError)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _import_only


def _import_only(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]  # @triton.jit and friends: the function itself
    return _import_only


def install():
    # torch's own modules probe for Triton when first imported: load them before the fake one exists
    import torch._dynamo  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    triton = _Anything("triton")
    triton.__version__ = "cpu-standin"
    triton.cdiv = lambda a, b: -(-a // b)
    language = _Anything("triton.language")
    tools = _Anything("triton.tools")
    descriptor = _Anything("triton.tools.tensor_descriptor")
    triton.language, triton.tools, tools.tensor_descriptor = language, tools, descriptor
    sys.modules.update({"triton": triton, "triton.language": language, "triton.tools": tools,
                        "triton.tools.tensor_descriptor": descriptor})
    kernels = types.ModuleType("kernels")
    kernels.get_kernel = get_kernel
    sys.modules["kernels"] = kernels
    torch.cuda._compile_kernel = _compile_kernel
    torch._scaled_mm = scaled_mm

    def no_compile(fn=None, **unused):
        return fn if fn is not None else (lambda f: f)
    torch.compile = no_compile
