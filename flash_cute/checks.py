"""Argument checks shared by the public entry points.

Every check raises TypeError (wrong kind of object or dtype), ValueError (wrong shape, value,
device or layout) or RuntimeError (wrong GPU), naming the argument and what was expected.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .plan import MAX_SPLITS

TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# FP8 dtypes: of a K/V cache (converted to q's dtype in the kernel), and of FP8 queries (taken
# by the FP8 GEMMs, or converted to the output's dtype on the way in: flash_cute.forward).
FP8_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn"}
TMA_ALIGN_BYTES = 16
MAX_GRID_YZ = 65535

_capability_ok: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    return TORCH_DTYPES[dtype]


def check_tensor(name: str, t, ndim: int, layout: str, fp8: bool = False) -> None:
    """A tensor of ndim dims with a contiguous last dim, float16 or bfloat16 (or with fp8 also
    float8_e4m3fn)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in TORCH_DTYPES and not (fp8 and t.dtype in FP8_DTYPES):
        allowed = "float16, bfloat16 or float8_e4m3fn" if fp8 else "float16 or bfloat16"
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}"
        )


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {t.dtype}"
        )


def kv_cache_dtype(q, k_name: str, k, v_name: str, v) -> Optional[str]:
    """K and V in q's dtype (None), or both float8_e4m3fn with q 16-bit or FP8:
    "float8_e4m3fn"."""
    if q.dtype in FP8_DTYPES and (k.dtype not in FP8_DTYPES or v.dtype != k.dtype):
        raise TypeError(
            f"with FP8 q ({q.dtype}) {k_name} and {v_name} must be {q.dtype} too, got "
            f"{k.dtype} and {v.dtype}"
        )
    if k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES:
        if k.dtype != v.dtype:
            raise TypeError(
                f"{k_name} and {v_name} must both be float8_e4m3fn (an FP8 cache) or both "
                f"q's dtype, got {k.dtype} and {v.dtype}"
            )
        return FP8_DTYPES[k.dtype]
    check_same_dtype(k_name, k, "q", q)
    check_same_dtype(v_name, v, "q", q)
    return None


def fp8_query_out_dtype(out) -> torch.dtype:
    """The output dtype of a call with FP8 queries: out's where it is a 16-bit tensor, else
    bfloat16 (FlashAttention-3's). output_for names any other out."""
    if isinstance(out, torch.Tensor) and out.dtype in TORCH_DTYPES:
        return out.dtype
    return torch.bfloat16


def check_descales(
    named, fp8: Optional[str], batch: int, nheads_kv: int, operands: str = "K/V cache"
):
    """Dequantization scales of FP8 operands (named: (name, tensor or None) pairs):
    (batch, nheads_kv) float32 tensors (stride 0 allowed: an expanded scalar), or None for 1;
    only where those operands are FP8 (fp8: their dtype's name, None when 16-bit)."""
    for name, t in named:
        if t is None:
            continue
        if fp8 is None:
            raise ValueError(
                f"{name} dequantizes FP8 (float8_e4m3fn) {operands}; this call's are 16-bit: "
                "pass None"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != (batch, nheads_kv):
            raise ValueError(
                f"{name} must have shape (batch, nheads_kv) = {(batch, nheads_kv)} (an expanded "
                f"scalar is fine), got {tuple(t.shape)}"
            )


def check_cuda(named_tensors) -> None:
    """All tensors on one CUDA device (the first one's)."""
    (ref_name, ref), *rest = list(named_tensors)
    if not ref.is_cuda:
        raise ValueError(f"{ref_name} must be a CUDA tensor, got a tensor on {ref.device}")
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(
                f"{name} must be on {ref_name}'s device ({ref.device}), got {t.device}"
            )


def check_v_shape(name: str, v: torch.Tensor, k_name: str, k: torch.Tensor) -> None:
    """v has k's shape but for its last (head) dim, which may differ (MLA: d != dv)."""
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(
            f"{name} must have the shape of {k_name} {tuple(k.shape)} in every dim but the last "
            f"(its head dim), got {tuple(v.shape)}"
        )


def check_gqa(nheads: int, nheads_kv: int) -> None:
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads of k and v ({nheads_kv})"
        )


def check_hopper(device: torch.device) -> None:
    """RuntimeError unless the tensor's GPU is compute capability 9.0 (H100/H200)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capability_ok.get(index)
    if ok is None:
        major, minor = torch.cuda.get_device_capability(index)
        ok = (major, minor) == (9, 0)
        if not ok:
            name = torch.cuda.get_device_name(index)
            raise RuntimeError(
                f"flash_cute kernels need a Hopper GPU (compute capability 9.0, sm_90a); "
                f"{device} is {name} with compute capability {major}.{minor}"
            )
        _capability_ok[index] = ok


def softmax_scale_log2(softmax_scale, head_dim: int) -> float:
    """softmax_scale (default 1/sqrt(head_dim)) times log2(e), for exp2-based softmax."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    elif not math.isfinite(softmax_scale) or softmax_scale < 0:
        # The kernel's running row max is taken over unscaled scores, which is the max of the
        # scaled ones only for a scale >= 0.
        raise ValueError(f"softmax_scale must be finite and >= 0, got {softmax_scale}")
    return float(softmax_scale) * math.log2(math.e)


def output_for(out, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output of an attention call: out checked (q's shape with v's head dim, q's dtype
    (FP8 q: fp8_query_out_dtype) and device, and the checks of check_out_like against q, k,
    v), or new_out(q, v)."""
    if out is None:
        return new_out(q, v)
    shape = (*q.shape[:-1], v.shape[-1])
    dtype = fp8_query_out_dtype(out) if q.dtype in FP8_DTYPES else q.dtype
    check_out_like(out, shape, dtype, q.device, (("q", q), ("k", k), ("v", v)))
    return out


def new_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output a call allocates: q's shape with v's head dim, q's dtype (bfloat16 for FP8
    q), contiguous."""
    if q.dtype in FP8_DTYPES:
        return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16)
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from t's first to one past its last element (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (
        sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    ) * t.element_size()


def _span(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    return start, start + byte_extent(t)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def aligned_16b(t: torch.Tensor) -> bool:
    """16-byte aligned base and 16-byte multiple strides on every dim but the last (size-1 dims
    aside): what TMA boxes and 16-byte vector accesses need."""
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return False
    per = TMA_ALIGN_BYTES // t.element_size()
    return all(st % per == 0 for size, st in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)


def for_tma(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read it; a view with canonical strides on size-1 dims (which are
    never stepped over) when only those are off; otherwise an aligned contiguous copy."""
    if aligned_16b(t):
        strides = t.stride()
        per = TMA_ALIGN_BYTES // t.element_size()
        if all(st % per == 0 for st in strides[:-1]):
            return t
        fixed = list(strides)
        for i in range(t.dim() - 1):
            if t.shape[i] == 1 and fixed[i] % per:
                fixed[i] = per
        return t.as_strided(t.shape, fixed)
    return (
        t.clone(memory_format=torch.contiguous_format)
        if t.data_ptr() % TMA_ALIGN_BYTES
        else t.contiguous()
    )


def check_grid(nheads: int, batch: int) -> None:
    if nheads > MAX_GRID_YZ:
        raise ValueError(f"nheads must be at most {MAX_GRID_YZ}, got {nheads}")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"batch size must be at most {MAX_GRID_YZ}, got {batch}")


def check_config(
    config, head_dim: int, dtype: str, head_dim_v: Optional[int] = None, v_in_k: bool = False
):
    from .config import AttentionConfig

    if config is None:
        return None
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"config must be a flash_cute.AttentionConfig or None, got {type(config).__name__}"
        )
    return config.validate(head_dim, dtype, head_dim_v, v_in_k)


def optional_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, int)) or isinstance(value, float):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


ALL_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def check_optional_bool(name: str, value):
    if value is None:
        return None
    return optional_bool(name, value)


def check_host_int(name: str, value) -> int:
    """A non-negative Python int (not a tensor: reading one would synchronize with the GPU)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def sms_left(sm_margin, num_sms: int) -> int:
    """The SMs a launch may plan for: num_sms less sm_margin (a non-negative int below
    num_sms: FlashAttention-3's argument, SMs left to kernels running beside this one)."""
    sm_margin = check_host_int("sm_margin", sm_margin)
    if sm_margin >= num_sms:
        raise ValueError(
            f"sm_margin must leave at least one of the device's {num_sms} SMs, got {sm_margin}"
        )
    return num_sms - sm_margin


def check_num_splits(num_splits) -> int:
    num_splits = check_host_int("num_splits", num_splits)

    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be at most {MAX_SPLITS}, got {num_splits}")
    return num_splits


def _check_int32_vector(name: str, t, length: Optional[int], what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {want} ({what}), got {tuple(t.shape)}")


def check_window_size(window_size) -> Tuple[int, int]:
    """(left, right) ints, each -1 (unbounded) or >= 0."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if not ok or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size):
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be -1 (unbounded) or >= 0, got ({left}, {right})")
    return left, right


def check_softcap(softcap) -> float:
    """A finite float >= 0 (0: off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    return float(softcap)


SINK_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_learnable_sink(sink, nheads: int) -> Optional[str]:
    """None, or a contiguous (nheads,) float32/bfloat16/float16 tensor: its dtype's name."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None, got {type(sink).__name__}")
    if sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {sink.dtype}")
    if tuple(sink.shape) != (nheads,):
        raise ValueError(
            f"learnable_sink must have shape ({nheads},) (nheads), got {tuple(sink.shape)}"
        )
    if nheads > 1 and sink.stride(0) != 1:
        raise ValueError(f"learnable_sink must be contiguous, got stride {sink.stride()}")
    return SINK_DTYPES[sink.dtype]


def check_cu_seqlens(name: str, t, batch: Optional[int]) -> int:
    """cu_seqlens: (batch + 1,) int32. Returns batch. Contents are not read (no host sync)."""
    _check_int32_vector(name, t, None if batch is None else batch + 1, "batch + 1 prefix sums")
    if t.shape[0] < 1:
        raise ValueError(
            f"{name} must have at least one element (batch + 1), got shape {tuple(t.shape)}"
        )
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    return t.shape[0] - 1


def check_seqused(name: str, t, batch: int, what: str = "keys used per sequence") -> None:
    """A (batch,) contiguous int32 tensor of per-sequence counts (seqused_k/q, cache_seqlens,
    cache_leftpad, cache_batch_idx)."""
    _check_int32_vector(name, t, batch, what)
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def check_page_table(
    page_table, batch: Optional[int], k_cache: torch.Tensor, name: str = "page_table"
) -> int:
    """page_table (batch, max_pages) int32 over k_cache (num_pages, page_size, ...); batch
    None: any number of rows (cache_batch_idx picks them). Returns the key capacity per
    sequence, max_pages * page_size."""
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {page_table.dtype}")
    if page_table.dim() != 2 or (batch is not None and page_table.shape[0] != batch):
        raise ValueError(
            f"{name} must have shape (batch={batch if batch is not None else 'any'}, "
            f"max_pages_per_seq), got {tuple(page_table.shape)}"
        )
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension, got strides {page_table.stride()}"
        )
    page_size = k_cache.shape[1]
    if page_size == 0:
        raise ValueError("page size (k_cache.shape[1]) must be positive, got 0")
    return page_table.shape[1] * page_size if k_cache.shape[0] > 0 else 0


def check_combine_partials(out_partial, lse_partial) -> None:
    """flash_attn_combine's partials: fp32, matching shapes, a headdim the kernel serves."""
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
            f"lse_partial must have shape {tuple(out_partial.shape[:-1])}, "
            f"got {tuple(lse_partial.shape)}"
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


def check_out_like(out, shape, dtype, device, inputs) -> None:
    """A caller-provided output: type, shape, dtype, device, unit last stride, no broadcast
    dims, no overlap with the named inputs."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out must be on {device}, got {out.device}")
    if out.numel() > 0 and out.stride(-1) != 1:
        raise ValueError(
            f"out must have a contiguous last dimension (stride 1), got strides {out.stride()}"
        )
    if 0 in out.stride()[:-1] and out.numel() > 1:
        raise ValueError(
            f"out must not have broadcast (stride 0) dimensions, got strides {out.stride()}"
        )
    for name, t in inputs:
        if _overlaps(out, t):
            raise ValueError(f"out must not overlap {name} in memory")
