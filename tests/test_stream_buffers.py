"""Host logic of the buffers kept per (device, stream) between calls (split partials scratch,
zeroed counters, int-length tensors), on CPU tensors with the stream queries stubbed: what is
reused, what grows, what a CUDA-graph capture gets instead, and what empty_cache() drops."""

import pytest
import torch

import flash_cute
from flash_cute import interface


@pytest.fixture
def streams(monkeypatch):
    """A fake current stream (settable) and capture flag; the caches start empty."""
    state = {"stream": 7, "capturing": False}
    monkeypatch.setattr(interface, "_current_raw_stream", lambda index: state["stream"])
    monkeypatch.setattr(interface, "_stream_capturing", lambda: state["capturing"])
    flash_cute.empty_cache()
    yield state
    flash_cute.empty_cache()


CPU = torch.device("cpu")


def stream():
    """The per-stream buffers' key, as a call queries it once for all of them."""
    return interface._stream_key(CPU)


def partials(num_splits, out_shape=(2, 3, 4, 64), lse_shape=(2, 4, 3)):
    return interface._SplitPartials.for_shapes(num_splits, out_shape, lse_shape)


def test_split_scratch_reused_per_stream_and_layout(streams):
    small = partials(2)
    o1, l1 = interface._split_scratch(CPU, small, stream())
    o2, l2 = interface._split_scratch(CPU, small, stream())
    assert o1 is o2 and l1 is l2, "the same layout on the same stream reuses its views"
    assert o1.shape == (2, 2, 3, 4, 64) and l1.shape == (2, 2, 4, 3)
    assert l1.data_ptr() == o1.data_ptr() + 4 * o1.numel(), "the LSE follows O in one buffer"
    # A larger layout grows the stream's buffer; the smaller one then gets views of the new one.
    big = partials(8)
    ob, _ = interface._split_scratch(CPU, big, stream())
    o3, _ = interface._split_scratch(CPU, small, stream())
    assert o3.data_ptr() == ob.data_ptr() and o3 is not o1
    # Another stream has its own buffer.
    streams["stream"] = 9
    o4, _ = interface._split_scratch(CPU, small, stream())
    assert o4.data_ptr() != o3.data_ptr()
    assert len(interface._SCRATCH) == 2


def test_split_scratch_capture_and_large_layouts_allocate(streams):
    small = partials(2)
    cached, _ = interface._split_scratch(CPU, small, stream())
    streams["capturing"] = True
    captured, _ = interface._split_scratch(CPU, small, stream())
    assert captured.data_ptr() != cached.data_ptr(), "a capture must not take the shared scratch"
    streams["capturing"] = False
    huge = partials(2, out_shape=(1, 1 << 12, 8, 128), lse_shape=(1, 8, 1 << 12))
    assert huge.numel > interface._SCRATCH_MAX_FLOATS
    first, _ = interface._split_scratch(CPU, huge, stream())
    assert first.shape == huge.o_shape
    assert all(huge not in views for _, views in interface._SCRATCH.values()), "a large layout was cached"
    assert all(buffer.numel() <= interface._SCRATCH_MAX_FLOATS for buffer, _ in interface._SCRATCH.values())


def test_zeroed_counters_grow_and_stay_zeroed(streams):
    c2 = interface._zeroed_counters(CPU, 2, stream())
    assert c2.dtype == torch.int32 and c2.numel() == 2 and not c2.any()
    assert interface._zeroed_counters(CPU, 1, stream()) is c2, "a smaller need reuses the buffer"
    c40 = interface._zeroed_counters(CPU, 40, stream())
    assert c40.numel() >= 40 and not c40.any() and c40 is not c2
    assert interface._zeroed_counters(CPU, 2, stream()) is c40
    streams["capturing"] = True
    assert interface._zeroed_counters(CPU, 2, stream()) is not c40, "a capture gets its own counters"


def test_constant_lengths_cached_per_stream(streams):
    a = interface._constant_lengths(CPU, 4, 333, stream())
    assert a.tolist() == [333] * 4 and a.dtype == torch.int32
    assert interface._constant_lengths(CPU, 4, 333, stream()) is a
    assert interface._constant_lengths(CPU, 4, 334, stream()) is not a
    streams["stream"] = 11
    b = interface._constant_lengths(CPU, 4, 333, stream())
    assert b is not a and interface._constant_lengths(CPU, 4, 333, stream()) is b
    cached = len(interface._LENGTHS)
    streams["capturing"] = True
    captured = interface._constant_lengths(CPU, 4, 333, stream())
    assert captured is not b and captured.tolist() == [333] * 4, "a capture fills its own tensor"
    assert len(interface._LENGTHS) == cached, "a capture's tensor was cached"


def test_empty_cache_drops_everything(streams):
    interface._split_scratch(CPU, partials(2), stream())
    interface._zeroed_counters(CPU, 2, stream())
    interface._constant_lengths(CPU, 2, 5, stream())
    assert interface._SCRATCH and interface._COUNTERS and interface._LENGTHS
    flash_cute.empty_cache()
    assert not interface._SCRATCH and not interface._COUNTERS and not interface._LENGTHS
