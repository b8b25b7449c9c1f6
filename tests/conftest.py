import os

import pytest
import torch

# Compile-only tests target Hopper even on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


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
