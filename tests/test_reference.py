"""The PyTorch reference itself (CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from flash_cute.reference import attention_ref, causal_mask, error_bound


def naive_attention(q, k, v, scale, causal, window=(-1, -1), chunk=0, softcap=0.0, sink=None):
    """Row by row, in float64: the definition (FlashAttention-3's local semantics: x = i + sk -
    sq; key j is visible iff x - left <= j <= x + right, -1 unbounded, causal meaning right = 0,
    and with a chunk j // chunk == x // chunk; a sink adds exp(sink) to the denominator)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            for i in range(sq):
                x = i + sk - sq
                keys = [
                    j
                    for j in range(sk)
                    if (left < 0 or j >= x - left)
                    and (right < 0 or j <= x + right)
                    and (chunk == 0 or j // chunk == x // chunk)
                ]
                s = [(q[bi, i, hi].double() @ k[bi, j, kv].double()) * scale for j in keys]
                if softcap:
                    s = [softcap * torch.tanh(x / softcap) for x in s]
                logits = s + (
                    [torch.tensor(float(sink[hi]), dtype=torch.float64)] if sink is not None else []
                )
                if not logits:
                    continue
                logits = torch.stack(logits)
                lse[bi, hi, i] = torch.logsumexp(logits, 0)
                p = torch.softmax(logits, 0)
                out[bi, i, hi] = sum(
                    (p[n] * v[bi, j, kv].double() for n, j in enumerate(keys)),
                    torch.zeros(d, dtype=torch.float64),
                )
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


@pytest.mark.parametrize(
    "window, chunk, causal",
    [
        ((2, 1), 0, False),
        ((0, 0), 0, False),
        ((3, -1), 0, True),
        ((-1, 2), 0, False),
        ((-1, -1), 4, False),
        ((1, 5), 3, True),
    ],
)
@pytest.mark.parametrize("seqlens", [(6, 9), (9, 6), (1, 7)])
def test_local_softcap_sink_match_definition(window, chunk, causal, seqlens):
    torch.manual_seed(4)
    sq, sk = seqlens
    q, k, v = torch.randn(2, sq, 4, 16), torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
    sink = torch.randn(4)
    for softcap, sinks in ((0.0, None), (1.5, None), (0.0, sink), (2.0, sink)):
        out, lse = attention_ref(
            q, k, v, 0.37, causal, window_size=window, attention_chunk=chunk, softcap=softcap,
            learnable_sink=sinks,
        )  # fmt: skip
        want_out, want_lse = naive_attention(q, k, v, 0.37, causal, window, chunk, softcap, sinks)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_rows_without_keys_give_zero_and_minus_inf_or_the_sink():
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 8, 1, 8), torch.randn(1, 8, 1, 8)
    sink = torch.tensor([0.5, -3.0])
    # Every row sees its diagonal key: a finite LSE with the sink in it.
    out, lse = attention_ref(q, k, v, window_size=(0, 0), attention_chunk=2, learnable_sink=sink)
    assert torch.isfinite(lse).all()
    out, lse = attention_ref(q[:, :3], k[:, :1], v[:, :1], causal=True, learnable_sink=sink)
    assert (out[0, :2] == 0).all() and torch.equal(lse[0, :, :2], sink.view(2, 1).expand(2, 2))


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
