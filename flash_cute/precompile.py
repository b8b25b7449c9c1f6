"""Compile every kernel variant of the config tables ahead of time (into the disk cache).

    python -m flash_cute.precompile [--head-dims 64 128] [--gqa-ratios 4 8] [--check-ptx]

Covers the prefill table (and its short-sequence rows), with and without the LSE, and the decode
configs as flash_attn_with_kvcache uses them (cache_seqlens a tensor or an int, split and not,
GQA packed at each --gqa-ratios). Kernels target sm_90a, so it runs on a machine with no GPU.
--check-ptx keeps each kernel's PTX and ptxas report and fails unless the PTX targets sm_90a,
has WGMMA, TMA loads and setmaxnreg, and ptxas reports zero spill bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from .compile_cache import TARGET_ARCH, compile_forward, get_forward_kernel
from .config import (
    DECODE_CONFIGS,
    FORWARD_CONFIGS,
    PAIR_CONFIGS,
    SHORT_SEQUENCE_CONFIGS,
    AttentionConfig,
)
from .plan import ForwardVariant, Problem, plan_forward

REQUIRED_PTX = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg")
# ptxas' info lines that cost a kernel its WGMMA pipelining (the code and the reason, up to the
# function's name): "(C7513) Potential Performance Loss: wgmma.mma_async instructions are
# serialized due to ...", "(C7517) wgmma.wait_group is injected ...".
WGMMA_SERIALIZED = re.compile(
    r"\((C75\d\d)\) (?:Potential Performance Loss: )?(wgmma[^'\n]*?)(?: in (?:the )?function|$)",
    re.MULTILINE,
)


@dataclass
class PtxReport:
    variant: ForwardVariant
    instruction_counts: dict
    spill_bytes: int
    registers: int
    setmaxnreg_ignored: bool
    seconds: float
    target: str = ""  # the PTX's .target
    # ptxas' notes that it serialized WGMMAs or waited them out (C75xx): correct, only slower
    wgmma_serialized: tuple = ()

    def problems(self) -> List[str]:
        found = [f"no {name} in the PTX" for name, n in self.instruction_counts.items() if n == 0]
        if self.target != TARGET_ARCH:
            found.append(f"the PTX targets {self.target or 'nothing'}, not {TARGET_ARCH}")
        if self.spill_bytes:
            found.append(f"ptxas reports {self.spill_bytes} spill bytes")
        if self.setmaxnreg_ignored:
            found.append("ptxas ignored setmaxnreg (C7508: no register cap at kernel entry)")
        found += [f"ptxas serialized WGMMAs: {note}" for note in self.wgmma_serialized]
        return found


# The SM count the variants are planned for (an H100 SXM's): it decides only which problems
# fit in one wave of CTAs, and the problems below are far from that boundary.
PLANNED_SMS = 132


def func_variant(
    config: AttentionConfig,
    head_dim: int,
    dtype: str,
    causal: bool,
    writes_lse: bool = False,
    single_wave: bool = False,
    window_left: int = -1,
    head_dim_v: Optional[int] = None,
) -> ForwardVariant:
    """The variant flash_attn_func launches with `config` on a problem of many waves of tiles
    (4096 tiles of 128 rows), or with single_wave on one of a single tile; with window_left,
    on a causal problem long enough for that window to stay a window."""
    nheads, seqlen = (1, 64) if single_wave else (64, max(1024, window_left + 2))
    problem = Problem(
        batch=1 if single_wave else 8,
        nheads=nheads,
        nheads_kv=nheads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        max_seqlen_q=seqlen,
        max_seqlen_k=seqlen,
        kv_capacity=seqlen,
        causal=causal,
        writes_lse=writes_lse,
        window_left=window_left,
    )
    plan = plan_forward(problem, PLANNED_SMS, config, pack_gqa=False, decode_rows=False)
    return plan.variant


def table_variants(
    head_dims: Optional[Iterable[int]] = None, writes_lse=(True, False)
) -> List[ForwardVariant]:
    """Prefill kernels of the config table (long and short-sequence rows) as flash_attn_func
    launches them: on many waves of tiles, and on one wave (a dynamic persistent row then runs
    its static twin)."""
    rows = list(FORWARD_CONFIGS.items()) + [
        (k, entry[1]) for k, entry in SHORT_SEQUENCE_CONFIGS.items()
    ]
    rows = [((d, None, dtype, causal), config) for (d, dtype, causal), config in rows]
    rows += list(PAIR_CONFIGS.items())  # (head_dim, head_dim_v, dtype, causal)
    variants = []
    for (head_dim, head_dim_v, dtype, causal), config in sorted(rows, key=str):
        if head_dims is not None and head_dim not in head_dims:
            continue
        for single_wave in (False, True):
            for lse in writes_lse:
                variants.append(
                    func_variant(config, head_dim, dtype, causal, lse, single_wave, -1, head_dim_v)
                )
    return list(dict.fromkeys(variants))


def decode_variants(
    head_dims: Optional[Iterable[int]] = None,
    gqa_ratios=(4, 8),
    int_lengths=(False, True),
    appends=(False,),
) -> List[ForwardVariant]:
    """Decode kernels as flash_attn_with_kvcache launches them for one new token per sequence
    on a padded cache, no LSE returned: cache_seqlens a tensor and (int_lengths) an int, causal
    or not, split (2 splits) or not, GQA packed at each ratio; with appends (False, True) also
    those that append k and v themselves with rotary (a tensor cache_seqlens: fused_append;
    rotary over the whole head dim, tables in the queries' dtype, interleaved or not)."""
    variants = []
    for head_dim, dtype in sorted(DECODE_CONFIGS, key=str):
        if head_dims is not None and head_dim not in head_dims:
            continue
        for causal in (False, True):
            for num_splits in (1, 2):
                for ratio in gqa_ratios:
                    forms = itertools.product(int_lengths, appends, (True, False))
                    for scalar, after_append, interleaved in forms:
                        if (scalar and after_append) or (not after_append and not interleaved):
                            continue  # (an append hands the forward a lengths tensor)
                        problem = Problem(
                            batch=1,
                            nheads=8 * ratio,
                            nheads_kv=8,
                            head_dim=head_dim,
                            dtype=dtype,
                            max_seqlen_q=1,
                            max_seqlen_k=4096,
                            kv_capacity=4096,
                            causal=causal,
                            seqused_k=not scalar,
                            scalar_kv_length=scalar,
                            after_append=after_append,
                            fused_append=after_append,
                            rotary_dim=head_dim if after_append else 0,
                            rotary_interleaved=after_append and interleaved,
                            rotary_per_row=after_append and causal,
                            rotary_dtype=dtype if after_append else None,
                        )
                        plan = plan_forward(problem, PLANNED_SMS, num_splits=num_splits)
                        variants.append(plan.variant)
    return variants


def wgmma_serializations(ptxas_report: str) -> tuple:
    """ptxas' notes in a compile's report that it serialized WGMMAs or injected waits between
    them, as "C75xx why", each once."""
    found = WGMMA_SERIALIZED.findall(ptxas_report)
    return tuple(sorted({f"{code} {why}" for code, why in found}))


def compile_with_ptx_report(variant: ForwardVariant) -> PtxReport:
    """Compile `variant` (uncached), keeping its PTX and the ptxas resource report."""
    with tempfile.TemporaryDirectory() as dump_dir:
        log = io.StringIO()
        start = time.time()
        # remarks{ptx} prints the ptxas -v report (registers, spills) as compiler remarks.
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            compile_forward(variant, options=f"--keep-ptx --dump-dir={dump_dir} remarks{{ptx}}")
        seconds = time.time() - start
        ptx = "".join(path.read_text() for path in Path(dump_dir).glob("*.ptx"))
    report = log.getvalue()
    if not ptx:
        raise RuntimeError(f"no PTX was kept for {variant}")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    spills += [int(n) for n in re.findall(r"(\d+) bytes spill loads", report)]
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    if not regs:
        raise RuntimeError(f"ptxas printed no resource report for {variant}:\n{report[-2000:]}")
    return PtxReport(
        variant=variant,
        instruction_counts={name: ptx.count(name) for name in REQUIRED_PTX},
        spill_bytes=sum(spills),
        registers=max(regs),
        setmaxnreg_ignored="C7508" in report or "'setmaxnreg' ignored" in report,
        seconds=seconds,
        target=" ".join(re.findall(r"^\.target\s+(\S+)", ptx, re.MULTILINE)),
        wgmma_serialized=wgmma_serializations(report),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--head-dims", type=int, nargs="*", default=None)
    parser.add_argument(
        "--gqa-ratios",
        type=int,
        nargs="*",
        default=[4, 8],
        help="q heads per kv head to prepare decode kernels for",
    )
    parser.add_argument("--check-ptx", action="store_true")
    args = parser.parse_args(argv)
    failures = 0
    variants = table_variants(args.head_dims) + decode_variants(
        args.head_dims, args.gqa_ratios, appends=(False, True)
    )
    for variant in variants:
        label = variant.describe()
        try:
            if args.check_ptx:
                report = compile_with_ptx_report(variant)
                problems = report.problems()
                status = "FAIL " + "; ".join(problems) if problems else "ok"
                failures += bool(problems)
                print(
                    f"{label}: {status} ({report.registers} regs at entry, "
                    f"{report.spill_bytes} spill bytes, {report.seconds:.1f}s)",
                    flush=True,
                )
            else:
                start = time.time()
                get_forward_kernel(variant)
                print(f"{label}: compiled in {time.time() - start:.1f}s", flush=True)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"{label}: FAIL {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
