"""Context parallelism on torch.distributed: ring attention for prefill and sharded-KV decode.

One sequence's keys spread over the ranks of a process group, each rank computes attention of
its queries over the keys it holds, and partial results merge by their log-sum-exp (LSE):
for rows that saw key sets A and B, lse = log(exp(lse_A) + exp(lse_B)) and
out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B, in float32.

Ring prefill (`ring_attention`, `ring_attention_varlen`): q, k and v are sharded along the
sequence. Each rank keeps its queries and passes K/V chunks around the ring: at step s it
holds the chunk of rank (rank - s) mod world, sends it to rank + 1 and receives the next from
rank - 1 while it attends to it. Layouts (`shard_sequence`):

- "contiguous": rank r holds tokens [r L, (r + 1) L) of each sequence (L = length / world);
- "zigzag": the sequence cut in 2 world pieces, rank r holds pieces r and 2 world - 1 - r, so
  under a causal mask every rank has the same work (a contiguous split leaves the last rank
  world times the first's).

Each (query piece, key piece) pair is one kernel call whose mask follows from the pieces'
places in the sequence (`pair_mask`): all visible, causal (the same piece), skipped, or a
window shifted to the pieces' offsets.

Sharded decode (`sharded_decode`): token t of every sequence's cache lives on rank
t mod world (`shard_cache`), so each rank holds an equal share at any length; each attends
its shard with all query heads, and an all-gather of the partial outputs and LSEs plus the
combine kernel merge them. No host synchronization: a decode step captures in a CUDA graph.

The attention of a piece pair comes from an `attend` callable (default: flash_cute's kernels;
`reference_attend` computes it in float32 with PyTorch, as the CPU tests over gloo do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import reference
from .interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

LAYOUTS = ("contiguous", "zigzag")


def _world(group, x: torch.Tensor) -> Tuple[int, int]:
    """(world size, rank) of group, checked to carry x's device: NCCL for CUDA tensors, gloo
    for CPU ones."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_cute.distributed needs an initialized torch.distributed group")
    backend = dist.get_backend(group)
    if backend != ("nccl" if x.is_cuda else "gloo"):
        raise ValueError(
            f"the group's backend is {backend!r}; {'CUDA' if x.is_cuda else 'CPU'} tensors "
            f"need {'nccl' if x.is_cuda else 'gloo'}"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _pieces(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def piece_indices(layout: str, world: int, rank: int) -> List[int]:
    """The global piece indices rank holds, in local order: [rank] (contiguous; world pieces)
    or [rank, 2 world - 1 - rank] (zigzag; 2 world pieces)."""
    if _pieces(layout) == 1:
        return [rank]
    return [rank, 2 * world - 1 - rank]


def shard_sequence(x: torch.Tensor, world: int, rank: int, layout: str = "zigzag", dim: int = 1):
    """Rank's shard of x along its sequence dim (length divisible by world x pieces)."""
    count = world * _pieces(layout)
    if x.shape[dim] % count:
        raise ValueError(
            f"sequence length {x.shape[dim]} must be divisible by {count} ({layout} over "
            f"{world} ranks)"
        )
    pieces = x.chunk(count, dim=dim)
    return torch.cat([pieces[i] for i in piece_indices(layout, world, rank)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1):
    """The full sequence from every rank's shard (rank order), inverting shard_sequence."""
    world = len(shards)
    pieces = [None] * (world * _pieces(layout))
    for rank, shard in enumerate(shards):
        owned = piece_indices(layout, world, rank)
        for index, piece in zip(owned, shard.chunk(len(owned), dim=dim)):
            pieces[index] = piece
    return torch.cat(pieces, dim=dim)


def shard_cache(cache: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank's interleaved shard of a contiguous cache (batch, seqlen, ...): slots rank,
    rank + world, ... (a copy; seqlen divisible by world)."""
    if cache.shape[dim] % world:
        raise ValueError(f"cache length {cache.shape[dim]} must be divisible by world {world}")
    index = torch.arange(rank, cache.shape[dim], world, device=cache.device)
    return cache.index_select(dim, index).contiguous()


def local_lengths(seqlens: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Keys of each sequence on rank under the interleaved layout: ceil((len - rank) / world),
    at least 0 (device math, no host sync: two elementwise kernels, where the clamped form
    took four and twice the time in a decode step's graph)."""
    return torch.div(seqlens + (world - 1 - rank), world, rounding_mode="floor").to(torch.int32)


@dataclass(frozen=True)
class PairMask:
    """How a query piece attends a key piece of the same length: skipped, or one call on
    query rows [q0, q0 + n) and keys [k0, k0 + n) of the pieces with the kernel's bottom-right
    aligned mask (causal, or a window (left, right) with -1 unbounded)."""

    skip: bool
    q0: int = 0
    k0: int = 0
    n: int = 0
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)


def pair_mask(
    q_start: int, k_start: int, length: int, causal: bool, window: Tuple[int, int]
) -> PairMask:
    """Query tokens [q_start, q_start + length) against keys [k_start, k_start + length) under
    a causal mask and window in global positions: query g sees key t iff g - left <= t <= g +
    right (right 0 when causal; -1 unbounded)."""
    left, right = window
    left = None if left < 0 else left
    right = 0 if causal else (None if right < 0 else right)
    shift = q_start - k_start  # piece row i sees piece keys [i + shift - left, i + shift + right]
    last = length - 1
    if (right is not None and last + shift + right < 0) or (
        left is not None and shift - left > last
    ):
        return PairMask(True)
    q0, k0, n = 0, 0, length
    if left is not None and shift > left:  # every row's first key lies past its diagonal
        k0 = shift - left
        n = length - k0  # rows from n on see no key of the piece
    elif right is not None and shift + right < 0:  # every row's last key lies before it
        q0 = -(shift + right)
        n = length - q0
    shift += q0 - k0
    new_left = -1 if left is None or left - shift >= n - 1 else left - shift
    new_right = -1 if right is None or right + shift >= n - 1 else right + shift
    if new_left == -1 and new_right == 0:
        return PairMask(False, q0, k0, n, causal=True)
    return PairMask(False, q0, k0, n, window=(new_left, new_right))


def reference_attend(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    """`attend` in float32 by PyTorch (any device): (out (b, s, h, d) float32, lse (b, h, s))."""
    return reference.attention_ref(q, k, v, softmax_scale, causal=causal, window_size=window_size)


def kernel_attend(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    """`attend` by flash_cute's forward kernel: (out in q's dtype, lse (b, h, s) float32)."""
    return flash_attn_func(
        q, k, v, softmax_scale, causal=causal, window_size=window_size, return_lse=True
    )


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """acc_out (b, s, h, d) float32, acc_lse (b, h, s) float32 absorb one partial result of the
    same rows (in place). Rows with lse -inf (no keys) change nothing."""
    new_lse = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_w = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
    new_w = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(old_w).add_(torch.nan_to_num(out.float(), nan=0.0) * new_w)
    acc_lse.copy_(new_lse)


class _Ring:
    """Passes a tuple of tensors to rank + 1 and takes the next from rank - 1, asynchronously
    (NCCL: one batched group of sends and receives on a side stream)."""

    def __init__(self, group, world: int, rank: int):
        self.group, self.world = group, world
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group else (rank - 1) % world
        self.nccl = dist.get_backend(group) == "nccl"
        self.stream = torch.cuda.Stream() if self.nccl else None

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]):
        if not self.nccl:
            works = [dist.isend(t, self.next, self.group) for t in send]
            works += [dist.irecv(t, self.prev, self.group) for t in recv]
            return works
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
            ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
            return dist.batch_isend_irecv(ops)

    def finish(self, works):
        for work in works:
            work.wait()
        if self.nccl:
            torch.cuda.current_stream().wait_stream(self.stream)


def _ring_chunks(k: torch.Tensor, v: torch.Tensor, group, world: int, rank: int):
    """Yields (source rank, (k, v)) for each ring step: the chunk of rank (rank - step) mod
    world, the next one in flight while the caller attends to this one."""
    ring = _Ring(group, world, rank)
    kv = (k.contiguous(), v.contiguous())
    for step in range(world):
        works = nxt = None
        if step + 1 < world:
            nxt = tuple(torch.empty_like(t) for t in kv)
            works = ring.start(kv, nxt)
        yield (rank - step) % world, kv
        if works is not None:
            ring.finish(works)
            kv = nxt


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    layout: str = "zigzag",
    return_lse: bool = False,
    attend: Optional[Callable] = None,
):
    """Attention of this rank's queries over the whole sequence's keys, K/V passed around the
    group's ring.

    Args:
        q: (batch, seqlen_local, nheads, headdim), this rank's shard (`shard_sequence` with
            `layout`); k, v: (batch, seqlen_local, nheads_kv, headdim) likewise. Every rank
            holds the same shapes.
        group: the process group (default: the world).
        causal, window_size, softmax_scale: as flash_attn_func, in global token positions.
        layout: "zigzag" (balanced causal work, the default) or "contiguous".
        attend: the attention of one piece pair (default `kernel_attend`; the tests pass
            `reference_attend` to run on CPUs over gloo).

    Returns out (batch, seqlen_local, nheads, headdim) in q's dtype, and with return_lse the
    lse (batch, nheads, seqlen_local) float32.
    """
    world, rank = _world(group, q)
    pieces = _pieces(layout)
    if q.dim() != 4 or k.shape != v.shape[:-1] + (k.shape[-1],) or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            "q (batch, seqlen_local, nheads, d) and k, v (batch, seqlen_local, nheads_kv, d) "
            f"with the same batch and seqlen_local; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] % pieces:
        raise ValueError(f"seqlen_local {q.shape[1]} must be divisible by {pieces} ({layout})")
    attend = attend or kernel_attend
    batch, seqlen, nheads, _ = q.shape
    length = seqlen // pieces  # tokens per piece
    acc_out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    acc_lse = torch.full((batch, nheads, seqlen), float("-inf"), device=q.device)
    q_pieces = piece_indices(layout, world, rank)
    for source, kv in _ring_chunks(k, v, group, world, rank):
        for qi, q_piece in enumerate(q_pieces):
            for ki, k_piece in enumerate(piece_indices(layout, world, source)):
                m = pair_mask(q_piece * length, k_piece * length, length, causal, window_size)
                if m.skip:
                    continue
                rows = slice(qi * length + m.q0, qi * length + m.q0 + m.n)
                keys = slice(ki * length + m.k0, ki * length + m.k0 + m.n)
                out, lse = attend(
                    q[:, rows], kv[0][:, keys], kv[1][:, keys], causal=m.causal,
                    window_size=m.window, softmax_scale=softmax_scale,
                )  # fmt: skip
                merge_into(acc_out[:, rows], acc_lse[:, :, rows], out, lse)
    out = acc_out.to(q.dtype)
    return (out, acc_lse) if return_lse else out


def kernel_varlen_attend(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen,
    causal=False,
    softmax_scale=None,
):
    """Varlen `attend` by flash_cute's kernel: sequence b's queries are rows cu_seqlens_q[b] ..
    + seqused_q[b], its keys cu_seqlens_k[b] .. + seqused_k[b]; (out (total_q, h, d), lse
    (h, total_q)), rows outside the used ranges undefined."""
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, max_seqlen, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=causal,
        return_softmax_lse=True, seqused_q=seqused_q,
    )  # fmt: skip


def reference_varlen_attend(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen,
    causal=False,
    softmax_scale=None,
):
    """Varlen `attend` in float32 by PyTorch, per sequence (reads the lengths on the host)."""
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    starts_q, starts_k = cu_seqlens_q[:-1].tolist(), cu_seqlens_k[:-1].tolist()
    for sq, sk, nq, nk in zip(starts_q, starts_k, seqused_q.tolist(), seqused_k.tolist()):
        o, lse_b = reference.attention_ref(
            q[None, sq : sq + nq], k[None, sk : sk + nk], v[None, sk : sk + nk],
            softmax_scale, causal=causal,
        )  # fmt: skip
        out[sq : sq + nq], lse[:, sq : sq + nq] = o[0], lse_b[0]
    return out, lse


def ring_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    group=None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    attend: Optional[Callable] = None,
):
    """`ring_attention` over packed sequences: q (total_local, nheads, headdim) and k, v
    (total_local, nheads_kv, headdim) hold this rank's shard of every sequence (each sharded
    by `shard_sequence` along its own tokens), cu_seqlens (batch + 1,) int32 the local
    boundaries, the same on every rank, max_seqlen the longest local length. Each local length
    must be divisible by the layout's pieces per rank. No windows (their shift per sequence
    differs). Reads cu_seqlens on the host once. Returns out (total_local, nheads, headdim),
    and with return_lse the lse (nheads, total_local)."""
    world, rank = _world(group, q)
    pieces = _pieces(layout)
    attend = attend or kernel_varlen_attend
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if any(n % pieces for n in lengths):
        raise ValueError(f"every local sequence length must be divisible by {pieces} ({layout})")
    device = q.device
    piece_len = torch.tensor([n // pieces for n in lengths], dtype=torch.int32, device=device)
    starts = cu_seqlens[:-1].to(torch.int32)
    total = cu_seqlens[-1:].to(torch.int32)
    # Piece p of every sequence: its start offsets (cu_seqlens form) and its rows.
    piece_cu = [torch.cat([starts + p * piece_len, total]) for p in range(pieces)]
    lengths_t = torch.tensor(lengths, device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
    all_rows = torch.arange(bounds[0], bounds[-1], device=device)
    piece_of_row = (all_rows - starts[seq_of_row]) // piece_len[seq_of_row]
    piece_rows = [all_rows[piece_of_row == p] for p in range(pieces)]
    acc_out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=device)
    q_pieces = piece_indices(layout, world, rank)
    for source, kv in _ring_chunks(k, v, group, world, rank):
        for qi, q_piece in enumerate(q_pieces):
            for ki, k_piece in enumerate(piece_indices(layout, world, source)):
                if causal and k_piece > q_piece:
                    continue
                out, lse = attend(
                    q, kv[0], kv[1], piece_cu[qi], piece_cu[ki], piece_len, piece_len,
                    max_seqlen, causal=causal and k_piece == q_piece, softmax_scale=softmax_scale,
                )  # fmt: skip
                rows = piece_rows[qi]
                part_out, part_lse = acc_out.index_select(0, rows), acc_lse.index_select(1, rows)
                merge_into(
                    part_out.unsqueeze(0), part_lse.unsqueeze(0),
                    out.index_select(0, rows).unsqueeze(0), lse.index_select(1, rows).unsqueeze(0),
                )  # fmt: skip
                acc_out.index_copy_(0, rows, part_out)
                acc_lse.index_copy_(1, rows, part_lse)
    out = acc_out.to(q.dtype)
    return (out, acc_lse) if return_lse else out


def _gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(world, *x.shape): every rank's x, rank order."""
    if dist.get_backend(group) == "nccl":
        out = torch.empty((world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def kernel_decode_attend(q, k_cache, v_cache, cache_seqlens, page_table=None, softmax_scale=None):
    """Decode `attend` by flash_cute's kernel: (out in q's dtype, lse (b, h, s) float32)."""
    return flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
        softmax_scale=softmax_scale, return_softmax_lse=True,
    )  # fmt: skip


def reference_decode_attend(
    q, k_cache, v_cache, cache_seqlens, page_table=None, softmax_scale=None
):
    """Decode `attend` in float32 by PyTorch, per sequence (reads cache_seqlens on the host)."""
    outs, lses = [], []
    for b, n in enumerate(cache_seqlens.tolist()):
        if page_table is not None:
            k = reference.gather_paged(k_cache, page_table[b : b + 1], n)
            v = reference.gather_paged(v_cache, page_table[b : b + 1], n)
        else:
            k, v = k_cache[b : b + 1, :n], v_cache[b : b + 1, :n]
        out, lse = reference.attention_ref(q[b : b + 1], k, v, softmax_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


_LSE_PAD = 4  # float32 words after each gathered output row: its LSE, then 16-byte alignment


def sharded_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    group=None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    attend: Optional[Callable] = None,
):
    """Decode over a cache sharded across the group: token t of each sequence on rank
    t mod world (`shard_cache`; paged caches page this rank's tokens the same way).

    Args:
        q: (batch, seqlen_q, nheads, headdim), the same on every rank; with seqlen_q > 1 the
            queries see every cached key (no causal mask: the shards interleave).
        k_cache, v_cache: this rank's shard, (batch, seqlen_local, nheads_kv, headdim) or
            paged (num_pages, page_size, nheads_kv, headdim) with page_table.
        cache_seqlens: (batch,) int32, the full (global) lengths; rank r holds
            ceil((len - r) / world) of each (`local_lengths`, computed on the device).

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype (and with return_lse the lse
    (batch, nheads, seqlen_q)). One all-gather of outputs with their LSEs, then the combine kernel
    (CPU tensors: the reference merge); no host synchronization on CUDA.
    """
    world, rank = _world(group, q)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
        raise TypeError("cache_seqlens must be a (batch,) int32 tensor of global lengths")
    attend = attend or kernel_decode_attend
    lengths = local_lengths(cache_seqlens, world, rank)
    out, lse = attend(q, k_cache, v_cache, lengths, page_table, softmax_scale)
    # One all-gather carries both: each row holds the output, its LSE and padding that keeps
    # the rows 16-byte aligned for the combine kernel (a second collective cost more).
    d = out.shape[-1]
    part = out.new_empty(out.shape[:-1] + (d + _LSE_PAD,), dtype=torch.float32)
    part[..., :d] = out
    part[..., d] = lse.transpose(1, 2)
    parts = _gather(part, group, world)  # (world, b, s, h, d + pad)
    outs, lses = parts[..., :d], parts[..., d]
    if q.is_cuda:
        merged, merged_lse = flash_attn_combine(outs, lses, out_dtype=q.dtype, return_lse=True)
    else:
        merged, merged_lse = reference.combine_ref(outs, lses)
        merged = merged.to(q.dtype)
    merged_lse = merged_lse.transpose(1, 2)
    return (merged, merged_lse) if return_lse else merged
