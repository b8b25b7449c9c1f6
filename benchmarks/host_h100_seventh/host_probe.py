"""Host cost of TVM-FFI calls of trivial DSL kernels: per tensor argument, per pointer
argument, the bare launch; plus torch calibration ops. Tiny kernels, back-to-back calls."""

import sys
import time

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

BF16 = cutlass.BFloat16


@cute.kernel
def _k_empty(x: cute.Tensor):
    pass


@cute.kernel
def _k_empty_p(x: cute.Pointer):
    pass


@cute.jit
def h_t1(a: cute.Tensor, stream: cuda.CUstream):
    _k_empty(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def h_t4(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor, stream: cuda.CUstream):
    _k_empty(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def h_t1p3(
    a: cute.Tensor, b: cute.Pointer, c: cute.Pointer, d: cute.Pointer, stream: cuda.CUstream
):
    _k_empty(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def h_t1i12(
    a: cute.Tensor,
    i0: Int32,
    i1: Int32,
    i2: Int32,
    i3: Int32,
    i4: Int32,
    i5: Int32,
    i6: Int32,
    i7: Int32,
    i8: Int32,
    i9: Int32,
    i10: Int32,
    i11: Int32,
    stream: cuda.CUstream,
):
    _k_empty(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


def fake(shape=(None, None, None, 128)):
    sym = cute.sym_int
    dims = tuple(sym() if s is None else s for s in shape)
    strides = tuple(cute.sym_int64(divisibility=8) for _ in dims[:-1])
    return cute.runtime.make_fake_tensor(BF16, dims, stride=(*strides, 1), assumed_align=16)


def compile_all():
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    ptr = cute.runtime.make_ptr(BF16, 0, cute.AddressSpace.gmem, assumed_align=16)
    o = "--enable-tvm-ffi"
    fns = {
        "1 tensor": cute.compile(h_t1, fake(), stream, options=o),
        "4 tensors": cute.compile(h_t4, fake(), fake(), fake(), fake(), stream, options=o),
        "1 tensor + 3 pointers": cute.compile(h_t1p3, fake(), ptr, ptr, ptr, stream, options=o),
        "1 tensor + 12 int32": cute.compile(h_t1i12, fake(), *[Int32(1)] * 12, stream, options=o),
    }
    return {k: getattr(f, "_tvm_ffi_function", None) or f for k, f in fns.items()}


def per_call_us(fn, n=2000, rounds=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return best


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_all()
        print("compiled")
        sys.exit(0)
    fns = compile_all()
    q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    o = torch.empty_like(q)
    ints = [1] * 12
    calls = {
        "1 tensor": lambda: fns["1 tensor"](q),
        "4 tensors": lambda: fns["4 tensors"](q, k, v, o),
        "1 tensor + 3 pointers (data_ptr() each call)": lambda: fns["1 tensor + 3 pointers"](
            q, k.data_ptr(), v.data_ptr(), o.data_ptr()
        ),
        "1 tensor + 3 pointers (ints ready)": (
            lambda kp=k.data_ptr(), vp=v.data_ptr(), op=o.data_ptr(): fns["1 tensor + 3 pointers"](
                q, kp, vp, op
            )
        ),
        "1 tensor + 12 int32": lambda: fns["1 tensor + 12 int32"](q, *ints),
        "torch q.add_(0)": lambda: q.add_(0),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "q.new_empty(shape)": lambda s=tuple(q.shape): q.new_empty(s),
        "key (q,k,v shape/stride/dtype/device)": lambda: (
            q.shape,
            q.stride(),
            q.dtype,
            q.get_device(),
            k.shape,
            k.stride(),
            k.dtype,
            k.get_device(),
            v.shape,
            v.stride(),
            v.dtype,
            v.get_device(),
        ),
        "3x data_ptr": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr()),
    }
    res = {}
    for rnd in range(3):
        for name, fn in calls.items():
            res.setdefault(name, []).append(per_call_us(fn))
    for name, us in res.items():
        print(
            f"probe: {name:48s} " + "  ".join(f"{u:6.2f}" for u in us) + f"   min {min(us):6.2f} us"
        )
