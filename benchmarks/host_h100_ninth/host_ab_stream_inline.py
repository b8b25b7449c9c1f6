"""Host cost per cached call: 7082fa3's package (flash_cute_old) against the working tree's, interleaved
round by round in one process, tiny problems."""
import statistics, sys, time, torch
sys.path.insert(0, ".devscripts/pkg_ab")
import flash_cute, flash_cute_old
q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
out = torch.empty_like(q)
qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
sl = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
qv = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
kp, vp = (torch.randn(64, 16, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
cu_q = torch.arange(5, dtype=torch.int32, device="cuda")
pages = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
used = torch.full((4,), 256, dtype=torch.int32, device="cuda")
def calls(m):
    return {
        "func": lambda: m.flash_attn_func(q, k, v),
        "func causal": lambda: m.flash_attn_func(q, k, v, causal=True),
        "func out=": lambda: m.flash_attn_func(q, k, v, out=out),
        "kvcache tensor len, no split": lambda: m.flash_attn_with_kvcache(qd, kc, vc, sl, num_splits=1),
        "kvcache tensor len, auto split": lambda: m.flash_attn_with_kvcache(qd, kc, vc, sl),
        "kvcache int len, auto split": lambda: m.flash_attn_with_kvcache(qd, kc, vc, 1000),
        "varlen paged decode, 4 splits": lambda: m.flash_attn_varlen_func(
            qv, kp, vp, cu_q, 1, seqused_k=used, max_seqlen_k=256, page_table=pages, num_splits=4),
    }
entries = {}
for tag, m in (("old", flash_cute_old), ("new", flash_cute)):
    for n, fn in calls(m).items():
        entries[(n, tag)] = fn
entries[("torch x.add_(0)", "-")] = lambda: q.add_(0)
for fn in entries.values():
    for _ in range(300): fn()
torch.cuda.synchronize()
res = {e: [] for e in entries}
names = list(entries)
for r in range(21):
    order = names[r % len(names):] + names[:r % len(names)]
    for e in order:
        fn = entries[e]
        t = time.perf_counter()
        for _ in range(500): fn()
        res[e].append((time.perf_counter() - t) / 500 * 1e6)
        torch.cuda.synchronize()
print(f"{'call':32s} {'old med/best':>14s} {'new med/best':>14s}  new-old (median of rounds' differences)")
for n in calls(flash_cute):
    o, w = res[(n, "old")], res[(n, "new")]
    d = statistics.median(b - a for a, b in zip(o, w))
    print(f"{n:32s} {statistics.median(o):6.2f}/{min(o):5.2f}  {statistics.median(w):6.2f}/{min(w):5.2f}  {d:+.2f} us")
a = res[("torch x.add_(0)", "-")]
print(f"{'torch x.add_(0)':32s} {statistics.median(a):6.2f}/{min(a):5.2f}")
