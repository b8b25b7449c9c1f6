"""The call record (flash_cute.call) and the entry points built from it (flash_cute.entry), on
the CPU: one declaration, and everything derived from it agreeing with the kernel and the ops."""

import dataclasses
import inspect

import pytest
import torch

import flash_cute
from flash_cute import entry, ops
from flash_cute import flash_attn_interface as fa3
from flash_cute.call import (
    CALL_FIELDS,
    KERNEL_CALL_FIELDS,
    ROLES,
    Call,
    length_bound,
    length_class,
    metadata_splits,
)
from flash_cute.compile_cache import FULL, SHORT

ENTRY_POINTS = [
    flash_cute.flash_attn_func,
    flash_cute.flash_attn_varlen_func,
    flash_cute.flash_attn_with_kvcache,
    fa3.flash_attn_func,
    fa3.flash_attn_varlen_func,
    fa3.flash_attn_with_kvcache,
]


def test_the_kernel_takes_the_call_arguments_in_calls_order():
    """Call declares the kernel's call arguments in the order of its signature (after out and
    lse); the short signature ends its call arguments with kv_length as well."""
    first = FULL.args.index("lse") + 1
    assert FULL.args[first : first + len(KERNEL_CALL_FIELDS)] == KERNEL_CALL_FIELDS
    assert KERNEL_CALL_FIELDS[-1] == "kv_length" and "kv_length" in SHORT.args


def test_the_op_schema_is_calls_fields():
    schema = torch.ops.flash_cute.forward.default._schema
    assert [a.name for a in schema.arguments] == list(CALL_FIELDS)
    assert str(schema.arguments[CALL_FIELDS.index("out")].type) == "Tensor"
    assert schema.arguments[CALL_FIELDS.index("out")].alias_info.is_write


@pytest.mark.parametrize("function", ENTRY_POINTS, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_parameter_has_a_role_and_enters_the_path(function):
    point = function.entry_point
    assert point.params == tuple(inspect.signature(function).parameters)
    for name in point.params:
        role = point.roles[name]
        assert role is ROLES.get(name) or role.kind in ("unserved", "fp8_descale", "append")
        if role.kind not in ("ignored", "append_option"):  # (options: read only with an append)
            assert name in point.source  # (the key, the launch or the record)


def test_generated_functions_keep_the_stubs_docs_and_signatures():
    for function in ENTRY_POINTS:
        assert function.__doc__ and function.__module__.startswith("flash_cute")
        assert "<flash_cute entry point" in function.__code__.co_filename
    assert entry.EntryPoint.of_call().params == CALL_FIELDS


def test_length_classes_bound_every_length_they_hold():
    for n in [0, 1, 2, 3, 511, 512, 1000, 1023, 1024, 4095, 4096, 8191]:
        assert length_bound(n) >= n and length_class(length_bound(n)) == length_class(n)
        assert length_class(length_bound(n) + 1) == length_class(n) + 1


def test_scheduler_metadata_copies_are_read():
    meta = torch.tensor([7], dtype=torch.int32)
    meta.flash_cute_num_splits = 7
    assert metadata_splits(meta) == 7
    copy = torch.zeros(3, dtype=torch.int32)
    copy[:1] = meta
    assert metadata_splits(copy[:1]) == 7
    copy[0] = 5  # (new content: read again)
    assert metadata_splits(copy[:1]) == 5
    with pytest.raises(TypeError, match="int32 tensor"):
        metadata_splits(meta.float())


def test_op_arguments_round_trip():
    q = torch.zeros(1, 2, 4, 64)
    call = Call(q, q, q, q, window_size=(3, 0), config=flash_cute.AttentionConfig(64, 64))
    back = ops.call_from_op(ops.op_arguments(call))
    assert all(
        getattr(back, f.name) is getattr(call, f.name)
        or getattr(back, f.name) == getattr(call, f.name)
        for f in dataclasses.fields(Call)
    )


def test_call_takes_q_k_v_out_by_position_only():
    """Call(q, k, v, out) keeps out in its place whatever fields are added (a q_descale declared
    before out once took it); every other field is keyword-only."""
    q, out = torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 4, 64)
    call = Call(q, q, q, out)
    assert call.out is out and call.q_descale is None
    with pytest.raises(TypeError, match="positional"):
        Call(q, q, q, out, q)
