"""How many splits of the key range a problem gets (split-KV), and the plan of a call.

Split-KV pays when the grid without it leaves SMs idle: few (batch x kv head x query tile)
work tiles but long key sequences, as in decoding. The split count is chosen for wave
efficiency over the SMs, as FlashAttention-3 does, from host-known sizes only (shapes and
max lengths, never tensor contents), so a call stays capturable in a CUDA graph.
"""

from __future__ import annotations

import math
from functools import lru_cache

MAX_SPLITS = 128


def num_splits_heuristic(
    num_tiles: int, num_n_blocks: int, num_sms: int, max_splits: int = MAX_SPLITS
) -> int:
    """Splits for `num_tiles` work tiles of `num_n_blocks` key blocks each on `num_sms` SMs.

    1 when the tiles already fill most SMs or the key range is short; otherwise the smallest
    split count whose wave efficiency (tiles*splits/SMs over its ceiling) is within 5% of the
    best, never more than the key blocks (a split gets at least one block).
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


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
