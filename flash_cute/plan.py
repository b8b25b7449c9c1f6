"""The plan step: which kernel variant a call launches, and with which launch constants.

`plan_forward` maps what the host knows of a call (a `Problem`: sizes, dtype and flags, never
tensor contents) and the caller's options to a `ForwardPlan`: the `ForwardVariant` to compile
and launch, the split count, the persistent grid's cap and the counters the launch needs.
Every rewrite of a config happens here and nowhere else:

- the config row: the caller's, or the decode table for decode-like problems (few query rows
  per kv head), or the prefill table (its short-sequence rows for short ones);
- packed GQA: on when the q heads of a kv head divide the tile's rows (unless refused);
  asked for, the largest group of them that divides the rows;
- the split count: the wave-efficiency heuristic when asked for (num_splits=0);
- the scheduler: split launches run one CTA per tile; a dynamic persistent config whose tiles
  fit in one wave of CTAs runs its static twin (same tile order, no tile counter);
- paged K/V: TMA boxes where a box of a multiple of 16 rows divides the page size and the key
  block and carries at least MIN_TMA_BOX_BYTES, otherwise (and for left-padded pages) rows
  gathered with cp.async, one CTA per tile (with one MMA warpgroup, 128 producer registers);
- the O store: split and varlen launches store O from registers (their rows are ragged), as
  do launches whose V head dim differs from q's where O has no smem tile of its own;
- ping-pong needs two MMA warpgroups, and the O rescale under Q K^T needs the overlap;
- the mask (attention_mask): causal, a local window or chunk, or none; a local mask takes the
  causal rows, and its split count counts only the keys a tile can see.

The kernel takes the variant whole and derives only device-side facts from it. Nothing here
reads a tensor or a device: the SM count is an argument, so a plan is a pure function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from .config import (
    DECODE_ROWS,
    TRANSPOSED_ROWS,
    AttentionConfig,
    decode_config,
    default_config,
    fp8_kv_config,
    fp8_math_config,
    seesaw_config,
)

MAX_SPLITS = 128
# Paged caches whose TMA boxes would carry fewer bytes gather rows with cp.async instead: an
# FP8 page of 16 rows of 128 is a 2 KB box, 16 TMA issues per key block (H200, batch 8 x 32k
# keys: TMA boxes 278 us, gathered rows 249 us).
MIN_TMA_BOX_BYTES = 4096
# Rows whose page-table entries a gathering producer thread reads before their copies, where
# it has the registers (AttentionConfig.gather_lookahead).
GATHER_LOOKAHEAD = 16
# A split launch merges in the kernel (its last split to finish reads every split's rows of
# the tile) while a tile's fp32 partials stay within this; above it the combine kernel, spread
# over the GPU, merges them after the launch (varlen launches, which the combine kernel cannot
# take, are split at most this far instead). One CTA reads partials at ~0.1 TB/s (latency-
# bound), so 1 MiB is ~10 us: absorbed MLA at batch 1 (61 splits of 64 rows x 512) spent ~110
# of its 120 us there on an H100. Wide partials (V above 256 wide, a tile's partial at least
# WIDE_PARTIAL_BYTES: absorbed MLA's 16-64 rows of 512) take the combine kernel at any split
# count: 128 heads 8 x 16k keys in 8 splits (1 MiB of partials a tile, merged in the kernel)
# took 100.5 us against 77.7 with the combine kernel (H100, the seesaw kernel; 16 heads 16 x
# 32k 211.7 against 207.8, separate processes, within their noise). Narrower partials (head
# dim 512 with a few q heads per kv head) keep the in-kernel merge they were measured with.
MERGE_IN_KERNEL_BYTES = 1 << 20
WIDE_PARTIAL_BYTES = 16 * 512 * 4
KV_LAYOUTS = ("padded", "packed", "paged")
# Absorbed-MLA decode takes the seesaw kernel (seesaw_route_problem) for these q heads on one latent
# head (DeepSeek V3's 128 and Kimi K2's 64 under tensor parallelism of 1-16) and up to this
# many query tokens (1-4: speculative decoding): the shapes its GPU tests cover. H100, bf16,
# graph replays beside the forward kernel's latent path, same process (2fdb219,
# BENCHMARKS.md): 128 heads 1 x 8k 25.0 us against 27.3, 8 x 16k (split) 78.9 against 87.2,
# 64 x 8k 265.4 against 322.7, 128 x 2 x 4k 502.4 against 633.7, 132 x 16k 1064 against 1314;
# 16 heads 16 x 32k 207.9 against 210.0, 64 x 8k 207.0 against 210.6. The heads and token
# counts beyond those (8 and 32 heads, 3-4 tokens): BENCHMARKS.md "MLA and wide heads".
SEESAW_HEADS = (8, 16, 32, 64, 128)
SEESAW_MAX_TOKENS = 4
# Whether the plan routes by seesaw_route_problem (off: the forward kernel's latent path, for A/B;
# FP8 latent calls, which only the seesaw kernel reads, then raise).
SEESAW_ROUTING = True
# Whether FP8 latent calls of at most 32 rows a sequence go to the transposed kernel
# (transposed_problem; kernels/mla_decode/transposed.py) rather than the seesaw, in tiles of
# 16 rows where a sequence's fit (transposed_rows), else 32.
SEESAW_TRANSPOSED = True


@dataclass(frozen=True)
class CallShape:
    """What a forward call is, statically: its dtype and head dims, its mask, how its queries
    and keys are laid out and which optional tensors it has. A Problem (what the plan step
    reads) and a ForwardVariant (what a kernel is compiled for) both hold one: the plan copies
    it over whole (`shape_fields`) and rewrites the fields it decides, by name (the mask's
    normal form: attention_mask; V read from K's columns for qv).

    causal is bottom-right aligned. FlashAttention-3's local attention: query i sees key j iff
    i + sk - sq - window_left <= j <= i + sk - sq + window_right (-1: unbounded), and with
    attention_chunk c also floor((i + sk - sq) / c) == floor(j / c); a Problem holds the
    caller's values (a window given with causal keeps its left side and gets a right side of
    0), a variant their normal form (a local variant is not causal: window_right = 0).
    """

    dtype: str  # "float16" | "bfloat16"
    head_dim: int  # q's and k's (with qv: qv's columns and q's)
    causal: bool = False
    writes_lse: bool = False  # the final LSE (split kernels write their partial LSEs regardless)
    varlen_q: bool = False  # q packed (total_q, ...) with cu_seqlens_q
    # "padded" (batch, seqlen_k, ...), "packed" (total_k, ...) with cu_seqlens_k, or "paged"
    # (num_pages, page_size, ...) with a page table.
    kv_layout: str = "padded"
    seqused_k: bool = False  # each sequence's valid keys from a (batch,) tensor
    scalar_kv_length: bool = False  # ... or from one int for every sequence
    seqused_q: bool = False  # a packed sequence's queries are the first seqused_q[b] rows
    kv_batch_idx: bool = False  # batch b reads cache row kv_batch_idx[b]
    leftpad_k: bool = False  # a cache row's keys start at leftpad_k[b]
    window_left: int = -1
    window_right: int = -1
    attention_chunk: int = 0
    softcap: float = 0.0  # scores become softcap * tanh(s * scale / softcap); 0: off
    learnable_sink: Optional[str] = None  # the (nheads,) sink logits' dtype; None: no sink
    head_dim_v: Optional[int] = None  # V's (and O's) head dim; None: head_dim
    # V is the first head_dim_v columns of K (absorbed MLA's latent cache, v = k[..., :dv]):
    # read from K's smem stages, never loaded.
    v_in_k: bool = False
    # FlashAttention-3's absorbed-MLA form: scores q k^T + qv v^T, with q and k head_dim -
    # head_dim_v wide and qv like q with head_dim_v; Q's and K's tiles hold qv / v's columns
    # then q / k's (so a variant's V is K's leading columns: v_in_k).
    qv: bool = False
    # The K/V cache's dtype where it differs from q's: "float8_e4m3fn" (an FP8 cache, its
    # blocks converted to fp16 before each GEMM: kernels/kv_dequant.py, unless q_dtype says
    # the GEMMs run in e4m3), else None.
    kv_dtype: Optional[str] = None
    # FP8 queries ("float8_e4m3fn", with an FP8 kv_dtype): a Problem's says the caller's q is
    # FP8; a variant's that the kernel takes it as it is and runs both GEMMs in e4m3
    # (kernels/v_transpose.py). A variant without it takes q converted to dtype.
    q_dtype: Optional[str] = None
    # Launched right after kv_append's kernel, which wrote kv_length rows more to each sequence
    # than its seqused_k count: a programmatically dependent launch whose CTAs wait for the
    # append's writes only where they read them (q, the blocks holding new rows).
    after_append: bool = False
    # The append is fused (FlashAttention-3's way; with after_append): the kernel writes the
    # new rows itself, each tile those in its key range (K(n_max-1)'s stage patched in shared
    # memory, the later loads after the writes), and rotates Q's tile; rotary_dim 0: no
    # rotation, else its pairs as rotary_interleaved says, the tables in rotary_dtype, q rows
    # at their sequence's position (+ their index: per_row).
    fused_append: bool = False
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    rotary_per_row: bool = False
    rotary_dtype: Optional[str] = None

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    def seesaw_problem(self) -> Optional[str]:
        """Why the absorbed-MLA decode kernel (kernels/mla_decode/, AttentionConfig.seesaw)
        cannot serve this shape, or None: it serves the latent (576 wide, V its first 512
        columns) or qv form (16-bit; the latent form's cache also FP8), over a padded or paged
        cache with per-sequence lengths (seqused_k), padded or packed (varlen_q) queries,
        plain or causal (the cache's layout is checked where its page size is known)."""
        if not ((self.v_in_k or self.qv) and (self.head_dim, self.head_dim_v) == (576, 512)):
            return "absorbed MLA only (head_dim 576, head_dim_v 512, V in K's columns or qv)"
        if self.kv_layout == "packed" or not self.seqused_k:
            return "a padded or paged cache with per-sequence lengths (seqused_k)"
        unserved = [
            name
            for name in (
                "kv_batch_idx",
                "leftpad_k",
                "softcap",
                "learnable_sink",
                "q_dtype",
                "after_append",
            )
            if getattr(self, name)
        ]
        if self.window_left >= 0 or self.window_right >= 0 or self.attention_chunk:
            unserved.append("local window or chunk")
        if self.kv_dtype is not None and self.qv:
            unserved.append("an FP8 cache in the qv form")
        return f"not served: {', '.join(unserved)}" if unserved else None


SHAPE_FIELDS = tuple(f.name for f in fields(CallShape))


def shape_fields(shape: CallShape) -> dict:
    """A CallShape's fields by name (what a variant takes over from its problem)."""
    return {name: getattr(shape, name) for name in SHAPE_FIELDS}


@dataclass(frozen=True, kw_only=True)
class Problem(CallShape):
    """Host-known sizes and flags of one forward call: its CallShape and its sizes. Queries
    are padded (batch, max_seqlen_q rows each) or, with varlen_q, packed as total_q rows."""

    batch: int
    nheads: int
    nheads_kv: int
    max_seqlen_q: int
    max_seqlen_k: int  # longest key length known on the host (guides the split count)
    kv_capacity: int  # keys a sequence can hold at most; 0: no keys anywhere
    total_q: int = 0  # rows of a packed q (varlen_q)
    page_size: Optional[int] = None

    @property
    def qheads_per_kvhead(self) -> int:
        return self.nheads // self.nheads_kv


@dataclass(frozen=True, kw_only=True)
class ForwardVariant(CallShape):
    """One compiled forward kernel: the record the cache key, the compile step and the kernel
    all take whole. `config` is the effective config, what the kernel runs (the plan step has
    applied every rewrite); the CallShape fields are the problem's static shape.

    pack_gqa_ratio: q heads per kv head folded into a tile's rows (1: none). A paged K/V load
    takes TMA boxes of page_box_rows rows (gcd(page_size, tile_n), a multiple of 16), or with
    gather_page_size (the page size, when no such box exists or rows start at an offset) is
    gathered row by row with cp.async (kernels/paged_kv_gather.py).
    """

    config: AttentionConfig
    page_box_rows: Optional[int] = None
    gather_page_size: Optional[int] = None
    split: bool = False
    # A split launch whose partials the combine kernel merges, launched after it (rather than
    # the last of a tile's splits: one CTA reading every split's rows; plan.MERGE_IN_KERNEL_BYTES).
    combine_launch: bool = False
    pack_gqa_ratio: int = 1
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        # Facts the plan step guarantees: a hand-built variant breaking one is refused here
        # rather than compiled into a kernel that cannot run.
        c = self.config
        problems = []
        if self.v_in_k and (self.head_dim_v > self.head_dim or self.head_dim_v % 64):
            problems.append("v_in_k reads V from K's columns: head_dim_v <= head_dim, % 64")
        if self.qv and not (self.v_in_k and self.head_dim > self.head_dim_v):
            problems.append("qv variants read V from K's columns (v_in_k), after which q's follow")
        if (
            self.head_dim_v != self.head_dim
            and not c.store_o_from_registers
            and not c.separate_o_smem(self.head_dim, 2, self.head_dim_v, self.v_in_k)
        ):
            problems.append("O goes through Q's smem tile only where head_dim_v == head_dim")
        if self.combine_launch and (not self.split or self.varlen_q):
            # (The combine kernel writes every row: a packed q's rows past its sequences stay
            # untouched only with the in-kernel merge.)
            problems.append("combine_launch merges a split, not varlen, launch's partials")
        if self.kv_layout not in KV_LAYOUTS:
            problems.append(f"kv_layout must be one of {KV_LAYOUTS}")
        if (self.kv_layout == "paged") != (
            (self.page_box_rows is not None) != (self.gather_page_size is not None)
        ):
            problems.append("paged K/V sets exactly one of page_box_rows and gather_page_size")
        elif self.gather_page_size is not None and c.scheduler != "single_tile":
            problems.append("gathered paged K/V runs one CTA per tile (scheduler 'single_tile')")
        elif self.page_box_rows is not None and (
            c.tile_n % self.page_box_rows or self.page_box_rows % 16
        ):
            problems.append("page_box_rows must divide tile_n and be a multiple of 16")
        if self.kv_dtype is not None and (
            self.kv_dtype != "float8_e4m3fn"
            or (self.v_in_k and not c.seesaw)
            or (self.q_dtype is None and c.scheduler != "single_tile")
        ):
            problems.append(
                "an FP8 (float8_e4m3fn) K/V cache runs on separate K and V stages (v_in_k: "
                "only in the seesaw kernel), one CTA per tile (scheduler 'single_tile') unless "
                "q is FP8 too"
            )
        elif self.q_dtype is not None and not (
            self.q_dtype == self.kv_dtype
            and c.pv_from_registers
            and c.store_o_from_registers
            and c.rescale_threshold == 0
            and c.o_split == 1
            and c.tile_n % 32 == 0
            and self.head_dim % 32 == 0
            and self.head_dim_v % 32 == 0
            and not self.qv
        ):
            problems.append(
                "FP8 math (q_dtype) takes FP8 q, k and v (no qv), P from registers never above "
                "2^8 (rescale_threshold 0), O from registers, one warpgroup per 64 rows, tile_n "
                "and both head dims multiples of 32"
            )
        elif self.kv_dtype is not None and not c.seesaw and self._fp8_smem_bytes() > c.smem_limit():
            problems.append(
                f"with an FP8 cache (FP8 rings, and fp16 or V^T rings) the config needs "
                f"{self._fp8_smem_bytes()} bytes of shared memory, more than "
                f"{c.smem_limit()}: fewer stages or a smaller tile_n"
            )
        if self.seqused_k and self.scalar_kv_length:
            problems.append("seqused_k and scalar_kv_length exclude each other")
        if self.after_append and not self.seqused_k:
            problems.append("after_append adds the rows appended to seqused_k's counts")
        if self.seqused_q and not self.varlen_q:
            problems.append("seqused_q shortens packed (varlen) queries")
        if self.fused_append and not (
            self.after_append
            and self.kv_layout != "packed"
            and not (self.kv_batch_idx or self.leftpad_k or self.varlen_q or self.v_in_k)
            and self.kv_dtype is None
            and self.window_left < 0
            and self.attention_chunk == 0
        ):
            # (every key row the append writes lies in some tile's key range, which writes it)
            problems.append(
                "a fused append writes padded or paged 16-bit cache rows of the batch's own "
                "row, no v_in_k (nor qv), no left window or chunk, after_append"
            )
        if self.rotary_dim and not (
            self.fused_append and self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim
        ):
            problems.append("rotary_dim: an even count <= head_dim, with fused_append")
        if c.seesaw:
            problem = self.seesaw_problem()
            if problem is None and not (
                self.kv_layout == "padded" or self.page_box_rows == c.tile_n
            ):
                problem = "pages of a multiple of 64 keys (TMA boxes of whole key blocks)"
            if problem is None and c.trace:
                problem = "no trace"
            if problem is None and c.seesaw_rows < 64 and not _transposed_form(self):
                problem = (
                    f"seesaw_rows {c.seesaw_rows} (the transposed kernel) reads an FP8 latent "
                    "cache only"
                )
            if problem is not None:
                problems.append(f"the seesaw (latent decode) kernel: {problem}")
        if self.leftpad_k and not (self.kv_layout == "padded" or self.gather_page_size):
            problems.append("leftpad_k offsets padded cache rows or gathered pages")
        if self.kv_batch_idx and self.kv_layout == "packed":
            problems.append("kv_batch_idx picks padded cache rows or page-table rows")
        split_problem = c.register_split_problem()
        if split_problem:  # (else setmaxnreg.inc waits forever)
            problems.append(split_problem)
        if c.tile_rows % self.pack_gqa_ratio:  # (tile_rows divides tile_m)
            problems.append("pack_gqa_ratio must divide the tile's rows (config.tile_rows)")
        if self.split and c.scheduler != "single_tile":
            problems.append("split launches run one CTA per tile (scheduler 'single_tile')")
        if (self.split or self.varlen_q or c.o_split > 1) and not c.store_o_from_registers:
            problems.append("split, varlen and o_split launches store O from registers")
        if c.o_split > 1 and (c.tile_m != 64 or c.pv_from_registers == c.split_scores):
            problems.append("o_split needs tile_m 64 and P from registers (smem: split_scores)")
        if c.pingpong and c.tile_m < 128:
            problems.append("pingpong needs two MMA warpgroups")
        if c.rescale_o_before_pv and not c.intra_wg_overlap:
            problems.append("rescale_o_before_pv needs intra_wg_overlap")
        if self.local and self.causal:
            problems.append("a local variant carries causality as window_right = 0")
        if min(self.window_left, self.window_right) < -1 or self.attention_chunk < 0:
            problems.append("window sides are -1 or >= 0, the chunk >= 0")
        if not self.softcap >= 0:
            problems.append("softcap must be >= 0")
        if problems:
            raise ValueError(f"invalid {self}: " + "; ".join(problems))
        # Hashed once: the compile cache looks variants up on every first call.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _VARIANT_FIELDS)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self):  # the cached hash is per process (string hashing is seeded)
        return {f: getattr(self, f) for f in _VARIANT_FIELDS}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(tuple(state[f] for f in _VARIANT_FIELDS)))

    def _fp8_smem_bytes(self) -> int:
        return self.config.smem_bytes(
            self.head_dim, 2, self.head_dim_v, kv_fp8=True, fp8_math=self.q_dtype is not None
        )

    @property
    def local(self) -> bool:
        """A sliding window or chunked local attention (not plain causal)."""
        return self.window_left >= 0 or self.window_right >= 0 or self.attention_chunk > 0

    def describe(self) -> str:
        """A short label: head dim, dtype, causal, tile, scheduler, and the problem flags."""
        c = self.config
        flags = [
            f"d{self.head_dim}"
            + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
            self.dtype,
            "causal" if self.causal else "full",
            f"{c.tile_m}x{c.tile_n}",
            c.scheduler,
        ]
        flags += [f"seesaw{c.seesaw_rows}" if c.seesaw_rows != 64 else "seesaw"] if c.seesaw else []
        flags += [
            name
            for name in (
                "writes_lse",
                "varlen_q",
                "seqused_q",
                "seqused_k",
                "kv_batch_idx",
                "leftpad_k",
                "v_in_k",
                "qv",
            )
            if getattr(self, name)
        ]
        flags += ["kv_length"] if self.scalar_kv_length else []
        flags += ["after-append"] if self.after_append else []
        flags += ["fused-append"] if self.fused_append else []
        flags += [f"rotary{self.rotary_dim}"] if self.rotary_dim else []
        flags += [f"kv-{self.kv_dtype}"] if self.kv_dtype is not None else []
        flags += ["fp8-math"] if self.q_dtype is not None else []
        flags += (
            []
            if self.kv_layout == "padded"
            else [f"{self.kv_layout}{self.page_box_rows or ''}"]
            if self.gather_page_size is None
            else [f"paged-gather{self.gather_page_size}"]
        )
        flags += (["split+combine"] if self.combine_launch else ["split"]) if self.split else []
        flags += [f"pack{self.pack_gqa_ratio}"] if self.pack_gqa_ratio > 1 else []
        if self.local:
            flags.append(f"window({self.window_left},{self.window_right})")
        flags += [f"chunk{self.attention_chunk}"] if self.attention_chunk else []
        flags += [f"softcap{self.softcap:g}"] if self.softcap else []
        flags += [f"sink-{self.learnable_sink}"] if self.learnable_sink else []
        return " ".join(flags)

    @property
    def uses_tile_counter(self) -> bool:
        """The dynamic persistent scheduler draws tiles from a global counter."""
        return self.config.scheduler == "dynamic_persistent"

    @property
    def takes_counters(self) -> bool:
        """Zeroed int32 counters: the dynamic scheduler's, or the per-tile arrivals of a split
        launch that merges in the kernel."""
        return self.uses_tile_counter or (self.split and not self.combine_launch)

    @property
    def descales_taken(self) -> tuple:
        """Whether the kernel takes (q_descale, k_descale, v_descale): K's and V's with an FP8
        cache, q's with FP8 math (kernels that convert FP8 queries get q_descale folded)."""
        fp8_cache = self.kv_dtype is not None
        return (self.q_dtype is not None, fp8_cache, fp8_cache)

    @property
    def takes_optionals(self) -> bool:
        """Whether the kernel uses any optional argument (LSE, varlen offsets, packed or paged
        K/V, seqused_k/q, cache batch index or left padding, learnable sink, split scratch, tile
        counter); one that uses none is compiled with the short signature (compile_cache.SHORT)."""
        return (
            self.writes_lse
            or self.varlen_q
            or self.kv_layout != "padded"
            or self.seqused_k
            or self.seqused_q
            or self.kv_batch_idx
            or self.leftpad_k
            or self.split
            or self.uses_tile_counter
            or self.learnable_sink is not None
            or self.qv
            or self.kv_dtype is not None
            or self.v_in_k  # (its replays check that v still aliases k: LaunchPlan.launch)
            or self.config.trace
        )


_VARIANT_FIELDS = tuple(f for f in ForwardVariant.__dataclass_fields__ if not f.startswith("_"))


@dataclass(frozen=True)
class ForwardPlan:
    """What a call launches. variant None: no keys anywhere, nothing to launch (out = 0,
    lse = -inf). max_ctas caps a persistent grid (SMs x CTAs per SM); num_counters is how many
    zeroed int32 counters the launch needs (the dynamic scheduler's 2, or one arrival counter
    per tile of a split launch)."""

    variant: Optional[ForwardVariant]
    num_splits: int
    max_ctas: int
    num_counters: int
    trace_slots: int = 0  # traced variants: one record per work tile


# Set while flash_cute.trace.record() runs: every call planned meanwhile takes the traced
# variant of its config.
_tracing = False


def trace_calls(on: bool) -> None:
    """Whether the calls planned from now on are traced (flash_cute.trace.record)."""
    global _tracing
    _tracing = on


def tracing() -> bool:
    return _tracing


def plan_forward(
    problem: Problem,
    num_sms: int,
    config: Optional[AttentionConfig] = None,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    decode_rows: bool = True,
) -> ForwardPlan:
    """The plan of one call.

    config: the caller's (validated) config, or None for the tables. num_splits: 1 no split,
    n forces n, 0 picks with the heuristic. pack_gqa: None picks (all q heads of a kv head
    when their count divides the tile rows, or tiles full of them when the tile rows divide
    their count), True packs (the largest group of them that does),
    False never. decode_rows: whether decode-like
    problems take the decode table (flash_attn_func always takes the prefill table).
    """
    ratio = problem.qheads_per_kvhead
    causal, window_left, window_right, chunk = attention_mask(problem)
    local = window_left >= 0 or window_right >= 0 or chunk > 0
    caller_config = config
    decode_like = decode_rows and problem.max_seqlen_q * ratio <= DECODE_ROWS
    if config is None:
        if decode_like:
            config = decode_config(
                problem.head_dim, problem.dtype, problem.head_dim_v, problem.v_in_k or problem.qv
            )
        else:  # a local mask takes the causal rows (a band of the causal triangle, usually)
            config = default_config(
                problem.head_dim,
                problem.dtype,
                causal or local,
                problem.max_seqlen_q,
                window_span(window_left, window_right, chunk) if local else None,
                problem.head_dim_v,
                problem.v_in_k or problem.qv,
            )
    # Why the plan does not send the call to the seesaw kernel (None: it does), decided once.
    seesaw_refusal = seesaw_route_problem(problem) if caller_config is None else "caller config"
    fp8_latent = problem.kv_dtype is not None and (problem.v_in_k or problem.qv)
    if fp8_latent and problem.kv_capacity > 0:
        refusal = _fp8_latent_refusal(caller_config, seesaw_refusal)
        if refusal:
            raise NotImplementedError(
                f"an FP8 latent cache (absorbed MLA, kv_dtype {problem.kv_dtype}) is read by "
                f"the latent decode kernel only, which this call cannot take: {refusal}"
            )
    if caller_config is not None and caller_config.seesaw_rows < 64:
        unserved = transposed_problem(problem, caller_config.seesaw_rows)
        if unserved:
            raise ValueError(
                f"config: seesaw_rows {caller_config.seesaw_rows} (the transposed kernel) "
                f"{unserved}"
            )
    fp8_math = caller_config is None and serves_fp8_math(problem)
    if fp8_math:
        config = fp8_math_config(
            config,
            problem.head_dim,
            problem.head_dim_v,
            decode_like=decode_like,
            causal=bool(causal or local),
        )
    elif problem.kv_dtype is not None and caller_config is None and not fp8_latent:
        config = fp8_kv_config(config, problem.head_dim, problem.head_dim_v)
    if _tracing and not config.trace:
        config = config.replace(trace=True)
    if pack_gqa is None:  # K/V tiles read once for all q heads of a kv head (or once per
        # tile of them where they fill several: MLA's 128 heads on one latent head)
        pack_gqa = ratio > 1 and (config.tile_m % ratio == 0 or ratio % config.tile_m == 0)
    # A tile folds a group of consecutive q heads of one kv head into its rows: all of them,
    # or where their count does not divide the tile rows, the largest group that does (each
    # K/V tile is then read once per group).
    pack_ratio = 1
    if pack_gqa:
        pack_ratio = max(g for g in range(1, ratio + 1) if not ratio % g and not config.tile_m % g)
    max_ctas = num_sms * config.ctas_per_sm
    # fp32 partial bytes per split of a tile (the rows of one tile that hold a token).
    split_bytes = min(config.tile_m, _hinted_tokens(problem) * pack_ratio)
    split_bytes *= problem.head_dim_v * 4
    if num_splits == 0:
        visible = problem.max_seqlen_k
        if local:  # the keys a tile's rows can see: the splits share those out
            tile_tokens = math.ceil(config.tile_m / pack_ratio)
            # An unbounded right side reaches at most the last key, max_seqlen_q - 1 keys past
            # the first row's diagonal.
            left = window_left if window_left >= 0 else problem.max_seqlen_k
            right = window_right if window_right >= 0 else problem.max_seqlen_q - 1
            visible = min(visible, left + right + 1 + tile_tokens)
            if chunk:
                visible = min(visible, chunk + tile_tokens)
        n_blocks = math.ceil(visible / config.tile_n)
        num_splits = num_splits_heuristic(
            padded_tiles(problem, config.tile_m, pack_ratio), n_blocks, max_ctas
        )
        if problem.varlen_q:  # merged in the kernel: at most MERGE_IN_KERNEL_BYTES per tile
            num_splits = max(1, min(num_splits, MERGE_IN_KERNEL_BYTES // split_bytes))
        elif problem.head_dim_v > 256 and _combine_merges(problem, num_splits, split_bytes):
            num_splits = min(num_splits, combine_launch_split_cap(n_blocks))
    if problem.kv_capacity == 0:  # no keys: nothing for a kernel (or TMA) to read
        return ForwardPlan(None, num_splits, max_ctas, 0)
    if seesaw_refusal is None:
        # (the latent config's tiles: the split count stands)
        rows = 64
        if SEESAW_TRANSPOSED and transposed_problem(problem) is None:
            rows = transposed_rows(problem)
        config = seesaw_config(kv_fp8=problem.kv_dtype is not None, rows=rows)
    split = num_splits > 1
    page_box_rows, gather_page_size = _page_loads(problem, config)
    config = _effective_config(
        config, problem, pack_ratio, split, max_ctas, gather_page_size is not None
    )
    # The problem's shape, with what the plan decides of it: the mask's normal form, and V read
    # from K's columns for qv too.
    decided = dict(
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        attention_chunk=chunk,
        softcap=float(problem.softcap),
        v_in_k=problem.v_in_k or problem.qv,
        q_dtype=problem.q_dtype if fp8_math else None,
    )
    variant = ForwardVariant(
        **{**shape_fields(problem), **decided},
        config=config,
        page_box_rows=page_box_rows,
        gather_page_size=gather_page_size,
        split=split,
        combine_launch=split and _combine_merges(problem, num_splits, split_bytes),
        pack_gqa_ratio=pack_ratio,
    )
    if variant.uses_tile_counter:
        num_counters = 2
    elif variant.takes_counters:
        num_counters = split_tiles(problem, config.tile_rows, pack_ratio)
    else:
        num_counters = 0
    trace_slots = 0
    if config.trace:  # one record per work tile
        trace_slots = split_tiles(problem, config.tile_rows, pack_ratio) * num_splits
    return ForwardPlan(variant, num_splits, max_ctas, num_counters, trace_slots)


def _combine_merges(problem: Problem, num_splits: int, split_bytes: int) -> bool:
    """Whether a launch of num_splits splits (split_bytes of fp32 partial per split of a tile)
    leaves the merge to the combine kernel rather than to each tile's last split: above
    MERGE_IN_KERNEL_BYTES of partials a tile, or wide partials (WIDE_PARTIAL_BYTES); never for
    varlen queries, which the combine kernel cannot take."""
    if problem.varlen_q or num_splits <= 1:
        return False
    wide = problem.head_dim_v > 256 and split_bytes >= WIDE_PARTIAL_BYTES
    return wide or num_splits * split_bytes > MERGE_IN_KERNEL_BYTES


def _fp8_latent_refusal(caller_config, seesaw_refusal: Optional[str]) -> Optional[str]:
    """Why an FP8 latent call cannot run on the seesaw kernel (the only one that reads an
    FP8 latent cache), or None: a caller's config without seesaw, or the plan's reason for
    not routing it there (seesaw_route_problem)."""
    if caller_config is not None:
        return None if caller_config.seesaw else "config: a caller's config without seesaw"
    return seesaw_refusal


def seesaw_route_problem(problem: Problem) -> Optional[str]:
    """Why the plan does not send the problem to the seesaw kernel, or None where it does:
    routing on (SEESAW_ROUTING), a shape it serves (CallShape.seesaw_problem; pages of a
    multiple of 64 keys), not traced, with the q heads and tokens its GPU tests cover
    (SEESAW_HEADS on one latent head, up to SEESAW_MAX_TOKENS tokens; varlen queries over
    paged caches), where it measured at least as fast, split or not."""
    if not SEESAW_ROUTING:
        return "plan.SEESAW_ROUTING is off"
    unserved = problem.seesaw_problem()
    if unserved is not None:
        return unserved
    if _tracing:
        return "tracing (the seesaw kernel has no trace)"
    if problem.kv_layout == "paged" and problem.page_size % 64:
        return f"page_size {problem.page_size}: pages of a multiple of 64 keys"
    if problem.varlen_q and problem.kv_layout != "paged":
        return "varlen queries over a paged cache only (what its GPU tests cover)"
    if (
        problem.nheads_kv != 1
        or problem.nheads not in SEESAW_HEADS
        or problem.max_seqlen_q > SEESAW_MAX_TOKENS
    ):
        return (
            f"{problem.nheads} q heads on {problem.nheads_kv} kv heads, "
            f"{problem.max_seqlen_q} tokens: served are one latent head with q heads in "
            f"{SEESAW_HEADS} and up to {SEESAW_MAX_TOKENS} tokens"
        )
    return None


def transposed_problem(problem: Problem, max_rows: int = TRANSPOSED_ROWS[-1]) -> Optional[str]:
    """Why the transposed latent decode kernel (AttentionConfig.seesaw_rows 16 or 32, tiles
    of max_rows) cannot serve a call the seesaw kernel serves, or None: it reads an FP8 latent
    cache (FlashMLA's form) for sequences of at most max_rows rows (q heads per kv head x
    query tokens; a varlen call's max_seqlen_q says: a longer sequence, max_seqlen_q being a
    hint, takes more tiles, each reading the keys again)."""
    rows = _sequence_rows(problem)
    if not _transposed_form(problem):
        return "serves an FP8 latent cache in FlashMLA's form only"
    if rows > max_rows:
        return (
            f"serves at most {max_rows} rows a sequence (q heads per kv head x tokens), got {rows}"
        )
    return None


def transposed_rows(problem: Problem) -> int:
    """The transposed kernel's tile rows (its WGMMAs' N) for a call it serves: the fewest of
    TRANSPOSED_ROWS that hold a sequence's rows (H200, 16 heads x 1 token: tiles of 16 rows
    0.91-0.95x the time of tiles of 32)."""
    rows = _sequence_rows(problem)
    return next(r for r in TRANSPOSED_ROWS if rows <= r)


def _sequence_rows(problem: Problem) -> int:
    """A sequence's query rows as the latent kernels pack them: q heads per kv head x tokens
    (_hinted_tokens)."""
    return problem.nheads // problem.nheads_kv * _hinted_tokens(problem)


def _hinted_tokens(problem: Problem) -> int:
    """A sequence's query tokens as the plan sizes tiles and partials by: max_seqlen_q (for
    varlen calls a hint), 0 counted as one token (the API allows it; tiles still take a kv
    head's q heads whole, and partials are never 0 bytes)."""
    return max(1, problem.max_seqlen_q)


def _transposed_form(call) -> bool:
    """Whether a call (a Problem or a ForwardVariant) is in the transposed kernel's form: an FP8
    latent cache, V within it (FlashMLA's form, no qv)."""
    return call.kv_dtype is not None and not call.qv


def serves_fp8_math(problem: Problem) -> bool:
    """Whether FP8 queries run with both GEMMs in e4m3 (kernels/v_transpose.py) rather than
    converted to the output's dtype on the host (the FP8-cache kernels then run in 16-bit):
    head dims the e4m3 WGMMA takes (q/k's a multiple of 32) and equal, no qv; prefill shapes
    and decode-like rows, on padded, packed or paged keys (TMA boxes or gathered rows)."""
    if problem.q_dtype is None or problem.qv:
        return False
    return (
        problem.head_dim == problem.head_dim_v
        and problem.head_dim % 32 == 0
        and problem.head_dim <= 256
    )


def attention_mask(problem: Problem) -> tuple:
    """(causal, window_left, window_right, attention_chunk) as the kernel takes them. causal
    with a window is the window with a right side of 0; a side reaching past every key is
    unbounded (-1), so a window covering every key is no window; what is left is plain causal
    ((-1, 0) and no chunk), no mask, or a local mask."""
    left, right, chunk = problem.window_left, problem.window_right, problem.attention_chunk
    if left < 0 and right < 0 and chunk == 0:
        return problem.causal, -1, -1, 0
    if problem.causal:
        right = 0
    # Bounds on any sequence's key and query counts (a varlen call's max_seqlen_q is the
    # caller's word; its packed row count is not).
    keys = problem.kv_capacity
    queries = problem.total_q if problem.varlen_q else problem.max_seqlen_q
    if left >= keys - 1:  # row i's window starts at i + sk - sq - left <= 0
        left = -1
    if right >= queries - 1:  # and ends at i + sk - sq + right >= sk - 1
        right = -1
    if chunk == 0 and left < 0 and right <= 0:
        return right == 0, -1, -1, 0
    return False, left, right, chunk


def window_span(window_left: int, window_right: int, attention_chunk: int) -> Optional[int]:
    """The most keys one row of a local mask can see (None: unbounded)."""
    spans = []
    if window_left >= 0 and window_right >= 0:
        spans.append(window_left + window_right + 1)
    if attention_chunk > 0:
        spans.append(attention_chunk)
    return min(spans) if spans else None


def _page_loads(problem: Problem, config: AttentionConfig) -> tuple:
    """(page_box_rows, gather_page_size) of a paged cache: TMA boxes of whole pages' rows
    where a box of a multiple of 16 rows divides the page size and the key block and carries
    at least MIN_TMA_BOX_BYTES, else rows gathered with cp.async (also for left-padded
    pages)."""
    if not problem.page_size:
        return None, None
    rows = math.gcd(problem.page_size, config.tile_n)
    box_bytes = rows * problem.head_dim * (1 if problem.kv_dtype is not None else 2)
    if rows % 16 or problem.leftpad_k or box_bytes < MIN_TMA_BOX_BYTES:
        return None, problem.page_size
    return rows, None


def _effective_config(
    config: AttentionConfig,
    problem: Problem,
    pack_ratio: int,
    split: bool,
    max_ctas: int,
    gather: bool = False,
) -> AttentionConfig:
    """The config as the kernel runs it (see the module docstring). gather: paged K/V gathered
    with cp.async, whose four producer warps each walk the tile (one CTA per tile)."""
    changes = {}
    if (split or gather) and config.scheduler != "single_tile":
        changes["scheduler"] = "single_tile"
    elif (
        config.scheduler == "dynamic_persistent"
        and not split
        and not problem.varlen_q
        and padded_tiles(problem, config.tile_m, pack_ratio) <= max_ctas
    ):
        # CTA i takes tile i and none takes a second under either scheduler; the static one
        # needs no tile counter (one per-stream buffer fewer per call: small problems are
        # where host time matters).
        changes["scheduler"] = "static_persistent"
    if (split or problem.varlen_q or config.o_split > 1) and not config.store_o_from_registers:
        changes["store_o_from_registers"] = True
    if (
        problem.head_dim_v != problem.head_dim
        and not config.store_o_from_registers
        and not config.replace(**changes).separate_o_smem(problem.head_dim, 2, problem.head_dim_v)
    ):
        # Q's smem tile holds O only where the head dims agree; without a tile of its own,
        # O goes from registers.
        changes["store_o_from_registers"] = True
    if gather and config.num_mma_warpgroups == 1 and config.producer_registers < 128:
        # Registers to read page-table entries ahead of the copies; one MMA warpgroup leaves
        # them spare.
        changes["producer_registers"] = 128
    if config.pingpong and config.tile_m < 128:
        changes["pingpong"] = False
    if config.rescale_o_before_pv and not config.intra_wg_overlap:
        changes["rescale_o_before_pv"] = False
    config = config.replace(**changes) if changes else config
    if gather and config.producer_registers >= 128 and config.gather_lookahead == 1:
        # A read just before each copy waits out its latency once per row (H200, bf16, page
        # 8: 458 -> 262 us at batch 8 x 32k with the read-ahead). Producers of two MMA
        # warpgroups (24 registers) would spill the entries.
        config = config.replace(gather_lookahead=GATHER_LOOKAHEAD)
    return config


def padded_tiles(problem: Problem, tile_m: int, pack_ratio: int) -> int:
    """Query tiles of every (batch, kv-or-q head) with max_seqlen_q rows each: a fixed-length
    problem's grid (the host's estimate for a varlen one)."""
    m_blocks = math.ceil(problem.max_seqlen_q * pack_ratio / tile_m)
    return m_blocks * (problem.nheads // pack_ratio) * problem.batch


def split_tiles(problem: Problem, tile_m: int, pack_ratio: int) -> int:
    """Tiles of a split launch, one arrival counter each: its grid without the split factor
    (kernels/tile_scheduler.py, TileSpace.block_grid)."""
    heads = problem.nheads // pack_ratio
    if problem.varlen_q:  # every sequence's query tiles, flattened, plus one spare per sequence
        return (math.ceil(problem.total_q * pack_ratio / tile_m) + problem.batch) * heads
    return padded_tiles(problem, tile_m, pack_ratio)


def combine_launch_split_cap(num_n_blocks: int) -> int:
    """Most splits worth a launch whose partials the combine kernel merges, for V head dims
    above 256 (the rows it was fitted on; narrower partials cost less per split): each
    split adds a partial that the combine reads in turn, so past about 2 sqrt(key blocks)
    splits that costs more than the shorter key ranges gain. Fitted on an H100 (absorbed MLA,
    16 and 128 heads, batch 1 and 4, 4k-64k keys: 0.73-1.0x the time of the wave rule's
    61-122 splits, 1.06x at one point of 16 heads and 4k keys)."""
    return max(2, int(2 * math.sqrt(num_n_blocks)))


def num_splits_heuristic(
    num_tiles: int, num_n_blocks: int, num_sms: int, max_splits: int = MAX_SPLITS
) -> int:
    """Splits of the key range for `num_tiles` work tiles of `num_n_blocks` key blocks each on
    `num_sms` SMs (split-KV pays when the grid leaves SMs idle: few tiles, long keys).

    1 when the tiles already fill most SMs or the key range is short; otherwise the smallest
    split count whose wave efficiency (tiles*splits/SMs over its ceiling) is within 5% of the
    best, never more than the key blocks (a split gets at least one block). FlashAttention-3's
    rule, from host-known sizes only, so a call stays capturable in a CUDA graph.
    """
    if num_tiles <= 0 or num_n_blocks <= 4 or num_tiles >= 0.8 * num_sms:
        return 1
    limit = max(1, min(max_splits, num_sms, num_n_blocks))
    efficiency = []
    for splits in range(1, limit + 1):
        waves = num_tiles * splits / num_sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    for splits, eff in enumerate(efficiency, start=1):
        if eff >= 0.95 * best:
            return splits
    return 1  # pragma: no cover - the best itself qualifies
