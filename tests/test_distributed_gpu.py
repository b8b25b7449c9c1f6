"""flash_cute.distributed on GPUs over NCCL: world size 1 against the plain calls, and (with 2+
devices) every rank's outputs and LSEs against single-GPU flash_cute on the gathered tensors."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_cute
from flash_cute import distributed as cp
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(rank))


def _close(a, b, what, atol=2e-2):
    """bf16 outputs: merged pieces against one call (fp32 merge of bf16 partials)."""
    err = (a.float() - b.float()).abs().max().item()
    assert err <= atol, f"{what}: max error {err}"


def _check_ring(rank, world, layout, causal, window, gqa):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(layout, causal, window, gqa))
    h, hk = (32, 8) if gqa else (8, 8)
    seqlen = 1024 * world
    q, k, v = (
        torch.randn(2, seqlen, n, 128, device="cuda", dtype=BF16, generator=gen)
        for n in (h, hk, hk)
    )
    out_ref, lse_ref = flash_cute.flash_attn_func(
        q, k, v, causal=causal, window_size=window, return_lse=True
    )
    shard = [cp.shard_sequence(t, world, rank, layout) for t in (q, k, v)]
    out, lse = cp.ring_attention(
        *shard, causal=causal, window_size=window, layout=layout, return_lse=True
    )
    what = f"rank {rank} {layout} causal={causal} window={window}"
    _close(out, cp.shard_sequence(out_ref, world, rank, layout), what)
    _close(lse, cp.shard_sequence(lse_ref, world, rank, layout, dim=2), what + " lse", 1e-2)


def _check_varlen(rank, world, layout):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("varlen gpu", layout))
    local = [256, 1024, 512]
    seqs = [
        [torch.randn(1, n * world, h, 128, device="cuda", dtype=BF16, generator=gen)
         for h in (16, 4, 4)]
        for n in local
    ]  # fmt: skip
    shards = [[cp.shard_sequence(t, world, rank, layout) for t in s] for s in seqs]
    q, k, v = (torch.cat([sh[i][0] for sh in shards]) for i in range(3))
    cu = torch.tensor([0, 256, 1280, 1792], dtype=torch.int32, device="cuda")
    out = cp.ring_attention_varlen(q, k, v, cu, max(local), causal=True, layout=layout)
    for b, (qs, ks, vs) in enumerate(seqs):
        ref = flash_cute.flash_attn_func(qs, ks, vs, causal=True)
        rows = slice(int(cu[b]), int(cu[b + 1]))
        _close(out[rows], cp.shard_sequence(ref, world, rank, layout)[0], f"varlen {b}")


def _check_decode(rank, world):
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch, capacity = 3, 4096 * world
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=BF16, generator=gen)
    k, v = (
        torch.randn(batch, capacity, 8, 128, device="cuda", dtype=BF16, generator=gen)
        for _ in range(2)
    )
    lengths = torch.tensor([1, capacity - 7, capacity], dtype=torch.int32, device="cuda")
    ref, ref_lse = flash_cute.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=lengths, return_softmax_lse=True
    )
    k_local, v_local = (cp.shard_cache(t, world, rank) for t in (k, v))
    out, lse = cp.sharded_decode(q, k_local, v_local, lengths, return_lse=True)
    _close(out, ref, f"decode rank {rank}")
    _close(lse, ref_lse, f"decode lse rank {rank}", 1e-2)
    # Captured in a CUDA graph (one step replayed with new lengths and queries).
    out_static = cp.sharded_decode(q, k_local, v_local, lengths)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cp.sharded_decode(q, k_local, v_local, lengths)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = cp.sharded_decode(q, k_local, v_local, lengths)
    lengths.copy_(torch.tensor([5, 4097, capacity // 2], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, device="cuda", dtype=BF16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    ref = flash_cute.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)
    _close(out_static, ref, f"graph decode rank {rank}")


def _worker(rank, world, port):
    _init(rank, world, port)
    try:
        for layout in cp.LAYOUTS:
            for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (700, -1))):
                _check_ring(rank, world, layout, causal, window, gqa=True)
            _check_varlen(rank, world, layout)
        _check_ring(rank, world, "zigzag", False, (300, 200), gqa=False)
        _check_decode(rank, world)
    finally:
        dist.destroy_process_group()


def test_world_size_one_equals_the_plain_calls():
    mp.spawn(_worker, args=(1, _free_port()), nprocs=1, join=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_several_gpus_match_one():
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
