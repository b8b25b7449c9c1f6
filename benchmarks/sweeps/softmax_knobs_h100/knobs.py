"""A/B of the softmax knobs (exp2 on the FMA pipe, lazy rescale, stale max) against the table's
config, per head dim / causal / seqlen, interleaved in one run. Usage: knobs.py CASE..."""

import json
import os
import sys
import time

import torch

import flash_cute
from flash_cute.bench import DTYPES, precompile_parallel, time_interleaved
from flash_cute.compile_cache import ForwardKernelKey

VARIANTS = {
    "base": {},
    "fma1": dict(exp2_on_fma=1),
    "fma2": dict(exp2_on_fma=2),
    "fma3": dict(exp2_on_fma=3),
    "fma4": dict(exp2_on_fma=4),
    "lazy": dict(lazy_rescale=True),
    "plain": dict(lazy_rescale=False, rescale_threshold=0),
    "st3": dict(num_stages=3),
    "n112": dict(tile_n=112),
    "dyn": dict(scheduler="dynamic_persistent"),
    "single": dict(scheduler="single_tile"),
    "noprobe": dict(mbarrier_probe=False),
    "rb0single": dict(
        scheduler="single_tile", rescale_o_before_pv=True, lazy_rescale=True, rescale_threshold=0
    ),
    "rb8static": dict(
        mbarrier_probe=True,
        scheduler="static_persistent",
        rescale_o_before_pv=True,
        lazy_rescale=True,
        rescale_threshold=8,
    ),
    "rb8single": dict(
        scheduler="single_tile", rescale_o_before_pv=True, lazy_rescale=True, rescale_threshold=8
    ),
    "staticplain": dict(scheduler="static_persistent", lazy_rescale=False, rescale_threshold=0),
    "single0": dict(scheduler="single_tile", lazy_rescale=True, rescale_threshold=0),
    "static0": dict(scheduler="static_persistent", lazy_rescale=True, rescale_threshold=0),
    "dyn0": dict(scheduler="dynamic_persistent", lazy_rescale=True, rescale_threshold=0),
    "single8": dict(scheduler="single_tile", lazy_rescale=True, rescale_threshold=8),
    "static8": dict(scheduler="static_persistent", lazy_rescale=True, rescale_threshold=8),
    "lazy0": dict(lazy_rescale=True, rescale_threshold=0),
    "lazy8": dict(lazy_rescale=True, rescale_threshold=8),
    "lazy8fma1": dict(lazy_rescale=True, rescale_threshold=8, exp2_on_fma=1),
    "lazy8fma2": dict(lazy_rescale=True, rescale_threshold=8, exp2_on_fma=2),
}


def main():
    cases = []
    for spec in sys.argv[
        1:
    ]:  # hdim:causal:dtype:seqlens:variants  e.g. 64:0:bf16:2048,8192:base,fma1
        hd, causal, dt, seqs, names = spec.split(":")
        cases.append(
            (int(hd), causal == "1", dt, [int(s) for s in seqs.split(",")], names.split(","))
        )

    keys = []
    for hd, causal, dt, seqs, names in cases:
        dname = "bfloat16" if dt == "bf16" else "float16"
        for s in seqs:
            base = flash_cute.default_config(hd, dname, causal, s)
            for n in names:
                keys.append(ForwardKernelKey(dname, hd, causal, base.replace(**VARIANTS[n]), False))
    keys = list(dict.fromkeys(keys))
    t = time.time()
    fails = precompile_parallel(keys, 15)
    print(f"compiled {len(keys)} in {time.time() - t:.0f}s, failures {fails}", flush=True)
    out = {}
    for hd, causal, dt, seqs, names in cases:
        dname = "bfloat16" if dt == "bf16" else "float16"
        for s in seqs:
            batch = max(1, 16384 // s)
            nh = 2048 // hd
            g = torch.Generator(device="cuda").manual_seed(s)
            q, k, v = (
                torch.randn(batch, s, nh, hd, device="cuda", dtype=DTYPES[dt], generator=g)
                for _ in range(3)
            )
            flops = 4 * batch * nh * s * s * hd / (2 if causal else 1)
            base = flash_cute.default_config(hd, dname, causal, s)
            fns = {
                n: (
                    lambda c=base.replace(**VARIANTS[n]): flash_cute.flash_attn_func(
                        q, k, v, causal=causal, config=c
                    )
                )
                for n in names
            }
            times = time_interleaved(fns, warmup=5, reps=40, rounds=4)
            tf = {n: flops / times[n] / 1e9 for n in names}
            out[f"{hd}:{int(causal)}:{dt}:{s}"] = tf
            print(
                f"hd{hd} {'causal' if causal else 'full  '} {dt} {s:6d} | "
                + " ".join(f"{n}:{tf[n]:.0f}({tf[n] / tf[names[0]]:.3f})" for n in names),
                flush=True,
            )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"knobs_{int(time.time())}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
