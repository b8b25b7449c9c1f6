"""kernels/mla_decode/fp8_fragments.py's layouts, checked on the CPU: a key block's e4m3 stage
(nine swizzled 64 x 64 boxes) read lane by lane as the transposed kernel's ldmatrix calls
read it (each lane's row addresses from FragmentLoads and box_offset), its registers placed
into the WGMMA A fragments as convert_k / convert_v place them (the m64nNk16 register layout:
pair p of lane l holds row l // 4 + 8 (p % 2) of its warp's 16, k 2 (l % 4) + 8 (p // 2)),
must give S^T = K Q^T against Q stored in Q_PERMUTATION's order and O^T = V^T P^T with the
rows o_dim names. Bytes stand for the e4m3 values (the conversion keeps each value)."""

import random

import pytest
from flash_cute.kernels.mla_decode import fp8_fragments as ff

KEYS, DIMS, DV, ROWS = 64, 576, 512, 32


def _stage(k):
    """The stage's bytes for K (keys x dims of small ints), through box_offset."""
    mem = bytearray(ff.STAGE_BYTES)
    for key in range(KEYS):
        for dim in range(DIMS):
            base = ff.box_offset(key, dim - dim % 16)
            mem[base + dim % 16] = k[key][dim]
    return mem


def _ldmatrix(mem, addresses, trans):
    """ldmatrix x4 (16-bit elements) for a warp: addresses[8 j + r] is row r of matrix j;
    lane l gets of matrix j the elements (l // 4, 2 (l % 4) + e), or transposed (2 (l % 4) + e,
    l // 4), e = 0, 1, as four bytes (element e's two bytes at 2 e)."""
    out = []
    for lane in range(32):
        regs = []
        for j in range(4):
            got = []
            for e in range(2):
                row, col = (
                    (2 * (lane % 4) + e, lane // 4) if trans else (lane // 4, 2 * (lane % 4) + e)
                )
                at = addresses[8 * j + row] + 2 * col
                got += [mem[at], mem[at + 1]]
            regs.append(got)
        out.append(regs)
    return out


def _warp_ldmatrix(mem, warp, address, trans):
    """_ldmatrix for a warp whose lane l gives the row address address(FragmentLoads(l, warp))
    (as the kernel's load_k / load_v compute it)."""
    return _ldmatrix(mem, [address(ff.FragmentLoads(lane, warp)) for lane in range(32)], trans)


def _prmt(a: int, b: int, selector: int) -> int:
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(selector >> 4 * k) & 0xF] << 8 * k for k in range(4))


def _a_fragment(pairs_of_lane, warp):
    """{(row, k): value} of a warp's 16 rows from each lane's 16 pairs (4 k-blocks)."""
    a = {}
    for lane, pairs in enumerate(pairs_of_lane):
        g, q = lane // 4, lane % 4
        for kb in range(4):
            for p in range(4):
                lo, hi = pairs[4 * kb + p]
                row = 16 * warp + g + 8 * (p % 2)
                k = 16 * kb + 2 * q + 8 * (p // 2)
                a[row, k], a[row, k + 1] = lo, hi
    return a


@pytest.mark.parametrize("seed", [0, 1])
def test_s_transposed_from_k_fragments_and_permuted_q(seed):
    rng = random.Random(seed)
    k = [[rng.randrange(1, 30) for _ in range(DIMS)] for _ in range(KEYS)]
    q = [[rng.randrange(-9, 10) for _ in range(DIMS)] for _ in range(ROWS)]
    q_stored = [[row[16 * (c // 16) + ff.Q_PERMUTATION[c % 16]] for c in range(DIMS)] for row in q]
    mem = _stage(k)
    s_t = [[0] * ROWS for _ in range(KEYS)]
    for warp in range(4):
        for box in range(DIMS // 64):
            pairs = [[None] * 16 for _ in range(32)]
            for h2 in range(2):  # (load_k / convert_k)
                regs = _warp_ldmatrix(
                    mem,
                    warp,
                    lambda ld: ff.box_offset(ld.k_key, 64 * box + 32 * h2, ld.k_chunk),
                    trans=False,
                )
                for lane in range(32):
                    for h in range(2):
                        g_rows, g8_rows = regs[lane][2 * h], regs[lane][2 * h + 1]
                        base = 4 * (2 * h2 + h)
                        pairs[lane][base + 0] = g_rows[0:2]
                        pairs[lane][base + 1] = g8_rows[0:2]
                        pairs[lane][base + 2] = g_rows[2:4]
                        pairs[lane][base + 3] = g8_rows[2:4]
            a = _a_fragment(pairs, warp)
            for (row, kk), value in a.items():
                for n in range(ROWS):
                    s_t[row][n] += value * q_stored[n][64 * box + kk]
    want = [
        [sum(k[key][d] * q[n][d] for d in range(DIMS)) for n in range(ROWS)] for key in range(KEYS)
    ]
    assert s_t == want


@pytest.mark.parametrize("seed", [0, 1])
def test_o_transposed_from_v_fragments_rows_by_o_dim(seed):
    rng = random.Random(seed)
    k = [[rng.randrange(1, 30) for _ in range(DIMS)] for _ in range(KEYS)]
    p_t = [[rng.randrange(-9, 10) for _ in range(KEYS)] for _ in range(ROWS)]  # P^T
    mem = _stage(k)
    o_t = {}
    for warp in range(4):
        for atom in range(DV // 64):
            pairs = [[None] * 16 for _ in range(32)]
            for half in range(2):  # (load_v / convert_v)
                regs = _warp_ldmatrix(
                    mem,
                    warp,
                    lambda ld: ff.box_offset(32 * half + ld.v_key, 64 * atom, ld.warp),
                    trans=True,
                )
                for lane in range(32):
                    for j in range(4):
                        b = regs[lane][j]
                        word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
                        permuted = _prmt(word, word, ff.BY_DIM)
                        by = [(permuted >> 8 * i) & 0xFF for i in range(4)]
                        base = 4 * (2 * half + j // 2) + 2 * (j % 2)
                        pairs[lane][base + 0] = by[0:2]
                        pairs[lane][base + 1] = by[2:4]
            a = _a_fragment(pairs, warp)
            for (row, key), value in a.items():
                g, i = (row % 16) % 8, (row % 16) // 8
                dim = ff.o_dim(atom, warp, g, i)
                for n in range(ROWS):
                    o_t[dim, n] = o_t.get((dim, n), 0) + value * p_t[n][key]
    for dim in range(DV):
        for n in range(ROWS):
            assert o_t[dim, n] == sum(k[key][dim] * p_t[n][key] for key in range(KEYS))
