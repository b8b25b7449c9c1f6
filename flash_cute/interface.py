"""Public attention entry points."""

from __future__ import annotations

from typing import Optional

import torch

from . import checks
from .compile_cache import ForwardKernelKey, get_forward_kernel
from .config import AttentionConfig, default_config


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
        softmax_scale: scale of q k^T before the softmax; default 1/sqrt(headdim).
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
    checks.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    checks.check_tensor("k", k, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    checks.check_tensor("v", v, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch size {batch} (that of q), got shape {tuple(k.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have headdim {head_dim} (that of q), got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    checks.check_head_dim(head_dim)
    checks.check_gqa(nheads, nheads_kv)
    checks.check_grid(nheads, batch)
    causal = checks.optional_bool("causal", causal)
    return_lse = checks.optional_bool("return_lse", return_lse)
    scale_log2 = checks.softmax_scale_log2(softmax_scale, head_dim)
    dtype = checks.dtype_name(q.dtype)
    config = checks.check_config(config, head_dim, dtype) or default_config(head_dim, dtype, causal)
    checks.check_cuda((("q", q), ("k", k), ("v", v)))
    checks.check_hopper(q.device)

    shape = (batch, seqlen_q, nheads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    else:
        checks.check_out(out, shape, q, (q, k, v))
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None

    if out.numel() > 0:
        if seqlen_k == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            _launch_forward(q, k, v, out, lse, scale_log2, causal, config, dtype, head_dim)
    return (out, lse) if return_lse else out


def _launch_forward(q, k, v, out, lse, scale_log2, causal, config, dtype, head_dim):
    kernel = get_forward_kernel(
        ForwardKernelKey(dtype=dtype, head_dim=head_dim, causal=causal, config=config,
                         writes_lse=lse is not None)
    )
    # An out TMA cannot address (odd strides or base) is filled through a temporary.
    if checks.tma_compatible(out):
        out_kernel = checks.for_tma(out)
    else:
        out_kernel = torch.empty_like(out, memory_format=torch.contiguous_format)
    args = (checks.for_tma(q), checks.for_tma(k), checks.for_tma(v), out_kernel, lse, scale_log2)
    if q.device.index == torch.cuda.current_device():
        kernel(*args)
    else:
        with torch.cuda.device(q.device):
            kernel(*args)
    if out_kernel.data_ptr() != out.data_ptr():
        out.copy_(out_kernel)
