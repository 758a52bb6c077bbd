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

# =====================================================================================================
# Record 80 (upstream 2c702746): the r80 / tiny-r80 presets' new pieces, each against an independent
# computation (hand-derived values, float64 formulas, or autograd of a plain formula).
# =====================================================================================================
def small_r80_config():
    c = R.tiny_r80_config()
    c.vocab_size, c.padded_vocab, c.bigram_vocab = 500, 512, 64 * 5
    return c


def f64_sigmoid_bf16(logits):
    """The CE kernel's sigmoid of (l + 5) / 7.5 from its definition in float64, rounded to bf16."""
    return torch.sigmoid((logits.double() + 5) / 7.5).bfloat16().double()


@needs_torch
class R80ScheduleTest(unittest.TestCase):
    def test_boundaries_floor_and_cooldown(self):
        s = R.Schedule(R.r80_config())
        self.assertEqual(s.boundaries, [(0, 480), (480, 960), (960, 1440), (1440, 1480)])
        self.assertEqual(s.split_step, 961)
        # cooldown from int(1440 * 0.4) = 576: lr_mul * (1 - t) + 0.15 t
        self.assertEqual(s.lr(575), 1.52)
        self.assertEqual(s.lr(576), 1.52)
        self.assertAlmostEqual(s.lr(1008), 1.73 * 0.5 + 0.15 * 0.5, places=12)  # t = 432 / 864
        self.assertAlmostEqual(s.lr(1440), 0.15, places=12)  # extension: t = 1
        self.assertAlmostEqual(s.lr(1479), 0.15, places=12)
        self.assertEqual(R.Schedule(R.record_config()).lr(1515), 0.1)  # record 71 keeps its floor

    def test_train_max_seq_len_per_stage(self):
        s = R.Schedule(R.r80_config())
        self.assertEqual([s.train_max_seq_len(k) for k in (0, 479, 480, 1439, 1440, 1479)],
                         [896, 896, 2048, 2048, 2048, 2048])
        t = R.Schedule(R.tiny_r80_config())
        self.assertEqual(t.boundaries, [(0, 10), (10, 20), (20, 30), (30, 34)])
        self.assertEqual([t.train_max_seq_len(k) for k in (0, 9, 10, 33)], [112, 112, 256, 256])  # 256 * 896/2048
        self.assertEqual(t.lr(12), 1.52)  # cooldown start int(30 * 0.4) = 12
        self.assertAlmostEqual(t.lr(21), 1.73 * 0.5 + 0.15 * 0.5, places=12)  # t = 9 / 18

    def test_max_num_docs_table_and_overflow(self):
        r80, tiny, r71 = R.r80_config(), R.tiny_r80_config(), R.record_config()
        self.assertEqual([R.max_num_docs(r80, n) for n in (16384, 32768, 49152)], [64, 96, 128])
        # the rule keys on tokens per rank per micro-step, whatever the use: validation's val_batch_size
        # 2,097,152 over grad_accum x world = 8 is 262,144 per rank (not in the table) on 8 GPUs and on 1
        self.assertEqual(R.max_num_docs(r80, 4096), 128)
        self.assertEqual(R.max_num_docs(r80, 32768), 96)
        self.assertEqual(R.max_num_docs(r80, 262144), 896)         # ceil(873 / 128) * 128
        self.assertEqual(R.max_num_docs(r71, 16384), 128)          # record 71: ceil(54 / 128) * 128
        self.assertEqual([R.max_num_docs(tiny, n) for n in (32, 48, 64)], [64, 96, 128])
        self.assertEqual(R.max_num_docs(tiny, 256), 128)           # 256 // 300 = 0: one block, not 0
        R.check_num_docs(r80, 16384, 63)
        with self.assertRaisesRegex(ValueError, "64 documents .* 64 entries"):
            R.check_num_docs(r80, 16384, 64)


@needs_torch
class R80CrossEntropyTest(unittest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(80)
        self.T, self.V = 9, 40
        self.logits = (torch.randn(self.T, self.V, generator=g) * 4).bfloat16()
        self.targets = torch.randint(0, self.V, (self.T,), generator=g)
        self.targets[3] = self.targets[4] = self.targets[5]  # MTP targets that coincide: term2 sums weights
        self.w = torch.tensor([1.0, 0.5, 0.25])
        self.gs, self.gscale = 0.125 * 0.75 / 448, 0.125

    def test_losses_match_float64_definition(self):
        losses, _ = R.fused_ce_rows(self.logits, self.targets, self.w, self.gs, self.gscale)
        s = f64_sigmoid_bf16(self.logits)
        z = 23 * s
        lse = torch.logsumexp(z, 1)
        for t in range(self.T):
            want = sum(self.w[k].item() * (lse[t] - z[t, self.targets[t + k]]).item()
                       for k in range(3) if t + k < self.T)
            self.assertAlmostEqual(losses[t].item(), want, delta=2e-6 * abs(want), msg=f"row {t}")

    def test_gradient_numerics(self):
        """dlogit = e5m2(grad_scale (23/7.5) / grad_s (S_w p - term2) s (1 - s)) from the bf16 s, with S_w the
        sum of all three weights on every row (the kernel's quirk: the last two rows too)."""
        _, d8 = R.fused_ce_rows(self.logits, self.targets, self.w, self.gs, self.gscale)
        s = f64_sigmoid_bf16(self.logits)
        p = torch.softmax(23 * s, 1)
        term2 = torch.zeros(self.T, self.V, dtype=torch.float64)
        for t in range(self.T):
            for k in range(3):
                if t + k < self.T:
                    term2[t, self.targets[t + k]] += self.w[k].item()
        want = self.gscale * (23 / 7.5) / self.gs * (1.75 * p - term2) * s * (1 - s)
        want8 = torch.tensor([[round_to_format(v, 2, -14, 57344.0) for v in row] for row in want.tolist()],
                             dtype=torch.float64)
        got = d8.double()
        # the float64 and fp32 values may straddle an e5m2 rounding tie: allow one step there, nowhere else
        step = torch.where(want8 == 0, torch.tensor(2.0 ** -16, dtype=torch.float64),
                           2.0 ** (torch.floor(torch.log2(want8.abs().clamp_min(2.0 ** -16))) - 2))
        self.assertTrue(bool(((got - want8).abs() <= step).all()))
        self.assertGreater(float((got == want8).double().mean()), 0.97)
        # the last row: all the weight of S_w = 1.75 on p, only w_0 on its target (no t+1, t+2 rows)
        t, j = self.T - 1, int(self.targets[-1])
        self.assertGreater(got[t].sum().item(), 0.0)  # 1.75 - 1.0: the quirk leaves a positive row sum
        self.assertLess(got[t, j].item(), 0.0)

    def test_gradient_matches_autograd_where_the_weights_match(self):
        """For rows whose MTP targets all exist, S_w equals the loss's weight sum: the e5m2 gradient is
        the autograd gradient of sum_t sum_k w_k (lse - z) (times grad_scale) up to e5m2 and bf16(s)."""
        _, d8 = R.fused_ce_rows(self.logits, self.targets, self.w, self.gs, self.gscale)
        l = self.logits.double().requires_grad_(True)
        z = 23 * torch.sigmoid((l + 5) / 7.5)
        lse = torch.logsumexp(z, 1)
        loss = sum(self.w[k] * (lse[:self.T - k] - z[:self.T - k].gather(
            1, self.targets[k:].unsqueeze(1)).squeeze(1)).sum() for k in range(3))
        (loss * self.gscale).backward()
        got = d8.double()[:self.T - 2] * self.gs
        want = l.grad[:self.T - 2]
        self.assertTrue(torch.allclose(got, want, rtol=0.2, atol=self.gs * 2.0 ** -15))
        self.assertGreater(F_cos(got, want), 0.999)

    def test_function_backward_ignores_grad_output_and_forms_fp8_products(self):
        g = torch.Generator().manual_seed(81)
        T, C, V = 9, 32, 40
        x = torch.randn(T, C, generator=g).bfloat16().requires_grad_(True)
        w = (torch.randn(C, V, generator=g) * 0.02).bfloat16().requires_grad_(True)
        xs, ws = 100 / 448, 1.6 / 448
        tg = torch.randint(0, V, (T,), generator=g)
        losses = R.FusedSoftcappedCE.apply(x, w, tg, self.w, xs, ws, self.gs, self.gscale)
        (losses.sum() * 1000.0).backward()  # the factor is ignored: grad_scale is baked in
        q = lambda t, sc: torch.tensor([[round_to_format(v, 3, -6, 448.0) for v in row] for row in (t / sc).tolist()],
                                       dtype=torch.float64)
        xq, wq = q(x.detach().float(), xs), q(w.detach().float(), ws)
        logits = ((xq @ wq) * float(torch.tensor(xs)) * float(torch.tensor(ws))).bfloat16()
        self.assertTrue(torch.allclose(losses, R.fused_ce_rows(logits, tg, self.w, self.gs, self.gscale)[0]))
        _, d8 = R.fused_ce_rows(logits, tg, self.w, self.gs, self.gscale)
        sg = float(torch.tensor(self.gs))
        self.assertTrue(torch.allclose(x.grad.double(), (d8.double() @ wq.t()) * sg * float(torch.tensor(ws)),
                                       rtol=2 ** -7, atol=1e-9))
        self.assertTrue(torch.allclose(w.grad.double(), (xq.t() @ d8.double()) * float(torch.tensor(xs)) * sg,
                                       rtol=2 ** -7, atol=1e-9))


def F_cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


@needs_torch
class R80ModelTest(unittest.TestCase):
    def test_banks_concatenate_to_the_layer_matrices(self):
        cfg = R.r80_config()
        self.assertEqual(R.bank_counts(cfg), (60, 64, 20, 24))
        self.assertEqual(R.bank_counts(R.tiny_r80_config()), (20, 24, 20, 24))
        C, D = cfg.model_dim, cfg.head_dim
        g = torch.Generator().manual_seed(82)
        p = {"qk_bank": torch.randn(64, 2 * D, C, generator=g).bfloat16(),
             "vo_bank": torch.randn(24, C, C, generator=g).bfloat16()}
        W = R.attention_weights(cfg, p)
        self.assertEqual(len(W), 10)
        for a in (0, 5, 9):
            for j in range(3):  # heads 2j, 2j+1 of Wq and of Wk
                self.assertTrue(torch.equal(W[a][256 * j:256 * (j + 1)], p["qk_bank"][6 * a + j]))
                self.assertTrue(torch.equal(W[a][C + 256 * j:C + 256 * (j + 1)], p["qk_bank"][6 * a + 3 + j]))
            self.assertTrue(torch.equal(W[a][2 * C:3 * C], p["vo_bank"][2 * a]))
            self.assertTrue(torch.equal(W[a][3 * C:], p["vo_bank"][2 * a + 1]))

    def test_init_layout(self):
        cfg = small_r80_config()
        p = R.init_params(cfg, 3)
        self.assertTrue(bool((p["qk_bank"][20:] == 0).all()) and bool((p["qk_bank"][:20] != 0).any()))
        self.assertTrue(bool((p["vo_bank"][20:] == 0).all()))
        self.assertAlmostEqual(p["value_embeds"].float().std().item(), 0.01, delta=0.001)
        self.assertEqual(p["scalars"].tolist(), [0.5, 1.0] * 11 + [0.0, 0.5, -1.5] + [1.0] * 7)
        self.assertEqual(p["resid_lambdas"].dtype, torch.float32)
        self.assertTrue(bool((p["resid_lambdas"] == 1.1 ** 0.5).all()))
        self.assertTrue(bool((p["bigram_lambdas"] == 0.05).all()) and bool((p["post_lambdas"] == 1).all()))

    def test_ve_gate_reads_the_value_embedding(self):
        """Every token its own document: attention returns v, so the block's output is
        bf16(bf16(v * sigmoid(0)) @ Wo^T) with v = qkv's v + 2 sigmoid(cat(x[:6], ve[:6]) . w) ve (layer 1,
        unpaired) or 2 sigmoid(x[:12] . w) ve (layer 2, paired)."""
        cfg = small_r80_config()
        g = torch.Generator().manual_seed(83)
        p = R.init_params(cfg, 4)
        p["ve_gate_bank"] = (torch.randn(5, 2, 12, generator=g) * 0.5).bfloat16()
        T, C, D = 6, cfg.model_dim, cfg.head_dim
        h = torch.randn(T, C, generator=g).bfloat16()
        ve = (torch.randn(T, C, generator=g) * 0.5).bfloat16()
        doc = torch.arange(T)
        # layer 2 is paired: rows 2t, 2t+1 (heads 0, 1 of token t) share a document, so only head 0 is
        # v itself; its Wo columns for head 1 are zeroed so that the output shows head 0 alone
        p["vo_bank"][2 * R.attn_index(2) + 1][:, D:] = 0
        tr = R.Trainer(cfg, p)
        W = R.attention_weights(cfg, p)
        for layer, table in ((1, 0), (2, 1)):
            y = R.attention_block(cfg, p, layer, h, W[R.attn_index(layer)], ve, doc, tr.forward_args())
            sa = p["scalars"][2 * layer:2 * layer + 2].double()
            Wl = W[R.attn_index(layer)].double()
            v = (h.double() @ (sa[0] * Wl[2 * C:3 * C]).bfloat16().double().t()).bfloat16().double()
            wg = p["ve_gate_bank"][table].double()
            if layer == 1:
                logit = h.double()[:, :6] @ wg[:, :6].t() + ve.double()[:, :6] @ wg[:, 6:].t()
                gate = (2 * torch.sigmoid(logit.bfloat16().double())).repeat_interleave(D, 1)
            else:  # paired: (T, H) gates viewed as (2T, H/2) rows, as v is
                gate = (2 * torch.sigmoid((h.double()[:, :12] @ wg.t()).bfloat16().double())).repeat_interleave(D, 1)
            v = (v + gate * ve.double()).bfloat16().double()
            want = (v * 0.5).bfloat16().double() @ (sa[1] * Wl[3 * C:]).bfloat16().double().t()
            self.assertTrue(torch.allclose(y.double(), want, rtol=2 ** -7, atol=2 ** -12), f"layer {layer}")

    def test_dead_entries_and_padding_get_no_gradient(self):
        cfg = small_r80_config()
        p = R.init_params(cfg, 5)
        p["bigram_embed"] = (torch.randn(p["bigram_embed"].shape, generator=torch.Generator().manual_seed(1)) * 0.1
                             ).bfloat16()  # zeros at init would give the bigram lambdas zero gradients
        tr = R.Trainer(cfg, p)
        b = random_batch(cfg, 32, 3, torch.Generator().manual_seed(84))
        loss = R.forward(cfg, tr.params, b, tr.forward_args(), training=True)
        self.assertEqual(loss.shape, (32,))
        (loss.sum() * cfg.grad_scale).backward()
        P = tr.params
        for name, idx in (("resid_lambdas", (6, 0)), ("post_lambdas", (6, 0)), ("x0_lambdas", 6),
                          ("bigram_lambdas", 6)):
            self.assertEqual(P[name].grad[idx].item(), 0.0, name)
        self.assertNotEqual(P["resid_lambdas"].grad[6, 1].item(), 0.0)
        self.assertNotEqual(P["bigram_lambdas"].grad[0].item(), 0.0)  # the pre-layer-0 injection
        self.assertTrue(bool((P["qk_bank"].grad[20:] == 0).all()) and bool((P["qk_bank"].grad[:20] != 0).any()))
        # a lambda's gradient is an fp32 sum rounded to bf16 at the .bfloat16() cast
        gl = P["resid_lambdas"].grad
        self.assertTrue(torch.equal(gl, gl.bfloat16().float()))
        self.assertGreater(P["value_embeds"].grad.float().abs().sum().item(), 0)

    def test_layers_8_to_10_read_layer_7(self):
        """Perturbing layer 8's MLP changes the stream after layer 8 but not the attention inputs of layers
        9 and 10 (they read norm(h7)); perturbing layer 7's MLP changes all three."""
        cfg = small_r80_config()
        p = R.init_params(cfg, 6)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=torch.Generator().manual_seed(2))
                               * 0.05).bfloat16()  # c_proj is zero at init: the MLPs would add nothing
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(85))
        args = R.Trainer(cfg, p).forward_args()
        real = R.attention_block

        def inputs(params):
            seen = {}

            def spy(cfg_, p_, layer, h, *rest):
                seen[layer] = h.clone()
                return real(cfg_, p_, layer, h, *rest)
            R.attention_block = spy
            try:
                R.forward(cfg, params, b, args, training=False)
            finally:
                R.attention_block = real
            return seen

        base = inputs(p)
        for layer, changed in ((8, ()), (7, (8, 9, 10))):
            q = {n: t.clone() for n, t in p.items()}
            q["mlp_bank"][layer, 1] = (q["mlp_bank"][layer, 1].float() * 3).bfloat16()
            got = inputs(q)
            for l in (8, 9, 10):
                self.assertEqual(torch.equal(got[l], base[l]), l not in changed, f"MLP {layer}, attention {l}")
        self.assertTrue(torch.equal(base[9], base[10]))  # the same norm(h7)


@needs_torch
class R80OptimizerTest(unittest.TestCase):
    def test_xtx_matches_transposed_xxt_and_float64(self):
        g = torch.Generator().manual_seed(86)
        G = torch.randn(96, 32, generator=g)
        tall = R.polar_express_r80(G.clone(), torch.zeros(96, 32), 0.0)
        wide = R.polar_express_r80(G.t().contiguous(), torch.zeros(32, 96), 0.0).t()
        diff = (tall.float() - wide.float()).abs()
        self.assertLessEqual(diff.max().item(), 2 ** -7 * tall.float().abs().max().item())
        self.assertGreater(float((diff == 0).float().mean()), 0.9)
        f64 = f64_polar_express(G.bfloat16().double())
        self.assertLess(((tall.double() - f64).norm() / f64.norm()).item(), 0.02)

    def test_nesterov_is_fused_in_fp32(self):
        g = torch.Generator().manual_seed(87)
        G, buf = torch.randn(16, 24, generator=g), torch.randn(16, 24, generator=g)
        m = 0.9
        want_buf = buf.double() + (1 - m) * (G.double() - buf.double())
        want_u = G.double() + m * (want_buf - G.double())
        b = buf.clone()
        X = R.polar_express_r80(G.clone(), b, m)
        self.assertTrue(torch.allclose(b.double(), want_buf, rtol=1e-6, atol=1e-6))
        direct = R.polar_express_r80(want_u.float(), torch.zeros(16, 24), 0.0)  # m = 0: u = g
        self.assertLessEqual((X.float() - direct.float()).abs().max().item(), 2 ** -7)

    def test_column_wise_second_moment_for_wide_qk_blocks(self):
        cfg = R.r80_config()
        shapes = {n: R.normuon_matrices(cfg, n) for n in ("qk_bank", "vo_bank", "mlp_bank")}
        self.assertEqual(shapes, {"qk_bank": (64, 256, 768), "vo_bank": (24, 768, 768), "mlp_bank": (24, 3072, 768)})
        tiny = small_r80_config()
        opt = R.NorMuonAdam(tiny, R.init_params(tiny, 7))
        self.assertEqual(tuple(opt.state["qk_bank"]["second_moment"].shape), (24, 128, 1))  # square: rows
        self.assertEqual(opt.lr_muls("qk_bank"), [1.0] * 24)
        self.assertEqual(opt.lr_muls("mlp_bank"), [2.0, 4.0] * 12)  # sqrt(512/128) = 2, c_proj 2x
        # a wide 256x768 block: mean square per column, second moment lerped with beta2 0.9
        g = torch.Generator().manual_seed(88)
        v = torch.randn(2, 256, 768, generator=g).bfloat16()
        sm = torch.rand(2, 1, 768, generator=g) * 2
        sm0 = sm.clone().double()
        out = R.normuon_variance_reduction(v, sm, 0.9, scale_bf16=True)
        vd = v.double()
        mean = vd.square().mean(dim=-2, keepdim=True)
        want_sm = sm0 + 0.1 * (mean - sm0)
        self.assertTrue(torch.allclose(sm.double(), want_sm, rtol=1e-6))
        step = want_sm.rsqrt()
        scaled = vd * step
        want = scaled * (vd.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True))
        self.assertTrue(torch.allclose(out.double(), want, rtol=2 ** -6, atol=1e-6))

    def test_config_json_keeps_record_71_keys(self):
        """Record 71's fixtures store Config.to_json(): the structure fields must not appear at their
        record-71 defaults, and r80's must appear with its values."""
        r71, r80 = R.tiny_config().to_json(), R.tiny_r80_config().to_json()
        for f in R._STRUCTURE_FIELDS:
            self.assertNotIn(f, r71)
        self.assertTrue(all("train_max_seq_len" not in st for st in r71["stages"]))
        self.assertEqual((r80["lr_floor"], r80["value_layers"], r80["grad_scale"]), (0.15, (1, 2, 8, 9, 10), 1 / 8))
        self.assertEqual([st["train_max_seq_len"] for st in r80["stages"]], [112, 256, 256, 256])

    def test_r80_optimizer_table(self):
        t = R.R80_PARAM_TABLE
        self.assertEqual(list(t), ["qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "skip_gate",
                                   "attn_gate_bank", "ve_gate_bank", "lm_head", "bigram_embed", "post_lambdas",
                                   "x0_lambdas", "bigram_lambdas", "resid_lambdas", "value_embeds", "embed"])
        self.assertEqual(t["x0_lambdas"], ("adam", (0.9, 0.95), 1.0, 0.0))
        self.assertEqual(t["resid_lambdas"], ("adam", (0.9, 0.95), 5.0, 0.0))
        self.assertEqual(sorted(R.param_names(R.r80_config())), sorted(t))
        cfg = R.r80_config()
        self.assertEqual((cfg.grad_scale, cfg.normuon_beta2, cfg.lm_head_grad_s), (1 / 8, 0.9, 0.75 / 448 / 8))

    def test_r80_training_step_updates_and_keeps_padding_zero(self):
        cfg = small_r80_config()
        tr = R.Trainer(cfg, R.init_params(cfg, 8))
        gen = torch.Generator().manual_seed(89)
        before = {n: t.detach().clone() for n, t in tr.params.items()}
        for step in range(2):
            tr.advance(step)
            tr.train_step(step, [random_batch(cfg, 32, 3, gen) for _ in range(8)])
        P = tr.params
        self.assertTrue(bool((P["qk_bank"][20:] == 0).all()) and bool((P["vo_bank"][20:] == 0).all()))
        self.assertFalse(torch.equal(P["qk_bank"], before["qk_bank"]))
        self.assertFalse(torch.equal(P["resid_lambdas"], before["resid_lambdas"]))  # Adam ran at step 1
        self.assertTrue(torch.equal(P["embed"], P["lm_head"].t()))  # still tied
        self.assertEqual(P["resid_lambdas"][6, 0].item(), before["resid_lambdas"][6, 0].item())  # dead entry



if __name__ == "__main__":
    if not HAVE_TORCH:
        print("test_torch_reference: skipped (torch is not installed)")
        sys.exit(0)
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
