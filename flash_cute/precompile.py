"""Compile every kernel variant of the config tables ahead of time (into the disk cache).

    python -m flash_cute.precompile [--arch sm_90a] [--head-dims 64 128] [--gqa-ratios 4 8]
                                    [--check-ptx]

Covers the prefill table (and its short-sequence rows), with and without the LSE, and the decode
configs as flash_attn_with_kvcache uses them (cache_seqlens a tensor or an int, split and not,
GQA packed at each --gqa-ratios). With --arch sm_90a it runs on a machine with no GPU.
--check-ptx keeps each kernel's PTX and ptxas report and fails unless the PTX has WGMMA, TMA
loads and setmaxnreg and ptxas reports zero spill bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional

from .compile_cache import ForwardKernelKey, compile_forward, ensure_target_arch, get_forward_kernel
from .config import DECODE_CONFIGS, FORWARD_CONFIGS, SHORT_SEQUENCE_CONFIGS

REQUIRED_PTX = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg")


@dataclass
class PtxReport:
    key: ForwardKernelKey
    instruction_counts: dict
    spill_bytes: int
    registers: int
    setmaxnreg_ignored: bool
    seconds: float

    def problems(self) -> List[str]:
        found = [f"no {name} in the PTX" for name, n in self.instruction_counts.items() if n == 0]
        if self.spill_bytes:
            found.append(f"ptxas reports {self.spill_bytes} spill bytes")
        if self.setmaxnreg_ignored:
            found.append("ptxas ignored setmaxnreg (C7508: no register cap at kernel entry)")
        return found


def table_keys(
    head_dims: Optional[Iterable[int]] = None, writes_lse=(True, False)
) -> List[ForwardKernelKey]:
    """Prefill kernels of the config table, long and short-sequence rows; a dynamic persistent
    row also with its static twin, which problems of one wave of tiles launch
    (interface.single_wave_config)."""
    rows = list(FORWARD_CONFIGS.items()) + [
        (k, entry[1]) for k, entry in SHORT_SEQUENCE_CONFIGS.items()
    ]
    keys = []
    for (head_dim, dtype, causal), config in sorted(rows, key=str):
        if head_dims is not None and head_dim not in head_dims:
            continue
        configs = [config]
        if config.scheduler == "dynamic_persistent":
            configs.append(config.replace(scheduler="static_persistent"))
        for cfg in configs:
            for lse in writes_lse:
                keys.append(ForwardKernelKey(dtype, head_dim, causal, cfg, lse))
    return list(dict.fromkeys(keys))


def decode_keys(
    head_dims: Optional[Iterable[int]] = None, gqa_ratios=(4, 8), int_lengths=(False, True)
) -> List[ForwardKernelKey]:
    """Decode kernels as flash_attn_with_kvcache launches them for a padded cache and no LSE
    returned: cache_seqlens a tensor and (int_lengths) an int, causal or not, split or not, GQA
    packed at each ratio."""
    keys = []
    for (head_dim, dtype), config in sorted(DECODE_CONFIGS.items(), key=str):
        if head_dims is not None and head_dim not in head_dims:
            continue
        for causal in (False, True):
            for split in (False, True):
                for ratio in gqa_ratios:
                    for scalar in int_lengths:
                        keys.append(
                            ForwardKernelKey(
                                dtype,
                                head_dim,
                                causal,
                                config,
                                False,
                                seqused_k=not scalar,
                                scalar_kv_length=scalar,
                                split=split,
                                pack_gqa_ratio=ratio,
                            )
                        )
    return keys


def compile_with_ptx_report(key: ForwardKernelKey) -> PtxReport:
    """Compile `key` (uncached), keeping its PTX and the ptxas resource report."""
    ensure_target_arch()
    with tempfile.TemporaryDirectory() as dump_dir:
        log = io.StringIO()
        start = time.time()
        # remarks{ptx} prints the ptxas -v report (registers, spills) as compiler remarks.
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            compile_forward(key, options=f"--keep-ptx --dump-dir={dump_dir} remarks{{ptx}}")
        seconds = time.time() - start
        ptx = "".join(
            open(os.path.join(dump_dir, f)).read()
            for f in os.listdir(dump_dir)
            if f.endswith(".ptx")
        )
    report = log.getvalue()
    if not ptx:
        raise RuntimeError(f"no PTX was kept for {key}")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    spills += [int(n) for n in re.findall(r"(\d+) bytes spill loads", report)]
    regs = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    if not regs:
        raise RuntimeError(f"ptxas printed no resource report for {key}:\n{report[-2000:]}")
    return PtxReport(
        key=key,
        instruction_counts={name: ptx.count(name) for name in REQUIRED_PTX},
        spill_bytes=sum(spills),
        registers=max(regs),
        setmaxnreg_ignored="C7508" in report or "'setmaxnreg' ignored" in report,
        seconds=seconds,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", default=None, help="target arch when there is no GPU, e.g. sm_90a"
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
    ensure_target_arch(args.arch)
    failures = 0
    for key in table_keys(args.head_dims) + decode_keys(args.head_dims, args.gqa_ratios):
        label = (
            f"hdim={key.head_dim} {key.dtype} causal={key.causal} lse={key.writes_lse} "
            f"tile={key.config.tile_m}x{key.config.tile_n}"
            + (f" decode split={key.split} gqa={key.pack_gqa_ratio}" if key.seqused_k else "")
        )
        try:
            if args.check_ptx:
                report = compile_with_ptx_report(key)
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
                get_forward_kernel(key)
                print(f"{label}: compiled in {time.time() - start:.1f}s", flush=True)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"{label}: FAIL {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
