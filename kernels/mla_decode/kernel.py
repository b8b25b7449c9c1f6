"""The absorbed-MLA decode kernel for Hopper (sm_90a): one tile of 64 query rows (heads x
tokens of a sequence, packed GQA over the one latent head) against a 576-wide latent cache
whose first 512 columns are V (or FlashAttention-3's qv form: q 64 + qv 512 against k_cache 64
+ v_cache 512), on FlashMLA's seesaw schedule (seesaw.py).

It takes the forward kernel's launch whole (its signature, ForwardVariant, tile scheduler, Q
load, epilogue, split partials and their merge) and replaces what runs between: K loaded as
64 x 64 boxes into two buffers of two halves (loads.py), and the two MMA warpgroups' seesaw.

Warp roles (384 threads): warpgroup 0's warp 0 issues the TMA loads (registers lowered; its
other warps idle); warpgroups 1 and 2 are the seesaw's warpgroups 0 and 1 (O columns 0-255
and 256-511; with an FP8 cache each converts the halves it reads first: fp8_loads.py).

Shared memory: Q (64 x 576, 72 KB; its rope columns hold warpgroup 1's P once each warpgroup has
them in registers), two K buffers (64 x 576 each), warpgroup 0's P (64 x 64), the row
exchange and the barriers: 231,424 of the 232,448 bytes a CTA may have (an FP8 cache's bytes
land in the K buffers themselves).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import hopper_mma
from ..forward.epilogue import Epilogue
from ..forward.facts import THREADS_PER_WARPGROUP, ForwardFacts, Piece
from ..forward.host import HostSetup
from ..forward.kernel import FlashAttentionForwardSm90
from ..forward.producer import Producer
from ..forward.records import (
    GmemLoads,
    KernelParams,
    MmaSetup,
    QLoad,
    TmaAtoms,
)
from .loads import BOX, HalfRings, LatentBlockLoads, half_bytes
from .seesaw import D_LATENT, Seesaw, SeesawBuffers, SeesawMmas

# Warps reading each K-buffer half (left0, right0, left1, right1): seesaw.py's schedule.
HALF_READERS = (4, 8, 8, 4)


class MlaDecodeSm90(FlashAttentionForwardSm90):
    """One compiled variant (config.seesaw) of the latent decode kernel. Its entry points and
    arguments are the forward kernel's (FlashAttentionForwardSm90's docstring)."""

    mainloop_cls = Seesaw  # (subclasses: their own mainloop, the same launch)

    def __init__(self, variant):
        Piece.__init__(self, ForwardFacts(variant))
        self.host = HostSetup(self.facts)
        self.producer = Producer(self.facts)  # (Q's load)
        self.mainloop = self.mainloop_cls(self.facts)
        self.epilogue = Epilogue(self.facts)

    # ------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------

    def _tiled_mmas(self) -> SeesawMmas:
        dtype = self.mma_dtype
        return SeesawMmas(
            qk=hopper_mma.make_tiled_mma(dtype, 1, BOX, b_mn_major=False, a_from_registers=False),
            qk_rope=hopper_mma.make_tiled_mma(
                dtype, 1, BOX, b_mn_major=False, a_from_registers=True
            ),
            pv=hopper_mma.make_tiled_mma(
                dtype, 1, D_LATENT, True, a_from_registers=True, split_n=2
            ),
            pv_smem=hopper_mma.make_tiled_mma(
                dtype, 1, D_LATENT, True, a_from_registers=False, split_n=2
            ),
        )

    def _box_layout(self):
        """A cache box's smem layout as TMA writes it (an FP8 cache's: staged unswizzled,
        kernels/mla_decode/fp8_loads.py)."""
        if const_expr(self.kv_fp8):
            return cute.make_layout((BOX, BOX), stride=(BOX, 1))
        return hopper_mma.make_row_major_smem_layout(self.dtype, BOX, BOX)

    def _tma(self, views, layouts):
        """(TmaAtoms, GmemLoads): Q's tile (and qv's) as the forward kernel loads it, and the
        cache's 64 x 64 boxes (k; with qv, v's and k's)."""
        op = cpasync.CopyBulkTensorTileG2SOp()
        dv = self.variant.head_dim_v
        box_layout = self._box_layout()

        def box_atom(mX):
            return cpasync.make_tiled_tma_atom(op, mX, box_layout, (BOX, BOX), 1)

        q_width = (
            self.variant.head_dim - dv if const_expr(self.variant.qv) else self.variant.head_dim
        )
        atom_q, tma_q = self.host.q_tma_atom(op, views.q, q_width)
        atom_qv, tma_qv, atom_v, tma_v = None, None, None, None
        if const_expr(self.variant.qv):
            atom_qv, tma_qv = self.host.q_tma_atom(op, views.qv, dv)
            atom_v, tma_v = box_atom(views.v)
        atom_k, tma_k = box_atom(views.k)
        return (
            TmaAtoms(atom_q, atom_k, atom_v, None, atom_qv),
            GmemLoads(tma_q, tma_k, tma_v, tma_qv),
        )

    def _shared_storage(self, layouts):
        """Q's tile as it is loaded (converted in place to the GEMMs' fp16 with an FP8 cache
        and bf16 q), the K buffers and sP in the GEMMs' dtype (an FP8 cache's bytes land in
        the K buffers), a ring per half."""
        dtype, mma_dtype, align = self.dtype, self.mma_dtype, self.smem_align
        sQ_size, sK_size, sP_size = [cute.cosize(x) for x in (layouts.q, layouts.k, layouts.p)]
        halves = 2 * len(HALF_READERS)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_halves: cute.struct.MemRange[cutlass.Int64, halves]
            split_last: cute.struct.MemRange[Int32, 1]  # split kernels: this CTA merges
            rows: cute.struct.MemRange[Float32, 4 * 64]  # seesaw.SeesawBuffers.sRows
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, sQ_size], align]
            sK: cute.struct.Align[cute.struct.MemRange[mma_dtype, sK_size], align]
            sP: cute.struct.Align[cute.struct.MemRange[mma_dtype, sP_size], align]

        return SharedStorage

    def _device_setup(self, views, layouts):
        """The forward kernel's launch with this kernel's pieces: Q's and the cache's TMA
        (_tma), its tiled MMAs and shared storage; O as the launch takes it (from registers)."""
        atoms, loads = self._tma(views, layouts)
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, layouts.q)
        self.shared_storage = self._shared_storage(layouts)
        return atoms, loads, views.o, self._tiled_mmas()

    # ------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------

    def _rings(self, storage, tma_thread) -> HalfRings:
        """The halves' rings over their mbarriers (two a ring): TMA fills a half (an FP8
        cache's e4m3 bytes, which its first MMA reader converts in place), its readers' warps
        free it (HALF_READERS)."""
        barriers = storage.mbar_halves.data_ptr()
        element_bytes = 1 if const_expr(self.kv_fp8) else self.dtype.width // 8
        rings = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers + 2 * i,
                num_stages=1,
                producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
                tx_count=half_bytes(i % 2, element_bytes),
                defer_sync=True,
            )
            for i, readers in enumerate(HALF_READERS)
        ]
        return HalfRings(*rings)

    def _buffers(self, storage, layouts, sQ, sQ_mma, pipeline_q, rings) -> SeesawBuffers:
        """The tiles and rings as the MMA warpgroups see them (sQ as loaded, sQ_mma as the
        GEMMs read it)."""
        return SeesawBuffers(
            sQ=sQ_mma,
            sQ_loaded=sQ,
            sK=storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner),
            sV=storage.sK.get_tensor(layouts.v.outer, swizzle=layouts.v.inner),
            sP0=storage.sP.get_tensor(layouts.p.outer, swizzle=layouts.p.inner),
            sRows=storage.rows.get_tensor(cute.make_layout((2, 2, 64))),
            pipeline_q=pipeline_q,
            rings=rings,
            fp8_k=storage.sK.data_ptr() if const_expr(self.kv_fp8) else None,
        )

    def _load_keys(self, atoms, loads, storage, buf, tile, shapes, n_block_min, n_block_max):
        """The loading warp's key blocks after Q: their halves in the seesaw's order (an FP8
        cache's boxes staged in the K buffers as e4m3)."""
        staged = None
        if const_expr(self.kv_fp8):
            staged = cute.recast_ptr(storage.sK.data_ptr(), dtype=self.kv_dtype)
        states = [
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            for _ in HALF_READERS
        ]
        LatentBlockLoads.create(
            atoms, loads, buf.sK, buf.rings, self.variant, tile.head_kv_idx, tile.batch_idx,
            shapes.page_table, staged,
        ).load_blocks(n_block_min, n_block_max, states)  # fmt: skip

    @cute.kernel
    def kernel(self, params: KernelParams):
        """Shared memory and the rings, then the roles: the loading warp (Q, then the key
        blocks: _load_keys) and the two MMA warpgroups (the mainloop, the epilogue, a split
        tile's merge). params: the forward kernel's launch groups, mmas this kernel's
        (_tiled_mmas). Subclasses change _rings, _buffers, _load_keys and the mainloop."""
        loads, outputs, problem, mCounters, _, scalars, atoms = params[:7]
        softmax_scale_log2, layouts, mmas = params[7:]
        mO, mLSE, mOPartial, mLSEPartial = outputs
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atoms.q, atoms.k, atoms.v, atoms.qv):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(),
            num_stages=1,
            producer_group=tma_thread,
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mma_threads // 32
            ),
            tx_count=self.tma_bytes_q,
            defer_sync=True,
        )
        rings = self._rings(storage, tma_thread)
        space = self.facts.tile_space(
            problem.q, problem.k, problem.cu_seqlens_q, problem.page_table, scalars.num_splits,
            scalars.max_ctas,
        )  # fmt: skip
        scheduler = self.scheduler_cls.create(space)
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sQ_mma = sQ
        if const_expr(self.converts_q):  # the same smem as fp16, with the same swizzle
            sQ_mma = cute.make_tensor(
                cute.recast_ptr(storage.sQ.data_ptr(), layouts.q.inner, dtype=self.mma_dtype),
                layouts.q.outer,
            )
        buf = self._buffers(storage, layouts, sQ, sQ_mma, pipeline_q, rings)
        shapes = problem._replace(
            num_splits=scalars.num_splits,
            kv_length=scalars.kv_length if const_expr(self.variant.scalar_kv_length) else None,
        )
        tile = scheduler.work_tile(scheduler.first_tile())
        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.config.producer_registers)
            if warp_idx == 0:
                seqlen, _, n_block_min, n_block_max = self.tile_problem(tile, shapes)
                if n_block_max > n_block_min:
                    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    self.producer.load_q(
                        QLoad(
                            copies=self.producer.q_copies(loads, atoms, sQ, tile, seqlen),
                            ring=pipeline_q,
                            state=q_state,
                        )
                    )
                    self._load_keys(
                        atoms, loads, storage, buf, tile, shapes, n_block_min, n_block_max
                    )
        else:
            cute.arch.setmaxregister_increase(self.config.mma_registers)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
            setup = MmaSetup(
                tiled_mma_qk=mmas.qk, tiled_mma_pv=mmas.pv, tma_atom_O=None,
                softmax_scale_log2=softmax_scale_log2, tidx=tidx,
                warpgroup_idx=cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP),
            )  # fmt: skip
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            result = self.mainloop.mma(mmas, buf, setup, tile, shapes, q_state)
            split = self.variant.split
            tile_out, tile_lse = (mOPartial, mLSEPartial) if const_expr(split) else (mO, mLSE)
            self.epilogue.store(result, tile_out, tile_lse, sQ, setup, tile)
            if const_expr(split and not self.variant.combine_launch):
                split_last = storage.split_last.get_tensor(cute.make_layout(1))
                self.epilogue.merge_splits(
                    mO, mLSE, mOPartial, mLSEPartial, mCounters, split_last, tile, shapes, tidx
                )
