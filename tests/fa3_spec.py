"""Run FlashAttention-3's own forward tests against flash_cute.flash_attn_interface.

    python tests/fa3_spec.py --fa3-hopper DIR [--sample N] [--no-local] [pytest args ...]

DIR holds FlashAttention-3's hopper/test_flash_attn.py, padding.py and test_util.py (copy them
from a checkout of Dao-AILab/flash-attention; they are not part of this repository; the tests
import einops). The script copies them into a work directory, applies PATCHES (each leaves out
a feature flash_cute does not serve yet, named in its reason), writes a flash_attn_interface
module there that is flash_cute's, and runs pytest on the forward cases the spec names
(output, varlen, kvcache, combine) with FlashAttention-3's own switches off for what flash_cute
does not serve: backward. Appending K/V with rotary (FlashAttention-3's reference for it is
flash_attn.layers.rotary; where that is not installed, the work directory gets a stand-in
written to its documented semantics, ROTARY_REFERENCE) and FP8 cases run (flash_cute serves FP8
q, k, v in e4m3 math with FlashAttention-3's error; head dims e4m3 math does not take, such as
80 or 192 / 128, in 16-bit math, below it).

flash_cute bakes window sizes and attention chunks into its kernels, and FlashAttention-3's
tests draw them at random, so each local case compiles new kernels: --no-local switches local
cases off (FLASH_ATTENTION_DISABLE_LOCAL), and --sample N keeps one test in N of each test
function (a stable choice by the test's id) to fit a time budget.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = ("test_flash_attn.py", "padding.py", "test_util.py")

# (text in test_flash_attn.py, replacement, why): each must match, or the run stops. None
# now: the forward cases run unchanged.
PATCHES: list = []

SELECT = (
    "test_flash_attn_output or test_flash_attn_varlen_output or test_flash_attn_kvcache "
    "or test_flash_attn_combine"
)

SHIM = '"""FlashAttention-3\'s module name, served by flash_cute."""\n' + (
    "from flash_cute.flash_attn_interface import *  # noqa: F403\n"
)

SAMPLER = """import zlib

SAMPLE = {sample}


def pytest_collection_modifyitems(config, items):
    if SAMPLE > 1:
        kept = [i for i in items if zlib.crc32(i.nodeid.encode()) % SAMPLE == 0]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
"""


# FlashAttention-3's tests take their rotary reference from FlashAttention-2's package
# (flash_attn.layers.rotary: without it they skip every rotary case). Where it is not
# installed, the work directory gets this one: its documented semantics, in float32.
ROTARY_REFERENCE = '''"""apply_rotary_emb as flash_attn.layers.rotary documents it (spec runs)."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens; cos,
    sin (seqlen_ro, rotary_dim / 2). Row s of sequence b sits at position s + seqlen_offsets
    (an int or a (batch,) tensor); its first rotary_dim dims rotate in pairs (2j, 2j + 1) if
    interleaved, else (j, j + rotary_dim / 2). Float32 math, x's dtype out."""
    half = cos.shape[-1]
    if cu_seqlens is None:
        offsets = seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets.long()
        steps = torch.arange(x.shape[1], device=x.device)
        pos = steps[None, :] + (offsets if isinstance(offsets, int) else offsets[:, None])
        c, s = cos.float()[pos][..., None, :], sin.float()[pos][..., None, :]
    else:
        token = torch.arange(x.shape[0], device=x.device)
        cu = cu_seqlens.long()
        seq = torch.searchsorted(cu[1:], token, right=True)
        offsets = seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets.long()[seq]
        pos = token - cu[seq] + offsets
        c, s = cos.float()[pos][:, None, :], sin.float()[pos][:, None, :]
    out = x.to(torch.float32, copy=True)
    first = out[..., 0 : 2 * half : 2] if interleaved else out[..., :half]
    second = out[..., 1 : 2 * half : 2] if interleaved else out[..., half : 2 * half]
    first, second = first * c - second * s, first * s + second * c
    if interleaved:
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = first, second
    else:
        out[..., :half], out[..., half : 2 * half] = first, second
    out = out.to(x.dtype)
    return x.copy_(out) if inplace else out
'''


def rotary_reference_installed() -> bool:
    try:
        from flash_attn.layers import rotary  # noqa: F401
    except ImportError:
        return False
    return True


def prepare(fa3_hopper: Path, work: Path, sample: int) -> list:
    """The work directory's files; returns the patches applied."""
    for name in FILES:
        shutil.copy(fa3_hopper / name, work / name)
    if not rotary_reference_installed():
        layers = work / "flash_attn" / "layers"
        layers.mkdir(parents=True, exist_ok=True)
        (work / "flash_attn" / "__init__.py").write_text('"""The spec run\'s stand-in."""\n')
        (layers / "__init__.py").write_text("")
        (layers / "rotary.py").write_text(ROTARY_REFERENCE)
        print("rotary reference: flash_cute's stand-in for flash_attn.layers.rotary")
    test = work / "test_flash_attn.py"
    text = test.read_text()
    for old, new, why in PATCHES:
        if text.count(old) < 1:
            raise SystemExit(f"FlashAttention-3's tests changed: no {old!r} to patch ({why})")
        text = text.replace(old, new)
    test.write_text(text)
    (work / "flash_attn_interface.py").write_text(SHIM)
    (work / "conftest.py").write_text(SAMPLER.format(sample=sample))
    return PATCHES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fa3-hopper", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--sample", type=int, default=1, help="keep one test in N")
    parser.add_argument("--no-local", action="store_true", help="no windows or chunks")
    args, pytest_args = parser.parse_known_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="fa3_spec_"))
    work.mkdir(parents=True, exist_ok=True)
    patches = prepare(args.fa3_hopper, work, args.sample)
    env = dict(os.environ)
    for switch in ("BACKWARD",) + (("LOCAL",) if args.no_local else ()):
        env[f"FLASH_ATTENTION_DISABLE_{switch}"] = "TRUE"
    if "-k" not in pytest_args:
        pytest_args = ["-k", SELECT, *pytest_args]
    for why in (p[2] for p in patches):
        print(f"patched out: {why}")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    return subprocess.call(command, cwd=work, env=env)


if __name__ == "__main__":
    sys.exit(main())
