"""Hugging Face transformers: `attn_implementation="cute_attention"`.

    import flash_cute.integrations.transformers as fc_transformers
    fc_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cute_attention",
                                                 dtype=torch.bfloat16, device_map="cuda")

The name has no "flash" in it on purpose: transformers takes every implementation whose name
contains "flash" for a FlashAttention kernel (it tries to load one from the hub, and swaps in
another for models that list their FlashAttention kernels, gpt-oss among them).

`register()` adds flash_cute to transformers' AttentionInterface (and its mask interface, the
one FlashAttention uses: no mask unless a row is padded). Each attention layer then runs
flash_cute's forward kernel, in prefill and in generate with transformers' caches, with the
layer's sliding window, logit softcap and attention sinks (gpt-oss's `s_aux`) passed through.

Forward only (inference): a call that needs gradients, dropout, attention probabilities, or a
mask other than left padding raises an error naming it, as do head dims or dtypes the kernels
do not serve. A value head dim other than the query's (MLA prefill, DeepSeek-V3's 192 / 128)
runs as it is, V unpadded. Nothing falls back to another implementation.
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
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "flash_cute.integrations.transformers needs transformers: "
            "pip install 'flash-cute[transformers]'"
        ) from err
    AttentionInterface.register(name, flash_cute_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _refuse(feature: str) -> None:
    raise NotImplementedError(f"attn_implementation='{NAME}' (flash_cute) does not serve {feature}")


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
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        # transformers' sliding window W: a query sees itself and the W - 1 keys before it.
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    mask_options = dict(
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window,
        softcap=float(softcap) if softcap else 0.0,
        learnable_sink=s_aux,
    )
    # The cache entry point serves prefill and decode alike (decode steps get its split-KV
    # heuristic and decode tiles); a left-padded batch gives each row's first key.
    leftpad = None if attention_mask is None else _left_padding(attention_mask, k.shape[1])
    out = interface.flash_attn_with_kvcache(
        q,
        k,
        v,
        cache_leftpad=leftpad,
        k_descale=kwargs.get("k_descale"),
        v_descale=kwargs.get("v_descale"),
        **mask_options,
    )
    return out, None


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
        _refuse(f"an attention mask of shape {tuple(attention_mask.shape)} (a 2-D padding mask)")
    mask = attention_mask.bool()
    first = mask.int().argmax(dim=1)
    cols = torch.arange(kv_length, device=mask.device)
    if not torch.equal(mask, cols.unsqueeze(0) >= first.unsqueeze(1)) or not mask[:, -1].all():
        _refuse("attention masks other than left padding (pad on the left to batch prompts)")
    return first.to(torch.int32)
