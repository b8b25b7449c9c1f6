"""The on-disk kernel cache (CPU; marker: compile): a second process loads instead of compiling,
and processes filling the cache at once neither clash nor duplicate files."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.compile

SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import flash_cute.compile_cache as cc
    if sys.argv[1] == "load-only":
        def refuse(key, options=""):
            raise SystemExit("compiled although the kernel was on disk")
        cc.compile_combine = refuse
    start = time.time()
    fn = cc.get_combine_kernel(cc.CombineKernelKey("bfloat16", 128, True))
    print(type(fn).__name__, f"{time.time() - start:.3f}")
""")


def run(cache_dir, mode):
    env = dict(os.environ, FLASH_CUTE_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_90a")
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_second_process_loads_from_disk(tmp_path):
    first = run(tmp_path, "compile")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) == 1
    second = run(tmp_path, "load-only")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    name, seconds = out.split()
    assert name == "Function"  # a tvm_ffi.Function loaded from the object file
    assert float(seconds) < 0.5


def test_concurrent_processes_fill_the_cache_once(tmp_path):
    procs = [run(tmp_path, "compile") for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    assert len(list(tmp_path.rglob("*.o"))) == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_cache_can_be_disabled(tmp_path):
    env = dict(
        os.environ,
        FLASH_CUTE_CACHE_DIR=str(tmp_path),
        FLASH_CUTE_DISK_CACHE="0",
        CUTE_DSL_ARCH="sm_90a",
    )
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, "compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert not list(tmp_path.rglob("*.o"))
