"""torch.library custom ops of the public entry points, for torch.compile and graph tracers.

Each forward entry point and the combine is one op under `flash_cute::`, an out-variant: it
writes the output tensor it is given (declared in mutates_args) and returns the LSE (an empty
tensor when the call asks for none). Their fake implementations compute the LSE's shape from
the arguments alone, so torch.compile traces a call without running it.

Eager calls never reach these ops: each public function checks `torch.compiler.is_compiling()`
first and, outside a trace, takes its own fast path (a launch-plan replay), so eager host time
does not pay for the dispatcher. Inside a trace the public function calls `traced_*` here,
which allocates the output and calls the op. The ops' CUDA kernels are the public functions
run eagerly: flash_cute.interface registers them (this module does not import it); on other
devices an op raises.

An AttentionConfig travels through an op as JSON (ops take no Python objects).
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional

import torch

from .checks import new_out
from .config import AttentionConfig

_EMPTY_LSE = (0,)


@torch.compiler.assume_constant_result  # a trace takes the string, not the json code
def config_to_str(config: Optional[AttentionConfig]) -> Optional[str]:
    if config is None:
        return None
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig or None, got {type(config).__name__}")
    return json.dumps(dataclasses.asdict(config))


def config_from_str(text: Optional[str]) -> Optional[AttentionConfig]:
    return None if text is None else AttentionConfig(**json.loads(text))


def lse_or_empty(result, wants_lse: bool, like: torch.Tensor) -> torch.Tensor:
    """What an op returns for a public function's result: its LSE, or an empty tensor."""
    return result[1] if wants_lse else _fake_lse(like, None, False)


def _fake_lse(like: torch.Tensor, shape, wants_lse: bool) -> torch.Tensor:
    """An op's LSE output: fp32 of `shape` when the call asks for it, else empty."""
    return like.new_empty(shape if wants_lse else _EMPTY_LSE, dtype=torch.float32)


def _no_kernel(tensor: torch.Tensor):
    raise RuntimeError(
        f"flash_cute's kernels run on CUDA tensors (a Hopper GPU), got a tensor on {tensor.device}"
    )


# ----------------------------------------------------------------------------------------
# flash_cute::flash_attn_func
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("flash_cute::flash_attn_func", mutates_args=("out",))
def flash_attn_func_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: Optional[float],
    causal: bool,
    return_lse: bool,
    config: Optional[str],
    window_size: List[int],
    attention_chunk: int,
    softcap: float,
    learnable_sink: Optional[torch.Tensor],
    qv: Optional[torch.Tensor],
) -> torch.Tensor:
    _no_kernel(q)


@flash_attn_func_op.register_fake
def _(q, k, v, out, softmax_scale, causal, return_lse, config, window_size, attention_chunk,
      softcap, learnable_sink, qv):  # fmt: skip
    batch, seqlen_q, nheads, _ = q.shape
    return _fake_lse(q, (batch, nheads, seqlen_q), return_lse)


# ----------------------------------------------------------------------------------------
# flash_cute::flash_attn_varlen_func
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("flash_cute::flash_attn_varlen_func", mutates_args=("out",))
def flash_attn_varlen_func_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    max_seqlen_k: Optional[int],
    page_table: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    num_splits: int,
    pack_gqa: Optional[bool],
    return_softmax_lse: bool,
    out: torch.Tensor,
    config: Optional[str],
    window_size: List[int],
    attention_chunk: int,
    softcap: float,
    learnable_sink: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    qv: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
) -> torch.Tensor:
    _no_kernel(q)


@flash_attn_varlen_func_op.register_fake
def _(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k, page_table,
      softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out, config, window_size,
      attention_chunk, softcap, learnable_sink, seqused_q, cache_batch_idx, cache_leftpad,
      qv, k_descale, v_descale):  # fmt: skip
    total_q, nheads, _ = q.shape
    return _fake_lse(q, (nheads, total_q), return_softmax_lse)


# ----------------------------------------------------------------------------------------
# flash_cute::flash_attn_with_kvcache
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("flash_cute::flash_attn_with_kvcache", mutates_args=("out",))
def flash_attn_with_kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: Optional[torch.Tensor],
    cache_seqlens_int: Optional[int],
    page_table: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    num_splits: int,
    pack_gqa: Optional[bool],
    return_softmax_lse: bool,
    out: torch.Tensor,
    config: Optional[str],
    window_size: List[int],
    attention_chunk: int,
    softcap: float,
    learnable_sink: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    qv: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
) -> torch.Tensor:
    _no_kernel(q)


@flash_attn_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_seqlens_int, page_table, softmax_scale, causal,
      num_splits, pack_gqa, return_softmax_lse, out, config, window_size, attention_chunk,
      softcap, learnable_sink, cache_batch_idx, cache_leftpad, qv, k_descale,
      v_descale):  # fmt: skip
    batch, seqlen_q, nheads, _ = q.shape
    return _fake_lse(q, (batch, nheads, seqlen_q), return_softmax_lse)


# ----------------------------------------------------------------------------------------
# flash_cute::flash_attn_combine
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("flash_cute::flash_attn_combine", mutates_args=("out",))
def flash_attn_combine_op(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, return_lse: bool
) -> torch.Tensor:
    _no_kernel(out_partial)


@flash_attn_combine_op.register_fake
def _(out_partial, lse_partial, out, return_lse):
    return _fake_lse(out_partial, tuple(lse_partial.shape[1:]), return_lse)


# ----------------------------------------------------------------------------------------
# The traced calls of the public functions
# ----------------------------------------------------------------------------------------


def _result(out, lse, wants_lse: bool):
    return (out, lse) if wants_lse else out


def traced_func(q, k, v, softmax_scale, causal, return_lse, out, config, window_size,
                attention_chunk, softcap, learnable_sink, qv=None):  # fmt: skip
    if out is None:
        out = new_out(q, v)
    lse = flash_attn_func_op(
        q, k, v, out, softmax_scale, causal, return_lse, config_to_str(config),
        list(window_size), attention_chunk, softcap, learnable_sink, qv,
    )  # fmt: skip
    return _result(out, lse, return_lse)


def traced_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k,
                  page_table, softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse,
                  out, config, window_size, attention_chunk, softcap, learnable_sink,
                  seqused_q, cache_batch_idx, cache_leftpad, qv=None, k_descale=None,
                  v_descale=None):  # fmt: skip
    if out is None:
        out = new_out(q, v)
    lse = flash_attn_varlen_func_op(
        q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, max_seqlen_k, page_table,
        softmax_scale, causal, num_splits, pack_gqa, return_softmax_lse, out,
        config_to_str(config), list(window_size), attention_chunk, softcap, learnable_sink,
        seqused_q, cache_batch_idx, cache_leftpad, qv, k_descale, v_descale,
    )  # fmt: skip
    return _result(out, lse, return_softmax_lse)


def traced_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, causal,
                   num_splits, pack_gqa, return_softmax_lse, out, config, window_size,
                   attention_chunk, softcap, learnable_sink, cache_batch_idx,
                   cache_leftpad, qv=None, k_descale=None, v_descale=None):  # fmt: skip
    if out is None:
        out = new_out(q, v_cache)
    tensor_lengths = isinstance(cache_seqlens, torch.Tensor)
    lse = flash_attn_with_kvcache_op(
        q, k_cache, v_cache, cache_seqlens if tensor_lengths else None,
        None if tensor_lengths else cache_seqlens, page_table, softmax_scale, causal, num_splits,
        pack_gqa, return_softmax_lse, out, config_to_str(config), list(window_size),
        attention_chunk, softcap, learnable_sink, cache_batch_idx, cache_leftpad, qv, k_descale,
        v_descale,
    )  # fmt: skip
    return _result(out, lse, return_softmax_lse)


def traced_combine(out_partial, lse_partial, out, out_dtype, return_lse):
    if out is None:
        dtype = out_dtype if out_dtype is not None else torch.float32
        out = out_partial.new_empty(tuple(out_partial.shape[1:]), dtype=dtype)
    lse = flash_attn_combine_op(out_partial, lse_partial, out, return_lse)
    return _result(out, lse, return_lse)
