"""The forward path every entry point shares once a call is a `Call` (flash_cute.call).

`describe` checks a call's arguments and describes it as a flash_cute.plan.Problem (what the
plan step decides from); `run` adds the device checks, asks the plan step for the variant,
builds the launch plan (flash_cute.runtime.LaunchPlan), launches, and keeps the plan under the
call's replay key when the call can be replayed. Every check names the argument as the entry
point calls it (`names`: Call field -> parameter name).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, runtime
from . import config as configs
from .call import KERNEL_CALL_FIELDS, Call, length_bound
from .plan import Problem, plan_forward
from .runtime import LaunchPlan, PlanCache, current_device


def describe(call: Call, names: Optional[dict] = None) -> Problem:
    """The Problem of a call, after checking every argument it reads (no device checks: a call
    of meta tensors is described too, as get_scheduler_metadata does). An int key count enters
    as the largest count of its replay class (call.length_bound), capped by the capacity."""
    names = names or {}

    def name(field: str) -> str:
        return names.get(field, field)

    q, k, v = call.q, call.k, call.v
    varlen_q = call.cu_seqlens_q is not None
    if varlen_q:
        checks.check_tensor(
            name("q"), q, 3, "(total_q, nheads, headdim) with cu_seqlens_q", fp8=True
        )
    else:
        checks.check_tensor(name("q"), q, 4, "(batch, seqlen_q, nheads, headdim)", fp8=True)
        for field in ("seqused_q", "cu_seqlens_k"):
            if getattr(call, field) is not None:
                raise NotImplementedError(
                    f"flash_cute serves {name(field)} with packed queries (cu_seqlens_q) only"
                )
    q_fp8 = q.dtype in checks.FP8_DTYPES
    for field, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name(field)} must be a torch.Tensor, got {type(t).__name__}")
    if call.cu_seqlens_k is not None and call.page_table is not None:
        raise ValueError(
            f"{name('page_table')} cannot be combined with {name('cu_seqlens_k')} (paged keys use "
            f"{name('seqused_k')})"
        )
    if call.cu_seqlens_k is not None:
        kv_layout, kv_doc = "packed", f"(total_k, nheads_kv, headdim) with {name('cu_seqlens_k')}"
    elif call.page_table is not None:
        kv_layout = "paged"
        kv_doc = f"(num_pages, page_size, nheads_kv, headdim) with {name('page_table')}"
    else:
        kv_layout, kv_doc = "padded", "(batch, seqlen_k, nheads_kv, headdim)"
    kv_ndim = 3 if kv_layout == "packed" else 4
    # FP8 K/V: a cache where the call reads one (the padded prefill entry point does not), or
    # beside FP8 queries.
    fp8_kv = call.decode_rows or q_fp8
    if not fp8_kv and (k.dtype in checks.FP8_DTYPES or v.dtype in checks.FP8_DTYPES):
        raise TypeError(
            f"{name('k')} and {name('v')} in float8_e4m3fn need float8_e4m3fn {name('q')} here "
            f"(got {q.dtype}); 16-bit queries read FP8 keys as a cache: flash_attn_with_kvcache "
            "or flash_attn_varlen_func"
        )
    checks.check_tensor(name("k"), k, kv_ndim, kv_doc, fp8=fp8_kv)
    checks.check_tensor(name("v"), v, kv_ndim, kv_doc, fp8=fp8_kv)
    if q_fp8 and isinstance(call.out, torch.Tensor) and call.out.dtype not in checks.TORCH_DTYPES:
        raise TypeError(
            f"{name('out')} must be bfloat16 or float16 with float8_e4m3fn {name('q')}, got "
            f"{call.out.dtype}"
        )
    kv_dtype = checks.kv_cache_dtype(q, name("k"), k, name("v"), v)
    checks.check_v_shape(name("v"), v, name("k"), k)
    _check_qv(call.qv, q, v, kv_dtype)
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_kv = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(
            f"{name('k')} must have headdim {head_dim} (that of q), got shape {tuple(k.shape)}"
        )
    if varlen_q:
        batch = checks.check_cu_seqlens(name("cu_seqlens_q"), call.cu_seqlens_q, None)
        total_q = q.shape[0]
        if call.max_seqlen_q is None:
            raise ValueError(
                f"{name('max_seqlen_q')} must be given with {name('cu_seqlens_q')} (the longest "
                "query length, an int)"
            )
        max_seqlen_q = checks.check_host_int(name("max_seqlen_q"), call.max_seqlen_q)
    else:
        batch, max_seqlen_q = q.shape[0], q.shape[1]
        total_q = 0
    descales = ((name("k_descale"), call.k_descale), (name("v_descale"), call.v_descale))
    checks.check_descales(descales, kv_dtype, batch, nheads_kv)
    checks.check_descales(
        ((name("q_descale"), call.q_descale),),
        kv_dtype if q_fp8 else None,
        batch,
        nheads_kv,
        operands="queries",
    )
    if call.cu_seqlens_k is not None:
        checks.check_cu_seqlens(name("cu_seqlens_k"), call.cu_seqlens_k, batch)
    if call.seqused_k is not None:
        checks.check_seqused(name("seqused_k"), call.seqused_k, batch)
    if call.seqused_q is not None:
        checks.check_seqused(name("seqused_q"), call.seqused_q, batch, "queries used per sequence")
    if kv_layout == "packed" and (call.kv_batch_idx is not None or call.leftpad_k is not None):
        raise ValueError(
            f"{name('kv_batch_idx')} and {name('leftpad_k')} index padded or paged caches, not "
            f"packed keys ({name('cu_seqlens_k')})"
        )
    if call.kv_batch_idx is not None:
        checks.check_seqused(
            name("kv_batch_idx"), call.kv_batch_idx, batch, "cache row per sequence"
        )
    if call.leftpad_k is not None:
        checks.check_seqused(name("leftpad_k"), call.leftpad_k, batch, "first key per sequence")
    # The cache's rows: the call's batch, or any number with kv_batch_idx (which picks them).
    cache_batch = None if call.kv_batch_idx is not None else batch
    if kv_layout == "paged":
        capacity = checks.check_page_table(call.page_table, cache_batch, k, name("page_table"))
    elif kv_layout == "padded":
        if cache_batch is not None and k.shape[0] != batch:
            raise ValueError(
                f"{name('k')} must have batch size {batch} (that of the queries), got shape "
                f"{tuple(k.shape)}"
            )
        if cache_batch is None and k.shape[0] == 0 and batch > 0:
            raise ValueError(
                f"{name('kv_batch_idx')} needs a {name('k')} with at least one cache row"
            )
        capacity = k.shape[1]
    else:
        capacity = k.shape[0]
    if batch == 0:
        capacity = 0
    if call.appended_keys is not None:
        appended = checks.check_host_int(name("appended_keys"), call.appended_keys)
        if call.seqused_k is None:
            raise ValueError(
                f"{name('appended_keys')} ({appended}) counts rows past {name('seqused_k')}'s, "
                f"which the call lacks"
            )
        if appended > capacity and batch > 0:
            raise ValueError(
                f"{name('appended_keys')}={appended} exceeds the cache's capacity of "
                f"{capacity} keys"
            )
    max_seqlen_k = capacity
    if call.kv_length is not None:
        if call.seqused_k is not None:
            raise ValueError(f"{name('kv_length')} and {name('seqused_k')} exclude each other")
        length = checks.check_host_int(name("kv_length"), call.kv_length)
        if length > capacity and batch > 0:
            raise ValueError(
                f"{name('kv_length')}={length} exceeds the cache's capacity of {capacity} keys"
            )
        # Planned for every length that replays the plan (its class, up to the capacity).
        max_seqlen_k = min(capacity, length_bound(length))
    elif call.max_seqlen_k is not None:
        max_seqlen_k = min(checks.check_host_int(name("max_seqlen_k"), call.max_seqlen_k), capacity)
    window_left, window_right = checks.check_window_size(call.window_size)
    problem = Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=nheads_kv,
        head_dim=head_dim + (0 if call.qv is None else v.shape[-1]),
        head_dim_v=v.shape[-1],
        v_in_k=_v_in_k(k, v),
        qv=call.qv is not None,
        # FP8 queries: the output's (q_dtype says q is FP8; run converts it where the plan
        # runs 16-bit math).
        dtype=checks.dtype_name(checks.fp8_query_out_dtype(call.out) if q_fp8 else q.dtype),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        # An int count: the plan may see its whole class (a window then drops only where it
        # covers every key at each of them).
        kv_capacity=max_seqlen_k if call.kv_length is not None else capacity,
        causal=checks.optional_bool(name("causal"), call.causal),
        writes_lse=checks.optional_bool(name("return_lse"), call.return_lse),
        varlen_q=varlen_q,
        total_q=total_q,
        kv_layout=kv_layout,
        page_size=k.shape[1] if kv_layout == "paged" else None,
        seqused_k=call.seqused_k is not None,
        # The kernel takes an int length as a scalar (also for a contiguous cache, rather than
        # a slice of it, which costs two views per call).
        scalar_kv_length=call.kv_length is not None,
        seqused_q=call.seqused_q is not None,
        kv_batch_idx=call.kv_batch_idx is not None,
        leftpad_k=call.leftpad_k is not None,
        after_append=call.appended_keys is not None,
        **_fused_append(call, name, batch, kv_layout),
        kv_dtype=kv_dtype,
        q_dtype=checks.FP8_DTYPES[q.dtype] if q_fp8 else None,
        window_left=window_left,
        window_right=window_right,
        attention_chunk=checks.check_host_int(name("attention_chunk"), call.attention_chunk),
        softcap=checks.check_softcap(call.softcap),
        learnable_sink=checks.check_learnable_sink(call.learnable_sink, nheads),
    )
    # (get_scheduler_metadata describes calls too: these hold for every described call; the
    # qv pairs only with qv: a latent cache of those widths has no GPU test)
    configs.check_head_dims(problem.head_dim, problem.head_dim_v, problem.qv)
    checks.check_gqa(problem.nheads, problem.nheads_kv)
    return problem


def _fused_append(call: Call, name, batch: int, kv_layout: str) -> dict:
    """The CallShape fields of a fused append (Call.append_k; flash_cute.kv_append makes them
    and has checked its arguments: what is left to check is what only direct Call users could
    break)."""
    if call.append_k is None:
        if any(t is not None for t in (call.append_v, call.append_cos, call.append_sin)):
            raise ValueError(f"{name('append_v')}, cos and sin need {name('append_k')}")
        return {}
    k, v, new = call.append_k, call.append_v, call.appended_keys
    for field, rows, cache in (("append_k", k, call.k), ("append_v", v, call.v)):
        expected = (batch, new, *cache.shape[-2:])
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected:
            raise ValueError(f"{name(field)} must be {expected} (appended_keys rows a sequence)")
        if rows.dtype != cache.dtype or rows.stride(-1) != 1:
            raise ValueError(f"{name(field)} must be in the cache's dtype, last dim contiguous")
    if kv_layout == "packed" or call.kv_batch_idx is not None or call.leftpad_k is not None:
        raise NotImplementedError(
            f"{name('append_k')} appends to a padded or paged cache of each sequence's own row"
        )
    cos = call.append_cos
    if (cos is None) != (call.append_sin is None):
        raise ValueError(f"{name('append_cos')} and {name('append_sin')} go together")
    if cos is None:
        return dict(fused_append=True)
    table_dtype = checks.ALL_DTYPE_NAMES.get(cos.dtype)
    if table_dtype is None or cos.dim() != 2 or not 0 < 2 * cos.shape[1] <= k.shape[-1]:
        raise ValueError(
            f"{name('append_cos')} must be a (seqlen_ro, rotary_dim / 2) float16, bfloat16 or "
            f"float32 table, rotary_dim <= the head dim"
        )
    return dict(
        fused_append=True,
        rotary_dim=2 * cos.shape[1],
        rotary_interleaved=checks.optional_bool(
            name("append_interleaved"), call.append_interleaved
        ),
        rotary_per_row=checks.optional_bool(name("append_per_row"), call.append_per_row),
        rotary_dtype=table_dtype,
    )


def check(call: Call, names: dict) -> tuple:
    """Every check of one call that needs no launch: (problem, scale_log2, config,
    num_splits, pack_gqa, sms: the SMs its plan may use). kv_append runs them before it
    writes to the cache."""
    problem = describe(call, names)
    checks.check_grid(problem.nheads, problem.batch)
    scale_log2 = checks.softmax_scale_log2(call.softmax_scale, problem.head_dim)
    config = checks.check_config(
        call.config, problem.head_dim, problem.dtype, problem.head_dim_v, problem.v_in_k
    )
    num_splits = checks.check_num_splits(call.num_splits)
    pack_gqa = checks.check_optional_bool(names.get("pack_gqa", "pack_gqa"), call.pack_gqa)
    checks.check_cuda([(names.get(f, f), t) for f, t in call.tensors() if f != "out"])
    checks.check_hopper(call.q.device)
    device_index = call.q.device.index
    device_index = device_index if device_index is not None else current_device()
    sms = checks.sms_left(call.sm_margin, runtime.num_sms(device_index))
    return problem, scale_log2, config, num_splits, pack_gqa, sms


def run(call: Call, names: dict, plans: PlanCache, key):
    """Check, plan and launch one call; keep its launch plan in `plans` under `key` when it can
    be replayed (key None: never). Returns out, or (out, lse) with call.return_lse."""
    problem, scale_log2, config, num_splits, pack_gqa, sms = check(call, names)
    q, k, v, qv = call.q, call.k, call.v, call.qv
    out = checks.output_for(call.out, q, k, v)
    if problem.varlen_q:
        lse_shape = (problem.nheads, problem.total_q)
    else:
        lse_shape = (problem.batch, problem.nheads, problem.max_seqlen_q)
    plan = None
    if out.numel() > 0:
        plan = plan_forward(problem, sms, config, num_splits, pack_gqa, call.decode_rows)
    if plan is None or plan.variant is None:  # no rows, or no keys anywhere: nothing to launch
        out.zero_()
        if not problem.writes_lse:
            return out
        return out, torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if problem.q_dtype is not None and plan.variant.q_dtype is None:
        # FP8 queries in 16-bit math: q converted, q_descale folded (such calls are not
        # replayed: their launch plans hold the folded descale).
        call, key = with_descales_folded(call), None
        q = call.q
    launch = LaunchPlan.build(plan, q, k, v, out, lse_shape, scale_log2)
    # TMA reads strides of 16 bytes: a tensor with others goes in as a copy (and such a call
    # is not replayed).
    q_k, k_k, v_k = checks.for_tma(q), checks.for_tma(k), checks.for_tma(v)
    if call.append_k is not None and (k_k is not k or v_k is not v):  # (it writes the cache)
        raise ValueError(
            f"{names.get('append_k', 'append_k')}: a fused append writes k and v in place, "
            "which must then be 16-byte aligned (base and strides)"
        )
    qv_k = qv if qv is None else checks.for_tma(qv)
    out_k = checks.for_tma(out) if checks.aligned_16b(out) else None
    with runtime.on_device(q.device):  # (its buffers follow q's device's current stream)
        result = launch.launch(q_k, k_k, v_k, out_k, kernel_call_args(call.replace(qv=qv_k)))
    out_k, lse = result if problem.writes_lse else (result, None)
    if out_k.data_ptr() != out.data_ptr():
        out.copy_(out_k)
    if q_k is q and k_k is k and v_k is v and out_k is out and qv_k is qv:
        if call.kv_length is not None:
            launch.int_capacity = problem.kv_capacity  # replays check their length against it
        plans.remember(key, launch)
    return (out, lse) if problem.writes_lse else out


def with_descales_folded(call: Call) -> Call:
    """An FP8-query call as the FP8-cache kernels run it in 16-bit math (head dims FP8 math does
    not take): q converted to the output's dtype (exactly: every float8_e4m3fn value is a
    bfloat16 and a float16 value), q_descale folded into k_descale (both scale the scores of
    a (batch, kv head) pair). The FP8-math kernels take q and q_descale as they are."""
    k_descale = call.k_descale
    if call.q_descale is not None:
        k_descale = call.q_descale if k_descale is None else call.q_descale * k_descale
    q = call.q.to(checks.fp8_query_out_dtype(call.out))
    return call.replace(q=q, q_descale=None, k_descale=k_descale)


def kernel_call_args(call: Call) -> tuple:
    """The kernel's call arguments (call.KERNEL_CALL_FIELDS, ending in kv_length) of a call: its
    tensors, and its int key count (after an append: the rows appended to each sequence; 0
    without either)."""
    values = tuple(getattr(call, f) for f in KERNEL_CALL_FIELDS)
    scalar = call.appended_keys if call.kv_length is None else call.kv_length
    return values[:-1] + (scalar or 0,)


def _check_qv(qv, q: torch.Tensor, v: torch.Tensor, kv_dtype: Optional[str]) -> None:
    """qv (FlashAttention-3's absorbed MLA): like q with v's head dim, q's dtype, on a 16-bit
    cache; FlashAttention-3 takes q's head dim <= 64 and v's 256-512."""
    if qv is None:
        return
    if kv_dtype is not None:
        raise NotImplementedError(
            f"qv (absorbed MLA) reads a 16-bit latent cache; got a {kv_dtype} cache"
        )
    checks.check_tensor("qv", qv, q.dim(), "q's shape with v's head dim")
    checks.check_same_dtype("qv", qv, "q", q)
    d, dv = q.shape[-1], v.shape[-1]
    if d > 64 or dv < 256:
        raise ValueError(f"qv takes q's head dim <= 64 and v's >= 256, got {d} and {dv}")
    if d not in configs.QV_ROPE_DIMS or dv not in configs.QV_HEAD_DIMS_V:
        raise NotImplementedError(
            f"flash_cute serves qv with q's head dim one of {configs.QV_ROPE_DIMS} and v's one "
            f"of {configs.QV_HEAD_DIMS_V} (absorbed MLA: 64 + 512), got {d} + {dv}"
        )
    if tuple(qv.shape) != (*q.shape[:-1], v.shape[-1]):
        raise ValueError(
            f"qv must have shape {(*q.shape[:-1], v.shape[-1])} (q's, with v's head dim), "
            f"got {tuple(qv.shape)}"
        )


def _v_in_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is a view of k's leading columns (absorbed MLA's latent cache: v = k[..., :dv]),
    so the kernel reads V from K's tiles instead of loading it (never for meta tensors, which
    have no memory to share)."""
    return (
        v.shape[-1] > 256
        and not k.is_meta
        and v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and v.shape[-1] % 64 == 0
    )
