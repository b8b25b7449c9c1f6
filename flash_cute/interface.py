"""Public attention entry points: padded, varlen and KV-cache forward, and the split combine.

Each forward entry point first looks its call up by a key of the arguments' metadata: a call
like an earlier one replays that call's launch plan (flash_cute.runtime.LaunchPlan) without
the Python checks. Otherwise it checks its own arguments, describes the call as a
flash_cute.plan.Problem, and takes the shared forward path (_forward): the common checks, the
plan step, and a new launch plan, through which it launches.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import checks, ops, runtime
from . import config as configs
from .config import AttentionConfig
from .plan import Problem, plan_forward
from .runtime import (
    FUNC_PLANS,
    KVCACHE_PLANS,
    VARLEN_PLANS,
    LaunchPlan,
    PlanCache,
    current_device,
    empty_cache,
)

# A torch.compile trace (or export) calls the custom ops (flash_cute.ops); eager calls take the
# fast paths below. (torch.compiler.is_compiling itself: dynamo knows the function.)
_is_compiling = torch.compiler.is_compiling

__all__ = [
    "empty_cache",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[AttentionConfig] = None,
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
):
    """Scaled dot-product attention forward on Hopper.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA device of
            compute capability 9.0.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype and device as q;
            nheads must be a multiple of nheads_kv (GQA/MQA read the shared K/V head).
            headdim is one of 64, 96, 128, 192, 256, 512 (576 with qv-less absorbed MLA;
            docs/api.md). v may have its own head dim headdim_v (one of the same, or 512;
            MLA prefill: 192 / 128); out then has headdim_v.
            Each tensor needs a contiguous last dimension; other strides are arbitrary
            (slices of bigger tensors work; strides that are not multiples of 16 bytes cost
            a copy).
        softmax_scale: scale (>= 0) of q k^T before the softmax; default 1/sqrt(headdim).
        causal: mask key j for query i when j > i + seqlen_k - seqlen_q (bottom-right aligned).
        return_lse: also return the log-sum-exp of each row.
        out: optional preallocated output, shape and dtype of q, last dim contiguous.
        config: optional `AttentionConfig` overriding the per-head-dim table (validated).
        window_size: (left, right) local attention, -1 meaning unbounded on that side: query i
            sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (bottom-right
            aligned; with causal, the right side is 0). Key blocks outside every row's window
            are never loaded.
        attention_chunk: c > 0 also restricts query i to the keys j with
            floor((i + sk - sq) / c) == floor(j / c) (chunked local attention); 0: off.
        softcap: scores become softcap * tanh(s * softmax_scale / softcap) before masking and
            the softmax; 0: off.
        learnable_sink: (nheads,) float32, bfloat16 or float16 logits, one per head: an extra
            term exp(sink) in each row's softmax denominator with no value row (not scaled by
            softmax_scale). The returned LSE includes it; a row that sees no key gets out = 0
            and lse = its sink.
        qv: FlashAttention-3's absorbed-MLA form: (..., nheads, headdim_v) like q with v's
            head dim; the scores are q k^T + qv v^T (q and k then hold the rope part, e.g.
            64 against v's 512) and the default scale 1/sqrt(headdim + headdim_v).

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype, and with return_lse also
        lse (batch, nheads, seqlen_q) float32 (natural log; -inf for rows with no keys and no
        sink).

    Runs on torch's current CUDA stream, with no host synchronization, so a call can be
    captured in a CUDA graph after one warm-up call (which compiles the kernel).
    """
    if _is_compiling():
        return ops.traced_func(
            q, k, v, softmax_scale, causal, return_lse, out, config, window_size,
            attention_chunk, softcap, learnable_sink, qv,
        )  # fmt: skip
    try:  # a call like an earlier one replays its launch plan (runtime.LaunchPlan); hot
        # The compiled function checks the rest of q, k, v and out (LaunchPlan.launch); without
        # out, whether q is contiguous picks how out is allocated; with out, the strides give the
        # byte extents of the overlap check (LaunchPlan.usable).
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
            window_size,
            attention_chunk,
            softcap,
            None if learnable_sink is None else (learnable_sink.shape, learnable_sink.dtype),
            qv if qv is None else (qv.shape, qv.dtype),
            type(softmax_scale),
            type(causal),
            type(return_lse),
            type(attention_chunk),
            type(softcap),
        )  # True == 1 == 1.0 as keys
        plan = FUNC_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == current_device() if out is None else plan.usable(q, k, v, out)
    ):
        try:
            if learnable_sink is None and qv is None:
                return plan.launch(q, k, v, out)
            return plan.launch(
                q, k, v, out, None, None, None, None, 0, learnable_sink, None, None, None, qv
            )
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
    checks.check_v_shape("v", v, "k", k)
    _check_qv(qv, q, v)
    problem = Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k.shape[2],
        **_head_dim_fields(head_dim, k, v, qv),
        dtype=checks.dtype_name(q.dtype),
        max_seqlen_q=seqlen_q,
        max_seqlen_k=k.shape[1],
        kv_capacity=k.shape[1],
        causal=checks.optional_bool("causal", causal),
        writes_lse=checks.optional_bool("return_lse", return_lse),
        **_mask_options(window_size, attention_chunk, softcap, learnable_sink, nheads),
    )
    # The prefill table whatever seqlen_q is, and no packed GQA: the padded API's kernels.
    return _forward(
        FUNC_PLANS,
        key,
        problem,
        q,
        k,
        v,
        out,
        softmax_scale,
        config,
        1,
        False,
        decode_rows=False,
        named=(("q", q), ("k", k), ("v", v), ("learnable_sink", learnable_sink), ("qv", qv)),
        learnable_sink=learnable_sink,
        qv=qv,
    )


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
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Attention over a batch of variable-length sequences packed along one token dimension.

    Args:
        q: (total_q, nheads, headdim); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
        k, v: one of
            (total_k, nheads_kv, headdim) packed, with cu_seqlens_k;
            (batch, seqlen_k, nheads_kv, headdim) padded, with seqused_k (valid keys per
                sequence) or without (all seqlen_k keys);
            (num_pages, page_size, nheads_kv, headdim) paged, with page_table and usually
                seqused_k (without it, every slot of the table's pages is a key). Any page
                size; pages need not be contiguous or ordered. Sizes whose pages a TMA box of
                a multiple of 16 rows cannot follow (1, 8, 24, ...) are gathered row by row.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 prefix sums of the lengths.
        max_seqlen_q: int, the longest query length (host value; picks the tile config — the
            grid covers every sequence's tiles whatever it says).
        seqused_k: (batch,) int32 valid keys per sequence (clamped to the sequence's keys:
            its cu_seqlens_k length when packed, the cache's capacity otherwise).
        max_seqlen_k: int, the longest key length; only guides the split heuristic.
        seqused_q: (batch,) int32: sequence b's queries are its first seqused_q[b] rows (the
            rest of its span is neither read as queries nor written).
        cache_batch_idx, cache_leftpad: with padded or paged k, v, as in
            flash_attn_with_kvcache (sequence b reads cache row or page-table row
            cache_batch_idx[b]; its keys start at slot cache_leftpad[b]).
        qv: (total_q, nheads, headdim_v), as in flash_attn_func.
        k_descale, v_descale: with float8_e4m3fn k and v (an FP8 cache), (batch, nheads_kv)
            float32 scales, as in flash_attn_with_kvcache.
        page_table: (batch, max_pages_per_seq) int32 page indices.
        num_splits: 1 (default) no split-KV; n forces n; 0 picks with the heuristic.
        pack_gqa: fold the q heads of a kv head into one tile (as in flash_attn_with_kvcache).
        config: optional `AttentionConfig` overriding the tables (validated); split-KV
            launches keep one CTA per query tile whatever its scheduler says.
        window_size, attention_chunk, softcap, learnable_sink: as in flash_attn_func, per
            sequence (i and j count within the sequence).
        Other arguments as in flash_attn_func.

    Returns:
        out (total_q, nheads, headdim_v), and with return_softmax_lse also lse
        (nheads, total_q) float32. A sequence with no keys gets out = 0, lse = -inf.

    cu_seqlens contents are not checked (that would need a host sync): they must start at 0,
    be non-decreasing and stay within q/k. Rows of q past cu_seqlens_q[-1] are not written.
    The call has no host synchronization.
    """
    if _is_compiling():
        return ops.traced_varlen(
            q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k,
            page_table, softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out,
            config, window_size, attention_chunk, softcap, learnable_sink, seqused_q,
            cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
        )  # fmt: skip
    try:  # a call like an earlier one replays its launch plan (runtime.LaunchPlan); hot
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
            None if cu_seqlens_k is None else (cu_seqlens_k.shape, cu_seqlens_k.dtype),
            None if seqused_k is None else (seqused_k.shape, seqused_k.dtype),
            None if page_table is None else (page_table.shape, page_table.dtype),
            None if seqused_q is None else (seqused_q.shape, seqused_q.dtype),
            None if cache_batch_idx is None else (cache_batch_idx.shape, cache_batch_idx.dtype),
            None if cache_leftpad is None else (cache_leftpad.shape, cache_leftpad.dtype),
            None if qv is None else (qv.shape, qv.dtype),
            k.dtype,
            v.dtype,
            None if k_descale is None else (k_descale.shape, k_descale.dtype),
            None if v_descale is None else (v_descale.shape, v_descale.dtype),
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            causal,
            num_splits,
            pack_gqa,
            return_softmax_lse,
            config,
            window_size,
            attention_chunk,
            softcap,
            None if learnable_sink is None else (learnable_sink.shape, learnable_sink.dtype),
            type(max_seqlen_q),
            type(max_seqlen_k),
            type(softmax_scale),
            type(causal),
            type(num_splits),
            type(pack_gqa),
            type(return_softmax_lse),
            type(attention_chunk),
            type(softcap),
        )
        plan = VARLEN_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == current_device() if out is None else plan.usable(q, k, v, out)
    ):
        try:
            return plan.launch(
                q, k, v, out, seqused_k, page_table, cu_seqlens_q, cu_seqlens_k, 0, learnable_sink,
                seqused_q, cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
            )  # fmt: skip
        except Exception:  # an argument the compiled function refused: the checks below name it
            pass
    checks.check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if cu_seqlens_k is not None and page_table is not None:
        raise ValueError(
            "page_table cannot be combined with cu_seqlens_k (paged keys use seqused_k)"
        )
    if cu_seqlens_k is not None:
        kv_layout, kv_doc = "packed", "(total_k, nheads_kv, headdim) with cu_seqlens_k"
    elif page_table is not None:
        kv_layout, kv_doc = "paged", "(num_pages, page_size, nheads_kv, headdim) with page_table"
    else:
        kv_layout, kv_doc = "padded", "(batch, seqlen_k, nheads_kv, headdim)"
    kv_ndim = 3 if kv_layout == "packed" else 4
    checks.check_tensor("k", k, kv_ndim, kv_doc, fp8=True)
    checks.check_tensor("v", v, kv_ndim, kv_doc, fp8=True)
    kv_dtype = checks.kv_cache_dtype(q, "k", k, "v", v)
    checks.check_v_shape("v", v, "k", k)
    _check_qv(qv, q, v, kv_dtype)
    total_q, nheads, head_dim = q.shape
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have headdim {head_dim} (that of q), got shape {tuple(k.shape)}")
    batch = checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    checks.check_descales(k_descale, v_descale, kv_dtype, batch, k.shape[-2])
    max_seqlen_q = checks.check_host_int("max_seqlen_q", max_seqlen_q)
    if cu_seqlens_k is not None:
        checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch)
    if seqused_k is not None:
        checks.check_seqused("seqused_k", seqused_k, batch)
    if seqused_q is not None:
        checks.check_seqused("seqused_q", seqused_q, batch, "queries used per sequence")
    if kv_layout == "packed" and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError(
            "cache_batch_idx and cache_leftpad index padded or paged caches, not packed keys "
            "(cu_seqlens_k)"
        )
    cache_batch = _check_cache_rows(batch, cache_batch_idx, cache_leftpad)
    if kv_layout == "paged":
        capacity = checks.check_page_table(page_table, cache_batch, k)
    elif kv_layout == "padded":
        _check_cache_batch(k, "k", batch, cache_batch)
        capacity = k.shape[1]
    else:
        capacity = k.shape[0]
    if max_seqlen_k is None:
        max_seqlen_k = capacity
    max_seqlen_k = min(checks.check_host_int("max_seqlen_k", max_seqlen_k), capacity)
    problem = Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k.shape[-2],
        **_head_dim_fields(head_dim, k, v, qv),
        dtype=checks.dtype_name(q.dtype),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_capacity=capacity if batch > 0 else 0,
        causal=checks.optional_bool("causal", causal),
        writes_lse=checks.optional_bool("return_softmax_lse", return_softmax_lse),
        varlen_q=True,
        total_q=total_q,
        kv_layout=kv_layout,
        page_size=k.shape[1] if kv_layout == "paged" else None,
        seqused_k=seqused_k is not None,
        seqused_q=seqused_q is not None,
        kv_batch_idx=cache_batch_idx is not None,
        leftpad_k=cache_leftpad is not None,
        kv_dtype=kv_dtype,
        **_mask_options(window_size, attention_chunk, softcap, learnable_sink, nheads),
    )
    return _forward(
        VARLEN_PLANS,
        key,
        problem,
        q,
        k,
        v,
        out,
        softmax_scale,
        config,
        num_splits,
        pack_gqa,
        named=(
            ("q", q),
            ("k", k),
            ("v", v),
            ("cu_seqlens_q", cu_seqlens_q),
            ("cu_seqlens_k", cu_seqlens_k),
            ("seqused_k", seqused_k),
            ("page_table", page_table),
            ("learnable_sink", learnable_sink),
            ("seqused_q", seqused_q),
            ("cache_batch_idx", cache_batch_idx),
            ("cache_leftpad", cache_leftpad),
            ("qv", qv),
            ("k_descale", k_descale),
            ("v_descale", v_descale),
        ),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k,
        page_table=page_table,
        learnable_sink=learnable_sink,
        seqused_q=seqused_q,
        kv_batch_idx=cache_batch_idx,
        leftpad_k=cache_leftpad,
        qv=qv,
        k_descale=k_descale,
        v_descale=v_descale,
    )


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
    window_size: Tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Attention of new queries over a KV cache (decoding, and prefill against a cache).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch, seqlen_cache, nheads_kv, headdim), or with page_table
            (num_pages, page_size, nheads_kv, headdim), any page size (see
            flash_attn_varlen_func); v_cache may have its own head dim headdim_v.
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
            once for all of them (None: on whenever nheads > nheads_kv and their count divides
            the tile rows; True: where it does not, the largest group of them that does).
        config: optional `AttentionConfig` overriding the decode and prefill tables
            (validated); persistent schedulers apply only when the call does not split.
        window_size, attention_chunk, softcap, learnable_sink: as in flash_attn_func, per
            sequence (i and j count within the sequence).
        cache_batch_idx: (batch,) int32: sequence b reads cache row cache_batch_idx[b] (or
            page-table row, when paged); k_cache (or page_table) may then have any number of
            rows. Indices are clamped to the rows there are (checking needs a host sync).
        cache_leftpad: (batch,) int32: sequence b's keys are cache slots cache_leftpad[b] ..
            cache_seqlens[b] - 1 (of its cache row, or of its pages in table order).
        qv: (batch, seqlen_q, nheads, headdim_v), as in flash_attn_func: absorbed MLA decode
            with k_cache the rope part and v_cache the latent.
        k_descale, v_descale: with an FP8 cache (k_cache and v_cache float8_e4m3fn, q 16-bit),
            (batch, nheads_kv) float32 dequantization scales (stride 0 allowed; None: 1): the
            keys are k_cache * k_descale[b, h], the values v_cache * v_descale[b, h]. The
            kernel converts each block to q's dtype exactly and does the math in 16 bits.
        Other arguments as in flash_attn_func.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v), and with return_softmax_lse also lse
        (batch, nheads, seqlen_q) float32. A sequence with 0 keys gets out = 0, lse = -inf.

    No host synchronization, and split buffers are sized from shapes and num_splits only: after
    one warm-up call a decode step can be captured in a CUDA graph and replayed with new
    cache_seqlens and page_table contents.
    """
    if _is_compiling():
        return ops.traced_kvcache(
            q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, causal, num_splits,
            pack_gqa, return_softmax_lse, out, config, window_size, attention_chunk, softcap,
            learnable_sink, cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
        )  # fmt: skip
    try:  # a call like an earlier one replays its launch plan (runtime.LaunchPlan); hot
        if isinstance(cache_seqlens, torch.Tensor):
            # dtype too: the compiled function takes uint32 as int32
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
            k_cache.dtype,
            v_cache.dtype,
            None if k_descale is None else (k_descale.shape, k_descale.dtype),
            None if v_descale is None else (v_descale.shape, v_descale.dtype),
            seqlens_meta,
            None if page_table is None else (page_table.shape, page_table.dtype),
            None if cache_batch_idx is None else (cache_batch_idx.shape, cache_batch_idx.dtype),
            None if cache_leftpad is None else (cache_leftpad.shape, cache_leftpad.dtype),
            None if qv is None else (qv.shape, qv.dtype),
            q.is_contiguous()
            if out is None
            else (q.stride(), k_cache.stride(), v_cache.stride(), out.stride()),
            softmax_scale,
            causal,
            num_splits,
            pack_gqa,
            return_softmax_lse,
            config,
            window_size,
            attention_chunk,
            softcap,
            None if learnable_sink is None else (learnable_sink.shape, learnable_sink.dtype),
            type(softmax_scale),
            type(causal),
            type(num_splits),
            type(pack_gqa),
            type(return_softmax_lse),
            type(attention_chunk),
            type(softcap),
        )
        plan = KVCACHE_PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is not None and (
        plan.device_index == current_device()
        if out is None
        else plan.usable(q, k_cache, v_cache, out)
    ):
        try:
            if plan.int_capacity is None:
                return plan.launch(
                    q, k_cache, v_cache, out, cache_seqlens, page_table, None, None, 0,
                    learnable_sink, None, cache_batch_idx, cache_leftpad, qv, k_descale,
                    v_descale,
                )  # fmt: skip
            if 0 <= cache_seqlens <= plan.int_capacity:  # otherwise the checks below raise
                return plan.launch(
                    q, k_cache, v_cache, out, None, page_table, None, None, cache_seqlens,
                    learnable_sink, None, cache_batch_idx, cache_leftpad, qv, k_descale,
                    v_descale,
                )  # fmt: skip
        except Exception:  # an argument the compiled function refused: the checks below name it
            pass
    checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    paged = page_table is not None
    if paged:
        kv_doc = "(num_pages, page_size, nheads_kv, headdim)"
    else:
        kv_doc = "(batch, seqlen_cache, nheads_kv, headdim)"
    checks.check_tensor("k_cache", k_cache, 4, kv_doc, fp8=True)
    checks.check_tensor("v_cache", v_cache, 4, kv_doc, fp8=True)
    kv_dtype = checks.kv_cache_dtype(q, "k_cache", k_cache, "v_cache", v_cache)
    checks.check_v_shape("v_cache", v_cache, "k_cache", k_cache)
    _check_qv(qv, q, v_cache, kv_dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    checks.check_descales(k_descale, v_descale, kv_dtype, batch, k_cache.shape[2])
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache must have headdim {head_dim} (that of q), got shape {tuple(k_cache.shape)}"
        )
    cache_batch = _check_cache_rows(batch, cache_batch_idx, cache_leftpad)
    if paged:
        capacity = checks.check_page_table(page_table, cache_batch, k_cache)
    else:
        _check_cache_batch(k_cache, "k_cache", batch, cache_batch)
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
    problem = Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=k_cache.shape[2],
        **_head_dim_fields(head_dim, k_cache, v_cache, qv),
        dtype=checks.dtype_name(q.dtype),
        max_seqlen_q=seqlen_q,
        max_seqlen_k=max_seqlen_k,
        kv_capacity=max_seqlen_k,
        causal=checks.optional_bool("causal", causal),
        writes_lse=checks.optional_bool("return_softmax_lse", return_softmax_lse),
        kv_layout="paged" if paged else "padded",
        page_size=k_cache.shape[1] if paged else None,
        seqused_k=seqused_k is not None,
        # The kernel takes an int length as a scalar (also for a contiguous cache, rather than
        # a slice of it, which costs two views per call).
        scalar_kv_length=int_length is not None,
        kv_batch_idx=cache_batch_idx is not None,
        leftpad_k=cache_leftpad is not None,
        kv_dtype=kv_dtype,
        **_mask_options(window_size, attention_chunk, softcap, learnable_sink, nheads),
    )
    return _forward(
        KVCACHE_PLANS,
        key,
        problem,
        q,
        k_cache,
        v_cache,
        out,
        softmax_scale,
        config,
        num_splits,
        pack_gqa,
        named=(
            ("q", q),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("page_table", page_table),
            ("cache_seqlens", seqused_k),
            ("learnable_sink", learnable_sink),
            ("cache_batch_idx", cache_batch_idx),
            ("cache_leftpad", cache_leftpad),
            ("qv", qv),
            ("k_descale", k_descale),
            ("v_descale", v_descale),
        ),
        seqused_k=seqused_k,
        page_table=page_table,
        kv_length=int_length,
        int_capacity=capacity,
        learnable_sink=learnable_sink,
        kv_batch_idx=cache_batch_idx,
        leftpad_k=cache_leftpad,
        qv=qv,
        k_descale=k_descale,
        v_descale=v_descale,
    )


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
    if _is_compiling():
        return ops.traced_combine(out_partial, lse_partial, out, out_dtype, return_lse)
    checks.check_combine_partials(out_partial, lse_partial)
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
    lse = None
    if return_lse:
        lse = torch.empty(shape[:-1], dtype=torch.float32, device=out_partial.device)
    if out.numel() > 0:
        if out_partial.shape[0] == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            runtime.combine(out_partial, lse_partial, out, lse)
    return (out, lse) if return_lse else out


def _forward(
    plans: PlanCache,
    key,
    problem: Problem,
    q,
    k,
    v,
    out,
    softmax_scale,
    config,
    num_splits,
    pack_gqa,
    decode_rows: bool = True,
    named=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_k=None,
    page_table=None,
    kv_length=None,
    int_capacity=None,
    learnable_sink=None,
    seqused_q=None,
    kv_batch_idx=None,
    leftpad_k=None,
    qv=None,
    k_descale=None,
    v_descale=None,
):
    """The forward path every entry point shares once its own arguments are checked and its
    call is described by `problem`: the common checks, the plan step, a launch plan (kept in
    `plans` under `key` when it can be replayed), and the launch through it. named: the call's
    tensors by argument name (default q, k, v). kv_length: an int cache_seqlens (int_capacity:
    the cache's capacity, which its replays check against)."""
    configs.check_head_dims(problem.head_dim, problem.head_dim_v)
    checks.check_gqa(problem.nheads, problem.nheads_kv)
    checks.check_grid(problem.nheads, problem.batch)
    scale_log2 = checks.softmax_scale_log2(softmax_scale, problem.head_dim)
    config = checks.check_config(
        config, problem.head_dim, problem.dtype, problem.head_dim_v, problem.v_in_k
    )
    num_splits = checks.check_num_splits(num_splits)
    pack_gqa = checks.check_optional_bool("pack_gqa", pack_gqa)
    named = named or (("q", q), ("k", k), ("v", v))
    checks.check_cuda([(n, t) for n, t in named if t is not None])
    checks.check_hopper(q.device)
    out = checks.output_for(out, q, k, v)
    if problem.varlen_q:
        lse_shape = (problem.nheads, problem.total_q)
    else:
        lse_shape = (problem.batch, problem.nheads, problem.max_seqlen_q)
    plan = None
    if out.numel() > 0:
        device_index = q.device.index if q.device.index is not None else current_device()
        plan = plan_forward(
            problem, runtime.num_sms(device_index), config, num_splits, pack_gqa, decode_rows
        )
    if plan is None or plan.variant is None:  # no rows, or no keys anywhere: nothing to launch
        out.zero_()
        if not problem.writes_lse:
            return out
        return out, torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    launch = LaunchPlan.build(plan, q, k, v, out, lse_shape, scale_log2)
    # TMA reads strides of 16 bytes: a tensor with others goes in as a copy (and such a call
    # is not replayed).
    q_k, k_k, v_k = checks.for_tma(q), checks.for_tma(k), checks.for_tma(v)
    qv_k = qv if qv is None else checks.for_tma(qv)
    out_k = checks.for_tma(out) if checks.aligned_16b(out) else None
    with runtime.on_device(q.device):  # (its buffers follow q's device's current stream)
        result = launch.launch(
            q_k, k_k, v_k, out_k, seqused_k, page_table, cu_seqlens_q, cu_seqlens_k,
            0 if kv_length is None else kv_length, learnable_sink, seqused_q, kv_batch_idx,
            leftpad_k, qv_k, k_descale, v_descale,
        )  # fmt: skip
    out_k, lse = result if problem.writes_lse else (result, None)
    if out_k.data_ptr() != out.data_ptr():
        out.copy_(out_k)
    if q_k is q and k_k is k and v_k is v and out_k is out and qv_k is qv:
        if kv_length is not None:
            launch.int_capacity = int_capacity  # replays check their length against it
        plans.remember(key, launch)
    return (out, lse) if problem.writes_lse else out


def _mask_options(window_size, attention_chunk, softcap, learnable_sink, nheads) -> dict:
    """The Problem fields of the local mask, softcap and sink arguments, checked."""
    window_left, window_right = checks.check_window_size(window_size)
    return dict(
        window_left=window_left,
        window_right=window_right,
        attention_chunk=checks.check_host_int("attention_chunk", attention_chunk),
        softcap=checks.check_softcap(softcap),
        learnable_sink=checks.check_learnable_sink(learnable_sink, nheads),
    )


def _check_qv(qv, q: torch.Tensor, v: torch.Tensor, kv_dtype: Optional[str] = None) -> None:
    """qv (FlashAttention-3's absorbed MLA): like q with v's head dim, q's dtype; served with
    the wide heads, on a 16-bit cache."""
    if qv is None:
        return
    if kv_dtype is not None:
        raise NotImplementedError(
            f"qv (absorbed MLA) reads a 16-bit latent cache; got a {kv_dtype} cache"
        )
    checks.check_tensor("qv", qv, q.dim(), "q's shape with v's head dim")
    checks.check_same_dtype("qv", qv, "q", q)
    if q.shape[-1] + v.shape[-1] not in configs.WIDE_HEAD_DIMS:
        raise NotImplementedError(
            f"flash_cute serves qv with q's and v's head dims summing to one of "
            f"{configs.WIDE_HEAD_DIMS} (absorbed MLA: 64 + 512), got {q.shape[-1]} + "
            f"{v.shape[-1]}"
        )
    if tuple(qv.shape) != (*q.shape[:-1], v.shape[-1]):
        raise ValueError(
            f"qv must have shape {(*q.shape[:-1], v.shape[-1])} (q's, with v's head dim), "
            f"got {tuple(qv.shape)}"
        )


def _head_dim_fields(head_dim: int, k: torch.Tensor, v: torch.Tensor, qv) -> dict:
    """The Problem's head-dim fields of a call: q/k's head dim (with qv, its columns too),
    v's, and how V is read (from K's columns, or qv's form)."""
    return dict(
        head_dim=head_dim + (0 if qv is None else v.shape[-1]),
        head_dim_v=v.shape[-1],
        v_in_k=_v_in_k(k, v),
        qv=qv is not None,
    )


def _v_in_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is a view of k's leading columns (absorbed MLA's latent cache: v = k[..., :dv]),
    so the kernel reads V from K's tiles instead of loading it."""
    return (
        v.shape[-1] > 256
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and v.shape[-1] % 64 == 0
    )


def _check_cache_rows(batch: int, cache_batch_idx, cache_leftpad) -> Optional[int]:
    """Checks cache_batch_idx and cache_leftpad; returns the batch size the cache (or page
    table) must have: None with cache_batch_idx (it picks the rows), else the call's batch."""
    if cache_batch_idx is not None:
        checks.check_seqused("cache_batch_idx", cache_batch_idx, batch, "cache row per sequence")
    if cache_leftpad is not None:
        checks.check_seqused("cache_leftpad", cache_leftpad, batch, "first key per sequence")
    return None if cache_batch_idx is not None else batch


def _check_cache_batch(k, name: str, batch: int, cache_batch: Optional[int]) -> None:
    """A padded cache's rows: the call's batch, or with cache_batch_idx at least one."""
    if cache_batch is not None and k.shape[0] != batch:
        raise ValueError(
            f"{name} must have batch size {batch} (that of the queries), got shape {tuple(k.shape)}"
        )
    if cache_batch is None and k.shape[0] == 0 and batch > 0:
        raise ValueError(f"cache_batch_idx needs a {name} with at least one cache row")


# ----------------------------------------------------------------------------------------
# The custom ops' CUDA kernels (flash_cute.ops): the public functions, run eagerly
# ----------------------------------------------------------------------------------------


def _func_op(q, k, v, out, softmax_scale, causal, return_lse, config, window_size,
             attention_chunk, softcap, learnable_sink, qv):  # fmt: skip
    result = flash_attn_func(
        q, k, v, softmax_scale, causal, return_lse, out, ops.config_from_str(config),
        tuple(window_size), attention_chunk, softcap, learnable_sink, qv,
    )  # fmt: skip
    return ops.lse_or_empty(result, return_lse, q)


def _varlen_op(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k,
               page_table, softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out,
               config, window_size, attention_chunk, softcap, learnable_sink, seqused_q,
               cache_batch_idx, cache_leftpad, qv, k_descale, v_descale):  # fmt: skip
    result = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k, page_table,
        softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out,
        ops.config_from_str(config), tuple(window_size), attention_chunk, softcap,
        learnable_sink, seqused_q, cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
    )  # fmt: skip
    return ops.lse_or_empty(result, return_softmax_lse, q)


def _kvcache_op(q, k_cache, v_cache, cache_seqlens, cache_seqlens_int, page_table,
                softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out, config,
                window_size, attention_chunk, softcap, learnable_sink, cache_batch_idx,
                cache_leftpad, qv, k_descale, v_descale):  # fmt: skip
    lengths = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    result = flash_attn_with_kvcache(
        q, k_cache, v_cache, lengths, page_table, softmax_scale, causal, num_splits, pack_gqa,
        return_softmax_lse, out, ops.config_from_str(config), tuple(window_size),
        attention_chunk, softcap, learnable_sink, cache_batch_idx, cache_leftpad, qv, k_descale,
        v_descale,
    )  # fmt: skip
    return ops.lse_or_empty(result, return_softmax_lse, q)


def _combine_op(out_partial, lse_partial, out, return_lse):
    result = flash_attn_combine(out_partial, lse_partial, out, out.dtype, return_lse)
    return ops.lse_or_empty(result, return_lse, out_partial)


ops.flash_attn_func_op.register_kernel("cuda", _func_op)
ops.flash_attn_varlen_func_op.register_kernel("cuda", _varlen_op)
ops.flash_attn_with_kvcache_op.register_kernel("cuda", _kvcache_op)
ops.flash_attn_combine_op.register_kernel("cuda", _combine_op)
