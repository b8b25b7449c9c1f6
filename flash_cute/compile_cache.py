"""Compile forward kernels on fake arguments, once per variant, into a cache.

A compiled kernel depends only on its variant (flash_cute.plan.ForwardVariant, the cache key):
batch, sequence lengths, head counts and strides are run-time values, so a new shape never
recompiles. Each compiled signature is one of the kernel's entry points (`Signature`: SHORT or
FULL, read off the method). Kernels are compiled for the TVM-FFI calling convention: the
compiled function takes torch tensors directly and launches on torch's current CUDA stream.

Compiled kernels also persist on disk as object files, so another process loads them in
milliseconds instead of compiling for seconds. The directory is FLASH_CUTE_CACHE_DIR (default
$XDG_CACHE_HOME/flash_cute or ~/.cache/flash_cute), namespaced by a fingerprint of this
package's sources and the DSL/TVM-FFI versions; FLASH_CUTE_DISK_CACHE=0 turns it off. Several
processes may fill it at once: a per-kernel file lock makes one compile while the others wait
and then load, and files appear atomically (write to a temporary name, then rename).

Compiling needs no GPU: every compile names its target, sm_90a, in its options (TARGET_OPTIONS),
so no environment variable has to be set before the DSL is imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import os
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from .call import DESCALED_OPERAND
from .plan import ForwardVariant

TARGET_ARCH = "sm_90a"

# Host-side contract the fake tensors declare (checked by flash_cute.checks before a call):
# 16-byte aligned base pointers and strides of a 16-byte multiple.


_cache: Dict[object, Callable] = {}
_lock = threading.Lock()


# The compile target, named in every compile's options: the DSL's own default (CUTE_DSL_ARCH,
# or the GPU it finds, or sm_100 without one) is read when it is imported, which a test runner
# or an application may do first.
TARGET_OPTIONS = f"--enable-tvm-ffi --gpu-arch {TARGET_ARCH}"

# Import the DSL with the package (about a second, once) rather than inside the first call,
# so a process whose kernels are in the disk cache serves its first call in milliseconds.
import cutlass  # noqa: E402
import cutlass.cute  # noqa: E402,F401


def _cutlass_dtype(name: str):
    return {
        "float16": cutlass.Float16,
        "bfloat16": cutlass.BFloat16,
        "float32": cutlass.Float32,
        "float8_e4m3fn": cutlass.Float8E4M3FN,
    }[name]


def _fake_tensor(dtype_, shape, divisibility: int = 1, align: Optional[int] = None):
    """A fake tensor of `shape` (symbolic sizes) for a compile: symbolic strides, each
    divisible by `divisibility` elements, the last dim contiguous, the base `align` bytes
    aligned (default: one element's)."""
    import cutlass.cute as cute

    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1])
    align = align or dtype_.width // 8
    return cute.runtime.make_fake_tensor(dtype_, shape, stride=(*strides, 1), assumed_align=align)


@dataclass(frozen=True)
class Signature:
    """A compiled entry point of the forward kernel: the FlashAttentionForwardSm90 method that
    is compiled and its arguments in order (the CUDA stream follows them), read off the method
    itself, which is where each signature is written. compile_forward builds one fake argument
    per name; runtime.LaunchPlan passes the values in this order."""

    method: str
    args: Tuple[str, ...]

    @staticmethod
    def of(method: str) -> "Signature":
        from flash_cute.kernels import FlashAttentionForwardSm90

        params = tuple(inspect.signature(getattr(FlashAttentionForwardSm90, method)).parameters)
        assert params[0] == "self" and params[-1] == "stream", params
        return Signature(method, params[1:-1])


# Variants that use no optional argument take the short signature: each argument costs
# TVM-FFI a conversion on the host, so the common call passes seven.
SHORT = Signature.of("call_short")
FULL = Signature.of("__call__")
DESCALES = tuple(DESCALED_OPERAND)  # (q, k, v: ForwardVariant.descales_taken's order)
OPTIONAL_TENSORS = (
    "lse",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "seqused_k",
    "page_table",
    "learnable_sink",
    "seqused_q",
    "kv_batch_idx",
    "leftpad_k",
    "qv",
    "q_descale",
    "k_descale",
    "v_descale",
    "append_k",
    "append_v",
    "append_cos",
    "append_sin",
)


def signature(variant: ForwardVariant) -> Signature:
    return FULL if variant.takes_optionals else SHORT


def fake_arguments(variant: ForwardVariant) -> Dict[str, object]:
    """A fake of every argument the forward kernel can take (None for the optional tensors the
    variant does not use), by signature name, with symbolic sizes and strides: the compiled
    function then checks each real argument against them (dtype, rank, shared sizes such as
    v's shape and k's, 16-byte alignment and stride divisibility)."""
    import cutlass.cute as cute

    from flash_cute.kernels.trace_records import RECORD_WORDS

    dtype = _cutlass_dtype(variant.dtype)
    kv_dtype = dtype if variant.kv_dtype is None else _cutlass_dtype(variant.kv_dtype)
    q_dtype = dtype if variant.q_dtype is None else _cutlass_dtype(variant.q_dtype)
    sym = cute.sym_int
    batch, seqlen_q, nheads, seqlen_k, nheads_kv = (sym() for _ in range(5))
    d, dv = variant.head_dim, variant.head_dim_v
    d_qk = d - dv if variant.qv else d  # q's and k's own columns (qv: the rope part)

    def tensor(dtype_, shape, align=16):
        # 16-byte aligned rows: strides divisible by 16 bytes' worth of elements.
        return _fake_tensor(dtype_, shape, 128 // dtype_.width if align == 16 else 1, align)

    def int32_tensor(rank):
        return tensor(cutlass.Int32, tuple(sym() for _ in range(rank)), align=4)

    q_rows = (seqlen_q,) if variant.varlen_q else (batch, seqlen_q)
    if variant.kv_layout == "packed":
        kv_rows = (seqlen_k, nheads_kv)
    else:  # padded: (batch, seqlen_k, ...); paged: (num_pages, page_size, ...)
        kv_rows = (sym(), seqlen_k, nheads_kv)
    lse_shape = (nheads, seqlen_q) if variant.varlen_q else (batch, nheads, seqlen_q)
    gmem = cute.AddressSpace.gmem
    return {
        "q": tensor(q_dtype, (*q_rows, nheads, d_qk)),
        "k": tensor(kv_dtype, (*kv_rows, d_qk)),
        "v": tensor(kv_dtype, (*kv_rows, dv)),
        "out": tensor(dtype, (*q_rows, nheads, dv)),
        "lse": tensor(cutlass.Float32, lse_shape, align=4) if variant.writes_lse else None,
        "cu_seqlens_q": int32_tensor(1) if variant.varlen_q else None,
        "cu_seqlens_k": int32_tensor(1) if variant.kv_layout == "packed" else None,
        "seqused_k": int32_tensor(1) if variant.seqused_k else None,
        "page_table": int32_tensor(2) if variant.kv_layout == "paged" else None,
        # (nheads,) sink logits, contiguous
        "learnable_sink": None
        if variant.learnable_sink is None
        else cute.runtime.make_fake_tensor(
            _cutlass_dtype(variant.learnable_sink), (nheads,), stride=(1,), assumed_align=2
        ),
        "seqused_q": int32_tensor(1) if variant.seqused_q else None,
        "kv_batch_idx": int32_tensor(1) if variant.kv_batch_idx else None,
        "leftpad_k": int32_tensor(1) if variant.leftpad_k else None,
        "qv": tensor(dtype, (*q_rows, nheads, dv)) if variant.qv else None,
        # FP8 K/V (and q with FP8 math): (batch, nheads_kv) fp32 descales, any strides (0: one
        # value broadcast).
        **{
            name: cute.runtime.make_fake_tensor(
                cutlass.Float32,
                (sym(), sym()),
                stride=(cute.sym_int64(), cute.sym_int64()),
                assumed_align=4,
            )
            if taken
            else None
            for name, taken in zip(DESCALES, variant.descales_taken)
        },
        # A fused append's rows (batch, new, nheads_kv, d / dv) and rotary tables: read by
        # scalar loads (element-aligned, any strides but the last).
        **_fused_append_fakes(variant, kv_dtype, batch, nheads_kv, d_qk, dv),
        "kv_length": cutlass.Int32(0),
        # Split scratch (partial O, then partial LSE) and the zeroed int32 counters (the
        # dynamic scheduler's, or a split launch's arrivals): addresses, which TVM-FFI
        # converts for less than a tensor; None where the variant has none.
        "partials": cute.runtime.make_ptr(cutlass.Float32, 0, gmem, assumed_align=16)
        if variant.split
        else None,
        "counters": cute.runtime.make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)
        if variant.takes_counters
        else None,
        "scale_log2": cutlass.Float32(1.0),
        "max_ctas": cutlass.Int32(1),
        "num_splits": cutlass.Int32(1),
        # Traced variants: (tiles, RECORD_WORDS) int64 records, row-major.
        "trace": cute.runtime.make_fake_tensor(
            cutlass.Int64, (sym(), RECORD_WORDS), stride=(RECORD_WORDS, 1), assumed_align=8
        )
        if variant.config.trace
        else None,
    }


def _fused_append_fakes(variant, kv_dtype, batch, nheads_kv, d, dv) -> dict:
    import cutlass.cute as cute

    names = ("append_k", "append_v", "append_cos", "append_sin")
    if not variant.fused_append:
        return dict.fromkeys(names)
    new, seqlen_ro = cute.sym_int(), cute.sym_int()
    tables = (None, None)
    if variant.rotary_dim:
        shape = (seqlen_ro, variant.rotary_dim // 2)
        tables = [_fake_tensor(_cutlass_dtype(variant.rotary_dtype), shape) for _ in range(2)]
    rows = [_fake_tensor(kv_dtype, (batch, new, nheads_kv, w)) for w in (d, dv)]
    return dict(zip(names, (*rows, *tables)))


def compile_forward(variant: ForwardVariant, options: str = "") -> Callable:
    """Compile (uncached) the forward kernel of `variant` on fake arguments, for sm_90a."""
    import cutlass.cute as cute

    from flash_cute.kernels import forward_kernel

    kernel = forward_kernel(variant)
    sig = signature(variant)
    fakes = fake_arguments(variant)
    # A variant taking the short signature may use none of the optional tensors.
    assert sig is FULL or all(fakes[name] is None for name in OPTIONAL_TENSORS), variant
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"{TARGET_OPTIONS} {options}".strip()
    args = [fakes[name] for name in sig.args]
    return cute.compile(getattr(kernel, sig.method), *args, stream, options=opts)


@dataclass(frozen=True)
class CombineKernelKey:
    """A compiled split-KV combine kernel."""

    out_dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int
    writes_lse: bool
    trace: bool = False  # records per CTA (kernels/trace_records.py)


def compile_combine(key: CombineKernelKey, options: str = "") -> Callable:
    """Compile (uncached) the combine kernel for `key` on fake tensors with symbolic shapes, for
    sm_90a."""
    import cutlass
    import cutlass.cute as cute

    from flash_cute.kernels import FlashAttentionCombine

    out_dtype = {"float32": cutlass.Float32}.get(key.out_dtype) or _cutlass_dtype(key.out_dtype)
    splits, batch, seqlen, nheads = (cute.sym_int() for _ in range(4))
    d = key.head_dim

    fp32 = cutlass.Float32
    out_partial = _fake_tensor(fp32, (splits, batch, seqlen, nheads, d), 4, 16)
    rows = (seqlen, nheads)
    lse_partial = cute.runtime.make_fake_tensor(
        fp32,
        (splits, batch, *rows),
        stride=tuple(cute.sym_int64() for _ in range(4)),
        assumed_align=4,
    )
    out = _fake_tensor(out_dtype, (batch, seqlen, nheads, d), 16 // (out_dtype.width // 8), 16)
    lse = None
    if key.writes_lse:
        lse = cute.runtime.make_fake_tensor(
            fp32, (batch, *rows), stride=tuple(cute.sym_int64() for _ in range(3)), assumed_align=4
        )
    records = None
    if key.trace:
        from flash_cute.kernels.trace_records import RECORD_WORDS

        records = cute.runtime.make_fake_tensor(
            cutlass.Int64, (cute.sym_int(), RECORD_WORDS), stride=(RECORD_WORDS, 1),
            assumed_align=8,
        )  # fmt: skip
    kernel = FlashAttentionCombine(out_dtype, d, key.writes_lse)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"{TARGET_OPTIONS} {options}".strip()
    return cute.compile(kernel, out_partial, lse_partial, out, lse, records, stream, options=opts)


@dataclass(frozen=True)
class AppendKernelKey:
    """A compiled KV-append kernel (kernels/kv_append.py): the cache's dtype and head dims, the
    rotation (rotary_dim 0: none; the cos / sin tables' dtype) and which optional index tensors
    it reads."""

    dtype: str
    head_dim: int
    head_dim_v: int
    q_dtype: Optional[str] = None  # with rotary: the queries' (FP8 caches serve 16-bit q too)
    rotary_dim: int = 0
    interleaved: bool = False
    per_row: bool = False  # queries at their sequence's rotary position plus their index
    rotary_dtype: Optional[str] = None
    paged: bool = False
    lengths: bool = True  # per-sequence lengths (else one int for all)
    varlen_new: bool = False  # cu_seqlens_k_new
    batch_idx: bool = False
    varlen_q: bool = False  # cu_seqlens_q (rotary only)
    rotary_seqlens: bool = False
    # Writes each sequence's length after the append (else the attention adds the new rows to
    # the lengths itself, and the lengths tensor gives the batch: lengths must be set).
    new_lengths: bool = True


def compile_append(key: AppendKernelKey, options: str = "") -> Callable:
    """Compile (uncached) the KV-append kernel for `key` on fake tensors with symbolic shapes,
    for sm_90a."""
    import cutlass
    import cutlass.cute as cute

    from flash_cute.kernels.kv_append import APPEND_ARGUMENTS, KVAppendKernel

    dtype = _cutlass_dtype(key.dtype)
    sym = cute.sym_int
    rows, nheads_kv, nheads, tokens = (sym() for _ in range(4))

    tensor = _fake_tensor  # (any strides, element-aligned: the kernel reads scalars)

    def ints(rank=1, taken=True):
        return tensor(cutlass.Int32, tuple(sym() for _ in range(rank))) if taken else None

    d, dv = key.head_dim, key.head_dim_v
    cache_rows = (sym(), sym(), nheads_kv)
    rotary = key.rotary_dim > 0
    table = None
    if rotary:
        table = tensor(_cutlass_dtype(key.rotary_dtype), (sym(), key.rotary_dim // 2))
    q_dtype = _cutlass_dtype(key.q_dtype) if rotary else None
    q = tensor(q_dtype, (tokens, nheads, d)) if rotary else None
    fakes = dict(
        k_new=tensor(dtype, (rows, nheads_kv, d)),
        v_new=tensor(dtype, (rows, nheads_kv, dv)),
        k_cache=tensor(dtype, (*cache_rows, d)),
        v_cache=tensor(dtype, (*cache_rows, dv)),
        lengths=ints(1, key.lengths),
        length=cutlass.Int32(0),
        new_lengths=ints(1, key.new_lengths),
        cu_new=ints(1, key.varlen_new),
        seqlen_new=cutlass.Int32(1),
        batch_idx=ints(1, key.batch_idx),
        page_table=ints(2, key.paged),
        q=q,
        q_out=tensor(q_dtype, (tokens, nheads, d)) if rotary else None,
        seqlen_q=cutlass.Int32(1),
        cu_q=ints(1, rotary and key.varlen_q),
        cos=table,
        sin=None if table is None else tensor(table.element_type, (sym(), key.rotary_dim // 2)),
        rotary_seqlens=ints(1, rotary and key.rotary_seqlens),
    )
    args = [fakes[name] for name in APPEND_ARGUMENTS]
    kernel = KVAppendKernel(d, dv, key.rotary_dim, key.interleaved, key.per_row)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"{TARGET_OPTIONS} {options}".strip()
    return cute.compile(kernel, *args, stream, options=opts)


def get_append_kernel(key: AppendKernelKey) -> Callable:
    """The compiled KV-append kernel for `key` (memory, then disk, then compile)."""
    return _get(key, compile_append)


def get_combine_kernel(key: CombineKernelKey) -> Callable:
    """The compiled combine kernel for `key` (memory, then disk, then compile)."""
    return _get(key, compile_combine)


def raw_function(compiled: Callable) -> Callable:
    """The underlying tvm_ffi.Function of a compiled kernel, when the DSL wraps it in its
    Python kwargs adapter (several microseconds per call); the compiled object otherwise.
    Call it with every argument, positionally, in the compiled signature's order."""
    return getattr(compiled, "_tvm_ffi_function", None) or compiled


def get_forward_kernel(variant: ForwardVariant) -> Callable:
    """The compiled forward kernel of `variant` (memory, then disk, then compile; thread-safe)."""
    return _get(variant, compile_forward)


def _get(key, compile_fn) -> Callable:
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = _load_or_compile(key, compile_fn)
                _cache[key] = fn
    return fn


# ----------------------------------------------------------------------------------------
# On-disk cache
# ----------------------------------------------------------------------------------------

EXPORTED_SYMBOL = "flash_cute_kernel"
LOCK_TIMEOUT_S = 300.0


def disk_cache_dir() -> Optional[Path]:
    """The directory holding this build's compiled kernels, or None when disabled."""
    if os.environ.get("FLASH_CUTE_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("FLASH_CUTE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "flash_cute")
    return Path(root) / _source_fingerprint()


@lru_cache(maxsize=1)
def _source_fingerprint() -> str:
    """Changes whenever a host or kernel source file, the DSL, TVM-FFI or Python changes."""
    import cutlass
    import tvm_ffi

    from flash_cute import kernels

    h = hashlib.sha256()
    versions = (
        f"py{sys.version_info[:2]} cutlass={cutlass.__version__} tvm_ffi={tvm_ffi.__version__}"
    )
    h.update(versions.encode())
    h.update(TARGET_ARCH.encode())
    # The host package's own modules (not its integrations) and every kernel module.
    host, device = Path(__file__).resolve().parent, Path(kernels.__file__).resolve().parent
    for package_dir, sources in ((host, host.glob("*.py")), (device, device.rglob("*.py"))):
        for src in sorted(sources):
            h.update(str(src.relative_to(package_dir)).encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:24]


def _key_hash(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


class _FileLock:
    """Advisory lock on a file (fcntl), shared or exclusive, with a timeout."""

    def __init__(self, path: Path, exclusive: bool):
        self.path, self.exclusive, self.fd = path, exclusive, None

    def __enter__(self):
        import time

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, mode)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(
                        f"timed out waiting for the kernel cache lock {self.path}"
                    ) from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


@lru_cache(maxsize=1)
def _load_runtime_libraries() -> None:
    """Exported objects resolve DSL runtime symbols from the process: load them globally."""
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load(path: Path) -> Callable:
    import cutlass.cute as cute

    _load_runtime_libraries()
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(module, EXPORTED_SYMBOL)


def _try_load(path: Path):
    """(function, None), or (None, the error) when the file cannot be loaded (a truncated or
    otherwise broken entry: files appear by atomic rename, so one that fails to load is
    broken, not half-written)."""
    try:
        return _load(path), None
    except Exception as exc:  # whatever the DSL's loader raises on a bad file
        return None, exc


def _load_or_compile(key, compile_fn) -> Callable:
    directory = disk_cache_dir()
    if directory is None:
        return compile_fn(key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        name = _key_hash(key)
        obj, lock = directory / f"{name}.o", directory / f"{name}.lock"
        if obj.exists():
            with _FileLock(lock, exclusive=False):
                fn, _ = _try_load(obj)
            if fn is not None:
                return fn
        with _FileLock(lock, exclusive=True):
            if obj.exists():  # another process compiled it while we waited, or it is broken
                fn, error = _try_load(obj)
                if fn is not None:
                    return fn
                warnings.warn(
                    f"flash_cute: the cached kernel {obj} could not be loaded "
                    f"({type(error).__name__}: {error}); it is deleted and compiled again",
                    stacklevel=3,
                )
                obj.unlink()
            fn = compile_fn(key)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".o.tmp")
            os.close(fd)
            os.chmod(tmp, 0o644)
            try:
                fn.export_to_c(object_file_path=tmp, function_name=EXPORTED_SYMBOL)
                os.replace(tmp, obj)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return fn
    except (OSError, TimeoutError) as exc:
        warnings.warn(
            f"flash_cute: kernel disk cache unavailable ({exc}); compiling in memory only",
            stacklevel=2,
        )
        return compile_fn(key)
