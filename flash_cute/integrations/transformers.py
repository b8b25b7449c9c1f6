"""Hugging Face transformers: `attn_implementation="cute_attention"`.

    import flash_cute.integrations.transformers as fc_transformers
    fc_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cute_attention",
                                                 dtype=torch.bfloat16, device_map="cuda")

The name has no "flash" in it on purpose: transformers takes every implementation whose name
contains "flash" for a FlashAttention kernel (it tries to load one from the hub, and swaps in
another for models that list their FlashAttention kernels, gpt-oss among them).

`register()` adds flash_cute to transformers' AttentionInterface (and its mask interface, the
one FlashAttention uses: no mask unless a row is padded or a static cache has empty slots).
Each attention layer then runs flash_cute's forward kernel, in prefill and in generate with
transformers' caches, with the layer's sliding window, logit softcap, attention sinks
(gpt-oss's `s_aux`) and chunked attention (Llama 4's `attention_chunk_size` layers) passed
through. As transformers' FlashAttention path does, it reads packed sequences (a batch of one
whose position_ids restart, or cu_seq_lens_q/k and max_length_q/k) as separate sequences,
and a static cache's keys up to the mask's length.

Forward only (inference): a call that needs gradients, dropout, attention probabilities, a
mask other than left padding, chunked attention over a cache that has dropped keys, packed
sequences over a cache, or paged continuous batching raises an error naming it, as do head
dims or dtypes the kernels do not serve. A value head dim other than the query's (MLA prefill,
DeepSeek-V3's 192 / 128) runs as it is, V unpadded. Nothing falls back to another
implementation.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import interface

NAME = "cute_attention"


def register(name: str = NAME) -> str:
    """Register flash_cute as `attn_implementation=name` in transformers (idempotent). Returns
    the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "flash_cute.integrations.transformers needs transformers: "
            "pip install 'flash-cute[transformers]'"
        ) from err
    AttentionInterface.register(name, flash_cute_attention_forward)
    AttentionMaskInterface.register(name, cute_attention_mask)
    return name


# Both functions below read tensors' values and make host decisions (padding, packing, filled
# slots): under torch.compile (transformers compiles static-cache generation) they run eagerly,
# a graph break each, as traced they could see one step's shapes and run with another's.
@torch.compiler.disable
def cute_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """FlashAttention's mask (transformers' flash_attention_mask: None, or the 2-D padding mask,
    whose length is that of the keys filled so far), and where a static cache hands the layer
    more slots than it has filled and no padding mask says so, a (batch, filled) mask of ones
    that does."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    mask = flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset,
        mask_function or causal_mask_function, attention_mask, **kwargs,
    )  # fmt: skip
    if mask is None and kv_offset == 0:
        filled = int(q_offset) + q_length  # (a static cache's offset may be a tensor: one read)
        if filled < kv_length:
            mask = torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))
            mask.flash_cute_filled_slots = True  # (no padding to check)
    return mask


def _refuse(feature: str) -> None:
    raise NotImplementedError(f"attn_implementation='{NAME}' (flash_cute) does not serve {feature}")


@torch.compiler.disable
def flash_cute_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
):
    """transformers' attention function: query (batch, nheads, seqlen_q, head_dim), key and
    value (batch, nheads_kv, seqlen_k, head_dim), attention_mask None or a (batch, seqlen_k)
    bool mask of left padding. Returns ((batch, seqlen_q, nheads, head_dim), None). A cache
    holding float8_e4m3fn key and value is read as an FP8 cache, with the (batch, nheads_kv)
    float32 scales of the `k_descale` and `v_descale` keyword arguments (default 1)."""
    if dropout and module.training:
        _refuse(f"attention dropout (p={dropout}) in training")
    if kwargs.get("output_attentions"):
        _refuse("output_attentions=True (use attn_implementation='eager')")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        _refuse("gradients (forward kernels only; run under torch.no_grad or inference_mode)")
    if query.dtype == torch.float32:
        # A 16-bit model whose rotary embedding or norms left fp32 activations (as
        # transformers' FlashAttention path does: back to the weights' or autocast's dtype).
        dtype = _half_dtype_of(module, query.device.type)
        query, key, value = (
            t.to(dtype) if t.dtype == torch.float32 else t for t in (query, key, value)
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        _refuse(f"{query.dtype} activations (load the model in float16 or bfloat16)")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    for paged in ("block_table", "k_cache", "v_cache"):
        if kwargs.get(paged) is not None:
            _refuse(f"paged continuous batching ({paged}); use transformers' own caches")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        # transformers' sliding window W: a query sees itself and the W - 1 keys before it.
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    options = dict(
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window,
        softcap=float(softcap) if softcap else 0.0,
        learnable_sink=s_aux,
    )
    # A static cache hands over all its slots; the padding mask covers those filled so far.
    keys = k.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        keys = min(keys, attention_mask.shape[1])
    chunk = _attention_chunk(module)
    if chunk:
        if keys >= chunk and q.shape[1] < keys:
            # transformers' chunk caches keep the last attention_chunk_size - 1 keys: once full,
            # the chunks no longer start at a key flash_cute can place (transformers' own
            # FlashAttention path refuses these calls too).
            _refuse(
                f"chunked attention (attention_chunk_size={chunk}) over a cache of {keys} keys "
                "(past the chunk size, transformers' chunk cache has dropped keys): prefills of "
                "any length and caches shorter than a chunk are served"
            )
        options["attention_chunk"] = chunk
    packed = _packed_sequences(q, k, attention_mask, kwargs)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        out = interface.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]),
            k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            cu_q,
            max_q,
            cu_seqlens_k=cu_k,
            max_seqlen_k=max_k,
            k_descale=kwargs.get("k_descale"),
            v_descale=kwargs.get("v_descale"),
            **options,
        )
        return out.view(*q.shape[:2], *out.shape[1:]), None
    # The cache entry point serves prefill and decode alike (decode steps get its split-KV
    # heuristic and decode tiles); a left-padded batch gives each row's first key.
    leftpad = None
    if attention_mask is not None and not hasattr(attention_mask, "flash_cute_filled_slots"):
        leftpad = _left_padding(attention_mask, keys)
    out = interface.flash_attn_with_kvcache(
        q,
        k,
        v,
        cache_seqlens=keys if keys < k.shape[1] else None,
        cache_leftpad=leftpad,
        k_descale=kwargs.get("k_descale"),
        v_descale=kwargs.get("v_descale"),
        **options,
    )
    return out, None


def _attention_chunk(module: torch.nn.Module) -> int:
    """The layer's attention chunk (Llama 4's chunked layers: attention_chunk_size), or 0: a
    layer whose config type is "chunked_attention", or every layer of a config with an
    attention_chunk_size and no layer types (as transformers' masks read it)."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        return 0
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if layer_types and layer is not None:
        return chunk if layer_types[layer] == "chunked_attention" else 0
    return chunk


def _packed_sequences(q, k, attention_mask, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of a packed batch, as transformers'
    FlashAttention path reads one: the cu_seq_lens_q/k and max_length_q/k keyword arguments,
    or without a mask a batch of one whose position_ids restart (the sequences' starts are
    where they take their least value). None for anything else."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    given = [kwargs.get(n) for n in names]
    if all(x is not None for x in given):
        cu_q, cu_k, max_q, max_k = given
        packed = (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))
    else:
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None or position_ids is None or q.shape[0] != 1:
            return None
        if q.shape[1] == 1 or position_ids.numel() != q.shape[1]:
            return None
        packed = _positions_packing(position_ids)
        if packed is None:
            return None
    if k.shape[1] != q.shape[1]:
        _refuse("packed sequences (restarting position_ids, cu_seq_lens) over a cache")
    return packed


# The last position_ids read, its version and the packing found: every layer of one forward
# gets the same tensor, so only the first layer pays the read's host sync.
_LAST_POSITIONS = [None, None, None]


def _positions_packing(position_ids: torch.Tensor):
    """(cu_seqlens, cu_seqlens, longest, longest) of (1, n) position_ids that restart, or None
    when they count up from their first value without restarting (one host sync per tensor
    version)."""
    seen, version, result = _LAST_POSITIONS
    if seen is position_ids and version is not None and version == position_ids._version:
        return result
    flat = position_ids.reshape(-1)
    starts = (flat == flat.min()).nonzero().view(-1)
    result = None
    if starts.numel() > 1:
        cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        result = (cu, cu, longest, longest)
    version = None if position_ids.is_inference() else position_ids._version
    _LAST_POSITIONS[:] = [position_ids, version, result]
    return result


def _half_dtype_of(module: torch.nn.Module, device_type: str) -> torch.dtype:
    """The 16-bit dtype fp32 activations go back to: autocast's, else the layer's weights'
    (float32 weights stay float32, which the caller then refuses)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for param in module.parameters():
        return param.dtype
    return torch.float32


# The last mask checked, its version and its result: every layer of one forward gets the same
# mask, so only the first layer pays the check's host sync.
_LAST_PADDING = [None, None, None]


def _left_padding(attention_mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """(batch,) int32 first valid key of each row of a (batch, kv_length) bool mask that pads
    on the left only; anything else is refused (one host sync per mask, as transformers' own
    FlashAttention path takes to unpad; the layers after the first reuse the result, except
    for masks made under inference_mode, which have no version counter to tell an in-place
    change by)."""
    mask_seen, version, first = _LAST_PADDING
    if (
        mask_seen is attention_mask
        and version is not None
        and version == attention_mask._version
        and attention_mask.shape[-1] == kv_length
    ):
        return first
    first = _check_left_padding(attention_mask, kv_length)
    version = None if attention_mask.is_inference() else attention_mask._version
    _LAST_PADDING[:] = [attention_mask, version, first]
    return first


def _check_left_padding(attention_mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    if attention_mask.dim() != 2 or attention_mask.shape[1] != kv_length:
        _refuse(
            f"an attention mask of shape {tuple(attention_mask.shape)} over {kv_length} keys "
            "(a 2-D padding mask, one column per key)"
        )
    mask = attention_mask.bool()
    first = mask.int().argmax(dim=1)
    cols = torch.arange(kv_length, device=mask.device)
    if not torch.equal(mask, cols.unsqueeze(0) >= first.unsqueeze(1)) or not mask[:, -1].all():
        _refuse("attention masks other than left padding (pad on the left to batch prompts)")
    return first.to(torch.int32)
