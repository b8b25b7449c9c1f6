"""kernels/v_transpose.py's addresses, checked on the CPU: the transposing warps' steps,
simulated byte by byte (the zeroing of rows past the valid keys, ldmatrix.trans, the two
byte permutes, stmatrix, each lane's addresses from the kernel's own helpers), must write
V^T with the module's key permutation, every byte once, zeros past the valid keys."""

import random

import pytest
from flash_cute.kernels import v_transpose as vt


def _byte(rows: int, width: int, row: int, col: int) -> int:
    """Byte offset of (row, col) in a swizzled (rows, width) 8-bit tile."""
    chunk = col - col % 16
    return vt._offset(rows, width, row, chunk, vt._row_xor(row, width)) + col % 16


def _b16(mem: bytearray, address: int) -> int:
    return mem[address] | mem[address + 1] << 8


def _prmt(a: int, b: int, selector: int) -> int:
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(selector >> 4 * k) & 0xF] << 8 * k for k in range(4))


def _transpose(src: bytearray, tile_n: int, width: int, num_warps: int, valid: int):
    """dst as transpose_block leaves it: every warp's steps, lane by lane (src: the FP8
    stage, whose rows from `valid` on the warps zero first)."""
    dst = bytearray([0xAA]) * (tile_n * width)  # (poisoned: every byte must be written)
    bases = [vt._lane_bases(lane, tile_n, width) for lane in range(32)]
    for warp in range(num_warps):
        steps = list(vt.warp_steps(warp, num_warps, tile_n, width))
        offsets = {
            step: [vt._step_offsets(bases[lane], vt._step_constants(step, tile_n, width))
                   for lane in range(32)]
            for step in steps
        }  # fmt: skip
        if valid < tile_n:  # (the kernel's zeroing loop, on its helpers)
            for j in range(len(steps)):
                step = j * num_warps + warp
                for lane in range(32):
                    key = vt._zeroed_key(step, lane, width)
                    if key >= valid:
                        zero = vt._zeroed_offset(step, key, bases[lane][1], tile_n, width)
                        src[zero : zero + 16] = bytes(16)
        for step in steps:
            regs = []  # regs[lane][i]: matrix i's register
            for lane in range(32):
                q, c = lane % 4, lane // 4
                lane_regs = []
                for i in range(4):
                    rows = [offsets[step][8 * i + r][0] for r in (2 * q, 2 * q + 1)]
                    lo, hi = (_b16(src, row + 2 * c) for row in rows)
                    lane_regs.append(lo | hi << 16)
                regs.append(lane_regs)
            for lane in range(32):
                sel_a, sel_b = vt.lane_selectors(lane)
                r = regs[lane]
                out = [_prmt(r[0], r[1], sel_a), _prmt(r[0], r[1], sel_b)]
                out += [_prmt(r[2], r[3], sel_a), _prmt(r[2], r[3], sel_b)]
                for m in range(4):  # matrix m, row lane // 4, elements 2 (lane % 4), +1
                    address = offsets[step][8 * m + lane // 4][1] + 4 * (lane % 4)
                    dst[address : address + 4] = out[m].to_bytes(4, "little")
    return dst


@pytest.mark.parametrize(
    "tile_n, width, num_warps, valid",
    [
        (96, 256, 3, 96),  # d256 prefill
        (192, 128, 3, 150),  # d128 prefill, a partial last block
        (128, 64, 3, 128),  # d64 (three MMA warpgroups)
        (64, 128, 1, 17),  # one transposing warp beside gathering ones
        (64, 96, 3, 64),
        (224, 160, 3, 1),
        (128, 256, 3, 32),  # d256 at 128 keys, a partial block of one key group
        (96, 256, 3, 95),
    ],
)
def test_transpose_writes_permuted_v_transpose(tile_n, width, num_warps, valid):
    rng = random.Random(tile_n * width + valid)
    src = bytearray(rng.randrange(256) for _ in range(tile_n * width))
    dst = _transpose(bytearray(src), tile_n, width, num_warps, valid)
    for d in range(width):
        for g in range(0, tile_n, 32):
            for p in range(32):  # position 16h + 4q + i holds key 16h + 8 (i // 2) + 2q + i % 2
                h, q, i = p // 16, (p % 16) // 4, p % 4
                key = g + 16 * h + 8 * (i // 2) + 2 * q + i % 2
                want = src[_byte(tile_n, width, key, d)] if key < valid else 0
                assert dst[_byte(width, tile_n, d, g + p)] == want, (d, g, p)


@pytest.mark.parametrize("tile_n", [64, 96, 128, 192, 224])
@pytest.mark.parametrize("width", [64, 96, 128, 256])
def test_steps_have_no_bank_conflicts(tile_n, width):
    """Each ldmatrix and stmatrix matrix's 8 rows of 16 bytes fall in 8 distinct 16-byte bank
    groups (one shared-memory wavefront), under every swizzle the rings take (32-byte at 96-key
    V^T rows and 96-wide heads)."""
    bases = [vt._lane_bases(lane, tile_n, width) for lane in range(32)]
    for step in range(vt.step_count(tile_n, width)):
        constants = vt._step_constants(step, tile_n, width)
        offsets = [vt._step_offsets(bases[lane], constants) for lane in range(32)]
        for kind in (0, 1):  # the load's rows, the store's
            for m in range(4):  # matrix m's rows: lanes 8m .. 8m + 7
                groups = {offsets[8 * m + r][kind] % 128 // 16 for r in range(8)}
                assert len(groups) == 8, (step, kind, m)
