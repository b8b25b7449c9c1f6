"""The call record: every forward argument of every entry point, declared once.

Each public forward function (flash_cute's three, FlashAttention-3's, and the custom op a
torch.compile trace calls) is a signature whose parameters are described here by name
(`ROLES`): which field of the canonical call record `Call` an argument fills, and how its
metadata enters the replay key. From a signature and these roles come, with no other list of
the arguments (flash_cute.entry builds them):

- the replay key: per parameter, the metadata a plan decision can read (`Role.key`);
- the plan's input: a `Call`, built from the arguments by role, which the shared forward path
  (flash_cute.forward) checks and describes as a flash_cute.plan.Problem;
- the launch order: the kernel's call arguments (compile_cache.CALL_ARGS, read off the kernel's
  signature; `Call` declares them in that order, tests/test_call.py checks it);
- the custom op's schema and fake (flash_cute.ops), from `Call`'s fields.

An int key count (cache_seqlens as an int) is the one value a replay may change without
changing the key: the key holds its bit length (`length_class`), and the plan is made for the
largest count of that class (`length_bound`), so it is right for every count the replay takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .config import AttentionConfig


@dataclass(frozen=True, eq=False)
class Call:
    """One forward call, as the shared path takes it. The fields from cu_seqlens_q to kv_length
    are the kernel's call arguments, in its signature's order; the rest are host options.

    q: (batch, seqlen_q, nheads, d), or (total_q, nheads, d) with cu_seqlens_q; k, v: padded
    (batch, seqlen_k, nheads_kv, d), packed (total_k, nheads_kv, d) with cu_seqlens_k, or
    paged (num_pages, page_size, nheads_kv, d) with page_table. q_descale: FP8 queries'
    dequantization scales (the FP8-math kernels take them; the forward path folds them into
    k_descale where q is converted). kv_length: one int key count for every sequence
    (seqused_k: a (batch,) tensor of them). decode_rows: whether few query rows per kv head
    take the decode table (flash_attn_func's padded calls keep the prefill table). sm_margin:
    SMs the launch leaves free (FlashAttention-3's): its plan sees the others only.
    appended_keys: rows an append (flash_cute.kv_append) wrote to each sequence just before
    the launch, on its stream, past its seqused_k count: the kernel adds them, and a split
    launch starts while the append runs (None: no append). append_k, append_v: (batch,
    appended_keys, nheads_kv, d / dv) rows the kernel itself writes to the cache (padded or
    paged, 16-byte aligned) past seqused_k (flash_cute.kv_append's fused form), rotated, with q,
    by append_cos and append_sin (seqlen_ro, rotary_dim / 2) where given: pairs (2j, 2j + 1)
    with append_interleaved, else (j, j + rotary_dim / 2); q row i of a sequence at position
    seqused_k + i with append_per_row, else at seqused_k. The public functions' docstrings
    say the rest.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: Optional[torch.Tensor] = None
    # The rest by name only: a field added among them cannot shift a positional argument.
    _: dataclasses.KW_ONLY
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    learnable_sink: Optional[torch.Tensor] = None
    seqused_q: Optional[torch.Tensor] = None
    kv_batch_idx: Optional[torch.Tensor] = None
    leftpad_k: Optional[torch.Tensor] = None
    qv: Optional[torch.Tensor] = None
    q_descale: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None
    append_k: Optional[torch.Tensor] = None
    append_v: Optional[torch.Tensor] = None
    append_cos: Optional[torch.Tensor] = None
    append_sin: Optional[torch.Tensor] = None
    kv_length: Optional[int] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    softmax_scale: Optional[float] = None
    causal: bool = False
    return_lse: bool = False
    config: Optional[AttentionConfig] = None
    window_size: Tuple[int, int] = (-1, -1)
    attention_chunk: int = 0
    softcap: float = 0.0
    num_splits: int = 1
    pack_gqa: Optional[bool] = None
    decode_rows: bool = True
    sm_margin: int = 0
    appended_keys: Optional[int] = None
    append_interleaved: bool = False
    append_per_row: bool = False

    def replace(self, **changes) -> Call:
        return dataclasses.replace(self, **changes)

    def tensors(self):
        """(field, tensor) of every tensor the call holds."""
        for f in TENSOR_FIELDS:
            t = getattr(self, f)
            if t is not None:
                yield f, t


CALL_FIELDS = tuple(f.name for f in dataclasses.fields(Call))
TENSOR_FIELDS = CALL_FIELDS[: CALL_FIELDS.index("append_sin") + 1]
# The kernel's call arguments (the rest of its signature the launch plan supplies).
KERNEL_CALL_FIELDS = CALL_FIELDS[
    CALL_FIELDS.index("cu_seqlens_q") : CALL_FIELDS.index("kv_length") + 1
]


def length_class(length: int) -> int:
    """The replay key of an int key count: its bit length (a decode loop whose count grows by
    one each step replays one plan per doubling). The generated fast paths inline it
    (flash_cute.entry: `.bit_length()`)."""
    return length.bit_length()


def length_bound(length: int) -> int:
    """The largest key count of `length`'s class: what a plan for an int count is made for, so
    that every count replaying it (its class, up to the cache's capacity) gets the same
    decisions (a window that excludes a key at any of them, say)."""
    return (1 << length_class(length)) - 1


@dataclass(frozen=True)
class Role:
    """How one parameter travels. kind:

    tensor: a required tensor (its shape and dtype in the key; the first one, q, also its
        device); optional: a tensor or None; lengths: cache_seqlens (a (batch,) tensor, filling
        seqused_k, or an int, filling kv_length); int_length: an int key count or None;
    out: the output (its strides in the key, with q's, k's and v's; none without it);
    host: a Python scalar (its value and type in the key: True == 1 == 1.0);
    appended: appended_keys, a host int whose value is also the kernel's scalar (kv_length's
        slot: the two exclude each other);
    value: a hashable option compared by value (config);
    window: window_size, compared by value once lists and tensors of two ints are a tuple
        (window_pair);
    metadata: FlashAttention-3's scheduler_metadata (its split count fills num_splits);
    fp8_descale: FlashAttention-3's descales: a tensor or None, read only where the operand it
        dequantizes (DESCALED_OPERAND) is FP8 and dropped otherwise, as FlashAttention-3 drops
        it (vLLM passes all three on every call); flash_cute's own functions take them as
        optional (a descale of a 16-bit operand then raises);
    append: a KVAppend field whose presence makes the call append to its cache first
        (flash_cute.kv_append; such calls are not replayed: the key holds only whether all of
        them are None); append_option: a KVAppend field read only when the call appends;
    ignored: accepted and without effect (FlashAttention-3's backward options).
    """

    kind: str
    field: Optional[str] = None


# Every parameter name of every forward entry point. A name with another meaning in one
# entry point (FlashAttention-3's k and v in flash_attn_with_kvcache: keys to append) is
# overridden there (EntryPoint's overrides).
ROLES = {
    "q": Role("tensor", "q"),
    "k": Role("tensor", "k"),
    "k_cache": Role("tensor", "k"),
    "v": Role("tensor", "v"),
    "v_cache": Role("tensor", "v"),
    "out": Role("out", "out"),
    "cu_seqlens_q": Role("optional", "cu_seqlens_q"),
    "cu_seqlens_k": Role("optional", "cu_seqlens_k"),
    "seqused_k": Role("lengths", "seqused_k"),
    "cache_seqlens": Role("lengths", "seqused_k"),
    "kv_length": Role("int_length", "kv_length"),
    "page_table": Role("optional", "page_table"),
    "learnable_sink": Role("optional", "learnable_sink"),
    "seqused_q": Role("optional", "seqused_q"),
    "kv_batch_idx": Role("optional", "kv_batch_idx"),
    "cache_batch_idx": Role("optional", "kv_batch_idx"),
    "leftpad_k": Role("optional", "leftpad_k"),
    "cache_leftpad": Role("optional", "leftpad_k"),
    "qv": Role("optional", "qv"),
    "q_descale": Role("optional", "q_descale"),
    "k_descale": Role("optional", "k_descale"),
    "v_descale": Role("optional", "v_descale"),
    "max_seqlen_q": Role("host", "max_seqlen_q"),
    "max_seqlen_k": Role("host", "max_seqlen_k"),
    "softmax_scale": Role("host", "softmax_scale"),
    "causal": Role("host", "causal"),
    "return_lse": Role("host", "return_lse"),
    "return_softmax_lse": Role("host", "return_lse"),
    "return_attn_probs": Role("host", "return_lse"),
    "config": Role("value", "config"),
    "window_size": Role("window", "window_size"),
    "attention_chunk": Role("host", "attention_chunk"),
    "softcap": Role("host", "softcap"),
    "num_splits": Role("host", "num_splits"),
    "pack_gqa": Role("host", "pack_gqa"),
    "decode_rows": Role("host", "decode_rows"),
    "sm_margin": Role("host", "sm_margin"),
    "appended_keys": Role("appended", "appended_keys"),
    # The fused append's rows and rotation (Call.append_k; flash_cute.kv_append fills them).
    "append_k": Role("optional", "append_k"),
    "append_v": Role("optional", "append_v"),
    "append_cos": Role("optional", "append_cos"),
    "append_sin": Role("optional", "append_sin"),
    "append_interleaved": Role("host", "append_interleaved"),
    "append_per_row": Role("host", "append_per_row"),
    "scheduler_metadata": Role("metadata", "num_splits"),
    # flash_attn_with_kvcache's appends (flash_cute.kv_append.KVAppend; its k and v are
    # overridden to these roles there).
    "rotary_cos": Role("append", "rotary_cos"),
    "rotary_sin": Role("append", "rotary_sin"),
    "cu_seqlens_k_new": Role("append", "cu_seqlens_k_new"),
    "rotary_seqlens": Role("append_option", "rotary_seqlens"),
    "rotary_interleaved": Role("append_option", "rotary_interleaved"),
    # FlashAttention-3's backward options.
    "deterministic": Role("ignored"),
}

# The Call field each descale dequantizes; FlashAttention-3's module takes them as FA3_DESCALES.
DESCALED_OPERAND = {"q_descale": "q", "k_descale": "k", "v_descale": "k"}
FA3_DESCALES = {name: Role("fp8_descale", name) for name in DESCALED_OPERAND}


def window_pair(window_size):
    """FlashAttention-3 reads window_size[0] and window_size[1], so its callers (its tests among
    them) also pass lists and 2-element integer tensors: as a tuple of ints (the sides are
    compile-time constants of the kernels, read on the host). Anything else is returned as it
    is, for the checks to name."""
    if isinstance(window_size, torch.Tensor) and window_size.numel() == 2:
        if window_size.dtype.is_floating_point or window_size.dtype == torch.bool:
            return window_size
        return tuple(window_size.tolist())
    if isinstance(window_size, list):
        return tuple(window_size)
    return window_size


# Split counts read off copies of get_scheduler_metadata's tensor, by (address, version).
_READ_METADATA: dict = {}
_warned_metadata = False


def metadata_splits(metadata) -> int:
    """The split count a scheduler_metadata tensor carries. get_scheduler_metadata's own tensor
    holds it on the host too; a copy of it (an engine's persistent buffer, say) is read on the
    device, one host sync per new content (its address and version), except under CUDA-graph
    capture, where the call keeps the split count it would choose itself and warns once."""
    global _warned_metadata
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32:
        raise TypeError("scheduler_metadata must be an int32 tensor from get_scheduler_metadata")
    count = getattr(metadata, "flash_cute_num_splits", None)
    if count is not None:
        return count
    if metadata.numel() < 1:
        raise ValueError("scheduler_metadata must hold get_scheduler_metadata's split count")
    memo = (metadata.data_ptr(), metadata._version)
    count = _READ_METADATA.get(memo)
    if count is None:
        if metadata.is_cuda and torch.cuda.is_current_stream_capturing():
            if not _warned_metadata:
                _warned_metadata = True
                import warnings

                warnings.warn(
                    "flash_cute: scheduler_metadata is a copy of get_scheduler_metadata's tensor, "
                    "whose split count cannot be read during a CUDA-graph capture: the call "
                    "chooses its own (pass the tensor get_scheduler_metadata returned, or "
                    "num_splits, to fix it)",
                    stacklevel=4,
                )
            return 0
        count = int(metadata.reshape(-1)[0])
        if len(_READ_METADATA) > 256:
            _READ_METADATA.clear()
        _READ_METADATA[memo] = count
    return count
