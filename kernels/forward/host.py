"""The forward kernel's host side, traced once per compile: the operands' views in kernel mode
order, the two GEMMs' tiled MMAs, the shared-memory layouts and the CTA's shared storage, the
TMA atoms, and each stage's bytes (what the K and V rings' barriers expect).
"""

from typing import NamedTuple, Optional, Tuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import hopper_mma
from .facts import Piece
from .records import GmemLoads, SmemLayouts, TiledMmas, TmaAtoms


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


class KernelViews(NamedTuple):
    """The launch's tensors in kernel mode order: rows first, then head_dim, then heads, then
    batch (and a split launch's partials' split mode last), so a TMA box is (rows, head_dim)
    at coordinate (head, batch)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    qv: Optional[cute.Tensor]
    o: cute.Tensor
    lse: Optional[cute.Tensor]
    o_partial: Optional[cute.Tensor]
    lse_partial: Optional[cute.Tensor]


class HostSetup(Piece):
    """What the launch builds for the kernel, from the variant's facts."""

    def views(self, q, k, v, qv, out, lse, o_partial, lse_partial) -> KernelViews:
        """The launch's tensors (as it takes them) in kernel mode order."""
        q_modes = (0, 2, 1) if const_expr(self.variant.varlen_q) else (1, 3, 2, 0)
        mQ = hopper_mma.permute_modes(q, q_modes)
        mQV = qv
        if const_expr(self.variant.qv):
            mQV = hopper_mma.permute_modes(qv, q_modes)
        lse_modes = (1, 0) if const_expr(self.variant.varlen_q) else (2, 1, 0)
        mO = hopper_mma.permute_modes(out, q_modes)
        mLSE = lse
        if const_expr(lse is not None):
            mLSE = hopper_mma.permute_modes(lse, lse_modes)
        mOPartial, mLSEPartial = o_partial, lse_partial
        if const_expr(self.variant.split):  # the leading split mode goes last
            mOPartial = hopper_mma.permute_modes(o_partial, tuple(m + 1 for m in q_modes) + (0,))
            mLSEPartial = hopper_mma.permute_modes(
                lse_partial, tuple(m + 1 for m in lse_modes) + (0,)
            )
        kv_modes = (0, 2, 1) if const_expr(self.variant.kv_layout == "packed") else (1, 3, 2, 0)
        mK, mV = [hopper_mma.permute_modes(t, kv_modes) for t in (k, v)]
        return KernelViews(mQ, mK, mV, mQV, mO, mLSE, mOPartial, mLSEPartial)

    def tiled_mmas(self) -> TiledMmas:
        """Q K^T (the warpgroups splitting O share its rows unless split_scores) and P V."""
        dv = self.variant.head_dim_v
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
            b_mn_major=not self.fp8_math,  # (FP8: V transposed in smem, K-major)
            a_from_registers=self.config.pv_from_registers,
            split_n=self.o_split,
        )
        return TiledMmas(tiled_mma_qk, tiled_mma_pv)

    def smem_layouts(self) -> SmemLayouts:
        """Q's tile, the K and V rings (FP8 K/V: the GEMMs read fp16 rings that converting warps
        fill from FP8 rings, the same stage count, that the loads fill; with fp8_math K's ring
        is the loads' and V's is V^T (dv, tile_n), which transposing warps fill from an FP8
        ring; v_in_k: V is the first dv columns of each K stage), O's own tile, and P's where
        P goes through smem."""
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        tile_n, stages = self.config.tile_n, self.config.num_stages
        sQ_layout = hopper_mma.make_row_major_smem_layout(self.q_dtype, self.config.tile_m, d)
        sO_layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.config.tile_m, dv)
        sK_layout, sV_layout = [
            hopper_mma.make_row_major_smem_layout(self.mma_dtype, tile_n, width, stages)
            for width in (d, dv)
        ]
        if const_expr(self.fp8_math):
            sV_layout = hopper_mma.make_row_major_smem_layout(self.mma_dtype, dv, tile_n, stages)
        sK8_layout, sV8_layout = None, None
        if const_expr(self.converts_kv):
            sK8_layout = hopper_mma.make_row_major_smem_layout(self.kv_dtype, tile_n, d, stages)
        if const_expr(self.kv_fp8):
            sV8_layout = hopper_mma.make_row_major_smem_layout(self.kv_dtype, tile_n, dv, stages)
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
        return SmemLayouts(
            sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout, sK8_layout, sV8_layout
        )

    def rings(self, layouts: SmemLayouts):
        """(K's, V's) layouts of the rings the loads fill: the FP8 rings of an FP8 cache (K's
        is the GEMMs' with fp8_math), the GEMMs' rings otherwise."""
        if const_expr(self.kv_fp8):
            return (layouts.k if const_expr(self.fp8_math) else layouts.k8), layouts.v8
        return layouts.k, layouts.v

    def tma(self, views: KernelViews, layouts: SmemLayouts):
        """(TmaAtoms, GmemLoads, O's view): the atoms of Q's tile (and qv's), the K and V rings
        and O's store, and the tensors they read or write (TMA views; K and V themselves where
        rows are gathered; O itself where it goes from registers)."""
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        mQ, mK, mV, mQV, mO = views.q, views.k, views.v, views.qv, views.o
        ring_K_layout, ring_V_layout = self.rings(layouts)
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        ratio = self.variant.pack_gqa_ratio
        # qv variants: Q's tile is qv's dv columns, then q's d - dv (K's: v's, then k's).
        q_width = d - dv if const_expr(self.variant.qv) else d
        tma_atom_Q, tma_Q = self.q_tma_atom(tma_load, mQ, q_width)
        tma_atom_QV, tma_QV = None, None
        if const_expr(self.variant.qv):
            tma_atom_QV, tma_QV = self.q_tma_atom(tma_load, mQV, dv)
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
            tma_atom_K, tma_K = self._kv_tma_atom(tma_load, mK, layouts.k, d)
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
                    tma_store, mO, layouts.o, self.config.tile_m, dv, ratio
                )
            else:
                tma_atom_O, mO_kernel = cpasync.make_tiled_tma_atom(
                    tma_store, mO, layouts.o, (self.config.tile_m, dv)
                )
        atoms = TmaAtoms(tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, tma_atom_QV)
        return atoms, GmemLoads(tma_Q, tma_K, tma_V, tma_QV), mO_kernel

    def stage_bytes(self, layouts: SmemLayouts) -> Tuple[int, int, int]:
        """Bytes TMA brings into Q's tile and into one stage of the K and V rings."""
        ring_K_layout, ring_V_layout = self.rings(layouts)
        bytes_q = cute.size_in_bytes(self.q_dtype, layouts.q)
        bytes_k, bytes_v = [
            cute.size_in_bytes(self.kv_dtype, cute.select(layout, mode=[0, 1]))
            for layout in (ring_K_layout, ring_V_layout)
        ]
        return bytes_q, bytes_k, bytes_v

    def shared_storage(self, layouts: SmemLayouts):
        """The CTA's shared memory: the rings' barriers, the scheduler's and the split merge's
        slots, and the tiles (empty where the variant has none)."""
        sK8_size, sV8_size = [
            cute.cosize(layout) if const_expr(layout is not None) else 0
            for layout in (layouts.k8, layouts.v8)
        ]
        sV_size = 0 if const_expr(self.variant.v_in_k) else cute.cosize(layouts.v)

        num_stages = self.config.num_stages
        k8_ring = 1 if const_expr(self.converts_kv) else 0
        v8_ring = 1 if const_expr(self.kv_fp8) else 0
        sP_size = cute.cosize(layouts.p) if const_expr(layouts.p is not None) else 0
        sO_size = cute.cosize(layouts.o) if const_expr(self.separate_o_smem) else 0
        score_rows_size = 4 * self.config.tile_m if const_expr(self.split_scores) else 0
        sQ_size, sK_size = cute.cosize(layouts.q), cute.cosize(layouts.k)
        dtype, q_dtype, mma_dtype = self.dtype, self.q_dtype, self.mma_dtype
        align = self.smem_align

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            # FP8 K/V: the FP8 rings' barriers (mbar_k / mbar_v guard the MMA warps' rings).
            mbar_k8: cute.struct.MemRange[cutlass.Int64, num_stages * 2 * k8_ring]
            mbar_v8: cute.struct.MemRange[cutlass.Int64, num_stages * 2 * v8_ring]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            next_tile: cute.struct.MemRange[Int32, 2]
            split_last: cute.struct.MemRange[Int32, 1]  # split kernels: this CTA merges the tile
            sQ: cute.struct.Align[cute.struct.MemRange[q_dtype, sQ_size], align]
            sK: cute.struct.Align[cute.struct.MemRange[mma_dtype, sK_size], align]
            sV: cute.struct.Align[cute.struct.MemRange[mma_dtype, sV_size], align]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, sP_size], align]
            sO: cute.struct.Align[cute.struct.MemRange[dtype, sO_size], align]
            sK8: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, sK8_size], align]
            sV8: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, sV8_size], align]
            # split_scores: (max or sum, warpgroup, row), ScoreHalves.
            score_rows: cute.struct.MemRange[Float32, score_rows_size]

        return SharedStorage

    def q_tma_atom(self, op, mX, width: int):
        """TMA atom of Q's tile (or of its columns from one tensor, width wide)."""
        layout = hopper_mma.make_row_major_smem_layout(self.q_dtype, self.config.tile_m, width)
        if const_expr(self.variant.pack_gqa_ratio > 1):
            return _make_packed_gqa_tma_atom(
                op, mX, layout, self.config.tile_m, width, self.variant.pack_gqa_ratio
            )
        return cpasync.make_tiled_tma_atom(op, mX, layout, (self.config.tile_m, width))

    def _kv_tma_atom(self, op, mX, stages_layout, width: int):
        """TMA atom of the K or V ring (width: d or dv): a box of one key block, or of
        page_box_rows rows where paged blocks load page by page."""
        if const_expr(self.variant.page_box_rows is not None):
            rows = self.variant.page_box_rows
            box_layout = hopper_mma.make_row_major_smem_layout(self.kv_dtype, rows, width)
            return cpasync.make_tiled_tma_atom(op, mX, box_layout, (rows, width), 1)
        stage_layout = cute.select(stages_layout, mode=[0, 1])
        return cpasync.make_tiled_tma_atom(op, mX, stage_layout, (self.config.tile_n, width), 1)
