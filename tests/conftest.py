import pytest
import torch

import flash_cute
from flash_cute import runtime


def has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    _add_xdist_groups(items)
    if has_hopper():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _add_xdist_groups(items):
    """Under pytest-xdist --dist loadgroup, send tests sharing a compiled kernel to one worker.

    A test module may define xdist_group_key(test_name, params) -> hashable or None;
    otherwise tests are grouped by their head_dim/dtype/causal parameters."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        custom = getattr(item.module, "xdist_group_key", None)
        key = custom(item.originalname, params) if custom else None
        if key is None and "head_dim" in params and "causal" in params:
            key = (params["head_dim"], params.get("dtype"), params["causal"])
        if key is not None:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{key}"))


@pytest.fixture
def streams(monkeypatch):
    """A fake current stream (settable) and capture flag; the caches start empty."""
    state = {"stream": 7, "capturing": False}
    monkeypatch.setattr(runtime, "current_raw_stream", lambda index: state["stream"])
    monkeypatch.setattr(runtime, "stream_capturing", lambda: state["capturing"])
    flash_cute.empty_cache()
    yield state
    flash_cute.empty_cache()


class Recorder:
    """A compiled kernel that records the arguments of each launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class CheckingRecorder(Recorder):
    """A Recorder for one variant that refuses what the compiled function refuses on the tensors
    no replay key holds (TVM-FFI's checks against the fake arguments' dtypes and fixed sizes:
    q's, k's and v's dtypes, the head dims, v's sizes against k's, a descale given where the
    variant takes none or missing where it takes one), with a ValueError as it does."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def __call__(self, *args):
        from flash_cute.compile_cache import DESCALES, signature

        variant, sent = self.variant, dict(zip(signature(self.variant).args, args))
        q, k, v = sent["q"], sent["k"], sent["v"]
        kv_dtype = getattr(torch, variant.kv_dtype or variant.dtype)
        d = variant.head_dim - variant.head_dim_v if variant.qv else variant.head_dim
        problems = [
            q.dtype != getattr(torch, variant.q_dtype or variant.dtype),
            k.dtype != kv_dtype or v.dtype != kv_dtype,
            q.shape[-1] != d or k.shape[-1] != d or v.shape[-1] != variant.head_dim_v,
            tuple(v.shape[:-1]) != tuple(k.shape[:-1]),
            *((sent.get(n) is None) == taken for n, taken in zip(DESCALES, variant.descales_taken)),
        ]
        if any(problems):
            raise ValueError(f"Mismatched argument for the compiled {variant.describe()}")
        super().__call__(*args)


@pytest.fixture
def fake_gpu(monkeypatch, streams):
    """The API on CPU tensors: the device checks pass, and the compiled kernel is a
    CheckingRecorder per variant (kernels[variant])."""
    from flash_cute import checks, entry, forward

    kernels = {}
    monkeypatch.setattr(
        runtime, "get_forward_kernel", lambda v: kernels.setdefault(v, CheckingRecorder(v))
    )
    monkeypatch.setattr(runtime, "raw_function", lambda f: f)
    monkeypatch.setattr(checks, "check_cuda", lambda named: None)
    monkeypatch.setattr(checks, "check_hopper", lambda device: None)
    monkeypatch.setattr(runtime, "num_sms", lambda index: 132)
    monkeypatch.setattr(forward, "current_device", lambda: None)
    monkeypatch.setattr(runtime, "current_device", lambda: None)
    for point in entry.ENTRY_POINTS:
        monkeypatch.setitem(point.function.__globals__, "_current_device", lambda: None)
        point.plans.clear()
    return kernels
