"""FlashAttention-3's Python interface (hopper/flash_attn_interface.py), forward only.

Engines written against FlashAttention-3 switch with one line:

    from flash_cute.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache

The functions keep FlashAttention-3's names, argument order, defaults and return conventions.
Each is an entry point of its own, generated from its signature like the native ones
(flash_cute.entry): its arguments' roles (flash_cute.call.ROLES) give its replay key and the
Call its first pass runs through the shared forward path, so a replay costs what a native
one does. An argument flash_cute does not serve yet raises NotImplementedError naming it;
nothing falls back to other math. Descales are read where their operands are FP8 and ignored
otherwise, as FlashAttention-3 ignores them (vLLM passes all three on every call).
`sm_margin` leaves that many SMs free: persistent grids and split counts are sized from the
others. Extensions, keyword-only: `learnable_sink` (per-head sink logits, gpt-oss's `s_aux`). There
is no backward pass: `deterministic` (a backward option) is accepted and has no effect.

Split counts: flash_cute chooses a call's split count on the host from shapes alone, so every
call can be captured in a CUDA graph and replayed with new lengths and page tables.
`get_scheduler_metadata` returns the split count a kvcache call with those arguments would
use, as a one-element int32 tensor that also carries it on the host; passing it back as
`scheduler_metadata` fixes that count for the call (as `num_splits=n` does). A copy of that
tensor is read on the device (once per new content; under CUDA-graph capture the call
chooses its own count and warns).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import checks, interface
from .call import FA3_DESCALES, Call, Role, window_pair
from .entry import entry_point
from .forward import describe
from .plan import plan_forward
from .runtime import PlanCache, current_device, num_sms

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]


def _padded_unless_split(call: Call) -> Call:
    """FlashAttention-3's flash_attn_func: the padded prefill kernels, unless it asks for
    split-KV or packed GQA (then those of a cache over the whole of k and v)."""
    if call.num_splits == 1 and call.pack_gqa is None:
        return call.replace(decode_rows=False, pack_gqa=False)
    return call


@entry_point(PlanCache(), overrides=FA3_DESCALES, adjust=_padded_unless_split)
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
    num_splits: 1 none, 0 the heuristic, n forces n. FP8 (float8_e4m3fn) q, k and v take
    q_descale, k_descale, v_descale (batch, nheads_kv) float32 (None: 1); out is then bfloat16.
    See flash_cute.flash_attn_func."""


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
    # Every other argument is flash_attn_func's, passed on by name.
    options = {n: value for n, value in locals().items() if n not in ("qkv", "num_heads_q")}
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
    return flash_attn_func(q, k, v, **options)


@entry_point(PlanCache(), overrides=FA3_DESCALES)
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
    FP8 inputs and descales as in flash_attn_func. See flash_cute.flash_attn_varlen_func."""


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge split results: out_partial (num_splits, batch, seqlen, nheads, headdim) or
    (num_splits, total_q, nheads, headdim) fp32 and lse_partial (num_splits, batch, seqlen,
    nheads) or (num_splits, total_q, nheads) fp32. Returns (out, lse), lse shaped like
    lse_partial without its split dim."""
    return interface.flash_attn_combine(out_partial, lse_partial, out, out_dtype, True)


def _with_accumulators(result):
    """FlashAttention-3's kvcache return with return_softmax_lse: (out, softmax_lse,
    out_accum, softmax_lse_accum), the accumulators empty (flash_cute merges split partials
    inside the launch)."""
    if type(result) is not tuple:
        return result
    out, lse = result
    empty = out.new_empty((0,), dtype=torch.float32)
    return out, lse, empty, empty


@entry_point(
    PlanCache(),
    overrides={"k": Role("append", "k"), "v": Role("append", "v"), **FA3_DESCALES},
    finish=_with_accumulators,
)
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
    merges split partials inside the launch). An FP8 cache (float8_e4m3fn k_cache, v_cache)
    takes k_descale, v_descale (batch, nheads_kv) float32; FP8 q (with an FP8 cache) also
    q_descale, and out is bfloat16 (or out's float16).

    k, v (batch, seqlen_new, nheads_kv, headdim), or (total_new, nheads_kv, headdim) with
    cu_seqlens_k_new (batch + 1,) int32: rows appended to the cache at cache_seqlens (a (batch,)
    int32 tensor or an int), which the call then attends over too (flash_cute.kv_append);
    rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2) rotate q and the new keys at positions
    from rotary_seqlens (default cache_seqlens), interleaved or not. rotary_seqlens and
    rotary_interleaved matter only with rotary_cos (as in FlashAttention-3). Appending calls are
    not replayed from launch plans, nor served inside torch.compile yet.
    See flash_cute.flash_attn_with_kvcache."""


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
    count for the call, and for every replay of a CUDA graph that captured it. The call is
    described as flash_attn_with_kvcache describes its own (on meta tensors of these sizes)."""
    # cu_seqlens_k_new and max_seqlen_k_new describe an append, which leaves the plan's
    # decisions alone (they follow the cache's capacity).
    checks.check_host_int("max_seqlen_k_new", max_seqlen_k_new)
    if page_size is not None:
        checks.check_host_int("page_size", page_size)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be a (batch,) int32 tensor, got {type(cache_seqlens).__name__}"
        )
    if qkv_dtype not in checks.TORCH_DTYPES and qkv_dtype not in checks.FP8_DTYPES:
        raise NotImplementedError(f"flash_cute does not serve qkv_dtype={qkv_dtype} yet")
    batch = checks.check_host_int("batch_size", batch_size)
    max_q = checks.check_host_int("max_seqlen_q", max_seqlen_q)
    max_k = checks.check_host_int("max_seqlen_k", max_seqlen_k)
    hq = checks.check_host_int("num_heads_q", num_heads_q)
    hkv = checks.check_host_int("num_heads_kv", num_heads_kv)
    d = checks.check_host_int("headdim", headdim)
    dv = d if headdim_v is None else checks.check_host_int("headdim_v", headdim_v)

    def meta(*shape, dtype=qkv_dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    varlen = cu_seqlens_q is not None
    call = Call(
        q=meta(batch * max_q, hq, d) if varlen else meta(batch, max_q, hq, d),
        k=meta(batch, max_k, hkv, d),
        v=meta(batch, max_k, hkv, dv),
        cu_seqlens_q=cu_seqlens_q,
        seqused_k=cache_seqlens,
        leftpad_k=cache_leftpad,
        max_seqlen_q=max_q if varlen else None,
        causal=causal,
        window_size=window_pair(window_size),
        attention_chunk=attention_chunk,
        softcap=1.0 if has_softcap else 0.0,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
    )
    problem = describe(call, flash_attn_with_kvcache.entry_point.names)
    device = cache_seqlens.device
    sms = num_sms(device.index if device.index is not None else current_device())
    sms = checks.sms_left(sm_margin, sms)
    plan = plan_forward(problem, sms, None, checks.check_num_splits(num_splits), pack_gqa)
    metadata = torch.tensor([plan.num_splits], dtype=torch.int32, device=device)
    metadata.flash_cute_num_splits = plan.num_splits
    return metadata
