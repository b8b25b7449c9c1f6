"""The flash_cute:: custom ops on the CPU: schemas and fake implementations (opcheck on meta
tensors, which run the fake implementations), torch.compile(fullgraph=True) of every public
entry point with no graph break, and eager calls that stay off the dispatcher."""

import pytest
import torch

import flash_cute
from flash_cute import AttentionConfig, ops
from flash_cute import flash_attn_interface as fa3
from flash_cute.call import Call

META = "meta"
BF16 = torch.bfloat16


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device=META)


def meta_int32(n):
    return torch.empty(n, dtype=torch.int32, device=META)


def op_cases():
    q, k = meta(2, 9, 8, 64), meta(2, 17, 2, 64)
    qv, kv = meta(30, 8, 64), meta(40, 2, 64)
    used = meta_int32(2)
    sink = meta(8, dtype=torch.float32)
    scale = meta(2, 2, dtype=torch.float32)
    calls = {
        "func": Call(
            q, k, k, meta(2, 9, 8, 64), softmax_scale=0.125, causal=True, return_lse=True,
            config=AttentionConfig(128, 128), window_size=(4, 0), softcap=5.0,
            learnable_sink=sink, decode_rows=False, pack_gqa=False,
        ),
        "func-no-lse": Call(q, k, k, meta(2, 9, 8, 64), attention_chunk=8, decode_rows=False),
        "varlen": Call(
            qv, kv, kv, meta(30, 8, 64), cu_seqlens_q=meta_int32(3), max_seqlen_q=20,
            cu_seqlens_k=meta_int32(3), seqused_k=used, max_seqlen_k=25, causal=True,
            num_splits=0, return_lse=True, seqused_q=used,
        ),
        "kvcache": Call(
            q, meta(50, 16, 2, 64), meta(50, 16, 2, 64), meta(2, 9, 8, 64), seqused_k=used,
            page_table=torch.empty(2, 4, dtype=torch.int32, device=META), causal=True,
            num_splits=0, pack_gqa=True, return_lse=True, learnable_sink=sink, k_descale=scale,
            v_descale=scale,
        ),
        "kvcache-int": Call(
            q, k, k, meta(2, 9, 8, 64), kv_length=11, kv_batch_idx=used, leftpad_k=used
        ),
    }  # fmt: skip
    for name, call in calls.items():
        yield name, ops.forward_op, ops.op_arguments(call)
    yield (
        "combine",
        ops.flash_attn_combine_op,
        (meta(3, 2, 9, 8, 64, dtype=torch.float32), meta(3, 2, 9, 8, dtype=torch.float32),
         meta(2, 9, 8, 64), True),
    )  # fmt: skip


CASES = list(op_cases())


@pytest.mark.parametrize("name, op, args", CASES, ids=[c[0] for c in CASES])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name, op, args", CASES, ids=[c[0] for c in CASES])
def test_fake_lse_shapes(name, op, args):
    lse = op(*args)
    expected = {
        "func": (2, 8, 9),
        "func-no-lse": (0,),
        "varlen": (8, 30),
        "kvcache": (2, 8, 9),
        "kvcache-int": (0,),
        "combine": (2, 9, 8),
    }[name]
    assert lse.shape == expected and lse.dtype == torch.float32


def test_config_round_trip():
    config = AttentionConfig(192, 128, num_stages=3, scheduler="dynamic_persistent")
    assert ops.config_from_str(ops.config_to_str(config)) == config
    assert ops.config_from_str(ops.config_to_str(None)) is None
    with pytest.raises(TypeError, match="config must be an AttentionConfig"):
        ops.config_to_str((128, 128))


def compile_calls():
    """(name, function of meta tensors, inputs): each public entry point as a model calls it."""
    q, k = meta(2, 9, 8, 64), meta(2, 17, 2, 64)
    qv, kv = meta(30, 8, 64), meta(40, 2, 64)
    cu_q, cu_k, used = meta_int32(3), meta_int32(3), meta_int32(2)
    pages, table = meta(50, 16, 2, 64), torch.empty(2, 4, dtype=torch.int32, device=META)
    sink = meta(8, dtype=torch.float32)
    yield (
        "native func",
        lambda q, k: flash_cute.flash_attn_func(
            q, k, k, causal=True, return_lse=True, window_size=(8, 0), learnable_sink=sink
        ),
        (q, k),
    )
    yield (
        "native varlen",
        lambda q, k: flash_cute.flash_attn_varlen_func(
            q, k, k, cu_q, 20, cu_seqlens_k=cu_k, max_seqlen_k=25, causal=True
        ),
        (qv, kv),
    )
    yield (
        "native kvcache",
        lambda q, k: flash_cute.flash_attn_with_kvcache(
            q, k, k, cache_seqlens=used, page_table=table, return_softmax_lse=True, softcap=5.0
        ),
        (q, pages),
    )
    config = AttentionConfig(128, 128)  # (made outside the traced function, as models do)
    yield (
        "native kvcache int length",
        lambda q, k: flash_cute.flash_attn_with_kvcache(q, k, k, cache_seqlens=11, config=config),
        (q, k),
    )
    yield (
        "native combine",
        lambda o, lse: flash_cute.flash_attn_combine(o, lse, out_dtype=BF16, return_lse=True),
        (meta(3, 2, 9, 8, 64, dtype=torch.float32), meta(3, 2, 9, 8, dtype=torch.float32)),
    )
    yield "fa3 func", lambda q, k: fa3.flash_attn_func(q, k, k, causal=True), (q, k)
    yield "fa3 qkvpacked", lambda qkv: fa3.flash_attn_qkvpacked_func(qkv), (meta(2, 9, 3, 8, 64),)
    yield (
        "fa3 varlen",
        lambda q, k: fa3.flash_attn_varlen_func(
            q, k, k, cu_q, cu_k, 20, 25, seqused_k=used, return_attn_probs=True
        ),
        (qv, kv),
    )
    yield (
        "fa3 kvcache",
        lambda q, k: fa3.flash_attn_with_kvcache(
            q, k, k, cache_seqlens=used, page_table=table, causal=True, return_softmax_lse=True
        ),
        (q, pages),
    )
    yield (
        "fa3 kvcache varlen",
        lambda q, k: fa3.flash_attn_with_kvcache(
            q, k, k, cache_seqlens=used, page_table=table, cu_seqlens_q=cu_q, max_seqlen_q=20
        ),
        (qv, pages),
    )
    yield (
        "fa3 combine",
        lambda o, lse: fa3.flash_attn_combine(o, lse),
        (
            meta(3, 30, 8, 64, dtype=torch.float32),
            meta(3, 30, 8, dtype=torch.float32),
        ),
    )


CALLS = list(compile_calls())


@pytest.mark.parametrize("name, fn, inputs", CALLS, ids=[c[0] for c in CALLS])
def test_compile_fullgraph(name, fn, inputs):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    result = compiled(*inputs)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any(t.startswith("flash_cute.") for t in targets), targets
    eager_shapes = [t.shape for t in (result if isinstance(result, tuple) else (result,))]
    assert eager_shapes and all(isinstance(s, torch.Size) for s in eager_shapes)


def test_compile_with_aot_autograd():
    """Through AOT autograd (functionalization of the out-variant's mutation)."""
    torch._dynamo.reset()
    q, k = meta(2, 9, 8, 64), meta(2, 17, 2, 64)
    compiled = torch.compile(
        lambda q, k: fa3.flash_attn_func(q, k, k, causal=True, return_attn_probs=True),
        fullgraph=True,
        backend="aot_eager",
    )
    out, lse = compiled(q, k)
    assert out.shape == q.shape and lse.shape == (2, 8, 9)


def test_eager_calls_stay_off_the_dispatcher(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    for name in ("traced_forward", "traced_combine"):
        monkeypatch.setattr(ops, name, refuse)
    q, k = torch.randn(1, 4, 2, 64, dtype=BF16), torch.randn(1, 4, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):  # the native checks
        flash_cute.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fa3.flash_attn_with_kvcache(q, k, k)


def test_ops_have_cuda_kernels_and_refuse_other_devices():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_cute::forward", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_cute::flash_attn_combine", "CUDA")
    with pytest.raises(RuntimeError, match="run on CUDA tensors .* got a tensor on cpu"):
        ops.flash_attn_combine_op(
            torch.zeros(2, 1, 1, 1, 64), torch.zeros(2, 1, 1, 1), torch.empty(1, 1, 1, 64), False
        )
