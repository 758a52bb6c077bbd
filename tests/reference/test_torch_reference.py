#!/usr/bin/env python3
"""Tests of the PyTorch reference (torch_reference.py) against facts computed independently of it:
hand-computed schedule values and optimizer steps, float64 re-derivations, format definitions.
Skips (exit 0) where torch is not installed; CI does not need it.

  python3 tests/reference/test_torch_reference.py      (about half a minute on one core)
"""
import math
import os
import struct
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import torch
    import torch_reference as R
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

needs_torch = unittest.skipUnless(HAVE_TORCH, "torch is not installed")


def small_config():
    """The tiny preset with a small vocabulary: every code path, fast."""
    c = R.tiny_config()
    c.vocab_size, c.padded_vocab, c.bigram_vocab = 500, 512, 64 * 5
    return c


def random_batch(cfg, T, docs, gen):
    inputs = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
    starts = sorted(set([0] + torch.randint(1, T, (docs - 1,), generator=gen).tolist()))
    cu = starts + [T] * (8 - len(starts))
    bigram = torch.randint(0, cfg.bigram_vocab, (T,), generator=gen)
    return R.Batch(inputs, targets, torch.tensor(cu), bigram)


def round_to_format(v, mantissa_bits, min_exp, max_finite):
    """Nearest value of a binary float format (ties to even), saturating at max_finite: from the
    format's definition, in Python floats."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = max(math.frexp(a)[1] - 1, min_exp)  # exponent of the leading bit, clamped to the subnormal range
    q = 2.0 ** (e - mantissa_bits)
    r = round(a / q) * q  # Python's round: ties to even
    return math.copysign(min(r, max_finite), v)


@needs_torch
class ScheduleTest(unittest.TestCase):
    def test_tiny_stages_split_and_transitions(self):
        s = R.Schedule(R.tiny_config())
        self.assertEqual(s.boundaries, [(0, 10), (10, 20), (20, 30), (30, 34)])
        self.assertEqual(s.split_step, 21)  # start of stage 2 (20), made odd
        self.assertEqual(s.transition_steps(), [10, 20, 30])
        self.assertEqual(s.total_steps, 34)

    def test_record_stages_split_and_transitions(self):
        s = R.Schedule(R.record_config())
        self.assertEqual(s.boundaries, [(0, 505), (505, 1010), (1010, 1515), (1515, 1555)])
        self.assertEqual(s.split_step, 1011)
        self.assertEqual(s.transition_steps(), [505, 1010, 1515])

    def test_lr(self):
        s = R.Schedule(R.tiny_config())
        # cool-down from int(30 * 0.45) = 13 to step 30, towards 0.1
        want = {0: 1.0, 9: 1.0, 10: 1.52, 12: 1.52, 13: 1.52,
                15: 1.52 * 15 / 17 + 0.1 * 2 / 17,
                20: 1.73 * 10 / 17 + 0.1 * 7 / 17,
                25: 1.73 * 5 / 17 + 0.1 * 12 / 17,
                29: 1.73 * 1 / 17 + 0.1 * 16 / 17,
                30: 0.1, 33: 0.1, 34: 0.1}
        for step, lr in want.items():
            self.assertAlmostEqual(s.lr(step), lr, places=12, msg=f"step {step}")
        r = R.Schedule(R.record_config())
        self.assertEqual(r.lr(680), 1.52)  # cool-down starts at int(1515 * 0.45) = 681
        self.assertAlmostEqual(r.lr(681 + 417), 1.73 * 0.5 + 0.1 * 0.5, places=12)  # halfway: 834 / 2 = 417
        self.assertAlmostEqual(r.lr(1515), 0.1, places=12)

    def test_muon_momentum(self):
        r = R.Schedule(R.record_config())
        for step, m in {0: 0.85, 150: 0.90, 299: 0.85 + 0.1 * 299 / 300, 300: 0.95, 1505: 0.95, 1530: 0.90,
                        1555: 0.85}.items():
            self.assertAlmostEqual(r.muon_momentum(step), m, places=12, msg=f"step {step}")
        t = R.Schedule(R.tiny_config())  # 34 steps never leave the 300-step warm-up
        self.assertAlmostEqual(t.muon_momentum(30), 0.86, places=12)
        self.assertAlmostEqual(t.muon_momentum(33), 0.85 + 0.1 * 33 / 300, places=12)

    def test_mtp_weights_and_windows(self):
        s = R.Schedule(R.tiny_config())
        want = {0: [1, 0.5, 0.25], 5: [1, 0.5, 0.125], 9: [1, 0.5, 0.025], 10: [1, 0.5], 15: [1, 0.25],
                20: [1], 34: [1]}
        for step, w in want.items():
            got = s.mtp_weights(step)
            self.assertEqual(got.dtype, torch.float32)
            self.assertEqual(got.tolist(), torch.tensor(w, dtype=torch.float32).tolist(), f"step {step}")
        for step, ws in {0: (1, 3), 9: (1, 3), 10: (3, 7), 19: (3, 7), 20: (5, 11), 30: (6, 13), 34: (6, 13)}.items():
            self.assertEqual(s.windows(step), ws, f"step {step}")
        for step, bt in {0: 8 * 32, 10: 8 * 48, 20: 8 * 64, 33: 8 * 64}.items():  # tiny_preset()'s stages
            self.assertEqual(s.batch_tokens(step), bt)

    def test_trainer_windows_and_yarn(self):
        cfg = small_config()
        cfg.block_size = 32  # windows long enough that YaRN's ramp is partial for the fastest frequencies
        tr = R.Trainer(cfg, R.init_params(cfg, 1))
        f0 = tr.yarn.freq.clone()
        for step in range(10):
            tr.advance(step)
        self.assertTrue(torch.equal(tr.yarn.freq, f0))
        tr.advance(10)  # long window 3 -> 7 blocks of 32 tokens: YaRN from 96 to 224 tokens
        self.assertEqual((tr.forward_args().ws_short, tr.forward_args().ws_long), (96, 224))
        self.assertAlmostEqual(tr.yarn.attn_scale, 0.1 * (0.2 * math.log(224 / 96) + 1), places=12)
        for j in (0, 15):  # the fastest and the slowest frequency, by hand in double
            f = (1 / 1024) ** (j / 15)
            blend = min(max((96 * f / (2 * math.pi) - 1) / 31, 0), 1)
            self.assertAlmostEqual(tr.yarn.freq[2 * j].item(), f * (96 / 224 + blend * (1 - 96 / 224)), delta=1e-6 * f)
        self.assertTrue(torch.equal(tr.yarn.freq, tr.yarn_paired.freq))
        # table entries: bf16 cos/sin of position * frequency; pairs rotate (x0, x1) -> (c x0 + s x1, c x1 - s x0)
        t, j = 37, 3
        th = t * tr.yarn.freq[2 * j].item()
        self.assertEqual(tr.yarn.cos[t, 2 * j].item(), torch.tensor(math.cos(th)).bfloat16().item())
        self.assertEqual(tr.yarn.sin[t, 2 * j + 1].item(), -torch.tensor(math.sin(th)).bfloat16().item())
        self.assertEqual(tr.yarn.cos[t, cfg.head_dim - 1].item(), 1.0)  # upper half unrotated
        th_odd = (2 * t + 1) * tr.yarn.freq[2 * j].item()  # paired row t, second head: position 2t+1
        want = torch.tensor(math.cos(th_odd)).bfloat16().item()
        self.assertEqual(tr.yarn_paired.cos[t, cfg.head_dim + 2 * j].item(), want)
        tr.apply_final_window_extension()
        self.assertEqual(tr.forward_args().ws_long, 20 * 32)
        self.assertAlmostEqual(tr.yarn.attn_scale, 0.1 * (0.2 * math.log(224 / 96) + 1), places=12)  # no YaRN for it


@needs_torch
class Fp8Test(unittest.TestCase):
    def test_casts_round_to_nearest_even_and_saturate(self):
        g = torch.Generator().manual_seed(3)
        x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, 300.0)] +
                      [torch.tensor([1.0625, 1.1875, 464.0, 1e6, -1e6, 2.0 ** -10, 3 * 2.0 ** -10, 0.0])])
        for dtype, bits, min_exp, mx in ((torch.float8_e4m3fn, 3, -6, 448.0), (torch.float8_e5m2, 2, -14, 57344.0)):
            got = R.to_fp8(x, dtype).float().tolist()
            want = [round_to_format(v, bits, min_exp, mx) for v in x.tolist()]
            self.assertEqual(got, want, str(dtype))
        self.assertEqual(R.to_fp8(torch.tensor([1.0625, 1.1875]), torch.float8_e4m3fn).float().tolist(), [1.0, 1.25])

    def test_lm_head_forward_and_backward(self):
        g = torch.Generator().manual_seed(4)
        T, C, V = 16, 32, 48
        x = torch.randn(T, C, generator=g).bfloat16().requires_grad_(True)
        w = (torch.randn(C, V, generator=g) * 0.01).bfloat16().requires_grad_(True)
        xs, ws, gs = 100 / 448, 1.6 / 448, 0.25 * 0.75 / 448
        out = R.Fp8LmHead.apply(x, w, xs, ws, gs)
        # operands divided by their scales in fp32 (upstream's compiled division), then rounded per the format
        q = lambda t, s, b, e, m: torch.tensor([[round_to_format(v, b, e, m) for v in row] for row in (t / s).tolist()],
                                               dtype=torch.float64)
        sx, sw, sg = (float(torch.tensor(v, dtype=torch.float32)) for v in (xs, ws, gs))
        xq, wq = q(x.float(), xs, 3, -6, 448.0), q(w.float(), ws, 3, -6, 448.0)
        want = (xq @ wq) * sx * sw
        self.assertTrue(torch.allclose(out.double(), want, rtol=2 ** -8, atol=1e-6))
        dy = (torch.randn(T, V, generator=g) * 1e-3).bfloat16()
        out.backward(dy)
        gq = q(dy.float(), gs, 2, -14, 57344.0)
        self.assertTrue(torch.allclose(x.grad.double(), (gq @ wq.t()) * sg * sw, rtol=2 ** -8, atol=1e-9))
        self.assertTrue(torch.allclose(w.grad.double(), (xq.t() @ gq) * sx * sg, rtol=2 ** -8, atol=1e-9))


@needs_torch
class LossTest(unittest.TestCase):
    def test_mtp_loss_by_hand_and_backward(self):
        g = torch.Generator().manual_seed(5)
        T, V = 7, 11
        logits = (torch.randn(T, V, generator=g) * 3).bfloat16().requires_grad_(True)
        targets = torch.randint(0, V, (T,), generator=g)
        w = torch.tensor([1.0, 0.5, 0.25])
        loss = R.mtp_loss(logits, targets, w)
        want = 0.0
        for t in range(T):
            z = [23 / (1 + math.exp(-(logits[t, v].item() + 5) / 7.5)) for v in range(V)]
            lse = math.log(sum(math.exp(zi) for zi in z))
            want += sum(w[k].item() * (lse - z[targets[t + k]]) for k in range(3) if t + k < T)
        self.assertAlmostEqual(loss.item(), want, delta=1e-5 * abs(want))
        loss.backward(torch.tensor(0.25))
        ref = logits.detach().clone().requires_grad_(True)
        (R.mtp_loss_autograd(ref, targets, w) * 0.25).backward()
        self.assertTrue(torch.allclose(logits.grad.float(), ref.grad.float(), rtol=2 ** -7, atol=1e-7))

    def test_eval_loss(self):
        logits = torch.tensor([[0.0, 1.0, -2.0], [3.0, 0.5, 0.5]]).bfloat16()
        z = [[23 / (1 + math.exp(-(v + 5) / 7.5)) for v in row] for row in logits.float().tolist()]
        want = sum(math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(z, [2, 0])) / 2
        self.assertAlmostEqual(R.eval_loss(logits, torch.tensor([2, 0])).item(), want, places=5)


@needs_torch
class ModelTest(unittest.TestCase):
    def test_initial_losses_are_uniform(self):
        """At init the logits are near 0, so every softcapped logit is near 23*sigmoid(2/3): the loss is
        ln(V) per prediction, the MTP one weighted by the sum of the row's weights."""
        cfg = small_config()
        tr = R.Trainer(cfg, R.init_params(cfg, 2))
        b = random_batch(cfg, 96, 4, torch.Generator().manual_seed(6))
        args = tr.forward_args()
        w = args.mtp_weights
        self.assertEqual(R.mtp_weight_sums(torch.ones(3), 96).sum().item(), 96 + 95 + 94)  # rows near the end
        train = R.forward(cfg, tr.params, b, args, training=True).item()
        weight = R.mtp_weight_sums(w, 96).sum().item()
        self.assertAlmostEqual(train / weight, math.log(cfg.padded_vocab), delta=0.01)
        ev = R.forward(cfg, tr.params, b, args, training=False).item()
        self.assertAlmostEqual(ev, math.log(cfg.padded_vocab), delta=0.01)

    def test_attention_window_and_documents(self):
        g = torch.Generator().manual_seed(7)
        R_, S, D = 12, 2, 8
        q, k, v = (torch.randn(R_, S, D, generator=g).bfloat16() for _ in range(3))
        doc = torch.tensor([0] * 5 + [1] * 7)
        self.assertTrue(torch.equal(R.attention(q, k, v, doc, 0, 0.3), v))  # window 0: a row sees itself only
        y = R.attention(q, k, v, doc, 2, 0.3)
        i, s = 7, 1  # row 7 sees rows 5, 6, 7 (its document starts at 5)
        sc = torch.tensor([(q[i, s].double() * k[j, s].double()).sum().item() * 0.3 for j in (5, 6, 7)]).softmax(0)
        want = sum(sc[n] * v[j, s].double() for n, j in enumerate((5, 6, 7)))
        self.assertTrue(torch.allclose(y[i, s].double(), want, rtol=2 ** -7, atol=1e-3))
        self.assertTrue(torch.equal(R.attention(q, k, v, doc, 2, 0.3)[5], v[5]))  # a document's first row

    def test_batch_doc_ids(self):
        b = R.Batch(torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), torch.tensor([0, 0, 3, 8, 8]),
                    torch.zeros(8, dtype=torch.long))
        self.assertEqual(b.doc_ids().tolist(), [2, 2, 2, 3, 3, 3, 3, 3])  # an empty document (0, 0) is harmless


def f64_polar_express(u):
    x = u / (torch.linalg.matrix_norm(u) * 1.02 + 1e-6)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for a, b, c in R.POLAR_EXPRESS_COEFFS:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


@needs_torch
class OptimizerTest(unittest.TestCase):
    def test_adam_first_step_by_hand(self):
        """Step 1: m = (1-b1) g, v = (1-b2) g^2, so m / sqrt(v) = g/|g| (1-b1)/sqrt(1-b2) and the bias
        correction makes the update lr * sign(g); cautious decay adds lr^2 wd wd_mul p where p and g agree."""
        p = torch.tensor([0.5, -0.25, 0.125, -1.0])
        g = torch.tensor([0.01, 0.02, -0.03, -0.04])
        m, v = torch.zeros(4), torch.zeros(4)
        b1, b2, lr, wd = 0.9, 0.99, 0.04, 0.005 * 0.0016  # lr 0.008 x lr_mul 5; eff_wd = lr^2 * 0.005 * 1
        R.adam_update(p, g, m, v, b1, b2, 1e-10, lr * (1 - b2) ** 0.5 / (1 - b1), wd)
        want = [0.5 - lr - wd * 0.5, -0.25 - lr, 0.125 + lr, -1.0 + lr - wd * -1.0]
        for got, w in zip(p.tolist(), want):
            self.assertAlmostEqual(got, w, delta=1e-7)
        self.assertTrue(torch.allclose(m, 0.1 * g) and torch.allclose(v, 0.01 * g * g))
        pb = torch.tensor([1.0, -1.0]).bfloat16()  # bf16 parameter: rounded once
        R.adam_update(pb, torch.tensor([1.0, 1.0]).bfloat16(), torch.zeros(2), torch.zeros(2), b1, b2, 1e-10,
                      0.01 * (1 - b2) ** 0.5 / (1 - b1), 0.0)
        self.assertEqual(pb.tolist(), [torch.tensor(0.99).bfloat16().item(), torch.tensor(-1.01).bfloat16().item()])

    def test_normuon_one_matrix_against_float64(self):
        g = torch.Generator().manual_seed(8)
        for rows, cols in ((96, 32), (32, 96), (48, 48)):
            p = (torch.rand(rows, cols, generator=g) * 0.2 - 0.1).bfloat16()
            mantissa = torch.zeros(rows, cols, dtype=torch.int32)
            mom = torch.randn(rows, cols, generator=g) * 1e-3
            grad = (torch.randn(rows, cols, generator=g) * 1e-3).bfloat16()
            sm_shape = (rows, 1) if rows >= cols else (1, cols)
            sm = torch.rand(sm_shape, generator=g) * 1e-2
            mu, beta2, lr, wd = 0.9, 0.95, 0.023 * 2, 1.2 * 0.023
            # float64, the same formulas without rounding
            mom64 = mom.double() + (1 - mu) * (grad.double() - mom.double())
            u64 = grad.double() + mu * (mom64 - grad.double())
            v64 = f64_polar_express(u64)
            dim = 1 if rows >= cols else 0
            mean = v64.square().mean(dim, keepdim=True)
            sm64 = sm.double() + (1 - beta2) * (mean - sm.double())
            step = sm64.clamp_min(1e-10).rsqrt()
            v64 = v64 * step * (v64.norm() / (v64 * step).norm())
            p64 = p.double()
            p64 = p64 - p64 * ((v64 * p64) >= 0) * wd * lr - v64 * lr
            # the reference
            m32, s32 = mom.clone(), sm.clone()
            gf = grad.float()
            m32.lerp_(gf, 1 - mu)
            v = R.normuon_variance_reduction(R.polar_express(gf.lerp(m32, mu)), s32, beta2)
            self.assertTrue(torch.allclose(m32.double(), mom64, rtol=1e-6, atol=1e-9))  # fp32 lerp of 1e-3 values
            # its lerp reads the bf16 v, whose per-row mean squares are within 4% of float64's (5% allowed)
            bound = 0.05 * (1 - beta2) * mean + 1e-6 * sm64
            self.assertTrue(bool(((s32.double() - sm64).abs() <= bound).all()), f"{rows}x{cols}: second moment")
            rel = (v.double() - v64).norm() / v64.norm()
            # five bf16 iterations: ~1.7% from float64
            self.assertLess(rel.item(), 0.03, f"{rows}x{cols}: bf16 Polar Express vs float64")
            pp = p.clone()
            R.cautious_update_with_mantissa(pp, mantissa, v, wd, lr)
            full = (R.bf16_bits(pp).long() << 16) | mantissa.long()
            full = (full - ((full >> 31) & 1) * (1 << 32)).to(torch.int32).view(torch.float32)
            # the fp32 parameter is the fp32 update of the bf16 one (mantissa 0), to the bit
            p32, vf = p.float(), v.float()
            lr32, wd32 = torch.tensor(lr, dtype=torch.float32), torch.tensor(wd, dtype=torch.float32)
            self.assertTrue(torch.equal(full, p32 - p32 * ((vf * p32) >= 0) * wd32 * lr32 - vf * lr32))
            step64 = p64 - p.double()
            self.assertLess(((full.double() - p.double() - step64).norm() / step64.norm()).item(), 0.03)
            # orthogonalization: singular values of the update near 1 before the variance scaling
            sv = torch.linalg.svdvals(R.polar_express(u64.float()).double())
            self.assertTrue(sv.max() < 1.25 and sv.min() > 0.6, f"{rows}x{cols}: singular values {sv}")

    def test_mantissa_keeps_small_updates(self):
        """A bf16 parameter alone cannot move by 1.2e-4 relative; with the 16-bit mantissa 100 such steps
        move it by 1.2e-2 (to fp32 precision). The split truncates: p is the top half of the fp32 bits
        (1.0078125, where rounding 1.012 to nearest would give 1.015625)."""
        p = torch.full((1, 4), 1.0).bfloat16()
        mantissa = torch.zeros(1, 4, dtype=torch.int32)
        for _ in range(100):
            R.cautious_update_with_mantissa(p, mantissa, torch.full((1, 4), -1.0).bfloat16(), 0.0, 1.2e-4)
        full = ((R.bf16_bits(p) << 16) | mantissa).view(torch.float32)
        self.assertAlmostEqual(full[0, 0].item(), 1.012, delta=1e-5)
        self.assertEqual(p[0, 0].item(), 1.0078125)
        self.assertEqual(full[0, 0].bfloat16().item(), 1.015625)

    def test_optimizer_steps_and_tying(self):
        cfg = small_config()
        tr = R.Trainer(cfg, R.init_params(cfg, 3))
        gen = torch.Generator().manual_seed(9)
        batches = [random_batch(cfg, 32, 2, gen) for _ in range(8)]
        before = {n: t.detach().clone() for n, t in tr.params.items()}
        tr.advance(0)
        tr.accumulate_gradients(batches)
        grads0 = {n: t.grad.clone() for n, t in tr.params.items()}
        tr.optimizer_step(0)  # even: NorMuon only; Adam gradients kept for the next step
        for n, (optim, *_rest) in R.PARAM_TABLE.items():
            t = tr.params[n]
            if optim == "adam":
                self.assertTrue(torch.equal(t.detach(), before[n]), n)
                self.assertTrue(torch.equal(t.grad, grads0[n]), n)
            else:
                self.assertIsNone(t.grad, n)
                self.assertFalse(torch.equal(t.detach(), before[n]), n)
        tr.advance(1)
        tr.accumulate_gradients(batches)
        lm_grad = (tr.params["lm_head"].grad.float() + tr.params["embed"].grad.float().t()).bfloat16()
        st = tr.optimizer.state["lm_head"]
        tr.optimizer_step(1)  # odd: Adam on the two steps' gradients, lm_head with embed's, embed = lm_head^T
        self.assertEqual(st["step"], 1)
        self.assertTrue(torch.allclose(st["exp_avg"], 0.5 * lm_grad.float()))  # beta1 0.5
        self.assertEqual(tr.optimizer.state["embed"]["step"], 0)
        self.assertTrue(torch.equal(tr.params["embed"].detach(), tr.params["lm_head"].detach().t()))
        self.assertFalse(torch.equal(tr.params["lm_head"].detach(), before["lm_head"]))
        self.assertTrue(all(t.grad is None for t in tr.params.values()))
        tr.optimizer.untie()
        self.assertEqual(tr.optimizer.state["embed"]["step"], 1)
        self.assertTrue(torch.equal(tr.optimizer.state["embed"]["exp_avg"], st["exp_avg"].t()))

    def test_normuon_lr_multipliers(self):
        cfg = small_config()  # the tiny preset's matrices: attn (128, 128), mlp (512, 128)
        opt = R.NorMuonAdam(cfg, R.init_params(cfg, 1))
        self.assertEqual(opt.lr_muls("attn_bank"), [1.0] * 40)
        self.assertEqual(opt.lr_muls("mlp_bank"), [2.0, 4.0] * 12)  # (512, 128): sqrt(4); c_proj twice that


@needs_torch
class CheckpointTest(unittest.TestCase):
    def test_safetensors_round_trip_and_labels(self):
        cfg = small_config()
        p = R.init_params(cfg, 4)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank0.safetensors")
            R.write_safetensors(path, {"param." + R.LABELS[n]: t.reshape(t.shape[0], -1) for n, t in p.items()},
                                {"preset": "tiny", "step": "0"})
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self.assertEqual((8 + n) % 8, 0)
            tensors, meta = R.read_safetensors(path)
            self.assertEqual(meta, {"preset": "tiny", "step": "0"})
            q = R.params_from_checkpoint(cfg, tensors)
            for name in R.PARAM_NAMES:
                self.assertTrue(torch.equal(p[name], q[name]), name)
            good = tensors["param.attn"]
            tensors["param.attn"] = good.float()
            with self.assertRaisesRegex(ValueError, "param.attn"):
                R.params_from_checkpoint(cfg, tensors)
            tensors["param.attn"] = good[:-1]
            with self.assertRaisesRegex(ValueError, "param.attn"):
                R.params_from_checkpoint(cfg, tensors)
            tensors["param.attn"] = good
            del tensors["param.scalars"]
            with self.assertRaisesRegex(ValueError, "scalars"):
                R.params_from_checkpoint(cfg, tensors)


if __name__ == "__main__":
    if not HAVE_TORCH:
        print("test_torch_reference: skipped (torch is not installed)")
        sys.exit(0)
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
