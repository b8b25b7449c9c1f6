"""The PyTorch reference itself (CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_cute.reference import attention_ref, causal_mask, error_bound


def naive_attention(q, k, v, scale, causal):
    """Row by row, in float64: the definition."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = torch.stack(
                    [(q[bi, i, hi].double() @ k[bi, j, kv].double()) * scale for j in keys]
                )
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, kv].double() for n, j in enumerate(keys))
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(5, 5), (3, 7), (7, 3), (1, 4)])
def test_matches_definition(causal, seqlens):
    torch.manual_seed(0)
    sq, sk = seqlens
    q, k, v = torch.randn(2, sq, 4, 16), torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
    out, lse = attention_ref(q, k, v, softmax_scale=0.37, causal=causal)
    want_out, want_lse = naive_attention(q, k, v, 0.37, causal)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_rows_without_keys_give_zero_and_minus_inf():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = attention_ref(q, k, v, causal=True)  # rows 0..3 see no key
    assert (out[0, :4] == 0).all() and (lse[0, 0, :4] == float("-inf")).all()
    assert torch.isfinite(lse[0, 0, 4:]).all()


def test_matches_sdpa_bottom_right_causal():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 9, 4, 32), torch.randn(2, 13, 4, 32), torch.randn(2, 13, 4, 32)
    out, _ = attention_ref(q, k, v, causal=True)
    allowed = ~causal_mask(9, 13)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed
    )
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_default_scale_and_lowp_path():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, 2, 64) for _ in range(3))
    a, _ = attention_ref(q, k, v)
    b, _ = attention_ref(q, k, v, softmax_scale=1 / math.sqrt(64))
    torch.testing.assert_close(a, b)
    lowp, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), upcast=False)
    assert lowp.dtype == torch.bfloat16 and a.dtype == torch.float32


def test_error_bound_has_a_floor_and_scales():
    ref = torch.randn(100)
    assert error_bound(ref.bfloat16(), ref) > 0
    worse = (ref + 0.1).bfloat16()
    assert error_bound(worse, ref) >= 2 * 0.09


def test_stable_seed_is_the_same_in_every_process():
    import subprocess
    import sys

    from flash_cute.reference import stable_seed

    code = (
        "from flash_cute.reference import stable_seed; "
        "print(stable_seed(64, 'paged', (2, 3), None))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert int(other) == stable_seed(64, "paged", (2, 3), None)
    assert stable_seed(64, "paged") != stable_seed(64, "padded")
