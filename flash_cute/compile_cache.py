"""Compile forward kernels on fake tensors, once per static configuration, into a cache.

A compiled kernel depends only on (dtype, head_dim, causal, config, writes_lse): batch,
sequence lengths, head counts and strides are run-time values, so a new shape never
recompiles. Kernels are compiled for the TVM-FFI calling convention: the compiled function
takes torch tensors directly and launches on torch's current CUDA stream.

Compiling needs no GPU: with no device, the target architecture comes from CUTE_DSL_ARCH
(set to sm_90a by `ensure_target_arch`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .config import AttentionConfig

TARGET_ARCH = "sm_90a"

# Host-side contract the fake tensors declare (checked by flash_cute.checks before a call):
# 16-byte aligned base pointers and strides (in elements) divisible by this for 16-bit types.
STRIDE_DIVISIBILITY_16BIT = 8


@dataclass(frozen=True)
class ForwardKernelKey:
    """Everything that selects a distinct compiled forward kernel."""

    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    causal: bool
    config: AttentionConfig
    writes_lse: bool
    varlen_q: bool = False  # q packed as (total_q, nheads, d) with cu_seqlens_q
    kv_layout: str = "padded"  # "padded" | "packed" (cu_seqlens_k) | "paged"
    seqused_k: bool = False
    page_box_rows: Optional[int] = None  # TMA box rows for paged K/V: gcd(page_size, tile_n)
    split: bool = False
    pack_gqa_ratio: int = 1  # q heads per kv head folded into the tile rows (1: no packing)


_cache: Dict[object, Callable] = {}
_lock = threading.Lock()


def ensure_target_arch(arch: Optional[str] = None) -> None:
    """Make the DSL target Hopper. Without a GPU it would otherwise pick a default arch."""
    if arch is not None:
        os.environ["CUTE_DSL_ARCH"] = arch
    elif "CUTE_DSL_ARCH" not in os.environ:
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except ImportError:  # pragma: no cover - torch is a dependency
            has_gpu = False
        if not has_gpu:
            os.environ["CUTE_DSL_ARCH"] = TARGET_ARCH


def _cutlass_dtype(name: str):
    import cutlass

    return {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[name]


def compile_forward(key: ForwardKernelKey, options: str = "") -> Callable:
    """Compile (uncached) the forward kernel for `key` on fake tensors with symbolic shapes."""
    ensure_target_arch()
    import cutlass
    import cutlass.cute as cute

    from flash_cute.kernels import FlashAttentionForwardSm90

    dtype = _cutlass_dtype(key.dtype)
    cfg = key.config
    kernel = FlashAttentionForwardSm90(
        dtype=dtype,
        head_dim=key.head_dim,
        causal=key.causal,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        num_stages=cfg.num_stages,
        pv_from_registers=cfg.pv_from_registers,
        intra_wg_overlap=cfg.intra_wg_overlap,
        pingpong=cfg.pingpong,
        rescale_o_before_pv=cfg.rescale_o_before_pv,
        producer_registers=cfg.producer_registers,
        mma_registers=cfg.mma_registers,
        varlen_q=key.varlen_q,
        kv_layout=key.kv_layout,
        seqused_k=key.seqused_k,
        page_box_rows=key.page_box_rows,
        split=key.split,
        pack_gqa_ratio=key.pack_gqa_ratio,
    )
    sym = cute.sym_int
    batch, seqlen_q, nheads, seqlen_k, nheads_kv, splits = (sym() for _ in range(6))
    d = key.head_dim

    def tensor(dtype_, shape, align=16, last_contiguous=True):
        div = STRIDE_DIVISIBILITY_16BIT if align == 16 else 1
        strides = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1])
        return cute.runtime.make_fake_tensor(dtype_, shape, stride=(*strides, 1), assumed_align=align)

    q_rows = (seqlen_q,) if key.varlen_q else (batch, seqlen_q)
    q = tensor(dtype, (*q_rows, nheads, d))
    if key.kv_layout == "packed":
        kv_shape = (seqlen_k, nheads_kv, d)
    else:  # padded: (batch, seqlen_k, ...); paged: (num_pages, page_size, ...)
        kv_shape = (sym(), seqlen_k, nheads_kv, d)
    k, v = tensor(dtype, kv_shape), tensor(dtype, kv_shape)
    lse_shape = (nheads, seqlen_q) if key.varlen_q else (batch, nheads, seqlen_q)
    if key.split:
        out = tensor(cutlass.Float32, (splits, *q_rows, nheads, d))
        lse_shape = (splits, *lse_shape)
    else:
        out = tensor(dtype, (*q_rows, nheads, d))
    lse = tensor(cutlass.Float32, lse_shape, align=4) if key.writes_lse else None
    int32 = cutlass.Int32
    cu_seqlens_q = tensor(int32, (sym(),), align=4) if key.varlen_q else None
    cu_seqlens_k = tensor(int32, (sym(),), align=4) if key.kv_layout == "packed" else None
    seqused_k = tensor(int32, (sym(),), align=4) if key.seqused_k else None
    page_table = tensor(int32, (sym(), sym()), align=4) if key.kv_layout == "paged" else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = ("--enable-tvm-ffi " + options).strip()
    return cute.compile(
        kernel, q, k, v, out, lse, cutlass.Float32(1.0), cu_seqlens_q, cu_seqlens_k, seqused_k,
        page_table, int32(1), int32(1), stream, options=opts,
    )


@dataclass(frozen=True)
class CombineKernelKey:
    """A compiled split-KV combine kernel."""

    out_dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int
    writes_lse: bool


def compile_combine(key: CombineKernelKey, options: str = "") -> Callable:
    """Compile (uncached) the combine kernel for `key` on fake tensors with symbolic shapes."""
    ensure_target_arch()
    import cutlass
    import cutlass.cute as cute

    from flash_cute.kernels import FlashAttentionCombine

    out_dtype = {"float32": cutlass.Float32}.get(key.out_dtype) or _cutlass_dtype(key.out_dtype)
    splits, batch, seqlen, nheads = (cute.sym_int() for _ in range(4))
    d = key.head_dim

    def tensor(dtype_, shape, divisibility, align):
        strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1])
        return cute.runtime.make_fake_tensor(dtype_, shape, stride=(*strides, 1), assumed_align=align)

    fp32 = cutlass.Float32
    out_partial = tensor(fp32, (splits, batch, seqlen, nheads, d), 4, 16)
    lse_partial = cute.runtime.make_fake_tensor(
        fp32, (splits, batch, seqlen, nheads), stride=tuple(cute.sym_int64() for _ in range(4)), assumed_align=4
    )
    out = tensor(out_dtype, (batch, seqlen, nheads, d), 16 // (out_dtype.width // 8), 16)
    lse = None
    if key.writes_lse:
        lse = cute.runtime.make_fake_tensor(
            fp32, (batch, seqlen, nheads), stride=tuple(cute.sym_int64() for _ in range(3)), assumed_align=4
        )
    kernel = FlashAttentionCombine(out_dtype, d, key.writes_lse)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = ("--enable-tvm-ffi " + options).strip()
    return cute.compile(kernel, out_partial, lse_partial, out, lse, stream, options=opts)


def get_combine_kernel(key: CombineKernelKey) -> Callable:
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = compile_combine(key)
                _cache[key] = fn
    return fn


def get_forward_kernel(key: ForwardKernelKey) -> Callable:
    """The compiled kernel for `key`, compiling it on first use (thread-safe)."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = compile_forward(key)
                _cache[key] = fn
    return fn


def cached_keys():
    return list(_cache)


def clear_cache() -> None:
    _cache.clear()
