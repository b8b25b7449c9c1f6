"""Making the CuTe DSL importable as `cutlass`.

flash_cute depends on the DSL's libs packages (nvidia-cutlass-dsl-libs-base and one CUDA build,
pyproject.toml) rather than the nvidia-cutlass-dsl meta package, which would also install a
second CUDA build. The meta package's one file is a .pth that puts the DSL's packages on
sys.path; without it, `find_dsl` does the same when this module is imported (first thing in
flash_cute/__init__.py), before anything imports `cutlass`.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def find_dsl() -> None:
    """Put nvidia_cutlass_dsl/dsl_packages on sys.path unless `cutlass` is importable already
    (the meta package's .pth, or another installation, put it there)."""
    if importlib.util.find_spec("cutlass") is not None:
        return
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "flash_cute needs the CuTe DSL: pip install nvidia-cutlass-dsl-libs-base==4.8.1 "
            "nvidia-cutlass-dsl-libs-cu13==4.8.1 (or reinstall flash-cute)"
        )
    for root in spec.submodule_search_locations:
        packages = os.path.join(root, "dsl_packages")
        if os.path.isdir(packages):
            sys.path.insert(0, packages)
            return
    raise ImportError(f"no dsl_packages folder in {list(spec.submodule_search_locations)}")


find_dsl()
