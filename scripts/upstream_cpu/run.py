#!/usr/bin/env python3
"""Runs upstream's own code on the CPU at a tiny preset's sizes, from the same step-0 parameters and batches
as this project's side, and prints the training losses step by step with their relative difference:

  record 80 (modded-nanogpt 2c702746) at tiny-r80, beside tests/reference/torch_reference.py (README of
  tests/reference: "tiny-r80");
  record 84 (a333be08) at tiny-r84, beside the C++ trainer's own run (--trainer build-up/train_gpt_cpu):
  the trainer trains --preset tiny-r84 at the same schedule and seed and saves its step-0 checkpoint,
  whose parameters (and sign table, buffer.bigram_signs) upstream starts from; the trainer's log gives its
  losses (4 decimals) and step 0's gradient norms (--log-grad-norms), and its step-1 checkpoint's NorMuon
  momentum (0.15 g after step 0) step 0's whole bank gradients, compared per matrix; its --dump-batches CRC-32s check
  every training micro-batch fed to upstream. --noise adds upstream from the same parameters nudged by one
  bf16 step on 1% of each bf16 tensor's elements (the noise floor); --reference adds tests/reference's
  tiny-r84 port from the same checkpoint as another column;
  record 88 on record 84 (the PR's code: a333be08 plus the prefix-token loss, as the logs of upstream's
  records/track_1_short/2026-07-13_PrefixTokenPrediction/prefix-1375-8x print it, train_gpt.py and
  triton_kernels.py cut from one log at their "# triton_kernels.py" banner) beside the trainer's
  --preset tiny-r84-prefix, as record 84's (the prefix table: data/gpt2_prefix_table.bin, not tiktoken);
  record 89 on record 84 (the PR's code: a333be08 plus the FP8 MLP down-projection with delayed scaling, as the
  logs of records/track_1_short/2026-07-17_FP8DownProjection/this_pr print it, cut the same way) beside
  tests/reference's tiny-r84-fp8down (--reference; after each step the three scale buffers against the
  reference's MlpDownState) and the trainer's --preset tiny-r84-fp8down, or, while the trainer lacks it,
  --trainer-preset tiny-r84 (the same step-0 parameters and batches; its losses then record 84's):

  python3 scripts/upstream_cpu/run.py --upstream /tmp/up89 --trainer build/train_gpt_cpu --trainer-preset tiny-r84 \
      --reference --noise --steps 34 --scheduled-steps 30 --extension-steps 4 --val-every 8 --val-tokens 4096

  record 86 (003ff3e2, records 85-86: the MUDD gate's per-token coefficients in place of the XSA alphas, the
  output gates, the x0 and bigram lambdas and the skip gate; DC-MHA's correction on layer 10; the XSA rewrite;
  bigram rows 15/2 vocabularies at full width) at tiny-r86 (tests/reference's preset where it has it, else run.py's
  own sizes: tiny-r84 at 6 heads of 64, upstream's init_mudd_gate asserts 6 heads) beside tests/reference's tiny-r86
  (--reference) and the trainer's (--trainer); without --trainer from a seeded init (--init-from: upstream's own
  GPT init, or the reference's init_params) and the reference loader's batches:

  python3 scripts/upstream_cpu/run.py --upstream /tmp/up86 --reference --noise --steps 8 --scheduled-steps 6 \
      --extension-steps 2 --val-tokens 4096
  python3 scripts/upstream_cpu/run.py --self-check   # the DC stand-in against a float64 evaluation

  75d6867a (upstream's HEAD, records 87-89 on 003ff3e2: the post-only ReLU^2 kernel, the prefix-token loss, the FP8
  down-projection with delayed scaling; --record 87-89) at tiny-r89 beside the trainer's (--trainer) and the
  reference's (--reference) tiny-r89, upstream's prefix table built by its own build_prefix_table (over a tiktoken
  stand-in reading $SHARED_DATA/gpt2/encoder.json, default ../shared/data) and checked equal to
  data/gpt2_prefix_table.bin:

  python3 scripts/upstream_cpu/run.py --upstream /tmp/up89h --trainer build/train_gpt_cpu --reference --noise \
      --steps 8 --scheduled-steps 6 --extension-steps 2 --val-tokens 4096 --val-every 4
  python3 scripts/upstream_cpu/run.py --self-check --upstream-git UPSTREAM_CLONE   # also the detection, every patch

Which record is told by the files (a333be08's train_gpt.py has quantize_mlp_fp8 and init_mudd; record 88's
also build_prefix_table; record 89's quantize_mlp_fp8 takes bootstrap_down; 003ff3e2's has init_mudd_gate, the
dc_triton_kernels import and DC on layer 10; 75d6867a's has the MUDD gate with records 87-89's lines (R8789_MARKERS)
and all three files exactly 75d6867a's git blobs; the MUDD gate with only part of it, e.g. 57a65f15, or any edit of
75d6867a's files, is refused); --record checks it. Upstream's files are never committed here: take them from a clone of upstream's repository,

  mkdir -p /tmp/up80 /tmp/up84
  for f in train_gpt.py triton_kernels.py; do git -C UPSTREAM_CLONE show 2c702746:$f > /tmp/up80/$f
                                              git -C UPSTREAM_CLONE show a333be08:$f > /tmp/up84/$f; done
  python3 scripts/upstream_cpu/run.py --upstream /tmp/up80 [--steps N] [--init FILE] [--noise]
  python3 scripts/upstream_cpu/run.py --upstream /tmp/up84 --trainer build-up/train_gpt_cpu --steps 8 \
      --scheduled-steps 6 --extension-steps 2 --val-tokens 4096 --noise

(from the repository root, with torch installed; the CPU wheel is enough). It copies both files into a
temporary folder and patches the copies. Each patch finds its anchor (one exact whole line, or a block of
consecutive whole lines) exactly once (the VE add of a333be08: exactly twice, its unpaired and paired
branches), else stops and names it: upstream's code is not the commit's as the patch knows it.
Both records:
  - CUDA, NCCL and the kernels package out: the CPU device, a one-process gloo group, standins.py for
    FlashAttention-3 (a333be08: kernels-community/flash-attn3 v1), the Triton kernels (a333be08: with the
    FP8 e4m3 up-projection), the NVRTC CE kernel and torch._scaled_mm; torch.compile is the identity
    (standins.install); the CE kernel's backward returns the eighth (None) gradient eager autograd wants;
    the attention stand-in keeps P in fp32 unless --fa3-bf16-p (P and dS rounded to bf16 for FA3's GEMMs,
    as FA3 and the C++ trainer do: the trainer's step-0 training loss, 18.5971, is upstream's with it);
  - Polar Express's split a X + X B (matrices of more than 1024 rows) as CUDA computes C.add_(X, alpha=a): alpha in
    fp32, where CPU PyTorch's add_ rounds it to bf16 (8.156554 -> 8.1875), one bf16 rounding;
  - the compiled graph's rounding where eager PyTorch would round more often (inductor fuses each chain of
    pointwise operations and keeps its intermediates in fp32): the norm and Polar Express's
    normalization in fp32, q and k fp32 through the norm and rotary until FA3's bf16 input, the key
    offset's overlapping copy reads a clone (the compiled graph is functional), the output gate, the
    smear gate and smear, the skip gate, the evaluation softcap, the CE's FP8 operands divided in fp32;
  - the sizes of the tiny preset (model width, heads, bigram rows, batch sizes, cut lengths, block size,
    steps; a333be08 also bigram_dim and bigram_sign_table_rows, from the trainer's checkpoint), the rest
    of the schedule (windows, lr_mul, MTP weights, cooldown, floor) as upstream's code has it: run.py
    checks it against tests/reference's schedule at every step;
  - the file is cut before its main program; run.py builds upstream's GPT and TrainingManager and drives
    them like upstream's training loop (advance_schedule, grad_accum forward/backward of loss.sum() *
    grad_scale, step_optimizers; a333be08: model.quantize_mlp_fp8() after construction and after each
    optimizer step, its global `model` pointed at the model being quantized).
2c702746 only: the unpaired and paired VE gates and adds, the pre-layer-0 bigram, the injections, the skip
add, the attention and MLP residuals, the backout, each rounded once.
a333be08 only (each a chain rounded once, where the compiled graph materializes it):
  - the VE gate (sigmoid in fp32) and the gated VE (aux_v) stay fp32 into v + aux_v, one rounding (both
    branches); MUDD's v terms and its gated VE likewise;
  - MUDD's coefficients: bf16((bf16(u W2^T) + b2) * 0.1), rounded once (the trainer's choice too), the GELU
    and both GEMMs as written; the stream recombination (1 + c5) h9 + c3 h0 + c4 h7 stays fp32 into layer
    10's attention update c8 r + c9 attn + c10 h0 (+ c11 bigram on the first bigram_dim channels), rounded
    once (the trainer rounds r and aux_v separately: a rounding-level difference); MUDD's MLP update and
    exit, each rounded once;
  - the pre-layer-0 bigram, still in place (x0 is the same tensor: upstream's aliasing kept), rounded
    once; the x0 and bigram injections fp32 into the attention update, which rounds once after the bigram
    part; the skip add and the MLP update, each rounded once;
  - XSA in fp32 (F.normalize of v, the projection, y - alpha p v^) into the output gate's one rounding;
    alpha = tanh(a).type_as(y) keeps its bf16 rounding as written (the trainer's choice too);
  - the FP8 input cast e4m3(fp32(x) * (448 / fp32(amax))), one rounding; quantize_mlp_fp8 and the dequant
    buffer run as written (eager, not compiled upstream either);
  - the sign table: upstream draws it unseeded at construction; run.py copies the trainer's into it.
003ff3e2 only (record 84's patches whose lines it keeps, and):
  - dc_triton_kernels.py copied unpatched and imported (its kernels stay plain functions), its launcher
    dc_attention_postonly_nodd_correction_add_base_triton replaced by standins.py's (the Triton kernels' rounding
    points, forward and backward; it takes the twin's head_dim 64 where upstream's asserts 128);
  - the MUDD gate's coefficients bf16((bf16(u W2^T) + b2) * bf16(scale)) (the scale's cast is explicit), rounded
    once, as MUDD's; every reader of the (1, T, 41) gate tensor reads its bf16 (it has many readers: materialized);
  - XSA (dot, denominator, tanh of the bf16 gate column, whose type_as(y) is now a no-op, y - alpha (dot / denom) v)
    and the output gate in fp32 into one rounding of the head
    outputs before O; the attention update rho x + pi y + g_x0 x0 (+ g_b xb, layers 1..) and the pre-layer-0
    bigram on x0's clone, each rounded once; the skip gate sigmoid(lambda) * gate fp32 into the skip add.
Record 89's PR only: the activations' partial-amax scratch (layers, SM count) gets one slot per layer, where the
EMIT_FP8 stand-in writes the exact max of the layer's post (at tiny sizes upstream's few tiles would leave stale
slots); quantize_transpose_mlp_down_weights and reduce_mlp_activation_scales are
stand-ins (its (12, 576) weight scratch, sized for 3072 x 768, is not asserted); quantize_mlp_fp8 runs as written
with bootstrap_down=True after construction and step < 16 after each optimizer step, as upstream's loop; the FP8
GEMMs accumulate in fp32 (the tensor cores' FP8 accumulation is hardware behaviour) and divisions are IEEE
(Triton's are div.full.f32).
75d6867a: record 86's patches (its lines unchanged), record 89's SM count and record 88's CE patches (the same CE
lines as its PR's); record 87's post-only kernel by standins.linear_relu_square_post_only (post = bf16(relu(c)^2)
returned alone or with post_f8; backward dpre = bf16(2 bf16(g W2^T) sqrt(fp32(post))), an IEEE root where Triton's
tl.sqrt is approximate); the FP8 down-projection as record 89's PR's (Fp8DownShadow checks the state machine); the
prefix table buffer starts all -1 and is filled after construction as the main program fills it after its clock
starts (upstream's build_prefix_table, run).
Record 80: upstream at world size 1 pads its banks to a multiple of 1 and its scalars by (-25) % 1: the
reference's 8-GPU layout's padding (zero matrices, ones) is dropped when loading, after checking it is
padding. Record 84: the trainer's checkpoint (its labels; value_embed, mlp) is reshaped to upstream's
parameters, padding dropped after the same check, and every parameter upstream initializes without
randomness (equal from two seeds: lambdas, scalars, MUDD's biases and w2, zero gates, c_proj, XSA) must
equal the trainer's bit for bit.
"""
import argparse
import glob
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))

# (what, exact text of one whole line, its replacement lines); "{line}" stands for the original line
TRAIN_PATCHES = [
    ("the CUDA warm-up tensor", "    1, device=f\"cuda:{os.environ['LOCAL_RANK']}\", requires_grad=True",
     ["    1, requires_grad=True"]),
    ("the kernels package import", "from kernels import get_kernel", ["from standins import get_kernel"]),
    ("the CUDA check", "assert torch.cuda.is_available()", ["pass  # upstream_cpu: CPU"]),
    ("the device", 'device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))', ['device = torch.device("cpu")']),
    ("set_device", "torch.cuda.set_device(device)", ["pass  # upstream_cpu: CPU"]),
    ("the process group", 'dist.init_process_group(backend="cuda:nccl,cpu:gloo", device_id=device)',
     ['dist.init_process_group(backend="gloo")']),
    ("the norm", "    return F.rms_norm(x, (x.size(-1),))",
     ["    return F.rms_norm(x.float(), (x.size(-1),)).type_as(x)  # upstream_cpu: inductor's fp32 forward and "
      "backward"]),
    ("Polar Express's normalization", "    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)",
     ["    X = (X.float() / (X.float().norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)).bfloat16()"]),
    # CPU PyTorch's add_ rounds alpha to the tensor's dtype (bf16(8.1566) = 8.1875); CUDA's add kernel takes it in fp32
    # (opmath): Polar Express's split a X + X B (tall or wide, more than 1024 rows: mlp_bank) as the GPU computes it
    ("Polar Express's split add (tall and wide branches)",
     "                C.add_(X, alpha=a)      # C = C + a*X  (in-place, X only read)",
     ["                C.copy_((C.float() + a * X.float()).to(C.dtype))  # upstream_cpu: alpha in fp32, as CUDA's add_"],
     2),
    ("QK norm", "        q, k = norm(q), norm(k) # QK norm @Grad62304977",
     ["        q, k = norm(q.float()), norm(k.float())  # upstream_cpu: fp32 until FA3's bf16 input"]),
    ("the key offset", "                k[:, 1:, :, self.head_dim // 2:] = k[:, :-1, :, self.head_dim // 2:]",
     ["                k[:, 1:, :, self.head_dim // 2:] = k[:, :-1, :, self.head_dim // 2:].clone()"]),
    ("the unpaired VE gate",
     "                ve_gate_out = 2 * torch.sigmoid(F.linear(torch.cat([x[..., :6], ve[None, ..., :6]], dim=-1), "
     "ve_gate_w)).view(B, T, self.num_heads, 1)",
     ["                ve_gate_out = 2 * torch.sigmoid(F.linear(torch.cat([x[..., :6], ve[None, ..., :6]], dim=-1), "
      "ve_gate_w).float()).view(B, T, self.num_heads, 1)"]),
    ("the unpaired VE add", "                v = v + ve_gate_out * ve.view_as(v) # @ KoszarskyB & @Grad62304977",
     ["                v = (v.float() + ve_gate_out * ve.view_as(v).float()).bfloat16()"]),
    ("the paired VE gate",
     "                ve_gate_out = 2 * torch.sigmoid(F.linear(x[..., :12], ve_gate_w)).view(B, T * 2, "
     "self.num_heads // 2, 1)",
     ["                ve_gate_out = 2 * torch.sigmoid(F.linear(x[..., :12], ve_gate_w).float()).view(B, T * 2, "
      "self.num_heads // 2, 1)"]),
    ("the paired VE add", "                v = v + ve_gate_out * ve.view_as(v)",
     ["                v = (v.float() + ve_gate_out * ve.view_as(v).float()).bfloat16()"]),
    ("the output gate",
     "        y = y * torch.sigmoid(F.linear(x[..., :12], attn_gate_w)).view(B, T, self.num_heads, 1)",
     ["        y = (y.float() * torch.sigmoid(F.linear(x[..., :12], attn_gate_w).float()).view(B, T, self.num_heads, "
      "1)).bfloat16()"]),
    ("the smear gate",
     "        smear_gate_out = smear_lambda * torch.sigmoid(self.smear_gate(x[1:, :self.smear_gate.weight.size(-1)]))",
     ["        smear_gate_out = smear_lambda * torch.sigmoid(self.smear_gate(x[1:, :self.smear_gate.weight.size(-1)])"
      ".float())"]),
    ("the smear", "        x = torch.cat([x[:1], x[1:] + smear_gate_out * x[:-1]])",
     ["        x = torch.cat([x[:1], (x[1:].float() + smear_gate_out * x[:-1].float()).bfloat16()])"]),
    ("the pre-layer-0 bigram", "        x = x + x0_bigram * bigram_lambdas[0]",
     ["        x = (x.float() + x0_bigram.float() * bigram_lambdas[0].float()).bfloat16()"]),
    ("the injections",
     "        x0_inject = (x0 * x0_lambdas[0],) + tuple(x0 * x0_lambdas[i] + x0_bigram * bigram_lambdas[i] for i in "
     "range(1, self.num_layers))",
     ["        x0_inject = (x0.float() * x0_lambdas[0].float(),) + tuple(x0.float() * x0_lambdas[i].float() + "
      "x0_bigram.float() * bigram_lambdas[i].float() for i in range(1, self.num_layers))"]),
    ("the skip gate",
     "        skip_gate_out = torch.sigmoid(skip_lambda) * 2 * torch.sigmoid(self.skip_gate(x0[..., "
     ":self.skip_gate.weight.size(-1)]))",
     ["        skip_gate_out = torch.sigmoid(skip_lambda) * 2 * torch.sigmoid(self.skip_gate(x0[..., "
      ":self.skip_gate.weight.size(-1)]).float())"]),
    ("the skip add", "                x = x + skip_gate_out * skip_connection",
     ["                x = (x.float() + skip_gate_out * skip_connection.float()).bfloat16()"]),
    ("the attention residual",
     "                x = resid_lambdas_attn[i] * x + post_lambdas_attn[i] * attn_out + x0_inject[i]",
     ["                x = (resid_lambdas_attn[i].float() * x.float() + post_lambdas_attn[i].float() * attn_out.float()"
      " + x0_inject[i]).bfloat16()"]),
    ("the MLP residual",
     "            x = resid_lambdas_mlp[i] * x + post_lambdas_mlp[i] * ReLUSqrdMLP(norm(x), c_fc, c_proj)",
     ["            x = (resid_lambdas_mlp[i].float() * x.float() + post_lambdas_mlp[i].float() * ReLUSqrdMLP(norm(x), "
      "c_fc, c_proj).float()).bfloat16()"]),
    ("the backout", "        x -= backout_lambda * x_backout",
     ["        x = (x.float() - backout_lambda * x_backout.float()).bfloat16()"]),
    ("the evaluation softcap", "            logits = 23 * torch.sigmoid((logits + 5) / 7.5)",
     ["            logits = 23 * torch.sigmoid((logits.float() + 5) / 7.5)"]),
    ("the hyperparameters", "args = Hyperparameters()",
     ["{line}", "import _upstream_cpu_hooks  # upstream_cpu: the tiny-r80 sizes",
      "_upstream_cpu_hooks.configure(args)"]),
    ("the training schedule",
     "training_schedule = TrainingSchedule(TRAINING_STAGES, args.num_scheduled_iterations, "
     "args.num_extension_iterations, cooldown_frac=0.60)",
     ["TRAINING_STAGES = _upstream_cpu_hooks.stages(TRAINING_STAGES)", "{line}"]),
    ("the block size", "        self.block_size = 128", ["        self.block_size = _upstream_cpu_hooks.BLOCK_SIZE"]),
    ("the main program", "# begin logging", ["_upstream_cpu_hooks.END = True  # upstream_cpu: cut here"]),
]
KERNEL_PATCHES = [
    ("the CE's x cast", "        x_f8 = x.div(x_s).to(torch.float8_e4m3fn)",
     ["        x_f8 = x.float().div(x_s).to(torch.float8_e4m3fn)  # upstream_cpu: inductor divides in fp32"]),
    ("the CE's w cast", "        w_f8 = lm_head_weight.div(w_s).to(torch.float8_e4m3fn)",
     ["        w_f8 = lm_head_weight.float().div(w_s).to(torch.float8_e4m3fn)"]),
    # forward takes 8 inputs (grad_scale last), backward returns 7 gradients: eager autograd refuses the
    # count, the compiled graph does not check it; the missing one is grad_scale's, None
    ("the CE backward's gradients", "        return grad_x, None, None, grad_w, None, None, None",
     ["        return grad_x, None, None, grad_w, None, None, None, None"]),
]

# record 84 (a333be08): the r80 patches whose lines are unchanged, then the new lines' patches, each
# (what, anchor, replacement[, count])
R84_KEPT = ("the CUDA warm-up tensor", "the kernels package import", "the CUDA check", "the device", "set_device",
            "the process group", "the norm", "Polar Express's normalization", "Polar Express's split add (tall and wide "
            "branches)", "QK norm", "the key offset",
            "the output gate", "the smear gate", "the smear", "the skip gate", "the evaluation softcap",
            "the hyperparameters", "the training schedule", "the block size", "the main program")
TRAIN_PATCHES_R84 = [p for p in TRAIN_PATCHES if p[0] in R84_KEPT] + [
    ("the VE add (unpaired and paired branches)", "                v = v + aux_v.view_as(v)",
     ["                v = (v.float() + aux_v.view_as(v).float()).bfloat16()  # upstream_cpu: one rounding with "
      "aux_v's terms"], 2),
    ("the VE gate",
     "                    ve_gate_out = 2 * torch.sigmoid(F.linear(gate_in, ve_gates[i])).view(B, T, self.num_heads, "
     "1)",
     ["                    ve_gate_out = 2 * torch.sigmoid(F.linear(gate_in, ve_gates[i]).float()).view(B, T, "
      "self.num_heads, 1)"]),
    ("the gated VE", "                    aux_v = (ve_gate_out * ve_view).view(B, T, -1)",
     ["                    aux_v = (ve_gate_out * ve_view.float()).view(B, T, -1)"]),
    ("MUDD's coefficients",
     "        x = (F.linear(x, self.mudd_w2[id, :num_coef]) + self.mudd_b2[id, :num_coef]) * self._mudd_scale",
     ["        x = ((F.linear(x, self.mudd_w2[id, :num_coef]).float() + self.mudd_b2[id, :num_coef].float()) * "
      "self._mudd_scale).bfloat16()  # upstream_cpu: one rounding"]),
    ("MUDD's v terms",
     "                    v_mudd = (mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * x).view(B, T, self.num_heads, "
     "self.head_dim)",
     ["                    v_mudd = (mu[0].float() * cache[0].float() + mu[1].float() * cache[7].float() + "
      "mu[2].float() * x.float()).view(B, T, self.num_heads, self.head_dim)"]),
    ("MUDD's stream recombination", "                    x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]",
     ["                    x = (1 + mu[5].float()) * x.float() + mu[3].float() * cache[0].float() + mu[4].float() * "
      "cache[7].float()  # upstream_cpu: fp32 into the attention update"]),
    ("MUDD's gated VE", "                    aux_v = (ve_gate * ve_view + v_mudd).view(B, T, -1)",
     ["                    aux_v = (ve_gate.float() * ve_view.float() + v_mudd).view(B, T, -1)"]),
    ("MUDD's attention update",
     ("                    x = mu[8] * x + mu[9] * attn_out + mu[10] * cache[0] ",
      "                    x[..., :args.bigram_dim] = x[..., :args.bigram_dim] + mu[11] * x0_bigram"),
     ["                    x = mu[8].float() * x + mu[9].float() * attn_out.float() + mu[10].float() * "
      "cache[0].float()",
      "                    x = torch.cat([x[..., :args.bigram_dim] + mu[11].float() * x0_bigram.float(), "
      "x[..., args.bigram_dim:]], dim=-1).bfloat16()  # upstream_cpu: one rounding"]),
    ("the attention update",
     ("                    x = resid_lambdas_attn[i] * x + post_lambdas_attn[i] * attn_out + x0_inject[i]",
      "                    if bg_inject[i] is not None:",
      "                        x[..., :args.bigram_dim] = x[..., :args.bigram_dim] + bg_inject[i]"),
     ["                    x = resid_lambdas_attn[i].float() * x.float() + post_lambdas_attn[i].float() * "
      "attn_out.float() + x0_inject[i]",
      "                    if bg_inject[i] is not None:",
      "                        x = torch.cat([x[..., :args.bigram_dim] + bg_inject[i], x[..., args.bigram_dim:]], "
      "dim=-1)",
      "                    x = x.bfloat16()  # upstream_cpu: one rounding"]),
    ("the pre-layer-0 bigram",
     "        x[..., :args.bigram_dim] = x[..., :args.bigram_dim] + x0_bigram * bigram_lambdas[0]",
     ["        x[..., :args.bigram_dim] = (x[..., :args.bigram_dim].float() + x0_bigram.float() * "
      "bigram_lambdas[0].float()).bfloat16()  # upstream_cpu: one rounding, still in place (x0 is x)"]),
    ("the x0 injections", "        x0_inject = tuple(x0 * x0_lambdas[i] for i in range(self.num_layers))",
     ["        x0_inject = tuple(x0.float() * x0_lambdas[i].float() for i in range(self.num_layers))"]),
    ("the bigram injections",
     "        bg_inject = (None,) + tuple(x0_bigram * bigram_lambdas[i] for i in range(1, self.num_layers))",
     ["        bg_inject = (None,) + tuple(x0_bigram.float() * bigram_lambdas[i].float() for i in range(1, "
      "self.num_layers))"]),
    ("the skip add", "                x = x + skip_gate_out * cache[3]",
     ["                x = (x.float() + skip_gate_out * cache[3].float()).bfloat16()"]),
    ("MUDD's MLP update", "                x = mu[12] * x + mu[13] * ReLUSqrdMLP(normed, *mlp_args)",
     ["                x = (mu[12].float() * x.float() + mu[13].float() * ReLUSqrdMLP(normed, *mlp_args).float())"
      ".bfloat16()"]),
    ("the MLP update",
     "                x = resid_lambdas_mlp[i] * x + post_lambdas_mlp[i] * ReLUSqrdMLP(normed, *mlp_args)",
     ["                x = (resid_lambdas_mlp[i].float() * x.float() + post_lambdas_mlp[i].float() * "
      "ReLUSqrdMLP(normed, *mlp_args).float()).bfloat16()"]),
    ("MUDD's exit",
     "        x = x + mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * cache[9] + mu[3] * ve_bank0 + mu[4] * cache[3]",
     ["        x = (x.float() + mu[0].float() * cache[0].float() + mu[1].float() * cache[7].float() + mu[2].float() * "
      "cache[9].float() + mu[3].float() * ve_bank0.float() + mu[4].float() * cache[3].float()).bfloat16()"]),
    ("the FP8 input cast", "                x_f8 = (normed.detach() * (448.0 / amax)).to(torch.float8_e4m3fn)",
     ["                x_f8 = (normed.detach().float() * (448.0 / amax.float())).to(torch.float8_e4m3fn)  "
      "# upstream_cpu: fp32, one rounding"]),
    ("XSA's v^", "            vn = F.normalize(v, dim=-1, eps=1e-4)",
     ["            vn = F.normalize(v.float(), dim=-1, eps=1e-4)  # upstream_cpu: fp32 until the gated output"]),
    ("XSA's projection", "            proj = (y * vn).sum(-1, keepdim=True)",
     ["            proj = (y.float() * vn).sum(-1, keepdim=True)"]),
    ("XSA's update", "            y = y - alpha * proj * vn",
     ["            y = y.float() - alpha.float() * proj * vn"]),
]


# record 88 on record 84 (its PR's code: a333be08 plus the prefix-token loss, as the logs of upstream's
# records/track_1_short/2026-07-13_PrefixTokenPrediction/prefix-1375-8x print it): record 84's patches (the PR
# strips a trailing space from MUDD's attention update), and
TRAIN_PATCHES_R88 = [(p[0], tuple(line.rstrip() for line in p[1]), *p[2:]) if p[0] == "MUDD's attention update" else p
                     for p in TRAIN_PATCHES_R84] + [
    ("the tiktoken import", "import tiktoken", ["pass  # upstream_cpu: the prefix table is data/gpt2_prefix_table.bin"]),
    ("the prefix table",
     '        self.register_buffer("prefix_table", build_prefix_table(self.vocab_size), persistent=False)',
     ['        self.register_buffer("prefix_table", _upstream_cpu_hooks.prefix_table(self.vocab_size), '
      'persistent=False)']),
]
KERNEL_PATCHES_R88 = KERNEL_PATCHES[:2] + [
    ("the CE backward's gradients", "        return grad_x, None, None, None, None, grad_w, None, None, None",
     ["        return grad_x, None, None, None, None, grad_w, None, None, None, None"]),
]


# record 89 on record 84 (its PR's code: a333be08 plus the FP8 MLP down-projection with delayed scaling, as the logs
# of upstream's records/track_1_short/2026-07-17_FP8DownProjection/this_pr print it): record 84's patches, and the
# activations' partial-amax scratch given one slot per layer (upstream sizes it by the GPU's SM count; the stand-in
# writes the exact max of the whole post into slot 0). Its Triton launchers are standins.py's; triton_kernels.py
# takes record 84's patches.
TRAIN_PATCHES_R89 = TRAIN_PATCHES_R84 + [
    ("the SM count",
     "        num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count",
     ["        num_sms = 1  # upstream_cpu: one partial-amax slot per layer (the stand-in writes the layer's max)"]),
]


# record 86 (003ff3e2, records 85-86: the MUDD gate, DC-MHA on layer 10, the XSA rewrite): record 84's patches whose
# lines are unchanged, then the new lines'. The MUDD gate's (1, T, n) coefficient tensor is read by many consumers, so
# the compiled graph materializes it (bf16); each consumer's chain stays fp32 into its one rounding, as record 84's.
R86_GONE = ("the pre-layer-0 bigram", "the attention update", "the x0 injections", "the bigram injections",
            "XSA's v^", "XSA's projection", "XSA's update", "the output gate", "the skip gate")
TRAIN_PATCHES_R86 = [p for p in TRAIN_PATCHES_R84 if p[0] not in R86_GONE] + [
    ("the MUDD gate's coefficients",
     "        return (F.linear(x, self.mudd_gate_w2[id, :num_coef]) + self.mudd_gate_b2[id, :num_coef]) * "
     "self._mudd_gate_scale.type_as(x)",
     ["        return ((F.linear(x, self.mudd_gate_w2[id, :num_coef]).float() + self.mudd_gate_b2[id, :num_coef].float()"
      ") * self._mudd_gate_scale.type_as(x).float()).bfloat16()  # upstream_cpu: one rounding (the scale's bf16 cast "
      "explicit)"]),
    ("the pre-layer-0 bigram",
     "        x[..., :args.bigram_dim] = x[..., :args.bigram_dim] + x0_bigram * bigram_gates[0]",
     ["        x[..., :args.bigram_dim] = (x[..., :args.bigram_dim].float() + x0_bigram.float() * "
      "bigram_gates[0].float()).bfloat16()  # upstream_cpu: one rounding (x is x0's clone)"]),
    ("the skip gate", "                skip_gate_out = torch.sigmoid(skip_lambda) * post_skip_gate",
     ["                skip_gate_out = torch.sigmoid(skip_lambda) * post_skip_gate.float()  # upstream_cpu: fp32 into "
      "the skip add"]),
    ("the attention update",
     ("                    x = resid_lambdas_attn[i] * x + post_lambdas_attn[i] * attn_out + x0 * x0_gates[i]",
      "                    if i != 0:",
      "                        x[..., :args.bigram_dim] = x[..., :args.bigram_dim] + x0_bigram * bigram_gates[i]"),
     ["                    x = resid_lambdas_attn[i].float() * x.float() + post_lambdas_attn[i].float() * "
      "attn_out.float() + x0.float() * x0_gates[i].float()",
      "                    if i != 0:",
      "                        x = torch.cat([x[..., :args.bigram_dim] + x0_bigram.float() * bigram_gates[i].float(), "
      "x[..., args.bigram_dim:]], dim=-1)",
      "                    x = x.bfloat16()  # upstream_cpu: one rounding"]),
    ("XSA's dot", "            dot = (y * v).sum(-1, keepdim=True)",
     ["            dot = (y.float() * v.float()).sum(-1, keepdim=True)  # upstream_cpu: fp32 until the head outputs' "
      "one rounding"]),
    ("XSA's denominator", "            denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)",
     ["            denom = v.float().square().sum(-1, keepdim=True).clamp_min(1e-8)"]),
    ("XSA's alpha",  # the gate column is bf16 like y: type_as is a no-op, tanh's output fused into XSA (not rounded)
     "            alpha = torch.tanh(attn_args.xsa_alpha).type_as(y).view(B, T, self.num_heads, 1)",
     ["            alpha = torch.tanh(attn_args.xsa_alpha.float()).view(B, T, self.num_heads, 1)  # upstream_cpu: fp32"]),
    ("XSA's update", "            y = y - alpha * (dot / denom) * v",
     ["            y = y.float() - alpha.float() * (dot / denom) * v.float()"]),
    ("the output gate", "            y = y * attn_gate_w.type_as(y).view(B, T, self.num_heads, 1)",
     ["            y = y.float() * attn_gate_w.type_as(y).float().view(B, T, self.num_heads, 1)"]),
    ("the head outputs",
     "        y = y.contiguous().view(B, T, self.num_heads * self.head_dim) # re-assemble all head outputs side by side",
     ["        y = y.bfloat16().contiguous().view(B, T, self.num_heads * self.head_dim)  # upstream_cpu: XSA and the "
      "gate rounded once, before O"]),
]


# 75d6867a (upstream's HEAD: records 87-89 on 003ff3e2): record 86's patches, whose lines it keeps, and record 89's
# SM count (one partial-amax slot per layer). Record 88's prefix table is upstream's own: the buffer is built all -1
# and run.py fills it as the main program does (model.prefix_table.copy_(build_prefix_table(...))), build_prefix_table
# reading a CPU tiktoken stand-in (GPT-2's encoder.json); triton_kernels.py takes record 88's PR's patches (the same CE
# lines) and record 87's post-only linear_relu_square stand-in.
R8789 = "87-89"  # the record id of 75d6867a (records 87, 88 and 89 merged on 003ff3e2)
TRAIN_PATCHES_R8789 = TRAIN_PATCHES_R86 + [p for p in TRAIN_PATCHES_R89 if p[0] == "the SM count"]
# git blob ids of 75d6867a's files: run.py's patches and stand-ins are written for exactly these
R8789_BLOBS = {"train_gpt.py": "228e05807d3abf32033e790c0b89cf69b3e0153e",
               "triton_kernels.py": "ae32d8258a0a4d8869efac0bcba2937ea83c1c1c",
               "dc_triton_kernels.py": "e9bbd9f907f4f5a88d9b5bb7ae99308b30bbbed1"}
# what tells 75d6867a's code, each (file, exact text): its absence is named when a file with the MUDD gate is refused
R8789_MARKERS = (
    ("train_gpt.py", "def build_prefix_table(vocab_size: int) -> Tensor:"),
    ("train_gpt.py", '        self.register_buffer("prefix_table", torch.full((self.vocab_size,), -1, dtype=torch.int64), '
                     'persistent=False)'),
    ("train_gpt.py", "    def quantize_mlp_fp8(self, bootstrap_down=False):"),
    ("train_gpt.py", "    model.quantize_mlp_fp8(bootstrap_down=(step < 16))"),
    ("train_gpt.py", "model.prefix_table.copy_(build_prefix_table(model.vocab_size))"),
    ("triton_kernels.py", "            c0 = 2 * c0 * tl.sqrt(c0_post.to(tl.float32))"),
    ("triton_kernels.py", "        return c, post_fp8"),
    ("triton_kernels.py", "  if (threadIdx.x <= n_predict) {"),
)


def git_blob_id(data):
    """git's object id of a file's bytes (sha1 of 'blob <size>\\0' + bytes)."""
    import hashlib
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class PatchError(Exception):
    pass


def apply_patches(text, patches, name, commit="2c702746"):
    """Each patch (what, anchor, replacement[, count]): the anchor, one exact whole line or a tuple of
    consecutive whole lines, must occur exactly `count` times (default once), else PatchError names it;
    every occurrence is replaced by the replacement lines ("{line}": the anchor's first line)."""
    lines = text.split("\n")
    for patch in patches:
        what, anchor, replacement = patch[:3]
        count = patch[3] if len(patch) > 3 else 1
        block = [anchor] if isinstance(anchor, str) else list(anchor)
        n = len(block)
        hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block]
        if len(hits) != count:
            raise PatchError(f"{name}: {what} ({block[0].strip()[:70]!r}{' + %d lines' % (n - 1) if n > 1 else ''}) "
                             f"found {len(hits)} times, want {count}: this is not upstream's {commit} code as the "
                             "patch knows it")
        for i in reversed(hits):
            lines[i:i + n] = [r.replace("{line}", lines[i]) for r in replacement]
    if name == "train_gpt.py":  # everything after the main program's first line is left out
        cut = lines.index("_upstream_cpu_hooks.END = True  # upstream_cpu: cut here")
        lines = lines[:cut]
    return "\n".join(lines)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upstream_record(src):
    """84 for a333be08's train_gpt.py (it has quantize_mlp_fp8 and init_mudd), 88 for record 88's PR on it (also
    build_prefix_table), 89 for record 89's PR on it (quantize_mlp_fp8 takes bootstrap_down), 86 for 003ff3e2 (the
    MUDD gate, init_mudd_gate, and the dc_triton_kernels import), R8789 ("87-89") for 75d6867a (the MUDD gate with
    records 87-89: every R8789_MARKERS line, and the three files exactly 75d6867a's git blobs), else 80 (2c702746).
    The MUDD gate with only part of records 87-89 (e.g. 57a65f15, the FP8 PR's merge before 75d6867a fixed its
    kernel and imports), any other edit of 75d6867a's files, and both PRs' changes on a333be08 together are refused."""
    path = os.path.join(src, "train_gpt.py")
    if not os.path.exists(path):
        raise PatchError(f"{path} is missing (git show COMMIT:train_gpt.py > {path})")
    text = open(path).read()
    if "def init_mudd_gate(" in text:
        if "from dc_triton_kernels import (" not in text or "self.dc_layers = [10]" not in text:
            raise PatchError(f"{path} has the MUDD gate but no dc_triton_kernels import / DC on layer 10: neither "
                             "003ff3e2's nor 75d6867a's code as run.py knows it: not supported")
        later = [m for m in ("def build_prefix_table(", "bootstrap_down") if m in text]
        if not later:
            return 86
        texts = {}
        for name in R8789_BLOBS:
            f = os.path.join(src, name)
            if not os.path.exists(f):
                raise PatchError(f"{f} is missing (git show 75d6867a:{name} > {f})")
            texts[name] = open(f, "rb").read()
        missing = [f"{name}: {line.strip()!r}" for name, line in R8789_MARKERS
                   if line not in texts[name].decode("utf-8", "replace").split("\n")]
        if missing:
            raise PatchError(f"{src} has the MUDD gate with part of records 87-89 ({', '.join(later)}) but is not "
                             f"75d6867a's code: it lacks {'; '.join(missing)}: not supported")
        for name, want in R8789_BLOBS.items():
            got = git_blob_id(texts[name])
            if got != want:
                raise PatchError(f"{src}/{name} has 75d6867a's records 87-89 but is not its file (git blob {got}, "
                                 f"75d6867a's is {want}): run.py's patches and stand-ins know that commit's files "
                                 "only: not supported")
        return R8789
    if "def quantize_mlp_fp8(self):" in text and "def init_mudd(" in text:
        return 88 if "def build_prefix_table(" in text else 84
    if "def quantize_mlp_fp8(self, bootstrap_down=False):" in text and "def init_mudd(" in text:
        if "def build_prefix_table(" in text:
            raise PatchError(f"{path} has both record 88's prefix loss and record 89's FP8 down-projection: not "
                             "supported here")
        return 89
    return 80


def load_upstream(src, tmp, cfg, record=80, extra=None):
    """Upstream's train_gpt.py (up to its main program) and triton_kernels.py, patched, imported."""
    commit = {80: "2c702746", 84: "a333be08", 88: "record 88's PR (a333be08 + the prefix loss)",
              89: "record 89's PR (a333be08 + the FP8 down-projection)", 86: "003ff3e2", R8789: "75d6867a"}[record]
    dc = record in (86, R8789)
    files = ("train_gpt.py", "triton_kernels.py") + (("dc_triton_kernels.py",) if dc else ())
    for name in files:
        if not os.path.exists(os.path.join(src, name)):
            raise PatchError(f"{src}/{name} is missing (git show {commit}:{name} > {src}/{name})")
    import standins
    import torch
    standins.install()
    hooks = types.ModuleType("_upstream_cpu_hooks")
    hooks.BLOCK_SIZE = cfg.block_size

    def configure(args):
        args.val_batch_size, args.val_tokens = cfg.val_batch_tokens, cfg.val_tokens
        args.bigram_vocab_size = cfg.bigram_vocab
        args.num_scheduled_iterations = cfg.scheduled_iterations
        args.num_extension_iterations = cfg.extension_iterations
        for key, value in (extra or {}).items():  # record 84: bigram_dim, bigram_sign_table_rows
            if not hasattr(args, key):
                raise PatchError(f"upstream's Hyperparameters has no {key}")
            setattr(args, key, value)

    def stages(upstream_stages):
        if len(upstream_stages) != len(cfg.stages):
            raise PatchError(f"upstream has {len(upstream_stages)} training stages, the reference {len(cfg.stages)}")
        for up, ours in zip(upstream_stages, cfg.stages):
            theirs = (tuple(up.window_sizes), up.lr_mul, list(up.mtp_weights_start), list(up.mtp_weights_end),
                      getattr(up, "prefix_weight_start", 0.0), getattr(up, "prefix_weight_end", 0.0))
            mine = ((ours.ws_short, ours.ws_long), ours.lr_mul, ours.mtp_start, ours.mtp_end, ours.prefix_start,
                    ours.prefix_end)
            if theirs != mine:
                raise PatchError(f"a stage differs between upstream {theirs} and the reference {mine}")
            up.batch_size, up.train_max_seq_len = ours.batch_tokens, ours.train_max_seq_len
        return upstream_stages
    def prefix_table(vocab_size):
        import torch_reference as R
        if vocab_size != R.PREFIX_TABLE_ROWS:
            raise PatchError(f"upstream's padded vocabulary is {vocab_size}, the prefix table's {R.PREFIX_TABLE_ROWS}")
        return R.load_prefix_table()
    hooks.configure, hooks.stages, hooks.prefix_table = configure, stages, prefix_table
    sys.modules["_upstream_cpu_hooks"] = hooks
    train_patches = {80: TRAIN_PATCHES, 84: TRAIN_PATCHES_R84, 88: TRAIN_PATCHES_R88, 89: TRAIN_PATCHES_R89,
                     86: TRAIN_PATCHES_R86, R8789: TRAIN_PATCHES_R8789}[record]
    kernel_patches = KERNEL_PATCHES_R88 if record in (88, R8789) else KERNEL_PATCHES
    if record == R8789:  # upstream imports tiktoken and loads GPT-2's encoding at import (build_prefix_table's)
        sys.modules["tiktoken"] = gpt2_tiktoken()
    for name, patches in (("train_gpt.py", train_patches), ("triton_kernels.py", kernel_patches)):
        text = apply_patches(open(os.path.join(src, name)).read(), patches, name, commit)
        open(os.path.join(tmp, name), "w").write(text)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if dc:  # unpatched: imported (its @triton.jit kernels stay plain functions), its launcher replaced
        shutil.copy(os.path.join(src, "dc_triton_kernels.py"), os.path.join(tmp, "dc_triton_kernels.py"))
    sys.path.insert(0, tmp)
    import triton_kernels
    standins.patch_kernels(triton_kernels, post_only=record == R8789)
    if dc:
        import dc_triton_kernels
        standins.patch_dc_kernels(dc_triton_kernels)
    path = os.path.join(tmp, "train_gpt.py")
    ns = {"__name__": "upstream_train_gpt", "__file__": path}
    argv0, sys.argv[0] = sys.argv[0], path  # upstream reads its own source (for its log) from argv[0]
    try:
        exec(compile(open(path).read(), path, "exec"), ns)
    finally:
        sys.argv[0] = argv0
    # the compiled update kernel works on uint32 bits, which CPU PyTorch cannot shift
    ns["NorMuonAndAdam"]._cautious_wd_and_update_inplace = staticmethod(standins.cautious_wd_and_update_inplace)
    if abs(ns["training_schedule"].cooldown_frac - cfg.cooldown_frac) > 0:
        raise PatchError(f"upstream's cooldown_frac {ns['training_schedule'].cooldown_frac} != {cfg.cooldown_frac}")
    return ns, torch


def gpt2_tiktoken():
    """A CPU stand-in for the tiktoken module as 75d6867a's build_prefix_table reads it: get_encoding("gpt2") with
    _mergeable_ranks, GPT-2's {token bytes: id} for its 50256 mergeable tokens (tiktoken's gpt2 ranks are the ids of
    encoder.json), read from $SHARED_DATA/gpt2/encoder.json or ../shared/data/gpt2 by scripts/make_prefix_table.py's
    token_bytes (no network)."""
    vocab = os.path.join(os.environ.get("SHARED_DATA", os.path.join(ROOT, "..", "shared", "data")), "gpt2")
    if not os.path.exists(os.path.join(vocab, "encoder.json")):
        raise PatchError(f"75d6867a builds its prefix table from GPT-2's vocabulary: {vocab}/encoder.json is missing "
                         "(set SHARED_DATA)")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import make_prefix_table
    ranks = {b: tid for tid, b in make_prefix_table.token_bytes(vocab).items()}
    encoding = types.SimpleNamespace(_mergeable_ranks=ranks)

    def get_encoding(name):
        if name != "gpt2":
            raise PatchError(f"upstream asks tiktoken for the {name} encoding: only gpt2 is stood in")
        return encoding
    module = types.ModuleType("tiktoken")
    module.get_encoding = get_encoding
    return module


def fill_prefix_table(ns, torch, R, models):
    """75d6867a's main program after its clock starts: model.prefix_table.copy_(build_prefix_table(vocab_size)),
    upstream's own build_prefix_table (over the tiktoken stand-in), checked equal to data/gpt2_prefix_table.bin,
    which the trainer and the reference use."""
    table = ns["build_prefix_table"](models[0].vocab_size)
    mine = R.load_prefix_table()
    if not torch.equal(table, mine):
        bad = (table != mine).nonzero()[:5].flatten().tolist()
        raise PatchError(f"upstream's build_prefix_table differs from data/gpt2_prefix_table.bin (ids {bad})")
    for m in models:
        if not bool((m.prefix_table == -1).all()):
            raise PatchError("75d6867a's prefix_table buffer should start all -1 (filled after the clock starts)")
        m.prefix_table.copy_(table)
    print(f"prefix table: upstream's build_prefix_table = data/gpt2_prefix_table.bin ({int((table >= 0).sum())} "
          f"valid of {table.numel()}), copied into the buffer as its main program does", flush=True)


# upstream converts these to bf16 after GPT(...) (in its main program, which is cut): the rest stay fp32
BF16_LABELS = {"embed", "bigram_embed", "smear_gate", "skip_gate", "lm_head", "value_embeds", "attn_gate_bank",
               "ve_gate_bank", "qk_bank", "vo_bank", "mlp_bank", "mudd_w1", "mudd_w2", "mudd_b2", "mudd_gate_w1",
               "mudd_gate_w2", "mudd_gate_b2"}


def build_model(ns, torch, params):
    """Upstream's GPT at the tiny-r80 sizes with the reference's step-0 parameters; the 8-GPU padding of
    the reference's layout (zero bank matrices, scalars' trailing ones) is dropped."""
    args = ns["args"]
    model = ns["GPT"](vocab_size=50257, num_layers=11, num_heads=params["cfg"].num_heads,
                      head_dim=params["cfg"].head_dim, model_dim=params["cfg"].model_dim,
                      max_seq_len=args.val_batch_size // (ns["grad_accum_steps"] * ns["world_size"]))
    seen = set()
    for name, p in model.named_parameters():
        label = name.replace(".weight", "")
        src = params["tensors"][label]
        want = torch.bfloat16 if label in BF16_LABELS else torch.float32
        if src.dtype != want:
            raise PatchError(f"{label}: the reference's dtype {src.dtype}, upstream's {want}")
        if src.shape != p.shape:
            n = p.shape[0]
            if src.shape[1:] != p.shape[1:] or src.shape[0] < n:
                raise PatchError(f"{label}: reference shape {tuple(src.shape)}, upstream's {tuple(p.shape)}")
            pad = src[n:]
            fill = 1.0 if label == "scalars" else 0.0
            if not bool((pad == fill).all()):
                raise PatchError(f"{label}: the entries past upstream's {n} are not padding")
            src = src[:n]
        p.data = src.clone()
        seen.add(label)
    missing = set(params["tensors"]) - seen
    if missing:
        raise PatchError(f"upstream's model has no {sorted(missing)}")
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--upstream", help="folder with upstream's train_gpt.py and triton_kernels.py at 2c702746 (record "
                                      "80) or a333be08 (record 84), and dc_triton_kernels.py at 003ff3e2 (record 86)")
    p.add_argument("--self-check", action="store_true",
                   help="only check standins' DC-MHA correction (record 86) and post-only ReLU^2 kernel (75d6867a) "
                        "against float64 evaluations on random data, forward and backward; with --upstream-git also "
                        "the record detection and every patch list on upstream's commits")
    p.add_argument("--upstream-git", default=None,
                   help="--self-check: a git directory of upstream's repository (a clone or mirror) whose commits "
                        "2c702746, a333be08, 003ff3e2, 57a65f15 and 75d6867a the detection checks read")
    p.add_argument("--init", help="step-0 parameters (safetensors, 'param.<label>'), e.g. make_golden.py "
                                  "--preset tiny-r80 --write-init FILE; default: the reference's init, --seed")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--scheduled-steps", type=int, default=6)
    p.add_argument("--extension-steps", type=int, default=2)
    p.add_argument("--val-tokens", type=int, default=None, help="validation tokens (make_golden.py's flag)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--full-size-optimizer", action="store_true",
                   help="only compare upstream's polar_express and NorMuon variance reduction with the reference's "
                        "on record-80-sized matrices (Q/K 256x768: wide, column-wise second moment; V/O 768x768; "
                        "MLP 3072x768: tall, XTX, split a X + X B), which tiny-r80 does not reach")
    p.add_argument("--noise", action="store_true",
                   help="also train a second reference from the same parameters nudged by one bf16 step on 1%% of "
                        "each bf16 tensor's elements (embed kept = lm_head^T): its distance from the first is the "
                        "bf16 noise floor the upstream-reference difference is judged against")
    p.add_argument("--noise-seed", type=int, default=12345,
                   help="--noise: the seed that picks the nudged elements and their directions (another twin, another "
                        "sample of the noise floor)")
    p.add_argument("--record", type=lambda v: int(v) if v.isdigit() else v, choices=(80, 84, 86, 88, 89, R8789),
                   default=None,
                   help="upstream's record: 80 (2c702746, against the reference), 84 (a333be08, against the C++ "
                        "trainer), 88 or 89 (their PRs' code on a333be08, against the trainer's tiny-r84-prefix or "
                        "tiny-r84-fp8down, and with --reference the reference's), 86 (003ff3e2, against the "
                        "reference's and the trainer's tiny-r86), 87-89 (75d6867a, upstream's HEAD: records 87-89 "
                        "merged, against the trainer's and the reference's tiny-r89); default: told by the files")
    p.add_argument("--trainer-preset", default=None,
                   help="records 84-89: the trainer's preset that gives the step-0 checkpoint, the batches and the "
                        "trainer column (default: the record's own, tiny-r84, tiny-r84-prefix or tiny-r84-fp8down); "
                        "e.g. record 89 with --trainer-preset tiny-r84 while the trainer lacks tiny-r84-fp8down: the "
                        "same parameters and batches, the trainer's losses then record 84's")
    p.add_argument("--init-from", choices=("upstream", "reference"), default=None,
                   help="record 86 without --trainer: the step-0 parameters and sign table from upstream's own GPT "
                        "init (torch.manual_seed(--seed) before it) or the reference's init_params and "
                        "random_sign_table (--seed); default: the reference's with --reference, else upstream's")
    p.add_argument("--trainer", help="record 84: the C++ trainer's CPU binary (e.g. build-up/train_gpt_cpu), run "
                                     "with --preset tiny-r84 at the same schedule and seed; its step-0 checkpoint "
                                     "gives both sides' parameters and the sign table")
    p.add_argument("--val-every", type=int, default=4, help="record 84: validate every N steps and at the end")
    p.add_argument("--reference", action="store_true",
                   help="record 84: also train tests/reference's tiny-r84 port from the same checkpoint (a column "
                        "beside the trainer's, judged against upstream like the nudged twin)")
    p.add_argument("--fa3-bf16-p", action="store_true",
                   help="the attention stand-in rounds P to bf16 for P V and dS to bf16 for dq, dk, as FA3's (and "
                        "the C++ trainer's) tensor-core GEMMs take them (default: exact fp32 P, as the reference)")
    args = p.parse_args(argv)
    globals()["NOISE_SEED"] = args.noise_seed
    if args.self_check:
        return self_check(upstream_git=args.upstream_git)
    if not args.upstream:
        p.error("--upstream is required (or --self-check)")
    import standins
    standins.FA3_BF16_P = args.fa3_bf16_p
    try:
        record = upstream_record(args.upstream)
        if args.record is not None and args.record != record:
            raise PatchError(f"{args.upstream}/train_gpt.py is record {record}'s code, not {args.record}'s")
        return run_r84(args, record) if record in (84, 86, 88, 89, R8789) else run(args)
    except PatchError as e:
        print(f"upstream_cpu: error: {e}", file=sys.stderr)
        return 1


def run(args):
    import torch
    import ref_loader
    import torch_reference as R
    torch.set_num_threads(args.threads)
    cfg = R.tiny_r80_config()
    cfg.scheduled_iterations, cfg.extension_iterations = args.scheduled_steps, args.extension_steps
    if args.val_tokens is not None:
        if args.val_tokens <= 0 or args.val_tokens % cfg.val_batch_tokens:
            raise PatchError(f"--val-tokens must be a positive multiple of {cfg.val_batch_tokens}")
        cfg.val_tokens = args.val_tokens
    cfg.validate()
    if not 1 <= args.steps <= cfg.total_steps:
        raise PatchError(f"--steps must be in 1..{cfg.total_steps}")
    if args.init:
        tensors, _ = R.read_safetensors(args.init, prefix="param.")
        params = R.params_from_checkpoint(cfg, tensors)
    else:
        params = R.init_params(cfg, args.seed)
    train_files = sorted(glob.glob(os.path.join(ROOT, "data/tinyshakespeare/tinyshakespeare_train_*.bin")))
    if not train_files:
        raise PatchError("the Tiny Shakespeare shards are missing from data/tinyshakespeare/")
    with tempfile.TemporaryDirectory() as tmp:
        if args.full_size_optimizer:
            ns, torch = load_upstream(os.path.abspath(args.upstream), tmp, cfg)
            return compare_optimizer(ns, torch, R)
        cwd = os.getcwd()
        os.chdir(tmp)  # upstream's module-level code may write logs/ into the working directory
        try:
            ns, torch = load_upstream(os.path.abspath(os.path.join(cwd, args.upstream)), tmp, cfg)
        finally:
            os.chdir(cwd)
        model = build_model(ns, torch, dict(cfg=cfg, tensors=params))  # r80's names are upstream's labels
        manager = ns["TrainingManager"](model)
        ref = R.Trainer(cfg, params)
        check_schedule(ns, ref.schedule, cfg)
        twin = R.Trainer(cfg, nudged(params, torch)) if args.noise else None
        grad_scale = ns["grad_scale"]
        if grad_scale != cfg.grad_scale:
            raise PatchError(f"upstream's grad_scale {grad_scale}, the reference's {cfg.grad_scale}")
        docs = lambda n: R.max_num_docs(cfg, n)
        seq = ref.schedule.train_max_seq_len(0)
        gen = ref_loader.generator(train_files, 0, 1, cfg.stages[0].batch_tokens, seq, cfg.grad_accum, True,
                                   cfg.bigram_vocab, max_num_docs=docs)
        started, batch_tokens = False, cfg.stages[0].batch_tokens
        manager.advance_schedule(0)
        ref.advance(0)
        validate(0, model, manager, ref, cfg, torch, R, ref_loader, docs)
        print(f"{'step':>4} {'upstream loss':>16} {'reference loss':>16} {'rel. diff':>10}" +
              (f" {'nudged ref.':>16} {'its diff':>10}" if twin else ""))
        t0 = time.time()
        rows = []
        for step in range(args.steps):
            manager.advance_schedule(step)
            ref.advance(step)
            send = manager.train_loader_send_args  # upstream's own (batch, seq_len, grad_accum) decision
            mine = None
            if ref.schedule.batch_tokens(step) != batch_tokens or ref.schedule.train_max_seq_len(step) != seq:
                batch_tokens, seq = ref.schedule.batch_tokens(step), ref.schedule.train_max_seq_len(step)
                mine = (batch_tokens, seq, cfg.grad_accum)
            if send != mine:
                raise PatchError(f"step {step}: upstream re-sends {send} to its loader, the reference {mine}")
            up_total = ref_total = twin_total = 0.0
            fwd = ref.forward_args()
            if twin:
                twin.advance(step)
            for micro in range(cfg.grad_accum):
                raw = gen.send(send) if started else next(gen)
                started = True
                b = R.Batch.from_lists(raw["inputs"], raw["targets"], raw["cu"], raw["bigram"])
                loss = model(b.inputs.int(), b.targets, b.cu_seqlens.int(), b.bigram.int(),
                             manager.get_forward_args()).sum()
                (loss * grad_scale).backward()
                up_total += float(loss.detach())
                rl = R.forward(cfg, ref.params, b, fwd, training=True).sum()
                (rl * cfg.grad_scale).backward()
                ref_total += float(rl.detach())
                if twin:
                    tl = R.forward(cfg, twin.params, b, twin.forward_args(), training=True).sum()
                    (tl * cfg.grad_scale).backward()
                    twin_total += float(tl.detach())
            if step == 0:
                print_grad_norms(model, ref, twin, torch)
            manager.step_optimizers(step)
            ref.optimizer_step(step)
            if twin:
                twin.optimizer_step(step)
            up, rf, tw = up_total / batch_tokens, ref_total / batch_tokens, twin_total / batch_tokens
            rows.append((step, up, rf, tw))
            extra = f" {tw:>16.9f} {abs(tw - rf) / abs(rf):>10.2e}" if twin else ""
            print(f"{step:>4} {up:>16.9f} {rf:>16.9f} {abs(up - rf) / abs(rf):>10.2e}{extra}   "
                  f"({time.time() - t0:.0f} s)", flush=True)
        # validation after the last step, as upstream's loop does at step == steps (with the final
        # longer window at the schedule's end)
        step = args.steps
        manager.advance_schedule(step)
        ref.advance(step)
        if step == cfg.total_steps:
            manager.apply_final_ws_ext()
            ref.apply_final_window_extension()
        validate(step, model, manager, ref, cfg, torch, R, ref_loader, docs)
    worst = max(abs(r[1] - r[2]) / abs(r[2]) for r in rows)
    print(f"upstream vs reference: step 0 {abs(rows[0][1] - rows[0][2]) / abs(rows[0][2]):.2e}, largest over "
          f"{len(rows)} steps {worst:.2e}")
    if twin:
        floor = max(abs(r[3] - r[2]) / abs(r[2]) for r in rows[1:]) if len(rows) > 1 else 0.0
        print(f"nudged reference vs reference (the noise floor): largest over steps 1.. {floor:.2e}")
    return 0


def check_schedule(ns, ours, cfg):
    """Upstream's schedule objects at the tiny-r80 step counts against the reference's, every step: stage
    boundaries, split step, learning-rate multiplier (cooldown and floor), Muon momentum, MTP weights."""
    theirs = ns["training_schedule"]
    if [tuple(b) for b in theirs.boundaries] != [tuple(b) for b in ours.boundaries] or \
            theirs.split_step != ours.split_step:
        raise PatchError(f"stage boundaries/split: upstream {theirs.boundaries} {theirs.split_step}, reference "
                         f"{ours.boundaries} {ours.split_step}")
    prefix = hasattr(theirs, "prefix_weights")  # record 88
    for step in range(cfg.total_steps + 1):
        up = (theirs.get_lr(step), ns["get_muon_momentum"](step), theirs.mtp_weights[step].tolist(),
              theirs.prefix_weights[step].tolist() if prefix else None)
        mine = (ours.lr(step), ours.muon_momentum(step), ours.mtp_weights(step).tolist(),
                [ours.prefix_weight(step).item()] if prefix else None)
        if up != mine:
            raise PatchError(f"step {step}: upstream (lr, momentum, MTP weights, prefix weight) {up}, reference {mine}")
    print(f"schedule: upstream's and the reference's agree exactly at steps 0..{cfg.total_steps} (boundaries "
          f"{ours.boundaries}, split {ours.split_step}, lr {ours.lr(0)} .. {ours.lr(cfg.total_steps)})")


def compare_optimizer(ns, torch, R):
    """Upstream's fused Nesterov + Polar Express and its variance reduction (red_dim by its own rule)
    against the reference's on random record-80-sized gradients, two NorMuon steps (the second with a
    nonzero momentum buffer and second moment): the fraction of bf16 outputs that agree exactly and the
    largest difference in units of the output's largest magnitude; beside them the same for the reference
    fed the gradient nudged by one bf16 step on 1% of its elements (5 bf16 iterations amplify any
    rounding-level difference: that is the noise floor)."""
    g = torch.Generator().manual_seed(80)
    worst = 0.0
    for name, (count, rows, cols) in (("qk_bank", (4, 256, 768)), ("vo_bank", (2, 768, 768)),
                                      ("mlp_bank", (2, 3072, 768))):
        red_dim = -1 if rows >= cols else -2
        sm_shape = (count, rows, 1) if red_dim == -1 else (count, 1, cols)
        buf_up, buf_ref, buf_n = (torch.zeros(count, rows, cols) for _ in range(3))
        sm_up, sm_ref, sm_n = (torch.zeros(sm_shape) for _ in range(3))
        for step, momentum in enumerate((0.85, 0.8503333333333333)):
            grad = (torch.randn(count, rows, cols, generator=g) * 1e-3).bfloat16().float()
            x_up = ns["polar_express"](grad.clone(), buf_up, torch.tensor(momentum), split_baddbmm=rows > 1024)
            v_up = ns["NorMuonAndAdam"]._apply_normuon_variance_reduction(x_up, sm_up, 0.9, red_dim)
            x_ref = R.polar_express_r80(grad.clone(), buf_ref, momentum)
            v_ref = R.normuon_variance_reduction(x_ref, sm_ref, 0.9, scale_bf16=True)
            bits = grad.bfloat16().view(torch.int16).to(torch.int32)
            pick = torch.rand(grad.shape, generator=g) < 0.01
            nudged_grad = torch.where(pick, bits + 1, bits).to(torch.int16).view(torch.bfloat16).float()
            v_n = R.normuon_variance_reduction(R.polar_express_r80(nudged_grad, buf_n, momentum), sm_n, 0.9,
                                               scale_bf16=True)
            peak = v_ref.float().abs().max()
            diff = float((v_up.float() - v_ref.float()).abs().max() / peak)
            floor = float((v_n.float() - v_ref.float()).abs().max() / peak)
            worst = max(worst, diff / floor)
            exact_up, exact_n = float((v_up == v_ref).float().mean()), float((v_n == v_ref).float().mean())
            print(f"{name} {count}x{rows}x{cols} step {step}: upstream exact {exact_up:.3f}"
                  f" largest {diff:.2e} | nudged reference exact {exact_n:.3f} largest "
                  f"{floor:.2e} | momentum buffers equal: {torch.equal(buf_up, buf_ref)}, second moments max rel. "
                  f"diff {float(((sm_up - sm_ref).abs() / sm_ref.abs().clamp_min(1e-30)).max()):.2e}")
    print(f"largest upstream difference / noise floor: {worst:.2f}")
    return 0


def validate(step, model, manager, ref, cfg, torch, R, ref_loader, docs):
    """Both models' validation loss (the mean over micro-batches of each one's mean loss) on the first
    val_tokens of the validation shard, printed with their relative difference."""
    val_files = sorted(glob.glob(os.path.join(ROOT, "data/tinyshakespeare/tinyshakespeare_val_*.bin")))
    gen = ref_loader.generator(val_files, 0, 1, cfg.val_batch_tokens, -1, cfg.grad_accum, False, cfg.bigram_vocab,
                               max_num_docs=docs)
    batches = []
    for _ in range(cfg.grad_accum * cfg.val_tokens // cfg.val_batch_tokens):
        r = next(gen)
        batches.append(R.Batch.from_lists(r["inputs"], r["targets"], r["cu"], r["bigram"]))
    model.eval()
    with torch.no_grad():
        up = sum(float(model(b.inputs.int(), b.targets, b.cu_seqlens.int(), b.bigram.int(),
                             manager.get_forward_args()).mean()) for b in batches) / len(batches)
    model.train()
    rf = ref.evaluate(batches)
    print(f"validation at step {step} ({cfg.val_tokens} tokens): upstream {up:.9f} reference {rf:.9f} "
          f"relative difference {abs(up - rf) / abs(rf):.2e}", flush=True)


NOISE_SEED = 12345  # --noise-seed: which 1% of elements the nudged twin moves, and which way


def nudged(params, torch):
    """The parameters with one bf16 step (up or down) on a fixed 1% of each bf16 tensor's elements;
    embed stays lm_head^T, exact zeros stay zero (padding and zero-initialized tensors keep their role)."""
    g = torch.Generator().manual_seed(NOISE_SEED)
    out = {}
    for name, t in params.items():
        if t.dtype != torch.bfloat16 or name == "embed":
            out[name] = t.clone()
            continue
        bits = t.view(torch.int16).to(torch.int32)
        pick = (torch.rand(t.shape, generator=g) < 0.01) & (t != 0)
        step = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1, 1)
        out[name] = torch.where(pick, bits + step, bits).to(torch.int16).view(torch.bfloat16)
    out["embed"] = out["lm_head"].t().contiguous()
    return out


def print_grad_norms(model, ref, twin, torch):
    """Step 0's accumulated gradients (before the optimizer), upstream vs the reference, per parameter
    (upstream's unpadded part; embed's gradient is separate from lm_head's while tied, in both): the norms
    and the norm of the difference relative to the reference's; with --noise also the nudged reference's."""
    print("step 0 gradient norms: upstream, reference, |upstream - reference| / |reference|" +
          (", |nudged - reference| / |reference|" if twin else ""))

    def grad(trainer, label, shape):
        g = trainer.params[label].grad
        return g.double()[:shape[0]] if g is not None else torch.zeros(shape, dtype=torch.float64)
    for name, p in model.named_parameters():
        label = name.replace(".weight", "")
        g_up = p.grad.double() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64)
        g_ref = grad(ref, label, p.shape)
        base = g_ref.norm().item()
        rel = lambda d: d / base if base else d
        line = f"  {label:>16} {g_up.norm().item():14.7e} {base:14.7e} {rel((g_up - g_ref).norm().item()):10.2e}"
        if twin:
            line += f" {rel((grad(twin, label, p.shape) - g_ref).norm().item()):10.2e}"
        print(line)
        if p.numel() <= 32 and os.environ.get("UPSTREAM_CPU_SHOW"):
            print("     upstream  " + " ".join(f"{v:.3e}" for v in g_up.flatten().tolist()))
            print("     reference " + " ".join(f"{v:.3e}" for v in g_ref.flatten().tolist()))


# =====================================================================================================
# Record 84 (a333be08): upstream against the C++ trainer's own run (--trainer), upstream from the
# trainer's step-0 parameters nudged as the noise floor.
# =====================================================================================================
# the trainer's checkpoint labels where they are not upstream's parameter names
TRAINER_LABELS = {"value_embeds": "value_embed", "mlp_bank": "mlp", "_mudd_gate_scale": "mudd_gate_scale"}


def make_gpt(ns, torch, cfg, seed=None):
    """Upstream's GPT at the tiny sizes, its bf16 parameters cast as its main program does."""
    if seed is not None:
        torch.manual_seed(seed)
    args = ns["args"]
    model = ns["GPT"](vocab_size=50257, num_layers=11, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                      model_dim=cfg.model_dim, max_seq_len=args.val_batch_size // (ns["grad_accum_steps"] *
                                                                                      ns["world_size"]))
    for name, p in model.named_parameters():
        if name.replace(".weight", "") in BF16_LABELS:
            p.data = p.data.bfloat16()
    return model


def trainer_params_r84(ns, torch, tensors, cfg):
    """The trainer's checkpoint tensors ('param.<label>') in upstream's shapes (a dict by upstream label),
    the 8-GPU layout's padding dropped after checking it is padding; the parameters upstream initializes
    without randomness (equal from two seeds: lambdas, scalars, MUDD's biases, zero gates, c_proj, ...)
    checked equal to the trainer's bit for bit."""
    ref = make_gpt(ns, torch, cfg, seed=1)
    other = dict(make_gpt(ns, torch, cfg, seed=2).named_parameters())
    out = {}
    for name, p in ref.named_parameters():
        label = name.replace(".weight", "")
        key = "param." + TRAINER_LABELS.get(label, label)
        if key not in tensors and "param." + label in tensors:
            key = "param." + label
        if key not in tensors:
            raise PatchError(f"the trainer's checkpoint has no {key} for upstream's {label}")
        src = tensors[key]
        if src.dtype != p.dtype:
            raise PatchError(f"{label}: the trainer's dtype {src.dtype}, upstream's {p.dtype}")
        if p.dim() == 0:  # 003ff3e2's _mudd_gate_scale: the trainer's (1,)
            if src.numel() != 1:
                raise PatchError(f"{label}: the trainer's {tuple(src.shape)} for upstream's scalar")
            src = src.reshape(())
            if torch.equal(p.data, other[name].data) and not torch.equal(src, p.data):
                raise PatchError(f"{label}: upstream initializes it to {p.item()}, the trainer's is {src.item()}")
            out[label] = src.clone()
            continue
        inner = math.prod(p.shape[1:])
        if src.numel() % inner or src.numel() < p.numel():
            raise PatchError(f"{label}: the trainer's {tuple(src.shape)} does not hold upstream's {tuple(p.shape)}")
        src = src.reshape(-1, *p.shape[1:])
        if src.shape[0] > p.shape[0]:
            pad = src[p.shape[0]:]
            fill = 1.0 if label == "scalars" else 0.0
            if not bool((pad == fill).all()):
                raise PatchError(f"{label}: the trainer's entries past upstream's {p.shape[0]} are not padding")
            src = src[:p.shape[0]]
        if torch.equal(p.data, other[name].data) and not torch.equal(src, p.data):
            bad = (src != p.data).nonzero()[:5].tolist()
            raise PatchError(f"{label}: upstream initializes it without randomness, the trainer's step-0 values "
                             f"differ (first indices {bad})")
        out[label] = src.clone()
    missing = {k[len("param."):] for k in tensors if k.startswith("param.")} - \
        {TRAINER_LABELS.get(k, k) for k in out} - set(out)
    if missing:
        raise PatchError(f"upstream's model has no {sorted(missing)}")
    return out


def build_model_r84(ns, torch, cfg, params, signs):
    model = make_gpt(ns, torch, cfg)
    for name, p in model.named_parameters():
        p.data = params[name.replace(".weight", "")].clone()
    table = model.bigram_sign_table
    if signs.shape != table.shape or signs.dtype != table.dtype or not bool((signs.abs() == 1).all()):
        raise PatchError(f"the trainer's sign table {tuple(signs.shape)} {signs.dtype} is not upstream's "
                         f"+-1 {tuple(table.shape)} {table.dtype}")
    table.copy_(signs)  # upstream draws it unseeded on rank 0: the trainer's instead
    return model


def quantize_fp8(ns, model, bootstrap_down=None):
    """upstream's model.quantize_mlp_fp8(), which reads the global `model`: pointed at this one first; record 89's
    takes bootstrap_down."""
    ns["model"] = model
    if bootstrap_down is None:
        model.quantize_mlp_fp8()
    else:
        model.quantize_mlp_fp8(bootstrap_down=bootstrap_down)


TRAINER_STEP = re.compile(r"^step:(\d+)/(\d+) (train_loss|val_loss):(\S+)")


def run_trainer(args, tmp, preset="tiny-r84"):
    """The C++ trainer's run at the same schedule (one emu worker), its step-0 checkpoint saved: its
    training losses by step (its step:N is after N steps: our step N - 1), validation losses by step,
    and step 0's gradient norms per group."""
    cmd = [args.trainer, "--preset", preset, "--seed", str(args.seed), "--scheduled-steps",
           str(args.scheduled_steps), "--extension-steps", str(args.extension_steps), "--max-steps", str(args.steps),
           "--val-every", str(args.val_every), "--log-train-loss", "--log-grad-norms", "--warmup", "0",
           "--save-checkpoint", os.path.join(tmp, "ckpt"), "--checkpoint-steps", "0,1",
           "--log-dir", os.path.join(tmp, "logs"), "--run-id", "upstream_cpu"]
    if args.val_tokens is not None:
        cmd += ["--val-tokens", str(args.val_tokens)]
    print("trainer: " + " ".join(cmd), flush=True)
    env = dict(os.environ, EMU_WORKERS=str(args.threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise PatchError(f"the trainer failed ({out.returncode}): {out.stderr[-2000:] or out.stdout[-2000:]}")
    train, val, norms = {}, {}, None
    for line in out.stdout.splitlines():
        m = TRAINER_STEP.match(line)
        if m:
            (train if m.group(3) == "train_loss" else val)[int(m.group(1)) - (m.group(3) == "train_loss")] = \
                float(m.group(4))
        elif line.startswith("step:1/") and " grad_norms " in line:
            norms = {k: float(v) for k, v in (kv.split(":") for kv in line.split(" grad_norms ")[1].split())}
        elif line.startswith(f"config {preset}:"):
            print("trainer: " + line.strip())
    if norms is None or len(train) != args.steps:
        raise PatchError(f"the trainer's log lacks the losses or gradient norms: {out.stdout[-2000:]}")
    # its training batches' CRC-32s (inputs, targets, bigram, cu_seqlens per micro-batch), checked below
    dump = subprocess.run(cmd[:3] + cmd[5:9] + ["--dump-batches", str(args.steps)], env=env, capture_output=True,
                          text=True)  # (--dump-batches refuses --seed)
    if dump.returncode:
        raise PatchError(f"the trainer's --dump-batches failed: {dump.stderr[-2000:]}")
    import make_golden
    try:
        sums = make_golden.parse_dump(dump.stdout, "train")
    except make_golden.GoldenError as e:
        raise PatchError(f"the trainer's --dump-batches: {e}")
    return train, val, norms, os.path.join(tmp, "ckpt", "step000000", "rank0.safetensors"), sums


BANKS = ("qk_bank", "vo_bank", "mlp_bank")


def trainer_bank_gradients(ns, torch, R, path, model):
    """Step 0's gradients of the NorMuon banks as the trainer had them: its momentum buffers after step 0
    (its step-1 checkpoint) are lerp(0, g, 1 - momentum(0)) = 0.15 g, as upstream's polar_express makes
    them; in upstream's shapes, padding dropped."""
    tensors, _ = R.read_safetensors(path, prefix="momentum.")
    scale = 1 - ns["get_muon_momentum"](0)
    out = {}
    for name, p in model.named_parameters():
        if name in BANKS:
            t = tensors["momentum." + TRAINER_LABELS.get(name, name)].double() / scale
            out[name] = t.reshape(-1, *p.shape[1:])[:p.shape[0]]
    return out


def print_bank_gradients(model, twin, trainer_grads):
    """Per matrix of each bank: |g_trainer - g_upstream| / |g_upstream| and, with --noise, the nudged
    upstream's |g_nudged - g_upstream| / |g_upstream|, and the norms' relative difference."""
    others = dict(twin.named_parameters()) if twin else {}
    print("step 0 bank gradients per matrix (the trainer's from its momentum after step 0): |trainer - upstream| / "
          "|upstream|, (|trainer| - |upstream|) / |upstream|" +
          (", |nudged - upstream| / |upstream|, (|nudged| - |upstream|) / |upstream|" if twin else ""))
    for name, p in model.named_parameters():
        if name not in BANKS:
            continue
        g, gt = p.grad.double(), trainer_grads[name]
        flat = lambda t: t.reshape(t.shape[0] * (t.shape[1] if name == "mlp_bank" else 1), -1)
        g, gt = flat(g), flat(gt)
        gn = flat(others[name].grad.double()) if twin else None
        cells = []
        for i in range(g.shape[0]):
            base = g[i].norm().item()
            if base == 0:
                cells.append(f"{i}: zero" + ("" if gt[i].norm().item() == 0 else " (trainer nonzero)"))
                continue
            cell = f"{i}: {(gt[i] - g[i]).norm().item() / base:.1e} {(gt[i].norm().item() - base) / base:+.1e}"
            if twin:
                cell += f" | {(gn[i] - g[i]).norm().item() / base:.1e} {(gn[i].norm().item() - base) / base:+.1e}"
            cells.append(cell)
        print(f"  {name}:")
        for i in range(0, len(cells), 2):
            print("    " + "   ".join(f"{c:<44}" for c in cells[i:i + 2]).rstrip())


def tiny_r86_config(R):
    """tests/reference's tiny-r86 where it has it; else run.py's own twin of its sizes: tiny-r84's schedule, windows,
    batches and vocabulary at 6 heads of 64 (model_dim 384, mlp 4 x 384: upstream's init_mudd_gate asserts 6 heads),
    4096 * 15 // 2 = 30,720 bigram rows at full width (003ff3e2: bigram_dim 768 = model_dim), 8192 sign rows."""
    if "tiny-r86" in R.PRESETS:
        return R.PRESETS["tiny-r86"]()
    c = R.tiny_r84_config()
    c.name = "tiny-r86 (run.py's sizes; tests/reference has no tiny-r86 preset yet)"
    c.model_dim, c.num_heads, c.head_dim, c.mlp_dim = 384, 6, 64, 4 * 384
    c.bigram_vocab, c.bigram_dim = 4096 * 15 // 2, 384
    return c


def seeded_init(args, ns, torch, cfg, R, preset):
    """Record 86 without --trainer: step-0 tensors named as the trainer's checkpoint names them ('param.<label>',
    'buffer.bigram_signs'), from upstream's own GPT init (torch.manual_seed(--seed), its sign table drawn there too)
    or from the reference's init_params and random_sign_table (--seed), in the reference's layout (8-GPU padding:
    trainer_params_r84 drops it after checking it)."""
    source = args.init_from or ("reference" if args.reference else "upstream")
    if source == "reference":
        if preset not in R.PRESETS:
            raise PatchError(f"--init-from reference: tests/reference/torch_reference.py has no {preset} preset")
        rcfg = R.PRESETS[preset]()
        tensors = {"param." + R.LABELS.get(n, n): t for n, t in R.init_params(rcfg, args.seed).items()}
        tensors["buffer.bigram_signs"] = R.random_sign_table(rcfg, args.seed)
    else:
        if args.reference:
            raise PatchError("--reference takes the reference's layout: --init-from reference (the default with it)")
        model = make_gpt(ns, torch, cfg, seed=args.seed)
        tensors = {"param." + TRAINER_LABELS.get(n.replace(".weight", ""), n.replace(".weight", "")): p.data.clone()
                   for n, p in model.named_parameters()}
        tensors["buffer.bigram_signs"] = model.bigram_sign_table.clone()
    print(f"step-0 parameters and sign table: the {source}'s init, seed {args.seed} (no trainer)", flush=True)
    return tensors


def self_check(seeds=(1, 2, 3, 4, 5), upstream_git=None):
    """The DC stand-in's check (dc_self_check), the post-only kernel's (post_only_self_check) and, given upstream's
    git directory, the detection's (detection_self_check)."""
    rc = dc_self_check(seeds)
    rc |= post_only_self_check(seeds)
    if upstream_git:
        rc |= detection_self_check(upstream_git)
    else:
        print("detection: not checked (--upstream-git DIR reads upstream's commits)")
    print("self-check: " + ("FAILED" if rc else "all passed"))
    return rc


def post_only_self_check(seeds):
    """standins.linear_relu_square_post_only (75d6867a's record-87 kernel) against float64 on random bf16 data (M 96,
    K 64, N 160; x scaled so pre spans the bf16 range's usual magnitudes), per seed:
      forward: returns post alone (no pre); post >= 0, zero exactly where bf16(pre64) <= 0, and elsewhere within
        |post - relu(pre64)^2| <= (2^-8 (1 + 2^-8) * 2 + 2^-8 + 1e-5) relu(pre64)^2 (pre's bf16 rounding, doubled by the
        square; post's; fp32 sums);
      EMIT_FP8 form (an FP8 up-projection with an act scale): (post, post_f8), post_f8 = e4m3(min(post / act, 448)) bit
        for bit from the post it returns;
      backward (aux = post): zero where post is zero, else |dpre - 2 g64 relu(pre64)| <= 4.5 * 2^-8 |2 g64 relu(pre64)|
        (bf16(g W2^T), sqrt(post)'s 2^-9 + pre's 2^-8, the bf16 result; fp32 sums), equal bit for bit to
        bf16(2 bf16(g W2^T) relu(pre)) wherever post = pre^2 exactly, and different from it somewhere (the root of
        post, not relu(pre): record 87's difference)."""
    import torch
    import standins
    failures, worst = [], {"forward": 0.0, "backward": 0.0}
    u = 2.0 ** -8
    differ = 0
    for seed in seeds:
        g = torch.Generator().manual_seed(8700 + seed)
        x = (torch.randn(96, 64, generator=g) * 0.5).bfloat16()
        w1 = (torch.randn(160, 64, generator=g) * 0.2).bfloat16()
        go = (torch.randn(96, 48, generator=g) * 0.1).bfloat16()
        w2 = (torch.randn(160, 48, generator=g) * 0.2).bfloat16()  # (hidden, model): the backward reads W2 as b
        post = standins.linear_relu_square_post_only(x, w1)
        if not isinstance(post, torch.Tensor) or post.shape != (96, 160) or post.dtype != torch.bfloat16:
            failures.append(f"seed {seed}: the forward returns {type(post).__name__}, want post (96, 160) bf16 alone")
            continue
        pre64 = x.double() @ w1.double().t()
        want = pre64.clamp_min(0).square()
        zero = pre64.bfloat16() <= 0
        if not bool((post[zero] == 0).all()) or not bool((post >= 0).all()):
            failures.append(f"seed {seed}: post nonzero where bf16(pre) <= 0, or negative")
        bound = (2 * u * (1 + u) + u + 1e-5) * want
        err = (post.double() - want).abs()
        ratio = float((err[~zero] / bound[~zero]).max())
        worst["forward"] = max(worst["forward"], ratio)
        if ratio > 1:
            failures.append(f"seed {seed}: post beyond its rounding bound ({ratio:.2f} of it)")
        # EMIT_FP8: the e4m3 up-projection (x and W1 as e4m3 codes, dequant 1) with act = 0.05
        x8, w8 = x.float().to(torch.float8_e4m3fn), w1.float().to(torch.float8_e4m3fn)
        act = torch.tensor([0.05], dtype=torch.float32)
        out = standins.linear_relu_square_post_only(x, w1, a_f8=x8, b_f8=w8, dequant_scale_ptr=torch.ones(1),
                                                    activation_scale=act, partial_amax=torch.zeros(4))
        if not isinstance(out, tuple) or len(out) != 2:
            failures.append(f"seed {seed}: the EMIT_FP8 forward returns {type(out).__name__}, want (post, post_f8)")
        else:
            p8, q8 = out
            q_want = torch.minimum(p8.float() * (1 / act), torch.tensor(448.0)).to(torch.float8_e4m3fn)
            if not torch.equal(q8.view(torch.uint8), q_want.view(torch.uint8)):
                failures.append(f"seed {seed}: post_f8 is not e4m3(min(post / act, 448)) of the post returned")
        # backward: aux = post
        dpre = standins.linear_relu_square_post_only(go, w2, aux=post)
        dpre64 = 2 * (go.double() @ w2.double().t()) * pre64.clamp_min(0)
        live = post != 0
        if not bool((dpre[~live] == 0).all()):
            failures.append(f"seed {seed}: dpre nonzero where post is zero")
        rel = ((dpre.double() - dpre64).abs() / dpre64.abs().clamp_min(1e-30))[live & (dpre64 != 0)]
        ratio = float(rel.max() / (4.5 * u))
        worst["backward"] = max(worst["backward"], ratio)
        if ratio > 1:
            failures.append(f"seed {seed}: dpre beyond its rounding bound ({ratio:.2f} of it)")
        c = (go.float() @ w2.float().t()).bfloat16()
        r86 = (2 * c.float() * pre64.bfloat16().float().clamp_min(0)).bfloat16()  # record 86's: relu(pre) itself
        exact = post.double() == pre64.bfloat16().double().clamp_min(0).square()
        if not torch.equal(dpre[exact], r86[exact]):
            failures.append(f"seed {seed}: dpre differs from relu(pre)'s where post = pre^2 exactly")
        differ += int((dpre != r86).sum())
    if differ == 0:
        failures.append("dpre equals relu(pre)'s derivation everywhere: not the root of the rounded post")
    print(f"post-only ReLU^2 stand-in vs float64: worst forward {worst['forward']:.3f} of its bound, backward "
          f"{worst['backward']:.3f} of its bound; {differ} dpre elements differ from relu(pre)'s derivation (the root of "
          "the rounded post)")
    for f in failures[:10]:
        print("  FAIL " + f)
    return 1 if failures else 0


def detection_self_check(git_dir):
    """upstream_record and every patch list on upstream's own files read from git_dir: 2c702746 -> 80, a333be08 -> 84,
    003ff3e2 -> 86, 75d6867a -> "87-89", each record's train_gpt.py and triton_kernels.py patches applying (each anchor
    found as often as it must be); refused: 57a65f15 (the FP8 PR's merge: no dc import, its kernel half post-only),
    75d6867a's train_gpt.py with 003ff3e2's triton_kernels.py, 75d6867a with one comment character changed in
    triton_kernels.py, and 75d6867a without dc_triton_kernels.py."""
    failures = []
    show = lambda commit, name: subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{name}"], capture_output=True,
                                               check=True).stdout
    names = ("train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py")
    patches = {80: (TRAIN_PATCHES, KERNEL_PATCHES), 84: (TRAIN_PATCHES_R84, KERNEL_PATCHES),
               86: (TRAIN_PATCHES_R86, KERNEL_PATCHES), R8789: (TRAIN_PATCHES_R8789, KERNEL_PATCHES_R88)}

    def case(what, files, want):
        with tempfile.TemporaryDirectory() as d:
            for name, data in files.items():
                open(os.path.join(d, name), "wb").write(data)
            try:
                got = upstream_record(d)
            except PatchError as e:
                got = e
            if isinstance(want, type) and isinstance(got, want):
                print(f"  {what}: refused ({str(got).replace(d, 'DIR')[:160]})")
                return
            if got != want:
                failures.append(f"{what}: upstream_record gives {got!r}, want {want!r}")
                return
            try:
                for name, plist in zip(("train_gpt.py", "triton_kernels.py"), patches[want]):
                    apply_patches(files[name].decode(), plist, name, what)
            except PatchError as e:
                failures.append(f"{what}: {e}")
                return
            print(f"  {what}: record {want}, all {len(patches[want][0])} + {len(patches[want][1])} patches apply")
    try:
        files = {c: {n: show(c, n) for n in names if c in ("003ff3e2", "57a65f15", "75d6867a") or n != names[2]}
                 for c in ("2c702746", "a333be08", "003ff3e2", "57a65f15", "75d6867a")}
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"detection: cannot read upstream's commits from {git_dir}: {e}")
        return 1
    print("detection on upstream's own files:")
    for commit, want in (("2c702746", 80), ("a333be08", 84), ("003ff3e2", 86), ("75d6867a", R8789)):
        case(commit, files[commit], want)
    head = files["75d6867a"]
    case("57a65f15", files["57a65f15"], PatchError)
    case("75d6867a + 003ff3e2's triton_kernels.py", dict(head, **{"triton_kernels.py": files["003ff3e2"]["triton_kernels.py"]}),
         PatchError)
    edited = head["triton_kernels.py"].replace(b"# Store ONLY post", b"# Store only post", 1)
    case("75d6867a, one comment edited", dict(head, **{"triton_kernels.py": edited}), PatchError)
    case("75d6867a without dc_triton_kernels.py", {n: head[n] for n in names[:2]}, PatchError)
    for f in failures:
        print("  FAIL " + f)
    return 1 if failures else 0


def dc_self_check(seeds=(1, 2, 3, 4, 5)):
    """--self-check: standins' DC-MHA correction (dc_attention_postonly_nodd_correction_add_base_triton) against a
    direct float64 evaluation (standins.dc_direct_float64, autograd for the gradients) from the same bf16 values, on
    random data: 256 tokens in documents [0, 40), [40, 200), [200, 256) (one longer than the 112-key window, one
    shorter; an empty one at the end) at D = 64 and 128, and 48 tokens in one document at D = 64; 5 seeds each.
    Forward, every element: |out - out64| <= (1 + u) e + u |out64| with e = u sum_s |w2 A v| + 1e-6 (|y| + sum_s
    |w2 A v|): u = 2^-8, bf16's unit roundoff, for w2 A rounded to bf16 before the dot and for the bf16 store; 1e-6
    for the fp32 softmax and sums. Backward: each gradient's relative Frobenius error within 2^-6 (dS and
    w2 A rounded to bf16 for their dots, the bf16 results, the bf16 atomic adds of at most 8 query blocks per key,
    the recomputed P), and dy exactly dout. Returns 0 when all hold."""
    import torch
    import standins
    torch.set_num_threads(1)
    worst, failures = {}, []
    cases = [(256, 64, [0, 40, 200, 256, 256]), (256, 128, [0, 40, 200, 256]), (48, 64, [0, 48])]
    for T, D, cu in cases:
        for seed in seeds:
            g = torch.Generator().manual_seed(seed * 1000 + T + D)
            rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).bfloat16()
            H, scaling = 6, 1 / D ** 0.5 * 1.6
            q, k, v, y = rnd(1, T, H, D), rnd(1, T, H, D), rnd(1, T, H, D), rnd(T, H, D, s=0.1)
            w1 = torch.nn.functional.rms_norm(torch.randn(1, T, H, generator=g), (H,), eps=1e-6).bfloat16()
            w2 = rnd(1, T, H, s=0.5)
            dout = rnd(T, H, D)
            cu_t = torch.tensor(cu, dtype=torch.int32)
            leaves = [t.clone().requires_grad_(True) for t in (y, q, k, v, w1, w2)]
            out = standins.dc_attention_postonly_nodd_correction_add_base_triton(
                leaves[0], leaves[1], leaves[2], leaves[3], (leaves[4], leaves[5]), None, scaling=scaling,
                window=112, seq_lens=cu_t)
            out.backward(dout)
            d = [t.detach().double().requires_grad_(True) for t in (y, q[0], k[0], v[0], w1[0], w2[0])]
            ref = standins.dc_direct_float64(*d, cu_t, scaling)
            ref.backward(dout.double())
            with torch.no_grad():
                seen = standins._dc_visible(cu_t, T, 112)
                p = torch.softmax((torch.einsum("ihd,jhd->hij", d[1], d[2]) * scaling).masked_fill(~seen, float("-inf")),
                                  dim=-1)
                a = torch.einsum("ih,hij->ij", d[4], p)
                corr_abs = torch.einsum("ij,jhd->ihd", a.abs(), d[3].abs()) * d[5].abs()[..., None]
                u = 2 ** -8
                bound = (1 + u) * (u * corr_abs + 1e-6 * (d[0].abs() + corr_abs)) + u * ref.abs()
                err = (out.double() - ref).abs()
                fwd = float((err / bound).max())
                worst["forward (error / bound)"] = max(worst.get("forward (error / bound)", 0.0), fwd)
                if fwd > 1:
                    failures.append(f"T {T} D {D} seed {seed}: forward error {float(err.max()):.3e} over its bound")
                if not torch.equal(leaves[0].grad, dout):
                    failures.append(f"T {T} D {D} seed {seed}: dy is not dout")
                for name, mine, theirs in zip(("dq", "dk", "dv", "dw1", "dw2"), leaves[1:], d[1:]):
                    got = mine.grad.double().reshape(theirs.grad.shape)
                    rel = float((got - theirs.grad).norm() / theirs.grad.norm())
                    worst[name] = max(worst.get(name, 0.0), rel)
                    if not rel <= 2 ** -6:
                        failures.append(f"T {T} D {D} seed {seed}: {name} relative error {rel:.3e} > 2^-6")
    print("DC correction stand-in vs float64: worst over cases and seeds: " +
          ", ".join(f"{k} {v:.3e}" for k, v in worst.items()))
    for f in failures[:10]:
        print("  FAIL " + f)
    return 1 if failures else 0


def run_r84(args, record=84):
    import torch
    import ref_loader
    import torch_reference as R
    torch.set_num_threads(args.threads)
    if not args.trainer and record not in (86, R8789):
        raise PatchError("record 84 is compared with the C++ trainer: --trainer build-up/train_gpt_cpu")
    if args.init or args.full_size_optimizer:
        raise PatchError("record 84: --init and --full-size-optimizer are record 80's (the trainer's own run "
                         "gives the step-0 parameters)")
    if record == 86:
        cfg = tiny_r86_config(R)
    elif record == R8789:
        cfg = R.PRESETS["tiny-r89"]()  # tiny-r86 with records 87-89's switches (the schedule's prefix weights)
    else:
        cfg = R.tiny_r80_config()  # tiny-r84 is tiny-r80's sizes and schedule with record 84's switches
    if record == 88:
        R.use_record88(cfg)
    cfg.scheduled_iterations, cfg.extension_iterations = args.scheduled_steps, args.extension_steps
    if args.val_tokens is not None:
        if args.val_tokens <= 0 or args.val_tokens % cfg.val_batch_tokens:
            raise PatchError(f"--val-tokens must be a positive multiple of {cfg.val_batch_tokens}")
        cfg.val_tokens = args.val_tokens
    if not 1 <= args.steps <= cfg.total_steps:
        raise PatchError(f"--steps must be in 1..{cfg.total_steps}")
    train_files = sorted(glob.glob(os.path.join(ROOT, "data/tinyshakespeare/tinyshakespeare_train_*.bin")))
    if not train_files:
        raise PatchError("the Tiny Shakespeare shards are missing from data/tinyshakespeare/")
    with tempfile.TemporaryDirectory() as tmp:
        return compare_r84(args, tmp, cfg, train_files, torch, ref_loader, R, record)


def compare_r84(args, tmp, cfg, train_files, torch, ref_loader, R, record=84):
    preset = {84: "tiny-r84", 88: "tiny-r84-prefix", 89: "tiny-r84-fp8down", 86: "tiny-r86", R8789: "tiny-r89"}[record]
    fp8_down = record in (89, R8789)  # record 89's FP8 down-projection (its PR's code, or 75d6867a's)
    trainer_preset = args.trainer_preset or preset
    if args.trainer:
        if trainer_preset != preset:
            print(f"trainer: --preset {trainer_preset} gives the step-0 checkpoint, the batches and the trainer column "
                  f"(its losses are {trainer_preset}'s, not {preset}'s)", flush=True)
        tr_train, tr_val, tr_norms, ckpt, tr_batches = run_trainer(args, tmp, trainer_preset)
        tensors, _ = R.read_safetensors(ckpt, prefix=("param.", "buffer."))
        shutil.rmtree(os.path.dirname(ckpt))
        ckpt1 = ckpt.replace("step000000", "step000001")
        if "buffer.bigram_signs" not in tensors:
            raise PatchError("the trainer's checkpoint has no buffer.bigram_signs (its sign table)")
        signs = tensors["buffer.bigram_signs"]
        cfg.bigram_vocab = tensors["param.bigram_embed"].shape[0]
        extra = dict(bigram_dim=signs.shape[1], bigram_sign_table_rows=signs.shape[0])
    else:  # record 86 before the trainer has tiny-r86: a seeded init, the reference's loader's batches
        tr_train, tr_val, tr_norms, tr_batches, ckpt1, tensors = {}, {}, {}, None, None, None
        extra = dict(bigram_dim=cfg.bigram_width, bigram_sign_table_rows=cfg.bigram_sign_rows)
    cfg.validate()
    cwd = os.getcwd()
    os.chdir(tmp)  # upstream's module-level code may write logs/ into the working directory
    try:
        ns, torch = load_upstream(os.path.abspath(os.path.join(cwd, args.upstream)), tmp, cfg, record, extra)
    finally:
        os.chdir(cwd)
    if tensors is None:
        tensors = seeded_init(args, ns, torch, cfg, R, preset)
        signs = tensors["buffer.bigram_signs"]
    params = trainer_params_r84(ns, torch, tensors, cfg)
    model = build_model_r84(ns, torch, cfg, params, signs)
    tr_bank_grads = None
    if ckpt1 is not None:
        tr_bank_grads = trainer_bank_gradients(ns, torch, R, ckpt1, model)
        shutil.rmtree(os.path.dirname(ckpt1))
    boot = True if fp8_down else None  # upstream: quantize_mlp_fp8(bootstrap_down=True) after the restore
    quantize_fp8(ns, model, boot)
    shadow = Fp8DownShadow(R, torch, model, sys.modules["triton_kernels"]) if fp8_down else None
    if shadow is not None:
        shadow.after_quantize(True)
    manager = ns["TrainingManager"](model)
    twin = twin_manager = None
    if args.noise:
        twin = build_model_r84(ns, torch, cfg, nudged(params, torch), signs)
        quantize_fp8(ns, twin, boot)
        twin_manager = ns["TrainingManager"](twin)
    if record == R8789:
        fill_prefix_table(ns, torch, R, [model] + ([twin] if twin is not None else []))
    check_schedule(ns, R.Schedule(cfg), cfg)
    ref = None
    if args.reference:  # tests/reference's record-84 port from the same checkpoint, as a third column
        if preset not in R.PRESETS:
            raise PatchError(f"--reference: tests/reference/torch_reference.py has no {preset} preset")
        rcfg = R.PRESETS[preset]()
        rcfg.scheduled_iterations, rcfg.extension_iterations = cfg.scheduled_iterations, cfg.extension_iterations
        rcfg.val_tokens = cfg.val_tokens
        rcfg.validate()
        ref = R.Trainer(rcfg, R.params_from_checkpoint(rcfg, tensors), R.bigram_signs_from_checkpoint(rcfg, tensors))
        check_schedule(ns, ref.schedule, rcfg)
    grad_scale = ns["grad_scale"]
    docs = lambda n: R.max_num_docs(cfg, n)
    sched = R.Schedule(cfg)
    seq, batch_tokens = sched.train_max_seq_len(0), cfg.stages[0].batch_tokens
    gen = ref_loader.generator(train_files, 0, 1, batch_tokens, seq, cfg.grad_accum, True, cfg.bigram_vocab,
                               max_num_docs=docs)
    models = [(model, manager)] + ([(twin, twin_manager)] if twin else [])
    val_up, val_ref, ref_rows, checked_batches = {}, {}, [], 0

    def validate_all(step):
        losses = [validate_upstream(m, mg, cfg, torch, R, ref_loader, docs) for m, mg in models]
        val_up[step] = losses
        if ref is not None:
            gen = ref_loader.generator(sorted(glob.glob(os.path.join(ROOT, "data/tinyshakespeare/"
                                                                     "tinyshakespeare_val_*.bin"))),
                                       0, 1, cfg.val_batch_tokens, -1, cfg.grad_accum, False, cfg.bigram_vocab,
                                       max_num_docs=docs)
            n = cfg.grad_accum * cfg.val_tokens // cfg.val_batch_tokens
            batches = [R.Batch.from_lists(r["inputs"], r["targets"], r["cu"], r["bigram"])
                       for r in (next(gen) for _ in range(n))]
            val_ref[step] = ref.evaluate(batches)
        tr = tr_val.get(step)
        line = f"validation at step {step} ({cfg.val_tokens} tokens): upstream {losses[0]:.9f} trainer " + \
            (f"{tr:.4f} relative difference {abs(losses[0] - tr) / abs(tr):.2e}" if tr is not None else "(none)")
        if twin:
            line += (f" | nudged upstream {losses[1]:.9f} its difference "
                     f"{abs(losses[1] - losses[0]) / abs(losses[0]):.2e}")
        if ref is not None:
            line += (f" | reference {val_ref[step]:.9f} its difference "
                     f"{abs(val_ref[step] - losses[0]) / abs(losses[0]):.2e}")
        print(line, flush=True)
    started, rows, t0 = False, [], time.time()
    for step in range(args.steps + 1):
        for m, mg in models:
            mg.advance_schedule(step)
        if ref is not None:
            ref.advance(step)
        if step == args.steps or (args.val_every > 0 and step % args.val_every == 0):
            if step == cfg.total_steps:
                for m, mg in models:
                    mg.apply_final_ws_ext()
                if ref is not None:
                    ref.apply_final_window_extension()
            validate_all(step)
        if step == args.steps:
            break
        if step == 0:
            print(f"{'step':>4} {'upstream loss':>16} {'trainer loss':>13} {'rel. diff':>10}" +
                  (f" {'nudged upstream':>16} {'its diff':>10}" if twin else "") +
                  (f" {'reference':>16} {'its diff':>10}" if args.reference else "") +
                  "   (the trainer logs 4 decimals: its rel. diff resolves ~5e-5 / loss)")
        send = manager.train_loader_send_args
        mine = None
        if sched.batch_tokens(step) != batch_tokens or sched.train_max_seq_len(step) != seq:
            batch_tokens, seq = sched.batch_tokens(step), sched.train_max_seq_len(step)
            mine = (batch_tokens, seq, cfg.grad_accum)
        if send != mine:
            raise PatchError(f"step {step}: upstream re-sends {send} to its loader, the reference schedule {mine}")
        totals, micro_batches = [0.0 for _ in models], []
        for micro in range(cfg.grad_accum):
            raw = gen.send(send) if started else next(gen)
            started = True
            b = R.Batch.from_lists(raw["inputs"], raw["targets"], raw["cu"], raw["bigram"])
            got = tuple(ref_loader.crc(t.tolist()) for t in (b.inputs, b.targets, b.bigram, b.cu_seqlens))
            if tr_batches is not None and tr_batches.get((step, micro)) != got:
                raise PatchError(f"step {step} micro-batch {micro}: CRC-32s {got} differ from the trainer's "
                                 f"--dump-batches {tr_batches.get((step, micro))}")
            checked_batches += 1
            micro_batches.append(b)
            for k, (m, mg) in enumerate(models):
                if shadow is not None:
                    shadow.on = k == 0
                loss = m(b.inputs.int(), b.targets, b.cu_seqlens.int(), b.bigram.int(), mg.get_forward_args()).sum()
                if shadow is not None and k == 0:
                    shadow.after_forward()
                (loss * grad_scale).backward()
                totals[k] += float(loss.detach())
        ref_loss = ref.accumulate_gradients(micro_batches) / batch_tokens if ref is not None else None
        if step == 0:
            print_grad_norms_r84(model, twin, tr_norms, torch, ref.grad_norms() if ref is not None else None)
            if tr_bank_grads is not None:
                print_bank_gradients(model, twin, tr_bank_grads)
        for k, (m, mg) in enumerate(models):
            mg.step_optimizers(step)  # upstream's loop: quantize_mlp_fp8(bootstrap_down=(step < 16)) (record 89)
            quantize_fp8(ns, m, step < R.MLP_DOWN_BOOTSTRAP_STEPS if fp8_down else None)
            if shadow is not None and k == 0:
                shadow.after_quantize(step < R.MLP_DOWN_BOOTSTRAP_STEPS)
        if ref is not None:
            ref.optimizer_step(step)
        ref_rows.append(ref_loss)
        losses = [t / batch_tokens for t in totals]
        tr = tr_train.get(step)
        rows.append((step, losses[0], tr, losses[1] if twin else None))
        extra_col = f" {losses[1]:>16.9f} {abs(losses[1] - losses[0]) / abs(losses[0]):>10.2e}" if twin else ""
        if ref is not None:
            extra_col += f" {ref_loss:>16.9f} {abs(ref_loss - losses[0]) / abs(losses[0]):>10.2e}"
        tr_col = f"{tr:>13.4f} {abs(losses[0] - tr) / abs(tr):>10.2e}" if tr is not None else f"{'(none)':>13} {'':>10}"
        print(f"{step:>4} {losses[0]:>16.9f} {tr_col}{extra_col}   ({time.time() - t0:.0f} s)", flush=True)
        if shadow is not None:
            shadow.report(step)
    if tr_batches is not None:
        print(f"training batches: all {checked_batches} micro-batches equal the trainer's (--dump-batches CRC-32s)")
        worst = max(abs(r[1] - r[2]) / abs(r[2]) for r in rows)
        print(f"upstream vs trainer: step 0 {abs(rows[0][1] - rows[0][2]) / abs(rows[0][2]):.2e}, largest over "
              f"{len(rows)} steps {worst:.2e}; validation " + ", ".join(
                  f"step {s} {abs(v[0] - tr_val[s]) / abs(tr_val[s]):.2e}" for s, v in sorted(val_up.items())
                  if s in tr_val))
    if twin:
        floor = max(abs(r[3] - r[1]) / abs(r[1]) for r in rows[1:]) if len(rows) > 1 else 0.0
        print(f"nudged upstream vs upstream (the noise floor): largest over steps 1.. {floor:.2e}; validation " +
              ", ".join(f"step {s} {abs(v[1] - v[0]) / abs(v[0]):.2e}" for s, v in sorted(val_up.items())))
    if ref is not None:
        print(f"reference vs upstream: step 0 {abs(ref_rows[0] - rows[0][1]) / abs(rows[0][1]):.2e}, largest over "
              f"{len(rows)} steps {max(abs(a - r[1]) / abs(r[1]) for a, r in zip(ref_rows, rows)):.2e}; validation " +
              ", ".join(f"step {s} {abs(val_ref[s] - v[0]) / abs(v[0]):.2e}" for s, v in sorted(val_up.items())))
    return 0


class Fp8DownShadow:
    """Record 89: the reference's MlpDownState driven by upstream's own W2 (after each of its quantize_mlp_fp8 calls,
    with the same bootstrap flag) and its own posts (the EMIT_FP8 launches of the model's training forwards), checked
    bit for bit against upstream's buffers: used, next and W2q after every quantization; at every FP8 down-projection
    the act upstream passes is the one the previous training forward left (1 at first) and the used its
    quantization left; after each forward, act = the reference's delayed scale of that forward's 11 posts. So the
    PR's wiring (which buffers, views and headroom, the bootstrap schedule, the one-step delay) is the reference's,
    whatever the two runs' parameters drift to."""

    def __init__(self, R, torch, model, kernels):
        self.R, self.torch, self.model, self.on = R, torch, model, False
        self.state = R.MlpDownState()
        self.calls, self.problems, self.checked = [], [], 0
        real = kernels.linear_relu_square

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            if self.on and kwargs.get("activation_scale") is not None:
                layer = len(self.calls)
                if float(kwargs["activation_scale"]) != float(self.state.act[layer]):
                    self.problems.append(f"layer {layer}'s forward read act {float(kwargs['activation_scale'])}, the "
                                        f"previous forward left {float(self.state.act[layer])}")
                self.state.record_amax(layer, out[-2])  # post: (pre, post, post_f8) or 75d6867a's (post, post_f8)
                self.calls.append(layer)
            return out
        kernels.linear_relu_square = spy

    def after_quantize(self, bootstrap):
        m, st = self.model, self.state
        st.quantize_weights(m.mlp_bank.detach(), bootstrap)
        for name, mine in (("_mlp_down_proj_scales", st.used), ("_mlp_down_proj_next_scales", st.next)):
            if not self.torch.equal(getattr(m, name), mine):
                self.problems.append(f"{name} {getattr(m, name).tolist()} != the reference's {mine.tolist()}")
        if not self.torch.equal(m._mlp_down_proj_f8.float(), st.w2q.float()):
            self.problems.append("W2q codes differ from the reference's quantize_weights")
        self.checked += 1

    def after_forward(self):
        if self.calls != list(range(11)):
            self.problems.append(f"the training forward ran the FP8 epilogue for layers {self.calls}")
        self.state.end_forward()
        self.calls = []
        if not self.torch.equal(self.model._mlp_down_act_scales, self.state.act):
            self.problems.append(f"act {self.model._mlp_down_act_scales.tolist()} != the reference's "
                                 f"{self.state.act.tolist()}")
        self.checked += 1

    def report(self, step):
        line = (f"       FP8 down state after step {step}: upstream's buffers = the reference's MlpDownState on "
                f"upstream's W2 and posts: {'yes' if not self.problems else 'NO'} ({self.checked} checks so far)")
        print(line + "".join("\n         " + p for p in self.problems[:5]), flush=True)
        if self.problems:
            raise PatchError(f"step {step}: upstream's FP8 down-projection state is not the reference's")


def validate_upstream(model, manager, cfg, torch, R, ref_loader, docs):
    """Upstream's validation loss (the mean over micro-batches of each one's mean loss) on the first
    val_tokens of the validation shard, as upstream's loop computes it (model.eval(): bf16 MLP)."""
    val_files = sorted(glob.glob(os.path.join(ROOT, "data/tinyshakespeare/tinyshakespeare_val_*.bin")))
    gen = ref_loader.generator(val_files, 0, 1, cfg.val_batch_tokens, -1, cfg.grad_accum, False, cfg.bigram_vocab,
                               max_num_docs=docs)
    total, n = 0.0, cfg.grad_accum * cfg.val_tokens // cfg.val_batch_tokens
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            r = next(gen)
            b = R.Batch.from_lists(r["inputs"], r["targets"], r["cu"], r["bigram"])
            total += float(model(b.inputs.int(), b.targets, b.cu_seqlens.int(), b.bigram.int(),
                                 manager.get_forward_args()).mean())
    model.train()
    return total / n


# the trainer's --log-grad-norms groups by upstream's labels
TRAINER_NORM_LABELS = {"value_embeds": "value_embed", "mlp_bank": "mlp", "_mudd_gate_scale": "mudd_gate_scale"}


def print_grad_norms_r84(model, twin, tr_norms, torch, ref_norms=None):
    """Step 0's accumulated gradients (before the optimizer) per parameter: upstream's norm, the trainer's
    logged norm (7 digits) and their relative difference; with --noise the nudged upstream's norm's
    relative difference from upstream's and the relative norm of its whole gradient's difference."""
    print("step 0 gradient norms: upstream, trainer, |upstream - trainer| / trainer" +
          (", nudged upstream: |its norm - upstream's| / upstream's, |its gradient - upstream's| / |upstream's|"
           if twin else "") + (", reference: |its norm - upstream's| / upstream's" if ref_norms else ""))
    others = dict(twin.named_parameters()) if twin else {}
    for name, p in model.named_parameters():
        label = name.replace(".weight", "")
        g = p.grad.double() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64)
        n_up = g.norm().item()
        n_tr = tr_norms.get(TRAINER_NORM_LABELS.get(label, label))
        rel = lambda d, base: d / base if base else d
        line = f"  {label:>16} {n_up:14.7e} " + (f"{n_tr:14.7e} {rel(abs(n_up - n_tr), n_tr):10.2e}"
                                                 if n_tr is not None else f"{'(none)':>14} {'':>10}")
        if twin:
            q = others[name].grad
            gt = q.double() if q is not None else torch.zeros(p.shape, dtype=torch.float64)
            line += f" {rel(abs(gt.norm().item() - n_up), n_up):10.2e} {rel((gt - g).norm().item(), n_up):10.2e}"
        if ref_norms:
            n_ref = ref_norms.get(label, ref_norms.get(TRAINER_LABELS.get(label, label)))
            line += f" {rel(abs(n_ref - n_up), n_up):10.2e}" if n_ref is not None else f" {'(none)':>10}"
        print(line)
        if p.numel() <= 32 and os.environ.get("UPSTREAM_CPU_SHOW"):
            print("     upstream  " + " ".join(f"{v:.3e}" for v in g.flatten().tolist()))


if __name__ == "__main__":
    sys.exit(main())
