"""Varlen prefill: the table's (persistent) config against the same config with one CTA per tile, and fa4."""
import torch, flash_cute
from flash_cute.bench import time_interleaved
from flash_cute.config import default_config
torch.manual_seed(0)
try:
    from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
except Exception:
    fa4_varlen = None
CASES = [  # (name, q lengths, hdim, nheads, nheads_kv, causal)
    ("16 x 100-2000 causal h128", torch.randint(100, 2001, (16,)).tolist(), 128, 32, 8, True),
    ("16 x 100-2000 full h128", torch.randint(100, 2001, (16,)).tolist(), 128, 32, 8, False),
    ("64 x 50-600 causal h128", torch.randint(50, 601, (64,)).tolist(), 128, 32, 8, True),
    ("8 x 500-4000 causal h64", torch.randint(500, 4001, (8,)).tolist(), 64, 32, 32, True),
    ("8 x 500-4000 causal h256", torch.randint(500, 4001, (8,)).tolist(), 256, 16, 16, True),
]
print("| case | tokens | table config TFLOP/s | single_tile | fa4 | table / single | table / fa4 |")
print("|---|---|---|---|---|---|---|")
for name, lens, d, h, hk, causal in CASES:
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    total, mx = int(cu[-1]), max(lens)
    q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = sum(4 * n * n * d * h / (2 if causal else 1) for n in lens)
    table = default_config(d, "bfloat16", causal, mx)
    single = table.replace(scheduler="single_tile")
    fns = {
        "table": lambda: flash_cute.flash_attn_varlen_func(q, k, v, cu, mx, cu_seqlens_k=cu, max_seqlen_k=mx, causal=causal, config=table),
        "single": lambda: flash_cute.flash_attn_varlen_func(q, k, v, cu, mx, cu_seqlens_k=cu, max_seqlen_k=mx, causal=causal, config=single),
    }
    if fa4_varlen is not None:
        fns["fa4"] = lambda: fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
    ms = time_interleaved(fns, warmup=3, reps=40)
    tf = {n: flops / t / 1e9 for n, t in ms.items()}
    fa = tf.get("fa4", float("nan"))
    print(f"| {name} ({table.tile_m}x{table.tile_n} {table.scheduler}) | {total} | {tf['table']:.0f} | {tf['single']:.0f} | {fa:.0f} | {tf['table']/tf['single']:.2f} | {tf['table']/fa:.2f} |", flush=True)
