"""Named-barrier ids of the forward kernel (id 0 is __syncthreads)."""

import enum


class NamedBarrier(enum.IntEnum):
    EPILOGUE = 1  # MMA warpgroups' smem writes of O, then the TMA store warp
    # Ping-pong: MMA warpgroup i waits on WG_SCHEDULE_1 + i before issuing its GEMMs.
    WG_SCHEDULE_1 = 2
    WG_SCHEDULE_2 = 3
    WG_SCHEDULE_3 = 4
    O_SMEM_FREE = 5  # persistent kernels: the MMA warpgroups before reusing sO
    SPLIT_MERGE = 6  # split kernels: the MMA warpgroups around the per-tile arrival count
    # MMA warpgroup i after zeroing the V rows past the sequence end (V_TAIL_1 + i).
    V_TAIL_1 = 7
    V_TAIL_2 = 8
    V_TAIL_3 = 9
    SPLIT_SCORES = 10  # split_scores: the two warpgroups sharing a tile's rows
    # The MMA warps after converting Q to fp16 (FP8 K/V, bf16 q: kv_dequant) or rotating it (a
    # fused append).
    Q_CONVERT = 11
    # The absorbed-MLA decode kernel's seesaw (kernels/mla_decode/seesaw.py), one arrive and one
    # sync of a warpgroup each per pair of key blocks: warpgroup 0's row maxima are in shared
    # memory, warpgroup 1's are, warpgroup 0's P is in sP0, warpgroup 1's in sP1.
    SEESAW_MAX_0 = 12
    SEESAW_MAX_1 = 13
    SEESAW_P_0 = 14
    SEESAW_P_1 = 15
    # Its MMA warpgroup converting buffer i's halves in place (an FP8 cache: LATENT_CONVERT_0 + i;
    # kernels/mla_decode/fp8_loads.py): between reading staged bytes and overwriting them, and
    # once a half is converted (the ping-pong ids: that kernel has no ping-pong).
    LATENT_CONVERT_0 = 2
    LATENT_CONVERT_1 = 3
    # The transposed latent decode kernel (kernels/mla_decode/transposed.py): MMA warpgroup i's
    # own syncs (TRANSPOSED_WG_0 + i: each block's OR of whether a score passed its column's
    # reference max (barrier.red), the maxima exchanged where one did, its P^T stored, the V
    # tail zeroed, the column sums reduced at the end; the seesaw's ids: that kernel has no
    # seesaw).
    TRANSPOSED_WG_0 = 12
    TRANSPOSED_WG_1 = 13
