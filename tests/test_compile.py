"""Compile-only checks of every kernel variant for sm_90a (CPU; marker: compile).

Each variant of the config table must compile, and its PTX must hold WGMMA
(wgmma.mma_async), TMA loads (cp.async.bulk.tensor) and register reallocation (setmaxnreg),
with ptxas reporting zero spill bytes and not ignoring setmaxnreg.
"""

import pytest

from flash_cute import AttentionConfig
from flash_cute.compile_cache import ForwardKernelKey
from flash_cute.precompile import compile_with_ptx_report, table_keys

pytestmark = pytest.mark.compile

# Every (head_dim, dtype, causal) row, writing the LSE (the larger variant).
TABLE_KEYS = table_keys(writes_lse=(True,))

# Knobs off the table's path, and the no-LSE variant.
KNOB_KEYS = [
    ForwardKernelKey("bfloat16", 128, False, AttentionConfig(128, 128), False),
    ForwardKernelKey("bfloat16", 128, True, AttentionConfig(128, 128, intra_wg_overlap=False), True),
    ForwardKernelKey("float16", 128, False, AttentionConfig(128, 128, pv_from_registers=False, pingpong=False), True),
    ForwardKernelKey("bfloat16", 128, True, AttentionConfig(128, 64, num_stages=3), True),
    ForwardKernelKey("bfloat16", 64, False, AttentionConfig(64, 128, pingpong=False), True),
    ForwardKernelKey("bfloat16", 64, True, AttentionConfig(192, 96, intra_wg_overlap=False), True),
]


def _id(key):
    c = key.config
    return (f"d{key.head_dim}-{key.dtype}-{'causal' if key.causal else 'full'}-{c.tile_m}x{c.tile_n}"
            f"-st{c.num_stages}-rs{int(c.pv_from_registers)}-ov{int(c.intra_wg_overlap)}"
            f"-pp{int(c.pingpong)}-lse{int(key.writes_lse)}")


@pytest.mark.parametrize("key", TABLE_KEYS + KNOB_KEYS, ids=_id)
def test_variant_compiles_clean(key):
    report = compile_with_ptx_report(key)
    assert not report.problems(), report.problems()
    assert report.instruction_counts["wgmma.mma_async"] > 0
