"""PyTorch reference attention, the yardstick for the kernels' tests.

`attention_ref(..., upcast=True)` computes in float32 (the reference); `upcast=False` does
the same math in the input dtype, which measures how much error plain PyTorch makes at that
precision. A kernel passes when its error against the float32 reference is at most twice
that, plus a small absolute floor (see `error_bound`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """True where query i may NOT attend key j: j > i + seqlen_k - seqlen_q (bottom-right
    aligned, as FlashAttention does when seqlen_q != seqlen_k)."""
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols > rows + (seqlen_k - seqlen_q)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    upcast: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over q (batch, seqlen_q, nheads, d) and k, v (batch, seqlen_k, nheads_kv, d).

    Returns out (batch, seqlen_q, nheads, d), float32 when upcast else q's dtype, and lse
    (batch, nheads, seqlen_q) in float32 (natural log; -inf for a row with no keys, whose out
    is 0).
    """
    dtype = q.dtype
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if nheads != nheads_kv:
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)
    # Scale q first, in the working dtype, as an input-precision implementation would.
    scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k).float()
    if causal:
        scores = scores.masked_fill(causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no keys
    out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def error_bound(out_lowp: torch.Tensor, out_ref: torch.Tensor, factor: float = 2.0) -> float:
    """Max error a kernel may show against `out_ref`: `factor` x the error of the same math
    in the input dtype (`out_lowp`), plus a floor of twice the rounding noise of the output
    dtype around the reference values."""
    ref = out_ref.float()
    lowp_err = (out_lowp.float() - ref).abs().max().item() if ref.numel() else 0.0
    rounding = ((ref + 0.3 - 0.3).to(out_lowp.dtype).float() - ref).abs().max().item() if ref.numel() else 0.0
    return factor * lowp_err + 2.0 * rounding + 1e-5
