"""flash_cute.distributed on CPUs: the ring schedule, the zigzag and interleaved layouts and the
LSE merge over the gloo backend, with the float32 reference standing in for the kernel,
against single-process attention over the whole sequence."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_cute import distributed as cp
from flash_cute.reference import attention_ref, local_mask, stable_seed


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0), (0, 3), (13, 2), (40, -1), (-1, 20)])
def test_pair_mask_is_the_global_mask(causal, window):
    """Every piece pair's call (trimmed rows and keys, bottom-right mask) covers exactly the
    pairs of the global mask restricted to those pieces."""
    length, pieces = 8, 6
    total = length * pieces
    masked = local_mask(total, total, (window[0], 0 if causal else window[1]))
    for qp in range(pieces):
        for kp in range(pieces):
            expect = ~masked[qp * length : (qp + 1) * length, kp * length : (kp + 1) * length]
            m = cp.pair_mask(qp * length, kp * length, length, causal, window)
            got = torch.zeros(length, length, dtype=torch.bool)
            if not m.skip:
                inner = (
                    local_mask(m.n, m.n, (-1, 0)) if m.causal else local_mask(m.n, m.n, m.window)
                )
                got[m.q0 : m.q0 + m.n, m.k0 : m.k0 + m.n] = ~inner
            assert torch.equal(got, expect), (qp, kp, m)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_and_unshard_invert(layout):
    x = torch.arange(2 * 24).view(2, 24)
    shards = [cp.shard_sequence(x, 3, r, layout) for r in range(3)]
    assert torch.equal(cp.unshard_sequence(shards, layout), x)
    if layout == "zigzag":  # pieces of 4: rank 0 holds 0 and 5
        assert shards[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def test_local_lengths_count_each_ranks_tokens():
    lengths = torch.arange(0, 23, dtype=torch.int32)
    for world in (1, 2, 3, 5):
        counts = [cp.local_lengths(lengths, world, rank) for rank in range(world)]
        for rank, got in enumerate(counts):
            assert got.dtype == torch.int32
            want = [len(range(rank, n, world)) for n in lengths.tolist()]
            assert got.tolist() == want, (world, rank)
        assert torch.equal(sum(counts), lengths)


def test_layout_and_length_errors():
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard_sequence(torch.zeros(1, 8), 2, 0, "striped")
    with pytest.raises(ValueError, match="divisible by 4"):
        cp.shard_sequence(torch.zeros(1, 10), 2, 0, "zigzag")


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="initialized torch.distributed group"):
        cp.ring_attention(q, q, q, attend=cp.reference_attend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RING_CASES = [
    # (layout, causal, window, nheads, nheads_kv)
    ("zigzag", True, (-1, -1), 4, 2),
    ("contiguous", True, (-1, -1), 4, 4),
    ("zigzag", False, (-1, -1), 4, 1),
    ("contiguous", False, (-1, -1), 2, 2),
    ("zigzag", True, (7, -1), 4, 2),  # a window shorter than a piece
    ("contiguous", True, (30, -1), 4, 2),  # longer than a piece
    ("zigzag", False, (9, 4), 2, 1),
]


def _ring_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in RING_CASES:
            layout, causal, window, h, hk = case
            gen = torch.Generator().manual_seed(stable_seed(*case))
            seqlen = 2 * world * 6
            q = torch.randn(2, seqlen, h, 16, generator=gen)
            k = torch.randn(2, seqlen, hk, 16, generator=gen)
            v = torch.randn(2, seqlen, hk, 16, generator=gen)
            ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window)
            shard = [cp.shard_sequence(t, world, rank, layout) for t in (q, k, v)]
            out, lse = cp.ring_attention(
                *shard, causal=causal, window_size=window, layout=layout, return_lse=True,
                attend=cp.reference_attend,
            )  # fmt: skip
            want = cp.shard_sequence(ref, world, rank, layout)
            want_lse = cp.shard_sequence(ref_lse, world, rank, layout, dim=2)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=str(case))
            torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5, msg=str(case))
        _varlen_cases(rank, world)
        _decode_cases(rank, world)
    finally:
        dist.destroy_process_group()


def _varlen_cases(rank, world):
    for layout in cp.LAYOUTS:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(stable_seed("varlen", layout, causal))
            local = [2, 6, 4]  # tokens per rank of each sequence (pieces of 1-3)
            seqs = [
                [torch.randn(1, n * world, h, 16, generator=gen) for h in (4, 2, 2)] for n in local
            ]
            shards = [[cp.shard_sequence(t, world, rank, layout) for t in s] for s in seqs]
            q, k, v = (torch.cat([sh[i][0] for sh in shards]) for i in range(3))
            cu = torch.tensor([0, 2, 8, 12], dtype=torch.int32)
            out, lse = cp.ring_attention_varlen(
                q, k, v, cu, max(local), causal=causal, layout=layout, return_lse=True,
                attend=cp.reference_varlen_attend,
            )  # fmt: skip
            for b, (qs, ks, vs) in enumerate(seqs):
                ref, ref_lse = attention_ref(qs, ks, vs, causal=causal)
                rows = slice(int(cu[b]), int(cu[b + 1]))
                want = cp.shard_sequence(ref, world, rank, layout)[0]
                want_lse = cp.shard_sequence(ref_lse, world, rank, layout, dim=2)[0]
                torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse[:, rows], want_lse, atol=1e-5, rtol=1e-5)


def _decode_cases(rank, world):
    gen = torch.Generator().manual_seed(7)
    batch, capacity, h, hk, d = 3, 24 * world, 4, 2, 16
    q = torch.randn(batch, 1, h, d, generator=gen)
    k = torch.randn(batch, capacity, hk, d, generator=gen)
    v = torch.randn(batch, capacity, hk, d, generator=gen)
    lengths = torch.tensor([1, capacity - 5, capacity], dtype=torch.int32)
    refs = [attention_ref(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n]) for b, n in
            enumerate(lengths.tolist())]  # fmt: skip
    ref = torch.cat([r[0] for r in refs])
    ref_lse = torch.cat([r[1] for r in refs])
    k_local, v_local = (cp.shard_cache(t, world, rank) for t in (k, v))
    out, lse = cp.sharded_decode(
        q, k_local, v_local, lengths, return_lse=True, attend=cp.reference_decode_attend
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # The same shard paged: pages of 4 local slots in a shuffled order.
    page, local = 4, k_local.shape[1]
    perm = torch.randperm(batch * local // page, generator=gen)
    table = perm.view(batch, -1).to(torch.int32)
    pages = [torch.empty(batch * local // page, page, hk, d) for _ in range(2)]
    for cache, src in zip(pages, (k_local, v_local)):
        cache[perm] = src.reshape(-1, page, hk, d)
    out_paged = cp.sharded_decode(
        q, *pages, lengths, page_table=table, attend=cp.reference_decode_attend
    )
    torch.testing.assert_close(out_paged, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_and_sharded_decode_over_gloo(world):
    mp.spawn(_ring_worker, args=(world, _free_port()), nprocs=world, join=True)
