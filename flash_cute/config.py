"""Forward-kernel configurations: the knobs, their validation, and the per-head-dim table.

A config is data: one frozen `AttentionConfig` per (head_dim, dtype, causal) row of
`FORWARD_CONFIGS`. Users may pass their own config to override the table (for research);
`AttentionConfig.validate` refuses configs that cannot run (shared memory, registers,
instruction shapes) with a ValueError saying which limit was broken.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = ("float16", "bfloat16")

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
    ctas_per_sm: CTAs the launch asks to fit on one SM (1 or 2); 2 halves the registers and
        shared memory each may use, for short, bandwidth-bound tiles.
    scheduler: how tiles reach CTAs (see TILE_SCHEDULERS). "single_tile": one CTA per tile,
        the hardware hands out CTAs. "static_persistent": at most SMs x ctas_per_sm CTAs loop
        over the tiles round-robin, so a tile's epilogue overlaps the next tile's loads (a
        TMA-stored O gets its own shared memory when it fits). "dynamic_persistent": the same, but each CTA
        takes its next tile from a global counter, which balances causal tiles of unequal
        length. Both persistent kinds apply to unsplit problems, fixed-length and varlen;
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

    def __post_init__(self):
        for name in (
            "tile_m",
            "tile_n",
            "num_stages",
            "ctas_per_sm",
            "l2_section_mb",
            "exp2_on_fma",
            "rescale_threshold",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"AttentionConfig.{name} must be an int, got {value!r}")
        if self.scheduler not in TILE_SCHEDULERS:
            raise ValueError(
                f"AttentionConfig.scheduler must be one of {TILE_SCHEDULERS}, got {self.scheduler!r}"
            )
        for name in (
            "pv_from_registers",
            "intra_wg_overlap",
            "pingpong",
            "rescale_o_before_pv",
            "mbarrier_probe",
            "lazy_rescale",
            "store_o_from_registers",
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
                f"AttentionConfig.exp2_on_fma must be in [0, 16] (of every 16 exponentials), got {self.exp2_on_fma}"
            )
        if not 0 <= self.rescale_threshold <= 15:
            raise ValueError(
                f"AttentionConfig.rescale_threshold must be in [0, 15] (log2 units; probabilities reach "
                f"2^threshold, and fp16's max is below 2^16), got {self.rescale_threshold}"
            )
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"AttentionConfig.ctas_per_sm must be 1 or 2, got {self.ctas_per_sm}")
        split = DEFAULT_REGISTER_SPLIT[self.tile_m // 64]
        if self.ctas_per_sm == 2:  # half the register file each: scale the split down
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
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + self.num_mma_warpgroups)

    @property
    def entry_registers(self) -> int:
        """Registers per thread at launch: the SM's file shared by ctas_per_sm CTAs (ptxas
        rounds down to a multiple of 8, at most 255); setmaxnreg then moves them between
        warpgroups."""
        return min(255, REGISTERS_PER_SM // (self.num_threads * self.ctas_per_sm)) // 8 * 8

    def replace(self, **changes) -> "AttentionConfig":
        """A copy with some fields changed (registers re-derived unless given)."""
        if "tile_m" in changes or "ctas_per_sm" in changes:
            changes.setdefault("producer_registers", None)
            changes.setdefault("mma_registers", None)
        return dataclasses.replace(self, **changes)

    def smem_limit(self) -> int:
        """Shared memory one CTA may use with ctas_per_sm CTAs resident on an SM."""
        return min(MAX_SMEM_BYTES_PER_BLOCK, SMEM_BYTES_PER_SM // self.ctas_per_sm - 1024)

    def _smem_bytes_without_o(self, head_dim: int, element_bytes: int = 2) -> int:
        aligned = _aligned_1k
        # Q, K, V rings' mbarriers, the tile handoff's 4 mbarriers and 2 int32 slots.
        mbarriers = aligned(8 * (2 + 4 * self.num_stages + 4) + 8)
        q = aligned(self.tile_m * head_dim * element_bytes)
        kv = 2 * aligned(self.num_stages * self.tile_n * head_dim * element_bytes)
        p = 0 if self.pv_from_registers else aligned(self.tile_m * self.tile_n * element_bytes)
        return mbarriers + q + kv + p

    def separate_o_smem(self, head_dim: int, element_bytes: int = 2) -> bool:
        """Whether O gets a smem tile of its own: persistent schedulers only (so the next
        tile's Q can load during this tile's epilogue), and only when it fits and O goes
        through smem at all (not store_o_from_registers); otherwise O reuses Q's tile when it
        goes through smem."""
        o = _aligned_1k(self.tile_m * head_dim * element_bytes)
        return (
            self.persistent
            and not self.store_o_from_registers
            and self._smem_bytes_without_o(head_dim, element_bytes) + o <= self.smem_limit()
        )

    def smem_bytes(self, head_dim: int, element_bytes: int = 2) -> int:
        """Dynamic shared memory of the kernel: Q (reused for a TMA-stored O unless
        separate_o_smem), O's own tile when separate_o_smem, the K and V rings, P when it goes
        through shared memory, and the mbarriers; each buffer 1024-byte aligned."""
        o = 0
        if self.separate_o_smem(head_dim, element_bytes):
            o = _aligned_1k(self.tile_m * head_dim * element_bytes)
        return self._smem_bytes_without_o(head_dim, element_bytes) + o

    def accumulator_registers(self, head_dim: int) -> int:
        """fp32 registers per MMA thread held by accumulators at the busiest point:
        S (tile_n/2) and O (head_dim/2), plus P (tile_n/4, packed 16-bit) when P stays in
        registers across the next block's Q K^T."""
        regs = self.tile_n // 2 + head_dim // 2
        if self.pv_from_registers and self.intra_wg_overlap:
            regs += self.tile_n // 4
        return regs

    def validate(self, head_dim: int, dtype: str = "bfloat16") -> "AttentionConfig":
        """Raise ValueError if this config cannot run for head_dim/dtype; return self."""
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
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
        if self.pingpong and self.num_mma_warpgroups < 2:
            problems.append("pingpong needs at least 2 MMA warpgroups (tile_m >= 128)")
        if self.rescale_o_before_pv and not self.intra_wg_overlap:
            problems.append("rescale_o_before_pv needs intra_wg_overlap")
        for name in ("producer_registers", "mma_registers"):
            value = getattr(self, name)
            if not isinstance(value, int) or not (24 <= value <= 256 and value % 8 == 0):
                problems.append(
                    f"{name}={value!r} must be a multiple of 8 in [24, 256] (setmaxnreg)"
                )
        if not problems:
            total = THREADS_PER_WARPGROUP * (
                self.producer_registers + self.num_mma_warpgroups * self.mma_registers
            )
            pool = self.entry_registers * self.num_threads
            if total > pool:
                problems.append(
                    f"register split uses {total} registers per CTA, more than the {pool} a CTA "
                    f"gets at launch ({self.entry_registers} per thread with {self.ctas_per_sm} CTA(s) per SM)"
                )
            acc = self.accumulator_registers(head_dim)
            if acc > self.mma_registers - REGISTER_HEADROOM:
                problems.append(
                    f"accumulators need ~{acc} registers per MMA thread, more than "
                    f"mma_registers - {REGISTER_HEADROOM} = {self.mma_registers - REGISTER_HEADROOM}"
                )
        smem = self.smem_bytes(head_dim)
        smem_limit = self.smem_limit()
        if smem > smem_limit:
            problems.append(
                f"needs {smem} bytes of shared memory for head_dim={head_dim}, more than the "
                f"{smem_limit} a Hopper CTA can have with {self.ctas_per_sm} CTA(s) per SM"
            )
        if problems:
            raise ValueError(f"invalid {self} for head_dim={head_dim}: " + "; ".join(problems))
        return self


# (head_dim, dtype, causal) -> config for long sequences. Starting points were FlashAttention-3
# (hopper/tile_size.h) and FlashAttention's CuTe DSL package (_tile_size_fwd_sm90); each row
# says what the H200 sweeps (benchmarks/sweeps, BENCHMARKS.md) measured for it.
def _row(tile_m, tile_n, **knobs) -> AttentionConfig:
    return AttentionConfig(tile_m=tile_m, tile_n=tile_n, **knobs)


_BY_HEAD_DIM = {
    # 3 warpgroups, P in registers: best of 36 configs at 512-8k (511 TFLOP/s at 8k; the next,
    # 192x96, 500). Ping-pong is worth 7% here. Without the lazy rescale, one CTA per tile led
    # at 16k (H100: 536-549 against 525-533 static persistent) and a static persistent short
    # row served up to 8k. Polling the K/V barriers before the blocking wait: +0.4-2.6% at 1k-16k (H100).
    # Static persistent CTAs hide each tile's prologue and epilogue under the next tile's loads:
    # +10-20% at 512-1k (H100, benchmarks/sweeps/scheduler_h100/sched64_*). Sixth session (H100):
    # with the lazy O rescale (max lagging 8 log2 units) done under the Q K^T, +1.4-6.6% at
    # 8k-16k, +0.6-2.3% at 4k and +2% at 1k-2k over the earlier rows (two runs, bf16 and fp16;
    # the lazy rescale alone with one CTA per tile: +0-5%), so one row serves every length.
    # Eighth session (H100): O stored from registers (no smem round trip, no epilogue barriers
    # with the storing warp): +0.4 / +1 / +1.8 / +2-4 / 0-4 / +3-9% at 512 / 1k / 2k / 4k / 8k /
    # 16k in bf16 (four runs from 8k), +0.5-2.6% in fp16; level or slower at hdim 64 causal, 96,
    # 128, 192 and 256 (benchmarks/sweeps/o_from_registers_h100.log).
    (64, False): _row(
        192,
        128,
        scheduler="static_persistent",
        mbarrier_probe=True,
        rescale_o_before_pv=True,
        lazy_rescale=True,
        rescale_threshold=8,
        store_o_from_registers=True,
    ),
    # Dynamic persistent beats one CTA per tile at every length from 2k (H100: 423 / 464 / 507 /
    # 535 against 372 / 433 / 490 / 527 at 2k-16k).
    # Lazy O rescale with the row max allowed to lag 8 log2 units: +1-6% at 2k-16k (two H100
    # runs, bf16 and fp16); on the non-causal row it measured level (-1 to +1%).
    (64, True): _row(
        192,
        128,
        scheduler="dynamic_persistent",
        mbarrier_probe=True,
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    # P from registers with 192-row tiles spills at head dim 96, so P goes through smem.
    # Dynamic persistent: +2-5% at 1k-16k (H100: 444 / 529 / 591 / 616 / 628 against 424 / 512 /
    # 576 / 603 / 617 with one CTA per tile, benchmarks/sweeps/scheduler_h100/sched96.json).
    # Eighth session (H100): 192 x 128 with O rescaled under the Q K^T and the lazy rescale (max
    # lagging 8) beat 192 x 144 at every length in two interleaved runs: bf16 +8-11% / +5-6% /
    # +3% / +2-4.5% at 2k / 4k / 8k / 16k, fp16 +10-11% / +2-4% / +1-2% at 2k / 8k / 16k (a
    # 48-config sweep ranked 192 x 128-160 with both knobs first; benchmarks/sweeps/hdim96_h100).
    (96, False): _row(
        192,
        128,
        pv_from_registers=False,
        scheduler="dynamic_persistent",
        rescale_o_before_pv=True,
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    # Eighth session (H100): O rescaled under the Q K^T with the lazy rescale (max lagging 8):
    # +2-4% at 2k-16k in two interleaved runs, bf16 and fp16 (the lazy rescale alone +1-5%;
    # benchmarks/sweeps/hdim96_h100/knobs96c.log).
    (96, True): _row(
        192,
        128,
        pv_from_registers=False,
        scheduler="dynamic_persistent",
        rescale_o_before_pv=True,
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    # 3 warpgroups with P through smem win from 4k (655 vs 628 TFLOP/s at 4k, 673 vs 660 at 8k);
    # dynamic persistent adds 1-2% (H100: 653 / 673 / 682 against 641 / 666 / 675 at 4k-16k).
    # Lazy O rescale, max lagging up to 8 log2 units: +0.9-1.1% at 4k-16k (H100, bf16 and fp16).
    (128, False): _row(
        192,
        128,
        pv_from_registers=False,
        scheduler="dynamic_persistent",
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    # 128x128 RS leads at every length (600 at 8k); ping-pong on or off within 1%. Dynamic
    # persistent: +24% / +19% / +10% at 512 / 1k / 2k, +1-4% from 4k (H100, 331 / 473 / 591 /
    # 644 / 662 against 267 / 396 / 535 / 619 / 641).
    # Lazy O rescale, max lagging up to 8 log2 units: +0.3-5.5% at 2k-16k (two H100 runs, bf16
    # and fp16; +3-5.5% at 4k and 16k).
    (128, True): _row(
        128, 128, scheduler="dynamic_persistent", lazy_rescale=True, rescale_threshold=8
    ),
    # Large O accumulators: no ping-pong; rescale O under the Q K^T instead.
    # Dynamic persistent: +1-7% at 1k-16k (H100: 621 / 723 / 705 / 729 / 767 against 578 / 695 /
    # 686 / 717 / 761; static persistent 562-633, sched192.json).
    # Eighth session (H100): key blocks of 64 with the lazy rescale (max lagging 8) beat 128 x 112
    # at every length in two interleaved runs: non-causal +12% / +16% / +3% / +7% at 512 / 2k / 8k
    # / 16k (fp16 +7-13% / +3% at 2k / 8k), causal +20% / +21% / +14-19% / +8.5% / +4.5% / +5-6%
    # at 512-16k (fp16 +20% / +12% / +4.5-8% at 512 / 2k / 8k); a 120-config causal sweep at
    # 512-2k ranked it first (benchmarks/sweeps/hdim192_h100/).
    (192, False): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    (192, True): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    # 128 x 80 is the largest tile whose two-stage K/V ring fits in shared memory; rescaling O
    # before P V is worth 24% at 8k (753 vs 609), ping-pong costs 7%. Non-causal from 8k: one
    # CTA per tile (persistent level at 8k, 0.5-2.3% behind at 16k; up to 4k SHORT_SEQUENCE_CONFIGS).
    # Ninth session (H100): key blocks of 64 with the lazy rescale (max lagging 8) beat 128 x 80
    # at all 28 points of two interleaved runs (bf16 and fp16, causal and not, 512-16k): +5.5% at
    # 512, +2% at 1k, +2-3% at 2k, +1-2% at 4k, +1-3% at 8k, +0.2-0.3% at 16k non-causal; causal
    # +2.6-3.9% at 512-2k, +0.7-1.8% at 4k-8k, +0.3-6% at 16k (after two eighth-session runs at
    # +0.2-3.3%, one point -0.7%; benchmarks/sweeps/hdim256_tile64_lazy_h100*.log).
    (256, False): _row(
        128, 64, pingpong=False, rescale_o_before_pv=True, lazy_rescale=True, rescale_threshold=8
    ),
    # Dynamic persistent: +2-5% at every length (H100: 307 / 476 / 616 / 649 / 696 / 715
    # against 300 / 453 / 596 / 638 / 687 / 710 at 512-16k).
    # Lazy O rescale, max lagging up to 8 log2 units: level on the padded grid (+0.1-0.6% at
    # 4k-16k, H100, bf16 and fp16), +5-6% on the varlen causal batch (8 x 500-4000, two runs).
    # Ninth session: key blocks of 64 (see the non-causal row).
    (256, True): _row(
        128,
        64,
        pingpong=False,
        rescale_o_before_pv=True,
        scheduler="dynamic_persistent",
        lazy_rescale=True,
        rescale_threshold=8,
    ),
}

FORWARD_CONFIGS = {
    (head_dim, dtype, causal): config
    for (head_dim, causal), config in _BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}

# (head_dim, causal) -> (longest seqlen_q it serves, config): fewer, shorter tiles win while
# there are few query rows per (batch, head).
_SHORT_BY_HEAD_DIM = {
    # 128x128 dynamic: 242 / 327 at 512 / 1k against 214 / 292 for 192x128 dynamic and 172 /
    # 263 for 128x128 with one CTA per tile (H100).
    # Lazy O rescale (max lagging up to 8 log2 units): +0.6-0.9% at 512 / 1k.
    (64, True): (
        1024,
        _row(
            128,
            128,
            scheduler="dynamic_persistent",
            mbarrier_probe=True,
            lazy_rescale=True,
            rescale_threshold=8,
        ),
    ),
    # 128x128 RS dynamic: 523 / 587 / 631 at 512 / 1k / 2k against 456 / 526 / 598 for 192x128
    # SS dynamic and 439 / 531 / 590 for 128x128 RS with one CTA per tile (H100).
    # Lazy O rescale (max lagging up to 8 log2 units): +2-6% at 512-2k (H100, bf16 and fp16).
    (128, False): (
        2048,
        _row(128, 128, scheduler="dynamic_persistent", lazy_rescale=True, rescale_threshold=8),
    ),
    # Dynamic persistent: 513 / 662 at 512 / 1k against 500 / 651 (H100); up to 4k in two
    # fifth-session sweeps, 729 / 714 and 702 / 694 at 2k / 4k against 716 / 704 and 696 / 686
    # with one CTA per tile, which is level at 8k and ahead at 16k (benchmarks/sweeps/hdim256_h100).
    # Ninth session: key blocks of 64 with the lazy rescale (see the long row).
    (256, False): (
        4096,
        _row(
            128,
            64,
            pingpong=False,
            rescale_o_before_pv=True,
            scheduler="dynamic_persistent",
            lazy_rescale=True,
            rescale_threshold=8,
        ),
    ),
}
SHORT_SEQUENCE_CONFIGS = {
    (head_dim, dtype, causal): entry
    for (head_dim, causal), entry in _SHORT_BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}


# Decode-like problems (at most 64 query rows per (batch, kv head) after GQA packing): one MMA
# warpgroup of 64 rows and the deepest K/V ring that fits, since these are bandwidth bound.
DECODE_ROWS = 64
_DECODE_BY_HEAD_DIM = {
    64: _row(64, 128, num_stages=4, pingpong=False),
    96: _row(64, 128, num_stages=4, pingpong=False),
    128: _row(64, 128, num_stages=3, pingpong=False),
    192: _row(64, 128, num_stages=2, pingpong=False),
    256: _row(64, 64, num_stages=3, pingpong=False),
}
DECODE_CONFIGS = {
    (head_dim, dtype): config
    for head_dim, config in _DECODE_BY_HEAD_DIM.items()
    for dtype in SUPPORTED_DTYPES
}


def decode_config(head_dim: int, dtype: str) -> AttentionConfig:
    """The config for decode-like problems (few query rows per kv head)."""
    try:
        return DECODE_CONFIGS[(head_dim, dtype)]
    except KeyError:
        raise ValueError(
            f"no decode config for head_dim={head_dim}, dtype={dtype}: supported head dims are "
            f"{SUPPORTED_HEAD_DIMS} and dtypes {SUPPORTED_DTYPES}"
        ) from None


def default_config(
    head_dim: int, dtype: str, causal: bool, seqlen_q: Optional[int] = None
) -> AttentionConfig:
    """The table's config for this problem; ValueError for an unsupported head dim or dtype.
    With seqlen_q, short sequences may get their own config (SHORT_SEQUENCE_CONFIGS)."""
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
