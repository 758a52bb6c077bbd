"""An independent PyTorch reference of the speedrun (the modded-nanogpt record of 2026-02-06, "Sparse
bigram gradient comms").

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

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# =====================================================================================================
# Configuration: train_gpt.cu's Config, record_preset() and tiny_preset(), and the layer structure.
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

    @property
    def grad_accum(self) -> int:
        return 8 // self.world_size

    @property
    def grad_scale(self) -> float:
        return 2 / self.grad_accum

    @property
    def lm_head_grad_s(self) -> float:
        return self.grad_scale * 0.75 / 448

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
        for st in self.stages:
            need(len(st.mtp_start) == len(st.mtp_end) >= 1, "each stage needs matching MTP weight lists")
            need(st.batch_tokens % (self.grad_accum * self.world_size) == 0, "a stage's batch must split evenly")


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


PRESETS = {"record": record_config, "tiny": tiny_config}

# The layer structure (fixed).
LAYERS = 11
ATTN_LAYERS = 10          # layer 6 has no attention
VALUE_TABLES = 5          # value embeddings on layers 0, 1 and 8, 9, 10
SKIP_FROM, SKIP_TO, BACKOUT_LAYER = 3, 6, 7
GATE = 12                 # gates read the first 12 channels
PAIRED_LAYERS = (0, 2, 5, 9)
LONG_WINDOW_LAYERS = (3, 10)


def has_attention(layer: int) -> bool:
    return layer != 6


def attn_index(layer: int) -> int:
    return layer if layer < 6 else layer - 1


def value_table(layer: int) -> int:
    return {0: 0, 1: 1, 8: 2, 9: 3, 10: 4}.get(layer, -1)


# The fp32 scalars vector: resid lambdas, sa lambdas (pairs), bigram lambdas, smear, backout, skip,
# then padding (4 ones: upstream pads by (-3*layers - 3) mod 8 on 8 GPUs).
RESID, SA, BIGRAM = 0, LAYERS, 3 * LAYERS
SMEAR, BACKOUT, SKIP = 4 * LAYERS, 4 * LAYERS + 1, 4 * LAYERS + 2
NUM_SCALARS = 4 * LAYERS + 3 + 4

RMS_EPS = torch.finfo(torch.float32).eps  # F.rms_norm without eps (torch 2.10): FLT_EPSILON, fp32 math
SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5

PARAM_NAMES = ["embed", "lm_head", "bigram_embed", "value_embeds", "attn_bank", "mlp_bank", "attn_gate_bank",
               "ve_gate_bank", "smear_gate", "skip_gate", "x0_lambdas", "scalars"]


def param_shapes(cfg: Config) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    V, C, H, M = cfg.padded_vocab, cfg.model_dim, cfg.num_heads, cfg.mlp_dim
    bf, f32 = torch.bfloat16, torch.float32
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


# =====================================================================================================
# Checkpoints: the safetensors layout (8-byte little-endian header length, JSON header, data).
# =====================================================================================================
_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
              "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "U8": torch.uint8, "U16": torch.uint16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str, prefix: str = "") -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors whose names start with `prefix`, and the metadata."""
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
        keys = [prefix + name, prefix + LABELS[name]]
        key = next((k for k in keys if k in tensors), None)
        if key is None:
            raise ValueError(f"checkpoint has no tensor {' or '.join(repr(k) for k in keys)}")
        t = tensors[key]
        if t.numel() != math.prod(shape) or t.dtype != dtype:
            raise ValueError(f"checkpoint tensor '{key}' is {tuple(t.shape)} {t.dtype}, want {shape} {dtype} "
                             f"(or any shape of {math.prod(shape)} elements)")
        out[name] = t.reshape(shape).clone()
    return out


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
        """The learning-rate multiplier: the stage's lr_mul, cooled down linearly to 0.1."""
        lr = self.stage(step).lr_mul
        S = self.cfg.scheduled_iterations
        cd_start = int(S * (1 - self.cfg.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (S - cd_start))
            lr = lr * (1 - t) + 0.1 * t
        return lr

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


def attention_block(cfg: Config, p: Dict[str, torch.Tensor], layer: int, h: torch.Tensor, W: torch.Tensor,
                    ve: Optional[torch.Tensor], doc: torch.Tensor, args: ForwardArgs) -> torch.Tensor:
    """W: the layer's (4C, C) [Wq; Wk; Wv; Wo]; h: the normed stream; ve: its value-embedding rows."""
    T, C, H, D = h.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim
    paired = layer in PAIRED_LAYERS
    sa = p["scalars"][SA + 2 * layer: SA + 2 * layer + 2]
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
    if ve is not None:
        table = value_table(layer)
        gate = 2 * torch.sigmoid(linear(h[:, :GATE], p["ve_gate_bank"][table]).float())
        v = v + gate.reshape(rows, -1, 1) * ve.float().reshape(rows, -1, D)
    y = attention(bf(q), bf(k), bf(v), doc, window, args.yarn_paired.attn_scale if paired else args.yarn.attn_scale)
    y = y.reshape(T, H, D)
    gate = torch.sigmoid(linear(h[:, :GATE], p["attn_gate_bank"][attn_index(layer)]).float())
    y = bf(y.float() * gate.unsqueeze(-1))
    return linear(y.reshape(T, C), w_o)


def mlp_block(h: torch.Tensor, c_fc: torch.Tensor, c_proj: torch.Tensor) -> torch.Tensor:
    """relu(h @ c_fc^T)^2 @ c_proj, pre and post activations in bf16 (upstream's fused kernel)."""
    pre = linear(h, c_fc)
    post = bf(torch.relu(pre.float()).square())
    return bf(post.float() @ c_proj.float())


def forward(cfg: Config, p: Dict[str, torch.Tensor], batch: Batch, args: ForwardArgs, training: bool) -> torch.Tensor:
    """Training: the FP8 lm_head and the MTP loss summed over rows. Eval: bf16 lm_head, mean CE."""
    T, V = batch.inputs.numel(), cfg.padded_vocab
    s = p["scalars"]
    doc = batch.doc_ids()
    emb = EmbeddingRows.apply(p["embed"], batch.inputs)
    x_bigram = EmbeddingRows.apply(p["bigram_embed"], batch.bigram).float()
    ve_ids = (torch.arange(VALUE_TABLES)[:, None] * V + batch.inputs[None, :])
    ve_all = EmbeddingRows.apply(p["value_embeds"], ve_ids)  # (5, T, C)

    # smear: token t gets smear_lambda * sigmoid(emb[t, :12] . smear_gate) * emb[t-1]
    g = torch.sigmoid(linear(emb[1:, :GATE], p["smear_gate"]).float())
    e = emb.float()
    x = bf(torch.cat([e[:1], e[1:] + s[SMEAR] * g * e[:-1]]))
    x0 = bf(rms_norm(x))
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
            table = value_table(i)
            ve = ve_all[table] if table >= 0 else None
            y = attention_block(cfg, p, i, bf(rms_norm(x)), attn_w[attn_index(i)], ve, doc, args)
            x = bf(x.float() + y.float())
        x = bf(x.float() + mlp_block(bf(rms_norm(x)), *mlp_w[i]).float())
        if i == SKIP_FROM:
            skip = x
        if i == BACKOUT_LAYER:
            backout = x
    x = bf(x.float() - s[BACKOUT] * backout.float())
    h = bf(rms_norm(x))
    if training:
        logits = Fp8LmHead.apply(h, p["lm_head"], cfg.lm_head_x_s, cfg.lm_head_w_s, cfg.lm_head_grad_s)
        return mtp_loss(logits, batch.targets, args.mtp_weights)
    logits = bf(h.float() @ p["lm_head"].float())
    return eval_loss(logits, batch.targets)


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


def normuon_matrices(cfg: Config, name: str) -> Tuple[int, int, int]:
    """(count, rows, cols) of a NorMuon bank's matrices: attn (40, C, C), mlp (24, mlp, C)."""
    C = cfg.model_dim
    return (4 * ATTN_LAYERS, C, C) if name == "attn_bank" else (2 * (LAYERS + 1), cfg.mlp_dim, C)


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


def normuon_variance_reduction(v: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """Scales each row (rows >= cols) or column of v by the rsqrt of its running mean square, then
    restores v's Frobenius norm; updates second_moment in place. v bf16 -> bf16."""
    rows, cols = v.shape[-2:]
    dim = -1 if rows >= cols else -2
    n = v.shape[dim]
    vf = v.float()
    mean = vf.square().mean(dim=dim, keepdim=True)
    norm = (mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(mean, 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((mean * n) * step.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return bf(vf * (step * (norm / new_norm.clamp_min(1e-10))))


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
        self.state: Dict[str, dict] = {}
        for name, (optim, _, _, _) in PARAM_TABLE.items():
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
        shape = max(1.0, rows / cols) ** 0.5 * PARAM_TABLE[name][2]
        return [shape * (2.0 if name == "mlp_bank" and i % 2 == 1 else 1.0) for i in range(count)]

    @torch.no_grad()
    def step(self, step: int, lr_schedule: float, momentum: float) -> None:
        cfg, P = self.cfg, self.params
        do_adam = Schedule.is_adam_step(step)
        lm, embed = P["lm_head"], P["embed"]
        if do_adam and not self.split_embed and embed.grad is not None:
            lm.grad.add_(embed.grad.t())  # tied: embed's gradient joins lm_head's
        for name, (optim, betas, lr_mul, wd_mul) in PARAM_TABLE.items():
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
        for name, (optim, _, _, _) in PARAM_TABLE.items():
            if optim == "normuon" or do_adam:
                P[name].grad = None

    def _normuon(self, name: str, lr_schedule: float, momentum: float, wd_mul: float) -> None:
        cfg, t, st = self.cfg, self.params[name], self.state[name]
        count, rows, cols = normuon_matrices(cfg, name)
        g = t.grad.reshape(count, rows, cols).float()
        st["momentum"].lerp_(g, 1 - momentum)
        u = g.lerp_(st["momentum"], momentum)
        v = normuon_variance_reduction(polar_express(u), st["second_moment"], cfg.normuon_beta2)
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
    def __init__(self, cfg: Config, params: Dict[str, torch.Tensor]):
        cfg.validate()
        shapes = param_shapes(cfg)
        for name, (shape, dtype) in shapes.items():
            if tuple(params[name].shape) != shape or params[name].dtype != dtype:
                raise ValueError(f"parameter {name} is {tuple(params[name].shape)} {params[name].dtype}, "
                                 f"want {shape} {dtype}")
        self.cfg = cfg
        self.params = {n: params[n].detach().clone().requires_grad_(True) for n in PARAM_NAMES}
        self.optimizer = NorMuonAdam(cfg, self.params)
        self.schedule = Schedule(cfg)
        self.yarn = Yarn(cfg.head_dim, cfg.yarn_max_seq_len, paired=False)
        self.yarn_paired = Yarn(cfg.head_dim, cfg.yarn_max_seq_len, paired=True)
        self.ws_short, self.ws_long = cfg.stages[0].ws_short, cfg.stages[0].ws_long
        self.mtp_weights = self.schedule.mtp_weights(0)

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

    def apply_final_window_extension(self) -> None:
        """The final validation's longer long window (YaRN is not updated for it, as upstream)."""
        self.ws_long = self.cfg.final_ws_long

    def forward_args(self) -> ForwardArgs:
        bs = self.cfg.block_size
        return ForwardArgs(self.ws_short * bs, self.ws_long * bs, self.mtp_weights, self.yarn, self.yarn_paired)

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
            (loss * self.cfg.grad_scale).backward()
            total += float(loss.detach())
        return total

    def optimizer_step(self, step: int) -> None:
        self.optimizer.step(step, self.schedule.lr(step), self.schedule.muon_momentum(step))
        if step == self.schedule.split_step:
            self.optimizer.untie()

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Batch]) -> float:
        """Mean of the micro-batches' mean cross-entropies (equal sizes: the mean over all tokens)."""
        args = self.forward_args()
        losses = [float(forward(self.cfg, self.params, b, args, training=False)) for b in micro_batches]
        return sum(losses) / len(losses)

    def grad_norms(self) -> Dict[str, float]:
        return {n: (float(t.grad.double().norm()) if t.grad is not None else 0.0) for n, t in self.params.items()}

    def param_norms(self) -> Dict[str, float]:
        return {n: float(t.detach().double().norm()) for n, t in self.params.items()}
