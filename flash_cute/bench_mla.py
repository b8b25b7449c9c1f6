"""The `mla` benchmark suite: absorbed-MLA decode against a paged latent cache.

    python -m flash_cute.bench mla [--batch 1 4 16 64 128] [--seqlens 4096 16384 65536]
                                   [--heads 128] [--seqlen-q 1 2] [--json PATH]

DeepSeek V3 / Kimi K2 decode run "absorbed": nheads query heads (128, or 16-64 per GPU under
tensor parallelism) against one latent head of 576 = 512 + 64 dims whose first 512 are also
the value, paged by 64 keys (random page order), bf16, causal, replayed from a CUDA graph. Two
forms: FlashMLA's (q and the cache 576 wide, v_cache = k_cache[..., :512]) and
FlashAttention-3's qv (q 64 against k_cache 64, qv 512 against v_cache 512).

Reported per point: microseconds, the cache's bytes over the time (TB/s; latent 576 x 2 bytes
per key and sequence; qv form: the same bytes in two tensors) beside the device-to-device copy
bandwidth measured in the same run, and TFLOP/s with FLOPs = 2 * batch * nheads * seqlen_q *
keys * (576 + 512) (Q K^T over 576 dims plus P V over 512; causal masking of the last few keys
ignored).
"""

from __future__ import annotations

import sys
from typing import List

import torch

from flash_cute.timing import copy_bandwidth_gbs, time_graph

D_LATENT, D_ROPE, PAGE = 512, 64, 64


def _paged(batch: int, keys: int, width: int, gen) -> tuple:
    """A (pages, PAGE, 1, width) bf16 cache holding `keys` keys per sequence, pages in a
    random order, and its (batch, pages per sequence) table."""
    pages = -(-keys // PAGE)
    cache = torch.randn(
        batch * pages, PAGE, 1, width, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    perm = torch.randperm(batch * pages, device="cuda", generator=gen)
    return cache, perm.view(batch, pages).to(torch.int32)


def run_decode(
    batches: List[int], seqlens: List[int], heads: List[int], seqlens_q: List[int]
) -> List[dict]:
    import flash_cute

    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs / 1e3:.2f} TB/s (read + write)", flush=True)
    rows = []
    for keys in seqlens:
        for batch in batches:
            gen = torch.Generator(device="cuda").manual_seed(batch * 7 + keys)
            latent, table = _paged(batch, keys, D_LATENT + D_ROPE, gen)
            lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
            # The qv form's two caches: the latent's 512 dims and the rope part's 64.
            v_cache, k_rope = latent[..., :D_LATENT].contiguous(), latent[..., D_LATENT:]
            k_rope = k_rope.contiguous()
            cache_bytes = batch * keys * (D_LATENT + D_ROPE) * 2
            for nheads in heads:
                for seqlen_q in seqlens_q:
                    q = torch.randn(
                        batch, seqlen_q, nheads, D_LATENT + D_ROPE, device="cuda",
                        dtype=torch.bfloat16, generator=gen,
                    )  # fmt: skip
                    q_rope, qv = q[..., D_LATENT:].contiguous(), q[..., :D_LATENT].contiguous()
                    common = dict(cache_seqlens=lengths, page_table=table, causal=True)
                    fns = {
                        "latent": lambda q=q: flash_cute.flash_attn_with_kvcache(
                            q, latent, latent[..., :D_LATENT], **common
                        ),
                        "qv": lambda q_rope=q_rope, qv=qv: flash_cute.flash_attn_with_kvcache(
                            q_rope, k_rope, v_cache, qv=qv, **common
                        ),
                    }
                    flops = 2 * batch * nheads * seqlen_q * keys * (D_LATENT + D_ROPE + D_LATENT)
                    row = dict(batch=batch, keys=keys, nheads=nheads, seqlen_q=seqlen_q, us={})
                    for name, fn in fns.items():
                        try:
                            row["us"][name] = time_graph(fn) * 1e3
                        except Exception as exc:
                            print(
                                f"# {name} failed: {type(exc).__name__}: {str(exc)[:160]}",
                                file=sys.stderr,
                            )
                    row["tbs"] = {n: cache_bytes / us / 1e6 for n, us in row["us"].items()}
                    row["tflops"] = {n: flops / us / 1e6 for n, us in row["us"].items()}
                    row["copy_tbs"] = copy_gbs / 1e3
                    rows.append(row)
                    cells = "  ".join(
                        f"{n} {row['us'][n]:.1f} us {row['tbs'][n]:.2f} TB/s "
                        f"{row['tflops'][n]:.0f} TFLOP/s"
                        for n in row["us"]
                    )
                    print(
                        f"b={batch:3d} keys={keys:6d} h={nheads:3d} sq={seqlen_q}: {cells}",
                        flush=True,
                    )
    return rows


def decode_table(rows: List[dict]) -> str:
    """Markdown: per point, each form's time, TB/s (and its share of the copy bandwidth) and
    TFLOP/s."""
    lines = [
        "| batch | keys | heads | q tokens | form | us | TB/s | of copy | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, us in r["us"].items():
            lines.append(
                f"| {r['batch']} | {r['keys']} | {r['nheads']} | {r['seqlen_q']} | {name} | "
                f"{us:.1f} | {r['tbs'][name]:.2f} | {r['tbs'][name] / r['copy_tbs']:.0%} | "
                f"{r['tflops'][name]:.0f} |"
            )
    return "\n".join(lines)
