"""FlashAttention-3-style forward kernel for Hopper (sm_90a), written in the CuTe DSL: the launch
and the kernel skeleton (warp roles, register reallocation, the rings, the tile loop), which
runs the pieces of kernels/forward/ (producer.py, mainloop.py, epilogue.py) on the records of
records.py, with the variant's facts (facts.py) and the host's setup (host.py).

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
- after_append: launched right after the KV append kernel (kernels/kv_append.py); seqused_k
  holds the lengths before the append and kv_length the rows appended to each sequence. A
  split launch is programmatically dependent (facts.overlaps_append): its CTAs start, and
  tiles that read none of the appended rows stream their K/V blocks, while the append runs.
- fused_append (with after_append, no append kernel before it): the kernel writes the
  appended rows (append_k rotated by the rotary tables, append_v) itself, as
  FlashAttention-3's kernel does: each tile those in its key range, after issuing K(n_max-1)'s
  load (whose stage its MMA warps patch: Mainloop._patch_k_tail) and before its other loads
  (Producer.load); its MMA warps rotate Q's tile in shared memory (Mainloop._convert_q).
- pack_gqa: pack_gqa_ratio consecutive query heads sharing a kv head (all of them, or a group
  whose size divides tile_m) are folded into the tile's rows (row = token * ratio + head in
  group), so each K/V tile is read once for the group.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import trace_records
from ..named_barriers import NamedBarrier
from ..signature_record import signature_record
from ..trace_records import TileTrace, linear_block_idx
from .epilogue import Epilogue
from .facts import THREADS_PER_WARPGROUP, ForwardFacts, Piece
from .host import HostSetup, _row_major_wide
from .mainloop import Mainloop
from .producer import Producer
from .records import (
    CALL_TENSORS,
    CtaBuffers,
    KernelParams,
    MmaSetup,
    Outputs,
    ProblemShapes,
    Scalars,
    SmemLayouts,
)


class FlashAttentionForwardSm90(Piece):
    """One compiled variant of the forward kernel: the host launch and the device kernel.

    Constructed from a flash_cute.plan.ForwardVariant, taken whole: its effective config (tile
    shape and knobs, an AttentionConfig, whose shared-memory model gives separate_o_smem) and
    the problem's static shape, from which ForwardFacts derives what the pieces read. The
    pieces: HostSetup (the launch's views, MMAs, layouts, TMA atoms, shared storage), Producer
    (loads), Mainloop (one tile's key blocks), Epilogue (O and the LSE out, split merges).

    Entry points (compile_cache.Signature reads their parameters; the CUDA stream comes last):
      __call__(q, k, v, out, lse, <the call's tensors: flash_cute.call.KERNEL_CALL_FIELDS,
               ending in kv_length>, partials, counters, scale_log2, max_ctas, num_splits,
               trace): its parameter list is the launch's one declaration (LaunchArgs)
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
      append_k, append_v: fused_append variants: (B, kv_length, nheads_kv, d / dv), the rows
            the kernel writes to k and v past seqused_k before reading them; append_cos,
            append_sin: (seqlen_ro, rotary_dim / 2) with rotary_dim (last dim contiguous, any
            other strides, element-aligned: read by scalar loads)
      kv_length: the keys of every sequence (scalar_kv_length variants), or the rows appended
            to each after its seqused_k (after_append variants); unused by others
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
        super().__init__(ForwardFacts(variant))  # (the facts read as attributes: self.config)
        self.host = HostSetup(self.facts)
        self.producer = Producer(self.facts)
        self.mainloop = Mainloop(self.facts)
        self.epilogue = Epilogue(self.facts)

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

    def _rings(self, storage):
        """(Q's ring, the K and V rings, the FP8 K and V rings or None) over the CTA's shared
        storage: TMA -> (FP8 rings -> converting warps ->) the rings the MMA warps read."""
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
        # TMA -> (FP8 rings -> converting or transposing warps ->) the MMA warps' rings.
        loaded = [(storage.mbar_k, self.tma_bytes_k), (storage.mbar_v, self.tma_bytes_v)]
        converted = (self.converts_kv, self.kv_fp8)  # K's, V's
        fp8_rings = [None, None]  # the FP8 rings between TMA and the converting warps
        for i, fp8_bar in enumerate((storage.mbar_k8, storage.mbar_v8)):
            if const_expr(converted[i]):
                fp8_rings[i] = self._kv_ring(fp8_bar, loaded[i][1], tma_warp, self.convert_threads)
        rings = [None, None]  # the MMA warps'
        for i in range(2):
            if const_expr(converted[i]):
                rings[i] = pipeline.PipelineAsync.create(
                    barrier_storage=loaded[i][0].data_ptr(),
                    num_stages=self.config.num_stages,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.convert_threads
                    ),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, self.num_mma_threads
                    ),
                    defer_sync=True,
                )
            else:
                rings[i] = self._kv_ring(*loaded[i], tma_warp, self.num_mma_threads)
        return pipeline_q, rings[0], rings[1], fp8_rings[0], fp8_rings[1]

    def _cta_buffers(self, storage, layouts: SmemLayouts, rings) -> CtaBuffers:
        """The CTA's shared-memory tiles (in `layouts`) and its rings, as the pieces see them."""
        sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout, sK8_layout, sV8_layout = layouts
        pipeline_q, pipeline_k, pipeline_v, pipeline_k8, pipeline_v8 = rings
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
        if const_expr(self.converts_kv):
            sK8 = storage.sK8.get_tensor(sK8_layout.outer, swizzle=sK8_layout.inner)
        if const_expr(self.kv_fp8):
            sV8 = storage.sV8.get_tensor(sV8_layout.outer, swizzle=sV8_layout.inner)
        sO = sQ  # (a TMA-stored O without a tile of its own has dv == d: the plan's rule)
        if const_expr(self.separate_o_smem):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        return CtaBuffers(
            sQ=sQ, sQ_mma=sQ_mma, sK=sK, sV=sV, sP=sP, sRows=sRows, sO=sO,
            pipeline_q=pipeline_q, pipeline_k=pipeline_k, pipeline_v=pipeline_v,
            sK8=sK8, sV8=sV8, pipeline_k8=pipeline_k8, pipeline_v8=pipeline_v8,
        )  # fmt: skip

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
        q_descale: Optional[cute.Tensor],
        k_descale: Optional[cute.Tensor],
        v_descale: Optional[cute.Tensor],
        append_k: Optional[cute.Tensor],
        append_v: Optional[cute.Tensor],
        append_cos: Optional[cute.Tensor],
        append_sin: Optional[cute.Tensor],
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
        self._launch(LaunchArgs.of(locals()), stream)

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
        args = LaunchArgs(
            q=q, k=k, v=v, out=out, kv_length=kv_length, scale_log2=scale_log2,
            max_ctas=max_ctas, num_splits=Int32(1),
        )  # fmt: skip
        self._launch(args, stream)

    @cute.jit
    def _launch(self, args, stream: cuda.CUstream):
        """The launch: a split launch's partials and the counters as views of their addresses
        (64-bit: a split launch's partials may pass 2^31 elements), the operands in kernel
        mode order, the host's setup (host.py), the grid, and the kernel."""
        out_partial, lse_partial, mCounters = self._scratch_views(args)
        views = self.host.views(
            args.q, args.k, args.v, args.qv, args.out, args.lse, out_partial, lse_partial
        )
        layouts = self.host.smem_layouts()
        atoms, loads, mO_kernel, mmas = self._device_setup(views, layouts)
        v_written = None  # (a fused append's: it writes v's new rows)
        if const_expr(self.variant.fused_append):
            v_written = views.v
        call_tensors = {n: getattr(args, n) for n in CALL_TENSORS}
        problem = ProblemShapes(views.q, views.k, v_written, **call_tensors)
        space = self.facts.tile_space(
            views.q, views.k, args.cu_seqlens_q, args.page_table, args.num_splits, args.max_ctas
        )
        self.kernel(
            KernelParams(
                loads,
                Outputs(mO_kernel, views.lse, views.o_partial, views.lse_partial),
                problem,
                mCounters,
                args.trace,
                Scalars(args.num_splits, args.max_ctas, args.kv_length),
                atoms,
                args.scale_log2,
                layouts,
                mmas,
            )
        ).launch(
            grid=self.scheduler_cls.grid(space),
            block=[self.num_threads, 1, 1],
            stream=stream,
            # Gives ptxas the entry register cap setmaxnreg needs (and fits that many CTAs).
            min_blocks_per_mp=self.config.ctas_per_sm,
            # All of the SM's unified memory as shared memory (stated, so the DSL need not ask
            # the device when ctas_per_sm > 1: compiling stays GPU-free).
            preferred_smem_carveout=100 if const_expr(self.config.ctas_per_sm > 1) else None,
            # After an append: CTAs start while the append kernel runs (the producer waits for
            # its writes where it reads them: Producer.load).
            use_pdl=self.overlaps_append,
        )

    def _device_setup(self, views, layouts):
        """(TmaAtoms, GmemLoads, O as the kernel takes it, the tiled MMAs) of the launch; sets
        the stage bytes the rings expect and the shared storage the kernel allocates."""
        mmas = self.host.tiled_mmas()
        atoms, loads, mO_kernel = self.host.tma(views, layouts)
        self.tma_bytes_q, self.tma_bytes_k, self.tma_bytes_v = self.host.stage_bytes(layouts)
        self.shared_storage = self.host.shared_storage(layouts)
        return atoms, loads, mO_kernel, mmas

    def _scratch_views(self, args):
        """(out_partial, lse_partial, counters): a split launch's partials and the counters as
        views of their addresses (None where the variant takes none)."""
        out_partial = lse_partial = mCounters = None
        if const_expr(self.variant.split):
            o_shape = (args.num_splits, *args.out.shape)
            if const_expr(self.variant.varlen_q):  # q (total_q, nheads, d): lse (nheads, total_q)
                lse_shape = (args.num_splits, args.q.shape[1], args.q.shape[0])
            else:  # q (batch, seqlen_q, nheads, d): lse (batch, nheads, seqlen_q)
                lse_shape = (args.num_splits, args.q.shape[0], args.q.shape[2], args.q.shape[1])
            o_layout, o_size = _row_major_wide(o_shape)
            out_partial = cute.make_tensor(args.partials, o_layout)
            # Offset by a multiple of head_dim (>= 64) floats: the LSE partial stays 16-byte
            # aligned.
            lse_partial = cute.make_tensor(args.partials + o_size, _row_major_wide(lse_shape)[0])
        if const_expr(self.variant.takes_counters):
            # Indexed by tile (split) or by its two slots (dynamic scheduler); the size is
            # never read.
            mCounters = cute.make_tensor(args.counters, cute.make_layout(1 << 30))
        return out_partial, lse_partial, mCounters

    # ------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, params: KernelParams):
        """The skeleton: shared memory and the rings, then the warp roles. The producer
        warpgroup lowers its registers; its loading warps run the producer's loads tile after
        tile (and with an FP8 cache its other warps convert the blocks); the MMA warpgroups
        raise theirs and run the mainloop and the epilogue of each tile the scheduler hands
        them (a split tile's merge after it). params: the launch's groups (records.py)."""
        loads, outputs, problem, mCounters, mTrace, scalars, atoms = params[:7]
        softmax_scale_log2, layouts, mmas = params[7:]
        mO, mLSE, mOPartial, mLSEPartial = outputs
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in atoms:  # (q, k, v, o, qv)
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        rings = self._rings(storage)
        space = self.facts.tile_space(
            problem.q, problem.k, problem.cu_seqlens_q, problem.page_table, scalars.num_splits,
            scalars.max_ctas,
        )  # fmt: skip
        scheduler = self.scheduler_cls.create(
            space,
            self.config.scheduler == "dynamic_persistent",
            mCounters,
            storage.mbar_sched.data_ptr(),
            storage.next_tile.get_tensor(cute.make_layout(2)),
            # (The converting warps follow the tiles too.)
            self.num_mma_threads + (self.convert_threads if const_expr(self.kv_fp8) else 0),
        )
        pipeline.pipeline_init_arrive()

        buffers = self._cta_buffers(storage, layouts, rings)
        shapes = problem._replace(
            num_splits=scalars.num_splits,
            kv_length=scalars.kv_length
            if const_expr(self.variant.scalar_kv_length or self.variant.after_append)
            else None,
        )

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
                    kv_state = self.producer.load(
                        loads, atoms, buffers, tile, shapes, q_state, kv_state
                    )
                    if const_expr(trace is not None):
                        trace.stamp(trace_records.LOAD_END)
                    q_state.advance()
                    tile_idx, handoff = scheduler.fetch_next(tile_idx, handoff)
                scheduler.finish()
                if const_expr(self.overlaps_append):
                    # (a CTA of empty tiles: the launch completes only after the append does,
                    # for the kernels behind it in the stream)
                    cute.arch.griddepcontrol_wait()
            elif const_expr(self.kv_fp8):  # the others: convert or transpose the blocks
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.config.num_stages
                )
                tile_idx, handoff = scheduler.first_tile(), scheduler.consumer_handoff()
                while scheduler.is_valid(tile_idx):
                    state = self.producer.convert_tile(
                        buffers, scheduler.work_tile(tile_idx), shapes, state
                    )
                    tile_idx, handoff = scheduler.receive_next(tile_idx, handoff)
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
                tiled_mma_qk=mmas.qk, tiled_mma_pv=mmas.pv, tma_atom_O=atoms.o,
                softmax_scale_log2=softmax_scale_log2, tidx=tidx, warpgroup_idx=warpgroup_idx,
            )  # fmt: skip
            tile_idx, handoff = scheduler.first_tile(), scheduler.consumer_handoff()
            while scheduler.is_valid(tile_idx):
                tile = scheduler.work_tile(tile_idx)
                trace = self._tile_trace(mTrace, scheduler, tile_idx, tidx == 0)
                if const_expr(trace is not None):
                    coords = (tile.m_block, tile.head_idx, tile.batch_idx, tile.split_idx)
                    trace.begin(trace_records.FORWARD_TILE, linear_block_idx(), coords)
                kv_state, result = self.mainloop.mma(
                    buffers, setup, tile, shapes, q_state, kv_state, trace
                )
                self.epilogue.store(result, tile_out, tile_lse, buffers.sO, setup, tile)
                q_state.advance()
                if const_expr(self.variant.split and not self.variant.combine_launch):
                    split_last = storage.split_last.get_tensor(cute.make_layout(1))
                    self.epilogue.merge_splits(
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


# The launch's arguments as __call__ declares them: its one declaration of the launch order
# (call_short leaves the optional ones None).
LaunchArgs = signature_record("LaunchArgs", FlashAttentionForwardSm90.__call__, optional=True)
