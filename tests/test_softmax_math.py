"""The FMA-pipe exp2 of kernels/softmax.py, replayed in float32 NumPy on the CPU (the same
operations in the same order as its PTX), and which columns use it."""

import numpy as np
import pytest
from flash_cute.kernels.softmax import _EXP2_POLY, _ROUNDING_MAGIC, fma_exp2_columns


def _exp2_on_fma(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    x = np.maximum(x.astype(f32), f32(-127.0))
    t = (x + f32(_ROUNDING_MAGIC)).astype(f32)
    r = (t - f32(_ROUNDING_MAGIC)).astype(f32)
    f = (x - r).astype(f32)
    c1, c2, c3, c4 = (f32(c) for c in _EXP2_POLY)
    # fma.rn in float64 then rounded once, as the hardware does
    p = f32(f.astype(np.float64) * c4 + c3)
    p = (p.astype(np.float64) * f + c2).astype(f32)
    p = (p.astype(np.float64) * f + c1).astype(f32)
    p = (p.astype(np.float64) * f + 1.0).astype(f32)
    bits = p.view(np.uint32).astype(np.int64) + (t.view(np.uint32).astype(np.int64) << 23)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(f32)


def test_relative_error_over_the_softmax_range():
    x = np.linspace(-126.0, 8.0, 2_000_001, dtype=np.float64).astype(np.float32)
    got = _exp2_on_fma(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1.0)
    assert rel.max() < 4e-6, rel.max()  # below fp16's rounding of P (2.4e-4) by 60x


def test_integers_are_exact_and_masked_scores_give_zero():
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(_exp2_on_fma(ints), np.exp2(ints))
    masked = np.array([-np.inf, -1e30, -200.0, -127.0], dtype=np.float32)
    assert np.array_equal(_exp2_on_fma(masked), np.zeros(4, np.float32))
    tiny = _exp2_on_fma(np.linspace(-127.0, -126.0, 1001, dtype=np.float32))
    assert (tiny >= 0).all() and (tiny <= 2.0**-126).all()  # never negative or NaN


@pytest.mark.parametrize("per_16", range(17))
@pytest.mark.parametrize("ncols", [4, 8, 16, 32, 64])
def test_columns_are_spread(per_16, ncols):
    cols = fma_exp2_columns(ncols, per_16)
    if ncols % 16 == 0:
        assert len(cols) == per_16 * ncols // 16
    for start in range(0, ncols, 16):
        chunk = sorted(c - start for c in cols if start <= c < start + 16)
        assert chunk == sorted(c for c in fma_exp2_columns(16, per_16) if c < ncols - start)
    if 0 < per_16 < 16:  # spread: no two picked columns further apart than needed
        picked = sorted(fma_exp2_columns(16, per_16))
        gaps = np.diff(picked)
        assert gaps.max() - gaps.min() <= 1 if len(gaps) else True
