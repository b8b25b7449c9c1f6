"""torch.library custom ops, for torch.compile and graph tracers.

`flash_cute::forward` takes a forward call's record (flash_cute.call.Call) field by field, its
schema derived from Call's fields: it writes the output tensor it is given (`out`, mutated)
and returns the LSE (an empty tensor when the call asks for none). Every forward entry point,
flash_cute's and FlashAttention-3's, traces into it; its fake implementation computes the LSE's
shape from the arguments alone. `flash_cute::flash_attn_combine` is the combine's.

Eager calls never reach the ops: each public function checks `torch.compiler.is_compiling()`
first and, outside a trace, takes its own fast path (a launch-plan replay), so eager host time
does not pay for the dispatcher. The ops' CUDA kernels run the calls eagerly: flash_cute.interface
registers them (this module does not import it); on other devices an op raises.

An AttentionConfig travels through an op as JSON (ops take no Python objects).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional

import torch

from .call import CALL_FIELDS, Call
from .checks import new_out
from .config import AttentionConfig

_EMPTY_LSE = (0,)

# Call's field types as schema types; the config crosses as JSON, the window as a list.
_SCHEMA_TYPES = {
    "torch.Tensor": "Tensor",
    "Optional[torch.Tensor]": "Tensor?",
    "Optional[int]": "int?",
    "Optional[float]": "float?",
    "Optional[bool]": "bool?",
    "bool": "bool",
    "int": "int",
    "float": "float",
    "Optional[AttentionConfig]": "str?",
    "Tuple[int, int]": "int[]",
}


def forward_schema() -> str:
    """flash_cute::forward's schema, from Call's fields (out mutated and required)."""
    params = []
    for f in dataclasses.fields(Call):
        kind = "Tensor(a!)" if f.name == "out" else _SCHEMA_TYPES[f.type]
        params.append(f"{kind} {f.name}")
    return f"({', '.join(params)}) -> Tensor"


@torch.compiler.assume_constant_result  # a trace takes the string, not the json code
def config_to_str(config: Optional[AttentionConfig]) -> Optional[str]:
    if config is None:
        return None
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an AttentionConfig or None, got {type(config).__name__}")
    return json.dumps(dataclasses.asdict(config))


@functools.lru_cache(maxsize=256)  # (an op call in a compiled graph parses it every call)
def config_from_str(text: Optional[str]) -> Optional[AttentionConfig]:
    return None if text is None else AttentionConfig(**json.loads(text))


def op_arguments(call: Call) -> tuple:
    """A call's fields as the op takes them."""
    values = []
    for name in CALL_FIELDS:
        value = getattr(call, name)
        if name == "config":
            value = config_to_str(value)
        elif name == "window_size":
            value = list(value) if isinstance(value, (tuple, list)) else value
        values.append(value)
    return tuple(values)


_CONFIG, _WINDOW = CALL_FIELDS.index("config"), CALL_FIELDS.index("window_size")


def fields_from_op(values: tuple) -> list:
    """An op's arguments as Call's field values, in CALL_FIELDS order (op_arguments undone)."""
    fields = list(values)
    fields[_CONFIG] = config_from_str(fields[_CONFIG])
    fields[_WINDOW] = tuple(fields[_WINDOW])
    return fields


def call_from_op(values: tuple) -> Call:
    """The Call of an op's arguments."""
    return Call(**dict(zip(CALL_FIELDS, fields_from_op(values))))


def lse_or_empty(result, wants_lse: bool, like: torch.Tensor) -> torch.Tensor:
    """What an op returns for a public function's result: its LSE, or an empty tensor."""
    return result[1] if wants_lse else _fake_lse(like, None, False)


def _fake_lse(like: torch.Tensor, shape, wants_lse: bool) -> torch.Tensor:
    """An op's LSE output: fp32 of `shape` when the call asks for it, else empty."""
    return like.new_empty(shape if wants_lse else _EMPTY_LSE, dtype=torch.float32)


def _no_kernel(*args):
    raise RuntimeError(
        f"flash_cute's kernels run on CUDA tensors (a Hopper GPU), got a tensor on {args[0].device}"
    )


LIBRARY = torch.library.Library("flash_cute", "FRAGMENT")

# ----------------------------------------------------------------------------------------
# flash_cute::forward
# ----------------------------------------------------------------------------------------

LIBRARY.define("forward" + forward_schema())
forward_op = torch.ops.flash_cute.forward.default
LIBRARY.impl("forward", _no_kernel, "CPU")


@torch.library.register_fake("flash_cute::forward", lib=LIBRARY)
def _(*values):
    call = dict(zip(CALL_FIELDS, values))
    q = call["q"]
    if (
        call["cu_seqlens_q"] is None
    ):  # q (batch, seqlen_q, nheads, d): lse (batch, nheads, seqlen_q)
        shape = (q.shape[0], q.shape[2], q.shape[1])
    else:  # q (total_q, nheads, d): lse (nheads, total_q)
        shape = (q.shape[1], q.shape[0])
    return _fake_lse(q, shape, call["return_lse"])


def refuse_fused_append(append_k) -> None:
    """The op declares out its only mutated argument: a fused append (Call.append_k), which
    writes k and v, is refused (its calls run eagerly)."""
    if append_k is not None:
        raise NotImplementedError(
            "flash_cute::forward does not take append_k (a fused append writes k and v, which "
            "its schema does not declare mutated); append eagerly (flash_attn_with_kvcache)"
        )


def traced_forward(call: Call):
    """A forward call inside a trace: the op, with out allocated when the call has none.
    Returns out, or (out, lse) with call.return_lse."""
    refuse_fused_append(call.append_k)
    out = call.out if call.out is not None else new_out(call.q, call.v)
    lse = forward_op(*op_arguments(call.replace(out=out)))
    return (out, lse) if call.return_lse else out


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


def traced_combine(out_partial, lse_partial, out, out_dtype, return_lse):
    if out is None:
        dtype = out_dtype if out_dtype is not None else torch.float32
        out = out_partial.new_empty(tuple(out_partial.shape[1:]), dtype=dtype)
    lse = flash_attn_combine_op(out_partial, lse_partial, out, return_lse)
    return (out, lse) if return_lse else out
