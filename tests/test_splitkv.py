"""Split-KV on the CPU: the split-count heuristic and the reference split + combine."""

import math

import pytest
import torch

from flash_cute.plan import num_splits_heuristic
from flash_cute.reference import attention_partial_ref, attention_ref, combine_ref, split_ranges


@pytest.mark.parametrize(
    "tiles, n_blocks, sms, want",
    [
        (8, 1024, 132, 16),  # batch 1, 8 kv heads, 128k keys: 8 x 16 = 128 of 132 SMs
        (32, 1024, 132, 4),  # 4 x 32 = 128
        (64, 64, 132, 2),  # 128
        (1, 1024, 132, 122),  # one tile: within 5% of the best wave (128 of 132)
        (1, 3, 132, 1),  # too few key blocks to split
        (8, 4, 132, 1),  # <= 4 key blocks: never split
        (120, 1024, 132, 1),  # tiles already fill 80% of the SMs
        (0, 100, 132, 1),
        (8, 10, 132, 10),  # capped by the key blocks
    ],
)
def test_split_heuristic(tiles, n_blocks, sms, want):
    assert num_splits_heuristic(tiles, n_blocks, sms) == want


def test_split_heuristic_efficiency():
    for tiles in range(1, 106):
        splits = num_splits_heuristic(tiles, 4096, 132)
        waves = tiles * splits / 132
        assert waves / math.ceil(waves) >= 0.9 or splits == min(128, 4096)


@pytest.mark.parametrize(
    "seqlen_k, tile_n, splits",
    [(1000, 128, 3), (1000, 128, 7), (128, 128, 4), (5, 64, 2), (0, 128, 3)],
)
def test_split_ranges_cover_keys(seqlen_k, tile_n, splits):
    ranges = split_ranges(seqlen_k, tile_n, splits)
    assert len(ranges) == splits
    covered = [j for lo, hi in ranges for j in range(lo, hi)]
    assert covered == list(range(seqlen_k))
    for lo, _ in ranges:
        assert lo % tile_n == 0 or lo == seqlen_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "seqlens, ranges",
    [
        ((7, 300), [(0, 128), (128, 256), (256, 300)]),
        ((7, 300), [(0, 300), (300, 300)]),  # an empty split
        ((5, 3), [(0, 1), (1, 2), (2, 3), (3, 3)]),  # causal: rows seeing no key of a split
        ((9, 4), [(0, 4)]),  # causal with seqlen_q > seqlen_k: empty rows
    ],
)
def test_split_then_combine_is_attention(causal, seqlens, ranges):
    torch.manual_seed(0)
    sq, sk = seqlens
    q, k, v = torch.randn(2, sq, 4, 32), torch.randn(2, sk, 2, 32), torch.randn(2, sk, 2, 32)
    out_p, lse_p = attention_partial_ref(q, k, v, ranges, causal=causal)
    out, lse = combine_ref(out_p, lse_p)
    want, want_lse = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.transpose(1, 2), want_lse, atol=1e-5, rtol=1e-5)


def test_combine_ignores_empty_splits_and_their_garbage():
    out_p = torch.randn(3, 2, 5, 8)
    lse_p = torch.randn(3, 2, 5)
    lse_p[1] = float("-inf")
    out_p[1] = float("nan")  # never read
    out, lse = combine_ref(out_p, lse_p)
    want, want_lse = combine_ref(out_p[[0, 2]], lse_p[[0, 2]])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    lse_p[:, 0, 0] = float("-inf")
    out, lse = combine_ref(out_p, lse_p)
    assert (out[0, 0] == 0).all() and lse[0, 0] == float("-inf")
