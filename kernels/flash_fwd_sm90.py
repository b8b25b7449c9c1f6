"""FlashAttention-3-style forward kernel for Hopper (sm_90a), written in the CuTe DSL.

One CTA computes one (query tile, head, batch): tile_m rows of O and their LSE.

Warp roles (128 * (1 + num_mma_warpgroups) threads):
- warpgroup 0, the producer, lowers its registers with setmaxnreg; its warp 0 issues the TMA
  loads of the Q tile and of K and V tiles into a num_stages-deep smem ring, each stage
  tracked by a full/empty mbarrier pair (separate rings for K and V).
- warpgroups 1.., the consumers, raise their registers; each owns 64 query rows and runs
  S = Q K^T (WGMMA, smem x smem), the online softmax in fp32, and O += P V (WGMMA with P
  from registers, or from smem when the config says so), then writes O through smem and a
  TMA store, and the LSE from registers.

Scheduling knobs (static config):
- intra_wg_overlap: issue S = Q K^T of key block n before the softmax of block n+1 finishes
  its P V, keeping two WGMMA groups in flight.
- pingpong: named barriers make the consumer warpgroups take turns issuing GEMMs, so one's
  softmax overlaps another's tensor-core work.
- rescale_o_before_pv: scale O while Q K^T is in flight instead of after P V (large head dims).
"""

from types import SimpleNamespace
from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import hopper_mma
from .block_range import KeyBlockRange
from .masking import AttentionMask
from .named_barriers import NamedBarrier
from .softmax import OnlineSoftmax, rescale_rows
from .tma_loads import TmaBlockLoader

THREADS_PER_WARPGROUP = 128


class FlashAttentionForwardSm90:
    """Static configuration plus the host launch (`__call__`) and the device kernel.

    Tensors passed to `__call__` (all 16-byte aligned, last dim contiguous):
      q, out: (batch, seqlen_q, nheads, head_dim)       dtype
      k, v:   (batch, seqlen_k, nheads_kv, head_dim)    dtype, nheads % nheads_kv == 0
      lse:    (batch, nheads, seqlen_q) float32, or None to skip writing it
    Batch, sequence lengths and head counts are run-time values.
    """

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        causal: bool,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        pv_from_registers: bool,
        intra_wg_overlap: bool,
        pingpong: bool,
        rescale_o_before_pv: bool,
        producer_registers: int,
        mma_registers: int,
    ):
        assert dtype in (cutlass.BFloat16, cutlass.Float16)
        assert tile_m % 64 == 0 and 1 <= tile_m // 64 <= 3
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.pv_from_registers = pv_from_registers
        self.intra_wg_overlap = intra_wg_overlap
        self.pingpong = pingpong and tile_m // 64 >= 2
        self.rescale_o_before_pv = rescale_o_before_pv and intra_wg_overlap
        self.producer_registers = producer_registers
        self.mma_registers = mma_registers
        self.num_mma_warpgroups = tile_m // 64
        self.num_mma_threads = THREADS_PER_WARPGROUP * self.num_mma_warpgroups
        self.num_threads = THREADS_PER_WARPGROUP * (1 + self.num_mma_warpgroups)
        self.smem_align = 1024

    # ------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        softmax_scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        # (b, s, h, d) -> (s, d, h, b): a TMA box is (rows, head_dim) at coordinate (head, batch).
        mQ, mK, mV, mO = [hopper_mma.permute_modes(t, (1, 3, 2, 0)) for t in (mQ, mK, mV, mO)]
        if const_expr(mLSE is not None):
            mLSE = hopper_mma.permute_modes(mLSE, (2, 1, 0))  # (b, h, s) -> (s, h, b)

        d = self.head_dim
        tiled_mma_qk = hopper_mma.make_tiled_mma(
            self.dtype, self.num_mma_warpgroups, self.tile_n, b_mn_major=False, a_from_registers=False
        )
        tiled_mma_pv = hopper_mma.make_tiled_mma(
            self.dtype, self.num_mma_warpgroups, d, b_mn_major=True,
            a_from_registers=self.pv_from_registers,
        )
        sQ_layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.tile_m, d)
        sKV_layout = hopper_mma.make_row_major_smem_layout(
            self.dtype, self.tile_n, d, self.num_stages
        )
        sP_layout = None
        if const_expr(not self.pv_from_registers):
            sP_layout = hopper_mma.make_row_major_smem_layout(self.dtype, self.tile_m, self.tile_n)
        sKV_stage_layout = cute.select(sKV_layout, mode=[0, 1])

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_layout, (self.tile_m, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sKV_stage_layout, (self.tile_n, d), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sKV_stage_layout, (self.tile_n, d), 1)
        # O reuses Q's smem (same shape and swizzle), stored with one TMA per tile.
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (self.tile_m, d)
        )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, sKV_stage_layout)

        num_stages = self.num_stages
        sP_size = cute.cosize(sP_layout) if const_expr(sP_layout is not None) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, num_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], self.smem_align]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], self.smem_align]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], self.smem_align]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, sP_size], self.smem_align]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            softmax_scale_log2,
            sQ_layout, sKV_layout, sP_layout,
            tiled_mma_qk, tiled_mma_pv,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # gives ptxas the entry register cap setmaxnreg needs
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
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sP_layout: Optional[cute.ComposedLayout],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Consumers release a stage with one arrive per warp.
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=mma_warps, tx_count=self.tma_bytes_q, defer_sync=True,
        )
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=tma_warp, consumer_group=mma_warps, tx_count=self.tma_bytes_kv,
            defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=tma_warp, consumer_group=mma_warps, tx_count=self.tma_bytes_kv,
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sP = None
        if const_expr(sP_layout is not None):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        # Longest causal tiles (largest m_block) launch first.
        bidx, head_idx, batch_idx = cute.arch.block_idx()
        m_block = bidx
        if const_expr(self.causal):
            m_block = cute.arch.grid_dim()[0] - 1 - bidx
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        head_kv_idx = head_idx // (mQ.shape[2] // mK.shape[2])
        block_range = KeyBlockRange(self.tile_m, self.tile_n, self.causal, seqlen_q, seqlen_k)

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load(
                    mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                    pipeline_q, pipeline_k, pipeline_v,
                    block_range, m_block, head_idx, head_kv_idx, batch_idx,
                )
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            self.mma(
                mO, mLSE, sQ, sK, sV, sP, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                pipeline_q, pipeline_k, pipeline_v, softmax_scale_log2,
                block_range, AttentionMask(self.tile_m, self.tile_n, seqlen_q, seqlen_k),
                m_block, head_idx, batch_idx,
            )

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        block_range: KeyBlockRange,
        m_block: Int32,
        head_idx: Int32,
        head_kv_idx: Int32,
        batch_idx: Int32,
    ):
        """Producer warp: Q once, then K and V blocks from the last to the first.

        With intra-warpgroup overlap the consumer needs K(n) one step before V(n), so V runs
        one block behind K: K(n_max-1), Q, [K(n-1), V(n)]..., V(n_min).
        """
        d = self.head_dim
        gQ = cute.local_tile(mQ[None, None, head_idx, batch_idx], (self.tile_m, d), (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tile_kv = (self.tile_n, d)
        k_loader = TmaBlockLoader.create(
            tma_atom_K, cute.local_tile(mK[None, None, head_kv_idx, batch_idx], tile_kv, (None, 0)),
            sK, pipeline_k,
        )
        v_loader = TmaBlockLoader.create(
            tma_atom_V, cute.local_tile(mV[None, None, head_kv_idx, batch_idx], tile_kv, (None, 0)),
            sV, pipeline_v,
        )

        n_block_min, n_block_max = block_range.bounds(m_block)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)

        k_loader.load(n_block_max - 1, kv_state)
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        if const_expr(self.intra_wg_overlap):
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

    @cute.jit
    def mma(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sP: Optional[cute.Tensor],
        tma_atom_O: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        softmax_scale_log2: Float32,
        block_range: KeyBlockRange,
        mask: AttentionMask,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """Consumer warpgroups: the attention mainloop over key blocks, then the epilogue."""
        tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # WGMMA operands are per warpgroup: slice at the warpgroup's first thread.
        wg_mma_qk = tiled_mma_qk.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        wg_mma_pv = tiled_mma_pv.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        smem_copy_P, tPsP = None, None
        if const_expr(self.pv_from_registers):
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        else:
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(sP))
            smem_copy_P = cute.make_tiled_copy_C(self._stmatrix_atom(), tiled_mma_qk).get_slice(tidx)
            tPsP = smem_copy_P.partition_D(sP)
        softmax = OnlineSoftmax(softmax_scale_log2, cute.size(hopper_mma.acc_as_rows_cols(acc_O), mode=[0]))
        ctx = SimpleNamespace(
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            thr_mma_qk=tiled_mma_qk.get_slice(tidx),
            tSrQ=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ)),
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK)),
            tOrVt=wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(hopper_mma.transpose_smem_view(sV))),
            tOrP=tOrP,
            smem_copy_P=smem_copy_P,
            tPsP=tPsP,
            acc_S_shape=wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
            acc_O=acc_O,
            softmax=softmax,
            # With rescale_o_before_pv, the O rescale owed by the last softmax step.
            pending_scale=cute.make_rmem_tensor(softmax.num_rows, Float32)
            if const_expr(self.rescale_o_before_pv) else None,
            mask=mask,
            m_block=m_block,
            pipeline_k=pipeline_k,
            pipeline_v=pipeline_v,
            warpgroup_idx=warpgroup_idx,
        )

        # Ping-pong start: the first warpgroup may issue first.
        if const_expr(self.pingpong):
            if warpgroup_idx == 0:
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrier.WG_SCHEDULE_1), number_of_threads=2 * THREADS_PER_WARPGROUP
                )

        n_block_min, n_block_max = block_range.bounds(m_block)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        acc_O.fill(0.0)
        pipeline_q.consumer_wait(q_state)

        # The last key block goes first: it alone carries the sequence-length mask.
        if const_expr(self.intra_wg_overlap):
            pipeline_k.consumer_wait(kv_state)
            acc_S = self._qk_gemm(ctx, kv_state.index, 0)
            pipeline_k.consumer_release(kv_state)
            mask.apply(acc_S, ctx.thr_mma_qk, m_block, n_block_max - 1, mask_seqlen=True, mask_causal=self.causal)
            softmax.step(acc_S, is_first=True)
            self._scores_to_p(ctx, acc_S)
            if const_expr(self.rescale_o_before_pv):
                ctx.pending_scale.fill(1.0)
        else:
            self._schedule_wait(warpgroup_idx)
            kv_state = self._block_no_overlap(ctx, kv_state, n_block_max - 1, self.causal, is_first=True)
        n_block_max -= 1

        block_step = self._block_overlap if const_expr(self.intra_wg_overlap) else self._block_no_overlap
        if const_expr(self.causal):
            n_block_masked_min = cutlass.max(block_range.first_causal_masked_block(m_block), n_block_min)
            for i in cutlass.range(n_block_max - n_block_masked_min, unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_max - 1 - i, True)
            n_block_max = cutlass.min(n_block_max, n_block_masked_min)
        for i in cutlass.range(n_block_max - n_block_min, unroll=1):
            kv_state = block_step(ctx, kv_state, n_block_max - 1 - i, False)
        pipeline_q.consumer_release(q_state)

        if const_expr(self.intra_wg_overlap):
            # The P V of the first key block is still to do.
            if const_expr(self.rescale_o_before_pv):
                rescale_rows(acc_O, ctx.pending_scale)
            pipeline_v.consumer_wait(kv_state)
            self._pv_gemm(ctx, kv_state.index, 0)
            pipeline_v.consumer_release(kv_state)
            kv_state.advance()
        else:
            self._schedule_signal_next(warpgroup_idx)

        inv_row_sum, lse = softmax.finalize()
        rescale_rows(acc_O, inv_row_sum)
        self.epilogue(
            acc_O, lse, mO, mLSE, sQ, tma_atom_O, tiled_mma_pv, tidx, m_block, head_idx, batch_idx
        )

    def _qk_gemm(self, ctx, stage, wait_groups):
        acc_S = cute.make_rmem_tensor(ctx.acc_S_shape, Float32)
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, stage], zero_init=True,
            wait_groups=wait_groups,
        )
        return acc_S

    def _pv_gemm(self, ctx, stage, wait_groups):
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt[None, None, None, stage], zero_init=False,
            wait_groups=wait_groups,
        )

    def _scores_to_p(self, ctx, acc_S):
        """Round probabilities to the input dtype where the P V GEMM reads them."""
        p_as_a = hopper_mma.acc_as_operand_a(acc_S)
        if const_expr(self.pv_from_registers):
            hopper_mma.convert_to_16bit(p_as_a, ctx.tOrP)
        else:
            rP = cute.make_rmem_tensor_like(p_as_a, self.dtype)
            hopper_mma.convert_to_16bit(p_as_a, rP)
            cute.copy(ctx.smem_copy_P, ctx.smem_copy_P.retile(rP), ctx.tPsP)
            # Each warp reads back only the P rows it wrote, so a warp barrier suffices.
            cute.arch.fence_view_async_shared()
            cute.arch.sync_warp()

    def _block_overlap(self, ctx, kv_state, n_block, mask_causal: bool):
        """Issue S = Q K(n), then O += P(n+1) V(n+1); the softmax of S(n) runs under P V."""
        v_state = kv_state.clone()
        kv_state.advance()
        ctx.pipeline_k.consumer_wait(kv_state)
        self._schedule_wait(ctx.warpgroup_idx)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        if const_expr(self.rescale_o_before_pv):
            rescale_rows(ctx.acc_O, ctx.pending_scale)
        ctx.pipeline_v.consumer_wait(v_state)
        self._pv_gemm(ctx, v_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(1)
        ctx.pipeline_k.consumer_release(kv_state)
        ctx.mask.apply(acc_S, ctx.thr_mma_qk, ctx.m_block, n_block, mask_seqlen=False, mask_causal=mask_causal)
        row_scale = ctx.softmax.step(acc_S, is_first=False)
        warpgroup.wait_group(0)
        ctx.pipeline_v.consumer_release(v_state)
        self._scores_to_p(ctx, acc_S)
        if const_expr(self.rescale_o_before_pv):
            ctx.pending_scale.store(row_scale.load())
        else:
            rescale_rows(ctx.acc_O, row_scale)
        return kv_state

    def _block_no_overlap(self, ctx, kv_state, n_block, mask_causal: bool, is_first: bool = False):
        """S = Q K(n); softmax; O += P V(n). A warpgroup's ping-pong turn spans this block's
        P V and the next block's Q K^T: the caller waits before the first block and signals
        after the last."""
        ctx.pipeline_k.consumer_wait(kv_state)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(0)
        ctx.pipeline_k.consumer_release(kv_state)
        ctx.mask.apply(acc_S, ctx.thr_mma_qk, ctx.m_block, n_block, mask_seqlen=is_first, mask_causal=mask_causal)
        row_scale = ctx.softmax.step(acc_S, is_first=is_first)
        self._scores_to_p(ctx, acc_S)
        rescale_rows(ctx.acc_O, row_scale)
        ctx.pipeline_v.consumer_wait(kv_state)
        self._schedule_wait(ctx.warpgroup_idx)
        self._pv_gemm(ctx, kv_state.index, 0)
        ctx.pipeline_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    def _schedule_wait(self, warpgroup_idx):
        if const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + warpgroup_idx,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    def _schedule_signal_next(self, warpgroup_idx):
        if const_expr(self.pingpong):
            next_wg = warpgroup_idx + 1
            if const_expr(self.num_mma_warpgroups == 2):
                next_wg = 1 - warpgroup_idx
            else:
                next_wg = next_wg % self.num_mma_warpgroups
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + next_wg,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    def _stmatrix_atom(self):
        return cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """O: registers -> smem (over Q's tile) -> one TMA store; LSE straight from registers.

        Each warpgroup writes only the 64 rows of sO whose sQ rows it alone read, so no barrier
        is needed before the smem writes; TMA clips rows past seqlen_q.
        """
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        hopper_mma.convert_to_16bit(acc_O, rO)
        smem_copy_O = cute.make_tiled_copy_C(self._stmatrix_atom(), tiled_mma_pv).get_slice(tidx)
        cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))

        if const_expr(mLSE is not None):
            thr_mma = tiled_mma_pv.get_slice(tidx)
            coords = hopper_mma.acc_as_rows_cols(
                thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            )
            seqlen_q = mO.shape[0]
            mLSE_cur = mLSE[None, head_idx, batch_idx]
            # The 4 threads of a quad hold the same rows; the one holding column 0 writes.
            if coords[0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = m_block * self.tile_m + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE_cur[row] = lse[r]

        cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
        cute.arch.barrier_arrive(
            barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads + 32
        )
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 4:
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads + 32
            )
            gO = cute.local_tile(mO[None, None, head_idx, batch_idx], (self.tile_m, self.head_dim), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
