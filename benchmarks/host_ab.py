"""Host cost per cached call, A/B in one process: an older revision of the package, importable
as `flash_cute_old` from OLD_DIR (benchmarks/old_package.py exports it), against the working
tree's `flash_cute`, on tiny problems (the GPU keeps up), interleaved round by round
(flash_cute.timing.host_rounds_us). Prints each call's median / best round for both and the
median of the rounds' differences: the comparison that holds on a shared CPU whose speed moves
between rounds. Exporting the working tree's own revision as OLD_DIR gives an A/A run: the
noise of the comparison. Run from the repository root on a GPU:

    python benchmarks/old_package.py REV OLD_DIR
    python benchmarks/host_ab.py OLD_DIR [CALL ...]      (no CALL: all of CALLS)
"""

import statistics
import sys

import torch

import flash_cute
import flash_cute.flash_attn_interface  # noqa: F401 (the fa3 calls)
from flash_cute.timing import host_rounds_us

dev, bf16 = "cuda", torch.bfloat16
q = torch.randn(1, 1, 8, 128, device=dev, dtype=bf16)
k = torch.randn(1, 256, 8, 128, device=dev, dtype=bf16)
v = torch.randn_like(k)
out = torch.empty_like(q)
qd = torch.randn(1, 1, 16, 128, device=dev, dtype=bf16)
kc, vc = (torch.randn(1, 1024, 2, 128, device=dev, dtype=bf16) for _ in range(2))
sl = torch.full((1,), 1000, dtype=torch.int32, device=dev)
qv = torch.randn(4, 16, 128, device=dev, dtype=bf16)
kp, vp = (torch.randn(64, 16, 2, 128, device=dev, dtype=bf16) for _ in range(2))
cu_q = torch.arange(5, dtype=torch.int32, device=dev)
pages = torch.arange(64, dtype=torch.int32, device=dev).view(4, 16)
used = torch.full((4,), 256, dtype=torch.int32, device=dev)

CALLS = {
    "func": lambda m: m.flash_attn_func(q, k, v),
    "func causal": lambda m: m.flash_attn_func(q, k, v, causal=True),
    "func out=": lambda m: m.flash_attn_func(q, k, v, out=out),
    "kvcache tensor len, no split": lambda m: m.flash_attn_with_kvcache(
        qd, kc, vc, sl, num_splits=1
    ),
    "kvcache int len, no split": lambda m: m.flash_attn_with_kvcache(
        qd, kc, vc, 1000, num_splits=1
    ),
    "kvcache tensor len, auto split": lambda m: m.flash_attn_with_kvcache(qd, kc, vc, sl),
    "kvcache int len, auto split": lambda m: m.flash_attn_with_kvcache(qd, kc, vc, 1000),
    "varlen paged decode, 4 splits": lambda m: m.flash_attn_varlen_func(
        qv, kp, vp, cu_q, 1, seqused_k=used, max_seqlen_k=256, page_table=pages, num_splits=4
    ),
    "fa3 func": lambda m: m.flash_attn_interface.flash_attn_func(q, k, v),
    "fa3 kvcache tensor len": lambda m: m.flash_attn_interface.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=sl
    ),
    "fa3 varlen paged decode": lambda m: m.flash_attn_interface.flash_attn_with_kvcache(
        qv, kp, vp, cache_seqlens=used, page_table=pages, cu_seqlens_q=cu_q, max_seqlen_q=1
    ),
}


def main():
    sys.path.insert(0, sys.argv[1])
    import flash_cute_old
    import flash_cute_old.flash_attn_interface  # noqa: F401

    names = sys.argv[2:] or list(CALLS)
    fns = {
        (n, tag): (lambda call=CALLS[n], m=m: call(m))
        for tag, m in (("old", flash_cute_old), ("new", flash_cute))
        for n in names
    }
    fns[("torch x.add_(0)", "-")] = lambda: q.add_(0)
    res = host_rounds_us(fns, calls=500, rounds=21)
    header = f"{'call':32s} {'old med/best':>14s} {'new med/best':>14s}"
    print(header + "  new-old (median of rounds' differences)")
    for n in names:
        o, w = res[(n, "old")], res[(n, "new")]
        d = statistics.median(b - a for a, b in zip(o, w))
        old, new = (
            f"{statistics.median(o):6.2f}/{min(o):5.2f}",
            f"{statistics.median(w):6.2f}/{min(w):5.2f}",
        )
        print(f"{n:32s} {old}  {new}  {d:+.2f} us")
    a = res[("torch x.add_(0)", "-")]
    print(f"{'torch x.add_(0)':32s} {statistics.median(a):6.2f}/{min(a):5.2f}")


if __name__ == "__main__":
    main()
