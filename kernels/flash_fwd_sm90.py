"""FlashAttention-3-style forward kernel for Hopper (sm_90a), written in the CuTe DSL.

A tile is one (query tile, head, batch[, split]): tile_m rows of O and their LSE. The tile
scheduler (kernels/tile_scheduler.py) says which tiles a CTA runs: one per CTA, or with a
persistent scheduler (config.scheduler, unsplit problems, fixed-length or varlen) at most
SMs x ctas_per_sm CTAs loop over the tiles, the producer warp loading the next tile's Q and
K/V while the MMA warpgroups finish the current one.

Warp roles (128 * (1 + num_mma_warpgroups) threads):
- warpgroup 0, the producer, lowers its registers with setmaxnreg; its warp 0 issues the TMA
  loads of the Q tile and of K and V tiles into a num_stages-deep smem ring, each stage
  tracked by a full/empty mbarrier pair (separate rings for K and V).
- warpgroups 1.., the consumers, raise their registers; each owns 64 query rows and runs
  S = Q K^T (WGMMA, smem x smem), the online softmax in fp32, and O += P V (WGMMA with P
  from registers, or from smem when the config says so), then writes O and the LSE.

Scheduling knobs (static config):
- intra_wg_overlap: issue S = Q K^T of key block n before the softmax of block n+1 finishes
  its P V, keeping two WGMMA groups in flight.
- pingpong: named barriers make the consumer warpgroups take turns issuing GEMMs, so one's
  softmax overlaps another's tensor-core work.
- rescale_o_before_pv: scale O while Q K^T is in flight instead of after P V (large head dims).
- scheduler, l2_section_mb: one CTA per tile or persistent CTAs (static or dynamic), and the
  causal tile order's head sections.
- mbarrier_probe: poll K/V barriers once before the blocking wait.
- exp2_on_fma: compute that many of every 16 softmax exponentials with a polynomial on the FMA
  pipe instead of the MUFU.
- lazy_rescale, rescale_threshold: skip a warp's O rescale when no row max moved; let a row's
  max lag a new one by up to rescale_threshold (log2 units) so that happens more often.
- store_o_from_registers: O straight from registers (row-predicated) rather than through smem
  and one TMA store (split and varlen variants always: their rows are ragged).

Problem variants (static; each is a separate compiled kernel, flash_cute.plan.ForwardVariant):
- varlen_q: q is packed (total_q, nheads, d) with cu_seqlens_q.
- kv_layout "padded" (batch, seqlen_k, nheads_kv, d), "packed" (total_k, ...) with
  cu_seqlens_k, or "paged" (num_pages, page_size, nheads_kv, d) with a page table; with
  seqused_k the valid key count per batch comes from a tensor, with scalar_kv_length from the
  kv_length argument (one count for every batch: an int cache_seqlens). kv_batch_idx: batch b
  reads cache row (or page-table row) kv_batch_idx[b]; leftpad_k: a padded cache row's keys
  start at leftpad_k[b]; seqused_q: a packed sequence's first seqused_q[b] rows are its queries.
- split: grid.y covers nheads x num_splits; split s takes the s-th share of the key blocks and
  writes its partial O (fp32, normalized over its own keys) and LSE (-inf for an empty split).
  The last of a tile's splits to finish (a per-tile arrival counter) merges the tile's
  partials into O and the LSE, so a split launch needs no separate combine kernel; with
  combine_launch (partials too large for one CTA to merge fast) it leaves them to the combine
  kernel, launched after it.
- pack_gqa: pack_gqa_ratio consecutive query heads sharing a kv head (all of them, or a group
  whose size divides tile_m) are folded into the tile's rows (row = token * ratio + head in
  group), so each K/V tile is read once for the group.
"""

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Tuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import hopper_mma, trace_records
from .block_range import KeyBlockRange, LocalWindow
from .kv_dequant import FP8_GATHER_WARPS, ConvertingBlockLoader, convert_block
from .masking import AttentionMask
from .named_barriers import NamedBarrier
from .paged_kv_gather import PRODUCER_THREADS, GatherPagedBlockLoader
from .seqlen_info import SeqlenInfo
from .softmax import (
    OnlineSoftmax,
    ScoreHalves,
    apply_softcap,
    rescale_rows,
    rescale_rows_if_any_changed,
)
from .split_merge import lanes_per_row, merge_row
from .tile_scheduler import (
    PersistentTileScheduler,
    SingleTileScheduler,
    TileSpace,
    WorkTile,
)
from .tma_loads import PairedBlockLoader, TmaBlockLoader, TmaPagedBlockLoader
from .trace_records import TileTrace, linear_block_idx

THREADS_PER_WARPGROUP = 128
LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def _row_major_wide(shape) -> Tuple[cute.Layout, cutlass.Int64]:
    """(the compact layout of `shape` with its last mode contiguous, torch's default; its size).
    Strides and size are 64-bit: a split launch's scratch may pass 2^31 elements. Static extents
    stay static in the strides."""
    strides, static_factor = [1], 1
    for extent in (*reversed(shape[1:]), shape[0]):
        if isinstance(extent, int):
            static_factor *= extent
            strides.append(strides[-1] * extent)
        else:  # the widening cast drops what the DSL knew of the stride's divisibility: restate it
            strides.append(cute.assume(strides[-1] * cutlass.Int64(extent), divby=static_factor))
    size = strides.pop()
    return cute.make_layout(shape, stride=tuple(reversed(strides))), size


def _make_packed_gqa_tma_atom(op, mX, smem_layout, tile_m: int, head_dim: int, ratio: int):
    """TMA atom over rows folded as (q head in group, token): mX (s, d, h[, b]) becomes
    ((ratio, s), d, h / ratio[, b]), and a box of tile_m rows covers tile_m / ratio tokens
    of `ratio` consecutive heads. The heads and tokens modes are grouped first so the
    descriptor keeps the tensor's rank."""
    rank = cute.rank(mX)
    grouped = hopper_mma.permute_modes(mX, (2, 0, 1, *range(3, rank)))  # (h, s, d[, b])
    grouped = cute.group_modes(grouped, 0, 2)  # ((h, s), d[, b])
    atom, tma = cpasync.make_tiled_tma_atom(
        op, grouped, smem_layout, ((ratio, tile_m // ratio), head_dim)
    )
    # Back to ((ratio, s), d, h / ratio[, b]) coordinates.
    shape = ((ratio, tma.shape[0][1]), tma.shape[1], tma.shape[0][0] // ratio, *tma.shape[2:])
    stride = (tma.stride[0], tma.stride[1], tma.stride[0][0] * ratio, *tma.stride[2:])
    return atom, cute.make_tensor(tma.iterator, cute.make_layout(shape, stride=stride))


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
class LoadSources:
    """What the producer copies from: q, k, v (and qv) in kernel mode order, the page table,
    and the TMA atoms of Q's tile and of the K and V rings (None where not loaded by TMA)."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mQV: Optional[cute.Tensor]
    mPageTable: Optional[cute.Tensor]
    tma_atom_Q: cute.CopyAtom
    tma_atom_K: Optional[cute.CopyAtom]
    tma_atom_V: Optional[cute.CopyAtom]
    tma_atom_QV: Optional[cute.CopyAtom]


@dataclass(frozen=True)
class MmaSetup:
    """The consumers' per-launch constants: the two GEMMs' tiled MMAs, O's TMA store atom
    (None where O goes from registers), and the softmax scale in log2 units."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tma_atom_O: Optional[cute.CopyAtom]
    softmax_scale_log2: Float32


@dataclass(frozen=True)
class ProblemShapes:
    """What every tile reads of the launch's run-time problem: q and k in kernel mode order
    (their shapes), the per-sequence tensors, the per-head sink logits, the split count, and
    the scalar key count of scalar_kv_length variants (None otherwise)."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mCuSeqlensQ: Optional[cute.Tensor]
    mCuSeqlensK: Optional[cute.Tensor]
    mSeqUsedK: Optional[cute.Tensor]
    mPageTable: Optional[cute.Tensor]
    mLearnableSink: Optional[cute.Tensor]
    num_splits: Int32
    kv_length: Optional[Int32]
    mSeqUsedQ: Optional[cute.Tensor] = None
    mKvBatchIdx: Optional[cute.Tensor] = None
    mLeftPadK: Optional[cute.Tensor] = None
    mKDescale: Optional[cute.Tensor] = None  # FP8 K/V: (batch, nheads_kv) fp32
    mVDescale: Optional[cute.Tensor] = None


class FlashAttentionForwardSm90:
    """One compiled variant of the forward kernel: the host launch and the device kernel.

    Constructed from a flash_cute.plan.ForwardVariant, taken whole: its effective config (tile
    shape and knobs, an AttentionConfig, whose shared-memory model gives separate_o_smem) and
    the problem's static shape. The constructor derives device-side facts only.

    Entry points (compile_cache.Signature reads their parameters; the CUDA stream comes last):
      __call__(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
               kv_length, partials, counters, scale_log2, max_ctas, num_splits)
      call_short(q, k, v, out, kv_length, scale_log2, max_ctas): variants that use none of
               the optional arguments (a cheaper call through TVM-FFI).
    Arguments (tensors 16-byte aligned, last dim contiguous), B = batch, S = num_splits:
      q:    (B, seqlen_q, nheads, d), or (total_q, nheads, d) when varlen_q
      k, v: (B, seqlen_k, nheads_kv, d) padded, (total_k, nheads_kv, d) packed,
            (num_pages, page_size, nheads_kv, d) paged; nheads % nheads_kv == 0
      out:  like q in q's dtype
      lse:  (B, nheads, seqlen_q) or (nheads, total_q) fp32, or None
      cu_seqlens_q / cu_seqlens_k: (B + 1,) int32; seqused_k: (B,) int32;
      page_table: (B, max_pages_per_seq) int32 (None where the variant has none of them)
      learnable_sink: (nheads,) sink logits
      seqused_q, kv_batch_idx, leftpad_k: (B,) int32 (None where the variant has none); with
            kv_batch_idx, k/v (padded) and page_table have the cache's own batch size
      qv:   qv variants (FlashAttention-3's absorbed MLA): like q with V's head dim dv; the
            scores are q k^T + qv v^T (q and k then have d - dv dims), the output P v
      kv_length: the keys of every sequence (scalar_kv_length variants); unused by others
      partials: split variants' fp32 scratch, 16-byte aligned: the partial O (S, *out.shape)
            and right after it the partial LSE (S, *lse.shape), both contiguous; unused by
            others
      counters: int32 counters, zero before the launch and left zero after it (the last CTA
            to use each resets it): 2 for the dynamic persistent scheduler, one per tile for
            split variants (TileSpace.block_grid without the split factor); unused by others.
            Launches that may run at the same time need different counters.
      scale_log2: softmax scale times log2(e)
      max_ctas: the persistent grid's size cap (SMs x CTAs per SM); unused by other variants
      num_splits: splits of the key range (split variants)
    Batch, sequence lengths, head counts, page size and num_splits are run-time values.
    """

    def __init__(self, variant):
        self.variant = variant
        self.config = config = variant.config
        self.dtype = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[variant.dtype]
        # K/V in the cache's dtype. FP8 blocks are converted before each GEMM, to fp16 (one
        # conversion instruction per two values; bf16 would take four): with an FP8 cache the
        # GEMMs run in fp16 (mma_dtype) and a bf16 Q tile is converted to fp16 once it lands.
        self.kv_fp8 = variant.kv_dtype is not None
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else self.dtype
        self.mma_dtype = cutlass.Float16 if self.kv_fp8 else self.dtype
        self.converts_q = self.mma_dtype is not self.dtype
        self.num_mma_warpgroups = config.num_mma_warpgroups
        # o_split warpgroups share the tile's 64 rows, each with its part of O's columns (and
        # each computing the rows' scores itself, or with split_scores its half of each key
        # block's); otherwise warpgroup w has rows 64w..64w+63.
        self.o_split = config.o_split
        self.split_scores = config.split_scores
        self.num_mma_threads = THREADS_PER_WARPGROUP * self.num_mma_warpgroups
        self.num_threads = THREADS_PER_WARPGROUP * (1 + self.num_mma_warpgroups)
        self.window = LocalWindow(
            variant.window_left, variant.window_right, variant.attention_chunk
        )
        # Whether K/V rows past a sequence's end can be loaded (see _clear_v_tail; with an
        # FP8 cache the converting warps write them as zeros instead).
        self.clears_v_tail = not self.kv_fp8 and (
            variant.kv_layout != "padded"
            or variant.seqused_k
            or variant.scalar_kv_length
            or variant.leftpad_k
        )
        # Persistent: a grid of at most max_ctas CTAs, each looping over tiles, so one tile's
        # epilogue overlaps the next tile's Q and K/V loads (kernels/tile_scheduler.py).
        self.persistent = config.scheduler != "single_tile"
        self.scheduler_cls = PersistentTileScheduler if self.persistent else SingleTileScheduler
        # O through smem and one TMA store (which clips rows past seqlen_q), or straight from
        # registers, row-predicated.
        self.tma_store_o = not config.store_o_from_registers
        # A TMA-stored O gets its own smem when it fits (config's smem model), so the next Q
        # can load during the epilogue; otherwise O reuses Q's tile and Q is freed once the O
        # store has read it.
        self.separate_o_smem = config.separate_o_smem(
            variant.head_dim, 2, variant.head_dim_v, variant.v_in_k
        )
        # When a persistent kernel's O goes through Q's tile, the storing warp frees Q after
        # the O store; otherwise the MMA warps free it after the mainloop.
        self.o_overwrites_q = self.persistent and self.tma_store_o and not self.separate_o_smem
        self.smem_align = 1024
        # Paged K/V gathered with cp.async (pages no TMA box follows); one CTA per tile, so
        # every producer warp walks the same tile.
        self.kv_gather = variant.gather_page_size is not None
        # The producer warps that load K/V (0 .. load_warps - 1; warp 0 also loads Q): warp 0
        # issuing TMA loads, the whole warpgroup gathering 16-bit rows straight into the
        # WGMMAs' stages, or FP8_GATHER_WARPS gathering FP8 rows. With an FP8 cache the
        # others convert its blocks (kernels/kv_dequant.py).
        self.load_warps = 1
        if self.kv_gather:
            self.load_warps = FP8_GATHER_WARPS if self.kv_fp8 else PRODUCER_THREADS // 32
        self.gathers_16bit = self.kv_gather and not self.kv_fp8
        self.convert_threads = PRODUCER_THREADS - 32 * self.load_warps if self.kv_fp8 else 0

    def _kv_ring(self, barriers, tx_count: int, tma_warp, consumer_threads: int):
        """The K or V ring (or an FP8 cache's K8 or V8 ring) read by consumer_threads: TMA
        loads complete on the bytes they carry (tx_count) and consumers release one arrive per
        warp; gathered rows arrive (noinc) from every gathering thread once its copies land,
        and a PipelineCpAsync consumer releases from every thread."""
        if const_expr(self.kv_gather):
            return pipeline.PipelineCpAsync.create(
                barrier_storage=barriers.data_ptr(),
                num_stages=self.config.num_stages,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * self.load_warps
                ),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
                defer_sync=True,
            )
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers.data_ptr(),
            num_stages=self.config.num_stages,
            producer_group=tma_warp,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads // 32),
            tx_count=tx_count,
            defer_sync=True,
        )

    def _kv_tma_atom(self, op, mX, stages_layout, width: int):
        """TMA atom of the K or V ring (width: d or dv): a box of one key block, or of
        page_box_rows rows where paged blocks load page by page."""
        if const_expr(self.variant.page_box_rows is not None):
            rows = self.variant.page_box_rows
            box_layout = hopper_mma.make_row_major_smem_layout(self.kv_dtype, rows, width)
            return cpasync.make_tiled_tma_atom(op, mX, box_layout, (rows, width), 1)
        stage_layout = cute.select(stages_layout, mode=[0, 1])
        return cpasync.make_tiled_tma_atom(op, mX, stage_layout, (self.config.tile_n, width), 1)

    def _tile_space(
        self,
        mQ_shape: cute.Tensor,
        mK_shape: cute.Tensor,
        mCuSeqlensQ,
        mPageTable,
        num_splits: Int32,
        max_ctas: Int32,
    ) -> TileSpace:
        """The launch's work tiles (q and k in kernel mode order, for their run-time shapes)."""
        v = self.variant
        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(v.varlen_q) else mQ_shape.shape[3]
        return TileSpace(
            tile_m=self.config.tile_m,
            rows_per_token=v.pack_gqa_ratio,
            causal=v.causal,
            varlen=v.varlen_q,
            split=v.split,
            kv_bytes_per_key=(v.head_dim + v.head_dim_v) * self.kv_dtype.width // 8,
            l2_section_mb=self.config.l2_section_mb,
            seqlen_q=mQ_shape.shape[0],
            nheads=mQ_shape.shape[2],
            nheads_kv=mK_shape.shape[2],
            batch=batch,
            num_splits=num_splits,
            kv_capacity=self._kv_capacity(mK_shape, mPageTable),
            max_ctas=max_ctas,
            cu_seqlens_q=mCuSeqlensQ,
        )

    # ------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        out: cute.Tensor,
        lse: Optional[cute.Tensor],
        cu_seqlens_q: Optional[cute.Tensor],
        cu_seqlens_k: Optional[cute.Tensor],
        seqused_k: Optional[cute.Tensor],
        page_table: Optional[cute.Tensor],
        learnable_sink: Optional[cute.Tensor],
        seqused_q: Optional[cute.Tensor],
        kv_batch_idx: Optional[cute.Tensor],
        leftpad_k: Optional[cute.Tensor],
        qv: Optional[cute.Tensor],
        k_descale: Optional[cute.Tensor],
        v_descale: Optional[cute.Tensor],
        kv_length: Int32,
        partials: Optional[cute.Pointer],
        counters: Optional[cute.Pointer],
        scale_log2: Float32,
        max_ctas: Int32,
        num_splits: Int32,
        trace: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        """The whole signature. The split scratch and the counters come as addresses (TVM-FFI
        converts an int for much less than a tensor); the views built here are 64-bit: a split
        launch's partials may pass 2^31 elements. trace: a traced variant's (tiles,
        RECORD_WORDS) int64 records (kernels/trace_records.py)."""
        out_partial = lse_partial = mCounters = None
        if const_expr(self.variant.split):
            o_shape = (num_splits, *out.shape)
            if const_expr(self.variant.varlen_q):  # q (total_q, nheads, d): lse (nheads, total_q)
                lse_shape = (num_splits, q.shape[1], q.shape[0])
            else:  # q (batch, seqlen_q, nheads, d): lse (batch, nheads, seqlen_q)
                lse_shape = (num_splits, q.shape[0], q.shape[2], q.shape[1])
            o_layout, o_size = _row_major_wide(o_shape)
            out_partial = cute.make_tensor(partials, o_layout)
            # Offset by a multiple of head_dim (>= 64) floats: the LSE partial stays 16-byte
            # aligned.
            lse_partial = cute.make_tensor(partials + o_size, _row_major_wide(lse_shape)[0])
        if const_expr(self.variant.takes_counters):
            # Indexed by tile (split) or by its two slots (dynamic scheduler); the size is
            # never read.
            mCounters = cute.make_tensor(counters, cute.make_layout(1 << 30))
        self._launch(
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, learnable_sink,
            seqused_q, kv_batch_idx, leftpad_k, qv, k_descale, v_descale, kv_length, out_partial,
            lse_partial, mCounters, scale_log2, max_ctas, num_splits, trace, stream,
        )  # fmt: skip

    @cute.jit
    def call_short(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        out: cute.Tensor,
        kv_length: Int32,
        scale_log2: Float32,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """The signature of a variant that uses none of the optional arguments: a call passes
        eight arguments fewer through TVM-FFI, which converts each on the host."""
        self._launch(
            q, k, v, out, None, None, None, None, None, None, None, None, None, None, None, None,
            kv_length, None, None, None, scale_log2, max_ctas, Int32(1), None, stream,
        )  # fmt: skip

    @cute.jit
    def _launch(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        mLearnableSink: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mKvBatchIdx: Optional[cute.Tensor],
        mLeftPadK: Optional[cute.Tensor],
        mQV: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        kv_length: Int32,
        mOPartial: Optional[cute.Tensor],
        mLSEPartial: Optional[cute.Tensor],
        mCounters: Optional[cute.Tensor],
        softmax_scale_log2: Float32,
        max_ctas: Int32,
        num_splits: Int32,
        mTrace: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        # Rows first, then head_dim, then heads, then batch (and split): a TMA box is
        # (rows, head_dim) at coordinate (head, batch).
        q_modes = (0, 2, 1) if const_expr(self.variant.varlen_q) else (1, 3, 2, 0)
        mQ = hopper_mma.permute_modes(mQ, q_modes)
        if const_expr(self.variant.qv):
            mQV = hopper_mma.permute_modes(mQV, q_modes)
        lse_modes = (1, 0) if const_expr(self.variant.varlen_q) else (2, 1, 0)
        mO = hopper_mma.permute_modes(mO, q_modes)
        if const_expr(mLSE is not None):
            mLSE = hopper_mma.permute_modes(mLSE, lse_modes)
        if const_expr(self.variant.split):  # the leading split mode goes last
            mOPartial = hopper_mma.permute_modes(mOPartial, tuple(m + 1 for m in q_modes) + (0,))
            mLSEPartial = hopper_mma.permute_modes(
                mLSEPartial, tuple(m + 1 for m in lse_modes) + (0,)
            )
        kv_modes = (0, 2, 1) if const_expr(self.variant.kv_layout == "packed") else (1, 3, 2, 0)
        mK, mV = [hopper_mma.permute_modes(t, kv_modes) for t in (mK, mV)]

        d, dv = self.variant.head_dim, self.variant.head_dim_v
        tiled_mma_qk = hopper_mma.make_tiled_mma(
            self.mma_dtype,
            self.num_mma_warpgroups // self.o_split,
            self.config.tile_n,
            b_mn_major=False,
            a_from_registers=False,
            split_n=self.o_split if const_expr(self.split_scores) else 1,
        )
        tiled_mma_pv = hopper_mma.make_tiled_mma(
            self.mma_dtype,
            self.num_mma_warpgroups // self.o_split,
            dv,
            b_mn_major=True,
            a_from_registers=self.config.pv_from_registers,
            split_n=self.o_split,
        )
        sQ_layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.config.tile_m, d)
        sO_layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.config.tile_m, dv)
        # FP8 K/V: the GEMMs read fp16 rings that converting warps fill from FP8 rings (the
        # same stage count) that the loads fill.
        sK_layout, sV_layout = [
            hopper_mma.make_row_major_smem_layout(
                self.mma_dtype, self.config.tile_n, width, self.config.num_stages
            )
            for width in (d, dv)
        ]
        sK8_layout, sV8_layout = None, None
        ring_K_layout, ring_V_layout = sK_layout, sV_layout
        if const_expr(self.kv_fp8):
            sK8_layout, sV8_layout = [
                hopper_mma.make_row_major_smem_layout(
                    self.kv_dtype, self.config.tile_n, width, self.config.num_stages
                )
                for width in (d, dv)
            ]
            ring_K_layout, ring_V_layout = sK8_layout, sV8_layout
        if const_expr(self.variant.v_in_k):  # V: the first dv columns of each K stage
            sV_layout = hopper_mma.column_block_layout(
                self.dtype,
                self.config.tile_n,
                dv,
                self.config.num_stages,
                sK_layout.outer.stride[2],
            )
        sP_layout = None
        if const_expr(not self.config.pv_from_registers):
            sP_layout = hopper_mma.make_row_major_smem_layout(
                self.dtype, self.config.tile_m, self.config.tile_n
            )

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        ratio = self.variant.pack_gqa_ratio
        # qv variants: Q's tile is qv's dv columns, then q's d - dv (K's: v's, then k's).
        q_width = d - dv if const_expr(self.variant.qv) else d
        tma_atom_Q, tma_Q = self._q_tma_atom(tma_load, mQ, q_width)
        tma_atom_QV, tma_QV = None, None
        if const_expr(self.variant.qv):
            tma_atom_QV, tma_QV = self._q_tma_atom(tma_load, mQV, dv)
        if const_expr(self.kv_gather):  # cp.async reads the tensors themselves
            tma_atom_K, tma_K, tma_atom_V, tma_V = None, mK, None, mV
        elif const_expr(self.variant.qv):  # both fill K's stages
            (tma_atom_K, tma_K), (tma_atom_V, tma_V) = [
                self._kv_tma_atom(
                    tma_load,
                    mX,
                    hopper_mma.make_row_major_smem_layout(
                        self.dtype, self.config.tile_n, width, self.config.num_stages
                    ),
                    width,
                )
                for mX, width in ((mK, d - dv), (mV, dv))
            ]
        elif const_expr(self.variant.v_in_k):  # V is never loaded
            tma_atom_K, tma_K = self._kv_tma_atom(tma_load, mK, sK_layout, d)
            tma_atom_V, tma_V = None, mV
        else:
            (tma_atom_K, tma_K), (tma_atom_V, tma_V) = [
                self._kv_tma_atom(tma_load, mX, layout, width)
                for mX, layout, width in ((mK, ring_K_layout, d), (mV, ring_V_layout, dv))
            ]
        tma_atom_O, mO_kernel = None, mO
        if const_expr(self.tma_store_o):
            # O goes through its own smem tile or Q's (where dv == d: same shape and
            # swizzle), stored with one TMA per tile.
            tma_store = cpasync.CopyBulkTensorTileS2GOp()
            if const_expr(ratio > 1):
                tma_atom_O, mO_kernel = _make_packed_gqa_tma_atom(
                    tma_store, mO, sO_layout, self.config.tile_m, dv, ratio
                )
            else:
                tma_atom_O, mO_kernel = cpasync.make_tiled_tma_atom(
                    tma_store, mO, sO_layout, (self.config.tile_m, dv)
                )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_k, self.tma_bytes_v = [
            cute.size_in_bytes(self.kv_dtype, cute.select(layout, mode=[0, 1]))
            for layout in (ring_K_layout, ring_V_layout)
        ]
        sK8_size, sV8_size = [
            cute.cosize(layout) if const_expr(layout is not None) else 0
            for layout in (sK8_layout, sV8_layout)
        ]
        sV_size = 0 if const_expr(self.variant.v_in_k) else cute.cosize(sV_layout)

        num_stages = self.config.num_stages
        fp8_rings = 1 if const_expr(self.kv_fp8) else 0
        sP_size = cute.cosize(sP_layout) if const_expr(sP_layout is not None) else 0
        sO_size = cute.cosize(sO_layout) if const_expr(self.separate_o_smem) else 0
        score_rows_size = 4 * self.config.tile_m if const_expr(self.split_scores) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            # FP8 K/V: the FP8 rings' barriers (mbar_k / mbar_v guard the fp16 rings).
            mbar_k8: cute.struct.MemRange[cutlass.Int64, num_stages * 2 * fp8_rings]
            mbar_v8: cute.struct.MemRange[cutlass.Int64, num_stages * 2 * fp8_rings]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            next_tile: cute.struct.MemRange[Int32, 2]
            split_last: cute.struct.MemRange[Int32, 1]  # split kernels: this CTA merges the tile
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], self.smem_align
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.mma_dtype, cute.cosize(sK_layout)], self.smem_align
            ]
            sV: cute.struct.Align[cute.struct.MemRange[self.mma_dtype, sV_size], self.smem_align]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, sP_size], self.smem_align]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, sO_size], self.smem_align]
            sK8: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, sK8_size], self.smem_align
            ]
            sV8: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, sV8_size], self.smem_align
            ]
            # split_scores: (max or sum, warpgroup, row), ScoreHalves.
            score_rows: cute.struct.MemRange[Float32, score_rows_size]

        self.shared_storage = SharedStorage

        space = self._tile_space(mQ, mK, mCuSeqlensQ, mPageTable, num_splits, max_ctas)
        self.kernel(
            tma_Q,
            tma_K,
            tma_V,
            tma_QV,
            mO_kernel,
            mLSE,
            mOPartial,
            mLSEPartial,
            mQ,
            mK,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            mPageTable,
            mLearnableSink,
            mSeqUsedQ,
            mKvBatchIdx,
            mLeftPadK,
            mKDescale,
            mVDescale,
            mCounters,
            mTrace,
            num_splits,
            max_ctas,
            kv_length,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            tma_atom_QV,
            softmax_scale_log2,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            sP_layout,
            sK8_layout,
            sV8_layout,
            tiled_mma_qk,
            tiled_mma_pv,
        ).launch(
            grid=self.scheduler_cls.grid(space),
            block=[self.num_threads, 1, 1],
            stream=stream,
            # Gives ptxas the entry register cap setmaxnreg needs (and fits that many CTAs).
            min_blocks_per_mp=self.config.ctas_per_sm,
            # All of the SM's unified memory as shared memory (stated, so the DSL need not ask
            # the device when ctas_per_sm > 1: compiling stays GPU-free).
            preferred_smem_carveout=100 if const_expr(self.config.ctas_per_sm > 1) else None,
        )

    # ------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mQV: Optional[cute.Tensor],
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mOPartial: Optional[cute.Tensor],
        mLSEPartial: Optional[cute.Tensor],
        mQ_shape: cute.Tensor,
        mK_shape: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        mLearnableSink: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mKvBatchIdx: Optional[cute.Tensor],
        mLeftPadK: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        mCounters: Optional[cute.Tensor],
        mTrace: Optional[cute.Tensor],
        num_splits: Int32,
        max_ctas: Int32,
        kv_length: Int32,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: Optional[cute.CopyAtom],
        tma_atom_QV: Optional[cute.CopyAtom],
        softmax_scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sP_layout: Optional[cute.ComposedLayout],
        sK8_layout: Optional[cute.ComposedLayout],
        sV8_layout: Optional[cute.ComposedLayout],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        """mQ_shape / mK_shape: q and k in kernel mode order, for their run-time shapes."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, tma_atom_QV):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Consumers release a stage with one arrive per warp.
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        # A persistent kernel whose O overwrites Q's tile frees Q from the storing warp alone,
        # once the O store has read it.
        q_releasers = mma_warps
        if const_expr(self.o_overwrites_q):
            q_releasers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(),
            num_stages=1,
            producer_group=tma_warp,
            consumer_group=q_releasers,
            tx_count=self.tma_bytes_q,
            defer_sync=True,
        )
        pipeline_k8 = pipeline_v8 = None
        if const_expr(self.kv_fp8):
            # TMA -> FP8 rings -> converting warps -> fp16 rings -> MMA warps.
            pipeline_k8, pipeline_v8 = [
                self._kv_ring(bar, tx_count, tma_warp, self.convert_threads)
                for bar, tx_count in (
                    (storage.mbar_k8, self.tma_bytes_k),
                    (storage.mbar_v8, self.tma_bytes_v),
                )
            ]
            pipeline_k, pipeline_v = [
                pipeline.PipelineAsync.create(
                    barrier_storage=bar.data_ptr(),
                    num_stages=self.config.num_stages,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.convert_threads
                    ),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.num_mma_threads
                    ),
                    defer_sync=True,
                )
                for bar in (storage.mbar_k, storage.mbar_v)
            ]
        else:
            pipeline_k, pipeline_v = [
                self._kv_ring(bar, tx_count, tma_warp, self.num_mma_threads)
                for bar, tx_count in (
                    (storage.mbar_k, self.tma_bytes_k),
                    (storage.mbar_v, self.tma_bytes_v),
                )
            ]
        space = self._tile_space(mQ_shape, mK_shape, mCuSeqlensQ, mPageTable, num_splits, max_ctas)
        scheduler = self.scheduler_cls.create(
            space,
            self.config.scheduler == "dynamic_persistent",
            mCounters,
            storage.mbar_sched.data_ptr(),
            storage.next_tile.get_tensor(cute.make_layout(2)),
            self.num_mma_threads,
        )
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQ_mma = sQ
        if const_expr(self.converts_q):  # the same smem as fp16, with the same swizzle
            sQ_mma = cute.make_tensor(
                cute.recast_ptr(storage.sQ.data_ptr(), sQ_layout.inner, dtype=self.mma_dtype),
                sQ_layout.outer,
            )
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV_storage = storage.sK if const_expr(self.variant.v_in_k) else storage.sV
        sV = sV_storage.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = None
        if const_expr(sP_layout is not None):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sRows = None
        if const_expr(self.split_scores):
            sRows = storage.score_rows.get_tensor(cute.make_layout((2, 2, self.config.tile_m)))
        sK8, sV8 = None, None
        if const_expr(self.kv_fp8):
            sK8 = storage.sK8.get_tensor(sK8_layout.outer, swizzle=sK8_layout.inner)
            sV8 = storage.sV8.get_tensor(sV8_layout.outer, swizzle=sV8_layout.inner)
        sO = sQ  # (a TMA-stored O without a tile of its own has dv == d: the plan's rule)
        if const_expr(self.separate_o_smem):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        shapes = ProblemShapes(
            mQ=mQ_shape,
            mK=mK_shape,
            mCuSeqlensQ=mCuSeqlensQ,
            mCuSeqlensK=mCuSeqlensK,
            mSeqUsedK=mSeqUsedK,
            mPageTable=mPageTable,
            mLearnableSink=mLearnableSink,
            num_splits=num_splits,
            kv_length=kv_length if const_expr(self.variant.scalar_kv_length) else None,
            mSeqUsedQ=mSeqUsedQ,
            mKvBatchIdx=mKvBatchIdx,
            mLeftPadK=mLeftPadK,
            mKDescale=mKDescale,
            mVDescale=mVDescale,
        )
        buffers = CtaBuffers(
            sQ=sQ, sQ_mma=sQ_mma, sK=sK, sV=sV, sP=sP, sRows=sRows, sO=sO,
            pipeline_q=pipeline_q, pipeline_k=pipeline_k, pipeline_v=pipeline_v,
            sK8=sK8, sV8=sV8, pipeline_k8=pipeline_k8, pipeline_v8=pipeline_v8,
        )  # fmt: skip
        sources = LoadSources(
            mQ=mQ, mK=mK, mV=mV, mQV=mQV, mPageTable=mPageTable, tma_atom_Q=tma_atom_Q,
            tma_atom_K=tma_atom_K, tma_atom_V=tma_atom_V, tma_atom_QV=tma_atom_QV,
        )  # fmt: skip

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.config.producer_registers)
            if warp_idx < self.load_warps:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.config.num_stages
                )
                tile_idx, handoff = scheduler.first_tile(), scheduler.producer_handoff()
                while scheduler.is_valid(tile_idx):
                    tile = scheduler.work_tile(tile_idx)
                    trace = self._tile_trace(
                        mTrace, scheduler, tile_idx, (warp_idx == 0) & (cute.arch.lane_idx() == 0)
                    )
                    if const_expr(trace is not None):
                        trace.stamp(trace_records.LOAD_START)
                    kv_state = self.load(sources, buffers, tile, shapes, q_state, kv_state)
                    if const_expr(trace is not None):
                        trace.stamp(trace_records.LOAD_END)
                    q_state.advance()
                    tile_idx, handoff = scheduler.fetch_next(tile_idx, handoff)
                scheduler.finish()
            elif const_expr(self.kv_fp8):  # the others: FP8 blocks -> fp16 (one tile per CTA)
                tile_idx = scheduler.first_tile()
                if scheduler.is_valid(tile_idx):
                    self._convert_tile(buffers, scheduler.work_tile(tile_idx), shapes)
        else:
            cute.arch.setmaxregister_increase(self.config.mma_registers)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
            warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
            # Ping-pong start: the first warpgroup may issue first. The turn passes on across
            # tiles (every warpgroup takes the same number of turns per tile).
            if const_expr(self.config.pingpong):
                if warpgroup_idx == 0:
                    cute.arch.barrier_arrive(
                        barrier_id=int(NamedBarrier.WG_SCHEDULE_1),
                        number_of_threads=2 * THREADS_PER_WARPGROUP,
                    )
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.config.num_stages
            )
            # A split CTA's epilogue writes its partials; the merge writes O and the LSE.
            tile_out, tile_lse = (
                (mOPartial, mLSEPartial) if const_expr(self.variant.split) else (mO, mLSE)
            )
            setup = MmaSetup(
                tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tma_atom_O=tma_atom_O,
                softmax_scale_log2=softmax_scale_log2,
            )  # fmt: skip
            mma_args = (tile_out, tile_lse, buffers, setup, tidx, warpgroup_idx)
            tile_idx, handoff = scheduler.first_tile(), scheduler.consumer_handoff()
            while scheduler.is_valid(tile_idx):
                tile = scheduler.work_tile(tile_idx)
                trace = self._tile_trace(mTrace, scheduler, tile_idx, tidx == 0)
                if const_expr(trace is not None):
                    coords = (tile.m_block, tile.head_idx, tile.batch_idx, tile.split_idx)
                    trace.begin(trace_records.FORWARD_TILE, linear_block_idx(), coords)
                kv_state = self.mma(*mma_args, tile, shapes, q_state, kv_state, trace)
                q_state.advance()
                if const_expr(self.variant.split and not self.variant.combine_launch):
                    split_last = storage.split_last.get_tensor(cute.make_layout(1))
                    self._merge_splits(
                        mO, mLSE, mOPartial, mLSEPartial, mCounters, split_last, tile, shapes, tidx
                    )
                if const_expr(trace is not None):
                    trace.stamp(trace_records.END)
                tile_idx, handoff = scheduler.receive_next(tile_idx, handoff)
            if const_expr(self.separate_o_smem):
                if warp_idx == 4:  # the last O store must finish reading smem
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _tile_trace(self, mTrace, scheduler, tile_idx: Int32, writer) -> Optional[TileTrace]:
        """Traced variants: the record of the tile at tile_idx (its slot: the flat tile index
        of a persistent scheduler, the linear block index of one CTA per tile)."""
        if const_expr(mTrace is None):
            return None
        slot = tile_idx if const_expr(self.persistent) else linear_block_idx()
        return TileTrace(mTrace, slot, writer)

    def _kv_capacity(self, mK_shape: cute.Tensor, mPageTable: Optional[cute.Tensor]):
        """Keys a (batch, head) can hold: k's rows, or a paged cache's pages x page size (packed
        k: the total, split by cu_seqlens_k per tile)."""
        if const_expr(self.variant.kv_layout == "paged"):
            return mK_shape.shape[0] * mPageTable.shape[1]
        return mK_shape.shape[0]

    @cute.jit
    def _tile_problem(self, tile: WorkTile, shapes: ProblemShapes):
        """(seqlen info, key block range, n_block_min, n_block_max) of a tile."""
        seqlen = SeqlenInfo.create(
            tile.batch_idx,
            shapes.mQ.shape[0],
            self._kv_capacity(shapes.mK, shapes.mPageTable),
            shapes.mCuSeqlensQ,
            shapes.mCuSeqlensK,
            shapes.mSeqUsedK,
            shapes.kv_length,
            shapes.mSeqUsedQ,
            shapes.mLeftPadK,
        )
        block_range = KeyBlockRange(
            self.config.tile_m,
            self.config.tile_n,
            self.variant.causal,
            self.variant.pack_gqa_ratio,
            seqlen.seqlen_q,
            seqlen.seqlen_k,
            self.window,
        )
        n_block_min, n_block_max = block_range.bounds(
            tile.m_block,
            tile.split_idx if const_expr(self.variant.split) else None,
            shapes.num_splits if const_expr(self.variant.split) else None,
        )
        return seqlen, block_range, n_block_min, n_block_max

    def _rows_of(
        self, mX: cute.Tensor, head: Int32, batch: Int32, offset: Int32, padded_offset=False
    ) -> cute.Tensor:
        """The (rows, head_dim) slice of a q/k/v-like tensor in kernel mode order for one
        head and batch; packed (varlen) tensors are offset to the batch's first row, padded
        ones only with padded_offset (a left-padded cache row)."""
        if const_expr(cute.rank(mX) == 3):
            x = mX[None, None, head]
            row_offset = (0, offset) if const_expr(cute.rank(x.shape[0]) == 2) else offset
            return cute.domain_offset((row_offset, 0), x)
        if const_expr(padded_offset):
            return cute.domain_offset((offset, 0), mX[None, None, head, batch])
        return mX[None, None, head, batch]

    @cute.jit
    def load(
        self,
        sources: LoadSources,
        buf: CtaBuffers,
        tile: WorkTile,
        shapes: ProblemShapes,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
    ):
        """Producer warp, one tile: Q once, then K and V blocks from the last to the first;
        returns the K/V ring state after them.

        With intra-warpgroup overlap the consumer needs K(n) one step before V(n), so V runs
        one block behind K: K(n_max-1), Q, [K(n-1), V(n)]..., V(n_min).
        An empty tile (no rows, no keys, or an empty split) loads no K/V, and Q only in a
        persistent kernel (whose consumers wait for Q on every tile).
        """
        seqlen, _, n_block_min, n_block_max = self._tile_problem(tile, shapes)
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        q_head = tile.head_idx  # (packed GQA: the group of q heads in the packed view)
        # (atom, gmem, smem) of Q's tile: q, or with qv its columns 0..dv and then q's.
        q_parts = [(sources.tma_atom_Q, sources.mQ, buf.sQ, d)]
        if const_expr(self.variant.qv):
            q_parts = [
                (sources.tma_atom_QV, sources.mQV, self._columns(buf.sQ, 0, dv), dv),
                (sources.tma_atom_Q, sources.mQ, self._columns(buf.sQ, dv, d - dv), d - dv),
            ]
        q_copies = []
        for atom, mX, sX, width in q_parts:
            gX = cute.local_tile(
                self._rows_of(mX, q_head, tile.batch_idx, seqlen.offset_q),
                (self.config.tile_m, width),
                (tile.m_block, 0),
            )
            dst, src = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
            )
            q_copies.append((atom, src, dst))
        # The cache row of this batch (cache_batch_idx picks it; the lengths stay per batch).
        kv_batch = tile.batch_idx
        if const_expr(shapes.mKvBatchIdx is not None):  # clamped: a bad index reads a real row
            rows = (
                sources.mPageTable.shape[0]
                if const_expr(self.variant.kv_layout == "paged")
                else shapes.mK.shape[3]
            )
            kv_batch = cutlass.max(cutlass.min(shapes.mKvBatchIdx[tile.batch_idx], rows - 1), 0)
        # (mX, sX, ring, atom, width) -> this tile's loader of those key blocks
        block_loader = functools.partial(
            self._block_loader, tile=tile, kv_batch=kv_batch, seqlen=seqlen,
            mPageTable=sources.mPageTable,
        )  # fmt: skip
        if const_expr(self.variant.qv):  # K's stage: v's columns 0..dv, then k's
            k_loader = PairedBlockLoader(
                block_loader(sources.mV, buf.sV, buf.pipeline_k, sources.tma_atom_V, dv),
                block_loader(
                    sources.mK, self._columns(buf.sK, dv, d - dv), buf.pipeline_k,
                    sources.tma_atom_K, d - dv,
                ),
            )  # fmt: skip
        else:
            sK_ring, k_ring = buf.sK, buf.pipeline_k
            if const_expr(self.kv_fp8):  # (the converting warps fill buf.sK from these)
                sK_ring, k_ring = buf.sK8, buf.pipeline_k8
            k_loader = block_loader(sources.mK, sK_ring, k_ring, sources.tma_atom_K, d)
        v_loader = None  # (v_in_k: V is in K's stages)
        if const_expr(not self.variant.v_in_k):
            sV_ring, v_ring = buf.sV, buf.pipeline_v
            if const_expr(self.kv_fp8):
                sV_ring, v_ring = buf.sV8, buf.pipeline_v8
            v_loader = block_loader(sources.mV, sV_ring, v_ring, sources.tma_atom_V, dv)
        q_load = SimpleNamespace(copies=q_copies, ring=buf.pipeline_q, state=q_state)

        # (Every loading warp runs this; Q is warp 0's.)
        loads_q = True
        if const_expr(self.load_warps > 1):
            loads_q = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        if n_block_max > n_block_min:
            k_loader.load(n_block_max - 1, kv_state)
            if loads_q:
                self._load_q(q_load)
            if const_expr(self.variant.v_in_k):  # V is in K's stages: K blocks only
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    kv_state.advance()
                    k_loader.load(n_block_max - 2 - i, kv_state)
                kv_state.advance()
            else:
                kv_state = self._load_kv_blocks(
                    k_loader, v_loader, kv_state, n_block_min, n_block_max
                )
        else:
            if const_expr(self.persistent):
                self._load_q(q_load)
        return kv_state

    @cute.jit
    def _convert_tile(self, buf: CtaBuffers, tile: WorkTile, shapes: ProblemShapes):
        """Converting warps, one tile: each FP8 K and V block the TMA warp loads, in its order,
        into the fp16 rings (kernels/kv_dequant.py)."""
        seqlen, _, n_block_min, n_block_max = self._tile_problem(tile, shapes)
        if n_block_max > n_block_min:
            thread = cute.arch.thread_idx()[0] - 32 * self.load_warps
            state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.config.num_stages
            )
            k_loader, v_loader = [
                ConvertingBlockLoader(
                    src,
                    dst,
                    ring8,
                    ring16,
                    thread,
                    self.convert_threads,
                    self.config.tile_n,
                    seqlen_k,
                )  # fmt: skip
                for src, dst, ring8, ring16, seqlen_k in (
                    (buf.sK8, buf.sK, buf.pipeline_k8, buf.pipeline_k, None),
                    (buf.sV8, buf.sV, buf.pipeline_v8, buf.pipeline_v, seqlen.seqlen_k),
                )
            ]
            k_loader.load(n_block_max - 1, state)
            self._load_kv_blocks(k_loader, v_loader, state, n_block_min, n_block_max)

    def _block_loader(self, mX, sX, ring, atom, width, tile, kv_batch, seqlen, mPageTable):
        """The loader of K or V key blocks (width: d or dv) for one tile: rows gathered with
        cp.async from pages, TMA boxes following pages, or TMA boxes of whole key blocks."""
        if const_expr(self.kv_gather):
            return GatherPagedBlockLoader.create(
                mX[None, None, tile.head_kv_idx, None],
                sX,
                ring,
                mPageTable[kv_batch, None],
                seqlen.offset_k,
                seqlen.seqlen_k,
                cute.arch.thread_idx()[0],
                self.variant.gather_page_size,
                self.config.tile_n,
                32 * self.load_warps,
                self.config.gather_lookahead,
            )
        if const_expr(self.variant.kv_layout == "paged"):
            return TmaPagedBlockLoader.create(
                atom,
                mX[None, None, tile.head_kv_idx, None],
                sX,
                ring,
                mPageTable[kv_batch, None],
                self.config.tile_n,
                self.variant.page_box_rows,
            )
        rows = self._rows_of(
            mX, tile.head_kv_idx, kv_batch, seqlen.offset_k, self.variant.leftpad_k
        )
        return TmaBlockLoader.create(
            atom, cute.local_tile(rows, (self.config.tile_n, width), (None, 0)), sX, ring
        )

    def _load_q(self, q_load: SimpleNamespace):
        q_load.ring.producer_acquire(q_load.state)
        for atom, src, dst in q_load.copies:  # (one barrier: its tx_count is Q's whole tile)
            cute.copy(atom, src, dst, tma_bar_ptr=q_load.ring.producer_get_barrier(q_load.state))

    def _columns(self, t: cute.Tensor, first: int, cols: int) -> cute.Tensor:
        """Columns first .. first + cols of a (rows, wider[, stages]) smem tile laid out by
        make_row_major_smem_layout (first and cols multiples of 64: whole swizzle columns,
        which start rows * 64 elements apart)."""
        rows = cute.size(t, mode=[0])
        if const_expr(cute.rank(t) == 2):
            layout = hopper_mma.make_row_major_smem_layout(self.dtype, rows, cols)
        else:
            stages = cute.size(t, mode=[2])
            layout = hopper_mma.column_block_layout(
                self.dtype, rows, cols, stages, t.layout.stride[2]
            )
        return cute.make_tensor(t.iterator + first * rows, layout.outer)

    def _q_tma_atom(self, op, mX, width: int):
        """TMA atom of Q's tile (or of its columns from one tensor, width wide)."""
        layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.config.tile_m, width)
        if const_expr(self.variant.pack_gqa_ratio > 1):
            return _make_packed_gqa_tma_atom(
                op, mX, layout, self.config.tile_m, width, self.variant.pack_gqa_ratio
            )
        return cpasync.make_tiled_tma_atom(op, mX, layout, (self.config.tile_m, width))

    @cute.jit
    def _load_kv_blocks(
        self,
        k_loader,
        v_loader,
        kv_state: pipeline.PipelineState,
        n_block_min: Int32,
        n_block_max: Int32,
    ):
        """Everything after the first K block (already issued at kv_state)."""
        if const_expr(self.config.intra_wg_overlap):
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block_v = n_block_max - 1 - i
                v_state = kv_state.clone()
                kv_state.advance()
                k_loader.load(n_block_v - 1, kv_state)
                v_loader.load(n_block_v, v_state)
            v_loader.load(n_block_min, kv_state)
            kv_state.advance()
        else:
            v_loader.load(n_block_max - 1, kv_state)
            kv_state.advance()
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block = n_block_max - 2 - i
                k_loader.load(n_block, kv_state)
                v_loader.load(n_block, kv_state)
                kv_state.advance()
        return kv_state

    @cute.jit
    def mma(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        buf: CtaBuffers,
        setup: MmaSetup,
        tidx: Int32,
        warpgroup_idx: Int32,
        tile: WorkTile,
        shapes: ProblemShapes,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        trace: Optional[TileTrace] = None,
    ):
        """Consumer warpgroups, one tile: the attention mainloop over key blocks, then the
        epilogue; returns the K/V ring state after the tile. trace (traced variants): the
        tile's record, stamped when the first K block has landed and when the mainloop ends."""
        softmax_scale_log2 = setup.softmax_scale_log2
        seqlen, block_range, n_block_min, n_block_max = self._tile_problem(tile, shapes)
        mask = AttentionMask(
            self.config.tile_m,
            self.config.tile_n,
            self.variant.pack_gqa_ratio,
            seqlen.seqlen_q,
            seqlen.seqlen_k,
            self.window,
        )
        m_block = tile.m_block
        # WGMMA operands are per warpgroup: slice at the warpgroup's first thread. Warpgroups
        # splitting O share the scores' rows: the Q K^T slices of the first one.
        own_scores = self.o_split == 1 or self.split_scores
        qk_tidx = tidx if const_expr(own_scores) else tidx % THREADS_PER_WARPGROUP
        qk_warpgroup = warpgroup_idx if const_expr(own_scores) else 0
        wg_mma_qk = setup.tiled_mma_qk.get_slice(qk_warpgroup * THREADS_PER_WARPGROUP)
        wg_mma_pv = setup.tiled_mma_pv.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        acc_O = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.config.tile_m, self.variant.head_dim_v)), Float32
        )
        smem_copy_P, tPsP = None, None
        if const_expr(self.config.pv_from_registers):
            tOrP = wg_mma_pv.make_fragment_A(
                wg_mma_pv.partition_shape_A((self.config.tile_m, self.config.tile_n))
            )
        else:
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(buf.sP))
            smem_copy_P = cute.make_tiled_copy_C(
                self._stmatrix_atom(), setup.tiled_mma_qk
            ).get_slice(tidx)
            tPsP = smem_copy_P.partition_D(buf.sP)
        # FP8 K/V: K's descale multiplies every score (folded into the softmax scale), V's
        # every output row (folded into the final 1 / row sum).
        v_descale = None
        if const_expr(shapes.mKDescale is not None):
            softmax_scale_log2 = (
                softmax_scale_log2 * shapes.mKDescale[tile.batch_idx, tile.head_kv_idx]
            )
        if const_expr(shapes.mVDescale is not None):
            v_descale = shapes.mVDescale[tile.batch_idx, tile.head_kv_idx]
        # Softcap: the scores become tanh(s * scale / softcap), and the softmax's scale is
        # softcap * log2(e).
        softcap_prescale = None
        if const_expr(self.variant.softcap > 0):
            softcap_log2 = self.variant.softcap * LOG2_E
            softcap_prescale = softmax_scale_log2 * (1.0 / softcap_log2)
            softmax_scale_log2 = Float32(softcap_log2)
        softmax = OnlineSoftmax.create(
            softmax_scale_log2,
            cute.size(hopper_mma.acc_as_rows_cols(acc_O), mode=[0]),
            self.config.exp2_on_fma,
            self.config.rescale_threshold,
        )
        ctx = MainloopOperands(
            tiled_mma_qk=setup.tiled_mma_qk,
            tiled_mma_pv=setup.tiled_mma_pv,
            thr_mma_qk=setup.tiled_mma_qk.get_slice(qk_tidx),
            tSrQ=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(buf.sQ_mma)),
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(buf.sK)),
            tOrVt=wg_mma_pv.make_fragment_B(
                wg_mma_pv.partition_B(hopper_mma.transpose_smem_view(buf.sV))
            ),
            tOrP=tOrP,
            smem_copy_P=smem_copy_P,
            tPsP=tPsP,
            acc_S_shape=wg_mma_qk.partition_shape_C((self.config.tile_m, self.config.tile_n)),
            acc_O=acc_O,
            softmax=softmax,
            softcap_prescale=softcap_prescale,
            # With rescale_o_before_pv, the O rescale owed by the last softmax step.
            pending_scale=cute.make_rmem_tensor(softmax.num_rows, Float32)
            if const_expr(self.config.rescale_o_before_pv)
            else None,
            mask=mask,
            m_block=m_block,
            pipeline_k=buf.pipeline_k,
            pipeline_v=buf.pipeline_v,
            warpgroup_idx=warpgroup_idx,
            sV=buf.sV,
            last_block=n_block_max - 1,
            last_block_keys=seqlen.seqlen_k - (n_block_max - 1) * self.config.tile_n,
            halves=self._score_halves(buf.sRows, setup.tiled_mma_qk, tidx, warpgroup_idx)
            if const_expr(self.split_scores)
            else None,
        )

        acc_O.fill(0.0)
        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        lse.fill(-Float32.inf)  # an empty tile or split: out = 0, lse = -inf
        sink_log2 = None
        if const_expr(shapes.mLearnableSink is not None):
            sink_log2 = self._row_sinks_log2(shapes.mLearnableSink, setup.tiled_mma_pv, tidx, tile)
            for r in cutlass.range_constexpr(softmax.num_rows):
                lse[r] = sink_log2[r] * LN2  # a row that sees no key: lse = its sink
        # Who frees Q when: after the mainloop, except in a persistent kernel whose O
        # overwrites Q's smem (then the epilogue's storing warp does, after the store).
        release_q_after_mainloop = const_expr(not self.o_overwrites_q)
        if const_expr(self.persistent):
            buf.pipeline_q.consumer_wait(q_state)  # loaded for every tile, empty or not
            self._convert_q(buf, tidx)
        if n_block_max > n_block_min:
            if const_expr(not self.persistent):
                buf.pipeline_q.consumer_wait(q_state)
                self._convert_q(buf, tidx)
            if const_expr(trace is not None):
                # (a second wait on the same phase returns at once)
                self._wait_full(buf.pipeline_k, kv_state)
                trace.stamp(trace_records.KV_READY)

            # The last key block goes first: it alone carries the sequence-length mask.
            if const_expr(self.config.intra_wg_overlap):
                self._wait_full(buf.pipeline_k, kv_state)
                acc_S = self._qk_gemm(ctx, kv_state.index, 0)
                self._release_k(ctx, kv_state)
                self._mask_scores(ctx, acc_S, n_block_max - 1, mask_seqlen=True, masked=True)
                softmax.step(acc_S, is_first=True, halves=ctx.halves)
                self._scores_to_p(ctx, acc_S)
                if const_expr(self.config.rescale_o_before_pv):
                    ctx.pending_scale.fill(1.0)
            else:
                self._schedule_wait(warpgroup_idx)
                kv_state = self._block_no_overlap(
                    ctx, kv_state, n_block_max - 1, True, is_first=True
                )
            kv_state = self._mainloop_rest(ctx, block_range, kv_state, n_block_min, n_block_max - 1)
            if const_expr(release_q_after_mainloop):
                buf.pipeline_q.consumer_release(q_state)

            if const_expr(self.config.intra_wg_overlap):
                # The P V of the first key block is still to do.
                if const_expr(self.config.rescale_o_before_pv):
                    self._rescale_o(acc_O, ctx.pending_scale)
                self._wait_v(ctx, kv_state)
                if const_expr(self.clears_v_tail):
                    self._clear_v_tail(ctx, kv_state.index, n_block_min)
                self._pv_gemm(ctx, kv_state.index, 0)
                self._release_v(ctx, kv_state)
                kv_state.advance()
            else:
                self._schedule_signal_next(warpgroup_idx)

            # A split's partial O is normalized by its own row sum; the merge (_merge_splits)
            # weighs it by exp(lse_split - lse).
            if const_expr(self.split_scores):
                softmax.combine_halves(ctx.halves)
            inv_row_sum, row_lse = softmax.finalize(sink_log2)
            if const_expr(v_descale is not None):
                for r in cutlass.range_constexpr(cute.size(inv_row_sum)):
                    inv_row_sum[r] = inv_row_sum[r] * v_descale
            rescale_rows(acc_O, inv_row_sum)
            lse.store(row_lse.load())
        else:
            if const_expr(self.persistent and not self.o_overwrites_q):
                buf.pipeline_q.consumer_release(q_state)

        if const_expr(trace is not None):
            trace.stamp(trace_records.MAINLOOP_END)
        q_release = None
        if const_expr(not release_q_after_mainloop):
            q_release = SimpleNamespace(ring=buf.pipeline_q, state=q_state)
        self.epilogue(
            acc_O,
            lse,
            mO,
            mLSE,
            buf.sO,
            setup.tma_atom_O,
            setup.tiled_mma_pv,
            tidx,
            tile,
            seqlen,
            q_release,
        )
        return kv_state

    @cute.jit
    def _mainloop_rest(self, ctx, block_range, kv_state, n_block_min: Int32, n_block_next: Int32):
        """Key blocks n_block_next - 1 down to n_block_min: those crossing the diagonal (causal)
        or the window's right edge (local) first, masked, then the unmasked ones, then those
        crossing the window's left edge, masked."""
        m_block = ctx.m_block
        block_step = (
            self._block_overlap
            if const_expr(self.config.intra_wg_overlap)
            else self._block_no_overlap
        )
        if const_expr(self.variant.causal):
            n_block_masked_min = cutlass.max(
                block_range.first_causal_masked_block(m_block), n_block_min
            )
            for i in cutlass.range(n_block_next - n_block_masked_min, unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, True)
            n_block_next = cutlass.min(n_block_next, n_block_masked_min)
        n_block_unmasked_min = n_block_min
        if const_expr(self.variant.local):
            right_from = cutlass.max(block_range.first_right_masked_block(m_block), n_block_min)
            for i in cutlass.range(cutlass.max(n_block_next - right_from, 0), unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, True)
            n_block_next = cutlass.min(n_block_next, right_from)
            n_block_unmasked_min = cutlass.min(
                cutlass.max(block_range.left_masked_blocks_end(m_block), n_block_min),
                n_block_next,
            )
        for i in cutlass.range(n_block_next - n_block_unmasked_min, unroll=1):
            kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, False)
        if const_expr(self.variant.local):
            for i in cutlass.range(n_block_unmasked_min - n_block_min, unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_unmasked_min - 1 - i, True)
        return kv_state

    def _mask_scores(self, ctx, acc_S, n_block, mask_seqlen: bool, masked: bool):
        """Scores of key block n_block, softcapped where the variant says so, then masked: keys
        past seqlen_k where mask_seqlen, and where masked (a block crossing the diagonal or an
        edge of the window) the variant's causal or local mask."""
        if const_expr(self.variant.softcap > 0):
            apply_softcap(acc_S, ctx.softcap_prescale)
        ctx.mask.apply(
            acc_S,
            ctx.thr_mma_qk,
            ctx.m_block,
            n_block,
            mask_seqlen=mask_seqlen,
            mask_causal=masked and self.variant.causal,
            mask_local=masked and self.variant.local,
        )

    @cute.jit
    def _row_sinks_log2(self, mLearnableSink: cute.Tensor, tiled_mma_pv, tidx: Int32, tile):
        """Per row of the thread's accumulator, its head's sink logit times log2(e); -inf in
        splits other than the first, so that a split launch counts each sink once."""
        coords = hopper_mma.acc_as_rows_cols(
            tiled_mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.variant.head_dim_v))
            )
        )
        num_rows = cute.size(coords, mode=[0])
        sinks = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            _, head = self._row_of_tile(coords[r, 0][0], tile)
            sinks[r] = mLearnableSink[head].to(Float32) * LOG2_E
            if const_expr(self.variant.split):
                if tile.split_idx != 0:
                    sinks[r] = -Float32.inf
        return sinks

    def _qk_gemm(self, ctx, stage, wait_groups):
        acc_S = cute.make_rmem_tensor(ctx.acc_S_shape, Float32)
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_qk,
            acc_S,
            ctx.tSrQ,
            ctx.tSrK[None, None, None, stage],
            zero_init=True,
            wait_groups=wait_groups,
        )
        return acc_S

    def _pv_gemm(self, ctx, stage, wait_groups):
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_pv,
            ctx.acc_O,
            ctx.tOrP,
            ctx.tOrVt[None, None, None, stage],
            zero_init=False,
            wait_groups=wait_groups,
        )

    def _rescale_o(self, acc_O, row_scale):
        """O *= the softmax's row scales (with lazy_rescale, only if some row's max moved)."""
        if const_expr(self.config.lazy_rescale):
            rescale_rows_if_any_changed(acc_O, row_scale)
        else:
            rescale_rows(acc_O, row_scale)

    def _scores_to_p(self, ctx, acc_S):
        """Round probabilities to the input dtype where the P V GEMM reads them."""
        p_as_a = hopper_mma.acc_as_operand_a(acc_S)
        if const_expr(self.config.pv_from_registers):
            hopper_mma.convert_to_16bit(p_as_a, ctx.tOrP)
        else:
            rP = cute.make_rmem_tensor_like(p_as_a, self.mma_dtype)
            hopper_mma.convert_to_16bit(p_as_a, rP)
            if const_expr(self.split_scores and self.config.intra_wg_overlap):
                # Both warpgroups' P V reads all of sP: the other's last one (which it waited
                # for before arriving) must be done before this half is overwritten. Without
                # the overlap each waits for its P V before the next block's Q K^T, so the
                # row-max exchange's barrier has already ordered it.
                self._split_scores_barrier()
            cute.copy(ctx.smem_copy_P, ctx.smem_copy_P.retile(rP), ctx.tPsP)
            cute.arch.fence_view_async_shared()
            if const_expr(self.split_scores):
                self._split_scores_barrier()  # both halves written before either P V
            else:
                # Each warp reads back only the P rows it wrote, so a warp barrier suffices.
                cute.arch.sync_warp()

    def _block_overlap(self, ctx, kv_state, n_block, masked: bool):
        """Issue S = Q K(n), then O += P(n+1) V(n+1); the softmax of S(n) runs under P V."""
        v_state = kv_state.clone()
        kv_state.advance()
        self._wait_full(ctx.pipeline_k, kv_state)
        self._schedule_wait(ctx.warpgroup_idx)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        if const_expr(self.config.rescale_o_before_pv):
            self._rescale_o(ctx.acc_O, ctx.pending_scale)
        self._wait_v(ctx, v_state)
        if const_expr(self.clears_v_tail):
            self._clear_v_tail(ctx, v_state.index, n_block + 1)
        self._pv_gemm(ctx, v_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(1)
        self._release_k(ctx, kv_state)
        self._mask_scores(ctx, acc_S, n_block, mask_seqlen=False, masked=masked)
        row_scale = ctx.softmax.step(acc_S, is_first=False, halves=ctx.halves)
        warpgroup.wait_group(0)
        self._release_v(ctx, v_state)
        self._scores_to_p(ctx, acc_S)
        if const_expr(self.config.rescale_o_before_pv):
            ctx.pending_scale.store(row_scale.load())
        else:
            self._rescale_o(ctx.acc_O, row_scale)
        return kv_state

    def _block_no_overlap(self, ctx, kv_state, n_block, masked: bool, is_first: bool = False):
        """S = Q K(n); softmax; O += P V(n). A warpgroup's ping-pong turn spans this block's
        P V and the next block's Q K^T: the caller waits before the first block and signals
        after the last."""
        self._wait_full(ctx.pipeline_k, kv_state)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(0)
        self._release_k(ctx, kv_state)
        self._mask_scores(ctx, acc_S, n_block, mask_seqlen=is_first, masked=masked)
        row_scale = ctx.softmax.step(acc_S, is_first=is_first, halves=ctx.halves)
        self._scores_to_p(ctx, acc_S)
        self._rescale_o(ctx.acc_O, row_scale)
        self._wait_v(ctx, kv_state)
        if const_expr(is_first and self.clears_v_tail):
            self._clear_v_tail(ctx, kv_state.index, n_block)
        self._schedule_wait(ctx.warpgroup_idx)
        self._pv_gemm(ctx, kv_state.index, 0)
        self._release_v(ctx, kv_state)
        kv_state.advance()
        return kv_state

    def _convert_q(self, buf: CtaBuffers, tidx: Int32):
        """FP8 cache, bf16 q: Q's tile to fp16 in place (buf.sQ_mma), saturating, by the MMA
        warps (tidx: this one's thread), which then sync."""
        if const_expr(self.converts_q):
            convert_block(
                buf.sQ, buf.sQ_mma, tidx, self.num_mma_threads, self.config.tile_m, saturate=True
            )
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.Q_CONVERT), number_of_threads=self.num_mma_threads
            )

    def _split_scores_barrier(self):
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_SCORES), number_of_threads=self.num_mma_threads
        )

    def _score_halves(self, sRows, tiled_mma_qk, tidx, warpgroup_idx) -> ScoreHalves:
        """split_scores: the row exchange of this thread (its accumulator rows' tile rows)."""
        coords = hopper_mma.acc_as_rows_cols(
            tiled_mma_qk.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.config.tile_n))
            )
        )
        rows = cute.make_rmem_tensor(cute.size(coords, mode=[0]), Int32)
        for r in range(cute.size(rows)):  # (a plain Python loop: this is not a jit function)
            rows[r] = coords[r, 0][0]
        return ScoreHalves(
            smem=sRows,
            rows=rows,
            warpgroup=warpgroup_idx,
            writer=tidx % 4 == 0,
            barrier_id=int(NamedBarrier.SPLIT_SCORES),
            num_threads=self.num_mma_threads,
        )

    @cute.jit
    def _clear_v_tail(self, ctx, stage, v_block: Int32):
        """Before the P V of key block v_block (V in stage `stage`): if that block is the
        tile's last and partial, zero its V rows past the sequence's last key. P is 0 there,
        but the rows hold whatever follows the sequence in memory (a cache's unused slots,
        another sequence's keys), and 0 * NaN or 0 * inf would reach O; only padded K/V
        without seqused_k end where the tensor (and TMA's zero fill) does. Each MMA warpgroup
        zeroes the whole tail before its own P V (they write the same zeros), in 16-byte
        pieces, then makes the stores visible to its WGMMA. Runs while Q K^T is in flight."""
        valid = ctx.last_block_keys
        if v_block == ctx.last_block and valid < self.config.tile_n:
            pieces_per_row = self.variant.head_dim_v // 8
            pieces = cute.zipped_divide(
                ctx.sV[None, None, stage], (1, 8)
            )  # ((1, 8), (rows, d / 8))
            zeros = cute.make_rmem_tensor((1, 8), self.dtype)
            zeros.fill(0.0)
            wg_thread = cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP
            first = cutlass.max(valid, 0) * pieces_per_row
            for j in cutlass.range(
                first + wg_thread,
                self.config.tile_n * pieces_per_row,
                THREADS_PER_WARPGROUP,
                unroll=1,
            ):
                row = j // pieces_per_row
                cute.autovec_copy(zeros, pieces[None, (row, j - row * pieces_per_row)])
            cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMA's reads
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.V_TAIL_1) + ctx.warpgroup_idx,
                number_of_threads=THREADS_PER_WARPGROUP,
            )

    # With v_in_k, V is part of K's stage: the stage stays held from its Q K^T (whose wait
    # covers V) until its P V is done, and is released once, then.
    def _release_k(self, ctx, state):
        if const_expr(not self.variant.v_in_k):
            ctx.pipeline_k.consumer_release(state)

    def _wait_v(self, ctx, state):
        if const_expr(not self.variant.v_in_k):
            self._wait_full(ctx.pipeline_v, state)

    def _release_v(self, ctx, state):
        if const_expr(self.variant.v_in_k):
            ctx.pipeline_k.consumer_release(state)
        else:
            ctx.pipeline_v.consumer_release(state)

    def _wait_full(self, ring, state):
        """Wait for a K/V stage. With mbarrier_probe, poll the barrier once first and take
        the blocking wait (with its suspend hint) only if the stage is not yet full."""
        if const_expr(self.config.mbarrier_probe):
            ring.consumer_wait(state, ring.consumer_try_wait(state))
        else:
            ring.consumer_wait(state)
        if const_expr(self.gathers_16bit):  # cp.async's writes -> WGMMA's reads
            cute.arch.fence_view_async_shared()

    def _schedule_wait(self, warpgroup_idx):
        if const_expr(self.config.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + warpgroup_idx,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    def _schedule_signal_next(self, warpgroup_idx):
        if const_expr(self.config.pingpong):
            next_wg = warpgroup_idx + 1
            if const_expr(self.num_mma_warpgroups == 2):
                next_wg = 1 - warpgroup_idx
            else:
                next_wg = next_wg % self.num_mma_warpgroups
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + next_wg,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    @cute.jit
    def _merge_splits(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        mArrivals: cute.Tensor,
        split_last: cute.Tensor,
        tile: WorkTile,
        shapes: ProblemShapes,
        tidx: Int32,
    ):
        """MMA warps of a split CTA, after its partials are stored: count this split in; the
        last of the tile's splits to arrive merges all of them into O and the LSE and resets
        the tile's counter (every split has arrived, so none touches it again this launch)."""
        num_splits = shapes.num_splits
        # The CTA's partial stores happen before the arrival: the barrier orders them before
        # thread 0's release (fence + atomic); its acquire orders the other splits' partials
        # before the merge's loads, which the second barrier passes on to every thread.
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_MERGE), number_of_threads=self.num_mma_threads
        )
        if tidx == 0:
            bidx, bidy, bidz = cute.arch.block_idx()
            grid_x, grid_y, _ = cute.arch.grid_dim()
            slot = (bidz * (grid_y // num_splits) + bidy // num_splits) * grid_x + bidx
            cute.arch.fence_acq_rel_gpu()
            arrived = cute.arch.atomic_add(
                (mArrivals.iterator + slot).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu"
            )
            is_last = arrived == num_splits - 1
            if is_last:
                mArrivals[slot] = Int32(0)
            split_last[0] = Int32(1) if is_last else Int32(0)
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_MERGE), number_of_threads=self.num_mma_threads
        )
        seqlen = SeqlenInfo.create(
            tile.batch_idx,
            shapes.mQ.shape[0],
            Int32(0),
            shapes.mCuSeqlensQ,
            mSeqUsedQ=shapes.mSeqUsedQ,
        )
        # The tile's rows that hold a token (a prefix of the tile).
        valid_rows = cutlass.min(
            cutlass.max(
                seqlen.seqlen_q * self.variant.pack_gqa_ratio - tile.m_block * self.config.tile_m, 0
            ),
            self.config.tile_m,
        )
        # (Uniform over the CTA: the counter's verdict, and whether the tile has rows at all.)
        if split_last[0] != 0 and valid_rows > 0:
            group = lanes_per_row(self.variant.head_dim_v)
            rows_per_pass = self.num_mma_threads // group
            sub = tidx % group
            acc = cute.make_rmem_tensor(self.variant.head_dim_v // group, Float32)
            out = cute.make_rmem_tensor(self.variant.head_dim_v // group, mO.element_type)
            for i in cutlass.range(cute.ceil_div(valid_rows, rows_per_pass), unroll=1):
                token, head = self._row_of_tile(i * rows_per_pass + tidx // group, tile)
                valid = token < seqlen.seqlen_q
                if (
                    not valid
                ):  # merge the tile's first row (no stores): every lane reaches the shuffles
                    token, head = self._row_of_tile(Int32(0), tile)
                idx = self._out_index(token, head, tile, seqlen, with_split=False)
                o_splits = mOPartial[(idx[0], None, *idx[1:], None)]  # (d, S)
                lse = merge_row(
                    mLSEPartial[(*idx, None)],
                    cute.make_tensor(o_splits.iterator, cute.select(o_splits.layout, mode=[1, 0])),
                    sub,
                    group,
                    acc,
                )
                if valid:
                    hopper_mma.convert_to_16bit(acc, out)
                    dst = cute.local_tile(
                        mO[(idx[0], None, *idx[1:])], (self.variant.head_dim_v // group,), (sub,)
                    )
                    dst.store(out.load())
                    if const_expr(mLSE is not None):
                        if sub == 0:
                            mLSE[idx] = lse

    def _stmatrix_atom(self):
        return cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )

    @cute.jit
    def _row_of_tile(self, local_row: Int32, tile: WorkTile):
        """(token index within the batch's sequence, q head) of a tile row."""
        row = tile.m_block * self.config.tile_m + local_row
        if const_expr(self.variant.pack_gqa_ratio > 1):
            token = row // self.variant.pack_gqa_ratio
            return token, tile.head_idx * self.variant.pack_gqa_ratio + (
                row - token * self.variant.pack_gqa_ratio
            )
        return row, tile.head_idx

    def _out_index(
        self,
        token: Int32,
        head: Int32,
        tile: WorkTile,
        seqlen: SeqlenInfo,
        with_split: bool = True,
    ):
        """Coordinates of (row, head[, batch][, split]) in out/lse (kernel mode order; the split
        in split kernels' partials), without the head_dim mode."""
        if const_expr(self.variant.varlen_q):
            idx = (seqlen.offset_q + token, head)
        else:
            idx = (token, head, tile.batch_idx)
        if const_expr(self.variant.split and with_split):
            idx = idx + (tile.split_idx,)
        return idx

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        tile: WorkTile,
        seqlen: SeqlenInfo,
        q_release: Optional[SimpleNamespace] = None,
    ):
        """O and LSE out. Padded, unsplit (unless the config stores O from registers): O
        registers -> smem (its own tile, or over Q's) -> one TMA store (which clips rows past
        seqlen_q); each warpgroup writes only the 64 rows of sO whose sQ rows it alone read, so
        no barrier is needed before the smem writes. Otherwise: O straight from registers, one
        column pair per store, rows predicated.
        The LSE always goes from registers; the 4 threads of a quad share rows and the one
        holding column 0 writes."""
        thr_mma = tiled_mma_pv.get_slice(tidx)
        coords = hopper_mma.acc_as_rows_cols(
            thr_mma.partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.variant.head_dim_v))
            )
        )
        if const_expr(mLSE is not None):
            if coords[0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    token, head = self._row_of_tile(coords[r, 0][0], tile)
                    if token < seqlen.seqlen_q:
                        mLSE[self._out_index(token, head, tile, seqlen)] = lse[r]

        if const_expr(self.tma_store_o):
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            hopper_mma.convert_to_16bit(acc_O, rO)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if const_expr(self.separate_o_smem):
                # sO is reused tile after tile: the previous tile's store must have read it.
                if warp_idx == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.O_SMEM_FREE), number_of_threads=self.num_mma_threads
                )
            smem_copy_O = cute.make_tiled_copy_C(self._stmatrix_atom(), tiled_mma_pv).get_slice(
                tidx
            )
            cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
            cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads + 32
            )
            if warp_idx == 4:
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.EPILOGUE),
                    number_of_threads=self.num_mma_threads + 32,
                )
                gO = cute.local_tile(
                    mO[None, None, tile.head_idx, tile.batch_idx],
                    (self.config.tile_m, self.variant.head_dim_v),
                    (tile.m_block, 0),
                )
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.separate_o_smem):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                if const_expr(q_release is not None):  # sO was Q's tile: the next Q may load
                    q_release.ring.consumer_release(q_release.state)
        else:
            out = acc_O
            if const_expr(mO.element_type != Float32):
                out = cute.make_rmem_tensor_like(acc_O, mO.element_type)
                hopper_mma.convert_to_16bit(acc_O, out)
            out_rc = hopper_mma.acc_as_rows_cols(out)
            pair = cute.make_rmem_tensor(2, mO.element_type)
            for r in cutlass.range_constexpr(cute.size(out_rc, mode=[0])):
                token, head = self._row_of_tile(coords[r, 0][0], tile)
                if token < seqlen.seqlen_q:
                    idx = self._out_index(token, head, tile, seqlen)
                    o_row = mO[(idx[0], None, *idx[1:])]
                    for c in cutlass.range_constexpr(0, cute.size(out_rc, mode=[1]), 2):
                        pair[0] = out_rc[r, c]
                        pair[1] = out_rc[r, c + 1]
                        cute.autovec_copy(
                            pair, cute.local_tile(o_row, (2,), (coords[r, c][1] // 2,))
                        )
