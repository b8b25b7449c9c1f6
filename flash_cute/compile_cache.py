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


_cache: Dict[ForwardKernelKey, Callable] = {}
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
    )
    batch, seqlen_q, nheads, seqlen_k, nheads_kv = (cute.sym_int() for _ in range(5))

    def qkvo(rows, heads):
        strides = tuple(cute.sym_int64(divisibility=STRIDE_DIVISIBILITY_16BIT) for _ in range(3))
        return cute.runtime.make_fake_tensor(
            dtype, (batch, rows, heads, key.head_dim), stride=(*strides, 1), assumed_align=16
        )

    q, out = qkvo(seqlen_q, nheads), qkvo(seqlen_q, nheads)
    k, v = qkvo(seqlen_k, nheads_kv), qkvo(seqlen_k, nheads_kv)
    lse = None
    if key.writes_lse:
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (batch, nheads, seqlen_q),
            stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4,
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = ("--enable-tvm-ffi " + options).strip()
    return cute.compile(kernel, q, k, v, out, lse, cutlass.Float32(1.0), stream, options=opts)


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
