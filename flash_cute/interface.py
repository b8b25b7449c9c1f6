"""Public attention entry points: padded, varlen and KV-cache forward, and the split combine.

Each forward entry point is generated from its signature (flash_cute.entry): a call like an
earlier one (same replay key, derived from the parameters' roles in flash_cute.call) replays
that call's launch plan (flash_cute.runtime.LaunchPlan) without the Python checks; otherwise
its arguments become a flash_cute.call.Call and take the shared forward path
(flash_cute.forward): the checks, the plan step, a new launch plan, the launch. The stubs below
hold the signatures and docstrings; their bodies never run.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import checks, ops, runtime
from .call import CALL_FIELDS, Call
from .config import AttentionConfig
from .entry import EntryPoint, entry_point
from .runtime import FUNC_PLANS, KVCACHE_PLANS, VARLEN_PLANS, empty_cache

# A torch.compile trace (or export) calls the custom ops (flash_cute.ops); eager calls take the
# fast paths. (torch.compiler.is_compiling itself: dynamo knows the function.)
_is_compiling = torch.compiler.is_compiling

__all__ = [
    "empty_cache",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]


def _padded_prefill(call: Call) -> Call:
    """flash_attn_func: the prefill table whatever seqlen_q is, and no packed GQA (the padded
    API's kernels), never split."""
    return call.replace(decode_rows=False, pack_gqa=False, num_splits=1)


@entry_point(FUNC_PLANS, adjust=_padded_prefill)
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
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Scaled dot-product attention forward on Hopper.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float8_e4m3fn (with FP8
            k and v), on a CUDA device of compute capability 9.0.
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
            64 against v's 512) and the default scale 1/sqrt(headdim + headdim_v). headdim
            64 with headdim_v 256, 384 or 512.
        q_descale, k_descale, v_descale: with FP8 (float8_e4m3fn) q, k and v, (batch,
            nheads_kv) float32 dequantization scales (stride 0 allowed; None: 1), as
            FlashAttention-3 takes them: the scores are (q k^T) * q_descale * k_descale *
            softmax_scale and out is scaled by v_descale. Head dims that are multiples of
            32 (equal, up to 256) run in e4m3 tensor-core math (FlashAttention-3's error);
            others, and calls given a `config`, convert q to out's dtype on the way in
            (exact) and each K/V block in the kernel: 16-bit math.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype (FP8 q: bfloat16, or out's
        float16), and with return_lse also
        lse (batch, nheads, seqlen_q) float32 (natural log; -inf for rows with no keys and no
        sink).

    Runs on torch's current CUDA stream, with no host synchronization, so a call can be
    captured in a CUDA graph after one warm-up call (which compiles the kernel).
    """


@entry_point(VARLEN_PLANS, required=("cu_seqlens_q",))
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_k=None,
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
    q_descale: Optional[torch.Tensor] = None,
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
        q_descale: with float8_e4m3fn q (and FP8 k, v), as in flash_attn_func.
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


@entry_point(KVCACHE_PLANS)
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
    q_descale: Optional[torch.Tensor] = None,
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
        k_descale, v_descale: with an FP8 cache (k_cache and v_cache float8_e4m3fn),
            (batch, nheads_kv) float32 dequantization scales (stride 0 allowed; None: 1): the
            keys are k_cache * k_descale[b, h], the values v_cache * v_descale[b, h]. With
            16-bit q the kernel converts each block to q's dtype exactly and does the math
            in 16 bits.
        q_descale: with float8_e4m3fn q (SGLang's and vLLM's FP8 attention; an FP8 cache),
            as in flash_attn_func; out is then bfloat16 (or out's float16). Head dims that
            are multiples of 32 (equal, up to 256) run e4m3 math on padded and paged caches
            alike; others take q converted exactly and run 16-bit math.
        Other arguments as in flash_attn_func.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v), and with return_softmax_lse also lse
        (batch, nheads, seqlen_q) float32. A sequence with 0 keys gets out = 0, lse = -inf.

    No host synchronization, and split buffers are sized from shapes and num_splits only: after
    one warm-up call a decode step can be captured in a CUDA graph and replayed with new
    cache_seqlens and page_table contents.
    """


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


# ----------------------------------------------------------------------------------------
# The custom ops' CUDA kernels (flash_cute.ops): the calls run eagerly
# ----------------------------------------------------------------------------------------

# flash_cute::forward's arguments are a Call's fields: an entry point of their own, whose
# replay key and plans serve compiled graphs as the public functions' serve eager calls.
_FORWARD_CALL = EntryPoint.of_call().function


_RETURN_LSE = CALL_FIELDS.index("return_lse")
_APPEND_K = CALL_FIELDS.index("append_k")


def _forward_kernel(*values):
    fields = ops.fields_from_op(values)  # (in CALL_FIELDS order: _FORWARD_CALL's parameters)
    ops.refuse_fused_append(fields[_APPEND_K])
    result = _FORWARD_CALL(*fields)
    return ops.lse_or_empty(result, fields[_RETURN_LSE], fields[0])


def _combine_kernel(out_partial, lse_partial, out, return_lse):
    result = flash_attn_combine(out_partial, lse_partial, out, out.dtype, return_lse)
    return ops.lse_or_empty(result, return_lse, out_partial)


ops.LIBRARY.impl("forward", _forward_kernel, "CUDA")
ops.flash_attn_combine_op.register_kernel("cuda", _combine_kernel)
