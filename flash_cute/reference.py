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


def local_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    device=None,
) -> torch.Tensor:
    """True where query i may NOT attend key j under FlashAttention-3's local attention: with
    x = i + seqlen_k - seqlen_q, j must satisfy x - left <= j <= x + right (a side of -1 is
    unbounded) and, with a chunk of c keys, lie in x's chunk: floor(j / c) == floor(x / c)."""
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    x = rows + (seqlen_k - seqlen_q)
    masked = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window_size
    if left >= 0:
        masked |= cols < x - left
    if right >= 0:
        masked |= cols > x + right
    if attention_chunk > 0:
        start = x - x % attention_chunk  # floor: torch's % takes the divisor's sign
        masked |= (cols < start) | (cols >= start + attention_chunk)
    return masked


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    upcast: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    p_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over q (batch, seqlen_q, nheads, d) and k, v (batch, seqlen_k, nheads_kv, d),
    with FlashAttention-3's semantics: causal bottom-right aligned (with a window: its right
    side 0), local windows and chunks (`local_mask`), softcap (scores become softcap *
    tanh(s * scale / softcap) before masking), and learnable sinks ((nheads,) logits, one more
    term exp(sink) in each row's denominator with no value row, in the LSE too).

    p_dtype: the normalized probabilities rounded to it before P V (float8_e4m3fn with upcast:
    a naive FP8 attention, the yardstick of FP8 math).

    Returns out (batch, seqlen_q, nheads, d), float32 when upcast else q's dtype, and lse
    (batch, nheads, seqlen_q) in float32 (natural log). A row with no keys gets out = 0 and
    lse = -inf, or its sink.
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
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0 or right >= 0 or attention_chunk > 0:
        masked = local_mask(seqlen_q, seqlen_k, (left, right), attention_chunk, q.device)
        scores = scores.masked_fill(masked, float("-inf"))
    if learnable_sink is not None:  # one more column, dropped after the softmax
        sink = learnable_sink.float().view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no keys
    if learnable_sink is not None:
        probs = probs[..., :-1]
    if p_dtype is not None:
        probs = probs.to(p_dtype)
    out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def error_bound(out_lowp: torch.Tensor, out_ref: torch.Tensor, factor: float = 2.0) -> float:
    """Max error a kernel may show against `out_ref`: `factor` x the error of the same math
    in the input dtype (`out_lowp`), plus a floor of twice the rounding noise of the output
    dtype around the reference values."""
    ref = out_ref.float()
    lowp_err = (out_lowp.float() - ref).abs().max().item() if ref.numel() else 0.0
    rounding = (
        ((ref + 0.3 - 0.3).to(out_lowp.dtype).float() - ref).abs().max().item()
        if ref.numel()
        else 0.0
    )
    return factor * lowp_err + 2.0 * rounding + 1e-5


def attention_partial_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_ranges,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to each key range [lo, hi) in turn (float32), as split-KV computes.

    Returns out_partial (num_splits, batch, seqlen_q, nheads, d), each normalized over its own
    keys (0 where a row sees none), and lse_partial (num_splits, batch, seqlen_q, nheads)
    (-inf where a row sees no key of the range). The causal mask stays in global positions.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    outs, lses = [], []
    for lo, hi in key_ranges:
        allowed = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
        allowed[:, lo:hi] = True
        if causal:
            allowed &= ~causal_mask(seqlen_q, seqlen_k, q.device)
        out, lse = _masked_attention(q, k, v, allowed, softmax_scale)
        outs.append(out)
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def _masked_attention(q, k, v, allowed, softmax_scale):
    head_dim = q.shape[-1]
    nheads, nheads_kv = q.shape[2], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    q, k, v = q.float(), k.float(), v.float()
    if nheads != nheads_kv:
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bhts,bshd->bthd", probs, v), lse


def combine_ref(
    out_partial: torch.Tensor, lse_partial: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results: lse = logsumexp_k lse_k, out = sum_k exp(lse_k - lse) out_k.

    out_partial (K, ..., d), lse_partial (K, ...). Splits with lse -inf contribute nothing
    (their out is never read); rows with all splits -inf give out 0 and lse -inf."""
    lse = torch.logsumexp(lse_partial, dim=0)
    weights = torch.exp(lse_partial - lse.unsqueeze(0))
    weights = torch.nan_to_num(weights, nan=0.0)  # all -inf: (-inf) - (-inf)
    safe = torch.where(
        torch.isfinite(lse_partial).unsqueeze(-1), out_partial, torch.zeros_like(out_partial)
    )
    return (weights.unsqueeze(-1) * safe).sum(0), lse


def split_ranges(seqlen_k: int, tile_n: int, num_splits: int):
    """Key ranges of the kernel's split rule: key blocks of tile_n shared out evenly
    (ceil), trailing splits possibly empty."""
    n_blocks = -(-seqlen_k // tile_n)
    per = -(-n_blocks // num_splits) if num_splits else 0
    return [
        (min(s * per * tile_n, seqlen_k), min((s + 1) * per * tile_n, seqlen_k))
        for s in range(num_splits)
    ]


def gather_paged(cache: torch.Tensor, page_table: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Padded (batch, seqlen, nheads_kv, d) view of a paged cache (num_pages, page_size, ...)."""
    pages = cache[page_table.long()]  # (batch, max_pages, page_size, h, d)
    return pages.flatten(1, 2)[:, :seqlen]


def stable_seed(*parts) -> int:
    """A seed from a test's parameters that is the same in every process (hash() of a str is
    salted per process, so a failing case could not be rerun with its inputs)."""
    import zlib

    return zlib.crc32(repr(parts).encode())
