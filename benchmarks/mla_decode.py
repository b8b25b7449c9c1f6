"""Absorbed-MLA decode (DeepSeek V3 / Kimi K2: nheads query heads against one 576-wide latent
head whose first 512 dims are V): the latent decode kernel (AttentionConfig.seesaw,
kernels/mla_decode/) beside the forward kernel's latent path (its decode row) and
FlashAttention-3's qv form (fa3_fwd_interface: q 64 + qv 512 against k_cache 64 + v_cache
512, contiguous), in one process, rounds interleaved, CUDA-graph replays of STEPS steps.
bf16, causal, every sequence `keys` long, the split count each library picks. "fp8": the
latent decode kernel on the same cache in float8_e4m3fn ((batch, 1) descales of 1), whose
speed is also given against the bf16 cache's (its TB/s count its own bytes: half); "fp8 s":
the same forced onto the seesaw where the plan takes the transposed kernel (<= 32 rows).

Prints per point each peer's median of ROUNDS rounds: us, TFLOP/s with FLOPs = 2 * batch *
nheads * q tokens * keys * (576 + 512), the cache's TB/s (576 x 2 bytes per key and sequence)
beside a same-run copy of those bytes (read + write), and the outputs' largest difference from
the forward kernel's. Run from the repository root on a GPU:

    python benchmarks/mla_decode.py        (env: ROUNDS=5, POINTS=0,2 to pick, PAGED=1,
                                            PEERS=seesaw,FA3 qv to keep only those)
"""

import os

import torch

import flash_cute
from flash_cute import timing
from flash_cute.config import decode_config, seesaw_config

fa3 = timing.optional_fa3()

BF16 = torch.bfloat16
ROUNDS = int(os.environ.get("ROUNDS", "5"))
PAGED = os.environ.get("PAGED", "1") == "1"
PEERS = os.environ.get("PEERS")  # (the forward kernel is always kept: the reference)
STEPS = 10  # decode calls per graph
FP8_PAIRS = (
    ("fp8", "seesaw"),
    ("fp8 s", "seesaw"),
    ("fp8 p64", "seesaw p64"),
)  # (FP8 cache, its bf16 peer)
D_LATENT, D_ROPE, PAGE = 512, 64, 64
# (heads, batch, q tokens, keys): the table.
POINTS = [
    (128, 1, 1, 8192),
    (128, 8, 1, 16384),
    (128, 64, 1, 8192),
    (128, 128, 2, 4096),
    (128, 132, 1, 16384),
    (16, 16, 1, 32768),
    (16, 64, 1, 8192),
    # Tensor-parallel shards and speculative tokens beyond it (plan.SEESAW_HEADS).
    (32, 64, 1, 8192),
    (16, 64, 2, 8192),
    (8, 64, 4, 8192),
    (128, 32, 4, 4096),
]


def peers(heads, batch, seqlen_q, keys):
    """{name: decode step} over one random latent cache (and its qv-form and paged copies)."""
    latent = torch.randn(batch, keys, 1, D_LATENT + D_ROPE, device="cuda", dtype=BF16)
    q = torch.randn(batch, seqlen_q, heads, D_LATENT + D_ROPE, device="cuda", dtype=BF16)
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    kvcache = flash_cute.flash_attn_with_kvcache
    common = dict(cache_seqlens=lens, causal=True)
    v = latent[..., :D_LATENT]
    forward = decode_config(D_LATENT + D_ROPE, "bfloat16", D_LATENT, v_in_k=True)
    seesaw = seesaw_config()
    steps = {"forward": lambda: kvcache(q, latent, v, config=forward, **common)}
    if kept("seesaw"):
        steps["seesaw"] = lambda: kvcache(q, latent, v, config=seesaw, **common)
    paged_peers = PAGED and (kept("seesaw p64") or kept("fp8 p64"))
    if paged_peers:
        pages = keys // PAGE
        table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
        paged = torch.empty(batch * pages, PAGE, 1, D_LATENT + D_ROPE, device="cuda", dtype=BF16)
        paged[table.long()] = latent.view(batch, pages, PAGE, 1, D_LATENT + D_ROPE)
    if paged_peers and kept("seesaw p64"):
        steps["seesaw p64"] = lambda: kvcache(
            q, paged, paged[..., :D_LATENT], page_table=table, config=seesaw, **common
        )
    descale = torch.ones(batch, 1, device="cuda")
    fp8 = dict(k_descale=descale, v_descale=descale, **common)
    latent8 = latent.to(torch.float8_e4m3fn) if kept("fp8") or kept("fp8 s") else None
    if kept("fp8"):
        steps["fp8"] = lambda: kvcache(q, latent8, latent8[..., :D_LATENT], **fp8)
    if kept("fp8 s"):  # (forced onto the seesaw where the plan takes the transposed kernel)
        seesaw8 = seesaw_config(kv_fp8=True)
        steps["fp8 s"] = lambda: kvcache(q, latent8, latent8[..., :D_LATENT], config=seesaw8, **fp8)
    if paged_peers and kept("fp8 p64"):
        paged8 = paged.to(torch.float8_e4m3fn)
        steps["fp8 p64"] = lambda: kvcache(
            q, paged8, paged8[..., :D_LATENT], page_table=table, **fp8
        )
    if fa3 is not None and kept("FA3 qv"):
        q_rope, qv = q[..., D_LATENT:].contiguous(), q[..., :D_LATENT].contiguous()
        k_rope, v_cache = latent[..., D_LATENT:].contiguous(), v.contiguous()
        steps["FA3 qv"] = lambda: fa3.flash_attn_with_kvcache(
            q_rope, k_rope, v_cache, qv=qv, softmax_scale=(D_LATENT + D_ROPE) ** -0.5, **common
        )
    return steps


def kept(name: str) -> bool:
    """Whether PEERS keeps the peer (all without it; the forward kernel always)."""
    return not PEERS or name == "forward" or name in PEERS.split(",")


def main():
    points = timing.env_points(POINTS)
    print(torch.cuda.get_device_name(), f"{STEPS} steps per graph", flush=True)
    for heads, batch, seqlen_q, keys in points:
        torch.cuda.empty_cache()
        steps = peers(heads, batch, seqlen_q, keys)
        outs = {name: fn() for name, fn in steps.items()}
        ref = outs["forward"].float()
        diffs = {n: (o.float() - ref).abs().max().item() for n, o in outs.items()}
        cache_bytes = batch * keys * (D_LATENT + D_ROPE) * 2
        flops = 2 * batch * heads * seqlen_q * keys * (D_LATENT + D_ROPE + D_LATENT)
        replays = {name: timing.captured(fn, STEPS) for name, fn in steps.items()}
        us = timing.graph_step_rounds_us(replays, STEPS, ROUNDS)
        copy = timing.copy_bandwidth_gbs(cache_bytes) / 1e3  # (TB/s, read + write)
        print(f"h={heads} {batch} x {seqlen_q} x {keys} (copy {copy:.2f} TB/s):", flush=True)
        for name, t in us.items():
            nbytes = cache_bytes // 2 if name.startswith("fp8") else cache_bytes
            print(
                f"  {name:12s} {t:8.1f} us {flops / t / 1e6:6.0f} TFLOP/s "
                f"{nbytes / t / 1e6:5.2f} TB/s ({nbytes / t / 1e6 / copy:4.0%} of "
                f"copy)  max|diff| {diffs[name]:.1e}",
                flush=True,
            )
        print(
            "  fp8 vs bf16: "
            + ", ".join(f"{n} {us[b] / us[n]:.2f}x" for n, b in FP8_PAIRS if n in us and b in us),
            flush=True,
        )
        if "FA3 qv" in us:
            print(
                "  vs FA3 qv: "
                + ", ".join(f"{n} {us['FA3 qv'] / us[n]:.3f}x" for n in us if n != "FA3 qv"),
                flush=True,
            )


if __name__ == "__main__":
    main()
