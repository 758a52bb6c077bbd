"""An independent PyTorch reference of the speedrun (the modded-nanogpt record of 2026-02-06, "Sparse
bigram gradient comms"; presets record and tiny), and of upstream's record 80 (commit 2c702746; presets
r80 and tiny-r80, whose differences are Config fields the model and optimizer read: README.md here), record 84
(a333be08; r84, tiny-r84, with records 88's and 89's variants) and record 86 (003ff3e2; r86, tiny-r86).

The model, the combined NorMuon + Adam optimizer and the schedule, written plainly with autograd for
one process on the CPU (world size 1: 8 micro-batches of gradient accumulation per step; the sharded
and sparse communication replaced by what it computes: the gradient itself, dense). It exists to
produce golden values for the C++ trainer (make_golden.py); CI does not need it.

Precision follows upstream, which runs under torch.compile: parameters bf16 except `scalars` and
`x0_lambdas` (fp32); optimizer state fp32; rotary tables bf16; the lm_head in FP8 in training.
Rounding points (one rule everywhere: compute in fp32 from bf16 values, round to bf16 once where a
tensor is materialized):
  - matmul results (fp32 accumulation of the exact bf16 or fp8 operands), including the 12-wide
    gate logits of F.linear;
  - lambda-scaled weights bf16(sa_lambda * W) that feed a matmul;
  - the residual stream after every step of upstream's forward (smear, skip add, layer mix, each
    block add, backout); a norm reads the rounded stream and its bf16 output feeds the next matmul;
  - q, k (QK norm, rotary, key offset in one region), v (+ gated value embedding), the attention
    output, the gated attention output, the MLP's pre and post activations (as its Triton kernel);
  - gradients are rounded to bf16 wherever the forward tensor is bf16 (autograd casts them), and a
    parameter's .grad is its dtype, accumulated over micro-steps and over Adam's two steps in it;
  - embedding gradients: fp32 sums over repeated ids, then one rounding (embedding_dense_backward).
Attention is computed exactly in fp32 (softmax not rounded to bf16 before P@V as FlashAttention does).

Everything is deterministic on the CPU (no atomics), so the same inputs give the same bits.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# =====================================================================================================
# Configuration: train_gpt.cu's Config, r71_preset() and tiny_preset(), and the layer structure.
# =====================================================================================================


@dataclass
class Stage:
    duration: float            # fraction of the scheduled steps (the extension stage: 0)
    batch_tokens: int          # tokens per step over all ranks and micro-steps
    ws_short: int              # attention windows in blocks of block_size tokens
    ws_long: int
    lr_mul: float
    mtp_start: List[float]     # multi-token-prediction weights, interpolated over the stage
    mtp_end: List[float]
    # r80 (#72): documents are cut at this many tokens in this stage; None: Config.max_seq_len (r71)
    train_max_seq_len: Optional[int] = None
    # record 88 (upstream 75d6867a prefix_weight_start/_end): the prefix-token loss's weight, interpolated over
    # the stage like the MTP weights (used where Config.prefix_loss)
    prefix_start: float = 0.0
    prefix_end: float = 0.0


@dataclass
class Config:
    name: str = "record"
    vocab_size: int = 50257
    padded_vocab: int = 50304
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_dim: int = 3072
    bigram_vocab: int = 50304 * 5
    max_seq_len: int = 2048
    val_batch_tokens: int = 4 * 64 * 1024 * 8
    val_tokens: int = 10485760
    scheduled_iterations: int = 1515
    extension_iterations: int = 40
    cooldown_frac: float = 0.55
    block_size: int = 128
    final_ws_long: int = 20
    val_loss_every: int = 250
    stages: List[Stage] = field(default_factory=list)
    # upstream's fixed constants
    world_size: int = 1
    split_embed_stage: int = 2
    muon_warmup_steps: int = 300
    muon_cooldown_steps: int = 50
    muon_momentum_min: float = 0.85
    muon_momentum_max: float = 0.95
    adam_lr: float = 0.008
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.005
    normuon_lr: float = 0.023
    normuon_beta2: float = 0.95
    normuon_weight_decay: float = 1.2
    lm_head_x_s: float = 100 / 448
    lm_head_w_s: float = 1.6 / 448
    # ---- The model's structure and the numerics that changed after record 71, as data. The defaults
    # are record 71's; r80_config() sets upstream's values at 2c702746 (records 72-80).
    # Fields at their default are left out of to_json() so that record 71's fixtures stay byte-identical.
    grad_scale_numerator: float = 2.0              # grad_scale = numerator / grad_accum (r80: 1, #bf699d0e)
    lr_floor: float = 0.1                          # the cooldown's end value (r80: 0.15, #72)
    value_layers: Tuple[int, ...] = (0, 1, 8, 9, 10)  # layer of value table k (r80: 1, 2, 8, 9, 10, #70)
    value_embed_std: float = 0.0                   # value_embeds init N(0, std) (r80: 0.01)
    ve_gate_reads_ve: bool = False                 # unpaired layers' VE gate reads cat(x[:6], ve[:6]) (#70)
    sublayer_lambdas: bool = False                 # r80's residual stream (#73-#77): resid/post lambdas per
    #                                                sublayer, x0/bigram injected after attention, bf16 lambdas
    late_attn_source: Optional[int] = None         # attention of later layers reads this layer's output (r80: 7)
    head_pair_banks: bool = False                  # qk_bank per head pair + vo_bank instead of attn_bank (#80)
    bank_pad_multiple: int = 8                     # banks padded to a multiple of upstream's 8 GPUs
    fused_ce: bool = False                         # r80's NVRTC CE kernel numerics (#79), per-token losses
    polar_express_xtx: bool = False                # r80's Polar Express: bf16 before the norm, XTX on tall
    #                                                matrices, Nesterov in fp32 tensors (#74)
    normuon_scale_bf16: bool = False               # variance reduction's final_scale.type_as(v) rounding
    max_num_docs_table: Optional[Dict[int, int]] = None  # cu_seqlens entries per tokens per rank (#78)
    optimizer_table: Optional[Dict[str, tuple]] = None   # None: record 71's PARAM_TABLE
    # ---- Records 81-84 (upstream a333be08); the defaults are record 80's (and 71's).
    mudd: bool = False                             # record 81's MUDD at the last layer's entry and after the loop
    #                                                (replaces the backout; scalars lose its slot)
    mudd_hidden: int = 64                          # MUDD's hidden width (upstream's mudd_dim)
    xsa_layers: Tuple[int, ...] = ()               # record 82's XSA on these (unpaired, attention) layers
    bigram_dim: int = 0                            # record 84's narrow bigram: channels [0, bigram_dim) (0: all,
    #                                                record 80's form and order of the injection sums)
    bigram_sign_rows: int = 0                      # record 83's sign table rows (0: no signs)
    x0_includes_bigram: bool = False               # a333be08's x = x0 = norm(..) then the in-place bigram add
    paired_ve_gate_reads_ve: bool = False          # paired layers' VE gate reads cat(x[:6], ve[:6]) too (L1448)
    mlp_up_fp8: bool = False                       # record 84's e4m3 MLP up-projection (training forward only)
    # ---- Records 85-89 (upstream 003ff3e2 and 75d6867a)
    prefix_loss: bool = False                      # record 88's prefix-token prediction in the fused CE
    #                                                (the weights: Stage.prefix_start/_end)
    mlp_fp8_down: bool = False                     # record 89's e4m3 MLP down-projection with delayed scales
    #                                                (training forward only; MlpDownState)
    mlp_post_only: bool = False                    # record 87's ReLU^2 MLP backward from post alone: relu(pre)
    #                                                taken as sqrt(fp32(post)) (ReluSquarePostOnly)
    mudd_gate: bool = False                        # record 85's MUDD gate: per-token columns (mudd_gate_layout) in
    #                                                place of the x0/bigram lambdas, the output gates, the skip gate
    #                                                and xsa_alphas; record 86's XSA form; x0 the clean normed embedding
    dc_mha: bool = False                           # record 85's DC-MHA on layer 10 (weights from the post gate)

    @property
    def grad_accum(self) -> int:
        return 8 // self.world_size

    @property
    def grad_scale(self) -> float:
        return self.grad_scale_numerator / self.grad_accum

    @property
    def lm_head_grad_s(self) -> float:
        return self.grad_scale * 0.75 / 448

    @property
    def bigram_width(self) -> int:
        """Columns of bigram_embed and of the bigram injection (record 84: model_dim / 4)."""
        return self.bigram_dim if self.bigram_dim else self.model_dim

    @property
    def total_steps(self) -> int:
        return self.scheduled_iterations + self.extension_iterations

    @property
    def yarn_max_seq_len(self) -> int:
        # upstream: val_batch_size // (grad_accum_steps * world_size); its tables hold twice as many positions
        return self.val_batch_tokens // (self.grad_accum * self.world_size)

    def micro_tokens(self, batch_tokens: int) -> int:
        return batch_tokens // (self.grad_accum * self.world_size)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        defaults = Config()
        for f in _STRUCTURE_FIELDS:
            if getattr(self, f) == getattr(defaults, f):
                del d[f]
        for st in d["stages"]:
            if st["train_max_seq_len"] is None:
                del st["train_max_seq_len"]
            for f in ("prefix_start", "prefix_end"):
                if not self.prefix_loss:
                    del st[f]
        d.update(grad_accum=self.grad_accum, grad_scale=self.grad_scale, lm_head_grad_s=self.lm_head_grad_s,
                 total_steps=self.total_steps)
        return d

    def validate(self) -> None:
        def need(ok, what):
            if not ok:
                raise ValueError(f"config '{self.name}': {what}")
        need(self.num_heads * self.head_dim == self.model_dim, "num_heads * head_dim must equal model_dim")
        need(self.num_heads % 2 == 0, "paired-head layers need an even number of heads")
        need(self.head_dim % 4 == 0, "head_dim must be a multiple of 4 (half-truncated rotary on pairs)")
        need(self.model_dim >= GATE, f"model_dim must be at least the {GATE} gate channels")
        need(self.padded_vocab >= self.vocab_size, "padded_vocab must be >= vocab_size")
        need(self.world_size >= 1 and 8 % self.world_size == 0, "the world size must divide 8")
        need(len(self.stages) >= 2, "at least one training stage and the extension stage are needed")
        need(len(set(self.value_layers)) == len(self.value_layers) and all(
            0 <= v < LAYERS and has_attention(v) for v in self.value_layers),
            "value_layers must be distinct layers with attention")
        need(self.late_attn_source is None or 0 <= self.late_attn_source < LAYERS - 1,
             "late_attn_source must be a layer before the last")
        need(not self.prefix_loss or self.fused_ce, "the prefix-token loss (record 88) lives in the fused CE kernel")
        need(self.prefix_loss or all(st.prefix_start == st.prefix_end == 0.0 for st in self.stages),
             "prefix weights without prefix_loss")
        need(not self.prefix_loss or self.vocab_size == 50257,
             "the prefix-token table is GPT-2's: vocab_size must be 50257")
        need(not self.mlp_fp8_down or self.mlp_up_fp8,
             "record 89's e4m3 post comes from record 84's FP8 up-projection's epilogue: mlp_up_fp8 is needed")
        need(not self.mlp_post_only or self.sublayer_lambdas,
             "record 87's post-only MLP backward is modeled on record 80's stream onwards (sublayer_lambdas)")
        need(not self.fused_ce or all(len(st.mtp_start) <= 3 for st in self.stages),
             "r80's CE kernel adds term2 for at most 3 MTP weights")
        need(self.bank_pad_multiple >= 1, "bank_pad_multiple must be positive")
        need(0 <= self.bigram_dim <= self.model_dim, "bigram_dim must be in 0..model_dim")
        need(self.bigram_dim >= GATE or self.bigram_dim == 0 or not self.x0_includes_bigram,
             "the aliased x0 is read by the skip gate's 12 channels: keep bigram_dim >= 12")
        need(self.bigram_sign_rows >= 0, "bigram_sign_rows must be >= 0")
        need(self.sublayer_lambdas or not (self.bigram_dim or self.x0_includes_bigram or self.mudd),
             "the narrow bigram, the aliased x0 and MUDD need record 80's per-sublayer stream")
        need(not self.mudd or self.late_attn_source == BACKOUT_LAYER,
             "MUDD mixes h7, the late attention source: late_attn_source must be 7")
        need(not self.mudd or self.mudd_hidden >= 1, "mudd_hidden must be positive")
        need(all(0 <= l < LAYERS and has_attention(l) and l not in PAIRED_LAYERS for l in self.xsa_layers),
             "XSA layers must have attention and not be paired (upstream: v is (2T, H/2, D) there)")
        need(not self.mudd_gate or self.mudd, "the MUDD gate (record 85) builds on record 81's MUDD")
        need(not self.mudd_gate or self.num_heads == MUDD_GATE_HEADS,
             f"the MUDD gate's fixed column layout needs {MUDD_GATE_HEADS} heads (upstream asserts it)")
        need(not self.mudd_gate or tuple(self.xsa_layers) == R86_XSA_LAYERS,
             f"the MUDD gate has XSA columns for layers {R86_XSA_LAYERS} exactly")
        need(not self.mudd_gate or not (self.x0_includes_bigram or self.bigram_dim),
             "the MUDD gate's records inject the full-width bigram into a stream that starts from x0.clone()")
        need(not self.dc_mha or self.mudd_gate, "DC-MHA's weights are MUDD gate columns: mudd_gate is needed")
        for st in self.stages:
            need(len(st.mtp_start) == len(st.mtp_end) >= 1, "each stage needs matching MTP weight lists")
            need(st.train_max_seq_len is None or st.train_max_seq_len >= 1, "train_max_seq_len must be positive")
            need(st.batch_tokens % (self.grad_accum * self.world_size) == 0, "a stage's batch must split evenly")


_STRUCTURE_FIELDS = ("grad_scale_numerator", "lr_floor", "value_layers", "value_embed_std", "ve_gate_reads_ve",
                     "sublayer_lambdas", "late_attn_source", "head_pair_banks", "bank_pad_multiple", "fused_ce",
                     "polar_express_xtx", "normuon_scale_bf16", "max_num_docs_table", "optimizer_table",
                     "mudd", "mudd_hidden", "xsa_layers", "bigram_dim", "bigram_sign_rows", "x0_includes_bigram",
                     "paired_ve_gate_reads_ve", "mlp_up_fp8", "mlp_fp8_down", "mudd_gate", "dc_mha",
                     "mlp_post_only")


def record_config() -> Config:
    c = Config(name="record")
    c.stages = [
        Stage(1 / 3, 8 * 2048 * 8, 1, 3, 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
        Stage(1 / 3, 16 * 2048 * 8, 3, 7, 1.52, [1.0, 0.5], [1.0, 0.0]),
        Stage(1 / 3, 24 * 2048 * 8, 5, 11, 1.73, [1.0], [1.0]),
        Stage(0.0, 24 * 2048 * 8, 6, 13, 1.0, [1.0], [1.0]),  # extension
    ]
    return c


def tiny_config() -> Config:
    """train_gpt.cu's tiny_preset(): the record's 11 layers at width 128, windows in blocks of 8."""
    c = record_config()
    c.name = "tiny"
    c.model_dim, c.num_heads, c.head_dim, c.mlp_dim = 128, 2, 64, 512
    c.bigram_vocab = 4096 * 5
    c.max_seq_len = 256
    c.val_batch_tokens = 8 * 256
    c.val_tokens = 8 * 256
    c.scheduled_iterations, c.extension_iterations = 30, 4
    c.block_size = 8
    c.val_loss_every = 10
    c.stages[0].batch_tokens = 8 * 32
    c.stages[1].batch_tokens = 8 * 48
    c.stages[2].batch_tokens = c.stages[3].batch_tokens = 8 * 64
    return c


# Upstream's param_table at 2c702746 (label: optim, adam betas, lr_mul, wd_mul); its dict order is the
# scatter order. Defined here, before the presets that name it; record 71's is PARAM_TABLE below.
R80_PARAM_TABLE = {
    "qk_bank": ("normuon", None, 1.0, 1.0),
    "vo_bank": ("normuon", None, 1.0, 1.0),
    "mlp_bank": ("normuon", None, 1.0, 1.0),
    "scalars": ("adam", (0.9, 0.99), 5.0, 0.0),
    "smear_gate": ("adam", (0.9, 0.99), 0.01, 0.0),
    "skip_gate": ("adam", (0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "ve_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "lm_head": ("adam", (0.5, 0.95), 1.0, 150.0),
    "bigram_embed": ("adam", (0.75, 0.95), 75.0, 5.0),
    "post_lambdas": ("adam", (0.9, 0.95), 1.0, 0.0),
    "x0_lambdas": ("adam", (0.9, 0.95), 1.0, 0.0),
    "bigram_lambdas": ("adam", (0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": ("adam", (0.9, 0.95), 5.0, 0.0),
    "value_embeds": ("adam", (0.75, 0.95), 75.0, 5.0),
    "embed": ("adam", (0.5, 0.95), 1.0, 150.0),
}


def r80_config() -> Config:
    """Upstream's record 80 (commit 2c702746, records 72-80) on the full sizes."""
    c = record_config()
    c.name = "r80"
    c.scheduled_iterations, c.extension_iterations = 1440, 40
    c.cooldown_frac, c.lr_floor = 0.60, 0.15
    c.normuon_beta2 = 0.9
    c.grad_scale_numerator = 1.0
    c.value_layers = (1, 2, 8, 9, 10)
    c.value_embed_std = 0.01
    c.ve_gate_reads_ve = True
    c.sublayer_lambdas = True
    c.late_attn_source = 7
    c.head_pair_banks = True
    c.fused_ce = True
    c.polar_express_xtx = True
    c.normuon_scale_bf16 = True
    # TRAIN_MAX_NUM_DOCS: tokens per rank per micro-step -> cu_seqlens entries (other sizes: the rule
    # in max_num_docs()). The extension stage has the third stage's batch, hence its entry.
    c.max_num_docs_table = {16384: 64, 32768: 96, 49152: 128}
    c.optimizer_table = dict(R80_PARAM_TABLE)
    for st, seq in zip(c.stages, (896, 2048, 2048, 2048)):
        st.train_max_seq_len = seq
    return c


def tiny_r80_config() -> Config:
    """The CPU-sized twin of r80: record 71's tiny sizes with r80's structure (README "tiny-r80" gives
    each choice): documents cut at 7/16 of max_seq_len in the first stage (896/2048 upstream), the
    max-documents table keyed by tiny's per-stage micro-batch sizes with the record's entry counts,
    banks padded to a multiple of 8 matrices (upstream's 8 GPUs)."""
    c = r80_config()
    t = tiny_config()
    c.name = "tiny-r80"
    for f in ("model_dim", "num_heads", "head_dim", "mlp_dim", "bigram_vocab", "max_seq_len", "val_batch_tokens",
              "val_tokens", "scheduled_iterations", "extension_iterations", "block_size", "val_loss_every"):
        setattr(c, f, getattr(t, f))
    for st, ts in zip(c.stages, t.stages):
        st.batch_tokens = ts.batch_tokens
    c.stages[0].train_max_seq_len = c.max_seq_len * 896 // 2048
    for st in c.stages[1:]:
        st.train_max_seq_len = c.max_seq_len
    c.max_num_docs_table = {c.micro_tokens(st.batch_tokens): n
                            for st, n in zip(c.stages, (64, 96, 128, 128))}
    return c


# Upstream's param_table at a333be08 (L1839-1864) in its dict order (the scatter order): record 80's with
# xsa_alphas before value_embeds and the MUDD overrides appended (wd_mul defaults to 1: mudd_w1, mudd_w2).
# Its work order (L1866-1874) is another order of the same rows; at world size 1 each row's update reads only
# its own state, except embed, tied to lm_head, which NorMuonAdam.step handles after every row.
R84_PARAM_TABLE = {}
for _name, _row in R80_PARAM_TABLE.items():
    if _name == "value_embeds":
        R84_PARAM_TABLE["xsa_alphas"] = ("adam", (0.9, 0.95), 1.0, 0.0)
    R84_PARAM_TABLE[_name] = _row
R84_PARAM_TABLE.update({
    "mudd_w1": ("adam", (0.9, 0.99), 0.25, 1.0),
    "mudd_w2": ("adam", (0.9, 0.99), 0.25, 1.0),
    "mudd_b2": ("adam", (0.9, 0.99), 0.25, 0.0),
})
R84_WORK_ORDER = ["scalars", "smear_gate", "skip_gate", "attn_gate_bank", "ve_gate_bank", "mudd_b2", "xsa_alphas",
                  "post_lambdas", "x0_lambdas", "bigram_lambdas", "resid_lambdas", "mudd_w2", "value_embeds",
                  "bigram_embed", "mudd_w1", "lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank"]
R84_XSA_LAYERS = (1, 3, 4, 7, 8, 10)  # a333be08 L1377: every unpaired attention layer


def use_record84(c: Config) -> None:
    """Records 81-84's switches (upstream a333be08) on a record-80 config; the bigram rows are the caller's."""
    c.mudd = True
    c.xsa_layers = R84_XSA_LAYERS
    c.bigram_dim = c.model_dim // 4          # 192 at the record's 768
    c.bigram_sign_rows = 8192
    c.x0_includes_bigram = True
    c.paired_ve_gate_reads_ve = True
    c.mlp_up_fp8 = True
    c.optimizer_table = dict(R84_PARAM_TABLE)


def r84_config() -> Config:
    """Upstream's record 84 (commit a333be08, 79.2 s, records 81-84) on the full sizes."""
    c = r80_config()
    c.name = "r84"
    use_record84(c)
    c.bigram_vocab = c.padded_vocab * 15     # 754,560 rows of 192
    c.scheduled_iterations, c.extension_iterations = 1380, 10
    return c


def tiny_r84_config() -> Config:
    """The CPU-sized twin of r84 (train_gpt.cu's tiny_r84_preset): tiny-r80's sizes and schedule with
    record 84's switches; bigram rows three times tiny's (15 of record 71's 5 vocabularies), bigram_dim
    model_dim / 4 = 32, 8192 sign rows, MUDD hidden 64 (README "tiny-r84")."""
    c = tiny_r80_config()
    c.name = "tiny-r84"
    use_record84(c)
    c.bigram_vocab = tiny_config().bigram_vocab * 3
    return c


def use_record88(c: Config) -> None:
    """Record 88's prefix-token loss (upstream 75d6867a; its PR logged it on a333be08 as prefix-1375-8x): pw 0.25
    through the first stage, 0.25 -> 0 through the second, 0 after."""
    c.prefix_loss = True
    for st, (a, b) in zip(c.stages, ((0.25, 0.25), (0.25, 0.0), (0.0, 0.0), (0.0, 0.0))):
        st.prefix_start, st.prefix_end = a, b


def r84_prefix_config() -> Config:
    """Record 88's PR on record 84 (a333be08 + the prefix-token loss, 1365 + 10 steps: the PR's prefix-1375-8x)."""
    c = r84_config()
    c.name = "r84-prefix"
    use_record88(c)
    c.scheduled_iterations, c.extension_iterations = 1365, 10
    return c


def tiny_r84_prefix_config() -> Config:
    """tiny-r84 with record 88's prefix-token loss (the tiny schedule's lengths)."""
    c = tiny_r84_config()
    c.name = "tiny-r84-prefix"
    use_record88(c)
    return c


def use_record89(c: Config) -> None:
    """Record 89's FP8 MLP down-projection with delayed scaling (upstream 75d6867a; its PR logged it on a333be08 as
    2026-07-17_FP8DownProjection/this_pr): MlpDownState, on record 84's FP8 up-projection."""
    c.mlp_fp8_down = True


def r84_fp8down_config() -> Config:
    """Record 89's PR on record 84 (a333be08 + the FP8 down-projection, 1380 + 10 steps as the PR's this_pr logs:
    the schedule of r84 unchanged)."""
    c = r84_config()
    c.name = "r84-fp8down"
    use_record89(c)
    return c


def tiny_r84_fp8down_config() -> Config:
    """tiny-r84 with record 89's FP8 down-projection (the tiny schedule's lengths: 30 + 4 steps, so the weights'
    bootstrap ends within it, at step 16). The per-layer activation amax is the exact max over the micro-batch's
    post: upstream's (layers, num_SMs) partial-amax scratch relies on at least 132 tiles of 128 x 256 per layer, and
    tiny's few tiles would leave stale slots in it (here: the actual tiles)."""
    c = tiny_r84_config()
    c.name = "tiny-r84-fp8down"
    use_record89(c)
    return c


# Upstream's param_table at 003ff3e2 (TrainingManager L1928-1953) in its dict order (the scatter order): record 84's
# without the five labels the MUDD gate replaced, the gate's four rows appended (its scale's label is
# `_mudd_gate_scale` upstream, `mudd_gate_scale` in the trainer's checkpoints and here). Work order L1956-1966.
R86_PARAM_TABLE = {n: r for n, r in R84_PARAM_TABLE.items()
                   if n not in ("skip_gate", "attn_gate_bank", "x0_lambdas", "bigram_lambdas", "xsa_alphas")}
R86_PARAM_TABLE.update({
    "mudd_gate_w1": ("adam", (0.9, 0.99), 0.1, 1.0),
    "mudd_gate_w2": ("adam", (0.9, 0.99), 0.1, 1.0),
    "mudd_gate_b2": ("adam", (0.9, 0.99), 0.1, 0.0),
    "mudd_gate_scale": ("adam", (0.9, 0.99), 0.1, 0.0),
})
R86_WORK_ORDER = ["scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "mudd_gate_scale", "post_lambdas",
                  "resid_lambdas", "mudd_w2", "mudd_gate_w2", "value_embeds", "bigram_embed", "mudd_w1", "mudd_gate_w1",
                  "lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank"]
R86_XSA_LAYERS = (1, 3, 4, 7)  # 003ff3e2 L1202 xsa_layers


def use_record86(c: Config) -> None:
    """Records 85-86's switches (upstream 003ff3e2) on a record-84 config; the bigram rows are the caller's: the MUDD
    gate and its consumers, DC-MHA on layer 10, XSA on layers 1, 3, 4, 7 only, x0 no longer the stream start, the
    bigram at full width (record 83's sign table kept, now (8192, C))."""
    c.mudd_gate = True
    c.dc_mha = True
    c.xsa_layers = R86_XSA_LAYERS
    c.bigram_dim = 0
    c.x0_includes_bigram = False
    c.optimizer_table = dict(R86_PARAM_TABLE)


def r86_config() -> Config:
    """Upstream's record 86 (commit 003ff3e2, records 85-86) on the full sizes: 1285 + 15 steps (Hyperparameters
    L1797-1798), bigram_vocab 50304 * 15 // 2 = 377,280 rows of 768 (L1809-1810)."""
    c = r84_config()
    c.name = "r86"
    use_record86(c)
    c.bigram_vocab = c.padded_vocab * 15 // 2
    c.scheduled_iterations, c.extension_iterations = 1285, 15
    return c


def tiny_r86_config() -> Config:
    """The CPU-sized twin of r86 (train_gpt.cu's tiny_r86_preset): tiny-r84's schedule, vocabulary, batches and
    windows, but 6 heads of 64 (the gate's layout is upstream's fixed 6-head one): model_dim 384, mlp_dim 1536;
    bigram rows tiny's times 1.5 (15/2 of record 71's 5 vocabularies): 30,720 (README "Record 86")."""
    c = tiny_r84_config()
    c.name = "tiny-r86"
    use_record86(c)
    c.num_heads, c.head_dim, c.model_dim, c.mlp_dim = 6, 64, 384, 4 * 384
    c.bigram_vocab = tiny_config().bigram_vocab * 3 // 2
    return c


def use_record87(c: Config) -> None:
    """Record 87's post-only ReLU^2 MLP (upstream 75d6867a triton_kernels.py linear_relu_square_kernel L455-499 (its backward branch L472-476),
    FusedLinearReLUSquareFunction L667-729): the forward keeps post = relu(pre)^2 only, the backward takes relu(pre)
    as sqrt(fp32(post)) (ReluSquarePostOnly)."""
    c.mlp_post_only = True


def r89_config() -> Config:
    """Upstream's record 89 (commit 75d6867a, HEAD; records 87-89 on record 86): r86 with the post-only MLP backward
    (#87), the prefix-token loss (#88: pw 0.25, 0.25 -> 0, 0, 0) and the FP8 MLP down-projection with delayed scaling
    (#89), 1270 + 15 steps (Hyperparameters L1890-1891)."""
    c = r86_config()
    c.name = "r89"
    use_record87(c)
    use_record88(c)
    use_record89(c)
    c.scheduled_iterations, c.extension_iterations = 1270, 15
    return c


def tiny_r89_config() -> Config:
    """The CPU-sized twin of r89 (train_gpt.cu's tiny-r89): tiny-r86 with records 87-89's switches (the tiny
    schedule's lengths, 30 + 4)."""
    c = tiny_r86_config()
    c.name = "tiny-r89"
    use_record87(c)
    use_record88(c)
    use_record89(c)
    return c


PRESETS = {"record": record_config, "tiny": tiny_config, "r80": r80_config, "tiny-r80": tiny_r80_config,
           "r84": r84_config, "tiny-r84": tiny_r84_config, "r84-prefix": r84_prefix_config,
           "tiny-r84-prefix": tiny_r84_prefix_config, "r84-fp8down": r84_fp8down_config,
           "tiny-r84-fp8down": tiny_r84_fp8down_config, "r86": r86_config, "tiny-r86": tiny_r86_config,
           "r89": r89_config, "tiny-r89": tiny_r89_config}


def next_multiple_of_n(v: int, n: int) -> int:
    return -(-v // n) * n


def max_num_docs(cfg: Config, tokens_local: int) -> int:
    """Length of a micro-batch's padded cu_seqlens (document starts, then padding = tokens_local).
    r80: TRAIN_MAX_NUM_DOCS.get(tokens, next_multiple_of_n(tokens // 300, n=128)); upstream's r80
    next_multiple_of_n is ceil(v / n) * n, which is 0 below 300 tokens (an empty cu_seqlens it then
    indexes: a crash), so small batches get one block of 128 -- record 71's rule, which is
    next(x for x in range(n, ...) if x >= v), i.e. max(n, ceil(v / n) * n), and agrees with r80's
    everywhere upstream runs."""
    fallback = max(128, next_multiple_of_n(tokens_local // 300, 128))
    if cfg.max_num_docs_table is None:
        return fallback
    return cfg.max_num_docs_table.get(tokens_local, fallback)


def check_num_docs(cfg: Config, tokens_local: int, num_docs: int) -> None:
    """More documents than entries - 1 is a crash upstream (tensor assignment out of range)."""
    limit = max_num_docs(cfg, tokens_local)
    if num_docs + 1 > limit:
        raise ValueError(f"{num_docs} documents in a micro-batch of {tokens_local} tokens, but cu_seqlens "
                         f"holds {limit} entries (at most {limit - 1} documents)")

# The layer structure (fixed).
LAYERS = 11
ATTN_LAYERS = 10          # layer 6 has no attention
VALUE_TABLES = 5          # value embeddings on layers 0, 1 and 8, 9, 10
SKIP_FROM, SKIP_TO, BACKOUT_LAYER = 3, 6, 7
GATE = 12                 # gates read the first 12 channels
MUDD_COEFS = 14           # record 81: coefficients of MUDD's entry block (its exit uses the first 5)
MUDD_EXIT_COEFS = 5
MUDD_SCALE = 0.1          # upstream's _mudd_scale
XSA_EPS = 1e-4            # F.normalize(v, eps=1e-4)
PAIRED_LAYERS = (0, 2, 5, 9)
LONG_WINDOW_LAYERS = (3, 10)
# Records 85-86 (upstream 003ff3e2 init_mudd_gate L1365-1392, forward L1415-1602)
MUDD_GATE_HEADS = 6       # the gate's column layout is written for 6 heads (upstream asserts num_heads == 6)
MUDD_GATE_COEFS = (26, 41)  # columns of the pre gate (from x0) and the post gate (from layer 4's input)
MUDD_GATE_MAX_COEFS = 41
MUDD_GATE_SCALE_INIT = 0.1  # _mudd_gate_scale's initial value (a learnable fp32 scalar, used as bf16)
MUDD_GATE_POST_LAYER = 4  # the post gate is computed at the top of this layer, from its input (h3)
R86_GATE_LAYERS = (3, 10)  # attn_gate_layers: the only layers with an output gate
DC_LAYER = 10             # dc_layers
DC_WINDOW = 112           # the DC correction's keys: 0 <= t - s < 112, within t's document
DC_RMS_EPS = 1e-6         # dc_gate's F.rms_norm(eps=1.0e-6) over the heads
XSA_R86_EPS = 1e-8        # record 86's clamp_min(1e-8) of |v|^2


def mudd_gate_layout() -> Dict[Tuple[str, int], Tuple[int, int, int]]:
    """Where each consumer reads the MUDD gate (003ff3e2 unpack_pre_mudd_gate / unpack_post_mudd_gate L1398-1413,
    dc_weights at L1514, the init's comments L1369-1371): (kind, layer) -> (gate, first column, width), gate 0 the pre
    gate (from x0), 1 the post gate (from layer 4's input). Kinds: xsa (per head, alpha = tanh), out (per-head output
    gate, raw), x0 and bigram (injection gates), skip (layer 6), dc_w1 and dc_w2 (layer 10, per head)."""
    H = MUDD_GATE_HEADS
    lay = {("xsa", 1): (0, 0, H), ("xsa", 3): (0, H, H), ("out", 3): (0, 2 * H, H)}
    for j, layer in enumerate((0, 1, 2, 3)):
        lay[("x0", layer)] = (0, 3 * H + 2 * j, 1)
        lay[("bigram", layer)] = (0, 3 * H + 2 * j + 1, 1)
    lay.update({("xsa", 4): (1, 0, H), ("xsa", 7): (1, H, H), ("out", 10): (1, 2 * H, H)})
    for j, layer in enumerate((4, 5, 7, 8, 9)):
        lay[("x0", layer)] = (1, 3 * H + 2 * j, 1)
        lay[("bigram", layer)] = (1, 3 * H + 2 * j + 1, 1)
    lay[("skip", 6)] = (1, 3 * H + 10, 1)
    lay[("dc_w1", DC_LAYER)] = (1, 3 * H + 11, H)
    lay[("dc_w2", DC_LAYER)] = (1, 4 * H + 11, H)
    return lay


def has_attention(layer: int) -> bool:
    return layer != 6


def attn_index(layer: int) -> int:
    return layer if layer < 6 else layer - 1


def value_table(layer: int, value_layers: Sequence[int] = (0, 1, 8, 9, 10)) -> int:
    """Index of the layer's value-embedding table (and VE gate), -1 without one."""
    return list(value_layers).index(layer) if layer in value_layers else -1


# The fp32 scalars vector: resid lambdas, sa lambdas (pairs), bigram lambdas, smear, backout, skip,
# then padding (4 ones: upstream pads by (-3*layers - 3) mod 8 on 8 GPUs).
RESID, SA, BIGRAM = 0, LAYERS, 3 * LAYERS
SMEAR, BACKOUT, SKIP = 4 * LAYERS, 4 * LAYERS + 1, 4 * LAYERS + 2
NUM_SCALARS = 4 * LAYERS + 3 + 4

RMS_EPS = torch.finfo(torch.float32).eps  # F.rms_norm without eps (torch 2.10): FLT_EPSILON, fp32 math
SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5

PARAM_NAMES = ["embed", "lm_head", "bigram_embed", "value_embeds", "attn_bank", "mlp_bank", "attn_gate_bank",
               "ve_gate_bank", "smear_gate", "skip_gate", "x0_lambdas", "scalars"]


@dataclass(frozen=True)
class ScalarSlots:
    """Offsets into the fp32 `scalars` vector (-1: not in it)."""
    resid: int
    sa: int
    bigram: int
    smear: int
    backout: int
    skip: int
    count: int


def scalar_slots(cfg: Config) -> ScalarSlots:
    if not cfg.sublayer_lambdas:
        return ScalarSlots(RESID, SA, BIGRAM, SMEAR, BACKOUT, SKIP, NUM_SCALARS)
    # r80: [sa (0.5, 1.0) x layers, smear, backout, skip, ones]; upstream pads by (-2*layers - 3) mod
    # world_size, here for its 8 GPUs (7 ones: 32 entries), as record 71's layout is padded for 8.
    if cfg.mudd:  # a333be08 L1270: the backout's slot is gone (MUDD's exit absorbs it): [sa x layers, smear,
        # skip, padding], padded by (-2*layers - 2) mod 8: 24 entries, no padding, for 11 layers
        n = 2 * LAYERS + 2
        return ScalarSlots(-1, 0, -1, 2 * LAYERS, -1, 2 * LAYERS + 1, n + (-n) % 8)
    n = 2 * LAYERS + 3
    return ScalarSlots(-1, 0, -1, 2 * LAYERS, 2 * LAYERS + 1, 2 * LAYERS + 2, n + (-n) % 8)


def bank_counts(cfg: Config) -> Tuple[int, int, int, int]:
    """(real, padded) Q/K head-pair groups and (real, padded) V/O matrices of r80's banks: one Q/K group
    per attention layer, Q or K, and head pair (10 * 2 * heads/2), one V and one O per attention layer,
    each padded with zero matrices to a multiple of bank_pad_multiple."""
    qk = ATTN_LAYERS * 2 * (cfg.num_heads // 2)
    vo = ATTN_LAYERS * 2
    m = cfg.bank_pad_multiple
    return qk, next_multiple_of_n(qk, m), vo, next_multiple_of_n(vo, m)


def param_names(cfg: Config) -> List[str]:
    if not cfg.head_pair_banks and not cfg.sublayer_lambdas:
        return list(PARAM_NAMES)
    return list(param_shapes(cfg))


def param_shapes(cfg: Config) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    V, C, H, M = cfg.padded_vocab, cfg.model_dim, cfg.num_heads, cfg.mlp_dim
    bf, f32 = torch.bfloat16, torch.float32
    if cfg.head_pair_banks or cfg.sublayer_lambdas:
        _, qk_pad, _, vo_pad = bank_counts(cfg)
        shapes = {
            "embed": ((V, C), bf),
            "lm_head": ((C, V), bf),
            "bigram_embed": ((cfg.bigram_vocab, cfg.bigram_width), bf),
            "value_embeds": ((len(cfg.value_layers) * V, C), bf),
        }
        if cfg.head_pair_banks:
            # qk_bank group 2*(H/2)*a + j: attention layer a, j < H/2: Wq rows of heads 2j, 2j+1;
            # j >= H/2: the same rows of Wk. vo_bank 2a = Wv, 2a+1 = Wo. Padding matrices are zero.
            shapes["qk_bank"] = ((qk_pad, 2 * cfg.head_dim, C), bf)
            shapes["vo_bank"] = ((vo_pad, C, C), bf)
        else:
            shapes["attn_bank"] = ((ATTN_LAYERS, 4 * C, C), bf)
        shapes.update({
            "mlp_bank": ((LAYERS + 1, 2, M, C), bf),
            "attn_gate_bank": ((ATTN_LAYERS, H, GATE), bf),
            "ve_gate_bank": ((len(cfg.value_layers), H, GATE), bf),
            "smear_gate": ((1, GATE), bf),
            "skip_gate": ((1, GATE), bf),
            "post_lambdas": ((LAYERS, 2), f32),     # [:, 0] after attention, [:, 1] after the MLP
            "x0_lambdas": ((LAYERS,), f32),
            "bigram_lambdas": ((LAYERS,), f32),
            "resid_lambdas": ((LAYERS, 2), f32),
            "scalars": ((scalar_slots(cfg).count,), f32),
        })
        if cfg.xsa_layers:  # record 82: (layers, heads) fp32, rows of layers without XSA never read
            shapes["xsa_alphas"] = ((LAYERS, H), f32)
        if cfg.mudd:  # record 81: block 0 the last layer's entry (14 coefficients), block 1 the exit (5)
            shapes["mudd_w1"] = ((2, cfg.mudd_hidden, C), bf)
            shapes["mudd_w2"] = ((2, MUDD_COEFS, cfg.mudd_hidden), bf)
            shapes["mudd_b2"] = ((2, MUDD_COEFS), bf)
        if cfg.mudd_gate:  # record 85: gate 0 the pre gate (26 columns), 1 the post gate (41); the five it replaces go
            for gone in ("attn_gate_bank", "skip_gate", "x0_lambdas", "bigram_lambdas", "xsa_alphas"):
                shapes.pop(gone, None)
            shapes["mudd_gate_w1"] = ((2, cfg.mudd_hidden, C), bf)
            shapes["mudd_gate_w2"] = ((2, MUDD_GATE_MAX_COEFS, cfg.mudd_hidden), bf)
            shapes["mudd_gate_b2"] = ((2, MUDD_GATE_MAX_COEFS), bf)
            shapes["mudd_gate_scale"] = ((1,), f32)  # upstream's 0-dim _mudd_gate_scale; the trainer's (1,)
        return shapes
    return {
        "embed": ((V, C), bf),
        "lm_head": ((C, V), bf),  # stored transposed, as upstream's CastedLinearT
        "bigram_embed": ((cfg.bigram_vocab, C), bf),
        "value_embeds": ((VALUE_TABLES * V, C), bf),
        "attn_bank": ((ATTN_LAYERS, 4 * C, C), bf),  # per attention layer [Wq; Wk; Wv; Wo]
        "mlp_bank": ((LAYERS + 1, 2, M, C), bf),  # [c_fc, c_proj] per layer; entry 11 is padding
        "attn_gate_bank": ((ATTN_LAYERS, H, GATE), bf),
        "ve_gate_bank": ((VALUE_TABLES, H, GATE), bf),
        "smear_gate": ((1, GATE), bf),
        "skip_gate": ((1, GATE), bf),
        "x0_lambdas": ((LAYERS,), f32),
        "scalars": ((NUM_SCALARS,), f32),
    }


def init_params(cfg: Config, seed: int) -> Dict[str, torch.Tensor]:
    """Upstream's GPT.__init__ distributions with torch's generator (for tests and standalone runs;
    golden fixtures start from the trainer's own checkpoint instead)."""
    g = torch.Generator().manual_seed(seed)
    shapes = param_shapes(cfg)
    p = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
    bound = math.sqrt(3) * 0.5 * cfg.model_dim ** -0.5
    if "attn_bank" not in shapes:
        return _init_params_r80(cfg, p, g, bound)
    p["attn_bank"] = (torch.rand(shapes["attn_bank"][0], generator=g) * 2 - 1).mul(bound).bfloat16()
    fc = (torch.rand((LAYERS + 1, cfg.mlp_dim, cfg.model_dim), generator=g) * 2 - 1).mul(bound)
    p["mlp_bank"][:, 0] = fc.bfloat16()
    p["lm_head"] = (torch.randn(shapes["lm_head"][0], generator=g) * 0.005).bfloat16()
    p["embed"] = p["lm_head"].t().contiguous()
    s = torch.ones(NUM_SCALARS)
    s[RESID:RESID + LAYERS] = 1.1
    s[SA:SA + 2 * LAYERS] = torch.tensor([0.5, 1.0]).repeat(LAYERS)
    s[BIGRAM:BIGRAM + LAYERS] = 0.1
    s[SMEAR], s[BACKOUT], s[SKIP] = 0.0, 0.5, -1.5
    p["scalars"] = s
    return p


def _init_params_r80(cfg: Config, p: Dict[str, torch.Tensor], g: torch.Generator, bound: float):
    """Upstream's GPT.__init__ at 2c702746 (distributions only: torch's CPU generator, not upstream's
    CUDA draw order)."""
    qk, _, vo, _ = bank_counts(cfg)
    uniform = lambda shape: (torch.rand(shape, generator=g) * 2 - 1).mul(bound).bfloat16()
    p["qk_bank"][:qk] = uniform(p["qk_bank"][:qk].shape)
    p["vo_bank"][:vo] = uniform(p["vo_bank"][:vo].shape)
    p["mlp_bank"][:, 0] = uniform((LAYERS + 1, cfg.mlp_dim, cfg.model_dim))
    p["lm_head"] = (torch.randn(p["lm_head"].shape, generator=g) * 0.005).bfloat16()
    p["embed"] = p["lm_head"].t().contiguous()
    p["value_embeds"] = (cfg.value_embed_std * torch.randn(p["value_embeds"].shape, generator=g)).bfloat16()
    p["post_lambdas"].fill_(1.0)
    if "bigram_lambdas" in p:
        p["bigram_lambdas"].fill_(0.05)
    p["resid_lambdas"].fill_(1.1 ** 0.5)  # per sublayer, so a layer scales the stream by 1.1
    sl = scalar_slots(cfg)
    sc = torch.ones(sl.count)
    sc[sl.sa:sl.sa + 2 * LAYERS] = torch.tensor([0.5, 1.0]).repeat(LAYERS)
    sc[sl.smear], sc[sl.skip] = 0.0, -1.5
    if sl.backout >= 0:
        sc[sl.backout] = 0.5
    p["scalars"] = sc
    if cfg.mudd:  # a333be08 init_mudd: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(C)), w2 zeros, b2 pre-scaled
        b = cfg.model_dim ** -0.5
        p["mudd_w1"] = (torch.rand(p["mudd_w1"].shape, generator=g) * 2 - 1).mul(b).bfloat16()
        p["mudd_b2"] = mudd_initial_b2()
    if cfg.mudd_gate:  # 003ff3e2 init_mudd_gate: w1 U(+-1/sqrt(C)), w2 zeros, b2 pre-scaled, scale 0.1
        b = cfg.model_dim ** -0.5
        p["mudd_gate_w1"] = (torch.rand(p["mudd_gate_w1"].shape, generator=g) * 2 - 1).mul(b).bfloat16()
        p["mudd_gate_b2"] = mudd_gate_initial_b2()
        p["mudd_gate_scale"] = torch.tensor([MUDD_GATE_SCALE_INIT], dtype=torch.float32)
    return p


def mudd_initial_b2() -> torch.Tensor:
    """Upstream's mudd_b2 init (a333be08 L1306-1319), stored pre-scaled (effective = 0.1 x), in bf16: the
    entry's ve gate halves 2.0, its layer lambdas resid sqrt(1.1), post 1, x0 0, bigram 0.05; the exit's h7
    coefficient -0.5 (record 80's backout)."""
    b = torch.zeros(2, MUDD_COEFS)
    b[0, 6] = b[0, 7] = 2.0 / MUDD_SCALE
    b[0, 8] = b[0, 12] = 1.1 ** 0.5 / MUDD_SCALE
    b[0, 9] = b[0, 13] = 1.0 / MUDD_SCALE
    b[0, 11] = 0.05 / MUDD_SCALE
    b[1, 1] = -0.5 / MUDD_SCALE
    return b.bfloat16()


def mudd_gate_initial_b2() -> torch.Tensor:
    """Upstream's mudd_gate_b2 init (003ff3e2 L1379-1391), stored pre-scaled (effective = bf16(0.1) x), in bf16:
    both output gates 0.25 / 0.1 = 2.5, every bigram gate 0.05 / 0.1 = 0.5, the skip 0.5 / 0.1 = 5, DC's w1 1 / 0.1
    = 10 (its rms-normalised w1 starts at 1); the XSA strengths, x0 gates and DC's w2 0 (DC starts as a no-op)."""
    b = torch.zeros(2, MUDD_GATE_MAX_COEFS)
    for (kind, _), (gate, start, width) in mudd_gate_layout().items():
        value = {"out": 0.25, "bigram": 0.05, "skip": 0.5, "dc_w1": 1.0}.get(kind, 0.0)
        b[gate, start:start + width] = value / MUDD_GATE_SCALE_INIT
    return b.bfloat16()


def random_sign_table(cfg: Config, seed: int) -> torch.Tensor:
    """A +-1 bf16 table (bigram_sign_rows, bigram_width), as upstream's randn().sign() (which is unseeded;
    golden runs take the trainer's table from its checkpoint instead)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (cfg.bigram_sign_rows, cfg.bigram_width), generator=g) * 2 - 1).bfloat16()


# =====================================================================================================
# Checkpoints: the safetensors layout (8-byte little-endian header length, JSON header, data).
# =====================================================================================================
_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
              "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "U8": torch.uint8, "U16": torch.uint16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str, prefix="") -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors whose names start with `prefix` (a string or a tuple of them), and the metadata."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = memoryview(raw)[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        if not name.startswith(prefix):
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = _ST_DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        count = math.prod(shape)
        if e - b != count * torch.tensor([], dtype=dtype).element_size() or e > len(data):
            raise ValueError(f"{path}: tensor {name} has {e - b} bytes for shape {shape} {info['dtype']}")
        t = torch.frombuffer(bytearray(data[b:e]), dtype=dtype) if count else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape).clone()
    return out, meta


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None):
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# The trainer's checkpoints name parameters by upstream's optimizer labels.
LABELS = {"embed": "embed", "lm_head": "lm_head", "bigram_embed": "bigram_embed", "value_embeds": "value_embed",
          "attn_bank": "attn", "mlp_bank": "mlp", "attn_gate_bank": "attn_gate_bank", "ve_gate_bank": "ve_gate_bank",
          "smear_gate": "smear_gate", "skip_gate": "skip_gate", "x0_lambdas": "x0_lambdas", "scalars": "scalars"}


def params_from_checkpoint(cfg: Config, tensors: Dict[str, torch.Tensor],
                           prefix: str = "param.") -> Dict[str, torch.Tensor]:
    """The parameters in a checkpoint ("param.<name>" or "param.<upstream label>", any shape with the
    right element count, e.g. the trainer's 2-D (rows, row elements)), in this module's shapes, with
    the dtypes checked."""
    out = {}
    for name, (shape, dtype) in param_shapes(cfg).items():
        keys = [prefix + name, prefix + LABELS.get(name, name)]
        key = next((k for k in keys if k in tensors), None)
        if key is None:
            raise ValueError(f"checkpoint has no tensor {' or '.join(repr(k) for k in keys)}")
        t = tensors[key]
        if t.numel() != math.prod(shape) or t.dtype != dtype:
            raise ValueError(f"checkpoint tensor '{key}' is {tuple(t.shape)} {t.dtype}, want {shape} {dtype} "
                             f"(or any shape of {math.prod(shape)} elements)")
        out[name] = t.reshape(shape).clone()
    return out


PREFIX_TABLE_ROWS = 50304


def load_prefix_table(path: Optional[str] = None) -> torch.Tensor:
    """Record 88's prefix-token table (int64, 50304): the committed data/gpt2_prefix_table.bin (int32 little
    endian, made by scripts/make_prefix_table.py from GPT-2's vocabulary and checked against upstream's sha256)."""
    if path is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "gpt2_prefix_table.bin")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) != 4 * PREFIX_TABLE_ROWS:
        raise ValueError(f"prefix table {path}: {len(raw)} bytes, want {4 * PREFIX_TABLE_ROWS}")
    return torch.tensor(struct.unpack(f"<{PREFIX_TABLE_ROWS}i", raw), dtype=torch.int64)


def bigram_signs_from_checkpoint(cfg: Config, tensors: Dict[str, torch.Tensor],
                                 key: str = "buffer.bigram_signs") -> Optional[torch.Tensor]:
    """Record 83's sign table (a buffer, not a parameter: upstream draws it unseeded on rank 0 and broadcasts
    it; the trainer draws it from its seed and saves it as `buffer.bigram_signs`, BF16 (rows, width)), checked
    to be +-1. None where the config has no sign table."""
    if not cfg.bigram_sign_rows:
        return None
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor '{key}' (the bigram sign table of a config with "
                         f"{cfg.bigram_sign_rows} sign rows)")
    t = tensors[key]
    shape = (cfg.bigram_sign_rows, cfg.bigram_width)
    if t.numel() != math.prod(shape) or t.dtype != torch.bfloat16:
        raise ValueError(f"checkpoint tensor '{key}' is {tuple(t.shape)} {t.dtype}, want {shape} torch.bfloat16")
    t = t.reshape(shape).clone()
    if not bool((t.float().abs() == 1).all()):
        raise ValueError(f"checkpoint tensor '{key}' holds entries other than +-1")
    return t


# =====================================================================================================
# Schedule: upstream's TrainingSchedule, get_muon_momentum and TrainingManager's stage logic.
# =====================================================================================================
class Schedule:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        S = cfg.scheduled_iterations
        self.total_steps = cfg.total_steps
        ends, acc = [0], 0.0
        for st in cfg.stages[:-1]:
            acc += st.duration
            ends.append(round(acc * S))
        ends.append(self.total_steps)
        if ends[-2] != S:
            raise ValueError(f"stage durations end at step {ends[-2]}, not at the {S} scheduled steps")
        self.boundaries = list(zip(ends[:-1], ends[1:]))
        self.split_step = self.boundaries[cfg.split_embed_stage][0] | 1  # an odd step, so Adam updates

    def lookup(self, step: int) -> Tuple[int, float]:
        """(stage index, fraction of the way through it)."""
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return i, (step - start) / (end - start)
        return len(self.boundaries) - 1, 1.0

    def stage(self, step: int) -> Stage:
        return self.cfg.stages[self.lookup(step)[0]]

    def transition_steps(self) -> List[int]:
        return [start for start, _ in self.boundaries[1:]]

    def lr(self, step: int) -> float:
        """The learning-rate multiplier: the stage's lr_mul, cooled down linearly to lr_floor (0.1; r80 0.15)."""
        lr = self.stage(step).lr_mul
        S = self.cfg.scheduled_iterations
        cd_start = int(S * (1 - self.cfg.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (S - cd_start))
            lr = lr * (1 - t) + self.cfg.lr_floor * t
        return lr

    def train_max_seq_len(self, step: int) -> int:
        """Documents are cut at this length in the step's batches (r80: per stage)."""
        seq = self.stage(step).train_max_seq_len
        return self.cfg.max_seq_len if seq is None else seq

    def muon_momentum(self, step: int) -> float:
        c = self.cfg
        cd_start = self.total_steps - c.muon_cooldown_steps
        if step < c.muon_warmup_steps:
            return c.muon_momentum_min + step / c.muon_warmup_steps * (c.muon_momentum_max - c.muon_momentum_min)
        if step > cd_start:
            frac = (step - cd_start) / c.muon_cooldown_steps
            return c.muon_momentum_max - frac * (c.muon_momentum_max - c.muon_momentum_min)
        return c.muon_momentum_max

    def mtp_weights(self, step: int) -> torch.Tensor:
        i, t = self.lookup(step)
        st = self.cfg.stages[i]
        return torch.tensor([a + (b - a) * t for a, b in zip(st.mtp_start, st.mtp_end)], dtype=torch.float32)

    def prefix_weight(self, step: int) -> torch.Tensor:
        """Record 88's pw: start + (end - start) t in double, then fp32 (upstream's torch.tensor([pw]))."""
        i, t = self.lookup(step)
        st = self.cfg.stages[i]
        return torch.tensor(st.prefix_start + (st.prefix_end - st.prefix_start) * t, dtype=torch.float32)

    def windows(self, step: int) -> Tuple[int, int]:
        """(short, long) windows of the step in blocks."""
        st = self.stage(step)
        return st.ws_short, st.ws_long

    def batch_tokens(self, step: int) -> int:
        return self.stage(step).batch_tokens

    @staticmethod
    def is_adam_step(step: int) -> bool:
        return step % 2 == 1


# =====================================================================================================
# YaRN rotary state (upstream's Yarn module, one plain and one paired instance).
# =====================================================================================================
class Yarn:
    def __init__(self, head_dim: int, max_seq_len: int, paired: bool):
        self.head_dim, self.max_seq_len, self.paired = head_dim, max_seq_len, paired
        self.reset()

    def _tables(self) -> None:
        t = torch.arange(2 * self.max_seq_len, dtype=torch.float32)
        if self.paired:  # row t holds the angles of positions 2t and 2t+1 side by side
            th1, th2 = torch.outer(2 * t, self.freq), torch.outer(2 * t + 1, self.freq)
            cos, sin = torch.cat((th1.cos(), th2.cos()), -1), torch.cat((th1.sin(), th2.sin()), -1)
        else:
            th = torch.outer(t, self.freq)
            cos, sin = th.cos(), th.sin()
        self.cos = cos.bfloat16()
        sin = sin.bfloat16()
        sin[..., 1::2] *= -1  # so that rotary = cos * x + sin * swap_pairs(x)
        self.sin = sin

    def reset(self) -> None:
        D = self.head_dim
        f = (1 / 1024) ** torch.linspace(0, 1, steps=D // 4, dtype=torch.float32)
        # each frequency turns one adjacent pair; the upper half of the head is left unrotated
        self.freq = torch.cat([f.repeat_interleave(2), torch.zeros(D // 2)])
        self._tables()
        self.attn_scale = 0.1

    def apply(self, old_window: int, new_window: int, alpha: float = 1, beta: float = 32) -> None:
        """Window growth old -> new (tokens): slow frequencies stretched by old/new, fast ones kept."""
        turns = old_window * self.freq / (2 * torch.pi)
        ratio = old_window / new_window
        blend = torch.clamp((turns - alpha) / (beta - alpha), 0, 1)
        self.freq = self.freq * (ratio + blend * (1 - ratio))
        self._tables()
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1


# =====================================================================================================
# Numerics helpers
# =====================================================================================================
def bf(x: torch.Tensor) -> torch.Tensor:
    """Materialize in bf16 (round to nearest even)."""
    return x.to(torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16(x @ w^T) with fp32 accumulation, as a bf16 F.linear."""
    return bf(x.float() @ w.float().t())


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + FLT_EPSILON) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 to an fp8 format, saturating at its largest finite value (the GPU's satfinite
    conversion; torch's own CPU cast would give NaN for e4m3fn and inf for e5m2 beyond it)."""
    m = torch.finfo(dtype).max
    return x.clamp(-m, m).to(dtype)


class EmbeddingRows(torch.autograd.Function):
    """rows = table[ids] for a leaf table. Backward: the table's gradient for this micro-batch is the
    fp32 sum of the rows' gradients per id rounded once to bf16 (embedding_dense_backward), and it is
    added (in bf16) into table.grad, as autograd would add a dense gradient; only the touched rows are
    visited, since the others receive exact zeros."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.table = table
        return table.detach()[ids]

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        table = ctx.table
        C = table.shape[-1]
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        sums = torch.zeros((uniq.numel(), C), dtype=torch.float32)
        sums.index_add_(0, inverse, g.float().reshape(-1, C))
        if table.grad is None:
            table.grad = torch.zeros_like(table)
        table.grad[uniq] = (table.grad[uniq].float() + sums.to(table.dtype).float()).to(table.dtype)
        return None, None


class Fp8LmHead(torch.autograd.Function):
    """logits = bf16((x8 @ w8) * x_s * w_s), x8 = e4m3(x / x_s), w8 = e4m3(w / w_s), w stored (C, V).
    Backward: g8 = e5m2(g / grad_s); dx = bf16((g8 @ w8^T) * grad_s * w_s), dw = (x8^T @ g8) * x_s * grad_s
    in fp32, rounded to the bf16 parameter's gradient."""

    @staticmethod
    def forward(ctx, x, w, x_s, w_s, grad_s):
        x8 = to_fp8(x.float() / x_s, torch.float8_e4m3fn)
        w8 = to_fp8(w.float() / w_s, torch.float8_e4m3fn)
        scale = torch.tensor(x_s, dtype=torch.float32) * torch.tensor(w_s, dtype=torch.float32)
        ctx.save_for_backward(x8, w8)
        ctx.scales = (x_s, w_s, grad_s)
        return bf((x8.float() @ w8.float()) * scale)

    @staticmethod
    def backward(ctx, g):
        x8, w8 = ctx.saved_tensors
        x_s, w_s, grad_s = (torch.tensor(s, dtype=torch.float32) for s in ctx.scales)
        g8 = to_fp8(g.float() / grad_s, torch.float8_e5m2).float()
        dx = bf((g8 @ w8.float().t()) * (grad_s * w_s))
        dw = bf((x8.float().t() @ g8) * (x_s * grad_s))
        return dx, dw, None, None, None


def softcap(logits: torch.Tensor) -> torch.Tensor:
    """z = 23 * sigmoid((l + 5) / 7.5) in fp32."""
    return SOFTCAP_A * torch.sigmoid((logits.float() + SOFTCAP_B) / SOFTCAP_C)


def mtp_weight_sums(weights: torch.Tensor, T: int) -> torch.Tensor:
    """S_t = sum of the weights k with t + k < T (the rows near the end predict fewer tokens)."""
    S = torch.zeros(T, dtype=torch.float32)
    for k in range(min(weights.numel(), T)):
        S[:T - k] += weights[k]
    return S


class SoftcapMtpLoss(torch.autograd.Function):
    """loss = sum over rows t of sum_k w_k * (lse_t - z[t, targets[t+k]]), z = softcap(logits) in fp32,
    terms with t + k past the end dropped (upstream's fused kernel skips zero weights). Backward, as
    the fused kernel: dz = g * (S_t * softmax(z)_t - sum_k w_k [v == targets[t+k]]), dlogits =
    bf16(dz * z * (1 - sigmoid) / 7.5)."""

    @staticmethod
    def forward(ctx, logits, targets, weights):
        T = logits.shape[0]
        z = softcap(logits)
        lse = torch.logsumexp(z, dim=-1)
        rows = torch.zeros(T, dtype=torch.float32)
        for k, w in enumerate(weights.tolist()):
            if not w > 0 or k >= T:
                continue
            n = T - k
            zt = z[:n].gather(1, targets[k:k + n].unsqueeze(1)).squeeze(1)
            rows[:n] += weights[k] * (lse[:n] - zt)
        ctx.save_for_backward(logits, targets, weights, lse)
        return rows.sum()

    @staticmethod
    def backward(ctx, g):
        logits, targets, weights, lse = ctx.saved_tensors
        T = logits.shape[0]
        sig = torch.sigmoid((logits.float() + SOFTCAP_B) / SOFTCAP_C)
        z = SOFTCAP_A * sig
        dz = torch.exp(z - lse.unsqueeze(1)).mul_(mtp_weight_sums(weights, T).unsqueeze(1))
        for k in range(min(weights.numel(), T)):
            n = T - k
            dz[:n].scatter_add_(1, targets[k:k + n].unsqueeze(1), (-weights[k]).expand(n, 1).contiguous())
        dz.mul_(g.float())
        return bf(dz.mul_(z.mul_((1 - sig).div_(SOFTCAP_C)))), None, None


def mtp_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return SoftcapMtpLoss.apply(logits, targets, weights)


def mtp_loss_autograd(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same loss written with plain tensor ops (tests check SoftcapMtpLoss's backward against it)."""
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1)
    T = z.shape[0]
    total = torch.zeros(T, dtype=torch.float32)
    for k, w in enumerate(weights.tolist()):
        if not w > 0 or k >= T:
            continue
        n = T - k
        zt = z[:n].gather(1, targets[k:k + n].unsqueeze(1)).squeeze(1)
        total = total + F.pad(weights[k] * (lse[:n] - zt), (0, k))
    return total.sum()


CE_INV_C = torch.tensor(1.0, dtype=torch.float32) / SOFTCAP_C           # the kernel's 1 / C in fp32
CE_B_DIV_C = torch.tensor(SOFTCAP_B, dtype=torch.float32) * CE_INV_C    # B * inv_C in fp32


def ce_kernel_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """r80's CE kernel: s = 0.5 + 0.5 tanh(0.5 u), u = l * inv_C + B * inv_C in fp32 (nvcc contracts the
    multiply-add into one FMA: emulated in float64, where the product is exact). The kernel's tanh is
    the hardware approximation (--use_fast_math); this uses the correctly rounded one, and its 1/C is
    fast-math division: both are below bf16's resolution except near rounding ties (README)."""
    u = (logits.double() * CE_INV_C.double() + CE_B_DIV_C.double()).float()
    return 0.5 + torch.tanh(u * 0.5) * 0.5


def fused_ce_rows(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, grad_s: float,
                  grad_scale: float, prefix_targets: Optional[torch.Tensor] = None,
                  prefix_weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """What upstream's ce_fwd_bwd_kernel (triton_kernels.py @2c702746) computes from the bf16 logits
    (T, V): the per-row losses (fp32) and the e5m2 logit gradients, in its order of fp32 operations.
      s = sigmoid above, rounded to bf16 and reused: z = 23 s for the loss, the sum and the gradient;
      the max for the log-sum-exp is taken over the unrounded 23 s (it only shifts the sum);
      loss_t = sum_k [t+k < T] w_k (lse - z[target[t+k]]);
      dlogit = e5m2_satfinite(grad_scale * (1/C * A) * (1/grad_s) * (S_w p - term2) * s (1 - s)),
      S_w = sum of ALL the MTP weights (also k with t+k >= T: upstream's quirk, the last rows' gradient
      normalizer does not match their loss), term2_j = sum_k [t+k < T, target[t+k] = j] w_k.
    Record 88 (75d6867a, prefix_targets P (T) and the fp32 weight pw given): rows with 0 <= P_t < V add
    pw (lse - z[P_t]) to their loss after the MTP terms, start S_w at pw (then add the MTP weights), and
    add pw to term2 at column P_t after the MTP weights."""
    T, V = logits.shape
    A = torch.tensor(SOFTCAP_A, dtype=torch.float32)
    s_raw = ce_kernel_sigmoid(logits)
    s = bf(s_raw).float()
    zmax = (A * s_raw).amax(dim=1, keepdim=True)
    z = A * s
    lse = zmax + torch.log(torch.exp(z - zmax).sum(dim=1, keepdim=True))
    w = weights.float()
    n = w.numel()
    losses = torch.zeros(T, dtype=torch.float32)
    for k in range(n):
        m = max(T - k, 0)
        zt = z[:m].gather(1, targets[k:k + m].unsqueeze(1)).squeeze(1)
        # total += w * (lse - z): one FMA in the kernel (float64 holds the product exactly)
        losses[:m] = (losses[:m].double() + w[k].double() * (lse[:m, 0] - zt).double()).float()
    S_w = torch.zeros((T, 1), dtype=torch.float32)
    if prefix_targets is not None:
        pw = prefix_weight.float().reshape(())
        valid = (prefix_targets >= 0) & (prefix_targets < V)
        P = prefix_targets.clamp(0, V - 1)
        zp = z.gather(1, P.unsqueeze(1)).squeeze(1)
        with_prefix = (losses.double() + pw.double() * (lse[:, 0] - zp).double()).float()
        losses = torch.where(valid, with_prefix, losses)
        S_w = torch.where(valid, pw, torch.zeros((), dtype=torch.float32)).unsqueeze(1)
    for k in range(n):
        S_w = S_w + w[k]
    grad_z = S_w * torch.exp(z - lse)
    # the target columns are rewritten after a barrier with term2 (only k < 3, as the kernel's loop)
    term2 = torch.zeros((T, V), dtype=torch.float32)
    for k in range(min(n, 3)):
        m = max(T - k, 0)
        term2[:m].scatter_add_(1, targets[k:k + m].unsqueeze(1), w[k].expand(m, 1).contiguous())
    if prefix_targets is not None:
        rows = valid.nonzero().squeeze(1)
        term2[rows, P[rows]] += pw
    grad_z = grad_z - term2
    k1 = torch.tensor(grad_scale, dtype=torch.float32) * (CE_INV_C * A)
    k2 = 1.0 / torch.tensor(grad_s, dtype=torch.float32)
    d = k1 * k2 * grad_z * s * (1.0 - s)
    return losses, to_fp8(d, torch.float8_e5m2)


class FusedSoftcappedCE(torch.autograd.Function):
    """r80's FusedSoftcappedCrossEntropy: the FP8 lm_head (as Fp8LmHead's forward) fused with the CE
    kernel, which computes the gradient in the forward. Returns the per-token losses; the backward
    ignores grad_output (grad_scale is baked in: the caller must backprop losses.sum() * grad_scale)
    and forms dx = bf16((d8 @ w8^T) * grad_s * w_s), dW = (x8^T @ d8) * x_s * grad_s in fp32, rounded
    to the bf16 parameter's gradient."""

    @staticmethod
    def forward(ctx, x, w, targets, weights, x_s, w_s, grad_s, grad_scale, prefix_targets=None, prefix_weight=None):
        x8 = to_fp8(x.float() / x_s, torch.float8_e4m3fn)
        w8 = to_fp8(w.float() / w_s, torch.float8_e4m3fn)
        scale = torch.tensor(x_s, dtype=torch.float32) * torch.tensor(w_s, dtype=torch.float32)
        logits = bf((x8.float() @ w8.float()) * scale)
        losses, d8 = fused_ce_rows(logits, targets, weights, grad_s, grad_scale, prefix_targets, prefix_weight)
        ctx.save_for_backward(x8, w8, d8)
        ctx.scales = (x_s, w_s, grad_s)
        return losses

    @staticmethod
    def backward(ctx, _ignored):
        x8, w8, d8 = ctx.saved_tensors
        x_s, w_s, grad_s = (torch.tensor(v, dtype=torch.float32) for v in ctx.scales)
        d = d8.float()
        dx = bf((d @ w8.float().t()) * (grad_s * w_s))
        dw = bf((x8.float().t() @ d) * (x_s * grad_s))
        return dx, dw, None, None, None, None, None, None, None, None


def eval_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the softcapped fp32 logits."""
    return F.cross_entropy(softcap(logits), targets, reduction="mean")


# =====================================================================================================
# The model: upstream's GPT.forward on one packed sequence (batch 1), parameters in a dict.
# =====================================================================================================
@dataclass
class Batch:
    inputs: torch.Tensor       # (T) int64 token ids
    targets: torch.Tensor      # (T) int64 next tokens
    cu_seqlens: torch.Tensor   # document starts, then T, padded with T
    bigram: torch.Tensor       # (T) int64 bigram hash ids

    @staticmethod
    def from_lists(inputs, targets, cu_seqlens, bigram) -> "Batch":
        t = lambda v: torch.tensor(list(v), dtype=torch.int64)
        return Batch(t(inputs), t(targets), t(cu_seqlens), t(bigram))

    def doc_ids(self) -> torch.Tensor:
        """Document index of each position (positions share a document iff equal)."""
        T = self.inputs.numel()
        return torch.searchsorted(self.cu_seqlens, torch.arange(T), right=True)


@dataclass
class ForwardArgs:
    ws_short: int                 # windows in tokens (key j visible from query i iff i - w <= j <= i)
    ws_long: int
    mtp_weights: torch.Tensor     # fp32
    yarn: Yarn
    yarn_paired: Yarn
    bigram_signs: Optional[torch.Tensor] = None  # record 83's +-1 table (bigram_sign_rows, bigram_width), bf16
    prefix_table: Optional[torch.Tensor] = None  # record 88's prefix-token table (Config.prefix_loss)
    prefix_weight: Optional[torch.Tensor] = None  # and the step's weight pw (fp32)
    mlp_down: Optional["MlpDownState"] = None    # record 89's scales and W2q (Config.mlp_fp8_down), updated by
    #                                              every training forward


def rotary(x: torch.Tensor, yarn: Yarn) -> torch.Tensor:
    """x (T, slots, width) fp32: cos * x + sin * swap_pairs(x) with bf16 tables rows 0..T-1."""
    T, _, width = x.shape
    cos = yarn.cos[:T, None, :width].float()
    sin = yarn.sin[:T, None, :width].float()
    flipped = x.view(T, -1, width // 2, 2).flip(-1).reshape(x.shape)
    return cos * x + sin * flipped


def attention(q, k, v, doc, window: int, scale: float) -> torch.Tensor:
    """Causal sliding-window attention within documents; q, k, v bf16 (rows, slots, D) -> bf16."""
    R = q.shape[0]
    i = torch.arange(R)[:, None]
    j = torch.arange(R)[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j <= i) & (i - j <= window)
    s = torch.einsum("isd,jsd->sij", q.float(), k.float()) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return bf(torch.einsum("sij,jsd->isd", p, v.float()))


def xsa(y: torch.Tensor, v: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Record 82's XSA (a333be08 L1125-1131) on y, v (T, H, D) bf16 with the layer's raw strengths a (H) fp32:
    y - alpha (y . v^) v^ per token and head, v^ = v / max(|v|, 1e-4) (F.normalize(eps=1e-4)), alpha =
    bf16(tanh(a)) (`.type_as(y)`, an explicit cast). fp32 from the bf16 values, not rounded: upstream's
    compiled graph fuses it with the output gate's multiply, rounded once after it (the caller)."""
    vf, yf = v.float(), y.float()
    vhat = vf / vf.norm(dim=-1, keepdim=True).clamp_min(XSA_EPS)
    proj = (yf * vhat).sum(-1, keepdim=True)
    alpha = bf(torch.tanh(a)).float().view(1, -1, 1)
    return yf - alpha * proj * vhat


def xsa_r86(y: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Record 86's XSA (003ff3e2 L1152-1156) on y, v (T, H, D) bf16 with per-token, per-head gate columns g (T, H)
    bf16: y - tanh(g) ((y . v) / max(|v|^2, 1e-8)) v. fp32 from the bf16 values, not rounded: tanh of the bf16 column
    needs no cast (`type_as(y)` is a no-op), and the compiled graph fuses the whole expression with the output gate's
    multiply, rounded once after it (the caller)."""
    yf, vf = y.float(), v.float()
    dot = (yf * vf).sum(-1, keepdim=True)
    denom = vf.square().sum(-1, keepdim=True).clamp_min(XSA_R86_EPS)
    alpha = torch.tanh(g.float()).unsqueeze(-1)
    return yf - alpha * (dot / denom) * vf


def dc_weights(g_w1: torch.Tensor, g_w2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """dc_gate (003ff3e2 L1071-1079): w1 = bf16(F.rms_norm(fp32(G[29:35]), eps=1e-6)) over the heads (no learned
    scale), w2 = G[35:41] (already bf16). (T, H) each."""
    x = g_w1.float()
    return bf(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + DC_RMS_EPS)), g_w2


def dc_mha(y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, w1: torch.Tensor,
           w2: torch.Tensor, scale: float, window: int = DC_WINDOW) -> torch.Tensor:
    """Record 85's post-only DC correction (003ff3e2 dc_triton_kernels.py: _dc_postonly_probs_wsmall_head L91-142,
    _dc_postonly_store_corr_wsmall_head L197-251, the forward kernel L253-440) on y, q, k, v (T, H, D) bf16 (q, k
    after QK norm, rotary and the key offset; v with aux_v; y the attention's output) with w1, w2 (T, H) bf16:
      P_h[t, s] = softmax over the keys 0 <= t - s < window in t's document of scale q_h[t] . k_h[s] (its own
                  softmax, not the attention's probabilities), fp32 from the bf16 q, k;
      A[t, s]   = sum_h w1[t, h] P_h[t, s] (fp32);
      out[t, h] = bf16(y[t, h] + sum_s bf16(w2[t, h] A[t, s]) v_h[s]) -- the kernel rounds w2 A to v's dtype for its
                  dot with v (fp32 accumulation), adds the base in fp32 and stores bf16 once.
    Dense (T, T) masks: for the CPU sizes of the reference. Autograd gives the backward (fp32 math, q, k, v and the
    weights' gradients rounded to bf16 once each, where the kernel accumulates dk and dv with bf16 atomics)."""
    T = q.shape[0]
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (s <= t) & (t - s < window)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    a = torch.einsum("th,hts->ts", w1.float(), probs)
    corr_w = bf(w2.float().t()[:, :, None] * a[None])  # (H, T, S)
    corr = torch.einsum("hts,shd->thd", corr_w.float(), v.float())
    return bf(y.float() + corr)


@dataclass
class LayerGates:
    """Record 85's per-token readers of one attention layer (MUDD gate columns, (T, H) bf16 each, or None)."""
    xsa: Optional[torch.Tensor] = None   # XSA strengths (alpha = tanh)
    out: Optional[torch.Tensor] = None   # the raw output gate (no sigmoid)
    dc: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # DC-MHA's (w1 columns, w2 columns) before dc_weights


def attention_block(cfg: Config, p: Dict[str, torch.Tensor], layer: int, h: torch.Tensor, W: torch.Tensor,
                    ve: Optional[torch.Tensor], doc: torch.Tensor, args: ForwardArgs,
                    ve_gate: Optional[torch.Tensor] = None, v_add: Optional[torch.Tensor] = None,
                    gates: Optional[LayerGates] = None) -> torch.Tensor:
    """W: the layer's (4C, C) [Wq; Wk; Wv; Wo]; h: the normed stream; ve: its value-embedding rows.
    Record 81's MUDD entry (the last layer) passes ve_gate (T, H) fp32, the per-head gate that replaces the
    ve_gate_bank's, and v_add (T, C) fp32, its mix of h0, h7, h9 added to v with the gated ve (upstream's
    aux_v = g ve + v_mudd, then v + aux_v: one fp32 expression, v rounded once for the attention).
    Record 85 (cfg.mudd_gate) passes gates: the layer's XSA strengths, output gate and DC weights, in upstream's order
    (003ff3e2 L1142-1158): attention, DC (its own bf16 output), XSA and the output gate (one rounding)."""
    T, C, H, D = h.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim
    paired = layer in PAIRED_LAYERS
    sa_at = scalar_slots(cfg).sa + 2 * layer
    sa = p["scalars"][sa_at:sa_at + 2]
    w_qkv = bf(sa[0] * W[:3 * C].float())
    w_o = bf(sa[1] * W[3 * C:].float())
    qkv = linear(h, w_qkv).view(T, 3 * H, D)
    q, k, v = rms_norm(qkv[:, :H]), rms_norm(qkv[:, H:2 * H]), qkv[:, 2 * H:].float()
    window = args.ws_long if layer in LONG_WINDOW_LAYERS else args.ws_short
    if not paired:
        q, k = rotary(q, args.yarn), rotary(k, args.yarn)
        if window == args.ws_long:  # key offset: the unrotated half of each key comes from the previous token
            half = D // 2
            k = torch.cat([k[:, :, :half], torch.cat([k[:1, :, half:], k[:-1, :, half:]], 0)], -1)
        rows = T
    else:  # adjacent heads interleaved into one sequence of twice the length
        q = rotary(q.reshape(T, H // 2, 2 * D), args.yarn_paired).reshape(2 * T, H // 2, D)
        k = rotary(k.reshape(T, H // 2, 2 * D), args.yarn_paired).reshape(2 * T, H // 2, D)
        v = v.reshape(2 * T, H // 2, D)
        doc = doc.repeat_interleave(2)
        rows = 2 * T
    aux = None
    if ve is not None:
        if ve_gate is None:
            gate_w = p["ve_gate_bank"][value_table(layer, cfg.value_layers)]
            # #70: 2 sigmoid(cat(x[:6], ve[:6]) . w), bf16 logits; record 84: paired layers too (L1448-1453)
            if cfg.ve_gate_reads_ve and (not paired or cfg.paired_ve_gate_reads_ve):
                gate_in = torch.cat([h[:, :GATE // 2], ve[:, :GATE // 2]], -1)
            else:
                gate_in = h[:, :GATE]
            gate = 2 * torch.sigmoid(linear(gate_in, gate_w).float())
        else:
            gate = ve_gate
        aux = gate.reshape(rows, -1, 1) * ve.float().reshape(rows, -1, D)
    if v_add is not None:
        aux = v_add.reshape(rows, -1, D) if aux is None else aux + v_add.reshape(rows, -1, D)
    if aux is not None:
        v = v + aux
    v = bf(v)
    scale = args.yarn_paired.attn_scale if paired else args.yarn.attn_scale
    q, k = bf(q), bf(k)
    y = attention(q, k, v, doc, window, scale)
    if cfg.mudd_gate:
        gates = gates or LayerGates()
        if gates.dc is not None:
            y = dc_mha(y, q, k, v, doc, *dc_weights(*gates.dc), scale)
        y = y.reshape(T, H, D)
        yf = xsa_r86(y, v, gates.xsa) if gates.xsa is not None else y.float()
        if gates.out is not None:
            yf = yf * gates.out.float().unsqueeze(-1)
        if gates.xsa is not None or gates.out is not None:
            y = bf(yf)
        return linear(y.reshape(T, C), w_o)
    y = y.reshape(T, H, D)
    gate = torch.sigmoid(linear(h[:, :GATE], p["attn_gate_bank"][attn_index(layer)]).float())
    if layer in cfg.xsa_layers:
        y = xsa(y, v, p["xsa_alphas"][layer])
    y = bf(y.float() * gate.unsqueeze(-1))
    return linear(y.reshape(T, C), w_o)


class ReluSquarePostOnly(torch.autograd.Function):
    """Record 87: post = bf16(relu(pre)^2) (pre bf16, as the bf16 path), but the backward keeps post only and takes
    relu(pre) as sqrt(fp32(post)) (75d6867a linear_relu_square_kernel's backward branch: c = bf16(g W2^T), then
    bf16(2 c sqrt(fp32(post))), the product in fp32 and rounded once). sqrt(post) is relu(pre) up to post's bf16
    rounding (relative 2^-9 at most, halved by the root). IEEE sqrt here; upstream's tl.sqrt lowers to an
    approximate fp32 root (sqrt.approx), which can move a bf16 result only where it lies at a rounding midpoint."""

    @staticmethod
    def forward(ctx, pre):
        post = bf(torch.relu(pre.float()).square())
        ctx.save_for_backward(post)
        return post

    @staticmethod
    def backward(ctx, g):
        post, = ctx.saved_tensors
        return bf(2 * g.float() * torch.sqrt(post.float()))


def relu_square(pre: torch.Tensor, post_only: bool = False) -> torch.Tensor:
    """bf16(relu(pre)^2); its backward bf16(2 g relu(pre)) (autograd through fp32), or record 87's from post."""
    return ReluSquarePostOnly.apply(pre) if post_only else bf(torch.relu(pre.float()).square())


def mlp_block(h: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor, fp8: bool = False,
              down: Optional[Tuple["MlpDownState", int]] = None, post_only: bool = False) -> torch.Tensor:
    """relu(h @ c_fc^T)^2 @ c_proj, pre and post activations in bf16 (upstream's fused kernel). fp8: record
    84's e4m3 up-projection (Fp8UpProjection) for pre; the rest, and every gradient, as the bf16 path.
    down = (state, layer): record 89's e4m3 down-projection (Fp8DownProjection) with that layer's scales; the
    layer's amax of post is recorded in the state (MlpDownState.end_forward turns it into the next act).
    post_only: record 87's backward through relu^2 from post alone (ReluSquarePostOnly; with down as well: 75d6867a
    emits the e4m3 post from the same bf16 post the backward keeps)."""
    pre = Fp8UpProjection.apply(h, c_fc) if fp8 else linear(h, c_fc)
    post = relu_square(pre, post_only)
    if down is not None:
        state, layer = down
        state.record_amax(layer, post)
        return Fp8DownProjection.apply(post, c_proj, state.w2q[layer], state.act[layer], state.used[layer])
    return bf(post.float() @ c_proj.float())


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_up_projection(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Upstream's quantize_mlp_fp8 (a333be08 L1332-1343, eager bf16 ops) for one c_fc: w_s =
    bf16(max|W| / 448) (the amax of bf16 values is exact; the division is a bf16 op), Wq = e4m3(bf16(W / w_s)).
    Returns (Wq, w_s as fp32)."""
    w_s = bf(w.abs().amax().float().clamp_min(1e-12) / E4M3_MAX)
    wq = to_fp8(bf(w.float() / w_s.float()).float(), torch.float8_e4m3fn)
    return wq, w_s.float()


def quantize_activation(h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training forward's MLP input quantization (L1479-1483): a = max|h| over the whole micro-batch
    (bf16, exact, clamped >= 1e-12), xq = e4m3(h * (448 / a)) with the scale formed in fp32 (the compiled
    graph fuses it; eager would round 448 / a to bf16). Returns (xq, a as fp32)."""
    a = h.detach().abs().amax().float().clamp_min(1e-12)
    scale = torch.tensor(E4M3_MAX, dtype=torch.float32) / a
    return to_fp8(h.detach().float() * scale, torch.float8_e4m3fn), a


class Fp8UpProjection(torch.autograd.Function):
    """pre = bf16((xq @ Wq^T) * dequant): the e4m3 operands' products summed in fp32 (exact products; the
    GPU's FP8 MMA accumulates them in its own order), dequant = (w_s * a) / 448 in fp32 as upstream's
    _mlp_dequant_scale_buf (copy_(w_s).mul_(a).div_(448)), applied to the fp32 accumulator before the bf16
    rounding (triton_kernels.py@a333be08 L435-436). Wq is formed from the current c_fc at each forward: upstream
    re-quantizes after every optimizer step, and c_fc changes only there, so the values are the same.
    Backward (FusedLinearReLUSquareFunction.backward): bf16 from the bf16 input and c_fc, as a linear."""

    @staticmethod
    def forward(ctx, h, w):
        wq, w_s = quantize_up_projection(w)
        xq, a = quantize_activation(h)
        dequant = (w_s * a) / E4M3_MAX
        ctx.save_for_backward(h, w)
        return bf((xq.float() @ wq.float().t()) * dequant)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        gf = g.float()
        return bf(gf @ w.float()), bf(gf.t() @ h.float())


# Record 89: the FP8 MLP down-projection with delayed scaling (upstream 75d6867a quantize_mlp_fp8 train_gpt.py
# L1403-1434, the forward's use_mlp_fp8 branch L1643-1675, triton_kernels.py L403-785; its PR on a333be08 as
# 2026-07-17_FP8DownProjection/this_pr logs it).
MLP_DOWN_BOOTSTRAP_STEPS = 16   # quantize_mlp_fp8(bootstrap_down=(step < 16)) after optimizer step `step`
MLP_DOWN_WEIGHT_HEADROOM = 1.12  # quantize_transpose_mlp_down_weights' headroom
MLP_DOWN_ACT_HEADROOM = 1.80     # reduce_mlp_activation_scales(headroom=1.80) after the layers
AMAX_FLOOR = 1e-12


def delayed_scale(amax: torch.Tensor, headroom: float) -> torch.Tensor:
    """reduce_mlp_activation_scales_kernel: max(amax, 1e-12) * (HEADROOM / 448.0), the constexpr quotient folded in
    double and rounded once to fp32 where it multiplies the fp32 amax (not fp32(headroom) / fp32(448))."""
    return torch.maximum(amax.float(), torch.tensor(AMAX_FLOOR, dtype=torch.float32)) * \
        torch.tensor(headroom / E4M3_MAX, dtype=torch.float32)


class MlpDownState:
    """Upstream's three persistent fp32 buffers of 12 (one per mlp_bank entry; all ones at the start, and again
    after the warm-up's state restore), W2q and the forward's per-layer amax of post:
      act[l]   _mlp_down_act_scales: the activations' scale, set by each training forward for the next one;
      used[l]  _mlp_down_proj_scales: the scale W2q was quantized with (the _scaled_mm's scale_b);
      next[l]  _mlp_down_proj_next_scales: the scale the next quantization will use.
    quantize_weights() is quantize_mlp_fp8's down half, after every optimizer step (bootstrap while step < 16) and
    at the start (bootstrap); the training forward reads act and used (Fp8DownProjection), record_amax() keeps
    each layer's max of its bf16 post and end_forward() turns them into act for the NEXT training forward (per
    micro-step, per rank, never all-reduced). Validation runs the bf16 MLP and touches none of it.
    Divisions are IEEE fp32 here; upstream's Triton `/` (W2 / next, 1.0 / act) lowers to div.full.f32 (within
    2 ulp), which can move an e4m3 code where the quotient lies within 2 ulp of a rounding midpoint."""

    def __init__(self, entries: int = LAYERS + 1):
        self.act = torch.ones(entries, dtype=torch.float32)
        self.used = torch.ones(entries, dtype=torch.float32)
        self.next = torch.ones(entries, dtype=torch.float32)
        self.w2q: Optional[torch.Tensor] = None  # (entries, H, C) e4m3: c_proj's layout (upstream stores W2^T)
        self.amax: Dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def quantize_weights(self, mlp_bank: torch.Tensor, bootstrap: bool) -> None:
        """W2 = mlp_bank[:, 1] (bf16). Bootstrap (eager bf16 torch): next = bf16(max(max|W2|, bf16(1e-12)) / 448)
        (the clamp's scalar in bf16, the division in fp32 rounded to bf16). Then (the Triton kernel and its reduce):
        used = next; W2q = e4m3(clamp(fp32(W2) / used, +-448)); next = max(max|W2|, 1e-12) * fp32(1.12 / 448)."""
        w = mlp_bank.detach()[:, 1]
        amax = w.abs().amax(dim=(1, 2))  # bf16, exact
        if bootstrap:
            floor = torch.tensor(AMAX_FLOOR, dtype=torch.bfloat16).float()
            self.next = bf(torch.maximum(amax.float(), floor) / E4M3_MAX).float()
        self.used = self.next.clone()
        q = (w.float() / self.used[:, None, None]).clamp(max=E4M3_MAX).clamp(min=-E4M3_MAX)
        self.w2q = q.to(torch.float8_e4m3fn)
        self.next = delayed_scale(amax.float(), MLP_DOWN_WEIGHT_HEADROOM)

    def record_amax(self, layer: int, post: torch.Tensor) -> None:
        """linear_relu_square's EMIT_FP8 partials: the max of the layer's bf16 post (>= 0), as fp32 (every tile
        of the (T, H) post counted once: the scratch sized to the actual tile count)."""
        self.amax[layer] = post.detach().float().amax()

    def end_forward(self) -> None:
        """reduce_mlp_activation_scales(headroom=1.80) after the training forward's layers: act[l] of each layer
        whose MLP ran."""
        for layer, a in sorted(self.amax.items()):
            self.act[layer] = delayed_scale(a, MLP_DOWN_ACT_HEADROOM)
        self.amax = {}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The persistent buffers (upstream's state_dict holds act, used, next) and W2q (quantize_mlp_fp8's
        output, a pure function of W2 and used)."""
        return dict(act=self.act.clone(), used=self.used.clone(), next=self.next.clone(),
                    w2q=None if self.w2q is None else self.w2q.clone())

    def load_state_dict(self, d: Dict[str, torch.Tensor]) -> None:
        self.act, self.used, self.next = d["act"].clone(), d["used"].clone(), d["next"].clone()
        self.w2q = None if d["w2q"] is None else d["w2q"].clone()
        self.amax = {}


def quantize_post(post: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """The EMIT_FP8 epilogue: postq = e4m3(min(post * (1 / act), 448)), 1 / act an fp32 division (Triton's 1.0 /
    tl.load(act)), the bf16 post widened to fp32 for the product, no lower clamp (post >= 0)."""
    inv = torch.tensor(1.0, dtype=torch.float32) / act
    return to_fp8(torch.minimum(post.detach().float() * inv, torch.tensor(E4M3_MAX)), torch.float8_e4m3fn)


class Fp8DownProjection(torch.autograd.Function):
    """out = bf16(fp32(postq @ W2q) * (act * used)) with postq = e4m3(min(post * (1 / act), 448)) (the epilogue:
    1 / act in fp32, the bf16 post widened to fp32 for the product, post >= 0 so no lower clamp) and the e4m3
    products summed in fp32 (the GPU's FP8 MMA with fast accumulation sums them less precisely), then
    torch._scaled_mm's scale_a = act, scale_b = used applied to the fp32 sum as one fp32 factor act * used
    (cuBLASLt's alpha * scaleA * scaleB; the emu's cuBLASLt and scripts/upstream_cpu's stand-in alike).
    Backward (FusedLinearReLUSquareFunction.backward, unchanged): bf16 from post and W2, the bf16 path's
    d post = bf16(g @ W2^T) and dW2 = bf16(post^T @ g)."""

    @staticmethod
    def forward(ctx, post, w2, w2q, act, used):
        ctx.save_for_backward(post, w2)
        return bf((quantize_post(post, act).float() @ w2q.float()) * (act * used))

    @staticmethod
    def backward(ctx, g):
        post, w2 = ctx.saved_tensors
        gf = g.float()
        return bf(gf @ w2.float().t()), bf(post.float().t() @ gf), None, None, None


def bigram_sign_index(inputs: torch.Tensor, rows: int) -> torch.Tensor:
    """Record 83's sign row per position (a333be08 L1390-1392): 0 at t = 0, (tok[t-1] XOR tok[t]) mod rows after,
    over the whole micro-batch (across document boundaries)."""
    idx = torch.zeros_like(inputs)
    idx[1:] = torch.bitwise_xor(inputs[:-1], inputs[1:]) % rows
    return idx


def mudd_coefficients(p: Dict[str, torch.Tensor], h: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Record 81's forward_mudd (a333be08 L1326-1330): c = (gelu(h W1[block]^T) W2[block, :n]^T + b2[block, :n])
    * 0.1, exact-erf GELU; both matmuls bf16 (z and u = gelu(z) materialized), the bias and scale fused and
    rounded once to bf16 (the (T, n) tensor its many readers share). Returns (T, n) bf16."""
    z = linear(h, p["mudd_w1"][block])
    u = bf(F.gelu(z.float()))
    lin = linear(u, p["mudd_w2"][block, :n])
    return bf((lin.float() + p["mudd_b2"][block, :n].float()) * MUDD_SCALE)


def forward(cfg: Config, p: Dict[str, torch.Tensor], batch: Batch, args: ForwardArgs, training: bool) -> torch.Tensor:
    """Training: the FP8 lm_head and the MTP loss summed over rows (r80's fused CE: the per-token losses).
    Eval: bf16 lm_head, mean CE."""
    V = cfg.padded_vocab
    s = p["scalars"]
    slots = scalar_slots(cfg)
    doc = batch.doc_ids()
    emb = EmbeddingRows.apply(p["embed"], batch.inputs)
    x_bigram = EmbeddingRows.apply(p["bigram_embed"], batch.bigram).float()
    if cfg.bigram_sign_rows:  # record 83: row t times sign row (tok[t-1] ^ tok[t]) mod rows (exact: +-1)
        if args.bigram_signs is None:
            raise ValueError(f"config '{cfg.name}' has a bigram sign table: ForwardArgs.bigram_signs is needed")
        x_bigram = x_bigram * args.bigram_signs[bigram_sign_index(batch.inputs, cfg.bigram_sign_rows)].float()
    ve_ids = (torch.arange(len(cfg.value_layers))[:, None] * V + batch.inputs[None, :])
    ve_all = EmbeddingRows.apply(p["value_embeds"], ve_ids)  # (tables, T, C)

    # smear: token t gets smear_lambda * sigmoid(emb[t, :12] . smear_gate) * emb[t-1]
    g = torch.sigmoid(linear(emb[1:, :GATE], p["smear_gate"]).float())
    e = emb.float()
    x = bf(torch.cat([e[:1], e[1:] + s[slots.smear] * g * e[:-1]]))
    x0 = bf(rms_norm(x))
    if cfg.mudd_gate:
        x, backout = residual_stream_r86(cfg, p, x0, x_bigram, ve_all, doc, args, training)
    elif cfg.sublayer_lambdas:
        x, backout = residual_stream_r80(cfg, p, x0, x_bigram, ve_all, doc, args, training)
    else:
        x, backout = residual_stream_r71(cfg, p, x0, x_bigram, ve_all, doc, args)
    if backout is not None:  # (MUDD's exit, inside residual_stream_r80, replaces the backout)
        x = bf(x.float() - s[slots.backout] * backout.float())
    h = bf(rms_norm(x))
    if training and cfg.fused_ce:
        prefix_targets = args.prefix_table[batch.targets] if cfg.prefix_loss else None
        return FusedSoftcappedCE.apply(h, p["lm_head"], batch.targets, args.mtp_weights, cfg.lm_head_x_s,
                                       cfg.lm_head_w_s, cfg.lm_head_grad_s, cfg.grad_scale, prefix_targets,
                                       args.prefix_weight)
    if training:
        logits = Fp8LmHead.apply(h, p["lm_head"], cfg.lm_head_x_s, cfg.lm_head_w_s, cfg.lm_head_grad_s)
        return mtp_loss(logits, batch.targets, args.mtp_weights)
    logits = bf(h.float() @ p["lm_head"].float())
    return eval_loss(logits, batch.targets)


def attention_weights(cfg: Config, p: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """Each attention layer's (4C, C) [Wq; Wk; Wv; Wo], from attn_bank or (r80) from the head-pair banks:
    upstream's qk_bank[:groups].view(layers, -1, C) and vo_bank[:2 layers].view(layers, 2, C, C),
    concatenated per layer."""
    if not cfg.head_pair_banks:
        return list(p["attn_bank"].unbind(0))
    qk, _, vo, _ = bank_counts(cfg)
    C = cfg.model_dim
    qk_all = p["qk_bank"][:qk].reshape(ATTN_LAYERS, -1, C)
    vo_all = p["vo_bank"][:vo].reshape(ATTN_LAYERS, 2 * C, C)
    return list(torch.cat([qk_all, vo_all], dim=1).unbind(0))


def mudd_entry(p: Dict[str, torch.Tensor], h9: torch.Tensor, h0: torch.Tensor, late: torch.Tensor, H: int):
    """Record 81's MUDD at the last layer's top (upstream a333be08 forward_mudd, id 0): its 14 coefficients (fp32
    copies of the bf16 values) as a column reader, aux_v's dense terms, the update's stream r (fp32 into the update:
    residual_stream_r80's notes) and the value gate (c6 for the first half of the heads, c7 for the rest)."""
    c = mudd_coefficients(p, h9, 0, MUDD_COEFS).float()
    col = lambda j: c[:, j:j + 1]
    h0f, h7f, h9f = h0.float(), late.float(), h9.float()
    v_add = col(0) * h0f + col(1) * h7f + col(2) * h9f
    r = (1 + col(5)) * h9f + col(3) * h0f + col(4) * h7f
    ve_gate = torch.cat([col(6).expand(-1, H // 2), col(7).expand(-1, H - H // 2)], -1)
    return col, v_add, r, ve_gate


def residual_stream_r80(cfg: Config, p: Dict[str, torch.Tensor], x0: torch.Tensor, x_bigram: torch.Tensor,
                        ve_all: torch.Tensor, doc: torch.Tensor, args: ForwardArgs, training: bool = False):
    """Records 73-77 (upstream @2c702746 GPT.forward): x = x0 + lb[0] bigram; per layer i
      i = 6: x += skip_gate_out * h3 (no attention, no injection);
      else:  x = ra[i] x + pa[i] attn(norm(h7 if i > 7 else x)) + (lx0[i] x0 + lb[i] bigram, no bigram at 0);
      every layer: x = rm[i] x + pm[i] MLP(norm(x)); h3, h7 = x after layers 3, 7.
    Lambdas are rounded to bf16 before use (upstream's .bfloat16().unbind), so their gradients are fp32
    sums rounded to bf16; each update is computed in fp32 from bf16 values and rounded once (inductor
    fuses it). Returns the stream and h7 (the backout source).

    Records 81-84 (a333be08 GPT.forward L1390-1499), each a Config switch:
      bigram_dim: x_bigram is (T, bigram_dim), added into channels [0, bigram_dim) only, by an in-place slice add
        after each update: ((ra x + pa y) + lx0 x0) + lb xb, one rounding (inductor fuses the slice add);
      x0_includes_bigram: x = x0 = norm(..), then x[:, :bd] += lb[0] xb in place changes x0 too (the same
        tensor): the injections, the skip gate and MUDD's h0 read the stream start;
      mudd: at the last layer, c = mudd(h9, block 0, 14): aux_v = g ve + c0 h0 + c1 h7 + c2 h9 (g = c6 for
        the first half of the heads, c7 for the rest), r = (1 + c5) h9 + c3 h0 + c4 h7 and aux_v stay fp32 (each
        has one reader, which inductor fuses them into: aux_v into v's rounding, r into the attention update's),
        x = bf16(c8 r + c9 attn + c10 h0 (+ c11 xb on the bigram channels)), x = bf16(c12 x + c13 MLP(norm x));
        after the loop c' = mudd(x, block 1, 5), x = bf16(x + c'0 h0 + c'1 h7 + c'2 h9 + c'3 ve0 + c'4 h3)
        (ve0: value table 0 at the tokens) instead of the backout (returned None);
      mlp_up_fp8: the training forward's MLP up-projections in e4m3 (Fp8UpProjection)."""
    s, slots = p["scalars"], scalar_slots(cfg)
    lam = lambda name: bf(p[name]).float()
    resid, post, lx0, lb = lam("resid_lambdas"), lam("post_lambdas"), lam("x0_lambdas"), lam("bigram_lambdas")
    C, H = cfg.model_dim, cfg.num_heads
    narrow = cfg.bigram_dim != 0  # record 84's in-place injection (and its order of sums), any width
    xb = F.pad(x_bigram, (0, C - x_bigram.shape[-1])) if x_bigram.shape[-1] < C else x_bigram  # zeros: exact
    x0f = x0.float()
    x = bf(x0f + lb[0] * xb)
    if cfg.x0_includes_bigram:
        x0, x0f = x, x.float()
    skip_gate = torch.sigmoid(s[slots.skip]) * 2 * torch.sigmoid(linear(x0[:, :GATE], p["skip_gate"]).float())
    attn_w = attention_weights(cfg, p)
    mlp_w = [pair.unbind(0) for pair in p["mlp_bank"].unbind(0)]
    fp8 = training and cfg.mlp_up_fp8
    down = training and cfg.mlp_fp8_down
    if down and args.mlp_down is None:
        raise ValueError(f"config '{cfg.name}' has the FP8 down-projection: ForwardArgs.mlp_down is needed")
    h0 = x
    skip = late = backout = h9 = None
    for i in range(LAYERS):
        entry = cfg.mudd and i == LAYERS - 1
        if not has_attention(i):
            x = bf(x.float() + skip_gate * skip.float())
        else:
            table = value_table(i, cfg.value_layers)
            source = late if late is not None else x
            ve_gate = v_add = None
            if entry:
                h9 = x
                col, v_add, r, ve_gate = mudd_entry(p, h9, h0, late, H)
            y = attention_block(cfg, p, i, bf(rms_norm(source)), attn_w[attn_index(i)],
                                ve_all[table] if table >= 0 else None, doc, args, ve_gate, v_add)
            if entry:
                x = bf(col(8) * r + col(9) * y.float() + col(10) * h0.float() + col(11) * xb)
            elif narrow:
                upd = resid[i, 0] * x.float() + post[i, 0] * y.float() + lx0[i] * x0f
                x = bf(upd if i == 0 else upd + lb[i] * xb)
            else:
                inject = lx0[i] * x0f if i == 0 else lx0[i] * x0f + lb[i] * x_bigram
                x = bf(resid[i, 0] * x.float() + post[i, 0] * y.float() + inject)
        m = mlp_block(bf(rms_norm(x)), *mlp_w[i], fp8=fp8, down=(args.mlp_down, i) if down else None,
                      post_only=cfg.mlp_post_only)
        if entry:
            x = bf(col(12) * x.float() + col(13) * m.float())
        else:
            x = bf(resid[i, 1] * x.float() + post[i, 1] * m.float())
        if i == SKIP_FROM:
            skip = x
        if i == cfg.late_attn_source:
            late = x
        if i == BACKOUT_LAYER:
            backout = x
    if down:  # reduce_mlp_activation_scales after the layers: the next training forward's act
        args.mlp_down.end_forward()
    if cfg.mudd:
        c = mudd_coefficients(p, x, 1, MUDD_EXIT_COEFS).float()
        ve0 = ve_all[0].float()
        x = bf(x.float() + c[:, 0:1] * h0.float() + c[:, 1:2] * late.float() + c[:, 2:3] * h9.float()
               + c[:, 3:4] * ve0 + c[:, 4:5] * skip.float())
        backout = None
    return x, backout


def mudd_gate(p: Dict[str, torch.Tensor], h: torch.Tensor, gate: int, n: int) -> torch.Tensor:
    """Record 85's forward_mudd_gate (003ff3e2 L1394-1396): G = (gelu(h W1[gate]^T) W2[gate, :n]^T + b2[gate, :n]) *
    bf16(_mudd_gate_scale) (`type_as(x)`, an explicit cast of the fp32 scalar), exact-erf GELU; both matmuls bf16 (z
    and u materialized), the bias and scale fused and rounded once to bf16 (the (T, n) tensor its readers share), as
    mudd_coefficients. The scale's gradient: the fp32 sum of dG P (P = lin + b2) rounded to bf16 at the cast, then
    widened. Returns (T, n) bf16."""
    z = linear(h, p["mudd_gate_w1"][gate])
    u = bf(F.gelu(z.float()))
    lin = linear(u, p["mudd_gate_w2"][gate, :n])
    return bf((lin.float() + p["mudd_gate_b2"][gate, :n].float()) * bf(p["mudd_gate_scale"][0]).float())


def residual_stream_r86(cfg: Config, p: Dict[str, torch.Tensor], x0: torch.Tensor, x_bigram: torch.Tensor,
                        ve_all: torch.Tensor, doc: torch.Tensor, args: ForwardArgs, training: bool = False):
    """Records 85-86 (003ff3e2 GPT.forward L1415-1602): record 84's stream (residual_stream_r80 with MUDD) with the
    MUDD gate's per-token columns (mudd_gate_layout) in place of its lambdas and gates:
      G0 = mudd_gate(x0, 0, 26) from the clean normed embedding x0; x = bf16(x0 + Gb[0] xb) is a copy (x0.clone():
        x0 stays clean for every x0 injection) and MUDD's h0;
      G1 = mudd_gate(h3, 1, 41) at the top of layer 4, from its input;
      attention layers i != 10: x = bf16(((ra x + pa y) + Gx0[i] x0) + Gb[i] xb) (no bigram term at layer 0; one
        rounding: inductor fuses the full-width slice add); the layer's XSA (1, 3, 4, 7), output gate (3) and, on
        layer 10, output gate and DC weights are passed to attention_block (LayerGates);
      layer 6: x = bf16(x + sigmoid(skip_lambda) G1[28] h3);
      layer 10: MUDD's entry as record 84 (its x0 coefficient reads h0, its bigram coefficient the full-width xb);
      after the loop: MUDD's exit as record 84.
    The lambdas are bf16-rounded as record 80's; the gate columns are bf16 values used in fp32 expressions. Returns
    the stream and None (no backout)."""
    s, slots = p["scalars"], scalar_slots(cfg)
    lam = lambda name: bf(p[name]).float()
    resid, post = lam("resid_lambdas"), lam("post_lambdas")
    H = cfg.num_heads
    layout = mudd_gate_layout()
    G = [mudd_gate(p, x0, 0, MUDD_GATE_COEFS[0]).float(), None]

    def read(kind: str, layer: int) -> Optional[torch.Tensor]:
        where = layout.get((kind, layer))
        if where is None:
            return None
        gate, start, width = where
        return G[gate][:, start:start + width]

    def read_bf16(kind: str, layer: int) -> Optional[torch.Tensor]:  # per-head readers take the bf16 values
        c = read(kind, layer)
        return None if c is None else bf(c)  # (exact: G holds bf16 values)

    xb = x_bigram
    x0f = x0.float()
    x = bf(x0f + read("bigram", 0) * xb)
    attn_w = attention_weights(cfg, p)
    mlp_w = [pair.unbind(0) for pair in p["mlp_bank"].unbind(0)]
    fp8 = training and cfg.mlp_up_fp8
    down = training and cfg.mlp_fp8_down
    if down and args.mlp_down is None:
        raise ValueError(f"config '{cfg.name}' has the FP8 down-projection: ForwardArgs.mlp_down is needed")
    h0 = x
    skip = late = h9 = None
    for i in range(LAYERS):
        entry = i == LAYERS - 1
        if i == MUDD_GATE_POST_LAYER:
            G[1] = mudd_gate(p, x, 1, MUDD_GATE_COEFS[1]).float()
        if not has_attention(i):
            x = bf(x.float() + torch.sigmoid(s[slots.skip]) * read("skip", i) * skip.float())
        else:
            table = value_table(i, cfg.value_layers)
            source = late if late is not None else x
            ve_gate = v_add = None
            if entry:
                h9 = x
                col, v_add, r, ve_gate = mudd_entry(p, h9, h0, late, H)
            dc = None
            if cfg.dc_mha and i == DC_LAYER:
                dc = (read_bf16("dc_w1", i), read_bf16("dc_w2", i))
            gates = LayerGates(xsa=read_bf16("xsa", i), out=read_bf16("out", i), dc=dc)
            y = attention_block(cfg, p, i, bf(rms_norm(source)), attn_w[attn_index(i)],
                                ve_all[table] if table >= 0 else None, doc, args, ve_gate, v_add, gates)
            if entry:
                x = bf(col(8) * r + col(9) * y.float() + col(10) * h0.float() + col(11) * xb)
            else:
                upd = resid[i, 0] * x.float() + post[i, 0] * y.float() + x0f * read("x0", i)
                x = bf(upd if i == 0 else upd + xb * read("bigram", i))
        m = mlp_block(bf(rms_norm(x)), *mlp_w[i], fp8=fp8, down=(args.mlp_down, i) if down else None,
                      post_only=cfg.mlp_post_only)
        if entry:
            x = bf(col(12) * x.float() + col(13) * m.float())
        else:
            x = bf(resid[i, 1] * x.float() + post[i, 1] * m.float())
        if i == SKIP_FROM:
            skip = x
        if i == cfg.late_attn_source:
            late = x
    if down:
        args.mlp_down.end_forward()
    c = mudd_coefficients(p, x, 1, MUDD_EXIT_COEFS).float()
    x = bf(x.float() + c[:, 0:1] * h0.float() + c[:, 1:2] * late.float() + c[:, 2:3] * h9.float()
           + c[:, 3:4] * ve_all[0].float() + c[:, 4:5] * skip.float())
    return x, None


def residual_stream_r71(cfg: Config, p: Dict[str, torch.Tensor], x0: torch.Tensor, x_bigram: torch.Tensor,
                        ve_all: torch.Tensor, doc: torch.Tensor, args: ForwardArgs):
    """Record 71's layers: the per-layer mix resid x + x0 lambda x0 + bigram lambda bigram before each
    layer, then both blocks. Returns the stream and the backout snapshot (after layer 7)."""
    s = p["scalars"]
    x = x0
    x0f = x0.float()
    attn_w = p["attn_bank"].unbind(0)
    mlp_w = [pair.unbind(0) for pair in p["mlp_bank"].unbind(0)]
    skip = backout = None
    for i in range(LAYERS):
        if i == SKIP_TO:
            gate = torch.sigmoid(s[SKIP]) * 2 * torch.sigmoid(linear(x0[:, :GATE], p["skip_gate"]).float())
            x = bf(x.float() + gate * skip.float())
        if i == 0:
            x = bf((s[RESID] + p["x0_lambdas"][0]) * x.float() + s[BIGRAM] * x_bigram)
        else:
            x = bf(s[RESID + i] * x.float() + p["x0_lambdas"][i] * x0f + s[BIGRAM + i] * x_bigram)
        if has_attention(i):
            table = value_table(i, cfg.value_layers)
            ve = ve_all[table] if table >= 0 else None
            y = attention_block(cfg, p, i, bf(rms_norm(x)), attn_w[attn_index(i)], ve, doc, args)
            x = bf(x.float() + y.float())
        x = bf(x.float() + mlp_block(bf(rms_norm(x)), *mlp_w[i]).float())
        if i == SKIP_FROM:
            skip = x
        if i == BACKOUT_LAYER:
            backout = x
    return x, backout


# =====================================================================================================
# The optimizer: upstream's NorMuonAndAdam on one rank (every matrix and row its own).
# =====================================================================================================
POLAR_EXPRESS_COEFFS = [  # (a, b, c) for 5 iterations, safety factor 2e-2, cushion 2 (from the record's source)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]

# label: (optim, adam betas, lr_mul, wd_mul), upstream's param_table
PARAM_TABLE = {
    "attn_bank": ("normuon", None, 1.0, 1.0),
    "mlp_bank": ("normuon", None, 1.0, 1.0),
    "scalars": ("adam", (0.9, 0.99), 5.0, 0.0),
    "smear_gate": ("adam", (0.9, 0.99), 0.01, 0.0),
    "skip_gate": ("adam", (0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "ve_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "x0_lambdas": ("adam", (0.65, 0.95), 5.0, 0.0),
    "bigram_embed": ("adam", (0.75, 0.95), 75.0, 5.0),
    "lm_head": ("adam", (0.5, 0.95), 1.0, 150.0),
    "value_embeds": ("adam", (0.75, 0.95), 75.0, 5.0),
    "embed": ("adam", (0.5, 0.95), 1.0, 150.0),
}


def optimizer_table(cfg: Config) -> Dict[str, tuple]:
    return PARAM_TABLE if cfg.optimizer_table is None else cfg.optimizer_table


def normuon_matrices(cfg: Config, name: str) -> Tuple[int, int, int]:
    """(count, rows, cols) of a NorMuon bank's matrices (upstream's .reshape): attn (40, C, C), mlp
    (24, mlp, C); r80: qk (padded groups, 2 head_dim, C), vo (padded, C, C)."""
    C = cfg.model_dim
    if name == "attn_bank":
        return 4 * ATTN_LAYERS, C, C
    if name == "qk_bank":
        return bank_counts(cfg)[1], 2 * cfg.head_dim, C
    if name == "vo_bank":
        return bank_counts(cfg)[3], C, C
    if name == "mlp_bank":
        return 2 * (LAYERS + 1), cfg.mlp_dim, C
    raise ValueError(f"{name} is not a NorMuon bank")


def symmetric_product(X: torch.Tensor, tall: bool) -> torch.Tensor:
    """bf16(X^T X) (tall) or bf16(X X^T) (wide) with fp32 accumulation, as upstream's XTX / XXT Triton
    kernels: they compute the blocks on and above the diagonal and store each mirrored, so the result
    is exactly symmetric (the upper triangle, mirrored)."""
    Xf = X.float()
    M = bf(Xf.mT @ Xf) if tall else bf(Xf @ Xf.mT)
    return mirror_upper(M)


def mirror_upper(M: torch.Tensor) -> torch.Tensor:
    return torch.triu(M) + torch.triu(M, 1).mT


def polar_express_r80(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float) -> torch.Tensor:
    """Upstream's polar_express at 2c702746 (#74): Nesterov fused in, in fp32 with the momentum as an
    fp32 tensor (1 - m is formed in fp32); X = bf16(g), normalized by its own Frobenius norm (fp32 sum
    of the bf16 values, one rounding); then 5 iterations on the small Gram matrix A: wide matrices
    A = X X^T, X <- a X + B X; tall ones A = X^T X, X <- a X + X B (XTX and a right multiply instead of a
    transpose), B = bf16(b A + c A A) (ba_plus_cAA, mirrored likewise). Matrices with more than 1024
    rows form a X + X B in two roundings (upstream's split_baddbmm). Updates momentum_buffer; grad is
    consumed (fp32)."""
    m = torch.tensor(momentum, dtype=torch.float32)
    momentum_buffer.lerp_(grad, 1 - m)
    g = grad.lerp_(momentum_buffer, m)
    rows, cols = g.shape[-2:]
    tall, split = rows > cols, rows > 1024
    Xf = bf(g).float()
    X = bf(Xf / (Xf.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6))
    for a, b, c in POLAR_EXPRESS_COEFFS:
        Xf = X.float()
        A = symmetric_product(X, tall).float()
        B = mirror_upper(bf(c * (A @ A) + b * A)).float()
        XB = Xf @ B if tall else B @ Xf
        X = bf(bf(XB).float() + a * Xf) if split else bf(a * Xf + XB)
    return X


def polar_express(u: torch.Tensor) -> torch.Tensor:
    """Approximate orthogonalization of each (rows, cols) matrix of u (fp32) in bf16 arithmetic:
    X = bf16(u / (||u||_F * 1.02 + 1e-6)), then X <- a X + (b A + c A A) X with A = X X^T, every
    matmul accumulated in fp32 and rounded to bf16 (wide orientation: tall matrices transposed)."""
    rows, cols = u.shape[-2:]
    split = rows > 1024  # upstream forms a X + B X in two roundings for such matrices
    X = bf(u / (u.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6))
    if rows > cols:
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS:
        Xf = X.float()
        A = bf(Xf @ Xf.mT).float()
        B = bf(c * (A @ A) + b * A).float()
        if split:
            X = bf(bf(B @ Xf).float() + a * Xf)
        else:
            X = bf(a * Xf + B @ Xf)
    return X.mT if rows > cols else X


def normuon_variance_reduction(v: torch.Tensor, second_moment: torch.Tensor, beta2: float,
                               scale_bf16: bool = False) -> torch.Tensor:
    """Scales each row (rows >= cols) or column of v by the rsqrt of its running mean square, then
    restores v's Frobenius norm; updates second_moment in place. v bf16 -> bf16. scale_bf16: the
    per-row/column factor is rounded to bf16 first (upstream's v.mul_(final_scale.type_as(v)), an
    explicit cast that inductor keeps; record 71's reference multiplies by the fp32 factor)."""
    rows, cols = v.shape[-2:]
    dim = -1 if rows >= cols else -2
    n = v.shape[dim]
    vf = v.float()
    mean = vf.square().mean(dim=dim, keepdim=True)
    norm = (mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(mean, 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((mean * n) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    scale = step * (norm / new_norm.clamp_min(1e-10))
    if scale_bf16:
        scale = bf(scale).float()
    return bf(vf * scale)


def bf16_bits(p: torch.Tensor) -> torch.Tensor:
    return p.view(torch.int16).to(torch.int32) & 0xFFFF


def bits_bf16(bits: torch.Tensor) -> torch.Tensor:
    signed = bits - ((bits >> 15) & 1) * 65536
    return signed.to(torch.int16).view(torch.bfloat16)


def cautious_update_with_mantissa(p: torch.Tensor, mantissa: torch.Tensor, v: torch.Tensor, wd: float, lr: float):
    """p32 = (p << 16 | mantissa) as fp32; p32 -= p32 * [v p32 >= 0] * wd * lr + v * lr; then the top
    half of p32's bits is the bf16 parameter, the bottom half the mantissa (in place)."""
    wd_t, lr_t = torch.tensor(wd, dtype=torch.float32), torch.tensor(lr, dtype=torch.float32)
    raw = (bf16_bits(p).long() << 16) | mantissa.long()  # uint32 bits in int64, then wrapped to int32
    p32 = (raw - ((raw >> 31) & 1) * (1 << 32)).to(torch.int32).view(torch.float32)
    g = v.float()
    mask = (g * p32) >= 0
    new = p32 - (p32 * mask * wd_t * lr_t) - (g * lr_t)
    new_raw = new.view(torch.int32)
    p.copy_(bits_bf16((new_raw >> 16) & 0xFFFF))
    mantissa.copy_(new_raw & 0xFFFF)


def adam_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float,
                eps: float, step_size: float, eff_wd: float) -> None:
    """Adam with cautious weight decay (decay only where update and parameter agree in sign), fp32 math,
    the parameter rounded once to its dtype."""
    g = g.float()
    ss, wd = torch.tensor(step_size, dtype=torch.float32), torch.tensor(eff_wd, dtype=torch.float32)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    u = m.div(v.sqrt().add_(eps)).mul_(ss)
    pf = p.float()
    mask = ((u * pf) > 0).float()
    u.add_(wd * pf * mask)
    p.copy_(pf - u)


class NorMuonAdam:
    """Upstream's NorMuonAndAdam at world size 1. Gradients are the parameters' .grad (already the
    gradient of loss * grad_scale summed over micro-steps). Adam parameters step on odd steps only and
    keep accumulating their gradients over the even ones; embed is tied to lm_head^T until the split."""

    def __init__(self, cfg: Config, params: Dict[str, torch.Tensor]):
        self.cfg, self.params = cfg, params
        self.table = optimizer_table(cfg)
        self.state: Dict[str, dict] = {}
        for name, (optim, _, _, _) in self.table.items():
            t = params[name]
            if optim == "adam":
                self.state[name] = dict(step=0, exp_avg=torch.zeros(t.shape, dtype=torch.float32),
                                        exp_avg_sq=torch.zeros(t.shape, dtype=torch.float32))
            else:
                count, rows, cols = normuon_matrices(cfg, name)
                sm_shape = (count, rows, 1) if rows >= cols else (count, 1, cols)
                self.state[name] = dict(momentum=torch.zeros((count, rows, cols), dtype=torch.float32),
                                        second_moment=torch.zeros(sm_shape, dtype=torch.float32),
                                        mantissa=torch.zeros((count, rows, cols), dtype=torch.int32))
        self.split_embed = False

    def lr_muls(self, name: str) -> List[float]:
        """NorMuon's per-matrix lr multiplier: max(1, rows/cols)^0.5, and 2x on the MLP's c_proj
        (odd matrices of the (24, mlp, C) view)."""
        count, rows, cols = normuon_matrices(self.cfg, name)
        shape = max(1.0, rows / cols) ** 0.5 * self.table[name][2]
        return [shape * (2.0 if name == "mlp_bank" and i % 2 == 1 else 1.0) for i in range(count)]

    @torch.no_grad()
    def step(self, step: int, lr_schedule: float, momentum: float) -> None:
        cfg, P = self.cfg, self.params
        do_adam = Schedule.is_adam_step(step)
        lm, embed = P["lm_head"], P["embed"]
        if do_adam and not self.split_embed and embed.grad is not None:
            lm.grad.add_(embed.grad.t())  # tied: embed's gradient joins lm_head's
        for name, (optim, betas, lr_mul, wd_mul) in self.table.items():
            t = P[name]
            if t.grad is None:
                continue
            if optim == "adam":
                if not do_adam or (name == "embed" and not self.split_embed):
                    continue
                st = self.state[name]
                st["step"] += 1
                lr = cfg.adam_lr * lr_schedule * lr_mul
                b1, b2 = betas
                bias1, bias2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
                adam_update(t.data, t.grad, st["exp_avg"], st["exp_avg_sq"], b1, b2, cfg.adam_eps,
                            lr * (bias2 ** 0.5 / bias1), lr * lr * cfg.adam_weight_decay * wd_mul)
            else:
                self._normuon(name, lr_schedule, momentum, wd_mul)
        if do_adam and not self.split_embed:
            embed.data.copy_(lm.data.t())
        for name, (optim, _, _, _) in self.table.items():
            if optim == "normuon" or do_adam:
                P[name].grad = None

    def _normuon(self, name: str, lr_schedule: float, momentum: float, wd_mul: float) -> None:
        cfg, t, st = self.cfg, self.params[name], self.state[name]
        count, rows, cols = normuon_matrices(cfg, name)
        g = t.grad.reshape(count, rows, cols).float()
        if cfg.polar_express_xtx:
            X = polar_express_r80(g, st["momentum"], momentum)
        else:
            st["momentum"].lerp_(g, 1 - momentum)
            X = polar_express(g.lerp_(st["momentum"], momentum))
        v = normuon_variance_reduction(X, st["second_moment"], cfg.normuon_beta2, cfg.normuon_scale_bf16)
        lr = cfg.normuon_lr * lr_schedule
        wd = wd_mul * cfg.normuon_weight_decay * lr
        view = t.data.view(count, rows, cols)
        for i, mul in enumerate(self.lr_muls(name)):
            cautious_update_with_mantissa(view[i], st["mantissa"][i], v[i], wd, mul * lr)

    def untie(self) -> None:
        """At the split step: embed takes lm_head's Adam state (transposed) and step count."""
        lm, em = self.state["lm_head"], self.state["embed"]
        em["step"] = lm["step"]
        em["exp_avg"].copy_(lm["exp_avg"].t())
        em["exp_avg_sq"].copy_(lm["exp_avg_sq"].t())
        self.split_embed = True


# =====================================================================================================
# Training at world size 1: upstream's main loop around the pieces above.
# =====================================================================================================
class Trainer:
    def __init__(self, cfg: Config, params: Dict[str, torch.Tensor], bigram_signs: Optional[torch.Tensor] = None):
        """bigram_signs: record 83's sign table (bigram_sign_rows, bigram_width) bf16, for configs with one."""
        cfg.validate()
        if bool(cfg.bigram_sign_rows) != (bigram_signs is not None):
            raise ValueError(f"config '{cfg.name}' has {cfg.bigram_sign_rows} bigram sign rows: a sign table is "
                             "needed exactly when it has some")
        if bigram_signs is not None and (tuple(bigram_signs.shape) != (cfg.bigram_sign_rows, cfg.bigram_width)
                                         or bigram_signs.dtype != torch.bfloat16):
            raise ValueError(f"the sign table is {tuple(bigram_signs.shape)} {bigram_signs.dtype}, want "
                             f"{(cfg.bigram_sign_rows, cfg.bigram_width)} torch.bfloat16")
        self.bigram_signs = bigram_signs
        shapes = param_shapes(cfg)
        for name, (shape, dtype) in shapes.items():
            if tuple(params[name].shape) != shape or params[name].dtype != dtype:
                raise ValueError(f"parameter {name} is {tuple(params[name].shape)} {params[name].dtype}, "
                                 f"want {shape} {dtype}")
        self.cfg = cfg
        self.params = {n: params[n].detach().clone().requires_grad_(True) for n in param_names(cfg)}
        self.optimizer = NorMuonAdam(cfg, self.params)
        self.schedule = Schedule(cfg)
        self.yarn = Yarn(cfg.head_dim, cfg.yarn_max_seq_len, paired=False)
        self.yarn_paired = Yarn(cfg.head_dim, cfg.yarn_max_seq_len, paired=True)
        self.ws_short, self.ws_long = cfg.stages[0].ws_short, cfg.stages[0].ws_long
        self.mtp_weights = self.schedule.mtp_weights(0)
        self.prefix_table = load_prefix_table() if cfg.prefix_loss else None
        self.prefix_weight = self.schedule.prefix_weight(0)
        # record 89: quantize_mlp_fp8(bootstrap_down=True) after the warm-up's restore, scales all 1
        self.mlp_down = MlpDownState() if cfg.mlp_fp8_down else None
        if self.mlp_down is not None:
            self.mlp_down.quantize_weights(self.params["mlp_bank"], bootstrap=True)

    def advance(self, step: int) -> None:
        """Upstream's advance_schedule: the step's windows (YaRN follows a long-window change) and MTP
        weights. The batch size is the data side's (Schedule.batch_tokens)."""
        ws_short, ws_long = self.schedule.windows(step)
        if ws_long != self.ws_long:
            bs = self.cfg.block_size
            self.yarn.apply(self.ws_long * bs, ws_long * bs)
            self.yarn_paired.apply(self.ws_long * bs, ws_long * bs)
        self.ws_short, self.ws_long = ws_short, ws_long
        self.mtp_weights = self.schedule.mtp_weights(step)
        self.prefix_weight = self.schedule.prefix_weight(step)

    def apply_final_window_extension(self) -> None:
        """The final validation's longer long window (YaRN is not updated for it, as upstream)."""
        self.ws_long = self.cfg.final_ws_long

    def forward_args(self) -> ForwardArgs:
        bs = self.cfg.block_size
        return ForwardArgs(self.ws_short * bs, self.ws_long * bs, self.mtp_weights, self.yarn, self.yarn_paired,
                           self.bigram_signs, self.prefix_table, self.prefix_weight, self.mlp_down)

    def train_step(self, step: int, micro_batches: Sequence[Batch]) -> float:
        """The step's micro-batches forward and backward (loss * grad_scale), then the optimizer.
        Returns the sum of the micro-batches' training losses (fp32 values, summed in double)."""
        if len(micro_batches) != self.cfg.grad_accum:
            raise ValueError(f"step {step}: {len(micro_batches)} micro-batches, want {self.cfg.grad_accum}")
        total = self.accumulate_gradients(micro_batches)
        self.optimizer_step(step)
        return total

    def accumulate_gradients(self, micro_batches: Sequence[Batch]) -> float:
        total = 0.0
        args = self.forward_args()
        for b in micro_batches:
            loss = forward(self.cfg, self.params, b, args, training=True)
            if loss.dim():  # r80's fused CE returns per-token losses (upstream: losses.sum() * grad_scale)
                loss = loss.sum()
            (loss * self.cfg.grad_scale).backward()
            total += float(loss.detach())
        return total

    def optimizer_step(self, step: int) -> None:
        self.optimizer.step(step, self.schedule.lr(step), self.schedule.muon_momentum(step))
        if step == self.schedule.split_step:
            self.optimizer.untie()
        if self.mlp_down is not None:  # quantize_mlp_fp8 after every optimizer step
            self.mlp_down.quantize_weights(self.params["mlp_bank"], bootstrap=step < MLP_DOWN_BOOTSTRAP_STEPS)

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Batch]) -> float:
        """Mean of the micro-batches' mean cross-entropies (equal sizes: the mean over all tokens)."""
        args = self.forward_args()
        losses = [float(forward(self.cfg, self.params, b, args, training=False)) for b in micro_batches]
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit: parameters and their pending gradients (Adam's
        accumulate over two steps), the optimizer's state, the schedule's position (windows, YaRN, weights) and
        record 89's scales and W2q (MlpDownState.state_dict)."""
        return copy.deepcopy(dict(
            params={n: t.detach() for n, t in self.params.items()},
            grads={n: t.grad for n, t in self.params.items() if t.grad is not None},
            optimizer=dict(state=self.optimizer.state, split_embed=self.optimizer.split_embed),
            schedule=dict(ws=(self.ws_short, self.ws_long), yarn=self.yarn, yarn_paired=self.yarn_paired,
                          mtp_weights=self.mtp_weights, prefix_weight=self.prefix_weight),
            mlp_down=self.mlp_down.state_dict() if self.mlp_down is not None else None))

    def load_state_dict(self, d: dict) -> None:
        d = copy.deepcopy(d)
        with torch.no_grad():
            for n, t in self.params.items():
                t.copy_(d["params"][n])
                t.grad = d["grads"].get(n)
        self.optimizer.state = d["optimizer"]["state"]
        self.optimizer.split_embed = d["optimizer"]["split_embed"]
        sch = d["schedule"]
        (self.ws_short, self.ws_long), self.yarn, self.yarn_paired = sch["ws"], sch["yarn"], sch["yarn_paired"]
        self.mtp_weights, self.prefix_weight = sch["mtp_weights"], sch["prefix_weight"]
        if (d["mlp_down"] is None) != (self.mlp_down is None):
            raise ValueError("the state's FP8 down-projection scales do not match the config's mlp_fp8_down")
        if self.mlp_down is not None:
            self.mlp_down.load_state_dict(d["mlp_down"])

    def grad_norms(self) -> Dict[str, float]:
        return {n: (float(t.grad.double().norm()) if t.grad is not None else 0.0) for n, t in self.params.items()}

    def param_norms(self) -> Dict[str, float]:
        return {n: float(t.detach().double().norm()) for n, t in self.params.items()}
