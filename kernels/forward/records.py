"""The records the forward kernel's pieces pass each other: what the kernel's launch takes
(grouped, in the order of its parameters), and what one CTA's warps share on the device.

Device records are frozen: read-only to the DSL across dynamic control flow (their tensors are
register or shared-memory tensors the pieces point to). The kernel's parameters are
NamedTuples, which the DSL flattens into the kernel's parameters in field order.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from ..masking import AttentionMask
from ..softmax import OnlineSoftmax, ScoreHalves

# ----------------------------------------------------------------------------------------
# The kernel's parameters, group by group (FlashAttentionForwardSm90.kernel)
# ----------------------------------------------------------------------------------------


class GmemLoads(NamedTuple):
    """What the producer loads from, in kernel mode order: Q's (and qv's) TMA views, and K's
    and V's (TMA views, or the tensors themselves where rows are gathered)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    qv: Optional[cute.Tensor]


class Outputs(NamedTuple):
    """Where a tile's results go: O (its TMA view where O is TMA-stored) and the LSE, and a
    split launch's partials (fp32 O and LSE, the split mode last)."""

    o: cute.Tensor
    lse: Optional[cute.Tensor]
    o_partial: Optional[cute.Tensor]
    lse_partial: Optional[cute.Tensor]


class ProblemShapes(NamedTuple):
    """What every tile reads of the launch's run-time problem: q, k and v in kernel mode order
    (their shapes; a fused append writes k and v), the call's per-sequence and per-head
    tensors (named as the launch takes them), and, set on the device, the split count and the
    kv_length scalar (scalar_kv_length variants: every sequence's keys; after_append: the rows
    appended to each; None otherwise)."""

    q: cute.Tensor
    k: cute.Tensor
    v: Optional[cute.Tensor]  # (a fused append's only)
    cu_seqlens_q: Optional[cute.Tensor]
    cu_seqlens_k: Optional[cute.Tensor]
    seqused_k: Optional[cute.Tensor]
    page_table: Optional[cute.Tensor]
    learnable_sink: Optional[cute.Tensor]
    seqused_q: Optional[cute.Tensor]
    kv_batch_idx: Optional[cute.Tensor]
    leftpad_k: Optional[cute.Tensor]
    q_descale: Optional[cute.Tensor]  # FP8 math: (batch, nheads_kv) fp32
    k_descale: Optional[cute.Tensor]  # FP8 K/V: (batch, nheads_kv) fp32
    v_descale: Optional[cute.Tensor]
    # A fused append's new rows (batch, new, nheads_kv, d / dv) and rotary tables.
    append_k: Optional[cute.Tensor]
    append_v: Optional[cute.Tensor]
    append_cos: Optional[cute.Tensor]
    append_sin: Optional[cute.Tensor]
    num_splits: Optional[Int32] = None
    kv_length: Optional[Int32] = None


# The fields of ProblemShapes the launch passes through by name.
CALL_TENSORS = ProblemShapes._fields[
    ProblemShapes._fields.index("cu_seqlens_q") : ProblemShapes._fields.index("append_sin") + 1
]


class Scalars(NamedTuple):
    num_splits: Int32
    max_ctas: Int32  # the persistent grid's size cap
    kv_length: Int32  # every sequence's keys (scalar_kv_length) or its rows appended


class TmaAtoms(NamedTuple):
    """The TMA atoms of Q's tile, the K and V rings, O's store and qv's tile (None where that
    tensor is not moved by TMA)."""

    q: cute.CopyAtom
    k: Optional[cute.CopyAtom]
    v: Optional[cute.CopyAtom]
    o: Optional[cute.CopyAtom]
    qv: Optional[cute.CopyAtom]


class SmemLayouts(NamedTuple):
    """Shared-memory layouts: Q's tile, the K and V rings (V: K's leading columns with
    v_in_k), O's own tile, P's (P from smem), and FP8 caches' FP8 rings."""

    q: cute.ComposedLayout
    k: cute.ComposedLayout
    v: cute.ComposedLayout
    o: cute.ComposedLayout
    p: Optional[cute.ComposedLayout]
    k8: Optional[cute.ComposedLayout]
    v8: Optional[cute.ComposedLayout]


class TiledMmas(NamedTuple):
    qk: cute.TiledMma
    pv: cute.TiledMma


class KernelParams(NamedTuple):
    """The kernel's parameters: the launch's groups in order, one declaration for the forward
    kernel and the latent decode kernel (whose mmas are its own); the DSL flattens them in
    field order."""

    loads: GmemLoads
    outputs: Outputs
    problem: ProblemShapes
    counters: Optional[cute.Tensor]
    trace: Optional[cute.Tensor]
    scalars: Scalars
    atoms: TmaAtoms
    softmax_scale_log2: Float32
    layouts: SmemLayouts
    mmas: object  # TiledMmas (the latent decode kernel's: SeesawMmas)


# ----------------------------------------------------------------------------------------
# What a CTA's warps share on the device
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MainloopOperands:
    """What an MMA warpgroup's per-key-block steps work on (frozen: read-only to the DSL
    across dynamic control flow; the accumulators are register tensors it points to)."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    thr_mma_qk: cute.ThrMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    tOrP: cute.Tensor
    smem_copy_P: Optional[cute.ThrCopy]
    tPsP: Optional[cute.Tensor]
    acc_S_shape: object
    acc_O: cute.Tensor
    softmax: OnlineSoftmax
    softcap_prescale: Optional[Float32]  # softmax_scale / softcap, where softcap is on
    pending_scale: Optional[cute.Tensor]
    mask: AttentionMask
    m_block: Int32
    pipeline_k: pipeline.PipelineAsync
    pipeline_v: pipeline.PipelineAsync
    warpgroup_idx: Int32
    sV: cute.Tensor
    last_block: Int32  # the tile's last key block, processed first
    last_block_keys: Int32  # the keys of it that exist (may be fewer than tile_n)
    halves: Optional[ScoreHalves] = None  # split_scores: the warpgroups' row exchange


@dataclass(frozen=True)
class CtaBuffers:
    """The CTA's shared-memory tiles and the rings guarding them, as the producer and the
    consumers both see them. sV: K's stages where V is read from K's columns (v_in_k); sP
    (P through smem) and sRows (split_scores' row exchange) None where unused; sO: Q's tile
    unless O has one of its own."""

    sQ: cute.Tensor
    sQ_mma: cute.Tensor  # Q's tile as the GEMMs read it: sQ, or its fp16 form (kv_dequant)
    sK: cute.Tensor
    sV: cute.Tensor
    sP: Optional[cute.Tensor]
    sRows: Optional[cute.Tensor]
    sO: cute.Tensor
    pipeline_q: pipeline.PipelineAsync
    pipeline_k: pipeline.PipelineAsync
    pipeline_v: pipeline.PipelineAsync
    # FP8 K/V: the rings the TMA loads fill, which the converting warps read and turn into
    # the fp16 rings above (sK, sV, pipeline_k, pipeline_v: kernels/kv_dequant.py). None
    # otherwise.
    sK8: Optional[cute.Tensor] = None
    sV8: Optional[cute.Tensor] = None
    pipeline_k8: Optional[pipeline.PipelineAsync] = None
    pipeline_v8: Optional[pipeline.PipelineAsync] = None


@dataclass(frozen=True)
class MmaSetup:
    """A consumer thread's constants for the launch: the two GEMMs' tiled MMAs, O's TMA store
    atom (None where O goes from registers), the softmax scale in log2 units, and the thread's
    index among the MMA threads and its warpgroup's."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tma_atom_O: Optional[cute.CopyAtom]
    softmax_scale_log2: Float32
    tidx: Int32
    warpgroup_idx: Int32


@dataclass(frozen=True)
class TileResult:
    """What the mainloop leaves the epilogue of a tile: O (fp32, normalized) and the LSE in the
    MMA threads' registers, the tile's sequence lengths, and where O overwrites Q's tile, Q's
    ring and state to release after the store (None otherwise)."""

    acc_O: cute.Tensor
    lse: cute.Tensor
    seqlen: object  # kernels/seqlen_info.py SeqlenInfo
    q_release: Optional[object] = None


@dataclass(frozen=True)
class QLoad:
    """The producer's copies of one tile's Q (an (atom, src, dst) per tensor filling the tile:
    q, or qv then q), into Q's ring at state."""

    copies: tuple
    ring: pipeline.PipelineAsync
    state: pipeline.PipelineState


@dataclass(frozen=True)
class QRelease:
    """Q's ring and state, released once the O store has read Q's tile (where O overwrites it)."""

    ring: pipeline.PipelineAsync
    state: pipeline.PipelineState
