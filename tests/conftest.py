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


def _add_xdist_groups(items):  # noqa: D401
    """Under pytest-xdist --dist loadgroup, send tests sharing a compiled kernel to one worker."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "head_dim" in params and "causal" in params:
            group = f"{params['head_dim']}-{params.get('dtype')}-{params['causal']}"
            item.add_marker(pytest.mark.xdist_group(group))
