"""FP8 prefill: FP8 q, k, v (e4m3, unit descales) on FlashAttention-3's paper grid (batch x
seqlen = 16k tokens, nheads x head dim = 2048), flash_cute's FP8 math against
FlashAttention-3's FP8 (fa3_fwd_interface) and flash_cute's bf16 on the same values, in one
process, rounds interleaved; first each one's max error against float32 attention of the same
FP8 inputs (beside a naive FP8 attention's: P cast to e4m3). Prints TFLOP/s per point (the
median of ROUNDS rounds, each a median of REPS launches) and the table BENCHMARKS.md keeps.
Run from the repository root on a GPU:

    python benchmarks/fp8_prefill.py       (env: DIMS=64,128,256 SEQS=2048,8192,16384 ROUNDS=3)

Kernels compile first in parallel processes into the disk cache (bench.precompile_parallel,
on the variants the calls plan). Config sweeps: EXP=m192+n128+r72/144,... adds the FP8-math
kernel with those knobs (bench.fp8_math_knobs) beside the plan's.
"""

import itertools
import os
import statistics

import torch

import flash_cute
from flash_cute import bench, forward, plan, runtime
from flash_cute.call import Call
from flash_cute.reference import attention_ref
from flash_cute.runtime import FUNC_PLANS
from flash_cute.timing import optional_fa3, time_cuda

fa3 = optional_fa3()

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DIMS = [int(d) for d in os.environ.get("DIMS", "64,128,256").split(",")]
SEQS = [int(s) for s in os.environ.get("SEQS", "2048,8192,16384").split(",")]
ROUNDS, REPS = int(os.environ.get("ROUNDS", "3")), 10
EXPS = [e for e in os.environ.get("EXP", "").split(",") if e]


def use_knobs(name):
    """The plan's FP8-math config from now on with `name`'s knobs ("" for the plan's own)."""
    bench.set_fp8_math_changes(bench.fp8_math_knobs(name) if name else {}, FUNC_PLANS)


def with_config(name, fn):
    """fn under use_knobs(name), switched only when another name ran last (a switch re-plans
    the next call)."""

    def run():
        if with_config.current != name:
            use_knobs(name)
            with_config.current = name
        return fn()

    return run


with_config.current = ""


def inputs(d, s):
    b, h = 16384 // s, 2048 // d
    x = [torch.randn(b, s, h, d, device="cuda") for _ in range(3)]
    return [t.to(FP8) for t in x], [t.to(BF16) for t in x]


def peers(d, causal, s):
    """name -> callable at this point."""
    (q8, k8, v8), (qb, kb, vb) = inputs(d, s)
    out = {}
    if fa3 is not None:
        out["FA3 FP8"] = lambda: fa3.flash_attn_func(q8, k8, v8, causal=causal)
    for name in [""] + EXPS:
        label = f"FP8 {name}" if name else "FP8"
        call = lambda: flash_cute.flash_attn_func(q8, k8, v8, causal=causal)  # noqa: E731
        out[label] = with_config(name, call)
    out["bf16"] = lambda: flash_cute.flash_attn_func(qb, kb, vb, causal=causal)
    return out


def compile_all():
    """Every point's kernels, as flash_attn_func plans them (its padded-prefill form of the
    call, over meta tensors), compiled by worker processes into the disk cache."""
    variants = set()
    for d, causal, s, name in itertools.product(DIMS, (False, True), SEQS, [""] + EXPS):
        b, h = 16384 // s, 2048 // d
        use_knobs(name)
        for dtype in (FP8,) if name else (FP8, BF16):
            q, k, v = (torch.empty(b, s, h, d, dtype=dtype, device="meta") for _ in range(3))
            call = Call(q, k, v, causal=causal, decode_rows=False, pack_gqa=False, num_splits=1)
            try:
                planned = plan.plan_forward(
                    forward.describe(call), runtime.num_sms(0), None, 1, False, False
                )
            except ValueError as e:  # (a sweep's config may not fit: timings() says so too)
                print(f"  d{d} {name}: {str(e)[:120]}")
                continue
            variants.add(planned.variant)
    use_knobs("")
    with_config.current = ""
    failed = bench.precompile_parallel(sorted(variants, key=str), os.cpu_count() or 1)
    print(f"compiled {len(variants)} kernels; failed: {len(failed)}", flush=True)


def errors():
    print("max abs error vs float32 on the FP8 inputs (2 x 2k):")
    for d, causal in itertools.product(DIMS, (False, True)):
        torch.manual_seed(d + causal)
        (q8, k8, v8), _ = inputs(d, 8192)
        q8, k8, v8 = (t[:, :2048] for t in (q8, k8, v8))
        ref, _ = attention_ref(q8.float(), k8.float(), v8.float(), causal=causal)
        naive, _ = attention_ref(q8.float(), k8.float(), v8.float(), causal=causal, p_dtype=FP8)
        call = lambda: flash_cute.flash_attn_func(q8, k8, v8, causal=causal)  # noqa: E731
        row = {"flash_cute": with_config("", call)()}
        for name in EXPS:  # (a sweep's kernels are checked before they are timed)
            row[f"flash_cute {name}"] = with_config(name, call)()
        if fa3 is not None:
            row["FA3"] = fa3.flash_attn_func(q8, k8, v8, causal=causal)
        row = {n: ((o[0] if isinstance(o, tuple) else o).float() - ref).abs().max().item()
               for n, o in row.items()}  # fmt: skip
        row["naive"] = (naive - ref).abs().max().item()
        ratio = f"  flash_cute / FA3 {row['flash_cute'] / row['FA3']:.2f}" if "FA3" in row else ""
        print(f"  d{d} causal={causal}: " + " ".join(f"{n} {e:.3e}" for n, e in row.items())
              + ratio)  # fmt: skip


def timings():
    rows = []
    for d, causal, s in itertools.product(DIMS, (False, True), SEQS):
        b, h = 16384 // s, 2048 // d
        flops = 4 * b * s * s * h * d / (2 if causal else 1)
        cands = peers(d, causal, s)
        for name, fn in list(cands.items()):
            try:
                fn()
            except (ValueError, RuntimeError) as e:  # (a sweep's config may not fit)
                print(f"  {name}: {type(e).__name__} {str(e)[:160]}")
                del cands[name]
        times = {name: [] for name in cands}
        for _ in range(ROUNDS):
            for name, fn in cands.items():
                times[name].append(time_cuda(fn, 1, REPS) * 1e3)
        tflops = {n: flops / statistics.median(t) / 1e6 for n, t in times.items()}
        rows.append((d, causal, s, tflops))
        print(f"d{d} {'causal' if causal else 'full'} {s}: "
              + " ".join(f"{n} {x:.0f}" for n, x in tflops.items()), flush=True)  # fmt: skip
        with_config.current = None  # (the next point's first call re-plans)
    print("\n| hdim | causal | seqlen | flash_cute FP8 | FA3 FP8 | ratio | flash_cute bf16 |")
    print("|---|---|---|---|---|---|---|")
    for d, causal, s, tf in rows:
        fa = tf.get("FA3 FP8", float("nan"))
        print(f"| {d} | {'yes' if causal else 'no'} | {s} | {tf['FP8']:.0f} | {fa:.0f} | "
              f"{tf['FP8'] / fa:.2f} | {tf['bf16']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)
    compile_all()
    errors()
    timings()
