"""tests/fa3_spec.py on the CPU: the stand-in for FlashAttention-2's rotary reference (which
FlashAttention-3's kvcache tests compare appended keys with) against a row-by-row float64
rotation, and the work directory it prepares."""

import math

import pytest
import torch
from fa3_spec import ROTARY_REFERENCE, prepare
from test_kv_append import rotate_one


def stand_in():
    namespace = {}
    exec(compile(ROTARY_REFERENCE, "rotary.py", "exec"), namespace)  # noqa: S102 - our source
    return namespace["apply_rotary_emb"]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "tensor"])
@pytest.mark.parametrize("packed", [False, True])
def test_rotary_stand_in_rotates_each_row_at_its_position(interleaved, offsets, packed):
    gen = torch.Generator().manual_seed(7)
    batch, seqlen, h, d, half = 2, 5, 3, 32, 8
    x = torch.randn(batch, seqlen, h, d, generator=gen)
    angle = torch.rand(20, half, generator=gen) * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    shift = torch.tensor([4, 9], dtype=torch.int32) if offsets == "tensor" else offsets
    rotate = stand_in()
    if packed:
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
        out = rotate(x.reshape(-1, h, d), cos, sin, interleaved, seqlen_offsets=shift,
                     cu_seqlens=cu, max_seqlen=seqlen).reshape(x.shape)  # fmt: skip
    else:
        out = rotate(x, cos, sin, interleaved, seqlen_offsets=shift)
    for b in range(batch):
        base = int(shift[b]) if offsets == "tensor" else shift
        for s in range(seqlen):
            for head in range(h):
                want = rotate_one(x[b, s, head], cos[base + s], sin[base + s], interleaved)
                assert torch.allclose(out[b, s, head].double(), want, atol=1e-5)


def test_prepare_writes_the_stand_in_where_flash_attn_has_none(tmp_path, monkeypatch):
    import fa3_spec

    source = tmp_path / "hopper"
    source.mkdir()
    for name in fa3_spec.FILES:
        text = "dv_vals = [256, 512]\n" if name == "test_flash_attn.py" else ""
        (source / name).write_text(text)
    monkeypatch.setattr(fa3_spec, "rotary_reference_installed", lambda: False)
    work = tmp_path / "work"
    work.mkdir()
    prepare(source, work, 1)
    assert (work / "flash_attn" / "layers" / "rotary.py").read_text() == ROTARY_REFERENCE
    # Unchanged: no case is patched out.
    assert (work / "test_flash_attn.py").read_text() == "dv_vals = [256, 512]\n"
