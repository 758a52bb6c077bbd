"""A stand-in for the FlashAttention-3 function upstream's train_gpt.py imports (flash_attn_interface's
flash_attn_varlen_func), for a GPU machine without FlashAttention-3 (scripts/side_by_side.sh).

The same masks as FA3's varlen call upstream makes: documents from cu_seqlens (no attention across a
document boundary), causal, and a sliding window of window_size[0] tokens to the left (FA3: key j is
seen by query i when i - left <= j <= i + right; upstream passes right = 0). Computed with PyTorch's
flex_attention, which torch.compile fuses into one Triton kernel per direction; it is slower than
FA3 on an H100, so a comparison through it flatters our trainer (the report says so).
"""
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True,
                           softmax_scale=None, window_size=(-1, -1), **unused):
    """q, k, v: (T, H, D) tokens of concatenated documents; returns (T, H, D) like FA3's varlen call."""
    if not causal:
        raise NotImplementedError("fa3_standin: upstream's attention is causal")
    if cu_seqlens_q is not cu_seqlens_k and not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("fa3_standin: upstream passes the same documents for queries and keys")
    t = q.shape[0]
    positions = torch.arange(t, device=q.device, dtype=cu_seqlens_q.dtype)
    # the document of each token: how many document ends (cu_seqlens[1:]) are at or before it
    document = torch.searchsorted(cu_seqlens_q[1:].contiguous(), positions, right=True)
    left = window_size[0]

    def mask(b, h, q_idx, kv_idx):
        seen = (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)
        if left >= 0:
            seen = seen & (q_idx - kv_idx <= left)
        return seen

    block_mask = create_block_mask(mask, None, None, t, t, device=q.device)
    out = flex_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0), block_mask=block_mask, scale=softmax_scale)
    return out.squeeze(0).transpose(0, 1)
