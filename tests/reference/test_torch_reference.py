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


def assert_e5m2_of(test, got, want):
    """got (e5m2 values) is want (float64) rounded to e5m2: one step of slack only where the float64 and fp32
    values may straddle a rounding tie, and at least 97% exact."""
    want8 = torch.tensor([[round_to_format(v, 2, -14, 57344.0) for v in row] for row in want.tolist()],
                         dtype=torch.float64)
    step = torch.where(want8 == 0, torch.tensor(2.0 ** -16, dtype=torch.float64),
                       2.0 ** (torch.floor(torch.log2(want8.abs().clamp_min(2.0 ** -16))) - 2))
    test.assertTrue(bool(((got - want8).abs() <= step).all()))
    test.assertGreater(float((got == want8).double().mean()), 0.97)


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
        got = d8.double()
        assert_e5m2_of(self, got, want)
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
class R88PrefixLossTest(unittest.TestCase):
    """Record 88's prefix-token term in the fused CE rows (upstream 75d6867a triton_kernels.py's
    ce_fwd_bwd_kernel): each against a float64 definition written here."""

    def setUp(self):
        g = torch.Generator().manual_seed(88)
        self.T, self.V = 9, 40
        self.logits = (torch.randn(self.T, self.V, generator=g) * 4).bfloat16()
        self.targets = torch.randint(0, self.V, (self.T,), generator=g)
        self.w = torch.tensor([1.0, 0.5, 0.25])
        self.gs, self.gscale = 0.125 * 0.75 / 448, 0.125
        self.P = torch.randint(0, self.V, (self.T,), generator=g)
        self.P[1] = -1                       # no prefix
        self.P[2] = self.V + 3               # out of range: ignored like -1
        self.P[4] = self.targets[5]          # the prefix is also row 4's k = 1 MTP target: term2 adds both
        self.P[6] = self.targets[6]          # and row 6's own next token
        self.pw = torch.tensor(0.1875)

    def run_rows(self, pw=None, P="default"):
        P = self.P if P == "default" else P
        return R.fused_ce_rows(self.logits, self.targets, self.w, self.gs, self.gscale, P,
                               self.pw if pw is None else pw)

    def test_losses_match_float64_definition(self):
        losses, _ = self.run_rows()
        z = 23 * f64_sigmoid_bf16(self.logits)
        lse = torch.logsumexp(z, 1)
        for t in range(self.T):
            want = sum(self.w[k].item() * (lse[t] - z[t, self.targets[t + k]]).item()
                       for k in range(3) if t + k < self.T)
            if 0 <= self.P[t] < self.V:
                want += self.pw.item() * (lse[t] - z[t, self.P[t]]).item()
            self.assertAlmostEqual(losses[t].item(), want, delta=2e-6 * abs(want), msg=f"row {t}")

    def test_gradient_numerics(self):
        """S_w = pw (valid prefix rows) + all three MTP weights; term2 adds pw at the prefix column."""
        _, d8 = self.run_rows()
        s = f64_sigmoid_bf16(self.logits)
        p = torch.softmax(23 * s, 1)
        term2 = torch.zeros(self.T, self.V, dtype=torch.float64)
        S = torch.full((self.T, 1), 1.75, dtype=torch.float64)
        for t in range(self.T):
            for k in range(3):
                if t + k < self.T:
                    term2[t, self.targets[t + k]] += self.w[k].item()
            if 0 <= self.P[t] < self.V:
                term2[t, self.P[t]] += self.pw.item()
                S[t] += self.pw.item()
        want = self.gscale * (23 / 7.5) / self.gs * (S * p - term2) * s * (1 - s)
        assert_e5m2_of(self, d8.double(), want)

    def test_gradient_matches_autograd_of_the_loss(self):
        """Where the MTP targets all exist, S_w is the loss's weight sum: the e5m2 gradient is the autograd
        gradient of the rows' losses (MTP + prefix) up to e5m2 and bf16(s)."""
        _, d8 = self.run_rows()
        l = self.logits.double().requires_grad_(True)
        z = 23 * torch.sigmoid((l + 5) / 7.5)
        lse = torch.logsumexp(z, 1)
        loss = sum(self.w[k] * (lse[:self.T - k] - z[:self.T - k].gather(
            1, self.targets[k:].unsqueeze(1)).squeeze(1)).sum() for k in range(3))
        valid = (self.P >= 0) & (self.P < self.V)
        Pc = self.P.clamp(0, self.V - 1)
        loss = loss + (self.pw.double() * (lse - z.gather(1, Pc.unsqueeze(1)).squeeze(1)) * valid).sum()
        (loss * self.gscale).backward()
        got = d8.double()[:self.T - 2] * self.gs
        want = l.grad[:self.T - 2]
        self.assertTrue(torch.allclose(got, want, rtol=0.2, atol=self.gs * 2.0 ** -15))
        self.assertGreater(F_cos(got, want), 0.999)

    def test_zero_weight_and_no_prefix_equal_record_80(self):
        base_l, base_d = R.fused_ce_rows(self.logits, self.targets, self.w, self.gs, self.gscale)
        for pw, P in ((torch.tensor(0.0), self.P), (self.pw, torch.full((self.T,), -1))):
            l, d = self.run_rows(pw, P)
            self.assertTrue(torch.equal(l, base_l))
            self.assertTrue(torch.equal(d.view(torch.uint8), base_d.view(torch.uint8)))
        l, _ = self.run_rows()
        self.assertFalse(torch.equal(l, base_l))

    def test_prefix_table(self):
        """The committed table against the spec's check values (upstream's build_prefix_table on GPT-2)."""
        p = R.load_prefix_table()
        self.assertEqual(p.numel(), 50304)
        self.assertEqual(int((p >= 0).sum()), 50000)
        for tok, want in ((262, 294), (290, 281), (1169, 400), (50255, 17841), (11, -1), (50256, -1), (50300, -1)):
            self.assertEqual(int(p[tok]), want, msg=f"p[{tok}]")
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"\0" * 12)
            f.flush()
            with self.assertRaisesRegex(ValueError, "12 bytes, want 201216"):
                R.load_prefix_table(f.name)

    def test_model_passes_the_next_tokens_prefixes(self):
        """forward() hands the CE the prefixes of the targets (the immediate next tokens) and the step's pw."""
        cfg = R.tiny_r84_config()
        cfg.prefix_loss = True
        for st in cfg.stages[:-1]:
            st.prefix_start = st.prefix_end = 0.25
        p = r84_params(cfg, 7)
        b = random_batch(cfg, 16, 2, torch.Generator().manual_seed(88))
        trainer = R.Trainer(cfg, p, R.random_sign_table(cfg, 8))
        seen, real = [], R.fused_ce_rows

        def spy(*args):
            seen.append(args)
            return real(*args)
        R.fused_ce_rows = spy
        try:
            with_prefix = R.forward(cfg, trainer.params, b, trainer.forward_args(), training=True)
            cfg.prefix_loss = False
            without = R.forward(cfg, trainer.params, b, trainer.forward_args(), training=True)
        finally:
            R.fused_ce_rows = real
        self.assertTrue(torch.equal(seen[0][5], R.load_prefix_table()[b.targets]))
        self.assertEqual(float(seen[0][6]), 0.25)
        self.assertIsNone(seen[1][5])
        self.assertGreater(float((with_prefix - without).sum()), 0.0)

    def test_schedule_and_validation(self):
        c = R.tiny_r84_config()
        c.prefix_loss = True
        c.stages[0].prefix_start = c.stages[0].prefix_end = 0.25
        c.stages[1].prefix_start, c.stages[1].prefix_end = 0.25, 0.0
        c.validate()
        sch = R.Schedule(c)
        (s0, e0), (s1, e1) = sch.boundaries[0], sch.boundaries[1]
        self.assertEqual(float(sch.prefix_weight(s0)), 0.25)
        mid = (s1 + e1) // 2
        want = torch.tensor(0.25 + (0.0 - 0.25) * ((mid - s1) / (e1 - s1)), dtype=torch.float32)
        self.assertEqual(float(sch.prefix_weight(mid)), float(want))
        self.assertEqual(float(sch.prefix_weight(e1)), 0.0)  # stage 3: no weight
        c.prefix_loss = False
        with self.assertRaisesRegex(ValueError, "prefix weights without prefix_loss"):
            c.validate()


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




# =====================================================================================================
# Record 84 (upstream a333be08; records 81-84): the r84 / tiny-r84 presets' new pieces, each against an
# independent computation (hand-derived values, float64 formulas, finite differences, or an equivalent
# record-80 model).
# =====================================================================================================
def small_r84_config():
    c = R.tiny_r84_config()
    c.vocab_size, c.padded_vocab, c.bigram_vocab = 500, 512, 64 * 15
    c.bigram_sign_rows = 61  # not a power of two: a mask in place of the mod would show
    return c


def r84_params(cfg, seed, bigram_scale=0.3):
    """init_params with nonzero bigram rows (zeros at init would hide the bigram paths)."""
    p = R.init_params(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    p["bigram_embed"] = (torch.randn(p["bigram_embed"].shape, generator=g) * bigram_scale).bfloat16()
    return p


def e4m3(v):
    """Nearest e4m3fn value (3 mantissa bits, subnormals below 2^-6, largest finite 448), saturating."""
    return round_to_format(v, 3, -6, 448.0)


@needs_torch
class R84ConfigTest(unittest.TestCase):
    def test_presets_sizes_slots_and_schedule(self):
        c = R.r84_config()
        shapes = R.param_shapes(c)
        self.assertEqual(shapes["bigram_embed"], ((754560, 192), torch.bfloat16))
        self.assertEqual(shapes["scalars"], ((24,), torch.float32))
        self.assertEqual(shapes["xsa_alphas"], ((11, 6), torch.float32))
        self.assertEqual(shapes["mudd_w1"], ((2, 64, 768), torch.bfloat16))
        self.assertEqual(shapes["mudd_w2"], ((2, 14, 64), torch.bfloat16))
        self.assertEqual(shapes["mudd_b2"], ((2, 14), torch.bfloat16))
        sl = R.scalar_slots(c)
        self.assertEqual((sl.sa, sl.smear, sl.backout, sl.skip, sl.count), (0, 22, -1, 23, 24))
        s = R.Schedule(c)
        self.assertEqual(s.boundaries, [(0, 460), (460, 920), (920, 1380), (1380, 1390)])
        self.assertEqual(s.split_step, 921)
        self.assertEqual(int(1380 * (1 - c.cooldown_frac)), 552)
        t = R.tiny_r84_config()
        ts = R.param_shapes(t)
        self.assertEqual(ts["bigram_embed"], ((61440, 32), torch.bfloat16))
        self.assertEqual(ts["xsa_alphas"], ((11, 2), torch.float32))
        self.assertEqual(ts["mudd_w1"], ((2, 64, 128), torch.bfloat16))
        self.assertEqual((t.bigram_sign_rows, t.xsa_layers, t.total_steps), (8192, (1, 3, 4, 7, 8, 10), 34))
        # everything else is tiny-r80's
        t80 = R.tiny_r80_config()
        for f in ("model_dim", "num_heads", "mlp_dim", "stages", "max_num_docs_table", "value_layers", "grad_scale"):
            self.assertEqual(getattr(t, f), getattr(t80, f), f)
        # record 80's presets do not move: every new field at its default, and omitted from the fixture JSON
        for name in ("record", "tiny", "r80", "tiny-r80"):
            cf = R.PRESETS[name]()
            self.assertFalse(cf.mudd or cf.xsa_layers or cf.bigram_dim or cf.bigram_sign_rows or
                             cf.x0_includes_bigram or cf.paired_ve_gate_reads_ve or cf.mlp_up_fp8, name)
            self.assertNotIn("mudd", cf.to_json())
        self.assertTrue(t.to_json()["mudd"])

    def test_optimizer_table(self):
        t = R.R84_PARAM_TABLE
        # upstream's dict order at a333be08 (L1839-1864): the scatter order
        self.assertEqual(list(t), ["qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "skip_gate",
                                   "attn_gate_bank", "ve_gate_bank", "lm_head", "bigram_embed", "post_lambdas",
                                   "x0_lambdas", "bigram_lambdas", "resid_lambdas", "xsa_alphas", "value_embeds",
                                   "embed", "mudd_w1", "mudd_w2", "mudd_b2"])
        self.assertEqual(t["xsa_alphas"], ("adam", (0.9, 0.95), 1.0, 0.0))
        self.assertEqual(t["mudd_w1"], ("adam", (0.9, 0.99), 0.25, 1.0))
        self.assertEqual(t["mudd_w2"], ("adam", (0.9, 0.99), 0.25, 1.0))
        self.assertEqual(t["mudd_b2"], ("adam", (0.9, 0.99), 0.25, 0.0))
        self.assertEqual(sorted(R.R84_WORK_ORDER), sorted(t))
        self.assertEqual(sorted(R.param_names(R.r84_config())), sorted(t))

    def test_init_values(self):
        cfg = small_r84_config()
        p = R.init_params(cfg, 11)
        self.assertEqual(p["scalars"].tolist(), [0.5, 1.0] * 11 + [0.0, -1.5])
        b = p["mudd_b2"].float()
        # stored pre-scaled, in bf16: 2/0.1 = 20, sqrt(1.1)/0.1 = 10.488 -> 10.5, 1/0.1 = 10, 0.05/0.1 = 0.5, -5
        want0 = [0, 0, 0, 0, 0, 0, 20, 20, 10.5, 10, 0, 0.5, 10.5, 10]
        self.assertEqual(b[0].tolist(), want0)
        self.assertEqual(b[1].tolist(), [0, -5] + [0] * 12)
        w1 = p["mudd_w1"].float()
        self.assertLessEqual(w1.abs().max().item(), 128 ** -0.5)
        self.assertGreater(w1.abs().max().item(), 0.9 * 128 ** -0.5)
        self.assertTrue(bool((p["mudd_w2"] == 0).all()) and bool((p["xsa_alphas"] == 0).all()))

    def test_checkpoint_round_trip_with_the_sign_table(self):
        """The trainer's layout: 2-D (rows, row elements) tensors under its labels, the sign table as
        buffer.bigram_signs; read back in this module's shapes, a mis-sized table refused."""
        cfg = small_r84_config()
        p = r84_params(cfg, 22)
        signs = R.random_sign_table(cfg, 16)
        t = {"param." + R.LABELS.get(n, n): v.reshape(v.shape[0], -1) for n, v in p.items()}
        t["buffer.bigram_signs"] = signs
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rank0.safetensors")
            R.write_safetensors(path, t, {"preset": "tiny-r84"})
            got, meta = R.read_safetensors(path, prefix=("param.", "buffer."))
        q = R.params_from_checkpoint(cfg, got)
        self.assertEqual(sorted(q), sorted(p))
        for n in p:
            self.assertTrue(torch.equal(q[n], p[n]) and q[n].shape == p[n].shape, n)
        self.assertTrue(torch.equal(R.bigram_signs_from_checkpoint(cfg, got), signs))
        self.assertIsNone(R.bigram_signs_from_checkpoint(R.tiny_r80_config(), got))
        got["buffer.bigram_signs"] = signs[:-1]
        self.assertRaises(ValueError, R.bigram_signs_from_checkpoint, cfg, got)
        del got["buffer.bigram_signs"]
        self.assertRaises(ValueError, R.bigram_signs_from_checkpoint, cfg, got)

    def test_refusals(self):
        c = small_r84_config()
        c.xsa_layers = (2,)  # paired
        self.assertRaises(ValueError, c.validate)
        c = small_r84_config()
        c.sublayer_lambdas = False
        self.assertRaises(ValueError, c.validate)
        cfg = small_r84_config()
        self.assertRaises(ValueError, R.Trainer, cfg, R.init_params(cfg, 1))  # no sign table
        t = {"buffer.bigram_signs": torch.ones(61, 32, dtype=torch.bfloat16)}
        t["buffer.bigram_signs"][3, 4] = 0.5
        self.assertRaises(ValueError, R.bigram_signs_from_checkpoint, cfg, t)


@needs_torch
class R84BigramTest(unittest.TestCase):
    def test_sign_index_by_hand(self):
        ids = torch.tensor([5, 3, 8195, 1, 1, 100, 27])
        # t = 0: row 0; then (prev ^ cur) mod rows
        self.assertEqual(R.bigram_sign_index(ids, 8192).tolist(),
                         [0, 5 ^ 3, (3 ^ 8195) % 8192, (8195 ^ 1) % 8192, 0, 100 ^ 1, 100 ^ 27])
        self.assertEqual(R.bigram_sign_index(ids, 8192).tolist(), [0, 6, 0, 2, 0, 101, 127])
        self.assertEqual(R.bigram_sign_index(ids, 61).tolist(), [0, 6, 8192 % 61, 8194 % 61, 0, 101 - 61, 127 - 122])
        self.assertEqual(R.bigram_sign_index(ids, 61).tolist(), [0, 6, 18, 20, 0, 40, 5])

    def test_signs_in_lookup_and_gradient(self):
        """Flipping sign row k and negating the bigram rows read under it leaves the forward unchanged and
        negates those rows' gradients (a row read under sign row k only); every other row's gradient stays."""
        cfg = small_r84_config()
        p = r84_params(cfg, 12)
        gen = torch.Generator().manual_seed(120)
        b = random_batch(cfg, 32, 3, gen)
        signs = R.random_sign_table(cfg, 7)
        idx = R.bigram_sign_index(b.inputs, cfg.bigram_sign_rows)
        k = int(idx[5])
        mine = set(b.bigram[idx == k].tolist())
        others = set(b.bigram[idx != k].tolist())
        rows = sorted(mine - others)
        self.assertTrue(rows, "pick a batch where some bigram row is read under sign row k only")

        def run(params, table):
            tr = R.Trainer(cfg, params, table)
            loss = R.forward(cfg, tr.params, b, tr.forward_args(), training=False)
            loss.backward()
            return float(loss), tr.params["bigram_embed"].grad.clone()
        l0, g0 = run(p, signs)
        s2 = signs.clone()
        s2[k] = -s2[k]
        q = {n: t.clone() for n, t in p.items()}
        q["bigram_embed"][rows] = -q["bigram_embed"][rows]
        l1, g1 = run(q, s2)
        self.assertEqual(l0, l1)
        self.assertTrue(torch.equal(g1[rows], -g0[rows]))
        rest = sorted(others)
        self.assertTrue(torch.equal(g1[rest], g0[rest]))
        self.assertGreater(g0[rows].float().abs().sum().item(), 0)
        # and the signs matter: the unsigned model (all +1) differs
        l2, _ = run(p, torch.ones_like(signs))
        self.assertNotEqual(l0, l2)

    def test_narrow_injection_reaches_the_bigram_channels_only(self):
        """With every block's output zero (Wo and c_proj zero), the stream's channels >= bigram_dim do not
        depend on the bigram rows, before layer 0 and after the injections of layers 1 and 2; the bigram
        channels move with them."""
        cfg = small_r84_config()
        p = r84_params(cfg, 13)
        p["x0_lambdas"].fill_(0.25)
        p["vo_bank"][1::2] = 0
        b = random_batch(cfg, 16, 1, torch.Generator().manual_seed(121))
        signs = R.random_sign_table(cfg, 8)
        seen = []
        real = R.rms_norm

        def spy(x):
            if x.dim() == 2 and x.shape[-1] == cfg.model_dim:
                seen.append(x.detach().clone())
            return real(x)

        def stream_inputs(params):
            seen.clear()
            R.rms_norm = spy
            try:
                R.forward(cfg, params, b, R.Trainer(cfg, params, signs).forward_args(), training=False)
            finally:
                R.rms_norm = real
            return list(seen)
        a = stream_inputs(p)
        q = {n: t.clone() for n, t in p.items()}
        q["bigram_embed"] = (q["bigram_embed"].float() * 3).bfloat16()
        c = stream_inputs(q)
        bd = cfg.bigram_dim
        for i in (1, 3, 5, 7):  # the attention inputs of layers 0 (the stream start), 1, 2, 3
            self.assertTrue(torch.equal(a[i][:, bd:], c[i][:, bd:]), i)
            self.assertFalse(torch.equal(a[i][:, :bd], c[i][:, :bd]), i)


@needs_torch
class R84XsaTest(unittest.TestCase):
    def test_forward_against_the_formula(self):
        g = torch.Generator().manual_seed(130)
        T, H, D = 5, 3, 16
        y = torch.randn(T, H, D, generator=g).bfloat16()
        v = torch.randn(T, H, D, generator=g).bfloat16()
        v[2, 1] = 1e-6  # |v| < 1e-4: F.normalize divides by the eps, not by |v|
        a = torch.tensor([0.7, -1.3, 0.0])
        got = R.xsa(y, v, a).double()
        alpha = [float(torch.tensor(math.tanh(x)).bfloat16()) for x in a.tolist()]
        for t in range(T):
            for h in range(H):
                yy, vv = y[t, h].double(), v[t, h].double()
                n = max(math.sqrt(float((vv * vv).sum())), 1e-4)
                want = yy - alpha[h] * float((yy * vv).sum()) / (n * n) * vv
                self.assertTrue(torch.allclose(got[t, h], want, rtol=1e-5, atol=1e-6), (t, h))
        self.assertTrue(torch.equal(got[:, 2], y[:, 2].double()))  # tanh(0) = 0
        # the clamped row is not a projection: it removes alpha (y . v) / 1e-8 v
        self.assertFalse(torch.allclose(got[2, 1], y[2, 1].double()))

    def test_autograd_against_finite_differences(self):
        """The same function in float64 (no bf16 rounding of alpha) against central differences, also
        through the clamp (a row with |v| < 1e-4)."""
        def xsa64(y, v, a):
            vhat = v / v.norm(dim=-1, keepdim=True).clamp_min(R.XSA_EPS)
            return y - torch.tanh(a).view(1, -1, 1) * (y * vhat).sum(-1, keepdim=True) * vhat
        g = torch.Generator().manual_seed(131)
        y = torch.randn(4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
        v0 = torch.randn(4, 2, 8, generator=g, dtype=torch.float64)
        v0[1, 0] *= 1e-6
        v = v0.requires_grad_(True)
        a = torch.tensor([0.4, -0.9], dtype=torch.float64, requires_grad=True)
        self.assertTrue(torch.autograd.gradcheck(xsa64, (y, v, a), eps=1e-7, atol=1e-6, rtol=1e-5))
        # and the reference's own function (fp32 math, alpha rounded to bf16 with its gradient straight
        # through the cast, rounded to bf16 there) has the float64 function's gradient at the rounded alpha
        ga = torch.randn(4, 2, 8, generator=g, dtype=torch.float64)
        yb = y.detach().bfloat16()
        vb = v.detach().bfloat16()
        y32, v32, a32 = (yb.float().requires_grad_(True), vb.float().requires_grad_(True),
                         a.detach().float().requires_grad_(True))
        got = torch.autograd.grad((R.xsa(y32, v32, a32).double() * ga).sum(), (y32, v32, a32))

        def xsa64_rounded(y_, v_, a_):
            t = torch.tanh(a_)
            alpha = t + (t.bfloat16().double() - t).detach()
            vhat = v_ / v_.norm(dim=-1, keepdim=True).clamp_min(R.XSA_EPS)
            return y_ - alpha.view(1, -1, 1) * (y_ * vhat).sum(-1, keepdim=True) * vhat
        y64, v64, a64 = (yb.double().requires_grad_(True), vb.double().requires_grad_(True),
                         a.detach().clone().requires_grad_(True))
        want = torch.autograd.grad((xsa64_rounded(y64, v64, a64) * ga).sum(), (y64, v64, a64))
        for gg, ww, tol in zip(got, want, (1e-5, 1e-4, 2 ** -7)):
            self.assertLessEqual((gg.double() - ww).norm().item(), tol * ww.norm().item())

    def test_model_gradient_reaches_the_xsa_layers_only(self):
        cfg = small_r84_config()
        p = r84_params(cfg, 14)
        p["xsa_alphas"] = torch.full((11, 2), 0.3)
        tr = R.Trainer(cfg, p, R.random_sign_table(cfg, 9))
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(132))
        (R.forward(cfg, tr.params, b, tr.forward_args(), training=True).sum() * cfg.grad_scale).backward()
        gx = tr.params["xsa_alphas"].grad
        for layer in range(11):
            self.assertEqual(bool((gx[layer] != 0).all()), layer in (1, 3, 4, 7, 8, 10), layer)


@needs_torch
class R84Fp8Test(unittest.TestCase):
    def test_e4m3_casts_and_saturation(self):
        vals = [0.0, 1.0, 1.0625, 1.1, 17.3, 240.0, 447.0, 448.0, 460.0, 470.0, 1e6, -0.3, 2 ** -9, 3 * 2 ** -10,
                2 ** -10, 0.013]
        got = R.to_fp8(torch.tensor(vals), torch.float8_e4m3fn).float().tolist()
        self.assertEqual(got, [e4m3(v) for v in vals])
        self.assertEqual(got[8:11], [448.0, 448.0, 448.0])  # saturating, as the GPU's satfinite cast

    def test_weight_and_activation_quantization_by_hand(self):
        w = torch.tensor([[0.5, -0.03, 0.0021], [0.25, 0.1, -0.7]]).bfloat16()
        wq, w_s = R.quantize_up_projection(w)
        amax = float(w.float().abs().max())
        ws = float(torch.tensor(amax / 448).bfloat16())           # bf16(max|W| / 448)
        self.assertEqual(w_s.item(), ws)
        for r in range(2):
            for c in range(3):
                q = float(torch.tensor(float(w[r, c]) / ws).bfloat16())  # bf16(W / w_s), then e4m3
                self.assertEqual(float(wq[r, c]), e4m3(q), (r, c))
        self.assertEqual(float(wq.float().abs().max()), 448.0)
        h = torch.tensor([[0.3, -2.0, 0.01], [1.7, 0.0, 0.5]]).bfloat16()
        xq, a = R.quantize_activation(h)
        self.assertEqual(a.item(), 2.0)
        s = 448.0 / 2.0
        self.assertEqual(xq.float().tolist(), [[e4m3(float(x) * s) for x in row] for row in h.float().tolist()])
        # amax 3: the scale 448 / 3 in fp32 (the compiled graph's), not rounded to bf16 (149.0): over every bf16
        # value in [0.5, 3] some products land on the other side of an e4m3 rounding boundary
        h = torch.arange(0x3F00, 0x4041, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(1, -1)
        xq, a = R.quantize_activation(h)
        self.assertEqual(a.item(), 3.0)
        s32 = float(torch.tensor(448.0) / 3)
        self.assertEqual(xq.float().tolist()[0], [e4m3(float(torch.tensor(float(x)) * s32)) for x in h[0].tolist()])

    def test_up_projection_forward_float64_and_backward_as_bf16(self):
        g = torch.Generator().manual_seed(140)
        h = torch.randn(9, 32, generator=g).bfloat16().requires_grad_(True)
        w = (torch.randn(24, 32, generator=g) * 0.05).bfloat16().requires_grad_(True)
        pre = R.Fp8UpProjection.apply(h, w)
        wq, w_s = R.quantize_up_projection(w.detach())
        xq, a = R.quantize_activation(h.detach())
        deq = float(torch.tensor(w_s.item() * a.item(), dtype=torch.float32) / 448)
        want = ((xq.double() @ wq.double().t()) * deq).bfloat16()
        self.assertLessEqual((pre.float() - want.float()).abs().max().item(),
                             2 ** -8 * want.float().abs().max().item())  # at most a bf16 step apart
        self.assertGreater(torch.eq(pre, want).float().mean().item(), 0.95)
        bf_pre = R.linear(h, w)
        self.assertFalse(torch.equal(pre, bf_pre))  # the FP8 path is not the bf16 one
        gy = torch.randn(9, 24, generator=g).bfloat16()
        dh, dw = torch.autograd.grad(pre, (h, w), gy)
        dh2, dw2 = torch.autograd.grad(bf_pre, (h, w), gy)
        self.assertTrue(torch.equal(dh, dh2) and torch.equal(dw, dw2))

    def test_training_forward_only(self):
        cfg = small_r84_config()
        p = r84_params(cfg, 15)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=torch.Generator().manual_seed(3))
                               * 0.05).bfloat16()
        signs = R.random_sign_table(cfg, 10)
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(141))
        off = small_r84_config()
        off.mlp_up_fp8 = False
        args = R.Trainer(cfg, p, signs).forward_args()
        with torch.no_grad():
            self.assertEqual(float(R.forward(cfg, p, b, args, training=False)),
                             float(R.forward(off, p, b, args, training=False)))
            self.assertNotEqual(float(R.forward(cfg, p, b, args, training=True).sum()),
                                float(R.forward(off, p, b, args, training=True).sum()))


class _Spy:
    """Records the reference's calls of some functions during a forward (monkeypatched module globals)."""

    def __init__(self, cfg, replace_coefficients=None):
        self.cfg, self.replace = cfg, replace_coefficients or {}
        self.norm_inputs, self.attn, self.mudd_in, self.mlp_out = [], {}, {}, []

    def run(self, params, batch, args, training):
        real_norm, real_attn, real_mudd, real_mlp = R.rms_norm, R.attention_block, R.mudd_coefficients, R.mlp_block
        C = self.cfg.model_dim

        def norm(x):
            if x.dim() == 2 and x.shape[-1] == C:
                self.norm_inputs.append(x.detach().clone())
            return real_norm(x)

        def attn(cfg, p, layer, h, W, ve, doc, args_, ve_gate=None, v_add=None):
            y = real_attn(cfg, p, layer, h, W, ve, doc, args_, ve_gate, v_add)
            self.attn[layer] = (ve_gate, v_add, y.detach().clone())
            return y

        def mudd(p, h, block, n):
            self.mudd_in[block] = h.detach().clone()
            return self.replace[block].clone() if block in self.replace else real_mudd(p, h, block, n)

        def mlp(*a, **k):
            out = real_mlp(*a, **k)
            self.mlp_out.append(out.detach().clone())
            return out
        R.rms_norm, R.attention_block, R.mudd_coefficients, R.mlp_block = norm, attn, mudd, mlp
        try:
            return R.forward(self.cfg, params, batch, args, training=training)
        finally:
            R.rms_norm, R.attention_block, R.mudd_coefficients, R.mlp_block = real_norm, real_attn, real_mudd, real_mlp

    def stream(self, k):
        """The stream normed at the k-th (T, C) norm: 0 the smeared embedding, then per layer its attention
        input (not layer 6) and its MLP input, the last the stream after the MUDD exit."""
        return self.norm_inputs[k]


NORM_H0, NORM_H3, NORM_H7, NORM_L10_MLP, NORM_FINAL = 1, 9, 16, 21, 22  # indices of _Spy.stream


@needs_torch
class R84MuddTest(unittest.TestCase):
    def test_coefficients_by_hand(self):
        cfg = small_r84_config()
        p = R.init_params(cfg, 16)
        h = torch.randn(3, cfg.model_dim, generator=torch.Generator().manual_seed(150)).bfloat16()
        # w2 = 0 at init: c = bf16(b2 * 0.1): 2.0, bf16(1.05) = 1.046875, 1.0, bf16(0.5 * 0.1) = 0.050048828125
        c0 = R.mudd_coefficients(p, h, 0, 14).float()
        want = [0, 0, 0, 0, 0, 0, 2.0, 2.0, 1.046875, 1.0, 0, 0.050048828125, 1.046875, 1.0]
        self.assertEqual(c0.tolist(), [want] * 3)
        self.assertEqual(R.mudd_coefficients(p, h, 1, 5).float().tolist(), [[0, -0.5, 0, 0, 0]] * 3)
        # random w2, b2: float64 from the definition, exact-erf GELU, roundings where upstream materializes
        g = torch.Generator().manual_seed(151)
        p["mudd_w2"] = (torch.randn(2, 14, 64, generator=g) * 0.3).bfloat16()
        p["mudd_b2"] = torch.randn(2, 14, generator=g).bfloat16()
        got = R.mudd_coefficients(p, h, 1, 5).double()
        z = (h.double() @ p["mudd_w1"][1].double().t()).bfloat16().double()
        u = (0.5 * z * (1 + torch.erf(z / math.sqrt(2)))).bfloat16().double()
        lin = (u @ p["mudd_w2"][1, :5].double().t()).bfloat16().double()
        want = ((lin + p["mudd_b2"][1, :5].double()) * 0.1).bfloat16().double()
        self.assertLessEqual((got - want).abs().max().item(), 2 ** -8 * want.abs().max().item())
        self.assertGreater(torch.eq(got, want).double().mean().item(), 0.9)
        # the tanh GELU would differ
        u_tanh = (0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))).bfloat16().double()
        self.assertFalse(torch.equal(u, u_tanh))

    def test_at_init_equals_record_80s_layer_10_and_backout(self):
        """With w2 = 0 MUDD's coefficients are its biases: the entry is layer 10 with resid sqrt(1.1), post 1,
        x0 0, bigram 0.05 lambdas and a ve gate of 2.0, the exit record 80's backout of 0.5 h7. Layer 10's value
        table is zeroed, so the ve gates do not matter; the two models' losses and shared gradients agree
        bit for bit."""
        cfg = small_r84_config()
        p = r84_params(cfg, 17)
        p["x0_lambdas"] = torch.linspace(-0.3, 0.3, 11)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=torch.Generator().manual_seed(4))
                               * 0.05).bfloat16()
        V = cfg.padded_vocab
        p["value_embeds"][4 * V:] = 0
        cfg80 = small_r84_config()
        cfg80.mudd = False
        cfg80.optimizer_table = {n: row for n, row in R.R84_PARAM_TABLE.items() if not n.startswith("mudd")}
        q = {n: t.clone() for n, t in p.items() if n in R.param_shapes(cfg80)}
        sc = torch.zeros(R.scalar_slots(cfg80).count)
        sc[:22] = p["scalars"][:22]
        sc[22], sc[23], sc[24] = p["scalars"][22], 0.5, p["scalars"][23]   # smear, backout 0.5, skip
        q["scalars"] = sc
        self.assertEqual(R.scalar_slots(cfg80).skip, 24)
        q["resid_lambdas"][10] = 1.1 ** 0.5   # bf16: 1.046875, as bf16(10.5 * 0.1)
        q["post_lambdas"][10] = 1.0
        q["x0_lambdas"][10] = 0.0
        q["bigram_lambdas"][10] = 0.05
        signs = R.random_sign_table(cfg, 11)
        b = random_batch(cfg, 32, 3, torch.Generator().manual_seed(152))
        out = []
        for c, params in ((cfg, p), (cfg80, q)):
            tr = R.Trainer(c, params, signs)
            loss = R.forward(c, tr.params, b, tr.forward_args(), training=True).sum()
            (loss * c.grad_scale).backward()
            out.append((float(loss), {n: t.grad for n, t in tr.params.items()}))
        self.assertEqual(out[0][0], out[1][0])
        for n in ("embed", "qk_bank", "vo_bank", "mlp_bank", "bigram_embed", "attn_gate_bank", "skip_gate"):
            self.assertTrue(torch.equal(out[0][1][n], out[1][1][n]), n)
        # the exit's h7 coefficient c'1 = -0.5 stands for the backout: d b2[1, 1] = 0.1 dL/dc'1 = -0.1 dL/d backout
        gb = out[0][1]["mudd_b2"][1, 1].item()
        gk = out[1][1]["scalars"][23].item()
        self.assertAlmostEqual(gb, -0.1 * gk, delta=2 ** -7 * abs(gb))

    def test_entry_and_exit_mix_their_sources(self):
        """Chosen coefficients in place of the MLP's (a spy), and the stream read at its norms: the last
        layer's v_add, ve gate, r and updates, and the exit's sum, each against a float64 formula of the
        sources it names (h0 the stream start, h3, h7, h9, value table 0 at the tokens)."""
        cfg = small_r84_config()
        p = r84_params(cfg, 18)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=torch.Generator().manual_seed(5))
                               * 0.05).bfloat16()
        T, C, H, bd = 32, cfg.model_dim, cfg.num_heads, cfg.bigram_dim
        g = torch.Generator().manual_seed(153)
        ce = (torch.randint(-8, 9, (T, 14), generator=g) / 8).bfloat16()   # exact multiples of 1/8
        cx = (torch.randint(-8, 9, (T, 5), generator=g) / 8).bfloat16()
        signs = R.random_sign_table(cfg, 12)
        b = random_batch(cfg, T, 2, torch.Generator().manual_seed(154))
        spy = _Spy(cfg, {0: ce, 1: cx})
        spy.run(p, b, R.Trainer(cfg, p, signs).forward_args(), training=False)
        self.assertEqual(len(spy.norm_inputs), NORM_FINAL + 1)
        d = lambda t: t.double()
        h0, h3, h7 = d(spy.stream(NORM_H0)), d(spy.stream(NORM_H3)), d(spy.stream(NORM_H7))
        h9, xl = d(spy.mudd_in[0]), d(spy.mudd_in[1])
        self.assertTrue(torch.equal(spy.stream(NORM_H7), spy.stream(NORM_H7 + 2)))  # layers 8-10 read h7
        c, e = d(ce), d(cx)
        col = lambda m, j: m[:, j:j + 1]
        ve_gate, v_add, y = spy.attn[10]
        self.assertTrue(torch.allclose(d(v_add), col(c, 0) * h0 + col(c, 1) * h7 + col(c, 2) * h9, rtol=1e-6, atol=1e-6))
        self.assertEqual(ve_gate.tolist(), [[a, b_] for a, b_ in zip(c[:, 6].tolist(), c[:, 7].tolist())])
        r = (1 + col(c, 5)) * h9 + col(c, 3) * h0 + col(c, 4) * h7  # not rounded: fused into the update
        xb = p["bigram_embed"][b.bigram].double() * signs[R.bigram_sign_index(b.inputs, cfg.bigram_sign_rows)].double()
        xbp = torch.cat([xb, torch.zeros(T, C - bd, dtype=torch.float64)], 1)
        mid = col(c, 8) * r + col(c, 9) * d(y) + col(c, 10) * h0 + col(c, 11) * xbp
        got_mid = d(spy.stream(NORM_L10_MLP))
        self.assertLessEqual((got_mid - mid).abs().max().item(), 2 ** -7 * mid.abs().max().item())
        last = col(c, 12) * got_mid + col(c, 13) * d(spy.mlp_out[-1])
        self.assertLessEqual((xl - last).abs().max().item(), 2 ** -7 * last.abs().max().item())
        ve0 = p["value_embeds"][b.inputs].double()  # value table 0 (layer 1's)
        final = xl + col(e, 0) * h0 + col(e, 1) * h7 + col(e, 2) * h9 + col(e, 3) * ve0 + col(e, 4) * h3
        got = d(spy.stream(NORM_FINAL))
        self.assertLessEqual((got - final).abs().max().item(), 2 ** -7 * final.abs().max().item())


@needs_torch
class R84StreamTest(unittest.TestCase):
    def test_x0_aliasing_changes_the_skip_gates_input(self):
        """x0 aliased to the stream start (after the in-place bigram add): with x0 lambdas zero only the skip
        gate reads x0, so aliasing changes the loss exactly when the skip gate's weights are nonzero and the
        bigram rows and lambda reach its 12 channels."""
        cfg = small_r84_config()
        p = r84_params(cfg, 19)
        p["x0_lambdas"].zero_()
        signs = R.random_sign_table(cfg, 13)
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(160))
        off = small_r84_config()
        off.x0_includes_bigram = False
        args = R.Trainer(cfg, p, signs).forward_args()
        loss = lambda c, q: float(R.forward(c, q, b, args, training=False))
        self.assertEqual(loss(cfg, p), loss(off, p))  # skip gate weights zero at init
        q = {n: t.clone() for n, t in p.items()}
        q["skip_gate"] = (torch.randn(1, 12, generator=torch.Generator().manual_seed(6)) * 2).bfloat16()
        self.assertNotEqual(loss(cfg, q), loss(off, q))
        q["bigram_lambdas"][0] = 0.0
        self.assertEqual(loss(cfg, q), loss(off, q))
        # the skip gate's gradient reads the aliased x0: with aliasing it sees the bigram rows' share
        q["bigram_lambdas"][0] = 0.5
        grads = []
        for c in (cfg, off):
            tr = R.Trainer(c, q, signs)
            R.forward(c, tr.params, b, tr.forward_args(), training=False).backward()
            grads.append(tr.params["skip_gate"].grad.clone())
        self.assertFalse(torch.equal(grads[0], grads[1]))

    def test_paired_layers_gate_reads_ve(self):
        cfg = small_r84_config()
        p = r84_params(cfg, 20)
        g = torch.Generator().manual_seed(161)
        p["ve_gate_bank"] = (torch.randn(5, 2, 12, generator=g) * 0.5).bfloat16()
        T, C = 6, cfg.model_dim
        h = torch.randn(T, C, generator=g).bfloat16()
        ve = (torch.randn(T, C, generator=g) * 0.5).bfloat16()
        doc = torch.arange(T)
        args = R.Trainer(cfg, p, R.random_sign_table(cfg, 14)).forward_args()
        W = R.attention_weights(cfg, p)
        layer = 2  # paired, value table 1
        y = R.attention_block(cfg, p, layer, h, W[R.attn_index(layer)], ve, doc, args)
        gate = 2 * torch.sigmoid(R.linear(torch.cat([h[:, :6], ve[:, :6]], -1), p["ve_gate_bank"][1]).float())
        y_given = R.attention_block(cfg, p, layer, h, W[R.attn_index(layer)], ve, doc, args, ve_gate=gate)
        self.assertTrue(torch.equal(y, y_given))
        off = small_r84_config()
        off.paired_ve_gate_reads_ve = False
        self.assertFalse(torch.equal(R.attention_block(off, p, layer, h, W[R.attn_index(layer)], ve, doc, args), y))

    def test_training_steps_keep_dead_entries(self):
        cfg = small_r84_config()
        p = r84_params(cfg, 21)
        tr = R.Trainer(cfg, p, R.random_sign_table(cfg, 15))
        gen = torch.Generator().manual_seed(162)
        before = {n: t.detach().clone() for n, t in tr.params.items()}
        losses = []
        for step in range(2):
            tr.advance(step)
            losses.append(tr.train_step(step, [random_batch(cfg, 32, 3, gen) for _ in range(8)]))
        self.assertTrue(all(math.isfinite(l) for l in losses))
        P = tr.params
        for name in ("mudd_w2", "mudd_b2", "xsa_alphas", "qk_bank", "bigram_embed"):
            self.assertFalse(torch.equal(P[name], before[name]), name)
        # w2 = 0 at init: no gradient reaches w1 before w2 has moved (Adam steps on step 1 only)
        self.assertTrue(torch.equal(P["mudd_w1"], before["mudd_w1"]))
        # MUDD's entry replaces layer 10's lambdas and ve gate; the exit uses 5 of 14 rows
        for name, idx in (("resid_lambdas", 10), ("post_lambdas", 10), ("x0_lambdas", 10), ("bigram_lambdas", 10),
                          ("ve_gate_bank", 4), ("mudd_w2", (1, slice(5, None))), ("mudd_b2", (1, slice(5, None))),
                          ("xsa_alphas", 2)):
            self.assertTrue(torch.equal(P[name][idx], before[name][idx]), name)
        self.assertTrue(torch.equal(P["embed"], P["lm_head"].t()))


# =====================================================================================================
# Record 89 (upstream 75d6867a; its PR on a333be08: 2026-07-17_FP8DownProjection/this_pr): the FP8 MLP
# down-projection's delayed-scale state machine, each against a re-derivation written here in Python floats
# (fp32 and bf16 roundings from the formats' definitions).
# =====================================================================================================
def f32(v):
    """v rounded to fp32 (an fp32 operation's result computed in double first is the correctly rounded one:
    double has more than 2 * 24 + 2 bits)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def bf16(v):
    return round_to_format(v, 7, -126, 3.3895313892515355e38)


class DownRederivation:
    """Upstream's quantize_mlp_fp8 (down half), the EMIT_FP8 epilogue, reduce_mlp_activation_scales and the
    _scaled_mm, written from upstream's code in Python floats, one layer at a time."""

    def __init__(self, layers):
        self.act, self.used, self.next = [1.0] * layers, [1.0] * layers, [1.0] * layers
        self.w2q = [None] * layers

    def quantize(self, bank, bootstrap):
        for l in range(bank.shape[0]):
            w = bank[l, 1].float().tolist()
            amax = max(abs(v) for row in w for v in row)
            if bootstrap:  # bf16 eager torch: clamp(min=1e-12) in bf16, / 448 a bf16 op
                self.next[l] = bf16(f32(max(amax, bf16(1e-12)) / 448.0))
            self.used[l] = self.next[l]
            self.w2q[l] = [[e4m3(max(min(f32(v / self.used[l]), 448.0), -448.0)) for v in row] for row in w]
            self.next[l] = f32(max(amax, f32(1e-12)) * f32(1.12 / 448.0))

    def forward(self, l, post):
        """postq codes and out's unrounded value (double sum of the e4m3 products, times fp32(act * used)); the
        layer's amax is returned for the caller to apply after the layers."""
        inv = f32(1.0 / self.act[l])
        postq = [[e4m3(min(f32(v * inv), 448.0)) for v in row] for row in post.float().tolist()]
        scale = f32(self.act[l] * self.used[l])
        w = self.w2q[l]
        out = [[sum(q[h] * w[h][c] for h in range(len(q))) * scale for c in range(len(w[0]))] for q in postq]
        return postq, out, max(v for row in post.float().tolist() for v in row)

    def end_forward(self, amaxes):
        for l, a in amaxes.items():
            self.act[l] = f32(max(a, f32(1e-12)) * f32(1.80 / 448.0))


def down_bank(gen, layers=3, H=24, C=16, scale=0.05):
    bank = torch.zeros(layers, 2, H, C)
    bank[:, 1] = torch.randn(layers, H, C, generator=gen) * scale
    return bank.bfloat16()


@needs_torch
class R89Fp8DownTest(unittest.TestCase):
    def test_presets(self):
        t, r = R.tiny_r84_fp8down_config(), R.r84_fp8down_config()
        self.assertTrue(t.mlp_fp8_down and r.mlp_fp8_down and t.mlp_up_fp8)
        self.assertEqual((r.scheduled_iterations, r.extension_iterations), (1380, 10))  # the PR's this_pr logs
        base = R.tiny_r84_config()
        self.assertFalse(base.mlp_fp8_down)
        self.assertNotIn("mlp_fp8_down", base.to_json())  # record 84's fixtures keep their bytes
        self.assertEqual(t.to_json()["mlp_fp8_down"], True)
        d = t.to_json()
        for k in ("name", "mlp_fp8_down"):
            d.pop(k)
        b = base.to_json()
        b.pop("name")
        self.assertEqual(d, b)  # tiny-r84 plus the switch
        t.mlp_up_fp8 = False
        with self.assertRaisesRegex(ValueError, "mlp_up_fp8 is needed"):
            t.validate()

    def test_weight_state_machine_over_steps(self):
        """Init (bootstrap), then 20 optimizer steps (bootstrap while step < 16): every step's act/used/next bits and
        W2q codes against the re-derivation; used is bf16(amax / 448) through step 15, then the previous step's
        amax * 1.12 / 448; a layer growing past the headroom clamps to +-448; a zero layer's floors."""
        g = torch.Generator().manual_seed(89)
        bank = down_bank(g)
        bank[2, 1] = 0.0  # a zero layer: bf16(bf16(1e-12) / 448), then 1e-12 * 1.12 / 448
        st, ref = R.MlpDownState(entries=3), DownRederivation(3)
        st.quantize_weights(bank, bootstrap=True)
        ref.quantize(bank, True)
        prev_amax = None
        for step in range(20):
            bank = bank.float()
            bank[:2, 1] += torch.randn(2, 24, 16, generator=g) * 0.01
            if step == 17:
                bank[0, 1, 3, 5] = 2.5 * bank[0, 1].abs().max()  # past the 1.12 headroom: clamps
            bank = bank.bfloat16()
            boot = step < R.MLP_DOWN_BOOTSTRAP_STEPS
            st.quantize_weights(bank, bootstrap=boot)
            ref.quantize(bank, boot)
            self.assertEqual(st.used.tolist(), ref.used, f"step {step}")
            self.assertEqual(st.next.tolist(), ref.next, f"step {step}")
            self.assertEqual(st.act.tolist(), [1.0] * 3)  # the weight side leaves act
            for l in range(3):
                self.assertEqual(st.w2q[l].float().tolist(), ref.w2q[l], f"step {step} layer {l}")
            amax = bank[:, 1].float().abs().amax(dim=(1, 2)).tolist()
            if boot:
                self.assertEqual(st.used[0].item(), bf16(f32(amax[0] / 448.0)))
            else:
                self.assertEqual(st.used[0].item(), f32(prev_amax[0] * f32(1.12 / 448)))
                self.assertNotEqual(st.used[0].item(), bf16(f32(amax[0] / 448.0)))
            if step == 17:
                self.assertEqual(st.w2q[0][3, 5].item(), 448.0)
                self.assertEqual(st.w2q[0].float().abs().max().item(), 448.0)
            floor = bf16(f32(bf16(1e-12) / 448)) if boot else f32(f32(1e-12) * f32(1.12 / 448))
            self.assertEqual(st.used[2].item(), floor)
            prev_amax = amax

    def test_activation_side_one_step_late(self):
        """Three forwards of one layer: each quantizes post with the act the previous one left (the first with 1:
        posts past 448 clamp), out against the re-derivation's double sum (within a bf16 step, mostly equal), act
        = amax * 1.80 / 448 after end_forward only; the weight scales untouched."""
        g = torch.Generator().manual_seed(90)
        bank = down_bank(g)
        st, ref = R.MlpDownState(entries=3), DownRederivation(3)
        st.quantize_weights(bank, True)
        ref.quantize(bank, True)
        used, nxt = st.used.clone(), st.next.clone()
        for k, scale in enumerate((30.0, 0.02, 0.3)):
            post = R.bf(torch.relu(torch.randn(20, 24, generator=g) * scale).square())
            act_before = st.act.clone()
            st.record_amax(1, post)
            out = R.Fp8DownProjection.apply(post, bank[1, 1], st.w2q[1], st.act[1], st.used[1])
            postq, want, amax = ref.forward(1, post)
            self.assertTrue(torch.equal(st.act, act_before))  # not before end_forward
            self.assertEqual(R.quantize_post(post, act_before[1]).float().tolist(), postq)
            if k == 0:
                self.assertGreater(sum(v == 448.0 for row in postq for v in row), 0)  # act 1: big posts clamp
            w = torch.tensor(want, dtype=torch.float64)
            diff = (out.double() - w).abs()
            self.assertTrue(bool((diff <= w.abs() * 2 ** -8 + 1e-30).all()), f"forward {k}")
            self.assertGreater(torch.eq(out, w.bfloat16()).float().mean().item(), 0.95)
            st.end_forward()
            ref.end_forward({1: amax})
            self.assertEqual(st.act.tolist(), ref.act)
            self.assertEqual(st.act[1].item(), f32(max(amax, f32(1e-12)) * f32(1.80 / 448.0)))
            self.assertEqual([st.act[0].item(), st.act[2].item()], [1.0, 1.0])
            self.assertTrue(torch.equal(st.used, used) and torch.equal(st.next, nxt))

    def test_post_quantization_every_bf16_value(self):
        """quantize_post on every bf16 value in [2^-10, 2^10) and past 448 * act, with acts a forward could leave:
        e4m3(min(f32(post * f32(1 / act)), 448)) exactly (1 / act in fp32, not bf16; no other rounding)."""
        post = torch.arange(0x3A80, 0x44A0, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        for amax in (0.7, 3.3, 517.25):
            act = f32(amax * f32(1.80 / 448.0))
            got = R.quantize_post(post, torch.tensor(act, dtype=torch.float32)).float().tolist()
            inv = f32(1.0 / act)
            want = [e4m3(min(f32(v * inv), 448.0)) for v in post.float().tolist()]
            self.assertEqual(got, want, amax)

    def test_backward_is_the_bf16_paths(self):
        g = torch.Generator().manual_seed(91)
        h = torch.randn(12, 16, generator=g).bfloat16().requires_grad_(True)
        bank = down_bank(g, H=32)
        bank[:, 0] = (torch.randn(3, 32, 16, generator=g) * 0.2).bfloat16()
        c_fc, c_proj = (bank[1, i].clone().requires_grad_(True) for i in (0, 1))
        st = R.MlpDownState(entries=3)
        st.quantize_weights(bank, True)
        gy = torch.randn(12, 16, generator=g).bfloat16()
        y8 = R.mlp_block(h, c_fc, c_proj, down=(st, 1))
        y16 = R.mlp_block(h, c_fc, c_proj)
        self.assertFalse(torch.equal(y8, y16))
        a = torch.autograd.grad(y8, (h, c_fc, c_proj), gy)
        b = torch.autograd.grad(y16, (h, c_fc, c_proj), gy)
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))

    def model_setup(self):
        cfg = small_r84_config()
        cfg.mlp_fp8_down = True
        p = r84_params(cfg, 17)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=torch.Generator().manual_seed(4))
                               * 0.05).bfloat16()
        return cfg, p, R.random_sign_table(cfg, 11)

    def test_model_act_per_training_forward_not_validation(self):
        """Through the model: each layer's down-projection reads the act the previous training forward left (1 at
        first), act changes after every training micro-step (per micro-batch, from that batch's posts alone) and
        never in validation, which runs the bf16 MLP; entry 11 (no layer) keeps 1."""
        cfg, p, signs = self.model_setup()
        tr = R.Trainer(cfg, p, signs)
        gen = torch.Generator().manual_seed(92)
        b1, b2 = (random_batch(cfg, 24, 2, gen) for _ in range(2))
        seen, real = [], R.Fp8DownProjection.apply

        def spy(post, w2, w2q, act, used):
            seen.append((float(act), float(post.float().amax())))
            return real(post, w2, w2q, act, used)
        R.Fp8DownProjection.apply = spy
        try:
            args = tr.forward_args()
            with torch.no_grad():
                R.forward(cfg, tr.params, b1, args, training=False)
                self.assertEqual((tr.mlp_down.act.tolist(), seen), ([1.0] * 12, []))
                R.forward(cfg, tr.params, b1, args, training=True)
                first = list(seen)
                act1 = tr.mlp_down.act.clone()
                R.forward(cfg, tr.params, b1, args, training=False)
                self.assertTrue(torch.equal(tr.mlp_down.act, act1))
                R.forward(cfg, tr.params, b2, args, training=True)
                second = seen[len(first):]
        finally:
            R.Fp8DownProjection.apply = real
        self.assertEqual(len(first), R.LAYERS)
        self.assertEqual([a for a, _ in first], [1.0] * R.LAYERS)
        want1 = [f32(max(m, f32(1e-12)) * f32(1.80 / 448.0)) for _, m in first]
        self.assertEqual(act1[:R.LAYERS].tolist(), want1)
        self.assertEqual(act1[R.LAYERS].item(), 1.0)
        self.assertEqual([a for a, _ in second], want1)  # one forward late
        self.assertEqual(tr.mlp_down.act[:R.LAYERS].tolist(),
                         [f32(max(m, f32(1e-12)) * f32(1.80 / 448.0)) for _, m in second])
        with torch.no_grad():
            off = small_r84_config()
            self.assertEqual(float(R.forward(cfg, tr.params, b1, args, training=False)),
                             float(R.forward(off, tr.params, b1, args, training=False)))

    def run_steps(self, tr, steps, batches):
        losses = []
        for step in steps:
            tr.advance(step)
            losses.append(tr.train_step(step, batches[step]))
        return losses

    def test_resume_mid_bootstrap_is_bitwise(self):
        """A run saved after step 0 (bootstrap shortened to step 0 so that step 1's quantization is delayed) and
        resumed in a fresh Trainer gives the uninterrupted run's losses, parameters and scales bit for bit; resumed
        without the scale state (ones, re-bootstrapped) it does not."""
        cfg, p, signs = self.model_setup()
        gen = torch.Generator().manual_seed(93)
        batches = [[random_batch(cfg, 16, 2, gen) for _ in range(cfg.grad_accum)] for _ in range(3)]
        saved = R.MLP_DOWN_BOOTSTRAP_STEPS
        R.MLP_DOWN_BOOTSTRAP_STEPS = 1
        try:
            a = R.Trainer(cfg, p, signs)
            self.run_steps(a, [0], batches)
            state = a.state_dict()
            next0 = a.mlp_down.next.clone()
            want = self.run_steps(a, [1], batches)
            self.assertTrue(torch.equal(a.mlp_down.used, next0))  # step 1's quantization: delayed
            want += self.run_steps(a, [2], batches)
            b = R.Trainer(cfg, p, signs)
            b.load_state_dict(state)
            got = self.run_steps(b, [1, 2], batches)
            c = R.Trainer(cfg, p, signs)
            c.load_state_dict(state)
            c.mlp_down = R.MlpDownState()
            c.mlp_down.quantize_weights(c.params["mlp_bank"], bootstrap=True)
            lost = self.run_steps(c, [1], batches)
        finally:
            R.MLP_DOWN_BOOTSTRAP_STEPS = saved
        self.assertEqual(got, want)
        for n in a.params:
            self.assertTrue(torch.equal(a.params[n], b.params[n]), n)
        for k in ("act", "used", "next", "w2q"):
            self.assertTrue(torch.equal(getattr(a.mlp_down, k).float(), getattr(b.mlp_down, k).float()), k)
        self.assertNotEqual(lost[0], want[0])


def small_r86_config():
    """tiny-r86 with a small vocabulary and sign table: every code path of records 85-86, fast."""
    c = R.tiny_r86_config()
    c.vocab_size, c.padded_vocab, c.bigram_vocab = 500, 512, 64 * 15 // 2
    c.bigram_sign_rows = 61
    return c


def r86_params(cfg, seed, w2_scale=0.0):
    """r84_params for record 86 (nonzero bigram rows); w2_scale > 0 also draws the gate's second layer, so that its
    columns vary per token and DC's w2 is nonzero."""
    p = r84_params(cfg, seed)
    if w2_scale:
        g = torch.Generator().manual_seed(seed + 2000)
        p["mudd_gate_w2"] = (torch.randn(p["mudd_gate_w2"].shape, generator=g) * w2_scale).bfloat16()
    return p


# Upstream's gate columns, transcribed from 003ff3e2's unpack_pre_mudd_gate / unpack_post_mudd_gate (L1398-1413) and
# the dc_weights line (L1514), independently of torch_reference.mudd_gate_layout: (gate, column) -> (kind, layer,
# head) with head -1 for the one-column readers.
def upstream_gate_columns():
    cols = {}
    for h in range(6):
        cols[(0, h)] = ("xsa", 1, h)
        cols[(0, 6 + h)] = ("xsa", 3, h)
        cols[(0, 12 + h)] = ("out", 3, h)
        cols[(1, h)] = ("xsa", 4, h)
        cols[(1, 6 + h)] = ("xsa", 7, h)
        cols[(1, 12 + h)] = ("out", 10, h)
        cols[(1, 29 + h)] = ("dc_w1", 10, h)
        cols[(1, 35 + h)] = ("dc_w2", 10, h)
    for layer, off in zip((0, 1, 2, 3), range(18, 26, 2)):
        cols[(0, off)] = ("x0", layer, -1)
        cols[(0, off + 1)] = ("bigram", layer, -1)
    for layer, off in zip((4, 5, 7, 8, 9), range(18, 28, 2)):
        cols[(1, off)] = ("x0", layer, -1)
        cols[(1, off + 1)] = ("bigram", layer, -1)
    cols[(1, 28)] = ("skip", 6, -1)
    return cols


UPSTREAM = "/work/.mirror/KellerJordan+modded-nanogpt/repo"


def upstream_source(commit, path):
    """A file of upstream's repository at a commit, from a local mirror (None where there is none)."""
    import subprocess
    try:
        return subprocess.run(["git", "-C", UPSTREAM, "show", f"{commit}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


@needs_torch
class R86ConfigTest(unittest.TestCase):
    def test_presets_sizes_and_schedule(self):
        c = R.r86_config()
        shapes = R.param_shapes(c)
        self.assertEqual(shapes["bigram_embed"], ((377280, 768), torch.bfloat16))
        self.assertEqual(shapes["mudd_gate_w1"], ((2, 64, 768), torch.bfloat16))
        self.assertEqual(shapes["mudd_gate_w2"], ((2, 41, 64), torch.bfloat16))
        self.assertEqual(shapes["mudd_gate_b2"], ((2, 41), torch.bfloat16))
        self.assertEqual(shapes["mudd_gate_scale"], ((1,), torch.float32))
        self.assertEqual(shapes["scalars"], ((24,), torch.float32))
        self.assertEqual(shapes["ve_gate_bank"], ((5, 6, 12), torch.bfloat16))
        for gone in ("attn_gate_bank", "skip_gate", "x0_lambdas", "bigram_lambdas", "xsa_alphas"):
            self.assertNotIn(gone, shapes)
        self.assertEqual((c.bigram_width, c.bigram_sign_rows, c.xsa_layers), (768, 8192, (1, 3, 4, 7)))
        self.assertFalse(c.x0_includes_bigram)
        s = R.Schedule(c)  # thirds of 1285: round(428.33) = 428, round(856.67) = 857; split 857 (odd)
        self.assertEqual(s.boundaries, [(0, 428), (428, 857), (857, 1285), (1285, 1300)])
        self.assertEqual(s.split_step, 857)
        t = R.tiny_r86_config()
        ts = R.param_shapes(t)
        self.assertEqual((t.model_dim, t.num_heads, t.head_dim, t.mlp_dim), (384, 6, 64, 1536))
        self.assertEqual(ts["bigram_embed"], ((30720, 384), torch.bfloat16))
        self.assertEqual(ts["qk_bank"], ((64, 128, 384), torch.bfloat16))  # 10 layers x 2 x 3 pairs, padded to 64
        self.assertEqual(ts["mlp_bank"], ((12, 2, 1536, 384), torch.bfloat16))
        t84 = R.tiny_r84_config()
        for f in ("stages", "max_num_docs_table", "value_layers", "grad_scale", "vocab_size", "block_size",
                  "val_batch_tokens", "scheduled_iterations", "extension_iterations", "max_seq_len"):
            self.assertEqual(getattr(t, f), getattr(t84, f), f)
        for name in ("record", "tiny", "r80", "tiny-r80", "r84", "tiny-r84", "tiny-r84-prefix", "tiny-r84-fp8down"):
            cf = R.PRESETS[name]()
            self.assertFalse(cf.mudd_gate or cf.dc_mha, name)
            self.assertNotIn("mudd_gate", cf.to_json())
        self.assertTrue(t.to_json()["mudd_gate"] and t.to_json()["dc_mha"])

    def test_optimizer_table_and_work_order(self):
        t = R.R86_PARAM_TABLE
        # 003ff3e2 L1928-1953 (transcribed): dict order = scatter order; _mudd_gate_scale is the trainer's mudd_gate_scale
        self.assertEqual(list(t), ["qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head",
                                   "bigram_embed", "post_lambdas", "resid_lambdas", "value_embeds", "embed", "mudd_w1",
                                   "mudd_w2", "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2",
                                   "mudd_gate_scale"])
        for n in ("mudd_gate_w1", "mudd_gate_w2"):
            self.assertEqual(t[n], ("adam", (0.9, 0.99), 0.1, 1.0))
        for n in ("mudd_gate_b2", "mudd_gate_scale"):
            self.assertEqual(t[n], ("adam", (0.9, 0.99), 0.1, 0.0))
        self.assertEqual(sorted(R.param_names(R.r86_config())), sorted(t))
        self.assertEqual(sorted(R.R86_WORK_ORDER), sorted(t))
        src = upstream_source("003ff3e2", "train_gpt.py")
        if src is None:
            return  # (no local mirror of upstream: the transcription above stands)
        # parsed from upstream's own TrainingManager: every row's betas, lr_mul, wd_mul (defaults 1) and the orders
        import re
        body = src[src.index("self.param_table = {"):src.index("self.work_order = [")]
        rows = {}
        for m in re.finditer(r'"(\w+)":\s*\{([^}]*)\}', body):
            fields = dict(re.findall(r'"(\w+)":\s*("[^"]*"|\[[^\]]*\]|None|[\d.]+)', m.group(2)))
            betas = None if fields["adam_betas"] == "None" else tuple(
                float(v) for v in fields["adam_betas"].strip("[]").split(","))
            rows[m.group(1).lstrip("_")] = (fields["optim"].strip('"'), betas, float(fields.get("lr_mul", 1.0)),
                                            float(fields.get("wd_mul", 1.0)))
        self.assertEqual(list(rows), list(t))
        self.assertEqual(rows, t)
        wo = src[src.index("self.work_order = ["):]
        wo = wo[:wo.index("adam_defaults")]
        self.assertEqual([n.lstrip("_") for n in re.findall(r'"(\w+)"', wo)], R.R86_WORK_ORDER)

    def test_init_and_the_biases_effective_values(self):
        cfg = small_r86_config()
        p = R.init_params(cfg, 31)
        self.assertTrue(torch.equal(p["mudd_gate_scale"], torch.tensor([0.1], dtype=torch.float32)))
        b = p["mudd_gate_b2"].float()
        want = torch.zeros(2, 41)
        want[0, 12:18] = want[1, 12:18] = 2.5
        want[0, [19, 21, 23, 25]] = 0.5
        want[1, [19, 21, 23, 25, 27]] = 0.5
        want[1, 28], want[1, 29:35] = 5.0, 10.0
        self.assertTrue(torch.equal(b, want))
        w1 = p["mudd_gate_w1"].float()
        self.assertLessEqual(w1.abs().max().item(), 384 ** -0.5)
        self.assertGreater(w1.abs().max().item(), 0.9 * 384 ** -0.5)
        self.assertTrue(bool((p["mudd_gate_w2"] == 0).all()))
        # effective values at the initial scale bf16(0.1) = 0.10009765625, each rounded to bf16:
        # 2.5 s = 0.2502 -> 0.25; 0.5 s = 0.050048828125 (exact in bf16); 5 s = 0.5005 -> 0.5; 10 s = 1.001 -> 1.0
        self.assertEqual(float(torch.tensor(0.1).bfloat16()), 0.10009765625)
        h = torch.randn(3, cfg.model_dim, generator=torch.Generator().manual_seed(170)).bfloat16()
        eff = {0: R.mudd_gate(p, h, 0, 26).float(), 1: R.mudd_gate(p, h, 1, 41).float()}
        self.assertEqual(tuple(eff[0].shape), (3, 26))
        value = {"out": 0.25, "bigram": 0.050048828125, "skip": 0.5, "dc_w1": 1.0}
        for (gate, col), (kind, layer, head) in upstream_gate_columns().items():
            self.assertEqual(eff[gate][:, col].tolist(), [value.get(kind, 0.0)] * 3, (gate, col, kind, layer))
        # DC's weights at init: w1 = bf16(rms_norm(1, ..., 1)) = 1, w2 = 0: DC starts as a no-op
        w1, w2 = R.dc_weights(R.bf(eff[1][:, 29:35]), R.bf(eff[1][:, 35:41]))
        self.assertEqual(w1.float().tolist(), [[1.0] * 6] * 3)
        self.assertEqual(w2.float().tolist(), [[0.0] * 6] * 3)

    def test_gate_by_formula_and_the_scales_gradient(self):
        """G = bf16((bf16(bf16(gelu(bf16(h W1^T))) W2^T) + b2) * bf16(s)) in float64 from the definition (exact-erf
        GELU), at a scale s that bf16 rounds (1 + 2^-9 -> 1); d s = bf16(sum dG (lin + b2))."""
        cfg = small_r86_config()
        p = R.init_params(cfg, 32)
        g = torch.Generator().manual_seed(173)
        p["mudd_gate_w2"] = (torch.randn(2, 41, 64, generator=g) * 0.3).bfloat16()
        p["mudd_gate_b2"] = torch.randn(2, 41, generator=g).bfloat16()
        p["mudd_gate_scale"] = torch.tensor([1 + 2 ** -9], requires_grad=True)
        h = torch.randn(40, cfg.model_dim, generator=g).bfloat16()
        got = R.mudd_gate(p, h, 1, 41)
        z = (h.double() @ p["mudd_gate_w1"][1].double().t()).bfloat16().double()
        u = (0.5 * z * (1 + torch.erf(z / math.sqrt(2)))).bfloat16().double()
        lin = (u @ p["mudd_gate_w2"][1].double().t()).bfloat16().double()
        pre = lin + p["mudd_gate_b2"][1].double()
        want = pre.bfloat16().double()  # bf16(s) = 1
        self.assertGreater(torch.eq(got.double(), want).double().mean().item(), 0.97)
        self.assertLessEqual((got.double() - want).abs().max().item(), 2 ** -7 * want.abs().max().item())
        go = torch.randn(40, 41, generator=g, dtype=torch.float64)
        (got.double() * go).sum().backward()
        ds = float((go.bfloat16().double() * pre).sum())
        self.assertAlmostEqual(p["mudd_gate_scale"].grad.item(), float(torch.tensor(ds).bfloat16()),
                               delta=2 ** -7 * abs(ds))

    def test_checkpoint_names_and_refusals(self):
        cfg = small_r86_config()
        p = r86_params(cfg, 23)
        t = {"param." + R.LABELS.get(n, n): v.reshape(v.shape[0], -1) for n, v in p.items()}
        self.assertIn("param.mudd_gate_scale", t)
        self.assertIn("param.mlp", t)
        q = R.params_from_checkpoint(cfg, t)
        self.assertEqual(sorted(q), sorted(p))
        for n in p:
            self.assertTrue(torch.equal(q[n], p[n]), n)
        del t["param.mudd_gate_b2"]
        self.assertRaises(ValueError, R.params_from_checkpoint, cfg, t)
        for field, value in (("num_heads", 2), ("xsa_layers", (1, 3, 4, 7, 8)), ("x0_includes_bigram", True),
                             ("bigram_dim", 96), ("mudd", False)):
            c = small_r86_config()
            if field == "num_heads":
                c.head_dim = c.model_dim // 2
            setattr(c, field, value)
            self.assertRaises(ValueError, c.validate)
        c = R.tiny_r84_config()
        c.dc_mha = True
        self.assertRaises(ValueError, c.validate)


class _GateSpy:
    """Records, during one forward, every (T, C) norm input (the stream), each attention layer's LayerGates and the
    MUDD gates' inputs."""

    def __init__(self, cfg):
        self.cfg = cfg

    def run(self, p, batch, args, training=False):
        real_norm, real_attn, real_gate = R.rms_norm, R.attention_block, R.mudd_gate
        self.norms, self.gates, self.gate_in = [], {}, {}
        C = self.cfg.model_dim

        def norm(x):
            if x.dim() == 2 and x.shape[-1] == C:
                self.norms.append(x.detach().float().clone())
            return real_norm(x)

        def attn(cfg, p_, layer, h, W, ve, doc, args_, ve_gate=None, v_add=None, gates=None):
            self.gates[layer] = gates
            return real_attn(cfg, p_, layer, h, W, ve, doc, args_, ve_gate, v_add, gates)

        def gate(p_, h, g, n):
            self.gate_in[g] = h.detach().clone()
            return real_gate(p_, h, g, n)
        R.rms_norm, R.attention_block, R.mudd_gate = norm, attn, gate
        try:
            with torch.no_grad():
                return R.forward(self.cfg, p, batch, args, training=training)
        finally:
            R.rms_norm, R.attention_block, R.mudd_gate = real_norm, real_attn, real_gate


def norm_points():
    """The spy's norm inputs in order: the embedding's, then per layer its attention input (not layer 6) and its MLP
    input, then the final norm."""
    pts = [("embed", -1)]
    for layer in range(11):
        if layer != 6:
            pts.append(("attn", layer))
        pts.append(("mlp", layer))
    return pts + [("final", 11)]


@needs_torch
class R86GateTest(unittest.TestCase):
    def test_layout_is_upstreams(self):
        want = upstream_gate_columns()
        got = {}
        for (kind, layer), (gate, start, width) in R.mudd_gate_layout().items():
            for j in range(width):
                self.assertNotIn((gate, start + j), got)
                got[(gate, start + j)] = (kind, layer, j if width > 1 else -1)
        self.assertEqual(got, want)
        self.assertEqual(sorted(c for g, c in want if g == 0), list(range(26)))  # every column read, once
        self.assertEqual(sorted(c for g, c in want if g == 1), list(range(41)))

    def test_each_column_moves_only_its_consumer(self):
        """Perturb one gate column (its bias) and run the forward: of that gate's per-head readers only the column's
        consumer changes (a pre-gate column also moves every post-gate column, through h3), and the stream first
        changes where the consumer acts. The gates' inputs: x0 (the clean normed embedding, not the stream start)
        and layer 4's input."""
        cfg = small_r86_config()
        p = r86_params(cfg, 24, w2_scale=0.3)
        args = R.Trainer(cfg, p, R.random_sign_table(cfg, 17)).forward_args()
        b = random_batch(cfg, 32, 3, torch.Generator().manual_seed(171))
        spy = _GateSpy(cfg)
        spy.run(p, b, args)
        base_norms, base_gates = spy.norms, spy.gates
        pts = norm_points()
        self.assertEqual(len(base_norms), len(pts))
        x0 = R.bf(R.rms_norm(base_norms[0]))
        self.assertTrue(torch.equal(spy.gate_in[0], x0))
        self.assertTrue(torch.equal(spy.gate_in[1].float(), base_norms[pts.index(("attn", 4))]))
        fields = {"xsa": lambda g: g.xsa, "out": lambda g: g.out, "dc_w1": lambda g: g.dc[0] if g.dc else None,
                  "dc_w2": lambda g: g.dc[1] if g.dc else None}
        first_change = {"xsa": "mlp", "out": "mlp", "dc_w1": "mlp", "dc_w2": "mlp", "x0": "mlp", "bigram": "mlp",
                        "skip": "mlp"}
        columns = [(0, 0), (0, 11), (0, 14), (0, 18), (0, 19), (0, 22), (0, 25), (1, 5), (1, 6), (1, 17), (1, 18),
                   (1, 21), (1, 26), (1, 27), (1, 28), (1, 29), (1, 40)]
        for gate, col in columns:
            kind, layer, head = upstream_gate_columns()[(gate, col)]
            q = dict(p)
            q["mudd_gate_b2"] = p["mudd_gate_b2"].clone()
            q["mudd_gate_b2"][gate, col] += 4.0
            spy.run(q, b, args)
            moved = []
            for l, g in spy.gates.items():
                for f, get in fields.items():
                    t0, t1 = get(base_gates[l]), get(g)
                    if t0 is None:
                        self.assertIsNone(t1)
                        continue
                    for hh in range(t0.shape[1]):
                        if not torch.equal(t0[:, hh], t1[:, hh]):
                            moved.append((f, l, hh))
            want_moved = [(kind, layer, head)] if kind in fields else []
            if gate == 0:  # the post gate reads h3, downstream of every pre-gate reader
                moved = [m for m in moved if m[1] < R.MUDD_GATE_POST_LAYER]
            self.assertEqual(moved, want_moved, (gate, col))
            changed = [i for i, (a, c) in enumerate(zip(base_norms, spy.norms)) if not torch.equal(a, c)]
            where = ("attn", 0) if (kind, layer) == ("bigram", 0) else (first_change[kind], layer)
            self.assertEqual(pts[changed[0]], where, (gate, col, kind, layer))

    def test_output_gate_is_raw_and_per_head(self):
        """Layer 3's output gate multiplies head h's output by its column h as is (no sigmoid): a gate of 2 doubles
        the layer's output exactly; a gate of 0 on head h equals no gate with W_o's columns of head h zeroed."""
        cfg = small_r86_config()
        p = r86_params(cfg, 28)
        args = R.Trainer(cfg, p, R.random_sign_table(cfg, 21)).forward_args()
        g = torch.Generator().manual_seed(174)
        T, C, D = 12, cfg.model_dim, cfg.head_dim
        h = R.bf(R.rms_norm(torch.randn(T, C, generator=g)))
        doc = torch.tensor([0] * 5 + [1] * 7)
        W = R.attention_weights(cfg, p)[R.attn_index(3)]
        block = lambda W_, out: R.attention_block(cfg, p, 3, h, W_, None, doc, args, gates=R.LayerGates(out=out))
        plain = block(W, None)
        two = torch.full((T, 6), 2.0, dtype=torch.bfloat16)
        self.assertTrue(torch.equal(block(W, two), R.bf(2 * plain.float())))
        for head in (0, 4):
            gate = torch.ones(T, 6, dtype=torch.bfloat16)
            gate[:, head] = 0
            W0 = W.clone()
            W0[3 * C:, head * D:(head + 1) * D] = 0
            self.assertTrue(torch.equal(block(W, gate), block(W0, None)), head)

    def test_injections_and_skip_by_formula(self):
        """Layer 2's update and layer 6's skip from the spied stream, attention output and gate columns."""
        cfg = small_r86_config()
        p = r86_params(cfg, 25, w2_scale=0.3)
        signs = R.random_sign_table(cfg, 18)
        args = R.Trainer(cfg, p, signs).forward_args()
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(172))
        real_attn = R.attention_block
        outs = {}

        def attn(*a, **k):
            y = real_attn(*a, **k)
            outs[a[2]] = y.detach().float()
            return y
        spy = _GateSpy(cfg)
        R.attention_block = attn
        try:
            spy.run(p, b, args)
        finally:
            R.attention_block = real_attn
        pts = norm_points()
        at = lambda kind, layer: spy.norms[pts.index((kind, layer))].double()
        x0 = R.bf(R.rms_norm(spy.norms[0])).double()
        G0 = R.mudd_gate(p, R.bf(R.rms_norm(spy.norms[0])), 0, 26).double()
        G1 = R.mudd_gate(p, at("attn", 4).bfloat16(), 1, 41).double()
        xb = (p["bigram_embed"][b.bigram].double() * signs[R.bigram_sign_index(b.inputs, 61)].double())
        lam = lambda n, i, j: float(p[n][i, j].bfloat16())
        # layer 2: x = bf16(ra x + pa y + G0[22] x0 + G0[23] xb)
        want = (lam("resid_lambdas", 2, 0) * at("attn", 2) + lam("post_lambdas", 2, 0) * outs[2].double()
                + G0[:, 22:23] * x0 + G0[:, 23:24] * xb)
        got = at("mlp", 2)
        self.assertLessEqual((got - want).abs().max().item(), 2 ** -8 * want.abs().max().item())
        self.assertGreater(torch.eq(got, want.bfloat16().double()).double().mean().item(), 0.95)
        # layer 6: x = bf16(x + sigmoid(skip_lambda) G1[28] h3), h3 = layer 4's input
        sig = 1 / (1 + math.exp(-float(p["scalars"][23])))
        h3 = at("attn", 4)
        x6 = at("mlp", 6)
        # layer 6's input is not spied (layer 5's MLP output): check the skip term by the difference to a run whose
        # skip column is larger, everything before layer 6 unchanged
        q = dict(p)
        q["mudd_gate_b2"] = p["mudd_gate_b2"].clone()
        q["mudd_gate_b2"][1, 28] += 5.0  # effective + 0.5: the skip term grows by sigmoid(l) 0.5 h3 (+- roundings)
        spy2 = _GateSpy(cfg)
        spy2.run(q, b, args)
        x6b = spy2.norms[pts.index(("mlp", 6))].double()
        G1b = R.mudd_gate(q, at("attn", 4).bfloat16(), 1, 41).double()
        delta = sig * (G1b[:, 28:29] - G1[:, 28:29]) * h3
        bound = 2 ** -8 * (x6.abs() + x6b.abs()) + 1e-6  # the two streams' bf16 roundings (unit roundoff 2^-8)
        self.assertTrue(bool(((x6b - x6 - delta).abs() <= bound).all()))
        self.assertLessEqual((x6b - x6 - delta).norm().item(), 0.05 * (x6b - x6).norm().item())  # delta explains it


def dc_direct(y, q, k, v, doc, w1, w2, scale, window, magnitude=None):
    """DC's forward from its definition, in float64 with per-query loops (no masks): the keys s of t's document with
    0 <= t - s < window, softmax per head over them, A = sum_h w1 P_h, out = y + w2 sum_s A v. magnitude (a tensor
    like y): filled with sum_s |w2 A v|, the scale of the correction's rounding errors."""
    T, H, D = q.shape
    out = y.clone()
    for t in range(T):
        keys = [s for s in range(max(0, t - window + 1), t + 1) if doc[s] == doc[t]]
        a = torch.zeros(len(keys), dtype=q.dtype)
        for h in range(H):
            sc = torch.stack([scale * (q[t, h] * k[s, h]).sum() for s in keys])
            a = a + w1[t, h] * torch.softmax(sc, 0)
        for h in range(H):
            out[t, h] = out[t, h] + w2[t, h] * (a[:, None] * v[keys, h]).sum(0)
            if magnitude is not None:
                magnitude[t, h] = (w2[t, h] * a[:, None] * v[keys, h]).abs().sum(0)
    return out


@needs_torch
class R86DcTest(unittest.TestCase):
    def random(self, T, H, D, seed):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)
        q, k = R.rms_norm(r(T, H, D)).bfloat16(), R.rms_norm(r(T, H, D)).bfloat16()
        return r(T, H, D).bfloat16(), q, k, r(T, H, D).bfloat16(), r(T, H).bfloat16(), (r(T, H) * 0.5).bfloat16()

    def test_forward_against_float64_direct(self):
        """T = 150 over documents [0, 5), [5, 130), [130, 150): t < 112, the window edge inside the long document,
        document starts inside the window. Tolerance: the output's bf16 rounding (unit roundoff 2^-8 of the larger of
        the two), the bf16 rounding of each w2 A weight (2^-8 of sum_s |w2 A v|), and fp32 slack (softmax, sums) of
        1e-5 of that."""
        T, H, D = 150, 6, 16
        y, q, k, v, w1, w2 = self.random(T, H, D, 180)
        doc = torch.tensor([0] * 5 + [1] * 125 + [2] * 20)
        scale = 0.12
        got = R.dc_mha(y, q, k, v, doc, w1, w2, scale).double()
        mag = torch.zeros(T, H, D, dtype=torch.float64)
        want = dc_direct(y.double(), q.double(), k.double(), v.double(), doc, w1.double(), w2.double(), scale, 112,
                         mag)
        corr = (want - y.double()).abs()
        bound = 2 ** -8 * torch.maximum(got.abs(), want.abs()) + (2 ** -8 + 1e-5) * mag + 1e-9
        self.assertTrue(bool(((got - want).abs() <= bound).all()), ((got - want).abs() / bound).max().item())
        self.assertGreater(corr.mean().item(), 0.05)  # the correction is not negligible
        # a window of 111 or 113 keys, or no document mask, is beyond the tolerance somewhere
        for wrong in (dc_direct(y.double(), q.double(), k.double(), v.double(), doc, w1.double(), w2.double(),
                                scale, 111),
                      dc_direct(y.double(), q.double(), k.double(), v.double(), torch.zeros(T, dtype=torch.long),
                                w1.double(), w2.double(), scale, 112)):
            self.assertFalse(bool(((got - wrong).abs() <= bound).all()))

    def test_window_and_documents_exactly(self):
        """q = 0: every allowed key has probability 1/n_t; with w1 = w2 = 1 (A = 6/n_t), y = 0 and v[s] = s / 64 in
        every channel, out[t] = sum of bf16(6/n_t) s/64 over the allowed keys: exact sums of small multiples."""
        T, H, D = 140, 6, 4
        doc = torch.tensor([0] * 3 + [1] * 130 + [2] * 7)
        zero = torch.zeros(T, H, D, dtype=torch.bfloat16)
        v = (torch.arange(T, dtype=torch.float32) / 64)[:, None, None].expand(T, H, D).bfloat16()
        ones = torch.ones(T, H, dtype=torch.bfloat16)
        got = R.dc_mha(zero, zero, zero, v, doc, ones, ones, 0.5).float()
        for t in (0, 2, 3, 50, 114, 115, 116, 132, 133, 139):
            keys = [s for s in range(max(0, t - 111), t + 1) if doc[s] == doc[t]]
            wt = float(torch.tensor(6.0 / len(keys)).bfloat16())
            want = float(torch.tensor(sum(wt * s / 64 for s in keys)).bfloat16())
            self.assertEqual(got[t].unique().tolist(), [want], t)

    def test_gradients_against_float64_autograd_and_finite_differences(self):
        """The float64 definition (dc_direct) checked against central differences (gradcheck), then the reference's
        autograd gradients (fp32 math from bf16 inputs, bf16 gradients) against float64 autograd at the same bf16
        inputs: within a few bf16 roundings of each gradient's norm."""
        T, H, D, W = 10, 6, 4, 4
        doc = torch.tensor([0] * 3 + [1] * 7)
        y, q, k, v, w1, w2 = self.random(T, H, D, 181)
        f64 = [t.double().requires_grad_(True) for t in (y, q, k, v, w1, w2)]
        fn = lambda y_, q_, k_, v_, a_, b_: dc_direct(y_, q_, k_, v_, doc, a_, b_, 0.7, W)
        self.assertTrue(torch.autograd.gradcheck(fn, tuple(f64), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True))
        go = torch.randn(T, H, D, generator=torch.Generator().manual_seed(182), dtype=torch.float64)
        want = torch.autograd.grad((fn(*f64) * go).sum(), f64)
        ref = [t.clone().requires_grad_(True) for t in (y, q, k, v, w1, w2)]
        out = R.dc_mha(*ref[:4], doc, ref[4], ref[5], 0.7, window=W)
        got = torch.autograd.grad((out.double() * go).sum(), ref)
        for name, gg, ww in zip(("y", "q", "k", "v", "w1", "w2"), got, want):
            self.assertEqual(gg.dtype, torch.bfloat16, name)
            self.assertLessEqual((gg.double() - ww).norm().item(), 2 ** -6 * ww.norm().item(), name)
            self.assertGreater(ww.norm().item(), 0, name)
        self.assertTrue(torch.equal(got[0], go.bfloat16()))  # dy = go, exactly (the base passes straight through)

    def test_weights_from_the_gate_columns(self):
        g = torch.Generator().manual_seed(183)
        c1 = torch.randn(7, 6, generator=g).bfloat16()
        c1[3] = 0  # all-zero: rsqrt(1e-6) * 0 = 0
        c2 = torch.randn(7, 6, generator=g).bfloat16()
        w1, w2 = R.dc_weights(c1, c2)
        x = c1.double()
        want = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        self.assertTrue(torch.equal(w1, want))
        self.assertTrue(torch.equal(w2, c2))
        self.assertEqual(w1[3].float().tolist(), [0.0] * 6)
        # columns of rms ~1e-3, where the eps (1e-6 against mean squares ~1e-6) matters
        small = (torch.randn(50, 6, generator=g) * 1e-3).bfloat16()
        x = small.double()
        want = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        self.assertTrue(torch.equal(R.dc_weights(small, small)[0], want))

    def test_model_dc_is_a_no_op_at_init_and_runs_in_validation(self):
        cfg = small_r86_config()
        p = r86_params(cfg, 26)
        off = small_r86_config()
        off.dc_mha = False
        signs = R.random_sign_table(cfg, 19)
        args = R.Trainer(cfg, p, signs).forward_args()
        b = random_batch(cfg, 32, 2, torch.Generator().manual_seed(184))
        with torch.no_grad():
            for training in (False, True):
                on_, off_ = (R.forward(c, p, b, args, training=training) for c in (cfg, off))
                self.assertTrue(torch.equal(on_, off_), training)
            q = dict(p)
            q["mudd_gate_b2"] = p["mudd_gate_b2"].clone()
            q["mudd_gate_b2"][1, 35:41] = 3.0  # w2 = 0.3
            for training in (False, True):
                on_, off_ = (R.forward(c, q, b, args, training=training) for c in (cfg, off))
                self.assertFalse(torch.equal(on_, off_), training)


@needs_torch
class R86XsaTest(unittest.TestCase):
    def test_projection_form_against_float64(self):
        g = torch.Generator().manual_seed(190)
        T, H, D = 5, 6, 16
        y = torch.randn(T, H, D, generator=g).bfloat16()
        v = torch.randn(T, H, D, generator=g).bfloat16()
        v[2, 1] = 1e-6  # |v|^2 = 1.6e-11 < 1e-8: the clamp divides by 1e-8
        a = torch.randn(T, H, generator=g).bfloat16()
        got = R.xsa_r86(y, v, a).double()
        yy, vv = y.double(), v.double()
        dot = (yy * vv).sum(-1, keepdim=True)
        den = (vv * vv).sum(-1, keepdim=True).clamp_min(1e-8)
        want = yy - torch.tanh(a.double()).unsqueeze(-1) * (dot / den) * vv
        self.assertLessEqual((got - want).abs().max().item(), 1e-5 * want.abs().max().item())
        # alpha is tanh of the bf16 column in fp32, not rounded to bf16 (record 84's cast of an fp32 strength)
        alpha_rounded = torch.tanh(a.double()).bfloat16().double().unsqueeze(-1)
        self.assertGreater((got - (yy - alpha_rounded * (dot / den) * vv)).abs().max().item(),
                           (got - want).abs().max().item())

    def test_training_step_updates_the_gate(self):
        """One Adam step of tiny-r86 (step 1; the banks' NorMuon left out for speed): every gate parameter has a
        gradient and moves, by its table row (lr_mul 0.1: the first Adam step moves each element by at most about
        lr = 0.008 * 0.1 in absolute value, weight decay aside)."""
        cfg = small_r86_config()
        p = r86_params(cfg, 27, w2_scale=0.1)
        tr = R.Trainer(cfg, p, R.random_sign_table(cfg, 20))
        gen = torch.Generator().manual_seed(185)
        batches = [random_batch(cfg, 32, 2, gen) for _ in range(2)]
        tr.accumulate_gradients(batches)
        for n in ("mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale"):
            self.assertGreater(tr.params[n].grad.double().norm().item(), 0, n)
        for n in ("qk_bank", "vo_bank", "mlp_bank"):
            tr.params[n].grad = None
        tr.optimizer_step(1)
        lr = cfg.adam_lr * tr.schedule.lr(1) * 0.1
        step = (tr.params["mudd_gate_scale"].detach() - p["mudd_gate_scale"]).abs().item()
        self.assertAlmostEqual(step, lr, delta=1e-3 * lr)  # |m / sqrt(v)| = 1 at the first step: the step is lr
        for n in ("mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale"):
            self.assertFalse(torch.equal(tr.params[n].detach(), p[n]), n)
        self.assertFalse(any(bool(torch.isnan(t).any()) for t in tr.params.values()))


@needs_torch
class R89Test(unittest.TestCase):
    """Record 89 = record 86 + #87 (post-only MLP backward) + #88 (prefix-token loss) + #89 (FP8 down-projection)."""

    def pre_and_grad(self, seed, n=4096):
        g = torch.Generator().manual_seed(seed)
        pre = (torch.randn(n, generator=g) * 2.0 ** torch.randint(-6, 6, (n,), generator=g)).bfloat16()
        pre[:8] = 0.0  # relu's kink: zero gradient both ways
        return pre, torch.randn(n, generator=g).bfloat16()

    def backward(self, pre, g, post_only):
        x = pre.clone().requires_grad_(True)
        post = R.relu_square(x, post_only)
        post.backward(g)
        return post.detach(), x.grad

    def test_post_only_backward_against_relu_pre(self):
        """75d6867a linear_relu_square_kernel's backward: dpre = bf16(2 g sqrt(fp32(post))). Against float64: within
        a bf16 rounding of 2 g sqrt(post) (and the old one of 2 g relu(pre)); sqrt(post) / relu(pre) is exactly
        post's rounding, so the two agree bit for bit where post is exact (pre with <= 4 significant bits) and differ
        elsewhere."""
        for seed in (871, 872, 873):
            pre, g = self.pre_and_grad(seed)
            post, new = self.backward(pre, g, True)
            post_b, old = self.backward(pre, g, False)
            self.assertTrue(torch.equal(post, post_b))  # the forward is unchanged
            self.assertEqual(new.dtype, torch.bfloat16)
            p64, g64, r64 = post.double(), g.double(), pre.double().clamp_min(0)
            want_new, want_old = 2 * g64 * p64.sqrt(), 2 * g64 * r64
            for got, want in ((new, want_new), (old, want_old)):
                # got is the bf16 nearest to want, except where want lies within the fp32 evaluation's error
                # (sqrt and product: 2^-23 relative) of a midpoint between two bf16 values
                near = want.bfloat16().double()  # (double -> bf16 through fp32 can double-round: also a midpoint)
                off = got.double() != near
                mid = (got.double()[off] + near[off]) / 2
                self.assertTrue(bool(((want[off] - mid).abs() <= 2.0 ** -22 * want[off].abs()).all()))
                self.assertLess(int(off.sum()), 5)
            self.assertTrue(bool((new[pre <= 0] == 0).all()) and bool((old[pre <= 0] == 0).all()))
            # the two derivations differ exactly by post's rounding: sqrt(post) = relu(pre) (1 + d), |d| <= 2^-9
            # (post's bf16 rounding is at most 2^-8 relative, halved by the root)
            d = p64.sqrt() / r64 - 1
            pos = pre > 0
            self.assertLessEqual(float(d[pos].abs().max()), 2.0 ** -9 * (1 + 1e-6))
            exact = pos & (p64 == r64 * r64)
            self.assertTrue(bool(torch.equal(new[exact], old[exact])))
            self.assertGreater(int(exact.sum()), 20)
            self.assertGreater(int((new != old).sum()), 50)  # elsewhere they do differ

    def test_post_only_is_wired_into_the_training_forward(self):
        """tiny-r89's switches on a small record-86 model (no prefix loss: the small vocabulary): the loss is record
        86's + FP8-down bits with and without #87, c_fc's gradient differs (by post's rounding only, under 1%), and
        every MLP of the training forward goes through ReluSquarePostOnly."""
        cfg = small_r86_config()
        R.use_record89(cfg)
        p = r86_params(cfg, 87, w2_scale=0.1)
        g = torch.Generator().manual_seed(88)
        p["mlp_bank"][:, 1] = (torch.randn(p["mlp_bank"][:, 1].shape, generator=g) * 0.02).bfloat16()
        batches = [random_batch(cfg, 32, 2, g) for _ in range(2)]
        calls, orig = [0], R.ReluSquarePostOnly.apply

        def counting(pre):
            calls[0] += 1
            return orig(pre)
        out = {}
        for post_only in (False, True):
            c = dataclasses_replace(cfg, mlp_post_only=post_only)
            tr = R.Trainer(c, {k: v.clone() for k, v in p.items()}, R.random_sign_table(c, 20))
            R.ReluSquarePostOnly.apply = counting
            try:
                loss = tr.accumulate_gradients(batches)
            finally:
                R.ReluSquarePostOnly.apply = orig
            out[post_only] = (loss, tr.params["mlp_bank"].grad[:, 0].double())
        self.assertEqual(calls[0], 2 * R.LAYERS)
        self.assertEqual(out[False][0], out[True][0])
        a, b = out[False][1], out[True][1]
        self.assertFalse(torch.equal(a, b))
        self.assertLess(float((a - b).norm() / a.norm()), 1e-2)

    def test_r89_config_against_upstream(self):
        """r89 = r86 + the three switches, 1270 + 15 steps (75d6867a Hyperparameters L1890-1891), record 88's prefix
        weights (TRAINING_STAGES L1979-1989) per step; tiny-r89 = tiny-r86 + the switches; no earlier preset moves."""
        r, t = R.r89_config(), R.tiny_r89_config()
        self.assertEqual((r.scheduled_iterations, r.extension_iterations), (1270, 15))
        for c, base in ((r, R.r86_config()), (t, R.tiny_r86_config())):
            self.assertTrue(c.mlp_post_only and c.prefix_loss and c.mlp_fp8_down)
            d, b = c.to_json(), base.to_json()
            for k in ("name", "mlp_post_only", "mlp_fp8_down", "prefix_loss", "scheduled_iterations", "total_steps",
                      "stages"):
                d.pop(k), b.pop(k, None)
            self.assertEqual(d, b)
        for name, make in R.PRESETS.items():
            if name not in ("r89", "tiny-r89"):
                self.assertNotIn("mlp_post_only", make().to_json(), name)
        s = R.Schedule(r)  # thirds of 1270: 423.33 -> 423, 846.67 -> 847; split 847
        self.assertEqual(s.boundaries, [(0, 423), (423, 847), (847, 1270), (1270, 1285)])
        self.assertEqual(s.split_step, 847)
        # pw: 0.25 through stage 0, 0.25 -> 0 over stage 1, then 0 (each an fp32 tensor of the double formula)
        for step, want in ((0, 0.25), (422, 0.25), (423, 0.25), (635, 0.125), (846, 0.25 / 424), (847, 0.0),
                           (1270, 0.0), (1285, 0.0)):
            got = s.prefix_weight(step)
            self.assertEqual(got.dtype, torch.float32)
            self.assertEqual(float(got), float(torch.tensor(want, dtype=torch.float32)), step)
        src = upstream_source("75d6867a", "train_gpt.py")
        if src is None:
            return  # (no local mirror of upstream: the transcription above stands)
        import re
        hp = lambda text: dict(re.findall(r"^    (\w+): \w+ = ([^#\n]+)", text[text.index("class Hyperparameters"):
                                                                               text.index("class TrainingStage")], re.M))
        h89, h86 = hp(src), hp(upstream_source("003ff3e2", "train_gpt.py"))
        self.assertEqual((int(h89["num_scheduled_iterations"]), int(h89["num_extension_iterations"])), (1270, 15))
        h89.pop("num_scheduled_iterations"), h86.pop("num_scheduled_iterations")
        self.assertEqual(h89, h86)  # nothing else of the hyperparameters changed after record 86
        stages = src[src.index("TRAINING_STAGES = ["):src.index("\n]", src.index("TRAINING_STAGES = ["))]
        pws = [(float(a), float(b)) for a, b in
               re.findall(r"prefix_weight_start=([\d.]+), prefix_weight_end=([\d.]+)", stages)]
        self.assertEqual(pws, [(st.prefix_start, st.prefix_end) for st in r.stages])
        kernels = upstream_source("75d6867a", "triton_kernels.py")
        self.assertIn("c0 = 2 * c0 * tl.sqrt(c0_post.to(tl.float32))", kernels)  # ReluSquarePostOnly's formula
        self.assertIn("ctx.save_for_backward(x, W1, W2, post)", kernels)


def dataclasses_replace(cfg, **changes):
    import dataclasses
    return dataclasses.replace(cfg, **changes)


if __name__ == "__main__":
    if not HAVE_TORCH:
        print("test_torch_reference: skipped (torch is not installed)")
        sys.exit(0)
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
