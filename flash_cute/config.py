"""Forward-kernel configurations: the knobs, their validation, and the per-head-dim table.

A config is data: one frozen `AttentionConfig` per (head_dim, dtype, causal) row of
`FORWARD_CONFIGS`. Users may pass their own config to override the table (for research);
`AttentionConfig.validate` refuses configs that cannot run (shared memory, registers,
instruction shapes) with a ValueError saying which limit was broken.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

# The head dims of the table's rows. The kernels take any multiple of 16 up to 256 (HEAD_DIMS):
# one without a row of its own runs on the row of the next larger one, whose tile fits it.
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
HEAD_DIMS = tuple(range(16, 257, 16))
SUPPORTED_DTYPES = ("float16", "bfloat16")
# Wide heads: V's head dim 512 (absorbed MLA's latent, Gemma 4's global layers), whose O two
# MMA warpgroups split along its columns (AttentionConfig.o_split), with q/k head dims of the
# supported ones or 512 and 576 (= 512 + 64: the latent and the rope part); and V read from
# K's columns when v is a view of k's leading columns (ForwardVariant.v_in_k).
WIDE_HEAD_DIMS = (512, 576)
# The transposed latent decode kernel's tile rows (AttentionConfig.seesaw_rows below 64).
TRANSPOSED_ROWS = (16, 32)
WIDE_HEAD_DIM_V = 512
# FlashAttention-3's qv form (q and k the rope part, d <= 64; qv and v the latent, dv >= 256):
# the kernels see one head of d + dv columns, qv's and v's first. The V head dims whose halves
# (one per MMA warpgroup, o_split) are whole 64-column swizzle atoms, and the rope width after
# them: one whole atom (narrower ones compile but read wrong on an H100).
QV_HEAD_DIMS_V = (256, 384, 512)
QV_ROPE_DIMS = (64,)


def check_head_dims(head_dim: int, head_dim_v: Optional[int] = None, v_in_k: bool = False) -> None:
    """ValueError unless the kernels take q/k's head dim and V's (default: the same): each a
    multiple of 16 up to 256 in any pair (whether a config fits is validate's), V's 512 with
    q/k's of those or 512 / 576, or with V read from K's columns (v_in_k: qv, or a latent
    cache) one of QV_HEAD_DIMS_V with q/k's that plus one of QV_ROPE_DIMS."""
    if v_in_k and head_dim_v in QV_HEAD_DIMS_V and head_dim - head_dim_v in QV_ROPE_DIMS:
        return
    if head_dim not in HEAD_DIMS + WIDE_HEAD_DIMS:
        raise ValueError(
            f"head_dim must be a multiple of 16 up to 256 or one of {WIDE_HEAD_DIMS}, got "
            f"{head_dim}"
        )
    if head_dim_v is not None and head_dim_v not in HEAD_DIMS + (WIDE_HEAD_DIM_V,):
        raise ValueError(
            "head_dim_v (v's head dim) must be a multiple of 16 up to 256 or "
            f"{WIDE_HEAD_DIM_V}, got {head_dim_v}"
        )
    if head_dim in WIDE_HEAD_DIMS and (head_dim_v or head_dim) != WIDE_HEAD_DIM_V:
        raise ValueError(
            f"head_dim {head_dim} goes with head_dim_v {WIDE_HEAD_DIM_V}, got {head_dim_v}"
        )


def table_head_dim(head_dim: int) -> int:
    """The head dim of the table row that serves head_dim (<= 256): the smallest of
    SUPPORTED_HEAD_DIMS not below it."""
    return min(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def wide_config(head_dim: int, head_dim_v: int, v_in_k: bool = False) -> "AttentionConfig":
    """The config of head dims above 256 (V's, or q/k's of qv's d + dv): 64 rows whose O two
    warpgroups split, and the longest key block whose K (and V, unless read from K's columns)
    stages fit. With V in K's columns (absorbed MLA) the warpgroups split each key block's
    scores (split_scores) and run without the intra-warpgroup overlap: that overlap holds both
    K stages (which are also V's) across a softmax, so the next block's load would start only
    as it is needed. On an H100 at the decode points measured: 0.66-0.99x the time of the
    overlapped split, 0.76-1.0x that of both warpgroups computing all scores. Head dim 512
    prefill keeps the overlapped repeat (neither change gains there: 0.98-1.12x its time)."""
    knobs = dict(pingpong=False, o_split=2, store_o_from_registers=True)
    if v_in_k:
        knobs.update(pv_from_registers=False, split_scores=True, intra_wg_overlap=False)
    for tile_n in (64, 32) if v_in_k else (64, 48, 32, 16):
        config = AttentionConfig(64, tile_n, **knobs)
        if config.smem_bytes(head_dim, 2, head_dim_v, v_in_k) <= config.smem_limit():
            return config
    raise ValueError(f"no tile fits head_dim={head_dim}, head_dim_v={head_dim_v}")


@functools.cache  # (frozen: one object for every plan that takes it)
def seesaw_config(kv_fp8: bool = False, rows: int = 64) -> "AttentionConfig":
    """The absorbed-MLA decode kernel's config (kernels/mla_decode/, AttentionConfig.seesaw):
    the latent's wide config with the seesaw, and the registers of a producer that only issues
    TMA (24) beside MMA warps holding half of O, a block's scores, P and Q's rope part (240).
    kv_fp8: an FP8 latent cache, which the MMA warpgroups convert (kernels/mla_decode/
    fp8_loads.py): 40 / 232, the split its GPU tests and timings ran with (chosen when spare
    producer warps converted; 24 / 240 compiles without spills, untimed). rows 16 or 32: the
    transposed kernel (FP8 only, tiles of at most that many rows; 24 / 240: its loading warp
    only issues TMA)."""
    producer, mma = (40, 232) if kv_fp8 and rows == 64 else (24, 240)
    return wide_config(576, 512, v_in_k=True).replace(
        seesaw=True, producer_registers=producer, mma_registers=mma, seesaw_rows=rows
    )


# Hopper limits used by validation.
MAX_SMEM_BYTES_PER_BLOCK = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
SMEM_BYTES_PER_SM = 233472  # 228 KB, of which each resident CTA reserves 1 KB
REGISTERS_PER_SM = 65536
THREADS_PER_WARPGROUP = 128
# Registers per MMA thread kept free of accumulators (addresses, softmax temporaries, masks).
REGISTER_HEADROOM = 32


def _aligned_1k(nbytes: int) -> int:
    """Bytes of a shared-memory buffer aligned to 1024 (the kernel's swizzle alignment)."""
    return (nbytes + 1023) // 1024 * 1024


TILE_SCHEDULERS = ("single_tile", "static_persistent", "dynamic_persistent")
# Standard producer / MMA register split per number of MMA warpgroups (FA3's choice).
DEFAULT_REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# Two warpgroups splitting O (o_split): the producer's wide-row loads (varlen, two sources)
# spill at 24 registers; the MMA warps need ~208 (O of 512 columns in halves).
O_SPLIT_REGISTER_SPLIT = (40, 232)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and scheduling knobs of the Hopper forward kernel.

    tile_m: query rows per CTA; 64 per MMA warpgroup, so 64, 128 or 192 (1-3 warpgroups).
    tile_n: keys per pipeline stage; a multiple of 16 up to 256.
    num_stages: depth of the K and V shared-memory rings (each), >= 2.
    pv_from_registers: P V takes P from registers (WGMMA RS) instead of shared memory (SS).
    intra_wg_overlap: issue S = Q K^T of the next key block before the current softmax ends.
    pingpong: MMA warpgroups take turns issuing GEMMs (needs >= 2 warpgroups).
    rescale_o_before_pv: rescale O while Q K^T runs rather than after P V (needs overlap).
    producer_registers, mma_registers: setmaxnreg targets; None picks the standard split.
    ctas_per_sm: CTAs the launch asks to fit on one SM (1 to 4); n > 1 divides the registers
        and shared memory each may use by n, for short, bandwidth- or latency-bound tiles
        (decode; short sliding windows, whose tiles span few key blocks).
    scheduler: how tiles reach CTAs (see TILE_SCHEDULERS). "single_tile": one CTA per tile,
        the hardware hands out CTAs. "static_persistent": at most SMs x ctas_per_sm CTAs loop
        over the tiles round-robin, so a tile's epilogue overlaps the next tile's loads (a
        TMA-stored O gets its own shared memory when it fits). "dynamic_persistent": the same,
        but each CTA takes its next tile from a global counter, which balances causal tiles of
        unequal length. Both persistent kinds apply to unsplit problems, fixed-length and varlen;
        split-KV launches keep one CTA per tile. Tile order: causal tiles longest first, in
        sections of heads whose K/V fit in l2_section_mb; otherwise query tiles of a head together.
    l2_section_mb: causal tile order: the K+V bytes (MB) of the (batch, head) pairs whose
        tiles are ordered longest first together; smaller keeps fewer heads' K/V in L2 at
        once. The last section may be larger, so that the longest tiles do not finish alone.
    mbarrier_probe: MMA warps poll a K/V stage's barrier once before the blocking wait (the
        pattern of flash-attn-4's kernel) instead of going straight to the suspending wait.
    exp2_on_fma: of every 16 exponentials in a thread's score row, how many are computed by a
        polynomial on the FMA pipe instead of the MUFU (0-16; 0: all on the MUFU). Meant to relieve
        the MUFU where it is as busy as the tensor cores (head dim 64); slower on H100 (PERF_NOTES).
    lazy_rescale: an MMA warp skips the O rescale of a key block when none of its rows' maxima
        moved (one vote per block instead of head_dim / 2 multiplies per thread).
    rescale_threshold: a row keeps its running max while a new block's max exceeds it by at
        most this many log2 units (0-15), so lazy_rescale skips more often; probabilities then
        reach 2^threshold before normalization (below fp16's max at 15). 0: the max always moves.
    store_o_from_registers: padded unsplit problems store O straight from registers (as varlen
        and split launches always do) instead of through smem and one TMA store; then O needs no
        smem, and a persistent CTA frees Q's tile after the mainloop, so the next tile's Q loads
        under this tile's epilogue even where O has no smem tile of its own.
    o_split: MMA warpgroups sharing the tile's 64 rows, each holding O for head_dim_v / o_split
        of its columns (2: V head dims above 256, whose O one warpgroup's registers cannot
        hold). Each computes the rows' scores and softmax itself (the Q K^T work is repeated
        o_split times, as no P goes through shared memory) unless split_scores. Needs tile_m
        64, P from registers (or split_scores) and no ping-pong; O is stored from registers.
    split_scores: with o_split 2, each warpgroup computes the scores of half the key block
        (Q K^T done once in all) and the two exchange their row maxima, their halves of P
        (through shared memory: P V reads all of it) and at the end their row sums. Needs P
        from shared memory, no lazy or pre-P V rescale, tile_n % 32 == 0.
    trace: the kernel records, per work tile, its SM, coordinates and phase times (a variant
        of its own: untraced kernels carry none of it; flash_cute.trace reads the records).
    gather_lookahead: paged K/V gathered with cp.async (pages no TMA box follows): rows whose
        page-table entries a producer thread reads before it issues their copies (1-32; 1: each
        read just before its copy). Above 1 the entries take registers: producer_registers
        >= 128. The plan sets it (plan.GATHER_LOOKAHEAD) where the producer has them.
    seesaw: absorbed MLA (V the first 512 of K's 576 columns): the latent decode kernel
        (kernels/mla_decode/), FlashMLA's schedule: key blocks in pairs, each of the two
        warpgroups computing one block's scores and both blocks' P V on its half of O, so one's
        softmax runs under the other's GEMMs. Needs the wide latent config (tile 64 x 64, two
        stages, o_split 2, split_scores, one CTA per tile).
    seesaw_rows: 16 or 32: the transposed latent decode kernel
        (kernels/mla_decode/transposed.py) for an FP8 latent cache and tiles of at most that
        many query rows (keys on the WGMMAs' M, the rows on N); 64: the seesaw.
    transpose_batch: FP8 math: steps of a warp transposing V whose loads go before their
        stores (1-4; kernels/v_transpose.py); each holds four registers of the producer's. A
        lone transposing warp (beside gathering warps) always goes one step at a time.
    """

    tile_m: int
    tile_n: int
    num_stages: int = 2
    pv_from_registers: bool = True
    intra_wg_overlap: bool = True
    pingpong: bool = True
    rescale_o_before_pv: bool = False
    producer_registers: Optional[int] = None
    mma_registers: Optional[int] = None
    ctas_per_sm: int = 1
    scheduler: str = "single_tile"
    l2_section_mb: int = 8
    mbarrier_probe: bool = False
    exp2_on_fma: int = 0
    lazy_rescale: bool = False
    rescale_threshold: int = 0
    store_o_from_registers: bool = False
    o_split: int = 1
    split_scores: bool = False
    trace: bool = False
    gather_lookahead: int = 1
    transpose_batch: int = 2
    seesaw: bool = False
    seesaw_rows: int = 64

    def __post_init__(self):
        for name in (
            "tile_m",
            "tile_n",
            "num_stages",
            "ctas_per_sm",
            "l2_section_mb",
            "exp2_on_fma",
            "rescale_threshold",
            "o_split",
            "gather_lookahead",
            "transpose_batch",
            "seesaw_rows",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"AttentionConfig.{name} must be an int, got {value!r}")
        if self.scheduler not in TILE_SCHEDULERS:
            raise ValueError(
                f"AttentionConfig.scheduler must be one of {TILE_SCHEDULERS}, "
                f"got {self.scheduler!r}"
            )
        for name in (
            "pv_from_registers",
            "intra_wg_overlap",
            "pingpong",
            "rescale_o_before_pv",
            "mbarrier_probe",
            "lazy_rescale",
            "store_o_from_registers",
            "split_scores",
            "trace",
            "seesaw",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"AttentionConfig.{name} must be a bool, got {value!r}")
        if self.tile_m not in (64, 128, 192):
            raise ValueError(
                f"AttentionConfig.tile_m must be 64, 128 or 192 (64 rows per MMA warpgroup), "
                f"got {self.tile_m}"
            )
        if not 1 <= self.l2_section_mb <= 1024:
            raise ValueError(
                f"AttentionConfig.l2_section_mb must be in [1, 1024], got {self.l2_section_mb}"
            )
        if not 0 <= self.exp2_on_fma <= 16:
            raise ValueError(
                "AttentionConfig.exp2_on_fma must be in [0, 16] (of every 16 exponentials), "
                f"got {self.exp2_on_fma}"
            )
        if not 0 <= self.rescale_threshold <= 15:
            raise ValueError(
                "AttentionConfig.rescale_threshold must be in [0, 15] (log2 units; probabilities "
                f"reach 2^threshold, and fp16's max is below 2^16), got {self.rescale_threshold}"
            )
        if self.o_split not in (1, 2):
            raise ValueError(f"AttentionConfig.o_split must be 1 or 2, got {self.o_split}")
        if self.o_split > 1 and self.tile_m != 64:
            raise ValueError(
                f"AttentionConfig.o_split={self.o_split} needs tile_m 64 (the warpgroups share "
                f"its rows), got tile_m {self.tile_m}"
            )
        if self.ctas_per_sm not in (1, 2, 3, 4):
            raise ValueError(
                f"AttentionConfig.ctas_per_sm must be 1, 2, 3 or 4, got {self.ctas_per_sm}"
            )
        split = (
            O_SPLIT_REGISTER_SPLIT
            if self.o_split > 1
            else DEFAULT_REGISTER_SPLIT[self.num_mma_warpgroups]
        )
        if self.ctas_per_sm > 1:  # a share of the register file each: scale the split down
            per_thread = self.entry_registers
            split = (max(24, per_thread // 4 // 8 * 8), None)
            split = (
                split[0],
                (per_thread * (1 + self.num_mma_warpgroups) - split[0])
                // self.num_mma_warpgroups
                // 8
                * 8,
            )
        if self.producer_registers is None:
            object.__setattr__(self, "producer_registers", split[0])
        if self.mma_registers is None:
            object.__setattr__(self, "mma_registers", split[1])
        # Hashed once: a config passed to every call is part of each call's launch-plan key.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    # The cached hash is per process (string hashing is seeded): rebuilt when unpickled.
    def __getstate__(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    @property
    def persistent(self) -> bool:
        return self.scheduler != "single_tile"

    @property
    def tile_rows(self) -> int:
        """Query rows a work tile serves: tile_m, but the transposed latent decode kernel's
        seesaw_rows (16 or 32) within its 64-row layouts. Tiles, their rows, the causal bounds and
        the arrival counters count in these."""
        return self.seesaw_rows if self.seesaw else self.tile_m

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64 * self.o_split

    @property
    def num_threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + self.num_mma_warpgroups)

    @property
    def entry_registers(self) -> int:
        """Registers per thread at launch: the SM's file shared by ctas_per_sm CTAs (ptxas
        rounds down to a multiple of 8, at most 255); setmaxnreg then moves them between
        warpgroups."""
        return min(255, REGISTERS_PER_SM // (self.num_threads * self.ctas_per_sm)) // 8 * 8

    def register_split_problem(self) -> Optional[str]:
        """Why the setmaxnreg split cannot run (None if it can): warpgroups that take more
        registers than the CTA got at launch wait in setmaxnreg.inc forever."""
        total = THREADS_PER_WARPGROUP * (
            self.producer_registers + self.num_mma_warpgroups * self.mma_registers
        )
        pool = self.entry_registers * self.num_threads
        if total <= pool:
            return None
        return (
            f"register split uses {total} registers per CTA, more than the {pool} a CTA gets "
            f"at launch ({self.entry_registers} per thread with {self.ctas_per_sm} CTA(s) per SM)"
        )

    def replace(self, **changes) -> "AttentionConfig":
        """A copy with some fields changed (registers re-derived unless given)."""
        if "tile_m" in changes or "ctas_per_sm" in changes or "o_split" in changes:
            changes.setdefault("producer_registers", None)
            changes.setdefault("mma_registers", None)
        return dataclasses.replace(self, **changes)

    def smem_limit(self) -> int:
        """Shared memory one CTA may use with ctas_per_sm CTAs resident on an SM."""
        return min(MAX_SMEM_BYTES_PER_BLOCK, SMEM_BYTES_PER_SM // self.ctas_per_sm - 1024)

    def separate_o_smem(
        self,
        head_dim: int,
        element_bytes: int = 2,
        head_dim_v: Optional[int] = None,
        v_in_k: bool = False,
    ) -> bool:
        """Whether O gets a smem tile of its own: persistent schedulers only (so the next
        tile's Q can load during this tile's epilogue), and only when it fits and O goes
        through smem at all (not store_o_from_registers); otherwise O reuses Q's tile when it
        goes through smem (which needs head_dim_v == head_dim)."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        o = _aligned_1k(self.tile_m * head_dim_v * element_bytes)
        without_o = self.smem_bytes(head_dim, element_bytes, head_dim_v, v_in_k, own_o=False)
        return (
            self.persistent
            and not self.store_o_from_registers
            and without_o + o <= self.smem_limit()
        )

    def smem_bytes(
        self,
        head_dim: int,
        element_bytes: int = 2,
        head_dim_v: Optional[int] = None,
        v_in_k: bool = False,
        kv_fp8: bool = False,
        fp8_math: bool = False,
        own_o: bool = True,
    ) -> int:
        """Dynamic shared memory of the kernel: Q (reused for a TMA-stored O unless
        separate_o_smem), O's own tile when separate_o_smem (and own_o), the K and V rings (no
        V ring with v_in_k: V is read from K's stages), P when it goes through shared memory,
        and the mbarriers; each buffer 1024-byte aligned. head_dim_v: V's and O's head dim
        (default head_dim). kv_fp8: an FP8 cache's blocks converted to fp16; fp8_math: FP8
        q, k and v in e4m3 GEMMs (kernels/v_transpose.py)."""
        aligned = _aligned_1k
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        o = 0
        if own_o and self.separate_o_smem(head_dim, element_bytes, head_dim_v, v_in_k):
            o = aligned(self.tile_m * head_dim_v * element_bytes)
        head_dim_v = 0 if v_in_k else head_dim_v  # (V read from K's stages: no ring of its own)
        # Q, K, V rings' mbarriers (FP8 K/V: twice, its FP8 rings; FP8 math has no K FP8
        # ring, counted anyway: a few bytes over), the tile handoff's 4 mbarriers and 2 int32
        # slots.
        fp8_rings = kv_fp8 or fp8_math
        mbarriers = aligned(8 * (2 + 4 * self.num_stages * (2 if fp8_rings else 1) + 4) + 8)
        # FP8 K/V: the fp16 rings the GEMMs read and the FP8 rings the loads fill. FP8 math:
        # FP8 Q and K, and V's FP8 ring and its transpose.
        q_bytes, k_bytes, v_bytes = (1, 1, 2) if fp8_math else (element_bytes,) * 3
        if kv_fp8 and not fp8_math:
            k_bytes = v_bytes = element_bytes + 1
        q = aligned(self.tile_m * head_dim * q_bytes)
        k = aligned(self.num_stages * self.tile_n * head_dim * k_bytes)
        v = aligned(self.num_stages * self.tile_n * head_dim_v * v_bytes)
        p = 0 if self.pv_from_registers else aligned(self.tile_m * self.tile_n * element_bytes)
        # split_scores: the row maxima and sums the two warpgroups exchange (fp32).
        rows = aligned(2 * 2 * self.tile_m * 4) if self.split_scores else 0
        return o + mbarriers + q + k + v + p + rows

    def accumulator_registers(self, head_dim: int, head_dim_v: Optional[int] = None) -> int:
        """fp32 registers per MMA thread held by accumulators at the busiest point:
        S (tile_n/2) and O (head_dim_v/2), plus P (tile_n/4, packed 16-bit) when P stays in
        registers across the next block's Q K^T."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        regs = self.tile_n // 2 // (2 if self.split_scores else 1) + head_dim_v // 2 // self.o_split
        if self.pv_from_registers and self.intra_wg_overlap:
            regs += self.tile_n // 4
        return regs

    def validate(
        self,
        head_dim: int,
        dtype: str = "bfloat16",
        head_dim_v: Optional[int] = None,
        v_in_k: bool = False,
    ) -> "AttentionConfig":
        """Raise ValueError if this config cannot run for head_dim/dtype (and V's head dim
        head_dim_v, default head_dim; v_in_k: V read from K's stages); return self."""
        check_head_dims(head_dim, head_dim_v, v_in_k)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        problems = []
        if not (16 <= self.tile_n <= 256 and self.tile_n % 16 == 0):
            problems.append(
                f"tile_n={self.tile_n} must be a multiple of 16 in [16, 256] (WGMMA N <= 256; "
                "P V consumes keys 16 at a time)"
            )
        if self.num_stages < 2:
            problems.append(f"num_stages={self.num_stages} must be >= 2")
        if self.pingpong and self.tile_m < 128:
            problems.append("pingpong needs at least 2 MMA warpgroups (tile_m >= 128)")
        if self.o_split > 1 and self.pv_from_registers == self.split_scores:
            problems.append("o_split needs P from registers, or split_scores and P from smem")
        if self.split_scores and (
            self.o_split != 2
            or self.rescale_o_before_pv
            or self.lazy_rescale
            or self.rescale_threshold
            or self.tile_n % 32
        ):
            problems.append(
                "split_scores needs o_split 2, no rescale_o_before_pv, no "
                "lazy_rescale or rescale_threshold, and tile_n % 32 == 0"
            )
        if self.rescale_o_before_pv and not self.intra_wg_overlap:
            problems.append("rescale_o_before_pv needs intra_wg_overlap")
        if self.seesaw and not (
            (self.tile_m, self.tile_n, self.num_stages) == (64, 64, 2)
            and self.split_scores
            and self.store_o_from_registers
            and not self.persistent
        ):
            problems.append(
                "seesaw needs the wide latent config: tile 64 x 64, two stages, split_scores, "
                "O from registers, one CTA per tile"
            )
        if self.seesaw_rows not in (64, *TRANSPOSED_ROWS) or (
            self.seesaw_rows < 64 and not self.seesaw
        ):
            problems.append(
                f"seesaw_rows={self.seesaw_rows} must be 64, or 16 or 32 with seesaw (the "
                "transposed kernel)"
            )
        if not 1 <= self.transpose_batch <= 4:
            problems.append(f"transpose_batch={self.transpose_batch} must be in [1, 4]")
        if not 1 <= self.gather_lookahead <= 32:
            problems.append(f"gather_lookahead={self.gather_lookahead} must be in [1, 32]")
        elif self.gather_lookahead > 1 and self.producer_registers < 128:
            problems.append(
                f"gather_lookahead={self.gather_lookahead} needs producer_registers >= 128 "
                f"(the read-ahead page-table entries live in registers), got "
                f"{self.producer_registers}"
            )
        for name in ("producer_registers", "mma_registers"):
            value = getattr(self, name)
            if not isinstance(value, int) or not (24 <= value <= 256 and value % 8 == 0):
                problems.append(
                    f"{name}={value!r} must be a multiple of 8 in [24, 256] (setmaxnreg)"
                )
        if not problems:
            split_problem = self.register_split_problem()
            if split_problem:
                problems.append(split_problem)
            acc = self.accumulator_registers(head_dim, head_dim_v)
            if acc > self.mma_registers - REGISTER_HEADROOM:
                problems.append(
                    f"accumulators need ~{acc} registers per MMA thread, more than mma_registers "
                    f"- {REGISTER_HEADROOM} = {self.mma_registers - REGISTER_HEADROOM}"
                )
        if self.seesaw and not (v_in_k and (head_dim, head_dim_v) == (576, 512)):
            problems.append("seesaw serves absorbed MLA only: head_dim 576, head_dim_v 512, V in K")
        smem = self.smem_bytes(head_dim, 2, head_dim_v, v_in_k)
        smem_limit = self.smem_limit()
        dims = f"head_dim={head_dim}" + (
            f", head_dim_v={head_dim_v}" if head_dim_v != head_dim else ""
        )
        if smem > smem_limit:
            problems.append(
                f"needs {smem} bytes of shared memory for {dims}, more than the "
                f"{smem_limit} a Hopper CTA can have with {self.ctas_per_sm} CTA(s) per SM"
            )
        if problems:
            raise ValueError(f"invalid {self} for {dims}: " + "; ".join(problems))
        return self


# (head_dim, causal) -> config for long sequences, from FlashAttention-3's (hopper/tile_size.h)
# and FlashAttention-4's SM90 tiles, then `python -m flash_cute.bench sweep` and interleaved A/B
# runs on the H100; PERF_NOTES.md has each change's prediction and outcome.
def _row(tile_m, tile_n, **knobs) -> AttentionConfig:
    return AttentionConfig(tile_m=tile_m, tile_n=tile_n, **knobs)


# Lazy rescale, max lagging 8 log2 units, on every prefill row: +0.3-6% over the rows without.
_LAZY = dict(lazy_rescale=True, rescale_threshold=8)
_BY_HEAD_DIM = {
    # Static persistent + lazy rescale: +1.4-6.6% at 8k-16k; O from registers: +0.4-9% (H100).
    (64, False): _row(
        192,
        128,
        scheduler="static_persistent",
        mbarrier_probe=True,
        rescale_o_before_pv=True,
        store_o_from_registers=True,
        **_LAZY,
    ),
    # Dynamic persistent: +1.5-14% over one CTA per tile at 2k-16k; lazy rescale +1-6% (H100).
    (64, True): _row(192, 128, scheduler="dynamic_persistent", mbarrier_probe=True, **_LAZY),
    # P through smem (P from registers spills at 192 rows); beat 192 x 144 by 2-11% (H100).
    (96, False): _row(
        192,
        128,
        pv_from_registers=False,
        scheduler="dynamic_persistent",
        rescale_o_before_pv=True,
        **_LAZY,
    ),
    # O rescale under Q K^T with the lazy rescale: +2-4% at 2k-16k (H100).
    (96, True): _row(
        192,
        128,
        pv_from_registers=False,
        scheduler="dynamic_persistent",
        rescale_o_before_pv=True,
        **_LAZY,
    ),
    # 3 warpgroups, P through smem: 655 vs 628 TFLOP/s at 4k against 128 x 128 RS (H100).
    (128, False): _row(192, 128, pv_from_registers=False, scheduler="dynamic_persistent", **_LAZY),
    # 128 x 128 RS, dynamic persistent: +10-24% at 512-2k, +1-4% from 4k (H100).
    (128, True): _row(128, 128, scheduler="dynamic_persistent", **_LAZY),
    # Key blocks of 64, no ping-pong, O rescale under Q K^T: +3-16% over 128 x 112 (H100).
    (192, False): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        **_LAZY,
    ),
    # As the non-causal row: +4.5-21% over 128 x 112 at 512-16k (H100).
    (192, True): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        **_LAZY,
    ),
    # Key blocks of 64, one CTA per tile from 8k: +0.2-5.5% over 128 x 80 at 512-16k (H100).
    (256, False): _row(128, 64, pingpong=False, rescale_o_before_pv=True, **_LAZY),
    # Key blocks of 64, dynamic persistent: +0.3-6% over 128 x 80 at 512-16k (H100).
    (256, True): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        **_LAZY,
    ),
}

# (head_dim, head_dim_v, causal) -> config where V's head dim differs from q's. (192, 128),
# DeepSeek V3 / Kimi K2 prefill: FlashAttention-3's tile for the pair (hopper/tile_size.h:
# 128 x 128, P from registers, O rescaled under Q K^T, no ping-pong). Swept on an H100 (16
# heads, 4k and 16k, bf16, 12 tiles of 128 rows): first non-causal; causal, 128 x 112 with
# ping-pong led the sweep by 2% but measured level in the prefill bench (0.96-1.03x the
# earlier run's TFLOP/s at 1k-16k, both dtypes), so the row stays. Other pairs take the row of
# the larger head dim, whose tile fits both (test_config checks).
_BY_HEAD_DIMS = {
    (192, 128, causal): _row(
        128,
        128,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        **_LAZY,
    )
    for causal in (False, True)
}
PAIR_CONFIGS = {
    (head_dim, head_dim_v, dtype, causal): config
    for (head_dim, head_dim_v, causal), config in _BY_HEAD_DIMS.items()
    for dtype in SUPPORTED_DTYPES
}

FORWARD_CONFIGS = {
    (head_dim, dtype, causal): config
    for (head_dim, causal), config in _BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}

# (head_dim, causal) -> (longest seqlen_q it serves, config): fewer, shorter tiles win while
# there are few query rows per (batch, head).
_SHORT_BY_HEAD_DIM = {
    # 128 x 128 dynamic: 242 / 327 against 214 / 292 TFLOP/s at 512 / 1k for 192 x 128 (H100).
    (64, True): (
        1024,
        _row(128, 128, scheduler="dynamic_persistent", mbarrier_probe=True, **_LAZY),
    ),
    # 128 x 128 RS dynamic: 523-631 against 456-598 TFLOP/s at 512-2k for 192 x 128 SS (H100).
    (128, False): (2048, _row(128, 128, scheduler="dynamic_persistent", **_LAZY)),
    # Dynamic persistent: +0.9-1.8% over one CTA per tile at 2k-4k (H100).
    (256, False): (
        4096,
        _row(
            128,
            64,
            pingpong=False,
            rescale_o_before_pv=True,
            scheduler="dynamic_persistent",
            **_LAZY,
        ),
    ),
}
SHORT_SEQUENCE_CONFIGS = {
    (head_dim, dtype, causal): entry
    for (head_dim, causal), entry in _SHORT_BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}


# Short sliding windows (each row sees at most `span` keys): a tile's rows span few key blocks,
# so per-tile latency dominates and several CTAs per SM hide it. hdim 64, causal windows of
# 128 / 256 / 512 / 1024 keys at 8k, TFLOP/s on visible pairs: 165 / 260 / 338 / 394 against
# 101 / 163 / 254 / 355 for the causal row's 192 x 128 (H100; gpt-oss 64/8 heads: 1.6x / 1.2x /
# 1.0x flash-attn-4 at 128 / 512 / 1024). Longer windows keep the causal row (0.96-0.98x of
# flash-attn-4 at 4096); this row is unmeasured there.
_SHORT_WINDOW_BY_HEAD_DIM = {
    64: (
        1025,
        _row(
            64,
            64,
            num_stages=3,
            pingpong=False,
            ctas_per_sm=3,
            scheduler="dynamic_persistent",
            mbarrier_probe=True,
            **_LAZY,
        ),
    ),
}
SHORT_WINDOW_CONFIGS = {
    (head_dim, dtype): entry
    for head_dim, entry in _SHORT_WINDOW_BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}


# Decode-like problems (at most 64 query rows per (batch, kv head) after GQA packing): one MMA
# warpgroup of 64 rows and the deepest K/V ring that fits, since these are bandwidth bound.
DECODE_ROWS = 64
_DECODE_BY_HEAD_DIM = {
    64: _row(64, 128, num_stages=4, pingpong=False),
    96: _row(64, 128, num_stages=4, pingpong=False),
    # Two stages: 1-5% faster than three on H100 decode graph replays at 1k-128k keys, batch
    # 1-128 (3 stages: 1419 vs 1380 us at 4.3 GB of K+V).
    128: _row(64, 128, num_stages=2, pingpong=False),
    192: _row(64, 128, num_stages=2, pingpong=False),
    256: _row(64, 64, num_stages=3, pingpong=False),
}
DECODE_CONFIGS = {
    (head_dim, dtype): config
    for head_dim, config in _DECODE_BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}


def decode_config(
    head_dim: int, dtype: str, head_dim_v: Optional[int] = None, v_in_k: bool = False
) -> AttentionConfig:
    """The config for decode-like problems (few query rows per kv head); with a V head dim
    head_dim_v other than head_dim, the row of the larger one (or the next larger one with a
    row); a head dim above 256 (V's or q/k's): wide_config."""
    check_head_dims(head_dim, head_dim_v, v_in_k)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if max(head_dim, head_dim_v) > 256:
        return wide_config(head_dim, head_dim_v, v_in_k)
    try:
        return DECODE_CONFIGS[(table_head_dim(max(head_dim, head_dim_v)), dtype)]
    except KeyError:
        raise ValueError(
            f"no decode config for head_dim={head_dim}, dtype={dtype}: supported head dims are "
            f"{SUPPORTED_HEAD_DIMS} and dtypes {SUPPORTED_DTYPES}"
        ) from None


def fp8_kv_config(config: AttentionConfig, head_dim: int, head_dim_v: int) -> AttentionConfig:
    """The form of a table row that reads an FP8 K/V cache (kernels/kv_dequant.py): one CTA
    per tile (the plan's rule for the converting warps' kernels), one MMA
    warpgroup of 64 rows, and two stages of both the FP8 and the fp16 rings, on the row's key
    block or, where those do not fit, 64 keys."""
    config = config.replace(
        tile_m=64,
        pingpong=False,
        o_split=1,
        split_scores=False,
        pv_from_registers=True,
        scheduler="single_tile",
        num_stages=2,
        ctas_per_sm=1,  # (the register split below assumes the whole file)
        rescale_o_before_pv=config.rescale_o_before_pv and config.intra_wg_overlap,
        # The converting warps hold up to 16 pieces of 16 values per thread and block (two
        # of them, beside two gathering warps); 96 registers spilled with three warps' 11.
        producer_registers=200,
        mma_registers=None,
    )
    if config.smem_bytes(head_dim, 2, head_dim_v, kv_fp8=True) > config.smem_limit():
        config = config.replace(tile_n=64)
    return config


def fp8_math_config(
    config: AttentionConfig,
    head_dim: int,
    head_dim_v: int,
    decode_like: bool = False,
    causal: bool = False,
) -> AttentionConfig:
    """The form of a table row for FP8 queries, keys and values in e4m3 GEMMs
    (kernels/v_transpose.py): P from registers, O from registers (Q's FP8 tile cannot hold
    it), and no lagging row max (P must stay within e4m3's range: 2^8 at most).

    Prefill: persistent CTAs taking tiles from the dynamic scheduler (H100, paper grid beside
    one CTA per tile: +2-10% at 15 of 18 points, causal 2k up to +18%; a static grid is
    slower causal), and the widest key blocks whose scores, P and O fit the MMA warps'
    registers without spills (FP8 GEMMs halve the time a block's GEMMs hide its softmax and
    transpose behind), two stages of K, of V and of V^T: head dim 64, three MMA warpgroups
    over 128-key blocks; up to 128, two over 192; above, two over 96 (H100, paper grid at 2k
    and 16k against 128 x 128 / 128 x 64: +8-20%, +9-26%, +17-55%; 224 and 128 keys spill
    there: PERF_NOTES "FP8 math"). Decode-like
    rows: one MMA warpgroup, 64-key blocks in four stages, no intra-warpgroup overlap (which
    holds K's and V's stages through each softmax; H100, GQA 32/8 d128: 2.3 -> 2.8-3.1 TB/s
    contiguous).

    causal: the rows are causal or local. Unmasked rows up to head dim 128 take 3 of every 16
    exponentials on the FMA pipe (exp2_on_fma): an FP8 block's GEMMs take as long as its
    exponentials on the MUFU there (H100, d128 non-causal, three interleaved runs: +1-11%;
    causal -5..+4%, d64 -1..+6%: left off)."""
    # Registers: the transposing warps hold transpose_batch ldmatrix results (v_transpose.py),
    # the loading warp a varlen tile's bounds; 24 spill, 56 suffice beside 192-key blocks,
    # 72 elsewhere (72 spill at head dim 256 with one MMA warpgroup, which leaves 128 spare).
    if decode_like:
        shape = dict(tile_m=64, tile_n=64, num_stages=4, intra_wg_overlap=False)
        shape.update(producer_registers=128, mma_registers=None, scheduler="single_tile")
    else:
        widest = max(head_dim, head_dim_v)
        shape = dict(tile_m=128, tile_n=96, num_stages=2, scheduler="dynamic_persistent")
        shape.update(producer_registers=72, mma_registers=216)
        if widest <= 128:  # (128 x 224 at 40 / 232 spills with sinks, a window, packed keys)
            shape.update(tile_n=192, producer_registers=56, mma_registers=224)
        if widest <= 64:  # (three MMA warpgroups: 144 registers each)
            shape.update(tile_m=192, tile_n=128, producer_registers=72, mma_registers=144)
    # (exp2_on_fma: slower at every head dim in 16-bit math; in FP8, unmasked 96-128 only.)
    fma_exponentials = not decode_like and not causal and 64 < max(head_dim, head_dim_v) <= 128
    # (Without the overlap, plan._effective_config drops rescale_o_before_pv.)
    return config.replace(
        pv_from_registers=True,
        o_split=1,
        split_scores=False,
        ctas_per_sm=1,  # (short-window rows take 3; the register splits assume the whole file)
        store_o_from_registers=True,
        rescale_threshold=0,
        exp2_on_fma=3 if fma_exponentials else 0,
        **shape,
    )


def default_config(
    head_dim: int,
    dtype: str,
    causal: bool,
    seqlen_q: Optional[int] = None,
    window_span: Optional[int] = None,
    head_dim_v: Optional[int] = None,
    v_in_k: bool = False,
) -> AttentionConfig:
    """The table's config for this problem; ValueError for an unsupported head dim or dtype.
    With seqlen_q, short sequences may get their own config (SHORT_SEQUENCE_CONFIGS); with
    window_span (the most keys a row of a local mask can see), short windows may
    (SHORT_WINDOW_CONFIGS). Other local masks take the causal rows. A V head dim head_dim_v
    other than head_dim takes its pair's row (PAIR_CONFIGS), or the larger head dim's; a head
    dim above 256 (V's or q/k's) wide_config. A head dim without a row takes the next larger one's
    (table_head_dim)."""
    check_head_dims(head_dim, head_dim_v, v_in_k)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if max(head_dim, head_dim_v) > 256:
        return wide_config(head_dim, head_dim_v, v_in_k)
    if head_dim_v != head_dim:
        pair = PAIR_CONFIGS.get((head_dim, head_dim_v, dtype, bool(causal)))
        if pair is not None:
            return pair
    head_dim = table_head_dim(max(head_dim, head_dim_v))
    short_window = SHORT_WINDOW_CONFIGS.get((head_dim, dtype))
    if short_window is not None and window_span is not None and window_span <= short_window[0]:
        return short_window[1]
    short = SHORT_SEQUENCE_CONFIGS.get((head_dim, dtype, bool(causal)))
    if short is not None and seqlen_q is not None and seqlen_q <= short[0]:
        return short[1]
    try:
        return FORWARD_CONFIGS[(head_dim, dtype, bool(causal))]
    except KeyError:
        raise ValueError(
            f"no forward config for head_dim={head_dim}, dtype={dtype}: supported head dims are "
            f"{SUPPORTED_HEAD_DIMS} and dtypes {SUPPORTED_DTYPES}"
        ) from None
