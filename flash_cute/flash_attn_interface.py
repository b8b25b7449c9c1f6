"""FlashAttention-3's Python interface (hopper/flash_attn_interface.py), forward only.

Engines written against FlashAttention-3 switch with one line:

    from flash_cute.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache

The functions keep FlashAttention-3's names, argument order, defaults and return conventions,
and map each call onto flash_cute's native entry points (flash_cute.interface). An argument
flash_cute does not serve yet raises NotImplementedError naming it; nothing falls back to
other math. Extensions, keyword-only: `learnable_sink` (per-head sink logits, gpt-oss's
`s_aux`). There is no backward pass: `deterministic` (a backward option) is accepted and has no
effect.

Split counts: flash_cute chooses a call's split count on the host from shapes alone, so every
call can be captured in a CUDA graph and replayed with new lengths and page tables.
`get_scheduler_metadata` returns the split count a kvcache call with those arguments would
use, as a one-element int32 tensor that also carries it on the host; passing it back as
`scheduler_metadata` fixes that count for the call (as `num_splits=n` does).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import checks, interface
from .config import check_head_dims
from .plan import Problem, plan_forward
from .runtime import current_device, num_sms

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]

_native_func = interface.flash_attn_func
_native_varlen = interface.flash_attn_varlen_func
_native_kvcache = interface.flash_attn_with_kvcache


def _unsupported(**given) -> None:
    """NotImplementedError naming the arguments flash_cute does not serve that the call gave
    (those not None). Callers test their arguments inline first, so a served call pays no
    call here."""
    names = [name for name, value in given.items() if value is not None]
    if names:
        raise NotImplementedError(
            f"flash_cute does not serve {', '.join(names)} yet (FlashAttention-3 arguments "
            "outside its feature set); leave them at their defaults"
        )


def _window_pair(window_size):
    """FlashAttention-3 reads window_size[0] and window_size[1], so its callers (its tests
    among them) also pass lists and 2-element integer tensors: as a tuple of ints here (the
    sides are compile-time constants of flash_cute's kernels, read on the host)."""
    if isinstance(window_size, torch.Tensor) and window_size.numel() == 2:
        if window_size.dtype.is_floating_point or window_size.dtype == torch.bool:
            return window_size  # (refused by the native checks)
        return tuple(window_size.tolist())
    if isinstance(window_size, list):
        return tuple(window_size)
    return window_size


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """Attention over padded batches: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_kv, headdim). Returns out (batch, seqlen_q, nheads, headdim), and
    with return_attn_probs (out, softmax_lse) with softmax_lse (batch, nheads, seqlen_q) fp32.
    num_splits: 1 none, 0 the heuristic, n forces n. See flash_cute.flash_attn_func."""
    if type(window_size) is not tuple:
        window_size = _window_pair(window_size)
    if q_descale is not None or k_descale is not None or v_descale is not None or sm_margin:
        _unsupported(
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            sm_margin=sm_margin or None,
        )  # fmt: skip
    if num_splits == 1 and pack_gqa is None:
        return _native_func(
            q, k, v, softmax_scale, causal, return_attn_probs, None, None, window_size,
            attention_chunk, softcap, learnable_sink, qv,
        )  # fmt: skip
    # Split-KV or packed GQA over a padded batch: the cache entry point, whole cache.
    return _native_kvcache(
        q, k, v, None, None, softmax_scale, causal, num_splits, pack_gqa, return_attn_probs,
        None, None, window_size, attention_chunk, softcap, learnable_sink, qv=qv,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 * nheads_kv,
    headdim) with num_heads_q (GQA). Otherwise as flash_attn_func."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(
                f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}"
            )
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("a 4-D qkv (batch, seqlen, heads, headdim) needs num_heads_q")
        num_heads_kv = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_q <= 0 or num_heads_kv <= 0 or num_heads_q + 2 * num_heads_kv != qkv.shape[2]:
            raise ValueError(
                f"qkv's {qkv.shape[2]} heads are not num_heads_q={num_heads_q} plus twice a "
                "kv head count"
            )
        q, k, v = qkv.split([num_heads_q, num_heads_kv, num_heads_kv], dim=2)
    else:
        raise ValueError(f"qkv must be 4-D or 5-D, got shape {tuple(qkv.shape)}")
    return flash_attn_func(
        q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
        attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs,
        learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """Packed variable-length sequences: q (total_q, nheads, headdim) with cu_seqlens_q
    (batch + 1,) int32; k, v (total_k, nheads_kv, headdim) with cu_seqlens_k, or padded
    (batch, seqlen_k, nheads_kv, headdim) with cu_seqlens_k None. seqused_q / seqused_k
    (batch,) int32 shorten each sequence to its first rows. Returns out (total_q, nheads,
    headdim), and with return_attn_probs (out, softmax_lse) with softmax_lse (nheads, total_q).
    See flash_cute.flash_attn_varlen_func."""
    if type(window_size) is not tuple:
        window_size = _window_pair(window_size)
    if q_descale is not None or sm_margin:
        _unsupported(q_descale=q_descale, sm_margin=sm_margin or None)
    if cu_seqlens_q is None:
        # Padded queries: FlashAttention-3's non-varlen path.
        if cu_seqlens_k is not None or seqused_q is not None:
            raise NotImplementedError(
                "flash_cute serves cu_seqlens_k and seqused_q with packed queries "
                "(cu_seqlens_q) only"
            )
        return _native_kvcache(
            q, k, v, seqused_k, None, softmax_scale, causal, num_splits, pack_gqa,
            return_attn_probs, None, None, window_size, attention_chunk, softcap, learnable_sink,
            qv=qv, k_descale=k_descale, v_descale=v_descale,
        )  # fmt: skip
    return _native_varlen(
        q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k, None,
        softmax_scale, causal, num_splits, pack_gqa, return_attn_probs, None, None, window_size,
        attention_chunk, softcap, learnable_sink, seqused_q, qv=qv, k_descale=k_descale,
        v_descale=v_descale,
    )  # fmt: skip


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge split results: out_partial (num_splits, batch, seqlen, nheads, headdim) or
    (num_splits, total_q, nheads, headdim) fp32 and lse_partial (num_splits, batch, seqlen,
    nheads) or (num_splits, total_q, nheads) fp32. Returns (out, lse), lse shaped like
    lse_partial without its split dim."""
    return interface.flash_attn_combine(out_partial, lse_partial, out, out_dtype, True)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
):
    """Attention of q over a KV cache: q (batch, seqlen_q, nheads, headdim), or
    (total_q, nheads, headdim) with cu_seqlens_q and max_seqlen_q; k_cache, v_cache
    (batch_cache, seqlen_cache, nheads_kv, headdim), or (num_pages, page_size, nheads_kv,
    headdim) with page_table (batch, max_pages) int32. cache_seqlens: int or (batch,) int32.
    cache_batch_idx, cache_leftpad: (batch,) int32. Returns out shaped like q, and with
    return_softmax_lse (out, softmax_lse, out_accum, softmax_lse_accum): softmax_lse
    (batch, nheads, seqlen_q) or (nheads, total_q) fp32, the accumulators empty (flash_cute
    merges split partials inside the launch). An FP8 cache (float8_e4m3fn k_cache, v_cache
    with 16-bit q) takes k_descale, v_descale (batch, nheads_kv) float32; q_descale (FP8 q)
    is not served. rotary_seqlens matters only with rotary_cos,
    which flash_cute does not serve yet (refused); alone it is ignored, as FlashAttention-3
    ignores it. See flash_cute.flash_attn_with_kvcache."""
    if type(window_size) is not tuple:
        window_size = _window_pair(window_size)
    if (
        k is not None
        or v is not None
        or rotary_cos is not None
        or rotary_sin is not None
        or cu_seqlens_k_new is not None
        or q_descale is not None
        or sm_margin
    ):
        _unsupported(
            k=k,
            v=v,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            cu_seqlens_k_new=cu_seqlens_k_new,
            q_descale=q_descale,
            sm_margin=sm_margin or None,
        )
    if scheduler_metadata is not None:
        num_splits = _splits_of_metadata(scheduler_metadata, num_splits)
    if cu_seqlens_q is None:
        result = _native_kvcache(
            q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits,
            pack_gqa, return_softmax_lse, None, None, window_size, attention_chunk, softcap,
            learnable_sink, cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
        )  # fmt: skip
    else:
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_q must be given with cu_seqlens_q")
        seqused_k = cache_seqlens
        if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
            length = checks.check_host_int("cache_seqlens", cache_seqlens)
            seqused_k = torch.full(
                (cu_seqlens_q.shape[0] - 1,), length, dtype=torch.int32, device=q.device
            )
        result = _native_varlen(
            q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, None, seqused_k, None, page_table,
            softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, None, None,
            window_size, attention_chunk, softcap, learnable_sink, None, cache_batch_idx,
            cache_leftpad, qv, k_descale, v_descale,
        )  # fmt: skip
    if not return_softmax_lse:
        return result
    out, lse = result
    empty = out.new_empty((0,), dtype=torch.float32)
    return out, lse, empty, empty


def get_scheduler_metadata(
    batch_size,
    max_seqlen_q,
    max_seqlen_k,
    num_heads_q,
    num_heads_kv,
    headdim,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """The split count a flash_attn_with_kvcache call with these sizes would use (num_splits
    0: the heuristic, from max_seqlen_k; n: n), as a (1,) int32 tensor on cache_seqlens'
    device that also carries the count on the host. Pass it as scheduler_metadata to fix that
    count for the call, and for every replay of a CUDA graph that captured it."""
    if type(window_size) is not tuple:
        window_size = _window_pair(window_size)
    if cu_seqlens_k_new is not None:
        _unsupported(cu_seqlens_k_new=cu_seqlens_k_new)
    # max_seqlen_k_new only describes the call (FA3's tests pass it without new keys); a call
    # that appends keys is refused by flash_attn_with_kvcache itself.
    checks.check_host_int("max_seqlen_k_new", max_seqlen_k_new)
    if sm_margin:
        _unsupported(sm_margin=sm_margin)
    if page_size is not None:
        checks.check_host_int("page_size", page_size)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be a (batch,) int32 tensor, got {type(cache_seqlens).__name__}"
        )
    if qkv_dtype not in (torch.float16, torch.bfloat16):
        _unsupported(**{f"qkv_dtype={qkv_dtype}": qkv_dtype})
    batch = checks.check_host_int("batch_size", batch_size)
    max_q = checks.check_host_int("max_seqlen_q", max_seqlen_q)
    max_k = checks.check_host_int("max_seqlen_k", max_seqlen_k)
    checks.check_gqa(num_heads_q, num_heads_kv)
    check_head_dims(headdim, headdim_v)
    window_left, window_right = checks.check_window_size(window_size)
    problem = Problem(
        batch=batch,
        nheads=num_heads_q,
        nheads_kv=num_heads_kv,
        head_dim=headdim,
        head_dim_v=headdim_v,
        dtype=checks.dtype_name(qkv_dtype),
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        kv_capacity=max_k,
        causal=bool(causal),
        varlen_q=cu_seqlens_q is not None,
        total_q=batch * max_q,
        seqused_k=True,  # (the split count depends on sizes, not on the cache's layout)
        window_left=window_left,
        window_right=window_right,
        attention_chunk=checks.check_host_int("attention_chunk", attention_chunk),
        softcap=1.0 if has_softcap else 0.0,
    )
    device = cache_seqlens.device
    sms = num_sms(device.index if device.index is not None else current_device())
    splits = plan_forward(problem, sms, None, checks.check_num_splits(num_splits), pack_gqa)
    metadata = torch.tensor([splits.num_splits], dtype=torch.int32, device=device)
    metadata.flash_cute_num_splits = splits.num_splits
    return metadata


def _splits_of_metadata(scheduler_metadata, num_splits: int) -> int:
    """The split count of a call given scheduler_metadata: its own num_splits when set, else
    the count get_scheduler_metadata recorded on the tensor (a copy of that tensor, which
    carries no host count, leaves the call's heuristic, which depends on shapes alone)."""
    if not isinstance(scheduler_metadata, torch.Tensor) or scheduler_metadata.dtype != torch.int32:
        raise TypeError("scheduler_metadata must be an int32 tensor from get_scheduler_metadata")
    if num_splits:
        return num_splits
    return getattr(scheduler_metadata, "flash_cute_num_splits", num_splits)
