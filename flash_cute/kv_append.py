"""New keys and values appended to a KV cache before the attention reads it: FlashAttention-3's
`flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=..., cu_seqlens_k_new=...)`.

Sequence b's new rows go to the cache slots cache_seqlens[b] .. cache_seqlens[b] + new_b - 1 of
its cache row (cache_batch_idx[b], or b; through the page table for paged caches), and the call
then attends over the cache up to there (from cache_leftpad[b]). With rotary_cos and rotary_sin
(seqlen_ro, rotary_dim / 2) the new keys are rotated before they are written, at positions
rotary_seqlens[b] + i (rotary_seqlens defaults to cache_seqlens), and so are the queries: row i
at rotary_seqlens[b] + i where the mask is causal or local, every row at rotary_seqlens[b]
otherwise (FlashAttention-3's convention). Interleaved rotary pairs dims (2j, 2j + 1), the
other form (j, j + rotary_dim / 2); dims past rotary_dim are left as they are.

On a GPU, where `fuses` allows (the common decode form: a lengths tensor, batch-major rows,
each sequence's own padded or paged 16-bit cache), the attention kernel itself writes the rows
and rotates q (Call.append_k: no launch of its own, as in FlashAttention-3). Otherwise the
update is one kernel on the call's stream ahead of the attention launch (kernels/kv_append.py),
which the attention kernel overlaps where the lengths are a tensor and the new rows
batch-major (a programmatically dependent launch: Call.appended_keys). Neither synchronizes
with the host, so CUDA-graph capture takes both. Rotations are computed in float32
and rounded once to the cache's dtype (FP8 caches, queries and tables included). Tensors off
the GPU (the CPU tests) take PyTorch ops of the same semantics instead. A row whose slot
lies past the cache's capacity (or past its page table's width) is dropped rather than written
out of bounds. Calls that append are not replayed from a launch plan (each takes the checked
path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import checks
from .compile_cache import AppendKernelKey, get_append_kernel
from .kernels.kv_append import APPEND_ARGUMENTS
from .runtime import on_device

# The kernel key's names of the dtypes it reads (FP8 caches and queries included).
DTYPE_NAMES = {**checks.ALL_DTYPE_NAMES, **checks.FP8_DTYPES}
# (FlashAttention-3's FP8 calls pass the tables in e4m3 too.)
ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
FUSED_ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# New rows a sequence may gain in a fused append: decode and speculative decoding's few tokens
# (a tile's loading warp writes its rows one after another; larger appends take the kernel).
FUSED_MAX_NEW_ROWS = 4
# The arguments whose presence makes a call append (the others only shape how).
TRIGGERS = ("k", "v", "rotary_cos", "rotary_sin", "cu_seqlens_k_new")


@dataclass(frozen=True)
class KVAppend:
    """The append arguments of one flash_attn_with_kvcache call (FlashAttention-3's names).

    k, v: (batch, seqlen_new, nheads_kv, d / dv), or (total_new, nheads_kv, d / dv) with
    cu_seqlens_k_new (batch + 1,) int32; the cache's dtype. rotary_cos, rotary_sin: (seqlen_ro,
    rotary_dim / 2). rotary_seqlens: (batch,) int32 rotary positions of the first new row."""

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    rotary_cos: Optional[torch.Tensor] = None
    rotary_sin: Optional[torch.Tensor] = None
    cu_seqlens_k_new: Optional[torch.Tensor] = None
    rotary_seqlens: Optional[torch.Tensor] = None
    rotary_interleaved: bool = True

    def requested(self) -> bool:
        return any(getattr(self, name) is not None for name in TRIGGERS)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x (..., d) rotated over its first 2 * cos.shape[-1] dims; cos, sin broadcast to
    (..., rotary_dim / 2) float32. Returns float32."""
    half = cos.shape[-1]
    x = x.float()
    if interleaved:
        x0, x1 = x[..., : 2 * half : 2], x[..., 1 : 2 * half : 2]
    else:
        x0, x1 = x[..., :half], x[..., half : 2 * half]
    r0, r1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    rotated = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), -1)
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


def _same_device(name: str, t: torch.Tensor, device) -> None:
    """The cache's device (a copy from elsewhere would synchronize, and break a capture)."""
    if t.device != device:
        raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}")


def _angles(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """table (seqlen_ro, rotary_dim / 2) rows at positions (any shape), float32; a position
    outside the table (rotary_seqlens past the cache, an error of the caller's) reads its
    nearest row rather than out of bounds."""
    return table[positions.clamp(0, table.shape[0] - 1)].float()  # (the rows only: not the table)


def _check_new_rows(append: KVAppend, k_cache, v_cache, batch: int) -> tuple:
    """Checks k, v and cu_seqlens_k_new; returns k and v as (total_new, nheads_kv, d / dv)
    and the new rows per sequence when they are batch-major (None: packed)."""
    a = append
    if (a.k is None) != (a.v is None):
        raise ValueError("k and v (the keys and values to append) must be given together")
    if a.k is None:
        given = [n for n in TRIGGERS if getattr(a, n) is not None]
        raise ValueError(
            f"{', '.join(given)} need k and v to append (rotary applies to q and the new keys, "
            "as in FlashAttention-3)"
        )
    if (a.rotary_cos is None) != (a.rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not isinstance(a.rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {a.rotary_interleaved!r}")
    for name, new, cache in (("k", a.k, k_cache), ("v", a.v, v_cache)):
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(new).__name__}")
        if new.dtype != cache.dtype or new.device != cache.device:
            raise ValueError(
                f"{name} must have its cache's dtype and device ({cache.dtype}, {cache.device}), "
                f"got {new.dtype}, {new.device}"
            )
        if new.shape[-2:] != cache.shape[-2:]:
            raise ValueError(
                f"{name} must have its cache's (nheads_kv, head dim) {tuple(cache.shape[-2:])}, "
                f"got {tuple(new.shape)}"
            )
        if new.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if a.cu_seqlens_k_new is not None:
        checks.check_cu_seqlens("cu_seqlens_k_new", a.cu_seqlens_k_new, batch)
        if a.k.dim() != 3 or a.v.dim() != 3 or a.k.shape[0] != a.v.shape[0]:
            raise ValueError(
                "with cu_seqlens_k_new, k and v must be (total_new, nheads_kv, head dim), got "
                f"{tuple(a.k.shape)} and {tuple(a.v.shape)}"
            )
        _same_device("cu_seqlens_k_new", a.cu_seqlens_k_new, k_cache.device)
        return a.k, a.v, None
    if a.k.dim() != 4 or a.k.shape[:2] != a.v.shape[:2] or a.k.shape[0] != batch:
        raise ValueError(
            f"k and v must be (batch={batch}, seqlen_new, nheads_kv, head dim), got "
            f"{tuple(a.k.shape)} and {tuple(a.v.shape)}"
        )
    return a.k.flatten(0, 1), a.v.flatten(0, 1), a.k.shape[1]


def _rotary_tables(a: KVAppend, head_dim: int, capacity: int, device):
    for name in ("rotary_cos", "rotary_sin"):
        t = getattr(a, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in ROTARY_DTYPES:
            raise ValueError(
                f"{name} must be a (seqlen_ro, rotary_dim / 2) float16, bfloat16, float32 or "
                "float8_e4m3fn tensor"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        _same_device(name, t, device)
    if a.rotary_cos.shape != a.rotary_sin.shape or a.rotary_cos.dtype != a.rotary_sin.dtype:
        raise ValueError(
            "rotary_cos and rotary_sin must have one shape and dtype, got "
            f"{tuple(a.rotary_cos.shape)} {a.rotary_cos.dtype} and {tuple(a.rotary_sin.shape)} "
            f"{a.rotary_sin.dtype}"
        )
    if a.rotary_cos.shape[0] < capacity:
        raise ValueError(
            f"rotary_cos and rotary_sin must have a row per cache slot ({capacity}), got "
            f"{a.rotary_cos.shape[0]}"
        )
    if not 0 < 2 * a.rotary_cos.shape[1] <= head_dim:
        raise ValueError(
            f"rotary_dim (2 x rotary_cos.shape[1] = {2 * a.rotary_cos.shape[1]}) must be in "
            f"(0, head dim {head_dim}]"
        )
    return a.rotary_cos, a.rotary_sin


@dataclass(frozen=True)
class _Checked:
    """One appending call, checked: what the kernel (or the PyTorch ops) reads."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_new: torch.Tensor  # (total_new, nheads_kv, d)
    v_new: torch.Tensor
    seqlen_new: Optional[int]  # batch-major new rows per sequence (None: cu_seqlens_k_new)
    batch: int
    lengths: Optional[torch.Tensor]  # (batch,) int32 rows cached, or None: `length` for all
    length: int
    page_table: Optional[torch.Tensor]
    batch_idx: Optional[torch.Tensor]
    cu_q: Optional[torch.Tensor]
    rotary: Optional[tuple]  # (cos, sin), or None
    per_row: bool  # queries at their rotary position plus their index


def _checked(append: KVAppend, fields: dict) -> _Checked:
    q, k_cache, v_cache = fields["q"], fields["k"], fields["v"]
    page_table = fields.get("page_table")
    cu_q = fields.get("cu_seqlens_q")
    if fields.get("cu_seqlens_k") is not None:
        raise ValueError("k and v append to a padded or paged cache, not to packed keys")
    batch = cu_q.shape[0] - 1 if cu_q is not None else q.shape[0]
    k_new, v_new, seqlen_new = _check_new_rows(append, k_cache, v_cache, batch)
    device = k_cache.device
    if page_table is None:
        capacity = k_cache.shape[1]
    else:
        capacity = page_table.shape[1] * k_cache.shape[1]
    lengths, length = fields.get("seqused_k"), 0
    if lengths is None:
        if fields.get("kv_length") is None:
            raise ValueError(
                "appending k and v needs cache_seqlens (where each sequence's new rows go)"
            )
        length = checks.check_host_int("cache_seqlens", fields["kv_length"])
    rotary, per_row = None, False
    if append.rotary_cos is not None:
        rotary = _rotary_tables(append, q.shape[-1], capacity, device)
        if append.rotary_seqlens is not None:
            checks.check_seqused(
                "rotary_seqlens", append.rotary_seqlens, batch, "rotary position per sequence"
            )
            _same_device("rotary_seqlens", append.rotary_seqlens, device)
        # FlashAttention-3's rule: per row where the mask is causal or local, a window side
        # that covers every key or query counting as none.
        left, right = fields.get("window_size", (-1, -1))
        seqlen_q = fields.get("max_seqlen_q") if cu_q is not None else q.shape[1]
        local = (0 <= left < capacity - 1) or (0 <= right < (seqlen_q or 1) - 1)
        per_row = bool(fields.get("causal")) or local or bool(fields.get("attention_chunk"))
    return _Checked(
        q, k_cache, v_cache, k_new, v_new, seqlen_new, batch, lengths, length, page_table,
        fields.get("kv_batch_idx"), cu_q, rotary, per_row,
    )  # fmt: skip


def apply(append: KVAppend, fields: dict, fuse: bool = True) -> dict:
    """Write the new rows into the cache (and rotate the queries); returns the Call fields
    with q the rotated queries and the lengths after the append: seqused_k, or seqused_k as
    it was plus appended_keys.

    fields: the Call fields of the call (q, k and v the caches, seqused_k or kv_length the
    lengths before the append, page_table, kv_batch_idx, leftpad_k, cu_seqlens_q, causal,
    window_size, attention_chunk), which forward.check has passed (their types, shapes and
    devices); this checks the append's own arguments. With a lengths tensor and batch-major
    new rows, seqused_k stays the lengths before the append and appended_keys says how many
    rows each sequence gained (Call.appended_keys). On a GPU one kernel does the work
    (kernels/kv_append.py), or with `fuse` where `fuses` says so none: the fields then carry
    the new rows and the tables (Call.append_k, ...), q as it was, and the attention kernel
    writes the rows and rotates q itself. Elsewhere (the CPU tests) PyTorch ops of the same
    semantics."""
    c = _checked(append, fields)
    if c.batch == 0:  # (no sequences: nothing to write, and no launch of no blocks)
        new_lengths = torch.empty(0, device=c.k_cache.device, dtype=torch.int32)
        return dict(fields, seqused_k=new_lengths, kv_length=None)
    if not _uses_kernel(c):
        q, new_lengths = _torch_ops(c, append)
    elif fuse and fuses(c, append, fields):
        # No launch here: the attention kernel writes the rows itself and rotates q.
        cos, sin = c.rotary or (None, None)
        return dict(
            fields, appended_keys=c.seqlen_new, append_k=append.k, append_v=append.v,
            append_cos=cos, append_sin=sin, append_interleaved=bool(append.rotary_interleaved),
            append_per_row=c.per_row,
        )  # fmt: skip
    elif c.lengths is not None and c.seqlen_new is not None:
        # The forward adds the rows itself, and a split launch starts while the append runs
        # (its CTAs wait for the writes where they read them: a programmatically dependent
        # launch), so the kernel writes no lengths it could be reading late.
        q, _ = _launch(c, append, writes_lengths=False)
        return dict(fields, q=q, appended_keys=c.seqlen_new)
    else:
        q, new_lengths = _launch(c, append)
    return dict(fields, q=q, seqused_k=new_lengths, kv_length=None)


def fuses(c: _Checked, append: KVAppend, fields: dict) -> bool:
    """Whether the attention kernel appends the rows itself (Call.append_k, a fused_append
    variant): at most FUSED_MAX_NEW_ROWS batch-major new rows a sequence, queries, a lengths
    tensor, a padded or paged 16-bit cache of each sequence's own row (or page-table row),
    16-byte aligned (TMA reads it in place), with no left padding (not a latent cache whose v
    is k's columns), padded 16-bit queries of the cache's dtype and no qv, rotary
    positions from the lengths and tables of 16 or 32 bits, and no left window or chunk (so
    every row the append writes lies in the key range of a tile that reads it)."""
    rotary_ok = c.rotary is None or (
        append.rotary_seqlens is None and c.rotary[0].dtype in FUSED_ROTARY_DTYPES
    )
    return (
        c.lengths is not None
        and c.seqlen_new is not None
        and c.seqlen_new <= FUSED_MAX_NEW_ROWS
        and c.q.numel() > 0  # (no queries: no attention launch to do the writes)
        # The kernel writes the caller's cache (TMA's 16-byte rows: no aligned copy of it).
        and checks.aligned_16b(c.k_cache)
        and checks.aligned_16b(c.v_cache)
        and c.batch_idx is None
        and fields.get("leftpad_k") is None
        and c.cu_q is None
        and fields.get("qv") is None
        and c.v_cache.data_ptr() != c.k_cache.data_ptr()  # (not a latent cache: v_in_k)
        and c.k_cache.dtype in (torch.float16, torch.bfloat16)
        and c.q.dtype == c.k_cache.dtype
        and rotary_ok
        and fields.get("window_size", (-1, -1))[0] < 0
        and not fields.get("attention_chunk")
    )


def _uses_kernel(c: _Checked) -> bool:
    """Every append on a GPU takes the kernel (FP8 rotation included); the PyTorch ops serve
    tensors elsewhere (the CPU tests)."""
    return c.k_cache.is_cuda


def _launch(c: _Checked, append: KVAppend, writes_lengths: bool = True) -> tuple:
    """The append kernel: (the rotated queries, or q; the lengths after the append, or None
    without writes_lengths)."""
    rotary_dim = 0 if c.rotary is None else 2 * c.rotary[0].shape[1]
    key = AppendKernelKey(
        dtype=DTYPE_NAMES[c.k_cache.dtype],
        head_dim=c.k_cache.shape[-1],
        head_dim_v=c.v_cache.shape[-1],
        q_dtype=DTYPE_NAMES[c.q.dtype] if rotary_dim else None,
        rotary_dim=rotary_dim,
        interleaved=bool(rotary_dim) and append.rotary_interleaved,
        per_row=bool(rotary_dim) and c.per_row,
        rotary_dtype=DTYPE_NAMES[c.rotary[0].dtype] if rotary_dim else None,
        paged=c.page_table is not None,
        lengths=c.lengths is not None,
        varlen_new=c.seqlen_new is None,
        batch_idx=c.batch_idx is not None,
        varlen_q=bool(rotary_dim) and c.cu_q is not None,
        rotary_seqlens=bool(rotary_dim) and append.rotary_seqlens is not None,
        new_lengths=writes_lengths,
    )
    new_lengths = None
    if writes_lengths:
        new_lengths = torch.empty(c.batch, device=c.k_cache.device, dtype=torch.int32)
    q_rows = q_out = None
    if rotary_dim:
        q_rows = c.q if c.cu_q is not None else c.q.flatten(0, 1)
        q_out = torch.empty_like(q_rows)
    cos, sin = c.rotary if rotary_dim else (None, None)
    seqlen_q = c.q.shape[1] if c.cu_q is None else 1
    per_seq = 1 if c.seqlen_new is None else c.seqlen_new  # (0: no rows, no division)
    values = dict(
        k_new=c.k_new, v_new=c.v_new, k_cache=c.k_cache, v_cache=c.v_cache, lengths=c.lengths,
        length=c.length, new_lengths=new_lengths, cu_new=append.cu_seqlens_k_new,
        seqlen_new=per_seq, batch_idx=c.batch_idx, page_table=c.page_table, q=q_rows,
        q_out=q_out, seqlen_q=seqlen_q, cu_q=c.cu_q if key.varlen_q else None, cos=cos, sin=sin,
        rotary_seqlens=append.rotary_seqlens if key.rotary_seqlens else None,
    )  # fmt: skip
    with on_device(c.k_cache.device):
        get_append_kernel(key)(*(values[name] for name in APPEND_ARGUMENTS))
    q = c.q if q_out is None else q_out.view(c.q.shape)
    return q, new_lengths


def _torch_ops(c: _Checked, append: KVAppend) -> tuple:
    """The kernel's semantics in PyTorch ops (no host reads): the path of tensors off the GPU
    (the CPU tests). Rotations may differ from the kernel's by a float32 rounding (it fuses
    multiply-adds), so by a step of the cache's dtype at most."""
    device = c.k_cache.device
    if c.seqlen_new is None:
        cu = append.cu_seqlens_k_new.long()
        counts = (cu[1:] - cu[:-1]).clamp(min=0)
        token = torch.arange(c.k_new.shape[0], device=device)
        rows = torch.searchsorted(cu[1:], token, right=True).clamp(max=c.batch - 1)
        # Rows before cu_seqlens_k_new[0] or from cu_seqlens_k_new[batch] on belong to no
        # sequence (FlashAttention-3 reads only the rows in between).
        belongs = (token >= cu[0]) & (token < cu[-1])
        index = token - cu[rows]
    else:
        counts = torch.full((c.batch,), c.seqlen_new, device=device, dtype=torch.int64)
        rows = torch.arange(c.batch, device=device).repeat_interleave(c.seqlen_new)
        index = torch.arange(c.seqlen_new, device=device).repeat(c.batch)
        belongs = None
    if c.lengths is None:
        start = torch.full((c.batch,), c.length, device=device, dtype=torch.int64)
    else:
        start = c.lengths.long()
    position = start[rows] + index  # each new row's cache slot within its sequence
    q, k_new, v_new, k_cache = c.q, c.k_new, c.v_new, c.k_cache

    if c.rotary is not None:
        cos, sin = c.rotary
        offset = start if append.rotary_seqlens is None else append.rotary_seqlens.long()
        k_pos = offset[rows] + index
        k_new = _rotate(
            k_new, _angles(cos, k_pos)[:, None], _angles(sin, k_pos)[:, None],
            append.rotary_interleaved,
        ).to(k_cache.dtype)  # fmt: skip
        if c.cu_q is not None:
            token = torch.arange(q.shape[0], device=device)
            cu = c.cu_q.long()
            seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=c.batch - 1)
            q_pos = offset[seq] + ((token - cu[seq]) if c.per_row else 0)
            q_cos, q_sin = _angles(cos, q_pos)[:, None], _angles(sin, q_pos)[:, None]
        else:
            steps = (
                torch.arange(q.shape[1], device=device)
                if c.per_row
                else torch.zeros(q.shape[1], device=device, dtype=torch.int64)
            )
            q_pos = offset[:, None] + steps[None, :]
            q_cos, q_sin = _angles(cos, q_pos)[:, :, None], _angles(sin, q_pos)[:, :, None]
        q = _rotate(q, q_cos, q_sin, append.rotary_interleaved).to(q.dtype)

    # The writes. Every row's coordinates are clamped into the cache; a row whose real slot
    # is not there (past the capacity or the page table, a cache row or page out of range, a
    # packed row of no sequence) repeats the write of the first row whose slot is (or, with
    # none, writes its clamped slot's own content back): no write leaves the cache, and the
    # writes to one slot all carry one value, whatever order they land in.
    cache_row = rows
    if c.batch_idx is not None:
        cache_row = c.batch_idx.long()[rows]
    ok = position >= 0
    page_table = c.page_table
    if page_table is None:
        capacity = k_cache.shape[1]
        ok = ok & (position < capacity) & (cache_row >= 0) & (cache_row < k_cache.shape[0])
        where = (cache_row.clamp(0, k_cache.shape[0] - 1), position.clamp(0, capacity - 1))
    else:
        page_size, (table_rows, width) = k_cache.shape[1], page_table.shape
        page_index = torch.div(position, page_size, rounding_mode="floor")
        ok = ok & (page_index < width) & (cache_row >= 0) & (cache_row < table_rows)
        page = page_table[cache_row.clamp(0, table_rows - 1), page_index.clamp(0, width - 1)].long()
        ok = ok & (page >= 0) & (page < k_cache.shape[0])
        where = (page.clamp(0, k_cache.shape[0] - 1), position.clamp(min=0) % page_size)
    if belongs is not None:
        ok = ok & belongs
    new_lengths = (start + counts).to(torch.int32)
    if ok.numel() == 0:  # (no new rows: seqlen_new 0)
        return q, new_lengths
    # The first row with a real slot (0: none), as a one-element index: a 0-d tensor index
    # would read its value on the host, which a graph capture cannot.
    first = torch.argmax(ok.to(torch.int32)).view(1)
    where = tuple(torch.where(ok, w, w[first]) for w in where)
    for cache, new in ((k_cache, k_new), (c.v_cache, v_new)):
        first_ok = ok[first][:, None, None]
        stand_in = torch.where(first_ok, new[first], cache[tuple(w[first] for w in where)])
        cache.index_put_(where, torch.where(ok[:, None, None], new, stand_in))
    return q, new_lengths
