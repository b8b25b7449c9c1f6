"""Public attention entry points: padded, varlen and KV-cache forward, and the split combine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import checks
from .compile_cache import (
    CombineKernelKey,
    ForwardKernelKey,
    get_combine_kernel,
    get_forward_kernel,
    raw_function,
)
from .config import DECODE_ROWS, AttentionConfig, decode_config, default_config
from .splitkv import num_sms, num_splits_heuristic


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[AttentionConfig] = None,
):
    """Scaled dot-product attention forward on Hopper.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device of
            compute capability 9.0.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype and device as q;
            nheads must be a multiple of nheads_kv (GQA/MQA read the shared K/V head).
            headdim is one of 64, 96, 128, 192, 256.
            Each tensor needs a contiguous last dimension; other strides are arbitrary
            (slices of bigger tensors work; strides that are not multiples of 16 bytes cost
            a copy).
        softmax_scale: scale (>= 0) of q k^T before the softmax; default 1/sqrt(headdim).
        causal: mask key j for query i when j > i + seqlen_k - seqlen_q (bottom-right aligned).
        return_lse: also return the log-sum-exp of each row.
        out: optional preallocated output, shape and dtype of q, last dim contiguous.
        config: optional `AttentionConfig` overriding the per-head-dim table (validated).

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, and with return_lse also
        lse (batch, nheads, seqlen_q) float32 (natural log; -inf for rows with no keys).

    Runs on torch's current CUDA stream, with no host synchronization, so a call can be
    captured in a CUDA graph after one warm-up call (which compiles the kernel).
    """
    try:  # repeated calls with the same metadata skip the checks (see _LaunchPlan); inlined: hot
        # The compiled function checks the rest of q, k, v and out (_LaunchPlan.launch); without
        # out, whether q is contiguous picks how out is allocated; with out, the strides give the
        # byte extents of the overlap check (_LaunchPlan.usable).
        key = (
            q.shape,
            q.dtype,
            q.get_device(),
            k.shape,
            q.is_contiguous()
            if out is None
            else (q.stride(), k.stride(), v.stride(), out.stride()),
            softmax_scale,
            causal,
            return_lse,
            config,
            type(softmax_scale),
            type(causal),
            type(return_lse),
        )  # True == 1 == 1.0 as keys
        plan = _FUNC_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == _current_device() if out is None else plan.usable(q, k, v, out)
    ):
        try:
            return plan.launch(q, k, v, out)
        except Exception:  # an argument the compiled function refused: the checks below name it
            pass
    checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    checks.check_tensor("k", k, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    checks.check_tensor("v", v, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    batch, seqlen_q, nheads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch size {batch} (that of q), got shape {tuple(k.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have headdim {head_dim} (that of q), got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    problem = _Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k.shape[2],
        head_dim=head_dim,
        dtype=q.dtype,
        max_seqlen_q=seqlen_q,
        max_seqlen_k=k.shape[1],
        kv_capacity=k.shape[1],
    )
    scale_log2, causal, return_lse, config = _common_checks(
        problem, softmax_scale, causal, return_lse, config
    )
    checks.check_cuda((("q", q), ("k", k), ("v", v)))
    checks.check_hopper(q.device)
    out = _prepare_out(out, q, k, v)
    lse = (
        torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    if config is None:  # the prefill table, whatever seqlen_q is
        config = default_config(head_dim, checks.dtype_name(q.dtype), causal, seqlen_q)
    if out.numel() > 0:
        plan = _run(
            problem, q, k, v, out, lse, scale_log2, causal, config, num_splits=1, pack_gqa=False
        )
        _remember(_FUNC_PLANS, key, plan)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    return_softmax_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[AttentionConfig] = None,
):
    """Attention over a batch of variable-length sequences packed along one token dimension.

    Args:
        q: (total_q, nheads, headdim); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
        k, v: one of
            (total_k, nheads_kv, headdim) packed, with cu_seqlens_k;
            (batch, seqlen_k, nheads_kv, headdim) padded, with seqused_k (valid keys per
                sequence) or without (all seqlen_k keys);
            (num_pages, page_size, nheads_kv, headdim) paged, with page_table and usually
                seqused_k (without it, every slot of the table's pages is a key). page_size
                must be a multiple of 16; pages need not be contiguous or ordered.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 prefix sums of the lengths.
        max_seqlen_q: int, the longest query length (host value; picks the tile config — the
            grid covers every sequence's tiles whatever it says).
        seqused_k: (batch,) int32 valid keys per sequence (clamped to the cache's capacity).
        max_seqlen_k: int, the longest key length; only guides the split heuristic.
        page_table: (batch, max_pages_per_seq) int32 page indices.
        num_splits: 1 (default) no split-KV; n forces n; 0 picks with the heuristic.
        pack_gqa: fold the q heads of a kv head into one tile (None: when it helps).
        config: optional `AttentionConfig` overriding the tables (validated); split-KV
            launches keep one CTA per query tile whatever its scheduler says.
        Other arguments as in flash_attn_func.

    Returns:
        out (total_q, nheads, headdim), and with return_softmax_lse also lse
        (nheads, total_q) float32. A sequence with no keys gets out = 0, lse = -inf.

    cu_seqlens contents are not checked (that would need a host sync): they must start at 0,
    be non-decreasing and stay within q/k. Rows of q past cu_seqlens_q[-1] are not written.
    The call has no host synchronization.
    """
    try:  # repeated calls with the same metadata skip the checks (see _LaunchPlan); inlined: hot
        # As in flash_attn_func: the compiled function checks the rest of the arguments (the
        # int32 tensors' contiguity and device included); the key holds their shapes and dtypes.
        key = (
            q.shape,
            q.dtype,
            q.get_device(),
            k.shape,
            q.is_contiguous()
            if out is None
            else (q.stride(), k.stride(), v.stride(), out.stride()),
            cu_seqlens_q.shape,
            cu_seqlens_q.dtype,
            _int_meta(cu_seqlens_k),
            _int_meta(seqused_k),
            _int_meta(page_table),
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
            num_splits,
            pack_gqa,
            return_softmax_lse,
            config,
            type(max_seqlen_q),
            type(max_seqlen_k),
            type(softmax_scale),
            type(causal),
            type(num_splits),
            type(pack_gqa),
            type(return_softmax_lse),
        )
        plan = _VARLEN_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == _current_device() if out is None else plan.usable(q, k, v, out)
    ):
        try:
            return plan.launch(q, k, v, out, seqused_k, page_table, cu_seqlens_q, cu_seqlens_k)
        except Exception:  # an argument the compiled function refused: the checks below name it
            pass
    checks.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if cu_seqlens_k is not None and seqused_k is not None:
        raise ValueError("give either cu_seqlens_k or seqused_k, not both")
    if cu_seqlens_k is not None and page_table is not None:
        raise ValueError(
            "page_table cannot be combined with cu_seqlens_k (paged keys use seqused_k)"
        )
    kv_layout = (
        "packed" if cu_seqlens_k is not None else ("paged" if page_table is not None else "padded")
    )
    kv_ndim = 3 if kv_layout == "packed" else 4
    kv_doc = {
        "packed": "(total_k, nheads_kv, headdim) with cu_seqlens_k",
        "paged": "(num_pages, page_size, nheads_kv, headdim) with page_table",
        "padded": "(batch, seqlen_k, nheads_kv, headdim)",
    }[kv_layout]
    checks.check_tensor("k", k, kv_ndim, kv_doc)
    checks.check_tensor("v", v, kv_ndim, kv_doc)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    total_q, nheads, head_dim = q.shape
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have headdim {head_dim} (that of q), got shape {tuple(k.shape)}")
    batch = checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    max_seqlen_q = checks.check_host_int("max_seqlen_q", max_seqlen_q)
    if cu_seqlens_k is not None:
        checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch)
    if seqused_k is not None:
        checks.check_seqused("seqused_k", seqused_k, batch)
    if kv_layout == "paged":
        capacity = checks.check_page_table(page_table, batch, k)
    elif kv_layout == "padded":
        if k.shape[0] != batch:
            raise ValueError(
                f"padded k must have batch size {batch} (len(cu_seqlens_q) - 1), got shape {tuple(k.shape)}"
            )
        capacity = k.shape[1]
    else:
        capacity = k.shape[0]
    if max_seqlen_k is None:
        max_seqlen_k = capacity
    max_seqlen_k = min(checks.check_host_int("max_seqlen_k", max_seqlen_k), capacity)
    problem = _Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k.shape[-2],
        head_dim=head_dim,
        dtype=q.dtype,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_capacity=capacity if batch > 0 else 0,
        varlen_q=True,
        kv_layout=kv_layout,
        page_size=k.shape[1] if kv_layout == "paged" else None,
    )
    scale_log2, causal, return_lse, config = _common_checks(
        problem, softmax_scale, causal, return_softmax_lse, config
    )
    num_splits = checks.check_num_splits(num_splits)
    pack_gqa = checks.check_optional_bool("pack_gqa", pack_gqa)
    named = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
        ("seqused_k", seqused_k),
        ("page_table", page_table),
    ]
    checks.check_cuda([(n, t) for n, t in named if t is not None])
    checks.check_hopper(q.device)
    out = _prepare_out(out, q, k, v)
    lse = (
        torch.empty((nheads, total_q), dtype=torch.float32, device=q.device) if return_lse else None
    )
    if out.numel() > 0:
        plan = _run(
            problem,
            q,
            k,
            v,
            out,
            lse,
            scale_log2,
            causal,
            config,
            num_splits,
            pack_gqa,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_k=seqused_k,
            page_table=page_table,
        )
        _remember(_VARLEN_PLANS, key, plan)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens=None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    return_softmax_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[AttentionConfig] = None,
):
    """Attention of new queries over a KV cache (decoding, and prefill against a cache).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch, seqlen_cache, nheads_kv, headdim), or with page_table
            (num_pages, page_size, nheads_kv, headdim) with page_size a multiple of 16.
        cache_seqlens: valid keys per sequence: an int, a (batch,) int32 tensor, or None for
            the whole cache. Tensor values above the cache's capacity are clamped (checking
            them would need a host sync); an int is checked. Slots past the length may hold
            anything (e.g. NaN): they never reach the output. Repeated calls replay one launch
            plan per power of two of an int length (the split count of its first length).
        page_table: (batch, max_pages_per_seq) int32 page indices (any order).
        causal: bottom-right aligned: the last query sees all cache_seqlens keys.
        num_splits: 0 (default) picks the split-KV count with a wave-efficiency heuristic;
            1 disables splitting; n forces n (at most 128).
        pack_gqa: fold the q heads sharing a kv head into one tile so each K/V tile is read
            once for all of them (None: on whenever nheads > nheads_kv and it fits the tile).
        config: optional `AttentionConfig` overriding the decode and prefill tables
            (validated); persistent schedulers apply only when the call does not split.
        Other arguments as in flash_attn_func.

    Returns:
        out (batch, seqlen_q, nheads, headdim), and with return_softmax_lse also lse
        (batch, nheads, seqlen_q) float32. A sequence with 0 keys gets out = 0, lse = -inf.

    No host synchronization, and split buffers are sized from shapes and num_splits only: after
    one warm-up call a decode step can be captured in a CUDA graph and replayed with new
    cache_seqlens and page_table contents.
    """
    try:  # repeated calls with the same metadata skip the checks (see _LaunchPlan); inlined: hot
        if isinstance(
            cache_seqlens, torch.Tensor
        ):  # dtype too: the compiled function takes uint32 as int32
            seqlens_meta = (cache_seqlens.shape, cache_seqlens.dtype)
        elif type(cache_seqlens) is int:
            # One plan per power of two of an int length, so a decode loop whose length grows
            # by one each step replays plans (its split count was chosen for the first length).
            seqlens_meta = ("int length of bit length", cache_seqlens.bit_length())
        else:  # None, or what the checks reject (with its type: True == 1)
            seqlens_meta = (type(cache_seqlens), cache_seqlens)
        # As in flash_attn_func: the compiled function checks the rest of the arguments.
        key = (
            q.shape,
            q.dtype,
            q.get_device(),
            k_cache.shape,
            seqlens_meta,
            None if page_table is None else (page_table.shape, page_table.dtype),
            q.is_contiguous()
            if out is None
            else (q.stride(), k_cache.stride(), v_cache.stride(), out.stride()),
            softmax_scale,
            causal,
            num_splits,
            pack_gqa,
            return_softmax_lse,
            config,
            type(softmax_scale),
            type(causal),
            type(num_splits),
            type(pack_gqa),
            type(return_softmax_lse),
        )
        plan = _KVCACHE_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == _current_device()
        if out is None
        else plan.usable(q, k_cache, v_cache, out)
    ):
        try:
            if plan.int_capacity is None:
                return plan.launch(q, k_cache, v_cache, out, cache_seqlens, page_table)
            if 0 <= cache_seqlens <= plan.int_capacity:  # otherwise the checks below raise
                return plan.launch(
                    q, k_cache, v_cache, out, None, page_table, None, None, cache_seqlens
                )
        except Exception:  # an argument the compiled function refused: the checks below name it
            pass
    checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    paged = page_table is not None
    kv_doc = (
        "(num_pages, page_size, nheads_kv, headdim)"
        if paged
        else "(batch, seqlen_cache, nheads_kv, headdim)"
    )
    checks.check_tensor("k_cache", k_cache, 4, kv_doc)
    checks.check_tensor("v_cache", v_cache, 4, kv_doc)
    checks.check_same_dtype("k_cache", k_cache, "q", q)
    checks.check_same_dtype("v_cache", v_cache, "q", q)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(
            f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, nheads, head_dim = q.shape
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache must have headdim {head_dim} (that of q), got shape {tuple(k_cache.shape)}"
        )
    if paged:
        capacity = checks.check_page_table(page_table, batch, k_cache)
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache must have batch size {batch} (that of q), got shape {tuple(k_cache.shape)}"
            )
        capacity = k_cache.shape[1]
    seqused_k = int_length = None
    max_seqlen_k = capacity
    if cache_seqlens is None:
        pass
    elif isinstance(cache_seqlens, torch.Tensor):
        checks.check_seqused("cache_seqlens", cache_seqlens, batch)
        seqused_k = cache_seqlens
    else:
        int_length = max_seqlen_k = checks.check_host_int("cache_seqlens", cache_seqlens)
        if int_length > capacity:
            raise ValueError(
                f"cache_seqlens={int_length} exceeds the cache's capacity of {capacity} keys"
            )
    problem = _Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k_cache.shape[2],
        head_dim=head_dim,
        dtype=q.dtype,
        max_seqlen_q=seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_capacity=max_seqlen_k,
        kv_layout="paged" if paged else "padded",
        page_size=k_cache.shape[1] if paged else None,
    )
    scale_log2, causal, return_lse, config = _common_checks(
        problem, softmax_scale, causal, return_softmax_lse, config
    )
    num_splits = checks.check_num_splits(num_splits)
    pack_gqa = checks.check_optional_bool("pack_gqa", pack_gqa)
    named = [
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("page_table", page_table),
        ("cache_seqlens", seqused_k),
    ]
    checks.check_cuda([(n, t) for n, t in named if t is not None])
    checks.check_hopper(q.device)
    out = _prepare_out(out, q, k_cache, v_cache)
    lse = (
        torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    if out.numel() > 0:
        plan = _run(
            problem,
            q,
            k_cache,
            v_cache,
            out,
            lse,
            scale_log2,
            causal,
            config,
            num_splits,
            pack_gqa,
            seqused_k=seqused_k,
            page_table=page_table,
            int_length=int_length,
        )
        if plan is not None and int_length is not None:
            plan.int_capacity = capacity  # replays check their length against it
        _remember(_KVCACHE_PLANS, key, plan)
    return (out, lse) if return_lse else out


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
):
    """Merge attention results computed over disjoint key sets (split-KV, cascade, context
    parallel): per row, lse = log(sum_k exp(lse_k)) and out = sum_k exp(lse_k - lse) * out_k.

    Args:
        out_partial: (num_splits, batch, seqlen, nheads, headdim) or
            (num_splits, total_q, nheads, headdim), float32; split k's output normalized over
            its own keys. headdim a multiple of 8.
        lse_partial: (num_splits, batch, seqlen, nheads) or (num_splits, total_q, nheads),
            float32 natural-log LSE; -inf marks an empty split (its out_k is ignored: any
            values, NaN included).
        out: optional output, out_partial's shape without the split dim.
        out_dtype: dtype of out when it is allocated (float32 default, or float16/bfloat16).
        return_lse: also return the merged lse, shaped like lse_partial without the split dim.

    A row whose splits are all empty gets out = 0, lse = -inf.
    """
    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial and lse_partial must be torch.Tensors")
    if out_partial.dim() not in (4, 5):
        raise ValueError(
            "out_partial must be (num_splits, batch, seqlen, nheads, headdim) or "
            f"(num_splits, total_q, nheads, headdim), got shape {tuple(out_partial.shape)}"
        )
    if out_partial.dtype != torch.float32:
        raise TypeError(f"out_partial must be float32, got {out_partial.dtype}")
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial must be float32, got {lse_partial.dtype}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(
            f"lse_partial must have shape {tuple(out_partial.shape[:-1])}, got {tuple(lse_partial.shape)}"
        )
    head_dim = out_partial.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= 1024:
        raise ValueError(
            f"headdim of out_partial must be a multiple of 8 in [8, 1024], got {head_dim}"
        )
    if out_partial.stride(-1) != 1 and head_dim > 1:
        raise ValueError(
            f"out_partial must have a contiguous last dimension, got strides {out_partial.stride()}"
        )
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    return_lse = checks.optional_bool("return_lse", return_lse)
    checks.check_cuda((("out_partial", out_partial), ("lse_partial", lse_partial)))
    shape = tuple(out_partial.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=out_partial.device)
    else:
        checks.check_out_like(
            out, shape, out_dtype, out_partial.device, (("out_partial", out_partial),)
        )
    lse = (
        torch.empty(shape[:-1], dtype=torch.float32, device=out_partial.device)
        if return_lse
        else None
    )
    if out.numel() > 0:
        if out_partial.shape[0] == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            _combine(out_partial, lse_partial, out, lse)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """Host-known sizes of one call (no tensor contents)."""

    batch: int
    nheads: int
    nheads_kv: int
    head_dim: int
    dtype: torch.dtype
    max_seqlen_q: int
    max_seqlen_k: int  # longest key length known on the host (guides the split count)
    kv_capacity: int = -1  # keys a sequence can have at most; 0 means no keys anywhere
    varlen_q: bool = False
    kv_layout: str = "padded"
    page_size: Optional[int] = None


def _common_checks(problem: _Problem, softmax_scale, causal, return_lse, config):
    checks.check_head_dim(problem.head_dim)
    checks.check_gqa(problem.nheads, problem.nheads_kv)
    checks.check_grid(problem.nheads, problem.batch)
    causal = checks.optional_bool("causal", causal)
    return_lse = checks.optional_bool("return_lse", return_lse)
    scale_log2 = checks.softmax_scale_log2(softmax_scale, problem.head_dim)
    config = checks.check_config(config, problem.head_dim, checks.dtype_name(problem.dtype))
    return scale_log2, causal, return_lse, config


def _prepare_out(out, q, k, v):
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    checks.check_out(out, tuple(q.shape), q, (q, k, v))
    return out


def _choose(problem: _Problem, causal: bool, config, num_splits: int, pack_gqa, device_index: int):
    """(config, pack ratio, num_splits) for a call, from host-known sizes only."""
    dtype = checks.dtype_name(problem.dtype)
    ratio = problem.nheads // problem.nheads_kv
    decode_like = problem.max_seqlen_q * ratio <= DECODE_ROWS
    if config is None:
        config = (
            decode_config(problem.head_dim, dtype)
            if decode_like
            else default_config(problem.head_dim, dtype, causal, problem.max_seqlen_q)
        )
    if pack_gqa is None:  # K/V tiles read once for all q heads of a kv head
        pack_gqa = ratio > 1 and config.tile_m % ratio == 0
    if pack_gqa and ratio > 1 and config.tile_m % ratio:
        raise ValueError(
            f"pack_gqa=True needs nheads / nheads_kv ({ratio}) to divide the tile's {config.tile_m} rows"
        )
    pack_ratio = ratio if pack_gqa else 1
    if num_splits == 0:
        n_blocks = math.ceil(problem.max_seqlen_k / config.tile_n)
        num_splits = num_splits_heuristic(
            _padded_tiles(problem, config.tile_m, pack_ratio),
            n_blocks,
            num_sms(device_index) * config.ctas_per_sm,
        )
    return config, pack_ratio, num_splits


def _run(
    problem: _Problem,
    q,
    k,
    v,
    out,
    lse,
    scale_log2,
    causal,
    config,
    num_splits,
    pack_gqa,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_k=None,
    page_table=None,
    int_length=None,
):
    """Launch one forward call. int_length: an int cache_seqlens, given to the kernel as a
    scalar argument (also for a contiguous cache, rather than a slice of it, which costs two
    views per call)."""
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    config, pack_ratio, num_splits = _choose(
        problem, causal, config, num_splits, pack_gqa, device_index
    )
    if problem.kv_capacity == 0:  # no keys: nothing for a kernel (or TMA) to read
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    split = num_splits > 1
    config = single_wave_config(config, problem, pack_ratio, split, device_index)
    key = ForwardKernelKey(
        dtype=checks.dtype_name(problem.dtype),
        head_dim=problem.head_dim,
        causal=causal,
        config=config,
        writes_lse=lse is not None,
        varlen_q=problem.varlen_q,
        kv_layout=problem.kv_layout,
        seqused_k=seqused_k is not None,
        scalar_kv_length=int_length is not None,
        page_box_rows=math.gcd(problem.page_size, config.tile_n) if problem.page_size else None,
        split=split,
        pack_gqa_ratio=pack_ratio,
    )
    kernel = get_forward_kernel(key)
    partials = (
        _SplitPartials.for_shapes(num_splits, tuple(out.shape), _lse_shape(problem, q))
        if split
        else None
    )
    out_kernel = (
        checks.for_tma(out)
        if checks.aligned_16b(out)
        else torch.empty_like(out, memory_format=torch.contiguous_format)
    )
    q_k, k_k, v_k = checks.for_tma(q), checks.for_tma(k), checks.for_tma(v)
    max_ctas = num_sms(device_index) * config.ctas_per_sm  # the persistent grid's cap
    # Zeroed counters: the dynamic scheduler's tile counter, or a split launch's per-tile arrivals.
    num_counters = (
        2 if key.uses_tile_counter else _split_tiles(problem, q, config, pack_ratio) if split else 0
    )
    with _on_device(q.device):  # (counters and scratch depend on q's device's current stream)
        stream = _stream_key(q.device) if num_counters or partials is not None else None
        buffers = _stream_buffers(
            q.device, stream, num_counters, partials
        )  # (alive through the launch)
        counters, scratch = _kernel_scratch(buffers, split)
        kv_length = 0 if int_length is None else int_length
        if split:  # FlashAttentionForwardSm90.call_split: the scratch as two addresses
            kernel(
                q_k,
                k_k,
                v_k,
                out_kernel,
                lse,
                scratch,
                scale_log2,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_k,
                page_table,
                counters,
                max_ctas,
                num_splits,
                kv_length,
            )
        elif key.takes_optionals:
            kernel(
                q_k,
                k_k,
                v_k,
                out_kernel,
                lse,
                None,
                None,
                scale_log2,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_k,
                page_table,
                counters,
                max_ctas,
                num_splits,
                kv_length,
            )
        else:  # the shorter signature of a variant without optional tensors
            kernel(q_k, k_k, v_k, out_kernel, scale_log2, max_ctas, kv_length)
        if out_kernel.data_ptr() != out.data_ptr():
            out.copy_(out_kernel)
    # A call that needed no layout fix-ups can be replayed from its metadata alone.
    if q_k is not q or k_k is not k or v_k is not v or out_kernel is not out:
        return None
    return _LaunchPlan(
        forward=raw_function(kernel),
        device=q.device,
        dtype=q.dtype,
        out_shape=tuple(out.shape),
        lse_shape=tuple(lse.shape) if lse is not None else None,
        scale_log2=scale_log2,
        max_ctas=max_ctas,
        num_splits=num_splits,
        num_counters=num_counters,
        out_like_q=q.is_contiguous()
        and tuple(out.shape) == tuple(q.shape)
        and out.dtype == q.dtype,
        partials=partials,
        short_signature=not key.takes_optionals,
        extents=tuple(checks.byte_extent(t) for t in (q, k, v, out)),
    )


def single_wave_config(
    config: AttentionConfig, problem: _Problem, pack_ratio: int, split: bool, device_index: int
) -> AttentionConfig:
    """The dynamic persistent scheduler's static twin when the tiles fit in one wave of CTAs:
    then CTA i takes tile i and none takes a second under either scheduler, and the static one
    needs no tile counter (one per-stream buffer fewer to look up per call: small problems are
    where host time matters). Varlen and split launches keep theirs."""
    if config.scheduler != "dynamic_persistent" or split or problem.varlen_q:
        return config
    if (
        _padded_tiles(problem, config.tile_m, pack_ratio)
        > num_sms(device_index) * config.ctas_per_sm
    ):
        return config
    return config.replace(scheduler="static_persistent")


def _split_tiles(problem: _Problem, q, config, pack_ratio: int) -> int:
    """Tiles of a split launch (its grid without the split factor: grid.x * heads * grid.z in
    FlashAttentionForwardSm90.__call__), one arrival counter each."""
    if problem.varlen_q:  # every sequence's query tiles, flattened, plus one spare per sequence
        return (math.ceil(q.shape[0] * pack_ratio / config.tile_m) + problem.batch) * (
            problem.nheads // pack_ratio
        )
    return _padded_tiles(problem, config.tile_m, pack_ratio)


def _padded_tiles(problem: _Problem, tile_m: int, pack_ratio: int) -> int:
    """Query tiles of every (batch, kv-or-q head) with max_seqlen_q rows each: a fixed-length
    problem's grid (the host's estimate for a varlen one)."""
    return (
        math.ceil(problem.max_seqlen_q * pack_ratio / tile_m)
        * (problem.nheads // pack_ratio)
        * problem.batch
    )


try:
    _current_device = torch._C._cuda_getDevice  # torch.cuda.current_device without its wrappers
except AttributeError:  # pragma: no cover - other torch builds
    _current_device = torch.cuda.current_device

try:
    _current_raw_stream = torch._C._cuda_getCurrentRawStream
    _stream_capturing = torch._C._cuda_isCurrentStreamCapturing
except AttributeError:  # pragma: no cover - other torch builds

    def _current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

    _stream_capturing = torch.cuda.is_current_stream_capturing


def _stream_key(device: torch.device):
    """(device index, current raw stream): the key of the buffers kept per stream between
    calls; None while a CUDA graph is being captured (a capture makes its own buffers, so no
    graph holds a cached one)."""
    raw = _current_raw_stream(device.index)
    # The legacy default stream (0) cannot be captured: no capture query for eager calls on it.
    if raw and _stream_capturing():
        return None
    return device.index, raw


def _grown_size(current: Optional[torch.Tensor], needed: int, cap: Optional[int] = None) -> int:
    """Size of a per-stream buffer replacing `current` (None: none yet) that is too small for
    `needed` elements: doubled, so a run of growing calls reallocates a few times only (at most
    `cap`, unless `needed` is larger). The replaced buffer goes back to torch's caching allocator
    (once no unsplit plan's memo holds it), which reuses it only in stream order, after the
    launches that used it; the version bump keeps any memo from using it again."""
    if current is None:
        return needed
    doubled = 2 * current.numel()
    return max(needed, doubled if cap is None else min(doubled, cap))


def _stream_buffers(device: torch.device, stream: Optional[tuple], num_counters: int, partials):
    """(counters, out_partial, lse_partial) of a launch on `stream` (_stream_key(device)): zeroed
    tile counters when num_counters, split scratch for `partials` (a _SplitPartials or None);
    None for what the launch does not use."""
    counters = _zeroed_counters(device, num_counters, stream) if num_counters else None
    out_partial, lse_partial = (
        _split_scratch(device, partials, stream) if partials is not None else (None, None)
    )
    return counters, out_partial, lse_partial


def _kernel_scratch(buffers: tuple, split: bool) -> tuple:
    """What a launch passes the kernel for _stream_buffers' `buffers`: (counters, None) for an
    unsplit kernel; for a split kernel (FlashAttentionForwardSm90.call_split) the addresses of
    the arrival counters and of the partials (the LSE partial follows the O partial in one
    allocation, as _SplitPartials lays them out): two ints cost TVM-FFI ~0.7 us less than three
    tensors. The caller keeps `buffers` alive through the launch (the caches or a memo do
    between calls)."""
    counters, out_partial, _ = buffers
    if split:
        return counters.data_ptr(), out_partial.data_ptr()
    return counters, None


_COUNTERS: dict = {}
# Bumped whenever a per-stream buffer is replaced or dropped, so that launch plans' memos of
# them (_LaunchPlan.buffers) move to the caches' current buffers at their next launch. A split
# plan's memo holds bare addresses, so this bump is what keeps it from using freed memory:
# every path that replaces or drops a cached buffer must bump it. (A memo'd buffer stays valid
# for its stream: counters are left zero and the scratch is consumed within each launch.)
_BUFFERS_VERSION = [0]


def _zeroed_counters(device: torch.device, count: int, stream: Optional[tuple]) -> torch.Tensor:
    """At least `count` zeroed int32 counters: a dynamic-scheduler launch's tile counter, or a
    split launch's per-tile arrival counters. Each launch leaves its counters zero, so launches
    that run one after another share them: one buffer per (device, stream) for eager calls,
    grown when a launch needs more. A CUDA-graph capture gets a fresh buffer each time (zeroed
    by a captured fill), so graphs replayed on different streams never share counters.
    `stream` is _stream_key(device), which the caller queries once for all such buffers."""
    if stream is None:
        return torch.zeros(count, dtype=torch.int32, device=device)
    counters = _COUNTERS.get(stream)
    if counters is None or counters.numel() < count:
        counters = _COUNTERS[stream] = torch.zeros(
            _grown_size(counters, count), dtype=torch.int32, device=device
        )
        _BUFFERS_VERSION[0] += 1
    return counters


_FUNC_PLANS: dict = {}
_KVCACHE_PLANS: dict = {}
_VARLEN_PLANS: dict = {}


def _int_meta(t):
    """An optional int32 tensor's part of a launch-plan key: its shape and dtype (the compiled
    function takes uint32 for int32, and checks the rest itself); None stays None."""
    return None if t is None else (t.shape, t.dtype)


_MAX_PLANS = 4096


def _remember(plans: dict, key, plan) -> None:
    if key is None or plan is None:
        return
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan


class _LaunchPlan:
    """Everything a call derived from its arguments' metadata: the raw kernel functions, split
    count, buffer shapes. A later call whose key matches makes the same choices, and launches
    without the checks: the key holds the metadata those choices depend on (q's shape, dtype,
    device and contiguity, k's shape, flags, the int32 tensors' shapes and dtypes, and with out
    the strides that size the overlap check); the compiled function itself checks the rest of
    the 16-bit tensors (dtypes, one device, ranks, head_dim, strides divisible by 8 elements on
    dims longer than 1, 16-byte alignment, v's shape against k's, out's against q's) and raises
    before launching, and the call then takes the full checks (which name the argument, or
    copy what TMA cannot read: such a call pays that exception each time). What neither covers
    is checked here: the current device, and out not overlapping the inputs."""

    __slots__ = (
        "forward",
        "device",
        "device_index",
        "dtype",
        "out_shape",
        "lse_shape",
        "scale_log2",
        "max_ctas",
        "num_splits",
        "extents",
        "num_counters",
        "out_like_q",
        "partials",
        "int_capacity",
        "short_signature",
        "buffers",
    )

    def __init__(
        self,
        forward,
        device,
        dtype,
        out_shape,
        lse_shape,
        scale_log2,
        max_ctas,
        num_splits,
        partials,
        extents,
        num_counters=0,
        out_like_q=False,
        short_signature=False,
    ):
        self.forward = forward
        self.extents = extents  # bytes spanned by q, k, v, out
        self.device, self.device_index, self.dtype = device, device.index, dtype
        self.out_shape, self.lse_shape = out_shape, lse_shape
        self.scale_log2, self.max_ctas, self.num_splits = scale_log2, max_ctas, num_splits
        self.num_counters = num_counters  # zeroed int32 counters the kernel needs (0: none)
        self.out_like_q = out_like_q  # q contiguous: empty_like(q) is out (and cheaper to call)
        self.partials = partials
        # flash_attn_with_kvcache with an int cache_seqlens: the cache's capacity (replays pass
        # their length to the kernel as a scalar); None otherwise.
        self.int_capacity = None
        # The kernel takes (q, k, v, out, scale_log2, max_ctas, kv_length) only
        # (ForwardKernelKey.takes_optionals); otherwise its whole signature.
        self.short_signature = short_signature
        # The per-stream buffers of the last launch, as the kernel takes them: (raw stream,
        # _BUFFERS_VERSION, _kernel_scratch(...)), reused while the stream and version match (two
        # cache lookups fewer per split call; the caches keep the buffers alive, and replacing
        # or dropping one bumps the version); None before the first launch.
        self.buffers = None

    def usable(self, q, k, v, out) -> bool:
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) & 15 or _current_device() != self.device_index:
            return False
        if out is None:
            return True
        op = out.data_ptr()
        if op & 15:
            return False
        # Byte extents come from the metadata the plan was made for.
        oe = self.extents[3]
        return all(op >= p + e or p >= op + oe for p, e in zip((qp, kp, vp), self.extents))

    def launch(
        self,
        q,
        k,
        v,
        out,
        seqused_k=None,
        page_table=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        int_length=None,
    ):
        """Launch for a call whose key matched this plan. The key leaves out metadata the compiled
        function checks itself (see the class docstring): it raises before launching if they do
        not fit."""
        if out is None:
            out = (
                torch.empty_like(q)
                if self.out_like_q
                else torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            )
        kv_length = 0 if int_length is None else int_length
        if self.short_signature:  # the common call
            self.forward(q, k, v, out, self.scale_log2, self.max_ctas, kv_length)
            return out
        lse = (
            None
            if self.lse_shape is None
            else torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        )
        split = self.partials is not None
        counters = scratch = buffers = None
        if self.num_counters or split:
            # _stream_key inlined (one query for every per-stream buffer); the memo holds the
            # raw stream, the plan's device being fixed.
            raw = _current_raw_stream(self.device_index)
            capturing = (
                raw and _stream_capturing()
            )  # (the legacy default stream 0 cannot be captured)
            memo = self.buffers
            if (
                not capturing
                and memo is not None
                and memo[0] == raw
                and memo[1] == _BUFFERS_VERSION[0]
            ):
                counters, scratch = memo[2]
            else:
                stream = None if capturing else (self.device_index, raw)
                buffers = _stream_buffers(self.device, stream, self.num_counters, self.partials)
                counters, scratch = _kernel_scratch(buffers, split)
                # (A capture's buffers are its own; large split scratch is allocated per call.)
                if stream is not None and (not split or self.partials.numel <= _SCRATCH_MAX_FLOATS):
                    self.buffers = (raw, _BUFFERS_VERSION[0], (counters, scratch))
        if split:
            self.forward(
                q,
                k,
                v,
                out,
                lse,
                scratch,
                self.scale_log2,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_k,
                page_table,
                counters,
                self.max_ctas,
                self.num_splits,
                kv_length,
            )
        else:
            self.forward(
                q,
                k,
                v,
                out,
                lse,
                None,
                None,
                self.scale_log2,
                cu_seqlens_q,
                cu_seqlens_k,
                seqused_k,
                page_table,
                counters,
                self.max_ctas,
                self.num_splits,
                kv_length,
            )
        return out if self.lse_shape is None else (out, lse)


@dataclass(frozen=True)
class _SplitPartials:
    """Layout of a split launch's fp32 partial O (num_splits, *out_shape) and LSE
    (num_splits, *lse_shape), contiguous and sharing one allocation (O first: its size is a
    multiple of headdim >= 64 floats, so the LSE starts 16-byte aligned)."""

    o_shape: tuple
    o_stride: tuple
    lse_shape: tuple
    lse_stride: tuple
    lse_offset: int
    numel: int

    def __post_init__(self):  # hashed once: a split launch looks its scratch views up by layout
        object.__setattr__(
            self, "_hash", hash((self.o_shape, self.o_stride, self.lse_shape, self.lse_stride))
        )

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def for_shapes(num_splits: int, out_shape: tuple, lse_shape: tuple) -> "_SplitPartials":
        o_shape, lse_shape = (num_splits, *out_shape), (num_splits, *lse_shape)
        offset = math.prod(o_shape)
        return _SplitPartials(
            o_shape,
            _contiguous_strides(o_shape),
            lse_shape,
            _contiguous_strides(lse_shape),
            offset,
            offset + math.prod(lse_shape),
        )

    def allocate(self, device):
        return self.views_of(torch.empty(self.numel, dtype=torch.float32, device=device))

    def views_of(self, buffer):
        """(out_partial, lse_partial) at the start of an fp32 buffer of at least numel floats."""
        return (
            buffer.as_strided(self.o_shape, self.o_stride),
            buffer.as_strided(self.lse_shape, self.lse_stride, self.lse_offset),
        )


# Split partials of up to this many floats (16 MB: decode steps need well under 1 MB per 8
# sequences) stay allocated per stream between calls; larger ones (split prefills) are
# allocated per call, where the host cost is noise. empty_cache() drops them.
_SCRATCH_MAX_FLOATS = 4 << 20
_SCRATCH: dict = {}


def empty_cache() -> None:
    """Drop the buffers flash_cute keeps between calls on each (device, stream): split-KV
    partials scratch (up to 16 MB each) and the zeroed tile counters. Their memory goes back to
    torch's caching allocator (torch.cuda.empty_cache() then returns it to the driver); launches
    already queued are unaffected, since the allocator reuses a block only in stream order.
    CUDA graphs keep the buffers they captured."""
    _SCRATCH.clear()
    _COUNTERS.clear()
    _BUFFERS_VERSION[0] += 1
    for plans in (_FUNC_PLANS, _KVCACHE_PLANS, _VARLEN_PLANS):
        for plan in plans.values():
            plan.buffers = None


def _split_scratch(device: torch.device, partials: _SplitPartials, stream: Optional[tuple]):
    """A split launch's (out_partial, lse_partial). The kernel merges them before it ends, so
    launches that run one after another on a stream can share them: one buffer per (device,
    stream), with its views cached per layout (torch.empty and two as_strided cost several us
    per call); `stream` is _stream_key(device). A CUDA-graph capture and large layouts
    allocate their own."""
    key = None if partials.numel > _SCRATCH_MAX_FLOATS else stream
    if key is None:
        return partials.allocate(device)
    scratch = _SCRATCH.get(key)
    if scratch is None or scratch[0].numel() < partials.numel:
        size = _grown_size(
            None if scratch is None else scratch[0], partials.numel, _SCRATCH_MAX_FLOATS
        )
        scratch = _SCRATCH[key] = (torch.empty(size, dtype=torch.float32, device=device), {})
        _BUFFERS_VERSION[0] += 1
    views = scratch[1].get(partials)
    if views is None:
        if len(scratch[1]) >= 64:
            scratch[1].clear()
        views = scratch[1][partials] = partials.views_of(scratch[0])
    return views


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _lse_shape(problem: _Problem, q):
    if problem.varlen_q:
        return (problem.nheads, q.shape[0])
    return (problem.batch, problem.nheads, problem.max_seqlen_q)


def _combine(out_partial, lse_partial, out, lse):
    """out_partial (K, B, S, H, D) or (K, T, H, D) and matching lse views -> out, lse."""
    if out_partial.dim() == 4:
        out_partial, lse_partial = out_partial.unsqueeze(1), lse_partial.unsqueeze(1)
        out = out.unsqueeze(0)
        lse = lse.unsqueeze(0) if lse is not None else None
    if not checks.aligned_16b(out_partial):
        out_partial = (
            out_partial.contiguous()
            if out_partial.data_ptr() % 16 == 0
            else out_partial.clone(memory_format=torch.contiguous_format)
        )
    out_kernel = (
        out
        if checks.aligned_16b(out)
        else torch.empty_like(out, memory_format=torch.contiguous_format)
    )
    key = CombineKernelKey(
        out_dtype=checks.ALL_DTYPE_NAMES[out.dtype],
        head_dim=out.shape[-1],
        writes_lse=lse is not None,
    )
    with _on_device(out.device):
        get_combine_kernel(key)(out_partial, lse_partial, out_kernel, lse)
        if out_kernel.data_ptr() != out.data_ptr():
            out.copy_(out_kernel)


class _on_device:
    """torch.cuda.device(d) only when d is not already current (it costs a few us)."""

    def __init__(self, device):
        self.device = device
        self.ctx = None

    def __enter__(self):
        index = self.device.index
        if index is not None and index != torch.cuda.current_device():
            self.ctx = torch.cuda.device(self.device)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
